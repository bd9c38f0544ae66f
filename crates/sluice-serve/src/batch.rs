//! The batch endpoints, advertised in `nix-cache-info` as `SluiceBatch: 1` (Nix ignores
//! unknown keys there) and used by sluice's closure engine:
//!
//! - `POST /_sluice/v1/narinfos`: the body is hash parts separated by white space; the answer
//!   is one line per hash part, in the order asked.
//! - `POST /_sluice/v1/closure`: the body is the hash parts of roots; the answer is one line
//!   per path of their closure (a root that is not valid gives its line with `null`), sent
//!   level by level as each level is read from the store, each path once.
//!
//! Each answer is NDJSON (`application/x-ndjson`), a line being
//! `{"hash":"<hash part>","narinfo":"<text>"}` or `{"hash":"<hash part>","narinfo":null}`;
//! the text is exactly what `GET /<hash part>.narinfo` serves (the same function renders
//! both), so its signatures verify the same. A body over [`MAX_BODY`] bytes is 413, a word
//! that is not a hash part is 400 naming it.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use sluice_store::store::StoreError;
use tokio::sync::mpsc;

use crate::routes::{is_hash_part, App, RequestBody};
use crate::stored::{Lookup, Stored};

/// Where the batch endpoints live (after the leading `/`).
pub(crate) const PREFIX: &str = "_sluice/v1/";
/// The value of `SluiceBatch` in `nix-cache-info`: the version of these endpoints.
pub const VERSION: &str = "1";
/// Most bytes of a request body (about 30,000 hash parts).
pub(crate) const MAX_BODY: usize = 1 << 20;
/// Paths asked of the store at once.
const STORE_BATCH: usize = 1024;
/// Bytes of lines gathered into one chunk for the connection (a chunk is also handed over at
/// the end of each store batch, so that a level's lines leave as soon as it is read).
const CHUNK_BYTES: usize = 32 * 1024;
/// Chunks buffered for the connection before the walk waits for it.
const CHUNKS_IN_FLIGHT: usize = 4;

/// Which batch endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    NarInfos,
    Closure,
}

impl Kind {
    /// The endpoint named by the rest of the path after [`PREFIX`].
    pub fn parse(name: &str) -> Option<Kind> {
        match name {
            "narinfos" => Some(Kind::NarInfos),
            "closure" => Some(Kind::Closure),
            _ => None,
        }
    }
}

/// Appends the NDJSON line for `hash_part` to `out`.
fn push_line(out: &mut Vec<u8>, hash_part: &str, narinfo: Option<&str>) {
    // Serializing a string into a Vec cannot fail.
    out.extend_from_slice(b"{\"hash\":");
    let _ = serde_json::to_writer(&mut *out, hash_part);
    out.extend_from_slice(b",\"narinfo\":");
    let _ = serde_json::to_writer(&mut *out, &narinfo);
    out.extend_from_slice(b"}\n");
}

type Answer = Response<http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>>;

fn refuse(code: StatusCode, text: String) -> Answer {
    let mut r = Response::new(crate::routes::full(text + "\n"));
    *r.status_mut() = code;
    r
}

/// Answers a batch request: reads and checks the hash parts, then streams the lines as a
/// task walks the store.
pub async fn answer(app: Arc<App>, kind: Kind, req: Request<RequestBody>) -> Answer {
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            return refuse(StatusCode::PAYLOAD_TOO_LARGE, format!("request body over {MAX_BODY} bytes"));
        }
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("reading the request body: {e}")),
    };
    let Ok(text) = std::str::from_utf8(&body) else { return refuse(StatusCode::BAD_REQUEST, "request body is not UTF-8".into()) };
    let hashes: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if let Some(bad) = hashes.iter().find(|h| !is_hash_part(h)) {
        return refuse(StatusCode::BAD_REQUEST, format!("{bad:?} is not a store path hash part"));
    }
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(CHUNKS_IN_FLIGHT);
    let mut walker = Walker { app, tx, chunk: Vec::new() };
    tokio::spawn(async move {
        let result = match (kind, walker.app.stored.clone()) {
            (kind, Some(stored)) => walker.stored(&stored, hashes, kind == Kind::Closure).await,
            (Kind::NarInfos, None) => walker.narinfos(hashes).await,
            (Kind::Closure, None) => walker.closure(hashes).await,
        };
        if let Err(e) = result {
            tracing::warn!("batch: {e}");
            // The body ends in an error: the client sees a reset, not a short answer.
            let _ = walker.tx.send(Err(std::io::Error::other(e.to_string()))).await;
        }
    });
    let frames = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item.map(hyper::body::Frame::data), rx)) });
    let mut r = Response::new(http_body_util::StreamBody::new(frames).boxed_unsync());
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    r
}

/// The error that ends a walk: the store failed, or the client went away (nothing to report).
enum Stop {
    Store(StoreError),
    Gone,
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Store(e) => e.fmt(f),
            Stop::Gone => f.write_str("the client went away"),
        }
    }
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Store(e)
    }
}

