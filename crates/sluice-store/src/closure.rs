//! The closure engine: given store paths, find their closures in the substituters (binary
//! caches, and other stores through [`Source`]) by fetching narinfos in parallel with no
//! barrier per level. A path's references are queued the moment
//! its narinfo arrives; every substituter is asked at once and the answer taken by priority
//! (lowest `Priority` first), without waiting on lower-priority caches once a higher one has
//! answered. The narinfo disk cache is consulted in batches before the network, and new
//! answers are written back in batches. This is the batch `querySubstitutablePathInfos` of
//! Nix's founding design; `missing`, `copy` and `path-info -r` use it.
//!
//! A substituter of another store directory than the destination's (`?store=DIR`) is asked
//! only for the paths whose content address the caller knows ([`ClosureQuery::content_addresses`]),
//! under the name that content address gives them in its directory, and its answer is taken
//! only for a content-addressed path without references, renamed to the destination's path:
//! Nix's `PathSubstitutionGoal::init` (`src/libstore/build/substitution-goal.cc`).

use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

use futures::future::{BoxFuture, FutureExt};
use futures::stream::{FuturesUnordered, StreamExt};
use sluice_nix::content_address::ContentAddress;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::by_key::ByKey;
use crate::fd_budget::FdBudget;
use crate::prefetched::{NarInfoAnswer, Prefetched, Taken};
use crate::substituter_source::Source;
use sluice_binary_cache::narinfo_cache::{Cached, DiskCacheError, NarInfoCache};
use sluice_binary_cache::CacheError;
use sluice_local_store::{LocalStore, SignaturePolicy, TempRoots, VouchedInfo};

/// A substituter: where its paths come from, with its id in the disk cache (if any).
#[derive(Debug)]
pub struct Substituter {
    pub source: Source,
    pub disk_id: Option<i64>,
    /// Narinfo answers fetched while the cache was being opened, or still arriving, taken by
    /// the first lookup of each path instead of a request.
    pub prefetched: Arc<Prefetched>,
    /// The URL's `?trusted=true`: its paths need no signature (Nix's `isTrusted`).
    pub trusted: bool,
}

impl Substituter {
    /// A substituter with nothing prefetched.
    pub fn new(source: Source, disk_id: Option<i64>) -> Self {
        Substituter { source, disk_id, prefetched: Default::default(), trusted: false }
    }

    /// The name the cache gives the destination's `path` in `store_dir`: the same, for a cache
    /// of `store_dir`; for a cache of another store directory, the one `content_addresses`
    /// implies in its directory, and none without one (Nix's `PathSubstitutionGoal::init`).
    fn name_of(&self, path: &StorePath, store_dir: &StoreDir, content_addresses: &ContentAddresses) -> Option<StorePath> {
        let dir = self.source.store_dir();
        if dir == store_dir {
            return Some(path.clone());
        }
        content_addresses.get(path)?.store_path(dir, path.name(), &[], false).ok()
    }
}

/// Content addresses of paths without references, by path (Nix's `StorePathCAMap`).
pub type ContentAddresses = HashMap<StorePath, ContentAddress>;

/// What the engine learnt about one path of the closure.
#[derive(Debug)]
pub enum ClosureEvent {
    /// Valid in the destination already; its references were not followed.
    Valid(StorePath),
    /// Substituter number `cache` (an index into the engine's list) has it; `vouched` when
    /// [`ClosureQuery::accept`] checked this narinfo and accepted it (so that it is not
    /// checked again).
    Found { narinfo: Arc<NarInfo>, cache: usize, vouched: Option<VouchedInfo> },
    /// No substituter has it, and none failed.
    Unknown(StorePath),
    /// No substituter has it and at least one failed: the substituter's index and its error
    /// (which names the URL).
    Failed { path: StorePath, errors: Vec<(usize, Arc<CacheError>)> },
}

/// Decides which of a batch of paths are already valid in the destination.
pub type ValidityCheck = Arc<dyn Fn(&[StorePath]) -> HashSet<StorePath> + Send + Sync>;

