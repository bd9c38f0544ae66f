//! A client of a Nix daemon (`sluice daemon` or `nix-daemon`) over its Unix socket: the
//! worker protocol's client side (`RemoteStore` in Nix `src/libstore/remote-store.cc`):
//! queries, a NAR read (NarFromPath), additions (AddToStoreNar, AddMultipleToStore) and the build operations,
//! with the old CPU-affinity hint; and [`DaemonStore`], a daemon behind the
//! [`Store`](crate::store::Store) interface. With `lock-cpu`, the client pins its thread to the CPU it is
//! running on and sends that CPU in the greeting (flag 1, then the CPU: protocol ≥ 1.14, as
//! Nix 1.6–2.5 did), so that a daemon which honours it (sluice does) runs the connection's
//! worker on the same CPU and each round trip avoids a cross-CPU wake-up.

use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::{
    read_bool, read_build_result, read_keyed_build_result, read_stderr_message, read_string, read_u64, read_unkeyed_path_info,
    write_basic_derivation, write_bool, write_bytes, write_derived_path, write_keyed_path_info, write_string_pairs, write_u64, BasicDerivation, BuildMode,
    BuildResult, DerivedPath, FramedWriter, ProtocolVersion, StderrMessage, WireError, WORKER_MAGIC_1, WORKER_MAGIC_2,
};

use sluice_nix::path_info::{PathInfo, ValidPathInfo};

use crate::store::{NarReader, PipedNar, PublishGate, StoreError, StoreFuture};

