//! The endpoints, as Nix's `HttpBinaryCacheStore` asks for them
//! (`src/libstore/http-binary-cache-store.cc`, `binary-cache-store.cc`): `nix-cache-info`,
//! `<hash part>.narinfo` (GET and HEAD), the NAR at the narinfo's `URL` (with single byte
//! ranges), `<hash part>.ls` (the NAR listing, as `write-nar-listing` writes it),
//! `log/<derivation base name>` (`getBuildLog`), `/metrics`, and the batch endpoints
//! ([`crate::batch`]).
//!
//! Only a request path of exactly one of these shapes reaches the store, and only as a hash
//! part (32 nixbase32 characters) or a store path base name, which are looked up among the
//! valid paths: nothing is ever opened by a name taken from the URL, so `..`, percent-encoded
//! or not, temporary trees and files outside the store are all 404.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Body as _;
use hyper::header::{HeaderValue, ACCEPT_RANGES, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, RANGE};
use hyper::{Method, Request, Response, StatusCode};
use sluice_compress::Compression;
use sluice_nix::base32;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::{StorePath, HASH_PART_LEN};
use sluice_store::store::{NarReader, Store, StoreError};

use crate::metrics::{Metered, Metrics, RequestLine};
use crate::progress::Tracked;
use crate::stored::{Lookup, NarFile};
use crate::upstream::{kept_name, Found, Keep, Upstreams};
use crate::{batch, narinfo};

/// A response body: streamed, metered.
pub type Body = Metered<http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>>;
/// A request body: the connection's, tracked for progress ([`crate::progress`]).
pub(crate) type RequestBody = Tracked<hyper::body::Incoming>;

/// Longest request target and header line accepted, as nginx's default
/// `large_client_header_buffers 4 8k` (414 and 431 past it; nginx says 414 and 400).
pub(crate) const MAX_LINE: usize = 8 * 1024;
/// Bytes of a streamed body read from the store at a time.
const CHUNK: usize = 64 * 1024;
/// Bytes of a body read from a file at a time ([`stream_reader`]).
const READ_CHUNK: usize = 256 * 1024;
/// Chunks buffered between the store's reader and the connection.
const CHUNKS_IN_FLIGHT: usize = 4;

/// What the server serves and how.
pub struct App {
    pub store: Arc<dyn Store>,
    /// Every narinfo is signed with each of these.
    pub keys: Vec<SecretKey>,
    /// `Priority` in `nix-cache-info`.
    pub priority: i32,
    /// Whether the batch endpoints are offered and advertised.
    pub batch: bool,
    pub metrics: Arc<Metrics>,
    /// The narinfos served last, rendered and signed.
    pub rendered: narinfo::Rendered,
    /// When the store is a binary cache: served as it is stored, and pulled through from
    /// upstreams if it has them ([`crate::stored`]).
    pub stored: Option<Arc<crate::stored::Stored>>,
    /// When the store is a local store and the server a pull-through cache: its upstreams,
    /// whose paths are served while they are fetched and then added to the store
    /// ([`Keep::Store`]).
    pub upstreams: Option<Arc<Upstreams>>,
}

/// The hash part and NAR hash of `nar/<hash part>-<NarHash>.nar`, the name a store's NARs are
/// served by ([`narinfo::nar_url`]).
fn store_nar(rel: &str) -> Option<(&str, &str)> {
    let (h, n) = rel.strip_prefix("nar/")?.strip_suffix(".nar")?.split_once('-')?;
    (is_hash_part(h) && n.len() == 52 && base32::is_digits(n)).then_some((h, n))
}

