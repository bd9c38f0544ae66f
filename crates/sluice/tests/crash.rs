//! Crashes (issue 6, kind 8): `sluice copy` of the corpus closure is killed with SIGKILL at
//! many moments, each run continuing the previous one's store; a final run completes. Then
//! real Nix's `nix-store --verify --check-contents` is clean, every path of the closure is
//! valid, and no temporary tree (`.<name>.sluice`) or `.lock` file remains.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

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

#[test]
fn kill_9_at_random_moments_then_rerun() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let url = format!("file://{}", corpus().join("cache-xz").display());
    let args = ["copy", "--substituters", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP];
    // The kill moments are spread over what a whole copy takes with this build on this machine
    // (a fixed span would outlast most copies of a release build on a fast one).
    let whole = {
        let scratch = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let to = scratch.path().join("root");
        check(&sluice(scratch.path(), &["copy", "--substituters", &url, "--to", to.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP]), "a whole copy");
        start.elapsed().as_millis() as u64
    };
    let mut killed = 0;
    for (i, delay) in delays(20, whole).into_iter().enumerate() {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        let mut child = cmd.args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(delay) {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            killed += 1;
        }
        let status = child.wait().unwrap();
        eprintln!("iteration {i}: {delay} ms of {whole}, {status}");
    }
    assert!(killed >= 10, "only {killed} of 20 runs were killed mid-copy");
    let o = sluice(tmp.path(), &args);
    check(&o, "the rerun after the crashes");
    assert_eq!(nix_path_info(tmp.path(), root.to_str().unwrap(), TOP).len(), 1056);
    assert_nix_verifies(tmp.path(), &root);
    assert_eq!(store_leftovers(&root), Vec::<String>::new());
    assert_eq!(registered_rows(&root), (1056, 1056));
}

/// SIGINT, SIGTERM or SIGHUP while a copy runs (from nginx at RTT 50 ms, NARs unpacked on
/// tokio's blocking threads, and from a `file://` cache, NARs unpacked on the unpacking
/// threads; stopped once 50 paths are in place, so that others are being downloaded, unpacked
/// and registered at that moment):
/// the copy says Nix's `interrupted by the user`, fails, and leaves the store as a finished
/// command leaves it (Nix's substitution goals clean up as they are interrupted): no temporary
/// root, the database closed, no temporary tree and no lock file; what it registered is valid
/// to real Nix. Before, the copy left its temporary roots, the database's write-ahead log and
/// the lock files of the paths in flight.
#[test]
fn a_signal_stops_a_copy_and_leaves_the_store_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-zstd"), &tmp.path().join("srv"), &["--rtt-ms", "50"]);
    let file = format!("file://{}", corpus().join("cache-zstd").display());
    let cases = [("SIGINT", libc::SIGINT, &server.url), ("SIGTERM", libc::SIGTERM, &server.url), ("SIGHUP", libc::SIGHUP, &server.url), ("SIGINT-file", libc::SIGINT, &file)];
    for (name, signal, from) in cases {
        let root = tmp.path().join(name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        isolate(&mut cmd, tmp.path(), "");
        let args = ["copy", "--from", from, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), TOP];
        let child = cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let placed = || store_entries(&root).iter().filter(|e| !e.starts_with('.') && !e.ends_with(".lock")).count();
        let start = Instant::now();
        while placed() < 50 {
            assert!(start.elapsed() < Duration::from_secs(120), "{name}: fewer than 50 paths placed in 120 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: a signal to the child this test started and has not waited for.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        assert!(!o.status.success() && err.contains("error: interrupted by the user"), "{name}: {:?}\n{err}", o.status);
        assert_store_closed(&root);
        let (registered, _) = registered_rows(&root);
        assert!(registered < 1056, "{name}: the copy was not stopped ({registered} paths registered)");
        assert_nix_verifies(tmp.path(), &root);
    }
}
