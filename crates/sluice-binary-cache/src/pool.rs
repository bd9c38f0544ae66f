//! More than one HTTP/2 connection to a cache. A server limits the streams of one connection
//! (nginx: 128), and hyper queues requests beyond that limit on the one connection it has;
//! a closure query wants several hundred narinfo requests in flight. With the first request to
//! an HTTPS cache (or once a cache has answered over HTTP/2), [`ClientPool`] adds
//! [`H2_CONNECTIONS`]` - 1` more clients (each with its own connection), opens their
//! connections at once with a `HEAD` of the cache's root so that they are ready before the
//! wide levels of the closure arrive, and spreads requests over all of them in turn — each extra client only once its connection is up (until then its pool does
//! not know the server speaks HTTP/2 and would open a connection per request).
//!
//! NAR downloads go over [`NAR_CONNECTIONS`] connections of their own, opened at the same
//! moment ([`ClientPool::next_nar`]): a NAR stream holds one of its connection's streams until
//! its body is read (while it is unpacked), so on shared connections the narinfo requests of
//! the closure's last levels queued behind NAR bytes, and the last narinfo came round trips
//! late (docs/benchmarks.md).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::http::{Client, HttpOptions};

/// HTTP/2 connections per cache for narinfos and other small files.
pub(crate) const H2_CONNECTIONS: usize = 4;

/// HTTP/2 connections per cache for NARs (with nginx's 128 streams each, room for
/// `sluice copy`'s 256 jobs).
pub(crate) const NAR_CONNECTIONS: usize = 2;

/// An additional client and whether its connection is up.
#[derive(Debug)]
struct Extra {
    client: Client,
    ready: Arc<AtomicBool>,
    /// Set once the connection's `HEAD` was answered, whether over HTTP/2 or not.
    settled: tokio::sync::watch::Receiver<bool>,
}

/// The clients of one cache; one until the cache speaks HTTP/2.
#[derive(Debug)]
pub(crate) struct ClientPool {
    first: Client,
    extra: OnceLock<Vec<Extra>>,
    /// The NAR connections, made with `extra`.
    nar: OnceLock<Vec<Extra>>,
    next: AtomicUsize,
    next_nar: AtomicUsize,
    options: HttpOptions,
}

impl ClientPool {
    /// A pool starting with `first` (shared with other caches); `options` build the others.
    pub fn new(first: Client, options: &HttpOptions) -> Self {
        ClientPool {
            first,
            extra: OnceLock::new(),
            nar: OnceLock::new(),
            next: AtomicUsize::new(0),
            next_nar: AtomicUsize::new(0),
            options: options.clone(),
        }
    }

    /// The client for the next request: the first, and in turn each extra one that is ready.
    pub fn next(&self) -> &Client {
        let Some(extra) = self.extra.get() else { return &self.first };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % (extra.len() + 1);
        match i.checked_sub(1).and_then(|j| extra.get(j)) {
            Some(e) if e.ready.load(Ordering::Acquire) => &e.client,
            _ => &self.first,
        }
    }

    /// The client for the next NAR download: in turn each NAR connection, once its `HEAD`
    /// was answered (they are opened with the first request, so by the time a NAR is asked
    /// for they are about up); the narinfo clients ([`Self::next`]) without HTTP/2 or when
    /// the connection did not come up over HTTP/2.
    pub(crate) async fn next_nar(&self) -> &Client {
        let Some(nar) = self.nar.get().filter(|n| !n.is_empty()) else { return self.next() };
        let e = &nar[self.next_nar.fetch_add(1, Ordering::Relaxed) % nar.len()];
        // An error means the opening task is gone: the connection is not up.
        let _ = e.settled.clone().wait_for(|settled| *settled).await;
        match e.ready.load(Ordering::Acquire) {
            true => &e.client,
            false => self.next(),
        }
    }

    /// Adds the other HTTP/2 connections to `base` and the NAR connections (once), opening
    /// them in the background.
    pub(crate) fn grow_for_h2(&self, base: &str) {
        if self.extra.get().is_some() {
            return;
        }
        let root = format!("{base}/");
        let open = |n: usize| -> Vec<Extra> {
            (0..n)
                .filter_map(|_| super::http::client(&self.options).ok())
                .map(|client| {
                    let ready = Arc::new(AtomicBool::new(false));
                    let (settle, settled) = tokio::sync::watch::channel(false);
                    let (c, r, root) = (client.clone(), ready.clone(), root.clone());
                    tokio::spawn(async move {
                        if let Ok(url) = reqwest::Url::parse(&root) {
                            let head = c.execute(reqwest::Request::new(reqwest::Method::HEAD, url)).await;
                            r.store(head.is_ok_and(|resp| resp.version() == reqwest::Version::HTTP_2), Ordering::Release);
                        }
                        settle.send_replace(true);
                    });
                    Extra { client, ready, settled }
                })
                .collect()
        };
        let mut made = false;
        self.extra.get_or_init(|| {
            made = true;
            open(H2_CONNECTIONS - 1)
        });
        if made {
            self.nar.get_or_init(|| open(NAR_CONNECTIONS));
        }
    }

    /// How many connections narinfo requests are spread over.
    pub fn connections(&self) -> usize {
        1 + self.extra.get().map_or(0, Vec::len)
    }

    /// How many connections NAR downloads are spread over apart from those.
    pub(crate) fn nar_connections(&self) -> usize {
        self.nar.get().map_or(0, Vec::len)
    }
}
