//! What a store knows about a store path: Nix's `ValidPathInfo` (`src/libstore/path-info.hh`),
//! the one path-info type of sluice, used by the local store's registry, the worker protocol
//! and the verification boundary; [`PathInfo`], a store's answer for a path (the info and, from
//! a binary cache, where the NAR is: Nix's `NarInfo`, `src/libstore/nar-info.hh`); and the
//! signature fingerprint (`ValidPathInfo::fingerprint`, `path-info.cc`), computed in one place
//! for narinfos and path infos alike.

use std::collections::BTreeSet;

use crate::content_address::ContentAddress;
use crate::hash::Hash;
use crate::narinfo::NarInfo;
use crate::store_path::{StoreDir, StorePath};

/// Metadata of a store path, as registered or as claimed by whoever offers the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidPathInfo {
    pub path: StorePath,
    /// Hash of the NAR serialisation (sha256 in practice).
    pub nar_hash: Hash,
    /// Bytes of the NAR serialisation.
    pub nar_size: u64,
    /// References, possibly including `path` itself (a self-reference).
    pub references: BTreeSet<StorePath>,
    pub deriver: Option<StorePath>,
    /// Seconds since the epoch.
    pub registration_time: i64,
    /// Built locally (trusted without signatures).
    pub ultimate: bool,
    /// Signatures `keyname:base64`.
    pub sigs: BTreeSet<String>,
    /// Content address, parsed once where the info is read.
    pub ca: Option<ContentAddress>,
}

/// The file a binary cache keeps a path's NAR in: the fields Nix's `NarInfo` adds to
/// `ValidPathInfo` (`src/libstore/nar-info.hh`), as the narinfo gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NarFile {
    /// `URL:`, relative to the cache (`nar/<FileHash>.nar.xz`).
    pub url: String,
    /// `Compression:` (Nix's default when absent is `bzip2`).
    pub compression: String,
    /// `FileHash:`, hash of the file; `None` when unknown.
    pub file_hash: Option<Hash>,
    /// `FileSize:`, bytes of the file; `None` when unknown.
    pub file_size: Option<u64>,
}

/// A store's answer for a valid path (Nix's `queryPathInfo`, which answers a `NarInfo` for a
/// path in a binary cache): its info and, from a binary cache, the file its NAR is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathInfo {
    pub info: ValidPathInfo,
    /// `None` from a store that keeps no NAR files (a local store, a daemon).
    pub nar_file: Option<NarFile>,
}

impl PathInfo {
    /// A store's answer without a NAR file.
    pub fn of(info: ValidPathInfo) -> Self {
        PathInfo { info, nar_file: None }
    }

    /// What a binary cache answers with `narinfo` (no registration time: 0).
    pub fn from_narinfo(narinfo: &NarInfo) -> Self {
        let nar_file = NarFile {
            url: narinfo.url.clone(),
            compression: narinfo.compression.clone(),
            file_hash: narinfo.file_hash.clone(),
            file_size: narinfo.file_size,
        };
        PathInfo { info: ValidPathInfo::from_narinfo(narinfo, 0), nar_file: Some(nar_file) }
    }
}

impl ValidPathInfo {
    /// The info a narinfo claims for its path, registered at `registration_time` (seconds
    /// since the epoch); its signatures are kept verbatim.
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

    /// The signature fingerprint of this info (see [`fingerprint`]).
    pub fn fingerprint(&self, store_dir: &StoreDir) -> String {
        fingerprint(store_dir, &self.path, &self.nar_hash, self.nar_size, self.references.iter())
    }

    /// Whether `path` references itself.
    pub fn has_self_reference(&self) -> bool {
        self.references.contains(&self.path)
    }

    /// The references other than the path itself, sorted.
    pub(crate) fn other_references(&self) -> Vec<StorePath> {
        self.references.iter().filter(|r| **r != self.path).cloned().collect()
    }

    /// The store path its content address implies for its name and references (Nix's
    /// `ValidPathInfo::isContentAddressed` compares it with `path`); `None` without a content
    /// address or for an impossible combination (see [`ContentAddress::store_path`]).
    pub fn content_addressed_path(&self, store_dir: &StoreDir) -> Option<StorePath> {
        let ca = self.ca.as_ref()?;
        ca.store_path(store_dir, self.path.name(), &self.other_references(), self.has_self_reference()).ok()
    }
}

/// The text a path's signatures sign (Nix's `ValidPathInfo::fingerprint`):
/// `1;<store path>;<NarHash as sha256:nixbase32>;<NarSize>;<references, full paths, sorted, comma-separated>`.
pub fn fingerprint<'a>(
    store_dir: &StoreDir,
    path: &StorePath,
    nar_hash: &Hash,
    nar_size: u64,
    references: impl Iterator<Item = &'a StorePath>,
) -> String {
    let mut refs: Vec<&StorePath> = references.collect();
    refs.sort();
    refs.dedup();
    let refs: Vec<String> = refs.into_iter().map(|r| store_dir.display_path(r)).collect();
    format!("1;{};{};{};{}", store_dir.display_path(path), nar_hash.to_nix32_prefixed(), nar_size, refs.join(","))
}
