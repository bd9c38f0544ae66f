//! `sluice store verify` and `sluice store sign`: a copy of the corpus's 25-path subset cache
//! broken in every way a cache breaks (a NAR deleted, truncated, a byte flipped at the same
//! size, emptied; a reference's narinfo deleted; a signature removed; an unsigned narinfo
//! added), on `file://`, HTTP (nginx reading, s3s-fs taking PUT and DELETE) and s3s-fs: verify
//! names exactly the broken paths, `--repair --from` mends them, and real Nix 2.8 then copies
//! the closure. A local store with a modified path is found and repaired by substitution.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::common::*;

/// The subset's root.
fn subset_root() -> String {
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    summary["subsetRoot"].as_str().unwrap().to_string()
}

/// A cache's narinfos by store path: (hash part, NAR file, references other than itself).
fn narinfos(dir: &Path) -> BTreeMap<String, (String, String, Vec<String>)> {
    cache_narinfos(dir).into_iter().map(|n| (n.store_path, (n.hash, n.url, n.references))).collect()
}

/// How [`break_cache`] broke a cache.
struct Broken {
    /// Paths of the root's closure that verify must name, with contents checked.
    bad: BTreeSet<String>,
    /// The one of them only a check of the contents finds (a byte flipped at the same size).
    flipped: String,
    /// The unsigned narinfo added, of a path outside the root's closure.
    unsigned: String,
}

