//! A connection's two directions, coupled so that replies to pipelined requests leave in one
//! write: what the worker writes waits in an output buffer until the worker reads from the
//! client's socket again (or the buffer holds [`OUTPUT_CAPACITY`] bytes, or an explicit `flush`
//! sends a log message at once). The worker reads the client through a buffer
//! (`conn::Reader`), so requests that arrived together are answered from it without a read,
//! and their replies leave together when it is empty; a client that sends one request and
//! waits, as every Nix client does, gets each reply in one write just before the worker reads
//! its next request. Since the buffer is always emptied before a read, a client that waits for
//! a reply before it finishes sending the next request is never left waiting on a reply held
//! back.
//!
//! A [`Lease`] (the connection's shared GC lock) is kept while the client keeps up: while it
//! is held, a read waits at most [`LEASE_IDLE`] for the client and a write at most as long for
//! room in the socket before the lease is given up (the read or write then goes on without a
//! deadline), and a lease held longer than [`LEASE_MAX`] is given up before the next read. On
//! standard input and output (`--stdio`), it is given up before every read and write.

use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use rustix::net::sockopt::{set_socket_timeout, Timeout};
use sluice_compress::zstd_channel::{Switch, ZstdChannelReader, ZstdChannelWriter};

/// Output is sent once this many bytes wait (bytes).
pub(crate) const OUTPUT_CAPACITY: usize = 64 * 1024;

/// How long a read or write waits for the client before a held [`Lease`] is given up.
pub(crate) const LEASE_IDLE: Duration = Duration::from_millis(10);

/// How long a [`Lease`] is kept at most while the client keeps up.
pub(crate) const LEASE_MAX: Duration = Duration::from_millis(50);

/// Something the worker holds on the client's behalf between requests, to be let go when the
/// client does not keep up: see the module documentation.
pub(crate) trait Lease {
    /// How long it has been held, if it is.
    fn held_for(&self) -> Option<Duration>;
    /// Lets it go.
    fn release(&self);
}

/// What a client connection is read from: a readable file descriptor (a Unix socket, or
/// standard input for `--stdio`).
pub(crate) trait ClientInput: Read + AsFd + Send {}

impl<T: Read + AsFd + Send> ClientInput for T {}

/// What both sides share: the output waiting to be sent and where it goes, and the lease.
struct Shared {
    pending: Vec<u8>,
    sink: Box<dyn Write + Send>,
    lease: Option<Box<dyn Lease>>,
    /// The client's socket, to set its timeouts; `None` for standard input.
    socket: Option<OwnedFd>,
    /// Whether reads and writes wait at most [`LEASE_IDLE`] (`SO_RCVTIMEO`, `SO_SNDTIMEO`).
    timed: bool,
    /// Once the connection is compressed ([`Input::compress`]): what compresses the output
    /// before it is sent.
    zstd: Option<ZstdChannelWriter<Vec<u8>>>,
    /// When reading must be done by ([`Input::set_deadline`]).
    deadline: Option<Instant>,
}

impl Shared {
    /// Writes out everything pending (the buffer is emptied even if that fails: the
    /// connection is then unusable anyway).
    fn send(&mut self) -> io::Result<()> {
        let pending = std::mem::take(&mut self.pending);
        let sent = self.write_through(&pending);
        self.pending = pending;
        self.pending.clear();
        sent
    }

    /// Writes all of `data` to the sink (compressed, once the connection is) and flushes it.
    fn write_through(&mut self, data: &[u8]) -> io::Result<()> {
        let Some(zstd) = &mut self.zstd else { return self.write_plain(data) };
        zstd.write_all(data)?;
        let packed = std::mem::take(zstd.get_mut());
        let sent = self.write_plain(&packed);
        if let Some(zstd) = &mut self.zstd {
            *zstd.get_mut() = packed;
            zstd.get_mut().clear();
        }
        sent
    }

