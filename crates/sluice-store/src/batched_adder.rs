//! [`BatchedAdder`]: paths that arrive one after another on one stream (a daemon's
//! AddMultipleToStore, the serve protocol's imports), each unpacked as it arrives (with
//! [`BatchedAdder::unpacking_ahead`], a small NAR is read whole and unpacked on the process's
//! unpacking threads, `unpack_pool.rs`, while the next ones arrive; a large one as it is read)
//! and handed, in the stream's order, to
//! a [`Registrar`] of the stream's own in groups, each group registered in one batch (one
//! flush, one transaction: [`LocalStore::commit_all`]) while the next is unpacked. A group is
//! handed over once it has [`GROUP`] paths, or [`SMALL_GROUP`] while the registrar is idle,
//! or when the stream ends: a short stream is one batch, and in a long one the registrar
//! works while paths arrive, so that little is left to register after the last. Nix adds, flushes and registers
//! each path of an AddMultipleToStore on its own (`Store::addMultipleToStore`,
//! `src/libstore/store-api.cc`; `LocalStore::addToStore`).
//!
//! Nothing is half-registered: a path is registered only in a batch that made its tree durable
//! first, and a path whose NAR is cut short is never handed over. A path refused at commit
//! stops the stream before the next group is handed, as Nix's stops at the first path it
//! refuses; the paths of its group that passed are registered whole.

use std::collections::{BTreeSet, VecDeque};
use std::io::Read;
use std::sync::Arc;

use sluice_local_store::{LocalStore, LocalStoreError, PendingPath, SignaturePolicy, TempRoots};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use crate::registrar::{Finished, Registered, Registrar};
use crate::unpack_pool;

/// Paths handed to the registrar at once, and so registered in one batch. At most twice as
/// many are unpacked and not registered (each holds its lock file open): the group being
/// gathered, and the one being registered.
const GROUP: usize = 256;

/// Paths handed over as a group while the registrar has nothing to do.
const SMALL_GROUP: usize = 32;

/// NARs of at most this many bytes are read whole and unpacked on the unpacking threads.
const BUFFERED_NAR: u64 = 1 << 20;

/// Most NARs read whole and not yet unpacked, with [`BatchedAdder::unpacking_ahead`] (so at
/// most this many MiB of them held).
const UNPACKING: usize = 16;

/// A path being unpacked on an unpacking thread: the path (for messages), and the path
/// unpacked, or why not.
type Unpacking = (String, tokio::sync::oneshot::Receiver<Result<Result<PendingPath, LocalStoreError>, String>>);

/// Adds the paths of one stream in order, registering them in batches (see the module doc).
pub struct BatchedAdder {
    store: Arc<LocalStore>,
    roots: TempRoots,
    policy: SignaturePolicy,
    /// Paths unpacked (a path sent twice is added once).
    handed: BTreeSet<StorePath>,
    /// Paths being unpacked, in the stream's order.
    unpacking: VecDeque<Unpacking>,
    /// Most paths unpacked on the unpacking threads at once (0: each on the caller's).
    ahead: usize,
    /// Unpacked paths of the next group.
    gathered: Vec<PendingPath>,
    /// Dropped at the end, so that the registrar's thread ends.
    registrar: Option<Registrar>,
    finished: Option<Finished>,
    /// How the paths of the group handed last end, those not known yet.
    registering: VecDeque<Registered>,
}

impl BatchedAdder {
    /// An adder into `store` under `policy`, keeping each path a temporary root in `roots`;
    /// starts its registrar.
    pub fn new(store: &Arc<LocalStore>, roots: &TempRoots, policy: SignaturePolicy) -> Self {
        let (registrar, finished) = Registrar::start(store.clone(), policy.clone());
        BatchedAdder {
            store: store.clone(),
            roots: roots.clone(),
            policy,
            handed: BTreeSet::new(),
            unpacking: VecDeque::new(),
            ahead: 0,
            gathered: Vec::new(),
            registrar: Some(registrar),
            finished: Some(finished),
            registering: VecDeque::new(),
        }
    }

    /// The adder, unpacking small NARs on the process's unpacking threads while the next ones
    /// arrive. For a stream whose paths are all answered at its end (AddMultipleToStore): a
    /// caller that settles whenever it has read everything sent so far would settle sooner
    /// and more often, each time with a batch of its own.
    pub fn unpacking_ahead(mut self) -> Self {
        self.ahead = UNPACKING;
        self
    }