/// Breaks the cache directory `dir` (a copy of the subset cache) in every way, each on its own
/// path.
fn break_cache(dir: &Path, root: &str) -> Broken {
    let infos = narinfos(dir);
    // The reference whose narinfo goes: the one with the most referrers, other than the root.
    let referrers =
        |p: &str| -> BTreeSet<String> { infos.iter().filter(|(_, i)| i.2.iter().any(|r| r == p)).map(|(q, _)| q.clone()).collect() };
    let gone = infos.keys().filter(|p| *p != root).max_by_key(|p| referrers(p).len()).unwrap().clone();
    // The others, among the paths the root still reaches without it (a walk of the closure
    // from the root cannot see past the missing narinfo).
    let mut reached = BTreeSet::new();
    let mut stack = vec![root.to_string()];
    while let Some(p) = stack.pop() {
        if p != gone && reached.insert(p.clone()) {
            stack.extend(infos[&p].2.iter().cloned());
        }
    }
    let mut others = reached.iter().filter(|p| *p != root && !referrers(&gone).contains(*p));
    let mut next = || others.next().unwrap().clone();
    let (deleted, truncated, flipped, emptied, unsigned_sig) = (next(), next(), next(), next(), next());
    let file = |p: &str| dir.join(&infos[p].1);
    std::fs::remove_file(dir.join(format!("{}.narinfo", infos[&gone].0))).unwrap();
    std::fs::remove_file(file(&deleted)).unwrap();
    let bytes = std::fs::read(file(&truncated)).unwrap();
    std::fs::write(file(&truncated), &bytes[..bytes.len() / 2]).unwrap();
    let mut bytes = std::fs::read(file(&flipped)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(file(&flipped), &bytes).unwrap();
    std::fs::write(file(&emptied), b"").unwrap();
    let narinfo = dir.join(format!("{}.narinfo", infos[&unsigned_sig].0));
    let text = std::fs::read_to_string(&narinfo).unwrap();
    std::fs::write(&narinfo, text.lines().filter(|l| !l.starts_with("Sig: ")).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    // An unsigned narinfo (and its NAR) of a corpus path outside the subset with no references.
    let xz = corpus().join("cache-xz");
    let all = narinfos(&xz);
    let (unsigned, (hash, nar, _)) = all.iter().find(|(p, i)| i.2.is_empty() && !infos.contains_key(*p)).unwrap();
    let text = std::fs::read_to_string(xz.join(format!("{hash}.narinfo"))).unwrap();
    std::fs::write(
        dir.join(format!("{hash}.narinfo")),
        text.lines().filter(|l| !l.starts_with("Sig: ")).map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    std::fs::copy(xz.join(nar), dir.join(nar)).unwrap();
    let mut bad: BTreeSet<String> = [deleted, truncated, flipped.clone(), emptied, unsigned_sig].into();
    bad.extend(referrers(&gone));
    Broken { bad, flipped, unsigned: unsigned.clone() }
}

/// The paths `sluice store verify` named on standard output (one line each).
fn named(o: &std::process::Output) -> BTreeSet<String> {
    String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| l.split(": ").next()).map(str::to_owned).collect()
}

/// `sluice store verify --store URL` with the corpus key trusted and `args`.
fn verify(tmp: &Path, url: &str, args: &[&str]) -> std::process::Output {
    let key = corpus_key();
    let mut all = vec!["store", "verify", "--store", url, "--trusted-public-keys", &key];
    all.extend(args);
    sluice(tmp, &all)
}

/// Real Nix 2.8 copies the root's closure from `url` into a new chroot store, trusting only the
/// corpus key, and finds the store clean.
fn assert_nix_copies(tmp: &Path, url: &str, root: &str) {
    let store = tmp.join("nix-copied");
    let o =
        nix(tmp, "nix", &["copy", "--from", url, "--to", store.to_str().unwrap(), "--option", "trusted-public-keys", &corpus_key(), root]);
    check(&o, "nix copy --from the repaired cache");
    assert_nix_verifies(tmp, &store);
}

/// A broken copy of the subset cache under `dir`, with its breakages.
fn broken_subset_cache(dir: &Path) -> (String, Broken) {
    let root = subset_root();
    copy_dir(&corpus().join("cache-subset-none"), dir);
    let broken = break_cache(dir, &root);
    (root, broken)
}

#[test]
fn a_file_cache_broken_every_way_is_named_exactly_and_repaired() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let (root, broken) = broken_subset_cache(&cache);
    let url = format!("file://{}", cache.display());

    let o = verify(tmp.path(), &url, &["--check-contents", "-r", &root]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(named(&o), broken.bad, "{}", String::from_utf8_lossy(&o.stdout));
    // Without the contents, all but the flipped byte.
    let o = verify(tmp.path(), &url, &["-r", &root]);
    let mut sized = broken.bad.clone();
    sized.remove(&broken.flipped);
    assert_eq!(named(&o), sized, "{}", String::from_utf8_lossy(&o.stdout));
    // --all lists the directory: the unsigned narinfo too; --no-trust passes it.
    let o = verify(tmp.path(), &url, &["--check-contents", "--all"]);
    let mut every = broken.bad.clone();
    every.insert(broken.unsigned.clone());
    assert_eq!(named(&o), every, "{}", String::from_utf8_lossy(&o.stdout));
    assert!(!named(&verify(tmp.path(), &url, &["--no-trust", &broken.unsigned])).contains(&broken.unsigned));

    let from = format!("file://{}", corpus().join("cache-xz").display());
    let o = verify(tmp.path(), &url, &["--check-contents", "--all", "--repair", "--from", &from]);
    check(&o, "verify --repair");
    check(&verify(tmp.path(), &url, &["--check-contents", "--all"]), "verify after the repair");
    assert_nix_copies(tmp.path(), &url, &root);
}

#[test]
fn an_s3_cache_broken_every_way_is_named_exactly_and_repaired() {
    let tmp = tempfile::tempdir().unwrap();
    let bucket = tmp.path().join("s3/bucket");
    std::fs::create_dir_all(bucket.parent().unwrap()).unwrap();
    let (root, broken) = broken_subset_cache(&bucket);
    let server = S3Server::start(&tmp.path().join("s3"), false);
    let url = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1", server.port);

    let o = verify(tmp.path(), &url, &["--check-contents", "--all"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let mut every = broken.bad.clone();
    every.insert(broken.unsigned.clone());
    assert_eq!(named(&o), every, "{}", String::from_utf8_lossy(&o.stdout));

    let from = format!("file://{}", corpus().join("cache-xz").display());
    check(&verify(tmp.path(), &url, &["--check-contents", "--all", "--repair", "--from", &from]), "verify --repair");
    check(&verify(tmp.path(), &url, &["--check-contents", "--all"]), "verify after the repair");
    assert_nix_copies(tmp.path(), &format!("file://{}", bucket.display()), &root);
}

#[test]
fn an_http_cache_broken_every_way_is_named_exactly_and_repaired() {
    let tmp = tempfile::tempdir().unwrap();
    let bucket = tmp.path().join("s3/bucket");
    std::fs::create_dir_all(bucket.parent().unwrap()).unwrap();
    let (root, broken) = broken_subset_cache(&bucket);
    // nginx reads it; s3s-fs, without credentials, also takes PUT and DELETE.
    let nginx = CacheServer::start(&bucket, &tmp.path().join("srv"), &[]);
    let o = verify(tmp.path(), &nginx.url, &["--check-contents", "-r", &root]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(named(&o), broken.bad, "{}", String::from_utf8_lossy(&o.stdout));
    let o = verify(tmp.path(), &nginx.url, &["--all"]);
    assert!(!o.status.success() && stderr(&o).contains("cannot be listed"), "{}", stderr(&o));

    let server = S3Server::start(&tmp.path().join("s3"), false);
    let url = format!("http://127.0.0.1:{}/bucket", server.port);
    let from = format!("file://{}", corpus().join("cache-xz").display());
    check(&verify(tmp.path(), &url, &["--check-contents", "-r", &root, "--repair", "--from", &from]), "verify --repair");
    check(&verify(tmp.path(), &nginx.url, &["--check-contents", "-r", &root]), "verify after the repair");
    assert_nix_copies(tmp.path(), &nginx.url, &root);
}

/// A local store whose path was modified: `--all --check-contents` is `nix-store --verify
/// --check-contents`, the paths' check names it, and `--repair` substitutes it again.
#[test]
fn a_modified_local_path_is_named_and_substituted_again() {
    let tmp = tempfile::tempdir().unwrap();
    let root = subset_root();
    let store = tmp.path().join("store");
    let subset = format!("file://{}", corpus().join("cache-subset-none").display());
    check(&copy_with(tmp.path(), &store, &subset, &corpus_key(), &[], &[&root]), "filling the store");
    let victim = modify_a_file_of_another_path(&store, &root);
    let url = store.to_str().unwrap();
    let o = verify(tmp.path(), url, &["--check-contents", "-r", &root]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(named(&o), BTreeSet::from([victim.clone()]), "{}", String::from_utf8_lossy(&o.stdout));
    let o = verify(tmp.path(), url, &["--check-contents", "--all"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("path '{victim}' was modified!")), "{}", stderr(&o));
    check(&verify(tmp.path(), url, &["--check-contents", "--all", "--repair", "--from", &subset]), "verify --repair");
    assert_nix_verifies(tmp.path(), &store);
}

/// A path modified in the store behind `sluice daemon` (`unix://`): the paths' check through
/// the daemon names it, and only it.
#[test]
fn a_modified_path_behind_a_daemon_is_named() {
    let env = crate::daemon::Env::new();
    let cache = env.cache();
    let daemon = env.daemon("root", &cache, "");
    let (root, key) = (subset_root(), corpus_key());
    env.nix("nix", &["copy", "--from", &cache, "--to", &daemon.url, "--option", "trusted-public-keys", &key, &root]);
    let store = env.path("root");
    let victim = modify_a_file_of_another_path(&store, &root);
    let verify = |args: &[&str]| {
        let mut cmd = env.cmd(crate::daemon::sluice());
        cmd.args(["store", "verify", "--store", &daemon.url, "--trusted-public-keys", &key]).args(args).output().unwrap()
    };
    let o = verify(&["--check-contents", "-r", &root]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(named(&o), BTreeSet::from([victim]), "{}", String::from_utf8_lossy(&o.stdout));
    check(&verify(&["-r", &root]), "verify without the contents");
}

/// Changes a byte of the first file of a path of the subset other than `root` in the chroot
/// store `store`; that path.
fn modify_a_file_of_another_path(store: &Path, root: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let infos = narinfos(&corpus().join("cache-subset-none"));
    let under = |p: &str| store.join(p.trim_start_matches('/'));
    let victim = infos.keys().filter(|p| *p != root).find(|p| regular_file(&under(p)).is_some()).unwrap().clone();
    let file = regular_file(&under(&victim)).unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[0] ^= 0x20;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&file, &bytes).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444)).unwrap();
    victim
}

/// The first regular file under `path` (itself if it is one).
fn regular_file(path: &Path) -> Option<PathBuf> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    if meta.is_file() && meta.len() > 0 {
        return Some(path.to_path_buf());
    }
    if !meta.is_dir() {
        return None;
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path).ok()?.map(|e| e.unwrap().path()).collect();
    entries.sort();
    entries.iter().find_map(|e| regular_file(e))
}

/// A path no trusted key signed is "untrusted", in `nix store verify`'s words, naming who signed
/// it and whom the policy trusts; nothing is being added, so the message does not say "cannot
/// add path" (it did: the verification boundary's words for a copy).
#[test]
fn an_unsigned_path_is_named_untrusted() {
    let tmp = tempfile::tempdir().unwrap();
    let root = subset_root();
    let url = format!("file://{}", corpus().join("cache-subset-none").display());
    let other = "other-key-1:q5O2GFmQEvyTT7b2+X7ihXx+oq5tQ5KSmD43rUlO+8g=";
    let o = sluice(tmp.path(), &["store", "verify", "--store", &url, "--trusted-public-keys", other, &root]);
    let signer = corpus_key().split(':').next().unwrap().to_owned();
    let expected = format!("{root}: path '{root}' is untrusted (signed by: {signer}; trusted: other-key-1)");
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().next(), Some(expected.as_str()), "{}", stderr(&o));
}

/// `sluice store sign` adds a second key's signature to every narinfo of a cache (a key
/// rotation), once: real Nix then copies the closure trusting only the new key.
#[test]
fn signing_a_cache_with_a_new_key_lets_nix_trust_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = subset_root();
    let cache = tmp.path().join("cache");
    copy_dir(&corpus().join("cache-subset-none"), &cache);
    let secret = sluice(tmp.path(), &["key", "generate", "sluice-sign-test-1"]);
    check(&secret, "key generate");
    let key_file = tmp.path().join("secret.key");
    std::fs::write(&key_file, &secret.stdout).unwrap();
    let public = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["key", "generate", "--public"])
        .stdin(std::fs::File::open(&key_file).unwrap())
        .output()
        .unwrap();
    let public = String::from_utf8(public.stdout).unwrap().trim().to_string();
    let url = format!("file://{}", cache.display());
    let sign = |args: &[&str]| {
        let mut all = vec!["store", "sign", "--store", &url, "--key-file", key_file.to_str().unwrap()];
        all.extend(args);
        sluice(tmp.path(), &all)
    };
    let o = sign(&["-r", &root]);
    check(&o, "store sign -r");
    assert!(stderr(&o).contains("added 25 signatures"), "{}", stderr(&o));
    let o = sign(&["--all"]);
    assert!(stderr(&o).contains("added 0 signatures"), "{}", stderr(&o));
    let store = tmp.path().join("nix-copied");
    let o = nix(
        tmp.path(),
        "nix",
        &["copy", "--from", &url, "--to", store.to_str().unwrap(), "--option", "trusted-public-keys", &public, &root],
    );
    check(&o, "nix copy trusting only the new key");
    // The old signatures are kept.
    check(&verify(tmp.path(), &url, &["--all"]), "verify with the corpus key");
}

