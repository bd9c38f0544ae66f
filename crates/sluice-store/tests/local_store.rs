//! The local store against real data and real Nix 2.8 (`nix-store`, `nix` from Debian's
//! `nix-bin`): paths sluice adds must pass `nix-store --verify --check-contents` and show the
//! registered metadata in `nix path-info`; stores Nix wrote must read back correctly; failed
//! additions must leave nothing behind.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use sluice_local_store::{is_temp_dir, LocalStore, LocalStoreError, SignaturePolicy, Uncommitted};
use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::nar::writer::regular_file_nar;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::store_url::LocalStoreConfig;
use tempfile::TempDir;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/corpus");

/// A temporary directory that can be deleted without root although store paths in it are
/// read-only: directories are made writable before `TempDir` removes the tree.
pub(crate) struct Scratch(TempDir);

impl Scratch {
    pub(crate) fn new() -> Self {
        Scratch(TempDir::new().unwrap())
    }

    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        fn make_writable(dir: &Path) {
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    make_writable(&entry.path());
                }
            }
        }
        make_writable(self.0.path());
    }
}

fn subset_cache() -> PathBuf {
    Path::new(CORPUS).join("cache-subset-none")
}

pub(crate) fn store_dir() -> StoreDir {
    StoreDir::default()
}

/// Runs a Nix command isolated from the network and the user's configuration, with its own
/// home and cache directories under `scratch`. Panics (never skips) if Nix is missing.
fn nix(program: &str, args: &[&str], scratch: &Path) -> Output {
    let home = scratch.join("home");
    std::fs::create_dir_all(&home).unwrap();
    Command::new(program)
        .args(args)
        .env("HOME", &home)
        .env("XDG_CACHE_HOME", home.join("cache"))
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("XDG_DATA_HOME", home.join("data"))
        .env("NIX_CONFIG", "substituters =\nexperimental-features = nix-command\nrequire-sigs = false\n")
        // Nix opens its default store even when every store a command uses is given.
        .env("NIX_REMOTE", format!("local?root={}", scratch.join("default-store").display()))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (Nix 2.8's nix-bin must be installed for these tests): {e}"))
}

/// Like [`nix`], and asserts success with no error or warning on stderr.
pub(crate) fn nix_ok(program: &str, args: &[&str], scratch: &Path) -> Vec<u8> {
    let out = nix(program, args, scratch);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{program} {args:?} failed ({}): {stderr}", out.status);
    let lower = stderr.to_lowercase();
    assert!(
        !lower.contains("error") && !lower.contains("warning") && !lower.contains("was modified"),
        "{program} {args:?} complained: {stderr}"
    );
    out.stdout
}

/// The narinfos of a binary cache, references before referrers.
fn cache_infos(cache: &Path) -> Vec<NarInfo> {
    let mut by_path = BTreeMap::new();
    for entry in std::fs::read_dir(cache).unwrap() {
        let file = entry.unwrap().path();
        if file.extension().is_some_and(|e| e == "narinfo") {
            let info = NarInfo::parse(&store_dir(), &std::fs::read_to_string(&file).unwrap()).unwrap();
            by_path.insert(info.store_path.clone(), info);
        }
    }
    let mut order = Vec::new();
    let mut done = BTreeSet::new();
    fn visit(path: &StorePath, by_path: &BTreeMap<StorePath, NarInfo>, done: &mut BTreeSet<StorePath>, order: &mut Vec<NarInfo>) {
        if !done.insert(path.clone()) {
            return;
        }
        let info = &by_path[path];
        for reference in &info.references {
            visit(reference, by_path, done, order);
        }
        order.push(info.clone());
    }
    for path in by_path.keys() {
        visit(path, &by_path, &mut done, &mut order);
    }
    order
}

fn path_info(info: &NarInfo) -> ValidPathInfo {
    ValidPathInfo::from_narinfo(info, 0)
}

/// An uncompressed NAR of a cache.
fn nar_bytes(cache: &Path, info: &NarInfo) -> Vec<u8> {
    assert_eq!(info.compression, "none");
    std::fs::read(cache.join(&info.url)).unwrap()
}

/// Adds the whole `cache-subset-none` to `store`, returning what was registered.
fn add_subset(store: &Arc<LocalStore>) -> Vec<ValidPathInfo> {
    let cache = subset_cache();
    cache_infos(&cache)
        .iter()
        .map(|info| {
            let vpi = path_info(info);
            let mut nar = File::open(cache.join(&info.url)).unwrap();
            assert!(add(store, &vpi, &mut nar).unwrap(), "{} was already valid", vpi.path);
            vpi
        })
        .collect()
}

/// Adds `info`'s path from `nar` with signatures not required (the content is still checked),
/// rooted only for the addition.
pub(crate) fn add(store: &Arc<LocalStore>, info: &ValidPathInfo, nar: &mut dyn Read) -> Result<bool, LocalStoreError> {
    store.add_nar(info.clone(), nar, &SignaturePolicy::unchecked(), &store.temp_roots())
}

pub(crate) fn open_store(root: &Path) -> Arc<LocalStore> {
    Arc::new(LocalStore::open(&LocalStoreConfig::with_root(root)).unwrap())
}

pub(crate) fn shown(path: &StorePath) -> String {
    store_dir().display_path(path)
}

/// The entries of the real store directory other than `.links` (a directory of temporary
/// trees among them).
fn store_entries(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root.join("nix/store"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name != ".links")
        .collect()
}

/// The directories of temporary trees in the store directory.
fn temp_dirs(root: &Path) -> Vec<PathBuf> {
    store_entries(root).into_iter().filter(|n| is_temp_dir(n)).map(|n| root.join("nix/store").join(n)).collect()
}

pub(crate) fn dump(store: &LocalStore, path: &StorePath) -> Vec<u8> {
    let mut out = Vec::new();
    store.dump_path(path, &mut out).unwrap();
    out
}

/// `nix path-info --json -r <top>` as a map from path to its JSON object.
fn nix_path_infos(root: &Path, top: &StorePath, scratch: &Path) -> BTreeMap<String, serde_json::Value> {
    let root = root.to_str().unwrap();
    let json = nix_ok("nix", &["path-info", "--store", root, "--json", "-r", &shown(top)], scratch);
    let infos: Vec<serde_json::Value> = serde_json::from_slice(&json).unwrap();
    infos.into_iter().map(|i| (i["path"].as_str().unwrap().to_owned(), i)).collect()
}

/// Nix serialises `path` as `nar`: `nix-store --dump` of its real path (Nix 2.8 dumps file
/// system paths, not store paths) and `nix store dump-path` through the store.
fn assert_nix_dumps(root: &Path, path: &StorePath, nar: &[u8], scratch: &Path) {
    let real = root.join("nix/store").join(path.base_name());
    let dumped = nix_ok("nix-store", &["--dump", real.to_str().unwrap()], scratch);
    assert!(dumped == nar, "nix-store --dump of {path} differs");
    let dumped = nix_ok("nix", &["store", "dump-path", "--store", root.to_str().unwrap(), &shown(path)], scratch);
    assert!(dumped == nar, "nix store dump-path of {path} differs");
}

pub(crate) fn verify_with_nix(root: &Path, scratch: &Path) {
    nix_ok("nix-store", &["--store", root.to_str().unwrap(), "--verify", "--check-contents"], scratch);
}

#[test]
fn subset_added_by_sluice_is_what_nix_reads() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    assert_eq!(std::fs::read_to_string(root.join("nix/var/nix/db/schema")).unwrap(), "10");

    let started = Instant::now();
    let added = add_subset(&store);
    eprintln!("added {} paths in {:?}", added.len(), started.elapsed());
    assert_eq!(added.len(), 25);
    let expected_entries: BTreeSet<String> = added.iter().map(|i| i.path.base_name().to_owned()).collect();
    assert_eq!(store_entries(&root), expected_entries, "only the store paths, no temporary trees or lock files");

    verify_with_nix(&root, tmp.path());

    // Nix sees exactly what was registered.
    let top = StorePath::from_base_name("24ycq19xja05axfz8a72yhz9aw6mli99-hexurvend-wrapper").unwrap();
    let nix_infos = nix_path_infos(&root, &top, tmp.path());
    assert_eq!(nix_infos.len(), 25);
    for info in &added {
        let json = &nix_infos[&shown(&info.path)];
        assert_eq!(json["narHash"].as_str().unwrap(), info.nar_hash.to_sri(), "{}", info.path);
        assert_eq!(json["narSize"].as_u64().unwrap(), info.nar_size);
        let references: BTreeSet<String> = json["references"].as_array().unwrap().iter().map(|r| r.as_str().unwrap().to_owned()).collect();
        assert_eq!(references, info.references.iter().map(shown).collect());
        assert_eq!(json["deriver"].as_str().map(str::to_owned), info.deriver.as_ref().map(shown));
        assert_eq!(json["ca"].as_str().map(str::to_owned), info.ca.as_ref().map(ToString::to_string));
        let sigs: BTreeSet<String> =
            json["signatures"].as_array().map_or_else(Vec::new, Clone::clone).iter().map(|s| s.as_str().unwrap().to_owned()).collect();
        assert_eq!(sigs, info.sigs);
        assert!(json["ultimate"] != true, "{} is not ultimate", info.path);
    }

    // sluice reads back what it wrote; NARs from disk are byte-identical to the cache's and to
    // `nix-store --dump`.
    let cache = subset_cache();
    let by_path: BTreeMap<StorePath, NarInfo> = cache_infos(&cache).into_iter().map(|i| (i.store_path.clone(), i)).collect();
    for info in &added {
        let mut read = store.query_path_info(&info.path).unwrap().unwrap();
        assert!(read.registration_time > 1_600_000_000);
        read.registration_time = 0;
        assert_eq!(&read, info);
        let from_disk = dump(&store, &info.path);
        assert!(from_disk == nar_bytes(&cache, &by_path[&info.path]), "dump of {} differs from its NAR", info.path);
        assert_nix_dumps(&root, &info.path, &from_disk, tmp.path());
    }
    let all: BTreeSet<StorePath> = added.iter().map(|i| i.path.clone()).collect();
    assert_eq!(store.query_all_valid_paths().unwrap(), all);
    let glibc = StorePath::from_base_name("1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.37-8").unwrap();
    let referrers: BTreeSet<StorePath> = added.iter().filter(|i| i.references.contains(&glibc)).map(|i| i.path.clone()).collect();
    assert!(referrers.contains(&glibc) && referrers.len() > 3);
    assert_eq!(store.query_referrers(&glibc).unwrap(), referrers);

    // Canonical metadata on every node.
    for info in &added {
        assert_canonical(&store.real_path(&info.path));
    }

    // Adding again is a no-op; a second opener sees the same store.
    let again = path_info(&by_path[&glibc]);
    assert!(!add(&store, &again, &mut std::io::empty()).unwrap());
    let reopened = open_store(&root);
    let mut paths: Vec<StorePath> = all.iter().cloned().collect();
    paths.push(StorePath::from_base_name("00000000000000000000000000000000-absent").unwrap());
    assert_eq!(reopened.query_valid_paths(&paths).unwrap(), all);
}

