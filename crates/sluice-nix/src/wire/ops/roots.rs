//! GC-root and temporary-root requests (Nix `daemon.cc`: `wopAddTempRoot`, `wopEnsurePath`,
//! `wopAddIndirectRoot`, `wopAddPermRoot`, `wopSyncWithGC`, `wopFindRoots`).

use std::io::{self, Read, Write};

use super::super::{read_store_path, read_string, write_bytes, write_store_path};
use super::{empty_requests, path_requests, path_set_requests, Op, Request};
use crate::store_path::{StoreDir, StorePath};
use crate::wire::{ProtocolVersion, WireError};

/// Longest GC root path accepted, in bytes (`PATH_MAX`).
const MAX_ROOT: u64 = 4096;

path_requests! {
    /// AddTempRoot: a path to keep alive for the connection → 1.
    AddTempRoot, "path";
    /// EnsurePath: a path to make valid (by substitution) → 1.
    EnsurePath, "path";
}

path_set_requests! {
    /// AddTempRoots (op 49, feature `addTempRoots`; DeterminateSystems' `daemon.cc`): a path
    /// set to keep alive for the connection → 1. Sent only once negotiated.
    AddTempRoots;
}

empty_requests! {
    /// SyncWithGC: no arguments → 1 (obsolete in Nix, a no-op).
    SyncWithGc = SyncWithGC;
    /// FindRoots: no arguments → the GC roots (link → store path).
    FindRoots = FindRoots;
}

/// AddIndirectRoot: the absolute path of a symlink to register as a root → 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddIndirectRoot {
    pub link: String,
}

impl Request for AddIndirectRoot {
    const OP: Op = Op::AddIndirectRoot;

    fn read(r: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        Ok(AddIndirectRoot { link: read_string(r, MAX_ROOT, "root path")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bytes(w, self.link.as_bytes())
    }
}

/// AddPermRoot (≥ 1.36): a store path and the absolute path of the root to make for it →
/// the root's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddPermRoot {
    pub path: StorePath,
    pub root: String,
}

impl Request for AddPermRoot {
    const OP: Op = Op::AddPermRoot;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let path = read_store_path(r, dir, "store path")?;
        Ok(AddPermRoot { path, root: read_string(r, MAX_ROOT, "root path")? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_store_path(w, dir, &self.path)?;
        write_bytes(w, self.root.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, sp, VERSIONS};
    use super::*;

    #[test]
    fn round_trips() {
        for minor in VERSIONS {
            round_trip(&AddTempRoot { path: sp("a") }, minor);
            let bytes = round_trip(&AddTempRoots { paths: [sp("b"), sp("a")].into() }, minor);
            assert_eq!(bytes[..16], [49u64.to_le_bytes(), 2u64.to_le_bytes()].concat());
            round_trip(&EnsurePath { path: sp("a") }, minor);
            assert_eq!(round_trip(&SyncWithGc, minor), 13u64.to_le_bytes());
            round_trip(&FindRoots, minor);
            round_trip(&AddIndirectRoot { link: "/home/u/result".into() }, minor);
            round_trip(&AddPermRoot { path: sp("a"), root: "/home/u/result".into() }, minor);
        }
    }
}
