//! Where a substituter's paths come from ([`Source`]): a binary cache, read as
//! sluice-binary-cache reads one, or any other store whose kind can be a substituter (the
//! registry's `StoreConfig::as_substituter`), read through the [`Store`] interface. Nix opens
//! every substituter as a store (`getDefaultSubstituters`, `src/libstore/store-api.cc`) and
//! asks it `queryPathInfo`, then `narFromPath` (`build/substitution-goal.cc`); here such a
//! store ([`StoreSource`]) answers the closure engine and the substitution pipeline in a
//! binary cache's terms: its path infos as narinfos of uncompressed NARs with no `FileSize`
//! (Nix counts no download size for a substituter that is not a binary cache), its NARs as
//! streams. Its narinfos are not kept in the disk cache, as Nix keeps only binary caches'.
//!
//! A store is opened on the first path asked of it, once for the run (one connection), and
//! the paths asked meanwhile go to it together, in one batched query (one round trip per
//! level of a closure, not per path). A store that cannot be opened or whose query fails is
//! given up for the rest of the run with one warning, as a failing binary cache is.

use std::sync::{Arc, OnceLock};

use sluice_binary_cache::{BinaryCache, CacheError, NarStream, TransferProbe};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};
use tokio::sync::{mpsc, oneshot, OnceCell};

use crate::config::Settings;
use crate::store::Store;
use crate::store_url::{CommonParams, StoreUrl};

/// Lookups a [`StoreSource`] has in flight at once (they go in batches of up to as many).
const STORE_LOOKUPS: usize = 256;

/// Where a substituter's paths come from.
#[derive(Debug)]
pub enum Source {
    /// A binary cache: its narinfos and NAR files.
    Cache(BinaryCache),
    /// Any other store that can be a substituter.
    Store(StoreSource),
}

impl Source {
    /// The binary cache, for what only a cache offers (its `nix-cache-info`, its batch
    /// endpoint).
    pub fn as_cache(&self) -> Option<&BinaryCache> {
        match self {
            Source::Cache(cache) => Some(cache),
            Source::Store(_) => None,
        }
    }

    /// The URL, as given (a cache's without trailing slash).
    pub fn url(&self) -> &str {
        match self {
            Source::Cache(cache) => cache.url(),
            Source::Store(store) => &store.url,
        }
    }

    /// The store directory its paths are in.
    pub fn store_dir(&self) -> &StoreDir {
        match self {
            Source::Cache(cache) => cache.store_dir(),
            Source::Store(store) => &store.store_dir,
        }
    }

    /// Its priority (lower is preferred): a cache's `nix-cache-info`'s or `?priority=`; a
    /// store's `?priority=`, else 0 (Nix's `StoreConfig::priority`, `store-api.hh`).
    pub fn priority(&self) -> i32 {
        match self {
            Source::Cache(cache) => cache.info().priority,
            Source::Store(store) => store.priority,
        }
    }

    /// Lookups worth having in flight at once.
    pub fn capacity(&self) -> usize {
        match self {
            Source::Cache(cache) => cache.capacity(),
            Source::Store(_) => STORE_LOOKUPS,
        }
    }

    /// Whether it was given up on for the rest of this run.
    pub fn is_disabled(&self) -> bool {
        match self {
            Source::Cache(cache) => cache.is_disabled(),
            Source::Store(store) => store.disabled.get().is_some(),
        }
    }

    /// Where the info of `path` comes from, for messages: a cache's narinfo URL; a store's
    /// URL and the path.
    pub fn narinfo_url(&self, path: &StorePath) -> String {
        match self {
            Source::Cache(cache) => cache.narinfo_url(path),
            Source::Store(store) => store.narinfo_url_of(path),
        }
    }

    /// Where the NAR of `narinfo` comes from, for messages.
    pub fn nar_url(&self, narinfo: &NarInfo) -> String {
        match self {
            Source::Cache(cache) => cache.nar_url(narinfo),
            Source::Store(_) => self.narinfo_url(&narinfo.store_path),
        }
    }

    /// The narinfo text of `path`; `None` when it does not have it.
    pub async fn narinfo_text(&self, path: &StorePath) -> Result<Option<String>, CacheError> {
        match self {
            Source::Cache(cache) => cache.narinfo_text(path).await,
            Source::Store(store) => store.narinfo_text(path).await,
        }
    }

