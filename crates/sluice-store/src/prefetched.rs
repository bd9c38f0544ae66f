//! Narinfo answers a substituter was sent before the closure engine asked for them (the roots'
//! narinfos fetched with `nix-cache-info`, a batch endpoint's closure), by hash part. A batch
//! answer is kept line by line as it arrives ([`Prefetched::arrive`]): a lookup of a path whose
//! line has not come yet waits for it ([`Prefetched::take`]), and asks the cache itself only
//! if the answer ends without it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use sluice_binary_cache::{BatchLines, CacheError};
use tokio::sync::oneshot;

/// A narinfo answer: the text, `None` for absent, or why it could not be had.
pub type NarInfoAnswer = Result<Option<String>, CacheError>;

/// The answers of one substituter (shared by the task that receives them and the engine).
#[derive(Debug, Default)]
pub struct Prefetched {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    answers: HashMap<String, NarInfoAnswer>,
    /// Lookups waiting for their line, by hash part.
    waiting: HashMap<String, oneshot::Sender<NarInfoAnswer>>,
    /// Whether an answer is still arriving.
    arriving: bool,
}

/// What [`Prefetched::take`] has for a path.
pub enum Taken {
    Ready(NarInfoAnswer),
    /// Its line may still arrive: the receiver gets it, or is dropped when the answer ends
    /// without it.
    Pending(oneshot::Receiver<NarInfoAnswer>),
    /// Nothing, and nothing is arriving.
    None,
}

impl Prefetched {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `answers` (by hash part).
    pub fn extend(&self, answers: impl IntoIterator<Item = (String, NarInfoAnswer)>) {
        let mut state = self.state();
        for (hash, answer) in answers {
            state.arrive(hash, answer);
        }
    }

    /// The answer for `hash_part`, taken (a second take has nothing).
    pub fn take(&self, hash_part: &str) -> Taken {
        let mut state = self.state();
        if let Some(answer) = state.answers.remove(hash_part) {
            return Taken::Ready(answer);
        }
        if !state.arriving {
            return Taken::None;
        }
        let (tx, rx) = oneshot::channel();
        state.waiting.insert(hash_part.to_string(), tx);
        Taken::Pending(rx)
    }

    /// Keeps each line of `lines` as it arrives, on a task of its own, until the answer ends
    /// (then the lookups still waiting ask the cache themselves). A failure midway is a
    /// warning naming the URL: the lines kept so far stay.
    pub fn receive(self: &std::sync::Arc<Self>, mut lines: BatchLines) {
        self.state().arriving = true;
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                match lines.next().await {
                    Ok(Some((hash, text))) => this.state().arrive(hash, Ok(text)),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("{e}; asking for each narinfo instead");
                        break;
                    }
                }
            }
            this.state().end();
        });
    }
}

impl State {
    /// The answer has ended: the lookups still waiting are let go.
    fn end(&mut self) {
        self.arriving = false;
        self.waiting.clear();
    }

    /// `answer` to the lookup waiting for it, else kept.
    fn arrive(&mut self, hash: String, answer: NarInfoAnswer) {
        let answer = match self.waiting.remove(&hash) {
            Some(waiter) => match waiter.send(answer) {
                Ok(()) => return,
                // The lookup went away: kept for another.
                Err(answer) => answer,
            },
            None => answer,
        };
        self.answers.insert(hash, answer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiting_lookup_gets_its_line_or_is_let_go_at_the_end() {
        let prefetched = Prefetched::default();
        prefetched.extend([("a".to_string(), Ok(Some("A".to_string())))]);
        assert!(matches!(prefetched.take("a"), Taken::Ready(Ok(Some(t))) if t == "A"));
        assert!(matches!(prefetched.take("a"), Taken::None));
        prefetched.state().arriving = true;
        let Taken::Pending(b) = prefetched.take("b") else { panic!("b is not waited for") };
        let Taken::Pending(c) = prefetched.take("c") else { panic!("c is not waited for") };
        prefetched.extend([("b".to_string(), Ok(None))]);
        assert!(matches!(b.await, Ok(Ok(None))));
        prefetched.state().end();
        assert!(c.await.is_err(), "the end of the answer lets the lookup go");
    }
}
