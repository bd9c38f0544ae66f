//! What every networked command shares: settings from nix.conf and flags, the store URL, the
//! HTTP client, the substituters, the disk cache and the destination's validity check.

use std::sync::Arc;

use sluice_binary_cache::http::LazyClient;
use sluice_local_store::LocalStore;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_store::closure::{ClosureQuery, ValidityCheck};
use sluice_store::config::{RawConfig, Settings};
use sluice_store::store_url::{LocalStoreConfig, StoreUrl};
use sluice_store::substituters;

/// Flags of the commands that substitute (`copy`, `missing`); they win over nix.conf.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CacheFlags {
    /// Substituters to use, space-separated (overrides `substituters`).
    #[arg(long)]
    pub substituters: Option<String>,
    /// Trusted public keys, space-separated (overrides `trusted-public-keys`).
    #[arg(long)]
    pub trusted_public_keys: Option<String>,
    /// Accept paths without a trusted signature.
    #[arg(long)]
    pub no_check_sigs: bool,
    /// Consider every narinfo remembered in the disk cache out of date (Nix's `--refresh`).
    #[arg(long)]
    pub refresh: bool,
    #[command(flatten)]
    pub config: ConfigFlags,
}

/// Flags of every command that opens stores; they win over nix.conf.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ConfigFlags {
    /// Connections per cache over HTTP/1.1; 0 means no limit (overrides `http-connections`,
    /// default 25).
    #[arg(long)]
    pub http_connections: Option<usize>,
    /// Set a nix.conf option, as with Nix's `--option NAME VALUE`.
    #[arg(long, num_args = 2, value_names = ["NAME", "VALUE"], action = clap::ArgAction::Append)]
    pub option: Vec<String>,
}

impl From<&ConfigFlags> for CacheFlags {
    /// The flags of a command that does not substitute: no substituter flags given.
    fn from(config: &ConfigFlags) -> Self {
        CacheFlags { config: config.clone(), ..CacheFlags::default() }
    }
}

/// The settings of nix.conf files and `NIX_CONFIG`, with `extra` (`--option` pairs) applied.
/// The first call prints Nix's `warning: unknown setting 'NAME'` for each name no Nix knows.
pub fn raw_config(extra: &[String]) -> Result<RawConfig, String> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let mut raw = RawConfig::from_environment().map_err(|e| e.to_string())?;
    for pair in extra.chunks(2) {
        if let [name, value] = pair {
            raw.set(name, value);
        }
    }
    WARNED.call_once(|| raw.warn_unknown_settings());
    Ok(raw)
}

/// The local store a server (`daemon`, `legacy-serve`) serves without `--store`: `NIX_REMOTE`
/// when it names a local store (a chroot store, as Nix's `nix-daemon` serves the `store`
/// setting), else `local`. So a server started in an environment whose Nix commands use a
/// chroot store never opens this machine's `/nix`.
pub fn served_store(store: Option<String>) -> String {
    let remote =
        std::env::var("NIX_REMOTE").ok().filter(|s| !s.is_empty() && !matches!(s.as_str(), "auto" | "daemon") && !s.starts_with("unix://"));
    store.or(remote).unwrap_or_else(|| "local".into())
}

/// The store to use when none is named: the `store` setting, whose default is `$NIX_REMOTE`
/// or `auto`, as in Nix.
pub fn default_store(flags: &ConfigFlags) -> Result<String, String> {
    Ok(Settings::from_raw(&raw_config(&flags.option)?).map_err(|e| e.to_string())?.store)
}

/// Settings from nix.conf, `NIX_CONFIG` and the flags.
pub fn settings(flags: &CacheFlags) -> Result<Settings, String> {
    let raw = raw_settings(flags)?;
    let mut settings = Settings::from_raw(&raw).map_err(|e| e.to_string())?;
    settings.check_sigs = !flags.no_check_sigs;
    Ok(settings)
}

/// The settings of nix.conf files and `NIX_CONFIG` with the flags applied, unparsed.
pub fn raw_settings(flags: &CacheFlags) -> Result<RawConfig, String> {
    let mut raw = raw_config(&flags.config.option)?;
    if let Some(s) = &flags.substituters {
        raw.set("substituters", s);
    }
    if let Some(k) = &flags.trusted_public_keys {
        raw.set("trusted-public-keys", k);
    }
    if flags.no_check_sigs {
        raw.set("require-sigs", "false");
    }
    if let Some(n) = flags.config.http_connections {
        raw.set("http-connections", &n.to_string());
    }
    if flags.refresh {
        for ttl in ["narinfo-cache-positive-ttl", "narinfo-cache-negative-ttl", "tarball-ttl"] {
            raw.set(ttl, "0");
        }
    }
    Ok(raw)
}

/// The command-line paths, then with `stdin` (Nix's `--stdin`) those read from standard
/// input, separated by white space.
pub fn with_stdin(mut paths: Vec<String>, stdin: bool) -> Result<Vec<String>, String> {
    if stdin {
        let text = std::io::read_to_string(std::io::stdin()).map_err(|e| format!("reading paths from standard input: {e}"))?;
        paths.extend(text.split_whitespace().map(str::to_owned));
    }
    Ok(paths)
}

/// Threads for blocking work (unpacking, SQLite, locks): NAR jobs beyond this wait for a
/// thread with their response open. Tokio's default of 512 let a copy of 1056 paths start a
/// thread per path lock at once, hundreds of threads each with its own allocator arena.
const MAX_BLOCKING_THREADS: usize = 96;

