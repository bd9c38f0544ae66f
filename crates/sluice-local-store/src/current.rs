//! Whether an opened store still uses the directories at its paths. A `nix-daemon` opens the
//! store in each connection's worker (`src/nix/unix/daemon.cc`, `processConnection` of a new
//! `LocalStore`), so the store directory and state directory can be deleted and made again
//! between two connections (the `clearStore` of Nix's functional tests does it under a running
//! daemon): the next worker makes what is missing and uses the new ones. A process that keeps
//! a store open across such a change must open it again; [`LocalStore::is_current`] tells.
//!
//! What is compared is the identity (device, inode) of the store directory and of the
//! database file, as opened and as now found at their paths. Both stay open while the store
//! is (the directory's descriptor, SQLite's file), so their inode numbers cannot be reused by
//! new files meanwhile: a replaced directory or database always differs.

use std::os::fd::BorrowedFd;
use std::path::Path;

use rustix::fs::{fstat, stat, Stat};

use super::layout::Layout;
use super::{io_err, LocalStore, LocalStoreError};

/// The identities of the store directory and the database file an opened store uses.
#[derive(Debug)]
pub(super) struct Opened {
    store_dir: (u64, u64),
    db: (u64, u64),
}

/// A file's device and inode.
fn identity(s: &Stat) -> (u64, u64) {
    (s.st_dev, s.st_ino)
}

impl Opened {
    /// The identities of the open store directory `store_fd` and of the database just opened
    /// at `db`.
    pub(super) fn new(store_fd: BorrowedFd<'_>, layout: &Layout) -> Result<Self, LocalStoreError> {
        let store_dir = fstat(store_fd).map_err(|e| io_err("reading the identity of", &layout.real_store_dir)(e.into()))?;
        let db = stat(&layout.db_file).map_err(|e| io_err("reading the identity of", &layout.db_file)(e.into()))?;
        Ok(Opened { store_dir: identity(&store_dir), db: identity(&db) })
    }

    /// Whether `path` is (still) the file with identity `id`.
    fn is_at(id: (u64, u64), path: &Path) -> bool {
        stat(path).is_ok_and(|s| identity(&s) == id)
    }
}

impl LocalStore {
    /// Whether the store directory and the database this store opened are still those at its
    /// paths: false once either was deleted, moved away or replaced (see the module
    /// documentation), when the store must be opened again to use what is there now. Two
    /// `stat` calls.
    pub fn is_current(&self) -> bool {
        Opened::is_at(self.opened.store_dir, &self.layout.real_store_dir) && Opened::is_at(self.opened.db, &self.layout.db_file)
    }
}
