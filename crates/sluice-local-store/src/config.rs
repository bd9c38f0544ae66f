//! A local store's configuration, as its store URL gives it (parsed by sluice-store's
//! `store_url.rs` and `registry/local.rs`): Nix's `LocalStoreConfig`
//! (`src/libstore/local-store.hh`), its directories (`LocalFSStoreConfig`,
//! `local-fs-store.hh`) and the parameters every store takes (`StoreConfig`, `store-api.hh`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Parameters of Nix's `StoreConfig` (`src/libstore/store-api.hh`) that every store takes,
/// and the accepted parameters sluice does not act on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommonParams {
    /// `priority=N`: a substituter's priority (lower is preferred); overrides a cache's
    /// `nix-cache-info`.
    pub priority: Option<i32>,
    /// `want-mass-query=BOOL`: overrides a cache's `nix-cache-info`.
    pub want_mass_query: Option<bool>,
    /// `trusted=BOOL` (default false): paths from this substituter may be used without a
    /// signature by a trusted key (Nix's `isTrusted`).
    pub trusted: bool,
    /// Parameters Nix accepts for this kind of store that sluice does not act on (see
    /// sluice-store's `store_url.rs`), by name, with their values as given.
    pub unused: BTreeMap<String, String>,
}

/// Where a local file-system store keeps its files: Nix's `LocalFSStoreConfig`
/// (`src/libstore/local-fs-store.hh`). Without `root`, the system store's directories (which
/// `NIX_STATE_DIR` and `NIX_LOG_DIR` move: sluice-store's `env_dirs.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFsDirs {
    /// `root=DIR`: the directory the defaults below are under.
    pub root: Option<PathBuf>,
    /// `state=DIR`, default `<root>/nix/var/nix`: the database, GC roots, temporary roots.
    pub state: PathBuf,
    /// `log=DIR`, default `<root>/nix/var/log/nix`: build logs.
    pub log: PathBuf,
    /// `real=DIR`, default `<root>/nix/store`: where the store's paths are on disk.
    pub real: PathBuf,
}

impl LocalFsDirs {
    /// The directories of a store under `root` (`None`: the system store at its compiled-in
    /// place, as Nix's defaults without the environment's).
    pub fn under(root: Option<&Path>) -> Self {
        let base = root.unwrap_or(Path::new("/"));
        LocalFsDirs {
            root: root.map(Path::to_owned),
            state: base.join("nix/var/nix"),
            log: base.join("nix/var/log/nix"),
            real: base.join("nix/store"),
        }
    }
}

/// A local store's configuration: Nix's `LocalStoreConfig` (`src/libstore/local-store.hh`),
/// parsed by the local kind (`registry/local.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalStoreConfig {
    pub dirs: LocalFsDirs,
    /// `read-only=BOOL` (default false): open without creating or writing anything (no lock,
    /// the database opened immutable); adding paths is refused.
    pub read_only: bool,
    /// `require-sigs=BOOL`: whether paths copied into this store need a trusted signature;
    /// `None` leaves it to the `require-sigs` setting.
    pub require_sigs: Option<bool>,
    pub common: CommonParams,
}

impl LocalStoreConfig {
    /// The writable store under `root` (`local?root=ROOT`) with every other parameter at its
    /// default.
    pub fn with_root(root: &Path) -> Self {
        LocalStoreConfig { dirs: LocalFsDirs::under(Some(root)), read_only: false, require_sigs: None, common: CommonParams::default() }
    }
}
