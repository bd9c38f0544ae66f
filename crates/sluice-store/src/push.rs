//! Copying closures between any two stores through the [`Store`] interface (Nix's
//! `copyPaths`, `src/libstore/store-api.cc`, with the order of Nix 2.35's binary-cache
//! uploads): the closure is found in the source level by level (one batched query per level),
//! what the destination already has, contents included ([`Store::query_complete_paths`]), is
//! found and skipped, and every missing path is then transferred at once (the destination
//! having vouched for each path's signature or content address first, the source told to fetch
//! the NARs ahead, a daemon while it finds the closure: [`Store::closure_infos_fetching`]),
//! largest NAR first (in a dependency order from a store that sends its NARs one after the
//! other, [`Store::streams_nars_in_order`]: those fetched ahead are added as they come, while
//! the rest of the closure is looked for, `push/adding.rs`), at most the destination's
//! [`Store::parallelism`] NARs being read at a time. A path becomes visible in the destination
//! (its narinfo written, its registration committed) only after every reference it has in the
//! copy did, so a reader never sees a path whose closure is incomplete, even if the copy is
//! killed. Paths in a reference cycle the source claims fail, with their dependents. Into a
//! store that takes a whole copy as one stream (a daemon, `ssh-ng://`, `ssh://`), the missing
//! paths go instead in one stream in dependency order ([`stream`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use crate::failure::Failure;
use crate::reference_cycles::reference_cycles;
use crate::store::{FoundLevel, Store, StoreError};

mod adding;
mod stream;

use adding::Adding;

pub use stream::dependency_order;

/// What a copy did.
#[derive(Debug, Default)]
pub struct PushReport {
    /// Paths added to the destination.
    pub copied: Vec<StorePath>,
    /// Paths of the closure the destination had already.
    pub already_valid: usize,
    /// Paths that could not be added, with the reason (its message names the path).
    pub failed: BTreeMap<StorePath, Failure>,
    /// Bytes of NAR read from the source.
    pub nar_bytes: u64,
}

/// The closure of `roots` in `src`: every path's info, found one level of references at a time
/// (the default of [`Store::closure_infos`]).
pub(crate) async fn closure_infos_by_level<S: Store + ?Sized>(
    src: &S,
    roots: &[StorePath],
) -> Result<BTreeMap<StorePath, ValidPathInfo>, StoreError> {
    let mut infos = BTreeMap::new();
    let mut frontier: Vec<StorePath> = roots.to_vec();
    while !frontier.is_empty() {
        let answers = src.query_path_infos(&frontier).await?;
        let mut next = BTreeSet::new();
        for (path, info) in frontier.iter().zip(answers) {
            let info =
                info.ok_or_else(|| StoreError::NotValid { url: src.url().to_string(), path: src.store_dir().display_path(path) })?.info;
            next.extend(info.references.iter().filter(|r| !infos.contains_key(*r) && *r != path).cloned());
            infos.insert(path.clone(), info);
        }
        frontier = next.into_iter().filter(|p| !infos.contains_key(p)).collect();
    }
    Ok(infos)
}

/// The closure of `roots` in `src` ([`Store::closure_infos_fetching`]), the NARs of the paths
/// `dst` lacks and would take fetched ahead while it is found from a source that sends its
/// NARs one after the other ([`Store::streams_nars_in_order`]), and the order they were asked
/// for in: each set of infos found, in a dependency order, so that a path whose references
/// came first is added at once. None is fetched ahead from another source (which fetches none
/// ahead), into a store that takes whole streams (they are asked for as the stream needs
/// them), nor where `dst` could not say what it lacks or would refuse a path. The paths
/// fetched ahead are added as their NARs come, while the rest of the closure is looked for
/// (each set's tasks started in `adding` once the next set is found, or the closure: by then
/// the source has taken the names of the NARs to fetch).
async fn closure_fetching(
    src: &Arc<dyn Store>,
    dst: &Arc<dyn Store>,
    roots: &[StorePath],
    adding: &mut Adding,
) -> Result<(BTreeMap<StorePath, ValidPathInfo>, Vec<StorePath>), StoreError> {
    let (levels, mut found) = tokio::sync::mpsc::unbounded_channel::<FoundLevel>();
    let choose = async {
        let (mut asked, mut fetching) = (Vec::new(), Vec::new());
        while let Some(FoundLevel { infos, fetch }) = found.recv().await {
            fetching.drain(..).for_each(|info| adding.start(&info));
            let paths: Vec<StorePath> = infos.iter().map(|i| i.path.clone()).collect();
            let present = match dst.takes_streams() || !src.streams_nars_in_order() {
                true => None,
                false => dst.query_complete_paths(&paths).await.ok(),
            };
            let wanted: Vec<&ValidPathInfo> = match &present {
                None => Vec::new(),
                Some(present) => infos
                    .iter()
                    .filter(|i| !present.contains(&i.path) && dst.check_trust(&ValidPathInfo { ultimate: false, ..(*i).clone() }).is_ok())
                    .collect(),
            };
            let wanted: Vec<&ValidPathInfo> = dependency_order(wanted);
            asked.extend(wanted.iter().map(|i| i.path.clone()));
            fetching = wanted.into_iter().cloned().collect();
            let _ = fetch.send(fetching.iter().map(|i| i.path.clone()).collect());
        }
        (asked, fetching)
    };
    let (infos, (asked, fetching)) = tokio::join!(src.closure_infos_fetching(roots, levels), choose);
    fetching.iter().for_each(|info| adding.start(info));
    Ok((infos?, asked))
}

