//! The SSH stores (`ssh-ng://`, `ssh://`) against a real sshd on 127.0.0.1 ([`common::sshd`]).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use sluice_nix::store_path::StoreDir;
use sluice_nix::wire::ops::{NarFromPath, Op, QueryPathInfo, Request};
use sluice_nix::wire::{read_u64, ProtocolVersion};

use crate::common::sshd::{Sshd, HOST};
use crate::common::*;

/// The harness itself: the test's own keys and configuration log in, and nothing else does.
#[test]
fn sshd_logs_in_with_the_tests_key_only() {
    let tmp = tempfile::tempdir().unwrap();
    let sshd = Sshd::start(tmp.path());
    let o = Command::new("ssh").arg("-F").arg(sshd.ssh_config()).args([HOST, "echo", "logged-in"]).output().unwrap();
    check(&o, "ssh through the test's configuration");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "logged-in\n");
    let o = Command::new("ssh")
        .args(["-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"])
        .args(["-i", "/dev/null", "-p", &sshd.port.to_string(), "root@127.0.0.1", "true"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "a client without the test's key logged in");
}

// ssh-ng://: the worker protocol through ssh, real Nix at either end.

/// What serves a chroot store at the far end of `ssh-ng://`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FarEnd {
    /// Real Nix 2.8's `nix-daemon --stdio`.
    Nix28,
    /// Real Nix 2.26's `nix-daemon --stdio` (`shared/bin/nix-modern`).
    Nix226,
    /// `sluice daemon --stdio`.
    Sluice,
}

/// A chroot store under `tmp/name` served at the far end by `far`, and its `ssh-ng://` URL:
/// `remote-program=` a wrapper script that gives the far end an isolated environment whose
/// default store is that chroot store (so that it never opens this machine's /nix), trusting
/// the corpus's key, and `remote-store=` the chroot store for Nix's daemons (sluice's is given
/// `--store` by the wrapper). The wrapper runs `shape` with `CMD` replaced by the far end's
/// command (`CMD | dd … count=N` cuts it midway).
pub(crate) fn far_end(tmp: &Path, name: &str, far: FarEnd, shape: &str) -> (PathBuf, String) {
    let store = tmp.join(name);
    let (home, conf) = (tmp.join(format!("{name}-home")), tmp.join("no-etc-nix"));
    std::fs::create_dir_all(&home).unwrap();
    let root = format!("local?root={}", store.display());
    let program = match far {
        FarEnd::Nix28 => "nix-daemon".to_string(),
        FarEnd::Nix226 => format!("cd /tmp && {}/bin/nix-modern nix-daemon", shared().display()),
        FarEnd::Sluice => format!("{} daemon --store {}", env!("CARGO_BIN_EXE_sluice"), store.display()),
    };
    let command = shape.replace("CMD", &format!("{program} \"$@\""));
    let wrapper = tmp.join(format!("{name}-remote-program"));
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexport HOME={} NIX_CONF_DIR={} NIX_REMOTE='{root}' NIX_CONFIG='trusted-public-keys = {}'\n{command}\n",
            home.display(),
            conf.display(),
            corpus_key()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let remote_store = match far {
        FarEnd::Sluice => String::new(),
        _ => format!("&remote-store={root}"),
    };
    (store, format!("ssh-ng://{HOST}?remote-program={}{remote_store}", wrapper.display()))
}

/// `program` (sluice, Nix 2.8's `nix`, or `nix-modern` for Nix 2.26) isolated under `tmp`
/// (trusting the corpus's key), reaching the test's sshd through `NIX_SSHOPTS`.
pub(crate) fn over_ssh(tmp: &Path, sshd: &Sshd, program: &Path) -> Command {
    let mut cmd = Command::new(program);
    isolate(&mut cmd, tmp, &format!("trusted-public-keys = {}", corpus_key()));
    cmd.env("NIX_SSHOPTS", sshd.ssh_opts()).current_dir(tmp);
    cmd
}

pub(crate) fn sluice_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sluice"))
}

pub(crate) fn nix_modern_bin() -> PathBuf {
    shared().join("bin/nix-modern")
}

/// The 25-path subset of the corpus: its root, its paths, and a chroot store under `tmp`
/// holding it.
pub(crate) fn subset_store(tmp: &Path) -> (String, BTreeSet<String>, PathBuf) {
    let (root, paths) = crate::push::subset();
    let src = crate::push::source_store(tmp, "cache-xz", &root);
    (root, paths, src)
}

