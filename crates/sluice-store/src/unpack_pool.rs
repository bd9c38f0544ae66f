//! The process's unpacking threads: as many as the cores, started on first use and fed
//! through one queue, highest priority first, for blocking work that never waits on a peer
//! (unpacking a NAR whose bytes are on this machine, a `file://` cache's). Tokio's blocking pool (up to
//! `max_blocking_threads`, 96 in `sluice`) starts a thread whenever none is idle, so a copy
//! that hands it a NAR per path ran on dozens of threads, each with its own allocator arena,
//! and every hand-off woke and raced idle threads for the pool's lock, which cost a tenth of a
//! copy's CPU (docs/benchmarks.md). A NAR arriving over the network is still unpacked on tokio's pool: a transfer
//! that trickles in holds one of many threads there, and would hold one of these few.
//!
//! A job's priority is a number its submitter may raise while it waits, read when a thread
//! takes the next job (the waiting jobs are scanned: at most the copy's `--jobs`, 256 by
//! default). The substitution gives a path's unpacking its depth in the closure
//! (`closure_depth.rs`), so that the references of a path are unpacked before it.

use std::cmp::Reverse;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};

use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// Unpacking threads: the cores, and at least 2, so that one thread waiting for a disk write
/// does not stop the other unpacking.
fn threads() -> usize {
    sluice_compress::cores().max(2)
}

/// A job waiting for a thread, with its priority (read when a thread takes the next job) and
/// its place in the order of arrival.
struct Queued {
    priority: Arc<AtomicUsize>,
    seq: u64,
    job: Job,
}

/// The jobs waiting, the number the next one gets, and how many are running.
#[derive(Default)]
struct Waiting {
    jobs: Vec<Queued>,
    next_seq: u64,
    running: usize,
}

/// The jobs waiting, the condition the idle threads wait on, and the one [`wait_idle`] waits
/// on (told when a thread finds nothing to do and none runs).
struct Queue {
    waiting: Mutex<Waiting>,
    ready: Condvar,
    idle: Condvar,
}

impl Queue {
    /// The waiting job of highest priority, the earliest among equals; waits for one. It
    /// counts as running until the same thread asks for its next job with `finished_one` (one
    /// lock per job for both).
    fn next(&self, finished_one: bool) -> Job {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.running -= usize::from(finished_one);
        loop {
            let best =
                waiting.jobs.iter().enumerate().max_by_key(|(_, q)| (q.priority.load(Ordering::Relaxed), Reverse(q.seq))).map(|(i, _)| i);
            if let Some(i) = best {
                waiting.running += 1;
                return waiting.jobs.swap_remove(i).job;
            }
            if waiting.running == 0 {
                self.idle.notify_all();
            }
            waiting = self.ready.wait(waiting).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Queues `job` behind those that came before it.
    fn push(&self, priority: Arc<AtomicUsize>, job: Job) {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = waiting.next_seq;
        waiting.next_seq += 1;
        waiting.jobs.push(Queued { priority, seq, job });
        drop(waiting);
        self.ready.notify_one();
    }
}

/// The queue and its threads, once started ([`queue`]).
static QUEUE: OnceLock<Option<Arc<Queue>>> = OnceLock::new();

/// The queue, its threads started on first use; `None` if no thread could be started (jobs
/// then run on tokio's pool).
fn queue() -> Option<&'static Queue> {
    QUEUE
        .get_or_init(|| {
            let queue = Arc::new(Queue { waiting: Mutex::default(), ready: Condvar::new(), idle: Condvar::new() });
            let mut started = 0;
            for i in 0..threads() {
                let queue = queue.clone();
                let worker = move || {
                    let mut finished_one = false;
                    loop {
                        (queue.next(finished_one))();
                        finished_one = true;
                    }
                };
                started += usize::from(std::thread::Builder::new().name(format!("unpack-{i}")).spawn(worker).is_ok());
            }
            (started > 0).then_some(queue)
        })
        .as_deref()
}

/// Runs `f` on one of the unpacking threads, before the waiting jobs of lower `priority` (as
/// it is when a thread becomes free) and after those that came earlier with the same, and
/// returns its result; `Err` with the panic's message if `f` panicked (the thread lives on).
pub(crate) async fn run<T: Send + 'static>(priority: Arc<AtomicUsize>, f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    if queue().is_none() {
        return tokio::task::spawn_blocking(f).await.map_err(|e| e.to_string());
    }
    submit(priority, f).await.map_err(|_| "an unpacking thread stopped".to_owned())?
}

