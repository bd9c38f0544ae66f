//! `sluice copy` end to end on the corpus: from nginx over HTTP/1.1 and HTTPS+HTTP/2, and from
//! `file://` caches of every compression, into fresh chroot stores that real Nix 2.8 then
//! verifies and describes exactly as the cache did.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::*;
use serde_json::Value;

/// The fields `nix path-info --json` must agree on between the copy and the cache.
const FIELDS: [&str; 7] = ["path", "narHash", "narSize", "references", "deriver", "ca", "signatures"];

fn by_path(entries: Vec<Value>) -> BTreeMap<String, Value> {
    entries
        .into_iter()
        .map(|e| {
            let picked: serde_json::Map<String, Value> =
                FIELDS.iter().filter_map(|f| e.get(*f).map(|v| (f.to_string(), v.clone()))).collect();
            (e["path"].as_str().unwrap().to_string(), Value::Object(picked))
        })
        .collect()
}

/// Copies `top` from `from` into a fresh store and checks it with real Nix against `truth`.
fn copy_and_verify(tmp: &Path, from: &str, top: &str, truth: &str, extra: &[&str]) {
    let root = tmp.join("root");
    let mut args = vec!["copy", "--from", from, "--to", root.to_str().unwrap()];
    let key = corpus_key();
    args.extend(["--trusted-public-keys", &key]);
    args.extend(extra);
    args.push(top);
    let o = sluice(tmp, &args);
    check(&o, "sluice copy");
    // The copy's runtime is left to the process's exit; not what its tasks held.
    assert_store_closed(&root);
    assert_nix_verifies(tmp, &root);
    let got = by_path(nix_path_info(tmp, root.to_str().unwrap(), top));
    let want = by_path(serde_json::from_str(&std::fs::read_to_string(corpus().join("truth").join(truth)).unwrap()).unwrap());
    assert_eq!(got.len(), want.len(), "path count");
    for (path, w) in &want {
        assert_eq!(got.get(path), Some(w), "path-info of {path}");
    }
}

#[test]
fn copy_corpus_over_http1_from_nginx() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-xz"), &tmp.path().join("srv"), &[]);
    copy_and_verify(tmp.path(), &server.url, TOP, "path-info-cache-xz.json", &[]);
    assert_eq!(server.requests(".narinfo"), 1056, "one request per narinfo");
    assert_eq!(server.requests(".nar.xz"), 1056, "one request per NAR");
}

#[test]
fn copy_corpus_over_https_http2_from_nginx() {
    let tmp = tempfile::tempdir().unwrap();
    let server = CacheServer::start(&corpus().join("cache-zstd"), &tmp.path().join("srv"), &["--tls", "--http2"]);
    let ca = tmp.path().join("srv").join(server.url.rsplit(':').next().unwrap()).join("tls/ca.pem");
    let ssl = format!("ssl-cert-file {}", ca.display());
    let (name, value) = ssl.split_once(' ').unwrap();
    copy_and_verify(tmp.path(), &server.url, TOP, "path-info-cache-zstd.json", &["--option", name, value]);
}

#[test]
fn copy_corpus_from_file_caches() {
    for cache in ["cache-xz", "cache-zstd"] {
        let tmp = tempfile::tempdir().unwrap();
        let url = format!("file://{}", corpus().join(cache).display());
        copy_and_verify(tmp.path(), &url, TOP, &format!("path-info-{cache}.json"), &[]);
    }
}

#[test]
fn copy_subset_of_every_compression() {
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    let root_path = summary["subsetRoot"].as_str().expect("summary.json has subsetRoot").to_string();
    for comp in ["none", "bzip2", "gzip", "br"] {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let url = format!("file://{}", corpus().join(format!("cache-subset-{comp}")).display());
        let o = sluice(
            tmp.path(),
            &["copy", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &root_path],
        );
        check(&o, &format!("sluice copy from cache-subset-{comp}"));
        assert_nix_verifies(tmp.path(), &root);
        let got = nix_path_info(tmp.path(), root.to_str().unwrap(), &root_path);
        assert_eq!(got.len(), 25, "cache-subset-{comp}: the 25-path closure");
    }
}

