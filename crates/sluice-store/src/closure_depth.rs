//! The depth of each path in a closure being walked, as far as it is known: the priority of its
//! unpacking (`unpack_pool.rs`), so that the references of a path are unpacked before it and
//! the registrar, which registers a path only after its references, keeps pace with the
//! unpacking instead of registering most of a closure at its end (`substitute.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use sluice_nix::store_path::StorePath;

/// Depths by path: 0 for a root, and for a reference at least one more than each path found
/// so far that refers to it. A depth is raised as referrers are found and is not carried on to
/// the references of a path found earlier, so that a found path costs its references and no
/// more (a cycle a cache claims included). A reference is then deeper than the paths found
/// before it that refer to it; the walk finds paths before their references, so in practice
/// deeper than all of them.
///
/// Why: unpacked in the order found, most of a closure waits for the few deep libraries found
/// last and is then registered at once on one thread, at the end of the copy
/// (docs/benchmarks.md).
#[derive(Default)]
pub(crate) struct ClosureDepths {
    depths: Mutex<HashMap<StorePath, Arc<AtomicUsize>>>,
}

impl ClosureDepths {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StorePath, Arc<AtomicUsize>>> {
        self.depths.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The depth of `path`, shared: it rises as paths that refer to it are found.
    pub(crate) fn of(&self, path: &StorePath) -> Arc<AtomicUsize> {
        let mut depths = self.lock();
        match depths.get(path) {
            Some(depth) => depth.clone(),
            None => depths.entry(path.clone()).or_default().clone(),
        }
    }

    /// Raises the depth of each of `references` (but `path` itself) to one more than that of
    /// `path`, just found.
    pub(crate) fn found<'a>(&self, path: &StorePath, references: impl IntoIterator<Item = &'a StorePath>) {
        let mut depths = self.lock();
        let below = depths.get(path).map_or(0, |d| d.load(Ordering::Relaxed)) + 1;
        for r in references.into_iter().filter(|r| *r != path) {
            match depths.get(r) {
                Some(depth) => {
                    depth.fetch_max(below, Ordering::Relaxed);
                }
                None => {
                    depths.insert(r.clone(), Arc::new(AtomicUsize::new(below)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_nix::store_path::StoreDir;

    fn path(c: char) -> StorePath {
        StoreDir::default().parse_path(&format!("/nix/store/{}-p", c.to_string().repeat(32))).unwrap()
    }

    fn depth(depths: &ClosureDepths, c: char) -> usize {
        depths.of(&path(c)).load(Ordering::Relaxed)
    }

    /// A root is at 0; a reference one below its deepest referrer found so far, also when it
    /// is reached again by a longer way; a depth handed out before rises with it; a path's
    /// reference to itself and a cycle change nothing more than one step.
    #[test]
    fn a_reference_is_below_each_referrer_found() {
        let depths = ClosureDepths::default();
        let (a, b, c, d) = (path('a'), path('b'), path('c'), path('d'));
        let held = depths.of(&c);
        // a -> {a, b, c}; b -> c; c -> d; d -> c (a cycle a cache claims).
        depths.found(&a, [&a, &b, &c]);
        assert_eq!([depth(&depths, 'a'), depth(&depths, 'b'), depth(&depths, 'c')], [0, 1, 1]);
        depths.found(&b, [&c]);
        assert_eq!(held.load(Ordering::Relaxed), 2, "the longer way a -> b -> c counts");
        depths.found(&c, [&d]);
        depths.found(&d, [&c]);
        assert_eq!([depth(&depths, 'c'), depth(&depths, 'd')], [4, 3]);
        assert_eq!(depth(&depths, 'a'), 0);
    }
}
