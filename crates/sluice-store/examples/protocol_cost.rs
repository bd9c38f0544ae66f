//! The CPU that Nix's local-store protocol itself demands to substitute a closure, on one core:
//! what any client sharing a store with Nix does per path besides creating the path's files,
//! and besides the binary-cache format (`format_cost.rs`). Every path of a `file://` cache's
//! narinfos is added to a fresh store, with its store path and references but a minimal NAR of
//! its own (one empty regular file, with that NAR's NarHash and NarSize), so that the tree
//! made is as small as it can be and what is left is the protocol.
//!
//!   cargo run --release -p sluice-store --example protocol_cost -- CACHE_DIR WORK_DIR
//!
//! CACHE_DIR is a `file://` binary cache (every `*.narinfo` in it is one path; the NAR files
//! are not read), WORK_DIR an empty directory on the file system to measure (tmpfs, to leave
//! the disk out), in which each run makes its store and removes it afterwards. The paths are
//! added in dependency order (references first), in batches of 512 (the registrar's
//! `COMMIT_BATCH`, `substitute.rs`), through the functions `sluice copy` uses, on this one
//! thread, 5 times, each time into a new store (`local?root=WORK_DIR/run-<n>`, opened before
//! the timing). Signatures are not checked (`SignaturePolicy::unchecked`: they are the
//! format's cost) and the paths are vouched for before the timing, as the closure walk does.
//! Per batch:
//!
//! 1. begin: `LocalStore::try_begin_add_vouched` for each path: the temporary root (written to
//!    `temproots/<pid>-<n>` under a shared `gc.lock`), the per-path lock (`<path>.lock`: open,
//!    `flock`, `fstat`), the validity check under the lock (SQLite), the temporary directory
//!    (made and opened at the first path, `fstat`ed after);
//! 2. unpack: `PendingPath::unpack` of the minimal NAR: parse, sha256, the file made in the
//!    temporary directory with the store's metadata (`openat`, `futimens`, `close`);
//! 3. commit: `LocalStore::commit_all` of the batch: verification, the references' validity,
//!    the rename into place, one `syncfs`, one SQLite transaction (ValidPaths and Refs rows),
//!    and each path's lock released (unlink, write, `close`);
//! 4. the sum of 1–3, median over the runs of each run's sum;
//! 5. the floor: N empty files made in a new directory of WORK_DIR (`openat` with
//!    `O_CREAT|O_EXCL`, `futimens` to mtime 1 as `tar -x` restores mtimes, `close`): the
//!    file creation a `tar -x` of the store trees would do too;
//! 6. 4 − 5: the protocol's own cost.
//!
//! Printed: the median thread CPU time (`CLOCK_THREAD_CPUTIME_ID`) and wall time of each
//! stage, over all paths and per path, as a markdown table. Exits non-zero if a path is not
//! added (found valid or busy, or its commit fails), if a path is not registered afterwards
//! with its references and NAR hash, or if another thread of the process spent CPU during a
//! run (the figures would not be one core's).
// A measurement tool, not library code: it stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::cpu_time;

use rustix::fs::{futimens, openat, Mode, OFlags, Timespec, Timestamps, UTIME_OMIT};
use sluice_local_store::{LocalStore, SignaturePolicy, TryAdd, VouchedInfo};
use sluice_nix::hash::{HashAlgo, Hasher};
use sluice_nix::nar::writer::regular_file_nar;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::store_url::LocalStoreConfig;

/// `sluice`'s allocator (`crates/sluice/src/main.rs`), so that allocations cost what they do
/// in `sluice copy`.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Runs, each into a new store; the median is printed.
const RUNS: usize = 5;

/// Most paths committed at once: the registrar's `COMMIT_BATCH` (`substitute.rs`).
const BATCH: usize = 512;

/// Reads the infos of the cache's narinfos, each with the NAR hash and size of `nar` instead
/// of its own and without its content address (which `nar` would not match), in dependency
/// order: every path after its references. Fails if a reference is not in the cache or a
/// path is a derivation (whose commit would parse `nar` as one).
fn load(dir: &Path, store_dir: &StoreDir, nar: &[u8]) -> Result<Vec<ValidPathInfo>, String> {
    let mut hasher = Hasher::new(HashAlgo::Sha256);
    hasher.update(nar);
    let nar_hash = hasher.finish();
    let mut infos = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let name = entry.map_err(|e| format!("{}: {e}", dir.display()))?.file_name();
        let Some(name) = name.to_str().filter(|n| n.ends_with(".narinfo")) else {
            continue;
        };
        let text = std::fs::read_to_string(dir.join(name)).map_err(|e| format!("{name}: {e}"))?;
        let narinfo = NarInfo::parse(store_dir, &text).map_err(|e| format!("{name}: {e}"))?;
        if narinfo.store_path.is_derivation() {
            return Err(format!("{name}: a derivation, whose minimal NAR would not parse as one"));
        }
        let info =
            ValidPathInfo { nar_hash: nar_hash.clone(), nar_size: nar.len() as u64, ca: None, ..ValidPathInfo::from_narinfo(&narinfo, 0) };
        infos.insert(info.path.clone(), info);
    }
    let mut order = Vec::with_capacity(infos.len());
    let mut done = BTreeSet::new();
    for path in infos.keys() {
        visit(path, &infos, &mut done, &mut order, store_dir)?;
    }
    Ok(order)
}

