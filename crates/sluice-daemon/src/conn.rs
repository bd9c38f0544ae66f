//! One client connection's context (the server loop is `server::serve_connection`). Replies
//! follow Nix's `TunnelLogger`: log messages, then `LAST` and the result, or `ERROR`. A
//! request that cannot be read (malformed, truncated, oversized, unknown op) is answered
//! with one `ERROR` and the connection is closed, since the stream cannot be resynchronised;
//! a failing operation whose request was read completely leaves the connection usable.

use std::cell::RefCell;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::rc::Rc;
use std::sync::Arc;

use sluice_local_store::{KeptTempDir, LocalStore, TempRoots};
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::ops::{read_request, Op, Request};
use sluice_nix::wire::{ProtocolVersion, StderrWriter, WireError};

use crate::duplex::{Input, Lease, Output};
use crate::limits::{Admitted, RequestBytes, FREE_REQUEST_BYTES};
use crate::options::ClientOptions;
use crate::trust::Peer;
use crate::Daemon;

/// The buffered reading side of a connection.
pub(crate) type Reader = BufReader<Input>;
/// The buffered writing side of a connection: sent when the worker waits for the client's
/// next request (see [`crate::duplex`]), or at once by `flush`.
pub(crate) type Writer = Output;

/// How an operation failed.
#[derive(Debug)]
pub(crate) enum Fail {
    /// The request could not be read or is not acceptable as a request: reported, then the
    /// connection is closed.
    Fatal(String),
    /// The operation failed after its request was read: reported; the connection goes on.
    Op(String),
    /// Writing to the client failed: the connection is closed.
    Output(io::Error),
}

impl From<WireError> for Fail {
    fn from(e: WireError) -> Self {
        Fail::Fatal(e.to_string())
    }
}

impl From<io::Error> for Fail {
    fn from(e: io::Error) -> Self {
        Fail::Output(e)
    }
}

/// The outcome of one operation.
pub(crate) type OpResult = Result<(), Fail>;

/// An operation failure with `e`'s message.
pub(crate) fn op_err(e: impl std::fmt::Display) -> Fail {
    Fail::Op(e.to_string())
}

/// The reader of an untrusted connection's request: past [`FREE_REQUEST_BYTES`], each MiB is
/// taken from the shares of request memory before it is read.
struct Counted<'r, 'a> {
    inner: &'r mut Reader,
    read: u64,
    bytes: RequestBytes<'a>,
    /// Why a share refused more.
    refused: Option<String>,
}

/// The request memory taken at a time.
const REQUEST_BYTES_STEP: u64 = 1 << 20;

impl Read for Counted<'_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut allowed = FREE_REQUEST_BYTES.saturating_add(self.bytes.taken()) - self.read;
        if allowed == 0 && !buf.is_empty() {
            if let Err(why) = self.bytes.take(REQUEST_BYTES_STEP) {
                self.refused = Some(why.clone());
                return Err(io::Error::other(why));
            }
            allowed = REQUEST_BYTES_STEP;
        }
        let want = buf.len().min(usize::try_from(allowed).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.read += n as u64;
        Ok(n)
    }
}

/// A connection's state after the greeting.
pub(crate) struct Conn<'d> {
    pub daemon: &'d Daemon,
    /// The store this connection uses from start to end ([`Daemon::connection_store`]).
    pub store: Arc<LocalStore>,
    pub r: Reader,
    pub w: Writer,
    /// The negotiated protocol version.
    pub version: ProtocolVersion,
    pub peer: Peer,
    pub options: ClientOptions,
    /// This connection's temporary GC roots (the file is created at the first root; they end
    /// with the connection, as a `nix-daemon` child's do).
    pub temp_roots: TempRoots,
    /// What the connection keeps while its client keeps asking.
    pub kept: Rc<Kept>,
    /// The connection's place among the socket's connections (none on standard input).
    pub admitted: Option<&'d Admitted>,
}

/// What a connection keeps while its client keeps asking (see [`crate::duplex`]): the shared
/// GC lock of its temporary roots, and the store's directory of temporary trees once an
/// addition used it.
pub(crate) struct Kept {
    pub roots: TempRoots,
    temp_dir: RefCell<Option<KeptTempDir>>,
}

impl Kept {
    pub(crate) fn new(roots: TempRoots) -> Rc<Kept> {
        Rc::new(Kept { roots, temp_dir: RefCell::new(None) })
    }

