//! Garbage collection as Nix's `LocalStore::collectGarbage` does it (Nix 2.8
//! `src/libstore/gc.cc`; 2.26 is the same in what is used here), with the same locks and
//! protocol, so that sluice's and Nix's collectors and writers never delete each other's work
//! in flight:
//!
//! * the collector holds `<state>/gc.lock` exclusively for the whole collection; writers take
//!   it shared to append to their temporary roots file, so that no file changes once read;
//! * it serves `<state>/gc-socket/socket`: a writer that finds the lock taken sends each new
//!   root as a path line and waits for one byte; the root's hash part joins the temporary roots
//!   at once, and the answer waits while a path with that hash part is being deleted;
//! * roots: the `gcroots` and `profiles` trees (symlinks into the store, one indirection for
//!   links outside it such as `gcroots/auto/*` → `/home/u/result` → the store path, stale
//!   `auto` links removed; regular files named like a valid path), runtime roots
//!   (`/proc/<pid>/{exe,cwd,fd/*,maps,environ}` and three kernel settings) and the live
//!   holders' temporary roots, honoured by hash part (a root keeps `<hash>-x.lock`, a sluice
//!   directory of temporary trees, rooted by its holder, …);
//! * a path is visited with its referrers (and, with `keep-derivations`, a derivation's
//!   outputs; with `keep-outputs`, an output's derivers); if none of them is a root, all are
//!   dead, and are unregistered (`invalidatePathChecked`) then deleted, referrers first;
//! * every other name in the store directory is deleted too, except `.links`, whose files
//!   with one link left are deleted last, and a name starting with `tmp-` (Nix 2.26's
//!   `createTempDirInStore`) that is not a directory that can be locked at once: its holder is
//!   at work (Nix 2.26; 2.8 deletes it).
//!
//! Differences, each deliberate: a name that is not a store path is deleted only by an action
//! that deletes (Nix 2.8 and 2.26 delete it even for `--print-dead`); the whole visited set of
//! a closure being deleted is "pending" for the roots server, not only its last path; the
//! roots are found in `roots.rs`; `db/reserved` is not deleted (sluice does not make it).

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use rustix::fs::{flock, FlockOperation};
use sluice_nix::store_path::StorePath;

use super::{io_err, tree, LocalStore, LocalStoreError};

/// Root → the links (or labels such as `{temp:<pid>}`, `{censored}`) that make it one.
pub type Roots = BTreeMap<StorePath, BTreeSet<String>>;

/// What a collection does (Nix's `GCOptions::GCAction`, its numbers on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcAction {
    /// Return the live paths, delete nothing.
    ReturnLive = 0,
    /// Return the dead paths, delete nothing.
    ReturnDead = 1,
    /// Delete the dead paths.
    DeleteDead = 2,
    /// Delete the given paths, failing on the first that is alive.
    DeleteSpecific = 3,
}

impl GcAction {
    /// The action numbered `n` on the wire.
    pub fn from_wire(n: u64) -> Option<Self> {
        [Self::ReturnLive, Self::ReturnDead, Self::DeleteDead, Self::DeleteSpecific].into_iter().find(|a| *a as u64 == n)
    }

    fn deletes(self) -> bool {
        matches!(self, Self::DeleteDead | Self::DeleteSpecific)
    }
}

/// A collection's options (Nix's `GCOptions`, and the `keep-outputs`/`keep-derivations`
/// settings).
#[derive(Debug, Clone)]
pub struct GcOptions {
    pub action: GcAction,
    /// For [`GcAction::DeleteSpecific`].
    pub paths_to_delete: BTreeSet<StorePath>,
    /// Stop deleting once more than this many bytes were freed (`u64::MAX`: no limit; 0: visit
    /// nothing but the paths to delete).
    pub max_freed: u64,
    /// `keep-outputs` (Nix's default: false): a live derivation keeps its outputs.
    pub keep_outputs: bool,
    /// `keep-derivations` (Nix's default: true): a live output keeps its derivation.
    pub keep_derivations: bool,
}

