//! Directories of temporary trees in the store directory, made as Nix's
//! `LocalStore::createTempDirInStore` (`src/libstore/local-store.cc`, 2.26) makes them and
//! kept from the collectors as Nix 2.8's version of it keeps them: each is new, private and
//! locked by its holder, and named like a store path whose hash part is a temporary root of
//! its holder for its whole life.
//!
//! * Named `<random hash part>-sluice-unpacking` ([`TEMP_DIR_NAME`]), made with `mkdirat`
//!   (mode 0700), which fails if the name exists: nothing another user made first is used,
//!   and another name is drawn. Its hash part is made a temporary root (of a holder of its
//!   own) before it is made, so that Nix 2.8's and 2.26's collectors (and sluice's) keep it by
//!   hash part while it lives, and delete it as an invalid path once its holder is gone. (A
//!   name like Nix 2.26's `tmp-<pid>-<n>`, which 2.26's collector skips while it is locked,
//!   would be deleted by 2.8's at once, locked or not: 2.8 deletes every name in the store
//!   directory that is not a store path.)
//! * Locked (`flock`, exclusive) while it lives, as Nix's: a store's next opener removes the
//!   directories whose lock it can take (a killed run's) before it makes its own, and only
//!   after checking that the name is still the directory it locked.
//! * Shared by the additions of one opened store that overlap, and removed when the last of
//!   them ends: after a command, and while a daemon adds nothing, the store directory holds
//!   none.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use rustix::fs::{flock, fstat, mkdirat, statat, AtFlags, Dir, FlockOperation, Mode};
use sluice_nix::store_path::StorePath;

use super::lock::PathLock;
use super::temp_roots::TempRoots;
use super::unpack::{creation_modes, Creation};
use super::{io_err, tree, LocalStore, LocalStoreError};

/// The name part of every directory of temporary trees (`<hash part>-sluice-unpacking`).
/// Adding a store path with this name is refused: the addition would take a directory of
/// temporary trees at its location for a tree an interrupted addition left.
pub const TEMP_DIR_NAME: &str = "sluice-unpacking";

/// Whether the entry `base_name` of a store directory is named like a directory of temporary
/// trees (whoever made it).
pub fn is_temp_dir(base_name: &str) -> bool {
    StorePath::from_base_name(base_name).is_ok_and(|p| p.name() == TEMP_DIR_NAME)
}

/// A directory of temporary trees, open and locked; removed (with anything left in it) when
/// dropped, then its root ends.
pub(super) struct TempDir {
    pub(super) fd: OwnedFd,
    /// Its real path, for messages.
    pub(super) path: PathBuf,
    name: String,
    /// The store directory (a duplicate of the store's descriptor), to remove it from.
    store_fd: OwnedFd,
    /// How nodes made in it get their modes.
    pub(super) creation: Creation,
    /// Its hash part, rooted from before it was made until after it is removed.
    _roots: TempRoots,
}

impl TempDir {
    /// Makes, opens and locks a new directory of temporary trees in `store`'s directory (see
    /// the module documentation).
    fn create(store: &LocalStore) -> Result<TempDir, LocalStoreError> {
        let roots = store.temp_roots();
        let parent = store.store_fd.as_fd();
        loop {
            let path = random_path().map_err(io_err("naming a directory of temporary trees in", &store.layout.real_store_dir))?;
            roots.add(&path)?;
            let name = path.base_name();
            let real = store.real_path(&path);
            match mkdirat(parent, name, Mode::RWXU) {
                Ok(()) => {}
                // Someone made it first: it is theirs.
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(io_err("creating", &real)(e.into())),
            }
            // Until it is locked, another opener's removal of stale directories may take it
            // (it is then gone, or locked by the remover): another name.
            let fd = match tree::open_dir(parent, name.as_bytes()) {
                Ok(fd) => fd,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("opening", &real)(e)),
            };
            tree::owned_dir(fd.as_fd(), 0o077, "no permission for group or others").map_err(io_err("using", &real))?;
            if !lock_as_named(parent, name.as_bytes(), fd.as_fd()) {
                continue;
            }
            let creation = *store.creation.get_or_init(|| creation_modes(fd.as_fd()));
            let store_fd = store.store_fd.try_clone().map_err(io_err("duplicating the descriptor of", &store.layout.real_store_dir))?;
            return Ok(TempDir { fd, path: real, name: name.to_owned(), store_fd, creation, _roots: roots });
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Only if the name is still this directory (it is when nobody but a collector, which
        // spares it while it is rooted, removes names in the store directory).
        let name = self.name.as_bytes();
        if !same_file(self.store_fd.as_fd(), name, self.fd.as_fd()) {
            return;
        }
        if let Err(e) = tree::remove_tree(self.store_fd.as_fd(), name) {
            tracing::warn!("removing the directory of temporary trees {}: {e}", self.path.display());
        }
    }
}

/// A store path named `<20 random bytes in nix32>-sluice-unpacking`.
fn random_path() -> io::Result<StorePath> {
    StorePath::from_base_name(&format!("{}-{TEMP_DIR_NAME}", sluice_nix::base32::encode(&random_bytes::<20>()?))).map_err(io::Error::other)
}

/// `N` random bytes (`getrandom(2)`), for names nobody can guess.
pub(super) fn random_bytes<const N: usize>() -> io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(bytes)
}

