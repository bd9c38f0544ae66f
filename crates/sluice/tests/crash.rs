//! Crashes: `sluice copy` of the corpus closure is killed with SIGKILL at
//! many moments, each run continuing the previous one's store; a final run completes. Then
//! real Nix's `nix-store --verify --check-contents` is clean, every path of the closure is
//! valid, and no temporary tree (`.<name>.sluice`) or `.lock` file remains.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// Kill moments, in ms after the start: spread over a copy's whole run (a few ms: opening the
/// store; later: mid-download, mid-unpack, mid-registration), in a fixed pseudo-random order.
fn delays(n: usize, max_ms: u64) -> Vec<u64> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let span = max_ms * (i as u64 + 1) / n as u64;
            5 + x % span.max(1)
        })
        .collect()
}

/// Runs killed mid-copy that [`kill_9_at_random_moments_then_rerun`] asks for.
const KILLS: usize = 20;

/// The store of a copy that completed after crashes is complete, and clean for Nix.
fn assert_complete_and_clean(tmp: &std::path::Path, root: &std::path::Path) {
    assert_eq!(nix_path_info(tmp, root.to_str().unwrap(), TOP).len(), 1056);
    assert_nix_verifies(tmp, root);
    assert_eq!(store_leftovers(root), Vec::<String>::new());
    assert_eq!(registered_rows(root), (1056, 1056));
}

#[test]
fn kill_9_at_random_moments_then_rerun() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", corpus().join("cache-xz").display());
    let args = |root: &std::path::Path| {
        ["copy", "--substituters", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP].map(str::to_owned)
    };
    // The kill moments are spread over what a whole copy takes with this build on this machine
    // (a fixed span would outlast most copies of a release build on a fast one): the shorter
    // of two, as the first reads the cache's files from the disk.
    let mut whole = (0..2)
        .map(|_| {
            let scratch = tempfile::tempdir().unwrap();
            let start = Instant::now();
            check(&sluice(scratch.path(), &args(&scratch.path().join("root")).each_ref().map(String::as_str)), "a whole copy");
            start.elapsed().as_millis() as u64
        })
        .min()
        .unwrap();
    // Each run continues the previous one's store, killed at its moment: a fraction of the
    // whole copy's time, the fractions spread over the whole run. A run that completes before
    // its moment (the whole copy measured on a loaded machine outlasts the runs that follow)
    // leaves a store that is checked, and the next runs start a new one, the same moment
    // again; a run that completes from an empty store is the whole copy's time from then on.
    let fractions = delays(KILLS, 1000);
    let (mut killed, mut stores, mut runs, mut fresh) = (0, 0, 0, true);
    let mut root = tmp.path().join("root0");
    while killed < KILLS {
        runs += 1;
        assert!(runs <= 3 * KILLS, "only {killed} of {runs} runs were killed mid-copy");
        let delay = (whole * fractions[killed] / 1000).max(5);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        let mut child = cmd.args(args(&root)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(delay) {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let running = child.try_wait().unwrap().is_none();
        if running {
            child.kill().unwrap();
            killed += 1;
        }
        let status = child.wait().unwrap();
        eprintln!("store {stores}: {delay} ms of {whole}, {status}");
        if running {
            fresh = false;
            continue;
        }
        assert!(status.success(), "a run that was not killed failed: {status}");
        assert_complete_and_clean(tmp.path(), &root);
        if fresh {
            whole = whole.min(start.elapsed().as_millis() as u64);
        }
        (stores, fresh) = (stores + 1, true);
        root = tmp.path().join(format!("root{stores}"));
    }
    check(&sluice(tmp.path(), &args(&root).each_ref().map(String::as_str)), "the rerun after the crashes");
    assert_complete_and_clean(tmp.path(), &root);
}

/// A run killed while releasing the locks of a batch it had just registered (references
/// first) leaves lock files on valid paths that the next run's closure walk never reaches (the
/// references of a valid path are not walked). Every path of the corpus closure is given such
/// a lock file, one of them held by another process: a rerun that finds the closure valid
/// removes all but the held one (only the top path's went before, and the kill test found 9
/// left on a batch's paths).
#[test]
fn lock_files_left_on_a_registered_batch_are_removed_by_the_next_run() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let url = format!("file://{}", corpus().join("cache-xz").display());
    let args = ["copy", "--substituters", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP];
    check(&sluice(tmp.path(), &args), "the copy");
    let closure = std::fs::read_to_string(corpus().join("truth/closure-paths.txt")).unwrap();
    let locks: Vec<_> =
        closure.lines().map(|p| root.join("nix/store").join(format!("{}.lock", p.trim_start_matches("/nix/store/")))).collect();
    assert_eq!(locks.len(), 1056);
    for lock in &locks {
        std::fs::File::create(lock).unwrap();
    }
    // Held as Nix's `lockFile` holds one, by a process that is adding the path.
    let held = std::fs::File::open(&locks[500]).unwrap();
    #[allow(unsafe_code)] // a libc call the test drives processes or files with
    let r = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(r, 0);
    let o = sluice(tmp.path(), &args);
    check(&o, "the rerun");
    assert!(stderr(&o).contains("copied 0 paths"), "{}", stderr(&o));
    let name = locks[500].file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(store_leftovers(&root), vec![name]);
    drop(held);
}