/// A parsed request path.
#[derive(Debug, PartialEq, Eq)]
enum Route<'a> {
    CacheInfo,
    NarInfo(&'a str),
    Listing(&'a str),
    /// A NAR file, by its path in the cache (`nar/<name>`, [`crate::stored::is_nar_file`]).
    Nar(&'a str),
    Log(&'a str),
    Batch(batch::Kind),
    Metrics,
    NotFound,
}

impl Route<'_> {
    /// The endpoint's name in `/metrics`.
    fn endpoint(&self) -> &'static str {
        match self {
            Route::CacheInfo => "nix-cache-info",
            Route::NarInfo(_) => "narinfo",
            Route::Listing(_) => "ls",
            Route::Nar(_) => "nar",
            Route::Log(_) => "log",
            Route::Batch(batch::Kind::NarInfos) => "batch-narinfos",
            Route::Batch(batch::Kind::Closure) => "batch-closure",
            Route::Metrics => "metrics",
            Route::NotFound => "other",
        }
    }
}

/// Whether `s` is a hash part: 32 nixbase32 characters.
pub(crate) fn is_hash_part(s: &str) -> bool {
    s.len() == HASH_PART_LEN && base32::is_digits(s)
}

/// `s`, when it is a hash part.
fn hash(s: Option<&str>) -> Option<&str> {
    s.filter(|h| is_hash_part(h))
}

fn route(path: &str) -> Route<'_> {
    let Some(rest) = path.strip_prefix('/') else { return Route::NotFound };
    if rest == "nix-cache-info" {
        Route::CacheInfo
    } else if rest == "metrics" {
        Route::Metrics
    } else if let Some(h) = hash(rest.strip_suffix(".narinfo")) {
        Route::NarInfo(h)
    } else if let Some(h) = hash(rest.strip_suffix(".ls")) {
        Route::Listing(h)
    } else if rest.strip_prefix("nar/").is_some_and(crate::stored::is_nar_file) {
        Route::Nar(rest)
    } else if let Some(name) = rest.strip_prefix("log/") {
        match StorePath::from_base_name(name) {
            Ok(p) if p.is_derivation() => Route::Log(name),
            _ => Route::NotFound,
        }
    } else if let Some(kind) = rest.strip_prefix(batch::PREFIX).and_then(batch::Kind::parse) {
        Route::Batch(kind)
    } else {
        Route::NotFound
    }
}

/// A body of `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error> {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A streamed body of what `write` writes into the [`BodySink`] it is given (on a blocking
/// thread or a task of its own), after skipping `skip` bytes, at most `limit` bytes, in chunks
/// of [`CHUNK`] bytes with at most [`CHUNKS_IN_FLIGHT`] waiting for the connection. An error
/// of `write` before the body is complete ends the body with that error (the client sees the
/// connection or stream reset, never a short body taken as whole). Writing fails as soon as
/// the client goes away.
pub fn stream<F>(
    skip: u64,
    limit: u64,
    write: impl FnOnce(BodySink) -> F,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>
where
    F: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(CHUNKS_IN_FLIGHT);
    let complete = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sink = BodySink { tx: Some(tx.clone()), buf: BytesMut::new(), skip, left: limit, complete: complete.clone() };
    let writing = write(sink);
    tokio::spawn(async move {
        if let Err(e) = writing.await {
            if !complete.load(std::sync::atomic::Ordering::Acquire) {
                let _ = tx.send(Err(std::io::Error::other(e))).await;
            }
        }
    });
    let frames = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item.map(hyper::body::Frame::data), rx)) });
    http_body_util::StreamBody::new(frames).boxed_unsync()
}

/// A streamed body of what `reader` yields, read on a blocking thread straight into the
/// chunks sent (up to [`READ_CHUNK`] bytes each, no copy between), at most
/// [`CHUNKS_IN_FLIGHT`] waiting for the connection; an error of `reader` ends the body with it.
/// Reading stops as soon as the client goes away.
fn stream_reader(reader: NarReader) -> http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error> {
    use std::io::Read as _;
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(CHUNKS_IN_FLIGHT);
    tokio::task::spawn_blocking(move || {
        let mut reader = reader;
        loop {
            // Read into the chunk's spare capacity: `take` ends at its size, and a file reads
            // into it without initialising it first.
            let mut chunk = Vec::with_capacity(READ_CHUNK);
            let (sent, failed) = match (&mut reader).take(READ_CHUNK as u64).read_to_end(&mut chunk) {
                Ok(0) => return,
                Ok(_) => (tx.blocking_send(Ok(chunk.into())), false),
                Err(e) => (tx.blocking_send(Err(e)), true),
            };
            if sent.is_err() || failed {
                return;
            }
        }
    });
    let frames = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item.map(hyper::body::Frame::data), rx)) });
    http_body_util::StreamBody::new(frames).boxed_unsync()
}

