//! The NAR serialisation of a tree on disk (Nix's `dumpPath`, `src/libutil/archive.cc`),
//! produced as [`NarVisitor`] events so that `sluice_nix`'s `NarWriter` writes the bytes:
//! directory entries in byte order of their names, a regular file executable when its owner
//! may execute it, symlinks by their target. Nothing is followed.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};

use rustix::fs::{openat, readlinkat, FileType, Mode, OFlags};
use sluice_nix::nar::NarVisitor;

use super::tree::{file_type_at, open_dir, sorted_entries};

/// Visits the tree `name` in `parent` as the root of a NAR.
pub(super) fn dump<V: NarVisitor + ?Sized>(parent: BorrowedFd<'_>, name: &[u8], visitor: &mut V) -> io::Result<()> {
    dump_node(parent, name, &mut Vec::new(), visitor)
}

/// Visits the node `name` in `parent`, whose NAR path is `path` (components from the root).
fn dump_node<V: NarVisitor + ?Sized>(parent: BorrowedFd<'_>, name: &[u8], path: &mut Vec<Vec<u8>>, visitor: &mut V) -> io::Result<()> {
    match file_type_at(parent, name)? {
        FileType::RegularFile => {
            let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let file = File::from(openat(parent, name, flags, Mode::empty())?);
            let meta = file.metadata()?;
            let executable = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o100 != 0;
            let mut contents = ExactReader { inner: file, left: meta.len() };
            // The offset of the contents in the NAR is not tracked: the NAR is being written.
            visitor.regular(path, executable, meta.len(), 0, &mut contents)
        }
        FileType::Symlink => {
            let target = readlinkat(parent, name, Vec::new())?;
            visitor.symlink(path, target.as_bytes())
        }
        FileType::Directory => {
            let dir = open_dir(parent, name)?;
            visitor.directory_start(path)?;
            for entry in sorted_entries(dir.as_fd())? {
                path.push(entry.clone());
                dump_node(dir.as_fd(), &entry, path, visitor)?;
                path.pop();
            }
            visitor.directory_end(path)
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
