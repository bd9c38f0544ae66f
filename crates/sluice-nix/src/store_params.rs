//! The parameters every kind of store takes in its URL: Nix's `StoreConfig`
//! (`src/libstore/store-api.hh`). Parsed by sluice-store's `store_url.rs`; kept by each kind's
//! configuration (the local store's, a binary cache's).

use std::collections::BTreeMap;

use crate::store_path::StoreDir;

/// Parameters of Nix's `StoreConfig` (`src/libstore/store-api.hh`) that every store takes,
/// and the accepted parameters sluice does not act on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommonParams {
    /// `priority=N`: a substituter's priority (lower is preferred); overrides a cache's
    /// `nix-cache-info`.
    pub priority: Option<i32>,
    /// `want-mass-query=BOOL`: overrides a cache's `nix-cache-info`.
    pub want_mass_query: Option<bool>,
    /// `trusted=BOOL` (default false): paths from this substituter may be used without a
    /// signature by a trusted key (Nix's `isTrusted`).
    pub trusted: bool,
    /// `store=DIR` (default `/nix/store`): the store directory the store's paths are in. Only
    /// a binary cache may have another, and sluice uses such a cache only as a substituter of
    /// content-addressed paths without references (as Nix's substitution goal does).
    pub store_dir: StoreDir,
    /// Parameters Nix accepts for this kind of store that sluice does not act on (see
    /// sluice-store's `store_url.rs`), by name, with their values as given.
    pub unused: BTreeMap<String, String>,
}