    /// Writes all of `data` to the sink and flushes it. A write that waited [`LEASE_IDLE`]
    /// gives the lease up and goes on without a deadline.
    fn write_plain(&mut self, mut data: &[u8]) -> io::Result<()> {
        if !self.timed_for_lease() {
            self.release();
        }
        while !data.is_empty() {
            match self.sink.write(data) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if self.timed && matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    self.release();
                    self.set_timeouts(None)?;
                }
                Err(e) => return Err(e),
            }
        }
        self.sink.flush()
    }

    /// Gives the lease up, if held.
    fn release(&self) {
        if let Some(lease) = self.lease.as_ref().filter(|l| l.held_for().is_some()) {
            lease.release();
        }
    }

    /// Sets the socket's read and write timeouts; `false` if there is no socket.
    fn set_timeouts(&mut self, timeout: Option<Duration>) -> io::Result<bool> {
        let Some(socket) = &self.socket else { return Ok(false) };
        let set = [Timeout::Recv, Timeout::Send].into_iter().try_for_each(|which| set_socket_timeout(socket, which, timeout));
        match set {
            Ok(()) => {
                self.timed = timeout.is_some();
                Ok(true)
            }
            Err(rustix::io::Errno::NOTSOCK) => {
                self.socket = None;
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// How long the lease has been held, if it is.
    fn held_for(&self) -> Option<Duration> {
        self.lease.as_ref().and_then(|l| l.held_for())
    }

    /// Whether the lease is held and reads and writes wait at most [`LEASE_IDLE`] (set now if
    /// they did not; `false` without a socket).
    fn timed_for_lease(&mut self) -> bool {
        self.held_for().is_some() && (self.timed || self.set_timeouts(Some(LEASE_IDLE)).unwrap_or(false))
    }

    /// Bounds the next read by the deadline, if there is one: `SO_RCVTIMEO` (and
    /// `SO_SNDTIMEO`) set to the time left, or a `TimedOut` error once it has passed or if
    /// there is no socket to bound. Without a deadline, lets the read wait as long as it takes.
    fn time_read(&mut self) -> io::Result<()> {
        let Some(deadline) = self.deadline else {
            return match self.timed {
                true => self.set_timeouts(None).map(|_| ()),
                false => Ok(()),
            };
        };
        let left = deadline.saturating_duration_since(Instant::now());
        // A zero timeout would mean none at all.
        if left.is_zero() || !self.set_timeouts(Some(left))? {
            return Err(deadline_passed());
        }
        Ok(())
    }

    /// Whether the next read may keep the lease, waiting at most [`LEASE_IDLE`] for the
    /// client: it is held, not for [`LEASE_MAX`] yet, and the source is a socket.
    fn keep_lease(&mut self) -> bool {
        self.held_for().is_some_and(|h| h < LEASE_MAX) && self.timed_for_lease()
    }
}

/// The writing side: buffers until the reading side reads from the client, the buffer is
/// full, or `flush` is called.
pub(crate) struct Output(Rc<RefCell<Shared>>);

/// The reading side: before each read from the client, sends pending output.
pub(crate) struct Input {
    source: ZstdChannelReader<Box<dyn ClientInput>>,
    /// Whether `source` is decoded as zstd.
    zstd: Switch,
    shared: Rc<RefCell<Shared>>,
}

/// Couples `source` and `sink` (the two directions of one client connection).
pub(crate) fn duplex(source: Box<dyn ClientInput>, sink: Box<dyn Write + Send>) -> (Input, Output) {
    let socket = source.as_fd().try_clone_to_owned().ok();
    let shared =
        Shared { pending: Vec::with_capacity(OUTPUT_CAPACITY), sink, lease: None, socket, timed: false, zstd: None, deadline: None };
    let shared = Rc::new(RefCell::new(shared));
    let zstd = Switch::default();
    (Input { source: ZstdChannelReader::new(source, zstd.clone()), zstd, shared: Rc::clone(&shared) }, Output(shared))
}

impl Write for Output {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut out = self.0.borrow_mut();
        if out.pending.len() + data.len() > OUTPUT_CAPACITY {
            out.send()?;
        }
        if data.len() >= OUTPUT_CAPACITY {
            // Flushed too: a sink with its own buffer (standard output is line-buffered) would
            // otherwise keep the tail, and nothing would send it before the worker waits.
            out.write_through(data)?;
            return Ok(data.len());
        }
        out.pending.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.borrow_mut().send()
    }
}

impl Input {
    /// Reads from the client must be done by `deadline` (all of them together, however little
    /// each one brings: a socket's `SO_RCVTIMEO` is set to the time left before each read);
    /// `None` lets reads wait without a deadline again. A read past the deadline, or with one
    /// on standard input (which has no timeout), fails with `TimedOut`.
    pub(crate) fn set_deadline(&mut self, deadline: Option<Instant>) -> io::Result<()> {
        let mut shared = self.shared.borrow_mut();
        shared.deadline = deadline;
        match deadline {
            Some(_) => Ok(()),
            None => shared.set_timeouts(None).map(|_| ()),
        }
    }

    /// From now on, both directions are zstd streams (the [`SLUICE_ZSTD`] feature: see
    /// `sluice_compress::zstd_channel`). Called with nothing pending either way: right after the
    /// greeting, which the client answers only with a request.
    ///
    /// [`SLUICE_ZSTD`]: sluice_nix::wire::features::SLUICE_ZSTD
    pub(crate) fn compress(&mut self) {
        self.zstd.on();
        self.shared.borrow_mut().zstd = Some(ZstdChannelWriter::new(Vec::new(), Switch::on_now()));
    }

    /// Keeps `lease` while the client keeps up (see the module documentation).
    pub(crate) fn set_lease(&mut self, lease: Box<dyn Lease>) {
        self.shared.borrow_mut().lease = Some(lease);
    }
}

impl Read for Input {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut shared = self.shared.borrow_mut();
        if !shared.pending.is_empty() {
            shared.send()?;
        }
        if shared.keep_lease() {
            drop(shared);
            match self.source.read(buf) {
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                done => return done,
            }
            shared = self.shared.borrow_mut();
        }
        shared.release();
        shared.time_read()?;
        let bounded = shared.deadline.is_some();
        drop(shared);
        match self.source.read(buf) {
            // The socket's timeout, set to what was left of the deadline, ran out in this read.
            Err(e) if bounded && e.kind() == io::ErrorKind::WouldBlock => Err(deadline_passed()),
            done => done,
        }
    }
}

