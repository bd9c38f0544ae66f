//! SSH stores (`ssh-ng://`, `ssh://`) as substituters, against a real sshd with real Nix 2.8
//! at the far end: `sluice daemon` substitutes from them for a real Nix 2.8 client, each path's
//! signature checked unless the URL says `?trusted=true`; `sluice missing` answers as Nix 2.26.

use std::process::Output;

use crate::common::sshd::{Sshd, HOST};
use crate::common::*;
use crate::daemon::{wait_for_socket, Daemon, Env};
use crate::ssh::{far_end, nix_modern_bin, over_ssh, sluice_bin, subset_store, FarEnd};

/// A key that signed none of the corpus's paths.
const OTHER_KEY: &str = "cache.nixos.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=";

/// `sluice daemon` on `<env>/<socket>` for the store `<env>/root`, its substituters
/// `substituters` (the corpus key trusted, and `extra_config` lines), reaching `sshd`.
fn daemon_over_ssh(env: &Env, sshd: &Sshd, socket: &str, substituters: &str, extra_config: &str) -> Daemon {
    let socket = env.path(socket);
    let mut cmd = env.daemon_command(&socket, "root", substituters, extra_config);
    cmd.env("NIX_SSHOPTS", sshd.ssh_opts());
    wait_for_socket(cmd.spawn().unwrap(), &socket)
}

/// Real Nix 2.8's `nix-store -r root` through `daemon`; the client sets no substituters, so
/// that the daemon's own are used.
fn realise(env: &Env, daemon: &Daemon, root: &str) -> Output {
    let mut cmd = env.cmd("nix-store");
    cmd.env("NIX_CONFIG", "experimental-features = nix-command").args(["--store", &daemon.url, "-r", root]).output().unwrap()
}

/// The test's directory under `env`, with an sshd and the corpus's 25-path subset in the
/// chroot store `<tmp>/src`: its root and paths.
fn with_subset(env: &Env) -> (std::path::PathBuf, Sshd, String, std::collections::BTreeSet<String>) {
    let tmp = env.path("t");
    std::fs::create_dir_all(&tmp).unwrap();
    let sshd = Sshd::start(&tmp);
    let (root, paths, _) = subset_store(&tmp);
    (tmp, sshd, root, paths)
}

/// `sluice daemon` with `substituters = ssh-ng://…` (Nix 2.8's `nix-daemon --stdio` at the far
/// end, holding the closure signed by the corpus key) substitutes the closure for a real Nix
/// 2.8 client's `nix-store -r`; real Nix finds the store whole and valid.
#[test]
fn a_daemon_substitutes_a_closure_from_ssh_ng_for_a_nix_client() {
    let env = Env::new();
    let (tmp, sshd, root, paths) = with_subset(&env);
    let (_, url) = far_end(&tmp, "src", FarEnd::Nix28, "CMD");
    let daemon = daemon_over_ssh(&env, &sshd, "socket", &url, "");
    let o = realise(&env, &daemon, &root);
    check(&o, "nix-store -r through sluice daemon substituting from ssh-ng://");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), root);
    drop(daemon);
    assert_eq!(registered_paths(&env.path("root")), paths);
    assert_nix_verifies(&tmp, &env.path("root"));
}

/// From `ssh://` (Nix 2.8's `nix-store --serve` at the far end), paths signed by no key the
/// daemon trusts are refused, the error naming the path asked for and nothing added; with
/// `?trusted=true` on the URL they need no signature (Nix's `isTrusted`, which only a
/// substituter's use reads) and the closure is substituted.
#[test]
fn a_daemon_refuses_unsigned_substitutes_from_ssh_unless_the_url_says_trusted() {
    let env = Env::new();
    let (tmp, sshd, root, paths) = with_subset(&env);
    let serve = crate::ssh_serve::nix_store_wrapper(&tmp, "serve-src", &tmp.join("src"), false);
    let url = format!("ssh://{HOST}?remote-program={}", serve.display());
    let untrusting = format!("trusted-public-keys = {OTHER_KEY}");
    let refusing = daemon_over_ssh(&env, &sshd, "socket-untrusted", &url, &untrusting);
    let o = realise(&env, &refusing, &root);
    assert!(!o.status.success(), "paths signed by no trusted key were substituted");
    let err = stderr(&o);
    assert!(err.contains(&root) && err.contains("signature"), "{err}");
    drop(refusing);
    assert!(registered_paths(&env.path("root")).is_empty());
    let trusting = daemon_over_ssh(&env, &sshd, "socket-trusted", &format!("{url}&trusted=true"), &untrusting);
    check(&realise(&env, &trusting, &root), "nix-store -r substituting from ssh://…?trusted=true");
    drop(trusting);
    assert_eq!(registered_paths(&env.path("root")), paths);
    assert_nix_verifies(&tmp, &env.path("root"));
}

/// `sluice missing --substituters ssh-ng://…` prints what Nix 2.26's `nix-store -r --dry-run`
/// prints with the same substituter: every path to be fetched, with no download size (a
/// substituter that is not a binary cache has none).
#[test]
fn missing_with_an_ssh_ng_substituter_answers_as_nix_2_26() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, _) = subset_store(tmp);
    let (_, url) = far_end(tmp, "src", FarEnd::Nix28, "CMD");
    let empty = tmp.join("empty");
    let o = over_ssh(tmp, &sshd, &sluice_bin())
        .args(["missing", "--store", empty.to_str().unwrap(), "--substituters", &url, &root])
        .output()
        .unwrap();
    check(&o, "sluice missing");
    let nix = over_ssh(tmp, &sshd, &nix_modern_bin())
        .args(["nix-store", "--store", &format!("local?root={}", empty.display()), "-r", "--dry-run"])
        .args(["--option", "substituters", &url, &root])
        .output()
        .unwrap();
    check(&nix, "Nix 2.26 nix-store -r --dry-run");
    assert_eq!(answer(&stderr(&o)), answer(&stderr(&nix)));
    let head = format!("these {} paths will be fetched (0.00 MiB download,", paths.len());
    assert!(stderr(&o).starts_with(&head), "{}", stderr(&o));
    let listed: std::collections::BTreeSet<String> = stderr(&o).lines().skip(1).map(|l| l.trim().to_string()).collect();
    assert_eq!(listed, paths);
}

