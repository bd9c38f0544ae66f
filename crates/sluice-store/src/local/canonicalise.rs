//! Canonical metadata of store paths (Nix's `canonicalisePathMetaData`,
//! `src/libstore/local-store.cc`): every file, directory and symlink gets mtime 1 (one second
//! into the epoch); regular files and directories get mode 0444, or 0555 if the owner may
//! execute (which also drops setuid/setgid/sticky bits). Directories are made read-only after
//! their entries. Ownership is left alone: everything was created by this process.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use rustix::fs::{chmodat, fchmod, futimens, statat, utimensat, AtFlags, FileType, Mode, Stat, Timespec, Timestamps, UTIME_OMIT};

use super::tree::{open_dir, sorted_entries};

/// Nix's `mtimeStore`.
const MTIME_STORE: i64 = 1;

/// Canonicalises the tree `name` in `parent`. Fails on file types a NAR cannot hold.
pub(super) fn canonicalise(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<()> {
    let st = statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Symlink => {
            if !has_store_mtime(&st) {
                utimensat(parent, name, &store_times(), AtFlags::SYMLINK_NOFOLLOW)?;
            }
        }
        FileType::RegularFile => {
            if let Some(mode) = canonical_mode(&st) {
                chmodat(parent, name, mode, AtFlags::empty())?;
            }
            if !has_store_mtime(&st) {
                utimensat(parent, name, &store_times(), AtFlags::SYMLINK_NOFOLLOW)?;
            }
        }
        FileType::Directory => {
            let dir = open_dir(parent, name)?;
            for entry in sorted_entries(dir.as_fd())? {
                canonicalise(dir.as_fd(), &entry)?;
            }
            if let Some(mode) = canonical_mode(&st) {
                fchmod(&dir, mode)?;
            }
            if !has_store_mtime(&st) {
                futimens(&dir, &store_times())?;
            }
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{:?} has an unsupported file type {other:?}", String::from_utf8_lossy(name)),
            ))
        }
    }
    Ok(())
}

/// Whether the modification time is already [`MTIME_STORE`] (`st_mtime` is signed or not
/// depending on the target).
#[allow(clippy::unnecessary_cast)]
fn has_store_mtime(st: &Stat) -> bool {
    st.st_mtime as i64 == MTIME_STORE
}

/// The mode to set, if the current one is not already 0444 or 0555.
fn canonical_mode(st: &Stat) -> Option<Mode> {
    let perms = st.st_mode & 0o7777;
    if perms == 0o444 || perms == 0o555 {
        return None;
    }
    Some(Mode::from_raw_mode(if perms & 0o100 != 0 { 0o555 } else { 0o444 }))
}

/// Access time untouched, modification time [`MTIME_STORE`].
fn store_times() -> Timestamps {
    Timestamps {
        last_access: Timespec { tv_sec: 0, tv_nsec: UTIME_OMIT },
        last_modification: Timespec { tv_sec: MTIME_STORE, tv_nsec: 0 },
    }
}
