//! A binary cache's paths, read and written as Nix's `BinaryCacheStore`
//! (`src/libstore/binary-cache-store.cc`) does (sluice-store's `Store` implementation runs
//! these steps):
//!
//! - `nix-cache-info` is created (`StoreDir: /nix/store`) when missing, before the first
//!   addition (`BinaryCacheStore::init`);
//! - an addition (`addToStoreCommon`) compresses the NAR into a temporary file while checking
//!   it ([`upload::prepare_nar`]), writes `<hash part>.ls` if `write-nar-listing`, uploads
//!   `nar/<FileHash>.nar<ext>` (for a compressed NAR of [`CHECK_BEFORE_UPLOAD`] bytes or
//!   more, unless a file of that name and size exists), and only then — once its publish gate opens —
//!   writes `<hash part>.narinfo`, signed with every `secret-key` (`writeNarInfo`; the info's
//!   own signatures are kept).

use std::collections::BTreeSet;

use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::{StoreDir, StorePath};

use super::upload::{self, PreparedNar};
use super::{BinaryCache, CacheError, Transport, Upload};
use crate::http::LazyClient;
use crate::url::CacheUrl;
use sluice_compress::encoder_memory::{EncoderPlan, ENCODER_MEMORY};

const NARINFO_MIME: &str = "text/x-nix-narinfo";
const NAR_MIME: &str = "application/x-nix-nar";
const CACHE_INFO_MIME: &str = "text/x-nix-cache-info";
const LISTING_MIME: &str = "application/json";

/// Compressed NARs of fewer bytes are uploaded without asking first whether the cache has
/// them (Nix asks for every NAR: `fileExists(narInfo->url)` in `addToStoreCommon`). The file
/// is named by the sha256 of its bytes, so one already there is the same bytes and writing it
/// again loses nothing; asking costs a round trip (a `HEAD`, a quarter of a push's requests)
/// on every NAR, and saves one upload only for NARs a cache has without their narinfo (a push
/// that was cut short). Below 1 MiB an upload costs about what the question costs (the
/// bytes in flight of a 100 Mbit/s link at an 80 ms round trip), so asking cannot pay.
pub(crate) const CHECK_BEFORE_UPLOAD: u64 = 1 << 20;

impl BinaryCache {
    /// Opens the cache `url` for reading and writing (of `/nix/store` only): reads its
    /// `nix-cache-info` and its secret keys. A `file://` or S3 cache without `nix-cache-info` is taken to serve
    /// `/nix/store`, and one is written before the first addition (Nix's
    /// `BinaryCacheStore::init` writes it at once); over HTTP it is written now, as Nix's
    /// `HttpBinaryCacheStore::init` does, and a server that refuses it is not a binary cache
    /// ([`BinaryCache::read_without_cache_info`]'s error, Nix's words).
    pub async fn open(url: &CacheUrl, client: &LazyClient) -> Result<Self, CacheError> {
        let mut cache = BinaryCache::new(url, client, Default::default())?;
        cache.require_nix_store_dir()?;
        let info = match cache.fetch_cache_info().await? {
            Some(info) => info,
            None => match cache.read_without_cache_info() {
                Ok(info) => info,
                Err(not_a_cache) => {
                    cache.init_for_writing().await.map_err(|_| not_a_cache)?;
                    Default::default()
                }
            },
        };
        cache.set_info(info);
        cache.check_store_dir()?;
        for file in &url.write.secret_key_files {
            let bad = |what: String| CacheError::SecretKey { url: cache.url.clone(), file: file.clone(), what };
            let text = std::fs::read_to_string(file).map_err(|e| bad(e.to_string()))?;
            cache.secret_keys.push(SecretKey::parse(text.trim()).map_err(|e| bad(e.to_string()))?);
        }
        Ok(cache)
    }

    /// Whether the cache file `rel` exists.
    pub(crate) async fn file_exists(&self, rel: &str) -> Result<bool, CacheError> {
        match &self.transport {
            Transport::File(t) => t.exists(rel),
            Transport::Http { http, .. } => http.exists(rel).await,
        }
    }

    /// The size of the cache file `rel` (`HEAD`'s `Content-Length`, S3's `HeadObject`, a
    /// `file://` cache's `stat`); `None` when it does not exist.
    pub(crate) async fn file_size(&self, rel: &str) -> Result<Option<u64>, CacheError> {
        match &self.transport {
            Transport::File(t) => t.size(rel),
            Transport::Http { http, .. } => http.size(rel).await,
        }
    }

