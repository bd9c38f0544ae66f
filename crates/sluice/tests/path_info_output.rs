//! `path-info` prints what real Nix 2.26's `nix path-info`
//! prints for the same store, byte for byte, and with `--as-nix 2.8` what Nix 2.8's prints.

use std::collections::BTreeSet;
use std::path::Path;

use crate::common::*;

/// `--json` (an object keyed by path, `null` for a path that is not valid, `ca`, `deriver`,
/// `registrationTime`, `ultimate` and `signatures` always there, a cache's `url`,
/// `compression`, download fields and `closureDownloadSize`) and `-h` (`14.0 KiB`) are Nix
/// 2.26's by default, byte for byte, of a local store and of a binary cache.
#[test]
fn json_and_sizes_as_nix_2_26_by_default() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    let (root, bash, _) = bash_store(t);
    // A cache nix-modern can see (under /tmp), pushed from the store.
    let from = format!("file://{}", t.join("cache").display());
    check(
        &sluice(t, &["copy", "--from", root.to_str().unwrap(), "--to", &format!("{from}?compression=zstd"), &bash]),
        "sluice copy --to file://",
    );
    let invalid = "/nix/store/00000000000000000000000000000000-x";
    let runs: [&[&str]; 6] = [
        &["--json", &bash, invalid],
        &["--json", "-S", &bash],
        &["-r", "--json", "-S", &bash],
        &["-h", "-s", "-S", "-r", &bash],
        &["-h", "-s", &bash],
        &["--sigs", "-r", &bash],
    ];
    for store in [root.to_str().unwrap(), from.as_str()] {
        for args in runs {
            let nix_out = nix_modern(t, &[&["nix", "path-info", "--store", store][..], args].concat());
            let sluice_out = sluice(t, &[&["path-info", "--store", store][..], args].concat());
            assert_eq!(
                String::from_utf8_lossy(&sluice_out.stdout),
                String::from_utf8_lossy(&nix_out.stdout),
                "{store} {args:?}: {}",
                stderr(&nix_out)
            );
            assert_eq!(sluice_out.status.code(), nix_out.status.code(), "{store} {args:?}: {}", stderr(&sluice_out));
        }
    }
}

/// A store under `t` with bash's closure copied from the corpus's xz cache: (its root, bash's
/// path, the cache's URL).
fn bash_store(t: &Path) -> (std::path::PathBuf, String, String) {
    let root = t.join("root");
    let bash = corpus_path("bash-5.2-p15");
    let from = format!("file://{}", corpus().join("cache-xz").display());
    check(&copy_with(t, &root, &from, &corpus_key(), &[], &[&bash]), "sluice copy");
    (root, bash, from)
}

/// `-S` without `-r` is the closure size of each path asked for (its closure walked, only it
/// printed), in text and in `--json`'s `closureSize`; `--json` lists a path that is not valid
/// as `{"path": …, "valid": false}` in path order and exits 0, as Nix 2.8 does.
#[test]
fn closure_size_without_recursion_and_invalid_paths_with_as_nix_2_8() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (root, bash, _) = bash_store(t);
    let store = root.to_str().unwrap();
    let invalid = "/nix/store/00000000000000000000000000000000-x";
    let runs: [&[&str]; 4] = [&["-S", &bash], &["-s", "-S", &bash], &["--json", "-S", &bash, invalid], &["--json", &bash, invalid]];
    for args in runs {
        let nix_out = nix(t, "nix", &[&["path-info", "--store", store][..], args].concat());
        let sluice_out = sluice(t, &[&["path-info", "--as-nix", "2.8", "--store", store][..], args].concat());
        assert_eq!(String::from_utf8_lossy(&sluice_out.stdout), String::from_utf8_lossy(&nix_out.stdout), "{args:?}");
        assert_eq!(sluice_out.status.code(), nix_out.status.code(), "{args:?}: {}", stderr(&sluice_out));
    }
}

/// `-h` (`--human-readable`) and `--sigs`, alone and with `-s`/`-S`/`-r`, as Nix 2.8 prints
/// them, of a local store (with `ultimate` paths of its own: `nix-store --add` makes them
/// and a content address) and of the binary cache it was copied from.
#[test]
fn human_readable_sizes_and_signatures_with_as_nix_2_8() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (root, bash, from) = bash_store(t);
    let store = root.to_str().unwrap();
    let file = t.join("hello.txt");
    std::fs::write(&file, "hello\n").unwrap();
    let added = nix(t, "nix-store", &["--store", store, "--add", file.to_str().unwrap()]);
    check(&added, "nix-store --add");
    let added = String::from_utf8_lossy(&added.stdout).trim().to_string();
    let runs: [&[&str]; 5] = [
        &["-h", "-s", "-S", "-r", &bash],
        &["--human-readable", "-s", &bash],
        &["--sigs", &bash],
        &["-r", "-S", "-h", "--sigs", &bash],
        &["--sigs", "-s", "-h", &added],
    ];
    for store in [store, from.as_str()] {
        for args in runs.iter().filter(|a| store != from || !a.contains(&added.as_str())) {
            let nix_out = nix(t, "nix", &[&["path-info", "--store", store][..], args].concat());
            check(&nix_out, &format!("nix path-info {args:?}"));
            let sluice_out = sluice(t, &[&["path-info", "--as-nix", "2.8", "--store", store][..], args].concat());
            assert_eq!(String::from_utf8_lossy(&sluice_out.stdout), String::from_utf8_lossy(&nix_out.stdout), "{store} {args:?}");
        }
    }
}