/// `--json` into a pipe whose reader is gone (`sluice copy --json | head`) copies as without
/// it and ends quietly. Regression: the report's `println!` panicked on `EPIPE` (`copy`
/// ignores SIGPIPE, for its uploads), after the copy was done.
#[test]
fn copy_json_into_a_closed_pipe() {
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    let root_path = summary["subsetRoot"].as_str().expect("summary.json has subsetRoot").to_string();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let url = format!("file://{}", corpus().join("cache-subset-gzip").display());
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp.path(), "");
    cmd.args(["copy", "--json", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &corpus_key(), &root_path]);
    let o = cmd.stdout(writer).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "sluice copy --json into a closed pipe: {:?}\n{stderr}", o.status);
    assert!(!stderr.contains("panicked"), "no panic: {stderr}");
    assert!(stderr.contains("copied 25 paths"), "the copy's summary: {stderr}");
    assert_eq!(nix_path_info(tmp.path(), root.to_str().unwrap(), &root_path).len(), 25, "the 25-path closure is valid");
}

/// Nodes get Nix's canonical metadata as they are unpacked, whatever the umask or a default
/// ACL on the store's parent: mode 0444 or 0555 on files and directories, mtime 1 on
/// everything (symlinks included). Regressions: with the metadata set at creation instead of
/// in a second walk, umask 077 left files 0400/0500 and a default ACL `o::---` left them
/// 0440/0550. Under umask 022 without an ACL, as root (directories made 0555 at once) and as
/// `nobody` (made 0755, set to 0555 once filled). And under a soft open-file limit of 1024 the copy of the corpus ran out of
/// descriptors (one lock file per path waiting to be registered).
#[test]
fn copy_gives_canonical_metadata_under_a_strict_umask() {
    let tmp = tempfile::tempdir().unwrap();
    let acl_parent = tmp.path().join("acl");
    std::fs::create_dir(&acl_parent).unwrap();
    // `setfacl -d -m o::--- acl`: user::rwx, group::r-x, other::--- as the default ACL.
    let set_acl = "import os, struct, sys\n\
                   e = lambda tag, perm: struct.pack('<HHI', tag, perm, 0xffffffff)\n\
                   os.setxattr(sys.argv[1], 'system.posix_acl_default', struct.pack('<I', 2) + e(1, 7) + e(4, 5) + e(0x20, 0))";
    let o = std::process::Command::new("python3").args(["-c", set_acl, acl_parent.to_str().unwrap()]).output().unwrap();
    check(&o, "setting a default ACL");
    // A store owned by `nobody`, whose copy cannot fill a directory made read-only (root can,
    // and then makes directories 0555 at once: the plain root case).
    let user = tmp.path().join("user");
    std::fs::create_dir(&user).unwrap();
    std::os::unix::fs::chown(&user, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let as_nobody = format!("setpriv --reuid=65534 --regid=65534 --clear-groups env HOME={0} XDG_CACHE_HOME={0}/cache", user.display());
    let key = corpus_key();
    for (umask, root, cache, top, as_user) in [
        ("077", tmp.path().join("root"), "cache-subset-none", corpus_path("hexurvend-wrapper"), ""),
        ("022", acl_parent.join("root"), "cache-zstd", TOP.to_string(), ""),
        ("022", tmp.path().join("plain"), "cache-subset-none", corpus_path("hexurvend-wrapper"), ""),
        ("022", user.join("root"), "cache-subset-none", corpus_path("hexurvend-wrapper"), as_nobody.as_str()),
    ] {
        let url = format!("file://{}", corpus().join(cache).display());
        let args = ["copy", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &key, &top];
        let setup = format!("umask {umask} && ulimit -Sn 1024 && exec {as_user} \"$0\" \"$@\"");
        check(&sluice_after(tmp.path(), &setup, &args), &format!("sluice copy under umask {umask} {as_user}"));
        let mut seen = (0, 0, 0);
        for entry in std::fs::read_dir(root.join("nix/store")).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap();
            assert!(!sluice_local_store::is_temp_dir(name), "a directory of temporary trees was left: {}", path.display());
            if !name.ends_with(".lock") && !name.starts_with('.') {
                assert_canonical(&path, &mut seen);
            }
        }
        let (files, dirs, links) = seen;
        assert!(files > 25 && dirs > 5 && links > 0, "{cache}: files ({files}), directories ({dirs}) and symlinks ({links})");
    }
}

