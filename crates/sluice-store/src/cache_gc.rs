//! Garbage collection of a binary cache (`sluice store gc`; Nix has none). A `file://` or S3
//! cache is listed; the closures of the paths to keep, of every narinfo written less than
//! `keep_newer_than` ago and, with a size limit, of the newest other narinfos while their NAR
//! files fit, are kept; then, behind the fence of `sluice_binary_cache::fence` (the
//! collection's `.running` file written, then the pushes' files read), the closures of the
//! pushes in progress and of the narinfos written since the listing (pushes that ended
//! meanwhile) are kept too. The rest is deleted in an order that leaves the cache consistent
//! at every moment, and so after a collection killed at any point:
//!
//! 1. narinfos, referrers before references: a narinfo is deleted only once every narinfo
//!    that refers to it was (the paths kept are closed under references, so none of them
//!    refers to one deleted); those that wait for none go at once. No push publishes a
//!    narinfo referring to one of them meanwhile: one that began before the fence is kept
//!    with its closure, one that begins after waits for the collection to end;
//! 2. unless a push is in progress (it may publish a narinfo naming a NAR file it found or
//!    uploaded before), NAR files and `<hash>.ls` listings that no narinfo names, and that are
//!    older than `keep_newer_than` (a writer other than sluice uploads a NAR before its
//!    narinfo).
//!
//! A narinfo that does not parse names nothing, and goes unless it is new or kept. Writers
//! other than sluice (`nix copy`) know no fence: `keep_newer_than` is what protects what they
//! write, and a narinfo they publish referring to an old path that the collection deletes in
//! the same moment can be left incomplete.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use futures::stream::{self, StreamExt};
use sluice_binary_cache::fence::Collection;
use sluice_binary_cache::objects::Object;
use sluice_binary_cache::{BinaryCache, CacheError};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::store_path::{StorePath, HASH_PART_LEN};

/// What to keep, and whether to delete.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Paths whose closures are kept.
    pub keep: Vec<StorePath>,
    /// Narinfos written less than this long ago are kept, with their closures (and NAR files
    /// this new are kept whatever names them).
    pub keep_newer_than: Duration,
    /// With this many bytes of NAR files, the newest closures that fit are kept too.
    pub max_size: Option<u64>,
    /// Only say what would be deleted.
    pub dry_run: bool,
}

/// What a collection did (or, dry, would do).
#[derive(Debug, Default)]
pub struct GcReport {
    /// Narinfos kept.
    pub kept: usize,
    /// Bytes of NAR files kept.
    pub kept_bytes: u64,
    /// Cache files deleted (or to delete), in the order they were: narinfos, then NARs and
    /// listings.
    pub deleted: Vec<String>,
    /// Bytes of the files deleted.
    pub freed: u64,
    /// Whether a push was in progress (its closure was kept, and no NAR file was deleted).
    pub pushes_in_progress: bool,
    /// Requests made to the cache (listing pages count one each on S3).
    pub requests: usize,
}

/// A narinfo of the cache, as far as the collection needs it.
struct Entry {
    modified: SystemTime,
    /// `None` when it does not parse.
    narinfo: Option<NarInfo>,
}