    /// Creates or replaces the cache file `rel` (Nix's `upsertFile`).
    pub(crate) async fn upsert_file(&self, rel: &str, upload: Upload, mime: &str) -> Result<(), CacheError> {
        match &self.transport {
            Transport::File(t) => t.put(rel, upload),
            Transport::Http { http, s3: None } => http.put(rel, &upload, mime, &[]).await,
            Transport::Http { http, s3: Some(s3) } => s3.put(http, rel, &upload, mime).await,
        }
    }

    /// Writes `nix-cache-info` unless the cache has one (and, for `file://`, makes its
    /// directories first), once.
    pub async fn init_for_writing(&self) -> Result<(), CacheError> {
        self.initialised
            .get_or_try_init(|| async {
                if let Transport::File(t) = &self.transport {
                    t.create_dirs()?;
                }
                self.sweep_staging().await?;
                if !self.file_exists("nix-cache-info").await? {
                    let text = format!("StoreDir: {}\n", self.store_dir.as_str());
                    self.upsert_file("nix-cache-info", Upload::Bytes(text.into()), CACHE_INFO_MIME).await?;
                }
                Ok(())
            })
            .await
            .map(drop)
    }

    /// Removes what writers killed mid-upload left where this cache's uploads are staged
    /// ([`crate::spool::sweep_staging`]); done once before this cache is first written.
    async fn sweep_staging(&self) -> Result<(), CacheError> {
        let dir = self.staging().0;
        let swept = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || crate::spool::sweep_staging(&dir)
        })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r);
        match swept {
            Ok(0) => Ok(()),
            Ok(n) => {
                tracing::info!("{}: removed {n} temporary files of uploads that were killed", dir.display());
                Ok(())
            }
            Err(source) => Err(CacheError::Io { url: dir.display().to_string(), source }),
        }
    }

    /// Where NARs are compressed before upload, and whether a small one may stay in memory:
    /// a file in the cache's own directory for `file://` (so that the upload is a rename),
    /// memory or the system's temporary directory otherwise ([`super::spool`]).
    fn staging(&self) -> (std::path::PathBuf, bool) {
        match &self.transport {
            Transport::File(t) => (t.dir().to_path_buf(), false),
            Transport::Http { .. } => (std::env::temp_dir(), true),
        }
    }

    /// The narinfo of an added path: `info` with the prepared NAR's URL, compression and file
    /// hash, signed with the cache's keys.
    fn narinfo_for(&self, info: &ValidPathInfo, nar: &PreparedNar, url: String) -> NarInfo {
        let file = (url, self.write.compression.name().to_string(), nar.file_hash.clone(), nar.file_size);
        NarInfo::signed(info, file, &self.secret_keys, &StoreDir::default())
    }
}

impl BinaryCache {
    /// The info of the path whose narinfo is `<hash_part>.narinfo` (kept for
    /// [`BinaryCache::narinfo_for_nar`]), `None` when the cache has none or `hash_part` is
    /// malformed.
    pub async fn narinfo_of_hash_part(&self, hash_part: &str) -> Result<Option<ValidPathInfo>, CacheError> {
        Ok(self.narinfo_by_hash_part(hash_part).await?.map(|(_, narinfo)| self.keep(narinfo).info))
    }

    /// The narinfo `<hash_part>.narinfo` as stored (its text) and parsed, `None` when the
    /// cache has none, `hash_part` is malformed or the narinfo is another path's.
    pub async fn narinfo_by_hash_part(&self, hash_part: &str) -> Result<Option<(String, NarInfo)>, CacheError> {
        // Only a well-formed hash part becomes a file name in the cache.
        if hash_part.len() != sluice_nix::store_path::HASH_PART_LEN || !sluice_nix::base32::is_digits(hash_part) {
            return Ok(None);
        }
        let Some(text) = self.narinfo_text_of(hash_part).await? else { return Ok(None) };
        let narinfo = NarInfo::parse(&self.store_dir, &text)
            .map_err(|source| CacheError::NarInfo { url: format!("{}/{hash_part}.narinfo", self.url), source })?;
        Ok((narinfo.store_path.hash_part() == hash_part).then_some((text, narinfo)))
    }

    /// Keeps `narinfo` for [`BinaryCache::narinfo_for_nar`]; what it says of its path.
    fn keep(&self, narinfo: NarInfo) -> PathInfo {
        let info = PathInfo::from_narinfo(&narinfo);
        self.narinfos.lock().unwrap_or_else(|p| p.into_inner()).insert(narinfo.store_path.clone(), narinfo);
        info
    }