/// mtime 1 everywhere, mode 0444/0555 on files and directories.
fn assert_canonical(path: &Path) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert_eq!(meta.mtime(), 1, "{}", path.display());
    if meta.file_type().is_symlink() {
        return;
    }
    let mode = meta.permissions().mode() & 0o7777;
    assert!(mode == 0o444 || mode == 0o555, "{} has mode {mode:o}", path.display());
    if meta.is_dir() {
        assert_eq!(mode, 0o555);
        for entry in std::fs::read_dir(path).unwrap() {
            assert_canonical(&entry.unwrap().path());
        }
    }
}

#[test]
fn sluice_reads_a_store_nix_wrote() {
    let tmp = Scratch::new();
    let cache = tmp.path().join("cache");
    copy_dir(&subset_cache(), &cache);
    let root = tmp.path().join("root");
    let top = "/nix/store/24ycq19xja05axfz8a72yhz9aw6mli99-hexurvend-wrapper";
    let from = format!("file://{}", cache.display());
    nix_ok("nix", &["copy", "--no-check-sigs", "--from", &from, "--to", root.to_str().unwrap(), top], tmp.path());

    let store = open_store(&root);
    let infos = cache_infos(&cache);
    assert_eq!(store.query_all_valid_paths().unwrap().len(), infos.len());
    for info in &infos {
        let read = store.query_path_info(&info.store_path).unwrap().unwrap_or_else(|| panic!("{} not valid", info.store_path));
        let mut expected = path_info(info);
        expected.registration_time = read.registration_time;
        assert_eq!(read, expected);
        assert!(dump(&store, &info.store_path) == nar_bytes(&cache, info), "dump of {}", info.store_path);
    }

    // Nix still reads the store after sluice opened it, and sluice can add to it.
    verify_with_nix(&root, tmp.path());
    let fixture = fixture("varied-tree.nar");
    assert!(add(&store, &fixture.0, &mut fixture.1.as_slice()).unwrap());
    verify_with_nix(&root, tmp.path());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()));
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// A NAR of `fixtures/` and its path info (no references: registration does not scan).
fn fixture(file: &str) -> (ValidPathInfo, Vec<u8>) {
    let table = std::fs::read_to_string(Path::new(CORPUS).join("fixtures/fixtures.tsv")).unwrap();
    let row: Vec<&str> = table.lines().map(|l| l.split('\t').collect::<Vec<_>>()).find(|r| r[0] == file).unwrap();
    let info = ValidPathInfo {
        path: store_dir().parse_path(row[1]).unwrap(),
        nar_hash: Hash::parse(&format!("sha256:{}", row[3])).unwrap(),
        nar_size: row[2].parse().unwrap(),
        references: BTreeSet::new(),
        deriver: None,
        registration_time: 1_700_000_000,
        ultimate: true,
        sigs: BTreeSet::new(),
        ca: None,
    };
    (info, std::fs::read(Path::new(CORPUS).join("fixtures").join(file)).unwrap())
}

#[test]
fn fixtures_round_trip_through_the_store() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    for file in ["varied-tree.nar", "symlink-root.nar", "exec-file-root.nar", "ca-source-dir.nar"] {
        let (info, nar) = fixture(file);
        assert!(add(&store, &info, &mut nar.as_slice()).unwrap());
        assert!(dump(&store, &info.path) == nar, "{file}");
        let read = store.query_path_info(&info.path).unwrap().unwrap();
        assert_eq!(read, info);
        assert_nix_dumps(&root, &info.path, &nar, tmp.path());
    }
    verify_with_nix(&root, tmp.path());
}

#[test]
fn unpack_hashes_a_root_file_and_can_be_repeated() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let (info, nar) = fixture("exec-file-root.nar");
    let roots = store.temp_roots();
    let unchecked = SignaturePolicy::unchecked();
    let pending = store.begin_add(info.clone(), &roots).unwrap().unwrap();
    assert!(matches!(pending.commit(&unchecked), Err(LocalStoreError::Misuse { .. })));
    assert!(store_entries(&root).is_empty(), "{:?}", store_entries(&root));

    let mut pending = store.begin_add(info.clone(), &roots).unwrap().unwrap();
    let truncated = pending.unpack(&mut &nar[..nar.len() - 8]).unwrap_err();
    assert!(matches!(truncated, LocalStoreError::Nar { .. }), "{truncated}");
    let unpacked = pending.unpack(&mut nar.as_slice()).unwrap();
    assert_eq!(unpacked.nar_hash, info.nar_hash);
    assert_eq!(unpacked.nar_size, info.nar_size);
    assert_eq!(unpacked.ca_hash, None, "no content address, no content hash");
    let temp = temp_dirs(&root);
    assert_eq!(temp.len(), 1, "one directory of temporary trees while an addition is in progress");
    assert_eq!(std::fs::metadata(&temp[0]).unwrap().permissions().mode() & 0o7777, 0o700);
    assert!(temp[0].join(info.path.base_name()).is_file(), "unpacked into the directory of temporary trees");
    pending.commit(&unchecked).unwrap();
    let meta = std::fs::symlink_metadata(store.real_path(&info.path)).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o555);
    assert_eq!(store_entries(&root), BTreeSet::from([info.path.base_name().to_owned()]));

    // A directory root has no flat hash.
    let (dir_info, dir_nar) = fixture("ca-source-dir.nar");
    let mut pending = store.begin_add(dir_info.clone(), &roots).unwrap().unwrap();
    pending.unpack(&mut dir_nar.as_slice()).unwrap();
    drop(pending);
    assert_eq!(store_entries(&root), BTreeSet::from([info.path.base_name().to_owned()]), "dropped addition left something");
    assert!(!store.is_valid_path(&dir_info.path).unwrap());
}

