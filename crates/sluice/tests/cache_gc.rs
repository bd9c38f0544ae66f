//! `sluice store gc` of `file://` and S3 caches: the closures kept stay whole for real Nix
//! 2.8, nothing else is left (no narinfo whose closure is incomplete, no NAR or listing no
//! narinfo names), `--dry-run` changes nothing, new files are kept, and a push racing the
//! collection leaves a consistent cache.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use crate::common::*;

/// A cache directory's narinfos by hash part: (store path, NAR file, references' hash parts).
fn narinfos(dir: &Path) -> BTreeMap<String, (String, String, Vec<String>)> {
    let hash = |p: &str| p.trim_start_matches("/nix/store/")[..32].to_string();
    cache_narinfos(dir).into_iter().map(|n| (n.hash, (n.store_path, n.url, n.references.iter().map(|r| hash(r)).collect()))).collect()
}

/// The hash parts of the closure of `hash` among `infos`.
fn closure(infos: &BTreeMap<String, (String, String, Vec<String>)>, hash: &str) -> BTreeSet<String> {
    let mut done = BTreeSet::new();
    let mut stack = vec![hash.to_string()];
    while let Some(h) = stack.pop() {
        if let Some(info) = infos.get(&h) {
            if done.insert(h) {
                stack.extend(info.2.iter().cloned());
            }
        }
    }
    done
}

/// Asserts that the cache directory is consistent: every narinfo's references have narinfos
/// and its NAR exists; with `no_orphan`, every NAR file and listing belongs to a narinfo too
/// (not so while a push runs: it uploads a NAR before its narinfo).
fn assert_consistent(dir: &Path, no_orphan: bool) {
    let infos = narinfos(dir);
    for (hash, (path, nar, refs)) in &infos {
        assert!(dir.join(nar).is_file(), "{path}: its NAR {nar} is gone");
        for r in refs {
            assert!(infos.contains_key(r), "{path} ({hash}): its reference {r} has no narinfo");
        }
    }
    if !no_orphan {
        return;
    }
    let named: BTreeSet<&String> = infos.values().map(|i| &i.1).collect();
    for entry in std::fs::read_dir(dir.join("nar")).unwrap() {
        let name = format!("nar/{}", entry.unwrap().file_name().to_string_lossy());
        assert!(named.contains(&name), "{name} is named by no narinfo");
    }
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if let Some(hash) = name.strip_suffix(".ls") {
            assert!(infos.contains_key(hash), "{name} belongs to no narinfo");
        }
    }
}

/// Makes every file under `dir` two hours old.
fn age(dir: &Path) {
    let o = Command::new("find").arg(dir).args(["-type", "f", "-exec", "touch", "-d", "2 hours ago", "{}", "+"]).output().unwrap();
    check(&o, "touch");
}

/// The root of the corpus's subset, and a corpus path outside it whose closure (of a few
/// paths) shares paths with the subset's.
fn two_roots() -> (String, String) {
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(corpus().join("truth/summary.json")).unwrap()).unwrap();
    let a = summary["subsetRoot"].as_str().unwrap().to_string();
    let subset = narinfos(&corpus().join("cache-subset-none"));
    let all = narinfos(&corpus().join("cache-xz"));
    let b = all
        .iter()
        .filter(|(h, _)| !subset.contains_key(*h))
        .map(|(h, i)| (closure(&all, h), i))
        .filter(|(c, _)| c.len() >= 3 && c.iter().any(|h| subset.contains_key(h)))
        .min_by_key(|(c, i)| (c.len(), i.0.clone()))
        .unwrap();
    (a, b.1 .0.clone())
}

/// The subset cache copied under `dir`, with the closure of `b` pushed in by sluice.
fn cache_of_two_closures(tmp: &Path, dir: &Path, b: &str) {
    copy_dir(&corpus().join("cache-subset-none"), dir);
    let from = format!("file://{}", corpus().join("cache-xz").display());
    let to = format!("file://{}?compression=none&write-nar-listing=true", dir.display());
    check(&sluice(tmp, &["copy", "--from", &from, "--to", &to, b]), "pushing a second closure");
}

