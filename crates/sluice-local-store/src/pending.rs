//! A path being added ([`PendingPath`]): its NAR unpacked into a temporary tree while hashed,
//! then verified, renamed into place and registered by [`PendingPath::commit`]
//! (`commit.rs` commits many at once); dropped uncommitted, its tree and lock go.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{openat, renameat, renameat_with, Mode, OFlags, RenameFlags};
use sluice_nix::hash::Hasher;
use sluice_nix::hash_modulo::ModuloHasher;
use sluice_nix::nar::reader::parse;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use crate::content_hash::{ContentHasher, ContentHashingReader};
use crate::error::io_err;
use crate::lock::PathLock;
use crate::temp_dir::TempDir;
use crate::verify::CaHashing;
use crate::{
    nar_hash_thread, tree, unpack, verify, LocalStore, LocalStoreError, OptimiseEvent, SignaturePolicy, TempRoots, Uncommitted, Unpacked,
};

/// A store path being added with the info its source claims: holds the per-path lock, the
/// caller's temporary roots (the path among them) and the temporary tree `<base name>` in the
/// store's directory of temporary trees. Dropping it without `commit` removes the temporary tree and the
/// lock. (It owns an `Arc` of its store so that it can move between threads and tasks while
/// it waits for its references to become valid.)
pub struct PendingPath {
    pub(crate) store: Arc<LocalStore>,
    pub(crate) info: ValidPathInfo,
    /// The policy that vouched for `info` ([`VouchedInfo`](crate::VouchedInfo)), if one did.
    pub(crate) vouched: Option<SignaturePolicy>,
    /// The directory of temporary trees (shared by the additions in progress). Only the
    /// holder of the path's lock uses the tree named after the path there.
    pub(crate) temp_dir: Arc<TempDir>,
    /// Whether this value may have made the temporary tree that is there now: false until
    /// [`PendingPath::unpack`] starts and after the tree was renamed into place or removed,
    /// so that nothing is looked up that is known to be absent. (A tree an interrupted
    /// addition left is found by the unpacking itself: see `unpack.rs`.)
    pub(crate) temp_tree: std::sync::atomic::AtomicBool,
    pub(crate) unpacked: Option<Unpacked>,
    /// A repair ([`LocalStore::try_begin_repair`]): `info` is the registration, and the tree
    /// replaces the one at the path, which stays registered as it is.
    pub(crate) repair: bool,
    /// Released (and its file deleted) after `Drop::drop` has removed the temporary tree.
    pub(crate) _lock: PathLock,
    /// Keeps the roots until the path is registered or given up.
    pub(crate) _roots: TempRoots,
}

impl PendingPath {
    /// The info the path is being added with.
    pub fn info(&self) -> &ValidPathInfo {
        &self.info
    }

    /// Unpacks the NAR read from `nar` into the temporary tree, hashing it (sha256, and what
    /// the info's content address needs) as it goes. Reads exactly the NAR: bytes after its
    /// end are left unread, as Nix's `restorePath` leaves them (a cache's NAR file with bytes
    /// after the NAR is substituted by Nix 2.8 and 2.26; a framed add's rest is drained by the
    /// daemon, as Nix's `FramedSource` drains it). On failure the temporary tree is removed, so the path can be unpacked
    /// again (e.g. from another source); a second call replaces the first's tree.
    pub fn unpack(&mut self, nar: &mut dyn Read) -> Result<Unpacked, LocalStoreError> {
        self.unpacked = None;
        self.remove_temp()?;
        self.temp_tree.store(true, std::sync::atomic::Ordering::Relaxed);
        let result = self.unpack_into_temp(nar);
        if result.is_err() {
            // The unpack error is the one to report.
            let _ = self.remove_temp();
        }
        let unpacked = result?;
        self.unpacked = Some(unpacked.clone());
        Ok(unpacked)
    }

