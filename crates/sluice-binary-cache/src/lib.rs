//! Binary caches: a cache directory of `nix-cache-info`, `<hash part>.narinfo` files and
//! NARs, reached over a transport (one per file: [`file`](mod@file), [`http`], [`s3`], the
//! last being HTTP with signed requests), with the credentials of `netrc-file` ([`netrc`])
//! and the narinfo disk cache ([`narinfo_cache`]). Layout: Nix
//! `src/libstore/binary-cache-store.cc`; opening, reading and writing paths: [`paths`].
//! sluice-store puts a [`BinaryCache`] behind its `Store` interface and parses the store URLs
//! into [`url`]'s types; this crate knows neither.

mod batch;
pub mod causes;
pub mod client;
mod error;
pub mod fence;
pub mod file;
pub mod http;
mod imds;
mod multipart;
pub mod narinfo_cache;
pub mod netrc;
pub mod objects;
pub mod paths;
mod pool;
pub mod retry;
pub mod s3;
pub mod spool;
mod tls;
pub mod transfer;
pub mod upload;
pub mod url;
mod window;

use std::io::Read;
use std::path::PathBuf;

use sluice_nix::cache_info::CacheInfo;
use sluice_nix::narinfo::NarInfo;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::{StoreDir, StorePath};

pub use batch::BatchLines;
pub use error::CacheError;

/// Concurrent reads from a `file://` cache.
pub(crate) const FILE_CAPACITY: usize = 256;
pub use transfer::TransferProbe;

use crate::url::{CacheKind, CacheUrl, CacheWriteParams};

/// How a cache's files are fetched and written.
#[derive(Debug)]
pub enum Transport {
    File(file::FileTransport),
    /// HTTP(S), and S3 (requests signed; `s3` set).
    Http {
        http: Box<http::HttpTransport>,
        s3: Option<Box<s3::S3>>,
    },
}

/// What is written to a cache file: small contents, or a prepared (compressed) NAR.
pub enum Upload {
    Bytes(bytes::Bytes),
    Nar(upload::PreparedNar),
}

impl Upload {
    /// Bytes to upload.
    pub fn len(&self) -> u64 {
        match self {
            Upload::Bytes(b) => b.len() as u64,
            Upload::Nar(n) => n.file_size,
        }
    }

    /// Whether there is nothing to upload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hex sha256 of the contents.
    pub fn sha256_hex(&self) -> String {
        match self {
            Upload::Bytes(b) => sluice_nix::hash::Hash::digest_bytes(sluice_nix::hash::HashAlgo::Sha256, b).to_base16(),
            Upload::Nar(n) => n.file_hash.to_base16(),
        }
    }

    /// The base64 MD5 of the contents (`Content-MD5`); `None` for a NAR prepared without it
    /// (only S3 uploads ask for it).
    pub(crate) fn md5_base64(&self) -> Option<String> {
        use base64::Engine as _;
        use md5::Digest as _;
        let md5: [u8; 16] = match self {
            Upload::Bytes(b) => md5::Md5::digest(b).into(),
            Upload::Nar(n) => n.md5?,
        };
        Some(base64::engine::general_purpose::STANDARD.encode(md5))
    }

    /// A request body of the contents (a NAR in a file streams from it, 256 KiB at a time, or
    /// in one read if it is smaller: many uploads may be in flight).
    pub async fn body(&self) -> std::io::Result<reqwest::Body> {
        Ok(match self {
            Upload::Nar(upload::PreparedNar { compressed: spool::Compressed::File(file), file_size, .. }) => {
                let chunk = (*file_size).clamp(1, 256 << 10) as usize;
                reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file.reopen()?), chunk))
            }
            Upload::Bytes(b) | Upload::Nar(upload::PreparedNar { compressed: spool::Compressed::Memory(b, _), .. }) => {
                reqwest::Body::from(b.clone())
            }
        })
    }
}

