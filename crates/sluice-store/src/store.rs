//! The one interface every kind of store offers (Nix's `Store`, `src/libstore/store-api.hh`),
//! as far as moving paths between stores needs it: path infos in batches, valid paths, a NAR as
//! a stream, adding a path from a NAR stream; and [`open_store`], the one place a store URL
//! becomes a store. Implemented by the local store (`local_handle.rs`), every
//! binary-cache transport ([`sluice_binary_cache::BinaryCache`]: file, HTTP, S3), the
//! daemon client ([`crate::remote::DaemonStore`]), and the `dummy://` and `memory://` stores
//! of `registry/`, where every kind of store is registered.
//!
//! The substitution pipeline ([`crate::substitute`]) stays the fast path from binary caches
//! into a local store; [`crate::push`] moves closures between any two stores through this
//! interface.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::sync::Arc;

use futures::future::BoxFuture;
use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};

use crate::config::Settings;
use crate::remote::RemoteError;
use crate::store_url::{StoreUrl, StoreUrlError};
use sluice_binary_cache::CacheError;
use sluice_local_store::LocalStoreError;

/// A future returned by a [`Store`] method.
pub(crate) type StoreFuture<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// Resolves once a path may become visible in the destination (its references are there), or
/// fails with the reason it may not (a reference failed).
pub type PublishGate = BoxFuture<'static, Result<(), StoreError>>;

/// A NAR being read: uncompressed bytes, to be read on a blocking thread.
pub type NarReader = Box<dyn Read + Send>;

/// One path of a stream of additions ([`Store::add_stream`]): its info and its NAR.
pub struct StreamedPath {
    pub info: ValidPathInfo,
    pub nar: NarReader,
}

/// The paths of a stream of additions, in the order they are to be sent, each as soon as the
/// copy has opened its NAR.
pub type AdditionStream = tokio::sync::mpsc::Receiver<StreamedPath>;

/// The outcome of each path a stream of additions brought, in order.
pub type StreamOutcomes = Vec<(StorePath, Result<(), StoreError>)>;

/// Infos of a closure being found ([`Store::closure_infos_fetching`]), and where to answer
/// which of their NARs to fetch ahead, in the order they will be read.
pub struct FoundLevel {
    pub infos: Vec<ValidPathInfo>,
    pub fetch: tokio::sync::oneshot::Sender<Vec<StorePath>>,
}

