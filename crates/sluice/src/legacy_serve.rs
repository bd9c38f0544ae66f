//! `sluice legacy-serve`: Nix's serve protocol on standard input and output, as
//! `nix-store --serve [--write]` speaks it, for real Nix clients of `ssh://` stores
//! (`nix copy --from/--to ssh://HOST?remote-program=…`, `nix-copy-closure`) and sluice's own.

use std::process::ExitCode;

use sluice_store::store_url::StoreUrl;

/// Arguments of `sluice legacy-serve`. Nix runs the remote program with `--serve --write` and,
/// from `remote-store`, `--store URL`; a later `--store` wins, so a wrapper may give one too.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Allow imports (ImportPaths, AddToStoreNar) and build requests, as `nix-store --serve --write`.
    /// Given twice it is the same as once: an `ssh://` client appends `--serve --write` to a
    /// `remote-program` that may already say it.
    #[arg(long, overrides_with = "write")]
    write: bool,
    /// The store to serve: `local`, `local?root=DIR` or a path (a chroot store; default `$NIX_REMOTE` when it names a local store, else `local`).
    #[arg(long, overrides_with = "store")]
    store: Option<String>,
    /// Accepted and ignored: Nix's `ssh://` store runs its remote program with `--serve`.
    #[arg(long, hide = true)]
    serve: bool,
}

/// Serves one client until it closes its end.
pub fn run(args: Args) -> Result<ExitCode, String> {
    let served = crate::setup::served_store(args.store.clone());
    let url = StoreUrl::parse(&served).map_err(|e| e.to_string())?;
    let store = url.as_local().ok_or_else(|| format!("{served}: legacy-serve serves a local store, not a {}", url.kind_name()))?;
    let config = crate::setup::raw_config(&[])?;
    sluice_daemon::serve_legacy_stdio(store, &config, args.write).map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}
