//! Committing unpacked paths in batches: verification, rename into place, one flush (an `fsync`
//! per single-file path and one of the store directory for a few such paths, else one
//! `syncfs`) and one transaction per batch (Nix registers each substituted path on its own, in
//! `LocalStore::addToStore` of `src/libstore/local-store.cc`; a batch keeps its guarantees:
//! nothing is registered before its tree is durable, nothing stays at a final path
//! unregistered).

use std::collections::BTreeSet;
use std::os::fd::AsFd;

use rustix::fs::{fstat, fsync, openat, syncfs, FileType, Mode, OFlags};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use super::{io_err, tree, LocalStore, LocalStoreError, PendingPath, SignaturePolicy};

/// Why [`LocalStore::commit_all`] did not register a path.
pub enum Uncommitted {
    /// It failed (verification, rename, `syncfs`, transaction): its temporary tree and lock are
    /// gone with it, and nothing is at its final path.
    Failed(LocalStoreError),
    /// A reference of it is not valid (it failed earlier in the batch, or is not registered):
    /// the path is handed back as it was, its tree unpacked and its lock held, to be committed
    /// again once that reference is valid. The error
    /// ([`LocalStoreError::MissingReference`]) names the reference.
    Waiting(Box<PendingPath>, LocalStoreError),
}

impl Uncommitted {
    /// The reason, giving a handed-back path up (its tree and lock are released).
    pub fn into_error(self) -> LocalStoreError {
        match self {
            Uncommitted::Failed(e) | Uncommitted::Waiting(_, e) => e,
        }
    }
}

impl std::fmt::Debug for Uncommitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Uncommitted::Failed(e) => f.debug_tuple("Failed").field(e).finish(),
            Uncommitted::Waiting(pending, e) => f.debug_tuple("Waiting").field(&pending.shown()).field(e).finish(),
        }
    }
}

/// What the first pass of a batch did with one path.
enum Placed {
    /// Renamed into place; the derivation outputs to register with it.
    Yes(Vec<(String, StorePath)>),
    Waiting(LocalStoreError),
    Failed(LocalStoreError),
}

impl LocalStore {
    /// Commits unpacked paths, each under its own policy, given in dependency order (a path
    /// comes after those of its references that are in `batch`): each passes the
    /// verification boundary and is moved into place as by [`PendingPath::commit`], then one
    /// flush makes them durable (`LocalStore::make_durable`) and one transaction registers all that were placed (a
    /// registration time of 0 becomes now, as in Nix's `registerValidPath`).
    ///
    /// Returns one result per path, in order. A path with a reference that is neither valid
    /// nor placed earlier in the batch is handed back ([`Uncommitted::Waiting`]); a path that
    /// fails otherwise is given up ([`Uncommitted::Failed`]); neither is registered, and
    /// nothing is left at its final path. If the flush or the transaction fails, every
    /// placed path fails.
    pub fn commit_all(&self, batch: Vec<(PendingPath, &SignaturePolicy)>) -> Vec<Result<(), Uncommitted>> {
        let mut placed = BTreeSet::new();
        // The references outside the batch, checked in one query rather than one per path; a
        // failed query leaves each path to check its own.
        let in_batch: BTreeSet<&StorePath> = batch.iter().map(|(p, _)| &p.info.path).collect();
        let outside: BTreeSet<&StorePath> = batch.iter().flat_map(|(p, _)| &p.info.references).filter(|r| !in_batch.contains(r)).collect();
        let known_valid = self.registry.valid_paths(outside.into_iter()).unwrap_or_default();
        let mut outcomes = Vec::with_capacity(batch.len());
        for (pending, policy) in &batch {
            let info = &pending.info;
            let unplaced = info.references.iter().find(|r| **r != info.path && in_batch.contains(r) && !placed.contains(*r));
            let outcome = match unplaced {
                Some(r) => {
                    Placed::Waiting(LocalStoreError::MissingReference { path: pending.shown(), reference: self.store_dir.display_path(r) })
                }
                None => match pending.place(policy, &placed, &known_valid) {
                    Ok(outputs) => {
                        placed.insert(info.path.clone());
                        Placed::Yes(outputs)
                    }
                    Err(e @ LocalStoreError::MissingReference { .. }) => Placed::Waiting(e),
                    Err(e) => Placed::Failed(e),
                },
            };
            outcomes.push(outcome);
        }
        let registered = match placed.is_empty() {
            true => Ok(()),
            false => self.register_placed(&batch, &mut outcomes),
        };
        batch
            .into_iter()
            .zip(outcomes)
            .map(|((pending, _), outcome)| match (outcome, &registered) {
                (Placed::Yes(_), Ok(())) => Ok(()),
                (Placed::Yes(_), Err(e)) => {
                    if !pending.repair {
                        // Nothing stays at a store path's location unregistered.
                        let _ = tree::remove_tree(self.store_fd.as_fd(), pending.info.path.base_name().as_bytes());
                    }
                    Err(Uncommitted::Failed(LocalStoreError::Registration { path: pending.shown(), reason: e.to_string() }))
                }
                (Placed::Waiting(e), _) => Err(Uncommitted::Waiting(Box::new(pending), e)),
                (Placed::Failed(e), _) => Err(Uncommitted::Failed(e)),
            })
            .collect()
    }

