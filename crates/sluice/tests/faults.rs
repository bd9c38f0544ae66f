//! Refusals: untrusted or malformed signatures (case 09) and NARs that do not match their
//! NarHash/NarSize (case 08). A refused path is neither registered nor left at its final
//! path, and no temporary tree or lock file remains; an accepted one is verified by real Nix.

mod common;

use common::*;

#[test]
fn signature_rules_of_case_09() {
    let case = "09-signature-verification";
    let url = format!("file://{}", shared().join("cases").join(case).join("cache").display());
    let accept = ["dep-helper", "trusted", "untrusted-then-trusted", "bad-base64-plus-good", "truncated-plus-good", "no-colon-sig", "ca-unsigned"];
    let paths = case_paths(case);
    assert_eq!(paths.len(), 16);
    for (variant, path) in paths {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let o = sluice(tmp.path(), &["copy", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), &path]);
        if accept.contains(&variant.as_str()) {
            check(&o, &format!("copy of {variant}"));
            assert_nix_verifies(tmp.path(), &root);
            // The Sig lines are stored verbatim, malformed ones too (never repaired).
            let narinfo = std::fs::read_to_string(case_dir(case).join("cache").join(format!("{}.narinfo", &path["/nix/store/".len()..][..32]))).unwrap();
            let mut sigs: Vec<&str> = narinfo.lines().filter_map(|l| l.strip_prefix("Sig: ")).collect();
            sigs.sort();
            let info = nix_path_info(tmp.path(), root.to_str().unwrap(), &path);
            let stored: Vec<&str> = info[0]["signatures"].as_array().map_or(vec![], |a| a.iter().map(|s| s.as_str().unwrap()).collect());
            assert_eq!(stored, sigs, "{variant}");
        } else {
            assert_eq!(o.status.code(), Some(1), "{variant} must be refused: {}", stderr(&o));
            let err = stderr(&o);
            assert!(err.contains(&path), "{variant}: the error names the path: {err}");
            assert!(err.contains("signature") || err.contains("content address"), "{variant}: the error gives the reason: {err}");
            assert_absent(tmp.path(), &root, &path);
            if ["untrusted-only", "keyname-relabelled"].contains(&variant.as_str()) {
                assert!(err.contains("(signed by: other-cache-1; trusted: case-test-1)"), "{variant}: the key names: {err}");
            }
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
        let o = sluice(tmp.path(), &["copy", "--from", &cache_a, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), &path]);
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
    let o = sluice(tmp.path(), &["copy", "--substituters", &subs, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), path]);
    check(&o, "copy with fallback to cache-b");
    assert_nix_verifies(tmp.path(), &root);
    let dump = nix(tmp.path(), "nix", &["store", "dump-path", "--store", root.to_str().unwrap(), path]);
    assert!(String::from_utf8_lossy(&dump.stdout).contains("good build"));
}
