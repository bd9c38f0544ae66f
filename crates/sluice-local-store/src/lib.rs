//! The local store: Nix's on-disk layout (`<root>/nix/store`, `<root>/nix/var/nix/db/db.sqlite`
//! with Nix's schema version 10, or the store URL's `real` and `state` directories) so that
//! real Nix reads what sluice writes and vice versa. Source of the layout and schema: Nix
//! `src/libstore/local-store.cc`, `schema.sql`; of the configuration, `local-store.hh` and
//! `local-fs-store.hh` ([`LocalStoreConfig`]).
//!
//! Adding a path: [`LocalStore::begin_add`] makes the path a temporary GC root of the caller's
//! [`TempRoots`] and takes the per-path lock (`<path>.lock`, flock, as Nix's `PathLocks`);
//! [`PendingPath`] unpacks a NAR into a temporary tree while hashing it and gives every node
//! Nix's canonical metadata as it is made; [`PendingPath::commit`] passes the verification
//! boundary ([`verify`](self::verify): hashes, content address, signatures), renames the tree
//! into place and registers the path in one transaction once all its references are valid.
//! Nothing appears at a store path's location before its contents are complete, verified and
//! durable, and a tree found there unregistered (after a crash) is replaced.
//!
//! Temporary trees live in a directory of the store directory that the store makes for the
//! additions in progress and removes when the last of them ends (see [`temp_dir`]): new,
//! private, locked and rooted by its holder, named like a store path with a random hash part
//! so that Nix's collectors keep it while it lives and delete it once its holder is gone. A
//! tree there is named after its path's base name and belongs to the holder of that path's
//! lock.

mod api;
mod commit;
pub mod config;
mod content_hash;
mod current;
mod drv_hashes;
mod dump;
mod error;
mod fs_nar;
mod gc;
mod layout;
mod lock;
mod nar_hash_thread;
mod optimise;
mod pending;
mod queries;
mod registry;
mod roots;
mod schema;
mod temp_dir;
mod temp_roots;
mod tree;
pub mod unix_socket;
mod unpack;
mod verify;
mod verify_store;

pub use commit::Uncommitted;
pub use dump::NarDump;
pub use fs_nar::{dump_fs_path, restore_nar};
pub use gc::{GcAction, GcOptions, GcResults, Roots};
pub use optimise::{OptimiseEvent, OptimiseStats};
pub use pending::PendingPath;
pub use temp_dir::{is_temp_dir, KeptTempDir, TEMP_DIR_NAME};
pub use temp_roots::TempRoots;
pub use verify::{SignaturePolicy, TrustedKeysError, Vouched, VouchedInfo};
pub use verify_store::{Repairer, VerifyMessage};

use std::collections::BTreeSet;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Once, OnceLock, Weak};

use rustix::fs::{open, Mode, OFlags};
use sluice_nix::hash::Hash;
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};

use crate::config::LocalStoreConfig;
use error::io_err;
pub use error::{untrusted_detail, unverified_signers, LocalStoreError};
use layout::Layout;
use lock::PathLock;
use registry::Registry;
use temp_dir::TempDir;

/// A local Nix store: the system store (`local`), a chroot store (`local?root=DIR`), or one
/// with its own `real`/`state`/`log` directories. Safe to share between threads.
pub struct LocalStore {
    store_dir: StoreDir,
    layout: Layout,
    /// `read-only=true`: nothing may be written.
    read_only: bool,
    /// The real store directory, opened once: every node of a store path is reached from it.
    store_fd: OwnedFd,
    registry: Registry,
    /// Removal of the directories of temporary trees that killed runs left, at the first
    /// addition or stale lock file (see [`LocalStore::remove_stale_temp_dirs`]).
    stale_temp_dirs: Once,
    /// The directory of temporary trees of the additions in progress, if any: it goes with
    /// the last of them.
    temp_dir: std::sync::Mutex<Weak<TempDir>>,
    /// How nodes made in a directory of temporary trees get their modes
    /// ([`unpack::creation_modes`] of the first one).
    creation: OnceLock<unpack::Creation>,
    /// `auto-optimise-store`: every path added is deduplicated against `.links` before it is
    /// moved into place ([`LocalStore::set_auto_optimise`]).
    auto_optimise: std::sync::atomic::AtomicBool,
    /// Whether paths are made durable before they are registered
    /// ([`LocalStore::set_fsync_store_paths`]); stored negated so that the default is on.
    no_fsync: std::sync::atomic::AtomicBool,
    /// The experimental features that derivations registered here may use
    /// ([`LocalStore::set_experimental_features`]).
    features: std::sync::atomic::AtomicU8,
    /// The hashes modulo of derivations read so far (`LocalStore::drv_hashes`).
    drv_hashes: drv_hashes::DrvHashMemo,
    /// The store directory and database as opened ([`LocalStore::is_current`]).
    opened: current::Opened,
}

