//! Errors talking to a binary cache. Each names the URL concerned.

/// A failure fetching from or understanding a binary cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{url}: HTTP status {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: {source}")]
    Transport { url: String, #[source] source: reqwest::Error },
    #[error("{url}: {source}")]
    Io { url: String, #[source] source: std::io::Error },
    #[error("{url}: invalid narinfo: {source}")]
    NarInfo { url: String, #[source] source: sluice_nix::narinfo::NarInfoError },
    #[error("{url}: narinfo is for {got}, not the requested {expected}")]
    WrongStorePath { url: String, expected: String, got: String },
    #[error("{url}: invalid nix-cache-info: {what}")]
    CacheInfo { url: String, what: String },
    #[error("{url}: cache is for store directory {got}, not {expected}")]
    WrongStoreDir { url: String, expected: String, got: String },
}

impl CacheError {
    /// Whether retrying the same request may succeed (5xx, connection failures, timeouts,
    /// truncated bodies); 401/407 and malformed data are final.
    pub fn is_transient(&self) -> bool {
        match self {
            CacheError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            CacheError::Transport { source, .. } => !source.is_builder() && !source.is_redirect(),
            CacheError::Io { source, .. } => !matches!(source.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied),
            _ => false,
        }
    }
}
