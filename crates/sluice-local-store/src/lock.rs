//! Lock files as Nix uses them (`src/libstore/pathlocks.cc`): `flock(2)` on a file opened
//! read-write with mode 0600. A per-path lock lives at `<real path>.lock`; its holder deletes it
//! on release after writing one byte (`d`) into it, so that a process which was waiting on the
//! deleted file sees a non-empty lock file, knows it is stale and retries with a fresh one.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

/// Opens (creating if missing) a lock file the way Nix does: read-write, mode 0600, close-on-exec.
pub(super) fn open_lock_file(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(path)
}

/// `flock` that blocks until granted, retrying on `EINTR`.
fn flock_blocking(file: &File, op: FlockOperation) -> io::Result<()> {
    loop {
        match flock(file, op) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Opens `path` (creating it) and holds a shared lock on it for as long as the returned file is
/// open. Nix holds `db/big-lock` this way while a store is open, and takes it exclusively only
/// to upgrade the schema.
/// Turns the lock held on `file` into an exclusive (`true`) or shared lock, blocking until
/// granted (the conversion is not atomic, as with `flock`).
pub(super) fn relock(file: &File, exclusive: bool) -> io::Result<()> {
    flock_blocking(file, if exclusive { FlockOperation::LockExclusive } else { FlockOperation::LockShared })
}

pub(super) fn hold_shared(path: &Path) -> io::Result<File> {
    let file = open_lock_file(path)?;
    flock_blocking(&file, FlockOperation::LockShared)?;
    Ok(file)
}

/// An exclusive lock on one store path, held until dropped. Dropping it deletes the lock file
/// (Nix's `PathLocks` with deletion enabled).
#[derive(Debug)]
pub(super) struct PathLock {
    file: File,
    lock_path: PathBuf,
}

/// `<real_path>.lock`.
fn lock_path(real_path: &Path) -> PathBuf {
    let mut lock_path = real_path.as_os_str().to_owned();
    lock_path.push(".lock");
    PathBuf::from(lock_path)
}

impl PathLock {
    /// Locks `<real_path>.lock`, blocking while another process or thread holds it.
    pub(super) fn acquire(real_path: &Path) -> io::Result<Self> {
        Self::lock(real_path, FlockOperation::LockExclusive)?.ok_or_else(|| {
            let what = format!("locking {}: the blocking lock was refused as busy", lock_path(real_path).display());
            io::Error::new(io::ErrorKind::WouldBlock, what)
        })
    }

    /// Locks `<real_path>.lock` if nobody holds it; `None` when another process or thread does.
    pub(super) fn try_acquire(real_path: &Path) -> io::Result<Option<Self>> {
        Self::lock(real_path, FlockOperation::NonBlockingLockExclusive)
    }

    fn lock(real_path: &Path, op: FlockOperation) -> io::Result<Option<Self>> {
        let lock_path = lock_path(real_path);
        loop {
            let file = open_lock_file(&lock_path)?;
            match flock_blocking(&file, op) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                r => r?,
            }
            // A non-empty lock file was deleted by its previous holder after we opened it:
            // others may already hold a lock on a new file at the same name.
            if file.metadata()?.len() == 0 {
                return Ok(Some(PathLock { file, lock_path }));
            }
        }
    }
}

/// Removes `<real_path>.lock` if a killed process left it behind: only when nobody holds it
/// (a non-blocking exclusive `flock` succeeds) and it was not already released (empty), using
/// the same unlink-then-mark protocol as a holder's release. Best effort; never blocks.
/// Whether it removed one.
pub(super) fn clear_stale(real_path: &Path) -> bool {
    let lock_path = lock_path(real_path);
    let Ok(mut file) = OpenOptions::new().read(true).write(true).open(&lock_path) else { return false };
    if flock(&file, FlockOperation::NonBlockingLockExclusive).is_ok() && file.metadata().is_ok_and(|m| m.len() == 0) {
        let removed = std::fs::remove_file(&lock_path).is_ok();
        let _ = file.write_all(b"d");
        return removed;
    }
    false
}

impl Drop for PathLock {
    fn drop(&mut self) {
        // Both steps are best effort, as in Nix: a lock file left behind is harmless.
        let _ = std::fs::remove_file(&self.lock_path);
        let _ = self.file.write_all(b"d");
        // Closing the file releases the flock.
    }
}
