//! `http://` and `https://` binary caches over one shared client ([`crate::client`]: rustls; HTTP/2
//! by ALPN, HTTP/1.1 keep-alive otherwise). Downloads (`GET`) from one cache are bounded by
//! `http-connections` (0: no limit) while the server speaks HTTP/1.1, and by [`H2_STREAMS`]
//! once it has answered over HTTP/2 (streams multiplexed on one connection); existence checks
//! and uploads (`HEAD`, `PUT`, `POST`, `DELETE`) by a window below `http-connections` that follows
//! what the server keeps up with ([`super::window`]). The cache's host
//! entry in `netrc-file` is sent as basic authentication ([`crate::netrc`]). 404, 403 and 410 mean
//! absence (on S3, only with a missing key's error code: [`super::s3::is_absence`]); 5xx, 408, 429, connection failures and stalls are retried with backoff
//! (`download-attempts`); a body sent with `Content-Encoding: gzip` (by a proxy, unasked) is
//! decoded. Writing (Nix's `HttpBinaryCacheStore::upsertFile`, `http-binary-cache-store.cc`):
//! `PUT` with the file's `Content-Type`, `HEAD` for whether a file exists; an S3 transport
//! ([`super::s3`]) is this transport with every request signed.

use std::future::Future;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use super::client::Client;
use super::pool::ClientPool;
use super::retry::RetryPolicy;
use super::transfer::TransferProbe;
use super::window::{Outcome, Slot, Window};
use super::{CacheError, Upload};

/// The hex sha256 of an empty body (SigV4's payload hash of `GET` and `HEAD`).
pub(crate) const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// Concurrent requests to one cache once it speaks HTTP/2 (nginx's default stream limit).
pub(crate) const H2_STREAMS: usize = 128;
/// Largest whole file fetched by [`HttpTransport::get`] (narinfo, `nix-cache-info`), after
/// content decoding.
pub(crate) const MAX_SMALL_FILE: usize = 64 << 20;
/// Uploads of fewer bytes are answered in about a round trip when the server keeps up (their
/// time tells the write window whether it does; a larger body's is the link's).
const SMALL_BODY: u64 = 64 << 10;
/// Bytes of an error answer's body quoted in the error.
const BODY_PREFIX: usize = 200;
/// Bytes of an S3 error answer read for its code and message (AWS's messages are long).
const S3_ERROR_PREFIX: usize = 2048;

/// What the HTTP transport takes from Nix's settings (`src/libstore/filetransfer.hh`,
/// `globals.hh`); sluice-store's `Settings::http_options` builds it.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Connections per HTTP/1.1 cache (`http-connections`); `None` for no limit (`0`).
    pub connection_limit: Option<usize>,
    /// Seconds to wait for a connection (`connect-timeout`); 0 means no limit.
    pub connect_timeout: u64,
    /// Seconds without data before a download is abandoned (`stalled-download-timeout`).
    pub stalled_download_timeout: u64,
    /// Attempts for a download that fails transiently (`download-attempts`).
    pub download_attempts: u64,
    /// The netrc file with credentials for the caches' hosts (`netrc-file`); a file that does
    /// not exist means none.
    pub netrc_file: PathBuf,
    /// CA bundle for HTTPS (`ssl-cert-file`): when set, its certificates are the only trust
    /// anchors, as curl's `CURLOPT_CAINFO` for Nix ([`super::tls`]).
    pub ssl_cert_file: Option<PathBuf>,
}

/// Builds the HTTP client for a run from its options (timeouts, CA bundle, pool size).
pub fn client(options: &HttpOptions) -> Result<Client, String> {
    let tls = match &options.ssl_cert_file {
        Some(file) => {
            let pem = std::fs::read(file).map_err(|e| format!("ssl-cert-file {}: {e}", file.display()))?;
            super::tls::client_config(&pem, file)?
        }
        None => super::client::system_tls()?,
    };
    let connect_timeout = (options.connect_timeout > 0).then(|| Duration::from_secs(options.connect_timeout));
    // Room to keep every connection the write requests opened.
    Ok(Client::new(tls, connect_timeout, write_ceiling(options)))
}

