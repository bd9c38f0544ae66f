//! What counts as progress on a connection, for [`crate::conn`]'s watchdog: requests and what
//! they move, not traffic. Each request in progress (from its head to the end of its response
//! body) is registered in its connection's [`Activity`]; its request body and response body
//! are [`Tracked`], which tells whose turn it is:
//!
//! - the client's, while the handler waits for request body bytes, and once a response chunk
//!   has been taken for sending until the next is asked for;
//! - the server's, while the handler works and while a response chunk is being produced (a
//!   slow store is not the client's fault).
//!
//! While a request is on the client's turn, the connection must move [`STEP`] bytes of what
//! the client does for its requests within each idle period: request body bytes read by a
//! handler, and answers written to the connection ([`Counted`]): every byte on HTTP/1.1,
//! which has nothing else to write, and only the payload of DATA frames on HTTP/2, which the
//! client's flow-control windows let out as it takes them. Control frames (PING ACKs,
//! SETTINGS, WINDOW_UPDATE, GOAWAY) never count: a client flooding PINGs gets as many ACKs
//! back and moves nothing. At the default 60 s that is about 1 KiB/s, and a request body
//! under [`STEP`] must arrive whole within it. HTTP/2 streams share their connection's
//! progress (what is written is almost all response bodies, as the connection buffers them
//! ahead, up to [`crate::conn::MAX_SEND_BUF`] per HTTP/2 stream).
//!
//! A connection with no request in progress is idle from the end of its last one, or from
//! the last [`STEP`] its answers moved (what it buffered of them goes out after the request
//! ended), whatever else travels on it. It is then closed ([`Activity::verdict`]), or sooner
//! if [`Activity::shed`] when the server's connections run out. nginx's `keepalive_timeout`
//! and `client_body_timeout` / `send_timeout` are the model, with a minimum rate instead of
//! "a byte" so that a trickle holds nothing forever.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Bytes a connection must move within each idle period while a request on it waits on the
/// client.
pub(crate) const STEP: u64 = 64 * 1024;

/// What a connection's watchdog does once its deadline passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No request in progress for the idle time, or shed: close the connection gracefully.
    Idle,
    /// A request waited on the client for the idle time while the connection moved less
    /// than [`STEP`] bytes: close the connection now.
    Stalled,
}

/// The requests in progress on one connection, when the last one ended, and what the
/// connection moved.
pub struct Activity {
    idle: Duration,
    state: Mutex<State>,
    /// Wakes [`Activity::verdict`] when the connection is shed.
    shed: Notify,
}

struct State {
    next: u64,
    /// Each request in progress: since when it has waited on the client, if it does.
    requests: HashMap<u64, Option<Instant>>,
    idle_since: Instant,
    /// When the connection last moved [`STEP`] bytes, and what it moved since.
    stepped: Instant,
    moved: u64,
    /// Whether the connection is being closed as idle (shed, or its idle time passed).
    closing: bool,
}

impl State {
    /// When a wait on the client that began at `since` stalls.
    fn stalls(&self, since: Instant, idle: Duration) -> Instant {
        since.max(self.stepped) + idle
    }

    /// Since when the connection is idle, if it has no request in progress.
    fn idle_since(&self) -> Option<Instant> {
        self.requests.is_empty().then(|| self.idle_since.max(self.stepped))
    }
}

