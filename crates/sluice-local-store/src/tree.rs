//! File-tree helpers working relative to directory descriptors (`*at` calls), so that no path
//! is resolved through a symbolic link: the store directory is opened once and every node
//! below it is reached by single names.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{fchmod, openat, statat, unlinkat, AtFlags, Dir, FileType, Mode, OFlags};

/// Opens the directory `name` in `parent` for reading, refusing to follow a symlink.
pub(super) fn open_dir(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    Ok(openat(parent, name, flags, Mode::empty())?)
}

/// Checks that this process's user owns the open directory `dir` and that its mode has none of
/// the bits `forbidden` (`0o077`: nothing for group and others; `0o022`: no writing by them).
/// Otherwise a `PermissionDenied` error naming its owner and mode and saying, by `wanted`, what
/// was required.
pub(super) fn owned_dir(dir: BorrowedFd<'_>, forbidden: u32, wanted: &str) -> io::Result<()> {
    let st = rustix::fs::fstat(dir)?;
    let uid = rustix::process::geteuid().as_raw();
    if st.st_uid == uid && st.st_mode & forbidden == 0 {
        return Ok(());
    }
    let why = format!(
        "owned by uid {} with mode {:04o}; it must be this process's user's (uid {uid}), with {wanted}",
        st.st_uid,
        st.st_mode & 0o7777
    );
    Err(io::Error::new(io::ErrorKind::PermissionDenied, why))
}

/// The entry names of the open directory `dir` (without `.` and `..`), sorted by bytes as
/// NAR directories are.
pub(super) fn sorted_entries(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut names = Vec::new();
    for entry in Dir::read_from(dir)? {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// [`sorted_entries`] of a directory opened by this thread and not read yet: its entries read
/// from the descriptor itself (`getdents64` from its offset, the start), where
/// [`sorted_entries`] opens the directory again (an `openat`, an `fcntl` and a `close` more for
/// each directory of a tree dumped).
pub(super) fn sorted_entries_of_new(dir: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
    let mut entries = rustix::fs::RawDir::new(dir, &mut buf);
    let mut names = Vec::new();
    while let Some(entry) = entries.next() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The status of `name` in `parent`, not following symlinks (`lstat`).
pub(super) fn lstat_at(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<rustix::fs::Stat> {
    Ok(statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)?)
}

/// Deletes the tree `name` in `parent`, making read-only directories writable first (store
/// paths are canonicalised to mode 0555). Returns whether anything was there.
pub(super) fn remove_tree(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<bool> {
    Ok(delete_tree(parent, name)?.is_some())
}

/// [`remove_tree`], returning the bytes it likely freed (`None` if nothing was there),
/// counted as Nix's `deletePath` counts them (`src/libutil/util.cc`, `_deletePath`): the size
/// of each non-directory with one or two links (two: probably also linked from `.links`, whose
/// copy the collector deletes next).
pub(super) fn delete_tree(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<Option<u64>> {
    let st = match statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        unlinkat(parent, name, AtFlags::empty())?;
        return Ok(Some(freed_by(&st)));
    }
    // The directories being emptied, innermost last, each with its name in the one below and
    // its entries still to delete: a stack of its own, not the thread's (a tree as deep as the
    // store accepts overflowed a thread's stack when this recursed).
    let mut open = vec![emptied_dir(parent, name)?];
    let mut freed = 0;
    while let Some((dir, _, entries)) = open.last_mut() {
        let Some(entry) = entries.pop() else {
            let Some((_, dir_name, _)) = open.pop() else { break };
            let up = open.last().map_or(parent, |(d, _, _)| d.as_fd());
            unlinkat(up, &dir_name, AtFlags::REMOVEDIR)?;
            continue;
        };
        let st = statat(dir.as_fd(), &entry, AtFlags::SYMLINK_NOFOLLOW)?;
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            let inner = emptied_dir(dir.as_fd(), &entry)?;
            open.push(inner);
        } else {
            unlinkat(dir.as_fd(), &entry, AtFlags::empty())?;
            freed += freed_by(&st);
        }
    }
    Ok(Some(freed))
}

/// The directory `name` of `parent` opened and made writable to be emptied, with its name and
/// its entries.
fn emptied_dir(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<(OwnedFd, Vec<u8>, Vec<Vec<u8>>)> {
    let dir = open_dir(parent, name)?;
    fchmod(&dir, Mode::from_raw_mode(0o700))?;
    let entries = sorted_entries(dir.as_fd())?;
    Ok((dir, name.to_vec(), entries))
}

/// What deleting a non-directory with status `st` likely frees: its size with one or two
/// links (two: probably also linked from `.links`, whose copy the collector deletes next).
fn freed_by(st: &rustix::fs::Stat) -> u64 {
    if st.st_nlink <= 2 {
        st.st_size as u64
    } else {
        0
    }
}