/// The validity check against `dest`: for a substitution into it, with `roots` (the copy's
/// temporary roots), each path is rooted before it is looked up, so that a path found valid
/// stays so while the copy builds on it; without a store, nothing is valid. A failed
/// look-up is logged and counts as "not valid" (the path is then substituted, and the store
/// finds it valid when it adds it).
pub fn validity_in(dest: Option<Arc<LocalStore>>, roots: Option<TempRoots>) -> ValidityCheck {
    Arc::new(move |paths: &[StorePath]| -> HashSet<StorePath> {
        let Some(store) = &dest else { return HashSet::new() };
        let valid = match &roots {
            Some(roots) => store.query_valid_paths_rooted(paths, roots),
            None => store.query_valid_paths(paths),
        };
        valid.map(|s| s.into_iter().collect()).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            HashSet::new()
        })
    })
}

/// Disk-cache answers are written back once this many have accumulated (and at the end), on
/// a blocking thread while the query goes on.
const RECORD_BATCH: usize = 256;

/// The closure engine's configuration.
#[derive(Clone)]
pub struct ClosureQuery {
    /// Substituters, sorted by priority (stable: ties keep the configured order).
    pub substituters: Arc<Vec<Substituter>>,
    pub disk_cache: Option<Arc<NarInfoCache>>,
    pub store_dir: StoreDir,
    pub is_valid: ValidityCheck,
    /// For a substitution, who must vouch for a path ([`SignaturePolicy::vouch`] under
    /// [`SignaturePolicy::for_source`]): a narinfo it refuses is passed over for a
    /// lower-priority substituter's that it accepts, as Nix's substitution goal tries the next
    /// substituter of a path whose info is untrusted (`tryNext` in
    /// `src/libstore/build/substitution-goal.cc`), so that the closure is walked along the
    /// references of the narinfos that will be used. If none is accepted, the first is taken
    /// (its path then fails, naming why). `None` (a query of what caches have, as Nix's
    /// `querySubstitutablePathInfos`): the first is taken.
    pub accept: Option<SignaturePolicy>,
    /// The content addresses the caller knows of paths it asks for (the fixed outputs of the
    /// derivations being realised: Nix's `getDerivationCA`), for the substituters of another
    /// store directory (see the module documentation).
    pub content_addresses: Arc<ContentAddresses>,
}

enum Answer {
    Cached(Cached),
    /// Fetched while the cache was being opened ([`Substituter::prefetched`]).
    Prefetched(NarInfoAnswer),
    /// Still arriving in a batch answer: its line, or a request if the answer ends without it.
    Arriving(oneshot::Receiver<NarInfoAnswer>),
    Fetch(JoinHandle<NarInfoAnswer>),
}

/// The state of one closure walk.
#[derive(Default)]
struct Walk {
    seen: HashSet<StorePath>,
    /// Lookups under way.
    pending: FuturesUnordered<BoxFuture<'static, Outcome>>,
    /// Paths waiting for a network slot, deepest (then newest) first.
    waiting: BinaryHeap<Waiting>,
    /// Depth of each path seen (references of a path at depth d are at d + 1).
    depth: HashMap<StorePath, usize>,
    /// Paths queued so far (orders equal depths, newest first).
    queued: u64,
    /// Per substituter: whether the disk cache has anything for it (else it is not asked).
    consult: Vec<bool>,
    /// Lookups under way that wait on the network.
    network: usize,
    /// Most such lookups the open-file budget allows (each may open a file per substituter).
    fd_slots: usize,
}

/// A path waiting for a network slot, with its disk-cache answers, keyed by (depth, order of
/// discovery): the deepest, then the newest, comes first.
type Waiting = ByKey<(usize, u64), (StorePath, Vec<Option<Cached>>)>;

struct Outcome {
    path: StorePath,
    /// Whether the lookup used the network (and so a slot of the budget).
    network: bool,
    event: ClosureEvent,
    /// Fresh network answers to record: (disk id, hash part, narinfo text or absent).
    records: Vec<(i64, String, Option<String>)>,
}

impl ClosureQuery {
    /// Sorts substituters by priority, keeping the given order among equals.
    pub(crate) fn sort_substituters(mut subs: Vec<Substituter>) -> Vec<Substituter> {
        subs.sort_by_key(|s| s.source.priority());
        subs
    }

