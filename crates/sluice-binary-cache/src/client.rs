//! The HTTP client the caches share (Nix's `FileTransfer` over curl, `src/libstore/filetransfer.cc`):
//! hyper-util's pooled client, rustls by hyper-rustls (HTTP/2 by ALPN, HTTP/1.1 keep-alive
//! otherwise), redirects followed as curl follows them for Nix, and TCP connections that
//! acknowledge what they receive at once ([`QuickAck`]).
//!
//! Why the last: a server that writes an answer's headers and its body in two writes with
//! Nagle's algorithm on (s3s-fs, and any server that does not set `TCP_NODELAY`) sends the body
//! only once the headers are acknowledged. Linux delays that ACK on a kept-alive connection
//! that has just sent a request (delayed ACK in "pingpong" mode, 40 ms), so every such request
//! took 40 ms. `TCP_QUICKACK` sends the pending ACK when it is set, and Linux leaves quick-ACK
//! mode again as the connection goes on, so it is set before every read. reqwest gives no access
//! to its sockets, so this is hyper-util's client with reqwest's request and response types:
//! [`Client::execute`] takes a `reqwest::Request` and gives a `reqwest::Response`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use reqwest::header::{self, HeaderMap, HeaderValue};
use tower_service::Service;

/// Redirects followed for one request (Nix's `CURLOPT_MAXREDIRS`, `filetransfer.cc`).
const MAX_REDIRECTS: usize = 10;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Inner = hyper_util::client::legacy::Client<Bounded, reqwest::Body>;

/// A request that failed before its answer's headers arrived.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The request could not be made into an HTTP request, or its answer's body failed.
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    /// Connecting, TLS, sending, or reading the answer's headers failed.
    #[error(transparent)]
    Connection(#[from] hyper_util::client::legacy::Error),
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooManyRedirects,
    /// A redirect's `Location` is not a URL.
    #[error("redirected to {0:?}, which is not a URL")]
    BadRedirect(String),
    /// A redirect's `Location` is a URL of another scheme than `http` and `https` (as curl
    /// refuses `file://` and the like for Nix: `CURLOPT_REDIR_PROTOCOLS`).
    #[error("redirected to {0:?}, which is not an http or https URL")]
    RedirectScheme(String),
}

impl ClientError {
    /// Whether the request cannot succeed however often it is sent again (a request that cannot
    /// be made, a redirect loop or a bad `Location`).
    pub(crate) fn is_final(&self) -> bool {
        match self {
            ClientError::Http(e) => e.is_builder() || e.is_redirect(),
            ClientError::Connection(_) => false,
            ClientError::TooManyRedirects | ClientError::BadRedirect(_) | ClientError::RedirectScheme(_) => true,
        }
    }
}

