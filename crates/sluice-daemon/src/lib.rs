//! `sluice daemon`: a Nix worker-protocol daemon (the server side of `unix://` and
//! `ssh-ng://` stores) on a sluice [`LocalStore`]. Real, unmodified Nix clients (2.8 speaks
//! protocol 1.34, Nix 2.24 and later 1.38 with features) connect to its Unix socket or talk to
//! it on stdio.
//!
//! One worker thread per connection (no fork), all sharing one store handle (one SQLite
//! connection with its prepared statements; opened again for the next connections when its
//! directories are replaced) and one async runtime for substitution. Sources of
//! the behaviour: Nix `src/libstore/daemon.cc` (ops, stderr tunnel, client settings),
//! `src/nix/unix/daemon.cc` (socket, peer credentials, trusted/allowed users),
//! `worker-protocol-connection.cc` (handshake). The wire formats are `sluice_nix::wire`.

mod affinity;
mod conn;
mod duplex;
mod handshake;
mod legacy_serve;
mod limits;
mod ops;
mod options;
mod server;
mod substitution;
mod trust;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sluice_local_store::{LocalStore, LocalStoreError};
use sluice_store::config::RawConfig;
use sluice_store::store_url::LocalStoreConfig;

pub use legacy_serve::{serve_legacy_stdio, LegacyServeError};
pub use server::{serve_listener, serve_socket, serve_stdio};

/// The worker-protocol version this daemon speaks at most: 1.38 (Nix 2.24: the feature
/// exchange, [`FEATURES`]; 1.37 CPU times in build results; 1.36 AddPermRoot; 1.35 the
/// trusted flag).
pub const PROTOCOL_VERSION: sluice_nix::wire::ProtocolVersion = sluice_nix::wire::ProtocolVersion::new(1, 38);

/// The protocol features offered to clients of protocol ≥ 1.38: DeterminateSystems' batch
/// operations AddTempRoots (op 49) and QueryPathInfos (op 50), and sluice's QueryClosureInfos
/// (`sluice-query-closure`). Upstream's
/// `delete-dead-specific-referrers` and `realisation-with-path-not-hash` (Nix 2.35) change the
/// forms of CollectGarbage, build results and realisations, which sluice does not speak.
pub const FEATURES: &[&str] = &[
    sluice_nix::wire::features::ADD_TEMP_ROOTS,
    sluice_nix::wire::features::QUERY_PATH_INFOS,
    sluice_nix::wire::features::SLUICE_QUERY_CLOSURE,
];

/// The oldest client version accepted: 1.21 (Nix 2.0; AddToStoreNar through `STDERR_READ`).
pub const MIN_CLIENT_VERSION: sluice_nix::wire::ProtocolVersion = sluice_nix::wire::ProtocolVersion::new(1, 21);

/// The version string sent to clients of protocol ≥ 1.33 (Nix prints it in `nix store info`;
/// Nix's tests compare it with the daemon's `nix --version`): the Nix release that introduced
/// the newest protocol sluice speaks (2.24.0, protocol 1.38), so that what a client expects of
/// that release (the trusted flag, features) is what it gets, with sluice's version as
/// build metadata (`+sluice.X.Y.Z`: one word, as Nix's tests cut it; semver precedence and
/// Nix's `compareVersions` both place it at 2.24.0, before 2.24.1).
pub const NIX_VERSION: &str = concat!("2.24.0+sluice.", env!("CARGO_PKG_VERSION"));

