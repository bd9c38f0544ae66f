//! `nix-cache-info`: `StoreDir`, `WantMassQuery`, `Priority`. Source: Nix
//! `src/libstore/binary-cache-store.cc`.

/// A binary cache's `nix-cache-info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheInfo {
    pub store_dir: String,
    pub want_mass_query: bool,
    /// Lower is preferred; Nix's default is 50.
    pub priority: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("nix-cache-info line {line}: {what}")]
pub struct CacheInfoError { pub line: usize, pub what: String }

impl CacheInfo {
    pub fn parse(text: &str) -> Result<Self, CacheInfoError> { todo!() }
}