    /// Parses narinfo text it answered for `path`, checking that it describes `path`.
    pub fn parse_narinfo(&self, path: &StorePath, store_dir: &StoreDir, text: &str) -> Result<NarInfo, CacheError> {
        match self {
            Source::Cache(cache) => cache.parse_narinfo(path, store_dir, text),
            Source::Store(_) => {
                let url = || self.narinfo_url(path);
                let info = NarInfo::parse(store_dir, text).map_err(|source| CacheError::NarInfo { url: url(), source })?;
                match info.store_path == *path {
                    true => Ok(info),
                    false => Err(CacheError::WrongStorePath {
                        url: url(),
                        expected: store_dir.display_path(path),
                        got: store_dir.display_path(&info.store_path),
                    }),
                }
            }
        }
    }

    /// Opens the NAR of `narinfo` (a cache's compressed as its narinfo says; a store's
    /// uncompressed); `None` when a cache's file is gone.
    pub async fn open_nar(&self, narinfo: &NarInfo) -> Result<Option<NarStream>, CacheError> {
        match self {
            Source::Cache(cache) => cache.open_nar(narinfo).await,
            Source::Store(store) => store.open_nar(narinfo).await.map(Some),
        }
    }

    /// The attempts a NAR download gets: a cache's `download-attempts`; 1 from a store, whose
    /// connection reconnects by itself.
    pub fn download_attempts(&self) -> u32 {
        match self {
            Source::Cache(cache) => cache.download_attempts(),
            Source::Store(_) => 1,
        }
    }

    /// The wait before attempt `attempt + 1` of a download.
    pub fn backoff(&self, attempt: u32) -> std::time::Duration {
        match self {
            Source::Cache(cache) => cache.backoff(attempt),
            Source::Store(_) => std::time::Duration::ZERO,
        }
    }

    /// The realisation (JSON) of the derivation output `id`, if it has one; a store is not
    /// asked (sluice's store clients do not query realisations).
    pub async fn realisation(&self, id: &str) -> Result<Option<String>, CacheError> {
        match self {
            Source::Cache(cache) => cache.realisation(id).await,
            Source::Store(_) => Ok(None),
        }
    }
}

/// A store other than a binary cache used as a substituter, opened on the first path asked of
/// it (see the module documentation).
pub struct StoreSource {
    url: String,
    parsed: StoreUrl,
    settings: Settings,
    store_dir: StoreDir,
    priority: i32,
    opened: OnceCell<Result<Opened, String>>,
    /// Why it was given up on, once it was.
    disabled: OnceLock<String>,
}

impl std::fmt::Debug for StoreSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreSource").field("url", &self.url).field("disabled", &self.disabled.get()).finish_non_exhaustive()
    }
}

/// An opened store, and the senders of the lookups and NARs its batching tasks send it.
struct Opened {
    store: Arc<dyn Store>,
    lookups: mpsc::UnboundedSender<Lookup>,
    nars: mpsc::UnboundedSender<NarOpened>,
}

/// A path asked of a store, and where its info goes.
type Lookup = (StorePath, oneshot::Sender<Result<Option<PathInfo>, String>>);

/// The info of a path whose NAR is being opened, and what is told once its NAR is asked for
/// ahead ([`Store::prefetch_nars`]).
type NarOpened = (ValidPathInfo, oneshot::Sender<()>);

impl StoreSource {
    /// The store `parsed` (whose URL is `url`, with the common parameters `common`), to be
    /// opened with `settings` when a path is first asked of it.
    pub fn new(url: &str, parsed: StoreUrl, common: &CommonParams, settings: &Settings) -> StoreSource {
        StoreSource {
            url: url.to_string(),
            parsed,
            settings: settings.clone(),
            store_dir: common.store_dir.clone(),
            priority: common.priority.unwrap_or(0),
            opened: OnceCell::new(),
            disabled: OnceLock::new(),
        }
    }

    /// Gives the store up for the rest of the run because of `reason`, with one warning (the
    /// first time); the error every use of it fails with from now on.
    fn give_up(&self, reason: String) -> CacheError {
        let mut first = false;
        let reason = self.disabled.get_or_init(|| {
            first = true;
            reason
        });
        if first {
            tracing::warn!("substituter {}: {reason}; not used for the rest of this run", self.url);
        }
        CacheError::Disabled { url: self.url.clone(), reason: reason.clone() }
    }

