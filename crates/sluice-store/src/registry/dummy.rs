//! `dummy://`: an empty store that refuses additions, Nix 2.26's `DummyStore`
//! (`src/libstore/dummy-store.cc`): every path is invalid, and looking a path up by its hash
//! part, reading a NAR or adding a path fail with Nix's message. It takes only the common
//! parameters, and no authority (`dummy://x` is refused, as Nix's `DummyStoreConfig` does).

use std::sync::Arc;

use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};

use super::{scheme_only, StoreConfig, StoreKind};
use crate::config::Settings;
use crate::store::{NarReader, PublishGate, Store, StoreError, StoreFuture};
use crate::store_url::{Query, StoreUrlError};

/// The dummy store's kind.
pub(super) const KIND: StoreKind = StoreKind {
    name: "dummy store",
    forms: "dummy://",
    claims: |main| main.starts_with("dummy://"),
    params: &[],
    parse,
};

/// The dummy store's configuration: nothing beyond the common parameters.
#[derive(Debug)]
struct DummyConfig;

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    scheme_only(url, main, "dummy://", q)?;
    Ok(Box::new(DummyConfig))
}

impl StoreConfig for DummyConfig {
    fn open<'a>(&'a self, _url: &'a str, _settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move { Ok(Arc::new(DummyStore { store_dir: StoreDir::default() }) as Arc<dyn Store>) })
    }
}

/// The empty store.
struct DummyStore {
    store_dir: StoreDir,
}

/// Nix's `Store::unsupported`: the operation `op` of store `dummy`.
fn unsupported(op: &str) -> StoreError {
    StoreError::Other(format!("operation '{op}' is not supported by store 'dummy'"))
}

impl Store for DummyStore {
    /// `dummy`, as Nix's `DummyStore::getUri`.
    fn url(&self) -> &str {
        "dummy"
    }

    fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        Box::pin(async move { Ok(vec![None; paths.len()]) })
    }

    fn query_path_from_hash_part<'a>(&'a self, _hash_part: &'a str) -> StoreFuture<'a, Option<StorePath>> {
        Box::pin(async move { Err(unsupported("queryPathFromHashPart")) })
    }

    fn nar_from_path<'a>(&'a self, _info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        Box::pin(async move { Err(unsupported("narFromPath")) })
    }

    fn add_to_store<'a>(&'a self, _info: ValidPathInfo, _nar: NarReader, _publish: PublishGate) -> StoreFuture<'a, ()> {
        Box::pin(async move { Err(unsupported("addToStore")) })
    }

    fn parallelism(&self) -> usize {
        1
    }
}
