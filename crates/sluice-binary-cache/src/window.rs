//! How many writes (`HEAD`, `PUT`, `POST`, `DELETE`) one cache has in flight: a window, as a
//! TCP sender's congestion window, so that a push never opens more connections than the server
//! takes. Over HTTP/1.1 each request in flight is a connection, and a server with a small
//! listen queue (python's `http.server`: 5) drops the connections beyond it, each then waiting
//! for a SYN sent again a second later (a push of the corpus opening 256 connections took
//! 68–111 s where Nix's 25 took 12 s, issue 39). The window starts at Nix's concurrency
//! ([`NIX_CONNECTIONS`], curl's connections per host in `src/libstore/filetransfer.cc`), never
//! exceeds its ceiling (`http-connections`), grows while the server keeps up (by one per
//! answer, doubling each round trip, until the first sign it does not; then by one per
//! window's worth of answers), and halves when a connection is refused or reset or a small
//! request is answered late.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Writes in flight a window starts with: Nix's `http-connections` default.
pub(crate) const NIX_CONNECTIONS: usize = 25;

/// A small request answered this late, and later than [`SLOW_FACTOR`] times the fastest one,
/// waited for the server (a dropped connection is tried again after 1 s, Linux's first SYN
/// retransmission timeout).
const SLOW: Duration = Duration::from_secs(1);
const SLOW_FACTOR: u32 = 4;

/// The write window of one cache.
#[derive(Debug)]
pub(crate) struct Window {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    permits: Arc<Semaphore>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    size: usize,
    ceiling: usize,
    /// Permits to take out of use as they come back (the window shrank below those in flight).
    owed: usize,
    /// Answers since the window last grew.
    answered: usize,
    /// Whether the server ever fell behind (growth is then one per window of answers).
    congested: bool,
    fastest: Option<Duration>,
    /// Times the window halved: a write sent before the last halving does not halve it again
    /// (once per round trip, as TCP).
    halvings: u64,
}

/// How a request that held a slot ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Answered after `elapsed`; `small`: it carried no large body (its time is the server's).
    Answered { elapsed: Duration, small: bool },
    /// The connection was refused or reset, or the answer never came.
    Refused,
}

/// One write's place in the window, given back when dropped.
pub(crate) struct Slot {
    inner: Arc<Inner>,
    permit: Option<OwnedSemaphorePermit>,
    /// Whether at least half the window was in flight when this one was taken: a window the
    /// writes do not fill says nothing of whether the server would take more.
    full: bool,
    /// [`State::halvings`] when it was taken.
    halvings: u64,
}

impl Window {
    /// A window of at most `ceiling` writes, starting at [`NIX_CONNECTIONS`] or `ceiling`.
    pub(crate) fn new(ceiling: usize) -> Self {
        let ceiling = ceiling.clamp(1, Semaphore::MAX_PERMITS);
        let size = ceiling.min(NIX_CONNECTIONS);
        let state = State { size, ceiling, owed: 0, answered: 0, congested: false, fastest: None, halvings: 0 };
        Window { inner: Arc::new(Inner { permits: Arc::new(Semaphore::new(size)), state: Mutex::new(state) }) }
    }

    /// Waits for a place in the window. Errors: the window's permits were closed (they never
    /// are while it lives).
    pub(crate) async fn acquire(&self) -> Result<Slot, tokio::sync::AcquireError> {
        let permit = self.inner.permits.clone().acquire_owned().await?;
        let state = self.inner.lock();
        let in_flight = (state.size + state.owed).saturating_sub(self.inner.permits.available_permits());
        let (full, halvings) = (in_flight * 2 >= state.size, state.halvings);
        drop(state);
        Ok(Slot { inner: self.inner.clone(), permit: Some(permit), full, halvings })
    }

    /// The writes it lets in flight now.
    pub(crate) fn size(&self) -> usize {
        self.inner.lock().size
    }

    /// Writes in flight now.
    pub(crate) fn in_flight(&self) -> usize {
        let state = self.inner.lock();
        (state.size + state.owed).saturating_sub(self.inner.permits.available_permits())
    }

