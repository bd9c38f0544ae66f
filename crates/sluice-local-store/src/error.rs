//! The local store's errors: each names the store path or file concerned, and the rule it
//! breaks in Nix's words where Nix has them.

use std::io;
use std::path::{Path, PathBuf};

use sluice_nix::derivation::DerivationError;
use sluice_nix::nar::reader::NarError;

use crate::schema;

/// Who signed an untrusted path and whom the policy trusts, as [`LocalStoreError::Untrusted`]
/// says it (and `sluice store verify`, in Nix's `nix store verify` words, `verify.cc`).
pub fn untrusted_detail(signers: &[String], trusted: &[String]) -> String {
    let trusted_names = if trusted.is_empty() { "none".to_owned() } else { trusted.join(", ") };
    if signers.is_empty() {
        return format!("it has no signature; trusted: {trusted_names}");
    }
    let mut detail = format!("signed by: {}; trusted: {trusted_names}", signers.join(", "));
    let unverified = unverified_signers(signers, trusted);
    if !unverified.is_empty() {
        detail.push_str(&format!(
            "; the signature by {} does not verify: it was not made over this NAR hash, size and references",
            unverified.join(", ")
        ));
    }
    detail
}

/// The key names of `signers` that `trusted` has: signatures by a trusted key's name that
/// did not verify (made by another key under that name, or over other path info).
pub fn unverified_signers<'a>(signers: &'a [String], trusted: &[String]) -> Vec<&'a str> {
    signers.iter().filter(|s| trusted.contains(s)).map(String::as_str).collect()
}

/// Errors of the local store. Each names the store path or file concerned.
#[derive(Debug, thiserror::Error)]
pub enum LocalStoreError {
    /// A file-system operation failed (`what` is the operation, e.g. "creating").
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// An SQLite operation on the store database failed.
    #[error("store database {}: {what}: {source}", db.display())]
    Db {
        db: PathBuf,
        what: String,
        #[source]
        source: rusqlite::Error,
    },
    /// The store database holds something Nix would not have written.
    #[error("store database {}: invalid {what}", db.display())]
    Corrupt { db: PathBuf, what: String },
    /// The `schema` file names a version other than the one sluice (and Nix 2.8) uses.
    #[error("{}: store schema version {found:?}, but only version {} is supported", path.display(), schema::SCHEMA_VERSION)]
    Schema { path: PathBuf, found: String },
    /// The NAR given for a path is malformed, or could not be unpacked.
    #[error("unpacking the NAR of {path}: {source}")]
    Nar {
        path: String,
        #[source]
        source: NarError,
    },
    /// The unpacked NAR's hash is not the one the path's info claims.
    #[error("NAR hash mismatch for {path}: expected {expected}, got {actual}")]
    HashMismatch { path: String, expected: String, actual: String },
    /// The unpacked NAR's size (bytes) is not the one the path's info claims.
    #[error("NAR size mismatch for {path}: expected {expected} bytes, got {actual} bytes")]
    SizeMismatch { path: String, expected: u64, actual: u64 },
    /// The unpacked content's hash is not the one its content address carries (Nix's words).
    #[error("ca hash mismatch importing path '{path}';\n  specified: {specified}\n  got:       {actual}")]
    CaMismatch { path: String, specified: String, actual: String },
    /// The content address does not yield the path for its name and references.
    #[error("cannot add path '{path}': its content address {ca} implies {implied}")]
    CaPath { path: String, ca: String, implied: String },
    /// An unsigned path's content address does not yield it, so nothing vouches for it (Nix:
    /// "claims to be content-addressed but isn't").
    #[error(
        "cannot add path '{path}' because it lacks a signature by a trusted key (it claims to be content-addressed but isn't: its content address {ca} implies {implied})"
    )]
    UnsignedFalseCa { path: String, ca: String, implied: String },
    /// Nobody the policy trusts vouches for the path (Nix's words, then who signed it):
    /// `signers` are the key names of its signatures, `trusted` those of `trusted-public-keys`.
    #[error("cannot add path '{path}' because it lacks a signature by a trusted key ({})", untrusted_detail(signers, trusted))]
    Untrusted { path: String, signers: Vec<String>, trusted: Vec<String> },
    /// A source offers a valid path with another NAR than the registered one: it cannot
    /// repair it.
    #[error("cannot repair {path} from this source: it has NAR hash {offered}, but {registered} is registered")]
    RepairMismatch { path: String, registered: String, offered: String },
    /// A path cannot be registered before its references are valid.
    #[error("cannot register {path}: its reference {reference} is not valid")]
    MissingReference { path: String, reference: String },
    /// The operation needs a valid path.
    #[error("{path} is not valid in the store")]
    NotValid { path: String },
    /// A `.drv` path's contents are not a derivation (Nix's words).
    #[error("error parsing derivation '{path}': {source}")]
    Derivation {
        path: String,
        #[source]
        source: DerivationError,
    },
    /// A derivation's output paths are not those its contents imply, or its type is one Nix
    /// refuses (Nix's `checkDerivationOutputs`, in its words).
    #[error("{0}")]
    DerivationOutputs(DerivationError),
    /// A batch's durability sync or registration transaction failed; the path was removed.
    #[error("cannot register {path}: {reason}")]
    Registration { path: String, reason: String },
    /// A [`PendingPath`] was used out of order or for another path.
    #[error("adding {path}: {what}")]
    Misuse { path: String, what: &'static str },
    /// The collector found a path to delete still referenced (Nix's `PathInUse`).
    #[error("cannot delete path '{path}' because it is in use by {referrers}")]
    PathInUse { path: String, referrers: String },
    /// A path named for deletion is reachable from a root (Nix's words).
    #[error("Cannot delete path '{path}' since it is still alive. To find out why, use: nix-store --query --roots")]
    StillAlive { path: String },
    /// The store was opened with `read-only=true` and the operation would write to it.
    #[error("the store in {} is read-only (read-only=true): cannot {what}", store.display())]
    ReadOnly { store: PathBuf, what: &'static str },
}

/// Maps an I/O error to [`LocalStoreError::Io`] for `what` on `path`.
pub(crate) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LocalStoreError {
    let path = path.to_owned();
    move |source| LocalStoreError::Io { what, path, source }
}
