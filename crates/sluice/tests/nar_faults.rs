//! NAR structure and integrity end to end (cases 04, 06): absurd declared lengths are refused
//! quickly without memory following them, illegal or unsorted entries and writes through a
//! symlink are refused, the `Compression` field must agree with the bytes, a proxy's
//! `Content-Encoding: gzip` is decoded, and a wrong FileSize only warns (the content is
//! verified by the signed NarHash). Nothing is ever left at a refused path's final place.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::*;

const C04: &str = "04-nar-bogus-lengths";
const C06: &str = "06-nar-directory-entries";

/// `sluice copy` of `path` from case `case`'s cache under `/usr/bin/time`: the output, the
/// peak RSS of the sluice process in KiB, and the wall time.
fn copy_measured(tmp: &Path, root: &Path, case: &str, path: &str) -> (Output, u64, Duration) {
    let rss = tmp.join("rss");
    let url = format!("file://{}", case_dir(case).join("cache").display());
    let mut cmd = sluice_measured(tmp, &rss);
    cmd.args(["copy", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &case_key(case), path]);
    let started = Instant::now();
    let o = cmd.output().unwrap();
    let took = started.elapsed();
    (o, measured_rss(&rss), took)
}

/// Asserts that copying `path` failed with an error naming the path and containing one of `reasons`.
fn assert_refused(o: &Output, path: &str, reasons: &[&str]) {
    assert_eq!(o.status.code(), Some(1), "{path} must be refused");
    let err = stderr(o);
    let line = err.lines().find(|l| l.starts_with("error:") && l.contains(path)).unwrap_or_else(|| panic!("{path}: {err}"));
    assert!(reasons.iter().any(|r| line.contains(r)), "{path}: expected one of {reasons:?} in {line}");
}

#[test]
fn bogus_lengths_are_refused_without_following_them() {
    let reasons: &[(&str, &[&str])] = &[
        // What is wrong with it, not that its bytes are of no known compression.
        ("no-magic", &["NAR: not a NAR: input doesn't look like a Nix archive (bad magic: it starts with '\\x00\\x00\\x88\\'\\x02\\x00\\x04\\x00', not the 'nix-archive-1' header) at byte 0"]),
        ("huge-token", &["too long"]),
        ("big-token", &["too long"]),
        ("huge-contents", &["unexpected end", "NarSize"]),
        ("truncated", &["unexpected end", "NarSize"]),
    ];
    for (variant, path) in case_paths(C04) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let (o, kib, took) = copy_measured(tmp.path(), &root, C04, &path);
        let expected = reasons.iter().find(|(v, _)| *v == variant).unwrap().1;
        assert_refused(&o, &path, expected);
        // A copy that failed closes the store as one that did not.
        assert_store_closed(&root);
        assert!(kib < 64 * 1024, "{variant}: peak RSS {kib} KiB");
        assert!(took < Duration::from_secs(2), "{variant}: took {took:?}");
        assert_absent(tmp.path(), &root, &path);
    }
}

#[test]
fn directory_entry_rules_of_case_06() {
    let outside = Path::new("/tmp/sluice-case06-outside");
    for (variant, path) in case_paths(C06) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let (o, _, _) = copy_measured(tmp.path(), &root, C06, &path);
        match variant.as_str() {
            "ok-prefix-names" => {
                check(&o, &variant);
                let out = root.join(&path[1..]);
                for f in ["foo/bar.h", "foo-", "foo.h"] {
                    assert!(out.join(f).exists(), "{f} missing");
                }
                assert_nix_verifies(tmp.path(), &root);
            }
            "unsorted" | "duplicate-file" | "dup-symlink-then-dir" | "dup-symlink-then-file" => {
                assert_refused(&o, &path, &["sorted", "duplicate"])
            }
            _ => assert_refused(&o, &path, &["invalid file name", "name"]),
        }
        if variant != "ok-prefix-names" {
            assert_absent(tmp.path(), &root, &path);
        }
        assert!(
            !outside.join("pwned").exists() && !outside.join("pwned2").exists() && !outside.join("pwned3").exists(),
            "{variant} wrote outside"
        );
    }
}

