//! Issue 12, "command line and output": `path-info` prints what real Nix 2.8's `nix path-info`
//! prints for the same store, byte for byte.

mod common;

use common::*;

/// `-S` without `-r` is the closure size of each path asked for (its closure walked, only it
/// printed), in text and in `--json`'s `closureSize`; `--json` lists a path that is not valid
/// as `{"path": …, "valid": false}` in path order and exits 0, as Nix 2.8 does.
#[test]
fn closure_size_without_recursion_and_invalid_paths_as_nix_2_8() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let root = t.join("root");
    let bash = corpus_path("bash-5.2-p15");
    let from = format!("file://{}", corpus().join("cache-xz").display());
    check(&copy_with(t, &root, &from, &corpus_key(), &[], &[&bash]), "sluice copy");
    let store = root.to_str().unwrap();
    let invalid = "/nix/store/00000000000000000000000000000000-x";
    let runs: [&[&str]; 4] = [&["-S", &bash], &["-s", "-S", &bash], &["--json", "-S", &bash, invalid], &["--json", &bash, invalid]];
    for args in runs {
        let nix_out = nix(t, "nix", &[&["path-info", "--store", store][..], args].concat());
        let sluice_out = sluice(t, &[&["path-info", "--store", store][..], args].concat());
        assert_eq!(String::from_utf8_lossy(&sluice_out.stdout), String::from_utf8_lossy(&nix_out.stdout), "{args:?}");
        assert_eq!(sluice_out.status.code(), nix_out.status.code(), "{args:?}: {}", stderr(&sluice_out));
    }
}