/// Adding `info` from `nar` fails as `check` expects, and leaves nothing behind.
fn assert_add_fails_cleanly(info: &ValidPathInfo, nar: &[u8], check: impl Fn(&LocalStoreError) -> bool) {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let err = add(&store, info, &mut &nar[..]).unwrap_err();
    assert!(check(&err), "unexpected error: {err}");
    let message = err.to_string();
    assert!(message.contains(&shown(&info.path)), "error does not name the path: {message}");
    assert!(!store.is_valid_path(&info.path).unwrap());
    assert!(store.query_path_info(&info.path).unwrap().is_none());
    assert!(store_entries(&root).is_empty(), "left behind: {:?}", store_entries(&root));
    assert!(matches!(store.dump_path(&info.path, &mut Vec::new()), Err(LocalStoreError::NotValid { .. })));
}

#[test]
fn nar_hash_or_size_mismatch_leaves_nothing() {
    let (info, nar) = fixture("varied-tree.nar");
    let mut wrong_hash = info.clone();
    wrong_hash.nar_hash = Hash::digest_bytes(HashAlgo::Sha256, b"not this NAR");
    assert_add_fails_cleanly(&wrong_hash, &nar, |e| {
        let text = e.to_string();
        matches!(e, LocalStoreError::HashMismatch { .. })
            && text.contains(&wrong_hash.nar_hash.to_nix32_prefixed())
            && text.contains(&info.nar_hash.to_nix32_prefixed())
    });
    let mut wrong_size = info.clone();
    wrong_size.nar_size += 8;
    assert_add_fails_cleanly(
        &wrong_size,
        &nar,
        |e| matches!(e, LocalStoreError::SizeMismatch { expected, actual, .. } if *expected == info.nar_size + 8 && *actual == info.nar_size),
    );
}

/// Bytes after the end of a NAR are left unread, as Nix's `restorePath` leaves them: the path
/// is added with the NAR's own hash and size, and the reader stops at the NAR's end.
#[test]
fn bytes_after_the_nar_are_left_unread() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let (info, nar) = fixture("varied-tree.nar");
    let mut longer = nar.clone();
    longer.extend_from_slice(b"trailing bytes, never read");
    let mut reader = longer.as_slice();
    assert!(add(&store, &info, &mut reader).unwrap());
    assert_eq!(reader, b"trailing bytes, never read");
    assert!(dump(&store, &info.path) == nar);
    verify_with_nix(&root, tmp.path());
}

#[test]
fn bad_nars_leave_nothing() {
    let (info, nar) = fixture("varied-tree.nar");
    assert_add_fails_cleanly(&info, &nar[..nar.len() / 2], |e| matches!(e, LocalStoreError::Nar { .. }));
    assert_add_fails_cleanly(&info, b"nix-archive-2", |e| matches!(e, LocalStoreError::Nar { .. }));
}

#[test]
fn missing_reference_leaves_nothing() {
    let cache = subset_cache();
    let infos = cache_infos(&cache);
    let with_refs = infos.iter().find(|i| i.references.iter().any(|r| *r != i.store_path)).unwrap();
    assert_add_fails_cleanly(
        &path_info(with_refs),
        &nar_bytes(&cache, with_refs),
        |e| matches!(e, LocalStoreError::MissingReference { reference, .. } if with_refs.references.iter().any(|r| shown(r) == *reference)),
    );
}

/// What killed runs leave: a read-only tree at a path's location (a crash between rename and
/// registration, or a half-copied tree), and directories of temporary trees, with trees in
/// them (one with the name sluice used before they were made per run). The first addition
/// replaces the tree and removes the directories whose lock is free; the one whose holder
/// (another process) lives is kept, and removed by the next opener once its holder is gone.
#[test]
fn stale_unregistered_tree_and_temporary_directories_are_removed() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let (info, nar) = fixture("varied-tree.nar");
    let (other, other_nar) = fixture("symlink-root.nar");
    let dead = ["00000000000000000000000000000000-sluice-unpacking", "1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b-sluice-unpacking"];
    let live = "2c2c2c2c2c2c2c2c2c2c2c2c2c2c2c2c-sluice-unpacking";
    let mut names = vec![info.path.base_name().to_owned()];
    for dir in dead.iter().chain([&live]) {
        names.extend([format!("{dir}/{}", info.path.base_name()), format!("{dir}/{}", other.path.base_name())]);
    }
    for name in &names {
        let stale = root.join("nix/store").join(name);
        std::fs::create_dir_all(stale.join("sub")).unwrap();
        std::fs::write(stale.join("sub/file"), b"stale").unwrap();
        for dir in [stale.join("sub"), stale.clone()] {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        }
    }
    let live_dir = root.join("nix/store").join(live);
    let mut holder = Command::new("flock")
        .arg(&live_dir)
        .args(["-c", "echo locked; sleep 3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("flock(1) from util-linux");
    let mut line = [0u8; 7];
    holder.stdout.take().unwrap().read_exact(&mut line).unwrap();
    assert!(add(&store, &info, &mut nar.as_slice()).unwrap());
    assert!(dump(&store, &info.path) == nar);
    assert_eq!(
        store_entries(&root),
        BTreeSet::from([info.path.base_name().to_owned(), live.to_owned()]),
        "only the directory whose holder lives is kept"
    );
    assert_eq!(std::fs::read_dir(&live_dir).unwrap().count(), 2, "the live directory's trees were touched");
    assert!(holder.wait().unwrap().success());
    drop(store);
    let store = open_store(&root);
    assert!(add(&store, &other, &mut other_nar.as_slice()).unwrap());
    assert_eq!(store_entries(&root), BTreeSet::from([info.path.base_name().to_owned(), other.path.base_name().to_owned()]));
    verify_with_nix(&root, tmp.path());
}

#[test]
fn concurrent_adders_register_once() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    // Two openers (two database connections, separate lock-file descriptors, as two
    // processes would have), two threads each.
    let stores = [open_store(&root), open_store(&root)];
    let (info, nar) = fixture("varied-tree.nar");
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let store = Arc::clone(&stores[i % 2]);
            let (info, nar, barrier) = (info.clone(), nar.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                add(&store, &info, &mut nar.as_slice()).unwrap()
            })
        })
        .collect();
    let added: Vec<bool> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(added.iter().filter(|a| **a).count(), 1, "{added:?}");
    assert_eq!(stores[0].query_all_valid_paths().unwrap().len(), 1);
    assert_eq!(store_entries(&root), BTreeSet::from([info.path.base_name().to_owned()]));
    verify_with_nix(&root, tmp.path());
}