/// `--all` (every valid path, in Nix's order), `--derivation` (a `.drv` itself, an output its
/// deriver when that is valid, else Nix's "does not have a known deriver" and status 1) and Nix
/// 2.26's `--stdin` print what Nix 2.26 and 2.8 print, of a store holding libidn2's closure,
/// its derivation's and a file added by `nix-store --add` (no deriver).
#[test]
fn all_stdin_and_derivation_as_nix() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    let root = t.join("root");
    // glibc refers to libidn2, which does not refer to it: not in the store.
    let (libidn2, glibc) = (corpus_path("libidn2-2.3.4"), corpus_path("glibc-2.37-8"));
    let drv = "/nix/store/lwdbwfnqd05c45mlvn9537salc088cyg-libidn2-2.3.4.drv";
    for (cache, path) in [("cache-subset-bzip2", libidn2.as_str()), ("cache-drv", drv)] {
        let from = format!("file://{}", corpus().join(cache).display());
        check(&copy_with(t, &root, &from, &corpus_key(), &[], &[path]), "sluice copy");
    }
    let store = root.to_str().unwrap();
    std::fs::write(t.join("added"), "no deriver\n").unwrap();
    let added = nix(t, "nix-store", &["--store", store, "--add", t.join("added").to_str().unwrap()]);
    check(&added, "nix-store --add");
    let added = String::from_utf8(added.stdout).unwrap().trim().to_owned();
    let runs: [&[&str]; 5] =
        [&["--all"], &["--derivation", &libidn2], &["--derivation", drv, "-r"], &["--derivation", &added], &["--derivation", &glibc]];
    let mut failed = 0;
    for args in runs {
        for (version, real) in [
            ("2.26", nix_modern(t, &[&["nix", "path-info", "--store", store][..], args].concat())),
            ("2.8", nix(t, "nix", &[&["path-info", "--store", store][..], args].concat())),
        ] {
            let own = sluice(t, &[&["path-info", "--as-nix", version, "--store", store][..], args].concat());
            let what = format!("Nix {version}: {args:?}");
            assert_eq!(String::from_utf8_lossy(&own.stdout), String::from_utf8_lossy(&real.stdout), "{what}: {}", stderr(&own));
            assert_eq!(own.status.code(), real.status.code(), "{what}: {}", stderr(&own));
            if !real.status.success() {
                failed += 1;
                let why = stderr(&real).lines().last().unwrap_or_default().to_owned();
                assert!(stderr(&own).contains(&why), "{what}: Nix says {why:?}, sluice {:?}", stderr(&own));
            }
        }
    }
    assert_eq!(failed, 4, "a path without a deriver, a path not in the store");
    let listed = sluice(t, &["path-info", "--store", store, "--all"]);
    assert!(String::from_utf8_lossy(&listed.stdout).lines().any(|l| l == drv));

    let piped = |program: &Path, args: &[&str]| {
        let mut cmd = std::process::Command::new(program);
        isolate(&mut cmd, t, "");
        let mut child =
            cmd.current_dir(t).args(args).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), format!("{libidn2}\n{drv} {added}\n").as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    };
    let real = piped(&shared().join("bin/nix-modern"), &["nix", "path-info", "--store", store, "--stdin", "-s"]);
    let own = piped(Path::new(env!("CARGO_BIN_EXE_sluice")), &["path-info", "--store", store, "--stdin", "-s"]);
    check(&real, "nix path-info --stdin");
    assert_eq!(String::from_utf8_lossy(&own.stdout), String::from_utf8_lossy(&real.stdout));
    assert_eq!(String::from_utf8_lossy(&own.stdout).lines().count(), 3);
}

/// `path-info --all` and `copy --all` of a `file://` cache take every path it has a narinfo
/// of, as Nix 2.8 and 2.26 list a directory cache's narinfos (`LocalBinaryCacheStore::
/// queryAllValidPaths`); sluice refused them as "listing every valid path is not supported".
#[test]
fn all_of_a_file_cache_is_its_narinfos_as_nix_lists_them() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    // Under /tmp, which Nix 2.26 (`nix-modern`) sees.
    copy_dir(&corpus().join("cache-subset-bzip2"), &t.join("cache"));
    let from = format!("file://{}", t.join("cache").display());
    let lines = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect::<BTreeSet<_>>();
    let own = sluice(t, &["path-info", "--store", &from, "--all"]);
    check(&own, "sluice path-info --all of a file:// cache");
    let listed = lines(&own);
    for real in [nix(t, "nix", &["path-info", "--store", &from, "--all"]), nix_modern(t, &["nix", "path-info", "--store", &from, "--all"])]
    {
        check(&real, "nix path-info --all of a file:// cache");
        assert_eq!(listed, lines(&real));
    }
    let narinfos = std::fs::read_dir(t.join("cache")).unwrap();
    assert_eq!(listed.len(), narinfos.filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".narinfo")).count());
    let root = t.join("root");
    let copied =
        sluice(t, &["copy", "--all", "--from", &from, "--to", root.to_str().unwrap(), "--option", "trusted-public-keys", &corpus_key()]);
    check(&copied, "sluice copy --all from a file:// cache");
    assert_eq!(lines(&sluice(t, &["path-info", "--store", root.to_str().unwrap(), "--all"])), listed);
}