/// What a collection found or did (Nix's `GCResults`).
#[derive(Debug, Default)]
pub struct GcResults {
    /// The live or dead paths (return actions), or the deleted paths and names in the store
    /// directory (delete actions), in full.
    pub paths: BTreeSet<String>,
    /// Bytes freed, as Nix counts them (see [`tree::delete_tree`]).
    pub bytes_freed: u64,
}

/// The collector's state shared with the roots server's connections (Nix's `Shared`).
#[derive(Default)]
struct Shared {
    /// Hash parts of the temporary roots.
    temp_roots: HashSet<String>,
    /// Hash parts of the closure being deleted: a root for one of them is answered only once
    /// its deletion ended, so that its sender then sees the path invalid.
    pending: HashSet<String>,
}

type SharedState = Arc<(Mutex<Shared>, Condvar)>;

fn lock_shared(shared: &SharedState) -> MutexGuard<'_, Shared> {
    shared.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// The roots server's connections, each with the thread serving it.
type Clients = Arc<Mutex<Vec<(UnixStream, JoinHandle<()>)>>>;

/// The roots server on `<state>/gc-socket/socket`, stopped (connections shut down, threads
/// joined) when dropped.
struct RootsServer {
    socket: PathBuf,
    shared: SharedState,
    stop: Arc<std::sync::atomic::AtomicBool>,
    clients: Clients,
    thread: Option<JoinHandle<()>>,
}

impl RootsServer {
    /// Serves `dir/socket`, making `dir` if needed.
    fn start(dir: &Path, shared: SharedState, store: &LocalStore) -> Result<Self, LocalStoreError> {
        let socket = dir.join("socket");
        std::fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
        match std::fs::remove_file(&socket) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("removing the old socket", &socket)(e)),
            _ => {}
        }
        let listener = crate::unix_socket::bind(&socket).map_err(io_err("binding the garbage collector's socket", &socket))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).map_err(io_err("setting the mode of", &socket))?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let clients: Clients = Arc::default();
        let (stop2, clients2, shared2, store_dir) = (Arc::clone(&stop), Arc::clone(&clients), Arc::clone(&shared), store.store_dir.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let Ok(handle) = conn.try_clone() else { continue };
                let (shared, store_dir) = (Arc::clone(&shared2), store_dir.clone());
                let thread = std::thread::spawn(move || serve_roots_client(conn, &shared, &store_dir));
                clients2.lock().unwrap_or_else(|p| p.into_inner()).push((handle, thread));
            }
        });
        Ok(RootsServer { socket, shared, stop, clients, thread: Some(thread) })
    }
}

/// Reads root lines from one writer until it hangs up, answering each with `1` (Nix's
/// connection thread in `collectGarbage`).
fn serve_roots_client(conn: UnixStream, shared: &SharedState, store_dir: &sluice_nix::store_path::StoreDir) {
    let Ok(mut out) = conn.try_clone() else { return };
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { return };
        match store_dir.parse_path(&line) {
            Ok(path) => {
                let hash_part = path.hash_part().to_owned();
                let mut state = lock_shared(shared);
                state.temp_roots.insert(hash_part.clone());
                while state.pending.contains(&hash_part) {
                    state = shared.1.wait(state).unwrap_or_else(|p| p.into_inner());
                }
            }
            Err(_) => tracing::error!("received garbage instead of a root from client: {line:?}"),
        }
        if out.write_all(b"1").is_err() {
            return;
        }
    }
}

impl Drop for RootsServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.1.notify_all();
        // Wakes the accepting thread, which then sees `stop`.
        let _ = crate::unix_socket::connect(&self.socket);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for (conn, thread) in std::mem::take(&mut *self.clients.lock().unwrap_or_else(|p| p.into_inner())) {
            let _ = conn.shutdown(std::net::Shutdown::Both);
            let _ = thread.join();
        }
    }
}

/// Ends a collection's closure visit: the pending hash parts are released and waiting roots
/// answered, however the visit ended (Nix's `releasePending`).
struct ReleasePending(SharedState);

impl Drop for ReleasePending {
    fn drop(&mut self) {
        lock_shared(&self.0).pending.clear();
        self.0 .1.notify_all();
    }
}

/// `max_freed` was exceeded (Nix's `GCLimitReached`).
enum Stop {
    Limit,
    Error(LocalStoreError),
}

