//! Temporary GC roots that Nix's garbage collector honours (Nix 2.8 `src/libstore/gc.cc`:
//! `createTempRootsFile`, `addTempRoot`, `findTempRoots`). A holder keeps an exclusive
//! `flock` on `<state>/temproots/<id>` for as long as it lives and appends each root as a
//! full store path followed by a NUL byte; the collector treats a file it can lock as stale.
//! While a collector runs it holds `<state>/gc.lock` exclusively and listens on
//! `<state>/gc-socket/socket`: a root added then is sent to it (path and a newline; it answers
//! one byte) before it is written to the file. The collector keeps roots by hash part: a root
//! protects every name with the same hash part (the path's lock file too).
//!
//! Nix names the file after its process id. sluice gives each holder ([`TempRoots`]) its own
//! file, `<pid>-<n>` with `n` counting the holders this process made (a daemon keeps one per
//! connection, so that a connection's roots end with it, as they end with a `nix-daemon`
//! child process). Nix's collector reads the leading number as the owner's process id
//! (`std::stoi`).
//!
//! A holder that serves a client which keeps asking (the daemon's connections) may keep the
//! shared GC lock between additions ([`TempRoots::add_all_keeping_gc_lock`]) and give it up
//! when the client goes quiet ([`TempRoots::release_gc_lock`]): while it is held no collector
//! runs, so the roots added meanwhile are written together when it is given up, before any
//! collector can read the file (one `write` where there was one per addition; `nix-store
//! --gc --print-roots`, which reads the files without the lock, sees them then); a collector
//! starting meanwhile waits for the release. Roots that cannot be written keep the lock until
//! they are, or until the holder ends. A lock
//! given up is kept again only [`GC_LOCK_GAP`] later, roots taking it one at a time
//! meanwhile: `flock` does not queue shared lockers behind a waiting exclusive one, so
//! connections that kept it back to back would keep a collector waiting for as long as their
//! clients keep asking.
//!
//! Roots are added before the paths they protect are looked at (Nix's order: `addTempRoot`,
//! then `isValidPath`): a collector that is deleting the path at that moment finishes first
//! (it answers a socket root only after its deletion of that hash part ends), so the path is
//! then seen as invalid and added again.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long after a kept shared GC lock was given up a holder takes it per root (released at
/// once) before it keeps it again ([`TempRoots::add_all_keeping_gc_lock`]): the gaps in which
/// a waiting collector gets the lock.
pub(crate) const GC_LOCK_GAP: Duration = Duration::from_millis(50);

use rustix::fs::{flock, FlockOperation};
use sluice_nix::store_path::{StoreDir, StorePath};

use super::{io_err, LocalStoreError};

/// The temporary roots of one holder (a `sluice copy` run, a daemon connection), shared by
/// the threads and tasks working for it: cloning shares the roots. The file is created at
/// the first root and deleted (the roots end) when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct TempRoots {
    file: Arc<Mutex<Option<TempRootsFile>>>,
    state_dir: Arc<Path>,
    store_dir: StoreDir,
}

impl TempRoots {
    pub(super) fn new(state_dir: &Path, store_dir: &StoreDir) -> Self {
        TempRoots { file: Arc::default(), state_dir: state_dir.into(), store_dir: store_dir.clone() }
    }

    /// Makes `path` a temporary root until the last clone of this holder is dropped (see
    /// [`TempRoots::add_all`]).
    pub fn add(&self, path: &StorePath) -> Result<(), LocalStoreError> {
        self.add_all(std::slice::from_ref(path))
    }

    /// Makes `paths` temporary roots until the last clone of this holder is dropped. Costs
    /// nothing for paths added before; the others are written in one `write` under one
    /// shared GC lock (or, while a collector runs, sent to it one by one first).
    pub fn add_all(&self, paths: &[StorePath]) -> Result<(), LocalStoreError> {
        self.add_with(paths, false)
    }

    /// [`TempRoots::add_all`], keeping the shared GC lock taken for them (or already held)
    /// until [`TempRoots::release_gc_lock`] or the last clone's end, so that the next roots
    /// are written without taking it again. No collector can start meanwhile: the caller
    /// releases it when it waits for something other than its client's next request.
    pub fn add_all_keeping_gc_lock(&self, paths: &[StorePath]) -> Result<(), LocalStoreError> {
        self.add_with(paths, true)
    }

