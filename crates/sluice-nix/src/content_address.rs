//! Content addresses (`CA:` in narinfo, `ca` in the database): `fixed:<r:>?<algo>:<hash>` and
//! `text:sha256:<hash>`, and the store paths they imply. Source: Nix
//! `src/libstore/content-address.cc`, `store-api.cc` (`makeFixedOutputPath`, `makeTextPath`).

use crate::hash::Hash;
use crate::store_path::{StoreDir, StorePath, StorePathError};

/// How a content-addressed path's hash was computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentAddress {
    /// `text:sha256:…`: the hash of a flat text file (`builtins.toFile`).
    Text(Hash),
    /// `fixed:…`: a fixed-output path; `recursive` means the hash is over the NAR.
    Fixed { recursive: bool, hash: Hash },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid content address {0:?}")]
pub struct ContentAddressError(pub String);

impl ContentAddress {
    pub fn parse(s: &str) -> Result<Self, ContentAddressError> { todo!() }
    /// The store path this content address implies for `name` with `references`
    /// (`self_ref`: the path references itself). Nix's `makeFixedOutputPathFromCA`.
    pub fn store_path(&self, store_dir: &StoreDir, name: &str, references: &[StorePath], self_ref: bool) -> Result<StorePath, StorePathError> { todo!() }
}

impl std::fmt::Display for ContentAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { todo!() }
}
