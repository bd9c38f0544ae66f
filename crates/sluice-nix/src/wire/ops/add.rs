//! Addition requests (Nix `daemon.cc`: `wopAddToStore`, `wopAddTextToStore`,
//! `wopAddToStoreNar`, `wopAddMultipleToStore`, `wopAddSignatures`, `wopAddBuildLog`). The
//! data added (framed data, a NAR, a framed stream of NARs, a framed log) follows the header
//! and is streamed by the caller.

use std::collections::BTreeSet;
use std::io::{self, Read, Write};

use super::super::{
    read_bool, read_bytes, read_keyed_path_info, read_store_path, read_store_path_set, read_string, read_strings, read_u64, write_bool,
    write_bytes, write_keyed_path_info, write_store_path, write_store_path_set, write_strings, write_u64, MAX_PATH_LEN,
};
use super::{Op, Request};
use crate::path_info::ValidPathInfo;
use crate::store_path::{StoreDir, StorePath};
use crate::wire::{ProtocolVersion, WireError};

/// Longest name of a path to add accepted, in bytes (store path names are at most 211).
pub const MAX_NAME: u64 = 1024;
/// Largest AddTextToStore text accepted, in bytes (it is held in memory).
pub const MAX_TEXT: u64 = 256 << 20;

/// AddToStore: from 1.25 name, content-address method (`text`, `flat:sha256`, `nar:sha256`,
/// …), references and repair, then the data as a framed stream → the keyed path info; before,
/// name, fixed flag, recursive number and hash algorithm, then a NAR → the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddToStore {
    /// Protocol ≥ 1.25.
    Modern { name: String, method: String, references: BTreeSet<StorePath>, repair: bool },
    /// Protocol < 1.25. `recursive` as sent (Nix accepts 0 and 1 only; the handler checks).
    Legacy { name: String, fixed: bool, recursive: u64, algo: String },
}

impl Request for AddToStore {
    const OP: Op = Op::AddToStore;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let name = read_string(r, MAX_NAME, "name")?;
        if version.at_least(25) {
            let method = read_string(r, 64, "content-address method")?;
            let references = read_store_path_set(r, dir, "references")?;
            let repair = read_bool(r, "repair flag")?;
            return Ok(AddToStore::Modern { name, method, references, repair });
        }
        let fixed = read_bool(r, "fixed flag")?;
        let recursive = read_u64(r, "recursive flag")?;
        let algo = read_string(r, 16, "hash algorithm")?;
        Ok(AddToStore::Legacy { name, fixed, recursive, algo })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        match self {
            AddToStore::Modern { name, method, references, repair } if version.at_least(25) => {
                write_bytes(w, name.as_bytes())?;
                write_bytes(w, method.as_bytes())?;
                write_store_path_set(w, dir, references.iter())?;
                write_bool(w, *repair)
            }
            AddToStore::Legacy { name, fixed, recursive, algo } if !version.at_least(25) => {
                write_bytes(w, name.as_bytes())?;
                write_bool(w, *fixed)?;
                write_u64(w, *recursive)?;
                write_bytes(w, algo.as_bytes())
            }
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, format!("AddToStore: this form is not the one of protocol {version}"))),
        }
    }
}

/// AddTextToStore: name, text and references → the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddTextToStore {
    pub name: String,
    pub text: Vec<u8>,
    pub references: BTreeSet<StorePath>,
}

impl Request for AddTextToStore {
    const OP: Op = Op::AddTextToStore;
    /// Its text, and references as any request's path list.
    const MAX_BYTES: u64 = MAX_TEXT + super::MAX_REQUEST;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let name = read_string(r, MAX_NAME, "name")?;
        let text = read_bytes(r, MAX_TEXT, "text")?;
        let references = read_store_path_set(r, dir, "references")?;
        Ok(AddTextToStore { name, text, references })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bytes(w, self.name.as_bytes())?;
        write_bytes(w, &self.text)?;
        write_store_path_set(w, dir, self.references.iter())
    }
}

/// AddToStoreNar (≥ 1.23 the NAR follows framed; before, through `STDERR_READ`): the keyed
/// info in its 1.16 form, repair, dontCheckSigs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddToStoreNar {
    pub info: ValidPathInfo,
    pub repair: bool,
    pub dont_check_sigs: bool,
}