/// When the signals of [`a_signal_stops_a_copy_and_leaves_the_store_closed`] are sent.
enum Moment {
    /// Once this many paths are in place.
    Placed(usize),
    /// This long after the start.
    After(Duration),
}

/// SIGINT, SIGTERM or SIGHUP while a copy runs: from nginx at RTT 50 ms (NARs unpacked on
/// tokio's blocking threads) and from a `file://` cache (NARs unpacked on the unpacking
/// threads), once 50 paths are in place, so that others are being downloaded, unpacked and
/// registered at that moment; a second Ctrl-C 20 ms after the first (while the copy stops);
/// and a SIGTERM 300 ms in from a cache at RTT 500 ms, while the copy opens its caches. Each
/// copy says Nix's `interrupted by the user`, fails, and leaves the store as a finished
/// command leaves it (Nix's substitution goals clean up as they are interrupted): no temporary
/// root, the database closed, no temporary tree, no lock file and no unregistered tree at a
/// store path; what it registered is valid to real Nix. Before, the copy left its temporary
/// roots, the database's write-ahead log and the lock files and trees of the paths in flight,
/// a second signal killed it in the middle of stopping, and a signal before the caches were
/// open killed it outright.
#[test]
fn a_signal_stops_a_copy_and_leaves_the_store_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-zstd"), &tmp.path().join("srv"), &["--rtt-ms", "50"]);
    let slow = CacheServer::start(&corpus().join("cache-zstd"), &tmp.path().join("slow"), &["--rtt-ms", "500"]);
    let file = format!("file://{}", corpus().join("cache-zstd").display());
    let (int, term, hup) = (libc::SIGINT, libc::SIGTERM, libc::SIGHUP);
    let cases: [(&str, &str, Moment, &[i32]); 6] = [
        ("SIGINT", &server.url, Moment::Placed(50), &[int]),
        ("SIGTERM", &server.url, Moment::Placed(50), &[term]),
        ("SIGHUP", &server.url, Moment::Placed(50), &[hup]),
        ("SIGINT-file", &file, Moment::Placed(50), &[int]),
        ("SIGINT-twice", &server.url, Moment::Placed(50), &[int, int]),
        ("SIGTERM-early", &slow.url, Moment::After(Duration::from_millis(300)), &[term]),
    ];
    for (name, from, moment, signals) in cases {
        let root = tmp.path().join(name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        let args = ["copy", "--from", from, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP];
        let child = cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let placed = || {
            store_entries(&root)
                .iter()
                .filter(|e| !e.starts_with('.') && !e.ends_with(".lock") && !sluice_local_store::is_temp_dir(e))
                .count()
        };
        let start = Instant::now();
        match moment {
            Moment::Placed(n) => {
                while placed() < n {
                    assert!(start.elapsed() < Duration::from_secs(120), "{name}: fewer than {n} paths placed in 120 s");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            Moment::After(d) => std::thread::sleep(d),
        }
        for (i, signal) in signals.iter().enumerate() {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            // SAFETY: a signal to the child this test started and has not waited for.
            #[allow(unsafe_code)] // a libc call the test drives processes or files with
            let r = unsafe { libc::kill(child.id() as libc::pid_t, *signal) };
            assert_eq!(r, 0);
        }
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        assert!(o.status.code() == Some(1) && err.contains("error: interrupted by the user"), "{name}: {:?}\n{err}", o.status);
        assert_store_closed(&root);
        let (registered, _) = registered_rows(&root);
        assert!(registered < 1056, "{name}: the copy was not stopped ({registered} paths registered)");
        if registered > 0 {
            assert_nix_verifies(tmp.path(), &root);
        }
    }
}
