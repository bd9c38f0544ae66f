//! `sluice daemon`: serve Nix's worker protocol on a Unix socket (or one client on stdio) from
//! a local store, for real Nix clients (`--store unix://PATH`, `NIX_REMOTE=daemon`).

use std::path::PathBuf;
use std::process::ExitCode;

use sluice_store::env_dirs::daemon_socket;
use sluice_store::store_url::StoreUrl;

/// Arguments of `sluice daemon`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The Unix socket to listen on (default: the socket systemd's socket activation passes,
    /// `LISTEN_FDS`; else `$NIX_DAEMON_SOCKET_PATH`, else `daemon-socket/socket` in the served
    /// store's state directory, as Nix 2.35's: `DIR/nix/var/nix` for a chroot store
    /// `local?root=DIR`, `$NIX_STATE_DIR` or `/nix/var/nix` for `local`).
    #[arg(long, conflicts_with = "stdio")]
    socket: Option<PathBuf>,
    /// Serve one client on standard input and output (as `nix-daemon --stdio`). Given twice
    /// it is the same as once: an `ssh-ng://` client appends it to a `remote-program` that may
    /// already say it.
    #[arg(long, overrides_with = "stdio")]
    stdio: bool,
    /// The store to serve: `local`, `local?root=DIR` or a path (a chroot store; default `$NIX_REMOTE` when it names a local store, else `local`), with
    /// the local store's parameters (`state`, `real`, `require-sigs`, …). Given more than once,
    /// the last one counts, as with Nix's options (a wrapper's `--store`, then the one Nix
    /// passes from `remote-store`).
    #[arg(long, overrides_with = "store")]
    store: Option<String>,
    /// Where the worker of a client that sends no CPU in its greeting (every Nix since 2.6)
    /// runs: `pin` puts the client's main thread and its worker on one CPU while it is
    /// connected (undone when it leaves; skipped for a client that narrowed its own affinity
    /// or that the daemon may not change; the threads and processes the client starts while
    /// connected inherit the pin); `auto` does the same for Nix's own clients (an executable
    /// named nix or nix-…) while they work alone, giving their CPUs back within 5 ms once they
    /// start a process, or a thread that lives longer than 20 ms, and before a NAR transfer, a
    /// build, a substitution or maintenance; `free` leaves both to the scheduler.
    #[arg(long, value_enum, default_value_t = ClientCpu::Auto)]
    client_cpu: ClientCpu,
    /// Build what no substituter has through the real `nix-daemon` listening on this socket
    /// (`unix:///nix/var/nix/daemon-socket/nix-build-socket`), which must serve the same store.
    /// sluice substitutes every input a cache has first, then forwards the build and relays
    /// its log to the client. Without it, builds fail.
    #[arg(long, value_name = "unix://PATH")]
    build_via: Option<String>,
    /// Settings over nix.conf's (`--option NAME VALUE`, `--substituters`, …), as
    /// `nix-daemon --option` takes them.
    #[command(flatten)]
    cache: crate::setup::CacheFlags,
}

/// `--client-cpu`: [`sluice_daemon::ClientCpu`].
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ClientCpu {
    Auto,
    Pin,
    Free,
}

/// Runs `sluice daemon` until it is killed (socket) or the client leaves (stdio).
pub fn run(args: Args) -> Result<ExitCode, String> {
    let activated = crate::systemd::listen_fds()?;
    let served = crate::setup::served_store(args.store.clone());
    let url = StoreUrl::parse(&served).map_err(|e| e.to_string())?;
    let store = url.as_local().ok_or_else(|| format!("{served}: the daemon serves a local store, not a {}", url.kind_name()))?;
    let config = crate::setup::raw_settings(&args.cache)?;
    let build_via = args.build_via.as_deref().map(build_socket).transpose()?;
    let options = sluice_daemon::DaemonOptions { client_cpu: args.client_cpu.into(), build_via };
    let daemon = sluice_daemon::Daemon::open_with(store, config, options).map_err(|e| e.to_string())?;
    let served = match (args.stdio, args.socket) {
        (true, _) => sluice_daemon::serve_stdio(daemon),
        (false, None) if !activated.is_empty() => {
            sluice_daemon::serve_listener(daemon, activated_socket(activated)?, "the socket systemd passed");
            Ok(())
        }
        (false, Some(socket)) => sluice_daemon::serve_socket(daemon, &socket),
        (false, None) => sluice_daemon::serve_socket(daemon, &daemon_socket(&store.dirs.state).map_err(|e| e.to_string())?),
    };
    served.map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}

/// The one Unix socket systemd passed (Nix's `nix-daemon` takes exactly one too).
fn activated_socket(mut fds: Vec<std::os::fd::OwnedFd>) -> Result<std::os::unix::net::UnixListener, String> {
    let fd = match (fds.pop(), fds.is_empty()) {
        (Some(fd), true) => fd,
        _ => return Err(format!("socket activation passed {} sockets; sluice daemon listens on one", fds.len() + 1)),
    };
    let listener = std::os::unix::net::UnixListener::from(fd);
    listener.local_addr().map_err(|e| format!("the socket systemd passed is not a Unix socket: {e}"))?;
    Ok(listener)
}

/// The socket path of a `--build-via` URL: `unix://` and an absolute path.
fn build_socket(url: &str) -> Result<PathBuf, String> {
    match url.strip_prefix("unix://") {
        Some(path) if path.starts_with('/') => Ok(PathBuf::from(path)),
        _ => Err(format!("--build-via {url}: expected unix:// and the absolute path of a nix-daemon's socket, e.g. unix:///nix/var/nix/daemon-socket/nix-build-socket")),
    }
}

impl From<ClientCpu> for sluice_daemon::ClientCpu {
    fn from(c: ClientCpu) -> Self {
        match c {
            ClientCpu::Auto => sluice_daemon::ClientCpu::Auto,
            ClientCpu::Pin => sluice_daemon::ClientCpu::Pin,
            ClientCpu::Free => sluice_daemon::ClientCpu::Free,
        }
    }
}
