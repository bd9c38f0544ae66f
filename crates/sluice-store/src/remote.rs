//! A client of a Nix daemon (`sluice daemon` or `nix-daemon`): [`DaemonConnection`], the
//! worker protocol's client side (`RemoteStore` in Nix `src/libstore/remote-store.cc`) over any
//! byte stream (a Unix socket, or a child process's standard input and output as `ssh-ng://`
//! uses): queries, temporary roots, a NAR read (NarFromPath), additions (AddToStoreNar,
//! AddMultipleToStore) and the build operations, sent as `sluice_nix::wire::ops` requests, with
//! the old CPU-affinity hint; and [`DaemonStore`], a daemon behind the
//! [`Store`](crate::store::Store) interface. With a daemon that offers them (protocol ≥ 1.38,
//! the features of DeterminateSystems' Nix, `sluice daemon`), path infos and temporary roots of
//! a path set go in one request each (QueryPathInfos, AddTempRoots); otherwise one request per
//! path, pipelined.
//! With `lock-cpu`, the client pins its thread to the CPU it is running on and sends that CPU
//! in the greeting (flag 1, then the CPU: protocol ≥ 1.14, as Nix 1.6–2.5 did), so that a
//! daemon which honours it (sluice does) runs the connection's worker on the same CPU and each
//! round trip avoids a cross-CPU wake-up.

use std::borrow::Borrow;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::features::{
    feature_set, negotiated, read_features, write_features, FeatureSet, ADD_TEMP_ROOTS, FEATURES_VERSION, QUERY_PATH_INFOS,
    SLUICE_QUERY_CLOSURE, SLUICE_ZSTD,
};
use sluice_nix::wire::ops::{
    write_request, AddMultipleToStore, AddTempRoot, AddTempRoots, AddToStoreNar, BuildDerivation, BuildPaths, BuildPathsWithResults,
    IsValidPath, NarFromPath, QueryDerivationOutputMap, QueryPathInfo, QueryPathInfos, QueryRealisation, QueryValidPaths,
    RegisterDrvOutput, Request, SetOptions, MAX_REALISATION,
};
use sluice_nix::wire::{
    read_bool, read_build_result, read_keyed_build_result, read_keyed_path_info, read_optional_store_path, read_stderr_message,
    read_store_path_set, read_string, read_trusted_flag, read_u64, read_unkeyed_path_info, write_keyed_path_info, write_u64,
    BasicDerivation, BuildMode, BuildResult, DerivedPath, FramedWriter, ProtocolVersion, StderrMessage, WireError, MAX_PATH_LEN,
    WORKER_MAGIC_1, WORKER_MAGIC_2,
};

use sluice_compress::zstd_channel::{Switch, ZstdChannelReader, ZstdChannelWriter};
use sluice_nix::path_info::ValidPathInfo;

mod batch;
mod closure;
mod daemon_store;
mod pace;

pub use daemon_store::{Connector, DaemonStore};

/// The protocol version this client speaks: 1.38 (Nix 2.24 and later; the daemon's trusted flag
/// from 1.35, CPU times in build results from 1.37, the feature exchange from 1.38). Both sides
/// use min(daemon, client) as a whole.
pub const CLIENT_VERSION: ProtocolVersion = ProtocolVersion::new(1, 38);

/// The features this client offers at ≥ 1.38 and uses when the daemon offers them too.
pub const CLIENT_FEATURES: &[&str] = &[ADD_TEMP_ROOTS, QUERY_PATH_INFOS, SLUICE_QUERY_CLOSURE];

/// The oldest daemon this client talks to (1.21: path info with signatures, no legacy forms).
const MIN_DAEMON_VERSION: ProtocolVersion = ProtocolVersion::new(1, 21);

/// Most request bytes written before their replies are read: well below a Unix socket's send
/// buffer (≈ 208 KiB by default), so that writing a batch never waits for the daemon, which
/// may itself be waiting for its replies to be read.
pub const PIPELINE_BYTES: usize = 64 << 10;

/// Receives the stderr messages of an operation (log lines, activities, results) as they
/// come, to pass them on; an error stops the operation ([`RemoteError::Relay`]).
pub type Relay<'a> = &'a mut dyn FnMut(&StderrMessage) -> std::io::Result<()>;

