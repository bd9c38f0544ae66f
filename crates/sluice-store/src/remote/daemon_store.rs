//! [`DaemonStore`]: a daemon behind the [`Store`](crate::store::Store) interface, its one
//! connection on a thread of its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::ProtocolVersion;

use super::closure::FoundClosure;
use super::{batch, DaemonConnection, RemoteError};
use crate::store::{
    fetched_ahead, AdditionStream, FoundLevel, NarReader, PipedNar, PublishGate, Store, StoreError, StoreFuture, StreamOutcomes,
    PREFETCH_TOTAL,
};

/// A daemon behind the [`Store`](crate::store::Store) interface: one connection (Nix's
/// default `max-connections`), owned by a thread of its own that runs the store's operations
/// one after another (so that with `lock-cpu` the thread pinned is the one that talks to the
/// daemon). A connection an operation failed on is dropped and the next operation connects
/// again. Additions wait for their publish gate before they are sent (the daemon makes a path
/// valid as it adds it, and registers it only after its references); meanwhile the NAR is
/// spooled to an unlinked temporary file, so that the source is read to its end. The
/// additions waiting when the thread comes to one go together in one AddMultipleToStore
/// (`remote/batch.rs`).
pub struct DaemonStore {
    url: String,
    store_dir: StoreDir,
    version: ProtocolVersion,
    jobs: std::sync::mpsc::Sender<Job>,
    prefetched: Prefetched,
    /// Whether additions ask the daemon to check signatures.
    check_sigs: bool,
}

/// NARs being fetched ahead of their readers ([`Store::prefetch_nars`]), by path: each
/// arrives whole, or as the connection's failure.
type Prefetched = Arc<Mutex<HashMap<StorePath, Receiver<Result<Vec<u8>, String>>>>>;

/// Work for the connection's thread.
pub(super) enum Job {
    /// An operation.
    Run(Box<dyn FnOnce(&mut Reconnecting) + Send>),
    /// A path to add, with the additions queued behind it ([`batch::Addition`]).
    Add(batch::Addition),
}

/// Paths a [`DaemonStore`] reads the NARs of at once when the daemon takes AddMultipleToStore:
/// the additions that can wait in its queue to go in one operation.
const ADDITIONS_AT_ONCE: usize = 64;

/// Opens a new connection to the daemon of a [`DaemonStore`] (a Unix socket's, or a remote
/// command's through ssh), on the connection's thread.
pub type Connector = Box<dyn FnMut() -> Result<DaemonConnection, RemoteError> + Send>;

/// The connection of a [`DaemonStore`], on its thread; `None` after a failure.
pub(super) struct Reconnecting {
    connect: Connector,
    conn: Option<DaemonConnection>,
}

impl Reconnecting {
    /// Runs `f` on the connection, connecting first if there is none; a failure drops it, as
    /// it may have left the connection out of step (a batch's replies unread).
    pub(super) fn with<T>(&mut self, f: impl FnOnce(&mut DaemonConnection) -> Result<T, RemoteError>) -> Result<T, RemoteError> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => self.conn.insert((self.connect)()?),
        };
        let result = f(conn);
        if result.is_err() {
            self.conn = None;
        }
        result
    }
}

impl DaemonStore {
    /// Connects to the daemon at `socket` (opened as `url`) from the connection's new thread,
    /// pinned with `lock_cpu` (see [`DaemonConnection::connect`]); additions ask the daemon to check
    /// signatures when `check_sigs` (Nix's `CheckSigs`; `false` is `--no-check-sigs`, which a
    /// daemon honours only for a trusted client).
    pub fn connect(url: &str, socket: &Path, lock_cpu: bool, check_sigs: bool) -> Result<Self, RemoteError> {
        let socket = socket.to_owned();
        let daemon = socket.display().to_string();
        Self::open(url, &daemon, Box::new(move || DaemonConnection::connect(&socket, lock_cpu)), check_sigs)
    }

