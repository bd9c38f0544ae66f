//! The hashes modulo of the derivations in the store, memoised for the store's lifetime (Nix's
//! `drvHashes` and `pathDerivationModulo` in `src/libstore/derivations.cc`): checking a
//! derivation's outputs ([`verify::verify_derivation`](super::verify::verify_derivation))
//! needs the hash of every derivation below it, and a closure shares most of them.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::sync::Mutex;

use rustix::fs::{openat, Mode, OFlags};
use sluice_nix::derivation::{drv_name, Derivation, DerivationError, DrvHashes};
use sluice_nix::store_path::StorePath;

use super::LocalStore;

/// Derivation path → its hash modulo. A derivation's contents never change once it is
/// valid, so entries never go stale.
#[derive(Default)]
pub(super) struct DrvHashMemo(Mutex<HashMap<StorePath, DrvHashes>>);

impl LocalStore {
    /// The hash modulo (outputs not masked) of the derivation `drv`, read from the store
    /// directory: the caller makes sure it is valid or placed by the batch being committed
    /// (the input hashes of [`Derivation::hash_modulo`]). Errors name the derivation.
    pub fn drv_hashes(&self, drv: &StorePath) -> Result<DrvHashes, DerivationError> {
        if let Some(h) = self.drv_hashes.0.lock().unwrap_or_else(|p| p.into_inner()).get(drv) {
            return Ok(h.clone());
        }
        let shown = self.store_dir.display_path(drv);
        let mut aterm = Vec::new();
        openat(&self.store_fd, drv.base_name(), OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
            .map_err(std::io::Error::from)
            .and_then(|fd| File::from(fd).read_to_end(&mut aterm))
            .map_err(|e| DerivationError(format!("reading the input derivation '{shown}': {e}")))?;
        let parsed = Derivation::parse(&self.store_dir, drv_name(drv), &aterm)
            .map_err(|e| DerivationError(format!("error parsing derivation '{shown}': {e}")))?;
        let hashes = parsed.hash_modulo(&self.store_dir, false, &mut |input| self.drv_hashes(input))?;
        self.drv_hashes.0.lock().unwrap_or_else(|p| p.into_inner()).insert(drv.clone(), hashes.clone());
        Ok(hashes)
    }
}
