//! The substitution pipeline: for each path the closure engine finds, check that it is trusted
//! (a signature by a trusted key, or a content address that matches the path), download its
//! NAR at once (at most `jobs` at a time, before its references are valid), and stream it
//! through decompression, hashing and unpacking into a temporary tree. Each path is then
//! committed — NarHash/NarSize checked, renamed into place and registered — as soon as all its
//! references are valid, so registration follows dependency order. A path whose NAR fails is
//! fetched from the next substituter that has it; a path that cannot be had fails its
//! dependents, never their valid dependencies.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::{Arc, Mutex};

use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::HashAlgo;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::{StoreDir, StorePath};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::closure::{ClosureEvent, ClosureQuery, Substituter};
use crate::compression::Compression;
use crate::local::{LocalStore, PendingPath, Unpacked};
use crate::path_info::ValidPathInfo;

/// How paths are trusted and how many are fetched at once.
#[derive(Debug, Clone)]
pub struct SubstituteOptions {
    /// NAR downloads in flight at once.
    pub jobs: usize,
    /// Refuse paths without a trusted signature (unless content-addressed).
    pub require_sigs: bool,
    pub trusted_keys: TrustedKeys,
}

/// Receives progress; called from many tasks at once.
pub trait Observer: Send + Sync {
    /// A path will be substituted: its compressed and NAR sizes in bytes (0 if unknown).
    fn queued(&self, _path: &StorePath, _download: u64, _nar: u64) {}
    /// `bytes` more compressed bytes arrived.
    fn downloaded(&self, _bytes: u64) {}
    /// A path became valid in the destination.
    fn done(&self, _path: &StorePath) {}
    /// A path failed, with the reason.
    fn failed(&self, _path: &StorePath, _reason: &str) {}
}

/// What a copy did. Sizes in bytes.
#[derive(Debug, Default)]
pub struct CopyReport {
    /// Paths added to the destination by this run.
    pub substituted: Vec<StorePath>,
    /// Paths of the closures that were valid already.
    pub already_valid: usize,
    /// Paths that could not be made valid, with the reason (naming path, URL, field).
    pub failed: BTreeMap<StorePath, String>,
    /// Compressed bytes downloaded.
    pub downloaded: u64,
    /// NAR bytes unpacked.
    pub unpacked: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    Valid,
    Failed,
}

/// Per-path validity states that jobs wait on (the topological gate).
#[derive(Default)]
struct Gate {
    states: Mutex<HashMap<StorePath, watch::Sender<State>>>,
}

impl Gate {
    fn sender(&self, path: &StorePath) -> watch::Sender<State> {
        let mut m = self.states.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(path.clone()).or_insert_with(|| watch::channel(State::Pending).0).clone()
    }

    fn set(&self, path: &StorePath, state: State) {
        self.sender(path).send_replace(state);
    }

    /// Waits until `path` is no longer pending; true if it is valid.
    async fn wait_valid(&self, path: &StorePath) -> bool {
        let mut rx = self.sender(path).subscribe();
        let state = rx.wait_for(|s| *s != State::Pending).await.map(|s| s.clone());
        matches!(state, Ok(State::Valid))
    }
}

/// Everything a path's job needs, shared by all jobs of one copy.
struct Shared {
    dest: Arc<LocalStore>,
    subs: Arc<Vec<Substituter>>,
    opts: SubstituteOptions,
    gate: Gate,
    jobs: Semaphore,
    observer: Arc<dyn Observer>,
    report: Mutex<CopyReport>,
}

/// Copies the closures of `roots` from the substituters of `query` into `dest`.
pub async fn copy_closure(query: ClosureQuery, dest: Arc<LocalStore>, roots: Vec<StorePath>, opts: SubstituteOptions, observer: Arc<dyn Observer>) -> CopyReport {
    let shared = Arc::new(Shared {
        dest,
        subs: query.substituters.clone(),
        jobs: Semaphore::new(opts.jobs.max(1)),
        opts,
        gate: Gate::default(),
        observer,
        report: Mutex::new(CopyReport::default()),
    });
    let (tx, mut rx) = mpsc::unbounded_channel();
    let engine = {
        let query = query.clone();
        tokio::spawn(async move { query.run(roots, tx).await })
    };
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(event) = rx.recv().await {
        match event {
            ClosureEvent::Valid(path) => {
                shared.lock_report().already_valid += 1;
                shared.gate.set(&path, State::Valid);
            }
            ClosureEvent::Found { narinfo, cache } => {
                shared.observer.queued(&narinfo.store_path, narinfo.file_size.unwrap_or(0), narinfo.nar_size);
                let shared = shared.clone();
                let store_dir = query.store_dir.clone();
                tasks.spawn(async move { shared.substitute(store_dir, narinfo, cache).await });
            }
            ClosureEvent::Unknown(path) => {
                let reason = format!("{}: no substituter has this path", query.store_dir.display_path(&path));
                shared.fail(&path, reason);
            }
            ClosureEvent::Failed { path, errors } => {
                let reasons: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                shared.fail(&path, format!("{}: {}", query.store_dir.display_path(&path), reasons.join("; ")));
            }
        }
    }
    let _ = engine.await;
    while tasks.join_next().await.is_some() {}
    let shared = Arc::into_inner(shared).map(|s| s.report.into_inner().unwrap_or_else(|p| p.into_inner()));
    shared.unwrap_or_default()
}