/// `sluice copy --from from --to to root` through the test's sshd, trusting `key` (the
/// destination's `trusted-public-keys` when given).
fn sluice_copy(tmp: &Path, sshd: &Sshd, from: &str, to: &str, key: Option<&str>, root: &str) -> Output {
    let mut cmd = over_ssh(tmp, sshd, &sluice_bin());
    cmd.args(["copy", "--option", "stalled-download-timeout", &STALL_LIMIT.to_string(), "--from", from, "--to", to]);
    if let Some(key) = key {
        cmd.args(["--trusted-public-keys", key]);
    }
    cmd.arg(root).output().unwrap()
}

/// The `stalled-download-timeout` (seconds) of `sluice_copy`: a far end cut midway may leave
/// its daemon alive and waiting while the copy waits for the rest of a reply, which only the
/// stall limit ends.
const STALL_LIMIT: u64 = 30;

/// Asserts that real Nix finds the chroot store `store` clean and holding the closure of
/// `root`, which is `paths`.
fn assert_holds(tmp: &Path, store: &Path, root: &str, paths: &BTreeSet<String>) {
    assert_nix_verifies(tmp, store);
    let infos = nix_path_info(tmp, store.to_str().unwrap(), root);
    let held: BTreeSet<String> = infos.iter().map(|i| i["path"].as_str().unwrap().to_string()).collect();
    assert_eq!(&held, paths);
}

/// `sluice copy` pushes a closure into `ssh-ng://` with real Nix 2.8's and 2.26's
/// `nix-daemon --stdio` at the far end and pulls it back, `sluice path-info --store` reads it
/// there; real Nix verifies every store.
#[test]
fn sluice_copies_both_ways_with_nix_daemons_at_the_far_end() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    for (far, name) in [(FarEnd::Nix28, "far-2.8"), (FarEnd::Nix226, "far-2.26")] {
        let (store, url) = far_end(tmp, name, far, "CMD");
        let o = sluice_copy(tmp, &sshd, src.to_str().unwrap(), &url, None, &root);
        check(&o, &format!("sluice copy --to {url}"));
        assert_holds(tmp, &store, &root, &paths);
        let o = over_ssh(tmp, &sshd, &sluice_bin()).args(["path-info", "--store", &url, "-r", &root]).output().unwrap();
        check(&o, "sluice path-info --store ssh-ng://");
        assert_eq!(String::from_utf8_lossy(&o.stdout).lines().map(str::to_string).collect::<BTreeSet<_>>(), paths);
        let back = tmp.join(format!("back-from-{name}"));
        let o = sluice_copy(tmp, &sshd, &url, back.to_str().unwrap(), Some(&corpus_key()), &root);
        check(&o, &format!("sluice copy --from {url}"));
        assert_holds(tmp, &back, &root, &paths);
        assert_store_closed(&back);
    }
}

/// Real Nix 2.8 and 2.26 clients copy a closure both ways through `sluice daemon --stdio` at
/// the far end of `ssh-ng://` (Nix's `nix copy --to` / `--from` unchanged, the daemon named by
/// `remote-program=`); real Nix verifies every store.
#[test]
fn real_nix_clients_copy_both_ways_through_sluice_at_the_far_end() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    let nix = PathBuf::from("nix");
    for (pusher, puller, name) in [(&nix, nix_modern_bin(), "far-a"), (&nix_modern_bin(), nix.clone(), "far-b")] {
        let (store, url) = far_end(tmp, name, FarEnd::Sluice, "CMD");
        let mut push = over_ssh(tmp, &sshd, pusher);
        if *pusher != nix {
            push.arg("nix");
        }
        let o = push.args(["copy", "--from", src.to_str().unwrap(), "--to", &url, &root]).output().unwrap();
        check(&o, &format!("{} nix copy --to {url}", pusher.display()));
        assert_holds(tmp, &store, &root, &paths);
        let back = tmp.join(format!("{name}-back"));
        let mut pull = over_ssh(tmp, &sshd, &puller);
        if puller != nix {
            pull.arg("nix");
        }
        let o = pull.args(["copy", "--from", &url, "--to", back.to_str().unwrap(), &root]).output().unwrap();
        check(&o, &format!("{} nix copy --from {url}", puller.display()));
        assert_holds(tmp, &back, &root, &paths);
    }
}

