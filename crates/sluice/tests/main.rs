//! The integration tests of `sluice`, one binary: a module per behaviour, shared helpers in `common`.
// Tests stop at the first failure (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

mod big_nar;
mod cache_gc;
mod common;
mod concurrency;
mod copy;
mod crash;
mod daemon;
mod disk_full;
mod errors;
mod faults;
mod gc_concurrency;
mod help;
mod http_faults;
mod logging;
mod missing;
mod nar_faults;
mod nar_ls;
mod narinfo_faults;
mod parallel_decode;
mod path_info_output;
mod protocol;
mod push;
mod push_faults;
mod review;
mod serve;
mod serve_upstream;
mod settings;
mod ssh;
mod ssh_serve;
mod ssh_substituters;
mod stale_cache;
mod store_substituters;
mod store_urls;
mod store_verify;