/// A multi-threaded runtime for one command.
pub fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// Leaves a command's runtime to the process's exit, its threads parked, instead of joining
/// them: a thread that ends makes jemalloc give its arena's free pages back (`tcache_cleanup`:
/// one `madvise` per extent, each sending the other cores a TLB shootdown) just before the
/// exit frees everything at once. At the end of the corpus copy from `file://` into tmpfs that
/// was about 230 `madvise` calls; the median time from the last path placed to the process's
/// exit went from 5.4 to 3.35 ms (18 copies each; docs/benchmarks.md, issue 16). Only for a
/// runtime whose tasks that hold a store or temporary roots have all ended, so that those are
/// dropped and closed by their owner as before; what else is left (an HTTP client's idle
/// connections) the exit closes as the runtime's drop would.
pub fn leave_runtime(rt: tokio::runtime::Runtime) {
    std::mem::forget(rt);
}

/// Parses command-line store paths (full paths in the store directory, or paths inside them).
/// A path outside the store directory is followed through symbolic links (such as `./result`)
/// until it lands in it, as Nix's `followLinksToStorePath` does.
pub fn parse_paths(store_dir: &StoreDir, args: &[String]) -> Result<Vec<StorePath>, String> {
    args.iter().map(|a| store_dir.to_store_path(&follow_links(store_dir, a)).map_err(|e| format!("{a}: {e}"))).collect()
}

/// Follows symbolic links from `arg` (at most 40) until the path is in `store_dir`.
fn follow_links(store_dir: &StoreDir, arg: &str) -> String {
    let mut path = std::path::PathBuf::from(arg);
    for _ in 0..40 {
        let text = path.to_string_lossy();
        if text.starts_with(&format!("{}/", store_dir.as_str())) {
            break;
        }
        match std::fs::read_link(&path) {
            Ok(target) => path = path.parent().map_or(target.clone(), |dir| dir.join(&target)),
            Err(_) => break,
        }
    }
    path.to_string_lossy().into_owned()
}

/// Parses a store URL that must name a local store (all its parameters checked, nothing
/// opened yet).
pub fn local_config(url: &str) -> Result<LocalStoreConfig, String> {
    StoreUrl::parse(url)
        .map_err(|e| e.to_string())?
        .as_local()
        .cloned()
        .ok_or_else(|| format!("{url}: this command needs a local store here"))
}

/// Where the caches of a closure query come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caches {
    /// The `substituters`: one that cannot be used is left out with a warning, as Nix does.
    Substituters,
    /// A cache the command line names (`copy --from`, `path-info --store`): one that cannot
    /// be used (not a binary cache, unreachable, TLS failure, 401) is an error, said once.
    Named,
}

/// Opens the caches `urls` with the disk cache (see [`Caches`] for those that cannot be
/// used); the narinfos of `roots` are asked for alongside each cache's `nix-cache-info`.
pub async fn closure_query(
    urls: &[String],
    caches: Caches,
    settings: &Settings,
    store_dir: &StoreDir,
    is_valid: ValidityCheck,
    roots: &[StorePath],
) -> Result<ClosureQuery, String> {
    let client = LazyClient::new(settings.http_options());
    let disk = substituters::open_disk_cache(settings);
    let (subs, mut errors) = substituters::open_prefetching(urls, settings, &client, disk.as_deref(), roots).await;
    if caches == Caches::Named {
        errors.extend(subs.iter().filter_map(|s| s.source.as_cache()?.require_nix_store_dir().err()).map(Into::into));
    }
    for e in errors {
        match caches {
            Caches::Substituters => crate::log::Log::get().msg(crate::log::LVL_WARN, &format!("warning: substituter left out: {e}")),
            // Every such error names the URL, as Nix's does (byte for byte for "does not appear
            // to be a binary cache").
            Caches::Named => return Err(e.to_string()),
        }
    }
    Ok(ClosureQuery {
        substituters: Arc::new(subs),
        disk_cache: disk,
        store_dir: store_dir.clone(),
        is_valid,
        accept: None,
        content_addresses: Default::default(),
    })
}

/// What `copy` and `missing` start from: the settings, the destination local store and the
/// command-line paths parsed in its store directory.
pub struct Destination {
    pub settings: Settings,
    pub store: Arc<LocalStore>,
    pub store_dir: StoreDir,
    pub roots: Vec<StorePath>,
}

/// Reads the settings, opens the local store `url` (default: [`default_store`]) and parses
/// `paths`. The settings' `require_sigs` becomes the store's (`SignaturePolicy::requires_sigs`).
pub fn destination(flags: &CacheFlags, url: Option<&str>, paths: &[String]) -> Result<Destination, String> {
    let mut settings = settings(flags)?;
    let config = local_config(url.unwrap_or(&settings.store))?;
    settings.require_sigs =
        sluice_local_store::SignaturePolicy::requires_sigs(settings.require_sigs, config.require_sigs, settings.check_sigs);
    let store = LocalStore::open(&config).map(Arc::new).map_err(|e| e.to_string())?;
    settings.configure_local_store(&store);
    let store_dir = store.store_dir().clone();
    let roots = parse_paths(&store_dir, paths)?;
    Ok(Destination { settings, store, store_dir, roots })
}
