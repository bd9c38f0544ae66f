//! HTTP faults (cases 10, 12, 13), each against the cases' scriptable `server.py`:
//! 404/403 are absence; 401/407 are errors that name the cache and are never cached as
//! absence; 5xx, refused connections, stalls and truncated bodies are retried with backoff up
//! to `download-attempts`, then the next substituter is used; a failing cache is skipped for
//! the rest of the run with one warning. Short timeouts keep the run time small.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;

const C10: &str = "10-http-403-401-404";
const C12: &str = "12-http-truncated-body";
const C13: &str = "13-http-5xx-and-dead-cache";

/// Few attempts and short timeouts, so that failing cases stay quick.
const FAST: &[(&str, &str)] = &[("download-attempts", "3"), ("stalled-download-timeout", "2"), ("connect-timeout", "2")];

fn one_path(case: &str) -> String {
    std::fs::read_to_string(case_dir(case).join("store-path.txt")).unwrap().trim().to_string()
}

/// Content of the single-file store path `path` under `root`.
fn file_content(root: &Path, path: &str) -> String {
    std::fs::read_to_string(root.join(path.trim_start_matches('/'))).unwrap()
}

/// Lines of `err` that are warnings mentioning `url`.
fn warnings_about(err: &str, url: &str) -> usize {
    err.lines().filter(|l| l.to_lowercase().contains("warn") && l.contains(url)).count()
}

fn narinfo_requests(s: &Scripted) -> usize {
    s.requests(|p| p.ends_with(".narinfo")).len()
}

fn nar_requests(s: &Scripted) -> usize {
    s.requests(|p| p.starts_with("/nar/")).len()
}

/// Case 10 with both caches: the primary answers every narinfo with `status`.
fn primary_status(status: u16) -> (String, Scripted) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = case_dir(C10);
    let rules = dir.join(format!("primary-rules-{status}.json"));
    let primary = Scripted::start(&dir.join("cache-primary"), Some(&rules), 0, &tmp.path().join("p.log"));
    let secondary = Scripted::start(&dir.join("cache-secondary"), None, 0, &tmp.path().join("s.log"));
    let root = tmp.path().join("root");
    let path = one_path(C10);
    let o = copy_with(tmp.path(), &root, &format!("{} {}", primary.url, secondary.url), &case_key(C10), FAST, &[&path]);
    check(&o, &format!("copy with the primary answering {status}"));
    assert_eq!(file_content(&root, &path), "found in the second cache\n");
    assert_eq!(narinfo_requests(&primary), 1, "{status} is final: no retry");
    assert_eq!(nar_requests(&secondary), 1);
    (stderr(&o), primary)
}

#[test]
fn not_found_and_forbidden_are_absence() {
    for status in [404, 403] {
        let (err, primary) = primary_status(status);
        assert_eq!(warnings_about(&err, &primary.url), 0, "{status} is silent: {err}");
    }
}

#[test]
fn auth_failures_are_reported_and_fall_back() {
    for (status, body) in [(401, "token expired"), (407, "Proxy Authentication Required")] {
        let (err, primary) = primary_status(status);
        assert_eq!(warnings_about(&err, &primary.url), 1, "one warning for {status}: {err}");
        let line = err.lines().find(|l| l.contains(&primary.url)).unwrap();
        assert!(line.contains(&status.to_string()) && line.contains(body), "{line}");
    }
}