/// ssh's own failures and a missing remote program are one error naming the host and saying
/// why: a host key other than the host's (`base64-ssh-public-host-key`), a key the host does
/// not accept (`ssh-key`, with `[user@]host:port`), a `remote-program` that is not there.
#[test]
fn ssh_failures_are_one_error_naming_the_host() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, _) = crate::push::subset();
    let (_, url) = far_end(tmp, "far", FarEnd::Nix28, "CMD");
    let o = Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(tmp.join("other_key")).output().unwrap();
    check(&o, "ssh-keygen");
    let other_key = std::fs::read_to_string(tmp.join("other_key.pub")).unwrap();
    let wrong_host_key = format!("{url}&base64-ssh-public-host-key={}", base64_of(other_key.as_bytes()));
    let direct = format!("ssh-ng://root@127.0.0.1:{}?ssh-key={}&remote-program=/bin/false", sshd.port, tmp.join("other_key").display());
    let missing = format!("ssh-ng://{HOST}?remote-program={}/no-such-nix-daemon", tmp.display());
    let cases = [
        (&wrong_host_key, sshd.ssh_opts(), vec!["failed to start SSH connection to 'sluice-test'", "Host key verification failed"]),
        (
            &direct,
            "-F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o IdentitiesOnly=yes".into(),
            vec!["failed to start SSH connection to '127.0.0.1'", "Permission denied (publickey"],
        ),
        (&missing, sshd.ssh_opts(), vec!["'sluice-test'", "status 127 (the remote program was not found)", "no-such-nix-daemon"]),
    ];
    for (url, opts, expected) in cases {
        let o = over_ssh(tmp, &sshd, &sluice_bin()).env("NIX_SSHOPTS", opts).args(["path-info", "--store", url, &root]).output().unwrap();
        assert!(!o.status.success(), "{url}: succeeded");
        let err = stderr(&o);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{url}: not one line:\n{err}");
        for e in expected {
            assert!(err.contains(e), "{url}: {e:?} not in:\n{err}");
        }
    }
}

/// The base64 of `bytes` (`base64 -w0`).
fn base64_of(bytes: &[u8]) -> String {
    let mut child = Command::new("base64").arg("-w0").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap()
}

/// A far end that dies in the middle of a copy (its output cut after 100 KB pulling, its
/// input cut after 100 KB pushing) fails the copy with an error naming the host and leaves
/// nothing half-registered on either side: sluice's store holds only whole, registered paths
/// whose closures are complete and nothing temporary, and Nix's verifies.
#[test]
fn a_far_end_killed_mid_copy_leaves_nothing_half_registered() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    let push = |url: &str| sluice_copy(tmp, &sshd, src.to_str().unwrap(), url, None, &root);
    check(&push(&far_end(tmp, "far", FarEnd::Nix28, "CMD").1), "push");
    let (_, cut_output) = far_end(tmp, "far", FarEnd::Nix28, &format!("CMD | {}", pass_first(CUT_AT, "")));
    let back = tmp.join("back");
    let o = sluice_copy(tmp, &sshd, &cut_output, back.to_str().unwrap(), Some(&corpus_key()), &root);
    assert!(!o.status.success(), "a pull from a far end cut short succeeded");
    assert!(stderr(&o).contains("ssh-ng://sluice-test"), "{}", stderr(&o));
    assert_store_closed(&back);
    let registered = registered_paths(&back);
    assert!(registered.len() < paths.len(), "everything was copied: {registered:?}");
    assert_nix_verifies(tmp, &back);
    for path in &registered {
        let closure = nix_path_info(tmp, back.to_str().unwrap(), path);
        assert!(closure.iter().all(|i| i["valid"].as_bool() != Some(false)), "{path}'s closure is incomplete: {closure:?}");
    }
    let (far2, cut_input) = far_end(tmp, "far2", FarEnd::Nix28, &cut_input());
    let o = push(&cut_input);
    assert!(!o.status.success(), "a push into a far end cut short succeeded");
    assert!(stderr(&o).contains("ssh-ng://sluice-test"), "{}", stderr(&o));
    assert!(registered_paths(&far2).len() < paths.len());
    assert_nix_verifies(tmp, &far2);
}

