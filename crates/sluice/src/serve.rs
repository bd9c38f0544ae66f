//! `sluice serve`: serve a store over HTTP as a binary cache (like nix-serve or harmonia) that
//! unmodified Nix substitutes from, with `sluice serve`'s batch endpoints for sluice clients; a
//! binary cache as it is stored, and with `--upstream` as a pull-through cache.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use sluice_binary_cache::http::LazyClient;
use sluice_binary_cache::BinaryCache;
use sluice_nix::signature::SecretKey;
use sluice_serve::metrics::Metrics;
use sluice_serve::stored::Stored;
use sluice_serve::upstream::Upstreams;
use sluice_store::config::Settings;
use sluice_store::store::{open_store, Store};
use sluice_store::store_url::StoreUrl;
use sluice_store::substituters;

use crate::setup::{self, CacheFlags, ConfigFlags};

/// Arguments of `sluice serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The store to serve: a local or chroot store (`local`, `local?root=DIR`, an absolute
    /// path), a binary cache (`file://DIR`, `s3://BUCKET?…`, `http(s)://…`) or any store URL
    /// sluice opens [default: the `store` setting].
    #[arg(long)]
    store: Option<String>,
    /// Address to listen on, `HOST:PORT`; may be given more than once. With systemd's socket
    /// activation (`LISTEN_FDS`), the sockets it passes instead.
    #[arg(long = "listen", default_value = "[::]:5000")]
    listen: Vec<String>,
    /// A secret key file (as `nix key generate-secret` writes); every narinfo is signed with
    /// each one given.
    #[arg(long = "secret-key")]
    secret_keys: Vec<PathBuf>,
    /// `Priority` in `nix-cache-info` (lower is preferred by Nix).
    #[arg(long, default_value_t = 30)]
    priority: i32,
    /// PEM certificate chain: serve HTTPS (HTTP/2 and HTTP/1.1 by ALPN) instead of plain HTTP.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Neither offer nor advertise the batch endpoints.
    #[arg(long)]
    no_batch: bool,
    /// Connections open at once; a connection past it has the oldest idle one (no request
    /// in progress) closed for it, and waits in the listen backlog while none is.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Seconds a connection may stay without a request in progress before it is closed
    /// (HTTP/2 PINGs do not count), within which a request head must arrive, within which a
    /// connection must move 64 KiB of requests and answers while a request on it waits on the
    /// client (sending its body, reading the answer), and after which a connection told to
    /// close is dropped.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout: u64,
    /// A binary cache to fetch what `--store` (then a `file://` or `s3://` cache, or a local
    /// store) lacks from: a pull-through cache. May be given more than once; all are asked at
    /// once and the highest-priority answer (`?priority=N`, else its `nix-cache-info`) signed
    /// by a key of `trusted-public-keys` wins. NARs are kept in a binary cache as the upstream
    /// compressed them; in a local store as paths, once their references are.
    #[arg(long = "upstream", value_name = "URL")]
    upstreams: Vec<String>,
    /// Seconds an upstream has to answer a narinfo request; one that fails or takes longer
    /// is left out for 60 s.
    #[arg(long, default_value_t = 5.0)]
    upstream_timeout: f64,
    /// The largest NAR fetched from an upstream (`500M`, `16G`): a narinfo whose `NarSize` or
    /// `FileSize` is larger is passed over (with a warning naming the path and the upstream),
    /// so that no upstream's claim makes the server spool more.
    #[arg(long, default_value = "16G", value_parser = crate::store::parse_size)]
    upstream_max_nar_size: u64,
    #[command(flatten)]
    config: ConfigFlags,
}

