//! sluice beside Nix's garbage collector, and after `kill -9`: the store stays consistent.
//!
//! * A collector loop (`nix-store --store ROOT --gc`, Nix 2.8, and Nix 2.26 through
//!   `shared/bin/nix-modern`) runs during a `sluice copy` of the corpus closure (1056 paths)
//!   and during a substitution through `sluice daemon` (`nix-store --store unix://… -r`).
//!   sluice must protect what it is adding the way Nix does (temporary roots in
//!   `<state>/temproots/<pid>`, flock-ed, announced through `gc-socket/socket` while a
//!   collection holds `gc.lock`; Nix's collector honours them by hash part) and keep its
//!   unpack trees out of the collector's reach. So: the copy succeeds, every closure path is
//!   valid, `nix-store --verify --check-contents` is clean, the collector deleted nothing, and
//!   nothing is left over.
//! * A copy killed with SIGKILL mid-flight leaves temporary trees; Nix's collector run after
//!   it leaves a consistent store; the next `sluice copy` removes them all, even one that
//!   copies a single other path; a full copy then completes and leaves nothing over.
//!
//! "Nothing left over" (see [`leftovers`]): the store directory `ROOT/nix/store` holds exactly
//! the valid paths (the `ValidPaths` table) and Nix's `.links`, nothing else — no temporary
//! trees or directories of them, no `.lock` files (Nix removes its own after substituting), no
//! other names.
//! Elsewhere under `ROOT` no file may remain outside Nix's own state (`db`, `gcroots`,
//! `profiles`, `temproots`, `gc-socket`, `gc.lock`, `daemon-socket`, `var/log`), apart
//! from empty `*.lock` files. `temproots/<pid>` files are not checked: Nix's collector removes
//! those of dead processes itself, so a check after a collector loop would prove nothing.
//!
//! Why the collector cannot delete the finished closure after the copy exits (when sluice's
//! temporary roots are gone): each test holds a temporary root on the top-level path for the
//! whole test, from a process of its own (`flock` holding `temproots/<pid>-holder`), as a
//! user's shell holding a result would. A permanent root (`gcroots/…` → top) is not enough:
//! a collection that reads the permanent roots while the top-level path is not valid yet
//! skips it, and if the copy then finishes and exits before that collection reads the
//! temporary roots, nothing protects the closure (Nix 2.26 was seen deleting all 1056 paths
//! this way; Nix's protocol assumes a permanent root is made while its path is valid or
//! temporarily rooted by a live process).
//!
//! What Nix's collector (2.8 and 2.26 alike, observed) does in the store directory: it deletes
//! every name that is not `.links` or a live path — `.lock` files (also of valid, rooted
//! paths), hidden names such as `.<name>.sluice`, any other name — except names whose hash
//! part is a temporary root: a root on `<hash>-x` also keeps `<hash>-x.lock` and `<hash>-y`,
//! but never a hidden `.<hash>-x…` (not parsed as a store path, so deleted unchecked).
//!
//! The copies fetch from nginx behind latency-proxy (RTT 20 ms, a few seconds for the
//! closure) so that at least 3 collections overlap each; a file:// copy took under a second.
//!
//! Each test runs once (`SLUICE_SOAK=N` repeats each N times) under hard timeouts. Soak:
//!
//!     SLUICE_SOAK=20 cargo test -p sluice --test integration gc_concurrency:: -- --test-threads 1 --nocapture

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::*;

/// Repetitions of each test: `SLUICE_SOAK` or 1.
fn reps() -> usize {
    std::env::var("SLUICE_SOAK").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(1)
}

/// A scratch directory under /tmp (the only host directory `nix-modern` sees besides /proc, /dev).
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("sluice-gc-").tempdir_in("/tmp").unwrap()
}

/// The corpus closure, from the ground truth.
fn closure() -> BTreeSet<String> {
    std::fs::read_to_string(corpus().join("truth/closure-paths.txt")).unwrap().lines().map(str::to_string).collect()
}

/// What a finished run must not leave under `root` (see the module comment), given the valid
/// paths: names in the store directory, then other files as paths relative to `root`.
fn leftovers(root: &Path, valid: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for name in store_entries(root) {
        if name == ".links" || valid.contains(&format!("/nix/store/{name}")) {
            continue;
        }
        out.push(name);
    }
    let nix_own = [
        "nix/store",
        "nix/var/nix/db",
        "nix/var/nix/gcroots",
        "nix/var/nix/profiles",
        "nix/var/nix/temproots",
        "nix/var/nix/gc-socket",
        "nix/var/nix/gc.lock",
        "nix/var/nix/daemon-socket",
        "nix/var/log",
    ];
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if nix_own.contains(&rel.as_str()) {
                continue;
            }
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                stack.push(p);
            } else if !(rel.ends_with(".lock") && meta.len() == 0) {
                out.push(rel);
            }
        }
    }
    out
}

/// At most `n` items of a list, for messages.
fn first<T: std::fmt::Debug>(items: impl IntoIterator<Item = T>, n: usize) -> String {
    let v: Vec<T> = items.into_iter().collect();
    let shown: Vec<&T> = v.iter().take(n).collect();
    format!("{} {shown:?}{}", v.len(), if v.len() > n { " …" } else { "" })
}

