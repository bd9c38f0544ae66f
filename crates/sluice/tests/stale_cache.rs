//! A stale narinfo disk cache: a cached narinfo whose NAR is now gone (404)
//! or whose NAR no longer matches is dropped and the narinfo fetched again, once, before the
//! path fails. Two runs share one disk cache; between them the binary cache is "rebuilt".

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
}
