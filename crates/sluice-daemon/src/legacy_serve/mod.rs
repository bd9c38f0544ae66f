//! `sluice legacy-serve`: Nix's serve protocol on standard input and output for one client,
//! as `nix-store --serve [--write]` speaks it (Nix 2.26 `src/nix-store/nix-store.cc`
//! `opServe`; Nix 2.8's is the same at version 2.7): the far end of an `ssh://` store, for
//! `nix copy --from/--to ssh://`, `nix-copy-closure` and sluice's own `ssh://` store. The wire
//! formats are [`sluice_nix::wire::serve`].
//!
//! Without `--write` only queries and NAR dumps are answered; imports and builds end the
//! connection with Nix's message. As in Nix, a request that fails ends the connection: its
//! error goes to standard error (ssh relays it to the client) and the process exits non-zero.
//! Additions ([`add`]) go through the store's verification boundary, and are committed in
//! batches while the client keeps sending them.

mod add;
mod build;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::Arc;

use sluice_local_store::{LocalStore, LocalStoreError, TempRoots};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use sluice_nix::wire::serve::{
    server_handshake, write_export_trailer, write_path_info_entry, DumpStorePath, ExportPaths, QueryClosure, QueryPathInfos,
    QueryValidPaths, ServeCommand, ServeRequest,
};
use sluice_nix::wire::{read_u64, write_bytes, write_store_path_set, write_u64, ProtocolVersion, WireError};
use sluice_store::config::RawConfig;
use sluice_store::store_url::LocalStoreConfig;

/// Why serving stopped (each names the request or path concerned).
#[derive(Debug, thiserror::Error)]
pub enum LegacyServeError {
    #[error("opening the store: {0}")]
    Store(#[from] LocalStoreError),
    #[error("settings: {0}")]
    Config(#[from] sluice_store::config::ConfigError),
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("writing to the client: {0}")]
    Write(#[source] io::Error),
    /// A request refused (unknown, not allowed without `--write`, invalid path…).
    #[error("{0}")]
    Refused(String),
}

/// The state of one client's session.
struct Session<R, W> {
    r: R,
    w: W,
    store: Arc<LocalStore>,
    roots: TempRoots,
    version: ProtocolVersion,
    write_allowed: bool,
    /// The additions not answered yet ([`add`]).
    adding: Option<add::Adding>,
    /// Whether input is waiting to be read on `r` (a read would not block).
    input_waiting: fn(&R) -> bool,
}

/// Serves one client on standard input and output from the local store `store` (settings
/// `config`) until it closes its end; `write_allowed` is `--write`. A store that cannot be
/// written is served read-only, and refused with `--write`.
pub fn serve_legacy_stdio(store: &LocalStoreConfig, config: &RawConfig, write_allowed: bool) -> Result<(), LegacyServeError> {
    let store = Arc::new(LocalStore::open(store)?);
    sluice_store::config::Settings::from_raw(config)?.configure_local_store(&store);
    if write_allowed {
        store.ensure_writable("import paths into it (sluice legacy-serve --write)")?;
    }
    let r = BufReader::with_capacity(256 * 1024, io::stdin().lock());
    let w = BufWriter::with_capacity(256 * 1024, io::stdout().lock());
    serve(r, w, store, write_allowed, |r| !r.buffer().is_empty() || readable(r.get_ref()))
}

/// Whether a read of `fd` would not block (data, or its end, is there).
fn readable(fd: &impl std::os::fd::AsFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, 0).is_ok_and(|n| n > 0)
}

/// Serves one client on `r`/`w` (the handshake, then requests until `r` ends);
/// `input_waiting` tells whether a read of `r` would not block. Additions are answered once
/// committed: before any other request, and before the session waits for input.
fn serve<R: Read, W: Write>(
    mut r: R,
    mut w: W,
    store: Arc<LocalStore>,
    write_allowed: bool,
    input_waiting: fn(&R) -> bool,
) -> Result<(), LegacyServeError> {
    let version = server_handshake(&mut r, &mut w)?;
    let roots = store.temp_roots();
    let mut s = Session { r, w, store, roots, version, write_allowed, adding: None, input_waiting };
    loop {
        if s.adding.is_some() && !(s.input_waiting)(&s.r) {
            s.settle()?;
            s.w.flush().map_err(LegacyServeError::Write)?;
        }
        let n = match read_u64(&mut s.r, "command") {
            Ok(n) => n,
            Err(e) if e.is_eof() => return s.settle(),
            Err(e) => return Err(e.into()),
        };
        let cmd = ServeCommand::from_wire(n).ok_or_else(|| LegacyServeError::Refused(format!("unknown serve command {n}")))?;
        if !matches!(cmd, ServeCommand::ImportPaths | ServeCommand::AddToStoreNar) {
            s.settle()?;
        }
        s.command(cmd)?;
        s.w.flush().map_err(LegacyServeError::Write)?;
    }
}

impl<R: Read, W: Write> Session<R, W> {
    /// Reads the header of `cmd` and answers it.
    fn command(&mut self, cmd: ServeCommand) -> Result<(), LegacyServeError> {
        match cmd {
            ServeCommand::QueryValidPaths => {
                let req = self.read::<QueryValidPaths>()?;
                self.query_valid_paths(req)
            }
            ServeCommand::QueryPathInfos => {
                let QueryPathInfos { paths } = self.read()?;
                self.query_path_infos(paths)
            }
            ServeCommand::DumpStorePath => {
                let DumpStorePath { path } = self.read()?;
                self.store.dump_path(&path, &mut self.w).map_err(refused)
            }
            ServeCommand::ImportPaths => self.import_paths(),
            ServeCommand::ExportPaths => {
                let ExportPaths { paths } = self.read()?;
                self.export_paths(paths)
            }
            ServeCommand::BuildPaths => self.build_paths(),
            ServeCommand::QueryClosure => {
                let QueryClosure { include_outputs, paths } = self.read()?;
                let closure = closure(&self.store, paths, include_outputs)?;
                write_store_path_set(&mut self.w, self.store.store_dir(), closure.keys()).map_err(LegacyServeError::Write)
            }
            ServeCommand::BuildDerivation => self.build_derivation(),
            ServeCommand::AddToStoreNar => self.add_to_store_nar(),
        }
    }