/// The HTTP client of a run, built from its options ([`client`]) when a cache over HTTP or
/// S3 first asks for it, and once: a run with `file://` caches only never builds one, whose
/// system CA certificates cost about 4 ms of CPU at the start of a copy (the corpus copy from
/// `file://`, docs/benchmarks.md, issue 16).
pub struct LazyClient {
    options: HttpOptions,
    client: OnceLock<Result<Client, String>>,
}

impl LazyClient {
    /// A client for `options`, not built yet.
    pub fn new(options: HttpOptions) -> Self {
        LazyClient { options, client: OnceLock::new() }
    }

    /// The options the client is built with, which the transports of its caches follow.
    pub fn options(&self) -> &HttpOptions {
        &self.options
    }

    /// The client, built on the first call. Errors: the options' `ssl-cert-file` cannot be
    /// read or parsed, or the TLS set-up failed (the same error on every call).
    pub fn get(&self) -> Result<&Client, String> {
        self.client.get_or_init(|| client(&self.options)).as_ref().map_err(String::clone)
    }
}

/// Most existence checks and uploads in flight to one cache over HTTP/1.1: `http-connections`,
/// as for downloads (Nix sends both through one curl pool of that many connections per host),
/// no limit if it is 0.
fn write_ceiling(options: &HttpOptions) -> usize {
    options.connection_limit.unwrap_or(Semaphore::MAX_PERMITS)
}

/// One HTTP(S) binary cache.
#[derive(Debug)]
pub struct HttpTransport {
    base: String,
    /// `base` with a trailing slash, parsed once: the URLs below it are joined onto it, which
    /// parses only their relative part.
    base_dir: Option<reqwest::Url>,
    pool: ClientPool,
    /// Downloads in flight (`GET`).
    limit: Arc<Semaphore>,
    /// Permits `limit` started with (`http-connections`).
    connections: usize,
    /// Existence checks and uploads in flight.
    writes: Window,
    h2: AtomicBool,
    /// The cache's credentials from `netrc-file`.
    credentials: Option<crate::netrc::Credentials>,
    stall: Duration,
    retry: RetryPolicy,
    signer: Option<Arc<dyn RequestSigner>>,
    /// An S3 absence answered to a `HEAD` (which has no body, so no error code) was checked
    /// by a `GET` ([`Self::exists`]).
    head_absence_checked: AtomicBool,
}

/// Signs each request before it is sent (S3's SigV4), given the hex sha256 of its body.
pub trait RequestSigner: Send + Sync + std::fmt::Debug {
    /// Adds the authentication headers to `request` (finding the credentials first, once,
    /// which may ask a service); the error says why it cannot be signed.
    fn sign<'a>(&'a self, request: &'a mut reqwest::Request, payload_sha256: &'a str)
        -> futures::future::BoxFuture<'a, Result<(), String>>;
}

/// What one request sends: the method, and for uploads the body and its `Content-Type`.
#[derive(Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a reqwest::Method,
    pub body: Option<(&'a Upload, &'a str)>,
    /// Extra headers (S3's `x-amz-storage-class`).
    pub headers: &'a [(&'static str, String)],
}

impl Request<'static> {
    /// A `GET`.
    pub const GET: Request<'static> = Request { method: &reqwest::Method::GET, body: None, headers: &[] };
}

/// A successful answer to [`HttpTransport::send`].
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    /// The whole body (at most [`MAX_SMALL_FILE`] bytes).
    pub body: Vec<u8>,
}

/// A failed attempt, with the server's `Retry-After` if it sent one.
struct Failure {
    error: CacheError,
    retry_after: Option<Duration>,
}

impl From<CacheError> for Failure {
    fn from(error: CacheError) -> Self {
        Failure { error, retry_after: None }
    }
}