/// Collects `cache` (see the module documentation).
pub async fn collect(cache: &BinaryCache, opts: &GcOptions) -> Result<GcReport, CacheError> {
    let requests = AtomicUsize::new(0);
    let started = SystemTime::now();
    let new_since = started.checked_sub(opts.keep_newer_than).unwrap_or(SystemTime::UNIX_EPOCH);
    let objects = cache.list_objects().await?;
    requests.fetch_add(1, Ordering::Relaxed);
    let sizes: HashMap<&str, u64> = objects.iter().map(|o| (o.name.as_str(), o.size)).collect();
    let mut entries = read_narinfos(cache, narinfos_of(&objects), &requests).await?;

    // The paths kept: roots, then their closures.
    let mut live: BTreeSet<String> = BTreeSet::new();
    let roots = opts.keep.iter().map(|p| p.hash_part().to_owned());
    let new = entries.iter().filter(|(_, e)| e.modified >= new_since).map(|(h, _)| h.clone());
    for root in roots.chain(new) {
        add_closure(&entries, &root, &mut live);
    }
    if let Some(limit) = opts.max_size {
        let mut others: Vec<(&String, &Entry)> = entries.iter().filter(|(h, _)| !live.contains(*h)).collect();
        others.sort_by(|a, b| b.1.modified.cmp(&a.1.modified).then_with(|| a.0.cmp(b.0)));
        let mut files = nar_files(&entries, &live);
        let mut used: u64 = files.iter().map(|f| sizes.get(f).copied().unwrap_or(0)).sum();
        for (hash, _) in others {
            let mut extra = BTreeSet::new();
            add_closure(&entries, hash, &mut extra);
            extra.retain(|h| !live.contains(h));
            let new_files: BTreeSet<&str> = nar_files(&entries, &extra).into_iter().filter(|f| !files.contains(f)).collect();
            let more: u64 = new_files.iter().map(|f| sizes.get(f).copied().unwrap_or(0)).sum();
            if used + more <= limit {
                used += more;
                files.extend(new_files);
                live.extend(extra);
            }
        }
    }
    // The fence (`sluice_binary_cache::fence`): a push that begins from now on waits for this
    // collection; the closures of those in progress are kept, and narinfos written since the
    // listing (pushes that ended meanwhile) keep theirs.
    let mut fence = match opts.dry_run {
        true => None,
        false => Some(Collection::begin(cache).await?),
    };
    let pushes = cache.pushes_in_progress().await?;
    requests.fetch_add(usize::from(fence.is_some()) + pushes.requests, Ordering::Relaxed);
    let pushing = pushes.closures;
    for hash in pushing.iter().flatten() {
        add_closure(&entries, hash, &mut live);
    }
    let again = cache.list_objects().await?;
    requests.fetch_add(1, Ordering::Relaxed);
    let rewritten = narinfos_of(&again).into_iter().filter(|o| entries.get(hash_of(&o.name)).is_none_or(|e| e.modified != o.modified));
    let added = read_narinfos(cache, rewritten.collect(), &requests).await?;
    let added_hashes: Vec<String> = added.keys().cloned().collect();
    entries.extend(added);
    for hash in &added_hashes {
        add_closure(&entries, hash, &mut live);
    }
    let mut report = GcReport { kept: live.len(), kept_bytes: nar_bytes(&entries, &live, &sizes), ..GcReport::default() };

    // 1. Narinfos, referrers first.
    let dead: BTreeSet<&String> = entries.keys().filter(|h| !live.contains(*h)).collect();
    let mut waiting: BTreeMap<&String, usize> = dead.iter().map(|h| (*h, 0)).collect();
    for hash in &dead {
        for r in references(&entries[*hash]).filter(|r| *r != hash.as_str()) {
            if let Some(count) = waiting.get_mut(&r.to_owned()) {
                *count += 1;
            }
        }
    }
    while !waiting.is_empty() {
        if let Some(fence) = &mut fence {
            requests.fetch_add(fence.keep_alive(cache).await?, Ordering::Relaxed);
        }
        let mut level: Vec<&String> = waiting.iter().filter(|(_, n)| **n == 0).map(|(h, _)| *h).collect();
        if level.is_empty() {
            // A cycle of narinfos (no store path can make one): deleted together.
            level = waiting.keys().copied().collect();
        }
        let names: Vec<String> = level.iter().map(|h| format!("{h}.narinfo")).collect();
        delete_all(cache, &names, opts.dry_run, &requests).await?;
        for (hash, name) in level.iter().zip(names) {
            waiting.remove(*hash);
            report.freed += sizes.get(name.as_str()).copied().unwrap_or(0);
            report.deleted.push(name);
            for r in references(&entries[*hash]) {
                if let Some(count) = waiting.get_mut(&r.to_owned()) {
                    *count = count.saturating_sub(1);
                }
            }
        }
    }

    // 2. Files no narinfo names, unless a push is in progress (it may be about to publish a
    //    narinfo naming a NAR file it found there, or uploaded before the listing).
    if pushing.is_none() {
        let now = cache.list_objects().await?;
        requests.fetch_add(1, Ordering::Relaxed);
        let unknown: Vec<&Object> = narinfos_of(&now).into_iter().filter(|o| !entries.contains_key(hash_of(&o.name))).collect();
        let unknown = read_narinfos(cache, unknown, &requests).await?;
        let mut named: BTreeSet<String> = BTreeSet::new();
        let mut described: BTreeSet<&str> = BTreeSet::new();
        let kept = entries.iter().filter(|(h, _)| live.contains(*h));
        for (hash, entry) in kept.chain(unknown.iter()) {
            named.extend(entry.narinfo.as_ref().map(|n| n.url.clone()));
            described.insert(hash.as_str());
        }
        let unnamed: Vec<&Object> = now
            .iter()
            .filter(|o| o.modified < new_since)
            .filter(|o| match o.name.strip_suffix(".ls") {
                Some(hash) => is_hash_part(hash) && !described.contains(hash),
                None => o.name.starts_with("nar/") && !named.contains(&o.name),
            })
            .collect();
        let names: Vec<String> = unnamed.iter().map(|o| o.name.clone()).collect();
        delete_all(cache, &names, opts.dry_run, &requests).await?;
        report.freed += unnamed.iter().map(|o| o.size).sum::<u64>();
        report.deleted.extend(names);
    }
    report.pushes_in_progress = pushing.is_some();
    if let Some(fence) = fence {
        delete_all(cache, &pushes.killed, false, &requests).await?;
        requests.fetch_add(fence.end(cache).await?, Ordering::Relaxed);
    }
    report.requests = requests.into_inner();
    Ok(report)
}

