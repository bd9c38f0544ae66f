//! The registrar: a thread per copy into a local store that registers the paths handed to it
//! (unpacked, their references valid or handed to it before them) in batches, in the order it
//! gets them. Every addition to a local store that is not a single path goes through one: the
//! substitution pipeline ([`crate::substitute`]), the local store's
//! [`Store`](crate::store::Store) handle (`local_handle.rs`: pulls from daemons and SSH
//! stores), and the streams of paths that [`BatchedAdder`](crate::BatchedAdder) takes (the
//! daemon's AddMultipleToStore, `legacy-serve --write`'s imports). Nix registers each
//! substituted path in a transaction of its own (`LocalStore::registerValidPaths` in
//! `src/libstore/local-store.cc`, called per path by `PathSubstitutionGoal`), and each path of
//! an AddMultipleToStore too (`Store::addMultipleToStore`, `src/libstore/store-api.cc`).
//!
//! It is a thread, not a task, so that callers without an async runtime (the daemon's
//! connections, `legacy-serve`) use it as the pipeline does.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use sluice_local_store::{LocalStore, PendingPath, SignaturePolicy, Uncommitted};
use tokio::sync::{mpsc, oneshot};

/// A path whose tree is unpacked and whose references are valid or handed to the registrar
/// before it, waiting for registration.
struct Commit {
    pending: PendingPath,
    /// Whether it came from a `?trusted=true` substituter.
    trusted: bool,
    reply: oneshot::Sender<Result<(), Uncommitted>>,
}

/// How a path handed to the registrar ends: registered, or handed back
/// ([`Uncommitted::Waiting`]: a reference of it is not valid) or refused.
pub(crate) type Registered = oneshot::Receiver<Result<(), Uncommitted>>;

/// Most paths registered in one transaction (a group handed at once is never split).
const COMMIT_BATCH: usize = 512;

/// The sending end of a registrar (see the module doc); its thread ends once every clone of
/// it is dropped and what it was handed is registered.
#[derive(Clone)]
pub(crate) struct Registrar {
    /// Each message is a group of paths that go into one batch.
    tx: mpsc::UnboundedSender<Vec<Commit>>,
}

/// Registrar threads running in the process, and the condition told when one ends.
static RUNNING: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// Waits, for at most `timeout`, until no registrar thread runs (each ends once its senders are
/// gone and what it was handed is registered, its handle on the store dropped); whether that
/// happened.
pub(crate) fn wait_ended(timeout: Duration) -> bool {
    let (running, ended) = &RUNNING;
    let running = running.lock().unwrap_or_else(PoisonError::into_inner);
    let (running, _) = ended.wait_timeout_while(running, timeout, |n| *n > 0).unwrap_or_else(PoisonError::into_inner);
    *running == 0
}

/// Counts a registrar thread as running while it lives.
struct Running;

impl Running {
    fn start() -> Running {
        *RUNNING.0.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        *RUNNING.0.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
        RUNNING.1.notify_all();
    }
}

/// A registrar's thread, to wait for ([`Finished::wait`]).
pub(crate) struct Finished(Option<std::thread::JoinHandle<()>>);

impl Finished {
    /// Returns once the registrar's thread has ended (at once if it could not start), its
    /// handle on the store dropped, so that the store can be closed. It ends once every
    /// clone of its [`Registrar`] is dropped and what it was handed is registered.
    pub fn wait(self) {
        if let Some(thread) = self.0 {
            let _ = thread.join();
        }
    }
}

impl Registrar {
    /// Starts a registrar committing into `dest` under `policy` (for each path, as
    /// [`SignaturePolicy::for_source`] says for its source). If its thread cannot be started,
    /// the error is logged and every path handed to it is refused ([`Registrar::hand`] says
    /// `None`).
    pub fn start(dest: Arc<LocalStore>, policy: SignaturePolicy) -> (Registrar, Finished) {
        let (tx, rx) = mpsc::unbounded_channel();
        let shown = format!("{} (state in {})", dest.store_dir().as_str(), dest.state_dir().display());
        let running = Running::start();
        let spawned = std::thread::Builder::new().name("sluice-registrar".into()).spawn(move || {
            register(&dest, &policy, rx);
            // The store's handle goes before the thread counts as ended.
            drop(dest);
            drop(running);
        });
        let thread = spawned.map_err(|e| tracing::error!("starting the registrar thread of the store {shown}: {e}")).ok();
        (Registrar { tx }, Finished(thread))
    }

    /// Hands `pending` (from a `?trusted=true` substituter if `trusted`) over, after every
    /// reference of it that is not valid; how it ends, or `None` if the registrar stopped.
    pub fn hand(&self, pending: PendingPath, trusted: bool) -> Option<Registered> {
        self.hand_all(vec![(pending, trusted)]).and_then(|mut r| r.pop())
    }

    /// [`Registrar::hand`] of each of `group`, in order, all registered in one batch (with
    /// what else arrived meanwhile); how each ends, in order.
    pub fn hand_all(&self, group: Vec<(PendingPath, bool)>) -> Option<Vec<Registered>> {
        let (commits, registered): (Vec<Commit>, Vec<Registered>) = group
            .into_iter()
            .map(|(pending, trusted)| {
                let (reply, registered) = oneshot::channel();
                (Commit { pending, trusted, reply }, registered)
            })
            .unzip();
        self.tx.send(commits).ok().map(|()| registered)
    }
}

/// Registers ready paths in batches ([`LocalStore::commit_all`]): whatever has arrived while
/// the previous batch was being committed goes into the next, with one `syncfs` and one
/// transaction per batch, each path under the policy of its source
/// ([`SignaturePolicy::for_source`]). A path is handed over only after those of its
/// references that are not valid, so the order of arrival is a dependency order: a chain of
/// paths unpacked at once is registered in one batch, not one batch per link. A path whose
/// reference was refused is handed back ([`Uncommitted::Waiting`]).
fn register(dest: &LocalStore, policy: &SignaturePolicy, mut rx: mpsc::UnboundedReceiver<Vec<Commit>>) {
    let policies = [policy.for_source(false), policy.for_source(true)];
    while let Some(mut batch) = rx.blocking_recv() {
        while batch.len() < COMMIT_BATCH {
            match rx.try_recv() {
                Ok(more) => batch.extend(more),
                Err(_) => break,
            }
        }
        tracing::debug!("registering {} paths in one transaction", batch.len());
        let (items, replies): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|c| ((c.pending, &*policies[usize::from(c.trusted)]), c.reply)).unzip();
        for (reply, result) in replies.into_iter().zip(dest.commit_all(items)) {
            let _ = reply.send(result);
        }
    }
}
