//! NAR files sent with `sendfile(2)` on plain HTTP/1.x connections, as nginx's `sendfile on`
//! (`src/os/unix/ngx_linux_sendfile_chain.c`) sends them: the bytes go from the page cache to
//! the socket, never read into the server and written out of it again (those two copies were
//! most of what a large NAR cost).
//!
//! hyper writes only bytes it is given (a body of file ranges is its open issue #3026), and it
//! still writes every answer here: its head, its framing, keep-alive and pipelining stay
//! hyper's. A file's body ([`body`]) is made of stand-ins: data frames that are slices of
//! [`STAND_IN`], a static region never read, each registered in the connection's [`Files`]
//! with the part of the file it stands for. hyper queues body frames as they are and hands
//! them to the connection's stream in vectored writes (its queue strategy, which
//! [`crate::conn`] asks for with `writev(true)`: frames are never copied); the stream
//! ([`Sendfile`]) knows a stand-in by its address and sends the part of the file in its place,
//! checking that the stand-ins come in the order and at the offsets they were made (anything
//! else fails the connection: the client sees it cut). What this relies on is that hyper
//! passes frames through unchanged, as its queue strategy does; a hyper that copied them would
//! send the stand-ins' zeros, which the integration tests of stored NARs would catch.
//!
//! Over TLS and HTTP/2, whose frames are copied anyway (nginx copies there too), a file is
//! read as any other body ([`crate::routes`]). As with nginx's `sendfile`, a file not in the
//! page cache is read from the disk by the thread that sends it.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// Most bytes of a file one stand-in frame stands for.
const FRAME: usize = 8 << 20;

/// Most bytes a connection's socket holds not yet sent (`TCP_NOTSENT_LOWAT`; what is in flight
/// is the congestion window's, and not bounded by it). Without a bound, one `sendfile` queues
/// a whole file (the send buffer grows to megabytes) and what the window does not let out at
/// once is sent later by the kernel as the client's acknowledgements arrive, on the client's
/// side of loopback; with it, the server sends as the window opens. The smaller the bound, the
/// more of the sending is the server's own: on this 2-core machine, the 2.4 MB NAR under
/// `wrk -c32`, 4–32 KiB served 1.6–2× nginx's rate at half its CPU per request, 64 KiB 1.2×,
/// 256 KiB 0.6–0.9× (docs/benchmarks.md, issue 40).
const NOT_SENT: u32 = 16 << 10;

/// What stand-in frames are slices of: never read, so never faulted in (zeroed static memory
/// is mapped on first touch).
static STAND_IN: [u8; FRAME] = [0; FRAME];

/// The part of a file a stand-in frame stands for, and how much of it was sent.
struct Part {
    file: Arc<File>,
    offset: u64,
    len: usize,
    sent: usize,
}

/// The parts of files that the stand-in frames given to a connection stand for, in the order
/// the frames were made (which is the order hyper writes them: one answer at a time).
#[derive(Clone, Default)]
pub struct Files(Arc<Mutex<VecDeque<Part>>>);

impl Files {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Part>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A body of the `len` bytes of `file`, for a connection whose stream is a [`Sendfile`] over
/// `files`.
pub fn body(file: File, len: u64, files: Files) -> http_body_util::combinators::UnsyncBoxBody<Bytes, io::Error> {
    let file = Arc::new(file);
    let frames = futures::stream::iter((0..len).step_by(FRAME)).map(move |offset| {
        let n = usize::try_from(len - offset).map_or(FRAME, |left| left.min(FRAME));
        files.lock().push_back(Part { file: file.clone(), offset, len: n, sent: 0 });
        Ok::<_, io::Error>(hyper::body::Frame::data(Bytes::from_static(&STAND_IN[..n])))
    });
    http_body_util::StreamBody::new(frames).boxed_unsync()
}

/// Where `buf` begins in [`STAND_IN`], if it is a stand-in.
fn stand_in(buf: &[u8]) -> Option<usize> {
    let at = (buf.as_ptr() as usize).wrapping_sub(STAND_IN.as_ptr() as usize);
    (!buf.is_empty() && at < FRAME).then_some(at)
}

/// A plain TCP connection's stream, sending the parts of files that stand-in frames stand for
/// with `sendfile` (see the module doc).
pub struct Sendfile {
    tcp: TcpStream,
    files: Files,
}

impl Sendfile {
    /// The stream of `tcp`, which takes no more than [`NOT_SENT`] bytes not yet sent at a time.
    pub fn new(tcp: TcpStream, files: Files) -> Self {
        // Best effort: without it (an old kernel) files go out all the same.
        let _ = socket2::SockRef::from(&tcp).set_tcp_notsent_lowat(NOT_SENT);
        Sendfile { tcp, files }
    }

