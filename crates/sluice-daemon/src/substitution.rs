//! Substitution for the daemon's operations, on the closure engine and the substitution
//! pipeline of `sluice-store`, run on the daemon's shared runtime from a worker thread. The
//! substituters are the connection's settings (the daemon's, with a trusted client's
//! overrides).

use std::sync::Arc;

use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::StorePath;
use sluice_store::closure::{ClosureEvent, ClosureQuery};
use sluice_store::config::Settings;
use sluice_store::local::LocalStore;
use sluice_store::substitute::{copy_closure, CopyReport, Observer, SubstituteOptions};
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
    fn failed(&self, path: &StorePath, _: &str) {
        let _ = self.0.send(Progress::Failed(path.clone()));
    }
}

/// Opens the substituters of `settings` (none when `use_substitutes` is off). Caches that
/// cannot be used are logged and left out, as Nix does.
async fn closure_query(store: &Arc<LocalStore>, settings: &Settings, use_substitutes: bool) -> Result<ClosureQuery, String> {
    let urls: &[String] = if use_substitutes { &settings.substituters } else { &[] };
    let client = binary_cache::http::client(settings)?;
    let disk = substituters::open_disk_cache(settings);
    let (subs, errors) = substituters::open(urls, settings, &client, disk.as_deref(), store.store_dir()).await;
    for e in errors {
        tracing::warn!("substituter left out: {e}");
    }
    let valid_store = Arc::clone(store);
    let is_valid = Arc::new(move |paths: &[StorePath]| {
        valid_store.query_valid_paths(paths).map(|s| s.into_iter().collect()).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            Default::default()
        })
    });
    Ok(ClosureQuery { substituters: Arc::new(subs), disk_cache: disk, store_dir: store.store_dir().clone(), is_valid })
}

/// What the substituters know about the closures of `roots` (paths valid in the store are not
/// followed).
pub(crate) fn query(daemon: &Daemon, settings: &Settings, use_substitutes: bool, roots: Vec<StorePath>) -> Result<Vec<ClosureEvent>, String> {
    daemon.runtime.block_on(async {
        let query = closure_query(&daemon.store, settings, use_substitutes).await?;
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

/// Substitutes the closures of `roots` into the store, calling `progress` on the worker
/// thread as paths start and finish.
pub(crate) fn copy(daemon: &Daemon, settings: &Settings, use_substitutes: bool, roots: Vec<StorePath>, mut progress: impl FnMut(Progress)) -> Result<CopyReport, String> {
    let keys = TrustedKeys::parse(&settings.trusted_public_keys.join(" ")).map_err(|e| format!("trusted-public-keys: {e}"))?;
    let opts = SubstituteOptions { jobs: settings.http_connections.clamp(1, 16), require_sigs: settings.require_sigs, trusted_keys: keys };
    daemon.runtime.block_on(async {
        let query = closure_query(&daemon.store, settings, use_substitutes).await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let store = Arc::clone(&daemon.store);
        let task = tokio::spawn(copy_closure(query, store, roots, opts, Arc::new(Forward(tx))));
        while let Some(p) = rx.recv().await {
            progress(p);
        }
        task.await.map_err(|e| format!("substitution: {e}"))
    })
}
