//! S3 binary caches: `s3://BUCKET`; Nix 2.35's `S3BinaryCacheStore`
//! (`s3-binary-cache-store.hh`), with the parameters of every binary cache
//! (`registry/binary_cache.rs`) and its own ([`S3Params`]): `region`, `endpoint`, `profile`,
//! `scheme`, `addressing-style`, `multipart-upload`, `multipart-chunk-size`,
//! `multipart-threshold`, `storage-class`.

use super::binary_cache::{cache_url, CACHE};
use super::{StoreConfig, StoreKind};
use crate::store_url::{CacheKind, ParamType, Query, S3Params, StoreUrlError};

/// The kind of S3 binary caches.
pub(super) const KIND: StoreKind = StoreKind {
    name: "S3 binary cache",
    forms: "s3://BUCKET",
    claims: |main| main.starts_with("s3://"),
    params: &[
        CACHE,
        &[
            ("region", ParamType::Text),
            ("endpoint", ParamType::Text),
            ("profile", ParamType::Text),
            ("scheme", ParamType::Text),
            ("addressing-style", ParamType::Text),
            ("multipart-upload", ParamType::Bool),
            ("multipart-chunk-size", ParamType::Int),
            ("multipart-threshold", ParamType::Int),
            ("storage-class", ParamType::Text),
        ],
    ],
    parse,
};

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, mut q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    match main.strip_prefix("s3://") {
        Some(bucket) if !bucket.is_empty() && !bucket.contains('/') => {
            let s3 = take_s3(&mut q, bucket)?;
            cache_url(main, CacheKind::S3(s3), q)
        }
        _ => Err(StoreUrlError::Unsupported(url.to_string())),
    }
}

/// The parameters of an `s3://BUCKET` URL ([`S3Params`]).
fn take_s3(q: &mut Query<'_>, bucket: &str) -> Result<S3Params, StoreUrlError> {
    let endpoint = q.take("endpoint").filter(|e| !e.is_empty());
    let path_style = match q.take("addressing-style").as_deref() {
        None | Some("auto") => endpoint.is_some(),
        Some("path") => true,
        Some("virtual") => false,
        Some(other) => return Err(q.bad("addressing-style", other, "not one of auto, path, virtual")),
    };
    let scheme = q.take("scheme").unwrap_or_else(|| "https".into());
    if scheme != "http" && scheme != "https" {
        return Err(q.bad("scheme", &scheme, "not http or https"));
    }
    Ok(S3Params {
        bucket: bucket.to_string(),
        region: q.take("region").unwrap_or_else(|| "us-east-1".into()),
        endpoint,
        profile: q.take("profile").filter(|p| !p.is_empty()),
        scheme,
        path_style,
        multipart_upload: q.take_bool("multipart-upload")?.unwrap_or(false),
        multipart_chunk_size: q.take_size("multipart-chunk-size", 5 << 20)?,
        multipart_threshold: q.take_size("multipart-threshold", 100 << 20)?,
        storage_class: q.take("storage-class").filter(|c| !c.is_empty()),
    })
}