/// Takes the lock of the open directory `dir` without waiting, and tells whether it got it
/// and `name` in `parent` is still `dir` (a directory removed after it was opened can be
/// locked by anyone).
fn lock_as_named(parent: BorrowedFd<'_>, name: &[u8], dir: BorrowedFd<'_>) -> bool {
    flock(dir, FlockOperation::NonBlockingLockExclusive).is_ok() && same_file(parent, name, dir)
}

/// Whether `name` in `parent` (not followed if a symlink) is the open file `fd`.
fn same_file(parent: BorrowedFd<'_>, name: &[u8], fd: BorrowedFd<'_>) -> bool {
    match (statat(parent, name, AtFlags::SYMLINK_NOFOLLOW), fstat(fd)) {
        (Ok(a), Ok(b)) => (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
        _ => false,
    }
}

/// The directory of temporary trees kept by [`LocalStore::keep_temp_dir`].
pub struct KeptTempDir {
    _dir: Arc<TempDir>,
}

impl LocalStore {
    /// Keeps the directory of temporary trees of the additions in progress (made now if there
    /// is none) while the value lives, so that additions one after another (a daemon
    /// connection's, while its client keeps asking) use one directory instead of making and
    /// removing one each.
    pub fn keep_temp_dir(&self) -> Result<KeptTempDir, LocalStoreError> {
        Ok(KeptTempDir { _dir: self.open_temp_dir()? })
    }

    /// The directory of temporary trees of the additions in progress, made if there is none
    /// (after removing the stale ones, the first time).
    pub(super) fn open_temp_dir(&self) -> Result<Arc<TempDir>, LocalStoreError> {
        let mut current = self.temp_dir.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(dir) = current.upgrade() {
            return Ok(dir);
        }
        self.remove_stale_temp_dirs();
        let dir = Arc::new(TempDir::create(self)?);
        *current = Arc::downgrade(&dir);
        Ok(dir)
    }

    /// Once per opened store that writes: removes the directories of temporary trees that
    /// killed runs left (their lock is free). A name that a valid path has, or whose path lock
    /// someone holds (a path of that name being added by Nix), is left alone. Best effort: a
    /// failure is logged.
    pub(super) fn remove_stale_temp_dirs(&self) {
        if self.read_only {
            return;
        }
        self.stale_temp_dirs.call_once(|| {
            let entries = match Dir::read_from(self.store_fd.as_fd()) {
                Ok(entries) => entries,
                Err(e) => return tracing::warn!("listing {}: {e}", self.layout.real_store_dir.display()),
            };
            let names: Vec<String> =
                entries.filter_map(|e| e.ok()?.file_name().to_str().ok().filter(|n| is_temp_dir(n)).map(str::to_owned)).collect();
            for name in names {
                self.remove_stale_temp_dir(&name);
            }
        });
    }

    /// Removes the directory of temporary trees `name` if its holder is gone.
    fn remove_stale_temp_dir(&self, name: &str) {
        let Ok(path) = StorePath::from_base_name(name) else { return };
        let real = self.real_path(&path);
        let Ok(Some(_lock)) = PathLock::try_acquire(&real) else { return };
        if !matches!(self.is_valid_path(&path), Ok(false)) {
            return;
        }
        let parent = self.store_fd.as_fd();
        // Not a directory, not ours to open, or in use.
        let Ok(dir) = tree::open_dir(parent, name.as_bytes()) else { return };
        if !lock_as_named(parent, name.as_bytes(), dir.as_fd()) {
            return;
        }
        match tree::remove_tree(parent, name.as_bytes()) {
            Ok(_) => tracing::info!("removed the directory of temporary trees {} that an interrupted run left", real.display()),
            Err(e) => tracing::warn!("removing the directory of temporary trees {}: {e}", real.display()),
        }
    }
}