impl From<LocalStoreError> for Stop {
    fn from(e: LocalStoreError) -> Self {
        Stop::Error(e)
    }
}

/// One collection's working state.
struct Collection<'a> {
    store: &'a LocalStore,
    options: &'a GcOptions,
    log: &'a mut dyn FnMut(&str),
    shared: SharedState,
    roots: BTreeSet<StorePath>,
    alive: BTreeSet<StorePath>,
    dead: BTreeSet<StorePath>,
    results: GcResults,
}

impl LocalStore {
    /// Collects garbage as `options` asks, logging Nix's progress lines through `log`. Holds
    /// `gc.lock` exclusively and serves the roots socket meanwhile (see the module
    /// documentation). [`GcAction::DeleteSpecific`] fails with
    /// [`LocalStoreError::StillAlive`] on the first path that is alive.
    pub fn collect_garbage(&self, options: &GcOptions, log: &mut dyn FnMut(&str)) -> Result<GcResults, LocalStoreError> {
        if options.action.deletes() {
            self.ensure_writable("collect garbage")?;
        }
        let lock_path = self.layout.state_dir.join("gc.lock");
        let gc_lock = super::lock::open_lock_file(&lock_path).map_err(io_err("opening the GC lock", &lock_path))?;
        if flock(&gc_lock, FlockOperation::NonBlockingLockExclusive).is_err() {
            log("waiting for the big garbage collector lock...");
            loop {
                match flock(&gc_lock, FlockOperation::LockExclusive) {
                    Err(rustix::io::Errno::INTR) => continue,
                    other => break other.map_err(|e| io_err("taking the GC lock", &lock_path)(e.into()))?,
                }
            }
        }
        let shared: SharedState = Arc::default();
        let server = RootsServer::start(&self.layout.state_dir.join("gc-socket"), Arc::clone(&shared), self)?;
        let mut gc = Collection {
            store: self,
            options,
            log,
            shared,
            roots: BTreeSet::new(),
            alive: BTreeSet::new(),
            dead: BTreeSet::new(),
            results: GcResults::default(),
        };
        let result = gc.run();
        // The server stops before the lock is released (Nix's order): a writer cut off
        // retries until it can take the lock shared.
        drop(server);
        drop(gc_lock);
        result.map(|()| gc.results)
    }
}

/// Whether `name` in `parent` is a directory whose lock (`flock`) can be taken at once, as
/// Nix 2.26's `deleteFromStore` asks of a temporary directory before deleting it. The lock
/// is released on return: the directory is deleted next.
fn unlocked_dir(parent: std::os::fd::BorrowedFd<'_>, name: &[u8]) -> bool {
    tree::open_dir(parent, name).is_ok_and(|dir| flock(&dir, FlockOperation::NonBlockingLockExclusive).is_ok())
}