    fn add_with(&self, paths: &[StorePath], keep: bool) -> Result<(), LocalStoreError> {
        let mut file = self.lock();
        let file = match &mut *file {
            Some(f) => f,
            None => file.insert(TempRootsFile::create(&self.state_dir, &self.store_dir)?),
        };
        file.add_all(paths, keep)
    }

    /// How long the shared GC lock has been kept ([`TempRoots::add_all_keeping_gc_lock`]),
    /// if it is.
    pub fn gc_lock_held_for(&self) -> Option<Duration> {
        self.lock().as_ref()?.gc_locked_at.map(|at| at.elapsed())
    }

    /// Writes the roots added since the shared GC lock was kept by
    /// [`TempRoots::add_all_keeping_gc_lock`], then gives it up, if it is kept. Roots that
    /// cannot be written keep it (logged): the next release tries again.
    pub fn release_gc_lock(&self) {
        if let Some(file) = self.lock().as_mut().filter(|f| f.gc_locked_at.is_some()) {
            if let Err(e) = file.unlock_gc() {
                tracing::warn!("{e}; the GC lock is kept until they are written");
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<TempRootsFile>> {
        self.file.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The file's path (`<state>/temproots/<pid>-<n>`), once a root was added.
    pub fn path(&self) -> Option<PathBuf> {
        self.lock().as_ref().map(|f| f.path.clone())
    }
}

/// Holders made by this process, for the file names.
static HOLDERS: AtomicU64 = AtomicU64::new(0);

/// A file of temporary roots, locked while this value lives; dropping it deletes the file (the
/// roots end).
#[derive(Debug)]
struct TempRootsFile {
    file: File,
    path: PathBuf,
    /// `<state>/gc.lock` (Nix's `openGCLock`, `gc.cc`), opened once.
    gc_lock: File,
    /// Its path, for messages.
    gc_lock_path: PathBuf,
    /// When the shared GC lock kept on `gc_lock` was taken, while it is kept.
    gc_locked_at: Option<Instant>,
    /// When a kept shared GC lock was last given up ([`GC_LOCK_GAP`]).
    gc_released_at: Option<Instant>,
    gc_socket: PathBuf,
    /// The connection to the running collector's socket, kept for every root this holder
    /// sends it (Nix's `_fdRootsSocket`), and dropped when the collector has gone. One
    /// connection per root would trip Nix 2.8's collector: a connection that ends before the
    /// collector's accepting thread has recorded it lets the next one reuse its descriptor
    /// number, the record is refused and a joinable `std::thread` is destroyed
    /// (`std::terminate`, "terminate called without an active exception", `gc.cc`).
    collector: Option<UnixStream>,
    store_dir: StoreDir,
    /// Roots already written or pending, so that each is written once.
    written: HashSet<StorePath>,
    /// Roots added while the shared GC lock is kept, written when it is given up.
    pending: Vec<u8>,
}

impl TempRootsFile {
    /// Creates `<state_dir>/temproots/<pid>-<n>` and locks it, replacing a stale file of
    /// that name.
    fn create(state_dir: &Path, store_dir: &StoreDir) -> Result<Self, LocalStoreError> {
        let id = format!("{}-{}", std::process::id(), HOLDERS.fetch_add(1, Ordering::Relaxed));
        let path = state_dir.join("temproots").join(id);
        let file = loop {
            // No live process can own a file with our id: whatever is there is stale.
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("removing the stale temporary roots file", &path)(e)),
                _ => {}
            }
            let file = super::lock::open_lock_file(&path).map_err(io_err("creating the temporary roots file", &path))?;
            lock(&file, FlockOperation::LockExclusive).map_err(io_err("locking", &path))?;
            // A collector that found the file unlocked deleted it and wrote "d" into it
            // before we locked it: start again with a new file.
            if file.metadata().map_err(io_err("reading the size of", &path))?.len() == 0 {
                break file;
            }
        };
        let gc_lock_path = state_dir.join("gc.lock");
        let gc_lock = super::lock::open_lock_file(&gc_lock_path).map_err(io_err("opening the GC lock", &gc_lock_path))?;
        Ok(TempRootsFile {
            file,
            path,
            gc_lock,
            gc_lock_path,
            gc_locked_at: None,
            gc_released_at: None,
            gc_socket: state_dir.join("gc-socket/socket"),
            collector: None,
            store_dir: store_dir.clone(),
            written: HashSet::new(),
            pending: Vec::new(),
        })
    }

    /// Writes the paths of `paths` not written before, in one `write`, under the GC lock
    /// taken shared (or kept from before); while a collector holds it, each is first sent to
    /// the collector over its socket (it will not read the file again). With `keep`, a lock
    /// taken here is kept, and the paths are written when it is given up.
    fn add_all(&mut self, paths: &[StorePath], keep: bool) -> Result<(), LocalStoreError> {
        let new: Vec<&StorePath> = paths.iter().filter(|p| !self.written.contains(*p)).collect();
        if new.is_empty() {
            return Ok(());
        }
        let shown: Vec<String> = new.iter().map(|p| self.store_dir.display_path(p)).collect();
        let mut told = 0;
        let mut locked = self.gc_locked_at.is_some();
        while !locked {
            match flock(&self.gc_lock, FlockOperation::NonBlockingLockShared) {
                Ok(()) => {
                    locked = true;
                    break;
                }
                Err(rustix::io::Errno::WOULDBLOCK) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(self.gc_lock_failed(e)),
            }
            // A collector holds the lock: it must learn of the roots now. If it is starting
            // (no socket yet) or has just finished (the lock is free again), try again
            // shortly.
            let mut tell = || -> io::Result<()> {
                for p in &shown[told..] {
                    self.tell_collector(p)?;
                    told += 1;
                }
                Ok(())
            };
            let told_all = tell();
            if told_all.is_err() {
                // Whatever failed, the next attempt starts on a new connection.
                self.collector = None;
            }
            match told_all {
                Ok(()) => break,
                // Refused or absent: starting, or finished. Cut off (EOF, EPIPE, reset): it
                // finished while we spoke (Nix's `addTempRoot` restarts on these too).
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::NotFound
                            | io::ErrorKind::UnexpectedEof
                            | io::ErrorKind::BrokenPipe
                            | io::ErrorKind::ConnectionReset
                    ) =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) => return Err(io_err("sending a temporary root to the garbage collector at", &self.gc_socket)(e)),
            }
        }
        let before = self.pending.len();
        for p in &shown {
            self.pending.extend_from_slice(p.as_bytes());
            self.pending.push(0);
        }
        let in_gap = self.gc_released_at.is_some_and(|at| at.elapsed() < GC_LOCK_GAP);
        if locked && keep && !in_gap {
            self.gc_locked_at.get_or_insert_with(Instant::now);
        } else if let Err(e) = self.unlock_gc() {
            // These roots are not taken (their addition fails); those pending from before keep the lock.
            self.pending.truncate(before);
            if self.pending.is_empty() {
                self.unlock_gc()?;
            }
            return Err(e);
        }
        self.written.extend(new.into_iter().cloned());
        Ok(())
    }