    /// The daemon `connect` connects to (opened as `url`, named `daemon` in errors), connected
    /// from the connection's new thread; additions as with [`DaemonStore::connect`].
    pub fn open(url: &str, daemon: &str, connect: Connector, check_sigs: bool) -> Result<Self, RemoteError> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let (greeted, greeting) = std::sync::mpsc::channel();
        let mut conn = Reconnecting { connect, conn: None };
        let spawned = std::thread::Builder::new().name("sluice-daemon-client".into()).spawn(move || {
            let greeting = conn.with(|c| Ok((c.store_dir().clone(), c.version())));
            let ok = greeting.is_ok();
            let _ = greeted.send(greeting);
            if ok {
                batch::serve(&mut conn, &queue, check_sigs);
            }
        });
        spawned.map_err(|source| RemoteError::Connect { daemon: daemon.to_string(), source })?;
        let ended = || RemoteError::Protocol { message: "the connection's thread ended".into(), daemon: daemon.to_string() };
        let (store_dir, version) = greeting.recv().map_err(|_| ended())??;
        Ok(DaemonStore { url: url.to_string(), store_dir, version, jobs, prefetched: Prefetched::default(), check_sigs })
    }

    /// Runs `f` on the connection's thread.
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut DaemonConnection) -> Result<T, RemoteError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.jobs.send(Job::Run(Box::new(move |conn: &mut Reconnecting| drop(tx.send(conn.with(f)))))).map_err(|_| self.ended())?;
        Ok(rx.await.map_err(|_| self.ended())??)
    }

    fn ended(&self) -> StoreError {
        StoreError::Other(format!("{}: the daemon connection's thread ended", self.url))
    }

    /// The infos of a closure found, or the error naming the first path of it the daemon did
    /// not know.
    fn whole(&self, found: FoundClosure) -> Result<BTreeMap<StorePath, ValidPathInfo>, StoreError> {
        match found.not_valid {
            Some(path) => Err(StoreError::NotValid { url: self.url.clone(), path: self.store_dir.display_path(&path) }),
            None => Ok(found.infos),
        }
    }
}

impl Store for DaemonStore {
    fn url(&self) -> &str {
        &self.url
    }

    fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        let paths = paths.to_vec();
        Box::pin(async move {
            let infos = self.run(move |c| c.query_path_infos(&paths)).await?;
            Ok(infos.into_iter().map(|i| i.map(PathInfo::of)).collect())
        })
    }

    /// Each path is made a temporary root of the connection before it is looked up, as Nix's
    /// `copyPaths` does (`addTempRoots`, then `queryValidPaths`), so that a path found valid
    /// stays valid in the daemon while the connection lives (a path added later may refer to
    /// it): one round trip ([`DaemonConnection::query_valid_paths_rooted`]).
    fn query_valid_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, BTreeSet<StorePath>> {
        let paths = paths.to_vec();
        Box::pin(async move { self.run(move |c| c.query_valid_paths_rooted(&paths)).await })
    }

    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        let nar = DaemonNar {
            url: self.url.clone(),
            jobs: self.jobs.clone(),
            path: info.path.clone(),
            nar_size: info.nar_size,
            prefetched: self.prefetched.clone(),
            reader: None,
        };
        Box::pin(async move { Ok(Box::new(nar) as NarReader) })
    }

    /// The NARs of `infos` (those [`fetched_ahead`] picks) are
    /// asked for at once, NarFromPath pipelined on the connection, and kept as they arrive
    /// until their readers take them: one round trip for hundreds of NARs instead of one each.
    fn prefetch_nars(&self, infos: &[&ValidPathInfo]) {
        let ahead = fetched_ahead(infos);
        let total: u64 = ahead.iter().map(|i| i.nar_size).sum();
        let mut wanted = Vec::new();
        let mut senders = Vec::new();
        let mut prefetched = self.prefetched.lock().unwrap_or_else(|p| p.into_inner());
        for info in ahead {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            prefetched.insert(info.path.clone(), rx);
            wanted.push((info.path.clone(), info.nar_size));
            senders.push(Some(tx));
        }
        if wanted.is_empty() {
            return;
        }
        tracing::debug!("{}: fetching {} NARs ahead ({total} bytes)", self.url, wanted.len());
        let fetch = Job::Run(Box::new(move |conn: &mut Reconnecting| {
            let fetched = conn.with(|c| {
                c.nars_from_paths(&wanted, |i, nar| {
                    if let Some(tx) = senders[i].take() {
                        let _ = tx.send(Ok(nar));
                    }
                })
            });
            if let Err(e) = fetched {
                let message = e.to_string();
                senders.into_iter().flatten().for_each(|tx| drop(tx.send(Err(message.clone()))));
            }
        }));
        // Without the thread, each reader finds its NAR's sender gone and says so.
        let _ = self.jobs.send(fetch);
    }

    /// The closure a level at a time (`remote/closure.rs`), each level sent on `levels` as it
    /// is found and the NARs named in the answer asked for right behind the next level's
    /// queries (those [`fetched_ahead`] picks, up to its total for the whole closure),
    /// each kept as it arrives until its reader takes it, as [`Store::prefetch_nars`] keeps
    /// them. The closure is answered once found; the connection's thread goes on reading the
    /// NARs still to come.
    fn closure_infos_fetching<'a>(
        &'a self,
        roots: &'a [StorePath],
        levels: tokio::sync::mpsc::UnboundedSender<FoundLevel>,
    ) -> StoreFuture<'a, BTreeMap<StorePath, ValidPathInfo>> {
        let (roots, prefetched) = (roots.to_vec(), self.prefetched.clone());
        let (answer_closure, closure) = tokio::sync::oneshot::channel();
        let job = Job::Run(Box::new(move |conn: &mut Reconnecting| {
            let senders = std::cell::RefCell::new(HashMap::new());
            // Dropped once the closure is found: the copy then knows no more levels come.
            let levels = std::cell::RefCell::new(Some(levels));
            let mut spent = 0;
            let mut choose = |infos: &[ValidPathInfo]| {
                let (fetch, answer) = tokio::sync::oneshot::channel();
                let level = FoundLevel { infos: infos.to_vec(), fetch };
                if levels.borrow().as_ref().is_none_or(|l| l.send(level).is_err()) {
                    return Vec::new();
                }
                let named = answer.blocking_recv().unwrap_or_default();
                let by_path: HashMap<&StorePath, &ValidPathInfo> = infos.iter().map(|i| (&i.path, i)).collect();
                let mut chosen = Vec::new();
                for info in fetched_ahead(&named.iter().filter_map(|p| by_path.get(p).copied()).collect::<Vec<_>>()) {
                    spent += info.nar_size;
                    if spent > PREFETCH_TOTAL {
                        break;
                    }
                    let (tx, rx) = std::sync::mpsc::sync_channel(1);
                    prefetched.lock().unwrap_or_else(|p| p.into_inner()).insert(info.path.clone(), rx);
                    senders.borrow_mut().insert(info.path.clone(), tx);
                    chosen.push(info.path.clone());
                }
                chosen
            };
            let mut take = |path: StorePath, nar: Vec<u8>| {
                if let Some(tx) = senders.borrow_mut().remove(&path) {
                    let _ = tx.send(Ok(nar));
                }
            };
            let mut answer_closure = Some(answer_closure);
            let fetched = conn.with(|c| {
                let (found, rest) = c.closure_fetching(&roots, &mut choose, &mut take)?;
                levels.borrow_mut().take();
                if let Some(answer) = answer_closure.take() {
                    let _ = answer.send(Ok(found));
                }
                c.fetch_rest(rest, &mut take)
            });
            if let Err(e) = fetched {
                let message = e.to_string();
                senders.into_inner().into_values().for_each(|tx| drop(tx.send(Err(message.clone()))));
                if let Some(answer) = answer_closure {
                    let _ = answer.send(Err(e));
                }
            }
        }));
        Box::pin(async move {
            self.jobs.send(job).map_err(|_| self.ended())?;
            let found = closure.await.map_err(|_| self.ended())??;
            self.whole(found)
        })
    }

    /// The closure as [`closure_infos_fetching`](Self::closure_infos_fetching) finds it (in one
    /// round trip from a daemon that offers sluice's QueryClosureInfos, else one per level of
    /// references), with no NARs.
    fn closure_infos<'a>(&'a self, roots: &'a [StorePath]) -> StoreFuture<'a, BTreeMap<StorePath, ValidPathInfo>> {
        let roots = roots.to_vec();
        Box::pin(async move {
            let found = self.run(move |c| Ok(c.closure_fetching(&roots, &mut |_| Vec::new(), &mut |_, _| {})?.0)).await?;
            self.whole(found)
        })
    }

    /// NarFromPath answers come in the order asked, on one connection.
    fn streams_nars_in_order(&self) -> bool {
        true
    }

    fn add_to_store<'a>(&'a self, info: ValidPathInfo, nar: NarReader, mut publish: PublishGate) -> StoreFuture<'a, ()> {
        use futures::FutureExt;
        Box::pin(async move {
            let nar = match (&mut publish).now_or_never() {
                Some(gate) => gate.map(|()| nar)?,
                None => {
                    let spooled = spool(&self.url, nar).await?;
                    publish.await?;
                    spooled
                }
            };
            let (done, answer) = tokio::sync::oneshot::channel();
            self.jobs.send(Job::Add(batch::Addition { info, nar, done })).map_err(|_| self.ended())?;
            answer.await.map_err(|_| self.ended())?
        })
    }

    /// Always: one AddMultipleToStore (one AddToStoreNar per path, in turn, before 1.32).
    fn takes_streams(&self) -> bool {
        true
    }

    fn add_stream<'a>(&'a self, count: usize, additions: AdditionStream) -> StoreFuture<'a, StreamOutcomes> {
        let check_sigs = self.check_sigs;
        Box::pin(async move {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let job = Job::Run(Box::new(move |conn| drop(tx.send(batch::add_stream(conn, count, additions, check_sigs)))));
            self.jobs.send(job).map_err(|_| self.ended())?;
            rx.await.map_err(|_| self.ended())?
        })
    }

    /// One NAR at a time when each path is its own AddToStoreNar; with AddMultipleToStore,
    /// [`ADDITIONS_AT_ONCE`], so that additions queue up for one operation.
    fn parallelism(&self) -> usize {
        match self.version.at_least(batch::MULTIPLE_VERSION) {
            true => ADDITIONS_AT_ONCE,
            false => 1,
        }
    }
}