    /// Keeps `store`'s directory of temporary trees (an addition is about to use it) while the
    /// GC lock is kept; a failure is the addition's to meet.
    pub(crate) fn keep_temp_dir(&self, store: &LocalStore) {
        let mut kept = self.temp_dir.borrow_mut();
        if kept.is_none() && self.roots.gc_lock_held_for().is_some() {
            *kept = store.keep_temp_dir().ok();
        }
    }
}

impl Kept {
    /// How long the GC lock has been kept (zero for a directory kept without it), if either is.
    pub(crate) fn held_for(&self) -> Option<std::time::Duration> {
        let dir = || self.temp_dir.borrow().as_ref().map(|_| std::time::Duration::ZERO);
        self.roots.gc_lock_held_for().or_else(dir)
    }

    /// Gives up the GC lock and the directory.
    pub(crate) fn release(&self) {
        self.roots.release_gc_lock();
        self.temp_dir.borrow_mut().take();
    }
}

impl Lease for Rc<Kept> {
    fn held_for(&self) -> Option<std::time::Duration> {
        Kept::held_for(self)
    }

    fn release(&self) {
        Kept::release(self)
    }
}

impl<'d> Conn<'d> {
    /// The stderr-channel writer for this connection's version.
    pub(crate) fn stderr(&self) -> StderrWriter {
        StderrWriter { version: self.version }
    }

    pub(crate) fn store(&self) -> &Arc<LocalStore> {
        &self.store
    }

    pub(crate) fn dir(&self) -> &StoreDir {
        self.store.store_dir()
    }

    /// Reads the request of an operation (after its number) as this connection's version
    /// sends it, within its byte budget; one that cannot be read is fatal. For an untrusted
    /// client, what the request took of the daemon's request memory comes with it, to be
    /// held until its operation is done (see [`crate::limits`]); a request refused more is fatal.
    pub(crate) fn read_request<R: Request>(&mut self) -> Result<(R, Option<RequestBytes<'d>>), Fail> {
        let dir = self.store.store_dir();
        let Some(bytes) = self.admitted.map(Admitted::request_bytes).filter(RequestBytes::counted) else {
            return Ok((read_request::<R>(&mut self.r, dir, self.version)?, None));
        };
        let mut counted = Counted { inner: &mut self.r, read: 0, bytes, refused: None };
        match read_request::<R>(&mut counted, dir, self.version) {
            Ok(request) => Ok((request, Some(counted.bytes))),
            Err(e) => Err(Fail::Fatal(
                counted.refused.take().map_or_else(|| e.to_string(), |why| format!("{} request refused: {why}", R::OP.name())),
            )),
        }
    }

    /// Whether the read buffer already holds a whole next request for operation `op` whose
    /// request is one string of at most `max` bytes (such as a store path). If so, the
    /// operation number is consumed and its request is what is read next; if not, nothing is
    /// consumed. Reads nothing from the client.
    pub(crate) fn take_buffered_request(&mut self, op: Op, max: u64) -> bool {
        let buf = self.r.buffer();
        let word = |at: usize| buf.get(at..at + 8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(u64::from_le_bytes);
        let whole = match (word(0), word(8)) {
            (Some(o), Some(len)) if o == op.to_wire() && len <= max => buf.len() as u64 >= 16 + len.next_multiple_of(8),
            _ => false,
        };
        if whole {
            self.r.consume(8);
        }
        whole
    }

    /// Writes `LAST`, then the result written by `result`. They are sent when the worker
    /// next waits for the client.
    pub(crate) fn reply(&mut self, result: impl FnOnce(&mut Writer, &StoreDir) -> io::Result<()>) -> OpResult {
        self.stderr().last(&mut self.w)?;
        result(&mut self.w, self.store.store_dir())?;
        Ok(())
    }

    /// Makes `paths` temporary GC roots for the rest of the connection, written together in
    /// the file Nix's collector reads; the shared GC lock is kept while the client keeps
    /// asking (see [`crate::duplex`]).
    pub(crate) fn add_temp_roots(&mut self, paths: &[StorePath]) -> Result<(), Fail> {
        self.temp_roots.add_all_keeping_gc_lock(paths).map_err(op_err)
    }

    /// Sends a log line (`NEXT`) at once.
    pub(crate) fn log(&mut self, line: &str) -> io::Result<()> {
        self.stderr().next(&mut self.w, &format!("{line}\n"))?;
        self.w.flush()
    }
}
