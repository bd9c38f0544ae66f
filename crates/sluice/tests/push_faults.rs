//! Pushes into caches that are broken, or break while they are pushed into: exit 0 means the
//! cache holds the whole closure, whatever it held before; a narinfo is in the cache only once
//! its NAR (of its `FileSize`) and its references' narinfos are; a push killed or refused at
//! any point leaves no narinfo whose NAR or references are missing. For `file://`, HTTP PUT
//! (`common/put_server.py`) and S3 (s3s-fs); real Nix 2.8 reads every pushed cache
//! (`push::assert_nix_reads`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::common::*;
use crate::push::{assert_nix_reads, incompressible_path, narinfos, signing_key, source_store, subset};

#[derive(Clone, Copy, Debug)]
enum Kind {
    File,
    Http,
    S3,
}

/// A cache to push into: its URL and the directory its files are in, and its server.
struct Dest {
    url: String,
    dir: PathBuf,
    _put: Option<PutServer>,
    _s3: Option<S3Server>,
}

/// An empty cache of `kind` under `tmp`, pushed to with the URL parameters `params`.
fn dest(tmp: &Path, kind: Kind, params: &str) -> Dest {
    match kind {
        Kind::File => {
            let dir = tmp.join("cache");
            Dest { url: format!("file://{}?{params}", dir.display()), dir, _put: None, _s3: None }
        }
        Kind::Http => {
            let dir = tmp.join("put");
            std::fs::create_dir_all(&dir).unwrap();
            let server = PutServer::start(&dir, tmp, "[]", 128, true);
            Dest { url: format!("{}?{params}", server.url), dir, _put: Some(server), _s3: None }
        }
        Kind::S3 => {
            let dir = tmp.join("s3/bucket");
            std::fs::create_dir_all(&dir).unwrap();
            let server = S3Server::start(&tmp.join("s3"), true);
            let url = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1&{params}", server.port);
            Dest { url, dir, _put: None, _s3: Some(server) }
        }
    }
}

/// `sluice copy --from SRC --to URL ROOT` with s3s-fs's credentials and `conf`, not waited for.
fn push_cmd(tmp: &Path, src: &Path, url: &str, root: &str, conf: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut cmd, tmp, conf);
    cmd.envs([("AWS_ACCESS_KEY_ID", "AKTEST"), ("AWS_SECRET_ACCESS_KEY", "SKTEST")]);
    cmd.args(["copy", "--from", src.to_str().unwrap(), "--to", url, root]);
    cmd
}

fn push(tmp: &Path, src: &Path, url: &str, root: &str) -> Output {
    push_cmd(tmp, src, url, root, "").output().unwrap()
}

/// The number of paths a push says it copied.
fn copied(o: &Output) -> usize {
    let err = stderr(o);
    let n = err.lines().find_map(|l| l.strip_prefix("copied ")?.split(' ').next()?.parse().ok());
    n.unwrap_or_else(|| panic!("no summary line:\n{err}"))
}

/// A field of a narinfo's text.
fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
}

/// The `URL` of each narinfo of the cache directory `dir`, by hash part.
fn nar_urls(dir: &Path) -> BTreeMap<String, String> {
    narinfos(dir)
        .into_iter()
        .map(|(hash, _)| {
            let text = std::fs::read_to_string(dir.join(format!("{hash}.narinfo"))).unwrap();
            (hash, field(&text, "URL").unwrap().to_string())
        })
        .collect()
}

/// Asserts that every narinfo in the cache directory `dir` has its NAR, of its `FileSize`, and
/// that the narinfo of each of its references is there: the cache is consistent.
fn assert_consistent(dir: &Path) {
    let infos = narinfos(dir);
    let have: BTreeSet<&str> = infos.iter().map(|(h, _)| h.as_str()).collect();
    for (hash, refs) in &infos {
        let text = std::fs::read_to_string(dir.join(format!("{hash}.narinfo"))).unwrap();
        let nar = dir.join(field(&text, "URL").unwrap());
        let size: u64 = field(&text, "FileSize").unwrap().parse().unwrap();
        let found = std::fs::metadata(&nar).map(|m| m.len()).ok();
        assert_eq!(found, Some(size), "{hash}.narinfo is there, but its NAR {} is not whole", nar.display());
        for r in refs {
            assert!(have.contains(r.as_str()), "{hash}.narinfo is there without the narinfo of its reference {r}");
        }
    }
}