/// Errors of any store; each names the store (URL, socket or directory) and the path.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Url(#[from] StoreUrlError),
    #[error(transparent)]
    Local(#[from] LocalStoreError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Daemon(#[from] RemoteError),
    /// The store cannot do this.
    #[error("{url}: {what} is not supported by this store")]
    Unsupported { url: String, what: &'static str },
    /// A path is not valid in the store it was asked of.
    #[error("{path} is not valid in {url}")]
    NotValid { url: String, path: String },
    /// A path was not added because a path it refers to failed.
    #[error("{path} not added: its reference {reference} failed")]
    ReferenceFailed { path: String, reference: String },
    /// A daemon refused another path of the AddMultipleToStore this path was sent in, and
    /// stopped before this one: it was not looked at, and may be sent again
    /// ([`crate::push::copy_closures`] does).
    #[error("not added: the daemon refused {refused}, sent before it in the same AddMultipleToStore")]
    NotAttempted { refused: String },
    /// Something else, with its context (a key file, a settings problem).
    #[error("{0}")]
    Other(String),
}

/// A Nix store, shareable between tasks.
pub trait Store: Send + Sync {
    /// The store's URL, as given (for messages).
    fn url(&self) -> &str;

    /// The logical store directory (`/nix/store`).
    fn store_dir(&self) -> &StoreDir;

    /// The info of each of `paths` (`None` where not valid), in order, asked all at once (Nix's
    /// `queryPathInfo`); a binary cache's answers carry the file its NAR is in.
    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>>;

    /// Those of `paths` that are valid (Nix's `queryValidPaths`).
    fn query_valid_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, BTreeSet<StorePath>> {
        Box::pin(async move {
            let infos = self.query_path_infos(paths).await?;
            Ok(paths.iter().zip(infos).filter(|(_, i)| i.is_some()).map(|(p, _)| p.clone()).collect())
        })
    }

    /// The closure of `roots` under references, every path's info (Nix's `computeFSClosure`);
    /// a path of it that is not valid is [`StoreError::NotValid`]. By default one batched
    /// [`query_path_infos`](Self::query_path_infos) per level of references.
    fn closure_infos<'a>(&'a self, roots: &'a [StorePath]) -> StoreFuture<'a, BTreeMap<StorePath, ValidPathInfo>> {
        Box::pin(crate::push::closure_infos_by_level(self, roots))
    }

    /// [`closure_infos`](Self::closure_infos), with NARs fetched ahead (as
    /// [`prefetch_nars`](Self::prefetch_nars) fetches them) while the closure is found, where
    /// Nix's `copyPaths` (`src/libstore/store-api.cc`) finds the whole closure first: each
    /// set of infos found is sent on `levels` with where to answer which of their NARs the copy
    /// will read, in the order it will read them. By default the whole closure is found, sent
    /// at once, and the NARs named are prefetched; a daemon sends each level of references as
    /// it finds it, and asks for the NARs named right behind the next level's queries
    /// (`remote/closure.rs`), so that they stream while the next level is looked for.
    fn closure_infos_fetching<'a>(
        &'a self,
        roots: &'a [StorePath],
        levels: tokio::sync::mpsc::UnboundedSender<FoundLevel>,
    ) -> StoreFuture<'a, BTreeMap<StorePath, ValidPathInfo>> {
        Box::pin(async move {
            let infos = self.closure_infos(roots).await?;
            let (fetch, answer) = tokio::sync::oneshot::channel();
            if levels.send(FoundLevel { infos: infos.values().cloned().collect(), fetch }).is_ok() {
                if let Ok(named) = answer.await {
                    self.prefetch_nars(&named.iter().filter_map(|p| infos.get(p)).collect::<Vec<_>>());
                }
            }
            Ok(infos)
        })
    }

    /// Those of `paths` whose contents are there as well as their metadata: what a copy into
    /// this store skips. [`Store::query_valid_paths`], but for a binary cache, where a narinfo
    /// can outlive its NAR (a push killed or failed, a NAR deleted or cut short) and only a NAR
    /// of the narinfo's `FileSize` counts (Nix's `copyPaths` skips what `queryValidPaths`
    /// answers, `src/libstore/store-api.cc`).
    fn query_complete_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, BTreeSet<StorePath>> {
        self.query_valid_paths(paths)
    }

    /// [`query_complete_paths`](Self::query_complete_paths) for a copy into this store that
    /// is about to begin, and a token for [`end_push`](Self::end_push): a binary cache that a
    /// collection may be deleting from keeps the two apart (`sluice_binary_cache::fence`), so
    /// that none of the paths answered goes while the copy publishes paths referring to them.
    fn begin_push<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, (BTreeSet<StorePath>, Option<String>)> {
        Box::pin(async move { Ok((self.query_complete_paths(paths).await?, None)) })
    }

    /// Ends the copy [`begin_push`](Self::begin_push) began, once its last path was added.
    fn end_push<'a>(&'a self, token: String) -> StoreFuture<'a, ()> {
        let _ = token;
        Box::pin(async move { Ok(()) })
    }

    /// The valid path whose hash part is `hash_part` (32 nixbase32 characters; Nix's
    /// `queryPathFromHashPart`), `None` when there is none or `hash_part` is malformed.
    fn query_path_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<StorePath>> {
        let _ = hash_part;
        Box::pin(async move { Err(StoreError::Unsupported { url: self.url().to_string(), what: "looking up a path by its hash part" }) })
    }

    /// The info of the valid path whose hash part is `hash_part`, `None` when there is none or
    /// `hash_part` is malformed: [`query_path_from_hash_part`](Self::query_path_from_hash_part)
    /// then its info, which a store may answer at once.
    fn query_path_info_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<ValidPathInfo>> {
        Box::pin(async move {
            let Some(path) = self.query_path_from_hash_part(hash_part).await? else { return Ok(None) };
            Ok(self.query_path_infos(std::slice::from_ref(&path)).await?.pop().flatten().map(|p| p.info))
        })
    }

    /// Every valid path (Nix's `queryAllValidPaths`, which binary caches and daemons other
    /// than a local store's do not answer here).
    fn query_all_valid_paths(&self) -> StoreFuture<'_, BTreeSet<StorePath>> {
        Box::pin(async move { Err(StoreError::Unsupported { url: self.url().to_string(), what: "listing every valid path" }) })
    }

    /// The build log of the derivation `drv` (Nix's `getBuildLog`), uncompressed, as a stream;
    /// `None` when the store keeps none for it.
    fn build_log<'a>(&'a self, drv: &'a StorePath) -> StoreFuture<'a, Option<NarReader>> {
        let _ = drv;
        Box::pin(async move { Ok(None) })
    }

    /// The NAR of the valid path `info.path` (Nix's `narFromPath`), uncompressed, as a stream.
    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader>;

    /// Writes the NAR of the valid path `info.path` into `sink` on a blocking thread, in the
    /// writes the store makes it with (a local store dumps its tree straight into `sink`, with
    /// no pipe between); resolves once it is all written. A failed write of `sink` ends the
    /// dump with that error.
    fn dump_nar<'a>(&'a self, info: &'a ValidPathInfo, mut sink: Box<dyn Write + Send>) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut nar = self.nar_from_path(info).await?;
            let shown = self.store_dir().display_path(&info.path);
            let copied = tokio::task::spawn_blocking(move || std::io::copy(&mut nar, &mut sink)).await;
            let copied = copied.map_err(|e| StoreError::Other(format!("{}: {shown}: {e}", self.url())))?;
            copied.map(drop).map_err(|e| StoreError::Other(format!("{}: writing the NAR of {shown}: {e}", self.url())))
        })
    }

    /// A hint that the NARs of `infos` are about to be read, in this order: a store that can
    /// fetch them ahead of their readers does (a daemon, with NarFromPath pipelined;
    /// `ssh://`, with DumpStorePath pipelined), those [`fetched_ahead`] picks.
    fn prefetch_nars(&self, infos: &[&ValidPathInfo]) {
        let _ = infos;
    }

    /// Whether the NARs [`prefetch_nars`](Self::prefetch_nars) is told of come back to back on
    /// one channel, in the order told (a daemon, `ssh://`): a copy from such a store reads
    /// them in a dependency order, so that each path can be registered as soon as it has
    /// arrived instead of after the NARs asked before it.
    fn streams_nars_in_order(&self) -> bool {
        false
    }

    /// Whether `info` may be added as far as its claims go (a trusted signature, or a content
    /// address, where the store requires one): asked before its NAR is transferred, so that
    /// a path that would be refused is not downloaded first (NixOS/nix#13339). By default every
    /// one is; [`add_to_store`](Self::add_to_store) checks again whatever this said.
    fn check_trust(&self, info: &ValidPathInfo) -> Result<(), StoreError> {
        let _ = info;
        Ok(())
    }

    /// Adds `info.path` from its NAR (Nix's `addToStore(info, source)`), checking the NAR
    /// against `info`. Everything that makes the path visible to readers (a narinfo, a
    /// registration) waits for `publish`, and does not happen if it fails; work that does not
    /// (unpacking, compressing, uploading the NAR) may go ahead. A local store registers a path
    /// as soon as each of its references is registered or queued for registration before it
    /// (`local_handle.rs`), which is what the gate guards, sooner.
    fn add_to_store<'a>(&'a self, info: ValidPathInfo, nar: NarReader, publish: PublishGate) -> StoreFuture<'a, ()>;

    /// NAR transfers worth running at once against this store.
    fn parallelism(&self) -> usize;

    /// Whether the store takes a whole copy as one stream ([`add_stream`](Self::add_stream)).
    fn takes_streams(&self) -> bool {
        false
    }

    /// Adds the `count` paths `additions` brings, in a dependency order (each after its
    /// references among them), as one stream the store makes each path valid from in turn
    /// (a daemon's AddMultipleToStore, Nix's `copyPaths`; the serve protocol's pipelined
    /// imports): no path waits for another's answer. One outcome per path received, in order;
    /// after a path the store refused, [`StoreError::NotAttempted`] for those it did not look
    /// at (to be sent again). Only for a store that [`takes_streams`](Self::takes_streams).
    fn add_stream<'a>(&'a self, count: usize, additions: AdditionStream) -> StoreFuture<'a, StreamOutcomes> {
        let _ = (count, additions);
        Box::pin(async move { Err(StoreError::Unsupported { url: self.url().to_string(), what: "adding paths as one stream" }) })
    }
}

