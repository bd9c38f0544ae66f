//! Regressions: a closure sluice has never seen, and regression tests for
//! the defects hostile reviews found.
//!
//! `unseen_closure_over_http_verified_by_nix` builds a fresh closure with
//! `shared/corpus/make-corpus` (250 paths, depth 7, a NEW random signing key each run; the shape
//! differs from the shipped corpus), serves its xz cache with real nginx, copies it with
//! `sluice copy` into an empty chroot store and lets real Nix 2.8 verify every path and compare
//! the metadata with what Nix reads from the cache. make-corpus builds in a private, empty /nix
//! on tmpfs mounted in a mount namespace of its own (sandbox = false), never in this machine's
//! /nix, which is why it needs root, as CI has.
//! Measured: ~45 s on 2 busy cores.
//!
//! The tests marked `#[ignore = "defect: …"]` reproduce defects found in the review; run them
//! with `cargo test -p sluice --test review -- --ignored`. Remove the `ignore` once fixed.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::*;
use serde_json::Value;

const FIELDS: [&str; 7] = ["path", "narHash", "narSize", "references", "deriver", "ca", "signatures"];

fn by_path(entries: &[Value], fields: &[&str]) -> BTreeMap<String, Value> {
    entries
        .iter()
        .map(|e| {
            let mut picked = serde_json::Map::new();
            for f in fields {
                let mut v = e.get(*f).cloned().unwrap_or(Value::Null);
                if *f == "signatures" {
                    if let Value::Array(a) = &mut v {
                        a.sort_by(|x, y| x.as_str().cmp(&y.as_str()));
                    }
                }
                picked.insert(f.to_string(), v);
            }
            (e["path"].as_str().unwrap().to_string(), Value::Object(picked))
        })
        .collect()
}

#[test]
fn unseen_closure_over_http_verified_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("corpus");
    let o = Command::new(corpus().join("make-corpus"))
        .args(["--out", out.to_str().unwrap(), "--seed", "23", "--paths", "250", "--depth", "7"])
        .args(["--key-name", "review-unseen-1", "--work", tmp.path().join("work").to_str().unwrap()])
        .args(["--full-compressions", "xz", "--subset-compressions", "none", "--no-drv-cache", "--no-verify"])
        .output()
        .unwrap();
    check(&o, "make-corpus (needs Nix 2.8 and root, for its private /nix)");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("truth/summary.json")).unwrap()).unwrap();
    let top = summary["topLevel"].as_str().unwrap().to_string();
    let key = std::fs::read_to_string(out.join("keys/cache-key.pub")).unwrap().trim().to_string();
    assert_ne!(key, corpus_key(), "make-corpus must have made a new key");

    let server = CacheServer::start(&out.join("cache-xz"), &tmp.path().join("srv"), &[]);
    let root = tmp.path().join("root");
    let o = sluice(tmp.path(), &["copy", "--from", &server.url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &key, &top]);
    check(&o, "sluice copy of the unseen closure");
    assert_nix_verifies(tmp.path(), &root);

    let cache = format!("file://{}", out.join("cache-xz").display());
    let want = nix_path_info(tmp.path(), &cache, &top);
    let got = nix_path_info(tmp.path(), root.to_str().unwrap(), &top);
    assert_eq!(want.len(), 250);
    assert_eq!(by_path(&got, &FIELDS), by_path(&want, &FIELDS), "real Nix sees the copy as the cache describes it");

    // sluice's own view of the cache and of the store matches real Nix's, field for field.
    let all = [
        "path",
        "narHash",
        "narSize",
        "references",
        "deriver",
        "ca",
        "signatures",
        "url",
        "downloadHash",
        "downloadSize",
        "closureSize",
        "closureDownloadSize",
    ];
    for store in [server.url.as_str(), root.to_str().unwrap()] {
        let o = sluice(tmp.path(), &["path-info", "--as-nix", "2.8", "--store", store, "-r", "--json", "-S", &top]);
        check(&o, "sluice path-info");
        let s: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
        let o = nix(tmp.path(), "nix", &["path-info", "--store", store, "-r", "--json", "-S", &top]);
        check(&o, "nix path-info");
        let n: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(by_path(&s, &all), by_path(&n, &all), "sluice path-info --store {store}");
    }

    // The same closure signed by the shipped corpus key only: every signed path is refused.
    let root2 = tmp.path().join("root2");
    let o =
        sluice(tmp.path(), &["copy", "--from", &server.url, "--to", root2.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &top]);
    assert_eq!(o.status.code(), Some(1), "untrusted key must fail");
    let o2 = nix(tmp.path(), "nix-store", &["--store", root2.to_str().unwrap(), "--check-validity", &top]);
    assert!(!o2.status.success(), "top must not be registered");
    assert!(stderr(&o).contains("lack a signature by a trusted key: they are signed by review-unseen-1 but trusted-public-keys has corpus-nixos-1-1; if you trust that key, add it to trusted-public-keys"), "{}", stderr(&o));
}

