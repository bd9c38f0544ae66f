//! What a store knows about a valid store path (Nix's `ValidPathInfo`,
//! `src/libstore/path-info.hh`).

use std::collections::BTreeSet;
use sluice_nix::hash::Hash;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::store_path::StorePath;

/// Metadata of a valid (registered) store path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidPathInfo {
    pub path: StorePath,
    /// Hash of the NAR serialisation (sha256 in practice).
    pub nar_hash: Hash,
    /// Bytes of the NAR serialisation.
    pub nar_size: u64,
    pub references: BTreeSet<StorePath>,
    pub deriver: Option<StorePath>,
    /// Seconds since the epoch.
    pub registration_time: i64,
    /// Built locally (trusted without signatures).
    pub ultimate: bool,
    /// Signatures `keyname:base64`.
    pub sigs: BTreeSet<String>,
    /// Content address (`fixed:…`/`text:…`), as text.
    pub ca: Option<String>,
}

impl ValidPathInfo {
    /// The record for a path described by `narinfo`, registered at `registration_time`
    /// (seconds since the epoch); its signatures are kept verbatim.
    pub fn from_narinfo(narinfo: &NarInfo, registration_time: i64) -> Self {
        ValidPathInfo {
            path: narinfo.store_path.clone(),
            nar_hash: narinfo.nar_hash.clone(),
            nar_size: narinfo.nar_size,
            references: narinfo.references.iter().cloned().collect(),
            deriver: narinfo.deriver.clone(),
            registration_time,
            ultimate: false,
            sigs: narinfo.signatures.iter().cloned().collect(),
            ca: narinfo.ca.clone(),
        }
    }

    /// The record for a path's metadata as the worker protocol carries it (a registration
    /// time beyond `i64` is clamped).
    pub fn from_wire(info: sluice_nix::wire::PathInfo) -> Self {
        ValidPathInfo {
            path: info.path,
            nar_hash: info.nar_hash,
            nar_size: info.nar_size,
            references: info.references,
            deriver: info.deriver,
            registration_time: i64::try_from(info.registration_time).unwrap_or(i64::MAX),
            ultimate: info.ultimate,
            sigs: info.sigs,
            ca: info.ca.map(|c| c.to_string()),
        }
    }
}