/// `--all --check-contents` of a local store makes, per node of the trees it hashes, the
/// system calls Nix's `dumpPath` makes and no more: one `openat` per directory and file (no
/// second open of each directory to read it, with the `fcntl` that goes with it), no `fstat`
/// of an opened file (its `lstat` said its size), and the registrations read in one
/// transaction, not with two locking queries per path. Counted with `strace -f -c`.
#[test]
fn a_local_verify_opens_each_node_once_and_locks_the_database_once() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let cache = format!("file://{}", corpus().join("cache-xz").display());
    check(&copy_with(tmp.path(), &store, &cache, &corpus_key(), &[], &[TOP]), "filling the store");
    let (mut dirs, mut files, mut paths) = (0, 0, 0);
    for entry in std::fs::read_dir(store.join("nix/store")).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        paths += 1;
        let o = std::process::Command::new("find")
            .arg(entry.path())
            .args(["-type", "d", "-printf", "d\n", "-o", "-type", "f", "-printf", "f\n"])
            .output()
            .unwrap();
        let text = String::from_utf8(o.stdout).unwrap();
        dirs += text.lines().filter(|l| *l == "d").count();
        files += text.lines().filter(|l| *l == "f").count();
    }
    assert!(paths > 1000 && dirs > 1000, "{paths} paths, {dirs} directories");
    let trace = tmp.path().join("strace");
    let mut cmd = std::process::Command::new("strace");
    isolate(&mut cmd, tmp.path(), "");
    cmd.args(["-f", "-o", trace.to_str().unwrap(), "-e", "trace=openat,fcntl,statx,fstat", env!("CARGO_BIN_EXE_sluice")]);
    let o = cmd
        .args(["store", "verify", "--store", store.to_str().unwrap(), "--all", "--check-contents"])
        .output()
        .expect("strace runs (CI installs it)");
    check(&o, "verify --all --check-contents under strace");
    let trace = std::fs::read_to_string(&trace).unwrap();
    // Calls, not their resumptions; a debug build's descriptor checks (F_GETFD) are no locks.
    let calls = |what: &str| trace.lines().filter(|l| l.contains(what) && !l.contains("resumed>")).count();
    let (opens, fcntls, fstats) = (calls(" openat("), calls("F_SETLK"), calls(" statx(") + calls(" fstat("));
    let table = format!("{opens} openat, {fcntls} fcntl locks, {fstats} fstat");
    assert!(opens >= dirs + files && opens <= dirs + files + 200, "{opens} openat for {dirs} directories and {files} files\n{table}");
    assert!(fcntls <= 200, "{fcntls} fcntl locks for {paths} paths\n{table}");
    assert!(fstats <= 200, "{fstats} fstat/statx for {files} files\n{table}");
}

