//! CPU placement of a connection: its worker thread and its client on one CPU, so that each
//! round trip wakes a thread on the CPU that just went idle instead of another one (on a
//! 2-vCPU VM a Unix-socket round trip costs 41 µs across CPUs and 9 µs on one).
//!
//! Nix 1.6–2.5 asked for this themselves: with `NIX_AFFINITY_HACK` the client pinned itself
//! and sent affinity flag 1 and its CPU in the greeting, and the daemon's worker pinned itself
//! to that CPU (Nix's `setAffinityTo`/`restoreAffinity`, `src/libutil/affinity.cc`, removed in
//! Nix 2.6). For clients that send no CPU, [`Placement::pin_client`] does both sides from the
//! daemon: the client's main thread (whose id is the peer pid from `SO_PEERCRED`, the thread
//! that makes a Nix client's store calls) and the worker go to one CPU, and the client's
//! threads and descendants that inherited the pin get their previous affinity back when the
//! placement ends: when the connection does, or, for a watched placement (the daemon's default,
//! `--client-cpu auto`, for Nix's own clients: [`runs_nix`]), as soon as the client's main
//! thread has started a process (seen within [`WATCH_PERIOD`]) or the client a thread that
//! lives longer than [`LASTING_THREAD`], since what it starts would inherit the one CPU and a
//! client that works in parallel would be slowed.

use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rustix::process::{sched_getaffinity, sched_setaffinity, CpuSet, Pid};

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
        match sched_setaffinity(None, &only(cpu)) {
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

/// How many connections the daemon has placed on each CPU, so that concurrent clients are
/// spread over the CPUs instead of sharing the one they happened to start on; and the watched
/// clients' pins.
#[derive(Default)]
pub(crate) struct CpuUse {
    counts: Mutex<Vec<u32>>,
    watched: Arc<Watched>,
}

/// How often the pinned clients of watched placements are looked at for threads and processes
/// they started.
pub(crate) const WATCH_PERIOD: Duration = Duration::from_millis(5);

/// How long a watched client's new thread runs on the pinned CPU before the client's CPUs are
/// given back (within a [`WATCH_PERIOD`] more): long enough for a thread that ends with its
/// request, under load too.
const LASTING_THREAD: Duration = Duration::from_millis(20);

/// A client's pin, shared by its placement and the watcher; `None` once given back.
type SharedPin = Arc<Mutex<Option<ClientPin>>>;

/// A watched placement's pin, as the watcher holds it: gone once the placement ends.
type WatchedPin = Weak<Mutex<Option<ClientPin>>>;

/// The pins of watched placements, and whether a watcher thread runs (it ends when none is left).
#[derive(Default)]
struct Watched(Mutex<(Vec<WatchedPin>, bool)>);

impl Watched {
    /// Has `pin` looked at every [`WATCH_PERIOD`] until its placement ends; `false` if no
    /// watcher thread could be started.
    fn watch(self: &Arc<Self>, pin: &SharedPin) -> bool {
        let mut state = lock(&self.0);
        state.0.push(Arc::downgrade(pin));
        if !state.1 {
            let watched = Arc::clone(self);
            match std::thread::Builder::new().name("sluice-client-cpu".into()).spawn(move || watched.run()) {
                Ok(_) => state.1 = true,
                Err(e) => {
                    tracing::warn!("cannot start the thread that watches pinned clients: {e}; the client is not pinned");
                    state.0.pop();
                    return false;
                }
            }
        }
        true
    }

    /// Gives back the pin of each client that started a thread or a process, until no pin is
    /// left to watch.
    fn run(&self) {
        loop {
            std::thread::sleep(WATCH_PERIOD);
            let mut state = lock(&self.0);
            state.0.retain(|pin| {
                let Some(shared) = pin.upgrade() else { return false };
                let mut pin = lock(&shared);
                if pin.as_mut().is_some_and(ClientPin::started_something) {
                    *pin = None;
                }
                pin.is_some()
            });
            if state.0.is_empty() {
                state.1 = false;
                return;
            }
        }
    }
}

/// `mutex` locked, even if a thread panicked while holding it.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl CpuUse {
    /// Counts a connection on the CPU of `candidates` with the fewest, `preferred` on a tie.
    fn take(&self, candidates: &CpuSet, preferred: usize) -> Option<Taken<'_>> {
        let mut counts = lock(&self.counts);
        let count = |cpu: usize| counts.get(cpu).copied().unwrap_or(0);
        let cpu = (0..CpuSet::MAX_CPU).filter(|c| candidates.is_set(*c)).min_by_key(|c| (count(*c), *c != preferred, *c))?;
        if counts.len() <= cpu {
            counts.resize(cpu + 1, 0);
        }
        counts[cpu] += 1;
        Some(Taken { uses: self, cpu })
    }
}