/// Runs `sluice serve` until it is killed or a listener fails.
pub fn run(args: Args) -> Result<ExitCode, String> {
    let activated = crate::systemd::listen_fds()?
        .into_iter()
        .map(|fd| {
            let listener = std::net::TcpListener::from(fd);
            listener.local_addr().map_err(|e| format!("a socket systemd passed is not a TCP socket: {e}"))?;
            listener.set_nonblocking(true).map_err(|e| format!("a socket systemd passed: {e}"))?;
            Ok(listener)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let settings = setup::settings(&CacheFlags::from(&args.config))?;
    let url = args.store.clone().unwrap_or_else(|| settings.store.clone());
    if let Some(addr) = args.listen.iter().find(|a| !has_port(a)) {
        return Err(format!("--listen {addr}: expected HOST:PORT, e.g. 127.0.0.1:5000 or [::]:5000"));
    }
    // A pull-through cache may start empty; a store only served must be there.
    if args.upstreams.is_empty() {
        must_exist(&url)?;
    }
    let keys = args
        .secret_keys
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            SecretKey::parse(text.trim()).map_err(|e| format!("{}: {e}", f.display()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(sluice_serve::tls_acceptor(cert, key)?),
        _ => None,
    };
    let limits = sluice_serve::Limits { max_connections: args.max_connections.max(1), idle: Duration::from_secs(args.idle_timeout) };
    setup::runtime()?.block_on(async {
        let metrics = Arc::new(sluice_serve::metrics::Metrics::default());
        let (store, stored, upstreams) = open(&url, &settings, &args, metrics.clone()).await?;
        let mut listeners = Vec::new();
        for listener in activated {
            listeners.push(tokio::net::TcpListener::from_std(listener).map_err(|e| format!("a socket systemd passed: {e}"))?);
        }
        if listeners.is_empty() {
            for addr in &args.listen {
                listeners.push(tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("listening on {addr}: {e}"))?);
            }
        }
        for listener in &listeners {
            let local = listener.local_addr().map_err(|e| format!("a listening socket: {e}"))?;
            eprintln!("serving {url} on {}://{local}", if tls.is_some() { "https" } else { "http" });
        }
        let app = Arc::new(sluice_serve::App {
            store,
            keys,
            priority: args.priority,
            // The batch endpoints walk a local store's paths only: not offered when what it
            // lacks comes from upstreams.
            batch: !args.no_batch && upstreams.is_none(),
            metrics,
            rendered: Default::default(),
            stored,
            upstreams,
        });
        sluice_serve::run(listeners, tls, app, limits).await.map_err(|e| e.to_string())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Whether `addr` ends with a port: `HOST:PORT`, an IPv6 host in brackets (`[::1]:5000`).
fn has_port(addr: &str) -> bool {
    addr.rsplit_once(':').is_some_and(|(host, port)| port.parse::<u16>().is_ok() && (!host.contains(':') || host.ends_with(']')))
}

/// Refuses to serve a local store or a `file://` cache whose directory does not exist: opening
/// it would make an empty one and serve that (Nix makes a chroot store it is asked to open,
/// for writing; a server is asked to show what is there).
fn must_exist(url: &str) -> Result<(), String> {
    let Ok(parsed) = sluice_store::store_url::StoreUrl::parse(url) else { return Ok(()) };
    let dir = match (parsed.as_local(), parsed.as_cache()) {
        (Some(local), _) => local.dirs.real.clone(),
        (None, Some(cache)) => match cache.base.strip_prefix("file://") {
            Some(path) => PathBuf::from(path),
            None => return Ok(()),
        },
        (None, None) => return Ok(()),
    };
    match dir.is_dir() {
        true => Ok(()),
        false => Err(format!("{url}: no store to serve: {} does not exist", dir.display())),
    }
}

/// What `sluice serve` serves: the store, the binary cache served as it is stored (if it is
/// one), and the upstreams of a pull-through local store.
type Opened = (Arc<dyn Store>, Option<Arc<Stored>>, Option<Arc<Upstreams>>);

/// Opens the store `url` to serve; a binary cache is also served as it is stored. With
/// `--upstream`s it is a pull-through cache, which needs a binary cache or a local store.
async fn open(url: &str, settings: &Settings, args: &Args, metrics: Arc<Metrics>) -> Result<Opened, String> {
    let parsed = StoreUrl::parse(url).map_err(|e| e.to_string())?;
    let upstreams = match args.upstreams.as_slice() {
        [] => None,
        urls => {
            let urls = urls.iter().map(|u| substituters::cache_url(u).map_err(|e| e.to_string())).collect::<Result<Vec<_>, _>>()?;
            let policy = settings.signature_policy(None).map_err(|e| e.to_string())?;
            let timeout = Duration::try_from_secs_f64(args.upstream_timeout).map_err(|e| format!("--upstream-timeout: {e}"))?;
            let client = LazyClient::new(settings.http_options());
            Some(Arc::new(Upstreams::open(&urls, client, policy, timeout, args.upstream_max_nar_size, metrics).await?))
        }
    };
    let Some(cache_url) = parsed.as_cache().cloned() else {
        if upstreams.is_some() && parsed.as_local().is_none() {
            return Err(format!("--upstream needs a binary cache (file:// or s3://) or a local store as --store, not {url}"));
        }
        return Ok((open_store(url, settings).await.map_err(|e| e.to_string())?, None, upstreams));
    };
    let client = LazyClient::new(settings.http_options());
    let cache = Arc::new(BinaryCache::open(&cache_url, &client).await.map_err(|e| e.to_string())?);
    if upstreams.is_some() {
        // Writable from the start, and rid of what fronts killed mid-NAR left.
        cache.init_for_writing().await.map_err(|e| e.to_string())?;
    }
    Ok((cache.clone(), Some(Arc::new(Stored::new(cache, upstreams))), None))
}
