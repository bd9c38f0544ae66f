//! Connections: accepting on each listener within a connection limit, TLS with ALPN (`h2`,
//! `http/1.1`), HTTP/1.1 and HTTP/2 (over TLS, or h2c with prior knowledge) on one port, and
//! the bounds that keep slow or idle clients from holding the server:
//!
//! - at most `max_connections` at once; a connection accepted past that has the oldest idle
//!   connection (no request in progress) shed for it ([`crate::slots`]) and waits for its
//!   slot, the kernel's backlog holding the rest meanwhile;
//! - a TLS handshake must finish within [`HANDSHAKE_TIMEOUT`];
//! - a connection with no request in progress for `idle` (since it opened, its last request
//!   ended or its answers last moved) is closed, gracefully (HTTP/2 GOAWAY, HTTP/1.1 after
//!   the answer being written), as is one shed; once the server has decided to close it, a
//!   connection has one `idle` period of grace to take what it still holds of its answers
//!   and is then dropped, whatever it sends: what travels without a request (HTTP/2 PINGs
//!   and their ACKs, SETTINGS, WINDOW_UPDATE, a request head a byte at a time) keeps no
//!   connection open;
//! - while a request in progress waits on the client (for its body, or to take its answer),
//!   the connection must move [`progress::STEP`] bytes of requests and answers (request body
//!   bytes read, HTTP/1.1 bytes and HTTP/2 DATA payload written; never control frames such
//!   as PING ACKs) within each `idle` period ([`crate::progress`]), or it is closed at once:
//!   a request body trickled a byte at a time, a client that stops reading a NAR, HTTP/2
//!   streams opened and never finished or never read, whatever PINGs come beside them. Time
//!   the server itself takes (a slow store) does not count;
//! - HTTP/1.1 request heads must arrive within `idle` and fit [`MAX_HEAD`] bytes (hyper
//!   answers 431 past it); HTTP/2 header lists are bounded the same, streams per connection
//!   by [`MAX_STREAMS`], and what is buffered for sending per stream by [`MAX_SEND_BUF`].

use std::convert::Infallible;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

use crate::progress::{self, Activity, Counted, Side, Tracked, Verdict};
use crate::routes::App;
use crate::sendfile::{Files, Sendfile};
use crate::slots::{Slot, Slots};

/// Most bytes of an HTTP/1.1 request head (request line and headers), and of an HTTP/2 header
/// list.
pub(crate) const MAX_HEAD: usize = 32 * 1024;
/// Most concurrent HTTP/2 streams per connection.
pub(crate) const MAX_STREAMS: u32 = 64;
/// Most bytes buffered for sending per HTTP/2 stream.
pub(crate) const MAX_SEND_BUF: usize = 256 * 1024;
/// Time a TLS handshake may take.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The connection limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Time after which a connection without a request, or a request waiting on its client
    /// without progress, is closed; and the grace of a connection being closed.
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
    // `writev(true)`: body frames are queued as they are, never copied, which sending files
    // with `sendfile` needs ([`crate::sendfile`]).
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.idle).max_buf_size(MAX_HEAD).writev(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(MAX_HEAD as u32)
        .max_send_buf_size(MAX_SEND_BUF);
    let slots = Slots::new(limits.max_connections);
    let accepting =
        listeners.into_iter().map(|l| tokio::spawn(accept_loop(l, tls.clone(), app.clone(), builder.clone(), slots.clone(), limits.idle)));
    for done in futures::future::join_all(accepting).await {
        done.map_err(io::Error::other)??;
    }
    Ok(())
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Arc<App>,
    builder: auto::Builder<TokioExecutor>,
    slots: Arc<Slots>,
    idle: Duration,
) -> io::Result<()> {
    loop {
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
        let slot = slots.take().await?;
        let (app, builder, tls) = (app.clone(), builder.clone(), tls.clone());
        tokio::spawn(async move {
            let served = match tls {
                None => {
                    let files = Files::default();
                    serve(&builder, Sendfile::new(tcp, files.clone()), Some(files), peer, app, slot, idle).await
                }
                Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => serve(&builder, stream, None, peer, app, slot, idle).await,
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

/// Serves `app` on one connection from `peer` in its `slot`, each request and its bodies [`Tracked`] in
/// the connection's [`Activity`], until the client closes it or the watchdog does (see the
/// module doc). With `files` (the stream is a [`Sendfile`] over them), its HTTP/1.x requests
/// carry them, for files to be sent with `sendfile`.
async fn serve<S>(
    builder: &auto::Builder<TokioExecutor>,
    stream: S,
    files: Option<Files>,
    peer: std::net::SocketAddr,
    app: Arc<App>,
    slot: Slot,
    idle: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::new(idle);
    slot.serves(activity.clone());
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (app, request) = (app.clone(), requests.start());
        let mut req = req.map(|body| Tracked::new(body, Side::Request, request.clone()));
        req.extensions_mut().insert(crate::routes::Client(peer));
        if let Some(files) = files.as_ref().filter(|_| req.version() < hyper::Version::HTTP_2) {
            req.extensions_mut().insert(files.clone());
        }
        async move { Ok::<_, Infallible>(app.handle(req).await.map(|body| Tracked::new(body, Side::Response, request))) }
    });
    let conn = builder.serve_connection(TokioIo::new(Counted::new(stream, activity.clone())), service);
    tokio::pin!(conn);
    let verdict = tokio::select! {
        served = conn.as_mut() => return served,
        verdict = activity.verdict() => verdict,
    };
    match verdict {
        Verdict::Stalled => {
            Err(format!("a request waited on the client while less than {} bytes moved in {} s", progress::STEP, idle.as_secs()).into())
        }
        Verdict::Idle => {
            conn.as_mut().graceful_shutdown();
            match tokio::time::timeout(idle, conn).await {
                Ok(served) => served,
                Err(_) => Err(format!("closing: still open {} s after being told to close", idle.as_secs()).into()),
            }
        }
    }
}