    /// Raises the ceiling to `ceiling` (a server that speaks HTTP/2 carries many requests on
    /// one connection); the window grows to it as it would to any ceiling.
    pub(crate) fn raise_ceiling(&self, ceiling: usize) {
        let mut state = self.inner.lock();
        state.ceiling = state.ceiling.max(ceiling.min(Semaphore::MAX_PERMITS));
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts an answer that showed no congestion; grows the window by one per answer of a
    /// full window until the server first fell behind, then by one per window of answers.
    fn answered(&self, state: &mut State, full: bool) {
        state.answered += 1;
        if full && state.size < state.ceiling && (!state.congested || state.answered >= state.size) {
            state.answered = 0;
            state.size += 1;
            match state.owed {
                0 => self.permits.add_permits(1),
                _ => state.owed -= 1,
            }
        }
    }

    fn halve(&self, state: &mut State, sent_after: u64) {
        if sent_after != state.halvings {
            return;
        }
        state.halvings += 1;
        state.congested = true;
        state.answered = 0;
        let new = (state.size / 2).max(1);
        state.owed += state.size - new;
        state.size = new;
        // Permits not in use are taken out at once; the others as they come back.
        while state.owed > 0 {
            match self.permits.clone().try_acquire_owned() {
                Ok(p) => {
                    p.forget();
                    state.owed -= 1;
                }
                Err(_) => break,
            }
        }
    }
}

impl Slot {
    /// Records how the request ended (once; the place is given back when the slot is dropped).
    pub(crate) fn ended(&self, outcome: Outcome) {
        let mut state = self.inner.lock();
        match outcome {
            Outcome::Refused => self.inner.halve(&mut state, self.halvings),
            Outcome::Answered { elapsed, small: true } => {
                let fastest = *state.fastest.get_or_insert(elapsed);
                state.fastest = Some(fastest.min(elapsed));
                if elapsed >= SLOW.max(fastest * SLOW_FACTOR) {
                    self.inner.halve(&mut state, self.halvings);
                } else {
                    self.inner.answered(&mut state, self.full);
                }
            }
            Outcome::Answered { small: false, .. } => self.inner.answered(&mut state, self.full),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else { return };
        let mut state = self.inner.lock();
        if state.owed > 0 {
            state.owed -= 1;
            permit.forget();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Outcome = Outcome::Answered { elapsed: Duration::from_millis(2), small: true };

    /// Runs `n` writes that take every place of the window at once and end with `outcome`.
    async fn round(w: &Window, outcome: Outcome) {
        let mut slots = Vec::new();
        for _ in 0..w.size() {
            slots.push(w.acquire().await.unwrap());
        }
        assert_eq!(w.in_flight(), slots.len());
        for s in slots {
            s.ended(outcome);
            drop(s);
        }
    }

    #[tokio::test]
    async fn starts_at_nix_grows_to_its_ceiling_and_halves_on_refusals() {
        let w = Window::new(100);
        assert_eq!(w.size(), NIX_CONNECTIONS);
        // Full windows answered fast: it grows by half of each round (the answers of writes
        // sent while half the window was in flight) until the ceiling.
        round(&w, FAST).await;
        assert_eq!(w.size(), 38);
        for _ in 0..3 {
            round(&w, FAST).await;
        }
        assert_eq!(w.size(), 100);
        // A refused connection halves it; the places in flight are taken out as they come back.
        let held: Vec<Slot> = futures::future::join_all((0..100).map(|_| w.acquire())).await.into_iter().map(Result::unwrap).collect();
        let mut held = held.into_iter();
        held.next().unwrap().ended(Outcome::Refused);
        assert_eq!(w.size(), 50);
        drop(held);
        assert_eq!(w.in_flight(), 0);
        assert_eq!(w.inner.permits.available_permits(), 50);
        // After congestion it grows by one per window of answers.
        round(&w, FAST).await;
        assert_eq!(w.size(), 51);
    }

    #[tokio::test]
    async fn a_late_small_answer_halves_it_and_a_window_not_full_does_not_grow() {
        let w = Window::new(8);
        assert_eq!(w.size(), 8);
        w.acquire().await.unwrap().ended(FAST);
        assert_eq!(w.size(), 8, "a window not full does not grow");
        let late = Outcome::Answered { elapsed: Duration::from_millis(1100), small: true };
        round(&w, late).await;
        assert_eq!(w.size(), 4, "late answers of writes sent together halve it once");
        round(&w, late).await;
        assert_eq!(w.size(), 2);
        // A large upload's time is its body's: no sign of congestion.
        round(&w, Outcome::Answered { elapsed: Duration::from_secs(5), small: false }).await;
        assert_eq!(w.size(), 3, "after congestion, one more per window of answers");
        round(&w, Outcome::Answered { elapsed: Duration::from_secs(5), small: false }).await;
        assert_eq!(w.size(), 4);
    }
}