/// One connection counted on `cpu` until dropped.
struct Taken<'a> {
    uses: &'a CpuUse,
    cpu: usize,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut counts = lock(&self.uses.counts);
        if let Some(n) = counts.get_mut(self.cpu) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Where a connection runs, undone when dropped: the client's affinity first, then the
/// worker's, then the CPU's count.
pub(crate) struct Placement<'a> {
    client: Option<SharedPin>,
    /// Whether the client's pin is given back as soon as it starts a thread or a process.
    watched: bool,
    _worker: Pinned,
    _taken: Taken<'a>,
}

impl Drop for Placement<'_> {
    fn drop(&mut self) {
        if let Some(client) = &self.client {
            lock(client).take();
        }
    }
}

impl<'a> Placement<'a> {
    /// Pins client process `pid` (its main thread) and the calling worker thread to one CPU:
    /// the least used (by this daemon's connections) of the CPUs both may run on, the client's
    /// current one on a tie. A client already confined to one CPU (e.g. `taskset -c 1`) is
    /// left as it is and the worker joins it. `None`, leaving both as they were, when the
    /// client's affinity is narrower than the worker's in any other way (someone chose it),
    /// when the client cannot be seen or changed (another pid namespace, another user's
    /// process for a daemon that is not root), or on one CPU. Only a process of the peer's
    /// `uid` (its effective uid) is touched: the pid from `SO_PEERCRED` is the one that
    /// connected, which may since have exited and been reused. `watched`: the client's pin is
    /// given back as soon as its main thread has started a thread or a process (see the module
    /// documentation); a client whose children cannot be seen is then not pinned.
    pub(crate) fn pin_client(uses: &'a CpuUse, pid: i32, uid: u32, watched: bool) -> Option<Placement<'a>> {
        let client = Pid::from_raw(pid)?;
        if std::fs::metadata(format!("/proc/{pid}")).ok()?.uid() != uid {
            return None;
        }
        let worker_cpus = sched_getaffinity(None).ok()?;
        let client_cpus = sched_getaffinity(Some(client)).map_err(|e| tracing::debug!("reading client {pid}'s CPU affinity: {e}")).ok()?;
        let current = client_cpu(pid)?;
        match placement(&worker_cpus, &client_cpus)? {
            Choice::JoinClient => {
                let taken = uses.take(&client_cpus, current)?;
                let worker = Pinned::to_cpu(taken.cpu as u64)?;
                Some(Placement { client: None, watched, _worker: worker, _taken: taken })
            }
            Choice::PinBoth => {
                let taken = uses.take(&worker_cpus, current)?;
                let client = Arc::new(Mutex::new(Some(ClientPin::new(client, client_cpus, taken.cpu, watched)?)));
                if watched && !uses.watched.watch(&client) {
                    return None;
                }
                let worker = Pinned::to_cpu(taken.cpu as u64)?;
                Some(Placement { client: Some(client), watched, _worker: worker, _taken: taken })
            }
        }
    }
}

impl Placement<'_> {
    /// Whether the client's pin was given back (it started a thread or a process); the worker's
    /// is kept until the placement is dropped.
    pub(crate) fn client_given_back(&self) -> bool {
        self.client.as_ref().is_some_and(|c| lock(c).is_none())
    }

