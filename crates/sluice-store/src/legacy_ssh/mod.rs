//! [`LegacySshStore`]: `nix-store --serve --write` (or `sluice legacy-serve --write`) on
//! another host behind the [`Store`] interface, over one ssh connection whose requests are
//! pipelined ([`pipeline`]). Nix's `LegacySSHStore` (`src/libstore/legacy-ssh-store.cc`, Nix
//! 2.8 and 2.26), which waits for each reply before the next request.
//!
//! Pulling: the closure in two round trips (QueryClosure, sent right behind the greeting, then
//! QueryPathInfos of all of it);
//! NARs with DumpStorePath, all requested at once (as the copy announces them,
//! [`Store::prefetch_nars`]) and streamed back to back, each handed to its reader as soon as
//! it has arrived (a large one streamed into the pipe its reader unpacks from), never more than
//! its info's NAR size read; the destination verifies each path as it verifies every addition.
//! Pushing: one QueryValidPaths (the push engine's), then every missing path in dependency
//! order with AddToStoreNar (ImportPaths before 2.5), pipelined as one stream
//! ([`Store::add_stream`]).

mod pipeline;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Seek, Write};
use std::sync::Arc;

use sluice_nix::nar::reader::copy_nar;
use sluice_nix::path_info::{PathInfo, ValidPathInfo};
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::serve::{
    read_path_info_entries, serve_at_least, write_export_trailer, write_serve_request, write_unversioned_serve_request, AddToStoreNar,
    DumpStorePath, ImportPaths, QueryClosure, QueryPathInfos, QueryValidPaths,
};
use sluice_nix::wire::{read_store_path_set, read_u64, write_u64, ProtocolVersion};

use crate::ssh::{SshConfig, SshMaster};
use crate::store::{
    fetched_ahead, AdditionStream, NarReader, NarWritten, PipedNar, PublishGate, Store, StoreError, StoreFuture, StreamOutcomes,
    StreamedPath,
};
use pipeline::{Pipeline, Reply};

/// Additions spooled at once (each NAR is kept until its references are accepted).
const ADDITIONS_AT_ONCE: usize = 32;

/// NARs asked for ahead of their readers ([`Store::prefetch_nars`]), by path: each arrives
/// whole, or as why it did not.
type Prefetched = std::sync::Mutex<std::collections::HashMap<StorePath, tokio::sync::oneshot::Receiver<Result<Vec<u8>, String>>>>;
/// A NAR to add above this size is spooled to a temporary file rather than memory.
const SPOOL_IN_MEMORY: usize = 8 << 20;

/// `nix-store --serve --write` on a host, through ssh (see the module doc).
pub(crate) struct LegacySshStore {
    /// `ssh://[user@]host`, for messages.
    url: String,
    store_dir: StoreDir,
    conn: Arc<Pipeline>,
    prefetched: Prefetched,
    /// Kept for the host key file it holds while the connection lives.
    _master: SshMaster,
}

impl LegacySshStore {
    /// Runs the remote program (`remote-program --serve --write [--store remote-store]`) on
    /// the host of `ssh` and greets it, without waiting for its answer (the first request
    /// follows the greeting at once, [`pipeline`]). A host that cannot be reached, or a remote
    /// program that is missing or does not speak the protocol, is one error naming the host, at
    /// the first request; so is one that moves no byte either way for `stall` while a reply or
    /// a request waits ([`SshChannel::give_up_after`](crate::ssh::SshChannel::give_up_after)).
    pub fn open(ssh: &SshConfig, stall: std::time::Duration) -> Result<Self, StoreError> {
        let url = format!("ssh://{}", ssh.destination());
        let err = |e: String| StoreError::Other(e);
        let master = SshMaster::new(ssh.clone()).map_err(|e| err(format!("{url}: {e}")))?;
        let channel = master.start(&ssh.remote_command(&["--serve", "--write"])).map_err(|e| err(format!("{url}: {e}")))?;
        channel.give_up_after(stall).map_err(|e| err(format!("{url}: {e}")))?;
        let conn = Pipeline::start(&url, Box::new(channel.reader), Box::new(channel.writer)).map_err(err)?;
        Ok(LegacySshStore { url, store_dir: StoreDir::default(), conn: Arc::new(conn), prefetched: Prefetched::default(), _master: master })
    }

