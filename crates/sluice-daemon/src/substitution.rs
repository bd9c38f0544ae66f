//! Substitution for the daemon's operations, on the closure engine and the substitution
//! pipeline of `sluice-store`, run on the daemon's shared runtime from a worker thread. The
//! substituters are the connection's settings (the daemon's, with a trusted client's
//! overrides), opened once per distinct set of such settings in a [`Session`] that every
//! client and operation shares for the daemon's lifetime.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::narinfo_cache::NarInfoCache;
use sluice_local_store::{LocalStore, TempRoots};
use sluice_nix::store_path::StorePath;
use sluice_store::closure::{self, ClosureEvent, ClosureQuery, ContentAddresses};
use sluice_store::config::Settings;
use sluice_store::failure::Failure;
use sluice_store::substitute::{copy_closure, repair_paths, CopyReport, Observer, SubstituteOptions};
use sluice_store::substituters;
use tokio::sync::{mpsc, OnceCell};

use crate::Daemon;

/// Progress of a substitution, forwarded to the client as activities.
#[derive(Debug)]
pub(crate) enum Progress {
    /// A path will be substituted: its compressed and NAR sizes (0 if unknown).
    Queued {
        path: StorePath,
        download: u64,
        nar: u64,
    },
    /// Its NAR started to arrive from the cache at URL `cache` (again on a further attempt).
    Started {
        path: StorePath,
        cache: String,
    },
    /// Its NAR is downloaded from `url` (an HTTP cache's).
    Fetching {
        path: StorePath,
        url: String,
    },
    /// How far its NAR got: compressed bytes downloaded and NAR bytes unpacked.
    Bytes {
        path: StorePath,
        downloaded: u64,
        unpacked: u64,
    },
    Done(StorePath),
    Failed(StorePath),
}

struct Forward(mpsc::UnboundedSender<Progress>);

impl Observer for Forward {
    fn queued(&self, path: &StorePath, download: u64, nar: u64) {
        let _ = self.0.send(Progress::Queued { path: path.clone(), download, nar });
    }
    fn started(&self, path: &StorePath, cache: &str) {
        let _ = self.0.send(Progress::Started { path: path.clone(), cache: cache.to_owned() });
    }
    fn fetching(&self, path: &StorePath, url: &str) {
        let _ = self.0.send(Progress::Fetching { path: path.clone(), url: url.to_owned() });
    }
    fn progress(&self, path: &StorePath, downloaded: u64, unpacked: u64) {
        let _ = self.0.send(Progress::Bytes { path: path.clone(), downloaded, unpacked });
    }
    fn done(&self, path: &StorePath, _: u64) {
        let _ = self.0.send(Progress::Done(path.clone()));
    }
    fn failed(&self, path: &StorePath, _: &Failure) {
        let _ = self.0.send(Progress::Failed(path.clone()));
    }
}

/// Paths to look up or substitute, with the content addresses known of some (the fixed outputs
/// of derivations being realised), for the substituters of another store directory
/// ([`ClosureQuery::content_addresses`]).
#[derive(Debug, Default)]
pub(crate) struct Wanted {
    pub paths: Vec<StorePath>,
    pub content_addresses: ContentAddresses,
}

impl From<Vec<StorePath>> for Wanted {
    fn from(paths: Vec<StorePath>) -> Self {
        Wanted { paths, content_addresses: ContentAddresses::new() }
    }
}

/// Most sessions kept at once: each distinct set of substituter settings (a trusted client's
/// SetOptions may choose its own) gets one; beyond this, the least recently used is dropped.
const MAX_SESSIONS: usize = 8;

/// The settings a [`Session`] is opened with: the substituters (none when a client turns
/// `use-substitutes` off) and everything the HTTP client, the caches and the disk cache
/// read when they are opened.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SessionKey {
    urls: Vec<String>,
    http_connections: usize,
    connect_timeout: u64,
    stalled_download_timeout: u64,
    download_attempts: u64,
    narinfo_cache_ttls: (u64, u64),
    netrc_file: PathBuf,
    ssl_cert_file: Option<PathBuf>,
}

impl SessionKey {
    fn new(settings: &Settings, use_substitutes: bool) -> Self {
        SessionKey {
            urls: if use_substitutes { settings.substituters.clone() } else { Vec::new() },
            http_connections: settings.http_connections,
            connect_timeout: settings.connect_timeout,
            stalled_download_timeout: settings.stalled_download_timeout,
            download_attempts: settings.download_attempts,
            narinfo_cache_ttls: (settings.narinfo_cache_positive_ttl, settings.narinfo_cache_negative_ttl),
            netrc_file: settings.netrc_file.clone(),
            ssl_cert_file: settings.ssl_cert_file.clone(),
        }
    }
}