/// Opens the store `url` with `settings` (Nix's `openStore`), as the kind of store that
/// claims the URL opens it (`registry/`).
pub async fn open_store(url: &str, settings: &Settings) -> Result<Arc<dyn Store>, StoreError> {
    StoreUrl::parse(url)?.open(settings).await
}

/// The read end of a pipe another thread writes a NAR into (a daemon's NarFromPath; a local
/// store's NAR is dumped by its reader instead, `local/dump.rs`). At its end, the writer's own failure (if any) is the read's error, so that a
/// cut-short NAR is reported as why it was. The read end is read [`PIPE_CHUNK`] bytes at a
/// time whatever its reader asks for: a NAR parser asks for each 8-byte token apart, which
/// was one `read` system call per token (260k for the 1056-path corpus pushed into a cache).
pub(crate) struct PipedNar {
    pipe: std::io::BufReader<std::fs::File>,
    finished: Option<NarWritten>,
}

/// How the writer of a [`PipedNar`] ended; resolves once it has.
pub(crate) type NarWritten = BoxFuture<'static, std::io::Result<()>>;

/// Bytes moved through a [`PipedNar`]'s pipe per system call: Linux's default pipe capacity.
pub(crate) const PIPE_CHUNK: usize = 64 << 10;

impl PipedNar {
    /// A pipe for a NAR of `url`'s: `start` is given its write end, starts the writer and
    /// returns how it will end; the reader of the read end.
    pub fn start(url: &str, start: impl FnOnce(std::fs::File) -> std::io::Result<NarWritten>) -> std::io::Result<PipedNar> {
        let (read, write) = rustix::pipe::pipe().map_err(|e| std::io::Error::other(format!("{url}: creating a pipe: {e}")))?;
        let finished = start(std::fs::File::from(write))?;
        Ok(PipedNar { pipe: std::io::BufReader::with_capacity(PIPE_CHUNK, std::fs::File::from(read)), finished: Some(finished) })
    }
}

impl Read for PipedNar {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.pipe.read(buf)?;
        if n == 0 && !buf.is_empty() {
            if let Some(finished) = self.finished.take() {
                futures::executor::block_on(finished)?;
            }
        }
        Ok(n)
    }
}

/// Largest NAR a store fetches ahead of its reader ([`Store::prefetch_nars`]); larger ones are
/// streamed when read.
pub(crate) const PREFETCH_NAR_MAX: u64 = 4 << 20;

/// Most bytes of NAR a store fetches ahead of their readers for one copy.
pub(crate) const PREFETCH_TOTAL: u64 = 512 << 20;

/// Those of `infos` whose NARs [`Store::prefetch_nars`] fetches ahead, in their order: up to
/// [`PREFETCH_NAR_MAX`] each, until [`PREFETCH_TOTAL`] in all.
pub(crate) fn fetched_ahead<'a>(infos: &[&'a ValidPathInfo]) -> Vec<&'a ValidPathInfo> {
    let mut total = 0;
    let small = infos.iter().copied().filter(|i| i.nar_size <= PREFETCH_NAR_MAX);
    small
        .take_while(|i| {
            total += i.nar_size;
            total <= PREFETCH_TOTAL
        })
        .collect()
}