/// A far end that stops reading or writing midway and stays connected (its output, then its
/// input, no longer passed on after 100 KB) is given up after `stalled-download-timeout`, a
/// pull and a push each failing with one error naming the host, instead of waiting for ever;
/// the local store holds nothing half-registered and the far one verifies. A far end whose
/// output ends while it lives on is not waited for either (before, the pull waited for it to
/// exit, whatever the limit).
#[test]
fn a_far_end_that_stalls_is_given_up() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    let stall = pass_first(CUT_AT, "sleep 30");
    let copy = |from: &str, to: &str, said: &str| {
        let o = over_ssh(tmp, &sshd, Path::new("timeout"))
            .arg("60")
            .arg(sluice_bin())
            .args([
                "copy",
                "--option",
                "stalled-download-timeout",
                "3",
                "--trusted-public-keys",
                &corpus_key(),
                "--from",
                from,
                "--to",
                to,
                &root,
            ])
            .output()
            .unwrap();
        assert_ne!(o.status.code(), Some(124), "{from} -> {to}: still waiting after 60 s: {}", stderr(&o));
        let err = stderr(&o);
        assert!(!o.status.success(), "{from} -> {to}: succeeded");
        let host = [from, to].into_iter().find_map(|url| url.strip_prefix("ssh-ng://")?.split('?').next()).unwrap();
        assert!(err.contains(&format!("ssh-ng://{host}")) && err.contains(said), "{from} -> {to}: {err}");
    };
    let stalled = "nothing moved either way for 3 s";
    check(&sluice_copy(tmp, &sshd, src.to_str().unwrap(), &far_end(tmp, "far", FarEnd::Nix28, "CMD").1, None, &root), "push");
    let (_, stalled_output) = far_end(tmp, "far", FarEnd::Nix28, &format!("CMD | {stall}"));
    let back = tmp.join("back");
    copy(&stalled_output, back.to_str().unwrap(), stalled);
    assert_store_closed(&back);
    assert_nix_verifies(tmp, &back);
    // ssh keeps its output open while it lives: the far end `localhost` runs here, without
    // ssh, ends it. Its output is held by the cut alone (the shell keeps no copy of it), which
    // closes it and lives on, the daemon behind it waiting.
    let closed = format!(
        "exec 3>&1 4<&0; CMD <&4 4<&- 3>&- | {} >&3 3>&- 4<&- & exec 3>&- 4<&- >&-; wait",
        pass_first(CUT_AT, "close STDOUT; sleep 90")
    );
    let (_, closed_output) = far_end(tmp, "far", FarEnd::Sluice, &closed);
    copy(&closed_output.replacen(HOST, "localhost", 1), back.to_str().unwrap(), "(end of its output)");
    assert_store_closed(&back);
    assert_nix_verifies(tmp, &back);
    let (far2, stalled_input) = far_end(tmp, "far2", FarEnd::Nix28, &format!("{stall} | CMD"));
    copy(src.to_str().unwrap(), &stalled_input, stalled);
    assert!(registered_paths(&far2).len() < paths.len());
    assert_nix_verifies(tmp, &far2);
}

/// A NAR this side cannot read whole (the source cache's file of glibc cut short) fails a
/// push into `ssh-ng://` with that cause, naming the path, not with the daemon's refusal of
/// the cut-short stream that follows it ("reached end of FramedSource"), as Nix reports
/// `withFramedSink`'s own failure first.
#[test]
fn a_nar_that_cannot_be_read_is_the_pushs_error() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths) = crate::push::subset();
    let cache = tmp.join("cache");
    copy_dir(&corpus().join("cache-subset-none"), &cache);
    let glibc = corpus_path("glibc-2.37-8");
    let narinfo = std::fs::read_to_string(cache.join(format!("{}.narinfo", &glibc["/nix/store/".len()..][..32]))).unwrap();
    let nar = cache.join(narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap());
    std::fs::OpenOptions::new().write(true).open(&nar).unwrap().set_len(150_000).unwrap();
    let (far, url) = far_end(tmp, "far", FarEnd::Nix28, "CMD");
    let o = sluice_copy(tmp, &sshd, &format!("file://{}", cache.display()), &url, Some(&corpus_key()), &root);
    assert!(!o.status.success(), "a push of a NAR cut short succeeded");
    let err = stderr(&o);
    let cause = format!("reading the NAR of {glibc} to add it: the NAR ended after 150000 of its 299200 bytes");
    assert!(err.contains(&cause) && !err.contains("FramedSource"), "{err}");
    let registered = registered_paths(&far);
    assert!(!registered.contains(&glibc) && registered.len() < paths.len(), "{registered:?}");
    assert_nix_verifies(tmp, &far);
}

/// `program copy` (sluice, or Nix 2.26 as `nix-modern nix copy`) isolated under `tmp`,
/// reaching the test's sshd.
fn copy_command(tmp: &Path, sshd: &Sshd, program: &Path) -> Command {
    let mut cmd = over_ssh(tmp, sshd, program);
    if program == nix_modern_bin() {
        cmd.arg("nix");
    }
    cmd.arg("copy");
    cmd
}

