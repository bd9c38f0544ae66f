//! Deduplication of identical files by hard links, as Nix's `src/libstore/optimise-store.cc`
//! (Nix 2.8: `optimisePath_`, `optimiseStore`, `optimisePath`) lays it out, so that Nix and
//! sluice share one `.links` directory: every regular file and symlink of a store path is
//! named in `<store>/.links` by the nix32 sha256 of its own NAR serialisation (so a file's
//! executable bit is part of its name, and a symlink is hashed by its target, never
//! followed), and a file whose content is there already is replaced, atomically, by a hard
//! link to that entry (`<store>/.tmp-link-<pid>-<n>` renamed over it). Its directory is made
//! writable for the rename and canonicalised again after it (mode 0555, mtime 1); the store
//! directory itself is never touched. Writable regular files (modified by someone) are left
//! alone with Nix's warning, and a `.links` entry whose size differs from the file's is
//! removed as corrupt, as Nix does; unlike Nix, an entry is also hashed once per run before a
//! file is replaced by a link to it, and one whose contents no longer match its name is
//! replaced by the file (Nix links intact files to it: NixOS/nix#3230). The garbage collector deletes the entries nobody links to
//! any more (`gc.rs`).

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{fchmod, fstat, futimens, linkat, renameat, statat, unlinkat, AtFlags, Dir, FileType, Mode};
use rustix::io::Errno;
use sluice_nix::hash::{Hash, HashAlgo, Hasher};
use sluice_nix::nar::writer::NarWriter;

use super::temp_roots::TempRoots;
use super::tree::{open_dir, remove_tree};
use super::unpack::store_times;
use super::{dump, io_err, LocalStore, LocalStoreError};

/// A directory opened by the walk, with its entries still to link.
type OpenedDir = (OwnedFd, Vec<Vec<u8>>);

/// The directory of hard-link targets in the store directory (Nix's `linksDir`).
pub(super) const LINKS_DIR: &str = ".links";

/// What an optimisation did (Nix's `OptimiseStats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OptimiseStats {
    /// Files replaced by a hard link.
    pub files_linked: u64,
    /// Their sizes, in bytes.
    pub bytes_freed: u64,
    /// Their 512-byte blocks.
    pub blocks_freed: u64,
}

