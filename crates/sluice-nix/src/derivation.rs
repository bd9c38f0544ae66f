//! Derivations (`.drv`, ATerm): the outputs and their paths, which the local store registers
//! in `DerivationOutputs`. Source: Nix `src/libstore/derivations.cc` (`parseDerivation`).

use crate::store_path::{StoreDir, StorePath};

/// Why a `.drv` could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("derivation: {0}")]
pub struct DerivationError(pub String);

/// The outputs of a derivation in ATerm form: `(output name, output path)`; the path is `None`
/// for floating content-addressed outputs (empty path in the ATerm).
pub fn parse_outputs(store_dir: &StoreDir, aterm: &[u8]) -> Result<Vec<(String, Option<StorePath>)>, DerivationError> {
    todo!()
}
