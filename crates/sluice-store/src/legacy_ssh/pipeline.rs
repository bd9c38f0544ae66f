//! One serve-protocol connection with its requests pipelined: a request is written (and
//! flushed) as soon as it is made, by the caller, while a thread of the connection reads the
//! replies in the order the requests went out, each with the reader its request left behind.
//! So every NAR asked for streams back to back on the channel, and a query costs one round
//! trip however many are in flight. Nix's `LegacySSHStore` waits for each reply before the
//! next request (`serve-protocol-connection.cc`).
//!
//! A reply that cannot be read leaves the stream out of step: the connection is then broken,
//! and every request after it fails with the first error.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use sluice_nix::wire::serve::client_handshake;
use sluice_nix::wire::ProtocolVersion;

/// What reads one reply: given the connection's reader, or the error that broke the connection
/// before it. It returns an error only when the stream is out of step after it.
type ReplyReader = Box<dyn FnOnce(Result<&mut dyn Read, &str>) -> Result<(), String> + Send>;

/// The writing half: the channel to the far end, and the queue of reply readers, taken
/// together so that replies are queued in the order their requests were written.
struct Sending {
    w: BufWriter<Box<dyn Write + Send>>,
    replies: mpsc::Sender<ReplyReader>,
    /// Set once a write failed: the far end may have half a request.
    broken: Option<String>,
}

/// The value read from a reply, or why there is none (see [`Pipeline::request`]).
pub(super) type Reply<T> = tokio::sync::oneshot::Receiver<Result<T, String>>;

/// A pipelined serve-protocol connection (see the module doc).
pub(super) struct Pipeline {
    /// `ssh://host`, for errors.
    name: String,
    version: ProtocolVersion,
    sending: Mutex<Sending>,
    /// Set by the reader thread when a reply could not be read.
    broken: Arc<Mutex<Option<String>>>,
}

/// Bytes buffered each way.
const BUFFER: usize = 256 << 10;

impl Pipeline {
    /// Greets the far end on `r`/`w` (`name` for errors) and starts the reader thread.
    pub fn start(name: &str, r: Box<dyn Read + Send>, w: Box<dyn Write + Send>) -> Result<Self, String> {
        let mut r = BufReader::with_capacity(BUFFER, r);
        let mut w = BufWriter::with_capacity(BUFFER, w);
        let version = client_handshake(&mut r, &mut w).map_err(|e| format!("{name}: 'nix-store --serve' handshake: {e}"))?;
        if !sluice_nix::wire::serve::serve_at_least(version, 4) {
            return Err(format!("{name}: 'nix-store --serve' protocol {version} is too old (2.4, which sends NAR hashes, is needed)"));
        }
        let (replies, queue) = mpsc::channel::<ReplyReader>();
        let broken = Arc::new(Mutex::new(None));
        let reader_broken = broken.clone();
        let spawned = std::thread::Builder::new().name("sluice-ssh-replies".into()).spawn(move || read_replies(r, &queue, &reader_broken));
        spawned.map_err(|e| format!("{name}: starting the reader thread: {e}"))?;
        Ok(Pipeline { name: name.to_string(), version, sending: Mutex::new(Sending { w, replies, broken: None }), broken })
    }

    /// The far end's name (`ssh://host`), for errors.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The negotiated protocol version.
    pub fn version(&self) -> ProtocolVersion {
        self.version
    }

    /// Writes a request with `write` (flushed) and queues `read` for its reply; the reply's
    /// value, or why there is none. `read` returns `Err` only for a reply that could not be
    /// read (the connection is then broken).
    pub fn request<T: Send + 'static>(
        &self,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
        read: impl FnOnce(&mut dyn Read) -> Result<T, String> + Send + 'static,
    ) -> Reply<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut s = self.sending.lock().unwrap_or_else(|p| p.into_inner());
        let failed = self.broken_by().or_else(|| s.broken.clone());
        if let Some(e) = failed {
            let _ = tx.send(Err(e));
            return rx;
        }
        if let Err(e) = write(&mut s.w).and_then(|_| s.w.flush()) {
            let e = format!("{}: sending a request: {e}", self.name);
            s.broken = Some(e.clone());
            let _ = tx.send(Err(e));
            return rx;
        }
        let reader: ReplyReader = Box::new(move |r| match r {
            Ok(r) => {
                let result = read(r);
                let out = result.as_ref().err().cloned();
                let _ = tx.send(result);
                out.map_or(Ok(()), Err)
            }
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                Ok(())
            }
        });
        if s.replies.send(reader).is_err() {
            s.broken = Some(format!("{}: the connection's reader stopped", self.name));
        }
        rx
    }

    /// The error that broke the connection on the reading side, if any.
    fn broken_by(&self) -> Option<String> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The reader thread: runs each reply reader in turn, until the connection is dropped.
fn read_replies(mut r: BufReader<Box<dyn Read + Send>>, queue: &mpsc::Receiver<ReplyReader>, broken: &Mutex<Option<String>>) {
    let mut failed: Option<String> = None;
    for reader in queue {
        match &failed {
            Some(e) => {
                let _ = reader(Err(e));
            }
            None => {
                if let Err(e) = reader(Ok(&mut r)) {
                    *broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
                    failed = Some(e);
                }
            }
        }
    }
}
