//! Queries read in one transaction of the store's database kept open across them while their
//! reader keeps the shared GC lock ([`LocalStore::kept_reads`]; the daemon's connections, for
//! a client that keeps asking). Outside a transaction SQLite takes and drops the WAL's read
//! lock (two `fcntl`) and checks the database file (`fstat`) for every statement; Nix's
//! `LocalStore` reads that way, one implicit transaction per statement (`local-store.cc`,
//! `queryPathInfoUncached`, `isValidPath_`).
//!
//! Why a kept transaction answers truly: a path leaves the database only through a collector (Nix's
//! and sluice's delete under `gc.lock` held exclusively; a verification unregisters only paths
//! whose files are gone already), and a kept transaction is read only while the holder of temporary
//! roots it was begun for has kept the shared GC lock since before it began, so no collector has
//! run since: a path valid in it is valid now. What it can miss is a path another process
//! registered since it began, for at most [`MAX_AGE`]; every read that decides a write reads past
//! it (validity under a path's lock in `LocalStore::begin_add`, the reference checks of a commit),
//! and every write and every read of another reader ends it first. It also ends when its reader
//! gives the lock up ([`LocalStore::end_kept_reads`]), so that checkpoints of the WAL are not held
//! back.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use super::{LocalStore, LocalStoreError, TempRoots};

/// How long a kept transaction is read at most: a path registered by another process is seen
/// at most this long after its registration.
pub(crate) const MAX_AGE: Duration = Duration::from_millis(50);

/// How a registry read sees the database.
#[derive(Clone, Copy)]
pub(super) enum Reading<'r> {
    /// As it is now: a transaction kept for a reader is ended first.
    Fresh,
    /// Through the transaction kept for these roots' holder while it keeps the shared GC lock
    /// (begun now if there is none, or if it cannot be read any more); as [`Reading::Fresh`]
    /// while the lock is not kept.
    Kept(&'r TempRoots),
}

/// The transaction kept open on the store's connection, and for whom.
pub(super) struct Snapshot {
    /// `TempRoots::id` of its reader.
    owner: usize,
    /// When it began (before SQLite took its read mark, at its first statement).
    began: Instant,
}

/// Makes `conn` ready for a read as `reading` asks: `kept` is the transaction kept open on it,
/// if any. If a transaction cannot be begun, the read goes on without one.
pub(super) fn prepare(conn: &Connection, kept: &mut Option<Snapshot>, reading: Reading) {
    let Reading::Kept(roots) = reading else { return end(conn, kept) };
    let Some(locked_since) = roots.gc_locked_since() else { return end(conn, kept) };
    let readable = |s: &Snapshot| s.owner == roots.id() && s.began >= locked_since && s.began.elapsed() < MAX_AGE;
    if kept.as_ref().is_some_and(readable) && !conn.is_autocommit() {
        return;
    }
    end(conn, kept);
    let began = Instant::now();
    if conn.execute_batch("begin").is_ok() {
        *kept = Some(Snapshot { owner: roots.id(), began });
    }
}

/// Ends the transaction kept for the reader `owner` (`TempRoots::id`), if it is the one kept.
pub(super) fn end_for(conn: &Connection, kept: &mut Option<Snapshot>, owner: usize) {
    if kept.as_ref().is_some_and(|s| s.owner == owner) {
        end(conn, kept);
    }
}

fn end(conn: &Connection, kept: &mut Option<Snapshot>) {
    // SQLite may have rolled it back itself after an error: then there is nothing to end.
    if kept.take().is_some() && !conn.is_autocommit() {
        if let Err(e) = conn.execute_batch("commit") {
            tracing::warn!("ending a kept read transaction: {e}");
        }
    }
}

/// The queries of [`LocalStore`] that a reader keeping the shared GC lock answers from the
/// transaction kept for it (see the module documentation).
pub struct KeptReads<'s> {
    store: &'s LocalStore,
    roots: &'s TempRoots,
}

impl LocalStore {
    /// Queries for the holder of `roots`, read through one transaction kept open across them
    /// while `roots` keep the shared GC lock ([`TempRoots::keep_gc_lock`],
    /// [`TempRoots::add_all_keeping_gc_lock`]), and as usual otherwise. The holder ends it
    /// with [`LocalStore::end_kept_reads`] before it gives the lock up, and must not read
    /// through it from another thread meanwhile.
    pub fn kept_reads<'s>(&'s self, roots: &'s TempRoots) -> KeptReads<'s> {
        KeptReads { store: self, roots }
    }

    /// Ends the transaction kept for `roots`' holder, if there is one.
    pub fn end_kept_reads(&self, roots: &TempRoots) {
        self.registry.end_kept(roots.id());
    }
}

impl KeptReads<'_> {
    /// [`LocalStore::query_path_info`].
    pub fn query_path_info(&self, path: &StorePath) -> Result<Option<ValidPathInfo>, LocalStoreError> {
        self.store.registry.query_path_info(path, Reading::Kept(self.roots))
    }

    /// [`LocalStore::query_path_infos`].
    pub fn query_path_infos(&self, paths: &[StorePath]) -> Vec<Result<Option<ValidPathInfo>, LocalStoreError>> {
        self.store.registry.query_path_infos(paths, Reading::Kept(self.roots))
    }

    /// [`LocalStore::is_valid_path`].
    pub fn is_valid_path(&self, path: &StorePath) -> Result<bool, LocalStoreError> {
        Ok(!self.query_valid_paths(std::slice::from_ref(path))?.is_empty())
    }

    /// [`LocalStore::query_valid_paths`].
    pub fn query_valid_paths(&self, paths: &[StorePath]) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        self.store.registry.valid_paths(paths.iter(), Reading::Kept(self.roots))
    }
}