    /// Sends `write`'s request (one the far end reads alike at every version) and waits for
    /// the value `read` makes of its reply, given the negotiated version.
    async fn ask<T: Send + 'static>(
        &self,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
        read: impl FnOnce(&mut dyn Read, ProtocolVersion) -> Result<T, String> + Send + 'static,
    ) -> Result<T, StoreError> {
        let reply = self.conn.request(write, read);
        reply.await.map_err(|_| StoreError::Other(format!("{}: the connection ended", self.url)))?.map_err(StoreError::Other)
    }

    /// The infos of `paths` (one QueryPathInfos), by path; paths not valid there are absent.
    /// An answer about a path not asked is refused ([`read_path_info_entries`]).
    async fn infos(&self, paths: BTreeSet<StorePath>) -> Result<BTreeMap<StorePath, ValidPathInfo>, StoreError> {
        let (dir, url) = (self.store_dir.clone(), self.url.clone());
        let (req, asked) = (QueryPathInfos { paths: paths.clone() }, paths);
        let read_dir = dir.clone();
        let infos = self
            .ask(
                move |w| write_unversioned_serve_request(w, &dir, &req),
                move |r, version| read_path_info_entries(r, &read_dir, version, &asked).map_err(|e| format!("{url}: QueryPathInfos: {e}")),
            )
            .await?;
        Ok(infos.into_iter().map(|i| (i.path.clone(), i)).collect())
    }
}

impl Store for LegacySshStore {
    fn url(&self) -> &str {
        &self.url
    }

    fn store_dir(&self) -> &StoreDir {
        &self.store_dir
    }

    fn query_path_infos<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, Vec<Option<PathInfo>>> {
        Box::pin(async move {
            let mut infos = self.infos(paths.iter().cloned().collect()).await?;
            Ok(paths.iter().map(|p| infos.remove(p).map(PathInfo::of)).collect())
        })
    }

    /// One QueryValidPaths. An answer naming a path not asked is refused, as
    /// [`read_path_info_entries`] refuses an info not asked.
    fn query_valid_paths<'a>(&'a self, paths: &'a [StorePath]) -> StoreFuture<'a, BTreeSet<StorePath>> {
        Box::pin(async move {
            let (dir, url) = (self.store_dir.clone(), self.url.clone());
            let asked: BTreeSet<StorePath> = paths.iter().cloned().collect();
            let req = QueryValidPaths { lock: false, substitute: false, paths: asked.clone() };
            let read_dir = dir.clone();
            self.ask(
                move |w| write_unversioned_serve_request(w, &dir, &req),
                move |r, _| {
                    let valid = read_store_path_set(r, &read_dir, "valid paths").map_err(|e| format!("{url}: QueryValidPaths: {e}"))?;
                    match valid.iter().find(|p| !asked.contains(*p)) {
                        Some(p) => Err(format!("{url}: QueryValidPaths: it answered {}, which was not asked", read_dir.display_path(p))),
                        None => Ok(valid),
                    }
                },
            )
            .await
        })
    }

    /// QueryClosure, then QueryPathInfos of the closure: two round trips whatever its depth.
    /// The far end's closure must hold every root and every reference of its paths (Nix's
    /// `computeFSClosure` follows the references itself): one that does not is refused, naming
    /// the path it lacks, before any NAR is asked for.
    fn closure_infos<'a>(&'a self, roots: &'a [StorePath]) -> StoreFuture<'a, BTreeMap<StorePath, ValidPathInfo>> {
        Box::pin(async move {
            let (dir, url) = (self.store_dir.clone(), self.url.clone());
            let req = QueryClosure { include_outputs: false, paths: roots.iter().cloned().collect() };
            let read_dir = dir.clone();
            let closure = self
                .ask(
                    move |w| write_unversioned_serve_request(w, &dir, &req),
                    move |r, _| read_store_path_set(r, &read_dir, "closure").map_err(|e| format!("{url}: QueryClosure: {e}")),
                )
                .await?;
            let infos = self.infos(closure.clone()).await?;
            if let Some(p) = closure.iter().find(|p| !infos.contains_key(*p)) {
                return Err(StoreError::NotValid { url: self.url.clone(), path: self.store_dir.display_path(p) });
            }
            let outside = |(referrer, missing): (Option<&StorePath>, &StorePath)| {
                let shown = |p| self.store_dir.display_path(p);
                let why = match referrer {
                    Some(r) => format!("a reference of {}", shown(r)),
                    None => "a path asked for".into(),
                };
                StoreError::Other(format!("{}: QueryClosure: its answer lacks {}, {why}", self.url, shown(missing)))
            };
            let roots = roots.iter().map(|p| (None, p));
            let references = infos.values().flat_map(|i| i.references.iter().map(|r| (Some(&i.path), r)));
            match roots.chain(references).find(|(_, p)| !infos.contains_key(*p)) {
                Some(lacking) => Err(outside(lacking)),
                None => Ok(infos),
            }
        })
    }