impl Activity {
    /// No request yet: idle from now.
    pub fn new(idle: Duration) -> Arc<Self> {
        let now = Instant::now();
        let state = State { next: 0, requests: HashMap::new(), idle_since: now, stepped: now, moved: 0, closing: false };
        Arc::new(Activity { idle, state: Mutex::new(state), shed: Notify::new() })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a request that has just arrived (the server's turn); it ends when the last
    /// clone of the handle is dropped.
    pub fn start(self: &Arc<Self>) -> Arc<Request> {
        let mut state = self.state();
        let id = state.next;
        state.next += 1;
        state.requests.insert(id, None);
        Arc::new(Request { activity: self.clone(), id })
    }

    /// `n` bytes moved: progress at each [`STEP`].
    fn moved(&self, n: u64) {
        let mut state = self.state();
        state.moved += n;
        if state.moved >= STEP {
            (state.stepped, state.moved) = (Instant::now(), 0);
        }
    }

    /// The earliest time something may be due, and what, if it is due now. Every deadline
    /// set later is at least `idle` after it is set, so sleeping until the returned time and
    /// asking again misses none. A connection idle is closing from then on; one with a
    /// request in progress is never shed.
    fn check(&self, now: Instant) -> Result<Instant, Verdict> {
        let mut state = self.state();
        let (due, verdict) = match state.idle_since() {
            Some(since) if state.closing => (since, Verdict::Idle),
            Some(since) => (since + self.idle, Verdict::Idle),
            None => {
                state.closing = false;
                match state.requests.values().flatten().min() {
                    Some(since) => (state.stalls(*since, self.idle), Verdict::Stalled),
                    None => return Ok(now + self.idle),
                }
            }
        };
        if due > now {
            return Ok(due);
        }
        state.closing |= verdict == Verdict::Idle;
        Err(verdict)
    }

    /// Waits until the connection is idle (or shed) or a request on it has stalled, as
    /// [`Activity`] describes.
    pub async fn verdict(&self) -> Verdict {
        loop {
            match self.check(Instant::now()) {
                Err(v) => return v,
                Ok(due) => tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    () = self.shed.notified() => {}
                },
            }
        }
    }

    /// Since when the connection is idle, if it has no request in progress and is not
    /// closing yet: what [`Activity::shed`] would close.
    pub(crate) fn sheddable_since(&self) -> Option<Instant> {
        let state = self.state();
        state.idle_since().filter(|_| !state.closing)
    }

    /// Closes the connection as idle now, if it has no request in progress.
    pub fn shed(&self) {
        let mut state = self.state();
        if state.idle_since().is_some() {
            state.closing = true;
            self.shed.notify_one();
        }
    }
}

/// A request in progress on its connection's [`Activity`].
pub struct Request {
    activity: Arc<Activity>,
    id: u64,
}

impl Request {
    /// The client's turn, from now if it was the server's.
    fn client(&self) {
        if let Some(since @ None) = self.activity.state().requests.get_mut(&self.id) {
            *since = Some(Instant::now())
        }
    }

