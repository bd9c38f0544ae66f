//! The substitution pipeline: for each path the closure engine finds, check that it may be
//! trusted (the local store's [`SignaturePolicy::vouch`], so that an untrusted NAR is not
//! even downloaded; the store checks it again, with its content, at commit; both under the
//! policy [`SignaturePolicy::for_source`] gives for its substituter), download its
//! NAR at once (at most `jobs` at a time, before its references are valid), and stream it
//! through decompression, hashing and unpacking into a temporary tree. Each path is then
//! handed to the registrar as soon as each of its references is valid or was handed to it
//! before, and the registrar commits paths — NarHash/NarSize checked, renamed into place and
//! registered — in the order it gets them, so registration follows dependency order and a
//! chain unpacked at once is registered in one batch. A path whose reference the store
//! refused at commit is handed back and waits for that reference to be registered. A path
//! whose NAR fails is fetched from the next substituter that has it; a path that cannot be
//! had fails its dependents, never their valid dependencies.
//!
//! Open files. A path holds its lock file open from before its NAR is unpacked into the
//! temporary tree (which only the lock protects) until it is registered, so held locks are
//! bounded by permits ([`LockPermits`]), as many as the open-file limit allows when the copy
//! starts ([`FdBudget`]; download jobs are capped by it too). A path found while a permit is
//! free takes it at once (it is *eager*) and is downloaded before its references are valid, as
//! above. A path found while none is free is *deferred*: it waits for its references (handed
//! to the registrar or valid) holding nothing, then queues for a permit, first come, first
//! served. A path whose NAR is unpacked but whose references are not ready yet gives up its
//! tree, lock and permit as soon as a path is queued for a permit (it is preempted), and goes
//! on as a deferred path: its NAR is downloaded again once its references are ready.
//!
//! Why this cannot deadlock: a path holding a permit while a path is queued is downloading,
//! unpacking or being registered, as it waits for its references only preemptibly. Suppose no
//! path became valid or failed any more. Downloads and registrations end, so every holder
//! would be waiting for its references, and nobody could be queued (or the holders would give
//! way to the first queued path, whose references are ready, and it would be registered after
//! them). Yet the closure has a pending path none of whose references is pending (its graph
//! is acyclic: a cycle a cache claims fails its paths once the closure is known,
//! `reference_cycles.rs`): it fails if one failed; otherwise, deferred, it would be queued,
//! and eager, it would be registered. So some path always finishes. A path is preempted at
//! most once for being eager (it is deferred afterwards) and once per reference refused at
//! commit, so preemption costs it at most that many more downloads. When the budget exceeds
//! the closure (a high limit), no path is ever deferred or preempted: the copy runs as it did
//! without one.
//!
//! This module runs a copy: the dispatch of the paths the closure engine finds, their states,
//! the registrar, and for each path the choice of substituter and narinfo; one attempt at a
//! path from one substituter (admission, download, unpacking, hand-off) is [`attempt`]'s.

mod attempt;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use tokio::sync::{mpsc, watch};

use crate::closure::{ClosureEvent, ClosureQuery, Substituter};
use crate::closure_depth::ClosureDepths;
use crate::failure::{Cause, Failure};
use crate::fd_budget::{FdBudget, LockPermits};
use crate::job_queue::JobQueue;
use crate::reference_cycles::reference_cycles;
use crate::registrar::Registrar;
use attempt::Attempt;
use sluice_binary_cache::narinfo_cache::NarInfoCache;
use sluice_local_store::{LocalStore, SignaturePolicy, TempRoots, VouchedInfo};

/// NAR downloads in flight at once unless the caller says otherwise: `sluice copy --jobs` and the
/// daemon without `max-substitution-jobs` (why 256: docs/benchmarks.md, "Why `copy --jobs`
/// defaults to 256").
pub const DEFAULT_JOBS: usize = 256;

/// How paths are trusted and how many are fetched at once.
#[derive(Debug, Clone)]
pub struct SubstituteOptions {
    /// NAR downloads in flight at once.
    pub jobs: usize,
    /// Who must vouch for a substituted path.
    pub policy: SignaturePolicy,
}