#[test]
fn derivations_register_their_outputs() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let cache = Path::new(CORPUS).join("cache-drv");
    let infos = cache_infos(&cache);
    // A derivation and its references (sources and other derivations), in order.
    let drv = infos.iter().find(|i| i.store_path.base_name() == "4pn0by0gf2sdxffw9hs5cvfi9vwzpvnb-glibc-2.37-8.drv").unwrap();
    let mut wanted = BTreeSet::from([drv.store_path.clone()]);
    for info in infos.iter().rev() {
        if wanted.contains(&info.store_path) {
            wanted.extend(info.references.iter().cloned());
        }
    }
    for info in infos.iter().filter(|i| wanted.contains(&i.store_path)) {
        let compressed = File::open(cache.join(&info.url)).unwrap();
        let mut nar = liblzma::read::XzDecoder::new(compressed);
        assert!(add(&store, &path_info(info), &mut nar).unwrap());
    }
    verify_with_nix(&root, tmp.path());

    let db = rusqlite::Connection::open(root.join("nix/var/nix/db/db.sqlite")).unwrap();
    let mut stmt = db
        .prepare("select d.id, d.path from DerivationOutputs d join ValidPaths v on d.drv = v.id where v.path = ? order by d.id")
        .unwrap();
    let outputs: Vec<(String, String)> =
        stmt.query_map([shown(&drv.store_path)], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect();
    let mut aterm = Vec::new();
    File::open(store.real_path(&drv.store_path)).unwrap().read_to_end(&mut aterm).unwrap();
    let expected: Vec<(String, String)> = sluice_nix::derivation::parse_outputs(&store_dir(), &drv.store_path, &aterm)
        .unwrap()
        .into_iter()
        .map(|(name, path)| (name, shown(&path.unwrap())))
        .collect();
    assert!(!expected.is_empty());
    assert_eq!(outputs, expected);
    assert!(outputs.iter().any(|(_, p)| p == "/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.37-8"));

    // The same table through the store's API, both ways.
    let map: Vec<(String, String)> =
        store.query_derivation_output_map(&drv.store_path).unwrap().into_iter().map(|(n, p)| (n, shown(&p))).collect();
    assert_eq!(map, expected);
    let glibc = store_dir().parse_path("/nix/store/1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.37-8").unwrap();
    assert_eq!(store.query_valid_derivers(&glibc).unwrap(), BTreeSet::from([drv.store_path.clone()]));
    let not_an_output = infos.iter().find(|i| wanted.contains(&i.store_path) && !i.store_path.is_derivation()).unwrap();
    assert!(store.query_valid_derivers(&not_an_output.store_path).unwrap().is_empty());
    assert!(matches!(store.query_derivation_output_map(&glibc), Err(LocalStoreError::NotValid { .. })));
}

#[test]
fn begin_add_waits_for_a_lock_held_by_another_process() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let (info, nar) = fixture("symlink-root.nar");
    // Another process holds `<path>.lock` with flock(2), as Nix's `PathLocks` does.
    let lock_file = format!("{}.lock", store.real_path(&info.path).display());
    let mut holder = Command::new("flock")
        .args([lock_file.as_str(), "-c", "echo locked; sleep 1"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("flock(1) from util-linux");
    let mut line = [0u8; 7];
    holder.stdout.take().unwrap().read_exact(&mut line).unwrap();
    assert_eq!(&line, b"locked\n");
    let started = Instant::now();
    let mut pending = store.begin_add(info.clone(), &store.temp_roots()).unwrap().unwrap();
    let waited = started.elapsed();
    assert!(holder.wait().unwrap().success());
    assert!(waited.as_millis() >= 500, "begin_add did not wait for the lock holder ({waited:?})");
    pending.unpack(&mut nar.as_slice()).unwrap();
    pending.commit(&SignaturePolicy::unchecked()).unwrap();
    assert_eq!(store_entries(&root), BTreeSet::from([info.path.base_name().to_owned()]), "lock file left behind");
}

/// A batch with a bad path in it: the path fails, its dependents in the batch are handed back
/// with their trees and locks (nothing of theirs at a final path) and are committed once the
/// path is added again, with its right NAR hash.
#[test]
fn commit_all_hands_back_the_dependents_of_a_bad_path_until_it_is_valid() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let cache = subset_cache();
    let infos = cache_infos(&cache);
    // A path with dependents inside the subset, given a wrong NarHash.
    let bad = infos
        .iter()
        .find(|i| infos.iter().any(|j| j.store_path != i.store_path && j.references.contains(&i.store_path)))
        .unwrap()
        .store_path
        .clone();
    let policy = SignaturePolicy::unchecked();
    let mut batch = Vec::new();
    let roots = store.temp_roots();
    for info in &infos {
        let mut vpi = path_info(info);
        if vpi.path == bad {
            vpi.nar_hash = Hash::digest_bytes(HashAlgo::Sha256, b"not this NAR");
        }
        let mut pending = store.begin_add(vpi, &roots).unwrap().unwrap();
        pending.unpack(&mut &nar_bytes(&cache, info)[..]).unwrap();
        batch.push((pending, &policy));
    }
    let results = store.commit_all(batch);
    // Which paths have `bad` in their closure (the subset is in dependency order).
    let mut tainted = BTreeSet::from([bad.clone()]);
    for info in &infos {
        if info.references.iter().any(|r| tainted.contains(r)) {
            tainted.insert(info.store_path.clone());
        }
    }
    assert!(tainted.len() > 1, "the bad path has dependents");
    let mut waiting = Vec::new();
    for (info, result) in infos.iter().zip(results) {
        let p = &info.store_path;
        match result {
            Err(Uncommitted::Failed(LocalStoreError::HashMismatch { .. })) => assert_eq!(*p, bad),
            Err(Uncommitted::Waiting(pending, LocalStoreError::MissingReference { .. })) => {
                assert!(tainted.contains(p) && *p != bad, "{p}");
                assert_eq!(pending.info().path, *p);
                waiting.push((*pending, &policy));
            }
            Ok(()) => assert!(!tainted.contains(p) && store.is_valid_path(p).unwrap(), "{p}"),
            Err(e) => panic!("unexpected result for {p}: {e:?}"),
        }
        assert_eq!(store.is_valid_path(p).unwrap(), !tainted.contains(p));
    }
    assert_eq!(waiting.len(), tainted.len() - 1);
    for (pending, _) in &waiting {
        assert!(!root.join("nix/store").join(pending.info().path.base_name()).exists(), "{} is at its final path", pending.info().path);
    }
    // Handed back again while the bad path is still missing; committed once it is valid.
    let again = store.commit_all(waiting);
    let waiting: Vec<_> = again
        .into_iter()
        .map(|r| match r {
            Err(Uncommitted::Waiting(pending, _)) => (*pending, &policy),
            r => panic!("committed without its reference: {r:?}"),
        })
        .collect();
    let info = infos.iter().find(|i| i.store_path == bad).unwrap();
    assert!(store.add_nar(path_info(info), &mut &nar_bytes(&cache, info)[..], &policy, &roots).unwrap());
    for result in store.commit_all(waiting) {
        result.unwrap();
    }
    for info in &infos {
        assert!(store.is_valid_path(&info.store_path).unwrap(), "{}", info.store_path);
    }
    let expected: BTreeSet<String> = infos.iter().map(|i| i.store_path.base_name().to_string()).collect();
    assert_eq!(store_entries(&root), expected, "the store directory holds the registered paths and nothing else");
    verify_with_nix(&root, tmp.path());
}

#[test]
fn signatures_and_hash_part_lookup() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let added = add_subset(&store);
    assert_eq!(store.state_dir(), root.join("nix/var/nix").as_path());
    assert_eq!(store.log_dir(), root.join("nix/var/log/nix").as_path());

    for info in &added {
        assert_eq!(store.query_path_from_hash_part(info.path.hash_part()).unwrap().as_ref(), Some(&info.path));
    }
    // A hash part just below a valid one (its last digit decremented) finds nothing, even
    // though the index seek lands on that valid path.
    let first = &added[0].path;
    let mut below = first.hash_part().to_owned();
    let last = below.pop().unwrap();
    let alphabet = sluice_nix::base32::ALPHABET;
    let pos = alphabet.iter().position(|c| char::from(*c) == last).unwrap();
    below.push(char::from(alphabet[(pos + 31) % 32]));
    assert!(pos > 0 || below != first.hash_part());
    assert_eq!(store.query_path_from_hash_part(&below).unwrap(), None);
    assert_eq!(store.query_path_from_hash_part("short").unwrap(), None);

    // Signatures are added as a set to those the path has, and Nix sees them.
    let target = &added[0];
    let before = store.query_path_info(&target.path).unwrap().unwrap().sigs;
    let new: BTreeSet<String> = ["test-key-1:AAAA".to_owned(), "test-key-2:BBBB".to_owned()].into();
    store.add_signatures(&target.path, &new).unwrap();
    store.add_signatures(&target.path, &new).unwrap();
    let after = store.query_path_info(&target.path).unwrap().unwrap().sigs;
    assert_eq!(after, before.union(&new).cloned().collect::<BTreeSet<_>>());
    let json = nix_path_infos(&root, &target.path, tmp.path());
    let sigs: BTreeSet<String> =
        json[&shown(&target.path)]["signatures"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect();
    assert_eq!(sigs, after);
    let missing = store_dir().parse_path("/nix/store/00000000000000000000000000000000-missing").unwrap();
    assert!(matches!(store.add_signatures(&missing, &new), Err(LocalStoreError::NotValid { .. })));
}