/// Pushes the subset into an empty cache of `kind`, breaks the cache (a NAR deleted, one cut to
/// half, one emptied, the narinfo of a path others refer to deleted), and pushes again: the
/// second push copies exactly the four broken paths and real Nix copies the closure from the
/// cache. Before, a path was skipped when its narinfo existed: the second push copied 1 path,
/// exited 0, and left three narinfos without their NARs.
fn mends(kind: Kind) {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let (secret, public) = signing_key(tmp.path());
    let dest = dest(tmp.path(), kind, &format!("compression=none&secret-key={}", secret.display()));
    let first = push(tmp.path(), &src, &dest.url, &root);
    check(&first, "first push");
    assert_eq!(copied(&first), 25);

    let infos = narinfos(&dest.dir);
    let urls = nar_urls(&dest.dir);
    let referenced: BTreeSet<&String> = infos.iter().flat_map(|(h, refs)| refs.iter().filter(move |r| *r != h)).collect();
    let gone_narinfo = *referenced.iter().next().unwrap();
    let mut others = urls.iter().filter(|(h, _)| h != &gone_narinfo);
    let mut nar = || dest.dir.join(others.next().unwrap().1);
    let (deleted, halved, emptied) = (nar(), nar(), nar());
    std::fs::remove_file(deleted).unwrap();
    let bytes = std::fs::read(&halved).unwrap();
    std::fs::write(&halved, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::write(emptied, b"").unwrap();
    std::fs::remove_file(dest.dir.join(format!("{gone_narinfo}.narinfo"))).unwrap();

    let second = push(tmp.path(), &src, &dest.url, &root);
    check(&second, "push into the broken cache");
    assert_eq!(copied(&second), 4, "{kind:?}: the broken paths are copied again:\n{}", stderr(&second));
    assert!(stderr(&second).contains("21 already there"), "{}", stderr(&second));
    assert_consistent(&dest.dir);
    assert_nix_reads(tmp.path(), &format!("file://{}", dest.dir.display()), &public, &root, &paths);
}

#[test]
fn a_push_mends_a_broken_file_cache() {
    mends(Kind::File);
}

#[test]
fn a_push_mends_a_broken_http_cache() {
    mends(Kind::Http);
}

#[test]
fn a_push_mends_a_broken_s3_cache() {
    mends(Kind::S3);
}

/// Every narinfo is uploaded only once its NAR's upload and the narinfo uploads of its
/// references were answered: the server holds each narinfo's answer 100 ms after reading it,
/// and its log shows when each request was read and answered.
#[test]
fn a_narinfo_goes_up_after_its_nar_and_references_were_answered() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let dir = tmp.path().join("put");
    std::fs::create_dir_all(&dir).unwrap();
    let rules = r#"[{"path": "/[0-9a-z]{32}\\.narinfo", "methods": ["PUT"], "delay": 0.1}]"#;
    let server = PutServer::start(&dir, tmp.path(), rules, 128, true);
    check(&push(tmp.path(), &src, &server.url, &root), "push");
    let puts: Vec<put_server::Logged> = server.requests().into_iter().filter(|r| r.method == "PUT").collect();
    assert!(puts.iter().all(|r| r.status == 201), "{puts:?}");
    let answered = |path: &str| puts.iter().find(|r| r.path == path).unwrap_or_else(|| panic!("no PUT of {path}")).answered;
    let urls = nar_urls(&dir);
    let infos = narinfos(&dir);
    assert_eq!(infos.len(), paths.len());
    for (hash, refs) in &infos {
        let sent = puts.iter().find(|r| r.path == format!("/{hash}.narinfo")).unwrap().received;
        assert!(answered(&format!("/{}", urls[hash])) <= sent, "{hash}.narinfo was sent before its NAR's upload was answered");
        for r in refs.iter().filter(|r| *r != hash) {
            assert!(answered(&format!("/{r}.narinfo")) <= sent, "{hash}.narinfo was sent before {r}.narinfo was answered");
        }
    }
}