/// Receives progress; called from many tasks at once.
pub trait Observer: Send + Sync {
    /// A path will be substituted: its compressed and NAR sizes in bytes (0 if unknown).
    fn queued(&self, _path: &StorePath, _download: u64, _nar: u64) {}
    /// The NAR of a path started to arrive from the cache at `cache` (its URL); called again
    /// for each further attempt.
    fn started(&self, _path: &StorePath, _cache: &str) {}
    /// The NAR of a path, which [`started`](Self::started) to arrive, is downloaded from `url`
    /// (an HTTP cache's: what Nix's `FileTransfer` reports as `actFileTransfer`).
    fn fetching(&self, _path: &StorePath, _url: &str) {}
    /// `bytes` more compressed bytes arrived from the cache at `cache` (its URL).
    fn downloaded(&self, _cache: &str, _bytes: u64) {}
    /// How far the NAR of a path that [`started`](Self::started) got in this attempt:
    /// compressed bytes downloaded and NAR bytes unpacked; called at most every 50 ms per
    /// path while it streams (not at its end: [`done`](Self::done) says that).
    fn progress(&self, _path: &StorePath, _downloaded: u64, _unpacked: u64) {}
    /// A path became valid in the destination; its NAR (`nar_size` bytes) was unpacked.
    fn done(&self, _path: &StorePath, _nar_size: u64) {}
    /// A path failed, with the reason.
    fn failed(&self, _path: &StorePath, _reason: &Failure) {}
    /// Something the user should know that did not fail a path (e.g. a substituter's bad NAR
    /// before another substituter's good one was used).
    fn warning(&self, _message: &str) {}
}

/// What a copy did. Sizes in bytes.
#[derive(Debug, Default)]
pub struct CopyReport {
    /// Paths added to the destination by this run.
    pub substituted: Vec<StorePath>,
    /// Paths of the closures that were valid already, or that another process made valid
    /// while this copy was at them.
    pub already_valid: usize,
    /// Paths that could not be made valid, with the reason.
    pub failed: BTreeMap<StorePath, Failure>,
    /// Compressed bytes downloaded.
    pub downloaded: u64,
    /// NAR bytes unpacked.
    pub unpacked: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    /// Handed to the registrar, which commits paths in the order it is handed them.
    Ready,
    Valid,
    Failed,
}

/// How far a path's references must have got before it goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Until {
    /// Each handed to the registrar or valid: the path can be handed to it after them.
    Ready,
    /// Each valid (a path handed back by the registrar waits for this).
    Valid,
}

/// Per-path validity states that jobs wait on (the topological gate).
#[derive(Default)]
struct Gate {
    states: Mutex<HashMap<StorePath, watch::Sender<State>>>,
}

impl Gate {
    fn sender(&self, path: &StorePath) -> watch::Sender<State> {
        let mut m = self.states.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(path.clone()).or_insert_with(|| watch::channel(State::Pending).0).clone()
    }

    /// Sets the state of `path`, unless it failed: a failure is final (a path failed for a
    /// cycle while its job went on must not become ready or valid afterwards). Whether it was set.
    fn set(&self, path: &StorePath, state: State) -> bool {
        self.update(path, |s| (*s != State::Failed).then_some(state))
    }

    /// Replaces the state of `path` with what `change` makes of it (`None`: left as it is), with
    /// no other change in between. Whether it was replaced.
    fn update(&self, path: &StorePath, change: impl FnOnce(&State) -> Option<State>) -> bool {
        self.sender(path).send_if_modified(|s| match change(s) {
            Some(new) => {
                *s = new;
                true
            }
            None => false,
        })
    }

    /// Waits until `path` has got as far as `until` says, or failed; false if it failed.
    async fn wait(&self, path: &StorePath, until: Until) -> bool {
        let mut rx = self.sender(path).subscribe();
        let state = rx
            .wait_for(|s| *s == State::Valid || *s == State::Failed || (until == Until::Ready && *s == State::Ready))
            .await
            .map(|s| s.clone());
        matches!(state, Ok(State::Valid | State::Ready))
    }
}

