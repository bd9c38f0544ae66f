//! A stale narinfo disk cache: a cached narinfo whose NAR is now gone (404)
//! or whose NAR no longer matches is dropped and the narinfo fetched again, once, and asked of
//! every other cache, before the path fails. Two runs share one disk cache; between them the binary cache is "rebuilt".

use std::path::Path;

use crate::common::*;

const C02: &str = "02-narinfo-field-validation";
const OK: &str = "/nix/store/j2yfr439465w3qg0kz6c1h1x6x5hf4zp-ok-baseline";

/// Copies `OK` through a server over a writable copy of case 02's cache, applies `rebuild` to
/// the cache directory, copies again into a fresh store with the same disk cache, and returns
/// the second run's output and the server (for its log).
fn after_rebuild(tmp: &Path, rebuild: impl Fn(&Path)) -> (std::process::Output, Scripted) {
    let cache = tmp.join("cache");
    copy_dir(&case_dir(C02).join("cache"), &cache);
    let server = Scripted::start(&cache, None, 0, &tmp.join("log"));
    check(&copy_with(tmp, &tmp.join("root1"), &server.url, &case_key(C02), &[], &[OK]), "first copy");
    rebuild(&cache);
    let o = copy_with(tmp, &tmp.join("root2"), &server.url, &case_key(C02), &[], &[OK]);
    (o, server)
}

/// Points the narinfo of `OK` at the bzip2 copy of the same NAR.
fn point_at_bzip2(cache: &Path) {
    let file = cache.join(format!("{}.narinfo", &OK[11..43]));
    let text = std::fs::read_to_string(&file)
        .unwrap()
        .replace("URL: nar/plain.nar\nCompression: none\n", "URL: nar/plain.nar.bz2\nCompression: bzip2\n");
    assert!(text.contains("plain.nar.bz2"));
    std::fs::write(file, text).unwrap();
}

fn narinfo_gets(server: &Scripted) -> usize {
    server.requests(|p| p.ends_with(".narinfo")).len()
}

#[test]
fn cached_narinfo_whose_nar_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let (o, server) = after_rebuild(tmp.path(), |cache| {
        std::fs::remove_file(cache.join("nar/plain.nar")).unwrap();
        point_at_bzip2(cache);
    });
    check(&o, "second copy after the cache was rebuilt");
    assert_eq!(narinfo_gets(&server), 2, "fetched in run 1, then again in run 2 after the 404");
    assert_eq!(
        server.requests(|p| p == "/nar/plain.nar"),
        vec![("GET".into(), "/nar/plain.nar".into(), 200), ("GET".into(), "/nar/plain.nar".into(), 404)]
    );
    assert_nix_verifies(tmp.path(), &tmp.path().join("root2"));
}

#[test]
fn cached_narinfo_whose_nar_no_longer_matches() {
    let tmp = tempfile::tempdir().unwrap();
    let (o, server) = after_rebuild(tmp.path(), |cache| {
        let nar = cache.join("nar/plain.nar");
        let mut bytes = std::fs::read(&nar).unwrap();
        let last = bytes.len() - 17;
        bytes[last] ^= 1;
        std::fs::write(&nar, bytes).unwrap();
        point_at_bzip2(cache);
    });
    check(&o, "second copy after the cache was rebuilt");
    assert_eq!(narinfo_gets(&server), 2);
    assert_eq!(server.requests(|p| p == "/nar/plain.nar.bz2").len(), 1);
    assert_nix_verifies(tmp.path(), &tmp.path().join("root2"));
}

#[test]
fn still_gone_after_refetching_fails_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (o, server) = after_rebuild(tmp.path(), |cache| std::fs::remove_file(cache.join("nar/plain.nar")).unwrap());
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    let line = err.lines().find(|l| l.starts_with("error:") && l.contains(OK)).unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains(&format!("{}/nar/plain.nar", server.url)) && line.contains("404"), "{line}");
    assert_eq!(narinfo_gets(&server), 2, "one refetch, no loop");
    assert_eq!(server.requests(|p| p == "/nar/plain.nar").len(), 2, "the NAR is tried once per run");
    assert_absent(tmp.path(), &tmp.path().join("root2"), OK);
    // The narinfo whose NAR is still missing is not remembered: before, the refetch recorded
    // it again, and every run for 30 days started from it.
    assert_eq!(remembered(tmp.path(), &OK[11..43]), 0);
}

/// Rows of the narinfo disk cache for `hash_part` (answers of any cache).
fn remembered(tmp: &Path, hash_part: &str) -> u64 {
    let db = tmp.join("home/.cache/sluice/narinfo-v1.sqlite");
    let script = "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('select count(*) from NARs where hashPart = ?', (sys.argv[2],)).fetchone()[0])";
    let o = std::process::Command::new("python3").args(["-c", script]).arg(&db).arg(hash_part).output().unwrap();
    check(&o, "reading the narinfo disk cache");
    String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
}

/// Two caches: the first (priority 10) lacks `OK` when a first copy takes it from the second
/// (priority 50), and the disk cache remembers both answers. Then the second loses the NAR and
/// the first gets the path: a second copy with the same disk cache asks the first cache again
/// once the second's NAR is missing, and takes the path from it. Before, only caches of lower
/// priority than the one that failed were asked, and the copy failed for the negative TTL.
#[test]
fn a_cache_remembered_as_lacking_the_path_is_asked_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (first, second) = (tmp.path().join("first"), tmp.path().join("second"));
    copy_dir(&case_dir(C02).join("cache"), &first);
    copy_dir(&case_dir(C02).join("cache"), &second);
    let narinfo = format!("{}.narinfo", &OK[11..43]);
    std::fs::rename(first.join(&narinfo), tmp.path().join(&narinfo)).unwrap();
    let a = Scripted::start(&first, None, 0, &tmp.path().join("log-first"));
    let b = Scripted::start(&second, None, 0, &tmp.path().join("log-second"));
    let subs = format!("{}?priority=10 {}?priority=50", a.url, b.url);
    check(&copy_with(tmp.path(), &tmp.path().join("root1"), &subs, &case_key(C02), &[], &[OK]), "first copy");
    assert_eq!(remembered(tmp.path(), &OK[11..43]), 2, "the first cache's absence and the second's narinfo");

    std::fs::remove_file(second.join("nar/plain.nar")).unwrap();
    std::fs::rename(tmp.path().join(&narinfo), first.join(&narinfo)).unwrap();
    let o = copy_with(tmp.path(), &tmp.path().join("root2"), &subs, &case_key(C02), &[], &[OK]);
    check(&o, "second copy");
    let gets = |s: &Scripted, p: &str| s.requests(|q| q == p).into_iter().map(|(_, _, status)| status).collect::<Vec<_>>();
    assert_eq!(gets(&a, &format!("/{narinfo}")), [404, 200], "the first cache is asked again in run 2");
    assert_eq!(gets(&a, "/nar/plain.nar"), [200]);
    assert_eq!(gets(&b, "/nar/plain.nar"), [200, 404]);
    assert_nix_verifies(tmp.path(), &tmp.path().join("root2"));
}