/// A binary cache: its URL, transport and `nix-cache-info`.
#[derive(Debug)]
pub struct BinaryCache {
    url: String,
    transport: Transport,
    info: CacheInfo,
    /// `?priority=` of the URL.
    priority_override: Option<i32>,
    /// `?want-mass-query=` of the URL.
    want_mass_query_override: Option<bool>,
    health: retry::Health,
    retry: retry::RetryPolicy,
    /// How paths are written.
    write: CacheWriteParams,
    /// The store directory the cache serves: the URL's `store` (default `/nix/store`).
    store_dir: StoreDir,
    /// The keys narinfos are signed with (read by [`BinaryCache::open`]).
    secret_keys: Vec<SecretKey>,
    /// `nix-cache-info` is known to exist (checked or written before the first addition).
    initialised: tokio::sync::OnceCell<()>,
    /// MiB of [`ENCODER_MEMORY`](sluice_compress::encoder_memory::ENCODER_MEMORY) not taken by the
    /// encoders of additions under way.
    encoder_budget: std::sync::Arc<tokio::sync::Semaphore>,
    /// Narinfos answered by the path-info and hash-part queries ([`paths`]), for reading
    /// their NARs without fetching them again: the last [`NARINFOS_KEPT`] (a NAR of a path dropped from it fetches its narinfo again).
    narinfos: std::sync::Mutex<hashlink::LruCache<StorePath, NarInfo>>,
}

/// Most narinfos a [`BinaryCache`] keeps for reading their NARs (at about 1 KiB each, a few
/// tens of MiB): bounded, so that a store serving a cache for months (`sluice serve --store
/// s3://…`) does not grow with every path ever asked for, and large enough for the closures
/// a copy reads whole (a NixOS system is a few thousand paths).
pub const NARINFOS_KEPT: usize = 16 * 1024;

/// An open NAR download: the (still compressed) bytes, and a probe telling after a failure
/// whether the transfer was cut short (then downloading it again may succeed).
pub struct NarStream {
    /// The body; to be read on a blocking thread.
    pub reader: Box<dyn Read + Send>,
    /// The transfer's state.
    pub probe: TransferProbe,
    /// Whether the bytes are on this machine (a `file://` cache's file): reading them never
    /// waits on a peer, so the substitution unpacks them on the few unpacking threads
    /// (sluice-store's `unpack_pool.rs`); a network body is read on tokio's blocking pool instead.
    pub local: bool,
    /// Its size, when known before reading it (a `file://` cache's file).
    pub len: Option<u64>,
}

/// A cache file opened by [`BinaryCache::open_cache_file`].
pub enum CacheFile {
    /// A `file://` cache's file, and its size.
    Local { file: std::fs::File, len: u64 },
    /// Any other cache's file, streamed.
    Stream(NarStream),
}

impl CacheFile {
    /// Its bytes as a stream.
    pub fn into_stream(self) -> NarStream {
        match self {
            CacheFile::Local { file, len } => {
                NarStream { reader: Box::new(file), probe: TransferProbe::default(), local: true, len: Some(len) }
            }
            CacheFile::Stream(stream) => stream,
        }
    }
}

