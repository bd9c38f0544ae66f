//! A [`NarVisitor`] that materialises a NAR as a file tree: the NAR's root becomes the entry
//! `root_name` of an already open directory (the store's private temporary directory). Every
//! node is created exclusively (`O_CREAT|O_EXCL` and `O_NOFOLLOW`, `mkdirat`, `symlinkat`), so
//! nothing existing is overwritten and no symlink is followed at a node's own name.
//!
//! Nodes below the root are made by their path relative to the root's descriptor (`a/b/file`),
//! as Nix's `restorePath` and `tar -x` make them by path, not relative to a descriptor of their
//! own directory: holding one for every directory above the node being made failed with "Too
//! many open files" on a NAR nested deeper than the open-file limit, which Nix restores, and
//! made a copy's unpacking jobs hold as many descriptors as their trees are deep. The
//! directories on such a path are the ones this unpacker made, in a tree only its user can
//! write (made 0755 or 0555; its root, once opened, is checked to be this user's and not
//! writable by others, as someone who may write in its parent could have swapped it), and a
//! NAR cannot put a symlink where a directory was made (its names are unique and every node is
//! created exclusively), so the walk meets only those directories. A directory whose path from
//! the nearest descriptor held would exceed [`HELD_PATH_MAX`] bytes is opened and held, so no
//! path given to the kernel nears `PATH_MAX` however deep the NAR: a job holds the root's
//! descriptor and one more per KiB of path.
//!
//! Files are created with the permissions of a [`FileModes`]. For a store
//! ([`FileModes::STORE`]) every node gets Nix's canonical metadata as it is made
//! (`canonicalisePathMetaData`, `src/libstore/local-store.cc`): mtime 1 (one second into the
//! epoch) on files, symlinks and directories; mode 0444, or 0555 if executable, on files; 0555
//! on directories, set when their last entry has been made. No second walk over the tree is
//! needed. Ownership is left alone: everything is created by this process. Modes are set with
//! `fchmod` only where creation may not have given them exactly ([`creation_modes`]): then a
//! file costs `openat`, its writes, `futimens` and `close`; a directory one `fchmod` (to
//! 0555 once filled), or none where this process may fill a directory made 0555 at once (root).
//!
//! A node whose path would be longer than [`PATH_MAX`] allows where the tree is to be used
//! (the caller says how many bytes its paths below the root may have: [`Unpacker::new`]'s
//! `room`) is refused before it is made: Nix's `restorePath`, `dumpPath` and
//! `canonicalisePathMetaData` name every node by its full path, so Nix could neither make such
//! a tree nor read it back (`nix-store --verify --check-contents` fails on it, and so would a
//! copy of it by Nix).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{
    chmodat, fchmod, futimens, mkdirat, openat, symlinkat, utimensat, AtFlags, Mode, OFlags, Timespec, Timestamps, UTIME_OMIT,
};
use sluice_nix::hash::{Hash, HashAlgo, Hasher};
use sluice_nix::nar::{NarPath, NarVisitor};

use super::tree::{open_dir, owned_dir, remove_tree};

/// Unpacks into `parent/root_name`; see the module documentation.
pub(super) struct Unpacker<'a> {
    parent: BorrowedFd<'a>,
    root_name: &'a [u8],
    /// The directories being filled, from the root down, while the root directory is open.
    dirs: Option<OpenDirs>,
    flat_algo: Option<HashAlgo>,
    flat_hash: Option<Hash>,
    modes: FileModes,
    /// How nodes made in `parent` get their modes ([`creation_modes`]).
    creation: Creation,
    /// The most bytes a node's path below the root (`a/b/file`) may have.
    room: usize,
    /// File contents pass through here: as long as the largest file so far, at most
    /// [`COPY_BUFFER`] bytes (one buffer per NAR, not one per file).
    buf: Vec<u8>,
}

/// Linux's `PATH_MAX`: the most bytes a path given to the kernel may have, its final NUL
/// included (`<linux/limits.h>`).
pub(super) const PATH_MAX: usize = 4096;

/// The most bytes of a file's contents read and written at once.
const COPY_BUFFER: usize = 64 * 1024;