/// Reads `nar` to its end into an unlinked temporary file; the file, from its start.
async fn spool(url: &str, mut nar: NarReader) -> Result<NarReader, StoreError> {
    let err = |e: std::io::Error| StoreError::Other(format!("{url}: spooling a NAR to a temporary file: {e}"));
    let spooled = tokio::task::spawn_blocking(move || {
        let mut file = tempfile::tempfile()?;
        std::io::copy(&mut nar, &mut file)?;
        std::io::Seek::rewind(&mut file)?;
        Ok(Box::new(file) as NarReader)
    });
    spooled.await.map_err(|e| err(std::io::Error::other(e)))?.map_err(err)
}

/// A NAR read from a daemon: fetched ahead ([`Store::prefetch_nars`]), or else streamed by
/// a NarFromPath operation queued on the connection's thread at the first read, not before:
/// that thread then streams only NARs whose readers are reading (a NAR opened but not read yet
/// cannot hold up the ones behind it). The thread writes into a pipe; a reader dropped early
/// makes its writes fail, and the rest is read and dropped.
struct DaemonNar {
    url: String,
    jobs: std::sync::mpsc::Sender<Job>,
    path: StorePath,
    nar_size: u64,
    prefetched: Prefetched,
    reader: Option<NarReader>,
}

impl DaemonNar {
    /// The NAR fetched ahead, once it has arrived, if it was asked for.
    fn take_prefetched(&self) -> Option<std::io::Result<NarReader>> {
        let arrival = self.prefetched.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.path)?;
        Some(match arrival.recv() {
            Ok(Ok(nar)) => Ok(Box::new(std::io::Cursor::new(nar)) as NarReader),
            Ok(Err(message)) => Err(std::io::Error::other(message)),
            Err(_) => Err(std::io::Error::other(format!("{}: the daemon connection's thread ended", self.url))),
        })
    }

    /// Starts streaming the NAR through a pipe from the connection's thread.
    fn stream(&self) -> std::io::Result<NarReader> {
        let (path, nar_size, jobs) = (self.path.clone(), self.nar_size, &self.jobs);
        let ended = format!("{}: the daemon connection's thread ended", self.url);
        let piped = PipedNar::start(&self.url, |mut write| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let job = Job::Run(Box::new(move |conn| {
                let read = conn.with(|c| c.nar_from_path(&path, nar_size, &mut write));
                drop(write);
                let _ = tx.send(read);
            }));
            jobs.send(job).map_err(|_| std::io::Error::other(ended.clone()))?;
            Ok(Box::pin(async move {
                match rx.await {
                    // A failed write is the reader's own doing (it stopped reading).
                    Ok(read) => read.map(drop).map_err(std::io::Error::other),
                    Err(_) => Err(std::io::Error::other(ended)),
                }
            }))
        })?;
        Ok(Box::new(piped))
    }
}

impl Read for DaemonNar {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let reader = match &mut self.reader {
            Some(reader) => reader,
            None => {
                let reader = self.take_prefetched().unwrap_or_else(|| self.stream())?;
                self.reader.insert(reader)
            }
        };
        reader.read(buf)
    }
}