/// Errors starting or running the daemon (each names the file or socket concerned).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("opening the store: {0}")]
    Store(#[from] LocalStoreError),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("daemon settings: {0}")]
    Config(#[from] sluice_store::config::ConfigError),
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// What all connections share: the store, the daemon's own settings, and the runtime and open
/// substituters used for substitution.
pub struct Daemon {
    /// The store new connections use ([`Daemon::connection_store`]).
    store: Mutex<Arc<LocalStore>>,
    /// What the store is opened from.
    store_config: LocalStoreConfig,
    /// The store URL's `require-sigs`, which wins over the setting (`SignaturePolicy::requires_sigs`).
    store_require_sigs: Option<bool>,
    /// The daemon's settings (nix.conf, `NIX_CONFIG`); clients' overrides apply on top.
    config: RawConfig,
    users: trust::Users,
    runtime: tokio::runtime::Runtime,
    /// Activity ids: the daemon's pid in the high 32 bits, as Nix does, then a counter.
    next_activity: AtomicU64,
    /// Whether a client that sends no CPU is placed on one CPU with its worker.
    client_cpu: ClientCpu,
    /// How many connections are placed on each CPU.
    cpu_use: affinity::CpuUse,
    /// The socket of the Nix daemon that builds what no substituter has.
    build_via: Option<PathBuf>,
    /// Open substituters, shared by all connections (see [`substitution::Session`]).
    sessions: substitution::Sessions,
}

/// Where a connection's worker and its client run, for clients that send no CPU (Nix ≥ 2.6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClientCpu {
    /// As [`ClientCpu::Pin`], for Nix's own clients (an executable named `nix` or `nix-…`)
    /// while they work alone (the default): the client's pin is given back as soon as its
    /// main thread starts a process (seen within 5 ms), or the client a thread that lives
    /// longer than 20 ms (Nix 2.8's thread per AddToStore reply ends with the request), or
    /// before an operation after which clients work in parallel (NAR transfers, builds,
    /// substitutions, maintenance), and the worker's at its next request. Only a client whose
    /// children the daemon can list (`/proc/<pid>/task/<pid>/children`) is pinned. Other
    /// programs are left free: a thread or process started by a pinned thread runs on its one
    /// CPU until the watcher sees it, which under load can be long enough for a program to
    /// size its thread pool by that one CPU (a test binary whose raw clients got its main
    /// thread pinned started test threads, whose Nix 2.26 wrote a parallel xz in one block).
    #[default]
    Auto,
    /// The client's main thread and its worker are pinned to one CPU (the least used by the
    /// daemon's connections) while connected, when the daemon may change the client's affinity
    /// (root, or the client's own user) and the client has not narrowed it; the client's
    /// threads and children get their affinity back when it disconnects. Each round trip then
    /// stays on one CPU; but every thread and process the client starts while connected runs
    /// on that CPU too (affinity is inherited), so a client that works in parallel is slowed.
    Pin,
    /// Both run where the scheduler puts them.
    Free,
}

impl ClientCpu {
    /// Whether client process `pid`, which sent no CPU, is placed on one CPU with its worker.
    fn places(self, pid: i32) -> bool {
        match self {
            ClientCpu::Auto => affinity::runs_nix(pid),
            ClientCpu::Pin => true,
            ClientCpu::Free => false,
        }
    }
}

/// Daemon options beyond the store and its settings.
#[derive(Debug, Clone, Default)]
pub struct DaemonOptions {
    /// Where the worker of a client that sends no CPU in its greeting (every Nix since 2.6)
    /// runs: see [`ClientCpu`].
    pub client_cpu: ClientCpu,
    /// The Unix socket of a real `nix-daemon` serving the same store: derivation outputs that
    /// no substituter has are built through it (BuildPaths, BuildPathsWithResults,
    /// BuildDerivation), after sluice has substituted every input a cache has. Without it,
    /// such builds fail with an error saying that sluice does not build.
    pub build_via: Option<PathBuf>,
}

impl Daemon {
    /// Opens the local store `store` (Nix's `LocalStoreConfig`, `src/libstore/local-store.hh`)
    /// with the daemon settings `config` (`trusted-users`, `allowed-users`, `substituters`, …).
    /// The store's `require-sigs`, when given, wins over that setting (and a client's);
    /// `auto-optimise-store` is the daemon's for every client (Nix applies a trusted client's
    /// override in its forked worker; sluice's store is shared). A read-only
    /// store is refused: connections write temporary roots.
    pub fn open(store: &LocalStoreConfig, config: RawConfig) -> Result<Arc<Self>, DaemonError> {
        Self::open_with(store, config, DaemonOptions::default())
    }

    /// [`open`](Self::open) with `options`.
    pub fn open_with(store: &LocalStoreConfig, config: RawConfig, options: DaemonOptions) -> Result<Arc<Self>, DaemonError> {
        let store_config = store.clone();
        let store = Mutex::new(open_store(&store_config, &config)?);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("sluice-substitute")
            .enable_all()
            .build()
            .map_err(DaemonError::Runtime)?;
        Ok(Arc::new(Daemon {
            store,
            store_require_sigs: store_config.require_sigs,
            store_config,
            users: trust::Users::from_config(&config),
            config,
            runtime,
            next_activity: AtomicU64::new(u64::from(std::process::id()) << 32),
            client_cpu: options.client_cpu,
            cpu_use: affinity::CpuUse::default(),
            build_via: options.build_via,
            sessions: substitution::Sessions::default(),
        }))
    }

    /// The store for a new connection to use while it lasts: the one open, unless its store
    /// directory or database was deleted or replaced since (see
    /// [`LocalStore::is_current`]), when the store is opened again, making what is missing,
    /// as a `nix-daemon` worker opens it for each connection (`src/nix/unix/daemon.cc`).
    /// Connections in progress keep the store they started with.
    pub fn connection_store(&self) -> Result<Arc<LocalStore>, DaemonError> {
        let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        if !store.is_current() {
            tracing::info!("the store {} or its database was replaced: opening it again", self.store_config.dirs.real.display());
            *store = open_store(&self.store_config, &self.config)?;
        }
        Ok(Arc::clone(&store))
    }

    fn activity_id(&self) -> u64 {
        self.next_activity.fetch_add(1, Ordering::Relaxed)
    }
}

/// Opens the local store `config` with the daemon settings `raw` applied, refusing a
/// read-only store: connections write temporary roots.
fn open_store(config: &LocalStoreConfig, raw: &RawConfig) -> Result<Arc<LocalStore>, DaemonError> {
    let store = Arc::new(LocalStore::open(config)?);
    sluice_store::config::Settings::from_raw(raw)?.configure_local_store(&store);
    store.ensure_writable("serve it (the daemon writes temporary roots)")?;
    Ok(store)
}