/// A hard limit on open files far below the size of the closure (1056 paths) fails no path:
/// the path locks held at once are bounded by the limit, not by the closure. Under 256 files
/// sluice holds at most 96 locks; under 48, the fewest it ever allows (8 locks, 1 download).
/// Regression: under `ulimit -n 1024`, hundreds of the corpus's paths failed with `Too many
/// open files` (a lock file per path found, held until it was registered).
#[test]
fn copy_of_a_closure_larger_than_the_open_file_limit() {
    let url = format!("file://{}", corpus().join("cache-zstd").display());
    let key = corpus_key();
    for limit in [256, 48] {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        // `ulimit -n` lowers the hard limit too: sluice cannot raise its soft limit past it.
        let args = ["copy", "--json", "--from", &url, "--to", root.to_str().unwrap(), "--trusted-public-keys", &key, TOP];
        let o = sluice_after(tmp.path(), &format!("ulimit -n {limit}"), &args);
        check(&o, &format!("sluice copy under ulimit -n {limit}"));
        let report: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["failed"], serde_json::json!({}), "ulimit -n {limit}: no path failed");
        assert_eq!(report["substituted"].as_array().map(Vec::len), Some(1056), "ulimit -n {limit}: every path was copied");
        assert_nix_verifies(tmp.path(), &root);
    }
}

/// Asserts canonical metadata on `path` and below; counts (files, directories, symlinks).
fn assert_canonical(path: &Path, seen: &mut (usize, usize, usize)) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert_eq!(meta.mtime(), 1, "mtime of {}", path.display());
    if meta.file_type().is_symlink() {
        seen.2 += 1;
        return;
    }
    let mode = meta.permissions().mode() & 0o7777;
    if meta.is_dir() {
        seen.1 += 1;
        assert_eq!(mode, 0o555, "mode of {}", path.display());
        for entry in std::fs::read_dir(path).unwrap() {
            assert_canonical(&entry.unwrap().path(), seen);
        }
    } else {
        seen.0 += 1;
        assert!(mode == 0o444 || mode == 0o555, "{} has mode {mode:o}", path.display());
    }
}

/// A path built in the source store is `ultimate` there and not in the store it is copied
/// to, as with Nix's `nix copy` (`copyStorePath` clears it): real Nix 2.8 describes sluice's
/// copy and its own alike. The path is added by Nix, then marked as a build registers it.
#[test]
fn copied_paths_are_not_ultimate_in_the_destination() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, by_sluice, by_nix) = (tmp.path().join("src"), tmp.path().join("by-sluice"), tmp.path().join("by-nix"));
    let file = tmp.path().join("hello.txt");
    std::fs::write(&file, b"built here\n").unwrap();
    let added = nix(tmp.path(), "nix-store", &["--store", src.to_str().unwrap(), "--add", file.to_str().unwrap()]);
    check(&added, "nix-store --add");
    let path = String::from_utf8(added.stdout).unwrap().trim().to_owned();
    let db = src.join("nix/var/nix/db/db.sqlite");
    let mark = std::process::Command::new("python3")
        .args([
            "-c",
            "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('update ValidPaths set ultimate = 1'); c.commit()",
            db.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    check(&mark, "marking the path ultimate");
    let ultimate = |root: &Path| nix_path_info(tmp.path(), root.to_str().unwrap(), &path)[0]["ultimate"].clone();
    assert_eq!(ultimate(&src), Value::Bool(true), "the source's own path is ultimate");
    check(&sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), "--to", by_sluice.to_str().unwrap(), &path]), "sluice copy");
    check(&nix(tmp.path(), "nix", &["copy", "--from", src.to_str().unwrap(), "--to", by_nix.to_str().unwrap(), &path]), "nix copy");
    assert_eq!(ultimate(&by_nix), Value::Null, "Nix 2.8 leaves out ultimate when false");
    assert_eq!(ultimate(&by_sluice), ultimate(&by_nix));
}