impl BinaryCache {
    /// A cache for `url` with `info` as its `nix-cache-info` (from the disk cache, or a default
    /// until [`BinaryCache::fetch_cache_info`] has answered); `?priority=` and
    /// `?want-mass-query=` override it, as Nix's `BinaryCacheStore::init`
    /// (`src/libstore/binary-cache-store.cc`) takes its values only as defaults. An HTTP or
    /// S3 cache gets `client`'s client, built now if it was not (its error is the error here),
    /// and follows its options.
    pub fn new(url: &CacheUrl, client: &http::LazyClient, info: CacheInfo) -> Result<Self, CacheError> {
        let CacheUrl { base, kind, common, write } = url;
        let options = client.options();
        let client = || client.get().map_err(|what| CacheError::Client { url: base.clone(), what });
        let (base, transport) = match kind {
            CacheKind::File => (base.clone(), Transport::File(file::FileTransport::new(PathBuf::from(base.trim_start_matches("file://"))))),
            CacheKind::Http => (
                base.clone(),
                Transport::Http { http: Box::new(http::HttpTransport::new(base.clone(), client()?.clone(), options)), s3: None },
            ),
            CacheKind::S3(params) => {
                let (s3, client) = (s3::S3::new(params), client()?);
                let http = http::HttpTransport::new(s3.bucket_url(), client.clone(), options).signed(s3.signer(client));
                (base.clone(), Transport::Http { http: Box::new(http), s3: Some(Box::new(s3)) })
            }
        };
        let mut cache = BinaryCache {
            url: base,
            transport,
            info,
            priority_override: common.priority,
            want_mass_query_override: common.want_mass_query,
            health: retry::Health::default(),
            retry: retry::RetryPolicy::new(options.download_attempts),
            write: write.clone(),
            store_dir: common.store_dir.clone(),
            secret_keys: Vec::new(),
            initialised: tokio::sync::OnceCell::new(),
            encoder_budget: std::sync::Arc::new(tokio::sync::Semaphore::new(
                (sluice_compress::encoder_memory::ENCODER_MEMORY >> 20) as usize,
            )),
            narinfos: std::sync::Mutex::new(hashlink::LruCache::new(NARINFOS_KEPT)),
        };
        cache.set_info(cache.info.clone());
        Ok(cache)
    }

    /// Replaces the cache's `nix-cache-info` (keeping the URL's overrides).
    pub fn set_info(&mut self, mut info: CacheInfo) {
        if let Some(p) = self.priority_override {
            info.priority = p;
        }
        if let Some(w) = self.want_mass_query_override {
            info.want_mass_query = w;
        }
        self.info = info;
    }

    /// Fetches and parses the cache's `nix-cache-info` over its own transport (so that the
    /// connection it opens serves the narinfo requests that follow); `None` when it has none
    /// (see [`BinaryCache::read_without_cache_info`]).
    pub async fn fetch_cache_info(&self) -> Result<Option<CacheInfo>, CacheError> {
        // The caller reports a failure here (the cache is then left out): no health warning.
        self.health.opening();
        let info = self.fetch_cache_info_once().await;
        self.health.opened(&self.url, info.is_ok());
        info
    }

    async fn fetch_cache_info_once(&self) -> Result<Option<CacheInfo>, CacheError> {
        let Some(bytes) = self.fetch("nix-cache-info").await? else { return Ok(None) };
        let text = String::from_utf8(bytes).map_err(|_| self.info_error("not UTF-8 text"))?;
        CacheInfo::parse(&text).map(Some).map_err(|e| self.info_error(&e.to_string()))
    }

    /// What a cache without `nix-cache-info` is to a reader. Nix's `BinaryCacheStore::init`
    /// writes one (`StoreDir: /nix/store`, so priority 50) into a `file://` or S3 cache, and
    /// so serves it; over HTTP, Nix's `HttpBinaryCacheStore::init` refuses the URL ("does not
    /// appear to be a binary cache"). A reader here writes nothing: the first two are taken to
    /// be what Nix would have written, the last is refused in Nix's words.
    pub fn read_without_cache_info(&self) -> Result<CacheInfo, CacheError> {
        match self.transport {
            Transport::Http { s3: None, .. } => Err(CacheError::NotACache { url: self.url.clone() }),
            _ => Ok(CacheInfo::default()),
        }
    }

    fn info_error(&self, what: &str) -> CacheError {
        CacheError::CacheInfo { url: format!("{}/nix-cache-info", self.url), what: what.to_string() }
    }