    /// The opened store, opening it first if it was not; an error if it was given up on.
    async fn opened(&self) -> Result<&Opened, CacheError> {
        if let Some(reason) = self.disabled.get() {
            return Err(CacheError::Disabled { url: self.url.clone(), reason: reason.clone() });
        }
        let opened = self.opened.get_or_init(|| async { self.parsed.open(&self.settings).await.map(start).map_err(|e| e.to_string()) });
        opened.await.as_ref().map_err(|reason| self.give_up(reason.clone()))
    }

    /// The info of `path` as narinfo text, asked in the next batch of lookups.
    async fn narinfo_text(&self, path: &StorePath) -> Result<Option<String>, CacheError> {
        let opened = self.opened().await?;
        let (reply, answer) = oneshot::channel();
        opened.lookups.send((path.clone(), reply)).map_err(|_| self.give_up("its lookups ended".into()))?;
        let info = answer.await.map_err(|_| self.give_up("it did not answer a path it was asked".into()))?;
        let info = info.map_err(|e| self.give_up(e))?;
        Ok(info.map(|i| narinfo_of(&i.info).to_text(&self.store_dir)))
    }

    /// The NAR of `narinfo`'s path, uncompressed, asked for ahead together with those of the
    /// other paths being opened meanwhile (their signatures were checked already: no NAR of a
    /// path that would be refused is fetched).
    async fn open_nar(&self, narinfo: &NarInfo) -> Result<NarStream, CacheError> {
        let opened = self.opened().await?;
        let info = ValidPathInfo::from_narinfo(narinfo, 0);
        let (ready, fetched_ahead) = oneshot::channel();
        if opened.nars.send((info.clone(), ready)).is_ok() {
            // Without the task, the NAR is asked for when it is read.
            let _ = fetched_ahead.await;
        }
        let url = || self.narinfo_url_of(&narinfo.store_path);
        let reader = opened
            .store
            .nar_from_path(&info)
            .await
            .map_err(|e| CacheError::Io { url: url(), source: std::io::Error::other(e.to_string()) })?;
        Ok(NarStream { reader, probe: TransferProbe::default(), local: false, len: None })
    }

    /// Its URL and `path`, naming where the path's info and NAR come from.
    fn narinfo_url_of(&self, path: &StorePath) -> String {
        format!("{} ({})", self.url, self.store_dir.display_path(path))
    }
}

/// `store` with its two tasks: one sends it the lookups asked meanwhile as one query, while
/// the previous one is answered; the other asks for the NARs being opened meanwhile at once
/// ([`Store::prefetch_nars`]: pipelined on one connection, instead of a round trip each).
fn start(store: Arc<dyn Store>) -> Opened {
    let (nars, mut opening) = mpsc::unbounded_channel::<NarOpened>();
    let fetching = store.clone();
    tokio::spawn(async move {
        let mut batch = Vec::new();
        while opening.recv_many(&mut batch, STORE_LOOKUPS).await > 0 {
            fetching.prefetch_nars(&batch.iter().map(|(info, _)| info).collect::<Vec<_>>());
            for (_, ready) in batch.drain(..) {
                let _ = ready.send(());
            }
        }
    });
    let (lookups, mut asked) = mpsc::unbounded_channel::<Lookup>();
    let queried = store.clone();
    tokio::spawn(async move {
        let mut batch = Vec::new();
        while asked.recv_many(&mut batch, STORE_LOOKUPS).await > 0 {
            let (paths, replies): (Vec<StorePath>, Vec<_>) = batch.drain(..).unzip();
            let answers: Vec<Result<Option<PathInfo>, String>> = match queried.query_path_infos(&paths).await {
                Ok(infos) => infos.into_iter().map(Ok).collect(),
                Err(e) => paths.iter().map(|_| Err(e.to_string())).collect(),
            };
            // A reply not sent (an answer missing) ends its lookup with an error.
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        }
    });
    Opened { store, lookups, nars }
}

/// The narinfo a store's `info` stands for: its NAR uncompressed, of unknown file size.
fn narinfo_of(info: &ValidPathInfo) -> NarInfo {
    NarInfo {
        store_path: info.path.clone(),
        url: format!("nar/{}.nar", info.path.hash_part()),
        compression: "none".into(),
        file_hash: None,
        file_size: None,
        nar_hash: info.nar_hash.clone(),
        nar_size: info.nar_size,
        references: info.references.iter().cloned().collect(),
        deriver: info.deriver.clone(),
        signatures: info.sigs.iter().cloned().collect(),
        ca: info.ca.clone(),
        system: None,
    }
}