/// Problems with the store under `root` after a run that should have made the closure valid:
/// missing or extra valid paths, `nix-store --verify --check-contents` (Nix 2.8) not clean,
/// leftovers. Empty when all is well.
fn store_problems(tmp: &Path, root: &Path, what: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let valid = registered_paths(root);
    let want = closure();
    let missing: Vec<&String> = want.difference(&valid).collect();
    let extra: Vec<&String> = valid.difference(&want).collect();
    if !missing.is_empty() {
        problems.push(format!("{what}: {} of {} closure paths are not valid: {}", missing.len(), want.len(), first(&missing, 5)));
    }
    if !extra.is_empty() {
        problems.push(format!("{what}: valid paths outside the closure: {}", first(&extra, 5)));
    }
    let on_disk: BTreeSet<String> = store_entries(root).into_iter().map(|n| format!("/nix/store/{n}")).collect();
    let vanished: Vec<&String> = valid.difference(&on_disk).collect();
    if !vanished.is_empty() {
        problems.push(format!("{what}: {} valid paths are missing from the store directory: {}", vanished.len(), first(&vanished, 5)));
    }
    problems.extend(verify_problems(tmp, root, what));
    let left = leftovers(root, &valid);
    if !left.is_empty() {
        problems.push(format!("{what}: left over under the root: {}", first(&left, 8)));
    }
    problems
}

/// `nix-store --verify --check-contents` (Nix 2.8) on `root`: exit 0 and nothing on standard
/// error but its progress lines.
fn verify_problems(tmp: &Path, root: &Path, what: &str) -> Vec<String> {
    let o = nix(tmp, "nix-store", &["--store", root.to_str().unwrap(), "--verify", "--check-contents"]);
    let err = stderr(&o);
    let noise: Vec<&str> = err.lines().filter(|l| !(l.starts_with("reading the Nix store") || l.starts_with("checking "))).collect();
    if o.status.success() && noise.is_empty() {
        Vec::new()
    } else {
        vec![format!("{what}: nix-store --verify --check-contents: {} with {} other lines: {}", o.status, noise.len(), first(&noise, 6))]
    }
}

/// Panics listing every problem.
fn assert_no_problems(problems: &[String]) {
    assert!(problems.is_empty(), "{} problem(s):\n  {}", problems.len(), problems.join("\n  "));
}

/// Spawns `cmd` with standard output and error going to `<tmp>/<name>.out|.err`.
fn spawn_logged(mut cmd: Command, tmp: &Path, name: &str) -> (Child, PathBuf, PathBuf) {
    let (out, err) = (tmp.join(format!("{name}.out")), tmp.join(format!("{name}.err")));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    (child, out, err)
}

/// Waits for `child` until `deadline`; kills it (SIGKILL) and returns `None` past it.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Which Nix runs the collector.
#[derive(Clone, Copy, Debug)]
enum Collector {
    Nix2_8,
    Nix2_26,
    /// sluice's collector: Nix 2.8's `nix-store --gc` through a `sluice daemon` of its own
    /// (`<tmp>/collector.sock`), another process than the writers.
    Sluice,
}

/// The socket of the `sluice daemon` that collects for [`Collector::Sluice`].
fn collector_socket(tmp: &Path) -> PathBuf {
    tmp.join("collector.sock")
}

/// Starts `sluice daemon` on `socket` for the store `root`, logged under `tmp` as `name`, and
/// waits for its socket.
fn start_sluice_daemon(tmp: &Path, root: &Path, socket: &Path, config: &str, name: &str) -> (Child, PathBuf) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, config);
    cmd.args(["daemon", "--socket", socket.to_str().unwrap(), "--store", root.to_str().unwrap()]);
    let (daemon, _, err) = spawn_logged(cmd, tmp, name);
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the daemon did not create {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    (daemon, err)
}

fn nix_modern() -> PathBuf {
    shared().join("bin/nix-modern")
}

/// Whether Nix 2.26 runs through `nix-modern`, setting it up once if needed. `Err` gives the
/// reason to skip.
fn nix_modern_ready() -> Result<(), String> {
    let works =
        || Command::new(nix_modern()).args(["nix-store", "--version"]).current_dir("/tmp").output().is_ok_and(|o| o.status.success());
    if works() {
        return Ok(());
    }
    let o = Command::new(shared().join("bin/setup-nix-modern"))
        .current_dir("/tmp")
        .output()
        .map_err(|e| format!("cannot run setup-nix-modern: {e}"))?;
    if works() {
        Ok(())
    } else {
        Err(format!("nix-modern does not work after setup-nix-modern ({}): {}", o.status, stderr(&o).lines().last().unwrap_or("")))
    }
}

/// `nix-store --store ROOT ARGS` of the given Nix, isolated under `tmp`.
fn nix_store(tmp: &Path, which: Collector, root: &Path, args: &[&str]) -> Command {
    let mut cmd = match which {
        Collector::Nix2_8 | Collector::Sluice => Command::new("nix-store"),
        Collector::Nix2_26 => {
            let mut c = Command::new(nix_modern());
            c.arg("nix-store").current_dir(tmp);
            c
        }
    };
    isolate(&mut cmd, tmp, "");
    let store = match which {
        Collector::Sluice => format!("unix://{}", collector_socket(tmp).display()),
        _ => root.display().to_string(),
    };
    cmd.args(["--store", &store]).args(args);
    cmd
}

