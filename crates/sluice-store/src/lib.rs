//! Nix stores and the engines that move store paths between them: the [`store::Store`]
//! interface, [`store::open_store`] and the registry of kinds of store (`registry/`), the
//! local store (sluice-local-store) and binary caches (sluice-binary-cache) behind that
//! interface, the daemon client, the closure engine, the substitution pipeline (caches →
//! local store), the push engine (any store → any store), builtins and settings.

mod batched_adder;
pub mod binary_cache_store;
pub mod builtins;
mod by_key;
pub mod cache_gc;
pub mod closure;
mod closure_depth;
pub mod config;
pub mod env_dirs;
pub mod failure;
pub mod fd_budget;
pub mod job_queue;
mod legacy_ssh;
mod local_handle;
pub mod prefetched;
pub mod push;
mod reference_cycles;
mod registrar;
mod registry;
pub mod remote;
pub mod ssh;
pub mod store;
pub mod store_url;
pub mod substitute;
pub mod substituter_source;
pub mod substituters;
mod unpack_pool;
pub mod verify;

pub use batched_adder::BatchedAdder;

/// Waits, for at most `timeout`, until the process's unpacking threads have nothing left to
/// do and its registrars' threads have ended (each registers what it was handed, then drops
/// its handle on the store); whether they got there. For a command stopped by a signal, once the futures of its
/// copy are dropped (its runtime shut down): unpacking jobs not begun are dropped, and those
/// running stop at their NAR's next read and remove their temporary trees and release their
/// paths' locks, so that the store is left as a finished command leaves it. (Nix's goals do
/// the same as they are interrupted: `checkInterrupt` in its copy loops.)
pub fn wait_for_unpacking(timeout: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    unpack_pool::wait_idle(timeout) && registrar::wait_ended(deadline.saturating_duration_since(std::time::Instant::now()))
}