    /// Whether the placement is watched (see [`Placement::pin_client`]).
    pub(crate) fn watched(&self) -> bool {
        self.watched
    }
}

/// What [`Placement::pin_client`] does for a client.
#[derive(Debug, PartialEq, Eq)]
enum Choice {
    /// The client is confined to one CPU the worker may use: the worker joins it.
    JoinClient,
    /// Both go to one of the worker's CPUs.
    PinBoth,
}

/// The placement for a client allowed on `client_cpus`, by a worker allowed on `worker_cpus`;
/// `None` for one CPU (nothing to gain) and for a client whose choice is narrower than the
/// worker's but not one CPU (someone chose it; it is not overridden).
fn placement(worker_cpus: &CpuSet, client_cpus: &CpuSet) -> Option<Choice> {
    if client_cpus.count() == 1 {
        let cpu = (0..CpuSet::MAX_CPU).find(|c| client_cpus.is_set(*c))?;
        return worker_cpus.is_set(cpu).then_some(Choice::JoinClient);
    }
    let narrower = (0..CpuSet::MAX_CPU).any(|c| worker_cpus.is_set(c) && !client_cpus.is_set(c));
    (worker_cpus.count() > 1 && !narrower).then_some(Choice::PinBoth)
}

/// The most processes looked at when undoing a client's pin.
const MAX_PROCESSES: usize = 65_536;

/// A client process's main thread pinned to `cpu` by the daemon; dropping it gives `previous`
/// back to that thread and to every thread and descendant process that inherited the pin
/// (born since, and still confined to exactly `cpu`). A descendant that the client's exit
/// handed to another parent keeps the pin.
struct ClientPin {
    pid: Pid,
    /// The main thread's start time, so that a reused pid is never touched.
    start: u64,
    /// When the pin was made (clock ticks since boot, as `/proc/<pid>/stat`'s start times).
    since: u64,
    previous: CpuSet,
    cpu: usize,
    /// For a watched pin, the client's threads and its main thread's children when it was
    /// made; empty otherwise.
    known: (Vec<i32>, Vec<i32>),
    /// The threads the watcher found new, each with when it first saw it.
    new_threads: Vec<(i32, Instant)>,
}

impl ClientPin {
    /// `watched`: the client's threads and children are noted first, `None` if its children
    /// cannot be listed (`/proc/<pid>/task/<pid>/children` needs `CONFIG_PROC_CHILDREN`).
    fn new(pid: Pid, previous: CpuSet, cpu: usize, watched: bool) -> Option<ClientPin> {
        let raw = pid.as_raw_nonzero().get();
        let start = task_stat(raw)?.start;
        let since = ticks_since_boot()?;
        let known = if watched { (tasks(raw), children(raw)?) } else { Default::default() };
        match sched_setaffinity(Some(pid), &only(cpu)) {
            Ok(()) => Some(ClientPin { pid, start, since, previous, cpu, known, new_threads: Vec::new() }),
            Err(e) => {
                tracing::debug!("cannot pin client {} to CPU {cpu}: {e}", pid.as_raw_nonzero());
                None
            }
        }
    }

    /// Whether, since it was pinned, the client's main thread has started a child, or the
    /// client a thread that the watcher has seen for [`LASTING_THREAD`] (Nix 2.8 starts a
    /// thread for each AddToStore's reply, which ends with the request), or its children can
    /// no longer be listed (it exited).
    fn started_something(&mut self) -> bool {
        let pid = self.pid.as_raw_nonzero().get();
        let now = Instant::now();
        let seen = std::mem::take(&mut self.new_threads);
        for tid in tasks(pid).into_iter().filter(|t| !self.known.0.contains(t)) {
            let first = seen.iter().find(|(t, _)| *t == tid).map_or(now, |(_, first)| *first);
            self.new_threads.push((tid, first));
        }
        let lasting = self.new_threads.iter().any(|(_, first)| now.duration_since(*first) >= LASTING_THREAD);
        lasting || children(pid).is_none_or(|c| c.iter().any(|p| !self.known.1.contains(p)))
    }