/// What unpacking a NAR produced: the NAR's own hash (sha256) and size, and the hash its
/// path's content address asks for, computed from the content (`None` without a content
/// address, for a `fixed:r:sha256` one without self-reference, which is the NAR hash, and
/// for a flat one whose NAR root is not a regular file).
#[derive(Debug, Clone)]
pub struct Unpacked {
    pub nar_hash: Hash,
    /// Bytes of the NAR.
    pub nar_size: u64,
    pub ca_hash: Option<Hash>,
    /// For a `fixed:r:` path that refers to itself, its content hash as Nix before 2.17
    /// computed it (`ca_hash` is Nix's since: [`sluice_nix::hash_modulo`]); a content address
    /// made by either is accepted.
    pub ca_hash_with_offsets: Option<Hash>,
}

/// What [`LocalStore::try_begin_add`] found.
pub enum TryAdd {
    /// The path is valid already.
    Valid,
    /// Another process or thread is adding it.
    Busy,
    /// The lock is ours: unpack and commit.
    Pending(Box<PendingPath>),
}

impl LocalStore {
    /// Opens the store `config` describes: its paths in `config.dirs.real`, its database in
    /// `<config.dirs.state>/db`. Creates the layout, database and `schema` file if missing and
    /// holds a shared lock on `db/big-lock` while open, as Nix does; with `read_only`, creates
    /// and locks nothing and opens the database immutable (Nix's `read-only` mode, which still
    /// creates missing directories). `config.require_sigs` is for the copying code to apply.
    pub fn open(config: &LocalStoreConfig) -> Result<Self, LocalStoreError> {
        let layout = Layout::new(&config.dirs);
        if !config.read_only {
            layout.create().map_err(|(path, source)| LocalStoreError::Io { what: "creating", path, source })?;
        }
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let store_fd =
            open(&layout.real_store_dir, flags, Mode::empty()).map_err(|e| io_err("opening", &layout.real_store_dir)(e.into()))?;
        let db = if config.read_only { schema::open_read_only(&layout.db_dir)? } else { schema::open(&layout.db_dir)? };
        let store_dir = StoreDir::default();
        let registry = Registry::new(db, layout.db_file.clone(), store_dir.clone());
        let opened = current::Opened::new(store_fd.as_fd(), &layout)?;
        Ok(LocalStore {
            store_dir,
            layout,
            read_only: config.read_only,
            store_fd,
            registry,
            stale_temp_dirs: Once::new(),
            temp_dir: Default::default(),
            creation: OnceLock::new(),
            auto_optimise: Default::default(),
            no_fsync: Default::default(),
            features: Default::default(),
            drv_hashes: Default::default(),
            opened,
        })
    }

