//! CPU affinity of a worker thread: old clients (protocol ≥ 1.14, Nix 1.6–2.5 with
//! `NIX_AFFINITY_HACK`) send flag 1 and the CPU they run on; the worker serving them is pinned
//! to that CPU so that each round trip stays on one CPU, and its previous affinity is restored
//! when the connection ends (Nix's `setAffinityTo`/`restoreAffinity`, removed in Nix 2.6).

use rustix::process::{sched_getaffinity, sched_setaffinity, CpuSet};

/// While alive, the calling thread is pinned to one CPU; dropping it restores the previous
/// affinity.
pub(crate) struct Pinned {
    previous: CpuSet,
}

impl Pinned {
    /// Pins the calling thread to `cpu`. `None` (with a log line) if the CPU does not exist or
    /// the affinity cannot be changed: the connection then runs unpinned.
    pub(crate) fn to_cpu(cpu: u64) -> Option<Pinned> {
        let previous = sched_getaffinity(None).map_err(|e| tracing::warn!("reading the worker's CPU affinity: {e}")).ok()?;
        let cpu = usize::try_from(cpu).ok().filter(|c| *c < CpuSet::MAX_CPU)?;
        let mut set = CpuSet::new();
        set.set(cpu);
        match sched_setaffinity(None, &set) {
            Ok(()) => {
                tracing::debug!(cpu, "worker pinned to the client's CPU");
                Some(Pinned { previous })
            }
            Err(e) => {
                tracing::info!("cannot pin the worker to CPU {cpu} as the client asked: {e}");
                None
            }
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Err(e) = sched_setaffinity(None, &self.previous) {
            tracing::warn!("restoring the worker's CPU affinity: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_and_restores() {
        let before = sched_getaffinity(None).unwrap();
        let first = (0..CpuSet::MAX_CPU).find(|c| before.is_set(*c)).unwrap();
        {
            let _p = Pinned::to_cpu(first as u64).expect("pin to an allowed CPU");
            assert_eq!(sched_getaffinity(None).unwrap().count(), 1);
            assert_eq!(rustix::process::sched_getcpu(), first);
        }
        assert_eq!(sched_getaffinity(None).unwrap().count(), before.count());
        assert!(Pinned::to_cpu(1 << 40).is_none());
    }
}