/// Open substituters shared by every operation that uses the same settings: one HTTP client
/// (its pooled connections), each cache's `nix-cache-info`, and the narinfo disk cache
/// handle. Nix's `nix-daemon` opens its substituters once per forked worker
/// (`getDefaultSubstituters`, `src/libstore/store-api.cc`); sluice's workers are threads of
/// one process, so one opening serves them all.
pub(crate) struct Session {
    substituters: Arc<Vec<closure::Substituter>>,
    disk: Option<Arc<NarInfoCache>>,
    /// Caches left out when it was opened (unreachable, another store directory).
    left_out: usize,
}

impl Session {
    /// Opens the substituters of `settings` (none when `use_substitutes` is off). Caches that
    /// cannot be used are logged and left out, as Nix does.
    /// The daemon's own store (`state_dir`) given as a substituter is left out
    /// ([`substituters::other_than`]).
    async fn open(settings: &Settings, use_substitutes: bool, state_dir: &std::path::Path) -> Result<Session, String> {
        let urls = if use_substitutes { substituters::other_than(&settings.substituters, state_dir) } else { Vec::new() };
        let urls = &urls[..];
        let client = LazyClient::new(settings.http_options());
        let disk = substituters::open_disk_cache(settings);
        let (subs, errors) = substituters::open(urls, settings, &client, disk.as_deref()).await;
        for e in &errors {
            tracing::warn!("substituter left out: {e}");
        }
        Ok(Session { substituters: Arc::new(subs), disk, left_out: errors.len() })
    }

    /// Whether the session should be opened again rather than reused: a cache was left out
    /// or given up on since (it may be reachable again).
    fn degraded(&self) -> bool {
        self.left_out > 0 || self.substituters.iter().any(|s| s.source.is_disabled())
    }
}

/// A kept session: empty while it is being opened.
type Slot = Arc<OnceCell<Arc<Session>>>;

/// The daemon's [`Session`]s, each opened on first use by the settings it is for.
#[derive(Default)]
pub(crate) struct Sessions {
    /// Most recently used last.
    kept: Mutex<Vec<(SessionKey, Slot)>>,
}

impl Sessions {
    /// The session for `settings`, opened now if there is none yet (concurrent callers with
    /// the same settings wait for the one opening). A degraded session is replaced.
    async fn get(&self, settings: &Settings, use_substitutes: bool, state_dir: &std::path::Path) -> Result<Arc<Session>, String> {
        let key = SessionKey::new(settings, use_substitutes);
        let cell = {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            let found = kept.iter().position(|(k, _)| *k == key);
            let reusable = found.map(|i| kept.remove(i)).filter(|(_, cell)| !cell.get().is_some_and(|s| s.degraded()));
            let entry = reusable.unwrap_or_else(|| (key, Arc::new(OnceCell::new())));
            let cell = Arc::clone(&entry.1);
            kept.push(entry);
            if kept.len() > MAX_SESSIONS {
                kept.remove(0);
            }
            cell
        };
        let session = cell.get_or_try_init(|| async { Session::open(settings, use_substitutes, state_dir).await.map(Arc::new) }).await?;
        Ok(Arc::clone(session))
    }
}

/// The closure engine on the daemon's session for `settings`. Paths whose validity is looked
/// up are made temporary roots in `roots` first, if given (for a substitution).
async fn closure_query(
    daemon: &Daemon,
    store: &Arc<LocalStore>,
    settings: &Settings,
    use_substitutes: bool,
    roots: Option<TempRoots>,
    content_addresses: ContentAddresses,
) -> Result<ClosureQuery, String> {
    let session = daemon.sessions.get(settings, use_substitutes, store.state_dir()).await?;
    let is_valid = closure::validity_in(Some(Arc::clone(store)), roots);
    Ok(ClosureQuery {
        substituters: Arc::clone(&session.substituters),
        disk_cache: session.disk.clone(),
        store_dir: store.store_dir().clone(),
        is_valid,
        accept: None,
        content_addresses: Arc::new(content_addresses),
    })
}

