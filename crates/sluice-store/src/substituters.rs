//! Opening the configured substituters: each cache's `nix-cache-info` from the disk cache when
//! fresh, otherwise fetched (all caches at once) and recorded; caches for another store
//! directory or that cannot be reached are left out with a warning, as Nix does.

use std::sync::Arc;

use futures::future::join_all;
use sluice_nix::store_path::StoreDir;

use crate::binary_cache::{BinaryCache, CacheError};
use crate::closure::{ClosureQuery, Substituter};
use crate::config::Settings;
use crate::narinfo_cache::NarInfoCache;
use crate::store_url::{CacheUrl, StoreUrl};

/// Why a substituter URL was not used.
#[derive(Debug, thiserror::Error)]
pub enum SubstituterError {
    #[error("{url}: not a binary cache URL")]
    NotACache { url: String },
    #[error(transparent)]
    Url(#[from] crate::store_url::StoreUrlError),
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Parses a substituter URL, which must name a binary cache.
pub fn cache_url(url: &str) -> Result<CacheUrl, SubstituterError> {
    match StoreUrl::parse(url)? {
        StoreUrl::BinaryCache(c) => Ok(c),
        StoreUrl::Local { .. } => Err(SubstituterError::NotACache { url: url.to_string() }),
    }
}

async fn open_one(url: &str, settings: &Settings, client: &reqwest::Client, disk: Option<&NarInfoCache>, store_dir: &StoreDir) -> Result<Substituter, SubstituterError> {
    let curl = cache_url(url)?;
    let cached = disk.and_then(|d| d.cache_info(&curl.base).map_err(|e| tracing::warn!("{e}")).ok().flatten());
    let (disk_id, info) = match cached {
        Some((id, info)) => (Some(id), info),
        None => {
            let info = BinaryCache::fetch_cache_info(&curl, client, settings).await?;
            let id = disk.and_then(|d| d.record_cache(&curl.base, &info).map_err(|e| tracing::warn!("{e}")).ok());
            (id, info)
        }
    };
    let cache = BinaryCache::new(&curl, client, settings, info);
    cache.check_store_dir(store_dir)?;
    Ok(Substituter { cache, disk_id })
}

/// Opens `urls` as substituters for `store_dir`, sorted by priority. Returns the usable ones
/// and one error per cache left out.
pub async fn open(urls: &[String], settings: &Settings, client: &reqwest::Client, disk: Option<&NarInfoCache>, store_dir: &StoreDir) -> (Vec<Substituter>, Vec<SubstituterError>) {
    let results = join_all(urls.iter().map(|u| open_one(u, settings, client, disk, store_dir))).await;
    let (mut subs, mut errors) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(s) => subs.push(s),
            Err(e) => errors.push(e),
        }
    }
    (ClosureQuery::sort_substituters(subs), errors)
}

/// Opens the disk cache at its default place with the settings' TTLs; `None` (with a
/// warning) when it cannot be opened, in which case every query goes to the network.
pub fn open_disk_cache(settings: &Settings) -> Option<Arc<NarInfoCache>> {
    let path = NarInfoCache::default_path()?;
    match NarInfoCache::open(&path, settings.narinfo_cache_positive_ttl, settings.narinfo_cache_negative_ttl) {
        Ok(c) => Some(Arc::new(c)),
        Err(e) => {
            tracing::warn!("{e}; continuing without it");
            None
        }
    }
}