/// A writable copy of case 12's cache with `edit` applied to the narinfo of `variant`.
fn edited_cache(tmp: &Path, variant: &str, edit: impl Fn(String) -> String) -> (String, String) {
    let cache = tmp.join("cache");
    copy_dir(&case_dir("12-http-truncated-body").join("cache"), &cache);
    let path = case_paths("12-http-truncated-body").into_iter().find(|(v, _)| v == variant).unwrap().1;
    let file = cache.join(format!("{}.narinfo", &path[11..43]));
    std::fs::write(&file, edit(std::fs::read_to_string(&file).unwrap())).unwrap();
    (format!("file://{}", cache.display()), path)
}

#[test]
fn compression_field_must_match_the_bytes() {
    for (variant, from, to, reason) in [
        ("xz", "Compression: xz", "Compression: zstd", "Compression is zstd but the data starts like xz"),
        ("plain", "Compression: none", "Compression: bzip2", "Compression is bzip2"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (url, path) = edited_cache(tmp.path(), variant, |t| t.replace(from, to));
        let root = tmp.path().join("root");
        let o = copy_with(tmp.path(), &root, &url, &case_key("12-http-truncated-body"), &[], &[&path]);
        assert_refused(&o, &path, &[reason]);
        assert!(stderr(&o).contains(&url), "names the cache");
        assert_absent(tmp.path(), &root, &path);
    }
}

#[test]
fn wrong_file_size_only_warns() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, path) = edited_cache(tmp.path(), "xz", |t| t.replace("FileSize: 300552", "FileSize: 12345"));
    let root = tmp.path().join("root");
    let o = copy_with(tmp.path(), &root, &url, &case_key("12-http-truncated-body"), &[], &[&path]);
    check(&o, "copy with a wrong FileSize");
    let err = stderr(&o);
    assert!(err.lines().any(|l| l.contains("FileSize is 12345") && l.contains("300552")), "{err}");
    assert_nix_verifies(tmp.path(), &root);
}