#[test]
fn auth_failure_is_not_cached_as_absence() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = case_dir(C10);
    let path = one_path(C10);
    let root = tmp.path().join("root");
    let port = {
        let primary = Scripted::start(&dir.join("cache-primary"), Some(&dir.join("primary-rules-401.json")), 0, &tmp.path().join("1.log"));
        let o = copy_with(tmp.path(), &root, &primary.url, &case_key(C10), FAST, &[&path]);
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains(&path) && err.contains(&primary.url) && err.contains("401") && err.contains("token expired"), "{err}");
        primary.port
    };
    // The same URL, healed: the next run (same disk cache) asks again and succeeds.
    let healed = Scripted::start(&dir.join("cache-secondary"), None, port, &tmp.path().join("2.log"));
    let o = copy_with(tmp.path(), &root, &healed.url, &case_key(C10), FAST, &[&path]);
    check(&o, "copy from the healed primary");
    assert_eq!(narinfo_requests(&healed), 1);
    assert_eq!(file_content(&root, &path), "found in the second cache\n");
}

/// Case 12: copies variant `variant` through `rules`; returns (output, GETs of the NAR, tmp, root).
fn truncated(rules: &str, variant: &str) -> (std::process::Output, usize, tempfile::TempDir, std::path::PathBuf, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = case_dir(C12);
    let server = Scripted::start(&dir.join("cache"), Some(&dir.join(rules)), 0, &tmp.path().join("log"));
    let path = case_paths(C12).into_iter().find(|(v, _)| v == variant).unwrap().1;
    let root = tmp.path().join("root");
    let o = copy_with(tmp.path(), &root, &server.url, &case_key(C12), FAST, &[&path]);
    let gets = nar_requests(&server);
    (o, gets, tmp, root, path)
}

#[test]
fn truncated_bodies_are_downloaded_again() {
    for (rules, gets) in [("rules-truncate-twice-then-ok.json", 3), ("rules-eof-no-length-once.json", 2)] {
        for variant in ["xz", "plain"] {
            let (o, got, tmp, root, path) = truncated(rules, variant);
            check(&o, &format!("{rules} {variant}"));
            assert_eq!(got, gets, "{rules} {variant}: one extra GET per failure");
            let out = root.join(path.trim_start_matches('/'));
            assert_eq!(std::fs::metadata(out.join("data.bin")).unwrap().len(), 300000);
            assert_eq!(std::fs::read_to_string(out.join("small.txt")).unwrap(), "ok\n");
            assert_nix_verifies(tmp.path(), &root);
        }
    }
}

#[test]
fn always_truncated_bodies_fail_cleanly() {
    for rules in ["rules-truncate-always.json", "rules-eof-no-length-always.json"] {
        for variant in ["xz", "plain"] {
            let (o, got, tmp, root, path) = truncated(rules, variant);
            assert_eq!(o.status.code(), Some(1), "{rules} {variant}");
            assert_eq!(got, 3, "{rules} {variant}: download-attempts GETs");
            let err = stderr(&o);
            let line = err.lines().find(|l| l.starts_with("error:") && l.contains(&path)).unwrap_or_else(|| panic!("{err}"));
            assert!(line.contains("truncated") && line.contains("/nar/big.nar") && line.contains("3 attempts"), "{line}");
            if rules == "rules-truncate-always.json" {
                assert!(line.contains("received 100000 of"), "{line}");
            }
            assert_absent(tmp.path(), &root, &path);
            let lock = root.join("nix/store").join(format!("{}.lock", path.trim_start_matches("/nix/store/")));
            assert!(!lock.exists(), "lock file left behind");
        }
    }
}

/// What a case-13 run left to check.
struct Run {
    err: String,
    primary: Option<Scripted>,
    primary_url: String,
    secondary_nars: usize,
    took: Duration,
    _tmp: tempfile::TempDir,
}

