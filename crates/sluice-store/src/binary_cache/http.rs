//! `http://` and `https://` binary caches over one shared `reqwest` client (rustls; HTTP/2
//! by ALPN, HTTP/1.1 keep-alive otherwise). Requests to one cache are bounded by
//! `http-connections` while the server speaks HTTP/1.1, and by [`H2_STREAMS`] once it has
//! answered over HTTP/2 (streams multiplexed on one connection).

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::CacheError;
use crate::config::Settings;

/// Concurrent requests to one cache once it speaks HTTP/2 (nginx's default stream limit).
pub const H2_STREAMS: usize = 128;
/// Attempts for a request that fails transiently (Nix's `download-attempts` default is 5).
pub const ATTEMPTS: u32 = 5;

/// Builds the HTTP client for a run from the settings (timeouts, CA bundle, pool size).
pub fn client(settings: &Settings) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")))
        .tcp_nodelay(true)
        .pool_max_idle_per_host(settings.http_connections.max(1))
        .no_proxy();
    if settings.connect_timeout > 0 {
        b = b.connect_timeout(Duration::from_secs(settings.connect_timeout));
    }
    if let Some(file) = &settings.ssl_cert_file {
        let pem = std::fs::read(file).map_err(|e| format!("ssl-cert-file {}: {e}", file.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| format!("ssl-cert-file {}: {e}", file.display()))?;
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    b.build().map_err(|e| format!("cannot set up the HTTP client: {e}"))
}

/// One HTTP(S) binary cache.
#[derive(Debug)]
pub struct HttpTransport {
    base: String,
    client: reqwest::Client,
    limit: Arc<Semaphore>,
    /// Permits `limit` started with (`http-connections`).
    connections: usize,
    h2: AtomicBool,
    stall: Duration,
}

impl HttpTransport {
    /// A transport for cache `base` (no trailing slash).
    pub fn new(base: String, client: reqwest::Client, settings: &Settings) -> Self {
        HttpTransport {
            base,
            client,
            limit: Arc::new(Semaphore::new(settings.http_connections.max(1))),
            connections: settings.http_connections.max(1),
            h2: AtomicBool::new(false),
            stall: Duration::from_secs(settings.stalled_download_timeout.max(1)),
        }
    }

    /// The absolute URL of `rel`: relative to the cache, root-relative, or already absolute.
    pub fn resolve(&self, rel: &str) -> String {
        if rel.contains("://") {
            rel.to_string()
        } else if rel.starts_with('/') {
            let origin_end = self.base.find("://").map(|i| i + 3).and_then(|s| self.base[s..].find('/').map(|j| s + j)).unwrap_or(self.base.len());
            format!("{}{}", &self.base[..origin_end], rel)
        } else {
            format!("{}/{}", self.base, rel)
        }
    }

    async fn send(&self, url: &str) -> Result<(Option<reqwest::Response>, OwnedSemaphorePermit), CacheError> {
        let mut attempt = 0;
        loop {
            let permit = self.limit.clone().acquire_owned().await.expect("semaphore never closed");
            let result = self.client.get(url).send().await;
            let err = match result {
                Ok(resp) => {
                    if resp.version() == reqwest::Version::HTTP_2 && !self.h2.swap(true, Ordering::Relaxed) {
                        self.limit.add_permits(H2_STREAMS.saturating_sub(self.connections));
                    }
                    match resp.status().as_u16() {
                        200..=299 => return Ok((Some(resp), permit)),
                        404 | 403 | 410 => return Ok((None, permit)),
                        status => CacheError::Status { url: url.to_string(), status },
                    }
                }
                Err(source) => CacheError::Transport { url: url.to_string(), source },
            };
            attempt += 1;
            if !err.is_transient() || attempt >= ATTEMPTS {
                return Err(err);
            }
            drop(permit);
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
    }

    /// Fetches a whole (small) file; `None` on 404, 403 or 410. Transient failures are
    /// retried with backoff, [`ATTEMPTS`] times in all.
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let url = self.resolve(rel);
        let mut attempt = 0;
        loop {
            let (resp, _permit) = self.send(&url).await?;
            let Some(resp) = resp else { return Ok(None) };
            match tokio::time::timeout(self.stall, resp.bytes()).await {
                Ok(Ok(body)) => return Ok(Some(body.to_vec())),
                Ok(Err(source)) if attempt + 1 < ATTEMPTS => {
                    tracing::debug!("{url}: {source}; retrying");
                }
                Ok(Err(source)) => return Err(CacheError::Transport { url, source }),
                Err(_) if attempt + 1 < ATTEMPTS => {}
                Err(_) => return Err(stalled(&url, self.stall)),
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
        }
    }

    /// Opens a file for streaming; `None` on 404, 403 or 410. The reader must be used on a
    /// blocking thread (it bridges the async body); it fails with `TimedOut` when no data
    /// arrives for `stalled-download-timeout` seconds.
    pub async fn open(&self, rel: &str) -> Result<Option<Box<dyn Read + Send>>, CacheError> {
        let url = self.resolve(rel);
        let (resp, permit) = self.send(&url).await?;
        let Some(resp) = resp else { return Ok(None) };
        let stall = self.stall;
        let body = resp.bytes_stream().map_err(std::io::Error::other);
        let body = Box::pin(futures::stream::unfold(Box::pin(body), move |mut s| async move {
            match tokio::time::timeout(stall, s.next()).await {
                Ok(Some(item)) => Some((item, s)),
                Ok(None) => None,
                Err(_) => Some((Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no data for {} s", stall.as_secs()))), s)),
            }
        }));
        let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(body));
        Ok(Some(Box::new(PermitReader { inner: reader, _permit: permit })))
    }
}

fn stalled(url: &str, stall: Duration) -> CacheError {
    CacheError::Io { url: url.to_string(), source: std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no data for {} s", stall.as_secs())) }
}

/// Holds a cache's request slot for as long as a body is being read.
struct PermitReader<R> {
    inner: R,
    _permit: OwnedSemaphorePermit,
}

impl<R: Read> Read for PermitReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner.read(buf)
    }
}