/// A shell command (for `far_end` shapes) that passes the first `bytes` of its input on as they
/// come, then runs the Perl statements `then` and ends. Not `dd bs=64K count=N
/// iflag=count_bytes`, which counts a short read from a pipe as a block: it ended after three
/// reads and 3,392 bytes more, within the handshake or the first reply, and whether the far end
/// then ended or stalled depended on how its writes fell. Nor `head -c`, whose output is
/// buffered.
pub(crate) fn pass_first(bytes: u64, then: &str) -> String {
    format!("perl -e '$n = {bytes}; while ($n > 0 && ($r = sysread(STDIN, $b, $n < 65536 ? $n : 65536))) {{ syswrite(STDOUT, $b); $n -= $r }} {then}'")
}

/// Where these tests cut a far end's stream (bytes): midway through a push or pull of the
/// subset, whose stream is about 218 KB between two sluice ends (zstd) and 567 KB of NAR
/// otherwise, and more than a pipe's buffer before its end, so that the far end, writing,
/// finds its output gone.
pub(crate) const CUT_AT: u64 = 100_000;

/// The far end's input cut after [`CUT_AT`] (a `far_end` shape).
pub(crate) fn cut_input() -> String {
    format!("{} | CMD", pass_first(CUT_AT, ""))
}

/// Waits (up to 30 s) until no process is left whose arguments name the store under `store`
/// (a far end's daemon, given `--store` or `remote-store`), which goes on after the copy that
/// cut it off has ended, so that its store can be checked as it left it.
pub(crate) fn wait_far_end_gone(store: &Path) {
    let store = store.to_str().unwrap();
    let names_store = |pid: &std::ffi::OsStr| {
        let args = std::fs::read(Path::new("/proc").join(pid).join("cmdline")).unwrap_or_default();
        args.split(|&b| b == 0).any(|a| a == store.as_bytes() || a.ends_with(format!("root={store}").as_bytes()))
    };
    for _ in 0..300 {
        let procs = std::fs::read_dir("/proc").unwrap().filter_map(Result::ok);
        if !procs.map(|e| e.file_name()).any(|pid| names_store(&pid)) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("the far end of {store} still runs after 30 s");
}

/// A push whose stream is cut midway into `sluice daemon --stdio`, which commits the paths of
/// an AddMultipleToStore in batches, leaves nothing half-registered there, from sluice and
/// from real Nix 2.26: only whole, registered paths whose closures are complete, no tree
/// unregistered, nothing temporary, and real Nix verifies the store; the push then completes
/// into the same store.
#[test]
fn a_push_cut_midway_into_sluice_leaves_nothing_half_registered() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    for (pusher, name) in [(sluice_bin(), "far-a"), (nix_modern_bin(), "far-b")] {
        let (far, cut) = far_end(tmp, name, FarEnd::Sluice, &cut_input());
        let o = copy_command(tmp, &sshd, &pusher).args(["--from", src.to_str().unwrap(), "--to", &cut, &root]).output().unwrap();
        assert!(!o.status.success(), "{}: a push into a far end cut short succeeded", pusher.display());
        wait_far_end_gone(&far);
        assert_store_closed(&far);
        let registered = registered_paths(&far);
        assert!(registered.len() < paths.len(), "everything was copied: {registered:?}");
        assert_nix_verifies(tmp, &far);
        for path in &registered {
            let closure = nix_path_info(tmp, far.to_str().unwrap(), path);
            assert!(closure.iter().all(|i| i["valid"].as_bool() != Some(false)), "{path}'s closure is incomplete: {closure:?}");
        }
        let (_, whole) = far_end(tmp, name, FarEnd::Sluice, "CMD");
        check(&sluice_copy(tmp, &sshd, src.to_str().unwrap(), &whole, None, &root), "the push again");
        assert_holds(tmp, &far, &root, &paths);
    }
}

/// `sluice daemon --stdio` at the far end commits the paths of an AddMultipleToStore in
/// batches: the 25 paths of a push, from sluice and from real Nix 2.26, are made durable with
/// one `syncfs` (one per path before, as Nix flushes each), counted by strace; real Nix
/// verifies the store.
#[test]
fn sluice_at_the_far_end_commits_a_push_in_one_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    for (pusher, name) in [(sluice_bin(), "far-a"), (nix_modern_bin(), "far-b")] {
        let traced = tmp.join(format!("{name}-syncfs"));
        let (far, url) = far_end(tmp, name, FarEnd::Sluice, &format!("strace -f -qq -e trace=syncfs -o {} CMD", traced.display()));
        let push = copy_command(tmp, &sshd, &pusher).args(["--from", src.to_str().unwrap(), "--to", &url, &root]).output().unwrap();
        check(&push, "push");
        assert_holds(tmp, &far, &root, &paths);
        let syncfs = std::fs::read_to_string(&traced).unwrap().lines().filter(|l| l.contains("syncfs(")).count();
        assert_eq!(syncfs, 1, "{}: {syncfs} syncfs for {} paths", pusher.display(), paths.len());
    }
}