/// Errors talking to a daemon. Each names the daemon (its socket's path, or what else it is
/// reached through) and what was being done.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The daemon could not be reached.
    #[error("connecting to the daemon at {daemon}: {source}")]
    Connect {
        daemon: String,
        #[source]
        source: std::io::Error,
    },
    /// Reading from or writing to the connection failed.
    #[error("daemon at {daemon}: {what}: {source}")]
    Io {
        daemon: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The daemon sent something malformed.
    #[error("daemon at {daemon}: {what}: {source}")]
    Wire {
        daemon: String,
        what: &'static str,
        #[source]
        source: WireError,
    },
    /// The peer is not a daemon this client can talk to.
    #[error("daemon at {daemon}: {message}")]
    Protocol { message: String, daemon: String },
    /// The daemon reported that the operation failed.
    #[error("daemon at {daemon}: {what}: {message}")]
    Daemon { daemon: String, what: &'static str, message: String },
    /// Passing on the daemon's messages failed (see [`Relay`]).
    #[error("relaying the messages of the daemon at {daemon}: {source}")]
    Relay {
        daemon: String,
        #[source]
        source: std::io::Error,
    },
    /// Reading the NAR of `path` to send it failed (the daemon was sent a cut-short NAR,
    /// which it refuses).
    #[error("daemon at {daemon}: reading the NAR of {path} to add it: {source}")]
    Nar {
        daemon: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl RemoteError {
    /// Whether the connection itself failed: it could not be made, its stream broke or
    /// stalled, or the peer went out of step. Asking that daemon again at once would meet the
    /// same failure (or wait as long again on a stalled far end); a daemon's refusal
    /// ([`RemoteError::Daemon`]) or a NAR this side could not read ([`RemoteError::Nar`])
    /// leaves the daemon able to take other paths.
    pub fn is_connection_failure(&self) -> bool {
        matches!(self, RemoteError::Connect { .. } | RemoteError::Io { .. } | RemoteError::Wire { .. } | RemoteError::Protocol { .. })
    }
}

/// The reading side of a daemon's byte stream.
pub type DaemonReader = Box<dyn Read + Send>;
/// The writing side of a daemon's byte stream.
pub type DaemonWriter = Box<dyn Write + Send>;

/// A connection to a daemon, over any byte stream: [`DaemonConnection::connect`] opens a Unix
/// socket, [`DaemonConnection::over`] takes a stream already open. Not shareable between
/// threads: the worker protocol is one request at a time.
pub struct DaemonConnection {
    /// The daemon, as errors name it.
    daemon: String,
    r: BufReader<DaemonReader>,
    w: BufWriter<DaemonWriter>,
    version: ProtocolVersion,
    /// The features both sides offered (≥ 1.38).
    features: FeatureSet,
    store_dir: StoreDir,
    daemon_version: Option<String>,
    /// Whether the daemon trusts this client (≥ 1.35; `None` when it does not say).
    trusted: Option<bool>,
    pinned_cpu: Option<usize>,
    /// The switch of the stream's zstd ([`SLUICE_ZSTD`]), when it is offered (over a stream
    /// that is not a local socket).
    zstd: Option<Switch>,
}

impl DaemonConnection {
    /// Connects to the daemon listening on the Unix socket `socket` and greets it. With
    /// `lock_cpu`, first pins the calling thread, for the rest of its life, to the CPU it runs
    /// on (if that fails, the connection goes on unpinned and sends no hint) and asks the
    /// daemon to run its worker there.
    pub fn connect(socket: &Path, lock_cpu: bool) -> Result<Self, RemoteError> {
        let daemon = socket.display().to_string();
        let connect_err = |source| RemoteError::Connect { daemon: daemon.clone(), source };
        let stream = sluice_local_store::unix_socket::connect(socket).map_err(connect_err)?;
        let reader = stream.try_clone().map_err(connect_err)?;
        let pinned_cpu = if lock_cpu { pin_to_current_cpu() } else { None };
        Self::greeted(daemon, Box::new(reader), Box::new(stream), pinned_cpu, None)
    }

    /// Greets the daemon that reads what `writer` writes and answers on `reader` (such as a
    /// `nix-daemon --stdio`'s standard input and output), named `daemon` in errors. No CPU
    /// hint is sent. [`SLUICE_ZSTD`] is offered: with a daemon that offers it too (`sluice
    /// daemon --stdio`), everything after the greeting travels zstd-compressed.
    pub fn over(daemon: String, reader: DaemonReader, writer: DaemonWriter) -> Result<Self, RemoteError> {
        let switch = Switch::default();
        let reader = Box::new(ZstdChannelReader::new(reader, switch.clone()));
        let writer = Box::new(ZstdChannelWriter::new(writer, switch.clone()));
        Self::greeted(daemon, reader, writer, None, Some(switch))
    }

    /// The connection over `reader` and `writer`, greeted, having named `pinned_cpu` to the
    /// daemon, offering [`SLUICE_ZSTD`] with `zstd`, the switch of the channel's compression.
    fn greeted(
        daemon: String,
        reader: DaemonReader,
        writer: DaemonWriter,
        pinned_cpu: Option<usize>,
        zstd: Option<Switch>,
    ) -> Result<Self, RemoteError> {
        let mut conn = DaemonConnection {
            daemon,
            r: BufReader::with_capacity(64 * 1024, reader),
            w: BufWriter::with_capacity(64 * 1024, writer),
            version: CLIENT_VERSION,
            features: FeatureSet::new(),
            store_dir: StoreDir::default(),
            daemon_version: None,
            trusted: None,
            pinned_cpu,
            zstd,
        };
        conn.greet()?;
        Ok(conn)
    }

    /// The negotiated protocol version.
    pub fn version(&self) -> ProtocolVersion {
        self.version
    }

    /// The features negotiated (those of [`CLIENT_FEATURES`] the daemon offers too).
    pub fn features(&self) -> &FeatureSet {
        &self.features
    }

    /// The daemon's version string (sent by daemons ≥ 1.33).
    pub fn daemon_version(&self) -> Option<&str> {
        self.daemon_version.as_deref()
    }

    /// Whether the daemon trusts this client, as it said in the greeting (≥ 1.35).
    pub fn trusted(&self) -> Option<bool> {
        self.trusted
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
        self.request(&IsValidPath { path: path.clone() }, "IsValidPath")?;
        let valid = read_bool(&mut self.r, "validity");
        valid.map_err(self.wire_err("reading the IsValidPath result"))
    }

    /// The registration of `path`, or `None` if it is not valid.
    pub fn query_path_info(&mut self, path: &StorePath) -> Result<Option<ValidPathInfo>, RemoteError> {
        self.request(&QueryPathInfo { path: path.clone() }, "QueryPathInfo")?;
        self.read_path_info(path)
    }

    /// The registrations of `paths` (`None` for each that is not valid), in order: one
    /// QueryPathInfos when the daemon offers it, else one QueryPathInfo per path, pipelined
    /// ([`DaemonConnection::pipelined`]). After an error the rest of the replies are unread:
    /// drop the connection.
    pub fn query_path_infos(&mut self, paths: &[StorePath]) -> Result<Vec<Option<ValidPathInfo>>, RemoteError> {
        if !self.features.contains(QUERY_PATH_INFOS) {
            let requests: Vec<QueryPathInfo> = paths.iter().map(|p| QueryPathInfo { path: p.clone() }).collect();
            return self.pipelined(&requests, "QueryPathInfo", |c, r| c.read_path_info(&r.path));
        }
        self.request(&QueryPathInfos { paths: paths.iter().cloned().collect() }, "QueryPathInfos")?;
        self.read_path_infos(paths)
    }

    /// Reads a QueryPathInfos result (after `LAST`) for `paths`: their registrations, in order.
    /// An info for a path not asked, or answered twice, is refused.
    fn read_path_infos(&mut self, paths: &[StorePath]) -> Result<Vec<Option<ValidPathInfo>>, RemoteError> {
        let what = "QueryPathInfos";
        let mut infos = self.read_keyed_infos(what)?;
        let asked: std::collections::BTreeSet<&StorePath> = paths.iter().collect();
        if let Some(other) = infos.keys().find(|p| !asked.contains(p)) {
            return Err(self.protocol(format!("{what}: an info for {}, which was not asked", self.store_dir.display_path(other))));
        }
        Ok(paths.iter().map(|p| infos.remove(p)).collect())
    }

    /// Reads a QueryClosureInfos result (after `LAST`) for `roots`: the registration of each
    /// root, in order, and those of the rest of their closure. An info for a path that no
    /// reference in the answer leads to from a root, or answered twice, is refused.
    fn read_closure_infos(&mut self, roots: &[StorePath]) -> Result<(Vec<Option<ValidPathInfo>>, Vec<ValidPathInfo>), RemoteError> {
        let what = "QueryClosureInfos";
        let mut infos = self.read_keyed_infos(what)?;
        let answered: Vec<Option<ValidPathInfo>> = roots.iter().map(|p| infos.remove(p)).collect();
        let mut reached: std::collections::BTreeSet<&StorePath> = roots.iter().collect();
        let mut frontier: Vec<&ValidPathInfo> = answered.iter().flatten().collect();
        while let Some(info) = frontier.pop() {
            for r in &info.references {
                if reached.insert(r) {
                    frontier.extend(infos.get(r));
                }
            }
        }
        if let Some(other) = infos.keys().find(|p| !reached.contains(p)) {
            let message =
                format!("{what}: an info for {}, which is not in the closure of the paths asked", self.store_dir.display_path(other));
            return Err(self.protocol(message));
        }
        Ok((answered, infos.into_values().collect()))
    }

    /// Reads a count, then that many keyed infos (QueryPathInfos' answer); a path answered
    /// twice is refused.
    fn read_keyed_infos(&mut self, what: &'static str) -> Result<std::collections::BTreeMap<StorePath, ValidPathInfo>, RemoteError> {
        let n = read_u64(&mut self.r, "path info count").map_err(self.wire_err(what))?;
        let mut infos = std::collections::BTreeMap::new();
        for _ in 0..n {
            let info = read_keyed_path_info(&mut self.r, &self.store_dir, self.version).map_err(self.wire_err(what))?;
            if infos.contains_key(&info.path) {
                return Err(self.protocol(format!("{what}: {} was answered twice", self.store_dir.display_path(&info.path))));
            }
            infos.insert(info.path.clone(), info);
        }
        Ok(infos)
    }

    /// The daemon broke the protocol: `message` says how.
    fn protocol(&self, message: String) -> RemoteError {
        RemoteError::Protocol { message, daemon: self.daemon.clone() }
    }

    /// Those of `paths` that are valid in the daemon's store: one QueryValidPaths (Nix's
    /// `RemoteStore::queryValidPaths`), substituting none.
    pub fn query_valid_paths(&mut self, paths: &[StorePath]) -> Result<std::collections::BTreeSet<StorePath>, RemoteError> {
        let what = "QueryValidPaths";
        self.request(&QueryValidPaths { paths: paths.iter().cloned().collect(), substitute: false }, what)?;
        read_store_path_set(&mut self.r, &self.store_dir, "valid paths").map_err(self.wire_err(what))
    }

    /// Those of `paths` that are valid in the daemon's store, each made a temporary root of
    /// the connection before it is looked up, as Nix's `copyPaths` does (`addTempRoot`, then
    /// `queryValidPaths`): a path found valid then stays valid while the connection lives,
    /// whatever a collector does meanwhile. The roots and the query are written at once (one
    /// round trip) when they fit in [`PIPELINE_BYTES`], else sent one after the other.
    pub fn query_valid_paths_rooted(&mut self, paths: &[StorePath]) -> Result<std::collections::BTreeSet<StorePath>, RemoteError> {
        let query = QueryValidPaths { paths: paths.iter().cloned().collect(), substitute: false };
        let batched = !self.features.contains(ADD_TEMP_ROOTS);
        let io = self.io_err("AddTempRoot");
        let mut batch = Vec::new();
        if batched {
            for path in paths {
                write_request(&mut batch, &self.store_dir, self.version, &AddTempRoot { path: path.clone() }).map_err(&io)?;
            }
        } else if !paths.is_empty() {
            write_request(&mut batch, &self.store_dir, self.version, &AddTempRoots { paths: query.paths.clone() }).map_err(&io)?;
        }
        write_request(&mut batch, &self.store_dir, self.version, &query).map_err(&io)?;
        if batch.len() > PIPELINE_BYTES {
            self.add_temp_roots(paths)?;
            return self.query_valid_paths(paths);
        }
        self.w.write_all(&batch).and_then(|()| self.w.flush()).map_err(&io)?;
        let roots = if batched { paths.len() } else { usize::from(!paths.is_empty()) };
        for _ in 0..roots {
            let what = if batched { "AddTempRoot" } else { "AddTempRoots" };
            self.finish_stderr(what)?;
            read_u64(&mut self.r, "AddTempRoot result").map_err(self.wire_err(what))?;
        }
        let what = "QueryValidPaths";
        self.finish_stderr(what)?;
        read_store_path_set(&mut self.r, &self.store_dir, "valid paths").map_err(self.wire_err(what))
    }

    /// Makes `paths` temporary roots in the daemon for the rest of the connection (Nix's
    /// `addTempRoot`): one AddTempRoots when the daemon offers it, else one AddTempRoot per
    /// path, pipelined.
    pub fn add_temp_roots(&mut self, paths: &[StorePath]) -> Result<(), RemoteError> {
        if paths.is_empty() {
            return Ok(());
        }
        if !self.features.contains(ADD_TEMP_ROOTS) {
            let requests: Vec<AddTempRoot> = paths.iter().map(|p| AddTempRoot { path: p.clone() }).collect();
            let read = |c: &mut Self, _: &AddTempRoot| read_u64(&mut c.r, "AddTempRoot result").map_err(c.wire_err("AddTempRoot"));
            return self.pipelined(&requests, "AddTempRoot", read).map(drop);
        }
        let what = "AddTempRoots";
        self.request(&AddTempRoots { paths: paths.iter().cloned().collect() }, what)?;
        read_u64(&mut self.r, "AddTempRoots result").map_err(self.wire_err(what))?;
        Ok(())
    }

    /// Sends `requests` pipelined: up to [`PIPELINE_BYTES`] of them are written at once and
    /// then their replies read by `read` (after each one's `LAST`), so that a batch costs one
    /// round trip per few hundred requests instead of one per request (the daemon serves
    /// requests one after another, in order). After an error the rest of the batch's replies
    /// are unread: drop the connection.
    fn pipelined<R: Request, T>(
        &mut self,
        requests: &[R],
        what: &'static str,
        mut read: impl FnMut(&mut Self, &R) -> Result<T, RemoteError>,
    ) -> Result<Vec<T>, RemoteError> {
        let mut replies = Vec::with_capacity(requests.len());
        let mut rest = requests;
        while !rest.is_empty() {
            let io = self.io_err(what);
            let (mut sent, mut batch) = (0, Vec::new());
            while sent < rest.len() && batch.len() < PIPELINE_BYTES {
                write_request(&mut batch, &self.store_dir, self.version, &rest[sent]).map_err(&io)?;
                sent += 1;
            }
            self.w.write_all(&batch).map_err(&io)?;
            self.w.flush().map_err(&io)?;
            for request in &rest[..sent] {
                self.finish_stderr(what)?;
                replies.push(read(self, request)?);
            }
            rest = &rest[sent..];
        }
        Ok(replies)
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

    /// NarFromPath: the NAR of the valid path `path`, `nar_size` bytes (its registered
    /// size), into `sink` (Nix `RemoteStore::narFromPath`: after `LAST`, the bare NAR). The
    /// whole NAR is read even when writing `sink` fails, so that the connection stays in step:
    /// that failure is the inner result.
    pub fn nar_from_path(&mut self, path: &StorePath, nar_size: u64, sink: &mut dyn Write) -> Result<std::io::Result<()>, RemoteError> {
        self.request(&NarFromPath { path: path.clone() }, "NarFromPath")?;
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

    /// NarFromPath of each of `paths` (a path and its registered NAR size), pipelined
    /// ([`DaemonConnection::pipelined`]: one round trip per [`PIPELINE_BYTES`] of requests):
    /// each NAR is read whole and given to `each` with its index as soon as it has arrived.
    /// After an error the rest of the replies are unread: drop the connection.
    pub fn nars_from_paths(&mut self, paths: &[(StorePath, u64)], mut each: impl FnMut(usize, Vec<u8>)) -> Result<(), RemoteError> {
        let requests: Vec<NarFromPath> = paths.iter().map(|(path, _)| NarFromPath { path: path.clone() }).collect();
        let mut next = 0;
        self.pipelined(&requests, "NarFromPath", |c, _| {
            let nar = c.read_nar(paths[next].1)?;
            each(next, nar);
            next += 1;
            Ok(())
        })?;
        Ok(())
    }

    /// Reads a NarFromPath result (after `LAST`): the NAR, `size` bytes (its registered size).
    fn read_nar(&mut self, size: u64) -> Result<Vec<u8>, RemoteError> {
        let io = self.io_err("reading the NAR (NarFromPath)");
        let mut nar = Vec::with_capacity(size.min(PIPELINE_BYTES as u64) as usize);
        (&mut self.r).take(size).read_to_end(&mut nar).map_err(&io)?;
        if nar.len() as u64 != size {
            return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        Ok(nar)
    }

    /// AddToStoreNar (daemons of protocol ≥ 1.23): adds `info.path` from the NAR read
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
            return Err(self.protocol(message));
        }
        self.send(&AddToStoreNar { info: info.clone(), repair: false, dont_check_sigs: !check_sigs }, what)?;
        let (daemon, shown) = (self.daemon.clone(), self.store_dir.display_path(&info.path));
        self.with_framed_sink(what, |out| {
            Ok(copy_nar(nar, out)?.map(drop).map_err(|source| RemoteError::Nar { daemon, path: shown, source }))
        })
    }

    /// AddMultipleToStore (daemons of protocol ≥ 1.32): adds the `count` paths `paths`
    /// yields, in order, in one operation, as Nix's `RemoteStore::addMultipleToStore` sends
    /// them: repair (false), dontCheckSigs (`!check_sigs`), then one framed stream of the
    /// count and, per path, its keyed info in the protocol 1.16 form followed by exactly
    /// `NarSize` bytes of its NAR, each NAR read as its turn comes. The daemon adds them one
    /// after another and stops at the first it refuses (its error is the result; the paths
    /// before it are added). A NAR that cannot be read, or ends before its `NarSize`, or a
    /// `paths` that ends before `count`, ends the stream there ([`RemoteError::Nar`]).
    pub fn add_multiple_to_store<I: Borrow<ValidPathInfo>, N: Read>(
        &mut self,
        count: usize,
        paths: impl Iterator<Item = (I, N)>,
        check_sigs: bool,
    ) -> Result<(), RemoteError> {
        let what = "AddMultipleToStore";
        if !self.version.at_least(batch::MULTIPLE_VERSION) {
            let message = format!("{what} needs protocol 1.32 (Nix 2.4), the daemon speaks {}", self.version);
            return Err(self.protocol(message));
        }
        self.send(&AddMultipleToStore { repair: false, dont_check_sigs: !check_sigs }, what)?;
        let (daemon, dir) = (self.daemon.clone(), self.store_dir.clone());
        self.with_framed_sink(what, |out| {
            write_u64(out, count as u64)?;
            let mut sent = 0;
            for (info, mut nar) in paths.take(count) {
                let info = info.borrow();
                write_keyed_path_info(out, &dir, ProtocolVersion::new(1, 16), info)?;
                let read = copy_nar(&mut (&mut nar).take(info.nar_size), out)?.and_then(|n| match n == info.nar_size {
                    true => Ok(()),
                    false => Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("the NAR ended after {n} of its {} bytes", info.nar_size),
                    )),
                });
                if let Err(source) = read {
                    return Ok(Err(RemoteError::Nar { daemon, path: dir.display_path(&info.path), source }));
                }
                sent += 1;
            }
            match sent == count {
                true => Ok(Ok(())),
                false => Ok(Err(RemoteError::Protocol { message: format!("{what}: {sent} of its {count} paths were given"), daemon })),
            }
        })
    }

    /// Flushes the request written so far, then sends the framed stream `send` writes while
    /// a second thread reads the daemon's messages (Nix's `withFramedSink`: the daemon may
    /// answer, or fail, before the stream ends). `send`'s own failure first (a NAR that could
    /// not be read: the stream is ended where it stopped, which the daemon then refuses, as
    /// Nix rethrows `fun`'s exception before the daemon's), then the daemon's refusal (a
    /// daemon that refuses may close the connection, failing the stream's writes), then the
    /// connection's failure, then the daemon's answer.
    fn with_framed_sink(
        &mut self,
        what: &'static str,
        send: impl FnOnce(&mut dyn Write) -> std::io::Result<Result<(), RemoteError>>,
    ) -> Result<(), RemoteError> {
        let io = self.io_err(what);
        self.w.flush().map_err(&io)?;
        let DaemonConnection { daemon, r, w, version, .. } = self;
        let (sent, replied) = std::thread::scope(|scope| {
            let replies = scope.spawn(|| relay_stderr(r, *version, daemon, what, &mut log_message));
            let sent = (|| {
                // Frames of up to 64 KiB: the infos' small writes are gathered.
                let mut framed = BufWriter::with_capacity(64 << 10, FramedWriter::new(&mut *w));
                let outcome = send(&mut framed)?;
                framed.into_inner().map_err(std::io::IntoInnerError::into_error)?.finish()?.flush()?;
                Ok(outcome)
            })();
            (sent, replies.join())
        });
        let replied = replied.unwrap_or_else(|_| {
            Err(RemoteError::Protocol {
                message: format!("{what}: the thread reading the daemon's messages panicked"),
                daemon: self.daemon.clone(),
            })
        });
        match (sent, replied) {
            (Ok(Err(nar)), _) => Err(nar),
            (_, Err(refused @ RemoteError::Daemon { .. })) => Err(refused),
            (Ok(Ok(())), replied) => replied,
            (Err(e), _) => Err(io(e)),
        }
    }

    /// SetOptions: the numeric settings and the setting overrides (name, value) of
    /// `options`, as Nix's `RemoteStore::setOptions` sends them (`remote-store.cc`; overrides
    /// are in every protocol sluice speaks, ≥ 1.21). The daemon's error if it refuses them.
    pub fn set_options(&mut self, options: &SetOptions) -> Result<(), RemoteError> {
        self.request(options, "SetOptions")
    }

    /// QueryDerivationOutputMap: output name → output path of the derivation `drv`, `None`
    /// for an output whose path is not known (Nix `RemoteStore::queryPartialDerivationOutputMap`).
    pub fn query_derivation_output_map(&mut self, drv: &StorePath) -> Result<Vec<(String, Option<StorePath>)>, RemoteError> {
        let what = "QueryDerivationOutputMap";
        self.request(&QueryDerivationOutputMap { path: drv.clone() }, what)?;
        let n = read_u64(&mut self.r, "output count").map_err(self.wire_err(what))?;
        let mut outputs = Vec::new();
        for _ in 0..n {
            let name = read_string(&mut self.r, MAX_PATH_LEN, "output name").map_err(self.wire_err(what))?;
            let path = read_optional_store_path(&mut self.r, &self.store_dir, "output path").map_err(self.wire_err(what))?;
            outputs.push((name, path));
        }
        Ok(outputs)
    }

    /// QueryRealisation (daemons of protocol ≥ 1.31): the realisations, as JSON, of the
    /// derivation output `id` (`sha256:<hash>!<output>`; Nix `RemoteStore::queryRealisationUncached`).
    pub fn query_realisation(&mut self, id: &str) -> Result<Vec<String>, RemoteError> {
        let what = "QueryRealisation";
        self.needs(31, what)?;
        self.request(&QueryRealisation { id: id.to_owned() }, what)?;
        let n = read_u64(&mut self.r, "realisation count").map_err(self.wire_err(what))?;
        (0..n).map(|_| read_string(&mut self.r, MAX_REALISATION, "realisation").map_err(self.wire_err(what))).collect()
    }

    /// RegisterDrvOutput (daemons of protocol ≥ 1.31): registers the realisation `json`
    /// (Nix `RemoteStore::registerDrvOutput`).
    pub fn register_drv_output(&mut self, json: &str) -> Result<(), RemoteError> {
        let what = "RegisterDrvOutput";
        self.needs(31, what)?;
        self.request(&RegisterDrvOutput::Json(json.to_owned()), what)
    }

    /// Fails unless the negotiated protocol is at least 1.`minor`, which `what` needs.
    fn needs(&self, minor: u8, what: &str) -> Result<(), RemoteError> {
        if self.version.at_least(minor) {
            return Ok(());
        }
        let message = format!("{what} needs protocol 1.{minor}, the daemon speaks {}", self.version);
        Err(self.protocol(message))
    }

    /// BuildPaths: realises `targets` in `mode` (Nix `RemoteStore::buildPaths`),
    /// passing the daemon's messages to `relay`. The daemon's error if any target failed.
    pub fn build_paths(&mut self, targets: &[DerivedPath], mode: BuildMode, relay: Relay) -> Result<(), RemoteError> {
        let what = "BuildPaths";
        self.send(&BuildPaths { targets: targets.to_vec(), mode }, what)?;
        self.relay_stderr(what, relay)?;
        read_u64(&mut self.r, "BuildPaths result").map_err(self.wire_err(what))?;
        Ok(())
    }

    /// BuildPathsWithResults (daemons of protocol ≥ 1.34): realises `targets` in
    /// `mode` (Nix `RemoteStore::buildPathsWithResults`), passing the daemon's messages to
    /// `relay`; a result per target, keyed by the target as the daemon names it.
    pub fn build_paths_with_results(
        &mut self,
        targets: &[DerivedPath],
        mode: BuildMode,
        relay: Relay,
    ) -> Result<Vec<(DerivedPath, BuildResult)>, RemoteError> {
        let what = "BuildPathsWithResults";
        self.needs(34, what)?;
        self.send(&BuildPathsWithResults { targets: targets.to_vec(), mode }, what)?;
        self.relay_stderr(what, relay)?;
        let n = read_u64(&mut self.r, "build result count").map_err(self.wire_err(what))?;
        if n > targets.len() as u64 {
            let message = format!("{what}: {n} results for {} paths", targets.len());
            return Err(self.protocol(message));
        }
        let mut results = Vec::with_capacity(n as usize);
        for _ in 0..n {
            results.push(read_keyed_build_result(&mut self.r, &self.store_dir, self.version).map_err(self.wire_err(what))?);
        }
        Ok(results)
    }

    /// BuildDerivation: builds `drv`, the derivation at `drv_path` in wire form, in
    /// `mode` (Nix `putBuildDerivationRequest`, `worker-protocol-connection.cc`), passing the
    /// daemon's messages to `relay`. The result in the negotiated version's form.
    pub fn build_derivation(
        &mut self,
        drv_path: &StorePath,
        drv: &BasicDerivation,
        mode: BuildMode,
        relay: Relay,
    ) -> Result<BuildResult, RemoteError> {
        let what = "BuildDerivation";
        self.send(&BuildDerivation { drv_path: drv_path.clone(), drv: drv.clone(), mode }, what)?;
        self.relay_stderr(what, relay)?;
        read_build_result(&mut self.r, self.version).map_err(self.wire_err(what))
    }

    /// The greeting (Nix's `BasicClientConnection::handshake` and `postHandshake`,
    /// `worker-protocol-connection.cc`): magic numbers, versions, (≥ 1.38) this client's
    /// features then the daemon's, the affinity hint, obsolete reserveSpace, the daemon's version
    /// string (≥ 1.33) and trust flag (≥ 1.35), then its startup messages up to `LAST`.
    fn greet(&mut self) -> Result<(), RemoteError> {
        let what = "greeting";
        let io = self.io_err(what);
        write_u64(&mut self.w, WORKER_MAGIC_1).and_then(|()| self.w.flush()).map_err(io)?;
        let magic = read_u64(&mut self.r, "daemon magic").map_err(self.wire_err(what))?;
        if magic != WORKER_MAGIC_2 {
            return Err(RemoteError::Protocol {
                message: format!("not a Nix daemon (it answered {magic:#x})"),
                daemon: self.daemon.clone(),
            });
        }
        let daemon = ProtocolVersion::from_wire(read_u64(&mut self.r, "daemon version").map_err(self.wire_err(what))?);
        if daemon.major != 1 || daemon < MIN_DAEMON_VERSION {
            let message = format!("unsupported daemon protocol {daemon} (this client needs 1.21 to 1.x)");
            return Err(self.protocol(message));
        }
        self.version = daemon.min(CLIENT_VERSION);
        let io = self.io_err(what);
        write_u64(&mut self.w, CLIENT_VERSION.to_wire()).map_err(&io)?;
        let mut ours = CLIENT_FEATURES.to_vec();
        ours.extend(self.zstd.as_ref().map(|_| SLUICE_ZSTD));
        if self.version >= FEATURES_VERSION {
            write_features(&mut self.w, &feature_set(&ours)).and_then(|()| self.w.flush()).map_err(&io)?;
            let offered = read_features(&mut self.r, "daemon features").map_err(self.wire_err(what))?;
            self.features = negotiated(&ours, &offered);
        }
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
        if self.version.at_least(35) {
            self.trusted = read_trusted_flag(&mut self.r, "daemon trusted flag").map_err(self.wire_err(what))?;
        }
        self.finish_stderr(what)?;
        // The daemon sends nothing more until asked: nothing compressed is buffered yet.
        if let Some(switch) = self.zstd.as_ref().filter(|_| self.features.contains(SLUICE_ZSTD)) {
            switch.on();
        }
        Ok(())
    }

    /// Sends `request` (its operation number and header) and flushes it.
    fn send<R: Request>(&mut self, request: &R, what: &'static str) -> Result<(), RemoteError> {
        let io = self.io_err(what);
        write_request(&mut self.w, &self.store_dir, self.version, request).and_then(|()| self.w.flush()).map_err(io)
    }

    /// Sends `request`, then reads the daemon's messages up to `LAST` (its result follows).
    fn request<R: Request>(&mut self, request: &R, what: &'static str) -> Result<(), RemoteError> {
        self.send(request, what)?;
        self.finish_stderr(what)
    }

    /// Reads stderr messages up to `LAST` (log lines go to the log) or `ERROR`.
    fn finish_stderr(&mut self, what: &'static str) -> Result<(), RemoteError> {
        self.relay_stderr(what, &mut log_message)
    }

    /// Reads stderr messages up to `LAST` or `ERROR`, passing each other one to `relay`.
    fn relay_stderr(&mut self, what: &'static str, relay: Relay) -> Result<(), RemoteError> {
        relay_stderr(&mut self.r, self.version, &self.daemon, what, relay)
    }

    fn io_err(&self, what: &'static str) -> impl Fn(std::io::Error) -> RemoteError {
        let daemon = self.daemon.clone();
        move |source| RemoteError::Io { daemon: daemon.clone(), what, source }
    }

    fn wire_err(&self, what: &'static str) -> impl FnOnce(WireError) -> RemoteError {
        let daemon = self.daemon.clone();
        move |source| RemoteError::Wire { daemon, what, source }
    }
}

/// Reads stderr messages from `r` up to `LAST` or `ERROR` (Nix `processStderr`), passing each
/// other one to `relay` as it comes.
fn relay_stderr(
    r: &mut BufReader<DaemonReader>,
    version: ProtocolVersion,
    daemon: &str,
    what: &'static str,
    relay: Relay,
) -> Result<(), RemoteError> {
    loop {
        match read_stderr_message(r, version).map_err(|source| RemoteError::Wire { daemon: daemon.to_owned(), what, source })? {
            StderrMessage::Last => return Ok(()),
            StderrMessage::Error(message) => return Err(RemoteError::Daemon { daemon: daemon.to_owned(), what, message }),
            m => relay(&m).map_err(|source| RemoteError::Relay { daemon: daemon.to_owned(), source })?,
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
