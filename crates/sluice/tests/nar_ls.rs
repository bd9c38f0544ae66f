//! `sluice nar ls` prints what real Nix 2.26's `nix nar ls`
//! prints for the same NAR, byte for byte, below the root as at it, and with `--as-nix 2.8`
//! what Nix 2.8's prints; a path either refuses gets the same refusal.

use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use crate::common::*;

/// A NAR (by Nix 2.8's `nix-store --dump`) of a tree with nested directories, an executable,
/// a symlink and an empty directory; and one of a lone file.
fn nars(t: &Path) -> [String; 2] {
    let tree = t.join("tree");
    std::fs::create_dir_all(tree.join("share/doc/hello")).unwrap();
    std::fs::create_dir_all(tree.join("bin")).unwrap();
    std::fs::create_dir_all(tree.join("empty")).unwrap();
    std::fs::write(tree.join("bin/hello"), "#!/bin/sh\necho hello\n").unwrap();
    std::fs::set_permissions(tree.join("bin/hello"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(tree.join("share/doc/hello/README"), "read me\n".repeat(100)).unwrap();
    symlink("../bin/hello", tree.join("share/hi")).unwrap();
    let mut out = Vec::new();
    for (name, src) in [("tree.nar", tree.clone()), ("file.nar", tree.join("bin/hello"))] {
        let dumped = nix(t, "nix-store", &["--dump", src.to_str().unwrap()]);
        check(&dumped, "nix-store --dump");
        std::fs::write(t.join(name), &dumped.stdout).unwrap();
        out.push(t.join(name).to_str().unwrap().to_owned());
    }
    out.try_into().unwrap()
}

#[test]
fn listings_and_path_spellings_as_nix_2_26_and_2_8() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    let [tree, file] = nars(t);
    let paths = [
        "/",
        "",
        "/share",
        "share",
        "/share/",
        "//share",
        "/bin/../share",
        "./share/doc",
        "/share/doc/hello/README",
        "/share/hi",
        "/bin/hello/x",
        "/missing",
        "/..",
        "/empty",
    ];
    let flags: [&[&str]; 8] = [&[], &["-l"], &["-R"], &["-d"], &["-lR"], &["--json"], &["--json", "-R"], &["--json", "-d"]];
    let mut compared = 0;
    for (nar, path) in paths.iter().map(|p| (&tree, *p)).chain([(&file, "/"), (&file, "/x")]) {
        for f in flags {
            let args = [&["nar", "ls"][..], f, &[nar.as_str(), path]].concat();
            for (version, real) in [("2.26", nix_modern(t, &[&["nix"][..], &args].concat())), ("2.8", nix(t, "nix", &args))] {
                let own = sluice(t, &[&args[..2], &["--as-nix", version], &args[2..]].concat());
                let what = format!("Nix {version}: nar ls {f:?} {path:?}");
                assert_eq!(String::from_utf8_lossy(&own.stdout), String::from_utf8_lossy(&real.stdout), "{what}");
                assert_eq!(own.status.code(), real.status.code(), "{what}: {}", stderr(&own));
                if !real.status.success() {
                    let why = stderr(&real).lines().next().unwrap_or_default().to_owned();
                    assert!(
                        stderr(&own).contains(why.trim_start_matches("error: ")),
                        "{what}: Nix says {why:?}, sluice {:?}",
                        stderr(&own)
                    );
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 16 * 8 * 2);
}

/// `sluice nar cat` prints a file of a NAR as Nix 2.26's and 2.8's `nix nar cat` do, byte for
/// byte, and refuses a directory, a symlink and a missing path as they do.
#[test]
fn cat_as_nix_2_26_and_2_8() {
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    let [tree, file] = nars(t);
    let mut compared = 0;
    for (nar, path) in [
        (&tree, "/bin/hello"),
        (&tree, "/share/doc/hello/README"),
        (&tree, "/share"),
        (&tree, "/share/hi"),
        (&tree, "/missing"),
        (&file, "/"),
    ] {
        let args = ["nar", "cat", nar.as_str(), path];
        for (version, real) in [("2.26", nix_modern(t, &[&["nix"][..], &args].concat())), ("2.8", nix(t, "nix", &args))] {
            let own = sluice(t, &[&args[..2], &["--as-nix", version], &args[2..]].concat());
            let what = format!("Nix {version}: nar cat {path:?}");
            assert!(
                own.stdout == real.stdout,
                "{what}: {:?} against {:?}",
                String::from_utf8_lossy(&own.stdout),
                String::from_utf8_lossy(&real.stdout)
            );
            assert_eq!(own.status.code(), real.status.code(), "{what}: {}", stderr(&own));
            if !real.status.success() {
                let why = stderr(&real).lines().find(|l| l.starts_with("error: ")).unwrap_or_default().to_owned();
                assert!(stderr(&own).contains(why.trim_start_matches("error: ")), "{what}: Nix says {why:?}, sluice {:?}", stderr(&own));
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 12);
}
