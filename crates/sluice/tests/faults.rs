//! Refusals: untrusted or malformed signatures (case 09) and NARs that do not match their
//! NarHash/NarSize (case 08). A refused path is neither registered nor left at its final
//! path, and no temporary tree or lock file remains; an accepted one is verified by real Nix.

use crate::common::*;

#[test]
fn signature_rules_of_case_09() {
    let case = "09-signature-verification";
    let url = format!("file://{}", shared().join("cases").join(case).join("cache").display());
    let accept =
        ["dep-helper", "trusted", "untrusted-then-trusted", "bad-base64-plus-good", "truncated-plus-good", "no-colon-sig", "ca-unsigned"];
    let paths = case_paths(case);
    assert_eq!(paths.len(), 16);
    for (variant, path) in paths {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let o =
            sluice(tmp.path(), &["copy", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), &path]);
        if accept.contains(&variant.as_str()) {
            check(&o, &format!("copy of {variant}"));
            assert_nix_verifies(tmp.path(), &root);
            // The Sig lines are stored verbatim, malformed ones too (never repaired).
            let narinfo =
                std::fs::read_to_string(case_dir(case).join("cache").join(format!("{}.narinfo", &path["/nix/store/".len()..][..32])))
                    .unwrap();
            let mut sigs: Vec<&str> = narinfo.lines().filter_map(|l| l.strip_prefix("Sig: ")).collect();
            sigs.sort();
            let info = nix_path_info(tmp.path(), root.to_str().unwrap(), &path);
            let stored: Vec<&str> = info[0]["signatures"].as_array().map_or(vec![], |a| a.iter().map(|s| s.as_str().unwrap()).collect());
            assert_eq!(stored, sigs, "{variant}");
            // A malformed Sig line is skipped with a warning naming it (case 09's rule).
            let warned = stderr(&o).lines().filter(|l| l.starts_with("warning: ") && l.contains("is not NAME:BASE64")).count();
            let malformed = ["bad-base64-plus-good", "truncated-plus-good", "no-colon-sig"].contains(&variant.as_str());
            assert_eq!(warned > 0, malformed, "{variant}: {}", stderr(&o));
        } else {
            assert_eq!(o.status.code(), Some(1), "{variant} must be refused: {}", stderr(&o));
            let err = stderr(&o);
            assert!(err.contains(&path), "{variant}: the error names the path: {err}");
            assert!(err.contains("signature") || err.contains("content address"), "{variant}: the error gives the reason: {err}");
            assert_absent(tmp.path(), &root, &path);
            if ["untrusted-only", "keyname-relabelled"].contains(&variant.as_str()) {
                assert!(err.contains("(signed by: other-cache-1; trusted: case-test-1)"), "{variant}: the key names: {err}");
            }
            // An unsigned path names the trusted keys too (what would have vouched for it).
            if variant == "no-sig" {
                assert!(
                    err.contains("lacks a signature by a trusted key (it has no signature; trusted: case-test-1)"),
                    "{variant}: the key names: {err}"
                );
            }
            // An unsigned path whose content address is false is told apart, in Nix's words.
            assert_eq!(err.contains("it claims to be content-addressed but isn't"), variant == "ca-mismatch", "{variant}: {err}");
            // A signature under the trusted key's name that does not verify is told apart.
            let unverified = "the signature by case-test-1 does not verify: it was not made over this NAR hash, size and references";
            assert_eq!(
                err.contains(unverified),
                ["wrong-key-same-name", "fingerprint-short-refs", "sig-of-other-path", "bad-base64-only", "truncated-sig"]
                    .contains(&variant.as_str()),
                "{variant}: {err}"
            );
        }
    }
}

