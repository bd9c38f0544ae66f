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

/// Ops between two looks at where a followed client runs.
const FOLLOW_INTERVAL: u32 = 32;

/// Keeps a connection's worker on the CPU its client last ran on (for clients that send no
/// CPU, i.e. every Nix since 2.6): before every [`FOLLOW_INTERVAL`]th operation it reads the
/// client's CPU from `/proc/<pid>/stat` and re-pins the worker if the client moved. Dropping
/// it restores the worker's previous affinity.
pub(crate) struct Follower {
    pid: i32,
    cpu: Option<usize>,
    ops: u32,
    _restore: Option<Pinned>,
}

impl Follower {
    /// Follows the client process `pid`.
    pub(crate) fn new(pid: i32) -> Self {
        Follower { pid, cpu: None, ops: 0, _restore: None }
    }

    /// Called before each operation.
    pub(crate) fn tick(&mut self) {
        self.ops = self.ops.wrapping_add(1);
        if self.ops % FOLLOW_INTERVAL != 1 {
            return;
        }
        let Some(cpu) = client_cpu(self.pid) else { return };
        if self.cpu == Some(cpu) {
            return;
        }
        if self._restore.is_none() {
            self._restore = Pinned::to_cpu(cpu as u64);
            self.cpu = self._restore.as_ref().map(|_| cpu);
        } else {
            let mut set = CpuSet::new();
            set.set(cpu);
            self.cpu = sched_setaffinity(None, &set).ok().map(|()| cpu);
        }
    }
}

/// The CPU process `pid` last ran on (field 39 of `/proc/<pid>/stat`).
fn client_cpu(pid: i32) -> Option<usize> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name start with field 3 (state).
    let cpu = stat.rsplit_once(')')?.1.split_whitespace().nth(39 - 3)?.parse().ok()?;
    (cpu < CpuSet::MAX_CPU).then_some(cpu)
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

    #[test]
    fn finds_a_process_cpu() {
        let own = client_cpu(std::process::id() as i32).expect("own CPU");
        assert!(sched_getaffinity(None).unwrap().is_set(own));
        assert_eq!(client_cpu(-1), None);
    }
}
