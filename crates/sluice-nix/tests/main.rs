//! The integration tests of `sluice-nix`, one binary: a module per behaviour, shared helpers in `common`.

mod common;
mod nar_corpus;
mod nar_proptest;
mod narinfo_corpus;
mod no_panic;
mod wire_golden;
