//! A binary cache ([`BinaryCache`], sluice-binary-cache) behind the [`Store`] interface, as
//! Nix's `BinaryCacheStore` (`src/libstore/binary-cache-store.cc`): queries answered from
//! narinfos, NARs decompressed as they are read, and an addition's narinfo written only once
//! its publish gate opens (the steps: `sluice_binary_cache::paths`).

use std::collections::BTreeSet;

use sluice_binary_cache::{BinaryCache, CacheError};
use sluice_compress::Compression;
use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};

use crate::store::{NarReader, PublishGate, Store, StoreError, StoreFuture};

/// The paths of every narinfo a `file://` or S3 cache holds (`--all`; Nix's
/// `LocalBinaryCacheStore::queryAllValidPaths`, `src/libstore/local-binary-cache-store.cc`,
/// lists a directory's narinfos the same way); the narinfos that cannot be read are the
/// errors, each naming its file. A plain HTTP cache cannot be listed.
pub async fn all_cache_paths(cache: &BinaryCache) -> Result<(Vec<StorePath>, Vec<String>), CacheError> {
    use futures::stream::StreamExt;
    let objects = cache.list_objects().await?;
    let hashes: Vec<String> = objects.into_iter().filter_map(|o| o.name.strip_suffix(".narinfo").map(str::to_owned)).collect();
    let found = futures::stream::iter(hashes)
        .map(|hash| async move { (cache.narinfo_of_hash_part(&hash).await, hash) })
        .buffer_unordered(cache.capacity().min(64))
        .collect::<Vec<_>>()
        .await;
    let (mut paths, mut errors) = (Vec::new(), Vec::new());
    for (info, hash) in found {
        match info {
            Ok(Some(info)) => paths.push(info.path),
            Ok(None) => errors.push(format!("{}/{hash}.narinfo: not the narinfo of a path of that hash", cache.url())),
            Err(e) => errors.push(e.to_string()),
        }
    }
    paths.sort();
    Ok((paths, errors))
}

impl Store for BinaryCache {
    fn url(&self) -> &str {
        BinaryCache::url(self)
    }

    fn store_dir(&self) -> &StoreDir {
        BinaryCache::store_dir(self)
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        Box::pin(async move { Ok(BinaryCache::query_path_infos(self, paths).await?) })
    }

    fn query_valid_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, BTreeSet<StorePath>> {
        Box::pin(async move { Ok(BinaryCache::query_valid_paths(self, paths).await?) })
    }

    fn query_complete_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, BTreeSet<StorePath>> {
        Box::pin(async move { Ok(BinaryCache::query_complete_paths(self, paths).await?) })
    }

    fn begin_push<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, (BTreeSet<StorePath>, Option<String>)> {
        Box::pin(async move { Ok(BinaryCache::begin_push(self, paths).await?) })
    }

    fn end_push<'a>(&'a self, token: String) -> StoreFuture<'a, ()> {
        Box::pin(async move { Ok(BinaryCache::end_push(self, &token).await?) })
    }

    fn query_path_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<StorePath>> {
        Box::pin(async move { Ok(self.narinfo_of_hash_part(hash_part).await?.map(|info| info.path)) })
    }

    /// One narinfo fetched, where the default would fetch it twice (for the path, then for
    /// its info).
    fn query_path_info_from_hash_part<'a>(&'a self, hash_part: &'a str) -> StoreFuture<'a, Option<ValidPathInfo>> {
        Box::pin(async move { Ok(self.narinfo_of_hash_part(hash_part).await?) })
    }

    /// The paths of its narinfos, for a `file://` or S3 cache ([`all_cache_paths`]); a narinfo
    /// that cannot be read fails the listing, naming it.
    fn query_all_valid_paths(&self) -> StoreFuture<'_, BTreeSet<StorePath>> {
        Box::pin(async move {
            let (paths, unreadable) = all_cache_paths(self).await?;
            match unreadable.into_iter().next() {
                Some(first) => Err(StoreError::Other(first)),
                None => Ok(paths.into_iter().collect()),
            }
        })
    }

    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        Box::pin(async move {
            let narinfo = self.narinfo_for_nar(&info.path).await?.ok_or_else(|| StoreError::NotValid {
                url: BinaryCache::url(self).to_owned(),
                path: BinaryCache::store_dir(self).display_path(&info.path),
            })?;
            let nar_url = self.nar_url(&narinfo);
            let gone = || {
                StoreError::Cache(CacheError::Io {
                    url: nar_url.clone(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "NAR file missing"),
                })
            };
            let stream = self.open_nar(&narinfo).await?.ok_or_else(gone)?;
            let compression = Compression::parse(&narinfo.compression).map_err(|e| StoreError::Other(format!("{nar_url}: {e}")))?;
            Ok(Box::new(LazyDecoder { compression, url: nar_url, raw: Some(stream.reader), decoder: None }) as NarReader)
        })
    }

    fn add_to_store<'a>(&'a self, info: ValidPathInfo, nar: NarReader, publish: PublishGate) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.init_for_writing().await?;
            let prepared = self.prepare_nar(&info, nar).await.map_err(StoreError::Other)?;
            let narinfo = self.upload_nar(&info, prepared).await?;
            publish.await?;
            Ok(self.write_narinfo(&narinfo).await?)
        })
    }

    fn parallelism(&self) -> usize {
        // Each addition compresses on a blocking thread: more than the cores only queue.
        let cores = sluice_compress::cores();
        self.capacity().min(4 * cores)
    }
}

/// A decoder started on the first read (a decoder reads the stream's head when made, which must
/// not happen on the async thread).
struct LazyDecoder {
    compression: Compression,
    url: String,
    /// The compressed stream, until the decoder is started on it.
    raw: Option<Box<dyn std::io::Read + Send>>,
    decoder: Option<Box<dyn std::io::Read + Send>>,
}

impl std::io::Read for LazyDecoder {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let decoder = match self.decoder.take() {
            Some(decoder) => decoder,
            None => {
                let raw = self.raw.take().ok_or_else(|| std::io::Error::other(format!("{}: decoder failed earlier", self.url)))?;
                self.compression.decoder(raw).map_err(|e| std::io::Error::other(format!("{}: {e}", self.url)))?
            }
        };
        self.decoder.insert(decoder).read(buf)
    }
}
