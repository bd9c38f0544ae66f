//! Typed worker-protocol requests: the operation numbers ([`Op`], Nix's `WorkerProto::Op` in
//! `src/libstore/worker-protocol.hh`) and one struct per request, its header as the client
//! sends it after the operation number (Nix `daemon.cc` `performOp` reads them,
//! `remote-store.cc` writes them). Read and write depend on the protocol version. A request's
//! streamed data (a NAR, framed data, a framed log) follows its header and is not part of the
//! struct: the daemon and the client stream it themselves.
//!
//! Reading fails only on what makes the stream unreadable (a [`WireError`]: truncated,
//! oversized, not a store path); checks of the values (trust, a malformed id) are the
//! handler's, made after the whole request is read.

mod add;
mod budget;
mod build;
mod maintenance;
mod options;
mod query;
mod realisation;
mod roots;

use std::io::{self, Read, Write};

use super::{write_u64, ProtocolVersion, WireError};
use crate::store_path::StoreDir;

pub use add::{AddBuildLog, AddMultipleToStore, AddSignatures, AddTextToStore, AddToStore, AddToStoreNar, MAX_NAME, MAX_TEXT};
pub use budget::{read_request, MAX_REQUEST};
pub use build::{BuildDerivation, BuildPaths, BuildPathsWithResults, QueryMissing};
pub use maintenance::{CollectGarbage, OptimiseStore, VerifyStore};
pub use options::{ClientSettings, SetOptions};
pub use query::{
    IsValidPath, NarFromPath, QueryAllValidPaths, QueryClosureInfos, QueryDerivationOutputMap, QueryPathFromHashPart, QueryPathInfo,
    QueryPathInfos, QueryReferrers, QuerySubstitutablePathInfos, QuerySubstitutablePaths, QueryValidDerivers, QueryValidPaths,
};
pub use realisation::{QueryRealisation, RegisterDrvOutput, MAX_DRV_OUTPUT_ID, MAX_REALISATION};
pub use roots::{AddIndirectRoot, AddPermRoot, AddTempRoot, AddTempRoots, EnsurePath, FindRoots, SyncWithGc};

