//! One attempt at a path from one substituter, once [`Shared::substitute_from`] chose the
//! narinfo: its signatures vouched for, a lock permit ([`Shared::admit`]), the NAR downloaded
//! (again after a transfer cut short), decompressed, checked against NarSize and unpacked
//! into a temporary tree under the path's lock, and the path handed to the registrar once
//! its references allow.

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_binary_cache::NarStream;
use sluice_compress::Compression;
use sluice_local_store::{LocalStore, LocalStoreError, PendingPath, TempRoots, TryAdd, Uncommitted, Unpacked, VouchedInfo};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use tokio::sync::OwnedSemaphorePermit;

use super::{Observer, Shared, State, Until, Verdict};
use crate::closure::Substituter;
use crate::failure::{Cause, Failure};

/// How often, at most, an attempt tells the observer how far its NAR got
/// ([`Observer::progress`]). Nix reports every chunk (`filetransfer.cc`'s progress callback,
/// `copyStorePath`'s progress sink) and its progress bar draws at most every 50 ms
/// (`progress-bar.cc`): reports at that rate show the same.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(50);

/// Bytes (read and unpacked together) after which progress is told even before
/// [`PROGRESS_INTERVAL`] has passed: a NAR read and unpacked within one interval still shows
/// its way through, as Nix's per-chunk reports do.
const PROGRESS_STEP: u64 = 1 << 20;

/// How far one attempt's NAR got: compressed bytes read and NAR bytes unpacked, told to the
/// observer every [`PROGRESS_INTERVAL`] or [`PROGRESS_STEP`] bytes, whichever comes first.
/// Shared by the readers on both sides of the decompressor, which may run on its own threads.
struct Meter {
    observer: Arc<dyn Observer>,
    path: StorePath,
    downloaded: AtomicU64,
    unpacked: AtomicU64,
    start: Instant,
    /// When it was last told, in nanoseconds since `start`.
    reported: AtomicU64,
    /// The bytes read and unpacked it was last told.
    reported_bytes: AtomicU64,
}

impl Meter {
    fn new(observer: Arc<dyn Observer>, path: StorePath) -> Arc<Meter> {
        let (downloaded, unpacked, reported) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        Arc::new(Meter { observer, path, downloaded, unpacked, start: Instant::now(), reported, reported_bytes: AtomicU64::new(0) })
    }

    fn add(&self, downloaded: u64, unpacked: u64) {
        let downloaded = self.downloaded.fetch_add(downloaded, Ordering::Relaxed) + downloaded;
        let unpacked = self.unpacked.fetch_add(unpacked, Ordering::Relaxed) + unpacked;
        let now = self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let last = self.reported.load(Ordering::Relaxed);
        let bytes = downloaded.saturating_add(unpacked);
        let due = now.saturating_sub(last) >= PROGRESS_INTERVAL.as_nanos() as u64
            || bytes.saturating_sub(self.reported_bytes.load(Ordering::Relaxed)) >= PROGRESS_STEP;
        if due && self.reported.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            self.reported_bytes.store(bytes, Ordering::Relaxed);
            self.observer.progress(&self.path, downloaded, unpacked);
        }
    }
}

/// A reader of a NAR's compressed bytes that tells the observer how many passed, and fails
/// once its job is [`Abandoned`].
struct Counting<R> {
    inner: R,
    meter: Arc<Meter>,
    /// The URL of the cache the bytes come from.
    cache: String,
    abandoned: Arc<AtomicBool>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.abandoned.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("the copy was stopped"));
        }
        let n = self.inner.read(buf)?;
        self.meter.observer.downloaded(&self.cache, n as u64);
        self.meter.add(n as u64, 0);
        Ok(n)
    }
}

/// A reader of a NAR's decompressed bytes that counts them into its [`Meter`].
struct Unpacking<R> {
    inner: R,
    meter: Arc<Meter>,
}

