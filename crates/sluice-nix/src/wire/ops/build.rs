//! Realisation requests (Nix `daemon.cc`: `wopBuildPaths`, `wopBuildPathsWithResults`,
//! `wopBuildDerivation`, `wopQueryMissing`; `worker-protocol-connection.cc`
//! `putBuildDerivationRequest`).

use std::io::{self, Read, Write};

use super::super::{
    read_basic_derivation, read_derived_paths, read_store_path, write_basic_derivation, write_derived_path, write_store_path, write_u64,
};
use super::{Op, Request};
use crate::store_path::StoreDir;
use crate::store_path::StorePath;
use crate::wire::{BasicDerivation, BuildMode, DerivedPath, ProtocolVersion, WireError};

/// Writes a count and the derived paths.
fn write_targets(w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion, targets: &[DerivedPath]) -> io::Result<()> {
    write_u64(w, targets.len() as u64)?;
    targets.iter().try_for_each(|t| write_derived_path(w, dir, version, t))
}

/// BuildPaths: derived paths and (≥ 1.15) a build mode → 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildPaths {
    pub targets: Vec<DerivedPath>,
    /// Always [`BuildMode::Normal`] before 1.15, which cannot send it.
    pub mode: BuildMode,
}

impl Request for BuildPaths {
    const OP: Op = Op::BuildPaths;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let targets = read_derived_paths(r, dir, version)?;
        let mode = if version.at_least(15) { BuildMode::read(r)? } else { BuildMode::Normal };
        Ok(BuildPaths { targets, mode })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        write_targets(w, dir, version, &self.targets)?;
        if version.at_least(15) {
            self.mode.write(w)?;
        }
        Ok(())
    }
}

/// BuildPathsWithResults (≥ 1.34): derived paths and a build mode → a keyed build result each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildPathsWithResults {
    pub targets: Vec<DerivedPath>,
    pub mode: BuildMode,
}

impl Request for BuildPathsWithResults {
    const OP: Op = Op::BuildPathsWithResults;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let targets = read_derived_paths(r, dir, version)?;
        Ok(BuildPathsWithResults { targets, mode: BuildMode::read(r)? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        write_targets(w, dir, version, &self.targets)?;
        self.mode.write(w)
    }
}

/// BuildDerivation: the derivation's path, the derivation in its basic wire form (named by
/// the path without `.drv`) and a build mode → a build result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildDerivation {
    pub drv_path: StorePath,
    pub drv: BasicDerivation,
    pub mode: BuildMode,
}

impl Request for BuildDerivation {
    const OP: Op = Op::BuildDerivation;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let drv_path = read_store_path(r, dir, "derivation path")?;
        let drv = read_basic_derivation(r, dir)?;
        Ok(BuildDerivation { drv_path, drv, mode: BuildMode::read(r)? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        let name = self.drv_path.name().strip_suffix(".drv").unwrap_or(self.drv_path.name());
        write_store_path(w, dir, &self.drv_path)?;
        write_basic_derivation(w, dir, name, &self.drv)?;
        self.mode.write(w)
    }
}

/// QueryMissing: derived paths → what would be built, substituted, is unknown, and the
/// download and NAR sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryMissing {
    pub targets: Vec<DerivedPath>,
}

impl Request for QueryMissing {
    const OP: Op = Op::QueryMissing;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        Ok(QueryMissing { targets: read_derived_paths(r, dir, version)? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        write_targets(w, dir, version, &self.targets)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, sp, words, VERSIONS};
    use super::*;
    use crate::wire::OutputsSpec;

    #[test]
    fn round_trips() {
        for minor in VERSIONS {
            // Before 1.30 a derivation file cannot be named, and a bare .drv is all its outputs.
            let mut targets = vec![DerivedPath::Opaque(sp("a")), DerivedPath::Built { drv: sp("b.drv"), outputs: OutputsSpec::All }];
            if minor >= 30 {
                targets.push(DerivedPath::Built {
                    drv: sp("c.drv"),
                    outputs: OutputsSpec::Names(["dev".to_owned(), "out".to_owned()].into()),
                });
                targets.push(DerivedPath::Opaque(sp("d.drv")));
            }
            let bytes = round_trip(&BuildPaths { targets: targets.clone(), mode: BuildMode::Repair }, minor);
            assert_eq!(*words(&bytes).last().unwrap(), 1, "the mode comes last");
            round_trip(&BuildPathsWithResults { targets: targets.clone(), mode: BuildMode::Check }, minor);
            round_trip(&QueryMissing { targets }, minor);
        }
    }

    #[test]
    fn build_derivation_round_trips() {
        let dir = StoreDir::default();
        // A basic derivation as Nix's client sends it, read from its own encoding.
        let drv = BasicDerivation {
            outputs: Vec::new(),
            input_srcs: [sp("src")].into(),
            platform: "x86_64-linux".into(),
            builder: "/bin/sh".into(),
            args: vec!["-c".into(), "true".into()],
            env: vec![("out".to_owned(), "/nix/store/x".to_owned())],
        };
        let mut bytes = Vec::new();
        write_basic_derivation(&mut bytes, &dir, "a", &drv).unwrap();
        let drv = read_basic_derivation(&mut bytes.as_slice(), &dir).unwrap();
        for minor in VERSIONS {
            round_trip(&BuildDerivation { drv_path: sp("a.drv"), drv: drv.clone(), mode: BuildMode::Normal }, minor);
        }
    }
}
