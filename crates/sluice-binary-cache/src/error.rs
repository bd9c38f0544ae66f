//! Errors talking to a binary cache. Each names the URL concerned.

use sluice_nix::quoted::Quoted;

use crate::causes::causes;

/// A failure fetching from or understanding a binary cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// An HTTP status that is neither success nor absence; `body` is a prefix of the answer.
    #[error("{url}: HTTP status {status}{}", body_suffix(body))]
    Status { url: String, status: u16, body: String },
    /// A failed request; the message carries the whole chain of causes (connection refused,
    /// certificate not trusted, …), which the HTTP client's own message leaves out, and for a
    /// certificate no trust anchor vouches for, what to do about it.
    #[error("{url}: {}{}", causes(source).replace(&url_suffix(source), ""), untrusted_hint(source))]
    Transport {
        url: String,
        #[source]
        source: crate::client::ClientError,
    },
    #[error("{url}: {source}")]
    Io {
        url: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{url}: invalid narinfo: {source}")]
    NarInfo {
        url: String,
        #[source]
        source: sluice_nix::narinfo::NarInfoError,
    },
    #[error("{url}: narinfo is for {got}, not the requested {expected}")]
    WrongStorePath { url: String, expected: String, got: String },
    /// An HTTP cache without `nix-cache-info` (Nix's words).
    #[error("'{url}' does not appear to be a binary cache")]
    NotACache { url: String },
    #[error("{url}: invalid nix-cache-info: {what}")]
    CacheInfo { url: String, what: String },
    #[error("{url}: cache is for store directory {}, not {expected}", Quoted(.got))]
    WrongStoreDir { url: String, expected: String, got: String },
    /// A cache of another store directory where sluice cannot use one (anywhere but among the
    /// substituters).
    #[error(
        "{url}: the cache is for the store directory {dir}; sluice uses such a cache only as a substituter, of content-addressed paths"
    )]
    OtherStoreDir { url: String, dir: String },
    /// The server answered an upload with 403, 404 or 410.
    #[error("{url}: the server refused the upload (HTTP 403, 404 or 410)")]
    Refused { url: String },
    /// S3 answered with an error code that is not a missing key's (`NoSuchKey`, or
    /// `AccessDenied` on a missing key without `ListBucket`): wrong credentials
    /// (`SignatureDoesNotMatch`, `InvalidAccessKeyId`), a bucket that does not exist
    /// (`NoSuchBucket`), or any refusal of an upload. `message` is S3's own, if it sent one.
    #[error("{url}: S3 refused the request (HTTP {status} {code}{})", message_suffix(message))]
    S3 { url: String, status: u16, code: String, message: String },
    /// A secret key file named by `secret-key`/`secret-keys` could not be used.
    #[error("{url}: secret key {}: {what}", file.display())]
    SecretKey { url: String, file: std::path::PathBuf, what: String },
    /// The HTTP client for the cache could not be built ([`super::http::LazyClient::get`]).
    #[error("{url}: {what}")]
    Client { url: String, what: String },
    /// The cache failed earlier in this run and is no longer asked.
    #[error("{url}: not used for the rest of this run after an earlier failure: {reason}")]
    Disabled { url: String, reason: String },
}

/// Whether `error` or one of its causes is an `EMFILE`, `ENFILE`, `ENOMEM` or `ENOBUFS`. An
/// `io::Error` wrapping another error is looked into too (its `source` skips the wrapped one).
fn is_shortage(error: &(dyn std::error::Error + 'static)) -> bool {
    use rustix::io::Errno;
    if let Some(io) = error.downcast_ref::<std::io::Error>() {
        if matches!(Errno::from_io_error(io), Some(Errno::MFILE | Errno::NFILE | Errno::NOMEM | Errno::NOBUFS)) {
            return true;
        }
        if let Some(inner) = io.get_ref() {
            return is_shortage(inner);
        }
    }
    error.source().is_some_and(is_shortage)
}

/// What reqwest's message says of the URL (` for url (URL)`), which the error names already.
fn url_suffix(source: &crate::client::ClientError) -> String {
    match source {
        crate::client::ClientError::Http(e) => e.url().map_or_else(String::new, |url| format!(" for url ({url})")),
        _ => String::new(),
    }
}

/// For a server certificate that no trust anchor vouches for, the setting that names one.
fn untrusted_hint(source: &crate::client::ClientError) -> &'static str {
    match ["UnknownIssuer", "CaUsedAsEndEntity"].iter().any(|e| causes(source).contains(e)) {
        true => "; if you trust the server's certificate (or its CA's), name it in ssl-cert-file (--option ssl-cert-file FILE)",
        false => "",
    }
}

fn message_suffix(message: &str) -> String {
    match message.is_empty() {
        true => String::new(),
        false => format!(": {message}"),
    }
}

fn body_suffix(body: &str) -> String {
    match body.is_empty() {
        true => String::new(),
        false => format!(" ({body})"),
    }
}

impl CacheError {
    /// Whether retrying the same request may succeed (5xx, connection failures, timeouts,
    /// truncated bodies); 401/407 and malformed data are final.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            CacheError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            // An untrusted certificate stays untrusted however often it is presented.
            CacheError::Transport { source, .. } => !source.is_final() && !causes(source).contains("certificate"),
            CacheError::Io { source, .. } => !matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::InvalidData
            ),
            _ => false,
        }
    }

    /// Whether the failure concerns the whole cache rather than one file: it stayed transient
    /// through every attempt, the cache refused our credentials (401, 407), or it answered a
    /// narinfo with an HTML page (a parked domain, a captive portal), or S3 refused a request
    /// (wrong credentials, no such bucket: [`CacheError::S3`]). Such a cache is skipped
    /// for the rest of the run. A shortage of this machine's resources (see
    /// [`is_local_shortage`](Self::is_local_shortage)) says nothing about the cache.
    pub(crate) fn disables_cache(&self) -> bool {
        (self.is_transient() && !self.is_local_shortage())
            || matches!(
                self,
                CacheError::Status { status: 401 | 407, .. }
                    | CacheError::S3 { .. }
                    | CacheError::NarInfo { source: sluice_nix::narinfo::NarInfoError::HtmlPage { .. }, .. }
            )
    }

    /// Whether the failure is the whole cache's, not one file's: it disables the cache
    /// ([`disables_cache`](Self::disables_cache)) or the cache was disabled already.
    pub fn is_cache_wide(&self) -> bool {
        self.disables_cache() || matches!(self, CacheError::Disabled { .. })
    }

    /// Whether this process ran short of a local resource while talking to the cache: open
    /// files (`EMFILE`, `ENFILE`), memory (`ENOMEM`) or socket buffers (`ENOBUFS`), found
    /// anywhere in the chain of causes. Retrying may succeed once other transfers end.
    pub(crate) fn is_local_shortage(&self) -> bool {
        let source: &(dyn std::error::Error + 'static) = match self {
            CacheError::Transport { source, .. } => source,
            CacheError::Io { source, .. } => source,
            _ => return false,
        };
        is_shortage(source)
    }
}
