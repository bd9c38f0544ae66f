//! Connections: accepting on each listener within a connection limit, TLS with ALPN (`h2`,
//! `http/1.1`), HTTP/1.1 and HTTP/2 (over TLS, or h2c with prior knowledge) on one port, and
//! the bounds that keep slow or idle clients from holding the server:
//!
//! - at most `max_connections` at once; past that the server stops accepting (the kernel's
//!   backlog holds the rest) until one closes;
//! - a TLS handshake must finish within [`HANDSHAKE_TIMEOUT`];
//! - a connection with a read or write pending and no byte moved either way for `idle`
//!   is closed ([`Deadline`]): an idle keep-alive connection, a client that stops reading a
//!   NAR, one that sends a request a byte a minute;
//! - HTTP/1.1 request heads must arrive within `idle` and fit [`MAX_HEAD`] bytes (hyper
//!   answers 431 past it); HTTP/2 header lists are bounded the same, streams per connection
//!   by [`MAX_STREAMS`], and what is buffered for sending per stream by [`MAX_SEND_BUF`].

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

use crate::routes::{App, Body};

/// Most bytes of an HTTP/1.1 request head (request line and headers), and of an HTTP/2 header
/// list.
pub const MAX_HEAD: usize = 32 * 1024;
/// Most concurrent HTTP/2 streams per connection.
pub const MAX_STREAMS: u32 = 64;
/// Most bytes buffered for sending per HTTP/2 stream.
pub const MAX_SEND_BUF: usize = 256 * 1024;
/// Time a TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The connection limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Time without progress after which a connection is closed.
    pub idle: Duration,
}

/// A TLS acceptor for the PEM certificate chain `cert` and private key `key`, offering HTTP/2
/// and HTTP/1.1 by ALPN. Errors name the file.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect())
        .map_err(|e| format!("{}: reading the TLS certificate chain: {e}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: reading the TLS private key: {e}", key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `app` on every listener until one fails to accept for good.
pub async fn run(listeners: Vec<TcpListener>, tls: Option<TlsAcceptor>, app: Arc<App>, limits: Limits) -> io::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.idle).max_buf_size(MAX_HEAD);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(MAX_HEAD as u32)
        .max_send_buf_size(MAX_SEND_BUF)
        .keep_alive_interval(Some(limits.idle / 2))
        .keep_alive_timeout(limits.idle / 2);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let accepting = listeners.into_iter().map(|l| tokio::spawn(accept_loop(l, tls.clone(), app.clone(), builder.clone(), slots.clone(), limits.idle)));
    for done in futures::future::join_all(accepting).await {
        done.map_err(io::Error::other)??;
    }
    Ok(())
}

async fn accept_loop(listener: TcpListener, tls: Option<TlsAcceptor>, app: Arc<App>, builder: auto::Builder<TokioExecutor>, slots: Arc<Semaphore>, idle: Duration) -> io::Result<()> {
    loop {
        let slot = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            // Out of descriptors or a connection reset before accept: wait and go on.
            Err(e) if !matches!(e.kind(), io::ErrorKind::InvalidInput) => {
                tracing::warn!("accepting: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let _ = tcp.set_nodelay(true);
        let (app, builder, tls) = (app.clone(), builder.clone(), tls.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let io = Deadline::new(tcp, idle);
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let app = app.clone();
                async move { Ok::<Response<Body>, Infallible>(app.handle(req).await) }
            });
            let served = match tls {
                None => builder.serve_connection(TokioIo::new(io), service).await,
                Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                    Ok(Ok(stream)) => builder.serve_connection(TokioIo::new(stream), service).await,
                    Ok(Err(e)) => Err(e.into()),
                    Err(_) => Err("TLS handshake timed out".into()),
                },
            };
            if let Err(e) = served {
                tracing::debug!("connection from {peer}: {e}");
            }
        });
    }
}

/// A stream that fails with `TimedOut` once a read or write has been pending for `timeout`
/// with no byte moved either way since the last progress.
pub struct Deadline<T> {
    inner: T,
    timeout: Duration,
    last_progress: Instant,
    sleep: Pin<Box<Sleep>>,
}

impl<T> Deadline<T> {
    pub fn new(inner: T, timeout: Duration) -> Self {
        let now = Instant::now();
        Deadline { inner, timeout, last_progress: now, sleep: Box::pin(tokio::time::sleep_until(now + timeout)) }
    }

    /// After the inner stream returned `Pending`: arms the timer for the current deadline
    /// and fails once it has passed.
    fn pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let deadline = self.last_progress + self.timeout;
        if self.sleep.deadline() != deadline {
            self.sleep.as_mut().reset(deadline);
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, format!("no progress for {} s", self.timeout.as_secs()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progressed<R>(&mut self, r: Poll<io::Result<R>>, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        match r {
            Poll::Ready(r) => {
                self.last_progress = Instant::now();
                Poll::Ready(r)
            }
            Poll::Pending => self.pending(cx).map(Err),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Deadline<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.progressed(r, cx)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Deadline<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progressed(r, cx)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.progressed(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progressed(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