/// Copies the closures of `roots` from `src` to `dst` (see the module doc).
pub async fn copy_closures(src: Arc<dyn Store>, dst: Arc<dyn Store>, roots: &[StorePath]) -> Result<PushReport, StoreError> {
    let mut adding = Adding::new(src.clone(), dst.clone());
    let (infos, asked) = match closure_fetching(&src, &dst, roots, &mut adding).await {
        Ok(found) => found,
        Err(e) => {
            adding.stop().await;
            return Err(e);
        }
    };
    tracing::debug!("{}: found the closure of {} paths, {} of them being added already", src.url(), infos.len(), adding.started_count());
    let all: Vec<StorePath> = infos.keys().cloned().collect();
    let (mut present, push) = match dst.begin_push(&all).await {
        Ok(begun) => begun,
        Err(e) => {
            adding.stop().await;
            return Err(e);
        }
    };
    // Paths added since they were found are this copy's, not the destination's.
    present.retain(|p| !adding.started(p));
    let mut missing: Vec<&ValidPathInfo> = infos.values().filter(|i| !present.contains(&i.path)).collect();
    // In the order their NARs were asked for, so that the paths read them as they come; the
    // rest after them, largest first.
    let turns: HashMap<&StorePath, usize> = asked.iter().enumerate().map(|(i, p)| (p, i)).collect();
    let rank = |i: &ValidPathInfo| turns.get(&i.path).copied().unwrap_or(usize::MAX);
    missing.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| b.nar_size.cmp(&a.nar_size)).then_with(|| a.path.cmp(&b.path)));
    let mut report = PushReport { already_valid: present.len(), ..Default::default() };
    adding.settle_present(missing.iter().map(|i| i.path.clone()).collect());
    // Paths in a cycle the source claims would wait for each other for ever.
    for cycle in reference_cycles(missing.iter().map(|i| (&i.path, i.references.iter()))) {
        let message = cycle.message(dst.store_dir());
        for path in cycle.members {
            adding.settle(&path, Err(message.clone()));
            report.failed.insert(path.clone(), Failure::other(format!("{}: {message}", dst.store_dir().display_path(&path))));
        }
    }
    // Trust is decided before any NAR is transferred (built here is not built there).
    for info in &missing {
        if let Err(e) = dst.check_trust(&ValidPathInfo { ultimate: false, ..(*info).clone() }) {
            adding.settle(&info.path, Err(e.to_string()));
            report.failed.insert(info.path.clone(), Failure::copy(&dst.store_dir().display_path(&info.path), dst.url(), &e));
        }
    }
    missing.retain(|i| !report.failed.contains_key(&i.path) && !adding.started(&i.path));
    adding.begin();
    if dst.takes_streams() {
        // Nothing was started: a store that takes streams has no NAR fetched ahead.
        adding.stop().await;
        stream::copy_as_stream(&src, &dst, missing, &mut report).await?;
        return Ok(report);
    }
    missing.into_iter().for_each(|info| adding.start(info));
    let (outcomes, joined) = adding.join().await;
    for (path, size, outcome) in outcomes {
        match outcome {
            Ok(()) => {
                report.copied.push(path);
                report.nar_bytes += size;
            }
            // A path of a cycle keeps the cycle's message.
            Err(reason) => {
                report.failed.entry(path).or_insert(reason);
            }
        }
    }
    // Every narinfo was answered (or will never be written): the push's fence comes down.
    if let Some(push) = push {
        dst.end_push(push).await?;
    }
    joined.map(|()| report)
}
