//! `memory://`: a store that holds its paths and their NARs in memory, empty when opened and
//! gone when dropped, for tests in one process (Nix 2.26 has none: its `dummy://` refuses
//! additions). An addition is checked as every store's is ([`Store::add_to_store`]): the NAR
//! must parse and have the info's hash and size, and the path appears only once its publish
//! gate opens. It takes only the common parameters, and no authority.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::{Arc, Mutex};

use sluice_nix::hash::Hasher;
use sluice_nix::nar::Discard;
use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};

use super::{scheme_only, StoreConfig, StoreKind};
use crate::config::Settings;
use crate::store::{NarReader, PublishGate, Store, StoreError, StoreFuture};
use crate::store_url::{Query, StoreUrlError};

/// The in-memory store's kind.
pub(super) const KIND: StoreKind = StoreKind {
    name: "memory store",
    forms: "memory://",
    claims: |main| main.starts_with("memory://"),
    params: &[],
    parse,
};

/// The in-memory store's configuration: nothing beyond the common parameters.
#[derive(Debug)]
struct MemoryConfig;

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    scheme_only(url, main, "memory://", q)?;
    Ok(Box::new(MemoryConfig))
}

impl StoreConfig for MemoryConfig {
    fn open<'a>(&'a self, url: &'a str, _settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move { Ok(Arc::new(MemoryStore { url: url.to_string(), store_dir: StoreDir::default(), paths: Mutex::default() }) as Arc<dyn Store>) })
    }
}

/// The valid paths, each with its info and NAR.
type Paths = BTreeMap<StorePath, (ValidPathInfo, Arc<[u8]>)>;

/// A store in memory.
struct MemoryStore {
    url: String,
    store_dir: StoreDir,
    paths: Mutex<Paths>,
}

impl MemoryStore {
    fn paths(&self) -> std::sync::MutexGuard<'_, Paths> {
        self.paths.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the NAR of `info.path` and checks it: it parses, and has the info's hash and size.
    fn read_nar(url: &str, shown: &str, info: &ValidPathInfo, mut nar: NarReader) -> Result<Vec<u8>, StoreError> {
        let mut bytes = Vec::new();
        nar.read_to_end(&mut bytes).map_err(|e| StoreError::Other(format!("{url}: reading the NAR of {shown}: {e}")))?;
        sluice_nix::nar::reader::parse(&bytes[..], &mut Discard).map_err(|e| StoreError::Other(format!("{url}: the NAR of {shown}: {e}")))?;
        let mut hasher = Hasher::new(info.nar_hash.algo());
        hasher.update(&bytes);
        let (size, hash) = (hasher.len(), hasher.finish());
        if hash != info.nar_hash || size != info.nar_size {
            return Err(StoreError::Other(format!(
                "{url}: the NAR of {shown} has hash {} and {size} bytes, its info says {} and {} bytes",
                hash.to_nix32_prefixed(),
                info.nar_hash.to_nix32_prefixed(),
                info.nar_size
            )));
        }
        Ok(bytes)
    }
}

impl Store for MemoryStore {
    fn url(&self) -> &str {
        &self.url
    }

    fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        Box::pin(async move {
            let held = self.paths();
            Ok(paths.iter().map(|p| held.get(p).map(|(info, _)| PathInfo::of(info.clone()))).collect())
        })
    }

    fn query_path_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<StorePath>> {
        Box::pin(async move { Ok(self.paths().keys().find(|p| p.hash_part() == hash_part).cloned()) })
    }

    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        Box::pin(async move {
            let nar = self.paths().get(&info.path).map(|(_, nar)| nar.clone());
            let nar = nar.ok_or_else(|| StoreError::NotValid { url: self.url.clone(), path: self.store_dir.display_path(&info.path) })?;
            Ok(Box::new(std::io::Cursor::new(nar)) as NarReader)
        })
    }

    fn add_to_store<'a>(&'a self, info: ValidPathInfo, nar: NarReader, publish: PublishGate) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let (url, shown, checked) = (self.url.clone(), self.store_dir.display_path(&info.path), info.clone());
            let read = tokio::task::spawn_blocking(move || MemoryStore::read_nar(&url, &shown, &checked, nar)).await;
            let bytes = read.map_err(|e| StoreError::Other(format!("{}: {e}", self.url)))??;
            publish.await?;
            self.paths().insert(info.path.clone(), (info, bytes.into()));
            Ok(())
        })
    }

    fn parallelism(&self) -> usize {
        sluice_compress::cores()
    }
}