mod batch;

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
const OP_NAR_FROM_PATH: u64 = 38;
const OP_ADD_TO_STORE_NAR: u64 = 39;
const OP_ADD_MULTIPLE_TO_STORE: u64 = 44;
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
    /// Reading the NAR of `path` to send it failed (the daemon was sent a cut-short NAR,
    /// which it refuses).
    #[error("daemon at {}: reading the NAR of {path} to add it: {source}", socket.display())]
    Nar { socket: PathBuf, path: String, #[source] source: std::io::Error },
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

    /// NarFromPath (op 38): the NAR of the valid path `path`, `nar_size` bytes (its registered
    /// size), into `sink` (Nix `RemoteStore::narFromPath`: after `LAST`, the bare NAR). The
    /// whole NAR is read even when writing `sink` fails, so that the connection stays in step:
    /// that failure is the inner result.
    pub fn nar_from_path(&mut self, path: &StorePath, nar_size: u64, sink: &mut dyn Write) -> Result<std::io::Result<()>, RemoteError> {
        self.request(OP_NAR_FROM_PATH, path, "NarFromPath")?;
        let io = self.io_err("reading the NAR (NarFromPath)");
        let (mut nar, mut buf, mut written) = ((&mut self.r).take(nar_size), vec![0u8; 64 << 10], Ok(()));
        loop {
            let n = match nar.read(&mut buf) {
                Ok(0) if nar.limit() > 0 => return Err(io(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(0) => return Ok(written),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io(e)),
            };
            if written.is_ok() {
                written = sink.write_all(&buf[..n]);
            }
        }
    }

    /// AddToStoreNar (op 39, daemons of protocol ≥ 1.23): adds `info.path` from the NAR read
    /// from `nar`, as Nix's `RemoteStore::addToStore` sends it: the info in its keyed form,
    /// repair (false), dontCheckSigs (`!check_sigs`; a daemon checks an untrusted client's
    /// signatures anyway), then the NAR as a framed stream while another thread reads the
    /// daemon's messages (`withFramedSink`). The daemon checks the NAR against `info`. A failed
    /// read of `nar` ends the stream there (the daemon refuses the cut-short NAR) and is the
    /// error ([`RemoteError::Nar`]).
    pub fn add_to_store_nar(&mut self, info: &ValidPathInfo, nar: &mut dyn Read, check_sigs: bool) -> Result<(), RemoteError> {
        let what = "AddToStoreNar";
        if !self.version.at_least(23) {
            let message = format!("{what} needs protocol 1.23 (Nix 2.4), the daemon speaks {}", self.version);
            return Err(RemoteError::Protocol { message, socket: self.socket.clone() });
        }
        let io = self.io_err(what);
        write_u64(&mut self.w, OP_ADD_TO_STORE_NAR).map_err(&io)?;
        write_keyed_path_info(&mut self.w, &self.store_dir, self.version, info).map_err(&io)?;
        write_bool(&mut self.w, false).and_then(|()| write_bool(&mut self.w, !check_sigs)).map_err(&io)?;
        let (socket, shown) = (self.socket.clone(), self.store_dir.display_path(&info.path));
        self.with_framed_sink(what, |out| Ok(copy_nar(nar, out)?.map(drop).map_err(|source| RemoteError::Nar { socket, path: shown, source })))
    }

    /// AddMultipleToStore (op 44, daemons of protocol ≥ 1.32): adds every path of `paths`, in
    /// order, in one operation, as Nix's `RemoteStore::addMultipleToStore` sends it: repair
    /// (false), dontCheckSigs (`!check_sigs`), then one framed stream of the count and, per
    /// path, its keyed info in the protocol 1.16 form followed by exactly `NarSize` bytes of
    /// its NAR. The daemon adds them one after another and stops at the first it refuses (its
    /// error is the result; the paths before it are added). A NAR that cannot be read, or
    /// ends before its `NarSize`, ends the stream there ([`RemoteError::Nar`]).
    pub fn add_multiple_to_store(&mut self, paths: &mut [(&ValidPathInfo, &mut dyn Read)], check_sigs: bool) -> Result<(), RemoteError> {
        let what = "AddMultipleToStore";
        if !self.version.at_least(batch::MULTIPLE_VERSION) {
            let message = format!("{what} needs protocol 1.32 (Nix 2.4), the daemon speaks {}", self.version);
            return Err(RemoteError::Protocol { message, socket: self.socket.clone() });
        }
        let io = self.io_err(what);
        write_u64(&mut self.w, OP_ADD_MULTIPLE_TO_STORE).map_err(&io)?;
        write_bool(&mut self.w, false).and_then(|()| write_bool(&mut self.w, !check_sigs)).map_err(&io)?;
        let (socket, dir) = (self.socket.clone(), self.store_dir.clone());
        self.with_framed_sink(what, |out| {
            write_u64(out, paths.len() as u64)?;
            for (info, nar) in paths.iter_mut() {
                write_keyed_path_info(out, &dir, ProtocolVersion::new(1, 16), info)?;
                let read = copy_nar(&mut nar.take(info.nar_size), out)?.and_then(|n| match n == info.nar_size {
                    true => Ok(()),
                    false => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("the NAR ended after {n} of its {} bytes", info.nar_size))),
                });
                if let Err(source) = read {
                    return Ok(Err(RemoteError::Nar { socket, path: dir.display_path(&info.path), source }));
                }
            }
            Ok(Ok(()))
        })
    }

    /// Flushes the request written so far, then sends the framed stream `send` writes while
    /// a second thread reads the daemon's messages (Nix's `withFramedSink`: the daemon may
    /// answer, or fail, before the stream ends). The connection's failure first, then
    /// `send`'s own (a NAR that could not be read: the stream is ended where it stopped), then
    /// the daemon's answer.
    fn with_framed_sink(&mut self, what: &'static str, send: impl FnOnce(&mut dyn Write) -> std::io::Result<Result<(), RemoteError>>) -> Result<(), RemoteError> {
        let io = self.io_err(what);
        self.w.flush().map_err(&io)?;
        let RemoteStore { socket, r, w, version, .. } = self;
        let (sent, replied) = std::thread::scope(|scope| {
            let daemon = scope.spawn(|| relay_stderr(r, *version, socket, what, &mut log_message));
            let sent = (|| {
                // Frames of up to 64 KiB: the infos' small writes are gathered.
                let mut framed = BufWriter::with_capacity(64 << 10, FramedWriter::new(&mut *w));
                let outcome = send(&mut framed)?;
                framed.into_inner().map_err(std::io::IntoInnerError::into_error)?.finish()?.flush()?;
                Ok(outcome)
            })();
            (sent, daemon.join())
        });
        let replied = replied.unwrap_or_else(|_| Err(RemoteError::Protocol { message: format!("{what}: the thread reading the daemon's messages panicked"), socket: self.socket.clone() }));
        match sent {
            Ok(Ok(())) => replied,
            Ok(Err(nar)) => Err(nar),
            Err(e) => Err(io(e)),
        }
    }

    /// SetOptions (op 19) with the numeric settings `settings` and the setting overrides
    /// `overrides` (name, value), as Nix's `RemoteStore::setOptions` sends them
    /// (`remote-store.cc`; overrides are in every protocol sluice speaks, ≥ 1.21). The
    /// daemon's error if it refuses them.
    pub fn set_options(&mut self, settings: &ClientSettings, overrides: &[(String, String)]) -> Result<(), RemoteError> {
        let io = self.io_err("SetOptions");
        write_u64(&mut self.w, OP_SET_OPTIONS).map_err(&io)?;
        for n in settings {
            write_u64(&mut self.w, *n).map_err(&io)?;
        }
        write_string_pairs(&mut self.w, overrides.iter().map(|(k, v)| (k, v))).and_then(|()| self.w.flush()).map_err(&io)?;
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
        self.relay_stderr(what, &mut log_message)
    }

    /// Reads stderr messages up to `LAST` or `ERROR`, passing each other one to `relay`.
    fn relay_stderr(&mut self, what: &'static str, relay: Relay) -> Result<(), RemoteError> {
        relay_stderr(&mut self.r, self.version, &self.socket, what, relay)
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

/// Reads stderr messages from `r` up to `LAST` or `ERROR` (Nix `processStderr`), passing each
/// other one to `relay` as it comes.
fn relay_stderr(r: &mut BufReader<UnixStream>, version: ProtocolVersion, socket: &Path, what: &'static str, relay: Relay) -> Result<(), RemoteError> {
    loop {
        match read_stderr_message(r, version).map_err(|source| RemoteError::Wire { socket: socket.to_owned(), what, source })? {
            StderrMessage::Last => return Ok(()),
            StderrMessage::Error(message) => return Err(RemoteError::Daemon { socket: socket.to_owned(), what, message }),
            m => relay(&m).map_err(|source| RemoteError::Relay { socket: socket.to_owned(), source })?,
        }
    }
}

/// Passes a daemon's log lines to the log (activities' texts at debug level).
fn log_message(m: &StderrMessage) -> std::io::Result<()> {
    match m {
        StderrMessage::Next(line) => tracing::info!("{}", line.trim_end()),
        StderrMessage::StartActivity { text, .. } if !text.is_empty() => tracing::debug!("{text}"),
        _ => {}
    }
    Ok(())
}

/// Copies what `nar` reads into `out`, 64 KiB at a time; the bytes copied, or `nar`'s
/// failure (inner) apart from `out`'s (outer).
fn copy_nar(nar: &mut dyn Read, out: &mut dyn Write) -> std::io::Result<std::io::Result<u64>> {
    let (mut buf, mut copied) = (vec![0u8; 64 << 10], 0);
    loop {
        match nar.read(&mut buf) {
            Ok(0) => return Ok(Ok(copied)),
            Ok(n) => {
                out.write_all(&buf[..n])?;
                copied += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Ok(Err(e)),
        }
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

/// A daemon behind the [`Store`](crate::store::Store) interface: one connection (Nix's
/// default `max-connections`), owned by a thread of its own that runs the store's operations
/// one after another (so that with `lock-cpu` the thread pinned is the one that talks to the
/// daemon). A connection an operation failed on is dropped and the next operation connects
/// again. Additions wait for their publish gate before they are sent (the daemon makes a path
/// valid as it adds it, and registers it only after its references); meanwhile the NAR is
/// spooled to an unlinked temporary file, so that the source is read to its end. The
/// additions waiting when the thread comes to one go together in one AddMultipleToStore
/// (`remote/batch.rs`).
pub struct DaemonStore {
    url: String,
    store_dir: StoreDir,
    version: ProtocolVersion,
    jobs: std::sync::mpsc::Sender<Job>,
}

/// Work for the connection's thread.
enum Job {
    /// An operation.
    Run(Box<dyn FnOnce(&mut Connection) + Send>),
    /// A path to add, with the additions queued behind it ([`batch::Addition`]).
    Add(batch::Addition),
}

/// Paths a [`DaemonStore`] reads the NARs of at once when the daemon takes AddMultipleToStore:
/// the additions that can wait in its queue to go in one operation.
const ADDITIONS_AT_ONCE: usize = 64;

/// The connection of a [`DaemonStore`], on its thread; `None` after a failure.
struct Connection {
    socket: PathBuf,
    lock_cpu: bool,
    conn: Option<RemoteStore>,
}

impl Connection {
    /// Runs `f` on the connection, connecting first if there is none; a failure drops it, as
    /// it may have left the connection out of step (a batch's replies unread).
    fn with<T>(&mut self, f: impl FnOnce(&mut RemoteStore) -> Result<T, RemoteError>) -> Result<T, RemoteError> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => self.conn.insert(RemoteStore::connect(&self.socket, self.lock_cpu)?),
        };
        let result = f(conn);
        if result.is_err() {
            self.conn = None;
        }
        result
    }
}

impl DaemonStore {
    /// Connects to the daemon at `socket` (opened as `url`) from the connection's new thread,
    /// pinned with `lock_cpu` (see [`RemoteStore::connect`]); additions ask the daemon to check
    /// signatures when `check_sigs` (Nix's `CheckSigs`; `false` is `--no-check-sigs`, which a
    /// daemon honours only for a trusted client).
    pub fn connect(url: &str, socket: &Path, lock_cpu: bool, check_sigs: bool) -> Result<Self, RemoteError> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let (greeted, greeting) = std::sync::mpsc::channel();
        let mut conn = Connection { socket: socket.to_owned(), lock_cpu, conn: None };
        let spawned = std::thread::Builder::new().name("sluice-daemon-client".into()).spawn(move || {
            let greeting = conn.with(|c| Ok((c.store_dir().clone(), c.version())));
            let ok = greeting.is_ok();
            let _ = greeted.send(greeting);
            if ok {
                batch::serve(&mut conn, &queue, check_sigs);
            }
        });
        spawned.map_err(|source| RemoteError::Connect { socket: socket.to_owned(), source })?;
        let ended = || RemoteError::Protocol { message: "the connection's thread ended".into(), socket: socket.to_owned() };
        let (store_dir, version) = greeting.recv().map_err(|_| ended())??;
        Ok(DaemonStore { url: url.to_string(), store_dir, version, jobs })
    }

    /// Runs `f` on the connection's thread.
    async fn run<T: Send + 'static>(&self, f: impl FnOnce(&mut RemoteStore) -> Result<T, RemoteError> + Send + 'static) -> Result<T, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.jobs.send(Job::Run(Box::new(move |conn: &mut Connection| drop(tx.send(conn.with(f)))))).map_err(|_| self.ended())?;
        Ok(rx.await.map_err(|_| self.ended())??)
    }

    fn ended(&self) -> StoreError {
        StoreError::Other(format!("{}: the daemon connection's thread ended", self.url))
    }
}

