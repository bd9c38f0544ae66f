//! A copy into a store that takes a whole copy as one stream ([`Store::takes_streams`]: a
//! daemon, `ssh-ng://`, `ssh://`), as Nix's `copyPaths` sends one AddMultipleToStore: the
//! missing paths in a dependency order, each NAR read from the source as its turn comes (up to
//! [`NARS_AHEAD`] opened ahead), the destination making each valid in turn. When the
//! destination refuses a path, the paths it did not look at are sent again in a new stream,
//! but those that refer to a path that failed, which fail too.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::Arc;

use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use super::PushReport;
use crate::failure::Failure;
use crate::store::{NarReader, Store, StoreError, StreamedPath};

/// NARs opened ahead of the one being sent.
const NARS_AHEAD: usize = 16;

/// `infos`, each after those of its references among them (Nix's `topoSortPaths`, reversed);
/// in a reference cycle, in some order.
pub fn dependency_order<'a>(infos: impl IntoIterator<Item = &'a ValidPathInfo>) -> Vec<&'a ValidPathInfo> {
    let by_path: BTreeMap<&StorePath, &ValidPathInfo> = infos.into_iter().map(|i| (&i.path, i)).collect();
    let mut seen: BTreeSet<&StorePath> = BTreeSet::new();
    let mut out = Vec::with_capacity(by_path.len());
    for &root in by_path.values() {
        if !seen.insert(&root.path) {
            continue;
        }
        let mut stack = vec![(root, root.references.iter())];
        while let Some((info, refs)) = stack.last_mut() {
            let info = *info;
            match refs.find_map(|r| by_path.get(r).copied().filter(|_| seen.insert(r))) {
                Some(next) => stack.push((next, next.references.iter())),
                None => {
                    out.push(info);
                    stack.pop();
                }
            }
        }
    }
    out
}

/// Sends `missing` (trusted by `dst`, in no reference cycle) from `src` into `dst` as one
/// stream, and again for the paths `dst` did not look at, recording each outcome in `report`.
pub(super) async fn copy_as_stream(
    src: &Arc<dyn Store>,
    dst: &Arc<dyn Store>,
    missing: Vec<&ValidPathInfo>,
    report: &mut PushReport,
) -> Result<(), StoreError> {
    let mut pending = dependency_order(missing);
    src.prefetch_nars(&pending);
    while !pending.is_empty() {
        pending.retain(|info| match info.references.iter().find(|r| report.failed.contains_key(*r)) {
            None => true,
            Some(r) => {
                let dir = dst.store_dir();
                let e = StoreError::ReferenceFailed { path: dir.display_path(&info.path), reference: dir.display_path(r) };
                report.failed.insert(info.path.clone(), Failure::copy(&dir.display_path(&info.path), dst.url(), &e));
                false
            }
        });
        let (tx, rx) = tokio::sync::mpsc::channel(NARS_AHEAD);
        let open = async {
            for info in &pending {
                let nar = match src.nar_from_path(info).await {
                    Ok(nar) => nar,
                    Err(e) => Box::new(Unreadable(format!("{}: {e}", src.url()))) as NarReader,
                };
                // Built here is not built there (Nix's `copyStorePath` clears `ultimate`).
                let info = ValidPathInfo { ultimate: false, ..(*info).clone() };
                if tx.send(StreamedPath { info, nar }).await.is_err() {
                    break;
                }
            }
            drop(tx);
        };
        let (_, outcomes) = tokio::join!(open, dst.add_stream(pending.len(), rx));
        let mut outcomes: BTreeMap<StorePath, Result<(), StoreError>> = outcomes?.into_iter().collect();
        let (mut again, sent) = (Vec::new(), pending.len());
        for info in pending {
            match outcomes.remove(&info.path) {
                Some(Ok(())) => {
                    report.copied.push(info.path.clone());
                    report.nar_bytes += info.nar_size;
                }
                Some(Err(StoreError::NotAttempted { .. })) | None => again.push(info),
                Some(Err(e)) => {
                    report.failed.insert(info.path.clone(), Failure::copy(&dst.store_dir().display_path(&info.path), dst.url(), &e));
                }
            }
        }
        if again.len() == sent {
            // Nothing was decided: sending them again would not decide them either.
            let e = StoreError::Other(format!("{}: the stream of additions ended before this path", dst.url()));
            for info in again.drain(..) {
                report.failed.insert(info.path.clone(), Failure::copy(&dst.store_dir().display_path(&info.path), dst.url(), &e));
            }
        }
        pending = again;
    }
    Ok(())
}

/// The NAR of a path the source could not open: reading it fails with why.
struct Unreadable(String);

impl Read for Unreadable {
    fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
        Err(std::io::Error::other(self.0.clone()))
    }
}