    /// Whether task `tid` (started at `start`) carries this pin: the pinned thread itself, or
    /// born since and confined to exactly the pinned CPU.
    fn carries_pin(&self, tid: i32, start: u64) -> bool {
        let ours = if tid == self.pid.as_raw_nonzero().get() { start == self.start } else { start >= self.since };
        ours && Pid::from_raw(tid).and_then(|t| sched_getaffinity(Some(t)).ok()).is_some_and(|set| set == only(self.cpu))
    }
}

impl Drop for ClientPin {
    fn drop(&mut self) {
        let root = self.pid.as_raw_nonzero().get();
        // The client and the processes born since the pin, by parent (`/proc` has no child lists here).
        let mut born_since: Vec<(i32, i32)> = Vec::new();
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for pid in entries.flatten().filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok()).take(MAX_PROCESSES) {
                if let Some(stat) = task_stat(pid).filter(|s| pid != root && s.start >= self.since) {
                    born_since.push((pid, stat.parent));
                }
            }
        }
        let mut stack = vec![root];
        let mut seen = 0;
        while let Some(process) = stack.pop() {
            seen += 1;
            if seen > MAX_PROCESSES {
                break;
            }
            for tid in tasks(process) {
                if task_stat(tid).is_some_and(|s| self.carries_pin(tid, s.start)) {
                    if let Err(e) = Pid::from_raw(tid).map_or(Ok(()), |t| sched_setaffinity(Some(t), &self.previous)) {
                        tracing::debug!("restoring task {tid}'s CPU affinity: {e}");
                    }
                }
            }
            stack.extend(born_since.iter().filter(|(_, parent)| *parent == process).map(|(child, _)| *child));
        }
    }
}

/// Whether process `pid` runs Nix: its executable is named `nix` (every command of Nix 2.x is
/// that one program) or `nix-…` (Nix 1's separate programs). `false` if it cannot be read
/// (another user's process, for a daemon that is not root).
pub(crate) fn runs_nix(pid: i32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|exe| exe.file_name()?.to_str().map(|name| name == "nix" || name.starts_with("nix-")))
        .unwrap_or(false)
}

/// The set of the one CPU `cpu`.
fn only(cpu: usize) -> CpuSet {
    let mut set = CpuSet::new();
    set.set(cpu);
    set
}