    /// Sets `auto-optimise-store` (Nix's default: false): from now on, the files of every path
    /// added are replaced by hard links to identical files under `.links` before the path
    /// is moved into place, as Nix's `addToStore` calls `optimisePath` before registering.
    pub fn set_auto_optimise(&self, on: bool) {
        self.auto_optimise.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets `fsync-store-paths` (sluice's default: true; Nix's: false, `src/libstore/globals.hh`).
    /// On, the contents of the paths of each commit and their renames into place are made
    /// durable (an `fsync` of each single-file path and of the store directory, or one
    /// `syncfs` of the store's file system for larger commits) before their registration is
    /// written, so that after a crash a path is absent or complete. Off, as in Nix by default,
    /// a commit costs no disk flush, and a crash can leave a registered path whose contents
    /// were not yet written.
    pub fn set_fsync_store_paths(&self, on: bool) {
        self.no_fsync.store(!on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the `experimental-features` (Nix's default: none) that a derivation registered
    /// from now on may need: `ca-derivations` for floating content-addressed outputs,
    /// `impure-derivations` for impure ones, `dynamic-derivations` for outputs hashed as text
    /// and outputs of input derivations' outputs (Nix's `parseDerivation` refuses them
    /// otherwise, at every registration of a `.drv`). Other features change nothing here.
    pub fn set_experimental_features<'f>(&self, features: impl IntoIterator<Item = &'f str>) {
        let bits = features.into_iter().fold(0, |bits, f| bits | verify::feature_bit(f));
        self.features.store(bits, std::sync::atomic::Ordering::Relaxed);
    }

    /// Fails with [`LocalStoreError::ReadOnly`] if the store was opened read-only: every
    /// operation that writes calls it first, and so can a caller before it starts work that
    /// would end in a write.
    pub fn ensure_writable(&self, what: &'static str) -> Result<(), LocalStoreError> {
        if self.read_only {
            return Err(LocalStoreError::ReadOnly { store: self.layout.real_store_dir.clone(), what });
        }
        Ok(())
    }

    /// The registration of `path` (references sorted, sigs as a set), or `None` if it is not
    /// valid.
    pub fn query_path_info(&self, path: &StorePath) -> Result<Option<ValidPathInfo>, LocalStoreError> {
        self.registry.query_path_info(path)
    }

    /// The registrations of `paths`, in order (`None` for a path that is not valid), read in
    /// one database transaction: cheaper than a [`query_path_info`](Self::query_path_info)
    /// per path. Each path's failure (a corrupt row) is its own.
    pub fn query_path_infos(&self, paths: &[StorePath]) -> Vec<Result<Option<ValidPathInfo>, LocalStoreError>> {
        self.registry.query_path_infos(paths)
    }

    /// Whether `path` is registered.
    pub fn is_valid_path(&self, path: &StorePath) -> Result<bool, LocalStoreError> {
        Ok(!self.registry.valid_paths(std::iter::once(path))?.is_empty())
    }

    /// The subset of `paths` that is valid, in one query batch.
    pub fn query_valid_paths(&self, paths: &[StorePath]) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        self.registry.valid_paths(paths.iter())
    }

    /// The valid paths that reference `path` (including `path` itself if it is
    /// self-referencing); empty if `path` is not valid.
    pub fn query_referrers(&self, path: &StorePath) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        self.registry.referrers(path)
    }

    /// Every valid path in the store.
    pub fn query_all_valid_paths(&self) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        self.registry.all_valid_paths()
    }

    /// Writes the NAR serialisation of a valid path (`nix-store --dump`). Fails with
    /// [`LocalStoreError::NotValid`] for a path that is not registered.
    pub fn dump_path(&self, path: &StorePath, out: &mut dyn std::io::Write) -> Result<(), LocalStoreError> {
        if !self.is_valid_path(path)? {
            return Err(LocalStoreError::NotValid { path: self.store_dir.display_path(path) });
        }
        let real_path = self.real_path(path);
        let mut writer = NarWriter::new(out).map_err(io_err("writing the NAR of", &real_path))?;
        dump::dump(self.store_fd.as_fd(), path.base_name().as_bytes(), &mut writer).map_err(io_err("dumping", &real_path))
    }

    /// The NAR of the valid path `path` as a reader that walks its tree as it is read
    /// ([`NarDump`]), on the reading thread; fails as [`LocalStore::dump_path`] does for a path
    /// that is not registered, before anything is read.
    pub fn nar_dump(&self, path: &StorePath) -> Result<dump::NarDump, LocalStoreError> {
        if !self.is_valid_path(path)? {
            return Err(LocalStoreError::NotValid { path: self.store_dir.display_path(path) });
        }
        dump::NarDump::new(self.store_fd.as_fd(), path.base_name().as_bytes()).map_err(io_err("dumping", &self.real_path(path)))
    }

    /// Removes the lock file of the valid path `path` if a killed process left it (nobody
    /// holds it), and if it did, those left on the paths of its closure: a process killed while
    /// releasing the locks of a batch it had just registered ([`LocalStore::commit_all`],
    /// references first) left them on the referrers in that batch, and a caller that walks a
    /// closure does not look at the references of a valid path. Cheap when there is none: one
    /// failed `open`. The first call of an opened store (as its first addition) also removes
    /// the directories of temporary trees that killed runs left, so that a run that finds
    /// everything valid removes them too. Does nothing in a read-only store.
    pub fn clear_stale_lock(&self, path: &StorePath) {
        self.remove_stale_temp_dirs();
        if self.read_only || !lock::clear_stale(&self.real_path(path)) {
            return;
        }
        let mut seen = BTreeSet::from([path.clone()]);
        let mut next = vec![path.clone()];
        while let Some(p) = next.pop() {
            let Ok(Some(info)) = self.registry.query_path_info(&p) else { continue };
            for r in info.references {
                if seen.insert(r.clone()) {
                    lock::clear_stale(&self.real_path(&r));
                    next.push(r);
                }
            }
        }
    }