#[test]
fn gc_keeps_the_kept_closures_whole_for_nix_and_leaves_no_orphan() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let (a, b) = two_roots();
    cache_of_two_closures(tmp.path(), &cache, &b);
    // Garbage a killed push or gc leaves: a NAR and a listing no narinfo names.
    std::fs::write(cache.join("nar/0000000000000000000000000000000000000000000000000000.nar"), b"x").unwrap();
    std::fs::write(cache.join("00000000000000000000000000000000.ls"), b"{}").unwrap();
    let url = format!("file://{}", cache.display());
    let before = narinfos(&cache);
    let hash = |p: &str| p.trim_start_matches("/nix/store/")[..32].to_string();
    let kept = closure(&before, &hash(&a));
    let gone: BTreeSet<String> = closure(&before, &hash(&b)).difference(&kept).cloned().collect();
    assert!(!gone.is_empty());

    // New files are kept, whatever keeps them.
    let o = sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep", &a]);
    check(&o, "gc of new files");
    assert_eq!(narinfos(&cache).len(), before.len(), "{}", stderr(&o));

    age(&cache);
    let listing = |dir: &Path| -> BTreeSet<String> {
        let o = Command::new("find").arg(dir).output().unwrap();
        String::from_utf8(o.stdout).unwrap().lines().map(str::to_owned).collect()
    };
    let files = listing(&cache);
    let o = sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep", &a, "--dry-run"]);
    check(&o, "gc --dry-run");
    assert_eq!(listing(&cache), files, "--dry-run deleted something");
    let would: BTreeSet<String> =
        String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| l.strip_prefix("would delete ")).map(str::to_owned).collect();
    for h in &gone {
        assert!(would.contains(&format!("{h}.narinfo")), "{h} would stay:\n{}", String::from_utf8_lossy(&o.stdout));
    }

    let o = sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep", &a]);
    check(&o, "gc");
    let after: BTreeSet<String> = narinfos(&cache).into_keys().collect();
    assert_eq!(after, kept, "{}", stderr(&o));
    assert_consistent(&cache, true);
    let store = tmp.path().join("nix-copied");
    let o = nix(
        tmp.path(),
        "nix",
        &["copy", "--from", &url, "--to", store.to_str().unwrap(), "--option", "trusted-public-keys", &corpus_key(), &a],
    );
    check(&o, "nix copy --from the collected cache");
    assert_nix_verifies(tmp.path(), &store);
}

#[test]
fn gc_of_an_s3_cache_with_a_size_limit_keeps_the_newest_closure_that_fits() {
    let tmp = tempfile::tempdir().unwrap();
    let bucket = tmp.path().join("s3/bucket");
    std::fs::create_dir_all(bucket.parent().unwrap()).unwrap();
    let (_, b) = two_roots();
    cache_of_two_closures(tmp.path(), &bucket, &b);
    age(&bucket);
    let server = S3Server::start(&tmp.path().join("s3"), false);
    let url = format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1", server.port);
    let before = narinfos(&bucket);
    let hash = |p: &str| p.trim_start_matches("/nix/store/")[..32].to_string();
    // The closure of b is the newest: with room for it only, it alone stays.
    let b_closure = closure(&before, &hash(&b));
    let newest = before.get(&hash(&b)).unwrap().1.clone();
    let nar_bytes: u64 = b_closure.iter().map(|h| std::fs::metadata(bucket.join(&before[h].1)).unwrap().len()).sum();
    let o = Command::new("touch").args(["-d", "30 minutes ago"]).arg(bucket.join(format!("{}.narinfo", hash(&b)))).output().unwrap();
    check(&o, "touch");
    let o = sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep-newer-than", "1m", "--max-size", &nar_bytes.to_string()]);
    check(&o, "gc --max-size");
    let after: BTreeSet<String> = narinfos(&bucket).into_keys().collect();
    assert_eq!(after, b_closure, "{}", stderr(&o));
    assert!(bucket.join(&newest).is_file());
    assert_consistent(&bucket, true);
}