#[test]
fn proxy_content_encoding_is_decoded() {
    let tmp = tempfile::tempdir().unwrap();
    let rules = tmp.path().join("rules.json");
    std::fs::write(&rules, r#"[{"path": "/.*", "gzip": true}]"#).unwrap();
    let case = "12-http-truncated-body";
    let server = Scripted::start(&case_dir(case).join("cache"), Some(&rules), 0, &tmp.path().join("log"));
    let root = tmp.path().join("root");
    let paths: Vec<String> = case_paths(case).into_iter().map(|(_, p)| p).collect();
    let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
    check(&copy_with(tmp.path(), &root, &server.url, &case_key(case), &[], &refs), "copy through a gzip-encoding proxy");
    assert_nix_verifies(tmp.path(), &root);
}

/// A NAR of `tokens` after the magic, each written as NAR strings are (length, bytes, padding).
fn nar_of(tokens: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for t in [b"nix-archive-1".as_slice()].iter().chain(tokens) {
        out.extend_from_slice(&(t.len() as u64).to_le_bytes());
        out.extend_from_slice(t);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    out
}

/// `nar restore` of `nar` into `tmp/DIR` by sluice and by real Nix 2.26's `nix-store --restore`
/// (through `nix-modern`): whether each succeeded, and sluice's standard error.
fn restore_both(tmp: &Path, name: &str, nar: &[u8]) -> (bool, bool, String) {
    let file = tmp.join(format!("{name}.nar"));
    std::fs::write(&file, nar).unwrap();
    let ours = tmp.join(format!("ours-{name}"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, "");
    let o = cmd.args(["nar", "restore", ours.to_str().unwrap()]).stdin(std::fs::File::open(&file).unwrap()).output().unwrap();
    let mut cmd = Command::new(shared().join("bin/nix-modern"));
    isolate(&mut cmd, tmp, "");
    let theirs = tmp.join(format!("theirs-{name}"));
    let n = cmd
        .current_dir(tmp)
        .args(["nix-store", "--restore", theirs.to_str().unwrap()])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .unwrap();
    (o.status.success(), n.status.success(), stderr(&o))
}

/// The NAR refusals sluice keeps where Nix 2.26's parser has no rule, each checked against Nix
/// 2.26's `nix-store --restore` of the same NAR: a regular file without `contents` (Nix 2.26
/// refuses it too: it takes the `)` as a tag and expects another; Nix 2.8 read an empty file),
/// an empty symlink target, an entry name over 255 bytes and a target over 4095 (Nix fails on
/// the system call, sluice before writing, naming the rule). The longest name and target are
/// taken by both.
#[test]
fn nar_refusals_where_nix_226_fails_too() {
    let tmp = tempfile::tempdir().unwrap();
    let (name255, name256) = (vec![b'a'; 255], vec![b'a'; 256]);
    let (target4095, target4096) = (vec![b'a'; 4095], vec![b'a'; 4096]);
    let file = |name: &[u8]| {
        nar_of(&[
            b"(",
            b"type",
            b"directory",
            b"entry",
            b"(",
            b"name",
            name,
            b"node",
            b"(",
            b"type",
            b"regular",
            b"contents",
            b"",
            b")",
            b")",
            b")",
        ])
    };
    let link = |target: &[u8]| nar_of(&[b"(", b"type", b"symlink", b"target", target, b")"]);
    let no_contents =
        nar_of(&[b"(", b"type", b"directory", b"entry", b"(", b"name", b"a", b"node", b"(", b"type", b"regular", b")", b")", b")"]);
    let cases: [(&str, Vec<u8>, Option<&str>); 7] = [
        ("no-contents-at-root", nar_of(&[b"(", b"type", b"regular", b")"]), Some("a regular file without 'contents'")),
        ("no-contents-in-directory", no_contents, Some("a regular file without 'contents'")),
        ("empty-target", link(b""), Some("empty symlink target")),
        ("name-256", file(&name256), Some("entry name too long (256 bytes; at most 255)")),
        ("target-4096", link(&target4096), Some("symlink target too long (4096 bytes; at most 4095)")),
        ("name-255", file(&name255), None),
        ("target-4095", link(&target4095), None),
    ];
    for (name, nar, refusal) in cases {
        let (ours, theirs, err) = restore_both(tmp.path(), name, &nar);
        assert_eq!((ours, theirs), (refusal.is_none(), refusal.is_none()), "{name}: {err}");
        if let Some(why) = refusal {
            assert!(err.contains(why), "{name}: {err}");
        }
    }
}

/// `nar restore` and `nar ls` take an input that is one NAR: data after the archive's end (a
/// second NAR, bytes appended) is refused, naming the offset where the NAR ended, and nothing
/// is left restored. Real Nix 2.8's `nix-store --restore` stops at the NAR's end and takes it,
/// the rest cut silently. (A NAR framed in a cache file is read as Nix reads it:
/// `bytes_after_the_nar_in_a_cache_file_are_ignored_as_by_nix`.)
#[test]
fn nar_restore_and_ls_refuse_data_after_the_archive() {
    let tmp = tempfile::tempdir().unwrap();
    let one = nar_of(&[b"(", b"type", b"regular", b"contents", b"hi", b")"]);
    let restore = |prog: &str, file: &Path, dest: &Path| {
        let mut cmd = Command::new(prog);
        isolate(&mut cmd, tmp.path(), "");
        let args: &[&str] = if prog == "nix-store" { &["--restore"] } else { &["nar", "restore"] };
        cmd.args(args).arg(dest).stdin(std::fs::File::open(file).unwrap()).output().unwrap()
    };
    let after = [
        ("two-nars", one.clone(), "'\\r\\x00\\x00\\x00\\x00\\x00\\x00\\x00nix-arch'"),
        ("one-zero", vec![0], "'\\x00'"),
        ("alone", Vec::new(), ""),
    ];
    for (name, tail, shown) in after {
        let file = tmp.path().join(format!("{name}.nar"));
        std::fs::write(&file, [one.clone(), tail].concat()).unwrap();
        let (ours, theirs) = (tmp.path().join(format!("ours-{name}")), tmp.path().join(format!("theirs-{name}")));
        let o = restore(env!("CARGO_BIN_EXE_sluice"), &file, &ours);
        check(&restore("nix-store", &file, &theirs), &format!("Nix 2.8's nix-store --restore of {name}"));
        assert_eq!(std::fs::read(&theirs).unwrap(), b"hi", "{name}: Nix 2.8 stops at the NAR's end");
        let ls = sluice(tmp.path(), &["nar", "ls", file.to_str().unwrap(), "/"]);
        if shown.is_empty() {
            check(&o, name);
            assert_eq!(std::fs::read(&ours).unwrap(), b"hi");
            check(&ls, name);
            continue;
        }
        let why = format!("NAR: data after the end of the archive (the NAR ends here, then {shown} follows) at byte {}", one.len());
        assert!(!o.status.success() && stderr(&o).contains(&why), "{name}: {}", stderr(&o));
        assert!(!ours.exists(), "{name}: nothing left restored");
        assert!(!ls.status.success() && stderr(&ls).contains(&why), "{name}: {}", stderr(&ls));
    }
}

/// A cache's NAR file with bytes after the NAR (its NarHash and NarSize those of the NAR) is
/// substituted, as real Nix 2.8 substitutes it (`restorePath` reads only the NAR): both stores
/// end up with the same verified path. A NAR longer than its NarSize is still refused.
#[test]
fn bytes_after_the_nar_in_a_cache_file_are_ignored_as_by_nix() {
    let tmp = tempfile::tempdir().unwrap();
    let (url, path) = edited_cache(tmp.path(), "plain", |t| t);
    let nar = tmp.path().join("cache/nar/big.nar");
    let mut bytes = std::fs::read(&nar).unwrap();
    bytes.extend_from_slice(&[0x55; 4096]);
    std::fs::write(&nar, &bytes).unwrap();
    let (by_sluice, by_nix) = (tmp.path().join("by-sluice"), tmp.path().join("by-nix"));
    let key = case_key("12-http-truncated-body");
    check(&copy_with(tmp.path(), &by_sluice, &url, &key, &[], &[&path]), "sluice copy of a NAR file with bytes after the NAR");
    let nix_copy =
        nix(tmp.path(), "nix", &["copy", "--from", &url, "--to", by_nix.to_str().unwrap(), "--option", "trusted-public-keys", &key, &path]);
    check(&nix_copy, "nix copy of the same file");
    for root in [&by_sluice, &by_nix] {
        assert_nix_verifies(tmp.path(), root);
    }
    let hash = |root: &Path| {
        String::from_utf8(nix(tmp.path(), "nix-store", &["--store", root.to_str().unwrap(), "-q", "--hash", &path]).stdout).unwrap()
    };
    assert_eq!(hash(&by_sluice), hash(&by_nix));

    // Its own scratch: the narinfo disk cache under the first one keeps the first narinfo.
    let tmp = tempfile::tempdir().unwrap();
    let (url, path) = edited_cache(tmp.path(), "plain", |t| t.replace("NarSize: 300480", "NarSize: 300472"));
    let root = tmp.path().join("short");
    let o = copy_with(tmp.path(), &root, &url, &key, &[("require-sigs", "false")], &[&path]);
    assert_refused(&o, &path, &["NarSize is 300472 bytes but the NAR is longer"]);
    assert_absent(tmp.path(), &root, &path);
}