#[test]
fn nar_mismatches_of_case_08() {
    let case = "08-nar-hash-size-mismatch";
    let dir = shared().join("cases").join(case);
    let cache_a = format!("file://{}", dir.join("cache-a").display());
    let cache_b = format!("file://{}", dir.join("cache-b").display());
    let expect = [("content-differs", "hash mismatch"), ("narsize-too-big", "size mismatch"), ("narsize-too-small", "size mismatch")];
    let mut seen = std::collections::HashSet::new();
    let rows: Vec<_> = case_paths(case).into_iter().filter(|(v, _)| seen.insert(v.clone())).collect();
    assert_eq!(rows.len(), 4);
    for (variant, path) in rows {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let o = sluice(
            tmp.path(),
            &["copy", "--from", &cache_a, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), &path],
        );
        match expect.iter().find(|(v, _)| *v == variant) {
            Some((_, reason)) => {
                assert_eq!(o.status.code(), Some(1), "{variant} must be refused");
                let err = stderr(&o);
                assert!(err.contains(&path) && err.contains(reason) && err.contains(&cache_a), "{variant}: {err}");
                assert_absent(tmp.path(), &root, &path);
            }
            None => {
                check(&o, &format!("copy of {variant}"));
                assert_nix_verifies(tmp.path(), &root);
            }
        }
    }
    // With both caches configured, the bad NAR of cache-a is refused and cache-b's is used.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let path = "/nix/store/8fzypr7nz0hvf4zms8g38mbna540c5yn-content-differs";
    let subs = format!("{cache_a} {cache_b}");
    let o = sluice(
        tmp.path(),
        &["copy", "--substituters", &subs, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), path],
    );
    check(&o, "copy with fallback to cache-b");
    assert_nix_verifies(tmp.path(), &root);
    let dump = nix(tmp.path(), "nix", &["store", "dump-path", "--store", root.to_str().unwrap(), path]);
    assert!(String::from_utf8_lossy(&dump.stdout).contains("good build"));
}

/// glibc of the uncompressed corpus subset, and libidn2, which it refers to.
const GLIBC: &str = "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.37-8";
const LIBIDN2: &str = "/nix/store/xyvbjffswy2ix1ipcpb6gnw3abxsaym7-libidn2-2.3.4";
/// A leaf of the subset that neither refers to them nor is referred to by them only.
const LIBUNISTRING: &str = "/nix/store/8j3ihyw3p978y2hzm7mkwvzqxk86h123-libunistring-1.1";

/// A writable copy of the corpus's uncompressed subset cache, at `tmp/name`.
fn subset_cache(tmp: &std::path::Path, name: &str) -> std::path::PathBuf {
    let dir = tmp.join(name);
    copy_dir(&corpus().join("cache-subset-none"), &dir);
    dir
}

/// The narinfo file of `path` in `cache`.
fn narinfo_of(cache: &std::path::Path, path: &str) -> std::path::PathBuf {
    cache.join(format!("{}.narinfo", &path["/nix/store/".len()..][..32]))
}

/// The NAR file of `path` in `cache` (its narinfo's `URL`).
fn nar_file_of(cache: &std::path::Path, path: &str) -> std::path::PathBuf {
    let narinfo = std::fs::read_to_string(narinfo_of(cache, path)).unwrap();
    cache.join(narinfo.lines().find_map(|l| l.strip_prefix("URL: ")).unwrap())
}

/// Makes libidn2's narinfo in `cache` claim glibc as a reference, closing a cycle with
/// glibc's claim of libidn2. Its signature, over the references, no longer holds.
fn claim_cycle(cache: &std::path::Path) {
    let file = narinfo_of(cache, LIBIDN2);
    let text = std::fs::read_to_string(&file).unwrap();
    let glibc = &GLIBC["/nix/store/".len()..];
    let claimed: String =
        text.lines().map(|l| if l.starts_with("References: ") { format!("{l} {glibc}\n") } else { format!("{l}\n") }).collect();
    assert_ne!(claimed, text);
    std::fs::write(file, claimed).unwrap();
}

/// `sluice ARGS` under `timeout 120`, so that a copy that hangs fails the test.
fn sluice_within(tmp: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new("timeout");
    isolate(&mut cmd, tmp, "");
    let o = cmd.arg("120").arg(env!("CARGO_BIN_EXE_sluice")).args(args).output().unwrap();
    assert_ne!(o.status.code(), Some(124), "sluice {args:?} hung: {}", stderr(&o));
    o
}