/// The HTTP client of a run (cheap to clone: clones share one pool of connections).
#[derive(Clone)]
pub struct Client {
    inner: Inner,
    /// Sent with every request that does not set them: `User-Agent` and `Accept: */*`.
    headers: HeaderMap,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client over `tls` (its ALPN protocols are set here), waiting at most `connect_timeout`
    /// for a connection, its TLS handshake included ([`Bounded`]), keeping at most
    /// `idle_per_host` idle connections to one host.
    pub(crate) fn new(tls: rustls::ClientConfig, connect_timeout: Option<Duration>, idle_per_host: usize) -> Client {
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        // reqwest's defaults, which the caches had before this client: a dead peer is found
        // within about a minute on an idle connection, and unacknowledged data fails after 30 s.
        tcp.set_keepalive(Some(Duration::from_secs(15)));
        tcp.set_keepalive_interval(Some(Duration::from_secs(15)));
        tcp.set_keepalive_retries(Some(3));
        tcp.set_tcp_user_timeout(Some(Duration::from_secs(30)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(Connector(tcp));
        let https = Bounded { connect: https, timeout: connect_timeout };
        let inner = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(idle_per_host)
            .build(https);
        let mut headers = HeaderMap::new();
        headers.insert(header::USER_AGENT, HeaderValue::from_static(concat!("sluice/", env!("CARGO_PKG_VERSION"))));
        headers.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        Client { inner, headers }
    }

    /// A client that trusts no certificate, for tests over plain HTTP.
    #[cfg(test)]
    pub(crate) fn plain() -> Client {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|b| b.with_root_certificates(rustls::RootCertStore::empty()).with_no_client_auth());
        Client::new(tls.unwrap_or_else(|e| panic!("rustls set-up: {e}")), None, 1)
    }

    /// Sends `request` and returns the answer once its headers are in. Redirects (301, 302,
    /// 303, 307, 308) of a request whose body can be sent again are followed, at most
    /// [`MAX_REDIRECTS`], as Nix's curl does (`CURLOPT_FOLLOWLOCATION`): a 303 becomes a
    /// `GET`, and `Authorization` is not sent on to another origin.
    pub async fn execute(&self, mut request: reqwest::Request) -> Result<reqwest::Response, ClientError> {
        for _ in 0..=MAX_REDIRECTS {
            let again = request.try_clone();
            let from = request.url().clone();
            let answer = self.send(request).await?;
            let (Some(mut next), Some(location)) = (again, redirect(&answer)) else { return Ok(answer) };
            let to = from.join(&location).map_err(|_| ClientError::BadRedirect(location.clone()))?;
            if !matches!(to.scheme(), "http" | "https") {
                return Err(ClientError::RedirectScheme(to.into()));
            }
            if to.origin() != from.origin() {
                next.headers_mut().remove(header::AUTHORIZATION);
            }
            if answer.status() == reqwest::StatusCode::SEE_OTHER && *next.method() != reqwest::Method::HEAD {
                *next.method_mut() = reqwest::Method::GET;
                *next.body_mut() = None;
                next.headers_mut().remove(header::CONTENT_LENGTH);
                next.headers_mut().remove(header::CONTENT_TYPE);
            }
            *next.url_mut() = to;
            request = next;
        }
        Err(ClientError::TooManyRedirects)
    }

    /// One request, no redirect followed.
    async fn send(&self, request: reqwest::Request) -> Result<reqwest::Response, ClientError> {
        let mut request = hyper::Request::<reqwest::Body>::try_from(request)?;
        for (name, value) in &self.headers {
            request.headers_mut().entry(name).or_insert_with(|| value.clone());
        }
        let answer = self.inner.request(request).await?;
        Ok(reqwest::Response::from(answer.map(reqwest::Body::wrap)))
    }
}

/// The `Location` of a redirect answer, if `answer` is one.
fn redirect(answer: &reqwest::Response) -> Option<String> {
    match answer.status().as_u16() {
        301 | 302 | 303 | 307 | 308 => answer.headers().get(header::LOCATION)?.to_str().ok().map(str::to_string),
        _ => None,
    }
}

/// hyper-util's TCP connector, its connections wrapped in [`QuickAck`].
#[derive(Clone)]
struct Connector(HttpConnector);

impl Service<hyper::Uri> for Connector {
    type Response = QuickAck;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<QuickAck, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: hyper::Uri) -> Self::Future {
        let connecting = self.0.call(dst);
        Box::pin(async move { Ok(QuickAck(connecting.await?)) })
    }
}

/// The connector of TCP and TLS, a connection's whole set-up bounded by `connect-timeout`, as
/// curl's `CURLOPT_CONNECTTIMEOUT` bounds Nix's (`filetransfer.cc`): a server that accepts and
/// never answers the TLS handshake fails the request when the timeout is up, as a closed port
/// does, instead of holding it until the stall timeout.
#[derive(Clone)]
struct Bounded {
    connect: hyper_rustls::HttpsConnector<Connector>,
    timeout: Option<Duration>,
}

impl Service<hyper::Uri> for Bounded {
    type Response = hyper_rustls::MaybeHttpsStream<QuickAck>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.connect.poll_ready(cx)
    }

    fn call(&mut self, dst: hyper::Uri) -> Self::Future {
        let connecting = self.connect.call(dst);
        let Some(timeout) = self.timeout else { return connecting };
        Box::pin(async move {
            tokio::time::timeout(timeout, connecting).await.unwrap_or_else(|_| {
                let what = format!("connection timed out: not connected (TCP and TLS) within connect-timeout ({} s)", timeout.as_secs());
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, what).into())
            })
        })
    }
}

/// A TCP connection that acknowledges what it receives at once: `TCP_QUICKACK` is set before
/// every read, which sends an ACK the kernel was holding back and leaves delayed-ACK mode
/// until the connection next sends (see the module doc).
struct QuickAck(TokioIo<tokio::net::TcpStream>);

