//! A local store's configuration, as its store URL gives it (parsed by sluice-store's
//! `store_url.rs` and `registry/local.rs`): Nix's `LocalStoreConfig`
//! (`src/libstore/local-store.hh`), its directories (`LocalFSStoreConfig`,
//! `local-fs-store.hh`) and the parameters every store takes (`StoreConfig`, `store-api.hh`).

use std::path::{Path, PathBuf};

pub use sluice_nix::store_params::CommonParams;

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