#[test]
fn temp_roots_are_honoured_by_nix_garbage_collector() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let added = add_subset(&store);
    // A path that others refer to (so its referrers are outside its closure) is the root.
    let top = added.iter().find(|i| added.iter().any(|j| j.path != i.path && j.references.contains(&i.path))).unwrap().path.clone();
    let closure: BTreeSet<StorePath> = {
        let mut seen = BTreeSet::from([top.clone()]);
        let mut todo = vec![top.clone()];
        while let Some(p) = todo.pop() {
            for r in store.query_path_info(&p).unwrap().unwrap().references {
                if seen.insert(r.clone()) {
                    todo.push(r);
                }
            }
        }
        seen
    };
    let outside: Vec<&StorePath> = added.iter().map(|i| &i.path).filter(|p| !closure.contains(*p)).collect();
    assert!(!outside.is_empty(), "the subset should have paths outside the top's closure");

    let roots = store.temp_roots();
    roots.add(&top).unwrap();
    roots.clone().add(&top).unwrap();
    let file = roots.path().unwrap();
    let id = file.file_name().unwrap().to_str().unwrap().to_owned();
    assert_eq!(id, format!("{}-{}", std::process::id(), id.split('-').nth(1).unwrap()), "named <pid>-<n>");
    assert_eq!(std::fs::read(&file).unwrap(), format!("{}\0", shown(&top)).into_bytes(), "written once");
    let found = store.find_temp_roots().unwrap();
    assert_eq!(found.get(&top), Some(&BTreeSet::from([format!("{{temp:{}}}", std::process::id())])));

    let r = root.to_str().unwrap();
    let printed = String::from_utf8(nix_ok("nix-store", &["--store", r, "--gc", "--print-roots"], tmp.path())).unwrap();
    assert!(printed.contains(&format!("{{temp:{}}} -> {}", std::process::id(), shown(&top))), "{printed}");
    // Nix's collector runs (and deletes) while the roots file is held: the closure stays.
    nix_ok("nix-store", &["--store", r, "--gc"], tmp.path());
    for p in &closure {
        assert!(store.is_valid_path(p).unwrap(), "{p} was collected although rooted");
        assert!(store.real_path(p).exists());
    }
    for p in &outside {
        assert!(!store.is_valid_path(p).unwrap(), "{p} is not rooted and should have been collected");
    }
    drop(roots);
    assert!(!file.exists(), "the roots file outlived its holder");
    nix_ok("nix-store", &["--store", r, "--gc"], tmp.path());
    assert!(!store.is_valid_path(&top).unwrap(), "the root ended with its holder");
}

#[test]
fn concurrent_first_opens_of_a_new_store_all_succeed() {
    // Regression: a reader could see the `schema` file created but still empty ("store schema
    // version \"\"") while another process was writing it.
    for _ in 0..20 {
        let tmp = Scratch::new();
        let root = tmp.path().join("root");
        let barrier = Arc::new(Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (root, barrier) = (root.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    LocalStore::open(&LocalStoreConfig::with_root(&root)).map(|_| ()).map_err(|e| e.to_string())
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap().unwrap();
        }
        assert_eq!(std::fs::read_to_string(root.join("nix/var/nix/db/schema")).unwrap(), "10");
    }
}

/// An info claiming `ca` for `name` with `references` (self-reference with `self_ref`), with
/// the NAR hash and size of `nar` (honest about the NAR, whatever it holds).
fn ca_info(ca: ContentAddress, name: &str, references: &[StorePath], self_ref: bool, nar: &[u8]) -> ValidPathInfo {
    let path = ca.store_path(&store_dir(), name, references, self_ref).unwrap();
    let mut refs: BTreeSet<StorePath> = references.iter().cloned().collect();
    if self_ref {
        refs.insert(path.clone());
    }
    ValidPathInfo {
        path,
        nar_hash: Hash::digest_bytes(HashAlgo::Sha256, nar),
        nar_size: nar.len() as u64,
        references: refs,
        deriver: None,
        registration_time: 0,
        ultimate: false,
        sigs: BTreeSet::new(),
        ca: Some(ca),
    }
}

/// The verification boundary computes every content address from the content, for every
/// form and hash algorithm, whoever vouches for the path: a mismatch is refused with Nix's
/// message naming both hashes, leaves nothing, and the honest content is accepted.
#[test]
fn content_addresses_are_checked_against_the_content() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let roots = store.temp_roots();
    let real = b"the real content\n".as_slice();
    let other = b"other content\n".as_slice();
    let (real_nar, other_nar) = (regular_file_nar(real, false), regular_file_nar(other, false));
    let strict = SignaturePolicy { require_sigs: true, trusted_keys: Default::default() };
    let text_ref =
        ca_info(ContentAddress::Text(Hash::digest_bytes(HashAlgo::Sha256, b"ref")), "ref", &[], false, &regular_file_nar(b"ref", false));
    assert!(
        store.add_nar(text_ref.clone(), &mut regular_file_nar(b"ref", false).as_slice(), &strict, &roots).unwrap(),
        "a CA path needs no signature"
    );
    let cases: Vec<(&str, ContentAddress, &[StorePath])> = vec![
        ("nar-sha256", ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha256, &real_nar) }, &[]),
        ("nar-sha1", ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha1, &real_nar) }, &[]),
        ("nar-sha512", ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha512, &real_nar) }, &[]),
        ("flat-sha256", ContentAddress::Fixed { recursive: false, hash: Hash::digest_bytes(HashAlgo::Sha256, real) }, &[]),
        ("flat-md5", ContentAddress::Fixed { recursive: false, hash: Hash::digest_bytes(HashAlgo::Md5, real) }, &[]),
        ("text", ContentAddress::Text(Hash::digest_bytes(HashAlgo::Sha256, real)), std::slice::from_ref(&text_ref.path)),
    ];
    for (name, ca, refs) in cases {
        let forged = ca_info(ca.clone(), name, refs, false, &other_nar);
        for policy in [&strict, &SignaturePolicy::unchecked()] {
            let err = store.add_nar(forged.clone(), &mut other_nar.as_slice(), policy, &roots).unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, LocalStoreError::CaMismatch { .. }), "{name}: {message}");
            assert!(message.starts_with(&format!("ca hash mismatch importing path '{}';", shown(&forged.path))), "{message}");
            assert!(message.contains(&format!("specified: {}", ca.hash().to_nix32_prefixed())), "{message}");
            assert!(!store.is_valid_path(&forged.path).unwrap());
            assert!(!store.real_path(&forged.path).exists(), "{name}: something left at the path");
        }
        let honest = ca_info(ca, name, refs, false, &real_nar);
        assert!(store.add_nar(honest.clone(), &mut real_nar.as_slice(), &strict, &roots).unwrap(), "{name}");
        assert_eq!(store.query_path_info(&honest.path).unwrap().unwrap().ca, honest.ca);
    }
    // The message names the hash that was computed.
    let ca = ContentAddress::Fixed { recursive: false, hash: Hash::digest_bytes(HashAlgo::Sha256, real) };
    let err = store.add_nar(ca_info(ca, "named", &[], false, &other_nar), &mut other_nar.as_slice(), &strict, &roots).unwrap_err();
    assert!(err.to_string().contains(&format!("got:       {}", Hash::digest_bytes(HashAlgo::Sha256, other).to_nix32_prefixed())), "{err}");
    // A content address that does not yield the path is refused, even unchecked.
    let mut moved = ca_info(
        ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha256, &real_nar) },
        "moved",
        &[],
        false,
        &real_nar,
    );
    moved.path = store_dir().parse_path("/nix/store/00000000000000000000000000000001-moved").unwrap();
    let err = store.add_nar(moved.clone(), &mut real_nar.as_slice(), &SignaturePolicy::unchecked(), &roots).unwrap_err();
    assert!(matches!(err, LocalStoreError::CaPath { .. }), "{err}");
    // Without a content address or a signature, a strict policy refuses (before unpacking
    // anything is fine too, but the store refuses at commit whatever the caller did).
    let mut plain = moved;
    plain.ca = None;
    let err = store.add_nar(plain.clone(), &mut real_nar.as_slice(), &strict, &roots).unwrap_err();
    assert!(err.to_string().contains("lacks a signature by a trusted key"), "{err}");
    assert!(!store.real_path(&plain.path).exists());
    store_entries(&root);
    verify_with_nix(&root, tmp.path());
}