/// [`run`] for a caller without a runtime: `f`'s result, to wait for (`blocking_recv`), is
/// sent once it has run (on the caller's thread at once if no unpacking thread could be
/// started). A job whose receiver is dropped before it begins is not run.
pub(crate) fn submit<T: Send + 'static>(
    priority: Arc<AtomicUsize>,
    f: impl FnOnce() -> T + Send + 'static,
) -> oneshot::Receiver<Result<T, String>> {
    let (tx, rx) = oneshot::channel();
    let job = move || {
        // Nobody waits for it any more (its copy stopped): not begun.
        if tx.is_closed() {
            return;
        }
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)).map_err(|panic| panic_message(&*panic)));
    };
    match queue() {
        Some(queue) => queue.push(priority, Box::new(job)),
        None => job(),
    }
    rx
}

/// Waits until no job runs or waits, for at most `timeout`; whether that happened. A stopping
/// process calls it once the futures waiting for its jobs are dropped: jobs not begun are then
/// dropped as a thread takes them, and a job running ends as its work allows (a substitution's
/// at its NAR's next read, `substitute.rs`), releasing what it holds (a path's lock and
/// temporary tree) before the process exits.
pub(crate) fn wait_idle(timeout: std::time::Duration) -> bool {
    let Some(queue) = QUEUE.get().and_then(Option::as_deref) else { return true };
    let waiting = queue.waiting.lock().unwrap_or_else(PoisonError::into_inner);
    let (waiting, _) =
        queue.idle.wait_timeout_while(waiting, timeout, |w| w.running > 0 || !w.jobs.is_empty()).unwrap_or_else(PoisonError::into_inner);
    waiting.running == 0 && waiting.jobs.is_empty()
}

/// The message a panic was raised with.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic.downcast_ref::<&str>().copied().or_else(|| panic.downcast_ref::<String>().map(String::as_str));
    format!("an unpacking thread panicked: {}", text.unwrap_or("(no message)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs run on the pool's threads, in order for each caller, and a panicking job is an
    /// error while the threads go on with the next jobs.
    #[tokio::test]
    async fn jobs_run_on_the_pool_and_survive_panics() {
        let name = run(Default::default(), || std::thread::current().name().map(str::to_owned)).await.unwrap();
        assert!(name.is_some_and(|n| n.starts_with("unpack-")));
        let panicked = run(Default::default(), || -> u32 { panic!("bad NAR") }).await.unwrap_err();
        assert_eq!(panicked, "an unpacking thread panicked: bad NAR");
        let results = futures::future::join_all((0..64u32).map(|i| run(Default::default(), move || i * 2))).await;
        assert_eq!(results.into_iter().map(Result::unwrap).collect::<Vec<_>>(), (0..64).map(|i| i * 2).collect::<Vec<_>>());
    }

    /// A free thread takes the waiting job of highest priority as it is then (a priority
    /// raised after the job was queued counts), the earliest among equals.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_free_thread_takes_the_job_of_highest_priority() {
        // Every thread held by a job that waits to be released, one at a time.
        let started = Arc::new(AtomicUsize::new(0));
        let (releases, blockers): (Vec<_>, Vec<_>) = (0..threads())
            .map(|_| {
                let (release, wait) = std::sync::mpsc::channel::<()>();
                let started = started.clone();
                (
                    release,
                    tokio::spawn(run(Arc::new(AtomicUsize::new(usize::MAX)), move || {
                        started.fetch_add(1, Ordering::SeqCst);
                        let _ = wait.recv();
                    })),
                )
            })
            .unzip();
        while started.load(Ordering::SeqCst) < threads() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let order = Arc::new(Mutex::new(Vec::new()));
        let raised = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<_> = [
            ("low", Arc::new(AtomicUsize::new(1))),
            ("high", Arc::new(AtomicUsize::new(5))),
            ("high, later", Arc::new(AtomicUsize::new(5))),
            ("raised", raised.clone()),
        ]
        .into_iter()
        .map(|(name, priority)| {
            let order = order.clone();
            let job = tokio::spawn(run(priority, move || order.lock().unwrap().push(name)));
            // Queued in this order.
            std::thread::sleep(std::time::Duration::from_millis(20));
            job
        })
        .collect();
        raised.store(9, Ordering::SeqCst);
        // One thread goes on, and takes the four jobs one after another.
        releases[0].send(()).unwrap();
        for job in jobs {
            job.await.unwrap().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["raised", "high", "high, later", "low"]);
        drop(releases);
        for blocker in blockers {
            blocker.await.unwrap().unwrap();
        }
    }
}
