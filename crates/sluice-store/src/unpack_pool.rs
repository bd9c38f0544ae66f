//! The process's unpacking threads: as many as the cores, started on first use and fed in
//! order through one queue, for blocking work that never waits on a peer (unpacking a NAR
//! whose bytes are on this machine, a `file://` cache's). Tokio's blocking pool (up to
//! `max_blocking_threads`, 96 in `sluice`) starts a thread whenever none is idle, so a copy
//! that hands it a NAR per path ran on dozens of threads, each with its own allocator arena,
//! and every hand-off woke and raced idle threads for the pool's lock: on the corpus copy from
//! `file://` this pool cut the CPU by about a tenth (docs/benchmarks.md, issue 16, fourth
//! session). A NAR arriving over the network is still unpacked on tokio's pool: a transfer
//! that trickles in holds one of many threads there, and would hold one of these few.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Mutex, OnceLock, PoisonError};

use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// Unpacking threads: the cores, and at least 2, so that one thread waiting for a disk write
/// does not stop the other unpacking.
fn threads() -> usize {
    crate::cores().max(2)
}

/// Where jobs go; `None` if no thread could be started (jobs then run on tokio's pool).
fn queue() -> Option<&'static mpsc::Sender<Job>> {
    static QUEUE: OnceLock<Option<mpsc::Sender<Job>>> = OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = std::sync::Arc::new(Mutex::new(rx));
            let mut started = 0;
            for i in 0..threads() {
                let rx = rx.clone();
                let worker = move || loop {
                    // The lock is held only while waiting for the next job.
                    let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                };
                started += usize::from(std::thread::Builder::new().name(format!("unpack-{i}")).spawn(worker).is_ok());
            }
            (started > 0).then_some(tx)
        })
        .as_ref()
}

/// Runs `f` on one of the unpacking threads, after the jobs queued before it, and returns
/// its result; `Err` with the panic's message if `f` panicked (the thread lives on).
pub(crate) async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let Some(queue) = queue() else {
        return tokio::task::spawn_blocking(f).await.map_err(|e| e.to_string());
    };
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)).map_err(|panic| panic_message(&*panic)));
    });
    // The threads never end, so the queue is always received from.
    let _ = queue.send(job);
    rx.await.map_err(|_| "an unpacking thread stopped".to_owned())?
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
        let name = run(|| std::thread::current().name().map(str::to_owned)).await.unwrap();
        assert!(name.is_some_and(|n| n.starts_with("unpack-")));
        let panicked = run(|| -> u32 { panic!("bad NAR") }).await.unwrap_err();
        assert_eq!(panicked, "an unpacking thread panicked: bad NAR");
        let results = futures::future::join_all((0..64u32).map(|i| run(move || i * 2))).await;
        assert_eq!(results.into_iter().map(Result::unwrap).collect::<Vec<_>>(), (0..64).map(|i| i * 2).collect::<Vec<_>>());
    }
}