    /// Sends what of the next file part the stand-in `buf`, which begins at `at`, stands for.
    fn send_part(&self, cx: &mut Context<'_>, buf: &[u8], at: usize) -> Poll<io::Result<usize>> {
        let out_of_step = |what: &str| Poll::Ready(Err(io::Error::other(format!("sending a NAR file: {what}"))));
        let mut files = self.files.lock();
        let Some(part) = files.front_mut() else { return out_of_step("a stand-in frame for no file part") };
        if at != part.sent || buf.len() > part.len - part.sent {
            return out_of_step("a stand-in frame out of step with its file part");
        }
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            let mut offset = part.offset + part.sent as u64;
            let sent = self.tcp.try_io(Interest::WRITABLE, || {
                rustix::fs::sendfile(&self.tcp, &*part.file, Some(&mut offset), buf.len()).map_err(io::Error::from)
            });
            match sent {
                Ok(0) => return Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "a NAR file ended before its size"))),
                Ok(n) => {
                    part.sent += n;
                    if part.sent == part.len {
                        files.pop_front();
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncRead for Sendfile {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Sendfile {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    /// Writes the bytes before the first stand-in, else sends what that stand-in stands for.
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let plain = bufs.iter().take_while(|b| stand_in(b).is_none()).count();
        let nothing_before = bufs[..plain].iter().all(|b| b.is_empty());
        match bufs.get(plain).and_then(|b| stand_in(b).map(|at| (b, at))) {
            Some((buf, at)) if nothing_before => self.send_part(cx, buf, at),
            _ => Pin::new(&mut self.tcp).poll_write_vectored(cx, &bufs[..plain]),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Buf;
    use std::io::Write as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A connected pair: the server's end as a [`Sendfile`] over `files`, and the client's.
    async fn pair(files: &Files) -> (Sendfile, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (Sendfile::new(server, files.clone()), client)
    }

    /// The frames of `body`.
    async fn frames(mut body: http_body_util::combinators::UnsyncBoxBody<Bytes, io::Error>) -> Vec<Bytes> {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            out.push(frame.unwrap().into_data().unwrap());
        }
        out
    }

    /// Writes `bufs` as hyper does: vectored, the rest again after a partial write.
    async fn write_all(out: &mut Sendfile, mut bufs: Vec<Bytes>) -> io::Result<()> {
        while !bufs.is_empty() {
            let slices: Vec<io::IoSlice<'_>> = bufs.iter().map(|b| io::IoSlice::new(b)).collect();
            let mut n = out.write_vectored(&slices).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            while n > 0 {
                let k = n.min(bufs[0].len());
                bufs[0].advance(k);
                n -= k;
                if bufs[0].is_empty() {
                    bufs.remove(0);
                }
            }
        }
        Ok(())
    }

    #[tokio::test]
    async fn stand_ins_go_out_as_the_parts_of_files_they_stand_for() {
        let data: Vec<u8> = (0..2 * FRAME + 4321).map(|i| (i % 251) as u8).collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&data).unwrap();
        let files = Files::default();
        let body = frames(body(file, data.len() as u64, files.clone())).await;
        assert_eq!(body.iter().map(Bytes::len).collect::<Vec<_>>(), [FRAME, FRAME, 4321]);
        assert!(body.iter().all(|b| stand_in(b) == Some(0)));
        let (mut out, mut client) = pair(&files).await;
        let reading = tokio::spawn(async move {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.map(|_| got)
        });
        let head = Bytes::from_static(b"HTTP/1.1 200 OK\r\n\r\n");
        write_all(&mut out, [vec![head.clone()], body, vec![Bytes::from_static(b"after")]].concat()).await.unwrap();
        out.shutdown().await.unwrap();
        assert!(files.lock().is_empty());
        let got = reading.await.unwrap().unwrap();
        assert!(got == [&head[..], &data, b"after"].concat(), "{} bytes", got.len());
    }

    #[tokio::test]
    async fn a_stand_in_out_of_step_or_past_its_file_fails() {
        let files = Files::default();
        let (mut out, _client) = pair(&files).await;
        // None registered; then one not at its part's start.
        let err = write_all(&mut out, vec![Bytes::from_static(&STAND_IN[..10])]).await.unwrap_err();
        assert!(err.to_string().contains("a stand-in frame for no file part"), "{err}");
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[7; 10]).unwrap();
        let body = frames(body(file, 100, files.clone())).await;
        let err = write_all(&mut out, vec![body[0].slice(1..)]).await.unwrap_err();
        assert!(err.to_string().contains("out of step"), "{err}");
        // From its start: the 10 bytes the file has, then it ends before its size.
        let err = write_all(&mut out, body).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    }
}
