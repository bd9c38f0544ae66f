//! Store paths (`/nix/store/<32-char nixbase32 hash part>-<name>`), validated by Nix's rules
//! (`src/libstore/path.cc`): hash part of 32 nixbase32 characters, name of 1–211 characters from
//! `[A-Za-z0-9+-._?=]`, not starting with `.`.

/// Length of a store path's hash part in characters.
pub const HASH_PART_LEN: usize = 32;

/// A store path without its store directory: hash part and name. Ordered as Nix orders the full
/// paths within one store directory (byte order of the base name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StorePath { base_name: String }

/// Errors validating a store path.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StorePathError {
    #[error("store path {0:?} is too short")]
    TooShort(String),
    #[error("store path {0:?} has an invalid hash part")]
    BadHashPart(String),
    #[error("store path {0:?} has an invalid name: {1}")]
    BadName(String, &'static str),
    #[error("path {path:?} is not in the store directory {store_dir:?}")]
    NotInStore { path: String, store_dir: String },
}

impl StorePath {
    /// Parses `<hash>-<name>`.
    pub fn from_base_name(s: &str) -> Result<Self, StorePathError> { todo!() }
    /// The 32-character hash part.
    pub fn hash_part(&self) -> &str { &self.base_name[..HASH_PART_LEN] }
    /// The name after the hash part and dash.
    pub fn name(&self) -> &str { &self.base_name[HASH_PART_LEN + 1..] }
    /// `<hash>-<name>`.
    pub fn base_name(&self) -> &str { &self.base_name }
    /// Whether the name ends in `.drv`.
    pub fn is_derivation(&self) -> bool { self.name().ends_with(".drv") }
    /// Builds a path from a 20-byte digest and a name (Nix's `StorePath(hash, name)`).
    pub fn from_digest(digest: &[u8; 20], name: &str) -> Result<Self, StorePathError> { todo!() }
}

impl std::fmt::Display for StorePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str(&self.base_name) }
}

/// A store directory such as `/nix/store` (the logical one, as written in paths).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreDir(String);

impl Default for StoreDir { fn default() -> Self { StoreDir("/nix/store".into()) } }

impl StoreDir {
    /// A store directory: absolute, no trailing slash.
    pub fn new(dir: &str) -> Result<Self, StorePathError> { todo!() }
    pub fn as_str(&self) -> &str { &self.0 }
    /// Parses a full path `<dir>/<hash>-<name>` (no trailing components).
    pub fn parse_path(&self, path: &str) -> Result<StorePath, StorePathError> { todo!() }
    /// Parses a path inside a store path (`<dir>/<hash>-<name>/sub/dir`) to its store path.
    pub fn to_store_path(&self, path: &str) -> Result<StorePath, StorePathError> { todo!() }
    /// `<dir>/<base name>`.
    pub fn display_path(&self, path: &StorePath) -> String { format!("{}/{}", self.0, path.base_name()) }
    /// Nix's `makeStorePath(type, hash, name)`: sha256 of `type:sha256:<base16>:<dir>:<name>`
    /// folded to 20 bytes. `type` includes any `:<ref>` suffixes.
    pub fn make_store_path(&self, ty: &str, hash: &crate::hash::Hash, name: &str) -> Result<StorePath, StorePathError> { todo!() }
}
