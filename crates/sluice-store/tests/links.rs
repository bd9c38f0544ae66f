//! `.links`, the store's hard-link targets: optimising never makes an intact file share the
//! inode of an entry whose contents no longer match its name (a disk fault, a write through
//! another link: NixOS/nix#3230), which Nix 2.8 and 2.26 do.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use sluice_local_store::OptimiseEvent;
use sluice_nix::store_path::StorePath;

use crate::local_store::{add, deep_nar, dump, honest_info, open_store, Scratch};

/// The entry that path A's `f` became is damaged at the same size; optimising path B, whose
/// `f` has A's original bytes, replaces the entry by B's file, with Nix's warning, and B
/// still dumps as its NAR.
#[test]
fn optimise_never_links_to_a_damaged_links_entry() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let nar = deep_nar(&tmp.path().join("tree"), 0, 1);
    let [a, b] = ["0000000000000000000000000000000a-links", "0000000000000000000000000000000b-links"];
    let optimise = |warnings: &mut Vec<String>| {
        store
            .optimise_store(&store.temp_roots(), &mut |event| {
                if let OptimiseEvent::Warning(w) = event {
                    warnings.push(w.to_owned());
                }
            })
            .unwrap()
    };
    assert!(add(&store, &honest_info(a, &nar), &mut nar.as_slice()).unwrap());
    optimise(&mut Vec::new());
    let a_f = root.join("nix/store").join(a).join("f");
    let links = root.join("nix/store/.links");
    let entry = std::fs::read_dir(&links)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.symlink_metadata().unwrap().ino() == a_f.metadata().unwrap().ino())
        .unwrap();
    std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&entry, b"tap\n").unwrap();
    std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o444)).unwrap();
    assert!(add(&store, &honest_info(b, &nar), &mut nar.as_slice()).unwrap());
    let mut warnings = Vec::new();
    optimise(&mut warnings);
    assert_eq!(
        warnings.first().map(String::as_str),
        Some(format!("removing corrupted link '{}'", entry.display()).as_str()),
        "{warnings:?}"
    );
    assert!(dump(&store, &StorePath::from_base_name(b).unwrap()) == nar, "b's files were linked to the damaged entry");
    let b_f = root.join("nix/store").join(b).join("f");
    assert_eq!(std::fs::read(&entry).unwrap(), b"top\n", "the entry is b's intact file now");
    assert_eq!(entry.metadata().unwrap().ino(), b_f.metadata().unwrap().ino());
}

/// A `.links` entry that is a directory (with a file in it) where a file's hash names one is
/// removed as a damaged entry and replaced by the file: it ended the whole `--optimise` run for
/// everyone with "Is a directory".
#[test]
fn a_directory_in_place_of_a_links_entry_is_replaced() {
    let tmp = Scratch::new();
    let root = tmp.path().join("root");
    let store = open_store(&root);
    let nar = deep_nar(&tmp.path().join("tree"), 0, 1);
    let [a, b] = ["0000000000000000000000000000000a-links", "0000000000000000000000000000000b-links"];
    let optimise = || store.optimise_store(&store.temp_roots(), &mut |_| {}).unwrap();
    assert!(add(&store, &honest_info(a, &nar), &mut nar.as_slice()).unwrap());
    optimise();
    let a_f = root.join("nix/store").join(a).join("f");
    let entry = std::fs::read_dir(root.join("nix/store/.links"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.symlink_metadata().unwrap().ino() == a_f.metadata().unwrap().ino())
        .unwrap();
    std::fs::remove_file(&entry).unwrap();
    std::fs::create_dir(&entry).unwrap();
    std::fs::write(entry.join("inside"), b"x").unwrap();
    assert!(add(&store, &honest_info(b, &nar), &mut nar.as_slice()).unwrap());
    optimise();
    let b_f = root.join("nix/store").join(b).join("f");
    assert_eq!(entry.symlink_metadata().unwrap().ino(), b_f.metadata().unwrap().ino(), "the entry is b's file now");
    assert!(dump(&store, &StorePath::from_base_name(b).unwrap()) == nar);
}