/// What the substituters know about the closures of `roots` (paths valid in `store` are not
/// followed).
pub(crate) fn query(
    daemon: &Daemon,
    store: &Arc<LocalStore>,
    settings: &Settings,
    use_substitutes: bool,
    roots: Wanted,
) -> Result<Vec<ClosureEvent>, String> {
    daemon.runtime.block_on(async {
        let query = closure_query(daemon, store, settings, use_substitutes, None, roots.content_addresses).await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let engine = tokio::spawn(async move { query.run(roots.paths, tx).await });
        let mut events = Vec::new();
        while let Some(e) = rx.recv().await {
            events.push(e);
        }
        engine.await.map_err(|e| format!("closure query: {e}"))?;
        Ok(events)
    })
}

/// The realisations (JSON) the substituters have for the derivation outputs `ids`, each
/// from the first substituter by priority that has one, as Nix's `DrvOutputSubstitutionGoal`
/// asks them (`build/drv-output-substitution-goal.cc`): a cache's failure is logged and the
/// next one asked. Caches of another store directory than `store`'s are not asked (their
/// output paths are not the store's).
pub(crate) fn realisations(
    daemon: &Daemon,
    store: &LocalStore,
    settings: &Settings,
    use_substitutes: bool,
    ids: &[String],
) -> Result<Vec<Option<String>>, String> {
    daemon.runtime.block_on(async {
        let session = daemon.sessions.get(settings, use_substitutes, store.state_dir()).await?;
        let subs: Vec<&closure::Substituter> = session.substituters.iter().filter(|s| s.source.store_dir() == store.store_dir()).collect();
        let mut found = Vec::new();
        for id in ids {
            let mut json = None;
            for sub in &subs {
                match sub.source.realisation(id).await {
                    Ok(Some(text)) => {
                        json = Some(text);
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!("{e}"),
                }
            }
            found.push(json);
        }
        Ok(found)
    })
}

/// Substitutes the closures of `wanted`'s paths into `store`, calling `progress` on the worker
/// thread as paths start and finish. Every path of the closures is a temporary root in
/// `roots` (the connection's, of `store`) from before its validity is looked at.
pub(crate) fn copy(
    daemon: &Daemon,
    store: &Arc<LocalStore>,
    settings: &Settings,
    use_substitutes: bool,
    roots: &TempRoots,
    wanted: Wanted,
    progress: impl FnMut(Progress),
) -> Result<CopyReport, String> {
    pipeline(daemon, store, settings, use_substitutes, roots, wanted, false, progress)
}

/// Substitutes the damaged valid path `path` again (Nix's `repairPath`; see
/// [`sluice_store::substitute::repair_paths`]); the error says why it could not be.
pub(crate) fn repair(
    daemon: &Daemon,
    store: &Arc<LocalStore>,
    settings: &Settings,
    use_substitutes: bool,
    roots: &TempRoots,
    path: &StorePath,
) -> Result<(), String> {
    let report = pipeline(daemon, store, settings, use_substitutes, roots, vec![path.clone()].into(), true, |_| {})?;
    match report.failed.get(path) {
        Some(why) => Err(why.message.clone()),
        None if report.substituted.contains(path) => Ok(()),
        None => Err("no substituter has it".into()),
    }
}

/// [`copy`], or with `repair` a repair of the valid `paths`.
#[allow(clippy::too_many_arguments)] // copy's and repair's arguments, and which of the two
fn pipeline(
    daemon: &Daemon,
    store: &Arc<LocalStore>,
    settings: &Settings,
    use_substitutes: bool,
    roots: &TempRoots,
    Wanted { paths, content_addresses }: Wanted,
    repair: bool,
    mut progress: impl FnMut(Progress),
) -> Result<CopyReport, String> {
    let policy = settings.signature_policy(daemon.store_require_sigs).map_err(|e| e.to_string())?;
    let opts = SubstituteOptions { jobs: settings.max_substitution_jobs.unwrap_or(sluice_store::substitute::DEFAULT_JOBS), policy };
    daemon.runtime.block_on(async {
        let query = closure_query(daemon, store, settings, use_substitutes, Some(roots.clone()), content_addresses).await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let store = Arc::clone(store);
        let observer = Arc::new(Forward(tx));
        let task = match repair {
            true => tokio::spawn(repair_paths(query, store, roots.clone(), paths, opts, observer)),
            false => tokio::spawn(copy_closure(query, store, roots.clone(), paths, opts, observer)),
        };
        while let Some(p) = rx.recv().await {
            progress(p);
        }
        task.await.map_err(|e| format!("substitution: {e}"))
    })
}