impl<R: Read> Read for Unpacking<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.meter.add(0, n as u64);
        Ok(n)
    }
}

/// Set when dropped: held by the future that waits for an unpacking job, so that a job whose
/// copy stopped (the future dropped: an interrupted command) ends at its
/// NAR's next read instead of unpacking the rest, and its tree and lock go with it.
struct Abandoned(Arc<AtomicBool>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Gives the NAR parser at most the narinfo's NarSize bytes, and fails a read it asks for
/// beyond them: a NAR longer than its NarSize is refused as soon as its excess is needed,
/// instead of being unpacked whole. Bytes after a NAR that ends within NarSize are never
/// asked for, and the download stops there (Nix substitutes such a file: `restorePath` reads
/// only the NAR).
struct SizeLimit<R> {
    inner: R,
    remaining: u64,
    declared: u64,
}

impl<R: Read> Read for SizeLimit<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.remaining == 0 {
            let msg = format!("size mismatch: NarSize is {} bytes but the NAR is longer", self.declared);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg));
        }
        let want = buf.len().min(self.remaining.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        self.remaining -= n as u64;
        Ok(n)
    }
}

impl Shared {
    /// Substitutes `narinfo`'s path from substituter `i`, admitted eagerly or not (see
    /// [`Shared::admit`]); `verdict` if its signatures were checked already (a refusal is this
    /// substituter's failure, with no second check).
    pub(super) async fn try_substituter(
        &self,
        store_dir: &StoreDir,
        narinfo: &NarInfo,
        i: usize,
        verdict: Option<&Verdict>,
        eager: &mut bool,
    ) -> Result<(), Attempt> {
        let (sub, trusted) = (&self.subs[i], self.subs[i].trusted);
        let cache = &sub.source;
        let narinfo_url = cache.narinfo_url(&narinfo.store_path);
        let vouched = match verdict {
            Some(Ok(vouched)) => vouched.clone(),
            Some(Err(refused)) => return Err(Attempt::TryNext(refused.clone())),
            None => {
                let info = ValidPathInfo::from_narinfo(narinfo, 0);
                self.opts
                    .policy
                    .for_source(trusted)
                    .vouch_info(store_dir, info)
                    .map_err(|e| Attempt::TryNext(Failure::store(&narinfo_url, &e)))?
            }
        };
        let compression =
            Compression::parse(&narinfo.compression).map_err(|e| Attempt::TryNext(Failure::other(format!("{narinfo_url}: {e}"))))?;
        let url = cache.nar_url(narinfo);
        // Released after the lock: `pending` is dropped, or consumed by the registrar, first.
        let _permit = self.admit(store_dir, narinfo, eager).await?;
        // Boxed: every path's task waits for its admission at once, and so its state is only
        // as large as what it holds while waiting (a page of memory per path otherwise).
        Box::pin(self.fetch_and_register(store_dir, sub, narinfo, &vouched, compression, &url)).await
    }