    /// Runs the query for the closures of `roots`, sending one event per distinct path to
    /// `events` as answers arrive, and closing it when the whole closure is known (or when the
    /// receiver closed it). Returns once the answers fetched are recorded in the disk cache,
    /// which goes on after `events` is closed.
    pub async fn run(&self, roots: Vec<StorePath>, events: mpsc::UnboundedSender<ClosureEvent>) {
        let fd_slots = FdBudget::current().lookups / self.substituters.len().max(1);
        let mut walk = Walk { consult: self.disk_entries(), fd_slots, ..Walk::default() };
        let (mut records, mut writes) = (Vec::new(), Vec::new());
        self.enqueue(roots.into_iter().map(|p| (p, 0)).collect(), &mut walk, &events);
        self.fill(&mut walk);
        while let Some(first) = walk.pending.next().await {
            // The lookups that have ended by now, taken together: their references are looked
            // up in the destination and the disk cache in one batch each (a closure found by
            // one batch request ends its lookups all at once).
            let mut ended = vec![first];
            while let Some(Some(outcome)) = walk.pending.next().now_or_never() {
                ended.push(outcome);
            }
            let mut refs = Vec::new();
            for Outcome { path, event, records: new, network } in &mut ended {
                walk.network -= *network as usize;
                records.append(new);
                if let ClosureEvent::Found { narinfo, .. } = event {
                    let depth = walk.depth.get(path).map_or(0, |d| d + 1);
                    refs.extend(narinfo.references.iter().filter(|r| *r != path).map(|r| (r.clone(), depth)));
                }
            }
            if records.len() >= RECORD_BATCH {
                writes.extend(self.flush(&mut records));
            }
            self.enqueue(refs, &mut walk, &events);
            self.fill(&mut walk);
            if ended.into_iter().any(|outcome| events.send(outcome.event).is_err()) {
                break;
            }
        }
        drop(events);
        writes.extend(self.flush(&mut records));
        for write in writes {
            if let Ok(Err(e)) = write.await {
                tracing::warn!("{e}");
            }
        }
    }

    /// Starts recording `records` in the disk cache, on a blocking thread (none without a disk
    /// cache or records).
    fn flush(&self, records: &mut Vec<(i64, String, Option<String>)>) -> Option<JoinHandle<Result<(), DiskCacheError>>> {
        let disk = self.disk_cache.clone().filter(|_| !records.is_empty())?;
        let batch = std::mem::take(records);
        Some(tokio::task::spawn_blocking(move || disk.record(&batch)))
    }