/// The permissions regular files are created with (before the umask), and whether nodes get
/// the store's canonical metadata.
#[derive(Debug, Clone, Copy)]
pub(super) struct FileModes {
    pub regular: u32,
    pub executable: u32,
    /// Mtime 1 everywhere, exact modes despite the umask or a default ACL, read-only
    /// directories.
    pub canonical: bool,
}

impl FileModes {
    /// Store objects: read-only and canonical from the start.
    pub(super) const STORE: FileModes = FileModes { regular: 0o444, executable: 0o555, canonical: true };
    /// `nix-store --restore`: writable files, as Nix's `restorePath` creates them.
    pub(super) const RESTORE: FileModes = FileModes { regular: 0o666, executable: 0o777, canonical: false };
}

/// Nix's `mtimeStore`, in seconds since the epoch.
const MTIME_STORE: i64 = 1;

/// Access time untouched, modification time [`MTIME_STORE`].
pub(super) fn store_times() -> Timestamps {
    Timestamps { last_access: Timespec { tv_sec: 0, tv_nsec: UTIME_OMIT }, last_modification: Timespec { tv_sec: MTIME_STORE, tv_nsec: 0 } }
}

impl<'a> Unpacker<'a> {
    /// `flat_algo`: also hash the contents of the root, if it is a regular file.
    /// `creation`: [`creation_modes`] of `parent`. `room`: the most bytes a node's path below
    /// the root may have ([`room_below`]); a longer one fails the NAR.
    pub(super) fn new(
        parent: BorrowedFd<'a>,
        root_name: &'a [u8],
        flat_algo: Option<HashAlgo>,
        modes: FileModes,
        creation: Creation,
        room: usize,
    ) -> Self {
        Unpacker { parent, root_name, dirs: None, flat_algo, flat_hash: None, modes, creation, room, buf: Vec::new() }
    }

    /// Whether a node's mode must be set after its creation for the canonical metadata.
    fn set_modes(&self) -> bool {
        self.modes.canonical && self.creation == Creation::Fchmod
    }

    /// Whether directories are made with their canonical mode (0555) and filled as they are.
    fn read_only_dirs(&self) -> bool {
        self.modes.canonical && self.creation == Creation::ExactReadOnlyDirs
    }

    /// Runs `create` for the node `path` with the directory to make it in and its path there
    /// ([`Unpacker::slot`]).
    fn create<T>(&mut self, path: &NarPath, create: impl Fn(BorrowedFd<'_>, &[u8]) -> rustix::io::Result<T>) -> io::Result<T> {
        let (dir, name) = self.slot(path)?;
        create(dir, name).map_err(|e| at(path)(e.into()))
    }

    /// The hash of the root regular file's contents, if one was asked for and the root is a
    /// regular file.
    pub(super) fn flat_hash(self) -> Option<Hash> {
        self.flat_hash
    }

    /// The directory to create `path`'s node in, and the node's path relative to it (see the
    /// module documentation). Rejects a path that is not a child of the innermost open
    /// directory, and names that could escape it.
    fn slot<'s>(&'s mut self, path: &'s NarPath) -> io::Result<(BorrowedFd<'s>, &'s [u8])> {
        let Some((name, ancestors)) = path.split_last() else {
            return Ok((self.parent, self.root_name));
        };
        let Some(dirs) = self.dirs.as_mut().filter(|d| d.depth() == ancestors.len() + 1) else {
            return Err(invalid(path, "entry outside the directory being unpacked"));
        };
        if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
            return Err(invalid(path, "invalid entry name"));
        }
        let below = dirs.below_root(name);
        if below > self.room {
            let why = format!("its path would be {below} bytes below the tree's root, where {} fit in PATH_MAX ({PATH_MAX} bytes): Nix could neither make nor read it", self.room);
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", abbreviated(path))));
        }
        Ok(dirs.child(name))
    }
}

/// The most bytes a node's path below a tree's root may have when the root's own path is
/// `root` bytes long: what [`PATH_MAX`] leaves after the root, a `/` and the final NUL.
pub(super) fn room_below(root: usize) -> usize {
    PATH_MAX.saturating_sub(root + 2)
}