/// A far end that floods its standard error with no newline (128 MiB of NUL bytes, then its
/// daemon) costs no memory for it: ssh's standard error is kept in pieces of at most 4 KiB
/// (before, the line being read grew to the whole flood); the push completes.
#[test]
fn a_far_end_flooding_its_stderr_costs_no_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    let (far, url) = far_end(tmp, "far", FarEnd::Nix28, "head -c 128M /dev/zero >&2; CMD");
    let rss = tmp.join("rss");
    let o = over_ssh(tmp, &sshd, Path::new("/usr/bin/time"))
        .args(["-f", "%M", "-o", rss.to_str().unwrap()])
        .arg(sluice_bin())
        .args(["copy", "--from", src.to_str().unwrap(), "--to", &url, &root])
        .output()
        .unwrap();
    check(&o, "push");
    assert_holds(tmp, &far, &root, &paths);
    let kib: u64 = std::fs::read_to_string(&rss).unwrap().lines().last().unwrap().trim().parse().unwrap();
    assert!(kib < 96 * 1024, "peak RSS {kib} KiB");
}

/// A push into `ssh-ng://` is one stream: one validity query, then every missing path in one
/// AddMultipleToStore, not a round trip per level of the closure: at 150 ms RTT the 25-path
/// closure goes into Nix 2.8's daemon in less than `ssh host true` and 8 round trips (the
/// greeting, the query, the stream and its answer).
#[test]
fn a_push_is_one_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let rtt = 150;
    let sshd = Sshd::start(tmp).with_rtt(rtt);
    let (root, paths, src) = subset_store(tmp);
    let (far, url) = far_end(tmp, "far", FarEnd::Nix28, "CMD");
    let started = std::time::Instant::now();
    check(&Command::new("ssh").arg("-F").arg(sshd.ssh_config()).args([HOST, "true"]).output().unwrap(), "ssh true");
    let floor = started.elapsed();
    let started = std::time::Instant::now();
    let o = sluice_copy(tmp, &sshd, src.to_str().unwrap(), &url, None, &root);
    let took = started.elapsed();
    check(&o, "push");
    assert_holds(tmp, &far, &root, &paths);
    let trips = (took.saturating_sub(floor)).as_millis() as f64 / rtt as f64;
    assert!(trips < 8.0, "the push took {took:?}, ssh true {floor:?}: {trips:.1} round trips");
}

/// Trust is decided before a NAR is transferred (NixOS/nix#13339): pulling paths signed by
/// no key the destination trusts fails without their NARs crossing the connection (the far
/// end's output, counted by `dd`, stays below the closure's NAR bytes).
#[test]
fn untrusted_paths_are_refused_before_their_nars_are_transferred() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    let (far, url) = far_end(tmp, "far", FarEnd::Nix28, "CMD");
    let o = sluice_copy(tmp, &sshd, src.to_str().unwrap(), &url, None, &root);
    check(&o, "push");
    let count = tmp.join("far-output-bytes");
    let (_, counted) = far_end(tmp, "far", FarEnd::Nix28, &format!("CMD | dd bs=64K 2>{}", count.display()));
    let back = tmp.join("back");
    let other_key = "cache.nixos.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=";
    let o = sluice_copy(tmp, &sshd, &counted, back.to_str().unwrap(), Some(other_key), &root);
    assert!(!o.status.success(), "untrusted paths were copied");
    assert!(stderr(&o).contains("signature"), "{}", stderr(&o));
    assert!(registered_paths(&back).is_empty());
    let nar_bytes: u64 = nix_path_info(tmp, far.to_str().unwrap(), &root).iter().map(|i| i["narSize"].as_u64().unwrap()).sum();
    let sent: u64 = std::fs::read_to_string(&count).unwrap().lines().find_map(|l| l.split(' ').next()?.parse().ok()).unwrap();
    assert_eq!(paths.len(), 25);
    assert!(sent < nar_bytes / 10, "{sent} bytes came from the far end, the closure's NARs are {nar_bytes}");
}