    /// The NARs of `infos` (those [`fetched_ahead`] picks) are
    /// asked for at once, DumpStorePath pipelined, and kept as they arrive, back to back on
    /// the channel, until their readers take them: one round trip for the closure's NARs, where
    /// a window of readers would cost one per window.
    fn prefetch_nars(&self, infos: &[&ValidPathInfo]) {
        let mut prefetched = self.prefetched.lock().unwrap_or_else(|p| p.into_inner());
        for info in fetched_ahead(infos) {
            let (dir, url) = (self.store_dir.clone(), self.url.clone());
            let shown = dir.display_path(&info.path);
            let (req, size) = (DumpStorePath { path: info.path.clone() }, info.nar_size);
            let nar = self.conn.request(
                move |w| write_unversioned_serve_request(w, &dir, &req),
                move |r, _| {
                    let mut nar = Vec::with_capacity(size as usize);
                    copy_nar(r.take(size), &mut nar)
                        .map_err(|e| format!("{url}: the NAR of {shown} (of {size} bytes, its info says): {e}"))?;
                    Ok(nar)
                },
            );
            prefetched.insert(info.path.clone(), nar);
        }
    }

    /// DumpStorePath answers come in the order asked, on one channel.
    fn streams_nars_in_order(&self) -> bool {
        true
    }

    /// The NAR fetched ahead ([`Store::prefetch_nars`]) once it has arrived; else DumpStorePath,
    /// sent at once, the NAR copied into the returned reader's pipe by the connection's reader
    /// thread when its turn comes. If the reader is dropped, the rest of the NAR is still read
    /// off the connection (and dropped) to keep it in step. No more than the info's NAR size is
    /// read, ahead or not: a NAR that goes on past it is an error (the connection is then out of
    /// step), not read for ever.
    fn nar_from_path<'a>(&'a self, info: &'a ValidPathInfo) -> StoreFuture<'a, NarReader> {
        Box::pin(async move {
            let ahead = self.prefetched.lock().unwrap_or_else(|p| p.into_inner()).remove(&info.path);
            if let Some(ahead) = ahead {
                let nar = ahead.await.map_err(|_| StoreError::Other(format!("{}: the connection ended", self.url)))?;
                return Ok(Box::new(io::Cursor::new(nar.map_err(StoreError::Other)?)) as NarReader);
            }
            let (dir, url) = (self.store_dir.clone(), self.url.clone());
            let shown = dir.display_path(&info.path);
            let (req, nar_size) = (DumpStorePath { path: info.path.clone() }, info.nar_size);
            let conn = self.conn.clone();
            let nar = PipedNar::start(&self.url, move |pipe| {
                let reply = conn.request(
                    move |w| write_unversioned_serve_request(w, &dir, &req),
                    move |r, _| {
                        let mut copy = Forward { pipe, failed: None };
                        copy_nar(r.take(nar_size), &mut copy)
                            .map_err(|e| format!("{url}: the NAR of {shown} (of {nar_size} bytes, its info says): {e}"))?;
                        Ok(copy.failed)
                    },
                );
                let written: NarWritten = Box::pin(async move {
                    match reply.await {
                        Ok(Ok(None)) => Ok(()),
                        Ok(Ok(Some(e))) => Err(e),
                        Ok(Err(e)) => Err(io::Error::other(e)),
                        Err(_) => Err(io::Error::other("the connection ended")),
                    }
                });
                Ok(written)
            });
            Ok(Box::new(nar.map_err(|e| StoreError::Other(format!("{}: {e}", self.url)))?) as NarReader)
        })
    }