    /// Fails unless the cache's `nix-cache-info` is for the store directory of its URL (its
    /// `store`, default `/nix/store`), as Nix's `BinaryCacheStore::init` checks.
    pub fn check_store_dir(&self) -> Result<(), CacheError> {
        if self.info.store_dir != self.store_dir.as_str() {
            return Err(CacheError::WrongStoreDir {
                url: self.url.clone(),
                expected: self.store_dir.as_str().into(),
                got: self.info.store_dir.clone(),
            });
        }
        Ok(())
    }

    /// Fails if the cache is for another store directory than `/nix/store` (see
    /// [`CacheError::OtherStoreDir`]).
    pub fn require_nix_store_dir(&self) -> Result<(), CacheError> {
        if self.store_dir != StoreDir::default() {
            return Err(CacheError::OtherStoreDir { url: self.url.clone(), dir: self.store_dir.as_str().into() });
        }
        Ok(())
    }

    /// The version of the cache file `rel` ([`file::FileTransport::stamp`]), for a `file://`
    /// cache only (`None` for any other).
    pub fn file_stamp(&self, rel: &str) -> Option<Result<Option<file::FileStamp>, CacheError>> {
        match &self.transport {
            Transport::File(file) => Some(file.stamp(rel)),
            Transport::Http { .. } => None,
        }
    }

    /// The cache's URL, without trailing slash.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The store directory the cache serves.
    pub fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    /// The cache's `nix-cache-info` (priority and want-mass-query possibly overridden by the URL).
    pub fn info(&self) -> &CacheInfo {
        &self.info
    }