impl Collection<'_> {
    fn run(&mut self) -> Result<(), LocalStoreError> {
        (self.log)("finding garbage collector roots...");
        self.roots = self.store.find_roots_no_temp(true)?.into_keys().collect();
        for path in self.store.find_temp_roots()?.into_keys() {
            lock_shared(&self.shared).temp_roots.insert(path.hash_part().to_owned());
            self.roots.insert(path);
        }
        let options = self.options;
        if options.action == GcAction::DeleteSpecific {
            for path in &options.paths_to_delete {
                match self.delete_referrers_closure(path) {
                    Ok(()) | Err(Stop::Limit) => {}
                    Err(Stop::Error(e)) => return Err(e),
                }
                if !self.dead.contains(path) {
                    return Err(LocalStoreError::StillAlive { path: self.store.store_dir.display_path(path) });
                }
            }
        } else if options.max_freed > 0 {
            (self.log)(if options.action.deletes() { "deleting garbage..." } else { "determining live/dead paths..." });
            match self.scan_store() {
                Ok(()) | Err(Stop::Limit) => {}
                Err(Stop::Error(e)) => return Err(e),
            }
        }
        match options.action {
            GcAction::ReturnLive => self.results.paths = self.alive.iter().map(|p| self.store.store_dir.display_path(p)).collect(),
            GcAction::ReturnDead => self.results.paths = self.dead.iter().map(|p| self.store.store_dir.display_path(p)).collect(),
            GcAction::DeleteDead | GcAction::DeleteSpecific => self.delete_unused_links()?,
        }
        Ok(())
    }

    /// Visits every name in the store directory, in directory order as Nix reads it: store
    /// paths with their referrers, other names deleted (by a deleting action).
    fn scan_store(&mut self) -> Result<(), Stop> {
        let real = &self.store.layout.real_store_dir;
        let entries = std::fs::read_dir(real).map_err(io_err("opening directory", real))?;
        for entry in entries {
            let entry = entry.map_err(io_err("reading directory", real))?;
            let name = entry.file_name();
            if name == super::optimise::LINKS_DIR {
                continue;
            }
            match name.to_str().map(StorePath::from_base_name) {
                Some(Ok(path)) => self.delete_referrers_closure(&path)?,
                _ if self.options.action.deletes() => self.delete_from_store(name.as_bytes())?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Nix's `deleteReferrersClosure`: visits `start` and what keeps it (referrers; a
    /// derivation's outputs with `keep-derivations`; derivers with `keep-outputs`). If any is
    /// a root, all visited are alive with their closures; otherwise all are dead, and deleted
    /// referrers first by a deleting action.
    fn delete_referrers_closure(&mut self, start: &StorePath) -> Result<(), Stop> {
        let _release = ReleasePending(Arc::clone(&self.shared));
        let mut visited: BTreeSet<StorePath> = BTreeSet::new();
        let mut todo: VecDeque<StorePath> = VecDeque::new();
        visited.insert(start.clone());
        todo.push_back(start.clone());
        let store = self.store;
        while let Some(path) = todo.pop_front() {
            if self.alive.contains(&path) {
                self.alive.insert(start.clone());
                return Ok(());
            }
            if self.dead.contains(&path) {
                continue;
            }
            if self.roots.contains(&path) {
                return self.mark_alive(&path, start);
            }
            if self.options.action == GcAction::DeleteSpecific && !self.options.paths_to_delete.contains(&path) {
                return Ok(());
            }
            {
                let mut shared = lock_shared(&self.shared);
                if shared.temp_roots.contains(path.hash_part()) {
                    drop(shared);
                    return self.mark_alive(&path, start);
                }
                shared.pending.insert(path.hash_part().to_owned());
            }
            if !store.is_valid_path(&path)? {
                continue;
            }
            let mut next: Vec<StorePath> = store.query_referrers(&path)?.into_iter().collect();
            if self.options.keep_derivations && path.is_derivation() {
                for output in store.query_derivation_output_map(&path)?.into_values() {
                    if store.query_path_info(&output)?.is_some_and(|info| info.deriver.as_ref() == Some(&path)) {
                        next.push(output);
                    }
                }
            }
            if self.options.keep_outputs {
                next.extend(store.query_valid_derivers(&path)?);
            }
            for p in next {
                if visited.insert(p.clone()) {
                    todo.push_back(p);
                }
            }
        }
        for path in self.referrers_first(&visited)? {
            if !self.dead.insert(path.clone()) {
                continue;
            }
            if self.options.action.deletes() {
                store.registry.invalidate_checked(&path)?;
                self.delete_from_store(path.base_name().as_bytes())?;
            }
        }
        Ok(())
    }

    /// Marks `path` (a root, or found alive) and `start` alive, with `path`'s closure
    /// (including outputs and derivers as the settings keep them; Nix's `computeFSClosure`).
    fn mark_alive(&mut self, path: &StorePath, start: &StorePath) -> Result<(), Stop> {
        self.alive.insert(start.clone());
        let store = self.store;
        let mut todo = vec![path.clone()];
        while let Some(p) = todo.pop() {
            if !self.alive.insert(p.clone()) && p != *path {
                continue;
            }
            let Some(info) = store.query_path_info(&p)? else { continue };
            let mut next: Vec<StorePath> = info.references.into_iter().collect();
            if self.options.keep_outputs && p.is_derivation() {
                let outputs = store.query_derivation_output_map(&p)?.into_values().collect::<Vec<_>>();
                next.extend(store.query_valid_paths(&outputs)?);
            }
            if self.options.keep_derivations {
                if let Some(deriver) = info.deriver.filter(|d| store.is_valid_path(d).unwrap_or(false)) {
                    next.push(deriver);
                }
            }
            todo.extend(next.into_iter().filter(|n| !self.alive.contains(n)));
        }
        Ok(())
    }

    /// `paths` ordered so that each comes before the paths of the set it references (Nix's
    /// `topoSortPaths`): referrers are deleted before their references.
    fn referrers_first(&self, paths: &BTreeSet<StorePath>) -> Result<Vec<StorePath>, LocalStoreError> {
        let mut references: BTreeMap<&StorePath, Vec<&StorePath>> = BTreeMap::new();
        let mut referrers_left: BTreeMap<&StorePath, usize> = paths.iter().map(|p| (p, 0)).collect();
        for p in paths {
            let refs = self.store.query_path_info(p)?.map(|i| i.references).unwrap_or_default();
            let within: Vec<&StorePath> = refs.iter().filter(|r| *r != p).filter_map(|r| paths.get(r)).collect();
            for r in &within {
                *referrers_left.entry(r).or_default() += 1;
            }
            references.insert(p, within);
        }
        let mut ready: Vec<&StorePath> = referrers_left.iter().filter(|(_, n)| **n == 0).map(|(p, _)| *p).collect();
        let mut sorted = Vec::with_capacity(paths.len());
        while let Some(p) = ready.pop() {
            sorted.push(p.clone());
            for r in references.get(p).into_iter().flatten() {
                let n = referrers_left.entry(r).or_default();
                *n = n.saturating_sub(1);
                if *n == 0 {
                    ready.push(r);
                }
            }
        }
        Ok(sorted)
    }

    /// Deletes `name` in the store directory (Nix's `deleteFromStore`); [`Stop::Limit`] once
    /// more than `max_freed` bytes were freed.
    fn delete_from_store(&mut self, name: &[u8]) -> Result<(), Stop> {
        let shown = format!("{}/{}", self.store.store_dir.as_str(), String::from_utf8_lossy(name));
        if name.starts_with(b"tmp-") && !unlocked_dir(self.store.store_fd.as_fd(), name) {
            tracing::debug!("skipping locked tempdir '{shown}'");
            return Ok(());
        }
        (self.log)(&format!("deleting '{shown}'"));
        let real = self.store.layout.real_store_dir.join(OsStr::from_bytes(name));
        let freed = tree::delete_tree(self.store.store_fd.as_fd(), name).map_err(io_err("deleting", &real))?;
        self.results.paths.insert(shown);
        self.results.bytes_freed += freed.unwrap_or(0);
        if self.results.bytes_freed > self.options.max_freed {
            (self.log)(&format!("deleted more than {} bytes; stopping", self.options.max_freed));
            return Err(Stop::Limit);
        }
        Ok(())
    }

    /// Deletes the files of `.links` that no store path links to any more, and reports what
    /// the remaining links save, as Nix does.
    fn delete_unused_links(&mut self) -> Result<(), LocalStoreError> {
        (self.log)("deleting unused links...");
        let links = self.store.links_path();
        let (mut actual, mut unshared) = (0i64, 0i64);
        let entries = match std::fs::read_dir(&links) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err("opening directory", &links)(e)),
        };
        for entry in entries {
            let path = entry.map_err(io_err("reading directory", &links))?.path();
            let meta = std::fs::symlink_metadata(&path).map_err(io_err("getting status of", &path))?;
            if meta.nlink() != 1 {
                actual += meta.size() as i64;
                unshared += (meta.nlink() as i64 - 1) * meta.size() as i64;
                continue;
            }
            std::fs::remove_file(&path).map_err(io_err("deleting", &path))?;
        }
        let overhead = std::fs::metadata(&links).map_err(io_err("getting status of", &links))?.blocks() as i64 * 512;
        (self.log)(&format!("note: currently hard linking saves {:.2} MiB", (unshared - actual - overhead) as f64 / (1024.0 * 1024.0)));
        Ok(())
    }
}