/// One `nix-store --gc`.
struct Collection {
    start: Instant,
    end: Instant,
    status: Option<ExitStatus>,
    /// The names it printed as `deleting '/nix/store/NAME'`.
    deleted: Vec<String>,
    stderr: String,
}

/// `nix-store --gc` of `which` on `root` (a hard limit of 60 s), logged under `tmp`.
fn collect(tmp: &Path, which: Collector, root: &Path, n: usize) -> Collection {
    let start = Instant::now();
    let (mut child, _, err) = spawn_logged(nix_store(tmp, which, root, &["--gc"]), tmp, &format!("gc-{n}"));
    let status = wait_until(&mut child, start + Duration::from_secs(60));
    let end = Instant::now();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    let deleted =
        stderr.lines().filter_map(|l| l.strip_prefix("deleting '/nix/store/")).map(|l| l.trim_end_matches('\'').to_string()).collect();
    let _ = std::fs::remove_file(&err);
    Collection { start, end, status, deleted, stderr }
}

/// A thread running the collector on a store again and again until stopped.
struct CollectorLoop {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Collection>>,
    /// The collecting `sluice daemon` of [`Collector::Sluice`].
    daemon: Option<Child>,
}

impl CollectorLoop {
    /// Starts the loop and returns after its first collection.
    fn start(tmp: &Path, which: Collector, root: &Path) -> CollectorLoop {
        let daemon =
            matches!(which, Collector::Sluice).then(|| start_sluice_daemon(tmp, root, &collector_socket(tmp), "", "collector-daemon").0);
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicBool::new(false));
        let (tmp, root, flag, first_done) = (tmp.to_path_buf(), root.to_path_buf(), stop.clone(), started.clone());
        let thread = std::thread::spawn(move || {
            let mut runs = Vec::new();
            while !flag.load(Ordering::SeqCst) {
                runs.push(collect(&tmp, which, &root, runs.len()));
                first_done.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(10));
            }
            runs
        });
        let t0 = Instant::now();
        while !started.load(Ordering::SeqCst) {
            assert!(t0.elapsed() < Duration::from_secs(70), "the first collection did not finish");
            std::thread::sleep(Duration::from_millis(10));
        }
        CollectorLoop { stop, thread, daemon }
    }

    /// Stops the loop (after the collection under way) and returns every collection.
    fn finish(self) -> Vec<Collection> {
        self.stop.store(true, Ordering::SeqCst);
        let runs = self.thread.join().expect("the collector thread panicked");
        if let Some(mut daemon) = self.daemon {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        runs
    }
}

/// Problems with the collections of a loop that ran while a run took `[from, to]`: fewer than 3
/// collections overlapping it, a failed collection, anything deleted.
fn collector_problems(runs: &[Collection], from: Instant, to: Instant, what: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let overlapping = runs.iter().filter(|c| c.start < to && c.end > from).count();
    let failed: Vec<String> = runs
        .iter()
        .filter(|c| !c.status.is_some_and(|s| s.success()))
        .map(|c| format!("{:?}: {}", c.status, c.stderr.lines().last().unwrap_or("")))
        .collect();
    // A directory of temporary trees is rooted from before it is made until it is removed:
    // deleting one is a problem too.
    let deleted: Vec<&String> = runs.iter().flat_map(|c| c.deleted.iter()).collect();
    let deleted_paths = deleted.iter().filter(|n| !n.starts_with('.') && !n.ends_with(".lock")).count();
    let deleted_hidden = deleted.iter().filter(|n| n.starts_with('.')).count();
    let deleted_locks = deleted.iter().filter(|n| n.ends_with(".lock")).count();
    eprintln!(
        "{what}: {} collections, {overlapping} overlapping the run ({:.2} s); deleted {} names: {deleted_paths} store paths, {deleted_hidden} hidden (temporary trees), {deleted_locks} .lock files",
        runs.len(),
        (to - from).as_secs_f64(),
        deleted.len()
    );
    if overlapping < 3 {
        problems.push(format!("{what}: only {overlapping} collections overlapped the run (want ≥ 3)"));
    }
    if !failed.is_empty() {
        problems.push(format!("{what}: collections failed: {}", first(&failed, 3)));
    }
    if !deleted.is_empty() {
        problems.push(format!(
            "{what}: the collector deleted {} names ({deleted_paths} store paths, {deleted_hidden} hidden, {deleted_locks} .lock): {}",
            deleted.len(),
            first(&deleted, 8)
        ));
    }
    problems
}

