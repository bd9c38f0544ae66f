//! The upstreams of a pull-through cache (`sluice serve --store CACHE --upstream URL…`): what
//! `CACHE` lacks is asked of every upstream at once, as Nix asks its substituters
//! (`src/libstore/store-api.cc`, `querySubstitutablePathInfos`, in priority order), and the
//! highest-priority answer that the trusted keys accept is served: with the upstream's
//! signatures, its NAR at `nar/<FileHash>.nar<ext>?hash=<hash part>` (the name it gets in
//! `CACHE`; the query lets any front over the same `CACHE` find the path again). An upstream
//! that fails or times out is a miss for that request and is skipped for [`SKIP`], as Nix's
//! `BinaryCacheStore::maybeDisable` (`src/libstore/http-binary-cache-store.cc`) does; a path
//! no upstream has is remembered for [`MISS_TTL`]. A narinfo whose `NarSize` or `FileSize` is
//! over the largest NAR the server takes (`--upstream-max-nar-size`) is passed over, so that
//! no claim makes the server spool more. Its NAR is fetched once ([`crate::flight`]) and kept
//! once checked ([`Keep`]): in a binary cache as the upstream compressed it, its narinfo
//! written only after the NAR; in a local store as a path registered with the upstream's
//! signatures, once its references are. A NAR that failed its check is never served from that
//! upstream again; one that was not fetched whole (the upstream did not have it, the transfer
//! broke) is fetched again on a later request, after [`NAR_RETRY`] (doubled each time it fails
//! again, up to [`SKIP`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use hashlink::LruCache;
use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::url::CacheUrl;
use sluice_binary_cache::BinaryCache;
use sluice_local_store::SignaturePolicy;
use sluice_nix::cache_info::CacheInfo;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StoreDir;

use sluice_compress::Compression;
use sluice_nix::store_path::StorePath;
use sluice_store::store::Store;

use crate::flight::{Expected, Failure, Fetched, Flight};
use crate::metrics::Metrics;

/// How long an upstream that failed or timed out is left out (Nix's `maybeDisable`: 60 s).
pub const SKIP: Duration = Duration::from_secs(60);
/// How long after a NAR fetch that failed without the file being checked (see [`Failure`]) it
/// may be tried again; doubled each time, up to [`SKIP`].
pub const NAR_RETRY: Duration = Duration::from_secs(2);
/// How long a path no upstream has is remembered as missing (and said so in
/// `Cache-Control: max-age`).
pub const MISS_TTL: Duration = Duration::from_secs(30);
/// Paths remembered: misses, and the upstream sources of NARs served but not yet kept.
const REMEMBERED: usize = 16 * 1024;
/// How long a path fetched for a local store waits for its references to be kept (its
/// client fetched them first, through this server; their keeping may still be under way).
pub const REFERENCES_WAIT: Duration = Duration::from_secs(60);

/// Where a pull-through cache keeps what it fetched from its upstreams.
#[derive(Clone)]
pub enum Keep {
    /// A binary cache (`file://`, `s3://`): the NAR file as the upstream compressed it, then
    /// its narinfo.
    Cache(Arc<BinaryCache>),
    /// A local store: the path unpacked from the NAR (checked again by the store) and
    /// registered with the upstream's signatures, once its references are valid there (a
    /// local store registers no path before its references, as Nix's `registerValidPaths`).
    Store(Arc<dyn Store>),
}

impl Keep {
    fn url(&self) -> &str {
        match self {
            Keep::Cache(cache) => cache.url(),
            Keep::Store(store) => store.url(),
        }
    }

    /// A temporary file for a NAR fetched to be kept: where a binary cache stages its
    /// uploads, else in the system's temporary directory.
    fn staging_file(&self) -> std::io::Result<tempfile::NamedTempFile> {
        match self {
            Keep::Cache(cache) => cache.nar_staging_file(),
            Keep::Store(_) => sluice_binary_cache::spool::staging_file(&std::env::temp_dir()),
        }
    }

