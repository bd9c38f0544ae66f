//! One serve-protocol connection with its requests pipelined: a request is written (and
//! flushed) as soon as it is made, by the caller, while a thread of the connection reads the
//! replies in the order the requests went out, each with the reader its request left behind.
//! So every NAR asked for streams back to back on the channel, and a query costs one round
//! trip however many are in flight. Nix's `LegacySSHStore` waits for each reply before the
//! next request (`serve-protocol-connection.cc`).
//!
//! The greeting is pipelined too: the client's half is sent when the connection starts and the
//! first request right behind it, before the far end's answer (the reader thread reads that
//! answer before the first reply), so that the first reply comes one round trip after the
//! connection's start, not two. Only a request written alike at every version
//! ([`Unversioned`](sluice_nix::wire::serve::Unversioned)) is sent before the far end's
//! version is known; the others wait for it ([`Pipeline::request_versioned`]).
//!
//! A reply that cannot be read leaves the stream out of step: the connection is then broken,
//! and every request after it fails with the first error.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use sluice_nix::wire::serve::{client_hello, read_server_hello, serve_at_least};
use sluice_nix::wire::ProtocolVersion;

/// What reads one reply: given the connection's reader and the negotiated version, or the error
/// that broke the connection before it. It returns an error only when the stream is out of
/// step after it.
type ReplyReader = Box<dyn FnOnce(Result<(&mut dyn Read, ProtocolVersion), &str>) -> Result<(), String> + Send>;

/// The far end's answer to the greeting, once the reader thread has read it: the negotiated
/// version, or why there is none.
#[derive(Default)]
struct Greeting {
    answer: Mutex<Option<Result<ProtocolVersion, String>>>,
    answered: Condvar,
}

impl Greeting {
    fn set(&self, answer: Result<ProtocolVersion, String>) {
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer);
        self.answered.notify_all();
    }

    /// Waits for the answer.
    fn wait(&self) -> Result<ProtocolVersion, String> {
        let mut answer = self.answer.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(answer) = answer.as_ref() {
                return answer.clone();
            }
            answer = self.answered.wait(answer).unwrap_or_else(|p| p.into_inner());
        }
    }
}

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
    greeting: Arc<Greeting>,
    sending: Mutex<Sending>,
    /// Set by the reader thread when a reply could not be read.
    broken: Arc<Mutex<Option<String>>>,
}

/// Bytes buffered each way.
const BUFFER: usize = 256 << 10;

impl Pipeline {
    /// Sends the client's half of the greeting on `w` (`name` for errors) and starts the reader
    /// thread, which reads the far end's answer from `r` before any reply. A far end that does
    /// not answer as `nix-store --serve` 2.4 or later breaks the connection: every request fails
    /// with that error.
    pub fn start(name: &str, r: Box<dyn Read + Send>, w: Box<dyn Write + Send>) -> Result<Self, String> {
        let r = BufReader::with_capacity(BUFFER, r);
        let mut w = BufWriter::with_capacity(BUFFER, w);
        client_hello(&mut w).map_err(|e| format!("{name}: 'nix-store --serve' handshake: {e}"))?;
        let (replies, queue) = mpsc::channel::<ReplyReader>();
        let (broken, greeting) = (Arc::new(Mutex::new(None)), Arc::new(Greeting::default()));
        let (reader_broken, reader_greeting, reader_name) = (broken.clone(), greeting.clone(), name.to_string());
        let spawned = std::thread::Builder::new()
            .name("sluice-ssh-replies".into())
            .spawn(move || read_replies(r, &reader_name, &reader_greeting, &queue, &reader_broken));
        spawned.map_err(|e| format!("{name}: starting the reader thread: {e}"))?;
        Ok(Pipeline { name: name.to_string(), greeting, sending: Mutex::new(Sending { w, replies, broken: None }), broken })
    }

    /// The far end's name (`ssh://host`), for errors.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The negotiated protocol version, once the far end has answered the greeting (this waits
    /// for it), or why it did not.
    pub fn version(&self) -> Result<ProtocolVersion, String> {
        self.greeting.wait()
    }

    /// [`request`](Self::request) of a request whose writing depends on the negotiated version,
    /// given to `write`: it waits for the far end's answer to the greeting.
    pub fn request_versioned<T: Send + 'static>(
        &self,
        write: impl FnOnce(&mut dyn Write, ProtocolVersion) -> io::Result<()>,
        read: impl FnOnce(&mut dyn Read, ProtocolVersion) -> Result<T, String> + Send + 'static,
    ) -> Reply<T> {
        match self.version() {
            Ok(version) => self.request(move |w| write(w, version), read),
            Err(e) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let _ = tx.send(Err(e));
                rx
            }
        }
    }

    /// Writes a request with `write` (flushed), which must not depend on the far end's version
    /// (it may not be known yet), and queues `read` for its reply, given the negotiated version;
    /// the reply's value, or why there is none. `read` returns `Err` only for a reply that could
    /// not be read (the connection is then broken).
    pub fn request<T: Send + 'static>(
        &self,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
        read: impl FnOnce(&mut dyn Read, ProtocolVersion) -> Result<T, String> + Send + 'static,
    ) -> Reply<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut s = self.sending.lock().unwrap_or_else(|p| p.into_inner());
        let failed = self.broken_by().or_else(|| s.broken.clone());
        if let Some(e) = failed {
            let _ = tx.send(Err(e));
            return rx;
        }
        if let Err(e) = write(&mut s.w).and_then(|_| s.w.flush()) {
            // A far end that never answered the greeting (a remote program that is missing or
            // is not `nix-store --serve`) is said as such, not as the write it made fail.
            let e = match self.greeting.wait() {
                Err(unanswered) => unanswered,
                Ok(_) => format!("{}: sending a request: {e}", self.name),
            };
            s.broken = Some(e.clone());
            let _ = tx.send(Err(e));
            return rx;
        }
        let reader: ReplyReader = Box::new(move |r| match r {
            Ok((r, version)) => {
                let result = read(r, version);
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

/// The reader thread: reads the far end's answer to the greeting (told to `greeting`), then
/// runs each reply reader in turn, until the connection is dropped.
fn read_replies(
    mut r: BufReader<Box<dyn Read + Send>>,
    name: &str,
    greeting: &Greeting,
    queue: &mpsc::Receiver<ReplyReader>,
    broken: &Mutex<Option<String>>,
) {
    let answer =
        read_server_hello(&mut r).map_err(|e| format!("{name}: 'nix-store --serve' handshake: {e}")).and_then(
            |version| match serve_at_least(version, 4) {
                true => Ok(version),
                false => Err(format!("{name}: 'nix-store --serve' protocol {version} is too old (2.4, which sends NAR hashes, is needed)")),
            },
        );
    greeting.set(answer.clone());
    if let Err(e) = &answer {
        *broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
    }
    // The negotiated version, or the first error, which every later reply gets.
    let mut state = answer;
    for reader in queue {
        match &state {
            Err(e) => {
                let _ = reader(Err(e));
            }
            Ok(version) => {
                if let Err(e) = reader(Ok((&mut r, *version))) {
                    *broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
                    state = Err(e);
                }
            }
        }
    }
}