/// The longest path, in bytes, of a directory made relative to a held directory descriptor
/// before it is held itself (a fourth of Linux's `PATH_MAX`): a node's path from a held
/// directory is at most this, a `/` and its name (255 bytes at most), 1,280 bytes.
const HELD_PATH_MAX: usize = 1024;

/// The directories an [`Unpacker`] is filling, from the root down: the root's descriptor and
/// those of the few directories deeper than [`HELD_PATH_MAX`] bytes below the last one held,
/// and the path from the root to the innermost.
struct OpenDirs {
    root: OwnedFd,
    /// The innermost directory's path from the root, each component followed by `/`; then,
    /// while a child's path is being given out, that child's name.
    rel: Vec<u8>,
    /// Per open directory below the root: the length of `rel` that is its path (the root's
    /// is 0).
    ends: Vec<usize>,
    /// The directories below the root held open, outermost first: the descriptor, and the
    /// length of `rel` at which paths relative to it begin.
    held: Vec<(OwnedFd, usize)>,
}

/// A directory of an [`OpenDirs`]: held open, or named by a path relative to one that is.
enum DirRef<'a> {
    Held(BorrowedFd<'a>),
    Below(BorrowedFd<'a>, &'a [u8]),
}

impl OpenDirs {
    /// Opens the root directory `name`, just made in `parent`, with `open`.
    fn root(name: &[u8], parent: BorrowedFd<'_>, open: impl FnOnce(BorrowedFd<'_>, &[u8]) -> io::Result<OwnedFd>) -> io::Result<Self> {
        let root = open(parent, name)?;
        // The root just made: between its `mkdirat` and this `openat`, someone who may write in
        // `parent` (an unsticky shared directory, for `nar restore`) could have put their own
        // directory there, whose entries they could replace with symlinks that the paths below
        // would follow.
        owned_dir(root.as_fd(), 0o022, "no writing by group or others")?;
        Ok(OpenDirs { root, rel: Vec::new(), ends: Vec::new(), held: Vec::new() })
    }

    /// How many directories are open, the root included.
    fn depth(&self) -> usize {
        self.ends.len() + 1
    }

    /// The length of `rel` that is the innermost open directory's path.
    fn innermost_end(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// The innermost held directory, and the length of `rel` at which paths relative to it
    /// begin.
    fn innermost_held(&self) -> (BorrowedFd<'_>, usize) {
        self.held.last().map_or((self.root.as_fd(), 0), |(fd, from)| (fd.as_fd(), *from))
    }

    /// The length in bytes of the path from the root of the child `name` of the innermost
    /// open directory.
    fn below_root(&self, name: &[u8]) -> usize {
        self.innermost_end() + name.len()
    }

    /// The innermost held directory and the path of the child `name` of the innermost open
    /// directory relative to it.
    fn child(&mut self, name: &[u8]) -> (BorrowedFd<'_>, &[u8]) {
        self.rel.truncate(self.innermost_end());
        self.rel.extend_from_slice(name);
        let (fd, from) = self.innermost_held();
        (fd, &self.rel[from..])
    }

    /// Opens the directory `name`, just made in the innermost open directory, as the new
    /// innermost one; `open` opens it, given its parent and its path there, when it is to be
    /// held.
    fn push(&mut self, name: &[u8], open: impl FnOnce(BorrowedFd<'_>, &[u8]) -> io::Result<OwnedFd>) -> io::Result<()> {
        self.rel.truncate(self.innermost_end());
        self.rel.extend_from_slice(name);
        let (held, from) = self.innermost_held();
        let fd = (self.rel.len() - from > HELD_PATH_MAX).then(|| open(held, &self.rel[from..])).transpose()?;
        self.rel.push(b'/');
        if let Some(fd) = fd {
            self.held.push((fd, self.rel.len()));
        }
        self.ends.push(self.rel.len());
        Ok(())
    }

    /// The innermost open directory.
    fn innermost(&self) -> DirRef<'_> {
        let end = self.innermost_end();
        let (fd, from) = self.innermost_held();
        match end == from {
            true => DirRef::Held(fd),
            // Without its trailing `/`.
            false => DirRef::Below(fd, &self.rel[from..end - 1]),
        }
    }

    /// Closes the innermost open directory below the root; false if the root is the
    /// innermost (it closes with the [`OpenDirs`]).
    fn pop(&mut self) -> bool {
        let Some(end) = self.ends.pop() else { return false };
        if self.held.last().is_some_and(|(_, from)| *from == end) {
            self.held.pop();
        }
        self.rel.truncate(self.innermost_end());
        true
    }
}