/// The ids of process `pid`'s threads.
fn tasks(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|entries| entries.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// The child processes of process `pid`'s main thread (`/proc/<pid>/task/<pid>/children`).
fn children(pid: i32) -> Option<Vec<i32>> {
    let list = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    Some(list.split_whitespace().filter_map(|c| c.parse().ok()).collect())
}

/// What the daemon reads of `/proc/<tid>/stat` (`man 5 proc`).
struct TaskStat {
    /// Field 4.
    parent: i32,
    /// Field 22, clock ticks since boot.
    start: u64,
    /// Field 39: the CPU it last ran on.
    cpu: usize,
}

fn task_stat(tid: i32) -> Option<TaskStat> {
    let stat = std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    // The fields after the parenthesised command name start with field 3 (state).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).copied();
    Some(TaskStat { parent: field(4)?.parse().ok()?, start: field(22)?.parse().ok()?, cpu: field(39)?.parse().ok()? })
}

/// The CPU process `pid` last ran on.
fn client_cpu(pid: i32) -> Option<usize> {
    task_stat(pid).map(|s| s.cpu).filter(|cpu| *cpu < CpuSet::MAX_CPU)
}

/// Now, in clock ticks since boot (`/proc/uptime`), rounded down.
fn ticks_since_boot() -> Option<u64> {
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let seconds: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    Some((seconds * rustix::param::clock_ticks_per_second() as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::process::{Child, Command};

    fn allowed() -> Vec<usize> {
        let set = sched_getaffinity(None).unwrap();
        (0..CpuSet::MAX_CPU).filter(|c| set.is_set(*c)).collect()
    }

    fn affinity_of(pid: u32) -> Vec<usize> {
        let set = sched_getaffinity(Pid::from_raw(pid as i32)).unwrap();
        (0..CpuSet::MAX_CPU).filter(|c| set.is_set(*c)).collect()
    }

    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn pins_and_restores() {
        let before = sched_getaffinity(None).unwrap();
        let first = allowed()[0];
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

    #[test]
    fn concurrent_connections_are_spread_over_the_cpus() {
        let uses = CpuUse::default();
        let mut both = CpuSet::new();
        both.set(0);
        both.set(1);
        let a = uses.take(&both, 1).unwrap();
        let b = uses.take(&both, 1).unwrap();
        assert_eq!((a.cpu, b.cpu), (1, 0));
        drop(a);
        assert_eq!(uses.take(&both, 0).unwrap().cpu, 1, "the CPU a connection left is the least used");
    }

    /// A client and a process it starts while pinned get their affinity back.
    #[test]
    fn a_pinned_client_and_what_it_started_get_their_affinity_back() {
        let cpus = allowed();
        if cpus.len() < 2 {
            eprintln!("skipped: one CPU");
            return;
        }
        // The shell starts its child only after the pin (it waits for the marker file).
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        let script = format!("while [ ! -e {0} ]; do sleep 0.01; done; sleep 30 & echo $! > {0}.child; wait", go.display());
        let client = Killed(Command::new("sh").arg("-c").arg(&script).spawn().unwrap());
        let uses = CpuUse::default();
        let placement = Placement::pin_client(&uses, client.0.id() as i32, rustix::process::geteuid().as_raw(), false).expect("placed");
        let cpu = rustix::process::sched_getcpu();
        assert_eq!(affinity_of(client.0.id()), vec![cpu], "the client joins the worker's CPU");
        std::fs::write(&go, "").unwrap();
        let child_file = dir.path().join("go.child");
        let child = loop {
            if let Some(pid) = std::fs::read_to_string(&child_file).ok().and_then(|s| s.trim().parse::<u32>().ok()) {
                break pid;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(affinity_of(child), vec![cpu], "the child inherited the pin");
        drop(placement);
        assert_eq!(affinity_of(client.0.id()), cpus);
        assert_eq!(affinity_of(child), cpus, "the child's affinity is restored too");
        assert_eq!(allowed(), cpus, "the worker's too");
        let _ = Command::new("kill").arg(child.to_string()).status();
    }

    /// A watched client that starts a process while connected gets its CPUs back, and so does
    /// the process, within a few watch periods and before the connection ends; the worker
    /// keeps its CPU until its placement is dropped.
    #[test]
    fn a_watched_client_gets_its_cpus_back_once_it_starts_a_process() {
        use std::io::{BufRead, Write};
        let cpus = allowed();
        if cpus.len() < 2 {
            eprintln!("skipped: one CPU");
            return;
        }
        // The shell waits (`read` is built in: it starts nothing) until told, then starts a child.
        let mut client = Killed(
            Command::new("sh")
                .args(["-c", "read go; sleep 30 & echo $!; wait"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let uses = CpuUse::default();
        let placement = Placement::pin_client(&uses, client.0.id() as i32, rustix::process::geteuid().as_raw(), true).expect("placed");
        let cpu = rustix::process::sched_getcpu();
        std::thread::sleep(WATCH_PERIOD * 4);
        assert_eq!(affinity_of(client.0.id()), vec![cpu], "pinned while it starts nothing");
        assert!(!placement.client_given_back());
        client.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut line = String::new();
        std::io::BufReader::new(client.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let child: u32 = line.trim().parse().unwrap();
        let start = std::time::Instant::now();
        while affinity_of(client.0.id()) != cpus || affinity_of(child) != cpus {
            assert!(start.elapsed() < WATCH_PERIOD * 200, "the client and its child still on CPU {cpu}");
            std::thread::sleep(WATCH_PERIOD);
        }
        assert!(placement.client_given_back());
        assert_eq!(allowed(), vec![cpu], "the worker keeps its CPU until the placement ends");
        drop(placement);
        assert_eq!(allowed(), cpus);
        let _ = Command::new("kill").arg(child.to_string()).status();
    }

    #[test]
    fn a_client_confined_to_one_cpu_is_left_alone() {
        let cpus = allowed();
        if cpus.len() < 2 {
            eprintln!("skipped: one CPU");
            return;
        }
        let last = *cpus.last().unwrap();
        let client = Killed(Command::new("taskset").args(["-c", &last.to_string(), "sleep", "30"]).spawn().unwrap());
        // taskset execs sleep once it has set the affinity.
        while affinity_of(client.0.id()) != vec![last] {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let uses = CpuUse::default();
        let placement = Placement::pin_client(&uses, client.0.id() as i32, rustix::process::geteuid().as_raw(), false)
            .expect("the worker joins the client");
        assert_eq!(allowed(), vec![last]);
        drop(placement);
        assert_eq!(affinity_of(client.0.id()), vec![last]);
        assert_eq!(allowed(), cpus);
    }

    /// Nix is known by its executable's name: `nix` (Nix 2) or `nix-…` (Nix 1), not by what
    /// it was started as.
    #[test]
    fn nix_is_known_by_its_executable() {
        let dir = tempfile::tempdir().unwrap();
        let sleep = Command::new("sh").args(["-c", "command -v sleep"]).output().unwrap();
        let sleep = std::fs::canonicalize(String::from_utf8(sleep.stdout).unwrap().trim()).unwrap();
        // Started, once it has left the test binary for its program.
        let started = |program: &Path| {
            // A copy just written may still be open for writing in a child that another test's
            // thread forked meanwhile, until that child execs: its exec fails with "text file
            // busy" (ETXTBSY) for that long, and is tried again.
            let spawn = || Command::new(program).arg("30").spawn();
            let child = (0..100)
                .map(|_| spawn())
                .find(|r| match r {
                    Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        false
                    }
                    _ => true,
                })
                .unwrap_or_else(spawn);
            let client = Killed(child.unwrap());
            let own = std::env::current_exe().unwrap();
            while std::fs::read_link(format!("/proc/{}/exe", client.0.id())).unwrap() == own {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            client
        };
        let named = |name: &str| {
            let copy = dir.path().join(name);
            std::fs::copy(&sleep, &copy).unwrap();
            started(&copy)
        };
        let linked = dir.path().join("nix-linked");
        std::os::unix::fs::symlink(&sleep, &linked).unwrap();
        for (client, nix) in [(named("nix"), true), (named("nix-store"), true), (named("nixos-rebuild"), false), (started(&linked), false)]
        {
            assert_eq!(runs_nix(client.0.id() as i32), nix, "{:?}", std::fs::read_link(format!("/proc/{}/exe", client.0.id())));
        }
        assert!(!runs_nix(std::process::id() as i32), "the test binary");
    }

    #[test]
    fn another_users_process_is_not_touched() {
        let client = Killed(Command::new("sleep").arg("30").spawn().unwrap());
        let other = rustix::process::geteuid().as_raw() + 1;
        assert!(Placement::pin_client(&CpuUse::default(), client.0.id() as i32, other, false).is_none());
    }

    #[test]
    fn only_a_client_free_to_run_anywhere_the_worker_may_is_moved() {
        let set = |cpus: &[usize]| {
            let mut s = CpuSet::new();
            cpus.iter().for_each(|c| s.set(*c));
            s
        };
        let four = set(&[0, 1, 2, 3]);
        assert_eq!(placement(&four, &four), Some(Choice::PinBoth));
        assert_eq!(placement(&four, &set(&[0, 1, 2, 3, 4])), Some(Choice::PinBoth), "a wider client");
        assert_eq!(placement(&four, &set(&[2])), Some(Choice::JoinClient));
        assert_eq!(placement(&four, &set(&[5])), None, "a CPU the worker may not use");
        assert_eq!(placement(&four, &set(&[1, 2])), None, "a client's own narrower choice");
        assert_eq!(placement(&set(&[1]), &four), None, "a daemon on one CPU");
    }
}
