//! Copying closures between any two stores through the [`Store`] interface (Nix's
//! `copyPaths`, `src/libstore/store-api.cc`, with the order of Nix 2.35's binary-cache
//! uploads): the closure is found in the source level by level (one batched query per level),
//! what the destination already has, contents included ([`Store::query_complete_paths`]), is
//! found and skipped, and every missing path is then transferred at once (the destination
//! having vouched for each path's signature or content address first, the source told to fetch
//! the NARs ahead, a daemon while it finds the closure: [`Store::closure_infos_fetching`]),
//! largest NAR first (in a dependency order from a store that sends its NARs one after the
//! other, [`Store::streams_nars_in_order`]), at most the destination's [`Store::parallelism`]
//! NARs being read at a time. A path becomes visible in the destination
//! (its narinfo written, its registration committed) only after every reference it has in the
//! copy did, so a reader never sees a path whose closure is incomplete, even if the copy is
//! killed. Paths in a reference cycle the source claims fail, with their dependents. Into a
//! store that takes a whole copy as one stream (a daemon, `ssh-ng://`, `ssh://`), the missing
//! paths go instead in one stream in dependency order ([`stream`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::sync::Arc;

use futures::future::{FutureExt, Shared};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::failure::Failure;
use crate::reference_cycles::reference_cycles;
use crate::store::{FoundLevel, NarReader, Store, StoreError};

mod stream;

pub use stream::dependency_order;

/// What a copy did.
#[derive(Debug, Default)]
pub struct PushReport {
    /// Paths added to the destination.
    pub copied: Vec<StorePath>,
    /// Paths of the closure the destination had already.
    pub already_valid: usize,
    /// Paths that could not be added, with the reason (its message names the path).
    pub failed: BTreeMap<StorePath, Failure>,
    /// Bytes of NAR read from the source.
    pub nar_bytes: u64,
}

/// The closure of `roots` in `src`: every path's info, found one level of references at a time
/// (the default of [`Store::closure_infos`]).
pub(crate) async fn closure_infos_by_level<S: Store + ?Sized>(
    src: &S,
    roots: &[StorePath],
) -> Result<BTreeMap<StorePath, ValidPathInfo>, StoreError> {
    let mut infos = BTreeMap::new();
    let mut frontier: Vec<StorePath> = roots.to_vec();
    while !frontier.is_empty() {
        let answers = src.query_path_infos(&frontier).await?;
        let mut next = BTreeSet::new();
        for (path, info) in frontier.iter().zip(answers) {
            let info =
                info.ok_or_else(|| StoreError::NotValid { url: src.url().to_string(), path: src.store_dir().display_path(path) })?.info;
            next.extend(info.references.iter().filter(|r| !infos.contains_key(*r) && *r != path).cloned());
            infos.insert(path.clone(), info);
        }
        frontier = next.into_iter().filter(|p| !infos.contains_key(p)).collect();
    }
    Ok(infos)
}

/// The closure of `roots` in `src` ([`Store::closure_infos_fetching`]), the NARs of the paths
/// `dst` lacks and would take fetched ahead while it is found from a source that sends its
/// NARs one after the other ([`Store::streams_nars_in_order`]), and the order they were asked
/// for in: each set of infos found, in a dependency order, so that a path whose references
/// came first is added at once. None is fetched ahead from another source (which fetches none
/// ahead), into a store that takes whole streams (they are asked for as the stream needs
/// them), nor where `dst` could not say what it lacks or would refuse a path.
async fn closure_fetching(
    src: &Arc<dyn Store>,
    dst: &Arc<dyn Store>,
    roots: &[StorePath],
) -> Result<(BTreeMap<StorePath, ValidPathInfo>, Vec<StorePath>), StoreError> {
    let (levels, mut found) = tokio::sync::mpsc::unbounded_channel::<FoundLevel>();
    let choose = async {
        let mut asked = Vec::new();
        while let Some(FoundLevel { infos, fetch }) = found.recv().await {
            let paths: Vec<StorePath> = infos.iter().map(|i| i.path.clone()).collect();
            let present = match dst.takes_streams() || !src.streams_nars_in_order() {
                true => None,
                false => dst.query_complete_paths(&paths).await.ok(),
            };
            let wanted: Vec<&ValidPathInfo> = match &present {
                None => Vec::new(),
                Some(present) => infos
                    .iter()
                    .filter(|i| !present.contains(&i.path) && dst.check_trust(&ValidPathInfo { ultimate: false, ..(*i).clone() }).is_ok())
                    .collect(),
            };
            let wanted: Vec<StorePath> = dependency_order(wanted).into_iter().map(|i| i.path.clone()).collect();
            asked.extend(wanted.iter().cloned());
            let _ = fetch.send(wanted);
        }
        asked
    };
    let (infos, asked) = tokio::join!(src.closure_infos_fetching(roots, levels), choose);
    Ok((infos?, asked))
}

/// Whether a path was added: shared by the paths that refer to it.
type Done = Shared<futures::future::BoxFuture<'static, Result<(), String>>>;