/// Case 04/06 say a rejected NAR leaves nothing behind "in every consumer (unpack, …)".
/// `sluice nar restore DIR` leaves a partial DIR (an empty directory for case 06, a truncated
/// file for case 04).
#[test]
fn nar_restore_leaves_nothing_on_reject() {
    let tmp = tempfile::tempdir().unwrap();
    for nar in [case_dir("04-nar-bogus-lengths").join("truncated.nar"), case_dir("06-nar-directory-entries").join("unsorted.nar")] {
        let dest = tmp.path().join("out");
        let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["nar", "restore", dest.to_str().unwrap()])
            .stdin(std::fs::File::open(&nar).unwrap())
            .output()
            .unwrap();
        assert!(!o.status.success(), "{} must be rejected", nar.display());
        assert!(!dest.exists() && dest.symlink_metadata().is_err(), "{}: partial output left at {}", nar.display(), dest.display());
    }
}

/// docs/usage.md: "metadata of paths … as `nix path-info` prints it". Without `--json`, Nix 2.8 prints
/// `-r` closures in topological order (dependencies first); sluice prints them sorted by hash.
#[test]
fn path_info_text_order_matches_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sample");
    let top = std::fs::read_to_string(sample.join("top")).unwrap().trim().to_string();
    let url = format!("file://{}", sample.join("cache").canonicalize().unwrap().display());
    for flags in [&["-r"][..], &["-r", "-s", "-S"][..]] {
        let mut args = vec!["path-info", "--store", url.as_str()];
        args.extend(flags);
        args.push(&top);
        let s = sluice(tmp.path(), &args);
        check(&s, "sluice path-info");
        let n = nix(tmp.path(), "nix", &args);
        check(&n, "nix path-info");
        assert_eq!(String::from_utf8_lossy(&s.stdout), String::from_utf8_lossy(&n.stdout), "sluice {args:?}");
    }
}

/// `sluice path-info … | head -1` panics with "failed printing to stdout: Broken pipe" (and a
/// backtrace when RUST_BACKTRACE is set); Nix exits quietly.
#[test]
fn path_info_into_closed_pipe_does_not_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", corpus().join("cache-xz").display());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp.path(), "");
    let mut child = cmd.args(["path-info", "--store", &url, "-r", TOP]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    drop(child.stdout.take()); // the reader goes away, like `| head -0`
    let o = child.wait_with_output().unwrap();
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

/// Case 02 and 08: when a corrupt narinfo / a bad NAR in the first cache is skipped in favour of a
/// second cache, the failure "must be logged". sluice falls back silently.
#[test]
fn fallback_after_bad_nar_is_logged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = case_dir("08-nar-hash-size-mismatch");
    let root = tmp.path().join("root");
    let subs = format!("file://{} file://{}", dir.join("cache-a").display(), dir.join("cache-b").display());
    let path = "/nix/store/8fzypr7nz0hvf4zms8g38mbna540c5yn-content-differs";
    let o = copy_with(tmp.path(), &root, &subs, &case_key("08-nar-hash-size-mismatch"), &[], &[path]);
    check(&o, "copy with fallback");
    let err = stderr(&o);
    assert!(err.contains("cache-a") && err.contains("hash"), "the hash mismatch in cache-a is not reported:\n{err}");
}

/// Case 09: "rejection message lists the key names found on the narinfo and the trusted key
/// names". sluice names only the keys found.
#[test]
fn untrusted_signature_message_names_trusted_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = case_dir("09-signature-verification");
    let root = tmp.path().join("root");
    let path = "/nix/store/jc08i6bnzssji53vrfykr9jdg8mmxhqa-app-untrusted-only";
    let o = copy_with(
        tmp.path(),
        &root,
        &format!("file://{}", dir.join("cache").display()),
        &case_key("09-signature-verification"),
        &[],
        &[path],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("other-cache-1") && err.contains("case-test-1"), "{err}");
}

