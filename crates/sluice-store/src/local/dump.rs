//! The NAR serialisation of a tree on disk (Nix's `dumpPath`, `src/libutil/archive.cc`),
//! produced as [`NarVisitor`] events so that `sluice_nix`'s `NarWriter` writes the bytes:
//! directory entries in byte order of their names, a regular file executable when its owner
//! may execute it, symlinks by their target. Nothing is followed.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{openat, readlinkat, FileType, Mode, OFlags};
use sluice_nix::nar::NarVisitor;

use super::tree::{file_type_at, open_dir, sorted_entries};

/// Visits the tree `name` in `parent` as the root of a NAR. The walk keeps its own stack of
/// open directories, not the thread's: a tree's depth is its author's choice (a channel
/// tarball of 1500 nested directories overflowed a daemon worker's 2 MiB stack and aborted
/// the daemon when this recursed).
pub(super) fn dump<V: NarVisitor + ?Sized>(parent: BorrowedFd<'_>, name: &[u8], visitor: &mut V) -> io::Result<()> {
    let mut path: Vec<Vec<u8>> = Vec::new();
    // The directories being visited, innermost last, each with its entries still to visit
    // (in reverse byte order); `path` names the innermost.
    let mut open: Vec<(OwnedFd, Vec<Vec<u8>>)> = Vec::new();
    open.extend(dump_node(parent, name, &path, visitor)?);
    while let Some((dir, entries)) = open.last_mut() {
        match entries.pop() {
            Some(entry) => {
                path.push(entry);
                let child = dump_node(dir.as_fd(), &path[path.len() - 1], &path, visitor)?;
                match child {
                    Some(child) => open.push(child),
                    None => drop(path.pop()),
                }
            }
            None => {
                open.pop();
                visitor.directory_end(&path)?;
                path.pop();
            }
        }
    }
    Ok(())
}

/// Visits the node `name` in `parent`, whose NAR path is `path` (components from the root):
/// a file or symlink whole; a directory's start only, returning it open with its entries (in
/// reverse byte order) for [`dump`] to visit.
fn dump_node<V: NarVisitor + ?Sized>(parent: BorrowedFd<'_>, name: &[u8], path: &[Vec<u8>], visitor: &mut V) -> io::Result<Option<(OwnedFd, Vec<Vec<u8>>)>> {
    match file_type_at(parent, name)? {
        FileType::RegularFile => {
            let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let file = File::from(openat(parent, name, flags, Mode::empty())?);
            let meta = file.metadata()?;
            let executable = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o100 != 0;
            let mut contents = ExactReader { inner: file, left: meta.len() };
            // The offset of the contents in the NAR is not tracked: the NAR is being written.
            visitor.regular(path, executable, meta.len(), 0, &mut contents)?;
            Ok(None)
        }
        FileType::Symlink => {
            let target = readlinkat(parent, name, Vec::new())?;
            visitor.symlink(path, target.as_bytes())?;
            Ok(None)
        }
        FileType::Directory => {
            let dir = open_dir(parent, name)?;
            visitor.directory_start(path)?;
            let mut entries = sorted_entries(dir.as_fd())?;
            entries.reverse();
            Ok(Some((dir, entries)))
        }
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{:?} has a file type a NAR cannot hold ({other:?})", String::from_utf8_lossy(name)),
        )),
    }
}

/// Yields exactly `left` bytes of `inner`, failing if the file is shorter than it was when
/// its size was read (it changed during the dump).
struct ExactReader {
    inner: File,
    left: u64,
}

impl Read for ExactReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank while being dumped"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}
