//! The closure engine: given store paths, find their closures in binary caches by fetching
//! narinfos in parallel with no barrier per level. A path's references are queued the moment
//! its narinfo arrives; every substituter is asked at once and the answer taken by priority
//! (lowest `Priority` first), without waiting on lower-priority caches once a higher one has
//! answered. The narinfo disk cache is consulted in batches before the network, and new
//! answers are written back in batches. This is the batch `querySubstitutablePathInfos` of
//! Nix's founding design; `missing`, `copy` and `path-info -r` use it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use tokio::sync::mpsc;

use crate::binary_cache::{BinaryCache, CacheError};
use crate::narinfo_cache::{Cached, NarInfoCache};

/// A binary cache used as a substituter, with its id in the disk cache (if any).
#[derive(Debug)]
pub struct Substituter {
    pub cache: BinaryCache,
    pub disk_id: Option<i64>,
}

/// What the engine learnt about one path of the closure.
#[derive(Debug)]
pub enum ClosureEvent {
    /// Valid in the destination already; its references were not followed.
    Valid(StorePath),
    /// Substituter number `cache` (an index into the engine's list) has it.
    Found { narinfo: Arc<NarInfo>, cache: usize },
    /// No substituter has it, and none failed.
    Unknown(StorePath),
    /// No substituter has it and at least one failed (each error names its URL).
    Failed { path: StorePath, errors: Vec<Arc<CacheError>> },
}

/// Decides which of a batch of paths are already valid in the destination.
pub type ValidityCheck = Arc<dyn Fn(&[StorePath]) -> HashSet<StorePath> + Send + Sync>;

/// Disk-cache answers are written back once this many have accumulated (and at the end).
const RECORD_BATCH: usize = 256;

/// The closure engine's configuration.
#[derive(Clone)]
pub struct ClosureQuery {
    /// Substituters, sorted by priority (stable: ties keep the configured order).
    pub substituters: Arc<Vec<Substituter>>,
    pub disk_cache: Option<Arc<NarInfoCache>>,
    pub store_dir: StoreDir,
    pub is_valid: ValidityCheck,
}

enum Answer {
    Cached(Cached),
    Fetch(tokio::task::JoinHandle<Result<Option<String>, CacheError>>),
}

struct Outcome {
    path: StorePath,
    event: ClosureEvent,
    /// Fresh network answers to record: (disk id, hash part, narinfo text or absent).
    records: Vec<(i64, String, Option<String>)>,
}

impl ClosureQuery {
    /// Sorts substituters by priority, keeping the given order among equals.
    pub fn sort_substituters(mut subs: Vec<Substituter>) -> Vec<Substituter> {
        subs.sort_by_key(|s| s.cache.info().priority);
        subs
    }

    /// Runs the query for the closures of `roots`, sending one event per distinct path to
    /// `events` as answers arrive. Returns when the whole closure is known (or `events` is
    /// closed by the receiver).
    pub async fn run(&self, roots: Vec<StorePath>, events: mpsc::UnboundedSender<ClosureEvent>) {
        let mut seen: HashSet<StorePath> = HashSet::new();
        let mut pending = FuturesUnordered::new();
        let mut records = Vec::new();
        self.enqueue(roots, &mut seen, &mut pending, &events);
        while let Some(outcome) = pending.next().await {
            let Outcome { path, event, records: new } = outcome;
            records.extend(new);
            if records.len() >= RECORD_BATCH {
                self.flush(&mut records).await;
            }
            if let ClosureEvent::Found { narinfo, .. } = &event {
                let refs: Vec<StorePath> = narinfo.references.iter().filter(|r| **r != path).cloned().collect();
                self.enqueue(refs, &mut seen, &mut pending, &events);
            }
            if events.send(event).is_err() {
                return;
            }
        }
        self.flush(&mut records).await;
    }

    async fn flush(&self, records: &mut Vec<(i64, String, Option<String>)>) {
        let Some(disk) = &self.disk_cache else { return };
        if records.is_empty() {
            return;
        }
        let batch = std::mem::take(records);
        let disk = disk.clone();
        let result = tokio::task::spawn_blocking(move || disk.record(&batch)).await;
        if let Ok(Err(e)) = result {
            tracing::warn!("{e}");
        }
    }