/// A recursive content address of a path that refers to itself is the NAR's hash modulo the
/// path's hash part (Nix's `HashModuloSink`): the NAR with the hash part zeroed, then (Nix
/// before 2.17) the offsets of the occurrences, or (Nix 2.17 and later, whose
/// `make-content-addressed` and `fetchClosure` make such paths) nothing more. A path addressed
/// either way is accepted. With the offsets, the NAR with the hash part already zeroed is not
/// (without them it is, in Nix 2.26 as here: the weakness the offsets guarded against).
#[test]
fn self_referencing_content_address_is_hashed_modulo_the_hash_part() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let roots = store.temp_roots();
    // A file that names its own store path: its hash part sits at a known offset, zeroed
    // while hashing.
    let prefix = b"#!/bin/sh\nexec /nix/store/".to_vec();
    let template = [prefix.clone(), vec![0u8; 32], b"-self/bin/x \"$@\"\n".to_vec()].concat();
    let zeroed_nar = regular_file_nar(&template, true);
    let at = zeroed_nar.windows(prefix.len()).position(|w| w == prefix.as_slice()).unwrap() + prefix.len();
    let with_offsets = [zeroed_nar.clone(), format!("|{at}").into_bytes()].concat();
    let strict = SignaturePolicy { require_sigs: true, trusted_keys: Default::default() };
    for (nix, hashed, name) in [("before 2.17", &with_offsets, "self"), ("2.17 and later", &zeroed_nar, "self-217")] {
        let ca = ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha256, hashed) };
        let path = ca.store_path(&store_dir(), name, &[], true).unwrap();
        let mut nar = zeroed_nar.clone();
        nar[at..at + 32].copy_from_slice(path.hash_part().as_bytes());
        let info = ca_info(ca.clone(), name, &[], true, &nar);
        assert_eq!(info.path, path);
        assert!(store.add_nar(info.clone(), &mut nar.as_slice(), &strict, &roots).unwrap(), "Nix {nix}");
    }
    // The zeroed NAR under the claim with offsets does not match (its hash part is not there).
    let ca = ContentAddress::Fixed { recursive: true, hash: Hash::digest_bytes(HashAlgo::Sha256, &with_offsets) };
    let other = ca_info(ca, "other", &[], true, &zeroed_nar);
    let err = store.add_nar(other, &mut zeroed_nar.as_slice(), &strict, &roots).unwrap_err();
    assert!(matches!(err, LocalStoreError::CaMismatch { .. }), "{err}");
    verify_with_nix(&root, tmp.path());
}

/// A snapshot of every entry under `dir`: relative path, size and modification time.
fn tree_snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, i64, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            out.insert(path.strip_prefix(dir).unwrap().to_path_buf(), (meta.len(), meta.mtime(), meta.mtime_nsec()));
            if meta.is_dir() {
                stack.push(path);
            }
        }
    }
    out
}

/// `read-only=true` (Nix's `local-store.hh`): queries work, adding is refused before anything
/// is written, and nothing in the store changes (not even a lock file); a store that does not
/// exist is not created.
#[test]
fn read_only_store_reads_and_refuses_writes() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let added = add_subset(&open_store(&root));
    let before = tree_snapshot(&root);

    let mut config = LocalStoreConfig::with_root(&root);
    config.read_only = true;
    let store = Arc::new(LocalStore::open(&config).unwrap());
    let all: BTreeSet<StorePath> = added.iter().map(|i| i.path.clone()).collect();
    assert_eq!(store.query_all_valid_paths().unwrap(), all);
    let info = store.query_path_info(&added[0].path).unwrap().unwrap();
    assert_eq!(
        (&info.nar_hash, info.nar_size, &info.references, &info.sigs),
        (&added[0].nar_hash, added[0].nar_size, &added[0].references, &added[0].sigs)
    );
    let mut dumped = Vec::new();
    store.dump_path(&added[0].path, &mut dumped).unwrap();
    assert_eq!(dumped, nar_bytes(&subset_cache(), &cache_infos(&subset_cache())[0]));

    let fresh = StorePath::from_base_name("00000000000000000000000000000000-not-there").unwrap();
    let refusal = |e: LocalStoreError| match e {
        LocalStoreError::ReadOnly { store, what } => format!("{}: {what}", store.display()),
        other => panic!("expected a read-only refusal, got {other}"),
    };
    let real = root.join("nix/store");
    assert_eq!(
        refusal(store.begin_add(ValidPathInfo { path: fresh.clone(), ..added[0].clone() }, &store.temp_roots()).err().unwrap()),
        format!("{}: add paths", real.display())
    );
    assert!(matches!(
        store.try_begin_add(ValidPathInfo { path: fresh.clone(), ..added[0].clone() }, &store.temp_roots()),
        Err(LocalStoreError::ReadOnly { .. })
    ));
    assert_eq!(
        refusal(store.add_signatures(&added[0].path, &BTreeSet::from(["k:sig".to_string()])).unwrap_err()),
        format!("{}: add signatures", real.display())
    );
    drop(store);
    assert_eq!(tree_snapshot(&root), before, "a read-only store was changed");

    let mut missing = LocalStoreConfig::with_root(&tmp.path().join("absent"));
    missing.read_only = true;
    assert!(LocalStore::open(&missing).is_err());
    assert!(!tmp.path().join("absent").exists(), "a read-only open created the store");
}

/// `state=` and `real=` (Nix's `local-fs-store.hh`) put the database and the paths where
/// asked, and nothing under the default `<root>/nix`.
#[test]
fn state_and_real_directories_are_honoured() {
    let tmp = Scratch::new();
    let mut config = LocalStoreConfig::with_root(&tmp.path().join("root"));
    config.dirs.state = tmp.path().join("state");
    config.dirs.real = tmp.path().join("paths");
    let store = Arc::new(LocalStore::open(&config).unwrap());
    let added = add_subset(&store);
    assert_eq!(store.real_path(&added[0].path), tmp.path().join("paths").join(added[0].path.base_name()));
    assert!(store.real_path(&added[0].path).exists());
    assert_eq!(store.state_dir(), tmp.path().join("state"));
    assert!(tmp.path().join("state/db/db.sqlite").is_file());
    assert!(tmp.path().join("state/gcroots").is_dir());
    assert!(!tmp.path().join("root").exists(), "nothing is under the root when state and real are elsewhere");
}

