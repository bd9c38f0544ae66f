//! Concurrency: several `sluice copy` processes with overlapping closures
//! into one store at once, and a `sluice daemon` adding paths while a copy runs. Every path
//! ends registered once and valid (real Nix's `--verify --check-contents`), nothing is left over.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// Starts a copy whose standard error goes to a file (a pipe nobody drains while another
/// copy is awaited would block it, holding its locks), and its JSON report to `<name>.json`.
fn spawn_copy(tmp: &std::path::Path, root: &std::path::Path, name: &str, paths: &[&str]) -> (Child, std::path::PathBuf) {
    spawn_copy_from(&format!("file://{}", corpus().join("cache-xz").display()), tmp, root, name, paths)
}

/// [`spawn_copy`] from the cache at `url`.
fn spawn_copy_from(url: &str, tmp: &std::path::Path, root: &std::path::Path, name: &str, paths: &[&str]) -> (Child, std::path::PathBuf) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    cmd.args(["copy", "--json", "--substituters", url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key()]);
    let log = tmp.join(format!("{name}.log"));
    let report = std::fs::File::create(tmp.join(format!("{name}.json"))).unwrap();
    let child = cmd.args(paths).stdout(report).stderr(std::fs::File::create(&log).unwrap()).spawn().unwrap();
    (child, log)
}

fn wait_ok((mut child, log): (Child, std::path::PathBuf), what: &str) {
    let status = child.wait().unwrap();
    assert!(status.success(), "{what} failed ({status}): {}", std::fs::read_to_string(&log).unwrap_or_default());
}

#[test]
fn overlapping_copies_into_one_store() {
    let glibc = corpus_path("glibc-2.37-8");
    let bash = corpus_path("bash-5.2-p15");
    for round in 0..2 {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let children = [
            spawn_copy(tmp.path(), &root, "a", &[TOP]),
            spawn_copy(tmp.path(), &root, "b", &[&glibc, &bash]),
            spawn_copy(tmp.path(), &root, "c", &[&bash, TOP]),
            spawn_copy(tmp.path(), &root, "d", &[&glibc]),
        ];
        for (i, c) in children.into_iter().enumerate() {
            wait_ok(c, &format!("round {round}, copy {i}"));
        }
        assert_eq!(registered_rows(&root), (1056, 1056), "round {round}");
        assert_eq!(store_leftovers(&root), Vec::<String>::new());
        assert_nix_verifies(tmp.path(), &root);
    }
}

#[test]
fn daemon_adds_while_a_copy_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let socket = tmp.path().join("socket");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp.path(), "");
    let mut daemon = cmd
        .args(["daemon", "--socket", socket.to_str().unwrap(), "--store", root.to_str().unwrap()])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !socket.exists() {
        assert!(start.elapsed() < Duration::from_secs(20), "the daemon did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let copy = spawn_copy(tmp.path(), &root, "copy", &[TOP]);
    let store = format!("unix://{}", socket.display());
    let mut added = Vec::new();
    for i in 0..12 {
        let file = tmp.path().join(format!("file-{i}"));
        std::fs::write(&file, format!("added through the daemon during a copy, #{i}\n")).unwrap();
        let o = nix(tmp.path(), "nix-store", &["--store", &store, "--add", file.to_str().unwrap()]);
        check(&o, "nix-store --add through the daemon");
        added.push(String::from_utf8_lossy(&o.stdout).trim().to_string());
    }
    wait_ok(copy, "copy while the daemon adds");
    let _ = daemon.kill();
    let _ = daemon.wait();
    assert_eq!(registered_rows(&root), (1056 + 12, 1056 + 12));
    for (i, p) in added.iter().enumerate() {
        let content = std::fs::read_to_string(root.join(&p[1..])).unwrap();
        assert_eq!(content, format!("added through the daemon during a copy, #{i}\n"));
    }
    assert_eq!(store_leftovers(&root), Vec::<String>::new());
    assert_nix_verifies(tmp.path(), &root);
}

/// A copy of bash's closure over HTTP (so that its NAR requests can be counted) while this
/// process holds bash's lock as Nix's `PathLocks` does, once the copy has tried the lock and
/// waited 3 s. (Fields are dropped in this order: the server is stopped while its state
/// directory in `tmp` is still there.)
struct LockedCopy {
    root: std::path::PathBuf,
    base: String,
    lock_path: std::path::PathBuf,
    lock: std::fs::File,
    server: CacheServer,
    nar_url: String,
    copy: (Child, std::path::PathBuf),
    tmp: tempfile::TempDir,
}

impl LockedCopy {
    fn start() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let store = root.join("nix/store");
        std::fs::create_dir_all(&store).unwrap();
        let bash = corpus_path("bash-5.2-p15");
        let base = bash.strip_prefix("/nix/store/").unwrap().to_owned();
        let lock_path = store.join(format!("{base}.lock"));
        let lock = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&lock_path).unwrap();
        // SAFETY: flock on an open file descriptor.
        #[allow(unsafe_code)] // a libc call the test drives processes or files with
        let r = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        assert_eq!(r, 0);
        let server = CacheServer::start(&corpus().join("cache-xz"), &tmp.path().join("srv"), &[]);
        let narinfo = std::fs::read_to_string(corpus().join("cache-xz").join(format!("{}.narinfo", &base[..32]))).unwrap();
        let nar_url = narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap().to_owned();
        let copy = spawn_copy_from(&server.url, tmp.path(), &root, "copy", &[&bash]);
        // The first attempt opens the NAR, finds the lock taken and drops it; the lock is then
        // waited for with no NAR open (98ff53a opened it again at every retry: ~15 in 3 s).
        let start = Instant::now();
        while server.requests(&nar_url) == 0 && start.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_secs(3));
        let locked = LockedCopy { root, base, lock_path, lock, server, nar_url, copy, tmp };
        assert!(
            locked.server.requests(&locked.nar_url) <= 1,
            "{} requests of {} while its path was locked",
            locked.server.requests(&locked.nar_url),
            locked.nar_url
        );
        let store = locked.root.join("nix/store");
        assert!(!store.join(&locked.base).exists(), "the locked path was written");
        let temp_trees: Vec<_> = store_entries(&locked.root)
            .into_iter()
            .filter(|e| sluice_local_store::is_temp_dir(e))
            .map(|d| store.join(d).join(&locked.base))
            .filter(|t| t.exists())
            .collect();
        assert!(temp_trees.is_empty(), "the locked path's temporary tree was written: {temp_trees:?}");
        locked
    }

    /// Releases the lock as Nix does (deleting the file, then marking it) and waits for the
    /// copy; returns its JSON report.
    fn release(self) -> (tempfile::TempDir, std::path::PathBuf, CacheServer, String, serde_json::Value) {
        use std::io::Write;
        let LockedCopy { tmp, root, lock_path, mut lock, server, nar_url, mut copy, .. } = self;
        assert!(
            copy.0.try_wait().unwrap().is_none(),
            "the copy ended while the path was locked: {}",
            std::fs::read_to_string(&copy.1).unwrap_or_default()
        );
        std::fs::remove_file(&lock_path).unwrap();
        lock.write_all(b"d").unwrap();
        drop(lock);
        wait_ok(copy, "copy after the lock was released");
        let report = serde_json::from_slice(&std::fs::read(tmp.path().join("copy.json")).unwrap()).unwrap();
        (tmp, root, server, nar_url, report)
    }
}