/// Whether real Nix finds `path` valid in the store at `root`.
fn nix_valid(tmp: &std::path::Path, root: &std::path::Path, path: &str) -> bool {
    nix(tmp, "nix-store", &["--store", root.to_str().unwrap(), "--check-validity", path]).status.success()
}

/// A cache whose narinfos claim a reference cycle (libidn2 and glibc referring to each other):
/// the copy, into a local store and into a file:// cache, fails their paths and those that
/// refer to them with Nix's message instead of waiting for ever, and copies the rest.
#[test]
fn a_reference_cycle_claimed_by_a_cache_fails_its_paths_instead_of_hanging() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = subset_cache(tmp.path(), "hostile");
    claim_cycle(&cache);
    let from = format!("file://{}", cache.display());
    let top = corpus_path("hexurvend-wrapper");
    let cycle = format!("cycle detected in the references of '{GLIBC}' from '{LIBIDN2}'");
    let root = tmp.path().join("root");
    let o = sluice_within(tmp.path(), &["copy", "--no-check-sigs", "--from", &from, "--to", root.to_str().unwrap(), &top]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(&cycle), "{}", stderr(&o));
    for path in [GLIBC, LIBIDN2, top.as_str()] {
        assert_absent(tmp.path(), &root, path);
    }
    assert!(nix_valid(tmp.path(), &root, LIBUNISTRING));
    assert_nix_verifies(tmp.path(), &root);

    let dest = tmp.path().join("dest");
    let to = format!("file://{}", dest.display());
    let o = sluice_within(tmp.path(), &["copy", "--from", &from, "--to", &to, &top]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    // Each failed path is named once, before its reason.
    assert!(stderr(&o).lines().any(|l| l == format!("error: {GLIBC}: {cycle}")), "{}", stderr(&o));
    for path in [GLIBC, LIBIDN2, top.as_str()] {
        assert!(!narinfo_of(&dest, path).exists(), "{path} was pushed");
    }
    assert!(narinfo_of(&dest, LIBUNISTRING).exists());
}

/// The first cache's libidn2 has no NAR; the second cache's narinfo of it claims glibc, which
/// the closure was not walked with (it would close a cycle): it is not used, and the copy
/// fails libidn2 and its referrers instead of waiting for ever.
#[test]
fn a_cycle_claimed_only_by_a_fallback_narinfo_does_not_hang_the_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let first = subset_cache(tmp.path(), "first");
    std::fs::remove_file(nar_file_of(&first, LIBIDN2)).unwrap();
    let second = subset_cache(tmp.path(), "second");
    claim_cycle(&second);
    let subs = format!("file://{} file://{}?trusted=true", first.display(), second.display());
    let root = tmp.path().join("root");
    let o = sluice_within(
        tmp.path(),
        &[
            "copy",
            "--substituters",
            &subs,
            "--trusted-public-keys",
            &corpus_key(),
            "--to",
            root.to_str().unwrap(),
            &corpus_path("hexurvend-wrapper"),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("not used: it lists references that the narinfo the closure was walked with does not")
            && err.contains(&format!("'{GLIBC}'")),
        "{err}"
    );
    for path in [GLIBC, LIBIDN2] {
        assert_absent(tmp.path(), &root, path);
    }
    assert!(nix_valid(tmp.path(), &root, LIBUNISTRING));
    assert_nix_verifies(tmp.path(), &root);
}

