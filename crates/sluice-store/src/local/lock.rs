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
fn open_lock_file(path: &Path) -> io::Result<File> {
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

impl PathLock {
    /// Locks `<real_path>.lock`, blocking while another process or thread holds it.
    pub(super) fn acquire(real_path: &Path) -> io::Result<Self> {
        let mut lock_path = real_path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock_path = PathBuf::from(lock_path);
        loop {
            let file = open_lock_file(&lock_path)?;
            flock_blocking(&file, FlockOperation::LockExclusive)?;
            // A non-empty lock file was deleted by its previous holder after we opened it:
            // others may already hold a lock on a new file at the same name.
            if file.metadata()?.len() == 0 {
                return Ok(PathLock { file, lock_path });
            }
        }
    }
}

impl Drop for PathLock {
    fn drop(&mut self) {
        // Both steps are best effort, as in Nix: a lock file left behind is harmless.
        let _ = std::fs::remove_file(&self.lock_path);
        let _ = self.file.write_all(b"d");
        // Closing the file releases the flock.
    }
}
