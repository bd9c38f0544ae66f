//! `sluice store`: commands that look after a store or a binary cache (Nix's `nix store
//! verify`, `nix store sign`; and a cache's garbage collection, which Nix has not).

mod gc;
mod sign;
mod verify;

use std::process::ExitCode;
use std::sync::Arc;

use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::BinaryCache;
use sluice_nix::store_path::StorePath;
use sluice_store::config::Settings;

/// `sluice store` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Check paths of a store or binary cache (like `nix store verify`, and for a cache its
    /// files and closure), and mend them with `--repair`.
    Verify(verify::Args),
    /// Sign paths of a store or binary cache with a secret key (like `nix store sign`).
    Sign(sign::Args),
    /// Delete what a `file://` or S3 binary cache keeps for no one, leaving it consistent.
    Gc(gc::Args),
}

/// Runs a `sluice store` subcommand.
pub fn run(cmd: Command) -> Result<ExitCode, String> {
    match cmd {
        Command::Verify(a) => verify::run(a),
        Command::Sign(a) => sign::run(a),
        Command::Gc(a) => gc::run(a),
    }
}

/// Opens `url` as a binary cache, or `None` when it names another kind of store.
async fn open_cache(url: &str, settings: &Settings) -> Result<Option<Arc<BinaryCache>>, String> {
    let parsed = sluice_store::store_url::StoreUrl::parse(url).map_err(|e| e.to_string())?;
    let Some(cache_url) = parsed.as_cache() else { return Ok(None) };
    let cache = BinaryCache::open(cache_url, &LazyClient::new(settings.http_options())).await.map_err(|e| e.to_string())?;
    Ok(Some(Arc::new(cache)))
}

/// The paths of every narinfo a `file://` or S3 cache holds (`--all`); the narinfos that
/// cannot be read are the errors, each naming its file.
async fn all_cache_paths(cache: &BinaryCache) -> Result<(Vec<StorePath>, Vec<String>), String> {
    use futures::stream::StreamExt;
    let objects = cache.list_objects().await.map_err(|e| e.to_string())?;
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