/// The first cache's narinfo of libidn2 claims a cycle and its signature does not hold; the
/// second cache has it signed, as it is. The closure is walked with the narinfo that will be
/// used (Nix passes over an untrusted one): the whole closure is copied.
#[test]
fn a_cycle_claimed_by_an_untrusted_narinfo_does_not_fail_paths_a_trusted_cache_has() {
    let tmp = tempfile::tempdir().unwrap();
    let hostile = subset_cache(tmp.path(), "hostile");
    claim_cycle(&hostile);
    let subs = format!("file://{} file://{}", hostile.display(), corpus().join("cache-subset-none").display());
    let root = tmp.path().join("root");
    let top = corpus_path("hexurvend-wrapper");
    let o = sluice_within(
        tmp.path(),
        &["copy", "--substituters", &subs, "--trusted-public-keys", &corpus_key(), "--to", root.to_str().unwrap(), &top],
    );
    check(&o, "copy past an untrusted cyclic narinfo");
    assert_eq!(nix_path_info(tmp.path(), root.to_str().unwrap(), &top).len(), 25);
    let info = nix_path_info(tmp.path(), root.to_str().unwrap(), LIBIDN2);
    let references: Vec<&str> =
        info.iter().find(|i| i["path"] == LIBIDN2).unwrap()["references"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    assert_eq!(references, [LIBUNISTRING, LIBIDN2]);
    assert_nix_verifies(tmp.path(), &root);
}

/// The first cache's NAR of libidn2 does not match its NarHash, which the store finds when it
/// commits it, maybe after glibc was handed to the registrar behind it: glibc waits and is
/// registered once libidn2 from the second cache is.
#[test]
fn dependents_of_a_path_refused_at_commit_are_registered_after_its_next_substituter() {
    let tmp = tempfile::tempdir().unwrap();
    let first = subset_cache(tmp.path(), "first");
    let nar_file = nar_file_of(&first, LIBIDN2);
    let mut nar = std::fs::read(&nar_file).unwrap();
    // The first byte of the first regular file's contents.
    let at = nar.windows(8).position(|w| w == b"contents").unwrap() + 16;
    nar[at] ^= 1;
    std::fs::write(&nar_file, nar).unwrap();
    let subs = format!("file://{} file://{}", first.display(), corpus().join("cache-subset-none").display());
    let root = tmp.path().join("root");
    let top = corpus_path("hexurvend-wrapper");
    let o = sluice_within(
        tmp.path(),
        &["copy", "--substituters", &subs, "--trusted-public-keys", &corpus_key(), "--to", root.to_str().unwrap(), &top],
    );
    check(&o, "copy past a NAR refused at commit");
    assert!(stderr(&o).contains("hash mismatch"), "the first cache's NAR is reported: {}", stderr(&o));
    assert_eq!(nix_path_info(tmp.path(), root.to_str().unwrap(), &top).len(), 25);
    assert_nix_verifies(tmp.path(), &root);
}

/// The first cache's libidn2 claims a cycle with glibc and has no NAR; the second cache's
/// narinfo of it lists fewer references. The cycle fails libidn2 once the closure is known,
/// while its job goes on to the second cache: it must not be registered afterwards. Each
/// path is reported failed or copied, never both, and a failed one is not in the store.
#[test]
fn a_path_failed_for_a_cycle_is_not_registered_by_its_next_substituter() {
    let tmp = tempfile::tempdir().unwrap();
    let first = subset_cache(tmp.path(), "first");
    claim_cycle(&first);
    std::fs::remove_file(nar_file_of(&first, LIBIDN2)).unwrap();
    let subs = format!("file://{} file://{}", first.display(), corpus().join("cache-subset-none").display());
    let root = tmp.path().join("root");
    let top = corpus_path("hexurvend-wrapper");
    let o = sluice_within(
        tmp.path(),
        &["copy", "--json", "--jobs", "1", "--no-check-sigs", "--substituters", &subs, "--to", root.to_str().unwrap(), &top],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let failed = report["failed"].as_object().unwrap();
    assert!(failed[GLIBC].as_str().unwrap().contains("cycle detected in the references of"), "{report}");
    for path in report["substituted"].as_array().unwrap() {
        assert!(!failed.contains_key(path.as_str().unwrap()), "{path} is reported both copied and failed: {report}");
    }
    for path in failed.keys() {
        assert_absent(tmp.path(), &root, path);
    }
    assert!(nix_valid(tmp.path(), &root, LIBUNISTRING));
    assert_nix_verifies(tmp.path(), &root);
}
