//! The registrar: one task per copy into a local store that registers the paths handed to it
//! (unpacked, their references valid or handed to it before them) in batches, in the order it
//! gets them. The substitution pipeline ([`crate::substitute`]) and every other copy into a
//! local store (the local store's [`Store`](crate::store::Store) handle, `local_handle.rs`:
//! pulls from daemons and SSH stores) hand their paths to one. Nix registers each substituted
//! path in a transaction of its own (`LocalStore::registerValidPaths` in
//! `src/libstore/local-store.cc`, called per path by `PathSubstitutionGoal`).

use std::sync::Arc;

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

/// Most paths registered in one transaction.
const COMMIT_BATCH: usize = 512;

/// The sending end of a registrar task (see the module doc); the task ends once every clone
/// of it is dropped and what it was handed is registered.
#[derive(Clone)]
pub(crate) struct Registrar {
    tx: mpsc::UnboundedSender<Commit>,
}

impl Registrar {
    /// Starts a registrar committing into `dest` under `policy` (for each path, as
    /// [`SignaturePolicy::for_source`] says for its source); its task, to wait for.
    pub fn start(dest: Arc<LocalStore>, policy: SignaturePolicy) -> (Registrar, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Registrar { tx }, tokio::spawn(registrar(dest, policy, rx)))
    }

    /// Hands `pending` (from a `?trusted=true` substituter if `trusted`) over, after every
    /// reference of it that is not valid; how it ends, or `None` if the registrar stopped.
    pub fn hand(&self, pending: PendingPath, trusted: bool) -> Option<Registered> {
        let (reply, registered) = oneshot::channel();
        self.tx.send(Commit { pending, trusted, reply }).ok().map(|()| registered)
    }
}

/// Registers ready paths in batches ([`LocalStore::commit_all`]): whatever has arrived while
/// the previous batch was being committed goes into the next, with one `syncfs` and one
/// transaction per batch, each path under the policy of its source
/// ([`SignaturePolicy::for_source`]). A path is handed over only after those of its
/// references that are not valid, so the order of arrival is a dependency order: a chain of
/// paths unpacked at once is registered in one batch, not one batch per link. A path whose
/// reference was refused is handed back ([`Uncommitted::Waiting`]).
async fn registrar(dest: Arc<LocalStore>, policy: SignaturePolicy, mut rx: mpsc::UnboundedReceiver<Commit>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < COMMIT_BATCH {
            match rx.try_recv() {
                Ok(more) => batch.push(more),
                Err(_) => break,
            }
        }
        tracing::debug!("registering {} paths in one transaction", batch.len());
        let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|c| ((c.pending, c.trusted), c.reply)).unzip();
        let (dest, policy) = (dest.clone(), policy.clone());
        let committed = tokio::task::spawn_blocking(move || {
            let policies = [policy.for_source(false), policy.for_source(true)];
            dest.commit_all(items.into_iter().map(|(pending, trusted)| (pending, &*policies[trusted as usize])).collect())
        });
        let results = match committed.await {
            Ok(results) => results,
            Err(e) => return tracing::error!("the registrar failed: {e}"),
        };
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
    }
}
