//! `sluice store`: commands that look after a store or a binary cache (Nix's `nix store
//! verify`, `nix store sign`; and a cache's garbage collection, which Nix has not).

mod gc;
mod sign;
mod verify;

pub(crate) use gc::parse_size;

use std::process::ExitCode;
use std::sync::Arc;

use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::BinaryCache;
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
