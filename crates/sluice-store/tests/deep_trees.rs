//! Walks over store trees as deep as the store accepts (about 2,000 levels within `PATH_MAX`):
//! each keeps its own stack, so that adding, optimising, verifying and collecting such a tree
//! runs on a thread with a small stack. A recursive walk overflowed a daemon worker's stack,
//! which aborts the whole daemon, whatever its other clients were doing.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use sluice_local_store::{GcAction, GcOptions, LocalStore, OptimiseEvent};
use sluice_nix::store_path::StorePath;

use crate::local_store::{add, deep_nar, deepest_below, dump, honest_info, open_store, verify_with_nix, Scratch};

/// A stack much smaller than a thread's default: the recursive walks needed about 1 KiB a level.
const SMALL_STACK: usize = 512 << 10;

/// Runs `f` on a thread with [`SMALL_STACK`].
fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new().stack_size(SMALL_STACK).spawn(f).unwrap().join().unwrap()
}

fn optimise(store: &LocalStore) -> (u64, Vec<String>) {
    let mut warnings = Vec::new();
    let stats = store
        .optimise_store(&store.temp_roots(), &mut |event| {
            if let OptimiseEvent::Warning(w) = event {
                warnings.push(w.to_owned());
            }
        })
        .unwrap();
    (stats.files_linked, warnings)
}

/// Two paths with the same deepest tree are added, optimised (the second's four files and
/// symlink linked to the first's, the executable and the plain file with the same bytes never
/// to each other), verified by sluice and by Nix 2.8, and collected, all on a small stack.
#[test]
fn every_walk_over_the_deepest_tree_runs_on_a_small_stack() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let bases = ["0000000000000000000000000000d1ip-deep", "0000000000000000000000000000d1iq-deep"];
    let below = bases.iter().map(|b| deepest_below(&store, &StorePath::from_base_name(b).unwrap())).min().unwrap();
    let levels = (below - 100) / 2;
    let nar = Arc::new(deep_nar(&tmp.path().join("tree"), levels, below - 2 * levels));
    for base in bases {
        let (store, nar) = (store.clone(), nar.clone());
        assert!(on_small_stack(move || add(&store, &honest_info(base, &nar), &mut nar.as_slice()).unwrap()));
    }
    let (linked, warnings) = on_small_stack({
        let store = store.clone();
        move || optimise(&store)
    });
    assert_eq!((linked, warnings), (4, vec![]), "the second path's f, x, s and bottom file, each linked once");
    let [first, second] = bases.map(|b| root.join("nix/store").join(b));
    for name in ["f", "x", "s"] {
        assert_eq!(first.join(name).symlink_metadata().unwrap().ino(), second.join(name).symlink_metadata().unwrap().ino(), "{name}");
    }
    assert_ne!(
        first.join("f").metadata().unwrap().ino(),
        first.join("x").metadata().unwrap().ino(),
        "an executable linked to a plain file"
    );
    for base in bases {
        assert!(dump(&store, &StorePath::from_base_name(base).unwrap()) == *nar, "{base} dumps otherwise after optimising");
    }
    let errors_remain = on_small_stack({
        let store = store.clone();
        move || store.verify_store(true, None, &mut |_| {}).unwrap()
    });
    assert!(!errors_remain, "sluice's verify found the optimised store damaged");
    verify_with_nix(&root, tmp.path());
    let results = on_small_stack({
        let store = store.clone();
        move || {
            store
                .collect_garbage(
                    &GcOptions {
                        action: GcAction::DeleteDead,
                        paths_to_delete: Default::default(),
                        max_freed: u64::MAX,
                        keep_outputs: false,
                        keep_derivations: true,
                    },
                    &mut |_| {},
                )
                .unwrap()
        }
    });
    for base in bases {
        assert!(results.paths.contains(&format!("/nix/store/{base}")), "{base} not collected: {:?}", results.paths);
        assert!(!root.join("nix/store").join(base).exists(), "{base} is still there");
    }
}

/// A user's `gcroots/per-user` directory nested as deep as `PATH_MAX` allows, with a root at the
/// bottom: finding the roots (every GC, and `--gc --print-roots` as any user through the
/// daemon) keeps its own stack and finds that root. Beside it, the user's tree nested past what
/// a path can name, and a symlink loop, are skipped: they stopped every collection ("File name
/// too long"), as they stop Nix's.
#[test]
fn roots_below_the_deepest_gcroots_tree_are_found_on_a_small_stack() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let nar = deep_nar(&tmp.path().join("tree"), 1, 1);
    let base = "0000000000000000000000000000d1ir-rooted";
    assert!(add(&store, &honest_info(base, &nar), &mut nar.as_slice()).unwrap());
    let user_dir = root.join("nix/var/nix/gcroots/per-user/nobody");
    std::fs::create_dir_all(&user_dir).unwrap();
    let levels = (4096 - 2 - user_dir.as_os_str().len() - "/root".len()) / 2;
    let mut link = user_dir;
    for _ in 0..levels {
        link.push("d");
    }
    std::fs::create_dir_all(&link).unwrap();
    link.push("root");
    std::os::unix::fs::symlink(format!("/nix/store/{base}"), &link).unwrap();
    let user_dir = root.join("nix/var/nix/gcroots/per-user/nobody");
    let mut dir = rustix::fs::open(&user_dir, rustix::fs::OFlags::DIRECTORY, rustix::fs::Mode::empty()).unwrap();
    for _ in 0..2100 {
        rustix::fs::mkdirat(&dir, "e", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
        dir = rustix::fs::openat(&dir, "e", rustix::fs::OFlags::DIRECTORY, rustix::fs::Mode::empty()).unwrap();
    }
    std::os::unix::fs::symlink("loop", user_dir.join("loop")).unwrap();
    let roots = on_small_stack(move || store.find_roots(false).unwrap());
    let path = StorePath::from_base_name(base).unwrap();
    assert_eq!(roots.get(&path).map(|links| links.iter().cloned().collect::<Vec<_>>()), Some(vec![link.display().to_string()]));
}