impl crate::store::Store for DaemonStore {
    fn url(&self) -> &str {
        &self.url
    }

    fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        let paths = paths.to_vec();
        Box::pin(async move {
            let infos = self.run(move |c| c.query_path_infos(&paths)).await?;
            Ok(infos.into_iter().map(|i| i.map(PathInfo::of)).collect())
        })
    }

    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        let nar = DaemonNar { url: self.url.clone(), jobs: self.jobs.clone(), path: info.path.clone(), nar_size: info.nar_size, piped: None };
        Box::pin(async move { Ok(Box::new(nar) as NarReader) })
    }

    fn add_to_store<'a>(&'a self, info: ValidPathInfo, nar: NarReader, mut publish: PublishGate) -> StoreFuture<'a, ()> {
        use futures::FutureExt;
        Box::pin(async move {
            let nar = match (&mut publish).now_or_never() {
                Some(gate) => gate.map(|()| nar)?,
                None => {
                    let spooled = spool(&self.url, nar).await?;
                    publish.await?;
                    spooled
                }
            };
            let (done, answer) = tokio::sync::oneshot::channel();
            self.jobs.send(Job::Add(batch::Addition { info, nar, done })).map_err(|_| self.ended())?;
            answer.await.map_err(|_| self.ended())?
        })
    }

    /// One NAR at a time when each path is its own AddToStoreNar; with AddMultipleToStore,
    /// [`ADDITIONS_AT_ONCE`], so that additions queue up for one operation.
    fn parallelism(&self) -> usize {
        match self.version.at_least(batch::MULTIPLE_VERSION) {
            true => ADDITIONS_AT_ONCE,
            false => 1,
        }
    }
}

