//! The NAR serialisation of a tree on disk (Nix's `dumpPath`, `src/libutil/archive.cc`):
//! directory entries in byte order of their names, a regular file executable when its owner
//! may execute it, symlinks by their target. Nothing is followed. [`Walk`] visits the tree one
//! node at a time; [`dump`] feeds its nodes to a [`NarVisitor`] (`sluice_nix`'s `NarWriter`
//! writes the bytes), and [`NarDump`] is the same NAR as a reader that walks the tree as it is
//! read, on the reading thread.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{openat, readlinkat, FileType, Mode, OFlags};
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::nar::{NarPath, NarVisitor};

use super::tree::{lstat_at, open_dir, sorted_entries_of_new};

/// One node of a [`Walk`], in NAR order; its position is [`Walk::path`].
pub(super) enum Node {
    /// A regular file: its contents, exactly its size when it was opened.
    Regular { executable: bool, contents: ExactReader },
    /// A symbolic link and its target.
    Symlink(Vec<u8>),
    /// A directory begins; its entries follow, then its [`Node::DirectoryEnd`].
    DirectoryStart,
    /// The directory at [`Walk::path`] ends.
    DirectoryEnd,
}

/// The nodes of a tree in NAR order. The walk keeps its own stack of open directories, not the
/// thread's: a tree's depth is its author's choice (a channel tarball of 1500 nested
/// directories overflowed a daemon worker's 2 MiB stack and aborted the daemon when this
/// recursed).
pub(super) struct Walk {
    /// The root's node, until [`Walk::next`] returns it.
    root: Option<Node>,
    /// The entry names from the root to the node last returned.
    path: Vec<Vec<u8>>,
    /// The directories being visited, innermost last, each with its entries still to visit (in
    /// reverse byte order); `path` names the innermost (or a node in it).
    open: Vec<(OwnedFd, Vec<Vec<u8>>)>,
    /// Whether the node last returned is done with (a file, a symlink, a directory's end), so
    /// that its name leaves `path` at the next step.
    leave: bool,
}

impl Walk {
    /// A walk of the tree `name` in `parent`; its root is looked at (and opened) now.
    pub(super) fn new(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<Walk> {
        let mut walk = Walk { root: None, path: Vec::new(), open: Vec::new(), leave: false };
        let root = look(parent, name)?;
        walk.root = Some(walk.settle(root));
        Ok(walk)
    }

    /// The position of the node last returned by [`Walk::next`] (empty for the root).
    pub(super) fn path(&self) -> &NarPath {
        &self.path
    }

    /// The next node, `None` after the root's end.
    pub(super) fn next(&mut self) -> io::Result<Option<Node>> {
        if let Some(root) = self.root.take() {
            return Ok(Some(root));
        }
        if std::mem::take(&mut self.leave) {
            self.path.pop();
        }
        let Some((dir, entries)) = self.open.last_mut() else { return Ok(None) };
        match entries.pop() {
            Some(entry) => {
                let looked = look(dir.as_fd(), &entry)?;
                self.path.push(entry);
                Ok(Some(self.settle(looked)))
            }
            None => {
                self.open.pop();
                self.leave = true;
                Ok(Some(Node::DirectoryEnd))
            }
        }
    }

    /// A node just looked at: a directory goes on the stack, anything else is left at the
    /// next step.
    fn settle(&mut self, (node, opened): (Node, Option<OpenDir>)) -> Node {
        match opened {
            Some(dir) => self.open.push(dir),
            None => self.leave = true,
        }
        node
    }
}

/// An open directory and its entries still to visit, in reverse byte order.
type OpenDir = (OwnedFd, Vec<Vec<u8>>);

/// Looks at the node `name` in `parent`: a file (opened) or symlink whole, a directory opened
/// with its entries. As Nix's `dumpPath`, a file's size and mode are those its `lstat` gave
/// (no `fstat` once it is open: [`ExactReader`] fails if it shrank meanwhile).
fn look(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<(Node, Option<OpenDir>)> {
    let st = lstat_at(parent, name)?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {
            let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let file = File::from(openat(parent, name, flags, Mode::empty())?);
            let (executable, size) = (st.st_mode & 0o100 != 0, st.st_size as u64);
            Ok((Node::Regular { executable, contents: ExactReader { inner: file, size, left: size } }, None))
        }
        FileType::Symlink => Ok((Node::Symlink(readlinkat(parent, name, Vec::new())?.into_bytes()), None)),
        FileType::Directory => {
            let dir = open_dir(parent, name)?;
            let mut entries = sorted_entries_of_new(dir.as_fd())?;
            entries.reverse();
            Ok((Node::DirectoryStart, Some((dir, entries))))
        }
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{:?} has a file type a NAR cannot hold ({other:?})", String::from_utf8_lossy(name)),
        )),
    }
}