    /// Writes the pending roots, then gives the GC lock up. If they cannot be written, the
    /// lock is kept (a collector must not read the file without them) and the error returned.
    fn unlock_gc(&mut self) -> Result<(), LocalStoreError> {
        if !self.pending.is_empty() {
            self.file.write_all(&self.pending).map_err(io_err("writing temporary roots to", &self.path))?;
            self.pending.clear();
        }
        if self.gc_locked_at.take().is_some() {
            self.gc_released_at = Some(Instant::now());
        }
        let _ = flock(&self.gc_lock, FlockOperation::Unlock);
        Ok(())
    }

    /// The failure to take the GC lock (`flock` failed with `errno`), naming the lock file.
    fn gc_lock_failed(&self, errno: rustix::io::Errno) -> LocalStoreError {
        io_err("taking the GC lock", &self.gc_lock_path)(errno.into())
    }

    /// Sends one root to a running collector over the kept connection (made first if there
    /// is none) and waits for its one-byte answer.
    fn tell_collector(&mut self, shown: &str) -> io::Result<()> {
        let socket = match &mut self.collector {
            Some(socket) => socket,
            None => self.collector.insert(crate::unix_socket::connect(&self.gc_socket)?),
        };
        socket.write_all(format!("{shown}\n").as_bytes())?;
        let mut ack = [0u8; 1];
        socket.read_exact(&mut ack)
    }
}

impl Drop for TempRootsFile {
    fn drop(&mut self) {
        // As Nix's LocalStore destructor: the file goes, then closing it releases the lock.
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!("removing the temporary roots file {}: {e}", self.path.display());
        }
    }
}

/// `flock` that blocks until granted, retrying on `EINTR`.
fn lock(file: &File, op: FlockOperation) -> io::Result<()> {
    loop {
        match flock(file, op) {
            Err(rustix::io::Errno::INTR) => continue,
            other => return other.map_err(io::Error::from),
        }
    }
}