struct Walker {
    app: Arc<App>,
    tx: mpsc::Sender<std::io::Result<Bytes>>,
    /// Lines not yet handed to the connection.
    chunk: Vec<u8>,
}

impl Walker {
    async fn send(&mut self, hash_part: &str, info: Option<&ValidPathInfo>) -> Result<(), Stop> {
        let text = info.map(|i| self.app.narinfo(i));
        self.send_text(hash_part, text.as_deref()).await
    }

    /// Adds the line of `hash_part`, handing the lines gathered to the connection once they
    /// make a chunk.
    async fn send_text(&mut self, hash_part: &str, text: Option<&[u8]>) -> Result<(), Stop> {
        // Rendered from a String or read as a narinfo: UTF-8, borrowed as it is.
        let text = text.map(String::from_utf8_lossy);
        push_line(&mut self.chunk, hash_part, text.as_deref());
        match self.chunk.len() >= CHUNK_BYTES {
            true => self.flush().await,
            false => Ok(()),
        }
    }

    /// Hands the lines gathered so far to the connection.
    async fn flush(&mut self) -> Result<(), Stop> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::take(&mut self.chunk));
        self.tx.send(Ok(chunk)).await.map_err(|_| Stop::Gone)
    }

    /// The narinfos of `hashes` (and with `closure`, of their closures, breadth first) in a
    /// cache served as stored, with its upstreams if any ([`crate::stored`]): each level's
    /// narinfos asked all at once, each line sent as soon as its level is answered.
    async fn stored(&mut self, stored: &Stored, hashes: Vec<String>, closure: bool) -> Result<(), Stop> {
        let mut seen = std::collections::HashSet::new();
        let mut level: Vec<String> = if closure { hashes.into_iter().filter(|h| seen.insert(h.clone())).collect() } else { hashes };
        while !level.is_empty() {
            let mut next = Vec::new();
            for chunk in level.chunks(STORE_BATCH) {
                let found = futures::future::try_join_all(chunk.iter().map(|h| stored.narinfo(h, &self.app.keys))).await?;
                for (hash, lookup) in chunk.iter().zip(found) {
                    let text = match lookup {
                        Lookup::Found(served) if closure => {
                            let refs = served.references.iter().map(|r| r.hash_part().to_string());
                            next.extend(refs.filter(|r| seen.insert(r.clone())));
                            Some(served.text)
                        }
                        Lookup::Found(served) => Some(served.text),
                        Lookup::Missing(_) => None,
                    };
                    self.send_text(hash, text.as_deref()).await?;
                }
                self.flush().await?;
            }
            level = next;
        }
        Ok(())
    }

    /// The valid paths of `hashes`, in order (`None` where there is none).
    async fn paths(&self, hashes: &[String]) -> Result<Vec<Option<StorePath>>, StoreError> {
        let lookups = hashes.iter().map(|h| self.app.store.query_path_from_hash_part(h));
        futures::future::try_join_all(lookups).await
    }

    async fn narinfos(&mut self, hashes: Vec<String>) -> Result<(), Stop> {
        for chunk in hashes.chunks(STORE_BATCH) {
            let paths = self.paths(chunk).await?;
            let found: Vec<StorePath> = paths.iter().flatten().cloned().collect();
            let mut infos = self.app.store.query_path_infos(&found).await?.into_iter();
            for (hash, path) in chunk.iter().zip(&paths) {
                let info = if path.is_some() { infos.next().flatten() } else { None };
                self.send(hash, info.as_ref().map(|i| &i.info)).await?;
            }
            self.flush().await?;
        }
        Ok(())
    }

    /// Breadth first from the roots: one store batch per level (per [`STORE_BATCH`] paths),
    /// each path's line sent as soon as its level is read.
    async fn closure(&mut self, roots: Vec<String>) -> Result<(), Stop> {
        let mut seen = std::collections::HashSet::new();
        let mut level = Vec::new();
        for chunk in roots.chunks(STORE_BATCH) {
            for (hash, path) in chunk.iter().zip(self.paths(chunk).await?) {
                match path {
                    Some(p) => {
                        if seen.insert(p.clone()) {
                            level.push(p);
                        }
                    }
                    None => self.send(hash, None).await?,
                }
            }
        }
        self.flush().await?;
        while !level.is_empty() {
            let mut next = Vec::new();
            for chunk in level.chunks(STORE_BATCH) {
                let infos = self.app.store.query_path_infos(chunk).await?;
                for (path, info) in chunk.iter().zip(infos) {
                    if let Some(info) = &info {
                        next.extend(info.info.references.iter().filter(|r| seen.insert((*r).clone())).cloned());
                    }
                    self.send(path.hash_part(), info.as_ref().map(|i| &i.info)).await?;
                }
                self.flush().await?;
            }
            level = next;
        }
        Ok(())
    }
}