/// The writing end of a [`stream`]ed body: drops the first `skip` bytes written, cuts the
/// next `left` into [`CHUNK`]-byte chunks (one copy, into the chunk) sent to the connection
/// (blocking while [`CHUNKS_IN_FLIGHT`] wait). A write fails with `BrokenPipe` once the client
/// has gone away, and once the body is complete (which stops a writer that has more, as a
/// dump past the end of a byte range).
pub struct BodySink {
    tx: Option<tokio::sync::mpsc::Sender<std::io::Result<Bytes>>>,
    buf: BytesMut,
    skip: u64,
    left: u64,
    complete: Arc<std::sync::atomic::AtomicBool>,
}

impl BodySink {
    /// Sends the chunk gathered so far.
    fn send(&mut self) -> std::io::Result<()> {
        let Some(tx) = &self.tx else { return Ok(()) };
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = self.buf.split().freeze();
        tx.blocking_send(Ok(chunk)).map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client went away"))
    }

    /// Sends what is left once everything was written (for a body of unknown length; a body
    /// of `limit` bytes ends by itself when they have been written).
    pub fn finish(&mut self) -> std::io::Result<()> {
        self.send()?;
        self.complete.store(true, std::sync::atomic::Ordering::Release);
        self.tx = None;
        Ok(())
    }
}