    /// Takes in newly discovered paths with their depths (a path met twice keeps its first):
    /// valid ones are reported, ones every substituter has a fresh disk-cache answer for are
    /// resolved at once, the rest wait for a network slot.
    fn enqueue(&self, paths: Vec<(StorePath, usize)>, walk: &mut Walk, events: &mpsc::UnboundedSender<ClosureEvent>) {
        let new: Vec<(StorePath, usize)> = paths.into_iter().filter(|(p, _)| walk.seen.insert(p.clone())).collect();
        if new.is_empty() {
            return;
        }
        let valid = (self.is_valid)(&new.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>());
        let (valid, rest): (Vec<_>, Vec<_>) = new.into_iter().partition(|(p, _)| valid.contains(p));
        for (v, _) in valid {
            let _ = events.send(ClosureEvent::Valid(v));
        }
        let mut cached = self.cached_answers(&rest.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), &walk.consult);
        for (path, depth) in rest {
            let known: Vec<Option<Cached>> = (0..self.substituters.len())
                .map(|i| match self.substituters[i].name_of(&path, &self.store_dir, &self.content_addresses) {
                    Some(_) => cached.remove(&(i, path.hash_part().to_string())),
                    None => Some(Cached::Absent),
                })
                .collect();
            walk.depth.insert(path.clone(), depth);
            if known.iter().all(Option::is_some) {
                self.start(path, known, walk);
            } else {
                walk.queued += 1;
                walk.waiting.push(ByKey { key: (depth, walk.queued), value: (path, known) });
            }
        }
    }

    /// Starts waiting lookups, deepest first (then newest), while the network budget allows:
    /// the long chains of a closure start early instead of queueing behind a wide level (no
    /// per-level barrier, and no FIFO one either).
    fn fill(&self, walk: &mut Walk) {
        let budget = self.substituters.iter().map(|s| s.source.capacity()).min().unwrap_or(1).min(walk.fd_slots).max(1);
        while walk.network < budget {
            let Some(ByKey { value: (path, known), .. }) = walk.waiting.pop() else { break };
            self.start(path, known, walk);
        }
    }

    /// Starts the lookup of `path`: cached answers as they are, a request to every other
    /// substituter at once.
    fn start(&self, path: StorePath, known: Vec<Option<Cached>>, walk: &mut Walk) {
        let network = known.iter().any(Option::is_none);
        let answers = known
            .into_iter()
            .enumerate()
            .map(|(i, k)| match k {
                Some(c) => Answer::Cached(c),
                None => {
                    let sub = &self.substituters[i];
                    let p = sub.name_of(&path, &self.store_dir, &self.content_addresses).unwrap_or_else(|| path.clone());
                    match sub.prefetched.take(p.hash_part()) {
                        Taken::Ready(answer) => Answer::Prefetched(answer),
                        Taken::Pending(line) => Answer::Arriving(line),
                        Taken::None => {
                            let subs = self.substituters.clone();
                            Answer::Fetch(tokio::spawn(async move { subs[i].source.narinfo_text(&p).await }))
                        }
                    }
                }
            })
            .collect();
        walk.network += network as usize;
        let lookup = Lookup {
            subs: self.substituters.clone(),
            store_dir: self.store_dir.clone(),
            accept: self.accept.clone(),
            content_addresses: self.content_addresses.clone(),
            path,
            network,
        };
        walk.pending.push(Box::pin(lookup.resolve(answers)));
    }

    /// Per substituter, whether its disk-cache entries are worth looking up (any exist).
    fn disk_entries(&self) -> Vec<bool> {
        self.substituters
            .iter()
            .map(|s| match (&self.disk_cache, s.disk_id) {
                (Some(disk), Some(id)) => disk.has_entries(id).unwrap_or(true),
                _ => false,
            })
            .collect()
    }

    /// Fresh disk-cache answers for `paths`, keyed by (substituter index, hash part), from
    /// the substituters `consult` marks.
    fn cached_answers(&self, paths: &[StorePath], consult: &[bool]) -> HashMap<(usize, String), Cached> {
        let mut out = HashMap::new();
        let Some(disk) = &self.disk_cache else { return out };
        let hashes: Vec<&str> = paths.iter().map(|p| p.hash_part()).collect();
        for (i, sub) in self.substituters.iter().enumerate() {
            // A cache of another store directory knows the paths by other names.
            let same_dir = sub.source.store_dir() == &self.store_dir;
            let Some(id) = sub.disk_id.filter(|_| same_dir && consult.get(i).copied().unwrap_or(true)) else { continue };
            match disk.lookup(id, &hashes) {
                Ok(found) => out.extend(found.into_iter().map(|(h, c)| ((i, h), c))),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        out
    }
}

/// One path's lookup at every substituter.
struct Lookup {
    subs: Arc<Vec<Substituter>>,
    store_dir: StoreDir,
    accept: Option<SignaturePolicy>,
    content_addresses: Arc<ContentAddresses>,
    path: StorePath,
    /// Whether it waits on the network.
    network: bool,
}

impl Lookup {
    /// What [`ClosureQuery::accept`] makes of substituter `i`'s `narinfo`: `None` if there is
    /// no policy, else the vouched info or `None` (refused).
    fn vouch(&self, i: usize, narinfo: &NarInfo) -> Option<Option<VouchedInfo>> {
        let policy = self.accept.as_ref()?;
        Some(policy.for_source(self.subs[i].trusted).vouch_info(&self.store_dir, ValidPathInfo::from_narinfo(narinfo, 0)).ok())
    }

    /// Takes the answer of the highest-priority substituter that has the path (and whose
    /// narinfo is accepted, if any is), waiting on a lower-priority one only while every
    /// higher one lacks it, failed or was refused; cancels the rest.
    async fn resolve(self, answers: Vec<Answer>) -> Outcome {
        let Lookup { subs, store_dir, path, .. } = &self;
        let mut records = Vec::new();
        let mut errors: Vec<(usize, Arc<CacheError>)> = Vec::new();
        let mut refused: Option<(usize, NarInfo)> = None;
        let last = answers.len().saturating_sub(1);
        let mut answers = answers.into_iter().enumerate();
        while let Some((i, answer)) = answers.next() {
            let sub = &subs[i];
            let asked = sub.name_of(path, store_dir, &self.content_addresses).unwrap_or_else(|| path.clone());
            let parse = |text: Option<&str>| {
                let parsed = text.map(|t| sub.source.parse_narinfo(&asked, sub.source.store_dir(), t)).transpose();
                parsed.map(|narinfo| narinfo.and_then(|n| self.renamed(sub, n)))
            };
            // A fresh answer: only well-formed narinfos are cached as present, and only under
            // the name they were asked for.
            let mut fresh = |result: Result<Option<String>, CacheError>| {
                result.and_then(|text| {
                    let parsed = parse(text.as_deref());
                    if let (Ok(_), Some(id), true) = (&parsed, sub.disk_id, asked == *path) {
                        records.push((id, path.hash_part().to_string(), text));
                    }
                    parsed
                })
            };
            let parsed = match answer {
                Answer::Cached(Cached::Present(text)) => parse(Some(&text)),
                Answer::Cached(Cached::Absent) => Ok(None),
                Answer::Prefetched(result) => fresh(result),
                Answer::Arriving(line) => match line.await {
                    Ok(result) => fresh(result),
                    Err(_) => fresh(sub.source.narinfo_text(&asked).await),
                },
                Answer::Fetch(handle) => {
                    let result = handle
                        .await
                        .unwrap_or_else(|e| Err(CacheError::Io { url: sub.source.narinfo_url(&asked), source: std::io::Error::other(e) }));
                    fresh(result)
                }
            };
            match parsed {
                Ok(Some(narinfo)) => {
                    // Checked (once) only while a later substituter may have an accepted one,
                    // or to choose between this one and one refused before.
                    let vouched = if i < last || refused.is_some() { self.vouch(i, &narinfo) } else { None };
                    if matches!(vouched, Some(None)) && i < last {
                        refused.get_or_insert((i, narinfo));
                        continue;
                    }
                    // Failures of higher-priority caches are skipped, but not silently (those that
                    // disabled a whole cache were reported once already).
                    for (_, e) in errors.iter().filter(|(_, e)| !e.is_cache_wide()) {
                        tracing::warn!("{e}; using {} instead", sub.source.url());
                    }
                    for (_, rest) in answers {
                        if let Answer::Fetch(h) = rest {
                            h.abort();
                        }
                    }
                    // A narinfo refused before is passed over only for one that is accepted.
                    let event = match (vouched, refused) {
                        (Some(None), Some((first, refused))) => {
                            ClosureEvent::Found { narinfo: Arc::new(refused), cache: first, vouched: None }
                        }
                        (vouched, _) => ClosureEvent::Found { narinfo: Arc::new(narinfo), cache: i, vouched: vouched.flatten() },
                    };
                    return self.outcome(event, records);
                }
                Ok(None) => {}
                Err(e) => errors.push((i, Arc::new(e))),
            }
        }
        let event = match (refused, errors.is_empty()) {
            (Some((cache, narinfo)), _) => ClosureEvent::Found { narinfo: Arc::new(narinfo), cache, vouched: None },
            (None, true) => ClosureEvent::Unknown(path.clone()),
            (None, false) => ClosureEvent::Failed { path: path.clone(), errors },
        };
        self.outcome(event, records)
    }

    /// `narinfo` from `sub` as the destination's: as it is from a cache of the destination's
    /// store directory; from one of another directory, renamed to the path asked for if it is
    /// content-addressed (at the name its content address gives it there) without references,
    /// else none (Nix's "asked '…' for '…' but got '…'" is not an error either).
    fn renamed(&self, sub: &Substituter, mut narinfo: NarInfo) -> Option<NarInfo> {
        let dir = sub.source.store_dir();
        if dir == &self.store_dir {
            return Some(narinfo);
        }
        let implied = narinfo.ca.as_ref().and_then(|ca| ca.store_path(dir, self.path.name(), &[], false).ok());
        if implied.as_ref() != Some(&narinfo.store_path) || !narinfo.references.is_empty() {
            tracing::warn!(
                "{}: not a content-addressed path without references; not substituted",
                sub.source.narinfo_url(&narinfo.store_path)
            );
            return None;
        }
        narinfo.store_path = self.path.clone();
        Some(narinfo)
    }

    fn outcome(self, event: ClosureEvent, records: Vec<(i64, String, Option<String>)>) -> Outcome {
        Outcome { path: self.path, event, records, network: self.network }
    }
}