/// A `Compression: none` NAR file is the NAR itself, hashed once for its FileHash and its
/// NarHash: a wrong FileHash is named as FileHash alone, and a wrong NarHash (signature not
/// checked) as NarHash alone.
#[test]
fn an_uncompressed_nar_with_one_wrong_hash_is_named_by_that_field() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    copy_dir(&corpus().join("cache-subset-none"), &cache);
    let url = format!("file://{}", cache.display());
    let root = subset_root();
    let narinfo = cache.join(format!("{}.narinfo", narinfos(&cache)[&root].0));
    let text = std::fs::read_to_string(&narinfo).unwrap();
    let wrong = format!("sha256:{}", "0".repeat(52));
    for (field, other) in [("FileHash", "NarHash"), ("NarHash", "FileHash")] {
        let prefix = format!("{field}: ");
        let lines = text.lines().map(|l| if l.starts_with(&prefix) { format!("{prefix}{wrong}\n") } else { format!("{l}\n") });
        std::fs::write(&narinfo, lines.collect::<String>()).unwrap();
        let o = verify(tmp.path(), &url, &["--check-contents", "--no-trust", &root]);
        assert_eq!(o.status.code(), Some(1), "{field}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(out.lines().count(), 1, "{field}: {out}");
        assert!(out.starts_with(&format!("{root}: ")) && out.contains(&format!("not the narinfo's {field} {wrong}")), "{out}");
        assert!(!out.contains(other), "{field} alone: {out}");
    }
}