/// The narinfos among `objects`.
fn narinfos_of(objects: &[Object]) -> Vec<&Object> {
    objects.iter().filter(|o| o.name.strip_suffix(".narinfo").is_some_and(is_hash_part)).collect()
}

fn is_hash_part(name: &str) -> bool {
    name.len() == HASH_PART_LEN && sluice_nix::base32::is_digits(name)
}

fn hash_of(narinfo_name: &str) -> &str {
    narinfo_name.strip_suffix(".narinfo").unwrap_or(narinfo_name)
}

/// Reads and parses the narinfos `objects`, as many at once as the cache serves.
async fn read_narinfos(cache: &BinaryCache, objects: Vec<&Object>, requests: &AtomicUsize) -> Result<BTreeMap<String, Entry>, CacheError> {
    let read = stream::iter(objects)
        .map(|o| async move {
            let hash = hash_of(&o.name).to_owned();
            requests.fetch_add(1, Ordering::Relaxed);
            let text = cache.narinfo_text_of_hash(&hash).await?;
            let narinfo = text.and_then(|t| NarInfo::parse(cache.store_dir(), &t).ok()).filter(|n| n.store_path.hash_part() == hash);
            Ok::<_, CacheError>((hash, Entry { modified: o.modified, narinfo }))
        })
        .buffer_unordered(cache.capacity().min(64));
    read.collect::<Vec<_>>().await.into_iter().collect()
}

/// The hash parts of the references of `entry`.
fn references(entry: &Entry) -> impl Iterator<Item = &str> {
    entry.narinfo.iter().flat_map(|n| n.references.iter().map(|r| r.hash_part()))
}

/// Adds the closure of `root` among the cache's narinfos to `live`.
fn add_closure(entries: &BTreeMap<String, Entry>, root: &str, live: &mut BTreeSet<String>) {
    let mut stack = vec![root.to_owned()];
    while let Some(hash) = stack.pop() {
        let Some(entry) = entries.get(&hash) else { continue };
        if live.insert(hash) {
            stack.extend(references(entry).map(str::to_owned));
        }
    }
}

/// The NAR files the narinfos `hashes` name.
fn nar_files<'e>(entries: &'e BTreeMap<String, Entry>, hashes: &BTreeSet<String>) -> BTreeSet<&'e str> {
    hashes.iter().filter_map(|h| Some(entries.get(h)?.narinfo.as_ref()?.url.as_str())).collect()
}

/// Bytes of the NAR files the narinfos `hashes` name (each file once).
fn nar_bytes(entries: &BTreeMap<String, Entry>, hashes: &BTreeSet<String>, sizes: &HashMap<&str, u64>) -> u64 {
    nar_files(entries, hashes).iter().map(|f| sizes.get(f).copied().unwrap_or(0)).sum()
}

/// Deletes the files `names` at once (unless `dry_run`).
async fn delete_all(cache: &BinaryCache, names: &[String], dry_run: bool, requests: &AtomicUsize) -> Result<(), CacheError> {
    if dry_run {
        return Ok(());
    }
    let deletions = stream::iter(names)
        .map(|name| {
            requests.fetch_add(1, Ordering::Relaxed);
            cache.delete_object(name)
        })
        .buffer_unordered(cache.capacity().min(64));
    deletions.collect::<Vec<_>>().await.into_iter().collect()
}