impl HttpTransport {
    /// A transport for cache `base` (no trailing slash).
    pub fn new(base: String, client: Client, options: &HttpOptions) -> Self {
        let base_dir = reqwest::Url::parse(&format!("{base}/")).ok();
        // As curl, credentials in the URL win over the netrc file.
        let host = base_dir.as_ref().filter(|u| u.username().is_empty()).and_then(|u| u.host_str());
        let credentials =
            host.and_then(|h| crate::netrc::lookup_file(&options.netrc_file, h).map_err(|e| tracing::warn!("{e}")).ok().flatten());
        let connections = options.connection_limit.unwrap_or(Semaphore::MAX_PERMITS);
        HttpTransport {
            base_dir,
            base,
            pool: ClientPool::new(client, options),
            limit: Arc::new(Semaphore::new(connections)),
            connections,
            writes: Window::new(write_ceiling(options)),
            h2: AtomicBool::new(false),
            credentials,
            stall: Duration::from_secs(options.stalled_download_timeout.max(1)),
            retry: RetryPolicy::new(options.download_attempts),
            signer: None,
            head_absence_checked: AtomicBool::new(false),
        }
    }

    /// This transport with every request signed by `signer`.
    pub fn signed(mut self, signer: Arc<dyn RequestSigner>) -> Self {
        self.signer = Some(signer);
        self
    }

    /// Requests worth having in flight at once: `http-connections` over HTTP/1.1, the stream
    /// limit times the connections once the cache speaks HTTP/2.
    pub fn capacity(&self) -> usize {
        match self.h2.load(Ordering::Relaxed) {
            true => H2_STREAMS * self.pool.connections(),
            false => self.connections,
        }
    }

    /// `rel` (relative to the cache, root-relative, or already absolute) as an absolute URL,
    /// joined onto the cache URL parsed once: only `rel` is parsed. `None` if it does not parse.
    fn url_of(&self, rel: &str) -> Option<reqwest::Url> {
        self.base_dir.as_ref()?.join(rel).ok()
    }

    /// The absolute URL of `rel`, as text (see [`Self::url_of`]).
    pub fn resolve(&self, rel: &str) -> String {
        self.url_of(rel).map_or_else(|| format!("{}/{}", self.base, rel), String::from)
    }

    /// [`Self::url_of`], or an error naming the URL that does not parse (not retried).
    fn request_url(&self, rel: &str) -> Result<reqwest::Url, CacheError> {
        self.url_of(rel).ok_or_else(|| CacheError::Io {
            url: self.resolve(rel),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not a valid URL"),
        })
    }

