//! The integration tests of `sluice-store`, one binary: a module per behaviour, shared helpers in `common`.
// Tests stop at the first failure (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

mod binary_cache_bound;
mod common;
mod contract;
mod deep_trees;
mod links;
mod local_store;