    /// Fetches a whole file, unless the cache was given up on; a failure that concerns the
    /// whole cache gives it up (see [`retry::Health`]).
    async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        self.health.check(&self.url)?;
        let result = self.fetch(rel).await;
        self.health.observe(&self.url, result)
    }

    async fn fetch(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        match &self.transport {
            Transport::File(t) => t.get(rel).await,
            Transport::Http { http, .. } => http.get(rel).await,
        }
    }

    /// Whether the cache was given up on for the rest of this run.
    pub fn is_disabled(&self) -> bool {
        self.health.check(&self.url).is_err()
    }

    /// The number of attempts a download from this cache gets (`download-attempts`); 1 for
    /// `file://` caches, whose reads do not fail transiently.
    pub fn download_attempts(&self) -> u32 {
        match &self.transport {
            Transport::File(_) => 1,
            Transport::Http { .. } => self.retry.attempts,
        }
    }

    /// The wait before attempt `attempt + 1` of a download from this cache.
    pub fn backoff(&self, attempt: u32) -> std::time::Duration {
        self.retry.backoff(attempt, None)
    }

    /// Requests worth having in flight at once to this cache ([`FILE_CAPACITY`] for a local
    /// directory).
    pub fn capacity(&self) -> usize {
        match &self.transport {
            Transport::File(_) => FILE_CAPACITY,
            Transport::Http { http, .. } => http.capacity(),
        }
    }

    /// The URL of the narinfo of `path`.
    pub fn narinfo_url(&self, path: &StorePath) -> String {
        self.narinfo_url_of(path.hash_part())
    }

    fn narinfo_url_of(&self, hash_part: &str) -> String {
        format!("{}/{hash_part}.narinfo", self.url)
    }

    /// Fetches the realisation of the derivation output `id` (`sha256:<hash>!<output>`):
    /// the JSON text of `realisations/<id>.doi`, where Nix's `BinaryCacheStore` keeps it
    /// (`queryRealisationUncached`, `binary-cache-store.cc`); `None` when the cache has none.
    pub async fn realisation(&self, id: &str) -> Result<Option<String>, CacheError> {
        let rel = format!("realisations/{id}.doi");
        let Some(bytes) = self.get(&rel).await? else { return Ok(None) };
        String::from_utf8(bytes).map(Some).map_err(|_| CacheError::Io {
            url: format!("{}/{rel}", self.url),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "realisation is not UTF-8 text"),
        })
    }

    /// Fetches the raw narinfo text of `path`; `None` when the cache does not have it.
    pub async fn narinfo_text(&self, path: &StorePath) -> Result<Option<String>, CacheError> {
        self.narinfo_text_of(path.hash_part()).await
    }

    /// Fetches the raw narinfo text `<hash_part>.narinfo`; `None` when the cache does not
    /// have it.
    pub(crate) async fn narinfo_text_of(&self, hash_part: &str) -> Result<Option<String>, CacheError> {
        let Some(bytes) = self.get(&format!("{hash_part}.narinfo")).await? else { return Ok(None) };
        let text = String::from_utf8(bytes).map_err(|_| CacheError::Io {
            url: self.narinfo_url_of(hash_part),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "narinfo is not UTF-8 text"),
        })?;
        // A page is the whole cache's answer, not this narinfo's: the cache is given up on.
        let page = NarInfo::check_not_html(&text).map_err(|source| CacheError::NarInfo { url: self.narinfo_url_of(hash_part), source });
        self.health.observe(&self.url, page)?;
        Ok(Some(text))
    }

    /// Parses narinfo text fetched for `path`, checking that it describes `path`.
    pub fn parse_narinfo(&self, path: &StorePath, store_dir: &StoreDir, text: &str) -> Result<NarInfo, CacheError> {
        let info = NarInfo::parse(store_dir, text).map_err(|source| CacheError::NarInfo { url: self.narinfo_url(path), source })?;
        if info.store_path != *path {
            return Err(CacheError::WrongStorePath {
                url: self.narinfo_url(path),
                expected: store_dir.display_path(path),
                got: store_dir.display_path(&info.store_path),
            });
        }
        // A malformed signature vouches for nothing and is no reason to refuse the others, but
        // whoever runs the cache should hear of it.
        for sig in info.signatures.iter().filter(|sig| sluice_nix::signature::parse_signature(sig).is_none()) {
            tracing::warn!("{}: signature '{sig}' is not NAME:BASE64 of an ed25519 signature; skipped", self.narinfo_url(path));
        }
        Ok(info)
    }

    /// The absolute URL of a narinfo's `URL` field.
    pub fn nar_url(&self, narinfo: &NarInfo) -> String {
        match &self.transport {
            Transport::Http { http, .. } => http.resolve(&narinfo.url),
            Transport::File(_) => format!("{}/{}", self.url, narinfo.url),
        }
    }

    /// Opens the (compressed) NAR of `narinfo` for streaming; `None` when the file is gone.
    /// The reader must be used on a blocking thread.
    pub async fn open_nar(&self, narinfo: &NarInfo) -> Result<Option<NarStream>, CacheError> {
        self.open_file(&narinfo.url).await
    }

    /// Opens the cache file `rel` (relative to the cache) for streaming, its bytes as stored;
    /// `None` when it does not exist. The reader must be used on a blocking thread.
    pub async fn open_file(&self, rel: &str) -> Result<Option<NarStream>, CacheError> {
        Ok(self.open_cache_file(rel).await?.map(CacheFile::into_stream))
    }

    /// Opens the cache file `rel` as [`BinaryCache::open_file`] does, a `file://` cache's as
    /// the file itself (which a server may send without reading it, with `sendfile`).
    pub async fn open_cache_file(&self, rel: &str) -> Result<Option<CacheFile>, CacheError> {
        self.health.check(&self.url)?;
        let result = match &self.transport {
            Transport::File(t) => t.open(rel).map(|r| r.map(|(file, len)| CacheFile::Local { file, len })),
            Transport::Http { http, .. } => http
                .open(rel)
                .await
                .map(|r| r.map(|(reader, probe)| CacheFile::Stream(NarStream { reader, probe, local: false, len: None }))),
        };
        self.health.observe(&self.url, result)
    }
}