    /// Makes `info.path` a temporary root in `roots`, then takes its per-path lock (blocking
    /// while another process holds it). Returns `None` when the path is already valid
    /// (possibly added meanwhile by the holder). Otherwise whatever an interrupted addition
    /// left is removed on the way: its temporary tree when the unpacking finds it, an
    /// unregistered tree at the path's location when the commit's rename finds it.
    /// Validity is looked at once, with the lock held (the caller of an addition has mostly
    /// just found the path invalid, so a check before locking would be a second one).
    pub fn begin_add(self: &Arc<Self>, info: ValidPathInfo, roots: &TempRoots) -> Result<Option<PendingPath>, LocalStoreError> {
        self.begin_blocking(info, None, roots)
    }

    /// [`LocalStore::begin_add`] for an info a policy vouched for: its commit under the same
    /// policy does not verify its signatures again.
    pub fn begin_add_vouched(self: &Arc<Self>, vouched: VouchedInfo, roots: &TempRoots) -> Result<Option<PendingPath>, LocalStoreError> {
        let (info, policy) = vouched.into_parts();
        self.begin_blocking(info, Some(policy), roots)
    }

    /// [`LocalStore::begin_add`], with the policy that vouched for `info`, if any.
    fn begin_blocking(
        self: &Arc<Self>,
        info: ValidPathInfo,
        vouched: Option<SignaturePolicy>,
        roots: &TempRoots,
    ) -> Result<Option<PendingPath>, LocalStoreError> {
        self.ensure_writable("add paths")?;
        roots.add(&info.path)?;
        let real_path = self.real_path(&info.path);
        let lock = PathLock::acquire(&real_path).map_err(io_err("locking", &real_path))?;
        self.start_add(info, vouched, lock, roots)
    }

    /// [`LocalStore::begin_add`] without blocking: [`TryAdd::Busy`] while another process
    /// (or thread) holds the path's lock, so that a caller can wait without tying up a thread
    /// and without holding other resources (two copies sharing a store would otherwise be
    /// able to starve each other).
    pub fn try_begin_add(self: &Arc<Self>, info: ValidPathInfo, roots: &TempRoots) -> Result<TryAdd, LocalStoreError> {
        self.try_begin(info, None, roots)
    }

    /// [`LocalStore::try_begin_add`] for an info a policy vouched for: its commit under the
    /// same policy does not verify its signatures again.
    pub fn try_begin_add_vouched(self: &Arc<Self>, vouched: VouchedInfo, roots: &TempRoots) -> Result<TryAdd, LocalStoreError> {
        let (info, policy) = vouched.into_parts();
        self.try_begin(info, Some(policy), roots)
    }

    /// [`LocalStore::try_begin_add`], with the policy that vouched for `info`, if any.
    fn try_begin(
        self: &Arc<Self>,
        info: ValidPathInfo,
        vouched: Option<SignaturePolicy>,
        roots: &TempRoots,
    ) -> Result<TryAdd, LocalStoreError> {
        self.ensure_writable("add paths")?;
        roots.add(&info.path)?;
        let real_path = self.real_path(&info.path);
        match PathLock::try_acquire(&real_path).map_err(io_err("locking", &real_path))? {
            None => Ok(TryAdd::Busy),
            Some(lock) => Ok(self.start_add(info, vouched, lock, roots)?.map_or(TryAdd::Valid, |p| TryAdd::Pending(Box::new(p)))),
        }
    }

    /// Starts replacing the tree of the valid path `offered.path` (Nix's `addToStore` with
    /// `repair`), without blocking: [`TryAdd::Busy`] while another process holds its lock.
    /// The source's info must carry the registered NAR hash and size
    /// ([`LocalStoreError::RepairMismatch`] otherwise); the [`PendingPath`] is then the
    /// registration's, so that the new tree is verified against what was registered, and
    /// [`PendingPath::commit`] exchanges it with the damaged (or missing) tree atomically,
    /// leaving the registration as it is. [`LocalStoreError::NotValid`] for a path that is not
    /// registered.
    pub fn try_begin_repair(self: &Arc<Self>, offered: &ValidPathInfo, roots: &TempRoots) -> Result<TryAdd, LocalStoreError> {
        self.start_repair(offered, roots, false)
    }