    /// The NAR is spooled, then, once the path's references were accepted, sent with
    /// AddToStoreNar (ImportPaths before 2.5); the far end's `1` is awaited.
    fn add_to_store<'a>(&'a self, info: ValidPathInfo, mut nar: NarReader, publish: PublishGate) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let shown = self.store_dir.display_path(&info.path);
            let url = self.url.clone();
            let spool_err = {
                let (url, shown) = (url.clone(), shown.clone());
                move |e: io::Error| StoreError::Other(format!("{url}: spooling the NAR of {shown}: {e}"))
            };
            let spooled = tokio::task::spawn_blocking(move || {
                let mut spool = tempfile::SpooledTempFile::new(SPOOL_IN_MEMORY);
                io::copy(&mut nar, &mut spool)?;
                spool.rewind()?;
                Ok::<_, io::Error>(spool)
            })
            .await
            .map_err(|e| StoreError::Other(format!("{url}: {e}")))?;
            let mut spool = spooled.map_err(spool_err)?;
            publish.await?;
            let (dir, conn) = (self.store_dir.clone(), self.conn.clone());
            let reply = tokio::task::spawn_blocking(move || send_addition(&conn, &dir, info, &mut spool))
                .await
                .map_err(|e| StoreError::Other(format!("{url}: {e}")))?;
            self.answer(shown, reply).await
        })
    }

    /// Every path as soon as its NAR is open: AddToStoreNar (ImportPaths of one path before
    /// 2.5) pipelined, each NAR streamed from its source into the request, the far end's
    /// answers read as they come: one stream, no round trip per path or per level (Nix's
    /// `LegacySSHStore` waits for each path's answer).
    fn add_stream<'a>(&'a self, count: usize, mut additions: AdditionStream) -> StoreFuture<'a, StreamOutcomes> {
        Box::pin(async move {
            let (dir, conn) = (self.store_dir.clone(), self.conn.clone());
            let sent = tokio::task::spawn_blocking(move || {
                let mut sent = Vec::with_capacity(count);
                while let Some(StreamedPath { info, mut nar }) = additions.blocking_recv() {
                    let (path, shown) = (info.path.clone(), dir.display_path(&info.path));
                    sent.push((path, shown, send_addition(&conn, &dir, info, &mut nar)));
                }
                sent
            });
            let sent = sent.await.map_err(|e| StoreError::Other(format!("{}: {e}", self.url)))?;
            let mut outcomes = Vec::with_capacity(sent.len());
            for (path, shown, reply) in sent {
                outcomes.push((path, self.answer(shown, reply).await));
            }
            Ok(outcomes)
        })
    }

    fn takes_streams(&self) -> bool {
        true
    }

    fn parallelism(&self) -> usize {
        ADDITIONS_AT_ONCE
    }
}

impl LegacySshStore {
    /// The outcome of the addition of `shown` from the far end's answer `reply`: `1` is added.
    async fn answer(&self, shown: String, reply: Reply<u64>) -> Result<(), StoreError> {
        match reply.await.map_err(|_| StoreError::Other(format!("{}: the connection ended", self.url)))? {
            Ok(1) => Ok(()),
            Ok(n) => Err(StoreError::Other(format!("{}: failed to add path '{shown}' (answered {n})", self.url))),
            Err(e) => Err(StoreError::Other(e)),
        }
    }
}

/// Sends the addition of `info.path` with its NAR, read from `nar` as it is sent (exactly its
/// `NarSize` bytes): AddToStoreNar, or before 2.5 ImportPaths of that one path; its answer.
/// Waits for the far end's version, which decides the request.
fn send_addition(conn: &Pipeline, dir: &StoreDir, info: ValidPathInfo, nar: &mut dyn Read) -> Reply<u64> {
    let (url, shown) = (conn.name().to_string(), dir.display_path(&info.path));
    conn.request_versioned(
        move |w, version| {
            let mut nar = nar.take(info.nar_size);
            let copied = match serve_at_least(version, 5) {
                true => {
                    write_serve_request(w, dir, version, &AddToStoreNar { info: info.clone() })?;
                    io::copy(&mut nar, w)?
                }
                false => {
                    write_serve_request(w, dir, version, &ImportPaths)?;
                    write_u64(w, 1)?;
                    let copied = io::copy(&mut nar, w)?;
                    write_export_trailer(w, dir, &info)?;
                    write_u64(w, 0)?;
                    copied
                }
            };
            match copied == info.nar_size {
                true => Ok(()),
                false => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the NAR ended after {copied} of its {} bytes", info.nar_size),
                )),
            }
        },
        move |r, _| read_u64(r, "import answer").map_err(|e| format!("{url}: adding {shown}: {e}")),
    )
}

/// Writes into a NAR's pipe until a write fails (its reader is gone), then drops the rest,
/// keeping the error for the reader's end.
struct Forward {
    pipe: std::fs::File,
    failed: Option<io::Error>,
}

impl Write for Forward {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.failed.is_none() {
            if let Err(e) = self.pipe.write_all(buf) {
                self.failed = Some(e);
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