    /// How many narinfos are kept for reading their NARs (at most [`super::NARINFOS_KEPT`]).
    pub fn narinfos_kept(&self) -> usize {
        self.narinfos.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The info of `path` from its narinfo (kept for [`BinaryCache::narinfo_for_nar`]).
    async fn query_one(&self, path: &StorePath) -> Result<Option<PathInfo>, CacheError> {
        let Some(text) = self.narinfo_text(path).await? else { return Ok(None) };
        Ok(Some(self.keep(self.parse_narinfo(path, &self.store_dir, &text)?)))
    }

    /// The info of each of `paths` from its narinfo (`None` where the cache has none), all at
    /// once: the transport bounds the requests in flight.
    pub async fn query_path_infos(&self, paths: &[StorePath]) -> Result<Vec<Option<PathInfo>>, CacheError> {
        futures::future::join_all(paths.iter().map(|path| self.query_one(path))).await.into_iter().collect()
    }

    /// Those of `paths` whose narinfo exists (`HEAD`, as Nix's
    /// `BinaryCacheStore::isValidPathUncached`), all at once: the transport bounds the
    /// requests in flight.
    pub async fn query_valid_paths(&self, paths: &[StorePath]) -> Result<BTreeSet<StorePath>, CacheError> {
        let exists = futures::future::join_all(
            paths.iter().map(|path| async move { self.file_exists(&format!("{}.narinfo", path.hash_part())).await }),
        )
        .await;
        let mut valid = BTreeSet::new();
        for (path, exists) in paths.iter().zip(exists) {
            if exists? {
                valid.insert(path.clone());
            }
        }
        Ok(valid)
    }

    /// Those of `paths` that the cache holds whole: a narinfo that parses and names the path,
    /// and a NAR at its `URL` of its `FileSize` bytes (of its `NarSize` if it has no
    /// `FileSize` and is not compressed; if neither, a NAR of any size). All at once: the
    /// narinfos are fetched and the NARs asked for (`HEAD`, `stat`) in parallel, the transport
    /// bounding the requests in flight. Stricter than Nix, whose `copyPaths` skips a path whose
    /// narinfo exists (`BinaryCacheStore::isValidPathUncached`): a narinfo left by a push cut
    /// short, or whose NAR was deleted or truncated, is written again with its NAR.
    pub async fn query_complete_paths(&self, paths: &[StorePath]) -> Result<BTreeSet<StorePath>, CacheError> {
        let complete = futures::future::join_all(paths.iter().map(|path| self.holds_whole(path))).await;
        let mut out = BTreeSet::new();
        for (path, complete) in paths.iter().zip(complete) {
            if complete? {
                out.insert(path.clone());
            }
        }
        Ok(out)
    }

    /// Whether the cache holds `path` whole (see [`BinaryCache::query_complete_paths`]).
    async fn holds_whole(&self, path: &StorePath) -> Result<bool, CacheError> {
        let Some(text) = self.narinfo_text(path).await? else { return Ok(false) };
        // A narinfo that does not parse is replaced.
        let Ok(narinfo) = self.parse_narinfo(path, &self.store_dir, &text) else { return Ok(false) };
        let expected = narinfo.file_size.or((narinfo.compression == "none").then_some(narinfo.nar_size));
        let found = self.file_size(&narinfo.url).await?;
        Ok(found.is_some() && (expected.is_none() || found == expected))
    }

    /// The narinfo of `path` to read its NAR by: the one kept from a query, else fetched
    /// again; `None` when the cache has none.
    pub async fn narinfo_for_nar(&self, path: &StorePath) -> Result<Option<NarInfo>, CacheError> {
        let known = self.narinfos.lock().unwrap_or_else(|p| p.into_inner()).get(path).cloned();
        if let Some(narinfo) = known {
            return Ok(Some(narinfo));
        }
        let Some(text) = self.narinfo_text(path).await? else { return Ok(None) };
        Ok(Some(self.parse_narinfo(path, &self.store_dir, &text)?))
    }
}

/// Adding a path, in the steps of Nix's `addToStoreCommon`: [`BinaryCache::init_for_writing`],
/// [`BinaryCache::prepare_nar`], [`BinaryCache::upload_nar`], and once the path may be
/// published, [`BinaryCache::write_narinfo`].
impl BinaryCache {
    /// Compresses and checks the NAR of `info` into a temporary file (or memory), on a
    /// blocking thread, within the encoders' memory budget. Errors name the cache.
    pub async fn prepare_nar(&self, info: &ValidPathInfo, mut nar: Box<dyn std::io::Read + Send>) -> Result<PreparedNar, String> {
        let (params, (dir, in_memory), info2) = (self.write.clone(), self.staging(), info.clone());
        // S3 uploads carry the MD5 (`Content-MD5`); nothing else uses it.
        let with_md5 = matches!(&self.transport, Transport::Http { s3: Some(_), .. });
        let cores = sluice_compress::cores() as u32;
        let plan = EncoderPlan::new(
            params.compression,
            params.compression_level,
            params.parallel_compression,
            info.nar_size,
            cores,
            ENCODER_MEMORY,
        );
        // The encoder's memory, in MiB, out of the budget every addition shares.
        let mib = plan.memory.div_ceil(1 << 20).min(ENCODER_MEMORY >> 20) as u32;
        let budget = self
            .encoder_budget
            .clone()
            .acquire_many_owned(mib)
            .await
            .map_err(|e| format!("{}: waiting for {mib} MiB of the encoders' memory: {e}", self.url))?;
        tokio::task::spawn_blocking(move || {
            let _budget = budget;
            upload::prepare_nar(&StoreDir::default(), &info2, &mut nar, &params, &plan, &dir, in_memory, with_md5)
        })
        .await
        .map_err(|e| format!("{}: {e}", self.url))?
        .map_err(|e| format!("{}: {e}", self.url))
    }