    fn unpack_into_temp(&self, nar: &mut dyn Read) -> Result<Unpacked, LocalStoreError> {
        let shown = self.shown();
        let hashing = verify::ca_hashing(&self.info);
        let (flat_algo, nar_hasher) = match &hashing {
            Some(CaHashing::Flat(algo)) => (Some(*algo), None),
            Some(CaHashing::Nar { algo, modulo: Some(m) }) => (None, Some(ContentHasher::Modulo(ModuloHasher::new(*algo, m.as_bytes())))),
            Some(CaHashing::Nar { algo, modulo: None }) => (None, Some(ContentHasher::Plain(Hasher::new(*algo)))),
            Some(CaHashing::NarHash) | None => (None, None),
        };
        let threaded = self.info.nar_size >= nar_hash_thread::THREADED_FROM;
        let mut reader = nar_hash_thread::NarHashingReader::new(ContentHashingReader { inner: nar, hasher: nar_hasher }, threaded);
        let name = self.info.path.base_name().as_bytes();
        // Nix reads the tree at its real path, and at its store path wherever the store is
        // used as the store directory itself (a chroot store moved into place).
        let root = self.store.real_path(&self.info.path).as_os_str().len().max(self.store.store_dir.display_path(&self.info.path).len());
        let mut unpacker = unpack::Unpacker::new(
            self.temp_dir.fd.as_fd(),
            name,
            flat_algo,
            unpack::FileModes::STORE,
            self.temp_dir.creation,
            unpack::room_below(root),
        );
        parse(&mut reader, &mut unpacker).map_err(|source| LocalStoreError::Nar { path: shown.clone(), source })?;
        let nar_size = reader.len();
        let (nar_hash, content) = reader.finish().map_err(io_err("hashing the NAR of", &self.store.real_path(&self.info.path)))?;
        let (ca_hash, ca_hash_with_offsets) = match content.hasher {
            Some(h) => {
                let (hash, with_offsets) = h.finish();
                (Some(hash), with_offsets)
            }
            None => (unpacker.flat_hash(), None),
        };
        Ok(Unpacked { nar_hash, nar_size, ca_hash, ca_hash_with_offsets })
    }

    /// Passes the verification boundary under `policy`, renames the tree to its final path
    /// and registers the path in one transaction. Fails (leaving nothing at the final path)
    /// if the path fails verification or a reference other than the path itself is not
    /// valid. The tree's contents and its rename are made durable (an `fsync` of a
    /// single file and of the store directory, else a `syncfs` of the store's file system)
    /// before the registration is committed. [`LocalStore::commit_all`] does the same for
    /// many paths with one flush and one transaction.
    pub fn commit(self, policy: &SignaturePolicy) -> Result<(), LocalStoreError> {
        let store = Arc::clone(&self.store);
        let shown = self.shown();
        match store.commit_all(vec![(self, policy)]).pop() {
            Some(result) => result.map_err(Uncommitted::into_error),
            None => Err(LocalStoreError::Misuse { path: shown, what: "no commit result" }),
        }
    }

    /// Verifies the unpacked tree against the info (see [`verify`](self::verify)), checks
    /// that every reference is valid or in `batch` (asking the database about those not in
    /// `known_valid`), deduplicates it with `auto-optimise-store`, and renames it to its final
    /// path. Returns the derivation outputs to register.
    pub(crate) fn place(
        &self,
        policy: &SignaturePolicy,
        batch: &BTreeSet<StorePath>,
        known_valid: &BTreeSet<StorePath>,
    ) -> Result<Vec<(String, StorePath)>, LocalStoreError> {
        let shown = self.shown();
        let info = &self.info;
        let Some(unpacked) = &self.unpacked else {
            return Err(LocalStoreError::Misuse { path: shown, what: "committed before a successful unpack" });
        };
        // A repair's tree is admitted by the registered NAR hash, which was vouched for when
        // the path was registered.
        let policy = if self.repair { &SignaturePolicy::unchecked() } else { policy };
        verify::verify(&self.store.store_dir, info, unpacked, policy, self.vouched.as_ref())?;
        let others: Vec<&StorePath> =
            info.references.iter().filter(|r| **r != info.path && !batch.contains(*r) && !known_valid.contains(*r)).collect();
        let valid = self.store.registry.valid_paths(others.iter().copied())?;
        if let Some(missing) = others.into_iter().find(|r| !valid.contains(*r)) {
            return Err(LocalStoreError::MissingReference { path: shown, reference: self.store.store_dir.display_path(missing) });
        }
        let outputs = self.derivation_outputs(batch)?;
        let name = info.path.base_name();
        if self.store.auto_optimise.load(std::sync::atomic::Ordering::Relaxed) {
            let shown = self.store.real_path(&info.path);
            self.store.optimise_tree(self.temp_dir.fd.as_fd(), name.as_bytes(), &shown, &mut |event| match event {
                OptimiseEvent::Warning(msg) => tracing::warn!("{msg}"),
                OptimiseEvent::Info(msg) => tracing::info!("{msg}"),
                OptimiseEvent::Progress { .. } => {}
            })?;
        }
        let (from, to) = (self.temp_dir.fd.as_fd(), self.store.store_fd.as_fd());
        let real_path = self.store.real_path(&info.path);
        let placed = rename_read_only_trees(from, to, name.as_bytes(), || match self.repair {
            // The damaged tree takes the temporary tree's place, and goes when `self` is
            // dropped; a tree that disappeared is simply replaced.
            true => renameat_with(from, name, to, name, RenameFlags::EXCHANGE).or_else(|e| match e {
                rustix::io::Errno::NOENT => renameat(from, name, to, name),
                e => Err(e),
            }),
            false => self.rename_new(from, to, &real_path),
        });
        placed.map_err(|e| io_err("renaming into place", &real_path)(e.into()))?;
        // A repair's temporary name now holds the damaged tree.
        self.temp_tree.store(self.repair, std::sync::atomic::Ordering::Relaxed);
        Ok(outputs)
    }