    /// Downloads and unpacks the NAR of `narinfo` from `sub` ([`Shared::fetch_nar`]), then
    /// hands the path to the registrar once its references allow and waits for it to be
    /// registered.
    async fn fetch_and_register(
        &self,
        store_dir: &StoreDir,
        sub: &Substituter,
        narinfo: &NarInfo,
        vouched: &VouchedInfo,
        compression: Compression,
        url: &str,
    ) -> Result<(), Attempt> {
        let trusted = sub.trusted;
        let Some((mut pending, unpacked, downloaded)) = self.fetch_nar(sub, narinfo, vouched, compression, url).await? else {
            // Another process made it valid meanwhile.
            self.lock_report().already_valid += 1;
            return Ok(());
        };
        let nar_size = unpacked.nar_size;
        let path = &narinfo.store_path;
        let mut until = Until::Ready;
        loop {
            self.wait_references(store_dir, narinfo, until, true).await?;
            let stopped = || Attempt::Final(Failure::other("the registrar stopped".into()));
            // Handed over only if it was not failed meanwhile (for a cycle), and marked ready in
            // the same step, so that a path is never both: its dependents are handed over after it
            // from now on.
            let (mut unhanded, mut registered) = (Some(pending), None);
            let handed = self.gate.update(path, |s| {
                if *s == State::Failed {
                    return None;
                }
                registered = unhanded.take().and_then(|p| self.registrar.hand(p, trusted));
                registered.is_some().then_some(State::Ready)
            });
            let registered = match (handed, registered) {
                (true, Some(registered)) => registered,
                _ if unhanded.is_some() => return Err(Attempt::Final(Failure::other("failed meanwhile".into()))),
                _ => return Err(stopped()),
            };
            let uncommitted = match registered.await.map_err(|_| stopped())? {
                Ok(()) => break,
                Err(uncommitted) => uncommitted,
            };
            self.gate.set(path, State::Pending);
            match uncommitted {
                // A reference handed over before it was refused, and goes to its next
                // substituter: this path waits for it to be registered.
                Uncommitted::Waiting(back, e) if until == Until::Ready => {
                    tracing::debug!("{e}; committing it again once its references are registered");
                    (pending, until) = (*back, Until::Valid);
                }
                uncommitted => return Err(Attempt::TryNext(Failure::store(url, &uncommitted.into_error()))),
            }
        }
        let mut report = self.lock_report();
        report.substituted.push(narinfo.store_path.clone());
        report.downloaded += downloaded;
        report.unpacked += nar_size;
        Ok(())
    }

    /// A permit to hold the lock of `narinfo`'s path. While `eager`, one is taken at once if
    /// free; otherwise the path becomes deferred (`eager` is cleared): it waits for its
    /// references holding nothing, then queues for a permit.
    async fn admit(&self, store_dir: &StoreDir, narinfo: &NarInfo, eager: &mut bool) -> Result<OwnedSemaphorePermit, Attempt> {
        if *eager {
            if let Some(permit) = self.locks.try_take() {
                return Ok(permit);
            }
            *eager = false;
        }
        self.wait_references(store_dir, narinfo, Until::Ready, false).await?;
        self.locks.take().await.map_err(|e| Attempt::Final(Failure::other(e)))
    }

    /// Waits until every reference of `narinfo`'s path (but itself) has got as far as `until`
    /// says. If `preemptible`, gives up ([`Attempt::Yielded`]) instead as soon as a path is
    /// queued for a lock permit.
    async fn wait_references(&self, store_dir: &StoreDir, narinfo: &NarInfo, until: Until, preemptible: bool) -> Result<(), Attempt> {
        let references = async {
            for r in narinfo.references.iter().filter(|r| **r != narinfo.store_path) {
                if !self.gate.wait(r, until).await {
                    let message = format!("its reference {} could not be substituted", store_dir.display_path(r));
                    return Err(Attempt::Final(Failure { cause: Cause::Reference, message }));
                }
            }
            Ok(())
        };
        if !preemptible {
            return references.await;
        }
        tokio::select! {
            biased;
            done = references => done,
            () = self.locks.contended() => Err(Attempt::Yielded),
        }
    }

    /// Starts adding (or repairing) the path of `vouched` in the destination without blocking
    /// on its lock ([`LocalStore::try_begin_add_vouched`], [`LocalStore::try_begin_repair`]):
    /// roots it, takes its lock if free and looks at its validity with the lock held. Runs on
    /// the blocking thread that then unpacks the NAR, so that both are one hand-off.
    fn try_begin(dest: &Arc<LocalStore>, vouched: VouchedInfo, roots: &TempRoots, repair: bool) -> Result<TryAdd, Attempt> {
        let tried = match repair {
            true => dest.try_begin_repair(vouched.info(), roots),
            false => dest.try_begin_add_vouched(vouched, roots),
        };
        tried.map_err(|e| match e {
            // Another substituter may have the registered NAR.
            LocalStoreError::RepairMismatch { .. } => Attempt::TryNext(Failure::other(e.to_string())),
            e => Attempt::Final(Failure::other(e.to_string())),
        })
    }