impl std::io::Write for BodySink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.tx.is_none() {
            return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the body is complete"));
        }
        let skipped = data.len().min(usize::try_from(self.skip).unwrap_or(usize::MAX));
        self.skip -= skipped as u64;
        let mut rest = &data[skipped..];
        while !rest.is_empty() && self.left > 0 {
            if self.buf.capacity() == 0 {
                self.buf.reserve(CHUNK);
            }
            let n = rest.len().min(CHUNK - self.buf.len()).min(usize::try_from(self.left).unwrap_or(usize::MAX));
            self.buf.extend_from_slice(&rest[..n]);
            (rest, self.left) = (&rest[n..], self.left - n as u64);
            if self.left == 0 {
                self.finish()?;
                break;
            } else if self.buf.len() == CHUNK {
                self.send()?;
            }
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A `Content-Range` header of the text `value`; the error names the header and its value.
fn content_range(value: String) -> Result<HeaderValue, StoreError> {
    HeaderValue::try_from(value).map_err(|e| StoreError::Other(format!("Content-Range header: {e}")))
}

/// A parsed `Range: bytes=…` header for a body of `len` bytes: one range, as (start, length).
/// `Err(())` when it cannot be satisfied (416); `None` for no header, several ranges or
/// another unit (the whole body is sent, as RFC 9110 allows).
fn byte_range(header: Option<&HeaderValue>, len: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = header?.to_str().ok()?.strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let (first, last) = (first.trim(), last.trim());
    let range = if first.is_empty() {
        let suffix: u64 = last.parse().ok()?;
        (suffix > 0 && len > 0).then(|| (len - suffix.min(len), suffix.min(len)))
    } else {
        let start: u64 = first.parse().ok()?;
        let end = if last.is_empty() { len.saturating_sub(1) } else { last.parse::<u64>().ok()?.min(len.saturating_sub(1)) };
        (start < len && start <= end).then(|| (start, end - start + 1))
    };
    Some(range.ok_or(()))
}

type Answer = Response<http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>>;

fn status(code: StatusCode, text: &str) -> Answer {
    let mut r = Response::new(full(format!("{text}\n")));
    *r.status_mut() = code;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// 404, and for how long that answer may be cached, if known.
fn missing(ttl: Option<std::time::Duration>) -> Answer {
    let mut r = status(StatusCode::NOT_FOUND, "not found");
    if let Some(Ok(value)) = ttl.map(|ttl| HeaderValue::try_from(format!("max-age={}", ttl.as_secs()))) {
        r.headers_mut().insert(hyper::header::CACHE_CONTROL, value);
    }
    r
}

fn ok(mime: &'static str, body: http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>, len: Option<u64>) -> Answer {
    let mut r = Response::new(body);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(mime));
    if let Some(len) = len {
        r.headers_mut().insert(CONTENT_LENGTH, len.into());
    }
    r
}

/// The length of the request target `uri` as the client wrote it (origin form, or absolute
/// form with its scheme and authority), counted without writing it out.
fn target_len(uri: &hyper::Uri) -> usize {
    let path = uri.path_and_query().map_or(0, |p| p.as_str().len());
    match (uri.scheme_str(), uri.authority()) {
        (Some(scheme), Some(authority)) => scheme.len() + "://".len() + authority.as_str().len() + path,
        _ => path,
    }
}

/// The address of the client that sent a request (in its extensions, for the access log).
#[derive(Debug, Clone, Copy)]
pub struct Client(pub std::net::SocketAddr);

impl App {
    /// Answers one request (never fails: store errors become 500 naming the store and path).
    pub async fn handle(self: Arc<Self>, req: Request<RequestBody>) -> Response<Body> {
        let started = Instant::now();
        let client = req.extensions().get::<Client>().map(|c| c.0);
        let line = RequestLine { client, method: req.method().clone(), target: req.uri().clone(), version: req.version() };
        let route = route(line.target.path());
        let endpoint = route.endpoint();
        let head = req.method() == Method::HEAD;
        let answer = match self.answer(route, req).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("{}: {e}", line.target.path());
                status(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
            }
        };
        let (mut parts, mut body) = answer.into_parts();
        if head {
            // Whatever the answer (an error's text too), HEAD gets its headers only: hyper
            // leaves a HEAD answer's body out over HTTP/1.1 but sends it over HTTP/2, where
            // DATA answering HEAD is a protocol error to the client (nghttp2 resets the
            // stream: Nix 2.8's 404 narinfo HEAD fails with "Stream error in the HTTP/2
            // framing layer").
            if let Some(len) = body.size_hint().exact() {
                parts.headers.entry(CONTENT_LENGTH).or_insert(len.into());
            }
            body = full(Bytes::new());
        }
        let status = parts.status.as_u16();
        Response::from_parts(parts, Metered::new(body, self.metrics.clone(), endpoint, status, started, line))
    }

    async fn answer(self: &Arc<Self>, route: Route<'_>, req: Request<RequestBody>) -> Result<Answer, StoreError> {
        if target_len(req.uri()) > MAX_LINE {
            return Ok(status(StatusCode::URI_TOO_LONG, "request target too long"));
        }
        if req.headers().iter().any(|(n, v)| n.as_str().len() + v.len() + 2 > MAX_LINE) {
            return Ok(status(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "header line too long"));
        }
        let head = req.method() == Method::HEAD;
        let wanted = if matches!(route, Route::Batch(_)) { Method::POST } else { Method::GET };
        if !(req.method() == wanted || head && wanted == Method::GET) {
            let mut r = status(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
            let allow = if wanted == Method::POST { "POST" } else { "GET, HEAD" };
            r.headers_mut().insert(hyper::header::ALLOW, HeaderValue::from_static(allow));
            return Ok(r);
        }
        let body = |text: Bytes, mime: &'static str| {
            let len = text.len() as u64;
            ok(mime, if head { full(Bytes::new()) } else { full(text) }, Some(len))
        };
        let not_found = || status(StatusCode::NOT_FOUND, "not found");
        // A pull-through NAR's `?hash=`: the path whose narinfo named it.
        let hash_part = || req.uri().query().and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("hash="))).filter(|h| is_hash_part(h));
        let files = req.extensions().get::<crate::sendfile::Files>().cloned();
        let nar_file = |found: Option<NarFile>| match found {
            None => not_found(),
            Some(NarFile::Local(_, len)) if head => ok("application/x-nix-nar", full(Bytes::new()), Some(len)),
            Some(NarFile::Local(file, len)) => match files {
                Some(files) => ok("application/x-nix-nar", crate::sendfile::body(file, len, files), Some(len)),
                None => ok("application/x-nix-nar", stream_reader(Box::new(file)), Some(len)),
            },
            Some(NarFile::Stream(_, len)) if head => ok("application/x-nix-nar", full(Bytes::new()), len),
            Some(NarFile::Stream(reader, len)) => ok("application/x-nix-nar", stream_reader(reader), len),
        };
        if let Some(stored) = &self.stored {
            match route {
                Route::NarInfo(h) => {
                    return Ok(match stored.narinfo(h, &self.keys).await? {
                        Lookup::Found(served) => body(served.text, "text/x-nix-narinfo"),
                        Lookup::Missing(ttl) => missing(ttl),
                    })
                }
                Route::Nar(rel) => return Ok(nar_file(stored.nar(rel, hash_part()).await?)),
                _ => {}
            }
        }
        Ok(match route {
            Route::CacheInfo => body(self.cache_info().into(), "text/x-nix-cache-info"),
            Route::Metrics => body(self.metrics.render().into(), "text/plain; version=0.0.4"),
            Route::NarInfo(h) => match (self.info_of(h).await?, &self.upstreams) {
                (Some(info), _) => body(self.narinfo(&info), "text/x-nix-narinfo"),
                // As the store will serve it once it is kept (uncompressed, at its name there),
                // so that a client's cached narinfo stays right.
                (None, Some(upstreams)) => match upstreams.narinfo(h).await {
                    Found::Yes(narinfo) => body(self.narinfo(&ValidPathInfo::from_narinfo(&narinfo, 0)), "text/x-nix-narinfo"),
                    Found::No(ttl) => missing(ttl),
                },
                (None, None) => not_found(),
            },
            Route::Listing(h) => match self.info_of(h).await? {
                Some(info) => body(self.listing(&info).await?.into(), "application/json"),
                None => not_found(),
            },
            Route::Nar(rel) => match store_nar(rel) {
                Some((hash_part, nar_hash)) => match (self.info_of(hash_part).await?, &self.upstreams) {
                    (Some(info), _) if info.nar_hash.to_nix32() == nar_hash => self.nar(&info, req.headers().get(RANGE), head).await?,
                    (None, Some(upstreams)) => self.pulled_nar(upstreams, hash_part, nar_hash, head).await?.unwrap_or_else(not_found),
                    _ => not_found(),
                },
                None => not_found(),
            },
            Route::Log(name) => {
                let drv = StorePath::from_base_name(name).map_err(|e| StoreError::Other(format!("{name}: {e}")))?;
                match self.store.build_log(&drv).await? {
                    Some(_) if head => ok("text/plain; charset=utf-8", full(Bytes::new()), None),
                    Some(log) => ok("text/plain; charset=utf-8", stream_reader(log), None),
                    None => not_found(),
                }
            }
            Route::Batch(_) if !self.batch => not_found(),
            Route::Batch(kind) => batch::answer(self.clone(), kind, req).await,
            Route::NotFound => not_found(),
        })
    }

    /// The NAR of the path `hash_part` (whose NAR hash is `nar_hash`) that a local store
    /// lacks, from the upstreams: fetched once and kept ([`Keep::Store`]), decompressed for the
    /// client on the way. `None` when no upstream has that NAR.
    async fn pulled_nar(
        &self,
        upstreams: &Arc<Upstreams>,
        hash_part: &str,
        nar_hash: &str,
        head: bool,
    ) -> Result<Option<Answer>, StoreError> {
        let Found::Yes(narinfo) = upstreams.narinfo(hash_part).await else { return Ok(None) };
        if narinfo.nar_hash.to_nix32() != nar_hash {
            return Ok(None);
        }
        let compression = Compression::parse(&narinfo.compression).map_err(|e| StoreError::Other(format!("{}: {e}", narinfo.url)))?;
        let keep = Keep::Store(self.store.clone());
        let Some(flight) = upstreams.flight(&kept_name(&narinfo), Some(hash_part), &keep).await.map_err(StoreError::Other)? else {
            return Ok(None);
        };
        let body = match head {
            true => full(Bytes::new()),
            false => stream_reader(compression.decoder(flight.follow()).map_err(|e| StoreError::Other(format!("{}: {e}", narinfo.url)))?),
        };
        Ok(Some(ok("application/x-nix-nar", body, Some(narinfo.nar_size))))
    }

    /// `nix-cache-info`: the store directory, `WantMassQuery: 1` (a server answers many
    /// narinfo requests cheaply), the priority, and the batch endpoints when offered.
    fn cache_info(&self) -> String {
        let mut text = format!("StoreDir: {}\nWantMassQuery: 1\nPriority: {}\n", self.store.store_dir().as_str(), self.priority);
        if self.batch {
            text.push_str(&format!("{}: {}\n", sluice_nix::cache_info::BATCH_KEY, batch::VERSION));
        }
        text
    }

    /// The narinfo of `info`, as every endpoint serves it (rendered once while `info` stays
    /// the same, [`narinfo::Rendered`]).
    pub fn narinfo(&self, info: &ValidPathInfo) -> Bytes {
        self.rendered.get(info, &self.keys, self.store.store_dir())
    }

    /// The info of the valid path with hash part `hash_part`, if any, read from the store.
    pub(crate) async fn info_of(&self, hash_part: &str) -> Result<Option<ValidPathInfo>, StoreError> {
        self.store.query_path_info_from_hash_part(hash_part).await
    }

    /// `{"version":1,"root":…}`, the listing of the NAR of `info` as Nix's
    /// `write-nar-listing` writes it, made by reading the NAR from the store.
    async fn listing(&self, info: &ValidPathInfo) -> Result<Vec<u8>, StoreError> {
        let nar = self.store.nar_from_path(info).await?;
        let shown = self.store.store_dir().display_path(&info.path);
        let listed = tokio::task::spawn_blocking(move || sluice_nix::nar::listing::list(nar))
            .await
            .map_err(|e| StoreError::Other(format!("{shown}: {e}")))?;
        let root = listed.map_err(|e| StoreError::Other(format!("listing the NAR of {shown}: {e}")))?;
        Ok(sluice_binary_cache::upload::listing_json(&root))
    }

    /// The NAR of `info`, uncompressed, whole or the one byte range asked for.
    async fn nar(&self, info: &ValidPathInfo, range: Option<&HeaderValue>, head: bool) -> Result<Answer, StoreError> {
        let len = info.nar_size;
        let (code, start, count) = match byte_range(range, len) {
            None => (StatusCode::OK, 0, len),
            Some(Ok((start, count))) => (StatusCode::PARTIAL_CONTENT, start, count),
            Some(Err(())) => {
                let mut r = status(StatusCode::RANGE_NOT_SATISFIABLE, "range not satisfiable");
                r.headers_mut().insert(CONTENT_RANGE, content_range(format!("bytes */{len}"))?);
                return Ok(r);
            }
        };
        let body = if head {
            full(Bytes::new())
        } else {
            let (store, info) = (self.store.clone(), info.clone());
            stream(start, count, |sink| async move { store.dump_nar(&info, Box::new(sink)).await })
        };
        let mut r = ok("application/x-nix-nar", body, Some(count));
        *r.status_mut() = code;
        r.headers_mut().insert(ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        if code == StatusCode::PARTIAL_CONTENT {
            let value = format!("bytes {start}-{}/{len}", start + count - 1);
            r.headers_mut().insert(CONTENT_RANGE, content_range(value)?);
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_only_exact_shapes() {
        let h = "0c7ry3w8ggj1mgwwxmrkjbpsg7sm25s9";
        assert_eq!(route(&format!("/{h}.narinfo")), Route::NarInfo(h));
        assert_eq!(route(&format!("/{h}.ls")), Route::Listing(h));
        assert_eq!(route("/nix-cache-info"), Route::CacheInfo);
        let n = "1".repeat(52);
        let nar = format!("nar/{h}-{n}.nar");
        assert_eq!(route(&format!("/{nar}")), Route::Nar(&nar));
        assert_eq!(store_nar(&nar), Some((h, &n[..])));
        assert_eq!(route(&format!("/nar/{n}.nar.xz")), Route::Nar(&format!("nar/{n}.nar.xz")[..]));
        assert_eq!(store_nar(&format!("nar/{n}.nar.xz")), None);
        for bad in [
            "/../etc/passwd",
            "/%2e%2e/nix-cache-info",
            "/nar/../../etc/passwd",
            &format!("/nar/{h}-{n}.nar/.."),
            &format!("/{h}.narinfo/"),
            &format!("//{h}.narinfo"),
            "/00000000000000000000000000000000-sluice-unpacking",
            &format!("/log/{h}-x"),
            &format!("/log/{h}-..%2f.drv"),
            &format!("/log/../{h}-x.drv"),
            "/0c7ry3w8ggj1mgwwxmrkjbpsg7sm25sU.narinfo",
        ] {
            assert_eq!(route(bad), Route::NotFound, "{bad}");
        }
        assert_eq!(route(&format!("/log/{h}-hello.drv")), Route::Log(&format!("{h}-hello.drv")[..]));
    }

    /// A sink over a channel of `chunks` places and the flag it sets once complete.
    fn sink(skip: u64, left: u64, chunks: usize) -> (BodySink, tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>) {
        let (tx, rx) = tokio::sync::mpsc::channel(chunks);
        (BodySink { tx: Some(tx), buf: BytesMut::new(), skip, left, complete: Default::default() }, rx)
    }

    #[test]
    fn body_sink_sends_the_range_in_whole_chunks_and_stops_after_it() {
        use std::io::Write;
        let data: Vec<u8> = (0..3 * CHUNK + 100).map(|i| (i % 251) as u8).collect();
        let (mut s, mut rx) = sink(10, 2 * CHUNK as u64 + 7, 8);
        // Written in uneven pieces, as a dump writes them.
        for piece in data.chunks(CHUNK / 3 + 1) {
            if s.write(piece).is_err() {
                break;
            }
        }
        assert!(s.complete.load(std::sync::atomic::Ordering::Acquire));
        let err = s.write(b"more").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
        drop(s);
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        while let Some(chunk) = rx.blocking_recv() {
            let chunk = chunk.unwrap();
            sizes.push(chunk.len());
            got.extend_from_slice(&chunk);
        }
        assert_eq!(sizes, [CHUNK, CHUNK, 7]);
        assert_eq!(got, data[10..10 + 2 * CHUNK + 7]);
    }

    #[test]
    fn body_sink_fails_once_the_client_is_gone() {
        use std::io::Write;
        let (mut s, rx) = sink(0, u64::MAX, 1);
        drop(rx);
        let err = s.write(&vec![0; CHUNK]).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn byte_ranges() {
        let v = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(byte_range(None, 10), None);
        assert_eq!(byte_range(Some(&v("bytes=0-3")), 10), Some(Ok((0, 4))));
        assert_eq!(byte_range(Some(&v("bytes=5-")), 10), Some(Ok((5, 5))));
        assert_eq!(byte_range(Some(&v("bytes=-3")), 10), Some(Ok((7, 3))));
        assert_eq!(byte_range(Some(&v("bytes=8-100")), 10), Some(Ok((8, 2))));
        assert_eq!(byte_range(Some(&v("bytes=10-")), 10), Some(Err(())));
        assert_eq!(byte_range(Some(&v("bytes=0-1,3-4")), 10), None);
        assert_eq!(byte_range(Some(&v("items=0-1")), 10), None);
    }
}
