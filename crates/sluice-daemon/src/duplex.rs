//! A connection's two directions, coupled so that replies to pipelined requests leave in one
//! write: what the worker writes waits in an output buffer until the worker is about to block
//! reading from the client (or the buffer holds [`OUTPUT_CAPACITY`] bytes, or an explicit
//! `flush` sends a log message at once). A client that sends one request and waits, as every
//! Nix client does, gets each reply as soon as the worker looks for the next request; a client
//! that sent several requests gets their replies together. Since the buffer is always emptied
//! before a read that would wait, a client that waits for a reply before it finishes sending
//! the next request is never left waiting on a reply held back.

use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::rc::Rc;

use rustix::event::{poll, PollFd, PollFlags};

/// Output is sent once this many bytes wait (bytes).
pub(crate) const OUTPUT_CAPACITY: usize = 64 * 1024;

/// What a client connection is read from: a readable file descriptor (a Unix socket, or
/// standard input for `--stdio`).
pub(crate) trait ClientInput: Read + AsFd + Send {}

impl<T: Read + AsFd + Send> ClientInput for T {}

/// The output waiting to be sent, and where it goes.
struct Outbox {
    pending: Vec<u8>,
    sink: Box<dyn Write + Send>,
}

impl Outbox {
    /// Writes out everything pending (the buffer is emptied even if that fails: the
    /// connection is then unusable anyway).
    fn send(&mut self) -> io::Result<()> {
        let sent = self.sink.write_all(&self.pending).and_then(|()| self.sink.flush());
        self.pending.clear();
        sent
    }
}

/// The writing side: buffers until the reading side is about to wait, the buffer is full, or
/// `flush` is called.
pub(crate) struct Output(Rc<RefCell<Outbox>>);

/// The reading side: before a read that would wait for the client, sends pending output.
pub(crate) struct Input {
    source: Box<dyn ClientInput>,
    outbox: Rc<RefCell<Outbox>>,
}

/// Couples `source` and `sink` (the two directions of one client connection).
pub(crate) fn duplex(source: Box<dyn ClientInput>, sink: Box<dyn Write + Send>) -> (Input, Output) {
    let outbox = Rc::new(RefCell::new(Outbox { pending: Vec::with_capacity(OUTPUT_CAPACITY), sink }));
    (Input { source, outbox: Rc::clone(&outbox) }, Output(outbox))
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
            out.sink.write_all(data)?;
            out.sink.flush()?;
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
    /// Lets reads wait without a deadline again (a socket's `SO_RCVTIMEO`; standard input has
    /// none).
    pub(crate) fn clear_read_timeout(&self) -> io::Result<()> {
        match rustix::net::sockopt::set_socket_timeout(self.source.as_fd(), rustix::net::sockopt::Timeout::Recv, None) {
            Ok(()) | Err(rustix::io::Errno::NOTSOCK) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Read for Input {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let waiting = !self.outbox.borrow().pending.is_empty();
        if waiting && !readable(self.source.as_fd())? {
            self.outbox.borrow_mut().send()?;
        }
        self.source.read(buf)
    }
}

/// Whether a read from `fd` would return without waiting (data, end of file or an error).
fn readable(fd: BorrowedFd) -> io::Result<bool> {
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    loop {
        match poll(&mut fds, 0) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
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

    #[test]
    fn output_waits_while_the_client_has_sent_more() {
        let (mut input, mut output, mut client) = pair();
        client.write_all(b"ab").unwrap();
        output.write_all(b"reply 1").unwrap();
        let mut byte = [0u8; 1];
        input.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"a");
        // The reading side buffered nothing itself, so "b" is still readable: no send yet.
        assert_eq!(available(&client), b"");
        input.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"b");
        assert_eq!(available(&client), b"");
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
