//! Nix stores and the engines that move store paths between them: the [`store::Store`]
//! interface and [`store::open_store`], the local store (Nix's own on-disk layout and SQLite
//! database), binary-cache stores (`file://`, `http(s)://`, `s3://`), the daemon client, the
//! narinfo disk cache, the closure engine, the substitution pipeline (caches → local store)
//! and the push engine (any store → any store).

pub mod local;
pub mod remote;
pub mod binary_cache;
pub mod builtins;
mod by_key;
mod causes;
pub mod closure;
mod closure_depth;
pub mod compression;
pub mod encoder_memory;
pub mod failure;
pub mod config;
pub mod fd_budget;
pub mod job_queue;
pub mod narinfo_cache;
pub mod netrc;
pub mod push;
mod reference_cycles;
pub mod store;
pub mod store_url;
pub mod substitute;
pub mod substituters;
mod unpack_pool;

/// The cores this process may run on (`std::thread::available_parallelism`, at least 1),
/// found once: each call of the standard function reads the cgroup's CPU quota files (three
/// to five system calls), which a push paid twice per path.
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}
