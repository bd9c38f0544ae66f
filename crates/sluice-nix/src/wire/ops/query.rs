//! Query requests (Nix `daemon.cc`: `wopIsValidPath`, `wopQueryPathInfo`, `wopQueryValidPaths`,
//! …; `remote-store.cc` for the client's side).

use std::collections::BTreeSet;
use std::io::{self, Read, Write};

use super::super::primitives::read_count;
use super::super::types::MAX_LIST;
use super::super::{
    read_bool, read_store_path, read_store_path_set, read_string, write_bool, write_bytes, write_store_path, write_store_path_set,
    write_u64,
};
use super::{empty_requests, path_requests, path_set_requests, Op, Request};
use crate::store_path::{StoreDir, StorePath};
use crate::wire::{ProtocolVersion, WireError};

path_requests! {
    /// IsValidPath: a path → whether it is valid.
    IsValidPath, "path";
    /// QueryReferrers: a path → the valid paths referring to it.
    QueryReferrers, "path";
    /// QueryPathInfo: a path → whether it is valid, then its unkeyed info.
    QueryPathInfo, "path";
    /// QueryValidDerivers: a path → the derivations known to produce it.
    QueryValidDerivers, "path";
    /// QueryDerivationOutputMap: a derivation path → its output names and paths.
    QueryDerivationOutputMap, "derivation path";
    /// NarFromPath: a valid path → after `LAST`, its NAR, bare.
    NarFromPath, "path";
}

empty_requests! {
    /// QueryAllValidPaths: no arguments → every valid path.
    QueryAllValidPaths = QueryAllValidPaths;
}

path_set_requests! {
    /// QuerySubstitutablePaths: paths → those a substituter has.
    QuerySubstitutablePaths;
    /// QueryPathInfos (op 50, feature `queryPathInfos`; DeterminateSystems' `daemon.cc`): a
    /// path set → the count of valid paths, then each one's keyed info (its path, then the
    /// fields of QueryPathInfo's answer); a path not answered is not valid. Sent only once
    /// negotiated.
    QueryPathInfos;
    /// QueryClosureInfos (sluice's own, feature `sluice-query-closure`): a path set → the
    /// count of paths, then each one's keyed info (as QueryPathInfos answers), for every valid
    /// path of the closure under references of the valid ones of the set; a path not answered
    /// is not valid. Sent only once negotiated.
    QueryClosureInfos;
}

/// QueryValidPaths: paths and (≥ 1.27) whether to substitute those missing → the valid ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryValidPaths {
    pub paths: BTreeSet<StorePath>,
    /// Always false before 1.27, which cannot send it.
    pub substitute: bool,
}

impl Request for QueryValidPaths {
    const OP: Op = Op::QueryValidPaths;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let paths = read_store_path_set(r, dir, "paths")?;
        let substitute = version.at_least(27) && read_bool(r, "substitute flag")?;
        Ok(QueryValidPaths { paths, substitute })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        write_store_path_set(w, dir, self.paths.iter())?;
        if version.at_least(27) {
            write_bool(w, self.substitute)?;
        }
        Ok(())
    }
}

/// QueryPathFromHashPart: a store path's hash part (at most 64 bytes read) → the valid path
/// with it, or the empty string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryPathFromHashPart {
    pub hash_part: String,
}

impl Request for QueryPathFromHashPart {
    const OP: Op = Op::QueryPathFromHashPart;