impl Request for AddToStoreNar {
    const OP: Op = Op::AddToStoreNar;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let info = read_keyed_path_info(r, dir, ProtocolVersion::new(1, 16))?;
        let repair = read_bool(r, "repair flag")?;
        let dont_check_sigs = read_bool(r, "dontCheckSigs flag")?;
        Ok(AddToStoreNar { info, repair, dont_check_sigs })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_keyed_path_info(w, dir, ProtocolVersion::new(1, 16), &self.info)?;
        write_bool(w, self.repair)?;
        write_bool(w, self.dont_check_sigs)
    }
}

/// AddMultipleToStore (≥ 1.32): repair, dontCheckSigs, then one framed stream of the count
/// and, per path, its keyed 1.16 info and NAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddMultipleToStore {
    pub repair: bool,
    pub dont_check_sigs: bool,
}

impl Request for AddMultipleToStore {
    const OP: Op = Op::AddMultipleToStore;

    fn read(r: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let repair = read_bool(r, "repair flag")?;
        Ok(AddMultipleToStore { repair, dont_check_sigs: read_bool(r, "dontCheckSigs flag")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bool(w, self.repair)?;
        write_bool(w, self.dont_check_sigs)
    }
}

/// AddSignatures: a path and signatures (at most 65,536 of at most 4096 bytes) → 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddSignatures {
    pub path: StorePath,
    pub sigs: Vec<String>,
}

impl Request for AddSignatures {
    const OP: Op = Op::AddSignatures;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let path = read_store_path(r, dir, "path")?;
        Ok(AddSignatures { path, sigs: read_strings(r, 1 << 16, 4096, "signatures")? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_store_path(w, dir, &self.path)?;
        write_strings(w, self.sigs.iter())
    }
}

/// AddBuildLog: the derivation (a base name or a full path, kept as sent: the handler parses
/// it, so that a bad one is an operation error), then the log as a framed stream → 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddBuildLog {
    pub drv: String,
}

impl Request for AddBuildLog {
    const OP: Op = Op::AddBuildLog;

    fn read(r: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        Ok(AddBuildLog { drv: read_string(r, MAX_PATH_LEN, "derivation path")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bytes(w, self.drv.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, sp, VERSIONS};
    use super::*;
    use crate::hash::{Hash, HashAlgo};

    fn info() -> ValidPathInfo {
        ValidPathInfo {
            path: sp("a"),
            deriver: Some(sp("a.drv")),
            nar_hash: Hash::parse_bare("1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s", HashAlgo::Sha256).unwrap(),
            references: [sp("b")].into(),
            registration_time: 1_700_000_000,
            nar_size: 120,
            ultimate: true,
            sigs: ["cache.example.org-1:c2ln".to_owned()].into(),
            ca: None,
        }
    }

    #[test]
    fn round_trips() {
        for minor in VERSIONS {
            let add = if minor >= 25 {
                AddToStore::Modern { name: "x".into(), method: "nar:sha256".into(), references: [sp("b")].into(), repair: false }
            } else {
                AddToStore::Legacy { name: "x".into(), fixed: true, recursive: 1, algo: "sha256".into() }
            };
            round_trip(&add, minor);
            round_trip(&AddTextToStore { name: "t".into(), text: b"hello\0".to_vec(), references: [sp("b"), sp("c")].into() }, minor);
            round_trip(&AddToStoreNar { info: info(), repair: true, dont_check_sigs: false }, minor);
            round_trip(&AddMultipleToStore { repair: false, dont_check_sigs: true }, minor);
            round_trip(&AddSignatures { path: sp("a"), sigs: vec!["k:1".into(), "k:2".into()] }, minor);
            round_trip(&AddBuildLog { drv: "g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-a.drv".into() }, minor);
        }
    }

    #[test]
    fn add_to_store_refuses_the_other_versions_form() {
        let legacy = AddToStore::Legacy { name: "x".into(), fixed: false, recursive: 0, algo: String::new() };
        let err = legacy.write(&mut Vec::new(), &StoreDir::default(), ProtocolVersion::new(1, 25)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