    /// [`LocalStore::try_begin_repair`], waiting for the path's lock while another process
    /// holds it.
    pub(crate) fn begin_repair(self: &Arc<Self>, offered: &ValidPathInfo, roots: &TempRoots) -> Result<PendingPath, LocalStoreError> {
        match self.start_repair(offered, roots, true)? {
            TryAdd::Pending(pending) => Ok(*pending),
            TryAdd::Valid | TryAdd::Busy => {
                Err(LocalStoreError::Misuse { path: self.store_dir.display_path(&offered.path), what: "the repair's lock was not taken" })
            }
        }
    }

    /// [`LocalStore::try_begin_repair`], or with `block` [`LocalStore::begin_repair`].
    fn start_repair(self: &Arc<Self>, offered: &ValidPathInfo, roots: &TempRoots, block: bool) -> Result<TryAdd, LocalStoreError> {
        self.ensure_writable("repair paths")?;
        roots.add(&offered.path)?;
        let shown = || self.store_dir.display_path(&offered.path);
        let info = self.query_path_info(&offered.path)?.ok_or_else(|| LocalStoreError::NotValid { path: shown() })?;
        if info.nar_hash != offered.nar_hash || info.nar_size != offered.nar_size {
            return Err(LocalStoreError::RepairMismatch {
                path: shown(),
                registered: format!("{} ({} bytes)", info.nar_hash.to_nix32_prefixed(), info.nar_size),
                offered: format!("{} ({} bytes)", offered.nar_hash.to_nix32_prefixed(), offered.nar_size),
            });
        }
        let real_path = self.real_path(&info.path);
        let lock = match block {
            true => Some(PathLock::acquire(&real_path)),
            false => PathLock::try_acquire(&real_path).transpose(),
        };
        match lock.transpose().map_err(io_err("locking", &real_path))? {
            None => Ok(TryAdd::Busy),
            Some(lock) => Ok(TryAdd::Pending(Box::new(self.pending(info, lock, roots, true)?))),
        }
    }

    /// A [`PendingPath`] for `info` with its lock held.
    fn pending(
        self: &Arc<Self>,
        info: ValidPathInfo,
        lock: PathLock,
        roots: &TempRoots,
        repair: bool,
    ) -> Result<PendingPath, LocalStoreError> {
        let temp_dir = self.open_temp_dir()?;
        let temp_tree = false.into();
        Ok(PendingPath {
            store: Arc::clone(self),
            info,
            vouched: None,
            temp_dir,
            temp_tree,
            unpacked: None,
            repair,
            _lock: lock,
            _roots: roots.clone(),
        })
    }

    /// The subset of `paths` that is valid, after making every one of them a temporary root
    /// in `roots` (Nix's order), so that a collector cannot delete a path found valid while
    /// the caller builds on it.
    pub fn query_valid_paths_rooted(&self, paths: &[StorePath], roots: &TempRoots) -> Result<BTreeSet<StorePath>, LocalStoreError> {
        roots.add_all(paths)?;
        self.query_valid_paths(paths)
    }

    /// With `info.path`'s lock held: `None` if it is valid, else a [`PendingPath`] (`vouched`:
    /// the policy that vouched for `info`).
    fn start_add(
        self: &Arc<Self>,
        info: ValidPathInfo,
        vouched: Option<SignaturePolicy>,
        lock: PathLock,
        roots: &TempRoots,
    ) -> Result<Option<PendingPath>, LocalStoreError> {
        if self.is_valid_path(&info.path)? {
            return Ok(None);
        }
        // Its "unregistered tree" could be a directory of every addition's temporary tree.
        if info.path.name() == TEMP_DIR_NAME {
            return Err(LocalStoreError::Misuse {
                path: self.store_dir.display_path(&info.path),
                what: "this name is reserved for the store's directories of temporary trees",
            });
        }
        let mut pending = self.pending(info, lock, roots, false)?;
        pending.vouched = vouched;
        Ok(Some(pending))
    }

    /// Adds `info`'s path from its NAR under `policy`: [`begin_add`](Self::begin_add),
    /// [`PendingPath::unpack`], [`PendingPath::commit`]. Returns `false` (reading nothing)
    /// if the path is already valid.
    pub fn add_nar(
        self: &Arc<Self>,
        info: ValidPathInfo,
        nar: &mut dyn Read,
        policy: &SignaturePolicy,
        roots: &TempRoots,
    ) -> Result<bool, LocalStoreError> {
        let Some(mut pending) = self.begin_add(info, roots)? else {
            return Ok(false);
        };
        pending.unpack(nar)?;
        pending.commit(policy)?;
        Ok(true)
    }
}
