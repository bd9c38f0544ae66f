//! The integration tests of `sluice`, one binary: a module per behaviour, shared helpers in `common`.

mod big_nar;
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
mod review;
mod serve;
mod settings;
mod stale_cache;
mod store_urls;