    fn read<Q: ServeRequest>(&mut self) -> Result<Q, LegacyServeError> {
        Ok(Q::read(&mut self.r, self.store.store_dir(), self.version)?)
    }

    /// Refuses `what` without `--write` (Nix's message).
    fn require_write(&self, what: &str) -> Result<(), LegacyServeError> {
        match self.write_allowed {
            true => Ok(()),
            false => Err(LegacyServeError::Refused(format!("{what} is not allowed"))),
        }
    }

    /// QueryValidPaths: the valid subset. With `--write`, `lock` makes every path a
    /// temporary root first (for the rest of the session); `substitute` is not acted on (no
    /// substituters are configured for the far end), so missing paths are reported missing.
    fn query_valid_paths(&mut self, QueryValidPaths { lock, paths, .. }: QueryValidPaths) -> Result<(), LegacyServeError> {
        let paths: Vec<StorePath> = paths.into_iter().collect();
        let valid = match lock && self.write_allowed {
            true => self.store.query_valid_paths_rooted(&paths, &self.roots)?,
            false => self.store.query_valid_paths(&paths)?,
        };
        write_store_path_set(&mut self.w, self.store.store_dir(), valid.iter()).map_err(LegacyServeError::Write)
    }

    /// QueryPathInfos: each valid path's entry (read in one transaction), then "".
    fn query_path_infos(&mut self, paths: BTreeSet<StorePath>) -> Result<(), LegacyServeError> {
        let paths: Vec<StorePath> = paths.into_iter().collect();
        let dir = self.store.store_dir();
        for info in self.store.query_path_infos(&paths) {
            if let Some(info) = info? {
                write_path_info_entry(&mut self.w, dir, self.version, &info).map_err(LegacyServeError::Write)?;
            }
        }
        write_bytes(&mut self.w, b"").map_err(LegacyServeError::Write)
    }

    /// ExportPaths: the paths (which must be valid), references first, each as `1`, its NAR
    /// and its trailer; then `0`.
    fn export_paths(&mut self, paths: BTreeSet<StorePath>) -> Result<(), LegacyServeError> {
        let infos = infos_of(&self.store, paths.into_iter().collect())?;
        for info in sluice_store::push::dependency_order(infos.values()) {
            write_u64(&mut self.w, 1).map_err(LegacyServeError::Write)?;
            self.store.dump_path(&info.path, &mut self.w).map_err(refused)?;
            write_export_trailer(&mut self.w, self.store.store_dir(), info).map_err(LegacyServeError::Write)?;
        }
        write_u64(&mut self.w, 0).map_err(LegacyServeError::Write)
    }
}

/// A store error made the message that ends the session.
fn refused(e: LocalStoreError) -> LegacyServeError {
    LegacyServeError::Refused(e.to_string())
}

/// The infos of `paths`, each of which must be valid (else an error naming it).
fn infos_of(store: &LocalStore, paths: Vec<StorePath>) -> Result<BTreeMap<StorePath, ValidPathInfo>, LegacyServeError> {
    let mut out = BTreeMap::new();
    for (path, info) in paths.iter().zip(store.query_path_infos(&paths)) {
        let info =
            info?.ok_or_else(|| LegacyServeError::Refused(format!("path '{}' is not valid", store.store_dir().display_path(path))))?;
        out.insert(path.clone(), info);
    }
    Ok(out)
}

/// The closure of `paths` under references with their infos (Nix's `computeFSClosure`), one
/// database transaction per level; with `include_outputs`, the valid outputs of each
/// derivation in it too. A path that is not valid is an error naming it.
fn closure(
    store: &LocalStore,
    paths: BTreeSet<StorePath>,
    include_outputs: bool,
) -> Result<BTreeMap<StorePath, ValidPathInfo>, LegacyServeError> {
    let mut done = BTreeMap::new();
    let mut level: Vec<StorePath> = paths.into_iter().collect();
    while !level.is_empty() {
        let infos = infos_of(store, level)?;
        let mut next = BTreeSet::new();
        for (path, info) in infos {
            next.extend(info.references.iter().filter(|r| !done.contains_key(*r)).cloned());
            if include_outputs && path.is_derivation() {
                let outputs: Vec<StorePath> = store.query_derivation_output_map(&path)?.into_values().collect();
                next.extend(store.query_valid_paths(&outputs)?.into_iter().filter(|o| !done.contains_key(o)));
            }
            done.insert(path, info);
        }
        level = next.into_iter().filter(|p| !done.contains_key(p)).collect();
    }
    Ok(done)
}
