//! Standard error, written whole line by line, or gathered while a copy runs.
//!
//! A copy logs a line per path (`copying path 'X' from 'URL'...`, or in JSON an activity's
//! start, results and stop), as Nix does. Written one `write` each into a pipe (a CI log, a
//! script, nix-output-monitor), every line wakes the reader, on the core the copy's other half
//! needs, and slows the copy (docs/benchmarks.md). While [`Gathering`],
//! lines are written together: at once when [`FULL`] bytes are waiting, and otherwise every
//! [`EVERY`], so that a line is late by at most that. The order of lines is kept: every line
//! sluice writes to standard error goes through [`write`].

use std::io::Write;
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Duration;

/// Bytes waiting that are written at once (a pipe holds 64 KiB).
const FULL: usize = 32 * 1024;
/// How late a gathered line may be written.
const EVERY: Duration = Duration::from_millis(50);

/// Lines not written yet, and whether lines are gathered.
struct Pending {
    bytes: Vec<u8>,
    gathering: bool,
}

static PENDING: Mutex<Pending> = Mutex::new(Pending { bytes: Vec::new(), gathering: false });

fn pending() -> MutexGuard<'static, Pending> {
    PENDING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes `text` (whole lines) to standard error, after the lines gathered before it; while
/// [`Gathering`], it may wait up to [`EVERY`]. A write error (standard error closed) is passed
/// over, as `eprintln!` cannot report one either.
pub fn write(text: &[u8]) {
    let mut pending = pending();
    pending.bytes.extend_from_slice(text);
    if !pending.gathering || pending.bytes.len() >= FULL {
        flush_locked(&mut pending);
    }
}

/// Writes what waits.
fn flush_locked(pending: &mut Pending) {
    if !pending.bytes.is_empty() {
        let _ = std::io::stderr().lock().write_all(&pending.bytes);
        pending.bytes.clear();
    }
}

/// Makes a panic's message come after the lines written before it: the default hook writes
/// to standard error directly, so the lines waiting are written first. Without waiting for
/// the lock, which the panicking thread itself may hold (its message then comes first).
pub fn write_waiting_lines_on_panic() {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        match PENDING.try_lock() {
            Ok(mut pending) => flush_locked(&mut pending),
            Err(TryLockError::Poisoned(poisoned)) => flush_locked(&mut poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
        hook(info)
    }));
}

/// Lines are gathered from [`Gathering::start`] until it is dropped, which writes what waits. A
/// thread writes them every [`EVERY`] meanwhile.
pub struct Gathering {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Gathering {
    /// Starts gathering lines, if standard error is not a terminal (where each line is written
    /// at once, as it is shown to someone).
    pub fn start() -> Gathering {
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return Gathering { stop: None, thread: None };
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("stderr".into()).spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(EVERY) {
                flush_locked(&mut pending());
            }
        });
        // Without the thread, lines are written at once.
        pending().gathering = thread.is_ok();
        Gathering { stop: Some(stop), thread: thread.ok() }
    }
}

impl Drop for Gathering {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let mut pending = pending();
        pending.gathering = false;
        flush_locked(&mut pending);
    }
}