    /// Runs `once` until it succeeds, fails for good, or used up the attempts; transient
    /// failures wait with exponential backoff (or the server's `Retry-After`).
    async fn retrying<T, F, Fut>(&self, mut once: F) -> Result<T, CacheError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let mut attempt = 0;
        loop {
            let Failure { error, retry_after } = match once().await {
                Ok(v) => return Ok(v),
                Err(f) => f,
            };
            attempt += 1;
            if !error.is_transient() || attempt >= self.retry.attempts {
                return Err(error);
            }
            let wait = self.retry.backoff(attempt, retry_after);
            tracing::info!("{error}; retrying in {} ms ({attempt} of {} attempts made)", wait.as_millis(), self.retry.attempts);
            tokio::time::sleep(wait).await;
        }
    }

    /// One request: the response when it is a success, `None` for absence, or the failure
    /// (with a prefix of the error body). Waiting for the answer is bounded by the stall timeout.
    /// `nar`: a NAR download, sent over the NAR connections ([`ClientPool::next_nar`]).
    async fn send_once(&self, target: &reqwest::Url, spec: Request<'_>, nar: bool) -> Result<(Option<reqwest::Response>, Held), Failure> {
        let url = target.as_str();
        let held = match *spec.method == reqwest::Method::GET {
            true => self.limit.clone().acquire_owned().await.map(|permit| Held::Read { _permit: permit }),
            false => self.writes.acquire().await.map(Held::Write),
        };
        let held = held.map_err(|e| CacheError::Io {
            url: url.to_string(),
            source: std::io::Error::other(format!("waiting for a place among the requests in flight: {e}")),
        })?;
        if self.base.starts_with("https://") {
            // HTTPS servers mostly speak HTTP/2: open the other connections alongside the
            // first, so that they are up before the closure fans out.
            self.pool.grow_for_h2(&self.base);
        }
        let client = if nar { self.pool.next_nar().await } else { self.pool.next() };
        let request = self.build(target, spec).await?;
        let started = std::time::Instant::now();
        let resp = match tokio::time::timeout(self.stall, client.execute(request)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(source)) => {
                held.ended(Outcome::Refused);
                return Err(CacheError::Transport { url: url.to_string(), source }.into());
            }
            Err(_) => {
                held.ended(Outcome::Refused);
                return Err(stalled(url, self.stall, "no answer").into());
            }
        };
        let status = resp.status().as_u16();
        // A server that answers it is too busy did not keep up either.
        let small = spec.body.is_none_or(|(upload, _)| upload.len() < SMALL_BODY);
        held.ended(match status {
            429 | 503 => Outcome::Refused,
            _ => Outcome::Answered { elapsed: started.elapsed(), small },
        });
        // One line per request (`SLUICE_LOG=sluice_binary_cache::http=debug`): what the
        // requests in flight and their round trips were, for benchmarks.
        let (in_flight, window) = match &held {
            Held::Read { .. } => (self.connections.saturating_sub(self.limit.available_permits()), self.connections),
            Held::Write(_) => (self.writes.in_flight(), self.writes.size()),
        };
        tracing::debug!(method = %spec.method, url, status, ms = started.elapsed().as_millis() as u64, in_flight, window, "request");
        if resp.version() == reqwest::Version::HTTP_2 && !self.h2.swap(true, Ordering::Relaxed) {
            self.pool.grow_for_h2(&self.base);
            let streams = H2_STREAMS * (self.pool.connections() + self.pool.nar_connections());
            self.limit.add_permits(streams.saturating_sub(self.connections));
            self.writes.raise_ceiling(streams);
        }
        match status {
            200..=299 => Ok((Some(resp), held)),
            404 | 403 if self.signer.is_some() => {
                let reading = matches!(*spec.method, reqwest::Method::GET | reqwest::Method::HEAD);
                match super::s3::error_of(&body_prefix(resp, self.stall, S3_ERROR_PREFIX).await) {
                    Some((code, _)) if reading && super::s3::is_absence(&code) => Ok((None, held)),
                    None if reading => Ok((None, held)),
                    Some((code, message)) => Err(CacheError::S3 { url: url.to_string(), status, code, message }.into()),
                    None => Err(CacheError::S3 { url: url.to_string(), status, code: "(no code)".into(), message: String::new() }.into()),
                }
            }
            404 | 403 | 410 => Ok((None, held)),
            _ => {
                let retry_after = resp
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.trim().parse().ok())
                    .map(Duration::from_secs);
                let body = body_prefix(resp, self.stall, BODY_PREFIX).await;
                Err(Failure { error: CacheError::Status { url: url.to_string(), status, body }, retry_after })
            }
        }
    }

    /// Builds the request `spec` for `target`, signed if this transport signs.
    async fn build(&self, target: &reqwest::Url, spec: Request<'_>) -> Result<reqwest::Request, CacheError> {
        let url = target.as_str();
        let invalid =
            |what: String| CacheError::Io { url: url.to_string(), source: std::io::Error::new(std::io::ErrorKind::InvalidData, what) };
        let mut request = reqwest::Request::new(spec.method.clone(), target.clone());
        let headers = request.headers_mut();
        if let Some(c) = &self.credentials {
            headers.insert(reqwest::header::AUTHORIZATION, basic_auth(c).map_err(|e| invalid(format!("netrc credentials: {e}")))?);
        }
        for (name, value) in spec.headers {
            let header = reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| invalid(format!("header {name}: {e}")))?;
            let value = reqwest::header::HeaderValue::from_str(value).map_err(|e| invalid(format!("header {name}: {e}")))?;
            headers.insert(header, value);
        }
        let payload_sha256 = match spec.body {
            Some((upload, content_type)) => {
                let body = upload.body().await.map_err(|source| CacheError::Io { url: url.to_string(), source })?;
                let content_type =
                    reqwest::header::HeaderValue::from_str(content_type).map_err(|e| invalid(format!("Content-Type: {e}")))?;
                headers.insert(reqwest::header::CONTENT_TYPE, content_type);
                headers.insert(reqwest::header::CONTENT_LENGTH, upload.len().into());
                if let Some(md5) = self.signer.as_ref().and_then(|_| upload.md5_base64()) {
                    headers.insert(
                        reqwest::header::HeaderName::from_static("content-md5"),
                        reqwest::header::HeaderValue::from_str(&md5).map_err(|e| invalid(format!("Content-MD5: {e}")))?,
                    );
                }
                *request.body_mut() = Some(body);
                upload.sha256_hex()
            }
            None => EMPTY_SHA256.to_string(),
        };
        if let Some(signer) = &self.signer {
            signer.sign(&mut request, &payload_sha256).await.map_err(|what| CacheError::Io {
                url: url.to_string(),
                source: std::io::Error::other(format!("cannot sign the request: {what}")),
            })?;
        }
        Ok(request)
    }

    /// Sends `spec` to `rel` (retried as [`Self::get`] is) and returns the answer; `None` on
    /// 404, 403 or 410.
    pub async fn send(&self, rel: &str, spec: Request<'_>) -> Result<Option<Answer>, CacheError> {
        let target = self.request_url(rel)?;
        let url = target.as_str();
        self.retrying(|| async {
            let (resp, _permit) = self.send_once(&target, spec, false).await?;
            let Some(resp) = resp else { return Ok(None) };
            let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
            Ok(Some(Answer { status, headers, body: read_body(url, resp, self.stall).await? }))
        })
        .await
    }

    /// Sends `spec` to `rel` and returns the answer once its headers are in, its body to be
    /// read as it arrives ([`Body::chunk`]); `None` on 404, 403 or 410. The request is retried
    /// as [`Self::send`]'s is; a body that fails midway is the caller's to handle.
    pub async fn send_streaming(&self, rel: &str, spec: Request<'_>) -> Result<Option<Body>, CacheError> {
        let target = self.request_url(rel)?;
        let (resp, held) = self.retrying(|| self.send_once(&target, spec, false)).await?;
        Ok(resp.map(|resp| Body::of(target.as_str(), resp, self.stall, Some(held))))
    }

    /// Whether `rel` exists (`HEAD`: a success status; 404, 403 and 410 are absence). On S3,
    /// the first absence is asked again by `GET`, whose answer carries the error code that
    /// tells a missing key from wrong credentials or a missing bucket.
    pub async fn exists(&self, rel: &str) -> Result<bool, CacheError> {
        let found = self.send(rel, Request { method: &reqwest::Method::HEAD, body: None, headers: &[] }).await?.is_some();
        if !found && self.signer.is_some() && !self.head_absence_checked.swap(true, Ordering::Relaxed) {
            self.send(rel, Request::GET).await?;
        }
        Ok(found)
    }

    /// The size of `rel` (`HEAD`'s `Content-Length`; S3's `HeadObject` when signed), `None` on
    /// 404, 403 or 410. An answer without a length is a size no expected one matches (0).
    pub async fn size(&self, rel: &str) -> Result<Option<u64>, CacheError> {
        let answer = self.send(rel, Request { method: &reqwest::Method::HEAD, body: None, headers: &[] }).await?;
        Ok(answer.map(|a| {
            let length = a.headers.get(reqwest::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse().ok());
            length.unwrap_or(0)
        }))
    }

    /// Creates or replaces `rel` with `upload` (`PUT`, as Nix's `upsertFile`).
    pub async fn put(&self, rel: &str, upload: &Upload, content_type: &str, headers: &[(&'static str, String)]) -> Result<(), CacheError> {
        match self.send(rel, Request { method: &reqwest::Method::PUT, body: Some((upload, content_type)), headers }).await? {
            Some(_) => Ok(()),
            None => Err(CacheError::Refused { url: self.resolve(rel) }),
        }
    }

    /// Fetches a whole (small) file; `None` on 404, 403 or 410. Transient failures, including
    /// a body cut short, are retried with backoff, `download-attempts` times in all.
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let target = self.request_url(rel)?;
        let url = target.as_str();
        self.retrying(|| async {
            let (resp, _permit) = self.send_once(&target, Request::GET, false).await?;
            let Some(resp) = resp else { return Ok(None) };
            let gzip = content_encoding(url, &resp)?;
            let body = read_body(url, resp, self.stall).await?;
            Ok(Some(if gzip { gunzip(url, &body)? } else { body }))
        })
        .await
    }

    /// Opens a file for streaming; `None` on 404, 403 or 410. The reader must be used on a
    /// blocking thread (it bridges the async body); it fails with `TimedOut` when no data
    /// arrives for `stalled-download-timeout` seconds. The probe tells whether the body was
    /// cut short; the caller retries the whole download if so.
    pub async fn open(&self, rel: &str) -> Result<Option<(Box<dyn Read + Send>, TransferProbe)>, CacheError> {
        let target = self.request_url(rel)?;
        let url = target.as_str();
        let (resp, permit) = self.retrying(|| self.send_once(&target, Request::GET, true)).await?;
        let Some(resp) = resp else { return Ok(None) };
        let gzip = content_encoding(url, &resp)?;
        let stall = self.stall;
        let expected = resp.content_length();
        let body = resp.bytes_stream().map_err(std::io::Error::other);
        let body = Box::pin(futures::stream::unfold(Box::pin(body), move |mut s| async move {
            match tokio::time::timeout(stall, s.next()).await {
                Ok(Some(item)) => Some((item, s)),
                Ok(None) => None,
                Err(_) => Some((Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no data for {} s", stall.as_secs()))), s)),
            }
        }));
        let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(body));
        let (reader, probe) = TransferProbe::watch(url, expected, reader);
        let reader: Box<dyn Read + Send> = match gzip {
            true => Box::new(LazyGunzip::Pending(Some(reader))),
            false => Box::new(reader),
        };
        Ok(Some((Box::new(PermitReader { inner: reader, _permit: permit }), probe)))
    }
}

/// The `Authorization` header of basic authentication with `credentials` (marked sensitive,
/// so that it is never logged).
fn basic_auth(credentials: &crate::netrc::Credentials) -> Result<reqwest::header::HeaderValue, reqwest::header::InvalidHeaderValue> {
    use base64::Engine;
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", credentials.login, credentials.password));
    let mut value = reqwest::header::HeaderValue::from_str(&format!("Basic {token}"))?;
    value.set_sensitive(true);
    Ok(value)
}

fn stalled(url: &str, stall: Duration, what: &str) -> CacheError {
    CacheError::Io {
        url: url.to_string(),
        source: std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} for {} s (stalled-download-timeout)", stall.as_secs())),
    }
}