    /// Waits, holding no job slot and no open NAR, until another process releases the lock
    /// of `vouched`'s path, trying it every 5 ms doubling to 200 ms; then the path is locked
    /// (`Some`), or found valid with the lock held (`None`).
    async fn wait_for_lock(&self, vouched: &VouchedInfo) -> Result<Option<PendingPath>, Attempt> {
        let mut wait = std::time::Duration::from_millis(5);
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(std::time::Duration::from_millis(200));
            let (dest, vouched, roots, repair) = (self.dest.clone(), vouched.clone(), self.roots.clone(), self.repair);
            let tried = tokio::task::spawn_blocking(move || Self::try_begin(&dest, vouched, &roots, repair));
            match tried.await.map_err(|e| Attempt::Final(Failure::other(e.to_string())))?? {
                TryAdd::Pending(pending) => return Ok(Some(*pending)),
                TryAdd::Valid => return Ok(None),
                TryAdd::Busy => {}
            }
        }
    }

    /// Downloads and unpacks the NAR of `narinfo` from `cache` into a temporary tree. Per
    /// attempt: a job slot, the NAR opened, then one blocking task (on the process's
    /// unpacking threads for a NAR whose bytes are local, `unpack_pool.rs`; on tokio's
    /// blocking pool for one arriving over the network) that takes the path's lock (the first time: [`Shared::try_begin`], Nix's order in `LocalStore::addToStore`:
    /// root, lock, validity, restore) and unpacks. While another process holds the lock, the
    /// slot and the NAR are given up and the lock waited for holding nothing else
    /// ([`Shared::wait_for_lock`]); the NAR is opened again once the lock is held. A transfer cut short (reset, stall, fewer bytes than announced)
    /// is downloaded again after a backoff, up to the cache's `download-attempts`, with the
    /// lock kept. `None` when the path is or became valid.
    async fn fetch_nar(
        &self,
        sub: &Substituter,
        narinfo: &NarInfo,
        vouched: &VouchedInfo,
        compression: Compression,
        url: &str,
    ) -> Result<Option<(PendingPath, Unpacked, u64)>, Attempt> {
        let cache = &sub.source;
        let attempts = cache.download_attempts();
        let mut attempt = 0;
        let mut pending: Option<PendingPath> = None;
        loop {
            let permit = self.jobs.acquire(narinfo.file_size.unwrap_or(narinfo.nar_size)).await;
            let NarStream { reader, probe, local, .. } = match cache.open_nar(narinfo).await {
                Ok(Some(r)) => r,
                Ok(None) => return Err(Attempt::TryNext(Failure::other(format!("{url}: NAR not found (404)")))),
                Err(e) => return Err(Attempt::TryNext(Failure::cache(sub.source.url(), &e))),
            };
            let observer = self.observer.clone();
            let cache_url = cache.url().to_string();
            let unpack_url = url.to_string();
            let (path, nar_size, file_size) = (narinfo.store_path.clone(), narinfo.nar_size, narinfo.file_size);
            let (dest, vouched_here, roots, repair) = (self.dest.clone(), vouched.clone(), self.roots.clone(), self.repair);
            let locked = pending.take();
            let abandoned = Arc::new(AtomicBool::new(false));
            let waiting = Abandoned(abandoned.clone());
            let unpack = move || {
                let mut pending = match locked {
                    Some(pending) => pending,
                    None => match Self::try_begin(&dest, vouched_here, &roots, repair)? {
                        TryAdd::Pending(pending) => *pending,
                        TryAdd::Valid => return Ok(None),
                        TryAdd::Busy => return Ok(Some(Locked::Busy)),
                    },
                };
                observer.started(&path, &cache_url);
                if unpack_url.starts_with("http://") || unpack_url.starts_with("https://") {
                    observer.fetching(&path, &unpack_url);
                }
                let meter = Meter::new(observer, path);
                let mut counting = Counting { inner: reader, meter: meter.clone(), cache: cache_url, abandoned };
                let result = match compression.decoder_sized(&mut counting, file_size) {
                    Ok(decoder) => {
                        let limited = SizeLimit { inner: decoder, remaining: nar_size, declared: nar_size };
                        let unpacking = Unpacking { inner: limited, meter: meter.clone() };
                        let mut nar = std::io::BufReader::with_capacity(sluice_compress::NAR_READ_BUFFER, unpacking);
                        pending.unpack(&mut nar).map_err(|e| format!("{unpack_url}: {e}"))
                    }
                    Err(e) => Err(format!("{unpack_url}: {e}")),
                };
                let total = meter.downloaded.load(Ordering::Relaxed);
                Ok(Some(Locked::Unpacked { pending, result: result.map(|u| (u, total)) }))
            };
            let locked = match local {
                true => crate::unpack_pool::run(self.depths.of(&narinfo.store_path), unpack).await,
                false => tokio::task::spawn_blocking(unpack).await.map_err(|e| e.to_string()),
            };
            drop(waiting);
            let locked = locked.map_err(|e| Attempt::Final(Failure::other(e)))?;
            drop(permit);
            let (locked, unpacked) = match locked? {
                None => return Ok(None),
                Some(Locked::Busy) => {
                    // The NAR opened for this attempt is dropped once; the lock is then waited
                    // for with no NAR open, and the NAR opened again with the lock held.
                    pending = match self.wait_for_lock(vouched).await? {
                        Some(pending) => Some(pending),
                        None => return Ok(None),
                    };
                    continue;
                }
                Some(Locked::Unpacked { pending, result }) => (pending, result),
            };
            attempt += 1;
            let error = match unpacked {
                Ok((unpacked, got)) => {
                    // FileSize/FileHash are unsigned hints; the content was verified against the
                    // signed NarHash/NarSize, so a mismatch is only worth a warning. Reading
                    // stops at the NAR's end, before the compressed stream's last bytes (xz's
                    // index and footer), so only more bytes than declared show a mismatch.
                    if let Some(declared) = narinfo.file_size.filter(|d| got > *d) {
                        tracing::warn!("{url}: FileSize is {declared} bytes but {got} were downloaded; the NAR itself matches its NarHash");
                    }
                    return Ok(Some((locked, unpacked, got)));
                }
                Err(e) => e,
            };
            pending = Some(locked);
            let Some(broken) = probe.broken() else { return Err(Attempt::TryNext(Failure::other(error))) };
            if attempt >= attempts {
                return Err(Attempt::TryNext(Failure::other(format!("{broken}; gave up after {attempt} attempts"))));
            }
            let wait = cache.backoff(attempt);
            tracing::info!("{broken}; downloading again in {} ms", wait.as_millis());
            tokio::time::sleep(wait).await;
        }
    }
}

/// What an attempt's blocking task did once the path was not found valid.
#[allow(clippy::large_enum_variant)] // one per path in flight, moved once
enum Locked {
    /// Another process or thread holds the path's lock.
    Busy,
    /// The lock is held (by `pending`) and the NAR was unpacked: what it produced and the
    /// compressed bytes read, or why it failed.
    Unpacked { pending: PendingPath, result: Result<(Unpacked, u64), String> },
}

/// Why one substituter could not provide a path.
pub(super) enum Attempt {
    /// Another substituter may succeed.
    TryNext(Failure),
    /// No substituter can (a reference failed, the pipeline broke).
    Final(Failure),
    /// The path gave its lock up to a path queued for a permit: to be tried again.
    Yielded,
}
