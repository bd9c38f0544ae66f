//! The store as a builtin sees it, as in Nix's sandbox: only the closure of the derivation's
//! inputs exists in the store directory, nothing outside it; symlinks are followed in the
//! same view. Shared by `builtin:buildenv` (the packages it links) and
//! `builtin:unpack-channel` (the tarball it reads).

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use sluice_nix::store_path::StorePath;

use sluice_local_store::LocalStore;

/// Symlinks followed while resolving one path (Linux's `MAXSYMLINKS`).
const MAX_SYMLINKS: usize = 40;

pub(super) fn libc_enotdir() -> i32 {
    rustix::io::Errno::NOTDIR.raw_os_error()
}

/// Whether `e` says that a path does not exist (or goes through a non-directory).
pub(super) fn is_absent(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc_enotdir())
}

/// The store as a builtin sees it: the store directory holds only the `visible` paths (the
/// closure of the inputs); nothing outside the store directory exists. Paths are the logical
/// ones (`/nix/store/…`); symlinks are followed in the same view.
pub(super) struct View<'a> {
    /// The store.
    pub(super) store: &'a LocalStore,
    /// The paths that exist in the view.
    pub(super) visible: &'a BTreeSet<StorePath>,
    /// Paths resolved so far and what they resolved to: a walk resolves each entry of a
    /// directory it resolved before, so that only the last component is looked at (resolving
    /// every path from the root made a tree `n` deep cost `n³`).
    resolved: RefCell<HashMap<PathBuf, PathBuf>>,
}

impl<'a> View<'a> {
    /// The store `store` with only `visible` in it.
    pub(super) fn new(store: &'a LocalStore, visible: &'a BTreeSet<StorePath>) -> Self {
        View { store, visible, resolved: RefCell::new(HashMap::new()) }
    }

    /// Where the logical path `p` (without symlinks in it, as [`View::resolve`] gives) is on
    /// disk; `NotFound` outside the visible paths.
    pub(super) fn real(&self, p: &Path) -> io::Result<PathBuf> {
        let absent = || io::Error::from(io::ErrorKind::NotFound);
        let rest = p.strip_prefix(self.store.store_dir().as_str()).map_err(|_| absent())?;
        let mut parts = rest.components();
        let Some(Component::Normal(base)) = parts.next() else { return Err(absent()) };
        let path = StorePath::from_base_name(&base.to_string_lossy()).map_err(|_| absent())?;
        if !self.visible.contains(&path) {
            return Err(absent());
        }
        // Not `join("")`, which would add a `/` and make a file a "not a directory".
        let real = self.store.real_path(&path);
        Ok(match parts.as_path() {
            rest if rest.as_os_str().is_empty() => real,
            rest => real.join(rest),
        })
    }

    /// `p` with every symlink in it followed (Nix's `canonPath(p, true)`), as a logical path;
    /// fails as `lstat` would on a missing component.
    pub(super) fn resolve(&self, p: &Path) -> io::Result<PathBuf> {
        if let Some(done) = self.resolved.borrow().get(p) {
            return Ok(done.clone());
        }
        let known_parent = match (p.parent(), p.file_name()) {
            (Some(parent), Some(name)) => self.resolved.borrow().get(parent).map(|dir| (dir.clone(), name.to_owned())),
            _ => None,
        };
        let (mut cur, mut todo) = match known_parent {
            Some((dir, name)) => (dir, vec![PathBuf::from(name)]),
            None => (PathBuf::from("/"), p.components().rev().map(|c| PathBuf::from(c.as_os_str())).collect()),
        };
        let mut followed = 0;
        let store_depth = Path::new(self.store.store_dir().as_str()).components().count();
        while let Some(c) = todo.pop() {
            match c.components().next() {
                Some(Component::RootDir | Component::CurDir) | None => continue,
                Some(Component::ParentDir) => {
                    cur.pop();
                    continue;
                }
                _ => cur.push(&c),
            }
            if cur.components().count() <= store_depth {
                continue;
            }
            let real = self.real(&cur)?;
            if std::fs::symlink_metadata(&real)?.file_type().is_symlink() {
                followed += 1;
                if followed > MAX_SYMLINKS {
                    return Err(io::Error::from_raw_os_error(rustix::io::Errno::LOOP.raw_os_error()));
                }
                let target = std::fs::read_link(&real)?;
                cur.pop();
                if target.is_absolute() {
                    cur = PathBuf::from("/");
                }
                todo.extend(target.components().rev().map(|c| PathBuf::from(c.as_os_str())));
            }
        }
        self.resolved.borrow_mut().insert(p.to_owned(), cur.clone());
        Ok(cur)
    }

    /// Whether `p`, symlinks followed, is a directory (Nix's `stat`).
    pub(super) fn stat_is_dir(&self, p: &Path) -> io::Result<bool> {
        Ok(std::fs::metadata(self.real(&self.resolve(p)?)?)?.is_dir())
    }

    /// The entry names of the directory `p` (symlinks followed), sorted.
    pub(super) fn read_dir(&self, p: &Path) -> io::Result<Vec<Vec<u8>>> {
        let real = self.real(&self.resolve(p)?)?;
        let mut names = std::fs::read_dir(real)?.map(|e| e.map(|e| e.file_name().as_bytes().to_vec())).collect::<io::Result<Vec<_>>>()?;
        names.sort();
        Ok(names)
    }
}