impl DirRef<'_> {
    /// Sets the directory's mode (`fchmod`, or `fchmodat` on its path: the path's last
    /// component is a directory this unpacker made).
    fn chmod(&self, mode: Mode) -> rustix::io::Result<()> {
        match self {
            DirRef::Held(fd) => fchmod(fd, mode),
            DirRef::Below(fd, path) => chmodat(fd, *path, mode, AtFlags::empty()),
        }
    }

    /// Sets the directory's times, not following a symlink.
    fn set_times(&self, times: &Timestamps) -> rustix::io::Result<()> {
        match self {
            DirRef::Held(fd) => futimens(fd, times),
            DirRef::Below(fd, path) => utimensat(fd, *path, times, AtFlags::SYMLINK_NOFOLLOW),
        }
    }
}

/// An `InvalidData` error naming the NAR path.
fn invalid(path: &NarPath, what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{what}: {}", display(path)))
}

/// Adds the NAR path to an I/O error's message.
fn at(path: &NarPath) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{}: {e}", display(path)))
}

/// [`display`] of `path`, its middle left out when it is longer than 160 bytes.
fn abbreviated(path: &NarPath) -> String {
    let shown = display(path);
    let chars: Vec<char> = shown.chars().collect();
    match chars.len() > 160 {
        true => format!("{}…{}", chars[..80].iter().collect::<String>(), chars[chars.len() - 80..].iter().collect::<String>()),
        false => shown,
    }
}

/// `/a/b` for the path components `[a, b]` (`/` for the root), lossily decoded.
fn display(path: &NarPath) -> String {
    if path.is_empty() {
        return "/".into();
    }
    path.iter().map(|c| format!("/{}", String::from_utf8_lossy(c))).collect()
}

impl NarVisitor for Unpacker<'_> {
    fn regular(&mut self, path: &NarPath, executable: bool, size: u64, _offset: u64, contents: &mut dyn Read) -> io::Result<()> {
        let mode = Mode::from_raw_mode(if executable { self.modes.executable } else { self.modes.regular });
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut file = File::from(self.create(path, |dir, name| openat(dir, name, flags, mode))?);
        let mut hasher = self.flat_algo.filter(|_| path.is_empty()).map(Hasher::new);
        let want = usize::try_from(size).unwrap_or(usize::MAX).min(COPY_BUFFER);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let buf = &mut self.buf;
        let mut left = size;
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = contents.read(&mut buf[..want])?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("{}: file contents end early", display(path))));
            }
            if let Some(h) = hasher.as_mut() {
                h.update(&buf[..n]);
            }
            file.write_all(&buf[..n]).map_err(at(path))?;
            left -= n as u64;
        }
        if self.set_modes() {
            // The mode asked of `openat` is cut by the umask or replaced by a default ACL of
            // the store directory: set it exactly.
            fchmod(&file, mode).map_err(|e| at(path)(e.into()))?;
        }
        if self.modes.canonical {
            futimens(&file, &store_times()).map_err(|e| at(path)(e.into()))?;
        }
        self.flat_hash = hasher.map(Hasher::finish);
        Ok(())
    }

    fn symlink(&mut self, path: &NarPath, target: &[u8]) -> io::Result<()> {
        if target.is_empty() || target.contains(&0) {
            return Err(invalid(path, "symlink target is empty or contains NUL"));
        }
        let canonical = self.modes.canonical;
        self.create(path, |dir, name| {
            symlinkat(target, dir, name)?;
            match canonical {
                true => utimensat(dir, name, &store_times(), AtFlags::SYMLINK_NOFOLLOW),
                false => Ok(()),
            }
        })
    }

    fn directory_start(&mut self, path: &NarPath) -> io::Result<()> {
        let mode = Mode::from_raw_mode(if self.read_only_dirs() { 0o555 } else { 0o755 });
        self.create(path, |dir, name| mkdirat(dir, name, mode))?;
        let name = path.last().map_or(self.root_name, |n| n.as_slice());
        let dirs = match self.dirs.take() {
            Some(mut dirs) => {
                dirs.push(name, open_dir).map_err(at(path))?;
                dirs
            }
            None => OpenDirs::root(name, self.parent, open_dir).map_err(at(path))?,
        };
        let set_modes = self.set_modes();
        let dirs = self.dirs.insert(dirs);
        if set_modes {
            // Writable by its owner until its last entry is made, whatever the umask (0222
            // would leave it 0555 and unfillable).
            dirs.innermost().chmod(Mode::from_raw_mode(0o755)).map_err(|e| at(path)(e.into()))?;
        }
        Ok(())
    }

    fn directory_end(&mut self, path: &NarPath) -> io::Result<()> {
        let read_only_dirs = self.read_only_dirs();
        let Some(dirs) = self.dirs.as_mut().filter(|d| d.depth() == path.len() + 1) else {
            return Err(invalid(path, "end of a directory that is not open"));
        };
        if self.modes.canonical {
            let dir = dirs.innermost();
            if !read_only_dirs {
                dir.chmod(Mode::from_raw_mode(0o555)).map_err(|e| at(path)(e.into()))?;
            }
            // After the last entry, which changed the directory's mtime.
            dir.set_times(&store_times()).map_err(|e| at(path)(e.into()))?;
        }
        if !dirs.pop() {
            self.dirs = None;
        }
        Ok(())
    }
}

