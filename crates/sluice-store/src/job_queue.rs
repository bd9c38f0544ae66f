//! NAR download slots handed out largest first: when more NARs are known than `--jobs` allows
//! at once, the biggest waiting one starts next, so the long downloads overlap with the many
//! small ones instead of forming the tail of a copy.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::by_key::ByKey;

/// A bounded set of slots; [`JobQueue::acquire`] waits for one.
pub(crate) struct JobQueue {
    state: Mutex<State>,
}

struct State {
    free: usize,
    waiting: BinaryHeap<Waiter>,
    next_seq: u64,
}

/// A waiting job: larger sizes first; among equal sizes, the earlier request.
type Waiter = ByKey<(u64, Reverse<u64>), oneshot::Sender<()>>;

/// A held slot; dropping it hands the slot to the largest waiter.
pub(crate) struct JobPermit {
    queue: Arc<JobQueue>,
}

impl JobQueue {
    /// A queue of `slots` slots (at least one).
    pub fn new(slots: usize) -> Arc<Self> {
        Arc::new(JobQueue { state: Mutex::new(State { free: slots.max(1), waiting: BinaryHeap::new(), next_seq: 0 }) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a slot for a job of `size` bytes.
    pub async fn acquire(self: &Arc<Self>, size: u64) -> JobPermit {
        let rx = {
            let mut state = self.lock();
            if state.free > 0 && state.waiting.is_empty() {
                state.free -= 1;
                return JobPermit { queue: self.clone() };
            }
            let (wake, rx) = oneshot::channel();
            state.next_seq += 1;
            let seq = state.next_seq;
            state.waiting.push(ByKey { key: (size, Reverse(seq)), value: wake });
            rx
        };
        // The sender lives in the queue until a slot is handed over, so this only fails if the
        // queue itself is gone, which the `Arc` held here rules out.
        let _ = rx.await;
        JobPermit { queue: self.clone() }
    }

    fn release(&self) {
        let mut state = self.lock();
        while let Some(w) = state.waiting.pop() {
            if w.value.send(()).is_ok() {
                return;
            }
        }
        state.free += 1;
    }
}

impl Drop for JobPermit {
    fn drop(&mut self) {
        self.queue.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn largest_waiter_goes_first() {
        let q = JobQueue::new(1);
        let first = q.acquire(1).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for size in [10u64, 1000, 100] {
            let (q, tx) = (q.clone(), tx.clone());
            tokio::spawn(async move {
                let _p = q.acquire(size).await;
                tx.send(size).unwrap();
            });
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        drop(first);
        let order: Vec<u64> = vec![rx.recv().await.unwrap(), rx.recv().await.unwrap(), rx.recv().await.unwrap()];
        assert_eq!(order, vec![1000, 100, 10]);
    }
}