/// A pull is at the round-trip floor: the closure found one level per round trip and every
/// NAR asked for at once (NarFromPath pipelined), not one round trip per path: at 150 ms RTT
/// the 25-path closure takes less than `ssh host true` and 16 round trips (one NAR per
/// round trip took 25 more).
#[test]
fn a_pull_pipelines_its_nars() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let rtt = 150;
    let sshd = Sshd::start(tmp).with_rtt(rtt);
    let (root, paths, src) = subset_store(tmp);
    let (_, url) = far_end(tmp, "far", FarEnd::Nix28, "CMD");
    check(&sluice_copy(tmp, &sshd, src.to_str().unwrap(), &url, None, &root), "push");
    let started = std::time::Instant::now();
    check(&Command::new("ssh").arg("-F").arg(sshd.ssh_config()).args([HOST, "true"]).output().unwrap(), "ssh true");
    let floor = started.elapsed();
    let back = tmp.join("back");
    let started = std::time::Instant::now();
    let o = sluice_copy(tmp, &sshd, &url, back.to_str().unwrap(), Some(&corpus_key()), &root);
    let took = started.elapsed();
    check(&o, "pull");
    assert_eq!(registered_paths(&back), paths);
    let trips = (took.saturating_sub(floor)).as_millis() as f64 / rtt as f64;
    assert!(trips < 16.0, "the pull took {took:?}, ssh true {floor:?}: {trips:.1} round trips");
}

/// A pull from `ssh-ng://` asks for NARs while it still looks for the closure: the requests
/// real nix-daemon 2.8 was sent (kept by `tee`) ask for the first NAR before the last level of
/// references is queried (before, every QueryPathInfo came first, one level per round trip,
/// and only then the NARs), each path's info and each NAR once.
#[test]
fn a_pull_asks_for_nars_while_it_looks_for_the_closure() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    check(&sluice_copy(tmp, &sshd, src.to_str().unwrap(), &far_end(tmp, "far", FarEnd::Nix28, "CMD").1, None, &root), "push");
    let asked = tmp.join("asked");
    let (_, url) = far_end(tmp, "far", FarEnd::Nix28, &format!("tee {} | CMD", asked.display()));
    let back = tmp.join("back");
    check(&sluice_copy(tmp, &sshd, &url, back.to_str().unwrap(), Some(&corpus_key()), &root), "pull");
    assert_holds(tmp, &back, &root, &paths);
    let ops = worker_ops(&std::fs::read(&asked).unwrap());
    for op in [Op::QueryPathInfo, Op::NarFromPath] {
        let named: Vec<&String> = ops.iter().filter(|(o, _)| *o == op).map(|(_, p)| p).collect();
        assert_eq!(named.len(), paths.len(), "{op:?}: {ops:#?}");
        assert_eq!(named.into_iter().cloned().collect::<BTreeSet<_>>(), paths, "{op:?}");
    }
    let first_nar = ops.iter().position(|(o, _)| *o == Op::NarFromPath).unwrap();
    let last_query = ops.iter().rposition(|(o, _)| *o == Op::QueryPathInfo).unwrap();
    assert!(first_nar < last_query, "the first NAR was asked for after the last query: {ops:#?}");
}

/// The operations in `sent`, what a client sent a nix-daemon 2.8 (the greeting of protocol
/// 1.34 without a CPU, then a pull's QueryPathInfo and NarFromPath only), with the path each
/// names, in order.
fn worker_ops(mut sent: &[u8]) -> Vec<(Op, String)> {
    let (dir, r, version) = (StoreDir::default(), &mut sent, ProtocolVersion::new(1, 34));
    for what in ["magic", "version", "CPU affinity", "reserveSpace"] {
        read_u64(r, what).unwrap();
    }
    let mut ops = Vec::new();
    while !r.is_empty() {
        let op = Op::from_wire(read_u64(r, "operation").unwrap()).unwrap();
        let path = match op {
            Op::QueryPathInfo => QueryPathInfo::read(r, &dir, version).unwrap().path,
            Op::NarFromPath => NarFromPath::read(r, &dir, version).unwrap().path,
            other => panic!("a pull sent {other:?}"),
        };
        ops.push((op, dir.display_path(&path)));
    }
    ops
}

/// The bytes a `dd` at the far end counted (its `N bytes … copied` line in `file`).
pub(crate) fn dd_bytes(file: &Path) -> u64 {
    std::fs::read_to_string(file).unwrap().lines().find_map(|l| l.split(' ').next()?.parse().ok()).unwrap()
}