    /// Adds `info`'s path from the NAR read from `nar` (exactly the NAR is read), or, if it
    /// is valid already (or was added before on this stream), reads nothing. It is refused
    /// before anything is read if the adder's policy does not vouch for it
    /// ([`SignaturePolicy::vouch`]; its signatures are then not verified again at its
    /// registration). With `repair`, a valid path's tree is replaced from `nar`
    /// ([`LocalStore::add_nar_if_missing`]). Fails with this path's own failure (its
    /// signatures, its NAR, its lock), or with the failure of an earlier path's registration.
    pub fn add(&mut self, info: ValidPathInfo, nar: &mut dyn Read, repair: bool) -> Result<(), LocalStoreError> {
        let vouched = self.policy.vouch_info(self.store.store_dir(), info)?;
        if repair {
            self.store.add_nar_if_missing(vouched.info().clone(), nar, &self.policy, &self.roots, true)?;
            return Ok(());
        }
        if self.handed.contains(&vouched.info().path) {
            return Ok(());
        }
        let path = vouched.info().path.clone();
        let Some(mut pending) = self.store.begin_add_vouched(vouched, &self.roots)? else { return Ok(()) };
        let nar_size = pending.info().nar_size;
        let mut buffered = Vec::new();
        let read = match nar_size <= BUFFERED_NAR && self.ahead > 0 {
            true => (&mut *nar).take(nar_size).read_to_end(&mut buffered).ok(),
            false => None,
        };
        match read {
            Some(n) if n as u64 == nar_size => {
                let shown = self.store.store_dir().display_path(&path);
                let unpack = move || pending.unpack(&mut buffered.as_slice()).map(|_| pending);
                self.unpacking.push_back((shown, unpack_pool::submit(Default::default(), unpack)));
                self.collect(self.ahead)?;
            }
            _ => {
                // A large NAR, or one cut short (its unpacking reads what was read, then
                // meets the end or the error again): unpacked here, after the others.
                self.collect(0)?;
                pending.unpack(&mut buffered.as_slice().chain(nar))?;
                self.gathered.push(pending);
            }
        }
        self.handed.insert(path);
        let gathered = self.gathered.len();
        match gathered >= GROUP || (gathered >= SMALL_GROUP && self.unless_refused(Self::registered)?) {
            true => self.hand(),
            false => Ok(()),
        }
    }

    /// Waits until every path added is registered; the first failure.
    pub fn finish(mut self) -> Result<(), LocalStoreError> {
        self.collect(0)?;
        self.hand()?;
        self.settle()
    }

    /// Moves the paths unpacked at the front of the stream's order into the group being
    /// gathered, waiting for them while more than `keep` are being unpacked; the first
    /// failure (that path's: its NAR).
    fn collect(&mut self, keep: usize) -> Result<(), LocalStoreError> {
        while let Some((shown, mut front)) = self.unpacking.pop_front() {
            let done = match front.try_recv() {
                Ok(done) => Ok(done),
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) if self.unpacking.len() < keep => {
                    self.unpacking.push_front((shown, front));
                    return Ok(());
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => front.blocking_recv().map_err(|_| "stopped".to_owned()),
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => Err("stopped".to_owned()),
            };
            let unpacked = done.and_then(|d| d).map_err(|why| {
                tracing::warn!("unpacking {shown}: {why}");
                LocalStoreError::Misuse { path: shown, what: "its unpacking thread stopped" }
            })?;
            self.gathered.push(unpacked?);
        }
        Ok(())
    }

    /// Waits for the group handed before ([`BatchedAdder::settle`]), then hands the gathered
    /// paths over as the next group.
    fn hand(&mut self) -> Result<(), LocalStoreError> {
        self.unless_refused(Self::settle)?;
        let group = std::mem::take(&mut self.gathered);
        if group.is_empty() {
            return Ok(());
        }
        let group = group.into_iter().map(|p| (p, false)).collect();
        self.registering = self.registrar.as_ref().and_then(|r| r.hand_all(group)).ok_or_else(stopped)?.into();
        Ok(())
    }

    /// Waits until the group handed last is registered; the first failure among its paths.
    fn settle(&mut self) -> Result<(), LocalStoreError> {
        for registered in self.registering.drain(..) {
            registered.blocking_recv().map_err(|_| stopped())?.map_err(|uncommitted| uncommitted.into_error())?;
        }
        Ok(())
    }

    /// Whether the group handed last is registered, without waiting; the first failure among
    /// its paths known so far.
    fn registered(&mut self) -> Result<bool, LocalStoreError> {
        while let Some(first) = self.registering.front_mut() {
            let result = match first.try_recv() {
                Ok(result) => result,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => return Ok(false),
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => return Err(stopped()),
            };
            self.registering.pop_front();
            result.map_err(|uncommitted| uncommitted.into_error())?;
        }
        Ok(true)
    }

    /// `check`'s answer; if it is a path's refusal, the gathered paths are given up (their
    /// trees and locks go): the stream stops at the first path refused.
    fn unless_refused<T>(&mut self, check: fn(&mut Self) -> Result<T, LocalStoreError>) -> Result<T, LocalStoreError> {
        let checked = check(self);
        if checked.is_err() {
            self.gathered.clear();
        }
        checked
    }
}

impl Drop for BatchedAdder {
    /// The paths unpacked are whole: they are registered (a stream cut after them keeps them).
    /// Returns once the registrar's thread has ended, so that the store can be closed.
    fn drop(&mut self) {
        while !self.unpacking.is_empty() {
            if let Err(e) = self.collect(0) {
                tracing::debug!("unpacking the paths of a stream cut short: {e}");
            }
        }
        if let Err(e) = self.hand().and_then(|()| self.settle()) {
            tracing::debug!("registering the paths of a stream cut short: {e}");
        }
        self.registrar = None;
        if let Some(finished) = self.finished.take() {
            finished.wait();
        }
    }
}

/// The error of a registrar that stopped.
fn stopped() -> LocalStoreError {
    LocalStoreError::Misuse { path: "the registrar".into(), what: "stopped" }
}
