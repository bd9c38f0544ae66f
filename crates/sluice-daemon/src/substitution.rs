//! Substitution for the daemon's operations, on the closure engine and the substitution
//! pipeline of `sluice-store`, run on the daemon's shared runtime from a worker thread. The
//! substituters are the connection's settings (the daemon's, with a trusted client's
//! overrides).

use std::sync::Arc;

use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::StorePath;
use sluice_store::closure::{self, ClosureEvent, ClosureQuery};
use sluice_store::config::Settings;
use sluice_store::local::{LocalStore, SignaturePolicy, TempRoots};
use sluice_store::substitute::{copy_closure, repair_paths, CopyReport, Failure, Observer, SubstituteOptions};
use sluice_store::{binary_cache, substituters};
use tokio::sync::mpsc;

use crate::Daemon;

/// Progress of a substitution, forwarded to the client as activities.
#[derive(Debug)]
pub(crate) enum Progress {
    Started(StorePath),
    Done(StorePath),
    Failed(StorePath),
}

struct Forward(mpsc::UnboundedSender<Progress>);

impl Observer for Forward {
    fn queued(&self, path: &StorePath, _: u64, _: u64) {
        let _ = self.0.send(Progress::Started(path.clone()));
    }
    fn done(&self, path: &StorePath, _: u64) {
        let _ = self.0.send(Progress::Done(path.clone()));
    }
    fn failed(&self, path: &StorePath, _: &Failure) {
        let _ = self.0.send(Progress::Failed(path.clone()));
    }
}

/// Opens the substituters of `settings` (none when `use_substitutes` is off). Caches that
/// cannot be used are logged and left out, as Nix does. Paths whose validity is looked up
/// are made temporary roots in `roots` first, if given (for a substitution).
async fn closure_query(store: &Arc<LocalStore>, settings: &Settings, use_substitutes: bool, roots: Option<TempRoots>) -> Result<ClosureQuery, String> {
    let urls: &[String] = if use_substitutes { &settings.substituters } else { &[] };
    let client = binary_cache::http::client(settings)?;
    let disk = substituters::open_disk_cache(settings);
    let (subs, errors) = substituters::open(urls, settings, &client, disk.as_deref(), store.store_dir()).await;
    for e in errors {
        tracing::warn!("substituter left out: {e}");
    }
    let is_valid = closure::validity_in(Some(Arc::clone(store)), roots);
    Ok(ClosureQuery { substituters: Arc::new(subs), disk_cache: disk, store_dir: store.store_dir().clone(), is_valid })
}

/// What the substituters know about the closures of `roots` (paths valid in the store are not
/// followed).
pub(crate) fn query(daemon: &Daemon, settings: &Settings, use_substitutes: bool, roots: Vec<StorePath>) -> Result<Vec<ClosureEvent>, String> {
    daemon.runtime.block_on(async {
        let query = closure_query(&daemon.store, settings, use_substitutes, None).await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let engine = tokio::spawn(async move { query.run(roots, tx).await });
        let mut events = Vec::new();
        while let Some(e) = rx.recv().await {
            events.push(e);
        }
        engine.await.map_err(|e| format!("closure query: {e}"))?;
        Ok(events)
    })
}

/// Substitutes the closures of `paths` into the store, calling `progress` on the worker
/// thread as paths start and finish. Every path of the closures is a temporary root in
/// `roots` (the connection's) from before its validity is looked at.
pub(crate) fn copy(daemon: &Daemon, settings: &Settings, use_substitutes: bool, roots: &TempRoots, paths: Vec<StorePath>, progress: impl FnMut(Progress)) -> Result<CopyReport, String> {
    pipeline(daemon, settings, use_substitutes, roots, paths, false, progress)
}

/// Substitutes the damaged valid path `path` again (Nix's `repairPath`; see
/// [`sluice_store::substitute::repair_paths`]); the error says why it could not be.
pub(crate) fn repair(daemon: &Daemon, settings: &Settings, use_substitutes: bool, roots: &TempRoots, path: &StorePath) -> Result<(), String> {
    let report = pipeline(daemon, settings, use_substitutes, roots, vec![path.clone()], true, |_| {})?;
    match report.failed.get(path) {
        Some(why) => Err(why.message.clone()),
        None if report.substituted.contains(path) => Ok(()),
        None => Err("no substituter has it".into()),
    }
}

/// [`copy`], or with `repair` a repair of the valid `paths`.
fn pipeline(daemon: &Daemon, settings: &Settings, use_substitutes: bool, roots: &TempRoots, paths: Vec<StorePath>, repair: bool, mut progress: impl FnMut(Progress)) -> Result<CopyReport, String> {
    let trusted_keys = TrustedKeys::parse(&settings.trusted_public_keys.join(" ")).map_err(|e| format!("trusted-public-keys: {e}"))?;
    let policy = SignaturePolicy { require_sigs: settings.require_sigs, trusted_keys };
    let opts = SubstituteOptions { jobs: settings.max_substitution_jobs, policy };
    daemon.runtime.block_on(async {
        let query = closure_query(&daemon.store, settings, use_substitutes, Some(roots.clone())).await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let store = Arc::clone(&daemon.store);
        let observer = Arc::new(Forward(tx));
        let task = match repair {
            true => tokio::spawn(repair_paths(query, store, roots.clone(), paths, opts, observer)),
            false => tokio::spawn(copy_closure(query, store, roots.clone(), paths, opts, observer)),
        };
        while let Some(p) = rx.recv().await {
            progress(p);
        }
        task.await.map_err(|e| format!("substitution: {e}"))
    })
}