/// A collector loop (sluice's: Nix 2.8's `nix-store --gc` through a `sluice daemon` of its own)
/// during a storm of `nix-instantiate` runs (the
/// 100-derivation workload, two runs at a time, its store already filled) through
/// `sluice daemon`, beside a raw client that adds again texts that are valid but rooted by
/// nobody (garbage to the collector): every path the daemon told a client is valid stays
/// valid while that client is connected (the temporary root of each path is taken once per
/// connection, before the answer that reveals it). The raw client checks every path it was
/// given after each batch (IsValidPath, and the file); each `nix-instantiate` run, whose
/// client reads the `.drv` files it was told are valid from the store, succeeds with the same
/// derivation. Nix's own collectors (2.8, 2.26) fail this: a root that reaches their socket
/// for a path their walk of a closure has already passed is acknowledged, and the path is
/// deleted all the same (`deleteReferrersClosure` waits only on the one path it is at; fixed
/// upstream by 87716847d4, "gc: fix race where concurrent addTempRoot is ignored during
/// deletion", 2026): with Nix 2.8's, a run fails with "… has the input derivation
/// '…-pkg-35.drv', which is not valid", a derivation the daemon had just told it was valid.
#[test]
fn a_collector_loop_during_an_instantiate_storm_deletes_nothing_a_client_was_told_is_valid() {
    use crate::daemon::{add_text, is_valid, raw_client_on};
    for rep in 0..reps() {
        let tmp = scratch();
        let (tmp, root) = (tmp.path(), tmp.path().join("root"));
        let wl = tmp.join("wl");
        let o = Command::new(shared().join("bench/gen-instantiate-workload")).arg(&wl).arg("100").output().unwrap();
        check(&o, "gen-instantiate-workload");
        let instantiate = |store: &str| {
            let mut cmd = Command::new("nix-instantiate");
            isolate(&mut cmd, tmp, "");
            cmd.args(["--store", store]).arg(&wl).output().unwrap()
        };
        let o = instantiate(root.to_str().unwrap());
        check(&o, "nix-instantiate into the store");
        let drv = String::from_utf8(o.stdout).unwrap();
        let drv = drv.as_str();
        let socket = tmp.join("socket");
        let (mut daemon, _) = start_sluice_daemon(tmp, &root, &socket, "", "daemon");
        let texts: Vec<(String, String)> = (0..300).map(|i| (format!("text-{i}"), format!("text {i} of the storm\n"))).collect();
        let (mut first, _) = raw_client_on(&socket, 34);
        let expected: Vec<Vec<u8>> = texts.iter().map(|(name, text)| add_text(&mut first, name, text)).collect();
        drop(first);

        let collector = CollectorLoop::start(tmp, Collector::Sluice, &root);
        let from = Instant::now();
        let url = format!("unix://{}?root={}", socket.display(), root.display());
        let mut problems = Vec::new();
        std::thread::scope(|scope| {
            let storm: Vec<_> = (0..2).map(|_| scope.spawn(|| (0..3).map(|_| instantiate(&url)).collect::<Vec<Output>>())).collect();
            let (mut client, _) = raw_client_on(&socket, 34);
            let mut told: Vec<Vec<u8>> = Vec::new();
            for batch in texts.chunks(30) {
                for (name, text) in batch {
                    told.push(add_text(&mut client, name, text));
                }
                for path in &told {
                    let shown = String::from_utf8_lossy(path);
                    if is_valid(&mut client, path) != 1 || !root.join(shown.trim_start_matches('/')).is_file() {
                        problems.push(format!("{shown}: no longer valid after {} paths were told", told.len()));
                    }
                }
            }
            assert_eq!(told, expected, "the texts' paths");
            for (i, run) in storm.into_iter().flat_map(|t| t.join().expect("an instantiate thread panicked")).enumerate() {
                if !run.status.success() || run.stdout != drv.as_bytes() {
                    problems.push(format!("nix-instantiate run {i}: {}: {}", run.status, stderr(&run).trim_end()));
                }
            }
        });
        let to = Instant::now();
        let runs = collector.finish();
        let _ = daemon.kill();
        let _ = daemon.wait();
        let overlapping = runs.iter().filter(|c| c.start < to && c.end > from).count();
        let failed: Vec<String> = runs
            .iter()
            .filter(|c| !c.status.is_some_and(|s| s.success()))
            .map(|c| format!("{:?}: {}", c.status, c.stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | ")))
            .collect();
        let deleted: usize = runs.iter().map(|c| c.deleted.len()).sum();
        eprintln!(
            "run {rep}: {} collections, {overlapping} overlapping the storm, {} failed, {deleted} names deleted",
            runs.len(),
            failed.len()
        );
        assert!(overlapping >= 3 && failed.is_empty(), "{overlapping} collections overlapped the storm (want ≥ 3); failed: {failed:?}");
        assert!(deleted > 0, "the collector deleted nothing: the garbage texts were never at risk");
        assert_no_problems(&problems);
    }
}

/// A fresh store under `root` as Nix creates it (one Nix 2.8 collection), with a temporary
/// root on the top-level path held by a `flock` process until the returned holder is
/// dropped (see the module comment).
fn prepare_store(tmp: &Path, root: &Path) -> RootHolder {
    let mut cmd = nix_store(tmp, Collector::Nix2_8, root, &["--gc"]);
    check(&cmd.output().unwrap(), "the first nix-store --gc");
    let file = root.join(format!("nix/var/nix/temproots/{}-holder", std::process::id()));
    std::fs::write(&file, format!("{TOP}\0")).unwrap();
    let mut child = Command::new("flock")
        // --no-fork: the process killed is the one holding the lock, with no `sleep` left behind.
        .args(["--exclusive", "--no-fork", file.to_str().unwrap(), "-c", "echo locked; exec sleep 600"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("flock(1) from util-linux");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line, "locked\n");
    RootHolder(child)
}

/// The process holding the test's temporary root; killed when dropped.
struct RootHolder(std::process::Child);

impl Drop for RootHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sluice copy --json` of the corpus closure from the cache `from` into `root`.
fn copy_command(tmp: &Path, root: &Path, from: &str) -> Command {
    copy_paths_command(tmp, root, from, &[TOP])
}

/// `sluice copy --json` of the closures of `paths` from the cache `from` into `root`.
fn copy_paths_command(tmp: &Path, root: &Path, from: &str, paths: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    cmd.args(["copy", "--json", "--from", from, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key()]).args(paths);
    cmd
}

/// nginx serving the corpus's zstd cache behind latency-proxy (RTT 20 ms), which stretches a
/// copy of the closure from under a second (file://) to a few seconds, so that several
/// collections overlap it even when they are slow (Nix 2.26 through nix-modern, a busy machine).
fn slow_cache(tmp: &Path) -> CacheServer {
    CacheServer::start(&corpus().join("cache-zstd"), &tmp.join("srv"), &["--rtt-ms", "20"])
}

fn zstd_cache() -> String {
    format!("file://{}", corpus().join("cache-zstd").display())
}

/// Problems with a finished `sluice copy --json`: its exit status and its report.
fn copy_problems(status: Option<ExitStatus>, out: &Path, err: &Path, what: &str) -> Vec<String> {
    let report: Option<serde_json::Value> = std::fs::read(out).ok().and_then(|b| serde_json::from_slice(&b).ok());
    let failed = report.as_ref().and_then(|r| r["failed"].as_object().map(|m| m.len()));
    let substituted = report.as_ref().and_then(|r| r["substituted"].as_array().map(|a| a.len()));
    let errors: Vec<String> =
        std::fs::read_to_string(err).unwrap_or_default().lines().filter(|l| l.starts_with("error")).map(str::to_string).collect();
    eprintln!("{what}: {status:?}, substituted {substituted:?}, failed {failed:?}");
    let mut problems = Vec::new();
    match status {
        None => problems.push(format!("{what}: timed out")),
        Some(s) if !s.success() => problems.push(format!(
            "{what}: {s}; report: substituted {substituted:?}, failed {failed:?}; {} error lines: {}",
            errors.len(),
            first(&errors, 4)
        )),
        Some(_) => {}
    }
    problems
}

/// 1. The collector loop (Nix `which`) during `sluice copy` of the corpus closure.
fn collector_during_copy(which: Collector) {
    collector_during("copy", which, copy_command);
}

/// The collector loop (Nix `which`) during the copy `copier(tmp, root, cache URL)`.
fn collector_during(name: &str, which: Collector, copier: fn(&Path, &Path, &str) -> Command) {
    for rep in 0..reps() {
        let tmp = scratch();
        let (tmp, root) = (tmp.path(), tmp.path().join("root"));
        let _holder = prepare_store(tmp, &root);
        let server = slow_cache(tmp);
        let gc = CollectorLoop::start(tmp, which, &root);
        let from = Instant::now();
        let (mut child, out, err) = spawn_logged(copier(tmp, &root, &server.url), tmp, "copy");
        let status = wait_until(&mut child, from + Duration::from_secs(120));
        let to = Instant::now();
        let runs = gc.finish();
        let what = format!("{name} beside the {which:?} collector, run {rep}");
        let mut problems = copy_problems(status, &out, &err, &what);
        problems.extend(collector_problems(&runs, from, to, &what));
        problems.extend(store_problems(tmp, &root, &what));
        assert_no_problems(&problems);
    }
}

#[test]
fn copy_beside_nix_2_8_collector_loop() {
    collector_during_copy(Collector::Nix2_8);
}

#[test]
fn copy_beside_sluice_collector_loop() {
    collector_during_copy(Collector::Sluice);
}

#[test]
fn copy_beside_nix_2_26_collector_loop() {
    if let Err(reason) = nix_modern_ready() {
        eprintln!("SKIPPED: Nix 2.26 is not available: {reason}");
        return;
    }
    collector_during_copy(Collector::Nix2_26);
}

/// A baseline, not a requirement (ignored): real Nix 2.8's own `nix copy` through the same
/// harness. It is not safe either: on 2026-12-01 it failed after 50 s ("path
/// '…-staden-3.12.15' is not valid"), the collector having deleted 3 of its store paths and 1
/// `.lock` file in 607 collections (sluice at the time: hundreds of paths in 4 or 5). Why was
/// not analysed; one known collector-side race: Nix's collector checks a path's temporary root
/// while visiting it, not again before deleting it (NixOS/nix#15469, merged as #15992), so a
/// root added in between is ignored. A rare failure of the tests above after the GC-safety
/// change may therefore be the collector's; rerun with `SLUICE_SOAK` to tell.
///
///     cargo test -p sluice --test gc_concurrency baseline -- --ignored --nocapture
#[test]
#[ignore = "baseline: fails on Nix 2.8 itself (collector race), about a minute"]
fn baseline_nix_2_8_copy_beside_nix_2_8_collector_loop() {
    fn nix_copy(tmp: &Path, root: &Path, from: &str) -> Command {
        let mut cmd = Command::new("nix");
        isolate(&mut cmd, tmp, "");
        cmd.args(["copy", "--from", from, "--to", root.to_str().unwrap(), "--option", "trusted-public-keys", &corpus_key(), TOP]);
        cmd
    }
    collector_during("nix copy (baseline)", Collector::Nix2_8, nix_copy);
}

/// 2. The collector loop (Nix 2.8, and 2.26) during `nix-store --store unix://S -r TOP`
///    (Nix 2.8), which `sluice daemon` serves by substituting from the zstd cache (nginx,
///    RTT 20 ms).
#[test]
fn daemon_substitution_beside_nix_2_8_collector_loop() {
    daemon_substitution_beside(Collector::Nix2_8);
}

#[test]
fn daemon_substitution_beside_nix_2_26_collector_loop() {
    if let Err(reason) = nix_modern_ready() {
        eprintln!("SKIPPED: Nix 2.26 is not available: {reason}");
        return;
    }
    daemon_substitution_beside(Collector::Nix2_26);
}

/// 3. sluice's collector loop (another `sluice daemon`) during the same substitution.
#[test]
fn daemon_substitution_beside_sluice_collector_loop() {
    daemon_substitution_beside(Collector::Sluice);
}

fn daemon_substitution_beside(which: Collector) {
    for rep in 0..reps() {
        let tmp = scratch();
        let (tmp, root) = (tmp.path(), tmp.path().join("root"));
        let _holder = prepare_store(tmp, &root);
        let socket = tmp.join("socket");
        let server = slow_cache(tmp);
        let cache = server.url.clone();
        let key = corpus_key();
        let config = format!("substituters = {cache}\ntrusted-public-keys = {key}\n");
        let (mut daemon, daemon_err) = start_sluice_daemon(tmp, &root, &socket, &config, "daemon");
        let gc = CollectorLoop::start(tmp, which, &root);
        let store = format!("unix://{}", socket.display());
        let mut client = Command::new("nix-store");
        isolate(&mut client, tmp, "");
        client.args(["--store", &store, "-r", TOP, "--option", "substituters", &cache, "--option", "trusted-public-keys", &key]);
        let from = Instant::now();
        let (mut child, out, err) = spawn_logged(client, tmp, "client");
        let status = wait_until(&mut child, from + Duration::from_secs(120));
        let to = Instant::now();
        let runs = gc.finish();
        let what = format!("daemon substitution beside the {which:?} collector, run {rep}");
        let mut problems = Vec::new();
        let printed = std::fs::read_to_string(&out).unwrap_or_default();
        let client_err = std::fs::read_to_string(&err).unwrap_or_default();
        eprintln!("{what}: client {status:?}, printed {:?}", printed.trim());
        match status {
            None => problems.push(format!("{what}: the client timed out")),
            Some(s) if !s.success() => {
                let errors: Vec<&str> = client_err.lines().filter(|l| l.contains("error")).collect();
                problems.push(format!("{what}: nix-store -r: {s}: {}", first(&errors, 4)));
            }
            Some(_) if printed.trim() != TOP => problems.push(format!("{what}: nix-store -r printed {:?}", printed.trim())),
            Some(_) => {}
        }
        problems.extend(collector_problems(&runs, from, to, &what));
        problems.extend(store_problems(tmp, &root, &what));
        let _ = daemon.kill();
        let _ = daemon.wait();
        if !problems.is_empty() {
            let log = std::fs::read_to_string(&daemon_err).unwrap_or_default();
            let errors: Vec<&str> = log.lines().filter(|l| l.to_lowercase().contains("error")).collect();
            eprintln!("{what}: daemon log has {} error lines: {}", errors.len(), first(&errors, 4));
        }
        assert_no_problems(&problems);
    }
}

/// Paths of the closure without references (`fan_out` 0 in the ground truth's graph.tsv).
fn leaves() -> Vec<String> {
    let graph = std::fs::read_to_string(corpus().join("truth/graph.tsv")).unwrap();
    graph.lines().skip(1).map(|l| l.split('\t').collect::<Vec<_>>()).filter(|f| f[4] == "0").map(|f| f[0].to_string()).collect()
}

/// Lines of `err` that report a path copied.
fn copied_so_far(err: &Path) -> usize {
    std::fs::read_to_string(err).map(|t| t.lines().filter(|l| l.starts_with("copied path")).count()).unwrap_or(0)
}

/// 3. `kill -9` during a copy (slowed by nginx behind latency-proxy, RTT 20 ms) once at least
///    150 paths are copied; the leftovers are recorded. On a copy of that store, Nix 2.8's
///    collector (every valid path rooted) leaves it consistent. On the store itself, the next
///    `sluice copy`, of one leaf path only, removes every temporary tree of the killed run;
///    then a copy of the whole closure completes and leaves nothing over.
#[test]
fn kill_9_mid_copy_then_collector_then_rerun() {
    for rep in 0..reps() {
        let tmp = scratch();
        let tmp = tmp.path();
        let t_test = Instant::now();
        let stage = |name: &str| eprintln!("kill -9, run {rep}: {name} at {:.1} s", t_test.elapsed().as_secs_f64());
        let server = slow_cache(tmp);
        let what = format!("kill -9, run {rep}");
        stage("cache server up");
        let mut killed_store = None;
        for attempt in 0..3 {
            let root = tmp.join(format!("root-{attempt}"));
            let (mut child, _, err) = spawn_logged(copy_command(tmp, &root, &server.url), tmp, &format!("killed-{attempt}"));
            let t0 = Instant::now();
            // 150 paths reported copied (about half-way at RTT 20 ms), or 1.5 s if sluice
            // stops printing `copied path` lines; the check below wants some paths registered.
            while copied_so_far(&err) < 150 && child.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_millis(1500) {
                std::thread::sleep(Duration::from_millis(5));
            }
            let running = child.try_wait().unwrap().is_none();
            let _ = child.kill();
            let _ = child.wait();
            let valid = registered_paths(&root);
            eprintln!(
                "{what}, attempt {attempt}: killed after {:.2} s ({} paths printed as copied), {} valid",
                t0.elapsed().as_secs_f64(),
                copied_so_far(&err),
                valid.len()
            );
            if running && !valid.is_empty() && valid.len() < 1056 {
                killed_store = Some((root, valid));
                break;
            }
        }
        let (root, valid) = killed_store.expect("the copy was never killed mid-flight with some paths registered");

        let left = leftovers(&root, &valid);
        let hidden = left.iter().filter(|n| n.starts_with('.')).count();
        let locks = left.iter().filter(|n| n.ends_with(".lock")).count();
        let store_dirs = left.iter().filter(|n| !n.starts_with('.') && !n.ends_with(".lock") && !n.contains('/')).count();
        let elsewhere = left.iter().filter(|n| n.contains('/')).count();
        eprintln!(
            "{what}: after the kill, {} valid paths, {} leftovers: {hidden} hidden names, {locks} .lock files, {store_dirs} other store-dir names, {elsewhere} files elsewhere: {}",
            valid.len(),
            left.len(),
            first(&left, 8)
        );
        assert!(!left.is_empty(), "{what}: the kill left nothing behind, so the cleanup is not exercised");

        stage("killed");
        // Nix's collector on a copy of the killed store, every valid path rooted.
        let gc_root = tmp.join("gc-root");
        copy_dir(&root, &gc_root);
        for (i, p) in valid.iter().enumerate() {
            std::os::unix::fs::symlink(p, gc_root.join(format!("nix/var/nix/gcroots/keep-{i}"))).unwrap();
        }
        let c = collect(tmp, Collector::Nix2_8, &gc_root, 0);
        let mut problems = Vec::new();
        let not_leftover: Vec<&String> = c.deleted.iter().filter(|n| !left.contains(n)).collect();
        eprintln!(
            "{what}: the collector after the kill ({:?}) deleted {} names: {}; of them not among the leftovers: {}",
            c.status,
            c.deleted.len(),
            first(&c.deleted, 8),
            first(&not_leftover, 8)
        );
        if !c.status.is_some_and(|s| s.success()) {
            problems.push(format!("{what}: collector after the kill: {:?}: {}", c.status, c.stderr));
        }
        let after_gc = registered_paths(&gc_root);
        if after_gc != valid {
            problems.push(format!("{what}: the collector changed the valid paths: {} before, {} after", valid.len(), after_gc.len()));
        }
        problems.extend(verify_problems(tmp, &gc_root, &format!("{what}, collected copy")));
        let left_gc = leftovers(&gc_root, &after_gc);
        if !left_gc.is_empty() {
            problems.push(format!("{what}: left after Nix's collector: {}", first(&left_gc, 8)));
        }

        stage("collected and verified the copy");
        // The next run on the killed store copies one leaf path the killed run did not
        // register: it must remove the killed run's temporary trees, all of them, not only
        // the ones of paths it copies itself. (Stale `<path>.lock` files are tolerated here:
        // Nix too leaves those of a killed process until the path is next substituted or the
        // collector runs; the full rerun below must leave none.)
        let leaf = leaves().into_iter().find(|p| !valid.contains(p)).expect("a leaf path not yet valid");
        let (mut child, out, err) = spawn_logged(copy_paths_command(tmp, &root, &zstd_cache(), &[&leaf]), tmp, "next");
        let status = wait_until(&mut child, Instant::now() + Duration::from_secs(60));
        problems.extend(copy_problems(status, &out, &err, &format!("{what}, next run (one leaf)")));
        let now_valid = registered_paths(&root);
        if !now_valid.contains(&leaf) || now_valid.len() != valid.len() + 1 {
            problems.push(format!("{what}: after the next run, {} valid paths (want {} + the leaf {leaf})", now_valid.len(), valid.len()));
        }
        // Also tolerated here: a closure path's own directory, present but not registered (the
        // kill came between its rename into place and its registration; Nix leaves those too,
        // until it next substitutes the path).
        let closure = closure();
        let trees: Vec<String> = leftovers(&root, &now_valid)
            .into_iter()
            .filter(|n| !n.ends_with(".lock") && !closure.contains(&format!("/nix/store/{n}")))
            .collect();
        eprintln!("{what}: after the next run (one leaf), {} leftovers other than .lock files: {}", trees.len(), first(&trees, 8));
        if !trees.is_empty() {
            problems.push(format!("{what}: the next run (one leaf) left the killed run's temporary trees: {}", first(&trees, 8)));
        }

        stage("next run done");
        // The full rerun on the killed store itself.
        let from = Instant::now();
        let (mut child, out, err) = spawn_logged(copy_command(tmp, &root, &zstd_cache()), tmp, "rerun");
        let status = wait_until(&mut child, from + Duration::from_secs(120));
        problems.extend(copy_problems(status, &out, &err, &format!("{what}, rerun")));
        problems.extend(store_problems(tmp, &root, &format!("{what}, after the rerun")));
        stage("rerun verified");
        assert_no_problems(&problems);
    }
}

/// A directory of temporary trees in use (an addition unpacked into it, not committed) is kept
/// by Nix 2.8's, Nix 2.26's and sluice's collectors, while one a killed run left beside it (its
/// hash part rooted by nobody, its lock free) is deleted by each; the addition then completes
/// and its directory goes with it: the store directory holds the path and `.links` only.
/// Nix 2.26's own temporary directory (`tmp-<pid>-<n>`), locked by its holder, is kept by
/// 2.26's collector and sluice's, and deleted by 2.8's, which deletes every name that is not a
/// store path (why sluice's directories are named like store paths and rooted).
#[test]
fn collectors_keep_a_directory_of_temporary_trees_in_use_and_delete_a_dead_one() {
    use sluice_local_store::{is_temp_dir, LocalStore, SignaturePolicy};
    use sluice_nix::hash::{Hash, HashAlgo};
    let tmp = scratch();
    let tmp = tmp.path();
    let root = tmp.join("root");
    let store = Arc::new(LocalStore::open(&sluice_store::store_url::LocalStoreConfig::with_root(&root)).unwrap());
    let nar = sluice_nix::nar::writer::regular_file_nar(b"in flight", false);
    let narinfo = format!(
        "StorePath: /nix/store/4g4g4g4g4g4g4g4g4g4g4g4g4g4g4g4g-in-flight\nURL: nar/x.nar\nCompression: none\nNarHash: {}\nNarSize: {}\nReferences: \n",
        Hash::digest_bytes(HashAlgo::Sha256, &nar).to_nix32_prefixed(),
        nar.len()
    );
    let info =
        sluice_nix::path_info::ValidPathInfo::from_narinfo(&sluice_nix::narinfo::NarInfo::parse(&Default::default(), &narinfo).unwrap(), 0);
    let roots = store.temp_roots();
    let mut pending = store.begin_add(info.clone(), &roots).unwrap().unwrap();
    pending.unpack(&mut nar.as_slice()).unwrap();
    let store_dir = root.join("nix/store");
    let temp_dirs = || store_entries(&root).into_iter().filter(|e| is_temp_dir(e)).collect::<Vec<_>>();
    let live = temp_dirs();
    assert_eq!(live.len(), 1, "{live:?}");
    let tree = store_dir.join(&live[0]).join(info.path.base_name());
    let mut collectors = vec![Collector::Nix2_8, Collector::Sluice];
    match nix_modern_ready() {
        Ok(()) => collectors.push(Collector::Nix2_26),
        Err(why) => eprintln!("skipping Nix 2.26: {why}"),
    }
    // What each collection did, looked at once the collecting daemon is stopped.
    let mut daemon = start_sluice_daemon(tmp, &root, &collector_socket(tmp), "", "collector-daemon").0;
    let mut runs = Vec::new();
    for (n, which) in collectors.into_iter().enumerate() {
        let dead = format!("{n}{}-sluice-unpacking", "5h".repeat(15) + "5");
        std::fs::create_dir_all(store_dir.join(&dead).join("left")).unwrap();
        let nix_tmp = format!("tmp-{}-{n}", std::process::id());
        std::fs::create_dir(store_dir.join(&nix_tmp)).unwrap();
        let held = std::fs::File::open(store_dir.join(&nix_tmp)).unwrap();
        // SAFETY: flock on an open file descriptor.
        #[allow(unsafe_code)] // a libc call the test drives processes or files with
        let r = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) };
        assert_eq!(r, 0);
        let c = collect(tmp, which, &root, n);
        let kept = (tree.is_file(), store_dir.join(&dead).exists(), store_dir.join(&nix_tmp).exists());
        let _ = std::fs::remove_dir(store_dir.join(&nix_tmp));
        runs.push((which, c, kept, dead, nix_tmp));
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
    for (which, c, (tree_kept, dead_kept, nix_tmp_kept), dead, nix_tmp) in runs {
        assert!(c.status.is_some_and(|s| s.success()), "{which:?}: {}", c.stderr);
        assert!(tree_kept, "{which:?} deleted the tree in use ({:?}): {}", c.deleted, c.stderr);
        assert!(!dead_kept, "{which:?} kept a dead directory of temporary trees: {}", c.stderr);
        let nix_2_8 = matches!(which, Collector::Nix2_8);
        assert_eq!(nix_tmp_kept, !nix_2_8, "{which:?}: the locked {nix_tmp}");
        let mut deleted = c.deleted.clone();
        deleted.sort();
        let expected = if nix_2_8 { vec![dead, nix_tmp] } else { vec![dead] };
        assert_eq!(deleted, expected, "{which:?}");
    }
    pending.commit(&SignaturePolicy::unchecked()).unwrap();
    drop(roots);
    let mut left = store_entries(&root);
    left.sort();
    assert_eq!(left, [".links".to_owned(), info.path.base_name().to_owned()]);
}
