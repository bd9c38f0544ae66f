//! The CPU of sluice's own parts substituting a closure from a `file://` cache, put together
//! with as little coordination as a pipeline can have (is the gap to the `tar -x`
//! floor in the parts, or in the way `sluice copy` puts them together?). Run by
//! `bench/copy-floor --lean`, beside `sluice copy`:
//!
//!   cargo build --release -p sluice-store --example lean_pipeline
//!   target/release/examples/lean_pipeline CACHE_DIR STORE_ROOT PUBLIC_KEY STORE_PATH
//!
//! CACHE_DIR is a `file://` binary cache, STORE_ROOT a directory where a new store is made
//! (`local?root=STORE_ROOT`), PUBLIC_KEY the cache's key (`name:base64`), STORE_PATH the
//! closure's top path. Four threads, no runtime, no task per path:
//!
//! - this thread walks the closure level by level, reading and parsing each narinfo, checks
//!   the signatures of 64 at a time ([`SignaturePolicy::vouch_all`], as the substitution does)
//!   and queues a job per path, its priority its level;
//! - two unpacking threads take the deepest job waiting, lock the path and check its validity
//!   ([`LocalStore::try_begin_add_vouched`]), open its NAR file, decompress, hash and unpack it
//!   ([`PendingPath::unpack`]) and hand it to the registrar;
//! - the registrar commits, in batches of whatever has arrived ([`LocalStore::commit_all`]),
//!   the paths whose references are registered or earlier in the batch, the others waiting.
//!
//! Its wall is not a bound: the walk and its signatures run before the first unpacking of
//! each level, where `sluice copy` overlaps them. What it leaves out that `sluice copy` does:
//! the validity query of the closure walk (the store is new), fallback caches, failures
//! other than stopping, the narinfo disk cache, the open-file budget, logging and progress.
//! Prints, on standard error, the paths and the wall from `main` to the last commit, and the
//! number of commits; exits non-zero if a walked path is not valid afterwards.
// A measurement tool, not library code: it stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

use std::collections::HashSet;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use sluice_compress::{Compression, NAR_READ_BUFFER};
use sluice_local_store::{LocalStore, PendingPath, SignaturePolicy, TempRoots, TryAdd, VouchedInfo};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::store_url::LocalStoreConfig;

/// `sluice`'s allocator and its options (`crates/sluice/src/main.rs`).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
#[allow(unsafe_code)] // the symbol jemalloc reads its options from
#[export_name = "_rjem_malloc_conf"]
static JEMALLOC_OPTIONS: &[u8; 19] = b"dirty_decay_ms:100\0";

/// Narinfos whose signatures are checked together: the substitution's `VOUCH_BATCH`.
const VOUCH_BATCH: usize = 64;

/// A path to unpack: its level in the walk (deeper first), what was vouched for, and its NAR.
struct Job {
    level: usize,
    vouched: VouchedInfo,
    nar: PathBuf,
    compression: Compression,
    file_size: Option<u64>,
}

/// The jobs waiting, and whether the walk has ended.
#[derive(Default)]
struct Queue {
    state: Mutex<(Vec<Job>, bool)>,
    ready: Condvar,
}

impl Queue {
    fn push(&self, jobs: Vec<Job>) {
        self.state.lock().unwrap().0.extend(jobs);
        self.ready.notify_all();
    }

    fn close(&self) {
        self.state.lock().unwrap().1 = true;
        self.ready.notify_all();
    }

    /// The deepest job waiting (the first queued among equals); `None` once none is left.
    fn next(&self) -> Option<Job> {
        let mut state = self.state.lock().unwrap();
        loop {
            let deepest = state.0.iter().enumerate().max_by_key(|(i, j)| (j.level, std::cmp::Reverse(*i))).map(|(i, _)| i);
            if let Some(i) = deepest {
                return Some(state.0.remove(i));
            }
            if state.1 {
                return None;
            }
            state = self.ready.wait(state).unwrap();
        }
    }
}