    fn server(&self) {
        if let Some(since) = self.activity.state().requests.get_mut(&self.id) {
            *since = None
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let mut state = self.activity.state();
        state.requests.remove(&self.id);
        if state.requests.is_empty() {
            state.idle_since = Instant::now();
        }
    }
}

/// Which body of its request a [`Tracked`] body is.
#[derive(Clone, Copy)]
pub enum Side {
    /// Read by the handler from the client.
    Request,
    /// Produced by the handler, taken by the connection for the client.
    Response,
}

/// A body that keeps its request in progress until it is dropped and tells it whose turn it
/// is (see the module doc).
pub struct Tracked<B> {
    inner: B,
    side: Side,
    request: Arc<Request>,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, side: Side, request: Arc<Request>) -> Self {
        Tracked { inner, side, request }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let request = &self.request;
        match (&polled, self.side) {
            (Poll::Pending, Side::Request) => request.client(),
            (Poll::Ready(Some(Ok(frame))), Side::Request) => request.activity.moved(frame.data_ref().map_or(0, |d| d.remaining() as u64)),
            (Poll::Ready(Some(Ok(_))), Side::Response) => request.client(),
            (Poll::Pending, Side::Response) | (Poll::Ready(_), _) => request.server(),
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's stream, counting the answers written to it in its [`Activity`].
pub(crate) struct Counted<T> {
    inner: T,
    activity: Arc<Activity>,
    wire: Wire,
}

impl<T> Counted<T> {
    pub fn new(inner: T, activity: Arc<Activity>) -> Self {
        Counted { inner, activity, wire: Wire::Unknown }
    }

    /// Counts what of `bufs` was written.
    fn count<'a>(&mut self, r: Poll<std::io::Result<usize>>, bufs: impl IntoIterator<Item = &'a [u8]>) -> Poll<std::io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = r {
            let mut left = n;
            let mut answers = 0;
            for buf in bufs {
                if left == 0 {
                    break;
                }
                let taken = &buf[..left.min(buf.len())];
                answers += self.wire.answers(taken);
                left -= taken.len();
            }
            self.activity.moved(answers);
        }
        r
    }
}

/// What a connection writes, to tell answers from control frames (see the module doc).
#[derive(Debug, PartialEq, Eq)]
enum Wire {
    /// Nothing written yet.
    Unknown,
    /// HTTP/1.x: every byte is an answer.
    Http1,
    /// HTTP/2: the frame being written, its 9-byte header as far as it has been written, then
    /// what of its payload is left and whether it is a DATA frame.
    Http2 { head: [u8; 9], have: usize, left: usize, data: bool },
}

/// The type of an HTTP/2 DATA frame (RFC 9113 §6.1).
const DATA: u8 = 0;

impl Wire {
    /// Takes `bytes`, written next, and returns how many of them are answers. An HTTP/1.x
    /// answer begins with `HTTP/`; an HTTP/2 server begins with its SETTINGS frame (RFC 9113
    /// §3.4), whose first byte, its length's highest, is 0.
    fn answers(&mut self, mut bytes: &[u8]) -> u64 {
        if *self == Wire::Unknown {
            match bytes.first() {
                None => return 0,
                Some(b'H') => *self = Wire::Http1,
                Some(_) => *self = Wire::Http2 { head: [0; 9], have: 0, left: 0, data: false },
            }
        }
        let Wire::Http2 { head, have, left, data } = self else { return bytes.len() as u64 };
        let mut answers = 0;
        while !bytes.is_empty() {
            if *left > 0 {
                let n = (*left).min(bytes.len());
                answers += if *data { n as u64 } else { 0 };
                (*left, bytes) = (*left - n, &bytes[n..]);
                continue;
            }
            let n = (9 - *have).min(bytes.len());
            head[*have..*have + n].copy_from_slice(&bytes[..n]);
            (*have, bytes) = (*have + n, &bytes[n..]);
            if *have == 9 {
                *have = 0;
                *left = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                *data = head[3] == DATA;
            }
        }
        answers
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.count(r, [buf])
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.count(r, bufs.iter().map(|b| &**b))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_from_the_end_of_the_last_request_and_stalled_below_a_step_per_period() {
        let idle = Duration::from_secs(10);
        let activity = Activity::new(idle);
        let t0 = Instant::now();
        assert_eq!(activity.check(t0), Ok(t0 + idle));
        assert_eq!(activity.check(t0 + idle), Err(Verdict::Idle));

        // The server's turn: never due.
        let request = activity.start();
        let later = t0 + 5 * idle;
        assert_eq!(activity.check(later), Ok(later + idle));
        // The client's: a trickle under STEP is due one period after the turn began.
        request.client();
        let waiting = Instant::now();
        activity.moved(STEP - 1);
        tokio::time::advance(idle / 2).await;
        assert_eq!(activity.check(Instant::now()), Ok(waiting + idle));
        activity.moved(1);
        let stepped = Instant::now();
        assert_eq!(activity.check(stepped), Ok(stepped + idle));
        assert_eq!(activity.check(stepped + idle), Err(Verdict::Stalled));
        // Back on the server's turn: not due.
        request.server();
        assert_eq!(activity.check(stepped + idle), Ok(stepped + 2 * idle));

        drop(request);
        let ended = Instant::now();
        assert_eq!(activity.check(ended), Ok(ended + idle));
        assert_eq!(activity.check(ended + idle), Err(Verdict::Idle));
    }

    #[tokio::test(start_paused = true)]
    async fn shed_only_without_a_request_in_progress_and_idle_after_the_last_step() {
        let idle = Duration::from_secs(10);
        let activity = Activity::new(idle);
        let request = activity.start();
        activity.shed();
        assert_eq!(activity.sheddable_since(), None);
        tokio::time::advance(idle / 2).await;
        // Its buffered answer still moving after the request ended: idle from the last step.
        drop(request);
        activity.moved(STEP);
        let stepped = Instant::now();
        assert_eq!(activity.sheddable_since(), Some(stepped));
        assert_eq!(activity.check(stepped), Ok(stepped + idle));
        activity.shed();
        assert_eq!(activity.sheddable_since(), None);
        assert_eq!(activity.verdict().await, Verdict::Idle);
        assert_eq!(Instant::now(), stepped);
    }

    #[test]
    fn only_http2_data_payloads_and_http1_bytes_are_answers() {
        let frame = |kind: u8, payload: &[u8]| {
            let mut f = u32::try_from(payload.len()).unwrap_or(0).to_be_bytes()[1..].to_vec();
            f.extend([kind, 0, 0, 0, 0, 1]);
            f.extend(payload);
            f
        };
        let mut h2 = [frame(4, &[0; 6]), frame(6, b"pingpong"), frame(DATA, &[7; 100]), frame(1, &[0x88]), frame(DATA, &[7; 20])].concat();
        h2.extend(frame(6, b"pingpong").repeat(1000));
        // Written whole, and a byte at a time.
        assert_eq!(Wire::Unknown.answers(&h2), 120);
        let mut wire = Wire::Unknown;
        assert_eq!(h2.iter().map(|b| wire.answers(std::slice::from_ref(b))).sum::<u64>(), 120);
        assert_eq!(Wire::Unknown.answers(b"HTTP/1.1 200 OK\r\n\r\n"), 19);
    }
}