/// A path vouched for under one policy (`VouchedInfo`) is checked again at its commit under
/// another: an unsigned path vouched for without `require-sigs` is refused by a commit that
/// requires a trusted signature, and nothing is left at its location; under the policy that
/// vouched for it, the same path is added.
#[test]
fn a_vouched_path_is_checked_again_under_another_policy() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let (info, nar) = fixture("symlink-root.nar");
    assert!(info.sigs.is_empty() && info.ca.is_none(), "the fixture is unsigned and input-addressed");
    let key = sluice_nix::signature::SecretKey::from_seed("other-1", &[3; 32]).to_public().to_string();
    let strict = SignaturePolicy { require_sigs: true, trusted_keys: sluice_nix::signature::TrustedKeys::parse(&key).unwrap() };
    assert!(matches!(strict.vouch_info(&store_dir(), info.clone()), Err(LocalStoreError::Untrusted { .. })));
    let lax = SignaturePolicy::unchecked();
    for (commit_policy, admitted) in [(&strict, false), (&lax, true)] {
        let vouched = lax.vouch_info(&store_dir(), info.clone()).unwrap();
        let sluice_local_store::TryAdd::Pending(mut pending) = store.try_begin_add_vouched(vouched, &store.temp_roots()).unwrap() else {
            panic!("the path is not valid yet")
        };
        pending.unpack(&mut nar.as_slice()).unwrap();
        let result = pending.commit(commit_policy);
        assert_eq!(result.is_ok(), admitted, "{result:?}");
        if !admitted {
            assert!(matches!(result, Err(LocalStoreError::Untrusted { .. })), "{result:?}");
        }
        assert_eq!(store.is_valid_path(&info.path).unwrap(), admitted);
        assert_eq!(store.real_path(&info.path).symlink_metadata().is_ok(), admitted);
    }
}

/// A tree 1500 directories deep (as an untrusted client's channel tarball can make it) is
/// serialised on a thread with a daemon worker's stack (2 MiB) to the NAR Nix 2.8's
/// `nix-store --dump` gives. The recursive walk overflowed that stack and aborted the process.
#[test]
fn dump_of_a_deep_tree_is_nix_s_nar_on_a_worker_s_stack() {
    use std::os::fd::AsFd;
    let scratch = TempDir::new().unwrap();
    let root = scratch.path().join("deep");
    std::fs::create_dir(&root).unwrap();
    // Made by single names (`mkdirat`), as a path 1500 levels deep is near `PATH_MAX`.
    let mut dir = rustix::fs::open(&root, rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY, rustix::fs::Mode::empty()).unwrap();
    for _ in 0..1500 {
        rustix::fs::mkdirat(&dir, "a", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        dir = rustix::fs::openat(&dir, "a", rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::RDONLY, rustix::fs::Mode::empty()).unwrap();
    }
    let file = rustix::fs::openat(
        dir.as_fd(),
        "f",
        rustix::fs::OFlags::CREATE | rustix::fs::OFlags::WRONLY,
        rustix::fs::Mode::from_raw_mode(0o644),
    )
    .unwrap();
    rustix::io::write(&file, b"at the bottom\n").unwrap();
    let dumped = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn({
            let root = root.clone();
            move || {
                let mut nar = Vec::new();
                sluice_local_store::dump_fs_path(&root, &mut nar).unwrap();
                nar
            }
        })
        .unwrap()
        .join()
        .unwrap();
    let reference = nix_ok("nix-store", &["--dump", root.to_str().unwrap()], scratch.path());
    assert_eq!(dumped.len(), reference.len());
    assert!(dumped == reference, "the NAR of the deep tree differs from nix-store --dump's");
}

/// An input-addressed info for `base_name` with no references, honest about `nar`.
pub(crate) fn honest_info(base_name: &str, nar: &[u8]) -> ValidPathInfo {
    ValidPathInfo {
        path: StorePath::from_base_name(base_name).unwrap(),
        nar_hash: Hash::digest_bytes(HashAlgo::Sha256, nar),
        nar_size: nar.len() as u64,
        references: BTreeSet::new(),
        deriver: None,
        registration_time: 0,
        ultimate: false,
        sigs: BTreeSet::new(),
        ca: None,
    }
}

/// A tree of `levels` nested directories `a` with, at the bottom, a file named `name_len` bytes
/// (`l`…), and at the top a file, an executable, a symlink and an empty directory; its NAR.
pub(crate) fn deep_nar(at: &Path, levels: usize, name_len: usize) -> Vec<u8> {
    use rustix::fs::{mkdirat, openat, symlinkat, Mode, OFlags};
    std::fs::create_dir(at).unwrap();
    let mut dir = rustix::fs::open(at, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    for (name, mode) in [("f", 0o644), ("x", 0o755)] {
        let file = openat(&dir, name, OFlags::CREATE | OFlags::WRONLY, Mode::from_raw_mode(mode)).unwrap();
        rustix::io::write(&file, b"top\n").unwrap();
    }
    symlinkat("f", &dir, "s").unwrap();
    mkdirat(&dir, "e", Mode::from_raw_mode(0o755)).unwrap();
    for _ in 0..levels {
        mkdirat(&dir, "a", Mode::from_raw_mode(0o755)).unwrap();
        dir = openat(&dir, "a", OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    }
    let file = openat(&dir, "l".repeat(name_len).as_str(), OFlags::CREATE | OFlags::WRONLY, Mode::from_raw_mode(0o644)).unwrap();
    rustix::io::write(&file, b"bottom\n").unwrap();
    let mut nar = Vec::new();
    sluice_local_store::dump_fs_path(at, &mut nar).unwrap();
    nar
}

/// The length of the longest path below `path`'s root that fits in `PATH_MAX` in `store`
/// (`<store path>/a/…/a/lll…` of 4,095 bytes).
pub(crate) fn deepest_below(store: &LocalStore, path: &StorePath) -> usize {
    let in_store = store.real_path(path).as_os_str().len().max(shown(path).len());
    4096 - 2 - in_store
}

/// A store path is added only if Nix could make and read its tree where the store keeps it:
/// a NAR whose deepest file would have a path in the store of 4,096 bytes (`PATH_MAX` with the
/// final NUL) is refused with an error naming the limit, and nothing of it is left; one byte
/// shorter (about 2,000 nested directories, so the unpacker holds a directory every KiB of
/// path) is added, its tree dumps as the NAR and Nix 2.8 verifies the store. Nix's
/// `restorePath` names nodes by their full path: it fails on the first NAR with
/// "File name too long", as does its `--verify --check-contents` on a store holding such a
/// tree.
#[test]
fn a_nar_with_a_path_longer_than_path_max_allows_is_refused() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    for (base, extra) in [("0000000000000000000000000000d1iq-deep", 1), ("0000000000000000000000000000d1ip-deep", 0)] {
        let path = StorePath::from_base_name(base).unwrap();
        let below = deepest_below(&store, &path) + extra;
        let levels = (below - 100) / 2;
        let nar = deep_nar(&tmp.path().join(base), levels, below - 2 * levels);
        let info = honest_info(base, &nar);
        let added = add(&store, &info, &mut nar.as_slice());
        if extra == 0 {
            assert!(added.unwrap());
            assert!(dump(&store, &path) == nar, "the store's tree of the deep NAR dumps otherwise");
            let real = store.real_path(&path);
            assert_canonical(&real.join("f"));
            assert_canonical(&real.join("x"));
            assert_canonical(&real.join("e"));
            assert_eq!(std::fs::symlink_metadata(real.join("a/a/a")).unwrap().permissions().mode() & 0o7777, 0o555);
            assert_eq!(std::fs::symlink_metadata(real.join("s")).unwrap().mtime(), 1);
            continue;
        }
        let err = added.unwrap_err().to_string();
        let why = format!(
            "its path would be {} bytes below the tree's root, where {} fit in PATH_MAX (4096 bytes): Nix could neither make nor read it",
            below,
            below - 1
        );
        assert!(err.contains(&why) && !err.contains("I/O error"), "{err}");
        assert!(err.contains("/a/a/a/a/") && err.contains("…") && err.contains("lll"), "{err}");
        assert!(!store.is_valid_path(&path).unwrap());
        assert!(!store.real_path(&path).exists());
        assert_eq!(temp_dirs(&root), Vec::<PathBuf>::new(), "a directory of temporary trees was left");
    }
    verify_with_nix(&root, tmp.path());
}

/// Names another user made first in the store directory (a build user, in Nix's store
/// directory that group nixbld may write in), named like directories of temporary trees, one
/// of them writable by all and one locked by its maker, stop no addition: each addition's
/// directory is new (sluice once used one fixed name, and refused a directory there that it
/// did not own privately: "owned by uid 65534 with mode 0777", and nothing could be added).
/// The unlocked one is removed as a killed run's; the locked one is left to its maker.
#[test]
fn names_another_user_made_first_stop_no_addition() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let (info, nar) = fixture("varied-tree.nar");
    let foreign = root.join("nix/store/00000000000000000000000000000000-sluice-unpacking");
    let locked = root.join("nix/store/3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d-sluice-unpacking");
    for dir in [&foreign, &locked] {
        std::fs::create_dir(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(dir, Some(65534), Some(65534)).unwrap();
        }
    }
    let held = File::open(&locked).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::LockExclusive).unwrap();
    assert!(add(&store, &info, &mut nar.as_slice()).unwrap());
    assert!(dump(&store, &info.path) == nar);
    assert_eq!(
        store_entries(&root),
        BTreeSet::from([info.path.base_name().to_owned(), locked.file_name().unwrap().to_string_lossy().into_owned()])
    );
    drop(held);
}