/// Everything a path's job needs, shared by all jobs of one copy.
struct Shared {
    dest: Arc<LocalStore>,
    /// The copy's temporary roots: every path of the closures from before it is looked at.
    roots: TempRoots,
    subs: Arc<Vec<Substituter>>,
    /// The narinfo disk cache, to drop stale entries from.
    disk: Option<Arc<NarInfoCache>>,
    opts: SubstituteOptions,
    gate: Gate,
    /// NAR download slots, largest NAR first.
    jobs: Arc<JobQueue>,
    /// Permits to hold a path lock (see the module documentation).
    locks: LockPermits,
    observer: Arc<dyn Observer>,
    report: Mutex<CopyReport>,
    /// Whether the paths asked for are valid ones being repaired ([`repair_paths`]).
    repair: bool,
    /// Paths ready to be registered (their references are valid or handed to it before).
    registrar: Registrar,
    /// The priorities of the paths' unpacking.
    depths: ClosureDepths,
}

/// Copies the closures of `paths` from the substituters of `query` into `dest`, keeping
/// every path it adds a temporary root in `roots` (which should be the roots `query`'s
/// validity check adds paths to, so that a path found valid stays valid).
pub async fn copy_closure(
    query: ClosureQuery,
    dest: Arc<LocalStore>,
    roots: TempRoots,
    paths: Vec<StorePath>,
    opts: SubstituteOptions,
    observer: Arc<dyn Observer>,
) -> CopyReport {
    run(query, dest, roots, paths, opts, observer, false).await
}

/// Substitutes the valid paths `paths` again (Nix's `repairPath`, a substitution goal with
/// `Repair`), as [`copy_closure`] copies paths: each one's NAR must have the registered NAR
/// hash (a substituter offering another is passed over), and its tree replaces the damaged
/// one atomically ([`LocalStore::try_begin_repair`]); the registration is left as it is.
/// Their references, valid, are not fetched.
pub async fn repair_paths(
    mut query: ClosureQuery,
    dest: Arc<LocalStore>,
    roots: TempRoots,
    paths: Vec<StorePath>,
    opts: SubstituteOptions,
    observer: Arc<dyn Observer>,
) -> CopyReport {
    let (is_valid, damaged) = (query.is_valid.clone(), paths.clone());
    query.is_valid = Arc::new(move |asked: &[StorePath]| {
        let mut valid = is_valid(asked);
        for p in &damaged {
            valid.remove(p);
        }
        valid
    });
    run(query, dest, roots, paths, opts, observer, true).await
}

