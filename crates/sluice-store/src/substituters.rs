//! Opening the configured substituters. A binary cache's `nix-cache-info` comes from the disk
//! cache when fresh, otherwise fetched (all caches at once) and recorded; caches whose
//! `nix-cache-info` is for another store directory than their URL's or that cannot be reached
//! are left out with a warning, as Nix does. A cache of another store directory than the
//! destination's substitutes only content-addressed paths without references (`closure.rs`).
//! Any other store whose kind can be a substituter (`ssh-ng://`, `ssh://`) is opened only
//! when a path is first asked of it ([`crate::substituter_source`]).

use std::sync::Arc;

use futures::future::join_all;
use sluice_nix::cache_info::CacheInfo;
use sluice_nix::store_path::StorePath;

use crate::closure::{ClosureQuery, Substituter};
use crate::config::Settings;
use crate::store_url::{CacheKind, CacheUrl, StoreUrl};
use crate::substituter_source::{Source, StoreSource};
use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::narinfo_cache::NarInfoCache;
use sluice_binary_cache::{BatchLines, BinaryCache, CacheError};

/// Most root narinfos fetched alongside `nix-cache-info`.
pub(crate) const MAX_PREFETCH: usize = 64;

/// Why a substituter URL was not used.
#[derive(Debug, thiserror::Error)]
pub enum SubstituterError {
    #[error("{url}: not a binary cache URL")]
    NotACache { url: String },
    /// A store of a kind that cannot be a substituter (`dummy://`, `memory://`).
    #[error("{url}: this kind of store cannot be a substituter")]
    NotASubstituter { url: String },
    #[error(transparent)]
    Url(#[from] crate::store_url::StoreUrlError),
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Parses a URL that must name a binary cache (`sluice serve --upstream`).
pub fn cache_url(url: &str) -> Result<CacheUrl, SubstituterError> {
    StoreUrl::parse(url)?.as_cache().cloned().ok_or_else(|| SubstituterError::NotACache { url: url.to_string() })
}

/// Opens the substituter at `url`: a binary cache ([`open_cache`]), or a store of a kind
/// that can be a substituter, to be opened with `settings` when a path is first asked of it.
async fn open_one(
    url: &str,
    settings: &Settings,
    client: &LazyClient,
    disk: Option<&NarInfoCache>,
    prefetch: &[StorePath],
) -> Result<Substituter, SubstituterError> {
    let parsed = StoreUrl::parse(url)?;
    if let Some(curl) = parsed.as_cache() {
        return open_cache(curl.clone(), client, disk, prefetch).await;
    }
    let common = parsed.as_substituter().cloned().ok_or_else(|| SubstituterError::NotASubstituter { url: url.to_string() })?;
    let mut sub = Substituter::new(Source::Store(StoreSource::new(url, parsed, &common, settings)), None);
    sub.trusted = common.trusted;
    Ok(sub)
}

/// Opens the binary cache `curl` as a substituter. The narinfo disk cache serves and records
/// only caches over the network: as in Nix, where the HTTP and S3 stores set `diskCache` and the local binary
/// cache store does not (`http-binary-cache-store.cc`, `s3-binary-cache-store.cc`,
/// `local-binary-cache-store.cc`), a `file://` cache's narinfos are read anew by every run, so
/// that a path pushed into it, or a narinfo edited there, is seen at once.
async fn open_cache(
    curl: CacheUrl,
    client: &LazyClient,
    disk: Option<&NarInfoCache>,
    prefetch: &[StorePath],
) -> Result<Substituter, SubstituterError> {
    let disk = disk.filter(|_| curl.kind != CacheKind::File);
    let cached = disk.and_then(|d| d.cache_info(&curl.base).map_err(|e| tracing::warn!("{e}")).ok().flatten());
    let (disk_id, cache) = match cached {
        Some((id, info)) => (Some(id), BinaryCache::new(&curl, client, info)?),
        None => {
            let mut cache = BinaryCache::new(&curl, client, CacheInfo::default())?;
            let roots = &prefetch[..prefetch.len().min(MAX_PREFETCH)];
            let (info, answers, closure) = fetch_cold(&cache, roots, prefetch).await;
            let info = match info? {
                Some(info) => info,
                None => cache.read_without_cache_info()?,
            };
            let id = disk.and_then(|d| d.record_cache(&curl.base, &info).map_err(|e| tracing::warn!("{e}")).ok());
            cache.set_info(info);
            cache.check_store_dir()?;
            let mut sub = Substituter::new(Source::Cache(cache), id);
            sub.trusted = curl.common.trusted;
            sub.prefetched.extend(roots.iter().map(|p| p.hash_part().to_string()).zip(answers));
            match closure {
                Some(lines) => sub.prefetched.receive(lines),
                None => prefetch_closure(&sub, disk, prefetch).await,
            }
            return Ok(sub);
        }
    };
    cache.check_store_dir()?;
    let mut sub = Substituter::new(Source::Cache(cache), disk_id);
    sub.trusted = curl.common.trusted;
    prefetch_closure(&sub, disk, prefetch).await;
    Ok(sub)
}

/// For a cache that advertises `SluiceBatch`, asks for the whole closure of `roots` in one
/// request and keeps every answer in `sub.prefetched` as it arrives, where the closure engine
/// takes each (or waits for it) instead of a request, and records it in the disk cache like
/// any answer it fetched. Skipped when the disk cache already has fresh answers for every
/// root; a failure is a warning, the engine then asks for each narinfo as with any cache.
async fn prefetch_closure(sub: &Substituter, disk: Option<&NarInfoCache>, roots: &[StorePath]) {
    let Some(cache) = sub.source.as_cache().filter(|c| c.info().batch && !roots.is_empty()) else { return };
    if let (Some(disk), Some(id)) = (disk, sub.disk_id) {
        let hashes: Vec<&str> = roots.iter().map(|p| p.hash_part()).collect();
        if disk.lookup(id, &hashes).is_ok_and(|known| known.len() == hashes.len()) {
            return;
        }
    }
    match cache.batch_closure(roots).await {
        Ok(Some(lines)) => sub.prefetched.receive(lines),
        Ok(None) => {}
        Err(e) => tracing::warn!("{e}; asking for each narinfo instead"),
    }
}

/// What a cache not yet known is asked at once, so that a cold closure query spends one round
/// trip on them together: its `nix-cache-info`, the narinfos of `roots`, and (of an HTTP
/// cache) the closure of `prefetch` from the batch endpoint, unasked for
/// ([`BinaryCache::batch_closure_unasked`]). The closure's answer is waited for (until its
/// headers are in: its lines are read as they arrive), and returned, only if `nix-cache-info`
/// offers the batch; otherwise it is dropped, in flight or not.
#[allow(clippy::type_complexity)]
async fn fetch_cold(
    cache: &BinaryCache,
    roots: &[StorePath],
    prefetch: &[StorePath],
) -> (Result<Option<CacheInfo>, CacheError>, Vec<Result<Option<String>, CacheError>>, Option<BatchLines>) {
    use futures::future::{select, Either};
    let opened = std::pin::pin!(futures::future::join(cache.fetch_cache_info(), join_all(roots.iter().map(|p| cache.narinfo_text(p)))));
    let mut closure = std::pin::pin!(async {
        match prefetch {
            [] => None,
            _ => cache.batch_closure_unasked(prefetch).await,
        }
    });
    let ((info, answers), early) = match select(opened, closure.as_mut()).await {
        Either::Left((opened, _)) => (opened, None),
        Either::Right((early, opened)) => (opened.await, Some(early)),
    };
    let offered = matches!(&info, Ok(Some(i)) if i.batch);
    let closure = match early {
        Some(early) => early,
        None if offered => closure.await,
        None => None,
    };
    (info, answers, closure.filter(|_| offered))
}

/// `urls` less those naming the local store whose state directory (its database) is
/// `state_dir`, each left out with a debug line: a store has nothing to substitute into
/// itself, as Nix's substitution goal finds (`PathSubstitutionGoal::init`,
/// `src/libstore/build/substitution-goal.cc`: a path valid in the store is not substituted, and
/// one not valid is not in that substituter either). Opening such a substituter would only
/// ask the store's own database, beside the open store, what it lacks.
pub fn other_than(urls: &[String], state_dir: &std::path::Path) -> Vec<String> {
    let real = |dir: &std::path::Path| std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let own = real(state_dir);
    let is_own = |url: &String| {
        let parsed = StoreUrl::parse(url).ok();
        let same = parsed.as_ref().and_then(|p| p.as_local()).is_some_and(|local| real(&local.dirs.state) == own);
        if same {
            tracing::debug!("substituter {url} left out: it is the store itself (state directory {})", own.display());
        }
        !same
    };
    urls.iter().filter(|url| is_own(url)).cloned().collect()
}

/// Opens `urls` as substituters, sorted by priority. Returns the usable ones and one error per
/// cache left out.
pub async fn open(
    urls: &[String],
    settings: &Settings,
    client: &LazyClient,
    disk: Option<&NarInfoCache>,
) -> (Vec<Substituter>, Vec<SubstituterError>) {
    open_prefetching(urls, settings, client, disk, &[]).await
}

/// Like [`open`], and asks each cache whose `nix-cache-info` is not in the disk cache for the
/// narinfos of `prefetch` (at most [`MAX_PREFETCH`]) at the same time, so that a cold closure
/// query does not spend a round trip on `nix-cache-info` alone.
pub async fn open_prefetching(
    urls: &[String],
    settings: &Settings,
    client: &LazyClient,
    disk: Option<&NarInfoCache>,
    prefetch: &[StorePath],
) -> (Vec<Substituter>, Vec<SubstituterError>) {
    let results = join_all(urls.iter().map(|u| open_one(u, settings, client, disk, prefetch))).await;
    let (mut subs, mut errors) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(s) => subs.push(s),
            Err(e) => errors.push(e),
        }
    }
    (ClosureQuery::sort_substituters(subs), errors)
}

/// Opens the disk cache at its default place with the settings' TTLs, its answers kept per
/// `trusted-public-keys` set; `None` (with a
/// warning) when it cannot be opened, in which case every query goes to the network.
pub fn open_disk_cache(settings: &Settings) -> Option<Arc<NarInfoCache>> {
    let path = NarInfoCache::default_path()?;
    match NarInfoCache::open(&path, settings.narinfo_cache_positive_ttl, settings.narinfo_cache_negative_ttl) {
        Ok(c) => Some(Arc::new(c.for_trusted_keys(&settings.trusted_public_keys))),
        Err(e) => {
            tracing::warn!("{e}; continuing without it");
            None
        }
    }
}