    fn enqueue(
        &self,
        paths: Vec<StorePath>,
        seen: &mut HashSet<StorePath>,
        pending: &mut FuturesUnordered<BoxFuture<'static, Outcome>>,
        events: &mpsc::UnboundedSender<ClosureEvent>,
    ) {
        let new: Vec<StorePath> = paths.into_iter().filter(|p| seen.insert(p.clone())).collect();
        if new.is_empty() {
            return;
        }
        let valid = (self.is_valid)(&new);
        let rest: Vec<StorePath> = new.into_iter().filter(|p| !valid.contains(p)).collect();
        for v in valid {
            let _ = events.send(ClosureEvent::Valid(v));
        }
        let cached = self.cached_answers(&rest);
        for path in rest {
            let answers = self
                .substituters
                .iter()
                .enumerate()
                .map(|(i, _)| match cached.get(&(i, path.hash_part().to_string())) {
                    Some(c) => Answer::Cached(c.clone()),
                    None => {
                        let subs = self.substituters.clone();
                        let p = path.clone();
                        Answer::Fetch(tokio::spawn(async move { subs[i].cache.narinfo_text(&p).await }))
                    }
                })
                .collect();
            pending.push(Box::pin(resolve(self.substituters.clone(), self.store_dir.clone(), path, answers)));
        }
    }

    /// Fresh disk-cache answers for `paths`, keyed by (substituter index, hash part).
    fn cached_answers(&self, paths: &[StorePath]) -> HashMap<(usize, String), Cached> {
        let mut out = HashMap::new();
        let Some(disk) = &self.disk_cache else { return out };
        let hashes: Vec<&str> = paths.iter().map(|p| p.hash_part()).collect();
        for (i, sub) in self.substituters.iter().enumerate() {
            let Some(id) = sub.disk_id else { continue };
            match disk.lookup(id, &hashes) {
                Ok(found) => out.extend(found.into_iter().map(|(h, c)| ((i, h), c))),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        out
    }
}

/// Takes the answer of the highest-priority substituter that has `path`, waiting on a
/// lower-priority one only while every higher one lacks it or failed; cancels the rest.
async fn resolve(subs: Arc<Vec<Substituter>>, store_dir: StoreDir, path: StorePath, answers: Vec<Answer>) -> Outcome {
    let mut records = Vec::new();
    let mut errors: Vec<Arc<CacheError>> = Vec::new();
    let mut answers = answers.into_iter().enumerate();
    while let Some((i, answer)) = answers.next() {
        let sub = &subs[i];
        let text = match answer {
            Answer::Cached(Cached::Present(text)) => Ok(Some(text)),
            Answer::Cached(Cached::Absent) => Ok(None),
            Answer::Fetch(handle) => {
                let result = handle.await.unwrap_or_else(|e| Err(CacheError::Io { url: sub.cache.narinfo_url(&path), source: std::io::Error::other(e) }));
                if let (Ok(text), Some(id)) = (&result, sub.disk_id) {
                    // Only well-formed narinfos are cached as present.
                    let valid = text.as_ref().is_none_or(|t| sub.cache.parse_narinfo(&path, &store_dir, t).is_ok());
                    if valid {
                        records.push((id, path.hash_part().to_string(), text.clone()));
                    }
                }
                result
            }
        };
        match text.and_then(|t| t.map(|t| sub.cache.parse_narinfo(&path, &store_dir, &t)).transpose()) {
            Ok(Some(narinfo)) => {
                // Failures of higher-priority caches are skipped, but not silently (those that
                // disabled a whole cache were reported once already).
                for e in errors.iter().filter(|e| !e.disables_cache() && !matches!(e.as_ref(), CacheError::Disabled { .. })) {
                    tracing::warn!("{e}; using {} instead", sub.cache.url());
                }
                for (_, rest) in answers {
                    if let Answer::Fetch(h) = rest {
                        h.abort();
                    }
                }
                return Outcome { path, event: ClosureEvent::Found { narinfo: Arc::new(narinfo), cache: i }, records };
            }
            Ok(None) => {}
            Err(e) => errors.push(Arc::new(e)),
        }
    }
    let event = if errors.is_empty() { ClosureEvent::Unknown(path.clone()) } else { ClosureEvent::Failed { path: path.clone(), errors } };
    Outcome { path, event, records }
}