/// Whether the body is gzip-encoded (a proxy may add this unasked); other encodings are refused.
fn content_encoding(url: &str, resp: &reqwest::Response) -> Result<bool, CacheError> {
    let Some(v) = resp.headers().get(reqwest::header::CONTENT_ENCODING) else { return Ok(false) };
    match v.to_str().unwrap_or("").trim().to_ascii_lowercase().as_str() {
        "" | "identity" => Ok(false),
        "gzip" | "x-gzip" => Ok(true),
        other => Err(CacheError::Io {
            url: url.to_string(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unsupported Content-Encoding {other:?}")),
        }),
    }
}

/// Decodes a gzip-encoded small body, refusing more than [`MAX_SMALL_FILE`] bytes.
fn gunzip(url: &str, body: &[u8]) -> Result<Vec<u8>, CacheError> {
    let mut out = Vec::new();
    let io = |source| CacheError::Io { url: url.to_string(), source };
    flate2::read::MultiGzDecoder::new(body).take(MAX_SMALL_FILE as u64 + 1).read_to_end(&mut out).map_err(io)?;
    if out.len() > MAX_SMALL_FILE {
        return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("decoded body exceeds {MAX_SMALL_FILE} bytes"))));
    }
    Ok(out)
}

/// An answer's body, read as it arrives; it holds the request's place among those in flight
/// until it is dropped.
pub struct Body {
    url: String,
    stream: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    stall: Duration,
    _held: Option<Held>,
}

