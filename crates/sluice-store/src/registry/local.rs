//! The local store: `local`, `local?root=DIR`, or a bare path (the same as `local?root=PATH`,
//! a chroot store: any text with a `/` and no `://`, relative to the working directory unless
//! absolute, as Nix's `isNonUriPath` and `absPath`, `src/libstore/store-reference.cc`); Nix's
//! `LocalStore` (`src/libstore/local-store.cc`).
//!
//! | parameter | Nix source | in sluice |
//! |---|---|---|
//! | `root`, `state`, `log`, `real` | `local-fs-store.hh` | where the store lives ([`LocalFsDirs`](crate::store_url::LocalFsDirs); without `root`, `state` and `log` default to `$NIX_STATE_DIR` and `$NIX_LOG_DIR`: [`crate::env_dirs`]) |
//! | `read-only` | `local-store.hh` | nothing is created or written; adding paths is refused |
//! | `require-sigs` | `local-store.hh` | whether paths copied into the store need a trusted signature (default: the `require-sigs` setting; [`Settings::signature_policy`](crate::config::Settings::signature_policy)) |

use std::sync::Arc;

use super::{StoreConfig, StoreKind};
use crate::config::Settings;
use crate::local_handle::LocalStoreHandle;
use sluice_local_store::LocalStore;
use crate::store::{Store, StoreError, StoreFuture};
use crate::store_url::{canon_path, CommonParams, LocalStoreConfig, ParamType, Query, StoreUrlError, LOCAL_FS};

/// The local store's kind.
pub(super) const KIND: StoreKind = StoreKind {
    name: "local store",
    forms: "local, local?root=DIR, a path",
    claims: |main| main == "local" || (!main.contains("://") && main.contains('/')),
    params: &[LOCAL_FS, &[("require-sigs", ParamType::Bool), ("read-only", ParamType::Bool)]],
    parse,
};

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, mut q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    let root = match main {
        "local" => None,
        _ if main.starts_with('/') => canon_path(main),
        _ => {
            let cwd = std::env::current_dir().map_err(|e| StoreUrlError::NoWorkingDir { url: url.to_owned(), reason: e.to_string() })?;
            canon_path(&cwd.join(main).to_string_lossy())
        }
    };
    let dirs = q.take_dirs(root)?;
    let read_only = q.take_bool("read-only")?.unwrap_or(false);
    let require_sigs = q.take_bool("require-sigs")?;
    Ok(Box::new(LocalStoreConfig { dirs, read_only, require_sigs, common: q.finish()? }))
}

impl StoreConfig for LocalStoreConfig {
    fn open<'a>(&'a self, url: &'a str, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move {
            let store = LocalStore::open(self).map(Arc::new)?;
            settings.configure_local_store(&store);
            let policy = settings.signature_policy(self.require_sigs).map_err(|e| StoreError::Other(e.to_string()))?;
            Ok(Arc::new(LocalStoreHandle::new(url, store, policy)) as Arc<dyn Store>)
        })
    }

    fn as_local(&self) -> Option<&LocalStoreConfig> {
        Some(self)
    }

    /// Usable as a substituter (`substituters = /mnt/store`, Nix's `LocalStore` as a source of
    /// `copyStorePath`), opened on the first path asked of it (`crate::substituter_source`); its
    /// paths carry their own signatures, checked as a cache's are unless `?trusted=true`.
    fn as_substituter(&self) -> Option<&CommonParams> {
        Some(&self.common)
    }
}