/// Walks the closure of `top` in `cache`, level by level, queueing each path's job.
fn walk(cache: &Path, store_dir: &StoreDir, policy: &SignaturePolicy, top: StorePath, queue: &Queue) -> Result<usize, String> {
    let (mut seen, mut level, mut frontier) = (HashSet::from([top.clone()]), 0, vec![top]);
    while !frontier.is_empty() {
        let mut next = Vec::new();
        for chunk in frontier.chunks(VOUCH_BATCH) {
            let narinfos = chunk
                .iter()
                .map(|p| {
                    let file = cache.join(format!("{}.narinfo", p.hash_part()));
                    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
                    NarInfo::parse(store_dir, &text).map_err(|e| format!("{}: {e}", file.display()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let infos = narinfos.iter().map(|n| ValidPathInfo::from_narinfo(n, 0)).collect();
            let vouched = policy.vouch_all(store_dir, infos).ok_or("a signature does not verify")?;
            let mut jobs = Vec::with_capacity(chunk.len());
            for (narinfo, vouched) in narinfos.into_iter().zip(vouched) {
                next.extend(narinfo.references.iter().filter(|r| seen.insert((*r).clone())).cloned());
                jobs.push(Job {
                    level,
                    vouched: vouched.map_err(|e| e.to_string())?,
                    nar: cache.join(&narinfo.url),
                    compression: Compression::parse(&narinfo.compression).map_err(|e| e.to_string())?,
                    file_size: narinfo.file_size,
                });
            }
            queue.push(jobs);
        }
        frontier = next;
        level += 1;
    }
    Ok(seen.len())
}

/// Unpacks the queue's jobs until it is empty and closed, handing each path to `registrar`.
fn unpack(store: &Arc<LocalStore>, roots: &TempRoots, queue: &Queue, registrar: mpsc::Sender<PendingPath>) -> Result<(), String> {
    while let Some(job) = queue.next() {
        let shown = job.nar.display().to_string();
        let mut pending = match store.try_begin_add_vouched(job.vouched, roots).map_err(|e| e.to_string())? {
            TryAdd::Pending(p) => *p,
            TryAdd::Valid | TryAdd::Busy => return Err(format!("{shown}: valid or locked in a new store")),
        };
        let file = std::fs::File::open(&job.nar).map_err(|e| format!("{shown}: {e}"))?;
        let decoder = job.compression.decoder_sized(file, job.file_size).map_err(|e| format!("{shown}: {e}"))?;
        let mut nar = BufReader::with_capacity(NAR_READ_BUFFER, decoder);
        pending.unpack(&mut nar).map_err(|e| format!("{shown}: {e}"))?;
        registrar.send(pending).map_err(|_| REGISTRAR_STOPPED)?;
    }
    Ok(())
}

/// An unpacking thread's error when the registrar ended first (its own error says why).
const REGISTRAR_STOPPED: &str = "the registrar stopped";

/// Closes the queue when dropped, so that the unpacking threads end even if the walk panics.
struct Closing<'a>(&'a Queue);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Commits what arrives, each path once its references are registered; returns the paths
/// registered and the number of commits.
fn register(
    store: &LocalStore,
    policy: &SignaturePolicy,
    arrivals: mpsc::Receiver<PendingPath>,
) -> Result<(Vec<StorePath>, usize), String> {
    let (mut valid, mut waiting, mut commits) = (HashSet::new(), Vec::<PendingPath>::new(), 0);
    let mut registered = Vec::new();
    while let Ok(first) = arrivals.recv() {
        waiting.push(first);
        waiting.extend(arrivals.try_iter());
        // Passes over the waiting paths until one adds none to the batch: a path joins it after
        // the references it has among them.
        let (mut batch, mut in_batch) = (Vec::new(), HashSet::new());
        loop {
            let before = batch.len();
            for p in std::mem::take(&mut waiting) {
                let info = p.info();
                match info.references.iter().all(|r| *r == info.path || valid.contains(r) || in_batch.contains(r)) {
                    true => {
                        in_batch.insert(info.path.clone());
                        batch.push(p);
                    }
                    false => waiting.push(p),
                }
            }
            if batch.len() == before {
                break;
            }
        }
        if batch.is_empty() {
            continue;
        }
        let paths: Vec<StorePath> = batch.iter().map(|p| p.info().path.clone()).collect();
        commits += 1;
        for (path, result) in paths.into_iter().zip(store.commit_all(batch.into_iter().map(|p| (p, policy)).collect())) {
            result.map_err(|e| e.into_error().to_string())?;
            valid.insert(path.clone());
            registered.push(path);
        }
    }
    match waiting.first() {
        Some(p) => Err(format!("{}: a reference never arrived", p.info().path.base_name())),
        None => Ok((registered, commits)),
    }
}

fn main() -> Result<(), String> {
    let start = Instant::now();
    let args: Vec<String> = std::env::args().collect();
    let [_, cache, root, key, top] = &args[..] else {
        return Err("usage: lean_pipeline CACHE_DIR STORE_ROOT PUBLIC_KEY STORE_PATH".into());
    };
    let store_dir = StoreDir::default();
    let top = store_dir.parse_path(top).map_err(|e| e.to_string())?;
    let policy = SignaturePolicy { require_sigs: true, trusted_keys: TrustedKeys::parse(key).map_err(|e| e.to_string())? };
    let store = Arc::new(LocalStore::open(&LocalStoreConfig::with_root(Path::new(root))).map_err(|e| e.to_string())?);
    let roots = store.temp_roots();
    let queue = Queue::default();
    let (to_registrar, arrivals) = mpsc::channel();
    let (walked, (registered, commits)) = std::thread::scope(|s| {
        let registrar = s.spawn(|| register(&store, &policy, arrivals));
        let unpackers: Vec<_> = (0..2)
            .map(|_| {
                let to_registrar = to_registrar.clone();
                s.spawn(|| unpack(&store, &roots, &queue, to_registrar))
            })
            .collect();
        drop(to_registrar);
        let walked = {
            let _closing = Closing(&queue);
            walk(Path::new(cache), &store_dir, &policy, top, &queue)
        };
        let unpacked: Result<Vec<()>, String> = unpackers.into_iter().map(|u| u.join().unwrap()).collect();
        let registered = registrar.join().unwrap();
        match (unpacked, registered) {
            (Err(e), Err(why)) if e == REGISTRAR_STOPPED => Err(why),
            (Err(e), _) => Err(e),
            (Ok(_), registered) => Ok((walked?, registered?)),
        }
    })?;
    let wall = start.elapsed();
    for (path, info) in registered.iter().zip(store.query_path_infos(&registered)) {
        info.map_err(|e| e.to_string())?.ok_or_else(|| format!("{}: not valid after its commit", path.base_name()))?;
    }
    if registered.len() != walked {
        return Err(format!("{} paths registered of the {walked} walked", registered.len()));
    }
    eprintln!("{walked} paths in {:.1} ms, {commits} commits", wall.as_secs_f64() * 1e3);
    Ok(())
}