impl Body {
    fn of(url: &str, resp: reqwest::Response, stall: Duration, held: Option<Held>) -> Body {
        Body { url: url.to_string(), stream: Box::pin(resp.bytes_stream()), stall, _held: held }
    }

    /// The URL the body is the answer of.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The next chunk, `None` at the end. Fails naming the URL when the transfer fails or no
    /// data arrives for `stalled-download-timeout`.
    pub async fn chunk(&mut self) -> Result<Option<bytes::Bytes>, CacheError> {
        match tokio::time::timeout(self.stall, self.stream.next()).await {
            Ok(Some(Ok(chunk))) => Ok(Some(chunk)),
            Ok(Some(Err(source))) => Err(CacheError::Transport { url: self.url.clone(), source: source.into() }),
            Ok(None) => Ok(None),
            Err(_) => Err(stalled(&self.url, self.stall, "no data")),
        }
    }
}

/// Reads a whole body, each chunk within the stall timeout, refusing more than [`MAX_SMALL_FILE`].
async fn read_body(url: &str, resp: reqwest::Response, stall: Duration) -> Result<Vec<u8>, CacheError> {
    let mut out = Vec::new();
    let mut body = Body::of(url, resp, stall, None);
    while let Some(chunk) = body.chunk().await? {
        out.extend_from_slice(&chunk);
        if out.len() > MAX_SMALL_FILE {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidData, format!("body exceeds {MAX_SMALL_FILE} bytes"));
            return Err(CacheError::Io { url: url.to_string(), source: e });
        }
    }
    Ok(out)
}

