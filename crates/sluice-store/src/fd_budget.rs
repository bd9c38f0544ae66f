//! How many file descriptors a copy may hold open, shared out from the soft limit on open
//! files (`RLIMIT_NOFILE`) when it starts, and the permits that bound its held path locks.
//!
//! A path being substituted holds its lock file open from before its NAR is unpacked until it
//! is registered, and a download job holds its NAR (a file, for `file://`) and the directories
//! and file it is unpacking into. Without a budget a closure of N paths held up to N lock
//! files at once and failed with `Too many open files` under a hard limit below N.

use std::sync::Arc;

use rustix::process::{getrlimit, Resource};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// Descriptors left for everything else a copy or the daemon holds: standard streams, the
/// store directory, the store database and the narinfo disk cache (SQLite: database,
/// journal, shared memory), `big-lock`, temporary roots, the runtime's own, HTTP connections
/// (25 by default) and the daemon's client sockets.
const RESERVE: u64 = 64;

/// Descriptors a download job may hold besides its path's lock: its NAR, the file being
/// written, its tree's root directory and one more for each KiB of path below it
/// (`local/unpack.rs`): at most three, as a store's paths must fit in `PATH_MAX` (4 KiB).
const FDS_PER_JOB: u64 = 6;

/// Path locks allowed however low the limit: a copy needs at least one to progress, a few
/// to overlap downloads.
const MIN_LOCKS: u64 = 8;

/// What a copy may hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FdBudget {
    /// Path locks held (one descriptor each): half of what the limit leaves after the reserve.
    pub locks: usize,
    /// Download jobs (each [`FDS_PER_JOB`] descriptors): most of the other half.
    pub jobs: usize,
    /// Narinfo lookups in flight (a file each, for `file://`): an eighth.
    pub lookups: usize,
}

impl FdBudget {
    /// The budget under a soft limit of `limit` open files.
    pub(crate) fn from_limit(limit: u64) -> Self {
        let usable = limit.saturating_sub(RESERVE);
        let locks = usable / 2;
        let lookups = usable / 8;
        let jobs = (usable - locks - lookups) / FDS_PER_JOB;
        let size = |n: u64, min: u64| usize::try_from(n.max(min)).unwrap_or(usize::MAX);
        FdBudget { locks: size(locks, MIN_LOCKS), jobs: size(jobs, 1), lookups: size(lookups, 1) }
    }

    /// The budget under the process's soft limit now.
    pub fn current() -> Self {
        Self::from_limit(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
    }
}

/// Permits to hold path locks, handed out first come, first served, that also tell holders
/// when a path is queued for one (so that a holder which can wait without its lock gives it
/// up: see `substitute`).
pub(crate) struct LockPermits {
    permits: Arc<Semaphore>,
    /// Paths queued for a permit.
    queued: watch::Sender<usize>,
}

impl LockPermits {
    /// `permits` permits (at most the semaphore's maximum).
    pub(crate) fn new(permits: usize) -> Self {
        LockPermits { permits: Arc::new(Semaphore::new(permits.min(Semaphore::MAX_PERMITS))), queued: watch::channel(0).0 }
    }

    /// A permit if one is free and nobody is queued (a released permit goes to the first
    /// queued path, so none is free while one waits).
    pub(crate) fn try_take(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// A permit, queueing behind the paths that asked earlier if none is free. The queued
    /// count includes this path while (and only while) it waits, also if the wait is dropped.
    /// Errors: the permits were closed (they never are while `self` lives).
    pub(crate) async fn take(&self) -> Result<OwnedSemaphorePermit, String> {
        if let Some(permit) = self.try_take() {
            return Ok(permit);
        }
        self.queued.send_modify(|n| *n += 1);
        let _queued = Unqueue(&self.queued);
        self.permits.clone().acquire_owned().await.map_err(|e| format!("waiting for a permit to hold a path's lock: {e}"))
    }

    /// Resolves once some path is queued for a permit.
    pub(crate) async fn contended(&self) {
        // The sender lives in `self`, so the wait ends only with a queued path.
        let _ = self.queued.subscribe().wait_for(|n| *n > 0).await;
    }
}

/// Takes a path off the queued count when its wait ends.
struct Unqueue<'a>(&'a watch::Sender<usize>);

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_follows_the_limit() {
        assert_eq!(FdBudget::from_limit(256), FdBudget { locks: 96, jobs: 12, lookups: 24 });
        let large = FdBudget::from_limit(20_000);
        assert!(large.locks > 9_000 && large.jobs > 1_000 && large.lookups > 2_000, "{large:?}");
        assert_eq!(FdBudget::from_limit(10), FdBudget { locks: 8, jobs: 1, lookups: 1 });
        assert_eq!(FdBudget::from_limit(u64::MAX).locks as u64, (u64::MAX - RESERVE) / 2);
    }

    #[tokio::test]
    async fn queued_paths_are_counted_and_served_in_order() {
        let permits = Arc::new(LockPermits::new(1));
        let held = permits.try_take().unwrap();
        assert!(permits.try_take().is_none());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let (permits, tx) = (permits.clone(), tx.clone());
            tokio::spawn(async move {
                let _p = permits.take().await.unwrap();
                tx.send(i).unwrap();
            });
            tokio::task::yield_now().await;
        }
        tokio::time::timeout(std::time::Duration::from_secs(5), permits.contended()).await.unwrap();
        assert_eq!(*permits.queued.borrow(), 3);
        drop(held);
        let order = vec![rx.recv().await.unwrap(), rx.recv().await.unwrap(), rx.recv().await.unwrap()];
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(*permits.queued.borrow(), 0);
        assert!(permits.try_take().is_some());
    }
}
