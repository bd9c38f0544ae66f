//! The integration tests of `sluice-store`, one binary: a module per behaviour, shared helpers in `common`.

mod binary_cache_bound;
mod common;
mod contract;
mod deep_trees;
mod links;
mod local_store;