/// The error of a read the deadline ended.
fn deadline_passed() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the deadline for reading from the client has passed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair() -> (Input, Output, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (input, output) = duplex(Box::new(ours.try_clone().unwrap()), Box::new(ours));
        (input, output, theirs)
    }

    fn available(s: &UnixStream) -> Vec<u8> {
        s.set_nonblocking(true).unwrap();
        let mut got = vec![0u8; 1024];
        let n = (&*s).read(&mut got).unwrap_or(0);
        s.set_nonblocking(false).unwrap();
        got.truncate(n);
        got
    }

    /// Replies wait while the worker answers requests it has buffered, and leave in one write
    /// before it reads from the client again.
    #[test]
    fn output_waits_while_requests_are_buffered() {
        let (input, mut output, mut client) = pair();
        let mut input = io::BufReader::new(input);
        client.write_all(b"ab").unwrap();
        let mut byte = [0u8; 1];
        input.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"a");
        output.write_all(b"reply 1").unwrap();
        input.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"b");
        output.write_all(b", reply 2").unwrap();
        assert_eq!(available(&client), b"", "nothing is sent while requests are buffered");
        client.write_all(b"c").unwrap();
        input.read_exact(&mut byte).unwrap();
        assert_eq!(available(&client), b"reply 1, reply 2");
    }

    /// A lease, with the times it was given up.
    struct Held(Rc<RefCell<(Option<std::time::Instant>, Vec<std::time::Instant>)>>);

    impl Lease for Held {
        fn held_for(&self) -> Option<Duration> {
            self.0.borrow().0.map(|at| at.elapsed())
        }
        fn release(&self) {
            let mut state = self.0.borrow_mut();
            state.0 = None;
            state.1.push(std::time::Instant::now());
        }
    }

    /// A lease is kept while the client answers within [`LEASE_IDLE`], given up when it
    /// does not (the read then goes on waiting), and given up before a read once held for
    /// [`LEASE_MAX`].
    #[test]
    fn a_lease_is_kept_while_the_client_keeps_sending() {
        let (mut input, _output, client) = pair();
        let state = Rc::new(RefCell::new((None, Vec::new())));
        input.set_lease(Box::new(Held(Rc::clone(&state))));
        let take = |at| state.borrow_mut().0 = Some(at);
        let mut byte = [0u8; 1];

        take(std::time::Instant::now());
        (&client).write_all(b"a").unwrap();
        input.read_exact(&mut byte).unwrap();
        assert!(state.borrow().0.is_some() && state.borrow().1.is_empty(), "kept: the client had sent");

        let late = std::thread::spawn({
            let client = client.try_clone().unwrap();
            move || {
                std::thread::sleep(LEASE_IDLE * 100);
                (&client).write_all(b"b").unwrap();
            }
        });
        let asked = std::time::Instant::now();
        input.read_exact(&mut byte).unwrap();
        late.join().unwrap();
        assert_eq!(&byte, b"b", "the read went on waiting");
        let released = state.borrow().1.clone();
        assert_eq!(released.len(), 1, "given up once");
        assert!(released[0] - asked < LEASE_IDLE * 50, "given up after {:?}", released[0] - asked);

        take(std::time::Instant::now() - LEASE_MAX);
        (&client).write_all(b"c").unwrap();
        input.read_exact(&mut byte).unwrap();
        assert_eq!(state.borrow().1.len(), 2, "given up: held for LEASE_MAX");
    }

    /// A deadline bounds all the reads until it together: a client sending a byte every 50 ms
    /// (each read waits far less than the deadline) is cut off 300 ms after it was set; with
    /// the deadline cleared, a read waits as long as the client takes.
    #[test]
    fn a_deadline_bounds_a_trickle_of_reads_and_is_cleared() {
        let (mut input, _output, client) = pair();
        let set = Instant::now();
        input.set_deadline(Some(set + Duration::from_millis(300))).unwrap();
        let trickle = std::thread::spawn({
            let client = client.try_clone().unwrap();
            move || {
                for _ in 0..40 {
                    std::thread::sleep(Duration::from_millis(50));
                    if (&client).write_all(b"x").is_err() {
                        break;
                    }
                }
            }
        });
        let mut greeting = [0u8; 40];
        let err = input.read_exact(&mut greeting).expect_err("40 bytes at 50 ms each arrived before a 300 ms deadline");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        let cut_off = set.elapsed();
        assert!((Duration::from_millis(250)..Duration::from_millis(800)).contains(&cut_off), "cut off after {cut_off:?}");
        trickle.join().unwrap();
        input.set_deadline(None).unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            (&client).write_all(b"y").unwrap();
            client
        });
        let mut byte = [0u8; 1];
        while byte != *b"y" {
            input.read_exact(&mut byte).unwrap();
        }
        drop(late.join().unwrap());
    }

    #[test]
    fn output_is_sent_before_a_read_that_would_wait() {
        let (mut input, mut output, client) = pair();
        output.write_all(b"reply").unwrap();
        let mut client_side = client.try_clone().unwrap();
        // The client answers only after it got the reply: a worker that kept the reply while
        // waiting for the client would hang here.
        let answer = std::thread::spawn(move || {
            let mut got = [0u8; 5];
            client_side.read_exact(&mut got).unwrap();
            client_side.write_all(b"next").unwrap();
            got
        });
        let mut next = [0u8; 4];
        input.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"next");
        assert_eq!(&answer.join().unwrap(), b"reply");
    }

    /// A large write to a sink that buffers by itself (as `--stdio`'s line-buffered standard
    /// output does) still reaches the client before the worker waits for it.
    #[test]
    fn a_large_write_through_a_buffering_sink_is_not_held_back() {
        let (ours, client) = UnixStream::pair().unwrap();
        ours.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let sink = io::LineWriter::new(ours.try_clone().unwrap());
        let (mut input, mut output) = duplex(Box::new(ours), Box::new(sink));
        let mut data = vec![b'x'; 2 * OUTPUT_CAPACITY];
        data[2 * OUTPUT_CAPACITY - 10] = b'\n';
        output.write_all(&data).unwrap();
        let expected = data.len();
        let answer = std::thread::spawn(move || {
            let mut got = vec![0u8; expected];
            (&client).read_exact(&mut got).unwrap();
            (&client).write_all(b"next").unwrap();
        });
        let mut next = [0u8; 4];
        input.read_exact(&mut next).expect("the client never got the whole reply");
        answer.join().unwrap();
    }

    #[test]
    fn a_full_buffer_and_flush_send_at_once() {
        let (_input, mut output, client) = pair();
        output.write_all(&vec![7u8; OUTPUT_CAPACITY - 1]).unwrap();
        output.write_all(b"xy").unwrap();
        let mut got = vec![0u8; OUTPUT_CAPACITY - 1];
        (&client).read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 7));
        assert_eq!(available(&client), b"");
        output.flush().unwrap();
        assert_eq!(available(&client), b"xy");
    }
}