/// Visits the tree `name` in `parent` as the root of a NAR.
pub(super) fn dump<V: NarVisitor + ?Sized>(parent: BorrowedFd<'_>, name: &[u8], visitor: &mut V) -> io::Result<()> {
    let mut walk = Walk::new(parent, name)?;
    while let Some(node) = walk.next()? {
        let path = walk.path();
        match node {
            Node::Regular { executable, mut contents } => {
                // The offset of the contents in the NAR is not tracked: the NAR is being written.
                visitor.regular(path, executable, contents.size, 0, &mut contents)?
            }
            Node::Symlink(target) => visitor.symlink(path, &target)?,
            Node::DirectoryStart => visitor.directory_start(path)?,
            Node::DirectoryEnd => visitor.directory_end(path)?,
        }
    }
    Ok(())
}

/// Files of at most this many bytes are copied into a [`NarDump`]'s buffer with the tokens
/// around them; the contents of larger ones are read straight into the reader's buffer.
const INLINE_FILE: u64 = 64 << 10;

/// The NAR of a tree (Nix's `dumpPath`, `src/libutil/archive.cc`) as a reader: each read
/// walks on until it can fill the caller's buffer (up to 64 KiB of tokens and files of at most
/// 64 KiB at a time; a larger file's contents are read straight into the caller's buffer), on
/// the reading thread. No thread or pipe stands between the tree and the reader, so a consumer
/// on a blocking thread (hashing, compressing) dumps the tree itself. Errors: the file system's
/// (a node that cannot be read, a file type a NAR cannot hold, a file that shrank while read)
/// and the NAR writer's (an entry name a NAR cannot hold), as I/O errors.
pub struct NarDump {
    walk: Walk,
    /// Tokens (and small files) not read yet: `out.get_ref()[sent..]`.
    out: NarWriter<Vec<u8>>,
    sent: usize,
    /// A large file whose contents are being read.
    streaming: Option<ExactReader>,
}

impl NarDump {
    /// The NAR of the tree `name` in `parent`; its root is looked at (and opened) now.
    pub(crate) fn new(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<NarDump> {
        Ok(NarDump {
            walk: Walk::new(parent, name)?,
            out: NarWriter::new(Vec::with_capacity(INLINE_FILE as usize))?,
            sent: 0,
            streaming: None,
        })
    }

    /// Walks on until at least `want` bytes are buffered, a large file's contents are next, or
    /// the tree ends.
    fn fill(&mut self, want: usize) -> io::Result<()> {
        while self.out.get_ref().len() < want && self.streaming.is_none() {
            let Some(node) = self.walk.next()? else { return Ok(()) };
            let path = self.walk.path();
            match node {
                Node::Regular { executable, contents } if contents.size > INLINE_FILE => {
                    self.out.regular_header(path, executable, contents.size)?;
                    self.streaming = Some(contents);
                }
                Node::Regular { executable, mut contents } => self.out.regular(path, executable, contents.size, 0, &mut contents)?,
                Node::Symlink(target) => self.out.symlink(path, &target)?,
                Node::DirectoryStart => self.out.directory_start(path)?,
                Node::DirectoryEnd => self.out.directory_end(path)?,
            }
        }
        Ok(())
    }
}

impl Read for NarDump {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.sent == self.out.get_ref().len() {
            self.out.get_mut().clear();
            self.sent = 0;
            if let Some(file) = &mut self.streaming {
                if file.left > 0 {
                    return file.read(buf);
                }
                let size = file.size;
                self.streaming = None;
                self.out.regular_trailer(self.walk.path(), size)?;
            }
            self.fill(buf.len().min(INLINE_FILE as usize))?;
        }
        let pending = &self.out.get_ref()[self.sent..];
        let n = pending.len().min(buf.len());
        buf[..n].copy_from_slice(&pending[..n]);
        self.sent += n;
        Ok(n)
    }
}

/// Yields exactly `size` bytes of `inner`, failing if the file is shorter than it was when
/// its size was read (it changed during the dump).
pub(super) struct ExactReader {
    inner: File,
    size: u64,
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