impl hyper::rt::Read for QuickAck {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: hyper::rt::ReadBufCursor<'_>) -> Poll<std::io::Result<()>> {
        // Best effort: where the option is refused, reads go on as without it.
        let _ = socket2::SockRef::from(self.0.inner()).set_tcp_quickack(true);
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for QuickAck {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl Connection for QuickAck {
    fn connected(&self) -> Connected {
        self.0.connected()
    }
}

/// The TLS set-up without `ssl-cert-file`: the system's CA certificates and Mozilla's (webpki-roots),
/// as reqwest's `rustls-tls-native-roots` and `rustls-tls-webpki-roots` gave.
pub(crate) fn system_tls() -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::debug!("system CA certificates: {e}");
    }
    roots.add_parsable_certificates(native.certs);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("cannot set up TLS: {e}"))?;
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A loopback server answering each request (kept alive) with `answer(path)`'s status,
    /// extra header lines and body; returns its address and the requests it got.
    fn fake(answer: fn(&str, u16) -> (u16, String, &'static str), other: u16) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let (mut conn, log) = (conn.unwrap(), log.clone());
                std::thread::spawn(move || loop {
                    let mut got = Vec::new();
                    let mut byte = [0u8; 1];
                    while !got.ends_with(b"\r\n\r\n") {
                        match conn.read(&mut byte) {
                            Ok(1) => got.push(byte[0]),
                            _ => return,
                        }
                    }
                    let text = String::from_utf8_lossy(&got).into_owned();
                    let path = text.split(' ').nth(1).unwrap_or("").to_string();
                    log.lock().unwrap().push(text);
                    let (status, headers, body) = answer(&path, other);
                    let head = format!("HTTP/1.1 {status} X\r\n{headers}Content-Length: {}\r\n\r\n", body.len());
                    conn.write_all(head.as_bytes()).unwrap();
                    conn.write_all(body.as_bytes()).unwrap();
                });
            }
        });
        (port, seen)
    }

    /// Redirects are followed (a relative `Location`, then one to another origin), and the
    /// credentials go only to the origin they were given for.
    #[tokio::test]
    async fn redirects_are_followed_and_credentials_stay_with_their_origin() {
        let (other, at_other) = fake(|_, _| (200, String::new(), "the file"), 0);
        let (port, at_first) = fake(
            |path, other| match path {
                "/a" => (302, "Location: /b\r\n".into(), ""),
                _ => (307, format!("Location: http://127.0.0.1:{other}/c\r\n"), ""),
            },
            other,
        );
        let mut request = reqwest::Request::new(reqwest::Method::GET, format!("http://127.0.0.1:{port}/a").parse().unwrap());
        request.headers_mut().insert(header::AUTHORIZATION, HeaderValue::from_static("Basic dTpw"));
        let answer = Client::plain().execute(request).await.unwrap();
        assert_eq!(answer.status(), 200);
        assert_eq!(answer.text().await.unwrap(), "the file");
        let first = at_first.lock().unwrap().clone();
        assert_eq!(first.len(), 2, "{first:?}");
        assert!(first[0].starts_with("GET /a ") && first[1].starts_with("GET /b "), "{first:?}");
        assert!(first.iter().all(|r| r.contains("authorization: Basic dTpw\r\n")), "{first:?}");
        let at_other = at_other.lock().unwrap().clone();
        assert_eq!(at_other.len(), 1);
        assert!(at_other[0].starts_with("GET /c ") && !at_other[0].contains("authorization"), "{at_other:?}");
    }

    /// A redirect to a `file://` URL (or any scheme but `http` and `https`) is a final error
    /// naming it, and nothing is read there (found by a hostile review: "builder error: invalid
    /// format", which named neither).
    #[tokio::test]
    async fn a_redirect_to_another_scheme_is_a_final_error_naming_it() {
        let (port, seen) = fake(|_, _| (302, "Location: file:///etc/passwd\r\n".into(), ""), 0);
        let request = reqwest::Request::new(reqwest::Method::GET, format!("http://127.0.0.1:{port}/a").parse().unwrap());
        let err = Client::plain().execute(request).await.unwrap_err();
        assert_eq!(err.to_string(), "redirected to \"file:///etc/passwd\", which is not an http or https URL");
        assert!(err.is_final());
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    /// A redirect loop ends after [`MAX_REDIRECTS`], with an error that is final.
    #[tokio::test]
    async fn a_redirect_loop_is_a_final_error() {
        let (port, seen) = fake(|_, _| (302, "Location: /again\r\n".into(), ""), 0);
        let request = reqwest::Request::new(reqwest::Method::GET, format!("http://127.0.0.1:{port}/a").parse().unwrap());
        let err = Client::plain().execute(request).await.unwrap_err();
        assert!(matches!(err, ClientError::TooManyRedirects) && err.is_final(), "{err}");
        assert_eq!(seen.lock().unwrap().len(), MAX_REDIRECTS + 1);
    }
}