    /// Makes the placed paths of `batch` durable ([`LocalStore::make_durable`], unless
    /// `fsync-store-paths` is off) and registers them in one
    /// transaction, but for repairs, which stay registered as they were. Takes the outputs out
    /// of `outcomes`.
    fn register_placed(&self, batch: &[(PendingPath, &SignaturePolicy)], outcomes: &mut [Placed]) -> Result<(), LocalStoreError> {
        if !self.no_fsync.load(std::sync::atomic::Ordering::Relaxed) {
            let placed = batch.iter().zip(outcomes.iter()).filter(|(_, o)| matches!(o, Placed::Yes(_))).map(|((p, _), _)| &p.info.path);
            self.make_durable(placed.collect())?;
        }
        let items: Vec<(&ValidPathInfo, Vec<(String, StorePath)>)> = batch
            .iter()
            .zip(outcomes.iter_mut())
            .filter_map(|((p, _), outcome)| match outcome {
                Placed::Yes(outputs) if !p.repair => Some((&p.info, std::mem::take(outputs))),
                _ => None,
            })
            .collect();
        match items.is_empty() {
            true => Ok(()),
            false => self.registry.register_all(&items),
        }
    }

    /// Makes the trees of `placed` (at their locations in the store directory) and their
    /// entries there durable, as Nix's `fsync-store-paths` does (`recursiveSync`,
    /// `syncParent`): when they are at most [`FSYNC_PATHS`] single regular files (text
    /// additions, `.drv` files, flat files), an `fsync` of each and one of the store
    /// directory; otherwise one `syncfs` of the store's file system, which flushes whatever
    /// else is pending on it too.
    fn make_durable(&self, placed: Vec<&StorePath>) -> Result<(), LocalStoreError> {
        let files = match placed.len() <= FSYNC_PATHS {
            true => placed.iter().map(|p| self.open_single_file(p)).collect::<Option<Vec<_>>>(),
            false => None,
        };
        let store = &self.layout.real_store_dir;
        let Some(files) = files else {
            return syncfs(self.store_fd.as_fd()).map_err(|e| io_err("syncing the file system of", store)(e.into()));
        };
        for (fd, path) in files.iter().zip(&placed) {
            fsync(fd).map_err(|e| io_err("syncing", &self.real_path(path))(e.into()))?;
        }
        fsync(self.store_fd.as_fd()).map_err(|e| io_err("syncing", store)(e.into()))
    }

    /// The tree of `path` opened, if it is a single regular file.
    fn open_single_file(&self, path: &StorePath) -> Option<std::os::fd::OwnedFd> {
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = openat(self.store_fd.as_fd(), path.base_name(), flags, Mode::empty()).ok()?;
        (FileType::from_raw_mode(fstat(&fd).ok()?.st_mode) == FileType::RegularFile).then_some(fd)
    }
}

/// Most paths of a batch made durable one `fsync` each (see [`LocalStore::make_durable`]).
const FSYNC_PATHS: usize = 8;