/// A reader that tells the observer how many bytes passed.
struct Counting<R> {
    inner: R,
    observer: Arc<dyn Observer>,
    total: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.total += n as u64;
        self.observer.downloaded(n as u64);
        Ok(n)
    }
}

/// Fails a read that goes past the narinfo's NarSize, so that an oversized NAR is refused
/// as soon as its excess arrives instead of being unpacked whole.
struct SizeLimit<R> {
    inner: R,
    remaining: u64,
    declared: u64,
}

impl<R: Read> Read for SizeLimit<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let want = buf.len().min(self.remaining.saturating_add(1).min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n as u64 > self.remaining {
            let msg = format!("size mismatch: NarSize is {} bytes but the NAR is longer", self.declared);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg));
        }
        self.remaining -= n as u64;
        Ok(n)
    }
}

/// What the content address of a path asks to be checked after unpacking.
enum CaCheck {
    None,
    Flat(sluice_nix::hash::Hash),
}

impl Shared {
    fn lock_report(&self) -> std::sync::MutexGuard<'_, CopyReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, path: &StorePath, reason: String) {
        self.observer.failed(path, &reason);
        self.lock_report().failed.insert(path.clone(), reason);
        self.gate.set(path, State::Failed);
    }

    async fn substitute(self: Arc<Self>, store_dir: StoreDir, narinfo: Arc<NarInfo>, cache: usize) {
        let path = narinfo.store_path.clone();
        match self.substitute_from(&store_dir, narinfo, cache).await {
            Ok(()) => {
                self.observer.done(&path);
                self.gate.set(&path, State::Valid);
            }
            Err(reason) => self.fail(&path, reason),
        }
    }

    /// Tries substituter `first` and then every lower-priority one that has the path.
    async fn substitute_from(&self, store_dir: &StoreDir, narinfo: Arc<NarInfo>, first: usize) -> Result<(), String> {
        let path = narinfo.store_path.clone();
        let shown = store_dir.display_path(&path);
        let mut errors = Vec::new();
        let mut candidate = Some((narinfo, first));
        let mut next = first + 1;
        loop {
            if let Some((narinfo, i)) = candidate.take() {
                match self.try_substituter(store_dir, &narinfo, i).await {
                    Ok(()) => return Ok(()),
                    Err(Attempt::Final(e)) => return Err(format!("{shown}: {e}")),
                    Err(Attempt::TryNext(e)) => errors.push(e),
                }
            }
            let Some(sub) = self.subs.get(next) else { break };
            let i = next;
            next += 1;
            match sub.cache.narinfo_text(&path).await {
                Ok(Some(text)) => match sub.cache.parse_narinfo(&path, store_dir, &text) {
                    Ok(ni) => candidate = Some((Arc::new(ni), i)),
                    Err(e) => errors.push(e.to_string()),
                },
                Ok(None) => {}
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(format!("{shown}: {}", errors.join("; ")))
    }

    async fn try_substituter(&self, store_dir: &StoreDir, narinfo: &NarInfo, i: usize) -> Result<(), Attempt> {
        let cache = &self.subs[i].cache;
        let ca_check = self.check_trust(store_dir, narinfo).map_err(|e| Attempt::TryNext(format!("{}: {e}", cache.narinfo_url(&narinfo.store_path))))?;
        let compression = Compression::parse(&narinfo.compression).map_err(|e| Attempt::TryNext(format!("{}: {e}", cache.narinfo_url(&narinfo.store_path))))?;
        let url = cache.nar_url(narinfo);
        let flat_algo = match &ca_check {
            CaCheck::Flat(h) => Some(h.algo()),
            CaCheck::None => None,
        };
        // Download and unpack, holding a job slot.
        let permit = self.jobs.acquire().await.map_err(|e| Attempt::Final(e.to_string()))?;
        let reader = match cache.open_nar(narinfo).await {
            Ok(Some(r)) => r,
            Ok(None) => return Err(Attempt::TryNext(format!("{url}: NAR not found (404)"))),
            Err(e) => return Err(Attempt::TryNext(e.to_string())),
        };
        let dest = self.dest.clone();
        let path = narinfo.store_path.clone();
        let observer = self.observer.clone();
        let unpack_url = url.clone();
        let nar_size = narinfo.nar_size;
        let unpacked = tokio::task::spawn_blocking(move || -> Result<Option<(PendingPath, Unpacked, u64)>, String> {
            let Some(mut pending) = dest.begin_add(&path).map_err(|e| e.to_string())? else { return Ok(None) };
            let mut counting = Counting { inner: reader, observer, total: 0 };
            let decoder = compression.decoder(&mut counting).map_err(|e| format!("{unpack_url}: {e}"))?;
            let mut nar = std::io::BufReader::with_capacity(256 * 1024, SizeLimit { inner: decoder, remaining: nar_size, declared: nar_size });
            let unpacked = pending.unpack(&mut nar, flat_algo).map_err(|e| format!("{unpack_url}: {e}"))?;
            drop(nar);
            Ok(Some((pending, unpacked, counting.total)))
        })
        .await
        .map_err(|e| Attempt::Final(e.to_string()))?
        .map_err(Attempt::TryNext)?;
        drop(permit);
        let Some((pending, unpacked, downloaded)) = unpacked else { return Ok(()) };
        if let CaCheck::Flat(expected) = &ca_check {
            if unpacked.flat_hash.as_ref() != Some(expected) {
                return Err(Attempt::TryNext(format!("{url}: content does not match its content address {}", narinfo.ca.as_deref().unwrap_or(""))));
            }
        }
        // Wait for the references, then register.
        for r in narinfo.references.iter().filter(|r| **r != narinfo.store_path) {
            if !self.gate.wait_valid(r).await {
                return Err(Attempt::Final(format!("its reference {} could not be substituted", store_dir.display_path(r))));
            }
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let info = ValidPathInfo::from_narinfo(narinfo, now);
        let nar_size = unpacked.nar_size;
        tokio::task::spawn_blocking(move || pending.commit(&info))
            .await
            .map_err(|e| Attempt::Final(e.to_string()))?
            .map_err(|e| Attempt::TryNext(format!("{url}: {e}")))?;
        let mut report = self.lock_report();
        report.substituted.push(narinfo.store_path.clone());
        report.downloaded += downloaded;
        report.unpacked += nar_size;
        Ok(())
    }

    /// Checks that `narinfo` may be trusted: a valid signature by a trusted key, or a content
    /// address from which the path follows (then its content must match, checked later).
    fn check_trust(&self, store_dir: &StoreDir, narinfo: &NarInfo) -> Result<CaCheck, String> {
        let ca = match &narinfo.ca {
            Some(text) => Some(ContentAddress::parse(text).map_err(|e| e.to_string())?),
            None => None,
        };
        let self_ref = narinfo.references.contains(&narinfo.store_path);
        let others: Vec<StorePath> = narinfo.references.iter().filter(|r| **r != narinfo.store_path).cloned().collect();
        let ca_ok = ca.as_ref().and_then(|ca| ca.store_path(store_dir, narinfo.store_path.name(), &others, self_ref).ok()).is_some_and(|p| p == narinfo.store_path);
        let signed = !self.opts.require_sigs || self.opts.trusted_keys.count_valid(&narinfo.fingerprint(store_dir), &narinfo.signatures) > 0;
        if !signed && !ca_ok {
            let names: Vec<&str> = narinfo.signatures.iter().map(|s| s.split(':').next().unwrap_or("")).collect();
            return Err(match names.is_empty() {
                true => "no signature, and signatures are required".to_string(),
                false => format!("no valid signature by a trusted key (signed by: {})", names.join(", ")),
            });
        }
        Ok(match ca {
            Some(ContentAddress::Fixed { recursive: false, hash }) | Some(ContentAddress::Text(hash)) if ca_ok => CaCheck::Flat(hash),
            Some(ContentAddress::Fixed { recursive: true, hash }) if ca_ok && !signed => {
                if hash.algo() == HashAlgo::Sha256 && hash != narinfo.nar_hash {
                    return Err(format!("NarHash {} does not match its content address {}", narinfo.nar_hash.to_nix32_prefixed(), narinfo.ca.as_deref().unwrap_or("")));
                }
                CaCheck::None
            }
            _ => CaCheck::None,
        })
    }
}

/// Why one substituter could not provide a path.
enum Attempt {
    /// Another substituter may succeed.
    TryNext(String),
    /// No substituter can (a reference failed, the pipeline broke).
    Final(String),
}