/// A path whose lock another process holds (as Nix's `PathLocks` holds it while it adds the
/// path) is not written by a copy, neither in its temporary tree nor at its location, while
/// the lock is held: the copy takes the lock in the task that unpacks, finds it taken, lets go
/// of its download and tries again later. Once the holder releases the lock, the copy adds the
/// path itself.
#[test]
fn a_path_locked_by_another_process_is_left_alone_until_released() {
    let locked = LockedCopy::start();
    let base = locked.base.clone();
    let (tmp, root, server, nar_url, report) = locked.release();
    assert_eq!(server.requests(&nar_url), 2, "the NAR is opened once more, with the lock held");
    assert!(report["substituted"].as_array().unwrap().iter().any(|p| p.as_str() == Some(&format!("/nix/store/{base}"))), "{report}");
    assert!(root.join("nix/store").join(&base).join("bin/bash").exists());
    assert_eq!(store_leftovers(&root), Vec::<String>::new());
    assert_nix_verifies(tmp.path(), &root);
}

/// The holder of the lock registers the path (as a Nix that substituted it would) before it
/// releases the lock: the copy finds it valid, does not download it again, and counts it as
/// already valid, so that its report accounts for every path of the closure.
#[test]
fn a_path_another_process_made_valid_meanwhile_counts_as_already_valid() {
    let locked = LockedCopy::start();
    let (tmp, root, base) = (locked.tmp.path().to_owned(), locked.root.clone(), locked.base.clone());
    let narinfo = std::fs::read_to_string(corpus().join("cache-xz").join(format!("{}.narinfo", &base[..32]))).unwrap();
    let field = |name: &str| narinfo.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_default().to_owned();
    let nar = std::process::Command::new("xz").args(["-dc"]).arg(corpus().join("cache-xz").join(field("URL: "))).output().unwrap();
    check(&nar, "xz -d");
    let mut restore = std::process::Command::new("nix-store");
    isolate(&mut restore, &tmp, "");
    let mut restore = restore.args(["--restore"]).arg(root.join("nix/store").join(&base)).stdin(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(restore.stdin.as_mut().unwrap(), &nar.stdout).unwrap();
    assert!(restore.wait().unwrap().success());
    let references: Vec<String> = field("References: ").split_whitespace().map(|r| format!("/nix/store/{r}")).collect();
    let registration =
        format!("/nix/store/{base}\n{}\n{}\n\n{}\n{}\n", field("NarHash: "), field("NarSize: "), references.len(), references.join("\n"));
    // Nix 2.8 looks at the path at its logical location (`/nix/store/…`) even for a chroot
    // store: it runs where the store's `nix` directory is `/nix` (a mount namespace of its own).
    let mut register = std::process::Command::new("unshare");
    isolate(&mut register, &tmp, "");
    register
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount --bind \"$0\" /nix && exec nix-store --store local --register-validity --hash-given",
        ])
        .arg(root.join("nix"));
    let mut register = register.stdin(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(register.stdin.as_mut().unwrap(), registration.as_bytes()).unwrap();
    assert!(register.wait().unwrap().success());
    let (tmp, root, server, nar_url, report) = locked.release();
    assert_eq!(server.requests(&nar_url), 1, "a path found valid is not downloaded again");
    let closure = nix_path_info(tmp.path(), root.to_str().unwrap(), &format!("/nix/store/{base}")).len();
    let substituted = report["substituted"].as_array().unwrap().len();
    assert_eq!((substituted, report["alreadyValid"].as_u64().unwrap() as usize), (closure - 1, 1), "{report}");
    assert_nix_verifies(tmp.path(), &root);
}