/// Appends `path` to `order` after its references (depth first), unless it is in `done`.
fn visit(
    path: &StorePath,
    infos: &BTreeMap<StorePath, ValidPathInfo>,
    done: &mut BTreeSet<StorePath>,
    order: &mut Vec<ValidPathInfo>,
    store_dir: &StoreDir,
) -> Result<(), String> {
    if !done.insert(path.clone()) {
        return Ok(());
    }
    let info = &infos[path];
    for r in info.references.iter().filter(|r| *r != path) {
        if !infos.contains_key(r) {
            return Err(format!("{}: its reference {} is not in the cache", store_dir.display_path(path), store_dir.display_path(r)));
        }
        visit(r, infos, done, order, store_dir)?;
    }
    order.push(info.clone());
    Ok(())
}

/// Thread CPU and wall time spent in a stage, summed over its parts, and the CPU other
/// threads of the process spent meanwhile.
#[derive(Default, Clone, Copy)]
struct Spent {
    cpu: Duration,
    wall: Duration,
    others: Duration,
}

impl Spent {
    /// Runs `part` and adds its times.
    fn time<T>(&mut self, part: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
        let (thread0, process0, wall0) =
            (cpu_time(libc::CLOCK_THREAD_CPUTIME_ID), cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID), Instant::now());
        let result = part();
        let (wall, thread, process) =
            (wall0.elapsed(), cpu_time(libc::CLOCK_THREAD_CPUTIME_ID) - thread0, cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID) - process0);
        self.cpu += thread;
        self.wall += wall;
        self.others += process.saturating_sub(thread);
        result
    }

    /// Fails if other threads spent more than 1 % of this thread's CPU, plus 0.1 ms.
    fn one_core(&self, name: &str) -> Result<(), String> {
        match self.others > self.cpu / 100 + Duration::from_micros(100) {
            true => {
                Err(format!("{name}: other threads spent {:?} of CPU beside this one's {:?}: not one core's cost", self.others, self.cpu))
            }
            false => Ok(()),
        }
    }
}

/// What one run spent in stages 1–3, and in the floor (stage 5).
struct Run {
    begin: Spent,
    unpack: Spent,
    commit: Spent,
    floor: Spent,
}