/// Reads `nar` to its end into an unlinked temporary file; the file, from its start.
async fn spool(url: &str, mut nar: NarReader) -> Result<NarReader, StoreError> {
    let err = |e: std::io::Error| StoreError::Other(format!("{url}: spooling a NAR to a temporary file: {e}"));
    let spooled = tokio::task::spawn_blocking(move || {
        let mut file = tempfile::tempfile()?;
        std::io::copy(&mut nar, &mut file)?;
        std::io::Seek::rewind(&mut file)?;
        Ok(Box::new(file) as NarReader)
    });
    spooled.await.map_err(|e| err(std::io::Error::other(e)))?.map_err(err)
}

/// A NAR read from a daemon. The NarFromPath operation is queued on the connection's thread
/// at the first read, not before: that thread then streams only NARs whose readers are reading
/// (a NAR opened but not read yet cannot hold up the ones behind it). The thread writes into a
/// pipe; a reader dropped early makes its writes fail, and the rest is read and dropped.
struct DaemonNar {
    url: String,
    jobs: std::sync::mpsc::Sender<Job>,
    path: StorePath,
    nar_size: u64,
    piped: Option<PipedNar>,
}

impl Read for DaemonNar {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.piped.is_none() {
            let (path, nar_size, jobs) = (self.path.clone(), self.nar_size, &self.jobs);
            let ended = format!("{}: the daemon connection's thread ended", self.url);
            self.piped = Some(PipedNar::start(&self.url, |mut write| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let job = Job::Run(Box::new(move |conn| {
                    let read = conn.with(|c| c.nar_from_path(&path, nar_size, &mut write));
                    drop(write);
                    let _ = tx.send(read);
                }));
                jobs.send(job).map_err(|_| std::io::Error::other(ended.clone()))?;
                Ok(Box::pin(async move {
                    match rx.await {
                        // A failed write is the reader's own doing (it stopped reading).
                        Ok(read) => read.map(drop).map_err(std::io::Error::other),
                        Err(_) => Err(std::io::Error::other(ended)),
                    }
                }))
            })?);
        }
        self.piped.as_mut().expect("started above").read(buf)
    }
}