/// What an optimisation reports as it goes.
#[derive(Debug)]
pub enum OptimiseEvent<'a> {
    /// `done` of `expected` store paths were looked at (Nix's progress of `actOptimiseStore`).
    Progress { done: u64, expected: u64 },
    /// A message Nix prints as a warning (without the `warning: ` prefix).
    Warning(&'a str),
    /// A message Nix prints at its informational level.
    Info(&'a str),
}

impl LocalStore {
    /// Deduplicates every valid path (Nix's `LocalStore::optimiseStore`): each is made a
    /// temporary root in `roots` and skipped if a collector deleted it meanwhile; the files
    /// whose inode `.links` holds already are not hashed again.
    pub fn optimise_store(&self, roots: &TempRoots, observe: &mut dyn FnMut(OptimiseEvent<'_>)) -> Result<OptimiseStats, LocalStoreError> {
        self.ensure_writable("optimise the store")?;
        let paths = self.query_all_valid_paths()?;
        let mut optimiser = Optimiser::new(self, load_inodes(&self.links_path())?, observe)?;
        let expected = paths.len() as u64;
        (optimiser.observe)(OptimiseEvent::Progress { done: 0, expected });
        for (done, path) in paths.iter().enumerate() {
            roots.add(path)?;
            if self.is_valid_path(path)? {
                optimiser.optimise_path(self.store_fd.as_fd(), path.base_name().as_bytes(), &self.real_path(path), false)?;
            }
            (optimiser.observe)(OptimiseEvent::Progress { done: done as u64 + 1, expected });
        }
        Ok(optimiser.stats)
    }

    /// Deduplicates the tree `name` in the open directory `parent` (a path being added,
    /// before it is moved into place; `shown` names it in messages) against `.links`, as
    /// `auto-optimise-store` makes Nix do for every path it adds (Nix's `optimisePath`, with
    /// no inodes known beforehand). `parent`'s own mode is left alone.
    pub(super) fn optimise_tree(
        &self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        shown: &Path,
        observe: &mut dyn FnMut(OptimiseEvent<'_>),
    ) -> Result<OptimiseStats, LocalStoreError> {
        let mut optimiser = Optimiser::new(self, HashSet::new(), observe)?;
        optimiser.optimise_path(parent, name, shown, false)?;
        Ok(optimiser.stats)
    }

    /// `<real store>/.links`.
    pub(super) fn links_path(&self) -> PathBuf {
        self.layout.real_store_dir.join(LINKS_DIR)
    }
}

/// The inodes of the entries of `.links` (Nix's `loadInodeHash`): files with one of them are
/// linked already.
fn load_inodes(links: &Path) -> Result<HashSet<u64>, LocalStoreError> {
    let dir =
        rustix::fs::open(links, rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| io_err("opening directory", links)(e.into()))?;
    let mut inodes = HashSet::new();
    for entry in Dir::read_from(&dir).map_err(|e| io_err("reading directory", links)(e.into()))? {
        inodes.insert(entry.map_err(|e| io_err("reading directory", links)(e.into()))?.ino());
    }
    Ok(inodes)
}

/// One optimisation's state.
struct Optimiser<'s, 'o> {
    store: &'s LocalStore,
    links: OwnedFd,
    /// Inodes known to be in `.links` (Nix's `InodeHash`).
    inodes: HashSet<u64>,
    /// Inodes of `.links` entries whose contents were found to match their names in this run.
    verified: HashSet<u64>,
    stats: OptimiseStats,
    observe: &'o mut dyn FnMut(OptimiseEvent<'_>),
}

impl<'s, 'o> Optimiser<'s, 'o> {
    fn new(store: &'s LocalStore, inodes: HashSet<u64>, observe: &'o mut dyn FnMut(OptimiseEvent<'_>)) -> Result<Self, LocalStoreError> {
        let links = open_dir(store.store_fd.as_fd(), LINKS_DIR.as_bytes()).map_err(io_err("opening directory", &store.links_path()))?;
        Ok(Optimiser { store, links, inodes, verified: HashSet::new(), stats: OptimiseStats::default(), observe })
    }

    /// Nix's `optimisePath_` for the tree `name` of `parent`, shown as `shown`; `toggle`:
    /// `parent` is a directory of a store path, made writable for a replacement. The walk
    /// keeps its own stack of open directories, not the thread's: a tree as deep as the store
    /// accepts (about 2,000 levels within `PATH_MAX`) overflowed a daemon worker's stack and
    /// aborted the daemon when this recursed.
    fn optimise_path(&mut self, parent: BorrowedFd<'_>, name: &[u8], shown: &Path, toggle: bool) -> Result<(), LocalStoreError> {
        let mut shown = shown.to_path_buf();
        // The directories being visited, innermost last, each with its entries still to visit.
        let mut open: Vec<(OwnedFd, Vec<Vec<u8>>)> = Vec::new();
        if let Some(dir) = self.optimise_node(parent, name, &shown, toggle)? {
            open.push(dir);
        }
        while let Some((dir, entries)) = open.last_mut() {
            let Some(entry) = entries.pop() else {
                open.pop();
                shown.pop();
                continue;
            };
            shown.push(std::ffi::OsStr::from_bytes(&entry));
            let inner = self.optimise_node(dir.as_fd(), &entry, &shown, true)?;
            match inner {
                Some(inner) => open.push(inner),
                None => {
                    shown.pop();
                }
            }
        }
        Ok(())
    }

    /// One node of [`Optimiser::optimise_path`]'s walk: a directory is opened and returned with
    /// its entries not yet linked; a file or symlink is linked to its `.links` entry.
    fn optimise_node(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        shown: &Path,
        toggle: bool,
    ) -> Result<Option<OpenedDir>, LocalStoreError> {
        let st = statat(parent, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| io_err("getting status of", shown)(e.into()))?;
        let file_type = FileType::from_raw_mode(st.st_mode);
        if file_type == FileType::Directory {
            let dir = open_dir(parent, name).map_err(io_err("opening directory", shown))?;
            let entries = self.unlinked_entries(dir.as_fd(), shown)?;
            return Ok(Some((dir, entries)));
        }
        self.link_node(parent, name, shown, toggle, &st)?;
        Ok(None)
    }

    /// Replaces the file or symlink `name` of `parent` (status `st`) by a hard link to its
    /// `.links` entry, making the entry if there is none.
    fn link_node(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        shown: &Path,
        toggle: bool,
        st: &rustix::fs::Stat,
    ) -> Result<(), LocalStoreError> {
        let file_type = FileType::from_raw_mode(st.st_mode);
        // Linux can hard-link symlinks (Nix's CAN_LINK_SYMLINK).
        if file_type != FileType::RegularFile && file_type != FileType::Symlink {
            return Ok(());
        }
        if file_type == FileType::RegularFile && st.st_mode & 0o200 != 0 {
            (self.observe)(OptimiseEvent::Warning(&format!("skipping suspicious writable file '{}'", shown.display())));
            return Ok(());
        }
        if st.st_nlink > 1 && self.inodes.contains(&st.st_ino) {
            return Ok(());
        }
        let hash = nar_hash(parent, name).map_err(io_err("hashing", shown))?;
        let link_name = hash.to_nix32();
        let link_path = self.store.links_path().join(&link_name);
        if let Some(link) = stat_if_exists(self.links.as_fd(), &link_name).map_err(io_err("getting status of", &link_path))? {
            if link.st_size != st.st_size {
                self.remove_corrupted(&link_name, &link_path)?;
            }
        }
        let mut tries = 0;
        loop {
            match linkat(parent, name, self.links.as_fd(), &link_name, AtFlags::empty()) {
                Ok(()) => {
                    // The first file with these contents: it is the entry now.
                    self.inodes.insert(st.st_ino);
                    self.verified.insert(st.st_ino);
                    return Ok(());
                }
                // Another file (or process) made the entry first: link to it below.
                Err(Errno::EXIST) => {}
                // On ext4, probably a full directory index: this file is not deduplicated.
                Err(Errno::NOSPC) => {
                    let msg = format!("cannot link '{}' to '{}': {}", link_path.display(), shown.display(), io::Error::from(Errno::NOSPC));
                    (self.observe)(OptimiseEvent::Info(&msg));
                    return Ok(());
                }
                Err(e) => return Err(io_err("linking into .links", shown)(e.into())),
            }
            let link = statat(self.links.as_fd(), &link_name, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| io_err("getting status of", &link_path)(e.into()))?;
            if link.st_ino == st.st_ino {
                return Ok(());
            }
            // An entry's name says what its contents were, not what they are (a disk fault, a
            // write through another link): linking to a damaged one would damage this file, so
            // its NAR is compared once per run, and a damaged one is replaced by this file.
            if self.verified.contains(&link.st_ino)
                || nar_hash(self.links.as_fd(), link_name.as_bytes()).map_err(io_err("hashing", &link_path))? == hash
            {
                self.verified.insert(link.st_ino);
                break;
            }
            self.remove_corrupted(&link_name, &link_path)?;
            tries += 1;
            if tries > 1 {
                // Another process keeps making a damaged entry: leave this file alone.
                return Ok(());
            }
        }
        let _writable = if toggle { Some(WritableDir::new(parent, shown)?) } else { None };
        let store_fd = self.store.store_fd.as_fd();
        // A random name, as Nix's (`.tmp-link-<pid>-<random>`), drawn again if someone made it
        // first: the store directory may be writable by others (build users).
        let (temp_name, temp_path) = loop {
            let random =
                super::temp_dir::random_bytes::<8>().map_err(io_err("naming a temporary link in", &self.store.layout.real_store_dir))?;
            let temp_name = format!(".tmp-link-{}-{}", std::process::id(), u64::from_ne_bytes(random));
            let temp_path = self.store.layout.real_store_dir.join(&temp_name);
            match linkat(self.links.as_fd(), &link_name, store_fd, &temp_name, AtFlags::empty()) {
                Ok(()) => break (temp_name, temp_path),
                Err(Errno::EXIST) => continue,
                // Too many links to one inode (likely an empty file): leave this one alone.
                Err(Errno::MLINK) => {
                    if st.st_size > 0 {
                        (self.observe)(OptimiseEvent::Info(&format!("'{}' has maximum number of links", link_path.display())));
                    }
                    return Ok(());
                }
                Err(e) => return Err(io_err("linking", &temp_path)(e.into())),
            }
        };
        self.inodes.insert(st.st_ino);
        if let Err(e) = renameat(store_fd, &temp_name, parent, name) {
            if let Err(u) = unlinkat(store_fd, &temp_name, AtFlags::empty()) {
                tracing::error!("unable to unlink '{}': {u}", temp_path.display());
            }
            // Some file systems count the rename's transient link against the maximum.
            if e == Errno::MLINK {
                return Ok(());
            }
            return Err(io_err("renaming a hard link over", shown)(e.into()));
        }
        let (size, blocks) = (st.st_size as u64, st.st_blocks as u64);
        self.stats.files_linked += 1;
        self.stats.bytes_freed += size;
        self.stats.blocks_freed += blocks;
        Ok(())
    }

    /// Removes the damaged `.links` entry `link_name`, with Nix's warnings.
    fn remove_corrupted(&mut self, link_name: &str, link_path: &Path) -> Result<(), LocalStoreError> {
        (self.observe)(OptimiseEvent::Warning(&format!("removing corrupted link '{}'", link_path.display())));
        (self.observe)(OptimiseEvent::Warning(
            "There may be more corrupted paths.\nYou should run `nix-store --verify --check-contents --repair` to fix them all",
        ));
        // Whatever took the entry's name, a directory too, goes: one damaged entry must not end
        // the optimisation of every other file.
        remove_tree(self.links.as_fd(), link_name.as_bytes()).map(drop).map_err(io_err("removing", link_path))
    }

    /// The entries of `dir` whose inode is not in `.links` already (Nix's
    /// `readDirectoryIgnoringInodes`).
    fn unlinked_entries(&self, dir: BorrowedFd<'_>, shown: &Path) -> Result<Vec<Vec<u8>>, LocalStoreError> {
        let mut names = Vec::new();
        for entry in Dir::read_from(dir).map_err(|e| io_err("reading directory", shown)(e.into()))? {
            let entry = entry.map_err(|e| io_err("reading directory", shown)(e.into()))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." && !self.inodes.contains(&entry.ino()) {
                names.push(name.to_vec());
            }
        }
        Ok(names)
    }
}

/// The sha256 of the NAR serialisation of the node `name` in `parent` (Nix's
/// `hashPath(htSHA256, path)`).
pub(super) fn nar_hash(parent: BorrowedFd<'_>, name: &[u8]) -> io::Result<Hash> {
    let mut hasher = Hasher::new(HashAlgo::Sha256);
    dump::dump(parent, name, &mut NarWriter::new(&mut hasher)?)?;
    Ok(hasher.finish())
}

/// The status of `name` in `dir` (not followed), `None` if there is no such entry.
fn stat_if_exists(dir: BorrowedFd<'_>, name: &str) -> io::Result<Option<rustix::fs::Stat>> {
    match statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A directory of a store path made writable by its owner while one of its entries is
/// replaced; dropping it makes it read-only with the store's mtime again (Nix's
/// `makeWritable` and `MakeReadOnly`, which calls `canonicaliseTimestampAndPermissions`).
struct WritableDir {
    dir: OwnedFd,
    shown: PathBuf,
}

impl WritableDir {
    fn new(dir: BorrowedFd<'_>, shown: &Path) -> Result<Self, LocalStoreError> {
        let dir = dir.try_clone_to_owned().map_err(io_err("duplicating the descriptor of", shown))?;
        let st = fstat(&dir).map_err(|e| io_err("getting status of", shown)(e.into()))?;
        fchmod(&dir, Mode::from_raw_mode(st.st_mode | 0o200)).map_err(|e| io_err("making writable", shown)(e.into()))?;
        Ok(WritableDir { dir, shown: shown.to_owned() })
    }
}

impl Drop for WritableDir {
    fn drop(&mut self) {
        let canonical = fchmod(&self.dir, Mode::from_raw_mode(0o555)).and_then(|()| futimens(&self.dir, &store_times()));
        if let Err(e) = canonical {
            tracing::error!("making {} read-only again: {e}", self.shown.display());
        }
    }
}
