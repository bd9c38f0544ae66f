//! The connection thread of a [`DaemonStore`](super::DaemonStore): operations in turn, and
//! additions in batches. When the thread comes to an addition, every addition queued behind it
//! (up to the next other operation) goes with it in one AddMultipleToStore, as Nix's
//! `copyPaths` sends a whole closure into a daemon (`RemoteStore::addMultipleToStore`,
//! `remote-store.cc`): one round trip, and one wait for the daemon's answer, per batch instead
//! of per path. A daemon older than protocol 1.32 gets one AddToStoreNar per path.

use std::sync::mpsc::Receiver;

use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use super::daemon_store::{Job, Reconnecting};
use super::RemoteError;
use crate::store::{AdditionStream, NarReader, StoreError, StreamOutcomes};

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
/// were added) and answers each addition ([`answers`]).
fn add(conn: &mut Reconnecting, mut batch: Vec<Addition>, check_sigs: bool) {
    let multiple = conn.with(|c| Ok(c.version().at_least(MULTIPLE_VERSION))).unwrap_or(false);
    if !multiple {
        let mut broken = None;
        for mut a in batch {
            let added = one_by_one(conn, &mut broken, |c| c.add_to_store_nar(&a.info, &mut a.nar, check_sigs));
            let _ = a.done.send(added);
        }
        return;
    }
    tracing::debug!("AddMultipleToStore of {} paths", batch.len());
    let count = batch.len();
    let added = conn.with(|c| c.add_multiple_to_store(count, batch.iter_mut().map(|a| (&a.info, &mut a.nar)), check_sigs));
    let paths: Vec<StorePath> = batch.iter().map(|a| a.info.path.clone()).collect();
    let answers = answers(conn, &paths, added);
    for (a, (_, answer)) in batch.into_iter().zip(answers) {
        let _ = a.done.send(answer);
    }
}

/// Adds the `count` paths `additions` brings (in dependency order) in one AddMultipleToStore
/// (one AddToStoreNar each, in turn, before protocol 1.32), each NAR read as its turn comes;
/// the outcome of each path received ([`Store::add_stream`](crate::store::Store::add_stream)).
/// A daemon that could not be reached before a path was sent is the error.
pub(super) fn add_stream(
    conn: &mut Reconnecting,
    count: usize,
    mut additions: AdditionStream,
    check_sigs: bool,
) -> Result<StreamOutcomes, StoreError> {
    let multiple = conn.with(|c| Ok(c.version().at_least(MULTIPLE_VERSION))).unwrap_or(false);
    if !multiple {
        let (mut outcomes, mut broken) = (Vec::with_capacity(count), None);
        while let Some(mut p) = additions.blocking_recv() {
            let added = one_by_one(conn, &mut broken, |c| c.add_to_store_nar(&p.info, &mut p.nar, check_sigs));
            outcomes.push((p.info.path, added));
        }
        return Ok(outcomes);
    }
    let mut sent = Vec::with_capacity(count);
    tracing::debug!("AddMultipleToStore of {count} paths, as one stream");
    let paths = std::iter::from_fn(|| additions.blocking_recv()).map(|p| {
        sent.push(p.info.path.clone());
        (p.info, p.nar)
    });
    match conn.with(|c| c.add_multiple_to_store(count, paths, check_sigs)) {
        Err(e) if sent.is_empty() => Err(e.into()),
        added => Ok(answers(conn, &sent, added)),
    }
}

/// Runs `add` (one path's AddToStoreNar) unless the connection failed for an earlier path
/// of the batch (`broken`, which a connection failure sets): the paths after it fail with
/// that failure, without connecting again to a far end that just failed or stalled.
fn one_by_one(
    conn: &mut Reconnecting,
    broken: &mut Option<String>,
    add: impl FnOnce(&mut super::DaemonConnection) -> Result<(), RemoteError>,
) -> Result<(), StoreError> {
    if let Some(failure) = broken {
        return Err(StoreError::Other(failure.clone()));
    }
    conn.with(add).map_err(|e| {
        if e.is_connection_failure() {
            *broken = Some(e.to_string());
        }
        e.into()
    })
}

/// The answer for each of `paths`, sent in this order in one AddMultipleToStore whose outcome
/// is `added`. When the daemon refused a path, it has added the paths before it (it adds them
/// in order, as Nix's `addMultipleToStore`): those it now has valid (asked in one query) are
/// answered as added, the first it does not have with the failure (it is the path refused),
/// the others as [`StoreError::NotAttempted`]. When the connection failed
/// ([`RemoteError::is_connection_failure`]), every path fails with that failure: the daemon is
/// not asked again (a far end that stalled would be waited on as long again), and a path it
/// did add is found valid by the next copy.
fn answers(conn: &mut Reconnecting, paths: &[StorePath], added: Result<(), RemoteError>) -> StreamOutcomes {
    let e = match added {
        Ok(()) => return paths.iter().map(|p| (p.clone(), Ok(()))).collect(),
        Err(e) if paths.len() == 1 => return vec![(paths[0].clone(), Err(e.into()))],
        Err(e) if e.is_connection_failure() => {
            let failure = e.to_string();
            return paths.iter().map(|p| (p.clone(), Err(StoreError::Other(failure.clone())))).collect();
        }
        Err(e) => e,
    };
    let failure = e.to_string();
    let valid = conn.with(|c| c.query_path_infos(paths)).unwrap_or_default();
    let mut refused: Option<String> = None;
    let answer = |(path, valid): (&StorePath, Option<&Option<ValidPathInfo>>)| {
        let answer = match (valid.is_some_and(Option::is_some), &refused) {
            (true, _) => Ok(()),
            (false, None) => {
                refused = Some(format!("'{}'", path.base_name()));
                Err(StoreError::Other(failure.clone()))
            }
            (false, Some(first)) => Err(StoreError::NotAttempted { refused: first.clone() }),
        };
        (path.clone(), answer)
    };
    paths.iter().zip(valid.iter().map(Some).chain(std::iter::repeat(None))).map(answer).collect()
}
