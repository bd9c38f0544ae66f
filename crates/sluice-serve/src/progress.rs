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
//! While a request is on the client's turn, the connection must move [`STEP`] bytes within
//! each idle period: request body bytes read by a handler, or bytes written to the connection
//! ([`Counted`]; what is written is almost all response bodies, as the connection buffers
//! them ahead, up to [`crate::conn::MAX_SEND_BUF`] per HTTP/2 stream). At the default 60 s
//! that is about 1 KiB/s, and a request body under [`STEP`] must arrive whole within it.
//! HTTP/2 streams share their connection's progress. A connection with no request in
//! progress is idle from the end of its last one, whatever else travels on it (HTTP/2 PINGs
//! and their ACKs, SETTINGS, WINDOW_UPDATEs). nginx's `keepalive_timeout` and
//! `client_body_timeout` / `send_timeout` are the model, with a minimum rate instead of "a
//! byte" so that a trickle holds nothing forever.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// Bytes a connection must move within each idle period while a request on it waits on the
/// client.
pub const STEP: u64 = 64 * 1024;

/// What a connection's watchdog does once its deadline passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No request in progress for the idle time: close the connection gracefully.
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
}

struct State {
    next: u64,
    /// Each request in progress: since when it has waited on the client, if it does.
    requests: HashMap<u64, Option<Instant>>,
    idle_since: Instant,
    /// When the connection last moved [`STEP`] bytes, and what it moved since.
    stepped: Instant,
    moved: u64,
}

impl State {
    /// When a wait on the client that began at `since` stalls.
    fn stalls(&self, since: Instant, idle: Duration) -> Instant {
        since.max(self.stepped) + idle
    }
}

impl Activity {
    /// No request yet: idle from now.
    pub fn new(idle: Duration) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Activity { idle, state: Mutex::new(State { next: 0, requests: HashMap::new(), idle_since: now, stepped: now, moved: 0 }) })
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
    /// asking again misses none.
    fn check(&self, now: Instant) -> Result<Instant, Verdict> {
        let state = self.state();
        let (due, verdict) = if state.requests.is_empty() {
            (state.idle_since + self.idle, Verdict::Idle)
        } else {
            match state.requests.values().flatten().min() {
                Some(since) => (state.stalls(*since, self.idle), Verdict::Stalled),
                None => return Ok(now + self.idle),
            }
        };
        if due <= now {
            Err(verdict)
        } else {
            Ok(due)
        }
    }

    /// Waits until the connection is idle or a request on it has stalled, as
    /// [`Activity`] describes.
    pub async fn verdict(&self) -> Verdict {
        loop {
            match self.check(Instant::now()) {
                Err(v) => return v,
                Ok(due) => tokio::time::sleep_until(due).await,
            }
        }
    }

    /// Waits until the connection, waiting on the client from `since` (closing, with what
    /// it holds still to send), has moved less than [`STEP`] bytes for the idle time.
    pub async fn stalled(&self, since: Instant) {
        loop {
            let due = self.state().stalls(since, self.idle);
            if due <= Instant::now() {
                return;
            }
            tokio::time::sleep_until(due).await
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

/// A connection's stream, counting the bytes written to it in its [`Activity`].
pub struct Counted<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T> Counted<T> {
    pub fn new(inner: T, activity: Arc<Activity>) -> Self {
        Counted { inner, activity }
    }

    fn count(&self, r: Poll<std::io::Result<usize>>) -> Poll<std::io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = r {
            self.activity.moved(n as u64);
        }
        r
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
        self.count(r)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.count(r)
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
}