/// Case 13: copies the path with the primary under `rules` (or a closed port) and the secondary.
fn primary_fault(rules: Option<&str>, options: &[(&str, &str)]) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let dir = case_dir(C13);
    let primary = rules.map(|r| Scripted::start(&dir.join("cache-primary"), Some(&dir.join(r)), 0, &tmp.path().join("p.log")));
    let secondary = Scripted::start(&dir.join("cache-secondary"), None, 0, &tmp.path().join("s.log"));
    let primary_url = primary.as_ref().map(|p| p.url.clone()).unwrap_or_else(|| format!("http://127.0.0.1:{}", closed_port()));
    let root = tmp.path().join("root");
    let path = one_path(C13);
    let started = Instant::now();
    let o = copy_with(tmp.path(), &root, &format!("{primary_url} {}", secondary.url), &case_key(C13), options, &[&path]);
    let took = started.elapsed();
    check(&o, &format!("copy with primary {rules:?}"));
    assert_eq!(file_content(&root, &path), "present in both caches\n");
    Run { err: stderr(&o), primary, primary_url, secondary_nars: nar_requests(&secondary), took, _tmp: tmp }
}

#[test]
fn transient_server_errors_are_retried_on_the_same_cache() {
    for (rules, narinfos, nars) in [("primary-rules-narinfo-500-twice.json", 3, 1), ("primary-rules-nar-503-once.json", 1, 2)] {
        let Run { err, primary, primary_url: url, secondary_nars, _tmp: _keep, .. } = primary_fault(Some(rules), FAST);
        let primary = primary.unwrap();
        assert_eq!(secondary_nars, 0, "{rules}: served by the primary");
        assert_eq!(narinfo_requests(&primary), narinfos, "{rules}");
        assert_eq!(nar_requests(&primary), nars, "{rules}");
        assert_eq!(warnings_about(&err, &url), 0, "{err}");
    }
}

#[test]
fn failing_caches_are_skipped_with_one_warning() {
    let cases = [
        Some("primary-rules-narinfo-502-always.json"),
        Some("primary-rules-nar-500-always.json"),
        Some("primary-rules-cache-info-500-always.json"),
        None,
    ];
    for rules in cases {
        let Run { err, primary, primary_url: url, secondary_nars, took, _tmp: _keep, .. } = primary_fault(rules, FAST);
        assert_eq!(secondary_nars, 1, "{rules:?}: served by the secondary");
        assert_eq!(warnings_about(&err, &url), 1, "{rules:?}: one warning: {err}");
        assert!(took < Duration::from_secs(15), "{rules:?}: took {took:?}");
        if let Some(p) = primary {
            let bad = p.requests(|_| true).iter().filter(|r| r.2 >= 500).count();
            assert_eq!(bad, 3, "{rules:?}: download-attempts requests, then no more");
        }
    }
}

#[test]
fn a_stalled_cache_times_out() {
    let options = [("download-attempts", "2"), ("stalled-download-timeout", "1")];
    let Run { err, primary_url: url, secondary_nars, took, _tmp: _keep, .. } =
        primary_fault(Some("primary-rules-narinfo-slow-30s.json"), &options);
    assert_eq!(secondary_nars, 1);
    assert_eq!(warnings_about(&err, &url), 1, "{err}");
    assert!(err.contains("stalled-download-timeout"), "{err}");
    assert!(took < Duration::from_secs(8), "took {took:?}");
}

/// An `https://` cache whose server accepts the connection and never answers the TLS
/// handshake: `connect-timeout` bounds the whole connection set-up, TLS included, as curl's
/// `CURLOPT_CONNECTTIMEOUT` does for Nix, so the query fails after about a second, naming the
/// URL and saying the connection timed out. Before, the setting bounded only the TCP connect
/// (which the kernel completes for a listening socket nobody accepts on), and the query waited
/// for the stall timeout.
#[test]
fn a_tls_handshake_never_answered_is_bounded_by_connect_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let to = tmp.path().join("to");
    let options = ["--option", "connect-timeout", "1", "--option", "download-attempts", "1", "--option", "stalled-download-timeout", "20"];
    let started = Instant::now();
    let o = sluice(tmp.path(), &[&["copy", "--from", &url, "--to", to.to_str().unwrap()][..], &options, &[TOP]].concat());
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    let line = err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.starts_with(&format!("error: {url}/")) && line.contains("connection timed out"), "{line}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(6), "took {took:?}");
    drop(silent);
}