    /// Renames the verified tree of a path that is not valid to its location, with
    /// `RENAME_NOREPLACE`: if an interrupted addition left an unregistered tree there
    /// (`EEXIST`), it is removed and the rename made again. Without `RENAME_NOREPLACE` (a file
    /// system that does not support it), the location is cleared first.
    fn rename_new(&self, from: std::os::fd::BorrowedFd<'_>, to: std::os::fd::BorrowedFd<'_>, real_path: &Path) -> rustix::io::Result<()> {
        let name = self.info.path.base_name();
        let remove = || {
            let removed = tree::remove_tree(to, name.as_bytes())
                .map_err(|e| rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO))?;
            if removed {
                tracing::warn!(path = %real_path.display(), "removed an unregistered tree at a store path's location");
            }
            Ok(())
        };
        match renameat_with(from, name, to, name, RenameFlags::NOREPLACE) {
            Err(rustix::io::Errno::EXIST) => remove().and_then(|()| renameat_with(from, name, to, name, RenameFlags::NOREPLACE)),
            Err(rustix::io::Errno::INVAL) => remove().and_then(|()| renameat(from, name, to, name)),
            r => r,
        }
    }

    /// For a `.drv` path (not repaired: a repair keeps the registration), the outputs to
    /// register, after [`verify::verify_derivation`] of the unpacked derivation (`batch`:
    /// the paths committed before it in the same batch).
    pub(crate) fn derivation_outputs(&self, batch: &BTreeSet<StorePath>) -> Result<Vec<(String, StorePath)>, LocalStoreError> {
        if !self.info.path.is_derivation() || self.repair {
            return Ok(Vec::new());
        }
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut aterm = Vec::new();
        openat(self.temp_dir.fd.as_fd(), self.info.path.base_name(), flags, Mode::empty())
            .map_err(io::Error::from)
            .and_then(|fd| File::from(fd).read_to_end(&mut aterm))
            .map_err(io_err("reading the derivation", &self.temp_path()))?;
        verify::verify_derivation(&self.store, &self.info, &aterm, batch)
    }

    /// Removes the temporary tree, if this value may have made one.
    fn remove_temp(&self) -> Result<(), LocalStoreError> {
        if self.temp_tree.load(std::sync::atomic::Ordering::Relaxed) {
            tree::remove_tree(self.temp_dir.fd.as_fd(), self.info.path.base_name().as_bytes())
                .map_err(io_err("removing", &self.temp_path()))?;
            self.temp_tree.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    fn temp_path(&self) -> PathBuf {
        self.temp_dir.path.join(self.info.path.base_name())
    }

    /// The full store path, for messages.
    pub(crate) fn shown(&self) -> String {
        self.store.store_dir.display_path(&self.info.path)
    }
}

impl Drop for PendingPath {
    fn drop(&mut self) {
        if let Err(e) = self.remove_temp() {
            tracing::warn!("{e}");
        }
    }
}

/// Runs `rename`, which moves the tree `name` of `from` to `to` (and, exchanging, the tree
/// there to `from`). Moving a directory to another parent rewrites its `..` entry, which needs
/// write permission on the directory itself, and store trees are read-only (0555): root may
/// anyway (`CAP_DAC_OVERRIDE`), another owner of the store gets `EACCES`. Then the directories
/// named `name` in `from` and `to` are made 0755 (their mtime stays 1: a mode change sets only
/// the ctime), `rename` runs again, and the tree at `to` — the moved one, or the one that stayed
/// if it failed again — is made 0555 again. The tree moved to `from` is a temporary tree, to be
/// removed.
fn rename_read_only_trees(
    from: BorrowedFd<'_>,
    to: BorrowedFd<'_>,
    name: &[u8],
    rename: impl Fn() -> rustix::io::Result<()>,
) -> rustix::io::Result<()> {
    match rename() {
        Err(rustix::io::Errno::ACCESS) => {}
        done => return done,
    }
    let set_mode = |dir: BorrowedFd<'_>, mode: u32| -> rustix::io::Result<()> {
        match tree::open_dir(dir, name) {
            Ok(fd) => rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)),
            // Not there, or not a directory: nothing to make movable.
            Err(_) => Ok(()),
        }
    };
    set_mode(from, 0o755)?;
    set_mode(to, 0o755)?;
    let renamed = rename();
    set_mode(to, 0o555)?;
    renamed
}