    /// Keeps `fetched`, the NAR file `name` of `narinfo` (compressed with `compression`).
    async fn keep(&self, name: &str, fetched: Fetched, narinfo: &NarInfo, compression: Compression) -> Result<(), String> {
        match self {
            Keep::Cache(cache) => {
                cache.put_nar_file(name, fetched.file, fetched.file_hash, fetched.file_size).await.map_err(|e| e.to_string())?;
                cache.write_narinfo(narinfo).await.map_err(|e| e.to_string())
            }
            Keep::Store(store) => {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                let info = ValidPathInfo::from_narinfo(narinfo, i64::try_from(now).unwrap_or(i64::MAX));
                references_kept(store.as_ref(), &info).await?;
                let file = fetched.file.reopen().map_err(|e| format!("{}: {e}", fetched.file.path().display()))?;
                let nar = compression.decoder(file).map_err(|e| e.to_string())?;
                store.add_to_store(info, nar, Box::pin(async { Ok(()) })).await.map_err(|e| e.to_string())
            }
        }
    }
}

/// Waits, at most [`REFERENCES_WAIT`], until every reference of `info` but itself is valid in
/// `store`; fails naming those that are not.
async fn references_kept(store: &dyn Store, info: &ValidPathInfo) -> Result<(), String> {
    let references: Vec<StorePath> = info.references.iter().filter(|r| **r != info.path).cloned().collect();
    let deadline = Instant::now() + REFERENCES_WAIT;
    loop {
        let valid = store.query_valid_paths(&references).await.map_err(|e| e.to_string())?;
        if valid.len() == references.len() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let missing: Vec<String> =
                references.iter().filter(|r| !valid.contains(*r)).map(|r| store.store_dir().display_path(r)).collect();
            return Err(format!("its references {} are not valid after {} s", missing.join(", "), REFERENCES_WAIT.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Locks `m`, whatever a panicking holder left.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One upstream binary cache.
pub struct Upstream {
    url: CacheUrl,
    /// The open cache; opened again once a skip ends (a [`BinaryCache`] gives up on a failing
    /// cache for good).
    cache: Mutex<Arc<BinaryCache>>,
    priority: i32,
    /// `?trusted=true`: its narinfos need no signature.
    trusted: bool,
    skipped_until: Mutex<Option<Instant>>,
}

/// Where the NAR of a path served from an upstream comes from.
#[derive(Clone)]
struct Source {
    upstream: usize,
    /// The NAR file's URL relative to the upstream.
    rel: String,
    /// The narinfo as served and kept (its URL the file's name in `CACHE`).
    narinfo: NarInfo,
}

/// A NAR file an upstream did not give.
#[derive(Clone, Copy)]
enum Failed {
    /// It failed its check: never served from there.
    Corrupt,
    /// It was not fetched, `times` in a row: not asked for again until `until`.
    Unfetched { until: Instant, times: u32 },
}

/// Why an upstream's narinfo is not served.
enum Refusal {
    /// No trusted key signed it.
    Unsigned,
    /// Its NAR is over the largest taken; the warning.
    TooLarge(String),
    /// Its NAR failed, for good or for now ([`Failed`]).
    Failed(Failed),
}

/// A narinfo lookup's outcome.
pub enum Found {
    /// The narinfo to serve (its URL relative to this server).
    Yes(Box<NarInfo>),
    /// No upstream has it; for how long that is remembered (`None`: an upstream failed, not
    /// remembered).
    No(Option<Duration>),
}

/// The upstreams, what they answered, and the NARs being fetched.
pub struct Upstreams {
    list: Vec<Upstream>,
    client: LazyClient,
    policy: SignaturePolicy,
    timeout: Duration,
    /// The largest `NarSize` and `FileSize` taken.
    max_nar_size: u64,
    store_dir: StoreDir,
    metrics: Arc<Metrics>,
    misses: Mutex<LruCache<String, Instant>>,
    sources: Mutex<LruCache<String, Source>>,
    flights: Mutex<HashMap<String, Arc<Flight>>>,
    /// NAR files that failed, by upstream.
    failed: Mutex<HashMap<(usize, String), Failed>>,
}

impl Upstreams {
    /// The upstreams at `urls` (each asked for its `nix-cache-info`, all at once within
    /// `timeout`, for its priority; one that does not answer gets Nix's default, 50, and is
    /// skipped), whose NARs are taken up to `max_nar_size` bytes.
    pub async fn open(
        urls: &[CacheUrl],
        client: LazyClient,
        policy: SignaturePolicy,
        timeout: Duration,
        max_nar_size: u64,
        metrics: Arc<Metrics>,
    ) -> Result<Upstreams, String> {
        let (client_ref, metrics_ref) = (&client, &metrics);
        // All at once: a dead upstream holds the start for one timeout, not one each.
        let opened = urls.iter().map(|url| {
            let (client, metrics) = (client_ref, metrics_ref);
            async move {
                let mut cache = BinaryCache::new(url, client, CacheInfo::default()).map_err(|e| e.to_string())?;
                let why = match tokio::time::timeout(timeout, cache.fetch_cache_info()).await {
                    Ok(Ok(Some(info))) => {
                        cache.set_info(info);
                        None
                    }
                    Ok(Ok(None)) => {
                        cache.set_info(cache.read_without_cache_info().map_err(|e| e.to_string())?);
                        None
                    }
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no nix-cache-info within {} s", timeout.as_secs_f64())),
                };
                if let Some(why) = &why {
                    tracing::warn!("upstream {}: {why}; skipped for {} s", url.base, SKIP.as_secs());
                    metrics.upstream(&url.base, |c| c.failures += 1);
                }
                Ok::<_, String>(Upstream {
                    url: url.clone(),
                    priority: cache.info().priority,
                    cache: Mutex::new(Arc::new(cache)),
                    trusted: url.common.trusted,
                    skipped_until: Mutex::new(why.map(|_| Instant::now() + SKIP)),
                })
            }
        });
        let mut list = futures::future::try_join_all(opened).await?;
        list.sort_by_key(|u| u.priority);
        Ok(Upstreams {
            list,
            client,
            policy,
            timeout,
            max_nar_size,
            store_dir: StoreDir::default(),
            metrics,
            misses: Mutex::new(LruCache::new(REMEMBERED)),
            sources: Mutex::new(LruCache::new(REMEMBERED)),
            flights: Mutex::default(),
            failed: Mutex::default(),
        })
    }

    /// Upstream `i`'s cache, unless it is being skipped (opened anew when its skip ended).
    fn cache(&self, i: usize) -> Option<Arc<BinaryCache>> {
        let up = &self.list[i];
        let mut until = lock(&up.skipped_until);
        match *until {
            Some(t) if Instant::now() < t => return None,
            Some(_) => {
                *until = None;
                let fresh = BinaryCache::new(&up.url, &self.client, lock(&up.cache).info().clone());
                match fresh {
                    Ok(c) => *lock(&up.cache) = Arc::new(c),
                    Err(e) => tracing::warn!("upstream {}: {e}", up.url.base),
                }
            }
            None => {}
        }
        Some(lock(&up.cache).clone())
    }

    /// Leaves upstream `i` out for [`SKIP`] after `why`.
    fn skip(&self, i: usize, why: &str) {
        let up = &self.list[i];
        tracing::warn!("upstream {}: {why}; skipped for {} s", up.url.base, SKIP.as_secs());
        *lock(&up.skipped_until) = Some(Instant::now() + SKIP);
        self.metrics.upstream(&up.url.base, |c| c.failures += 1);
    }

    /// The narinfo of `hash_part` from the upstreams (see the module doc).
    pub async fn narinfo(&self, hash_part: &str) -> Found {
        if lock(&self.misses).get(hash_part).is_some_and(|until| Instant::now() < *until) {
            return Found::No(Some(MISS_TTL));
        }
        let caches: Vec<Option<Arc<BinaryCache>>> = (0..self.list.len()).map(|i| self.cache(i)).collect();
        // Per upstream, in priority order: None while asked, Some(answer) once answered (a
        // skipped one has nothing).
        let mut answers: Vec<Option<Option<NarInfo>>> = caches.iter().map(|c| c.is_none().then_some(None)).collect();
        let mut clean = caches.iter().all(Option::is_some);
        let mut asked: FuturesUnordered<_> = caches
            .into_iter()
            .enumerate()
            .filter_map(|(i, c)| c.map(|c| (i, c)))
            .map(|(i, cache)| async move {
                let started = Instant::now();
                let answer = tokio::time::timeout(self.timeout, cache.narinfo_by_hash_part(hash_part)).await;
                (i, started.elapsed(), answer)
            })
            .collect();
        while let Some((i, took, answer)) = asked.next().await {
            let base = &self.list[i].url.base;
            answers[i] = Some(match answer {
                Ok(Ok(Some((_, narinfo)))) => match self.refusal(i, &narinfo) {
                    None => {
                        self.metrics.upstream(base, |c| c.hit(took));
                        Some(narinfo)
                    }
                    Some(Refusal::Unsigned) => {
                        tracing::warn!("upstream {base}: the narinfo of {hash_part} has no signature by a trusted key; passed over");
                        self.metrics.upstream(base, |c| c.refused += 1);
                        None
                    }
                    Some(Refusal::TooLarge(why)) => {
                        tracing::warn!("{why}");
                        self.metrics.upstream(base, |c| c.refused += 1);
                        None
                    }
                    Some(Refusal::Failed(failed)) => {
                        // Not remembered as a miss while its NAR may be fetched again soon.
                        clean &= matches!(failed, Failed::Corrupt);
                        None
                    }
                },
                Ok(Ok(None)) => {
                    self.metrics.upstream(base, |c| c.miss(took));
                    None
                }
                Ok(Err(e)) => {
                    clean = false;
                    if e.is_cache_wide() {
                        self.skip(i, &e.to_string());
                    } else {
                        tracing::warn!("{e}");
                    }
                    None
                }
                Err(_) => {
                    clean = false;
                    self.skip(i, &format!("no answer within {} s", self.timeout.as_secs_f64()));
                    None
                }
            });
            // The best answer is known once every upstream before it has answered.
            for (j, answer) in answers.iter().enumerate() {
                match answer {
                    None => break,
                    Some(Some(narinfo)) => return Found::Yes(Box::new(self.serve(j, hash_part, narinfo.clone()))),
                    Some(None) => {}
                }
            }
        }
        if clean {
            lock(&self.misses).insert(hash_part.to_string(), Instant::now() + MISS_TTL);
        }
        Found::No(clean.then_some(MISS_TTL))
    }

    /// Why upstream `i`'s `narinfo` is not served, if it is not: no trusted key signed it (and
    /// it needs a signature), its NAR is over the largest taken, or it failed and is not to be
    /// fetched again (yet).
    fn refusal(&self, i: usize, narinfo: &NarInfo) -> Option<Refusal> {
        let info = ValidPathInfo::from_narinfo(narinfo, 0);
        if self.policy.for_source(self.list[i].trusted).vouch(&self.store_dir, &info).is_err() {
            return Some(Refusal::Unsigned);
        }
        let size = narinfo.nar_size.max(narinfo.file_size.unwrap_or(0));
        if size > self.max_nar_size {
            return Some(Refusal::TooLarge(format!(
                "upstream {}: {}: its NAR is {size} bytes (NarSize {}, FileSize {}), more than the {} bytes of \
                 --upstream-max-nar-size; passed over",
                self.list[i].url.base,
                self.store_dir.display_path(&narinfo.store_path),
                narinfo.nar_size,
                narinfo.file_size.map_or_else(|| "not given".to_string(), |s| s.to_string()),
                self.max_nar_size,
            )));
        }
        self.failed(i, &kept_name(narinfo)).map(Refusal::Failed)
    }

    /// How the NAR file `name` failed at upstream `i`, if it did and is not to be fetched
    /// again (yet).
    fn failed(&self, i: usize, name: &str) -> Option<Failed> {
        let failed = *lock(&self.failed).get(&(i, name.to_string()))?;
        match failed {
            Failed::Unfetched { until, .. } if Instant::now() >= until => None,
            _ => Some(failed),
        }
    }

    /// Where the NAR file `name` comes from, unless it failed there (for now).
    fn source(&self, name: &str) -> Option<Source> {
        let source = lock(&self.sources).get(name).cloned()?;
        self.failed(source.upstream, name).is_none().then_some(source)
    }

    /// Records how the fetch of the NAR file `name` from upstream `i` ended.
    fn fetched(&self, i: usize, name: &str, outcome: Result<(), &Failure>) {
        let base = &self.list[i].url.base;
        let mut failed = lock(&self.failed);
        let key = (i, name.to_string());
        match outcome {
            Ok(()) => {
                self.metrics.upstream(base, |c| c.nars += 1);
                failed.remove(&key);
            }
            Err(Failure::Corrupt(why)) => {
                tracing::warn!("{why}: the NAR is not served from {base}");
                self.metrics.upstream(base, |c| c.nar_failures += 1);
                failed.insert(key, Failed::Corrupt);
            }
            Err(Failure::Unfetched(why)) => {
                let times = match failed.get(&key) {
                    Some(Failed::Unfetched { times, .. }) => times + 1,
                    _ => 1,
                };
                let wait = NAR_RETRY.saturating_mul(1 << (times - 1).min(16)).min(SKIP);
                tracing::warn!("{why}: the NAR is fetched again on a request after {} s", wait.as_secs());
                self.metrics.upstream(base, |c| c.failures += 1);
                failed.insert(key, Failed::Unfetched { until: Instant::now() + wait, times });
            }
        }
    }

    /// Upstream `i`'s `narinfo` as served: its NAR at the name it gets in `CACHE`, remembered
    /// until that NAR is asked for.
    fn serve(&self, i: usize, hash_part: &str, mut narinfo: NarInfo) -> NarInfo {
        let name = kept_name(&narinfo);
        let rel = std::mem::replace(&mut narinfo.url, name);
        lock(&self.sources).insert(narinfo.url.clone(), Source { upstream: i, rel, narinfo: narinfo.clone() });
        narinfo.url = format!("{}?hash={hash_part}", narinfo.url);
        narinfo
    }

    /// The flight fetching the NAR file `name` (`nar/…` in `CACHE`), started now if none is
    /// under way and an upstream's narinfo names it (asked again for `hash_part`, when this
    /// front did not serve it); once it checks out it is kept in `keep`. `None` when no
    /// upstream has it, or only one whose copy failed its check or whose fetch is waiting out
    /// its back-off.
    pub async fn flight(self: &Arc<Self>, name: &str, hash_part: Option<&str>, keep: &Keep) -> Result<Option<Arc<Flight>>, String> {
        if let Some(f) = lock(&self.flights).get(name) {
            return Ok(Some(f.clone()));
        }
        let mut source = self.source(name);
        if let (None, Some(h)) = (&source, hash_part) {
            if let Found::Yes(_) = self.narinfo(h).await {
                source = self.source(name);
            }
        }
        let Some(source) = source else { return Ok(None) };
        let Some(upstream) = self.cache(source.upstream) else { return Ok(None) };
        let mut flights = lock(&self.flights);
        if let Some(f) = flights.get(name) {
            return Ok(Some(f.clone()));
        }
        let compression = Compression::parse(&source.narinfo.compression).map_err(|e| format!("{name}: {e}"))?;
        let expected = Expected {
            compression,
            nar_hash: source.narinfo.nar_hash.clone(),
            nar_size: source.narinfo.nar_size,
            file_hash: source.narinfo.file_hash.clone(),
            file_size: source.narinfo.file_size,
            max_size: self.max_nar_size,
        };
        let spool = keep.staging_file().map_err(|e| format!("{}: a temporary file for {name}: {e}", keep.url()))?;
        let (flight, fetched) = Flight::start(upstream, source.rel.clone(), spool, expected).map_err(|e| format!("{name}: {e}"))?;
        flights.insert(name.to_string(), flight.clone());
        drop(flights);
        let (this, keep, name) = (self.clone(), keep.clone(), name.to_string());
        tokio::spawn(async move {
            let kept = match fetched.await.map_err(|e| Failure::Unfetched(e.to_string())).and_then(|r| r) {
                Ok(f) => {
                    this.fetched(source.upstream, &name, Ok(()));
                    keep.keep(&name, f, &source.narinfo, compression).await
                }
                Err(failure) => {
                    this.fetched(source.upstream, &name, Err(&failure));
                    Ok(())
                }
            };
            if let Err(e) = kept {
                tracing::warn!("keeping {name} in {}: {e}", keep.url());
            }
            lock(&this.flights).remove(&name);
        });
        Ok(Some(flight))
    }
}

/// The name the NAR file of `narinfo` gets in `CACHE`: `nar/<FileHash>.nar<ext>`, as Nix
/// names the NARs it writes, with the extension the upstream gave it; without a `FileHash`,
/// `nar/<NarHash>-<hash part>.nar<ext>`.
pub fn kept_name(narinfo: &NarInfo) -> String {
    let file = narinfo.url.rsplit('/').next().unwrap_or_default().split('?').next().unwrap_or_default();
    let ext = file.find(".nar").map_or("", |i| &file[i + 4..]);
    let ext = if ext.chars().all(|c| c == '.' || c.is_ascii_alphanumeric()) { ext } else { "" };
    match &narinfo.file_hash {
        Some(h) => format!("nar/{}.nar{ext}", h.to_nix32()),
        None => format!("nar/{}-{}.nar{ext}", narinfo.nar_hash.to_nix32(), narinfo.store_path.hash_part()),
    }
}