/// Copies the closures of `roots` from `src` to `dst` (see the module doc).
pub async fn copy_closures(src: Arc<dyn Store>, dst: Arc<dyn Store>, roots: &[StorePath]) -> Result<PushReport, StoreError> {
    let (infos, asked) = closure_fetching(&src, &dst, roots).await?;
    let all: Vec<StorePath> = infos.keys().cloned().collect();
    let (present, push) = dst.begin_push(&all).await?;
    let mut missing: Vec<&ValidPathInfo> = infos.values().filter(|i| !present.contains(&i.path)).collect();
    // In the order their NARs were asked for, so that the paths read them as they come; the
    // rest after them, largest first.
    let turns: HashMap<&StorePath, usize> = asked.iter().enumerate().map(|(i, p)| (p, i)).collect();
    let rank = |i: &ValidPathInfo| turns.get(&i.path).copied().unwrap_or(usize::MAX);
    missing.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| b.nar_size.cmp(&a.nar_size)).then_with(|| a.path.cmp(&b.path)));
    let mut report = PushReport { already_valid: present.len(), ..Default::default() };

    let slots = Arc::new(Semaphore::new(dst.parallelism().max(1)));
    let mut senders = HashMap::new();
    let mut done: HashMap<StorePath, Done> = HashMap::new();
    for info in &missing {
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        senders.insert(info.path.clone(), tx);
        done.insert(info.path.clone(), rx.map(|r| r.unwrap_or_else(|_| Err("the copy stopped".into()))).boxed().shared());
    }
    // Paths in a cycle the source claims would wait for each other for ever.
    for cycle in reference_cycles(missing.iter().map(|i| (&i.path, i.references.iter()))) {
        let message = cycle.message(dst.store_dir());
        for path in cycle.members {
            if let Some(tx) = senders.remove(&path) {
                let _ = tx.send(Err(message.clone()));
            }
            report.failed.insert(path.clone(), Failure::other(format!("{}: {message}", dst.store_dir().display_path(&path))));
        }
    }
    // Trust is decided before any NAR is transferred (built here is not built there).
    for info in &missing {
        if let Err(e) = dst.check_trust(&ValidPathInfo { ultimate: false, ..(*info).clone() }) {
            if let Some(tx) = senders.remove(&info.path) {
                let _ = tx.send(Err(e.to_string()));
            }
            report.failed.insert(info.path.clone(), Failure::copy(&dst.store_dir().display_path(&info.path), dst.url(), &e));
        }
    }
    missing.retain(|i| !report.failed.contains_key(&i.path));
    if dst.takes_streams() {
        stream::copy_as_stream(&src, &dst, missing, &mut report).await?;
        return Ok(report);
    }
    let mut tasks = Vec::with_capacity(missing.len());
    for info in missing {
        let gate_refs: Vec<(StorePath, Done)> =
            info.references.iter().filter(|r| **r != info.path).filter_map(|r| Some((r.clone(), done.get(r)?.clone()))).collect();
        let store_dir = dst.store_dir().clone();
        let shown = store_dir.display_path(&info.path);
        let gate = async move {
            for (reference, finished) in gate_refs {
                if finished.await.is_err() {
                    return Err(StoreError::ReferenceFailed { path: shown, reference: store_dir.display_path(&reference) });
                }
            }
            Ok(())
        }
        .boxed();
        let (src, dst, slots, info, tx) = (src.clone(), dst.clone(), slots.clone(), info.clone(), senders.remove(&info.path));
        tasks.push(tokio::spawn(async move {
            let shown = dst.store_dir().display_path(&info.path);
            let mut gate = Some(gate);
            let outcome = loop {
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    break Err(Failure::other(format!("{shown}: the push's slots were closed")));
                };
                let nar = match src.nar_from_path(&info).await {
                    Err(e) => break Err(Failure::copy(&shown, src.url(), &e)),
                    Ok(nar) => Box::new(SlotReader { inner: nar, permit: Some(permit) }) as NarReader,
                };
                // Its references were added before the first attempt.
                let gate = gate.take().unwrap_or_else(|| async { Ok(()) }.boxed());
                // Built here is not built there (Nix's `copyStorePath` clears `ultimate`).
                match dst.add_to_store(ValidPathInfo { ultimate: false, ..info.clone() }, nar, gate).await {
                    // Sent again, on its own verdict.
                    Err(StoreError::NotAttempted { .. }) => continue,
                    added => break added.map_err(|e| Failure::copy(&shown, dst.url(), &e)),
                }
            };
            if let Some(tx) = tx {
                let _ = tx.send(outcome.as_ref().map(|_| ()).map_err(|f| f.message.clone()));
            }
            (info.path, info.nar_size, outcome)
        }));
    }
    let mut joined = Ok(());
    for task in tasks {
        match task.await {
            Ok((path, size, Ok(()))) => {
                report.copied.push(path);
                report.nar_bytes += size;
            }
            Ok((path, _, Err(reason))) => {
                report.failed.insert(path, reason);
            }
            Err(e) => joined = Err(StoreError::Other(format!("copy task: {e}"))),
        }
    }
    // Every narinfo was answered (or will never be written): the push's fence comes down.
    if let Some(push) = push {
        dst.end_push(push).await?;
    }
    joined.map(|()| report)
}

/// A NAR reader holding one of the destination's transfer slots until the NAR has been read
/// to its end (or dropped): a path waiting for its references then holds none, so the paths
/// it waits for can always start.
struct SlotReader {
    inner: NarReader,
    permit: Option<OwnedSemaphorePermit>,
}

impl Read for SlotReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.permit = None;
        }
        Ok(n)
    }
}
