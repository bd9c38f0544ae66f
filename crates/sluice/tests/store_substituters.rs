//! Local and daemon stores as substituters, as Nix takes any store as one (`substituters =
//! /mnt/store`, `local?root=/mnt`, `daemon`: `getDefaultSubstituters` in Nix's
//! `src/libstore/store-api.cc`): the corpus's 25-path subset, put into a chroot store by
//! `sluice copy` from the corpus cache, is copied from it into other chroot stores, each path's
//! own signature checked; real Nix 2.8 finds each result whole.

use crate::common::*;
use crate::daemon::{wait_for_socket, Env};
use crate::ssh::subset_store;

/// A key that signed none of the corpus's paths.
const OTHER_KEY: &str = "cache.nixos.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=";

/// `local?root=…`, the bare path, and `unix://…` of a `sluice daemon` over the store: each
/// substitutes the closure; with a key that signed none of its paths, nothing is added, unless
/// the URL says `?trusted=true`.
#[test]
fn local_and_daemon_stores_are_substituters() {
    let env = Env::new();
    let tmp = env.path("t");
    std::fs::create_dir_all(&tmp).unwrap();
    let (root, paths, src) = subset_store(&tmp);
    let socket = env.path("socket");
    let daemon = wait_for_socket(env.daemon_command(&socket, "t/src", "", "").spawn().unwrap(), &socket);
    let local = format!("local?root={}", src.display());
    for (i, url) in [local.clone(), src.display().to_string(), daemon.url.clone()].iter().enumerate() {
        let dest = tmp.join(format!("dest-{i}"));
        let o = copy_with(&tmp, &dest, url, &corpus_key(), &[], &[&root]);
        check(&o, &format!("copy with the substituter {url}"));
        assert_eq!(registered_paths(&dest), paths, "{url}");
        assert_nix_verifies(&tmp, &dest);
    }
    drop(daemon);
    let untrusting = tmp.join("untrusting");
    let o = copy_with(&tmp, &untrusting, &local, OTHER_KEY, &[], &[&root]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("signature"), "{}", stderr(&o));
    assert!(!registered_paths(&untrusting).contains(&root));
    let trusted = tmp.join("trusted");
    let o = copy_with(&tmp, &trusted, &format!("{local}&trusted=true"), OTHER_KEY, &[], &[&root]);
    check(&o, "copy with the substituter trusted by its URL");
    assert_eq!(registered_paths(&trusted), paths);
    assert_nix_verifies(&tmp, &trusted);
}

/// The destination store given as a substituter of its own (`local?root=X`) is left out with
/// a debug line naming it, as Nix finds nothing to substitute from a store into itself: the
/// closure comes from the cache beside it, and a second copy, of paths it has, does nothing.
#[test]
fn the_destination_as_its_own_substituter_is_left_out() {
    let env = Env::new();
    let tmp = env.path("t");
    std::fs::create_dir_all(&tmp).unwrap();
    let (root, paths) = crate::push::subset();
    let dest = tmp.join("dest");
    let own = format!("local?root={}", dest.display());
    let cache = format!("file://{}", corpus().join("cache-xz").display());
    for _ in 0..2 {
        let started = std::time::Instant::now();
        let o = copy_with(&tmp, &dest, &format!("{own} {cache}"), &corpus_key(), &[], &["-vv", &root]);
        check(&o, "copy with the destination as a substituter");
        assert!(started.elapsed() < std::time::Duration::from_secs(120), "{:?}", started.elapsed());
        assert!(stderr(&o).contains(&format!("substituter {own} left out: it is the store itself")), "{}", stderr(&o));
        assert_eq!(registered_paths(&dest), paths);
    }
    assert_nix_verifies(&tmp, &dest);
}
