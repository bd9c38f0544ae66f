//! Store URL parameters end to end: a misspelt or misused parameter stops `sluice copy` with an
//! error naming it before anything is written (in particular nothing in the system's `/nix`),
//! and `state`, `real`, `read-only` and `require-sigs` do what Nix's `local-store.hh` and
//! `local-fs-store.hh` say, as real Nix 2.8 confirms.

use std::path::Path;
use std::process::Output;
use std::time::SystemTime;

use crate::common::*;

/// The sample cache (`sample/` in the repository): its `file://` URL, top path and key.
struct Sample {
    url: String,
    top: String,
    key: String,
}

fn sample() -> Sample {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sample").canonicalize().unwrap();
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap().trim().to_string();
    Sample { url: format!("file://{}", dir.join("cache").display()), top: read("top"), key: read("key.pub") }
}

/// `sluice copy` of the sample's closure into `to`, with the sample's key unless `keyless`.
fn copy_to(tmp: &Path, to: &str, keyless: bool) -> Output {
    let s = sample();
    let mut args = vec!["copy", "--from", &s.url, "--to", to];
    if !keyless {
        args.extend(["--trusted-public-keys", &s.key]);
    }
    args.push(&s.top);
    sluice(tmp, &args)
}

/// A directory's entries with their modification times, sorted.
type Entries = Vec<(String, SystemTime)>;

/// The entries of `dir` (none if it is missing) with their modification times, sorted,
/// leaving out SQLite's transient `-wal`, `-shm` and `-journal` files.
fn entries(dir: &Path) -> Entries {
    let mut v: Entries = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten().filter_map(|e| Some((e.file_name().to_string_lossy().into_owned(), e.metadata().ok()?.modified().ok()?))).collect()
        })
        .unwrap_or_default();
    v.retain(|(name, _)| ![".sqlite-wal", ".sqlite-shm", ".sqlite-journal"].iter().any(|s| name.ends_with(s)));
    v.sort();
    v
}

/// What a write into the system store would change, seen without changing anything (nothing is
/// created, so the test does not depend on `/nix` existing): which of `/nix`, `/nix/store`,
/// `/nix/var/nix` and its `db` exist, the entries and modification time of `/nix/store`, and
/// the database files with their modification times (without SQLite's transient files:
/// another process opening the system store with real Nix makes and removes them without
/// writing).
fn system_store_snapshot() -> [(&'static str, bool, Option<SystemTime>, Entries); 4] {
    ["/nix", "/nix/var/nix", "/nix/store", "/nix/var/nix/db"].map(|dir| {
        let modified = (dir == "/nix/store").then(|| std::fs::metadata(dir).ok()?.modified().ok()).flatten();
        let listed = if dir == "/nix/store" || dir == "/nix/var/nix/db" { entries(Path::new(dir)) } else { Vec::new() };
        (dir, Path::new(dir).exists(), modified, listed)
    })
}

#[test]
fn bad_parameters_are_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("x");
    let t = target.display();
    let cases = [
        (format!("local?rot={t}"), "unknown parameter \"rot\""),
        (
            format!("local?store=/foo/store&root={t}"),
            "parameter \"store\" has the invalid value \"/foo/store\": sluice supports only the store directory /nix/store",
        ),
        (format!("local?root={t}&stat={t}/state"), "unknown parameter \"stat\""),
        (format!("{t}?real=nix/store"), "parameter \"real\" has the invalid value \"nix/store\": not an absolute path"),
        (format!("local?root={t}&read-only=maybe"), "parameter \"read-only\" has the invalid value \"maybe\""),
        (format!("local?root={t}&priority=high"), "parameter \"priority\" has the invalid value \"high\""),
        (format!("local?root={t}&compression=xz"), "parameter \"compression\" is not one of a local store"),
    ];
    let before = system_store_snapshot();
    for (url, message) in &cases {
        let o = copy_to(tmp.path(), url, false);
        assert_eq!(o.status.code(), Some(1), "sluice copy --to {url:?} should fail:\n{}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains(&format!("store URL {url:?}: {message}")),
            "sluice copy --to {url:?}: the error should name the URL and say {message:?}:\n{err}"
        );
        assert!(!target.exists(), "sluice copy --to {url:?} created {t}");
        assert_eq!(system_store_snapshot(), before, "sluice copy --to {url:?} changed the system store under /nix");
    }
}

#[test]
fn state_and_real_put_database_and_paths_where_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, state, real) = (tmp.path().join("root"), tmp.path().join("state"), tmp.path().join("real"));
    let url = format!("local?root={}&state={}&real={}", root.display(), state.display(), real.display());
    check(&copy_to(tmp.path(), &url, false), "sluice copy into separate state and real directories");
    let s = sample();
    let base = s.top.strip_prefix("/nix/store/").unwrap();
    assert!(real.join(base).exists(), "{base} is not in {}", real.display());
    assert!(state.join("db/db.sqlite").is_file(), "no database in {}", state.display());
    assert!(!root.exists(), "{} was created although state and real are elsewhere", root.display());

    // Real Nix, given the same URL, finds the closure in that database and those files.
    let infos = nix_path_info(tmp.path(), &url, &s.top);
    assert!(infos.iter().any(|i| i["path"] == s.top.as_str()), "nix path-info did not list {}", s.top);
    let o = nix(tmp.path(), "nix-store", &["--store", &url, "--verify", "--check-contents"]);
    check(&o, "nix-store --verify of the store with state= and real=");
    let ours = sluice(tmp.path(), &["path-info", "--store", &url, "-r", &s.top]);
    check(&ours, "sluice path-info with state= and real=");
    assert_eq!(String::from_utf8_lossy(&ours.stdout).lines().count(), infos.len(), "sluice and Nix list the same closure");
}

#[test]
fn read_only_store_is_read_and_never_written() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    check(&copy_to(tmp.path(), root.to_str().unwrap(), false), "sluice copy into a fresh store");
    let s = sample();
    let read_only = format!("local?root={}&read-only=true", root.display());
    let listed = sluice(tmp.path(), &["path-info", "--store", &read_only, &s.top]);
    check(&listed, "sluice path-info on a read-only store");
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), s.top);

    let db = root.join("nix/var/nix/db");
    let (db_before, store_before) = (entries(&db), entries(&root.join("nix/store")));
    let o = copy_to(tmp.path(), &read_only, false);
    assert_eq!(o.status.code(), Some(1), "a copy into a read-only store should fail:\n{}", stderr(&o));
    assert!(stderr(&o).contains("is read-only (read-only=true): cannot copy paths into it"), "{}", stderr(&o));
    assert_eq!((entries(&db), entries(&root.join("nix/store"))), (db_before, store_before), "the read-only store changed");

    let absent = tmp.path().join("absent");
    let o = copy_to(tmp.path(), &format!("local?root={}&read-only=1", absent.display()), false);
    assert_eq!(o.status.code(), Some(1));
    assert!(!absent.exists(), "opening a read-only store created it");
}

#[test]
fn require_sigs_parameter_governs_copies_into_the_store() {
    let tmp = tempfile::tempdir().unwrap();
    let signed_only = tmp.path().join("signed-only");
    let o = copy_to(tmp.path(), signed_only.to_str().unwrap(), true);
    assert_eq!(o.status.code(), Some(1), "without a trusted key the copy must fail by default:\n{}", stderr(&o));
    let lax = format!("local?root={}&require-sigs=false", tmp.path().join("lax").display());
    check(&copy_to(tmp.path(), &lax, true), "sluice copy into a store with require-sigs=false");
}