/// The temporary roots of live holders (files under `<state>/temproots` that are locked),
/// by path, each with the holders' `{temp:<id>}` labels as Nix's `findTempRoots` reports
/// them. Stale files (unlocked) are deleted, as Nix's `findTempRoots` does. Paths that do not parse are
/// skipped too.
pub(super) fn find(state_dir: &Path, store_dir: &StoreDir) -> Result<BTreeMap<StorePath, BTreeSet<String>>, LocalStoreError> {
    let dir = state_dir.join("temproots");
    let mut roots: BTreeMap<StorePath, BTreeSet<String>> = BTreeMap::new();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(roots),
        Err(e) => return Err(io_err("listing", &dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io_err("listing", &dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        let mut file = match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("opening the temporary roots file", &path)(e)),
        };
        if flock(&file, FlockOperation::NonBlockingLockExclusive).is_ok() {
            // Stale: its holder is gone. Removed as Nix removes it (a holder that opened it
            // meanwhile sees the mark once it has the lock, and makes a new file).
            tracing::info!("removing stale temporary roots file '{}'", path.display());
            let _ = std::fs::remove_file(&path);
            let _ = file.write_all(b"d");
            continue;
        }
        let mut contents = Vec::new();
        file.read_to_end(&mut contents).map_err(io_err("reading the temporary roots file", &path))?;
        let label = format!("{{temp:{}}}", name.split(|c: char| !c.is_ascii_digit()).next().unwrap_or(""));
        // Only NUL-terminated entries: a trailing fragment is a write in progress.
        let complete = contents.rsplitn(2, |b| *b == 0).nth(1).unwrap_or(&[]);
        for entry in complete.split(|b| *b == 0) {
            if let Some(p) = std::str::from_utf8(entry).ok().and_then(|s| store_dir.parse_path(s).ok()) {
                roots.entry(p).or_default().insert(label.clone());
            }
        }
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixListener;

    use super::*;

    /// A collector as Nix's `collectGarbage` looks to a holder: `gc.lock` held exclusively and
    /// `gc-socket/socket` answering `1` per root line, ending a connection after 20 roots.
    /// Runs until `stop` is set, and returns the roots each connection carried.
    fn collector(state: &Path, stop: Arc<std::sync::atomic::AtomicBool>) -> (File, std::thread::JoinHandle<Vec<Vec<String>>>) {
        let lock = super::super::lock::open_lock_file(&state.join("gc.lock")).unwrap();
        flock(&lock, FlockOperation::LockExclusive).unwrap();
        std::fs::create_dir_all(state.join("gc-socket")).unwrap();
        let listener = UnixListener::bind(state.join("gc-socket/socket")).unwrap();
        listener.set_nonblocking(true).unwrap();
        let server = std::thread::spawn(move || {
            let mut connections = Vec::new();
            while !stop.load(Ordering::Acquire) {
                let conn = match listener.accept() {
                    Ok((conn, _)) => conn,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        continue;
                    }
                    Err(e) => panic!("accept: {e}"),
                };
                conn.set_nonblocking(false).unwrap();
                let mut w = conn.try_clone().unwrap();
                let mut roots = Vec::new();
                for line in BufReader::new(conn).lines() {
                    let Ok(line) = line else { break };
                    roots.push(line);
                    if w.write_all(b"1").is_err() || roots.len() == 20 {
                        break;
                    }
                }
                connections.push(roots);
            }
            connections
        });
        (lock, server)
    }

    /// A failure to take the GC lock names the lock file Nix's `openGCLock` (`gc.cc`) and the
    /// collector take, `<state>/gc.lock`. Regression: it named `<state>/gc-socket/gc.lock`,
    /// which does not exist.
    #[test]
    fn a_failure_to_take_the_gc_lock_names_the_lock_file() {
        let state = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(state.path().join("temproots")).unwrap();
        let holder = TempRootsFile::create(state.path(), &StoreDir::default()).unwrap();
        let message = holder.gc_lock_failed(rustix::io::Errno::NOLCK).to_string();
        let lock = state.path().join("gc.lock");
        assert!(message.contains(&format!("{}:", lock.display())), "{message}");
        assert!(!message.contains("gc-socket"), "{message}");
    }

    fn paths(dir: &StoreDir, from: usize, n: usize) -> Vec<StorePath> {
        (from..from + n).map(|i| dir.parse_path(&format!("/nix/store/{:0>32}-root-{i}", i % 10)).unwrap()).collect()
    }

    /// A state directory's would-be collector: whether it could take `gc.lock` exclusively now.
    fn collector_of(state: &Path) -> impl Fn() -> bool {
        std::fs::create_dir_all(state.join("temproots")).unwrap();
        let collector = super::super::lock::open_lock_file(&state.join("gc.lock")).unwrap();
        move || match flock(&collector, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => flock(&collector, FlockOperation::Unlock).is_ok(),
            Err(_) => false,
        }
    }

    /// A kept GC lock keeps collectors from starting until it is released, and the roots
    /// added meanwhile are written together when it is, before a collector can take it; a
    /// root added without keeping releases it, its own and the pending ones written first.
    #[test]
    fn a_kept_gc_lock_holds_collectors_off_until_released() {
        let (state, dir) = (tempfile::tempdir().unwrap(), StoreDir::new("/nix/store").unwrap());
        let can_collect = collector_of(state.path());
        let roots = TempRoots::new(state.path(), &dir);
        roots.add_all_keeping_gc_lock(&paths(&dir, 0, 1)).unwrap();
        assert!(!can_collect() && roots.gc_lock_held_for().is_some());
        roots.add_all_keeping_gc_lock(&paths(&dir, 1, 2)).unwrap();
        let file = roots.path().unwrap();
        let written = || std::fs::read(&file).unwrap().iter().filter(|b| **b == 0).count();
        assert_eq!(written(), 0, "written when the lock is given up");
        assert!(!can_collect());
        roots.release_gc_lock();
        assert_eq!(written(), 3);
        assert!(can_collect() && roots.gc_lock_held_for().is_none());
        std::thread::sleep(GC_LOCK_GAP);
        roots.add_all_keeping_gc_lock(&paths(&dir, 3, 1)).unwrap();
        assert_eq!((written(), can_collect()), (3, false));
        roots.add_all(&paths(&dir, 4, 1)).unwrap();
        assert!(can_collect() && roots.gc_lock_held_for().is_none());
        assert_eq!(written(), 5);
        roots.add_all_keeping_gc_lock(&paths(&dir, 5, 1)).unwrap();
        assert_eq!(written(), 6, "written at once within the gap, the lock not kept");
    }

    /// A lock given up is not kept again within [`GC_LOCK_GAP`]: roots added meanwhile take it
    /// one at a time, so a collector waiting for it gets it between them; after the gap it is
    /// kept again.
    #[test]
    fn a_released_gc_lock_is_kept_again_only_after_the_gap() {
        let (state, dir) = (tempfile::tempdir().unwrap(), StoreDir::new("/nix/store").unwrap());
        let can_collect = collector_of(state.path());
        let roots = TempRoots::new(state.path(), &dir);
        roots.add_all_keeping_gc_lock(&paths(&dir, 0, 1)).unwrap();
        roots.release_gc_lock();
        roots.add_all_keeping_gc_lock(&paths(&dir, 1, 1)).unwrap();
        assert!(can_collect() && roots.gc_lock_held_for().is_none(), "kept again within the gap");
        std::thread::sleep(GC_LOCK_GAP);
        roots.add_all_keeping_gc_lock(&paths(&dir, 2, 1)).unwrap();
        assert!(!can_collect() && roots.gc_lock_held_for().is_some(), "not kept after the gap");
    }

    /// Roots sent while a collector runs share one connection (Nix 2.8's collector aborts on
    /// a quick succession of short connections), and a connection the collector ended is
    /// replaced by a new one for the roots after it.
    #[test]
    fn roots_reach_a_collector_over_one_kept_connection() {
        let state = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(state.path().join("temproots")).unwrap();
        let dir = StoreDir::new("/nix/store").unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (_lock, server) = collector(state.path(), Arc::clone(&stop));
        let roots = TempRoots::new(state.path(), &dir);
        roots.add_all(&paths(&dir, 0, 15)).unwrap();
        roots.add_all(&paths(&dir, 15, 10)).unwrap();
        let file = std::fs::read(roots.path().unwrap()).unwrap();
        assert_eq!(file.iter().filter(|b| **b == 0).count(), 25);
        // The holder's end closes its connection, which ends the collector's second one.
        drop(roots);
        stop.store(true, Ordering::Release);
        let seen = server.join().unwrap();
        let shown = |ps: Vec<StorePath>| ps.iter().map(|p| dir.display_path(p)).collect::<Vec<_>>();
        assert_eq!(seen, vec![shown(paths(&dir, 0, 20)), shown(paths(&dir, 20, 5))]);
    }
}
