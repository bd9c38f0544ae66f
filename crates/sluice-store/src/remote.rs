//! A client of a Nix daemon (`sluice daemon` or `nix-daemon`) over its Unix socket: the
//! worker protocol's client side (`RemoteStore` in Nix `src/libstore/remote-store.cc`), with
//! the old CPU-affinity hint. With `lock-cpu`, the client pins its thread to the CPU it is
//! running on and sends that CPU in the greeting (flag 1, then the CPU: protocol ≥ 1.14, as
//! Nix 1.6–2.5 did), so that a daemon which honours it (sluice does) runs the connection's
//! worker on the same CPU and each round trip avoids a cross-CPU wake-up.

use std::io::{BufReader, BufWriter, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::{
    read_bool, read_build_result, read_keyed_build_result, read_stderr_message, read_string, read_u64, read_unkeyed_path_info,
    write_basic_derivation, write_bytes, write_derived_path, write_u64, BasicDerivation, BuildMode, BuildResult, DerivedPath, ProtocolVersion,
    StderrMessage, WireError, WORKER_MAGIC_1, WORKER_MAGIC_2,
};

use sluice_nix::path_info::ValidPathInfo;

/// The protocol version this client speaks: 1.34 (Nix 2.8's), so that no 1.35+ field is
/// expected; the daemon answers with min(its version, ours) as a whole.
pub const CLIENT_VERSION: ProtocolVersion = ProtocolVersion::new(1, 34);

/// The oldest daemon this client talks to (1.21: path info with signatures, no legacy forms).
const MIN_DAEMON_VERSION: ProtocolVersion = ProtocolVersion::new(1, 21);

/// Most request bytes written before their replies are read: well below a Unix socket's send
/// buffer (≈ 208 KiB by default), so that writing a batch never waits for the daemon, which
/// may itself be waiting for its replies to be read.
pub const PIPELINE_BYTES: usize = 64 << 10;

const OP_IS_VALID_PATH: u64 = 1;
const OP_BUILD_PATHS: u64 = 9;
const OP_SET_OPTIONS: u64 = 19;
const OP_QUERY_PATH_INFO: u64 = 26;
const OP_BUILD_DERIVATION: u64 = 36;
const OP_BUILD_PATHS_WITH_RESULTS: u64 = 46;

/// Receives the stderr messages of an operation (log lines, activities, results) as they
/// come, to pass them on; an error stops the operation ([`RemoteError::Relay`]).
pub type Relay<'a> = &'a mut dyn FnMut(&StderrMessage) -> std::io::Result<()>;

/// The numeric settings of SetOptions, in Nix's order (`RemoteStore::setOptions` in
/// `remote-store.cc`): keepFailed, keepGoing, tryFallback, verbosity, maxBuildJobs,
/// maxSilentTime, useBuildHook (obsolete, 1), verboseBuild (as a verbosity), logType and
/// printBuildTrace (obsolete, 0), buildCores, useSubstitutes.
pub type ClientSettings = [u64; 12];

/// The index of useSubstitutes in [`ClientSettings`].
pub const USE_SUBSTITUTES: usize = 11;

/// Errors talking to a daemon. Each names the socket and what was being done.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The socket could not be connected to.
    #[error("connecting to the daemon at {}: {source}", socket.display())]
    Connect { socket: PathBuf, #[source] source: std::io::Error },
    /// Reading from or writing to the connection failed.
    #[error("daemon at {}: {what}: {source}", socket.display())]
    Io { socket: PathBuf, what: &'static str, #[source] source: std::io::Error },
    /// The daemon sent something malformed.
    #[error("daemon at {}: {what}: {source}", socket.display())]
    Wire { socket: PathBuf, what: &'static str, #[source] source: WireError },
    /// The peer is not a daemon this client can talk to.
    #[error("daemon at {}: {message}", socket.display())]
    Protocol { message: String, socket: PathBuf },
    /// The daemon reported that the operation failed.
    #[error("daemon at {}: {what}: {message}", socket.display())]
    Daemon { socket: PathBuf, what: &'static str, message: String },
    /// Passing on the daemon's messages failed (see [`Relay`]).
    #[error("relaying the messages of the daemon at {}: {source}", socket.display())]
    Relay { socket: PathBuf, #[source] source: std::io::Error },
}

/// A connection to a daemon. Not shareable between threads: the worker protocol is one
/// request at a time.
pub struct RemoteStore {
    socket: PathBuf,
    r: BufReader<UnixStream>,
    w: BufWriter<UnixStream>,
    version: ProtocolVersion,
    store_dir: StoreDir,
    daemon_version: Option<String>,
    pinned_cpu: Option<usize>,
}

impl RemoteStore {
    /// Connects to the daemon at `socket` and greets it. With `lock_cpu`, first pins the
    /// calling thread, for the rest of its life, to the CPU it runs on (if that fails, the
    /// connection goes on unpinned and sends no hint) and asks the daemon to run its worker
    /// there.
    pub fn connect(socket: &Path, lock_cpu: bool) -> Result<Self, RemoteError> {
        let stream = UnixStream::connect(socket).map_err(|source| RemoteError::Connect { socket: socket.to_owned(), source })?;
        let reader = stream.try_clone().map_err(|source| RemoteError::Connect { socket: socket.to_owned(), source })?;
        let mut store = RemoteStore {
            socket: socket.to_owned(),
            r: BufReader::with_capacity(64 * 1024, reader),
            w: BufWriter::with_capacity(64 * 1024, stream),
            version: CLIENT_VERSION,
            store_dir: StoreDir::default(),
            daemon_version: None,
            pinned_cpu: if lock_cpu { pin_to_current_cpu() } else { None },
        };
        store.greet()?;
        Ok(store)
    }

    /// The negotiated protocol version.
    pub fn version(&self) -> ProtocolVersion {
        self.version
    }

    /// The daemon's version string (sent by daemons ≥ 1.33).
    pub fn daemon_version(&self) -> Option<&str> {
        self.daemon_version.as_deref()
    }

    /// The CPU this client pinned itself to and named to the daemon, if any.
    pub fn pinned_cpu(&self) -> Option<usize> {
        self.pinned_cpu
    }

    /// The store directory paths are shown in (`/nix/store`).
    pub fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    /// Whether `path` is valid in the daemon's store.
    pub fn is_valid_path(&mut self, path: &StorePath) -> Result<bool, RemoteError> {
        self.request(OP_IS_VALID_PATH, path, "IsValidPath")?;
        let valid = read_bool(&mut self.r, "validity");
        valid.map_err(self.wire_err("reading the IsValidPath result"))
    }

    /// The registration of `path`, or `None` if it is not valid.
    pub fn query_path_info(&mut self, path: &StorePath) -> Result<Option<ValidPathInfo>, RemoteError> {
        self.request(OP_QUERY_PATH_INFO, path, "QueryPathInfo")?;
        self.read_path_info(path)
    }

    /// The registrations of `paths` (`None` for each that is not valid), in order. The
    /// requests are pipelined: up to [`PIPELINE_BYTES`] of them are written at once and then
    /// their replies read, so a batch costs one round trip per few hundred paths instead of
    /// one per path (the daemon serves requests one after another, in order). After an error
    /// the rest of the batch's replies are unread: drop the connection.
    pub fn query_path_infos(&mut self, paths: &[StorePath]) -> Result<Vec<Option<ValidPathInfo>>, RemoteError> {
        let mut infos = Vec::with_capacity(paths.len());
        let mut rest = paths;
        while !rest.is_empty() {
            let io = self.io_err("QueryPathInfo");
            let (mut sent, mut bytes) = (0, 0);
            while sent < rest.len() && bytes < PIPELINE_BYTES {
                let shown = self.store_dir.display_path(&rest[sent]);
                write_u64(&mut self.w, OP_QUERY_PATH_INFO).and_then(|()| write_bytes(&mut self.w, shown.as_bytes())).map_err(&io)?;
                bytes += 16 + shown.len().next_multiple_of(8);
                sent += 1;
            }
            self.w.flush().map_err(&io)?;
            for path in &rest[..sent] {
                self.finish_stderr("QueryPathInfo")?;
                infos.push(self.read_path_info(path)?);
            }
            rest = &rest[sent..];
        }
        Ok(infos)
    }

    /// Reads a QueryPathInfo result (after `LAST`) for `path`.
    fn read_path_info(&mut self, path: &StorePath) -> Result<Option<ValidPathInfo>, RemoteError> {
        let what = "reading the QueryPathInfo result";
        if !read_bool(&mut self.r, "validity").map_err(self.wire_err(what))? {
            return Ok(None);
        }
        let info = read_unkeyed_path_info(&mut self.r, &self.store_dir, self.version, path.clone()).map_err(self.wire_err(what))?;
        Ok(Some(info))
    }

    /// SetOptions (op 19) with the numeric settings `settings` and no overrides.
    pub fn set_options(&mut self, settings: &ClientSettings) -> Result<(), RemoteError> {
        let io = self.io_err("SetOptions");
        write_u64(&mut self.w, OP_SET_OPTIONS).map_err(&io)?;
        for n in settings {
            write_u64(&mut self.w, *n).map_err(&io)?;
        }
        write_u64(&mut self.w, 0).and_then(|()| self.w.flush()).map_err(&io)?;
        self.finish_stderr("SetOptions")
    }

    /// BuildPaths (op 9): realises `targets` in `mode` (Nix `RemoteStore::buildPaths`),
    /// passing the daemon's messages to `relay`. The daemon's error if any target failed.
    pub fn build_paths(&mut self, targets: &[DerivedPath], mode: BuildMode, relay: Relay) -> Result<(), RemoteError> {
        let what = "BuildPaths";
        self.send_derived_paths(OP_BUILD_PATHS, targets, mode, what)?;
        self.relay_stderr(what, relay)?;
        read_u64(&mut self.r, "BuildPaths result").map_err(self.wire_err(what))?;
        Ok(())
    }

    /// BuildPathsWithResults (op 46, daemons of protocol ≥ 1.34): realises `targets` in
    /// `mode` (Nix `RemoteStore::buildPathsWithResults`), passing the daemon's messages to
    /// `relay`; a result per target, keyed by the target as the daemon names it.
    pub fn build_paths_with_results(&mut self, targets: &[DerivedPath], mode: BuildMode, relay: Relay) -> Result<Vec<(DerivedPath, BuildResult)>, RemoteError> {
        let what = "BuildPathsWithResults";
        if !self.version.at_least(34) {
            let message = format!("{what} needs protocol 1.34 (Nix 2.8), the daemon speaks {}", self.version);
            return Err(RemoteError::Protocol { message, socket: self.socket.clone() });
        }
        self.send_derived_paths(OP_BUILD_PATHS_WITH_RESULTS, targets, mode, what)?;
        self.relay_stderr(what, relay)?;
        let n = read_u64(&mut self.r, "build result count").map_err(self.wire_err(what))?;
        if n > targets.len() as u64 {
            let message = format!("{what}: {n} results for {} paths", targets.len());
            return Err(RemoteError::Protocol { message, socket: self.socket.clone() });
        }
        let mut results = Vec::with_capacity(n as usize);
        for _ in 0..n {
            results.push(read_keyed_build_result(&mut self.r, &self.store_dir, self.version).map_err(self.wire_err(what))?);
        }
        Ok(results)
    }

    /// BuildDerivation (op 36): builds `drv`, the derivation at `drv_path` in wire form, in
    /// `mode` (Nix `putBuildDerivationRequest`, `worker-protocol-connection.cc`), passing the
    /// daemon's messages to `relay`. The result in the negotiated version's form.
    pub fn build_derivation(&mut self, drv_path: &StorePath, drv: &BasicDerivation, mode: BuildMode, relay: Relay) -> Result<BuildResult, RemoteError> {
        let what = "BuildDerivation";
        let io = self.io_err(what);
        let name = drv_path.name().strip_suffix(".drv").unwrap_or(drv_path.name());
        let shown = self.store_dir.display_path(drv_path);
        write_u64(&mut self.w, OP_BUILD_DERIVATION).and_then(|()| write_bytes(&mut self.w, shown.as_bytes())).map_err(&io)?;
        write_basic_derivation(&mut self.w, &self.store_dir, name, drv).and_then(|()| mode.write(&mut self.w)).and_then(|()| self.w.flush()).map_err(&io)?;
        self.relay_stderr(what, relay)?;
        read_build_result(&mut self.r, self.version).map_err(self.wire_err(what))
    }

    /// Sends operation `op` with `targets` and `mode`.
    fn send_derived_paths(&mut self, op: u64, targets: &[DerivedPath], mode: BuildMode, what: &'static str) -> Result<(), RemoteError> {
        let io = self.io_err(what);
        write_u64(&mut self.w, op).and_then(|()| write_u64(&mut self.w, targets.len() as u64)).map_err(&io)?;
        for t in targets {
            write_derived_path(&mut self.w, &self.store_dir, self.version, t).map_err(&io)?;
        }
        mode.write(&mut self.w).and_then(|()| self.w.flush()).map_err(&io)
    }

    /// The greeting: magic numbers, versions, the affinity hint, obsolete reserveSpace, the
    /// daemon's version string and trust flag, then its startup messages up to `LAST`.
    fn greet(&mut self) -> Result<(), RemoteError> {
        let what = "greeting";
        let io = self.io_err(what);
        write_u64(&mut self.w, WORKER_MAGIC_1).and_then(|()| self.w.flush()).map_err(io)?;
        let magic = read_u64(&mut self.r, "daemon magic").map_err(self.wire_err(what))?;
        if magic != WORKER_MAGIC_2 {
            return Err(RemoteError::Protocol { message: format!("not a Nix daemon (it answered {magic:#x})"), socket: self.socket.clone() });
        }
        let daemon = ProtocolVersion::from_wire(read_u64(&mut self.r, "daemon version").map_err(self.wire_err(what))?);
        if daemon.major != 1 || daemon < MIN_DAEMON_VERSION {
            let message = format!("unsupported daemon protocol {daemon} (this client needs 1.21 to 1.x)");
            return Err(RemoteError::Protocol { message, socket: self.socket.clone() });
        }
        self.version = daemon.min(CLIENT_VERSION);
        let io = self.io_err(what);
        write_u64(&mut self.w, CLIENT_VERSION.to_wire()).map_err(&io)?;
        match self.pinned_cpu {
            Some(cpu) => write_u64(&mut self.w, 1).and_then(|()| write_u64(&mut self.w, cpu as u64)),
            None => write_u64(&mut self.w, 0),
        }
        .map_err(&io)?;
        write_u64(&mut self.w, 0).and_then(|()| self.w.flush()).map_err(&io)?;
        if self.version.at_least(33) {
            let v = read_string(&mut self.r, 1024, "daemon version string").map_err(self.wire_err(what))?;
            self.daemon_version = Some(v);
        }
        self.finish_stderr(what)
    }

    /// Sends an operation taking one store path.
    fn request(&mut self, op: u64, path: &StorePath, what: &'static str) -> Result<(), RemoteError> {
        let shown = self.store_dir.display_path(path);
        let io = self.io_err(what);
        write_u64(&mut self.w, op).and_then(|()| write_bytes(&mut self.w, shown.as_bytes())).and_then(|()| self.w.flush()).map_err(io)?;
        self.finish_stderr(what)
    }

    /// Reads stderr messages up to `LAST` (log lines go to the log) or `ERROR`.
    fn finish_stderr(&mut self, what: &'static str) -> Result<(), RemoteError> {
        self.relay_stderr(what, &mut |m: &StderrMessage| {
            match m {
                StderrMessage::Next(line) => tracing::info!("{}", line.trim_end()),
                StderrMessage::StartActivity { text, .. } if !text.is_empty() => tracing::debug!("{text}"),
                _ => {}
            }
            Ok(())
        })
    }

    /// Reads stderr messages up to `LAST` or `ERROR` (Nix `processStderr`), passing each
    /// other one to `relay` as it comes.
    fn relay_stderr(&mut self, what: &'static str, relay: Relay) -> Result<(), RemoteError> {
        loop {
            match read_stderr_message(&mut self.r, self.version).map_err(self.wire_err(what))? {
                StderrMessage::Last => return Ok(()),
                StderrMessage::Error(message) => return Err(RemoteError::Daemon { socket: self.socket.clone(), what, message }),
                m => relay(&m).map_err(|source| RemoteError::Relay { socket: self.socket.clone(), source })?,
            }
        }
    }

    fn io_err(&self, what: &'static str) -> impl Fn(std::io::Error) -> RemoteError {
        let socket = self.socket.clone();
        move |source| RemoteError::Io { socket: socket.clone(), what, source }
    }

    fn wire_err(&self, what: &'static str) -> impl FnOnce(WireError) -> RemoteError {
        let socket = self.socket.clone();
        move |source| RemoteError::Wire { socket, what, source }
    }
}

/// Pins the calling thread to the CPU it is running on; that CPU, or `None` (logged) if it
/// cannot be done.
fn pin_to_current_cpu() -> Option<usize> {
    let cpu = rustix::process::sched_getcpu();
    let mut set = rustix::process::CpuSet::new();
    set.set(cpu);
    match rustix::process::sched_setaffinity(None, &set) {
        Ok(()) => Some(cpu),
        Err(e) => {
            tracing::info!("lock-cpu: cannot pin this thread to CPU {cpu}: {e}");
            None
        }
    }
}

/// A daemon behind the [`Store`](crate::store::Store) interface: one connection, used by one
/// blocking thread at a time. Only queries are supported: sluice's client does not yet speak
/// `NarFromPath` or `AddToStoreNar`, so a daemon can be the subject of `path-info` and
/// `missing` but neither end of a copy.
pub struct DaemonStore {
    url: String,
    store_dir: StoreDir,
    conn: std::sync::Arc<std::sync::Mutex<RemoteStore>>,
}

impl DaemonStore {
    /// Connects to the daemon at `socket` (opened as `url`), without CPU pinning.
    pub fn connect(url: &str, socket: &Path) -> Result<Self, RemoteError> {
        let conn = RemoteStore::connect(socket, false)?;
        Ok(DaemonStore { url: url.to_string(), store_dir: conn.store_dir().clone(), conn: std::sync::Arc::new(std::sync::Mutex::new(conn)) })
    }

    fn unsupported<T>(&self, what: &'static str) -> crate::store::StoreFuture<'_, T> {
        let err = crate::store::StoreError::Unsupported { url: self.url.clone(), what };
        Box::pin(async move { Err(err) })
    }
}

impl crate::store::Store for DaemonStore {
    fn url(&self) -> &str {
        &self.url
    }

    fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> crate::store::StoreFuture<'a, Vec<Option<ValidPathInfo>>> {
        let (conn, paths) = (self.conn.clone(), paths.to_vec());
        Box::pin(async move {
            let infos = tokio::task::spawn_blocking(move || conn.lock().unwrap_or_else(|p| p.into_inner()).query_path_infos(&paths));
            let infos = infos.await.map_err(|e| crate::store::StoreError::Other(format!("{}: {e}", self.url)))?;
            Ok(infos?)
        })
    }

    fn nar_from_path<'a>(&'a self, _: &'a ValidPathInfo) -> crate::store::StoreFuture<'a, crate::store::NarReader> {
        self.unsupported("reading a NAR (NarFromPath)")
    }

    fn add_to_store<'a>(&'a self, _: ValidPathInfo, _: crate::store::NarReader, _: crate::store::PublishGate) -> crate::store::StoreFuture<'a, ()> {
        self.unsupported("adding a path (AddToStoreNar)")
    }

    fn parallelism(&self) -> usize {
        1
    }
}
