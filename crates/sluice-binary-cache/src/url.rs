//! What a binary cache's store URL says (`file://`, `http(s)://`, `s3://BUCKET` with their
//! parameters): parsed by sluice-store's store registry, read by [`crate::BinaryCache::open`].

use std::path::PathBuf;

use sluice_nix::store_params::CommonParams;

/// A binary cache's URL: `base` has no trailing slash and no query. Parsed by the binary
/// cache kinds of sluice-store (`registry/binary_cache.rs`, `registry/s3.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheUrl {
    pub base: String,
    pub kind: CacheKind,
    pub common: CommonParams,
    /// How paths are written into the cache.
    pub write: CacheWriteParams,
}

/// The transport of a binary cache (`s3://BUCKET` with its parameters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheKind {
    File,
    Http,
    S3(S3Params),
}

/// The parameters of writing to a binary cache: Nix's `BinaryCacheStoreConfig`
/// (`src/libstore/binary-cache-store.hh`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheWriteParams {
    /// `compression=` of NARs: `xz`, `zstd`, `br`, `gzip`, `bzip2` or `none`; default
    /// [`DEFAULT_COMPRESSION`] (Nix's is `xz`; `docs/caches.md` says why sluice's differs).
    pub compression: sluice_compress::Compression,
    /// `compression-level=N`; `None` (Nix's -1): the method's default level.
    pub compression_level: Option<i32>,
    /// `parallel-compression=BOOL` (default false): compress each NAR on every core (xz, zstd).
    pub parallel_compression: bool,
    /// `write-nar-listing=BOOL` (default false): write `<hash part>.ls`, the NAR's listing.
    pub write_nar_listing: bool,
    /// `secret-key=FILE` and `secret-keys=FILE,FILE…`: keys each narinfo is signed with.
    pub secret_key_files: Vec<PathBuf>,
}

/// The compression sluice writes NARs with when the URL names none.
pub const DEFAULT_COMPRESSION: sluice_compress::Compression = sluice_compress::Compression::Zstd;

/// `s3://BUCKET` parameters, as Nix 2.35's `S3BinaryCacheStoreConfig` reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Params {
    pub bucket: String,
    /// `region=` (default `us-east-1`), the SigV4 signing region.
    pub region: String,
    /// `endpoint=HOST[:PORT]` or a URL; default `s3.<region>.amazonaws.com`.
    pub endpoint: Option<String>,
    /// `profile=` of `~/.aws/credentials` (default `$AWS_PROFILE`, else `default`).
    pub profile: Option<String>,
    /// `scheme=` for an endpoint without one (default `https`).
    pub scheme: String,
    /// `addressing-style=`: `auto` (path style with a custom endpoint, virtual-hosted on AWS),
    /// `path` or `virtual`.
    pub path_style: bool,
    /// `multipart-upload=BOOL` (default false): upload NARs over
    /// [`S3Params::multipart_threshold`] in parts.
    pub multipart_upload: bool,
    /// `multipart-chunk-size=` bytes per part (default 5 MiB, S3's minimum).
    pub multipart_chunk_size: u64,
    /// `multipart-threshold=` bytes from which a NAR is uploaded in parts (default 100 MiB).
    pub multipart_threshold: u64,
    /// `storage-class=` (`x-amz-storage-class` of uploads), none by default.
    pub storage_class: Option<String>,
}