/// `sluice copy --from STORE` without `--to` copies into the `store` setting's store
/// (`$NIX_REMOTE`, here the test's chroot default store), as `nix copy` does, also when `--from`
/// is not a binary cache (a local store, a daemon, `ssh-ng://`); `sluice copy --to CACHE`
/// without `--from` copies from it. Regressions: the first went into `/nix/store` whatever
/// `NIX_REMOTE` said; the second (the README's `ssh://` example) was refused as needing `--from`.
#[test]
fn copy_without_to_or_from_uses_the_store_setting() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let file = tmp.path().join("hello.txt");
    std::fs::write(&file, b"into NIX_REMOTE\n").unwrap();
    let added = nix(tmp.path(), "nix-store", &["--store", src.to_str().unwrap(), "--add", file.to_str().unwrap()]);
    check(&added, "nix-store --add");
    let path = String::from_utf8(added.stdout).unwrap().trim().to_owned();
    let o = sluice(tmp.path(), &["copy", "--from", src.to_str().unwrap(), &path]);
    check(&o, "sluice copy without --to");
    let default = default_store(tmp.path());
    assert!(stderr(&o).contains(&format!("to {default} in")), "{}", stderr(&o));
    let info = nix_path_info(tmp.path(), &default, &path);
    assert_eq!(info[0]["path"], Value::String(path.clone()));
    let cache = format!("file://{}", tmp.path().join("cache").display());
    check(&sluice(tmp.path(), &["copy", "--to", &cache, &path]), "sluice copy without --from");
    assert_eq!(nix_path_info(tmp.path(), &cache, &path)[0]["narHash"], info[0]["narHash"]);
}

/// `sluice copy` ARGS under `t`, with `input` on standard input.
fn sluice_with_input(t: &Path, args: &[&str], input: &str) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, t, "");
    let mut child = cmd
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The flags of `nix copy` Nix users type: `--all` (every valid path of `--from`),
/// `--derivation` (a path's deriver's closure) copy what `nix copy` copies; `--stdin` reads the
/// paths; `-s` lets the destination substitute from its substituters what `--from` lacks; and
/// `--refresh` asks again a cache whose miss the narinfo disk cache remembers.
#[test]
fn copy_all_stdin_derivation_substitute_on_destination_and_refresh() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    let key = corpus_key();
    let (libidn2, drv) = (corpus_path("libidn2-2.3.4"), "/nix/store/lwdbwfnqd05c45mlvn9537salc088cyg-libidn2-2.3.4.drv");
    let src = t.join("src");
    let subset = format!("file://{}", corpus().join("cache-subset-bzip2").display());
    for (cache, path) in [(subset.clone(), libidn2.as_str()), (format!("file://{}", corpus().join("cache-drv").display()), drv)] {
        check(&copy_with(t, &src, &cache, &key, &[], &[path]), "filling the source store");
    }
    let s = src.to_str().unwrap();
    let closure = |path: &str| -> std::collections::BTreeSet<String> {
        let o = nix(t, "nix-store", &["--store", s, "-qR", path]);
        String::from_utf8(o.stdout).unwrap().lines().map(str::to_owned).collect()
    };
    for (flags, paths) in [(&["--all"][..], vec![]), (&["--derivation"], vec![libidn2.as_str()])] {
        let (ours, theirs) = (t.join(format!("sluice{}", flags[0])), t.join(format!("nix{}", flags[0])));
        let copied =
            sluice(t, &[&["copy", "--from", s, "--to", ours.to_str().unwrap(), "--trusted-public-keys", &key][..], flags, &paths].concat());
        check(&copied, &format!("sluice copy {flags:?}"));
        let nix_copied = nix(
            t,
            "nix",
            &[&["copy", "--from", s, "--to", theirs.to_str().unwrap(), "--option", "trusted-public-keys", &key][..], flags, &paths]
                .concat(),
        );
        check(&nix_copied, &format!("nix copy {flags:?}"));
        assert_eq!(registered_paths(&ours), registered_paths(&theirs), "{flags:?}");
    }
    assert_eq!(registered_paths(&t.join("sluice--all")), registered_paths(&src));
    assert_eq!(registered_paths(&t.join("sluice--derivation")), closure(drv));
    assert!(!registered_paths(&t.join("sluice--derivation")).contains(&libidn2));

    let stdin = t.join("stdin");
    let copied = sluice_with_input(
        t,
        &["copy", "--stdin", "--from", s, "--to", stdin.to_str().unwrap(), "--trusted-public-keys", &key],
        &format!("{libidn2}\n"),
    );
    check(&copied, "sluice copy --stdin");
    assert_eq!(registered_paths(&stdin), closure(&libidn2));

    // A cache without the paths, and the destination's substituters with them.
    let empty = t.join("empty-cache");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("nix-cache-info"), "StoreDir: /nix/store\n").unwrap();
    let from_empty = format!("file://{}", empty.display());
    for (flag, ok) in [(None, false), (Some("-s"), true), (Some("--substitute-on-destination"), true)] {
        let dst = t.join(format!("dst{}", flag.unwrap_or("")));
        let args = ["copy", "--from", &from_empty, "--substituters", &subset, "--to", dst.to_str().unwrap(), "--trusted-public-keys", &key];
        let copied = sluice(t, &[&args[..], flag.as_slice(), &[libidn2.as_str()]].concat());
        assert_eq!(copied.status.success(), ok, "{flag:?}: {}", stderr(&copied));
        assert_eq!(registered_paths(&dst), if ok { closure(&libidn2) } else { Default::default() }, "{flag:?}");
    }

    // The miss remembered: the cache fills, and only --refresh asks it again.
    let late = CacheServer::start(&empty, &t.join("nginx"), &[]);
    let refresh_dst = t.join("refresh");
    let copy_late = |extra: &[&str]| copy_with(t, &refresh_dst, &late.url, &key, &[], &[&[libidn2.as_str()][..], extra].concat());
    assert!(!copy_late(&[]).status.success());
    let filled = std::process::Command::new("cp").arg("-a").arg(corpus().join("cache-subset-bzip2/.")).arg(&empty).status().unwrap();
    assert!(filled.success());
    let stale = copy_late(&[]);
    assert!(!stale.status.success(), "the miss is remembered for narinfo-cache-negative-ttl");
    check(&copy_late(&["--refresh"]), "sluice copy --refresh");
    assert_eq!(registered_paths(&refresh_dst), closure(&libidn2));
}

