//! The connection thread of a [`DaemonStore`](super::DaemonStore): operations in turn, and
//! additions in batches. When the thread comes to an addition, every addition queued behind it
//! (up to the next other operation) goes with it in one AddMultipleToStore, as Nix's
//! `copyPaths` sends a whole closure into a daemon (`RemoteStore::addMultipleToStore`,
//! `remote-store.cc`): one round trip, and one wait for the daemon's answer, per batch instead
//! of per path. A daemon older than protocol 1.32 gets one AddToStoreNar per path.

use std::io::Read;
use std::sync::mpsc::Receiver;

use sluice_nix::path_info::ValidPathInfo;

use super::daemon_store::{Job, Reconnecting};
use crate::store::{NarReader, StoreError};

/// The protocol minor version from which a daemon takes AddMultipleToStore (1.32, Nix 2.4).
pub(super) const MULTIPLE_VERSION: u8 = 32;

/// A path to add: its info, its NAR (read when the batch is sent), and where its answer goes.
pub(super) struct Addition {
    pub(super) info: ValidPathInfo,
    pub(super) nar: NarReader,
    pub(super) done: tokio::sync::oneshot::Sender<Result<(), StoreError>>,
}

/// Runs the jobs of `queue` on `conn` until every sender is gone; additions ask the daemon
/// to check signatures when `check_sigs`.
pub(super) fn serve(conn: &mut Reconnecting, queue: &Receiver<Job>, check_sigs: bool) {
    let mut next = None;
    while let Some(job) = next.take().or_else(|| queue.recv().ok()) {
        match job {
            Job::Run(op) => op(conn),
            Job::Add(first) => {
                let mut batch = vec![first];
                while let Ok(job) = queue.try_recv() {
                    match job {
                        Job::Add(addition) => batch.push(addition),
                        other => {
                            next = Some(other);
                            break;
                        }
                    }
                }
                add(conn, batch, check_sigs);
            }
        }
    }
}

/// Adds `batch` (paths none of which refers to another: each was queued once its references
/// were added) and answers each addition. When a batch fails, the daemon has added the
/// paths before the one it refused (it adds them in order, as Nix's `addMultipleToStore`):
/// those it now has valid are answered as added, the first it does not have with the failure
/// (it is the path refused), the others as [`StoreError::NotAttempted`].
fn add(conn: &mut Reconnecting, mut batch: Vec<Addition>, check_sigs: bool) {
    let multiple = conn.with(|c| Ok(c.version().at_least(MULTIPLE_VERSION))).unwrap_or(false);
    if !multiple {
        for mut a in batch {
            let added = conn.with(|c| c.add_to_store_nar(&a.info, &mut a.nar, check_sigs));
            let _ = a.done.send(added.map_err(StoreError::from));
        }
        return;
    }
    tracing::debug!("AddMultipleToStore of {} paths", batch.len());
    let added = conn.with(|c| {
        let mut paths: Vec<(&ValidPathInfo, &mut dyn Read)> = batch.iter_mut().map(|a| (&a.info, &mut a.nar as &mut dyn Read)).collect();
        c.add_multiple_to_store(&mut paths, check_sigs)
    });
    match added {
        Ok(()) => batch.into_iter().for_each(|a| drop(a.done.send(Ok(())))),
        Err(e) if batch.len() == 1 => {
            let _ = batch.remove(0).done.send(Err(e.into()));
        }
        Err(e) => {
            let failure = e.to_string();
            let mut refused: Option<String> = None;
            for a in batch {
                let valid = conn.with(|c| c.is_valid_path(&a.info.path)).unwrap_or(false);
                let answer = match (valid, &refused) {
                    (true, _) => Ok(()),
                    (false, None) => {
                        refused = Some(format!("'{}'", a.info.path.base_name()));
                        Err(StoreError::Other(failure.clone()))
                    }
                    (false, Some(first)) => Err(StoreError::NotAttempted { refused: first.clone() }),
                };
                let _ = a.done.send(answer);
            }
        }
    }
}
