//! More than one HTTP/2 connection to a cache. A server limits the streams of one connection
//! (nginx: 128), and `reqwest` queues requests beyond that limit on the one connection it has;
//! a closure query wants several hundred narinfo requests in flight. With the first request to
//! an HTTPS cache (or once a cache has answered over HTTP/2), [`ClientPool`] adds
//! [`H2_CONNECTIONS`]` - 1` more clients (each with its own connection), opens their
//! connections at once with a `HEAD` of the cache's root so that they are ready before the
//! wide levels of the closure arrive, and spreads requests over all of them in turn — each extra client only once its connection is up (until then its pool does
//! not know the server speaks HTTP/2 and would open a connection per request).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::config::Settings;

/// HTTP/2 connections per cache.
pub const H2_CONNECTIONS: usize = 4;

/// An additional client and whether its connection is up.
#[derive(Debug)]
struct Extra {
    client: reqwest::Client,
    ready: Arc<AtomicBool>,
}

/// The clients of one cache; one until the cache speaks HTTP/2.
#[derive(Debug)]
pub struct ClientPool {
    first: reqwest::Client,
    extra: OnceLock<Vec<Extra>>,
    next: AtomicUsize,
    settings: Settings,
}

impl ClientPool {
    /// A pool starting with `first` (shared with other caches); `settings` builds the others.
    pub fn new(first: reqwest::Client, settings: &Settings) -> Self {
        ClientPool { first, extra: OnceLock::new(), next: AtomicUsize::new(0), settings: settings.clone() }
    }

    /// The client for the next request: the first, and in turn each extra one that is ready.
    pub fn next(&self) -> &reqwest::Client {
        let Some(extra) = self.extra.get() else { return &self.first };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % (extra.len() + 1);
        match i.checked_sub(1).and_then(|j| extra.get(j)) {
            Some(e) if e.ready.load(Ordering::Acquire) => &e.client,
            _ => &self.first,
        }
    }

    /// Adds the other HTTP/2 connections to `base` (once), opening them in the background.
    pub fn grow_for_h2(&self, base: &str) {
        if self.extra.get().is_some() {
            return;
        }
        let extra = self.extra.get_or_init(|| {
            (1..H2_CONNECTIONS)
                .filter_map(|_| super::http::client(&self.settings).ok())
                .map(|client| Extra { client, ready: Arc::new(AtomicBool::new(false)) })
                .collect()
        });
        let root = format!("{base}/");
        for e in extra {
            let (client, ready, root) = (e.client.clone(), e.ready.clone(), root.clone());
            tokio::spawn(async move {
                if client.head(root).send().await.is_ok_and(|r| r.version() == reqwest::Version::HTTP_2) {
                    ready.store(true, Ordering::Release);
                }
            });
        }
    }

    /// How many connections requests are spread over.
    pub fn connections(&self) -> usize {
        1 + self.extra.get().map_or(0, Vec::len)
    }
}