/// With `auto-optimise-store`, the temporary link that replaces a file by its `.links` copy is
/// made in the store directory under a name nobody can take first: sluice named it
/// `.tmp-link-<pid>-<counter>`, and another user who made the next names first (a build user,
/// in Nix's store directory) failed every addition with "linking …: File exists".
#[test]
fn temporary_link_names_another_user_made_first_stop_no_optimised_addition() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    store.set_auto_optimise(true);
    let taken: Vec<PathBuf> = (0..2000).map(|n| root.join(format!("nix/store/.tmp-link-{}-{n}", std::process::id()))).collect();
    for name in &taken {
        File::create(name).unwrap();
    }
    let nar = regular_file_nar(b"the same contents in two paths", false);
    for base in ["6j6j6j6j6j6j6j6j6j6j6j6j6j6j6j6j-first", "7k7k7k7k7k7k7k7k7k7k7k7k7k7k7k7k-second"] {
        let info = honest_info(base, &nar);
        assert!(add(&store, &info, &mut nar.as_slice()).unwrap());
    }
    let first = std::fs::metadata(root.join("nix/store/6j6j6j6j6j6j6j6j6j6j6j6j6j6j6j6j-first")).unwrap();
    let second = std::fs::metadata(root.join("nix/store/7k7k7k7k7k7k7k7k7k7k7k7k7k7k7k7k-second")).unwrap();
    assert_eq!(first.ino(), second.ino(), "the second path's file is not linked to the first's");
    for name in &taken {
        std::fs::remove_file(name).unwrap();
    }
    assert_eq!(store_entries(&root).into_iter().filter(|e| e.starts_with('.')).collect::<Vec<_>>(), Vec::<String>::new());
}

/// The NAR of a store path read as it is dumped (`LocalStore::nar_dump`: what a push reads,
/// with no thread or pipe between) is Nix 2.8's `nix-store --dump` of the same tree, whatever
/// the size of the reads: files up to 64 KiB go out with their tokens, larger ones are
/// streamed (either side of the boundary, an odd size for the padding, an executable), and
/// symlinks, empty files and nested directories are there. A path that is not valid fails
/// before anything is read.
#[test]
fn nar_read_as_it_is_dumped_is_nix_s_nar() {
    let tmp = Scratch::new();
    let tree = tmp.path().join("tree");
    std::fs::create_dir_all(tree.join("a/b")).unwrap();
    let bytes = |n: usize| (0..n).map(|i| (i * 7 % 251) as u8).collect::<Vec<u8>>();
    for (name, size) in [("empty", 0), ("small", 100), ("edge", 65536), ("over", 65537), ("big", (3 << 20) + 3), ("a/b/deep", 10)] {
        std::fs::write(tree.join(name), bytes(size)).unwrap();
    }
    std::fs::set_permissions(tree.join("big"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("a/b", tree.join("link")).unwrap();
    let nar = nix_ok("nix-store", &["--dump", tree.to_str().unwrap()], tmp.path());

    let store = open_store(&tmp.path().join("root"));
    let info = honest_info("0c7dkrjr7zzqbk8b7ww6r7z4nr4z4ly0-dumped", &nar);
    assert!(add(&store, &info, &mut nar.as_slice()).unwrap());
    for chunk in [1, 7, 8, 4096, 65536, 1 << 20] {
        let mut reader = store.nar_dump(&info.path).unwrap();
        let (mut out, mut buf) = (Vec::new(), vec![0; chunk]);
        loop {
            match reader.read(&mut buf).unwrap() {
                0 => break,
                n => out.extend_from_slice(&buf[..n]),
            }
        }
        assert_eq!(out.len(), nar.len(), "reads of {chunk} bytes");
        assert!(out == nar, "reads of {chunk} bytes: the NAR differs from nix-store --dump's");
    }
    let absent = StorePath::from_base_name("00000000000000000000000000000000-absent").unwrap();
    assert!(matches!(store.nar_dump(&absent), Err(LocalStoreError::NotValid { .. })));
}

/// `vouch_all` gives each info the verdict `vouch` gives it alone, in order: the corpus's
/// signed paths, an unsigned `.drv` (vouched for by its content address) and an unsigned
/// input-addressed path (refused, naming its signers and the trusted keys); without
/// `require-sigs`, all are accepted. Once one signature no longer holds (a NarSize altered),
/// it answers `None`: which one, only `vouch` of each tells.
#[test]
fn vouching_together_gives_each_path_its_own_verdict() {
    let dir = store_dir();
    let read = |cache: &str| -> Vec<ValidPathInfo> {
        let mut files: Vec<_> = std::fs::read_dir(Path::new(CORPUS).join(cache))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "narinfo"))
            .collect();
        files.sort();
        files.iter().map(|p| ValidPathInfo::from_narinfo(&NarInfo::parse(&dir, &std::fs::read_to_string(p).unwrap()).unwrap(), 0)).collect()
    };
    let mut infos = read("cache-zstd");
    let mut drv = read("cache-drv").into_iter().find(|i| i.ca.is_some()).unwrap();
    drv.sigs.clear();
    let mut unsigned = infos[9].clone();
    unsigned.sigs.clear();
    infos.extend([drv, unsigned]);
    let key = std::fs::read_to_string(Path::new(CORPUS).join("keys/cache-key.pub")).unwrap();
    let strict = SignaturePolicy { require_sigs: true, trusted_keys: sluice_nix::signature::TrustedKeys::parse(&key).unwrap() };
    let verdicts = strict.vouch_all(&dir, infos.clone()).unwrap();
    assert_eq!(verdicts.len(), infos.len());
    let mut refused = Vec::new();
    for (i, (info, verdict)) in infos.iter().zip(&verdicts).enumerate() {
        let alone = strict.vouch(&dir, info);
        assert_eq!(
            verdict.as_ref().map(|v| v.info().path.clone()).map_err(|e| e.to_string()),
            alone.map(|_| info.path.clone()).map_err(|e| e.to_string()),
            "item {i}"
        );
        if verdict.is_err() {
            refused.push(i);
        }
    }
    assert_eq!(refused, [infos.len() - 1]);
    assert!(strict.vouch(&dir, &infos[infos.len() - 2]).is_ok_and(|v| v == sluice_local_store::Vouched::ContentAddressed));
    assert!(SignaturePolicy::unchecked().vouch_all(&dir, infos.clone()).unwrap().iter().all(|v| v.is_ok()));
    infos[3].nar_size += 1;
    assert!(strict.vouch_all(&dir, infos.clone()).is_none());
    assert!(strict.vouch(&dir, &infos[3]).is_err() && strict.vouch(&dir, &infos[4]).is_ok());
}