/// An upload cut short by the server (which keeps the first 1 MB of the 12 MB NAR in place and
/// closes the connection, on every attempt) fails the push with no narinfo in the cache; the
/// next push writes the NAR again, as the object of that name has another size. Before, a
/// NAR of 1 MiB or more was not uploaded when an object of its name existed: the second push
/// exited 0 and published the narinfo of a NAR cut to 1 MB.
#[test]
fn an_upload_cut_short_is_written_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, path, dumped) = incompressible_path(tmp.path());
    let (secret, public) = signing_key(tmp.path());
    let dir = tmp.path().join("put");
    std::fs::create_dir_all(&dir).unwrap();
    let params = format!("compression=none&secret-key={}", secret.display());
    let rules = r#"[{"path": "/nar/.*", "methods": ["PUT"], "cut_at": 1000000}]"#;
    let cutting = PutServer::start(&dir, tmp.path(), rules, 128, true);
    let failed = push_cmd(tmp.path(), &src, &format!("{}?{params}", cutting.url), &path, "download-attempts = 2").output().unwrap();
    assert_eq!(failed.status.code(), Some(1), "{}", stderr(&failed));
    assert_eq!(cutting.requests().iter().filter(|r| r.method == "PUT" && r.path.starts_with("/nar/")).count(), 2);
    drop(cutting);
    assert_eq!(narinfos(&dir).len(), 0);
    let nars: Vec<u64> = std::fs::read_dir(dir.join("nar")).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).collect();
    assert_eq!(nars, [1_000_000], "the server kept the NAR cut short");

    let server = PutServer::start(&dir, tmp.path(), "[]", 128, true);
    check(&push(tmp.path(), &src, &format!("{}?{params}", server.url), &path), "push after the cut");
    assert_consistent(&dir);
    let url = &nar_urls(&dir)[&path[11..43]];
    assert_eq!(std::fs::read(dir.join(url)).unwrap().len(), dumped.len());
    assert_nix_reads(tmp.path(), &format!("file://{}", dir.display()), &public, &path, &BTreeSet::from([path.clone()]));
}

/// `kill -9` of a push into a cache of `kind` once its NAR directory has a file and no narinfo
/// is there yet, then once 1, 5 and 12 narinfos are: after each, the cache is consistent
/// ([`assert_consistent`]); a last push completes it for real Nix.
fn killed(kind: Kind) {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let (secret, public) = signing_key(tmp.path());
    let dest = dest(tmp.path(), kind, &format!("compression=xz&compression-level=9&secret-key={}", secret.display()));
    let nars = || {
        std::fs::read_dir(dest.dir.join("nar"))
            .map_or(0, |d| d.filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.')).count())
    };
    // 0: once a NAR more is there; n: once n narinfos more are.
    for step in [0, 1, 4, 7] {
        let (infos_before, nars_before) = (narinfos(&dest.dir).len(), nars());
        let mut child = push_cmd(tmp.path(), &src, &dest.url, &root, "").stderr(Stdio::null()).spawn().unwrap();
        let started = std::time::Instant::now();
        while !match step {
            0 => nars() > nars_before,
            n => narinfos(&dest.dir).len() >= infos_before + n,
        } {
            assert!(started.elapsed().as_secs() < 60 && child.try_wait().unwrap().is_none(), "the push ended before it was killed");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(narinfos(&dest.dir).len() < paths.len(), "{kind:?}: the push finished before it was killed");
        assert_consistent(&dest.dir);
    }
    check(&push(tmp.path(), &src, &dest.url, &root), "push after the kills");
    assert_consistent(&dest.dir);
    assert_nix_reads(tmp.path(), &format!("file://{}", dest.dir.display()), &public, &root, &paths);
}

#[test]
fn a_push_killed_at_any_point_leaves_a_consistent_http_cache() {
    killed(Kind::Http);
}

#[test]
fn a_push_killed_at_any_point_leaves_a_consistent_s3_cache() {
    killed(Kind::S3);
}

/// A push by PUT into a plain server (python's `http.server`: a listen queue of 5, a connection
/// per request) has at most `http-connections` connections open at once, 8 when set so and
/// Nix's 25 by default, and real Nix reads what it pushed (issue 39: it opened up to 256,
/// whatever `http-connections` said, and the server's full queue made the corpus's push take
/// 68–111 s where Nix took 12 s).
#[test]
fn a_push_by_put_keeps_to_http_connections() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, paths) = subset();
    let src = source_store(tmp.path(), "cache-subset-none", &root);
    let (secret, public) = signing_key(tmp.path());
    for (conf, most) in [("http-connections = 8", 8), ("", 25)] {
        let dir = tmp.path().join(format!("put-{most}"));
        std::fs::create_dir_all(&dir).unwrap();
        let server = PutServer::start(&dir, tmp.path(), "[]", 5, false);
        let url = format!("{}?secret-key={}", server.url, secret.display());
        check(&push_cmd(tmp.path(), &src, &url, &root, conf).output().unwrap(), "push by PUT");
        let (accepted, open) = server.connections();
        assert!(accepted >= 3 * paths.len(), "a connection per request: {accepted}");
        assert!(open <= most, "{open} connections open at once with {conf:?}");
        assert_consistent(&dir);
        std::fs::remove_file(tmp.path().join("put-server.log")).unwrap();
        assert_nix_reads(tmp.path(), &format!("file://{}", dir.display()), &public, &root, &paths);
        for d in ["nix-copy", "nix-substitute"] {
            std::fs::remove_dir_all(tmp.path().join(d)).ok();
        }
    }
}
