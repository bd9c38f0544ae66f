//! NARs compressed for decoding on several cores:
//! xz written by real Nix 2.26 with `parallel-compression=true` (many blocks), zstd written by
//! sluice's push as Nix 2.35 writes it (independent 16 MiB frames), and Nix 2.26's zstd (one
//! frame, streamed as before), each substituted by sluice and checked byte for byte and by
//! real Nix.

use std::path::Path;
use std::process::Command;

use crate::common::*;

/// A file of `mib` MiB, compressible like a binary (random runs between zero runs).
fn blob(path: &Path, mib: usize) {
    let mut state = 0x9e3779b97f4a7c15u64;
    let mut data = Vec::with_capacity(mib << 20);
    while data.len() < mib << 20 {
        for _ in 0..2048 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            data.extend_from_slice(&state.to_le_bytes());
        }
        data.resize(data.len() + 8192, 0);
    }
    data.truncate(mib << 20);
    std::fs::write(path, data).unwrap();
}

/// Real Nix 2.26 (`nix-modern`) running `args` under `tmp`.
fn modern(tmp: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(shared().join("bin/nix-modern"));
    isolate(&mut cmd, tmp, "");
    cmd.current_dir(tmp).args(args).output().unwrap()
}

/// The one NAR file of the cache at `cache`.
fn nar_file(cache: &Path) -> std::path::PathBuf {
    let mut nars: Vec<_> = std::fs::read_dir(cache.join("nar")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(nars.len(), 1, "{nars:?}");
    nars.pop().unwrap()
}

/// The number of zstd frames (`zstd -lv`) or xz blocks (`xz -lv --robot`) of `file`.
fn parts(file: &Path) -> usize {
    let zstd = file.extension().is_some_and(|e| e == "zst");
    let o = match zstd {
        true => Command::new("zstd").arg("-lv").arg(file).output().unwrap(),
        false => Command::new("xz").args(["-lv", "--robot"]).arg(file).output().unwrap(),
    };
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    match zstd {
        true => out.lines().find_map(|l| l.strip_prefix("# Zstandard Frames: ")).unwrap_or_else(|| panic!("{out}")).trim().parse().unwrap(),
        false => out.lines().filter(|l| l.starts_with("block\t")).count(),
    }
}

/// Substitutes `path` from `cache` into a fresh store and checks it against `original`, and
/// with `nix-store --verify --check-contents`.
fn substitute_and_compare(tmp: &Path, cache: &Path, path: &str, original: &Path, name: &str) {
    let root = tmp.join(format!("dest-{name}"));
    let url = format!("file://{}", cache.display());
    check(&copy_with(tmp, &root, &url, &corpus_key(), &[], &[path]), &format!("sluice copy from {name}"));
    let got = std::fs::read(root.join(&path[1..])).unwrap();
    assert!(got == std::fs::read(original).unwrap(), "{name}: the substituted file differs from the original");
    assert_nix_verifies(tmp, &root);
}

#[test]
fn multi_block_and_multi_frame_nars_decode_byte_for_byte() {
    // Under /tmp: nix-modern sees only /tmp of the host.
    let tmp = tempfile::tempdir_in("/tmp").unwrap();
    let t = tmp.path();
    let key = t.join("key.sec");
    std::fs::copy(corpus().join("keys/cache-key.sec"), &key).unwrap();
    let original = t.join("blob");
    blob(&original, 40);
    let src = t.join("src");
    let added = modern(t, &["nix-store", "--store", src.to_str().unwrap(), "--add", original.to_str().unwrap()]);
    check(&added, "nix-store --add (Nix 2.26)");
    let path = String::from_utf8(added.stdout).unwrap().trim().to_owned();

    // xz at level 0 (256 KiB dictionary): the multi-threaded encoder cuts many small blocks.
    for (name, params) in [
        ("xz-par", "compression=xz&parallel-compression=true&compression-level=0"),
        ("zstd-2.26", "compression=zstd&parallel-compression=true"),
    ] {
        let cache = t.join(name);
        let to = format!("file://{}?{params}&secret-key={}", cache.display(), key.display());
        check(
            &modern(t, &["nix", "copy", "--from", src.to_str().unwrap(), "--to", &to, &path]),
            &format!("nix copy --to {name} (Nix 2.26)"),
        );
    }
    assert!(parts(&nar_file(&t.join("xz-par"))) >= 10, "Nix 2.26 wrote few xz blocks");
    assert_eq!(parts(&nar_file(&t.join("zstd-2.26"))), 1, "Nix 2.26 writes zstd as one frame");

    // sluice's push writes zstd as Nix 2.35 does: 40 MiB are three frames.
    let pushed = t.join("zstd-frames");
    let local = t.join("local");
    check(&copy_with(t, &local, &format!("file://{}", t.join("xz-par").display()), &corpus_key(), &[], &[&path]), "filling a local store");
    let to = format!("file://{}?compression=zstd&secret-key={}", pushed.display(), key.display());
    check(&sluice(t, &["copy", "--from", local.to_str().unwrap(), "--to", &to, &path]), "push (zstd)");
    assert_eq!(parts(&nar_file(&pushed)), 3);

    for name in ["xz-par", "zstd-2.26", "zstd-frames"] {
        substitute_and_compare(t, &t.join(name), &path, &original, name);
    }
    // Real Nix 2.26 reads the frames sluice wrote.
    let nix_root = t.join("nix-from-frames");
    let from = format!("file://{}", pushed.display());
    let o = modern(
        t,
        &["nix", "copy", "--from", &from, "--to", nix_root.to_str().unwrap(), "--option", "trusted-public-keys", &corpus_key(), &path],
    );
    check(&o, "nix copy --from the frames sluice wrote (Nix 2.26)");
    assert!(std::fs::read(nix_root.join(&path[1..])).unwrap() == std::fs::read(&original).unwrap());
}
