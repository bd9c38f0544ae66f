//! `.narinfo` files: parse and print (Nix's field order; nixbase32 hashes), and the signature
//! fingerprint. Source: Nix `src/libstore/nar-info.cc`, `path-info.cc`.

use crate::hash::Hash;
use crate::store_path::{StoreDir, StorePath};

/// A parsed narinfo. `references` and `deriver` are store paths (written as base names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NarInfo {
    pub store_path: StorePath,
    /// The NAR's URL, relative to the cache (usually `nar/<filehash>.nar.xz`).
    pub url: String,
    /// `Compression:`; Nix's default when absent is `bzip2`.
    pub compression: String,
    pub file_hash: Option<Hash>,
    /// Bytes of the compressed NAR.
    pub file_size: Option<u64>,
    pub nar_hash: Hash,
    /// Bytes of the uncompressed NAR.
    pub nar_size: u64,
    pub references: Vec<StorePath>,
    pub deriver: Option<StorePath>,
    /// `Sig:` lines verbatim (`keyname:base64`).
    pub signatures: Vec<String>,
    /// `CA:` verbatim (`fixed:r:sha256:…`, `text:sha256:…`).
    pub ca: Option<String>,
    pub system: Option<String>,
}

/// Why a narinfo was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NarInfoError {
    #[error("narinfo line {line}: {what}")]
    Line { line: usize, what: String },
    #[error("narinfo lacks the required field {0}")]
    Missing(&'static str),
    #[error("narinfo field {field}: {what}")]
    Field { field: &'static str, what: String },
}

impl NarInfo {
    /// Parses narinfo text for `store_dir`.
    pub fn parse(store_dir: &StoreDir, text: &str) -> Result<Self, NarInfoError> { todo!() }
    /// Prints in Nix's form and field order.
    pub fn to_text(&self, store_dir: &StoreDir) -> String { todo!() }
    /// `1;<store path>;<NarHash nixbase32>;<NarSize>;<comma-separated references>`.
    pub fn fingerprint(&self, store_dir: &StoreDir) -> String { todo!() }
}