/// Adds every path of `infos` (in order) to a new store under `root`, timing each stage,
/// then makes as many empty files in `root/files`; removes `root` afterwards.
fn run(root: &Path, infos: &[ValidPathInfo], nar: &[u8], policy: &SignaturePolicy, store_dir: &StoreDir) -> Result<Run, String> {
    let store = std::sync::Arc::new(LocalStore::open(&LocalStoreConfig::with_root(root)).map_err(|e| e.to_string())?);
    let roots = store.temp_roots();
    let vouched: Vec<VouchedInfo> =
        infos.iter().map(|i| policy.vouch_info(store_dir, i.clone())).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let (mut begin, mut unpack, mut commit) = (Spent::default(), Spent::default(), Spent::default());
    let mut vouched = vouched.into_iter();
    for n in (0..infos.len()).step_by(BATCH) {
        let batch: Vec<VouchedInfo> = vouched.by_ref().take(BATCH).collect();
        let mut pending = begin.time(|| {
            batch
                .into_iter()
                .map(|v| {
                    let shown = store_dir.display_path(&v.info().path);
                    match store.try_begin_add_vouched(v, &roots) {
                        Ok(TryAdd::Pending(p)) => Ok(*p),
                        Ok(TryAdd::Valid) => Err(format!("{shown}: valid in a new store")),
                        Ok(TryAdd::Busy) => Err(format!("{shown}: locked by another process")),
                        Err(e) => Err(e.to_string()),
                    }
                })
                .collect::<Result<Vec<_>, _>>()
        })?;
        unpack.time(|| pending.iter_mut().try_for_each(|p| p.unpack(&mut &nar[..]).map(drop).map_err(|e| e.to_string())))?;
        let results = commit.time(|| Ok(store.commit_all(pending.into_iter().map(|p| (p, policy)).collect())))?;
        if let Some((i, e)) = results.into_iter().enumerate().find_map(|(i, r)| Some((i, r.err()?))) {
            return Err(format!("{}: {}", store_dir.display_path(&infos[n + i].path), e.into_error()));
        }
    }
    let paths: Vec<StorePath> = infos.iter().map(|i| i.path.clone()).collect();
    for (info, registered) in infos.iter().zip(store.query_path_infos(&paths)) {
        let shown = store_dir.display_path(&info.path);
        match registered.map_err(|e| e.to_string())? {
            Some(r) if r.references == info.references && r.nar_hash == info.nar_hash => {}
            Some(_) => return Err(format!("{shown}: registered with other references or NAR hash")),
            None => return Err(format!("{shown}: not valid after its commit")),
        }
    }
    drop((roots, store));

    let files = root.join("files");
    std::fs::create_dir(&files).map_err(|e| format!("{}: {e}", files.display()))?;
    let dir = std::fs::File::open(&files).map_err(|e| format!("{}: {e}", files.display()))?;
    let mtime =
        Timestamps { last_access: Timespec { tv_sec: 0, tv_nsec: UTIME_OMIT }, last_modification: Timespec { tv_sec: 1, tv_nsec: 0 } };
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
    let mut floor = Spent::default();
    floor.time(|| {
        infos.iter().try_for_each(|i| {
            let fd =
                openat(&dir, i.path.base_name(), flags, Mode::from_raw_mode(0o444)).map_err(|e| format!("{}: {e}", i.path.base_name()))?;
            futimens(&fd, &mtime).map_err(|e| format!("{}: {e}", i.path.base_name()))
        })
    })?;
    std::fs::remove_dir_all(root).map_err(|e| format!("removing {}: {e}", root.display()))?;
    for (name, spent) in [("begin", &begin), ("unpack", &unpack), ("commit", &commit), ("floor", &floor)] {
        spent.one_core(name)?;
    }
    Ok(Run { begin, unpack, commit, floor })
}

/// The median of `runs`' `stage`, in ms of thread CPU and of wall.
fn median(runs: &[Run], stage: impl Fn(&Run) -> Spent) -> (f64, f64) {
    let ms = |f: &dyn Fn(&Spent) -> Duration| {
        let mut ms: Vec<f64> = runs.iter().map(|r| f(&stage(r)).as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        ms[ms.len() / 2]
    };
    (ms(&|s| s.cpu), ms(&|s| s.wall))
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, cache, work] = args.as_slice() else {
        return Err("usage: protocol_cost CACHE_DIR WORK_DIR".into());
    };
    let store_dir = StoreDir::default();
    let nar = regular_file_nar(b"", false);
    let infos = load(Path::new(cache), &store_dir, &nar)?;
    let policy = SignaturePolicy::unchecked();
    let runs = (0..RUNS)
        .map(|n| run(&Path::new(work).join(format!("run-{n}")), &infos, &nar, &policy, &store_dir))
        .collect::<Result<Vec<_>, _>>()?;

    let sum = |r: &Run| Spent {
        cpu: r.begin.cpu + r.unpack.cpu + r.commit.cpu,
        wall: r.begin.wall + r.unpack.wall + r.commit.wall,
        others: Duration::ZERO,
    };
    let (total, floor) = (median(&runs, sum), median(&runs, |r| r.floor));
    let n = infos.len();
    let references: usize = infos.iter().map(|i| i.references.len()).sum();
    println!("{n} paths ({references} Refs rows), each a NAR of {} bytes (one empty file); batches of {BATCH}; one thread, median of {RUNS} runs, a new store each\n", nar.len());
    println!("| stage | thread CPU ms | CPU µs/path | wall ms | wall µs/path |");
    println!("|---|---|---|---|---|");
    let stages = [
        ("1. begin (temp root, lock, validity, temp dir)", median(&runs, |r| r.begin)),
        ("2. unpack of the minimal NAR", median(&runs, |r| r.unpack)),
        ("3. commit (rename, syncfs, SQLite, unlock)", median(&runs, |r| r.commit)),
        ("4. total of 1–3", total),
        ("5. floor: as many empty files", floor),
        ("6. protocol beyond the files (4 − 5)", (total.0 - floor.0, total.1 - floor.1)),
    ];
    for (name, (cpu, wall)) in stages {
        println!("| {name} | {cpu:.2} | {:.1} | {wall:.2} | {:.1} |", cpu * 1e3 / n as f64, wall * 1e3 / n as f64);
    }
    Ok(())
}