    fn read(r: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        Ok(QueryPathFromHashPart { hash_part: read_string(r, 64, "hash part")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bytes(w, self.hash_part.as_bytes())
    }
}

/// QuerySubstitutablePathInfos: from 1.22 a map path → content address (a string, at most
/// 4096 bytes, kept as sent), before a path set (each with an empty content address here) →
/// the substitutable infos. Paths keep the order and repetitions they were sent in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuerySubstitutablePathInfos {
    pub paths: Vec<(StorePath, String)>,
}

impl Request for QuerySubstitutablePathInfos {
    const OP: Op = Op::QuerySubstitutablePathInfos;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        if !version.at_least(22) {
            return Ok(QuerySubstitutablePathInfos {
                paths: read_store_path_set(r, dir, "paths")?.into_iter().map(|p| (p, String::new())).collect(),
            });
        }
        let n = read_count(r, MAX_LIST, "path count")?;
        let mut paths = Vec::with_capacity(n.min(1024) as usize);
        for _ in 0..n {
            let path = read_store_path(r, dir, "path")?;
            paths.push((path, read_string(r, 4096, "content address")?));
        }
        Ok(QuerySubstitutablePathInfos { paths })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        if !version.at_least(22) {
            let set: BTreeSet<&StorePath> = self.paths.iter().map(|(p, _)| p).collect();
            return write_store_path_set(w, dir, set.into_iter());
        }
        write_u64(w, self.paths.len() as u64)?;
        for (path, ca) in &self.paths {
            write_store_path(w, dir, path)?;
            write_bytes(w, ca.as_bytes())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, sp, words, VERSIONS};
    use super::*;

    #[test]
    fn round_trips() {
        for minor in VERSIONS {
            let bytes = round_trip(&IsValidPath { path: sp("a") }, minor);
            // The op, then the path as a string: its length and 8-byte-padded bytes.
            assert_eq!(words(&bytes)[..2], [1, "/nix/store/g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-a".len() as u64]);
            round_trip(&QueryReferrers { path: sp("a") }, minor);
            round_trip(&QueryPathInfo { path: sp("a") }, minor);
            round_trip(&QueryValidDerivers { path: sp("a") }, minor);
            round_trip(&QueryDerivationOutputMap { path: sp("a.drv") }, minor);
            round_trip(&NarFromPath { path: sp("a") }, minor);
            assert_eq!(round_trip(&QueryAllValidPaths, minor), 23u64.to_le_bytes());
            let paths: BTreeSet<_> = [sp("a"), sp("b")].into();
            let valid = QueryValidPaths { paths: paths.clone(), substitute: minor >= 27 };
            let bytes = round_trip(&valid, minor);
            // The flag is a last word only from 1.27.
            assert_eq!(*words(&bytes).last().unwrap() == 1, minor >= 27, "1.{minor}");
            round_trip(&QueryPathFromHashPart { hash_part: "g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q".into() }, minor);
            let bytes = round_trip(&QueryPathInfos { paths: paths.clone() }, minor);
            // The op, then the set: its count and the paths, sorted.
            assert_eq!(words(&bytes)[..3], [50, 2, "/nix/store/g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-a".len() as u64]);
            let bytes = round_trip(&QueryClosureInfos { paths: paths.clone() }, minor);
            assert_eq!(words(&bytes)[..2], [0x736c_0001, 2]);
            round_trip(&QuerySubstitutablePaths { paths }, minor);
            let cas = if minor >= 22 { ["fixed:r:sha256:1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s", ""] } else { [""; 2] };
            // Before 1.22 the paths are a set: sorted, as they are read back.
            let order = if minor >= 22 { [sp("b"), sp("a")] } else { [sp("a"), sp("b")] };
            let [p0, p1] = order;
            round_trip(&QuerySubstitutablePathInfos { paths: vec![(p0, cas[0].into()), (p1, cas[1].into())] }, minor);
        }
    }

    #[test]
    fn substitute_flag_is_not_read_before_1_27() {
        let dir = StoreDir::default();
        let mut bytes = Vec::new();
        QueryValidPaths { paths: BTreeSet::new(), substitute: true }.write(&mut bytes, &dir, ProtocolVersion::new(1, 27)).unwrap();
        let mut r = bytes.as_slice();
        let old = QueryValidPaths::read(&mut r, &dir, ProtocolVersion::new(1, 26)).unwrap();
        assert!(!old.substitute);
        assert_eq!(r.len(), 8, "the 1.27 flag is left for the next request");
    }
}
