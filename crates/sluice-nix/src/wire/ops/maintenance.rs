//! Maintenance requests (Nix `daemon.cc`: `wopCollectGarbage`, `wopVerifyStore`,
//! `wopOptimiseStore`).

use std::collections::BTreeSet;
use std::io::{self, Read, Write};

use super::super::{read_bool, read_store_path_set, read_u64, write_bool, write_store_path_set, write_u64};
use super::{empty_requests, Op, Request};
use crate::store_path::{StoreDir, StorePath};
use crate::wire::{ProtocolVersion, WireError};

empty_requests! {
    /// OptimiseStore: no arguments → 1.
    OptimiseStore = OptimiseStore;
}

/// CollectGarbage: the action (Nix's `GCOptions::GCAction` number, as sent: the handler
/// checks it), the paths to delete, ignoreLiveness, maxFreed (bytes) and three obsolete
/// fields (read and dropped; written as 0) → the paths, the bytes freed and an obsolete 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectGarbage {
    pub action: u64,
    pub paths_to_delete: BTreeSet<StorePath>,
    pub ignore_liveness: bool,
    pub max_freed: u64,
}

impl Request for CollectGarbage {
    const OP: Op = Op::CollectGarbage;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let action = read_u64(r, "GC action")?;
        let paths_to_delete = read_store_path_set(r, dir, "paths to delete")?;
        let ignore_liveness = read_bool(r, "ignoreLiveness flag")?;
        let max_freed = read_u64(r, "maxFreed")?;
        for _ in 0..3 {
            read_u64(r, "obsolete GC field")?;
        }
        Ok(CollectGarbage { action, paths_to_delete, ignore_liveness, max_freed })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_u64(w, self.action)?;
        write_store_path_set(w, dir, self.paths_to_delete.iter())?;
        write_bool(w, self.ignore_liveness)?;
        write_u64(w, self.max_freed)?;
        (0..3).try_for_each(|_| write_u64(w, 0))
    }
}

/// VerifyStore: checkContents, repair → whether errors remain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyStore {
    pub check_contents: bool,
    pub repair: bool,
}

impl Request for VerifyStore {
    const OP: Op = Op::VerifyStore;

    fn read(r: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let check_contents = read_bool(r, "checkContents flag")?;
        Ok(VerifyStore { check_contents, repair: read_bool(r, "repair flag")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bool(w, self.check_contents)?;
        write_bool(w, self.repair)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, sp, words, VERSIONS};
    use super::*;

    #[test]
    fn round_trips() {
        for minor in VERSIONS {
            let gc = CollectGarbage { action: 3, paths_to_delete: [sp("a")].into(), ignore_liveness: false, max_freed: u64::MAX };
            let w = words(&round_trip(&gc, minor));
            // op, action, count, path (length + 6 words), ignoreLiveness, maxFreed, 3 × 0.
            assert_eq!(w.len(), 15);
            assert_eq!((w[0], w[1], w[2]), (20, 3, 1));
            assert_eq!(w[10..], [0, u64::MAX, 0, 0, 0]);
            round_trip(&VerifyStore { check_contents: true, repair: false }, minor);
            round_trip(&OptimiseStore, minor);
        }
    }
}