macro_rules! ops {
    ($($(#[$doc:meta])* $name:ident = $n:literal,)*) => {
        /// A worker-protocol operation, with its wire number (`WorkerProto::Op`). Only the
        /// operations some Nix of protocol ≥ 1.21 still sends are listed; the obsolete ones
        /// (HasSubstitutes, QueryPathHash, ExportPath, ImportPaths, …) are unknown numbers.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u64)]
        pub enum Op {
            $($(#[$doc])* $name = $n,)*
        }

        impl Op {
            /// Every operation, in wire order.
            pub const ALL: &'static [Op] = &[$(Op::$name,)*];

            /// The operation numbered `n`; `None` for a number not listed.
            pub fn from_wire(n: u64) -> Option<Op> {
                match n {
                    $($n => Some(Op::$name),)*
                    _ => None,
                }
            }

            /// Nix's name of the operation (`IsValidPath`, …).
            pub fn name(self) -> &'static str {
                match self {
                    $(Op::$name => stringify!($name),)*
                }
            }
        }
    };
}

ops! {
    IsValidPath = 1,
    QueryReferrers = 6,
    AddToStore = 7,
    /// Obsolete since 1.25 (AddToStore takes text), still sent by older clients.
    AddTextToStore = 8,
    BuildPaths = 9,
    EnsurePath = 10,
    AddTempRoot = 11,
    AddIndirectRoot = 12,
    SyncWithGC = 13,
    FindRoots = 14,
    SetOptions = 19,
    CollectGarbage = 20,
    QueryAllValidPaths = 23,
    QueryPathInfo = 26,
    QueryPathFromHashPart = 29,
    QuerySubstitutablePathInfos = 30,
    QueryValidPaths = 31,
    QuerySubstitutablePaths = 32,
    QueryValidDerivers = 33,
    OptimiseStore = 34,
    VerifyStore = 35,
    BuildDerivation = 36,
    AddSignatures = 37,
    NarFromPath = 38,
    AddToStoreNar = 39,
    QueryMissing = 40,
    QueryDerivationOutputMap = 41,
    RegisterDrvOutput = 42,
    QueryRealisation = 43,
    AddMultipleToStore = 44,
    AddBuildLog = 45,
    BuildPathsWithResults = 46,
    AddPermRoot = 47,
    /// DeterminateSystems' Nix, with the feature `addTempRoots` (49 is reserved for it
    /// upstream).
    AddTempRoots = 49,
    /// DeterminateSystems' Nix, with the feature `queryPathInfos` (50 is reserved for it
    /// upstream).
    QueryPathInfos = 50,
    /// sluice's own, with the feature `sluice-query-closure`: a number far above Nix's
    /// (0x736c is "sl"), which no Nix sends.
    QueryClosureInfos = 0x736c_0001,
}

impl Op {
    /// The wire number.
    pub fn to_wire(self) -> u64 {
        self as u64
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A request header: what follows the operation number [`Request::OP`] on the wire.
pub trait Request: Sized {
    /// The operation this is the request of.
    const OP: Op;

    /// The most bytes the header may take on the wire ([`read_request`] enforces it).
    const MAX_BYTES: u64 = MAX_REQUEST;

    /// Reads the header (after the operation number) as a client of protocol `version` sends
    /// it, store paths in `dir`; a [`WireError`] names the field that could not be read. Its
    /// byte budget is [`read_request`]'s to enforce.
    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError>;

    /// Writes the header (without the operation number) for protocol `version`; an
    /// `InvalidInput` error if that version cannot express it.
    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()>;
}

/// Writes the operation number of `req`, then its header (nothing is flushed).
pub fn write_request<R: Request>(w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion, req: &R) -> io::Result<()> {
    write_u64(w, R::OP.to_wire())?;
    req.write(w, dir, version)
}

/// Defines requests whose header is one store path, `path`.
macro_rules! path_requests {
    ($($(#[$doc:meta])* $name:ident, $what:literal;)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, PartialEq, Eq)]
            pub struct $name {
                pub path: crate::store_path::StorePath,
            }

            impl super::Request for $name {
                const OP: super::Op = super::Op::$name;

                fn read(r: &mut dyn std::io::Read, dir: &crate::store_path::StoreDir, _: super::super::ProtocolVersion) -> Result<Self, super::super::WireError> {
                    Ok($name { path: super::super::read_store_path(r, dir, $what)? })
                }

                fn write(&self, w: &mut dyn std::io::Write, dir: &crate::store_path::StoreDir, _: super::super::ProtocolVersion) -> std::io::Result<()> {
                    super::super::write_store_path(w, dir, &self.path)
                }
            }
        )*
    };
}

/// Defines requests whose header is one store path set, `paths`.
macro_rules! path_set_requests {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, PartialEq, Eq)]
            pub struct $name {
                pub paths: std::collections::BTreeSet<crate::store_path::StorePath>,
            }

            impl super::Request for $name {
                const OP: super::Op = super::Op::$name;

                fn read(r: &mut dyn std::io::Read, dir: &crate::store_path::StoreDir, _: super::super::ProtocolVersion) -> Result<Self, super::super::WireError> {
                    Ok($name { paths: super::super::read_store_path_set(r, dir, "paths")? })
                }

                fn write(&self, w: &mut dyn std::io::Write, dir: &crate::store_path::StoreDir, _: super::super::ProtocolVersion) -> std::io::Result<()> {
                    super::super::write_store_path_set(w, dir, self.paths.iter())
                }
            }
        )*
    };
}

/// Defines requests with no header.
macro_rules! empty_requests {
    ($($(#[$doc:meta])* $name:ident = $op:ident;)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
            pub struct $name;

            impl super::Request for $name {
                const OP: super::Op = super::Op::$op;

                fn read(_: &mut dyn std::io::Read, _: &crate::store_path::StoreDir, _: super::super::ProtocolVersion) -> Result<Self, super::super::WireError> {
                    Ok($name)
                }

                fn write(&self, _: &mut dyn std::io::Write, _: &crate::store_path::StoreDir, _: super::super::ProtocolVersion) -> std::io::Result<()> {
                    Ok(())
                }
            }
        )*
    };
}

pub(crate) use {empty_requests, path_requests, path_set_requests};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store_path::StorePath;

    /// Versions every request is round-tripped at: the oldest accepted, the boundaries where
    /// request headers change (1.25 AddToStore, 1.27 QueryValidPaths, 1.30 derived paths, 1.31
    /// realisations), Nix 2.8's and the newest.
    pub(crate) const VERSIONS: [u8; 8] = [21, 22, 24, 25, 27, 30, 31, 38];

    pub(crate) fn v(minor: u8) -> ProtocolVersion {
        ProtocolVersion::new(1, minor)
    }

    pub(crate) fn sp(name: &str) -> StorePath {
        StorePath::from_base_name(&format!("g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-{name}")).unwrap()
    }

    /// Writes `req` with its operation number at `minor`, checks the number, reads it back,
    /// checks that every byte was read and returns it with the bytes.
    pub(crate) fn round_trip<R: Request + std::fmt::Debug + PartialEq>(req: &R, minor: u8) -> Vec<u8> {
        let dir = StoreDir::default();
        let mut bytes = Vec::new();
        write_request(&mut bytes, &dir, v(minor), req).unwrap();
        let mut r = bytes.as_slice();
        assert_eq!(crate::wire::read_u64(&mut r, "op").unwrap(), R::OP.to_wire());
        let back = R::read(&mut r, &dir, v(minor)).unwrap_or_else(|e| panic!("{:?} at 1.{minor}: {e}", R::OP));
        assert_eq!(&back, req, "at 1.{minor}");
        assert!(r.is_empty(), "{:?} at 1.{minor}: {} bytes left", R::OP, r.len());
        bytes
    }

    /// The u64 words of `bytes`.
    pub(crate) fn words(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn op_numbers_are_nixs() {
        // Spot checks against worker-protocol.hh, and every number maps back to its op.
        assert_eq!(Op::IsValidPath.to_wire(), 1);
        assert_eq!(Op::SetOptions.to_wire(), 19);
        assert_eq!(Op::QueryPathInfo.to_wire(), 26);
        assert_eq!(Op::AddMultipleToStore.to_wire(), 44);
        assert_eq!(Op::AddPermRoot.to_wire(), 47);
        // DeterminateSystems' nix-src, worker-protocol.hh.
        assert_eq!(Op::AddTempRoots.to_wire(), 49);
        assert_eq!(Op::QueryPathInfos.to_wire(), 50);
        assert_eq!(Op::QueryClosureInfos.to_wire(), 0x736c_0001);
        assert_eq!(Op::ALL.len(), 36);
        for op in Op::ALL {
            assert_eq!(Op::from_wire(op.to_wire()), Some(*op));
        }
        for unknown in [0, 2, 3, 4, 5, 15, 16, 17, 18, 21, 22, 24, 25, 27, 28, 48, 51, u64::MAX] {
            assert_eq!(Op::from_wire(unknown), None, "{unknown}");
        }
        assert_eq!(Op::SyncWithGC.to_string(), "SyncWithGC");
    }

    #[test]
    fn a_truncated_request_names_its_field() {
        let dir = StoreDir::default();
        let mut bytes = Vec::new();
        write_request(&mut bytes, &dir, v(34), &AddPermRoot { path: sp("a"), root: "/tmp/r".into() }).unwrap();
        let cut = &bytes[8..bytes.len() - 8];
        let err = AddPermRoot::read(&mut &cut[..], &dir, v(34)).unwrap_err();
        assert!(err.to_string().contains("root path"), "{err}");
    }
}