/// `nix copy ./result` follows a symlink to a store path; `sluice copy` refuses it with
/// "is not in the store directory".
#[test]
fn copy_accepts_symlink_to_store_path() {
    let tmp = tempfile::tempdir().unwrap();
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sample");
    let top = std::fs::read_to_string(sample.join("top")).unwrap().trim().to_string();
    let link = tmp.path().join("result");
    std::os::unix::fs::symlink(&top, &link).unwrap();
    let key = std::fs::read_to_string(sample.join("key.pub")).unwrap().trim().to_string();
    let root = tmp.path().join("root");
    let url = format!("file://{}", sample.join("cache").canonicalize().unwrap().display());
    let o = sluice(
        tmp.path(),
        &["copy", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &key, link.to_str().unwrap()],
    );
    check(&o, "sluice copy ./result");
}

/// Transport errors print only reqwest's outer message, "error sending request for url (…)",
/// without the cause (connection refused, unknown TLS issuer), so the "reason" the issue asks
/// for is missing. Repro: a closed port, and an HTTPS cache whose CA is not trusted.
#[test]
fn transport_errors_name_their_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sample");
    let top = std::fs::read_to_string(sample.join("top")).unwrap().trim().to_string();
    let key = std::fs::read_to_string(sample.join("key.pub")).unwrap().trim().to_string();
    let o = copy_with(tmp.path(), &tmp.path().join("r1"), &format!("http://127.0.0.1:{port}"), &key, &[], &[&top]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).to_lowercase().contains("refused"), "{}", stderr(&o));

    let server = CacheServer::start(&sample.join("cache"), &tmp.path().join("srv"), &["--tls"]);
    let o = copy_with(tmp.path(), &tmp.path().join("r2"), &server.url, &key, &[], &[&top]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).to_lowercase().contains("certificate") || stderr(&o).contains("UnknownIssuer"), "{}", stderr(&o));
}

/// A NAR nested deeper than the open-file limit (300 directories, under `ulimit -n 64`) is
/// restored as Nix restores it: its dump is the NAR. The unpacker held a descriptor for every
/// directory above the node being made, and failed with "Too many open files" at level 60; it
/// now holds one for each KiB of path (`unpack.rs`), so a copy's unpacking jobs hold a few
/// descriptors each however deep their trees (`fd_budget.rs`).
#[test]
fn nar_deeper_than_the_open_file_limit_restores() {
    let tmp = tempfile::tempdir().unwrap();
    let tree = tmp.path().join("deep");
    let mut dir = tree.clone();
    for level in 0..300 {
        if level % 50 == 0 {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("f"), format!("level {level}\n")).unwrap();
        }
        dir.push("a");
    }
    std::fs::create_dir_all(&dir).unwrap();
    let nar = tmp.path().join("deep.nar");
    let dumped = Command::new("nix-store").args(["--dump", tree.to_str().unwrap()]).output().unwrap();
    check(&dumped, "nix-store --dump");
    std::fs::write(&nar, &dumped.stdout).unwrap();
    let restored = tmp.path().join("restored");
    let o = Command::new("sh")
        .args(["-c", "ulimit -n 64 && exec \"$0\" nar restore \"$1\"", env!("CARGO_BIN_EXE_sluice"), restored.to_str().unwrap()])
        .stdin(std::fs::File::open(&nar).unwrap())
        .output()
        .unwrap();
    check(&o, "sluice nar restore under ulimit -n 64");
    let again = Command::new("nix-store").args(["--dump", restored.to_str().unwrap()]).output().unwrap();
    check(&again, "nix-store --dump of the restored tree");
    assert!(again.stdout == dumped.stdout, "the restored tree dumps otherwise");
}

/// `nix-store --restore` creates files 0644/0755 (then umask); `sluice nar restore` makes them
/// read-only (0444/0555), unlike the tool it mirrors. Canonical store metadata is given only
/// when unpacking into a store.
#[test]
fn nar_restore_modes_match_nix() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let nar = corpus().join("fixtures/varied-tree.nar");
    let run = |prog: &str, args: &[&str]| {
        let o = Command::new(prog).args(args).stdin(std::fs::File::open(&nar).unwrap()).output().unwrap();
        check(&o, prog);
    };
    let a = tmp.path().join("nix");
    let b = tmp.path().join("sluice");
    run("nix-store", &["--restore", a.to_str().unwrap()]);
    run(env!("CARGO_BIN_EXE_sluice"), &["nar", "restore", b.to_str().unwrap()]);
    for rel in ["bin/corven", "lib/libcorven.so.9.5.7"] {
        let ma = std::fs::metadata(a.join(rel)).unwrap().permissions().mode() & 0o7777;
        let mb = std::fs::metadata(b.join(rel)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(format!("{mb:o}"), format!("{ma:o}"), "{rel}");
    }
}