/// What a dry run's output says: its lines but warnings, in order but the listed paths, which
/// Nix 2.26 orders by name and Nix 2.8 (and sluice, as its corpus truth) by hash.
fn answer(output: &str) -> (Vec<&str>, std::collections::BTreeSet<&str>) {
    let lines = output.lines().filter(|l| !l.starts_with("warning:"));
    let (paths, rest): (Vec<&str>, Vec<&str>) = lines.partition(|l| l.starts_with("  "));
    (rest, paths.into_iter().collect())
}

/// An SSH substituter that cannot be reached (ssh cannot resolve its host) is asked first
/// (priority 0, before the cache's 50, as in Nix), given up for the run with one warning
/// naming it, and the closure comes from the next substituter, a `file://` cache.
#[test]
fn an_unreachable_ssh_substituter_is_given_up_with_one_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let (root, paths) = crate::push::subset();
    let unreachable = "ssh-ng://no-such-host.invalid";
    let cache = format!("file://{}", corpus().join("cache-xz").display());
    let substituters = format!("{unreachable} {cache}");
    let o = copy_with(tmp, &tmp.join("root"), &substituters, &corpus_key(), &[], &[&root]);
    check(&o, "sluice copy with an unreachable ssh-ng:// substituter first");
    assert_eq!(registered_paths(&tmp.join("root")), paths);
    let err = stderr(&o);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains(unreachable)).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("not used for the rest of this run"), "{err}");
}

/// Substitution from `ssh-ng://` pipelines its round trips: the closure's paths asked in
/// batches and their NARs fetched ahead (NarFromPath pipelined) on the one connection, not a
/// round trip per path for each: at 150 ms RTT the 25-path closure takes less than `ssh host
/// true` and 40 round trips (23–30 on a loaded machine; 37 with each NAR asked when read; Nix
/// 2.26's `nix-store -r` with the same substituter, about 400).
#[test]
fn substitution_from_ssh_ng_pipelines_its_lookups_and_nars() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let rtt = 150;
    let sshd = Sshd::start(tmp).with_rtt(rtt);
    let (root, paths, _) = subset_store(tmp);
    let (_, url) = far_end(tmp, "src", FarEnd::Nix28, "CMD");
    let started = std::time::Instant::now();
    check(&std::process::Command::new("ssh").arg("-F").arg(sshd.ssh_config()).args([HOST, "true"]).output().unwrap(), "ssh true");
    let floor = started.elapsed();
    let dest = tmp.join("dest");
    let started = std::time::Instant::now();
    let o =
        over_ssh(tmp, &sshd, &sluice_bin()).args(["copy", "--substituters", &url, "--to", dest.to_str().unwrap(), &root]).output().unwrap();
    let took = started.elapsed();
    check(&o, "sluice copy substituting from ssh-ng://");
    assert_eq!(registered_paths(&dest), paths);
    let trips = (took.saturating_sub(floor)).as_millis() as f64 / rtt as f64;
    assert!(trips < 40.0, "the substitution took {took:?}, ssh true {floor:?}: {trips:.1} round trips");
}

/// An SSH substituter's priority is 0 unless its URL says otherwise (Nix's
/// `StoreConfig::priority`), ahead of a binary cache's 50 even when listed after it: the
/// closure's NARs come from the far end (counted by `dd` there); with `?priority=60` they come
/// from the cache, whose answers come first.
#[test]
fn an_ssh_substituter_comes_before_a_cache_by_priority() {
    let tmp = tempfile::tempdir().unwrap();
    let tmp = tmp.path();
    let sshd = Sshd::start(tmp);
    let (root, paths, _) = subset_store(tmp);
    let nar_bytes: u64 = nix_path_info(tmp, tmp.join("src").to_str().unwrap(), &root).iter().map(|i| i["narSize"].as_u64().unwrap()).sum();
    let cache = format!("file://{}", corpus().join("cache-xz").display());
    for (query, from_far_end) in [("", true), ("&priority=60", false)] {
        let count = tmp.join(format!("far-output-bytes{query}"));
        let (_, url) = far_end(tmp, "src", FarEnd::Nix28, &format!("CMD | dd bs=64K 2>{}", count.display()));
        let dest = tmp.join(format!("dest{query}"));
        let substituters = format!("{cache} {url}{query}");
        let o = over_ssh(tmp, &sshd, &sluice_bin())
            .args(["copy", "--substituters", &substituters, "--to", dest.to_str().unwrap(), &root])
            .output()
            .unwrap();
        check(&o, &format!("sluice copy --substituters '{substituters}'"));
        assert_eq!(registered_paths(&dest), paths);
        // A substituter whose answers were not needed is never connected to.
        let sent = if count.exists() { crate::ssh::dd_bytes(&count) } else { 0 };
        assert_eq!(sent > nar_bytes, from_far_end, "{sent} bytes came from the far end, the closure's NARs are {nar_bytes} ({query})");
    }
}
