//! [`BatchedAdder`]: paths that arrive one after another on one stream (a daemon's
//! AddMultipleToStore, the serve protocol's imports), each unpacked as it arrives, committed by
//! a registrar thread in batches of [`COMMIT_BATCH`] paths (and the rest once the stream ends),
//! each with one flush and one transaction ([`LocalStore::commit_all`], as the substitution
//! pipeline's registrar commits, sluice-store `substitute.rs`), while the next batch is
//! unpacked. Nix adds, flushes and registers each path of an AddMultipleToStore on its own
//! (`Store::addMultipleToStore`, `src/libstore/store-api.cc`; `LocalStore::addToStore`).
//!
//! Nothing is half-registered: a path is registered only in a batch that made its tree durable
//! first, and a path whose NAR is cut short is never handed over. A path refused at commit
//! stops the stream, as Nix's stops at the first path it refuses; the paths of its batch that
//! passed are registered whole.

use std::collections::BTreeSet;
use std::io::Read;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use crate::error::io_err;
use crate::{LocalStore, LocalStoreError, PendingPath, SignaturePolicy, TempRoots};

/// Most paths committed in one batch, and most unpacked paths waiting for the registrar (each
/// holds its lock file open).
const COMMIT_BATCH: usize = 256;

/// Adds the paths of one stream in order, committing them in batches (see the module doc).
pub struct BatchedAdder {
    store: Arc<LocalStore>,
    roots: TempRoots,
    policy: SignaturePolicy,
    /// Paths handed to the registrar (a path sent twice is added once).
    handed: BTreeSet<StorePath>,
    to_registrar: Option<SyncSender<PendingPath>>,
    registrar: Option<JoinHandle<()>>,
    /// The first failure of a commit.
    failed: Arc<Mutex<Option<LocalStoreError>>>,
}

impl BatchedAdder {
    /// An adder into `store` under `policy`, keeping each path a temporary root in `roots`;
    /// starts its registrar thread.
    pub fn new(store: &Arc<LocalStore>, roots: &TempRoots, policy: SignaturePolicy) -> Result<Self, LocalStoreError> {
        let (to_registrar, arrivals) = sync_channel(COMMIT_BATCH);
        let failed = Arc::new(Mutex::new(None));
        let registrar = {
            let (store, policy, failed) = (store.clone(), policy.clone(), failed.clone());
            std::thread::Builder::new().name("sluice-registrar".into()).spawn(move || register(&store, &policy, &arrivals, &failed))
        };
        let registrar = registrar.map_err(io_err("starting the registrar thread of", &store.layout.real_store_dir))?;
        Ok(BatchedAdder {
            store: store.clone(),
            roots: roots.clone(),
            policy,
            handed: BTreeSet::new(),
            to_registrar: Some(to_registrar),
            registrar: Some(registrar),
            failed,
        })
    }

    /// Adds `info`'s path from the NAR read from `nar` (exactly the NAR is read), or, if it
    /// is valid already (or was added before on this stream), reads nothing. With `repair`, a
    /// valid path's tree is replaced from `nar` ([`LocalStore::add_nar_if_missing`]). Fails
    /// with this path's own failure (its NAR, its lock), or with the failure of an earlier
    /// path's commit.
    pub fn add(&mut self, info: ValidPathInfo, nar: &mut dyn Read, repair: bool) -> Result<(), LocalStoreError> {
        self.check()?;
        if repair {
            self.store.add_nar_if_missing(info, nar, &self.policy, &self.roots, true)?;
            return Ok(());
        }
        if self.handed.contains(&info.path) {
            return Ok(());
        }
        let path = info.path.clone();
        let Some(mut pending) = self.store.begin_add(info, &self.roots)? else { return Ok(()) };
        pending.unpack(nar)?;
        self.handed.insert(path);
        let sent = self.to_registrar.as_ref().map(|r| r.send(pending).is_ok());
        match sent {
            Some(true) => Ok(()),
            _ => self.check().and(Err(LocalStoreError::Misuse { path: "the registrar".into(), what: "stopped" })),
        }
    }

    /// Waits until every path handed over is committed; the first failure.
    pub fn finish(mut self) -> Result<(), LocalStoreError> {
        self.stop();
        self.check()
    }

    /// The first failure of a commit so far.
    fn check(&self) -> Result<(), LocalStoreError> {
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Lets the registrar commit what it was handed, and waits for it.
    fn stop(&mut self) {
        self.to_registrar = None;
        if let Some(registrar) = self.registrar.take() {
            let _ = registrar.join();
        }
    }
}

impl Drop for BatchedAdder {
    /// The paths handed over are whole: they are committed (a stream cut after them keeps them).
    fn drop(&mut self) {
        self.stop();
    }
}

/// The registrar: commits what `arrivals` brings in batches of [`COMMIT_BATCH`] until it ends
/// (then the rest), or until a path fails (the paths after it are dropped, uncommitted); that
/// failure goes into `failed`.
fn register(store: &LocalStore, policy: &SignaturePolicy, arrivals: &Receiver<PendingPath>, failed: &Mutex<Option<LocalStoreError>>) {
    loop {
        let batch: Vec<(PendingPath, &SignaturePolicy)> = arrivals.iter().take(COMMIT_BATCH).map(|p| (p, policy)).collect();
        if batch.is_empty() {
            return;
        }
        tracing::debug!("committing {} paths", batch.len());
        if let Some(e) = store.commit_all(batch).into_iter().find_map(Result::err) {
            *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.into_error());
            return;
        }
    }
}
