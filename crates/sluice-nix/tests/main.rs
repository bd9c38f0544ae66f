//! The integration tests of `sluice-nix`, one binary: a module per behaviour, shared helpers in `common`.
// Tests stop at the first failure (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

mod common;
mod nar_corpus;
mod nar_proptest;
mod narinfo_corpus;
mod no_panic;
mod wire_golden;