/// Bytes of each generated path of [`big_zstd_cache`]: three of sluice's 16 MiB zstd frames,
/// the last one short.
const BIG: usize = 40 << 20;

/// The peak RSS (KiB) a verify of [`big_zstd_cache`]'s four paths must stay under.
const MAX_VERIFY_RSS_KIB: u64 = 100 * 1024;

/// A `file://` zstd cache written by `sluice copy` (frames of 16 MiB) under `tmp`, of `n`
/// paths of [`BIG`] bytes added by real Nix, each random blocks between runs of zeros as
/// `bench/make-big-cache` makes them: the cache's directory and the paths.
fn big_zstd_cache(tmp: &Path, n: u64) -> (PathBuf, Vec<String>) {
    let src = tmp.join("src");
    let paths: Vec<String> = (1..=n)
        .map(|seed| {
            let file = tmp.join(format!("blob-{seed}"));
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let bytes: Vec<u8> = (0..BIG)
                .map(|i| match i % (64 << 10) < (40 << 10) {
                    true => {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x as u8
                    }
                    false => 0,
                })
                .collect();
            std::fs::write(&file, bytes).unwrap();
            let o = nix(tmp, "nix-store", &["--store", src.to_str().unwrap(), "--add", file.to_str().unwrap()]);
            check(&o, "nix-store --add");
            std::fs::remove_file(&file).unwrap();
            String::from_utf8(o.stdout).unwrap().trim().to_string()
        })
        .collect();
    let cache = tmp.join("cache");
    let mut args = vec!["copy", "--from", src.to_str().unwrap()];
    let to = format!("file://{}?compression=zstd", cache.display());
    args.extend(["--to", &to]);
    args.extend(paths.iter().map(String::as_str));
    check(&sluice(tmp, &args), "sluice copy into the zstd cache");
    (cache, paths)
}