    /// Uploads the listing (if `write-nar-listing`) and the prepared NAR of `info`; the
    /// narinfo to publish it by.
    pub async fn upload_nar(&self, info: &ValidPathInfo, prepared: PreparedNar) -> Result<NarInfo, CacheError> {
        let hash_part = info.path.hash_part();
        if let Some(listing) = &prepared.listing {
            self.upsert_file(&format!("{hash_part}.ls"), Upload::Bytes(upload::listing_json(listing).into()), LISTING_MIME).await?;
        }
        let url = format!("nar/{}.nar{}", prepared.file_hash.to_nix32(), self.write.compression.nar_extension());
        let narinfo = self.narinfo_for(info, &prepared, url.clone());
        // A file of that name is the same bytes only if it is whole: one cut short (a push
        // killed while writing it to a server that writes in place) is written again.
        if prepared.file_size < CHECK_BEFORE_UPLOAD || self.file_size(&url).await? != Some(prepared.file_size) {
            self.upsert_file(&url, Upload::Nar(prepared), NAR_MIME).await?;
        }
        Ok(narinfo)
    }

    /// A temporary file for a NAR fetched as it is from elsewhere, where
    /// [`BinaryCache::put_nar_file`] takes it from: in the cache's directory for `file://`
    /// (the upload is a rename), else in the system's temporary directory. Nothing in the
    /// cache names it: a process killed while writing it publishes nothing.
    pub fn nar_staging_file(&self) -> std::io::Result<tempfile::NamedTempFile> {
        if let Transport::File(t) = &self.transport {
            t.create_dirs().map_err(std::io::Error::other)?;
        }
        crate::spool::staging_file(&self.staging().0)
    }

    /// Uploads `file` (from [`BinaryCache::nar_staging_file`], `file_size` bytes whose sha256
    /// is `file_hash`) as the cache file `rel`, as stored: not recompressed. The narinfo that
    /// publishes it is written apart ([`BinaryCache::write_narinfo`]).
    pub async fn put_nar_file(
        &self,
        rel: &str,
        file: tempfile::NamedTempFile,
        file_hash: sluice_nix::hash::Hash,
        file_size: u64,
    ) -> Result<(), CacheError> {
        self.init_for_writing().await?;
        let nar = PreparedNar { compressed: crate::spool::Compressed::File(file), file_hash, md5: None, file_size, listing: None };
        self.upsert_file(rel, Upload::Nar(nar), NAR_MIME).await
    }

    /// Writes `narinfo`, which makes its path valid in the cache.
    pub async fn write_narinfo(&self, narinfo: &NarInfo) -> Result<(), CacheError> {
        let text = narinfo.to_text(&self.store_dir);
        self.upsert_file(&format!("{}.narinfo", narinfo.store_path.hash_part()), Upload::Bytes(text.into()), NARINFO_MIME).await
    }
}
