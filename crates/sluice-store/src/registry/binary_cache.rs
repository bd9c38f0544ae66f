//! Binary caches over a file system or HTTP: `file:///DIR`, `http://…`, `https://…`; Nix's
//! `LocalBinaryCacheStore` and `HttpBinaryCacheStore` (`local-binary-cache-store.cc`,
//! `http-binary-cache-store.cc`, which add no parameters of their own), written to as
//! [`crate::binary_cache`] says.
//!
//! | parameter | Nix source | in sluice |
//! |---|---|---|
//! | `compression`, `compression-level`, `parallel-compression`, `write-nar-listing`, `secret-key`, `secret-keys` | `binary-cache-store.hh` | how sluice writes to the cache ([`CacheWriteParams`]); `secret-keys` (Nix 2.35) is a comma-separated list of key files |
//! | `index-debug-info`, `local-nar-cache` | `binary-cache-store.hh` | accepted, no effect (sluice writes no debug-info index and keeps no NAR cache) |

use std::path::PathBuf;
use std::sync::Arc;

use super::{StoreConfig, StoreKind};
use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::BinaryCache;
use crate::config::Settings;
use crate::store::{Store, StoreFuture};
use crate::store_url::{CacheKind, CacheUrl, CacheWriteParams, Param, ParamType, Query, StoreUrlError, DEFAULT_COMPRESSION};

/// The kind of the file and HTTP binary caches.
pub(super) const KIND: StoreKind = StoreKind {
    name: "binary cache",
    forms: "file://, http://, https://",
    claims: |main| ["file://", "http://", "https://"].iter().any(|scheme| main.starts_with(scheme)),
    params: &[CACHE],
    parse,
};

/// The parameters of Nix's `BinaryCacheStoreConfig` (`binary-cache-store.hh`), which every
/// binary cache takes.
pub(super) const CACHE: &[Param] = &[
    ("compression", ParamType::Text),
    ("write-nar-listing", ParamType::Bool),
    ("index-debug-info", ParamType::Bool),
    ("secret-key", ParamType::Text),
    ("local-nar-cache", ParamType::Text),
    ("parallel-compression", ParamType::Bool),
    ("compression-level", ParamType::Int),
    ("secret-keys", ParamType::Text),
];

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    let kind = match main.strip_prefix("file://") {
        Some(dir) if !dir.starts_with('/') => return Err(StoreUrlError::Unsupported(url.to_string())),
        Some(_) => CacheKind::File,
        None => CacheKind::Http,
    };
    cache_url(main, kind, q)
}

/// The cache `main` of transport `kind`, with the parameters of writing to it and the common
/// ones from `q`.
pub(super) fn cache_url(main: &str, kind: CacheKind, mut q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    let write = take_write(&mut q)?;
    Ok(Box::new(CacheUrl { base: main.trim_end_matches('/').to_string(), kind, common: q.finish_cache()?, write }))
}

/// The parameters of writing to a binary cache ([`CacheWriteParams`]).
fn take_write(q: &mut Query<'_>) -> Result<CacheWriteParams, StoreUrlError> {
    let compression = match q.take("compression") {
        Some(v) => sluice_compress::Compression::parse(&v).map_err(|_| q.bad("compression", &v, "not one of xz, zstd, br, gzip, bzip2, none"))?,
        None => DEFAULT_COMPRESSION,
    };
    let compression_level = match q.take("compression-level") {
        Some(v) => match i32::try_from(q.int("compression-level", &v)?) {
            Ok(-1) => None,
            Ok(n) => Some(n),
            Err(_) => return Err(q.bad("compression-level", &v, "out of range")),
        },
        None => None,
    };
    // A key file is a plain string setting in Nix (`secretKeyFile`), read with `readFile`: a
    // relative path is the working directory's.
    let secret_key_files = ["secret-key", "secret-keys"]
        .into_iter()
        .flat_map(|name| q.take(name))
        .flat_map(|v| v.split(',').filter(|f| !f.is_empty()).map(PathBuf::from).collect::<Vec<_>>())
        .collect();
    Ok(CacheWriteParams {
        compression,
        compression_level,
        parallel_compression: q.take_bool("parallel-compression")?.unwrap_or(false),
        write_nar_listing: q.take_bool("write-nar-listing")?.unwrap_or(false),
        secret_key_files,
    })
}

impl StoreConfig for CacheUrl {
    /// A binary cache, written to with the URL's compression and keys, its `nix-cache-info`
    /// created when missing once something is added.
    fn open<'a>(&'a self, _url: &'a str, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move { Ok(Arc::new(BinaryCache::open(self, &LazyClient::new(settings.http_options())).await?) as Arc<dyn Store>) })
    }

    fn as_cache(&self) -> Option<&CacheUrl> {
        Some(self)
    }
}