/// The first `limit` bytes of an error answer, as one line of text (best effort).
async fn body_prefix(resp: reqwest::Response, stall: Duration, limit: usize) -> String {
    let mut buf = Vec::new();
    let mut stream = resp.bytes_stream();
    while buf.len() < limit {
        match tokio::time::timeout(stall.min(Duration::from_secs(5)), stream.next()).await {
            Ok(Some(Ok(chunk))) => buf.extend_from_slice(&chunk),
            _ => break,
        }
    }
    buf.truncate(limit);
    let text = String::from_utf8_lossy(&buf).split_whitespace().collect::<Vec<_>>().join(" ");
    text.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect()
}

/// A gzip decoder started on the first read: flate2 reads the header when constructed, which
/// must not happen on the async thread that opened the body.
enum LazyGunzip<R: Read> {
    Pending(Option<R>),
    Active(flate2::read::MultiGzDecoder<R>),
}

impl<R: Read> Read for LazyGunzip<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let LazyGunzip::Pending(inner) = self {
            let Some(inner) = inner.take() else { return Err(std::io::Error::other("gzip decoder lost its input")) };
            *self = LazyGunzip::Active(flate2::read::MultiGzDecoder::new(inner));
        }
        match self {
            LazyGunzip::Active(d) => d.read(buf),
            LazyGunzip::Pending(_) => Err(std::io::Error::other("gzip decoder lost its input")),
        }
    }
}

/// A request's place among those a cache has in flight: a download's, or a write's in the
/// write window.
enum Held {
    Read { _permit: OwnedSemaphorePermit },
    Write(Slot),
}

impl Held {
    /// Tells the write window how the request ended.
    fn ended(&self, outcome: Outcome) {
        if let Held::Write(slot) = self {
            slot.ended(outcome);
        }
    }
}

/// Holds a cache's request slot for as long as a body is being read.
struct PermitReader<R> {
    inner: R,
    _permit: Held,
}

impl<R: Read> Read for PermitReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}
