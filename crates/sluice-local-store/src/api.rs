//! [`LocalStore`] operations a daemon needs beyond adding and querying paths: where the store
//! lives, temporary GC roots, signatures, derivation outputs, the hash-part lookup, and
//! content-addressed additions that return the path's info whether or not it was valid.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_nix::store_path::{StoreDir, StorePath};

use super::temp_roots::{self, TempRoots};
use super::SignaturePolicy;
use super::{LocalStore, LocalStoreError};
use sluice_nix::path_info::ValidPathInfo;

impl LocalStore {
    /// The logical store directory (`/nix/store`).
    pub fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    /// Where `path` lives on disk (`<root>/nix/store/<base name>`).
    pub fn real_path(&self, path: &StorePath) -> PathBuf {
        self.layout.real_store_dir.join(path.base_name())
    }

    /// The state directory: `state=`, by default `<root>/nix/var/nix` (GC roots, temporary
    /// roots, profiles, db).
    pub fn state_dir(&self) -> &Path {
        &self.layout.state_dir
    }

    /// The build-log directory: `log=`, by default `<root>/nix/var/log/nix`.
    pub fn log_dir(&self) -> &Path {
        &self.layout.log_dir
    }

    /// A new holder of temporary roots that Nix's garbage collector honours; its file is made
    /// at the first root, and the roots last until its last clone is dropped.
    pub fn temp_roots(&self) -> TempRoots {
        TempRoots::new(&self.layout.state_dir, &self.store_dir)
    }

    /// The temporary roots of every live holder (Nix's and sluice's), each path with the
    /// `{temp:<id>}` labels of its holders.
    pub fn find_temp_roots(&self) -> Result<BTreeMap<StorePath, BTreeSet<String>>, LocalStoreError> {
        temp_roots::find(&self.layout.state_dir, &self.store_dir)
    }

    /// Adds `sigs` to the valid path `path`'s signatures (keeping those it has). Fails with
    /// [`LocalStoreError::NotValid`] if it is not registered.
    pub fn add_signatures(&self, path: &StorePath, sigs: &BTreeSet<String>) -> Result<(), LocalStoreError> {
        self.ensure_writable("add signatures")?;
        self.registry.add_signatures(path, sigs)
    }

    /// The valid derivations registered as producing `path` (Nix's `queryValidDerivers`).
    pub fn query_valid_derivers(&self, path: &StorePath) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        self.registry.valid_derivers(path)
    }

    /// Output name → path of the valid derivation `drv`, from the registry (Nix 2.8's
    /// `queryPartialDerivationOutputMap` without `ca-derivations`). Fails with
    /// [`LocalStoreError::NotValid`] if `drv` is not registered.
    pub fn query_derivation_output_map(&self, drv: &StorePath) -> Result<BTreeMap<String, StorePath>, LocalStoreError> {
        self.registry.derivation_outputs(drv)?.ok_or_else(|| LocalStoreError::NotValid { path: self.store_dir.display_path(drv) })
    }

    /// The valid path whose hash part is `hash_part`, by one index seek (Nix's
    /// `queryPathFromHashPart`); `None` for no such path or a malformed hash part.
    pub fn query_path_from_hash_part(&self, hash_part: &str) -> Result<Option<StorePath>, LocalStoreError> {
        Ok(self.query_path_info_from_hash_part(hash_part)?.map(|info| info.path))
    }

    /// The registration of the valid path whose hash part is `hash_part`, by one statement
    /// (Nix's `queryPathFromHashPart` and `queryPathInfo` at once); `None` for no such path or
    /// a malformed hash part.
    pub fn query_path_info_from_hash_part(&self, hash_part: &str) -> Result<Option<ValidPathInfo>, LocalStoreError> {
        self.registry.path_info_from_hash_part(hash_part)
    }

    /// Adds `info`'s path from the NAR in `nar` under `policy` unless it is valid, and returns
    /// its registration either way (nothing is read from `nar` for a valid path, unless
    /// `repair`: then its tree is replaced from `nar`, which must have the registered NAR hash,
    /// as by [`LocalStore::begin_repair`]; Nix's `addToStore` with `repair`). The path is made
    /// a temporary root in `roots` before its validity is looked at.
    pub fn add_nar_if_missing(
        self: &Arc<Self>,
        info: ValidPathInfo,
        nar: &mut dyn Read,
        policy: &SignaturePolicy,
        roots: &TempRoots,
        repair: bool,
    ) -> Result<ValidPathInfo, LocalStoreError> {
        roots.add(&info.path)?;
        let path = info.path.clone();
        if let Some(existing) = self.query_path_info(&path)? {
            if repair {
                let mut pending = self.begin_repair(&info, roots)?;
                pending.unpack(nar)?;
                pending.commit(policy)?;
            }
            return Ok(existing);
        }
        // `None`: added by another process meanwhile.
        if let Some(mut pending) = self.begin_add(info, roots)? {
            pending.unpack(nar)?;
            pending.commit(policy)?;
        }
        self.query_path_info(&path)?.ok_or_else(|| LocalStoreError::NotValid { path: self.store_dir.display_path(&path) })
    }
}