/// [`copy_closure`], or [`repair_paths`] with `repair`.
async fn run(
    query: ClosureQuery,
    dest: Arc<LocalStore>,
    roots: TempRoots,
    paths: Vec<StorePath>,
    opts: SubstituteOptions,
    observer: Arc<dyn Observer>,
    repair: bool,
) -> CopyReport {
    let query = ClosureQuery { accept: Some(opts.policy.clone()), ..query };
    let (registrar, registrar_finished) = Registrar::start(dest.clone(), opts.policy.clone());
    let budget = FdBudget::current();
    let shared = Arc::new(Shared {
        registrar,
        dest,
        roots,
        subs: query.substituters.clone(),
        disk: query.disk_cache.clone(),
        jobs: JobQueue::new(opts.jobs.min(budget.jobs)),
        locks: LockPermits::new(budget.locks),
        opts,
        gate: Gate::default(),
        observer,
        report: Mutex::new(CopyReport::default()),
        repair,
        depths: ClosureDepths::default(),
    });
    // Dispatched on the runtime's workers, not on the caller's thread (`block_on` in the
    // command line), so that each path found does not wake a sleeping thread (4 ms of the
    // corpus's copy). In a set of its own: dropping this future (an interrupted copy) aborts
    // it, and its tasks with it, as before.
    let mut dispatch_task = tokio::task::JoinSet::new();
    dispatch_task.spawn(dispatch(query, paths, shared.clone()));
    if let Some(Err(e)) = dispatch_task.join_next().await {
        if e.is_panic() {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    let Some(Shared { report, registrar, .. }) = Arc::into_inner(shared) else { return CopyReport::default() };
    drop(registrar);
    let _ = tokio::task::spawn_blocking(move || registrar_finished.wait()).await;
    report.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// Starts the closure engine of `query` on `paths` and a substitution task for each path it
/// finds; once the closure is known, fails the paths in reference cycles; returns when every
/// task has ended.
async fn dispatch(query: ClosureQuery, paths: Vec<StorePath>, shared: Arc<Shared>) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let engine = {
        let query = query.clone();
        tokio::spawn(async move { query.run(paths, tx).await })
    };
    let mut tasks = tokio::task::JoinSet::new();
    // The narinfos found, for the cycles among them.
    let mut found: Vec<Arc<NarInfo>> = Vec::new();
    let mut events = Vec::new();
    while rx.recv_many(&mut events, VOUCH_BATCH).await > 0 {
        let verdicts = vouch_found(&shared.opts.policy, &query, &events);
        for (event, verdict) in events.drain(..).zip(verdicts) {
            match event {
                ClosureEvent::Valid(path) => {
                    // A copy killed between registering a path and releasing its lock left the lock file.
                    shared.dest.clear_stale_lock(&path);
                    shared.lock_report().already_valid += 1;
                    shared.gate.set(&path, State::Valid);
                }
                ClosureEvent::Found { narinfo, cache, vouched } => {
                    let verdict = vouched.map(Ok).or(verdict);
                    shared.depths.found(&narinfo.store_path, &narinfo.references);
                    shared.observer.queued(&narinfo.store_path, narinfo.file_size.unwrap_or(0), narinfo.nar_size);
                    found.push(narinfo.clone());
                    let shared = shared.clone();
                    let store_dir = query.store_dir.clone();
                    tasks.spawn(async move {
                        // A bug must fail its path (and so its dependents), not leave them waiting.
                        let path = narinfo.store_path.clone();
                        let shown = store_dir.display_path(&path);
                        let job = std::panic::AssertUnwindSafe(shared.clone().substitute(store_dir, narinfo, cache, verdict));
                        if futures::FutureExt::catch_unwind(job).await.is_err() {
                            shared.fail(&path, Failure::other(format!("{shown}: internal error (a panic) while substituting it")));
                        }
                    });
                }
                ClosureEvent::Unknown(path) => {
                    let message = format!("{}: no substituter has this path", query.store_dir.display_path(&path));
                    shared.fail(&path, Failure { cause: Cause::Unknown, message });
                }
                ClosureEvent::Failed { path, errors } => {
                    let failures = errors.iter().map(|(i, e)| Failure::cache(query.substituters[*i].source.url(), e)).collect();
                    shared.fail(&path, Failure::combine(&query.store_dir.display_path(&path), failures));
                }
            }
        }
    }
    let _ = engine.await;
    // The closure is known: paths in a cycle would wait for each other for ever.
    for cycle in reference_cycles(found.iter().map(|n| (&n.store_path, n.references.iter()))) {
        let message = cycle.message(&query.store_dir);
        // Only members still pending fail: one another process made valid meanwhile (from a
        // cache with other references) stays so, and one handed to the registrar (its next
        // substituter's narinfo lists fewer references) is registered.
        for path in &cycle.members {
            if shared.gate.update(path, |s| (*s == State::Pending).then_some(State::Failed)) {
                shared.report_failure(path, Failure::other(format!("{}: {message}", query.store_dir.display_path(path))));
            }
        }
    }
    drop(found);
    while tasks.join_next().await.is_some() {}
}

/// Most found paths whose signatures [`dispatch`] verifies together.
const VOUCH_BATCH: usize = 64;

/// What was decided of a narinfo's signatures before its path's task started: vouched for, or
/// refused (the failure of that substituter's attempt, naming its narinfo's URL).
type Verdict = Result<VouchedInfo, Failure>;

/// The verdicts on the narinfos found in `events` that the closure engine did not check (from
/// substituters that are not `?trusted=true`), one per event (`None` for the others), their
/// signatures verified in one batch ([`SignaturePolicy::vouch_all`]) so that no path's task
/// verifies them alone: one ed25519 verification per path was the largest cost of the format.
/// If the batch does not hold, every verdict is `None`: each path's task then checks its own,
/// on both workers, once (a hostile cache's 20 narinfos with 2,000 forged signatures each, in
/// the corpus: 1.2 s as before batches, against 2.2 s when this loop checked them one after
/// another and their tasks checked them again).
fn vouch_found(policy: &SignaturePolicy, query: &ClosureQuery, events: &[ClosureEvent]) -> Vec<Option<Verdict>> {
    let unvouched = |event: &ClosureEvent| match event {
        ClosureEvent::Found { narinfo, cache, vouched: None } if !query.substituters[*cache].trusted => Some((narinfo.clone(), *cache)),
        _ => None,
    };
    let found: Vec<_> = events.iter().map(unvouched).collect();
    let infos = found.iter().flatten().map(|(narinfo, _)| ValidPathInfo::from_narinfo(narinfo, 0)).collect();
    let mut verdicts = policy.vouch_all(&query.store_dir, infos).unwrap_or_default().into_iter();
    found
        .into_iter()
        .map(|found| {
            let (narinfo, cache) = found?;
            let url = || query.substituters[cache].source.narinfo_url(&narinfo.store_path);
            verdicts.next().map(|verdict| verdict.map_err(|e| Failure::store(&url(), &e)))
        })
        .collect()
}

impl Shared {
    fn lock_report(&self) -> std::sync::MutexGuard<'_, CopyReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails `path` (a second failure is not reported: the first reason stays).
    fn fail(&self, path: &StorePath, reason: Failure) {
        self.report_failure(path, reason);
        self.gate.set(path, State::Failed);
    }

    /// Records and reports that `path` failed, unless it was already.
    fn report_failure(&self, path: &StorePath, reason: Failure) {
        let first = match self.lock_report().failed.entry(path.clone()) {
            std::collections::btree_map::Entry::Vacant(entry) => Some(entry.insert(reason).clone()),
            std::collections::btree_map::Entry::Occupied(_) => None,
        };
        if let Some(reason) = first {
            self.observer.failed(path, &reason);
        }
    }

    async fn substitute(self: Arc<Self>, store_dir: StoreDir, narinfo: Arc<NarInfo>, cache: usize, verdict: Option<Verdict>) {
        let path = narinfo.store_path.clone();
        let nar_size = narinfo.nar_size;
        match self.substitute_from(&store_dir, narinfo, cache, verdict).await {
            Ok(()) => {
                // Found valid after it was failed (for a cycle): it stays failed.
                if self.gate.set(&path, State::Valid) {
                    self.observer.done(&path, nar_size);
                }
            }
            Err(reason) => self.fail(&path, reason),
        }
    }

    /// Tries substituter `first` and then every other one that has the path, in priority
    /// order: those of higher priority too, whose answer that they lack it may have come from
    /// the disk cache and be stale (issue 38: the path is asked again of every cache).
    ///
    /// The closure was walked along the references of `narinfo`, and its paths wait for
    /// those: another substituter's narinfo (or a fresh one of the same substituter) is used
    /// only if it lists no other reference ([`Shared::within_walked`]). Nix would follow its
    /// references; here a path they add has not been looked up, and a cycle they close would
    /// not be seen. The fallbacks' lookups are boxed futures: rare, they would otherwise make
    /// every path's task larger for as long as it waits.
    async fn substitute_from(
        &self,
        store_dir: &StoreDir,
        narinfo: Arc<NarInfo>,
        first: usize,
        mut verdict: Option<Verdict>,
    ) -> Result<(), Failure> {
        let walked = narinfo.clone();
        let path = narinfo.store_path.clone();
        let shown = store_dir.display_path(&path);
        let mut errors = Vec::new();
        // `verdict`: what the closure engine or the dispatch decided of this first candidate's
        // signatures, if either checked them.
        let mut candidate = Some((narinfo, first));
        let mut others = (0..self.subs.len()).filter(|i| *i != first);
        let mut refetched = Vec::new();
        let mut last_failed = None;
        let mut eager = true;
        loop {
            if let Some((narinfo, i)) = candidate.take() {
                match self.try_substituter(store_dir, &narinfo, i, verdict.as_ref(), &mut eager).await {
                    Ok(()) => return Ok(()),
                    Err(Attempt::Yielded) => {
                        tracing::debug!("{shown}: gave its lock up to a queued path; downloading it again once its references are valid");
                        eager = false;
                        candidate = Some((narinfo, i));
                        continue;
                    }
                    Err(Attempt::Final(e)) => return Err(Failure { message: format!("{shown}: {}", e.message), ..e }),
                    Err(Attempt::TryNext(e)) => {
                        // The next candidates are other narinfos.
                        verdict = None;
                        errors.push(e);
                        last_failed = Some(i);
                        // A stale disk-cache entry gets one more try with the fresh narinfo.
                        if !refetched.contains(&i) {
                            refetched.push(i);
                            if let Some(fresh) = Box::pin(self.refetch_narinfo(store_dir, &narinfo, i)).await {
                                match self.within_walked(store_dir, &walked, &fresh, i) {
                                    Ok(()) => {
                                        candidate = Some((fresh, i));
                                        continue;
                                    }
                                    Err(e) => errors.push(e),
                                }
                            }
                        }
                    }
                }
            }
            let Some(i) = others.next() else { break };
            let sub = &self.subs[i];
            match Box::pin(sub.source.narinfo_text(&path)).await {
                Ok(Some(text)) => match sub.source.parse_narinfo(&path, store_dir, &text) {
                    Ok(ni) => match self.within_walked(store_dir, &walked, &ni, i) {
                        Err(e) => errors.push(e),
                        Ok(()) => {
                            // A cache that was given up on was reported once already.
                            let reported = last_failed.is_some_and(|j: usize| self.subs[j].source.is_disabled());
                            if let Some(last) = errors.last().filter(|_| !reported) {
                                self.observer.warning(&format!("{shown}: {}; trying {}", last.message, sub.source.url()));
                            }
                            candidate = Some((Arc::new(ni), i));
                        }
                    },
                    Err(e) => errors.push(Failure::cache(sub.source.url(), &e)),
                },
                Ok(None) => {}
                Err(e) => errors.push(Failure::cache(sub.source.url(), &e)),
            }
        }
        Err(Failure::combine(&shown, errors))
    }

    /// Whether substituter `i`'s `narinfo` lists only references that `walked` (the narinfo
    /// the closure was walked with) lists; else why it is not used.
    fn within_walked(&self, store_dir: &StoreDir, walked: &NarInfo, narinfo: &NarInfo, i: usize) -> Result<(), Failure> {
        let path = &narinfo.store_path;
        let others: Vec<String> = narinfo
            .references
            .iter()
            .filter(|r| *r != path && !walked.references.contains(r))
            .map(|r| format!("'{}'", store_dir.display_path(r)))
            .collect();
        if others.is_empty() {
            return Ok(());
        }
        let url = self.subs[i].source.narinfo_url(path);
        Err(Failure::other(format!(
            "{url}: not used: it lists references that the narinfo the closure was walked with does not ({})",
            others.join(", ")
        )))
    }

    /// After substituter `i` failed to provide `narinfo`'s path: drops its narinfo from the
    /// disk cache (it may be stale: the cache was rebuilt, the NAR deleted) and fetches it
    /// again. Returns the fresh narinfo when it differs from the one that failed, which it
    /// then records; one that does not differ stays out of the disk cache (its NAR is still
    /// missing or wrong: a later run asks the cache again rather than trusting it).
    async fn refetch_narinfo(&self, store_dir: &StoreDir, narinfo: &NarInfo, i: usize) -> Option<Arc<NarInfo>> {
        let sub = &self.subs[i];
        let (Some(disk), Some(id)) = (&self.disk, sub.disk_id) else { return None };
        let path = &narinfo.store_path;
        if let Err(e) = disk.forget(id, path.hash_part()) {
            tracing::warn!("{e}");
        }
        let text = sub.source.narinfo_text(path).await.ok()??;
        let fresh = sub.source.parse_narinfo(path, store_dir, &text).ok()?;
        if fresh == *narinfo {
            return None;
        }
        if let Err(e) = disk.record(&[(id, path.hash_part().to_string(), Some(text))]) {
            tracing::warn!("{e}");
        }
        Some(Arc::new(fresh))
    }
}