/// Between two sluice ends (`sluice daemon --stdio` at the far end of `ssh-ng://`) the
/// connection is zstd-compressed both ways (the `sluice-zstd` feature): a push and a pull of
/// the 25-path subset each move less than 60% of its NAR bytes (counted by `dd` at the far
/// end: before, all of them and more), and real Nix verifies both stores.
#[test]
fn nars_travel_zstd_compressed_between_two_sluice_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, src) = subset_store(tmp);
    let nar_bytes: u64 = nix_path_info(tmp, src.to_str().unwrap(), &root).iter().map(|i| i["narSize"].as_u64().unwrap()).sum();
    let (pushed_count, pulled_count) = (tmp.join("pushed-bytes"), tmp.join("pulled-bytes"));
    let (far, url) = far_end(tmp, "far", FarEnd::Sluice, &format!("dd bs=64K 2>{} | CMD", pushed_count.display()));
    check(&sluice_copy(tmp, &sshd, src.to_str().unwrap(), &url, None, &root), "push");
    assert_holds(tmp, &far, &root, &paths);
    let (_, url) = far_end(tmp, "far", FarEnd::Sluice, &format!("CMD | dd bs=64K 2>{}", pulled_count.display()));
    let back = tmp.join("back");
    check(&sluice_copy(tmp, &sshd, &url, back.to_str().unwrap(), Some(&corpus_key()), &root), "pull");
    assert_holds(tmp, &back, &root, &paths);
    for (count, what) in [(&pushed_count, "pushed"), (&pulled_count, "pulled")] {
        let moved = dd_bytes(count);
        assert!(moved * 10 < nar_bytes * 6, "{moved} bytes {what} for {nar_bytes} bytes of NAR");
    }
}

/// A pull registers its paths as the substitution pipeline does: handed to one registrar in
/// dependency order and committed in a few batches (each one transaction and one flush), not
/// one commit per path; real Nix finds the closure whole and valid.
#[test]
fn a_pull_registers_its_paths_in_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (o, paths) = pushed_and_pulled_back(tmp, &Sshd::start(tmp), "sluice_store::registrar=debug");
    let batches: Vec<usize> = stderr(&o).lines().filter_map(|l| l.split("registering ").nth(1)?.split(' ').next()?.parse().ok()).collect();
    assert_eq!(batches.iter().sum::<usize>(), paths.len(), "{}", stderr(&o));
    // How many commits depends on how fast the NARs come against how long a commit takes;
    // one per path (as before) is what must not happen.
    assert!(batches.len() < paths.len() && batches.iter().any(|&b| b > 1), "{} batches: {batches:?}", batches.len());
}

/// A pull adds the paths whose NARs came while it still looks for the rest of the closure:
/// at 150 ms RTT, a path of the 25-path subset whose closure is found early (one of its leaves)
/// is handed to the registrar before the last level of references is answered (before, every
/// path waited for the whole closure, and the NARs that had come waited unpacked).
#[test]
fn a_pull_adds_paths_while_it_looks_for_the_closure() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (o, _) = pushed_and_pulled_back(tmp, &Sshd::start(tmp).with_rtt(150), "sluice_store::registrar=debug,sluice_store::push=debug");
    let err = stderr(&o);
    let lines: Vec<&str> = err.lines().collect();
    let found = lines.iter().position(|l| l.contains("found the closure of 25 paths")).unwrap_or_else(|| panic!("{err}"));
    let first_registered = lines.iter().position(|l| l.contains("registering ")).unwrap_or_else(|| panic!("{err}"));
    assert!(first_registered < found, "nothing was registered before the closure was found:\n{err}");
}

/// The subset pushed by sluice into a Nix 2.8 far end over `sshd`, then pulled back by sluice
/// into a fresh chroot store with `SLUICE_LOG=log`, which real Nix finds whole: the pull's
/// output and the subset's paths.
fn pushed_and_pulled_back(tmp: &Path, sshd: &Sshd, log: &str) -> (Output, BTreeSet<String>) {
    let (root, paths, src) = subset_store(tmp);
    let (_, url) = far_end(tmp, "far", FarEnd::Nix28, "CMD");
    check(&sluice_copy(tmp, sshd, src.to_str().unwrap(), &url, None, &root), "push");
    let back = tmp.join("back");
    let mut cmd = over_ssh(tmp, sshd, &sluice_bin());
    cmd.env("SLUICE_LOG", log);
    let o =
        cmd.args(["copy", "--from", &url, "--to", back.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &root]).output().unwrap();
    check(&o, "pull");
    assert_holds(tmp, &back, &root, &paths);
    (o, paths)
}