/// Big NARs in 16 MiB zstd frames are checked in bounded memory (each decompressed as one
/// stream into pieces hashed on a thread of its own: frames decoded whole, 16 MiB buffers per
/// NAR and per helper, peaked at 221 MiB here and at 428 MiB for 16 NARs of 64 MiB), and a
/// byte flipped or a cut inside a later frame is named with the field that no longer holds.
#[test]
fn big_multi_frame_nars_are_checked_in_bounded_memory_and_broken_ones_named() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache, paths) = big_zstd_cache(tmp.path(), 4);
    let url = format!("file://{}", cache.display());
    let rss = tmp.path().join("rss");
    let mut cmd = sluice_measured(tmp.path(), &rss);
    cmd.args(["store", "verify", "--store", &url, "--no-trust", "--check-contents"]).args(&paths);
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(0), "verify of the intact cache: {}", stderr(&o));
    let rss_kib = measured_rss(&rss);
    eprintln!("verify of 4 NARs of 40 MiB: peak RSS {} MiB", rss_kib / 1024);
    assert!(rss_kib < MAX_VERIFY_RSS_KIB, "peak RSS {rss_kib} KiB (limit {MAX_VERIFY_RSS_KIB} KiB)");

    let infos = narinfos(&cache);
    let file = |p: &str| cache.join(&infos[p].1);
    let (flipped, cut) = (&paths[0], &paths[1]);
    let mut bytes = std::fs::read(file(flipped)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(file(flipped), &bytes).unwrap();
    let bytes = std::fs::read(file(cut)).unwrap();
    let kept = bytes.len() * 3 / 4;
    std::fs::write(file(cut), &bytes[..kept]).unwrap();
    let o = verify(tmp.path(), &url, &["--no-trust", "--check-contents", flipped, cut, &paths[2]]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert_eq!(named(&o), [flipped.clone(), cut.clone()].into(), "{out}");
    let line = |p: &str| out.lines().find(|l| l.starts_with(&format!("{p}: "))).unwrap().to_string();
    let narinfo = |p: &str, field: &str| {
        let text = std::fs::read_to_string(cache.join(format!("{}.narinfo", infos[p].0))).unwrap();
        text.lines().find_map(|l| l.strip_prefix(field)).unwrap().to_string()
    };
    let flipped_line = line(flipped);
    assert!(flipped_line.contains(&format!("not the narinfo's FileHash {}", narinfo(flipped, "FileHash: "))), "{flipped_line}");
    assert!(flipped_line.contains("does not decompress (zstd)") || flipped_line.contains("not the narinfo's NarHash"), "{flipped_line}");
    let cut_line = line(cut);
    assert!(cut_line.contains(&format!("is {kept} bytes, not the narinfo's FileSize {}", bytes.len())), "{cut_line}");
    assert!(cut_line.contains("does not decompress (zstd)"), "{cut_line}");
}