/// How the nodes an [`Unpacker`] makes in a directory get the store's modes, decided once per
/// directory by [`creation_modes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Creation {
    /// The umask or a default ACL may change the modes asked for: every node's mode is set
    /// with `fchmod` after its creation.
    Fchmod,
    /// Nodes get exactly the modes they are created with; directories are made 0755 and set
    /// to 0555 once filled.
    Exact,
    /// As [`Creation::Exact`], and this process may make entries in a directory that has no
    /// write permission (root, by `CAP_DAC_OVERRIDE`, on a file system that honours it):
    /// directories are made 0555 and filled as they are, with no `fchmod`.
    ExactReadOnlyDirs,
}

/// [`Creation`] for nodes made in the directory `dir`: [`Creation::Exact`] when the process's
/// umask clears none of 0755's bits and `dir` has no default ACL (which would replace the
/// umask, `acl(5)`; directories made in `dir` inherit it, so `dir` alone decides), and
/// [`Creation::ExactReadOnlyDirs`] if then a directory made 0555 in `dir` can be filled
/// (tried once with a hidden directory, `.sluice-probe-<pid>`, removed at once: no store
/// path's name starts with a dot). The umask is read from `/proc/self/status` (`umask(2)` can
/// only be read by setting it, which would race with other threads); when it cannot be read,
/// modes are set after creation.
pub(super) fn creation_modes(dir: BorrowedFd<'_>) -> Creation {
    static UMASK: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let umask = UMASK.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(line.trim(), 8).ok()
    });
    let no_default_acl = matches!(
        rustix::fs::fgetxattr(dir, "system.posix_acl_default", &mut []),
        Err(rustix::io::Errno::NODATA | rustix::io::Errno::NOTSUP)
    );
    if !(umask.is_some_and(|m| m & 0o755 == 0) && no_default_acl) {
        return Creation::Fchmod;
    }
    let probe = format!(".sluice-probe-{}", std::process::id());
    if mkdirat(dir, probe.as_str(), Mode::from_raw_mode(0o555)).is_err() {
        return Creation::Exact;
    }
    let filled = open_dir(dir, probe.as_bytes()).is_ok_and(|d| mkdirat(&d, "d", Mode::from_raw_mode(0o555)).is_ok());
    if let Err(e) = remove_tree(dir, probe.as_bytes()) {
        tracing::warn!("removing {probe}: {e}");
    }
    if filled {
        Creation::ExactReadOnlyDirs
    } else {
        Creation::Exact
    }
}