/// A push into the cache while it is collected: the push's new narinfos and the NARs it
/// uploads before them are kept, the closure kept stays whole, and the cache ends consistent.
#[test]
fn a_gc_and_a_push_racing_leave_a_consistent_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let (a, b) = two_roots();
    copy_dir(&corpus().join("cache-subset-none"), &cache);
    age(&cache);
    let url = format!("file://{}", cache.display());
    let from = format!("file://{}", corpus().join("cache-xz").display());
    let mut push = Command::new(env!("CARGO_BIN_EXE_sluice"));
    isolate(&mut push, tmp.path(), "");
    let push = push.args(["copy", "--from", &from, "--to", &format!("{url}?compression=none"), &b]).spawn().unwrap();
    for _ in 0..5 {
        check(&sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep", &a]), "gc while a push runs");
        assert_consistent(&cache, false);
    }
    let status = push.wait_with_output().unwrap();
    check(&status, "the push");
    check(&sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep", &a]), "gc after the push");
    assert_consistent(&cache, true);
    let infos = narinfos(&cache);
    let hash = |p: &str| p.trim_start_matches("/nix/store/")[..32].to_string();
    assert!(closure(&infos, &hash(&b)).contains(&hash(&b)), "the push's paths were collected");
}

/// A narinfo of `dir` that is there while a reference's narinfo or its NAR is not, looked at
/// twice (the referrer is read again after its reference was found missing: a collection
/// deletes referrers first, so one seen before it went is no fault); narinfos still being
/// written (not ending in a newline) are passed over.
fn broken_now(dir: &Path) -> Option<String> {
    let names: Vec<String> = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    for name in names.iter().filter(|n| n.ends_with(".narinfo")) {
        let Ok(text) = std::fs::read_to_string(dir.join(name)) else { continue };
        if !text.ends_with('\n') {
            continue;
        }
        let field = |f: &str| text.lines().find_map(|l| l.strip_prefix(f)).unwrap_or("").to_string();
        let mut wanted: Vec<String> = field("References: ").split_whitespace().map(|r| format!("{}.narinfo", &r[..32])).collect();
        wanted.push(field("URL: "));
        for missing in wanted.iter().filter(|w| !dir.join(w).exists()) {
            if dir.join(name).exists() && !dir.join(missing).exists() {
                return Some(format!("{name} is there, {missing} is not"));
            }
        }
    }
    None
}

/// A corpus path with a closure of 50 to 300 paths, and the corpus's cache without that
/// path's narinfo and its referrers': a push of it skips all but one path, and publishes a
/// narinfo referring to them.
fn cache_lacking_a_top(dir: &Path) -> String {
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    copy_dir(&corpus().join("cache-xz"), dir);
    let all = narinfos(dir);
    let (hash, top) = all
        .iter()
        .map(|(h, i)| (h, &i.0, closure(&all, h).len()))
        .filter(|(_, _, n)| (50..=300).contains(n))
        .max_by_key(|(h, _, n)| (*n, (*h).clone()))
        .map(|(h, p, _)| (h.clone(), p.clone()))
        .unwrap();
    for referrer in all.keys().filter(|h| closure(&all, h).contains(&hash)) {
        std::fs::remove_file(dir.join(format!("{referrer}.narinfo"))).unwrap();
    }
    age(dir);
    top
}

/// A push and a collection that keeps nothing (`--keep-newer-than 0s`) started together, at
/// staggered offsets, again and again, into a `file://` cache and an s3s-fs bucket: while both
/// run, the cache is consistent whenever it is looked at (a watcher reads it without pause),
/// the push succeeds, the cache ends consistent, and real Nix 2.8 copies the pushed closure
/// whenever its root is still there. Without the fence, the collection deleted paths the push
/// had found there, under the narinfo the push then published.
#[test]
fn a_gc_and_a_push_racing_leave_a_consistent_cache_at_every_moment() {
    let tmp = tempfile::tempdir().unwrap();
    let from = format!("file://{}", corpus().join("cache-xz").display());
    let mut copied = 0;
    for round in 0..12 {
        let s3 = round % 2 == 1;
        let dir = tmp.path().join(format!("s3-{round}"));
        let cache = dir.join("bucket");
        let top = cache_lacking_a_top(&cache);
        let server = s3.then(|| S3Server::start(&dir, false));
        let url = match &server {
            Some(server) => format!("s3://bucket?endpoint=http://127.0.0.1:{}&region=eu-west-1", server.port),
            None => format!("file://{}", cache.display()),
        };
        let done = std::sync::atomic::AtomicBool::new(false);
        let (push, gc, broken) = std::thread::scope(|scope| {
            let watcher = scope.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Some(fault) = broken_now(&cache) {
                        return Some(fault);
                    }
                }
                None
            });
            let mut push = Command::new(env!("CARGO_BIN_EXE_sluice"));
            isolate(&mut push, tmp.path(), "");
            let push = push.args(["copy", "--from", &from, "--to", &url, &top]).stderr(std::process::Stdio::piped()).spawn().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(15 * (round / 2) as u64));
            let gc = sluice(tmp.path(), &["store", "gc", "--store", &url, "--keep-newer-than", "0s"]);
            let push = push.wait_with_output().unwrap();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            (push, gc, watcher.join().unwrap())
        });
        check(&push, &format!("round {round}: the push"));
        check(&gc, &format!("round {round}: the gc"));
        assert_eq!(broken, None, "round {round} ({url}): the cache was inconsistent while the push and the gc ran\n{}", stderr(&gc));
        assert_consistent(&cache, false);
        let hash = |p: &str| p.trim_start_matches("/nix/store/")[..32].to_string();
        if cache.join(format!("{}.narinfo", hash(&top))).exists() {
            let store = tmp.path().join(format!("nix-copied-{round}"));
            let files = format!("file://{}", cache.display());
            let o = nix(
                tmp.path(),
                "nix",
                &["copy", "--from", &files, "--to", store.to_str().unwrap(), "--option", "trusted-public-keys", &corpus_key(), &top],
            );
            check(&o, &format!("round {round}: nix copy of the pushed closure"));
            copied += 1;
        }
    }
    assert!(copied > 0, "no round left the pushed closure for Nix to copy");
}
