//! The local store: Nix's on-disk layout (`<root>/nix/store`, `<root>/nix/var/nix/db/db.sqlite`
//! with Nix's schema version 10) so that real Nix reads what sluice writes and vice versa.
//! Source of the layout and schema: Nix `src/libstore/local-store.cc`, `schema.sql`.
//!
//! Adding a path: [`LocalStore::begin_add`] takes the per-path lock (`<path>.lock`, flock, as
//! Nix's `PathLocks`), [`PendingPath`] unpacks a NAR into a temporary directory in the store
//! directory while hashing it, [`PendingPath::commit`] checks NarHash and NarSize,
//! canonicalises, renames into place and registers the path in one transaction once all its
//! references are valid.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::store_path::{StoreDir, StorePath};

use crate::path_info::ValidPathInfo;

/// Errors of the local store. Each names the store path or file concerned.
#[derive(Debug, thiserror::Error)]
pub enum LocalStoreError {
    #[error("{0}")]
    Todo(String),
}

/// A local Nix store rooted at `root` (`/` for the system store; a chroot store
/// `local?root=DIR` otherwise). Safe to share between threads.
pub struct LocalStore { /* private */ }

/// What unpacking a NAR produced: the NAR's own hash and size, and for a NAR whose root is a
/// regular file, the hash of that file's contents (for flat and text content addresses).
#[derive(Debug, Clone)]
pub struct Unpacked {
    pub nar_hash: Hash,
    /// Bytes of the NAR.
    pub nar_size: u64,
    pub flat_hash: Option<Hash>,
}

/// A store path being added: holds the per-path lock and a temporary directory inside the
/// store directory. Dropping it without `commit` removes the temporary tree and the lock.
pub struct PendingPath<'a> { store: &'a LocalStore }

impl LocalStore {
    /// Opens (creating the layout, database and `schema` file if missing) the store whose
    /// `nix/store` and `nix/var/nix/db` live under `root`.
    pub fn open(root: &Path) -> Result<Self, LocalStoreError> { todo!() }
    /// The logical store directory (`/nix/store`).
    pub fn store_dir(&self) -> &StoreDir { todo!() }
    /// Where `path` lives on disk (`<root>/nix/store/<base name>`).
    pub fn real_path(&self, path: &StorePath) -> PathBuf { todo!() }
    pub fn query_path_info(&self, path: &StorePath) -> Result<Option<ValidPathInfo>, LocalStoreError> { todo!() }
    pub fn is_valid_path(&self, path: &StorePath) -> Result<bool, LocalStoreError> { todo!() }
    /// The subset of `paths` that is valid, in one query batch.
    pub fn query_valid_paths(&self, paths: &[StorePath]) -> Result<BTreeSet<StorePath>, LocalStoreError> { todo!() }
    /// Writes the NAR serialisation of a valid path (`nix-store --dump`).
    pub fn dump_path(&self, path: &StorePath, out: &mut dyn std::io::Write) -> Result<(), LocalStoreError> { todo!() }
    /// Takes the per-path lock for `path` (blocking while another process holds it). Returns
    /// `None` when the path is already valid (possibly added meanwhile by the holder).
    pub fn begin_add(&self, path: &StorePath) -> Result<Option<PendingPath<'_>>, LocalStoreError> { todo!() }
}

impl PendingPath<'_> {
    /// Unpacks the NAR read from `nar` into the temporary directory, hashing it (sha256) as it
    /// goes; `flat_algo` asks for the hash of a root regular file's contents.
    pub fn unpack(&mut self, nar: &mut dyn std::io::Read, flat_algo: Option<HashAlgo>) -> Result<Unpacked, LocalStoreError> { todo!() }
    /// Checks `info.nar_hash`/`nar_size` against what was unpacked, canonicalises the tree,
    /// renames it to its final path and registers `info` in one transaction. Fails (leaving
    /// nothing at the final path) if a reference other than the path itself is not valid.
    pub fn commit(self, info: &ValidPathInfo) -> Result<(), LocalStoreError> { todo!() }
}
