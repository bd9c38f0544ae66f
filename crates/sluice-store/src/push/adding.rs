//! The additions of a copy ([`crate::push::copy_closures`]), each a task of its own that reads
//! its NAR from the source and adds the path to the destination once every reference of it in
//! the copy was added (Nix's `copyPaths`, `src/libstore/store-api.cc`, adds in a topological
//! order). Tasks may start while the closure is still being found: each path's outcome is a
//! [`Done`] made when the path is first named, by itself or by a path referring to it, and
//! settled when it is known (added, failed, or not to be added at all), and no path is
//! published before [`Adding::begun`] (the destination's [`Store::begin_push`] answered).

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::sync::{Arc, Mutex};

use futures::future::{FutureExt, Shared};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use crate::failure::Failure;
use crate::store::{NarReader, Store, StoreError};

/// Whether a path was added: shared by the paths that refer to it.
type Done = Shared<futures::future::BoxFuture<'static, Result<(), String>>>;

/// The sending ends of the [`Done`]s not settled yet, by path.
type Settling = Arc<Mutex<HashMap<StorePath, oneshot::Sender<Result<(), String>>>>>;

/// What a task ends with: the path, its NAR's size, and whether it was added.
pub(super) type Outcome = (StorePath, u64, Result<(), Failure>);

/// The additions of one copy from `src` into `dst` (see the module doc).
pub(super) struct Adding {
    src: Arc<dyn Store>,
    dst: Arc<dyn Store>,
    /// The destination's [`Store::parallelism`]: NARs read at once.
    slots: Arc<Semaphore>,
    done: HashMap<StorePath, Done>,
    settling: Settling,
    /// Once the closure is known, the paths the copy adds (or fails to).
    missing: Option<BTreeSet<StorePath>>,
    /// Opened once the destination answered [`Store::begin_push`]; until then no path is
    /// published (it is dropped, failing the paths waiting, if the copy stops first).
    begun: (Option<oneshot::Sender<()>>, Shared<oneshot::Receiver<()>>),
    /// The paths whose tasks were started, in that order, and the tasks.
    started: BTreeSet<StorePath>,
    tasks: Vec<tokio::task::JoinHandle<Outcome>>,
}

impl Adding {
    /// No additions yet, from `src` into `dst`.
    pub(super) fn new(src: Arc<dyn Store>, dst: Arc<dyn Store>) -> Self {
        let slots = Arc::new(Semaphore::new(dst.parallelism().max(1)));
        let (begun, opened) = oneshot::channel();
        Adding {
            src,
            dst,
            slots,
            done: HashMap::new(),
            settling: Settling::default(),
            missing: None,
            begun: (Some(begun), opened.shared()),
            started: BTreeSet::new(),
            tasks: Vec::new(),
        }
    }

    /// The outcome of `path`, made now if it was not named before (settled as added if the
    /// copy is known not to add it).
    fn done(&mut self, path: &StorePath) -> &Done {
        let (settling, missing) = (&self.settling, &self.missing);
        self.done.entry(path.clone()).or_insert_with(|| {
            if missing.as_ref().is_some_and(|m| !m.contains(path)) {
                return futures::future::ready(Ok(())).boxed().shared();
            }
            let (tx, rx) = oneshot::channel::<Result<(), String>>();
            settling.lock().unwrap_or_else(|p| p.into_inner()).insert(path.clone(), tx);
            rx.map(|r| r.unwrap_or_else(|_| Err("the copy stopped".into()))).boxed().shared()
        })
    }

    /// Settles the outcome of `path` (named now if it was not), if it is not settled yet.
    pub(super) fn settle(&mut self, path: &StorePath, outcome: Result<(), String>) {
        self.done(path);
        settle(&self.settling, path, outcome);
    }

    /// Settles as added every path that is not `missing` nor started, named so far or later:
    /// paths the destination has (or that are no part of the copy) hold up none of their
    /// referrers.
    pub(super) fn settle_present(&mut self, missing: BTreeSet<StorePath>) {
        for path in self.done.keys().filter(|p| !missing.contains(*p) && !self.started.contains(*p)) {
            settle(&self.settling, path, Ok(()));
        }
        self.missing = Some(missing.into_iter().chain(self.started.iter().cloned()).collect());
    }

    /// The destination answered [`Store::begin_push`]: paths may be published.
    pub(super) fn begin(&mut self) {
        if let Some(begun) = self.begun.0.take() {
            let _ = begun.send(());
        }
    }

    /// How many tasks were started.
    pub(super) fn started_count(&self) -> usize {
        self.started.len()
    }

    /// Whether the task of `path` was started.
    pub(super) fn started(&self, path: &StorePath) -> bool {
        self.started.contains(path)
    }

    /// Starts the task adding `info`'s path: it takes a slot, reads the NAR, and adds the path
    /// once [`begin`](Self::begin) and each of its references in the copy was added.
    pub(super) fn start(&mut self, info: &ValidPathInfo) {
        if !self.started.insert(info.path.clone()) {
            return;
        }
        self.done(&info.path);
        let gate_refs: Vec<(StorePath, Done)> =
            info.references.iter().filter(|r| **r != info.path).map(|r| (r.clone(), self.done(r).clone())).collect();
        let store_dir = self.dst.store_dir().clone();
        let shown = store_dir.display_path(&info.path);
        let begun = self.begun.1.clone();
        let gate = async move {
            if begun.await.is_err() {
                return Err(StoreError::Other(format!("{shown}: the copy stopped")));
            }
            for (reference, finished) in gate_refs {
                if finished.await.is_err() {
                    return Err(StoreError::ReferenceFailed { path: shown, reference: store_dir.display_path(&reference) });
                }
            }
            Ok(())
        }
        .boxed();
        let (src, dst, slots, info, settling) =
            (self.src.clone(), self.dst.clone(), self.slots.clone(), info.clone(), self.settling.clone());
        self.tasks.push(tokio::spawn(async move {
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
            settle(&settling, &info.path, outcome.as_ref().map(|_| ()).map_err(|f| f.message.clone()));
            (info.path, info.nar_size, outcome)
        }));
    }

    /// Waits for every task started; their outcomes, or the first task that could not be
    /// joined.
    pub(super) async fn join(self) -> (Vec<Outcome>, Result<(), StoreError>) {
        let (mut outcomes, mut joined) = (Vec::with_capacity(self.tasks.len()), Ok(()));
        for task in self.tasks {
            match task.await {
                Ok(outcome) => outcomes.push(outcome),
                Err(e) => joined = Err(StoreError::Other(format!("copy task: {e}"))),
            }
        }
        (outcomes, joined)
    }

    /// Stops the copy: every task started is cancelled (a NAR being unpacked is finished and
    /// dropped) and waited for.
    pub(super) async fn stop(self) {
        self.tasks.iter().for_each(|t| t.abort());
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Settles the outcome of `path` in `settling`, if it is not settled yet.
fn settle(settling: &Settling, path: &StorePath, outcome: Result<(), String>) {
    if let Some(tx) = settling.lock().unwrap_or_else(|p| p.into_inner()).remove(path) {
        let _ = tx.send(outcome);
    }
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