/// The summary of a copy fits 80 columns, and a copy whose closure is valid already counts
/// that closure, not the path asked for (it said "1 already valid"); the summary of a push
/// names the cache without its `secret-key` file.
#[test]
fn copy_summaries_fit_80_columns_count_the_closure_and_hide_secret_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let top = corpus_path("hexurvend-wrapper");
    let (root, key) = (t.join("root"), corpus_key());
    let subset = format!("file://{}", corpus().join("cache-subset-bzip2").display());
    let summary = |o: &std::process::Output| stderr(o).lines().last().unwrap_or_default().to_owned();
    let first = copy_with(t, &root, &subset, &key, &[], &[&top]);
    check(&first, "first copy");
    let line = summary(&first);
    assert!(line.starts_with("copied 25 paths (0.5 MiB, 0.2 MiB DL) in ") && line.ends_with(" s"), "{line}");
    assert!(line.chars().count() <= 80, "{line}");
    let again = copy_with(t, &root, &subset, &key, &[], &[&top]);
    check(&again, "second copy");
    let line = summary(&again);
    assert!(line.starts_with("copied 0 paths (0.0 MiB, 0.0 MiB DL) in ") && line.ends_with(" s; 25 already valid"), "{line}");

    let secret = t.join("push.sec");
    std::fs::write(&secret, &sluice(t, &["key", "generate", "push-1"]).stdout).unwrap();
    let cache = t.join("cache");
    let to = format!("file://{}?secret-key={}&compression=none", cache.display(), secret.display());
    let pushed = sluice(t, &["copy", "--from", root.to_str().unwrap(), "--to", &to, &top]);
    check(&pushed, "push");
    let line = summary(&pushed);
    assert!(line.starts_with(&format!("copied 25 paths (0.5 MiB) to file://{}?compression=none in ", cache.display())), "{line}");
    assert!(!stderr(&pushed).contains("secret-key") && !stderr(&pushed).contains("push.sec"), "{}", stderr(&pushed));
}
