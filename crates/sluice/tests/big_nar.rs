//! Streaming with bounded memory: a 1 GiB NAR made by real Nix (`nix-store --add` of a
//! generated file, `nix copy` into a zstd `file://` cache) is substituted by `sluice copy`
//! with a peak RSS far below the NAR's size, and real Nix verifies the result; pushed into a
//! `file://` cache with xz and zstd, with and without `parallel-compression`, under 150 MiB.

use std::io::Write;

use crate::common::*;

/// Bytes of the generated file (the NAR is 120 bytes longer).
const SIZE: usize = 1 << 30;
/// The peak RSS the copy must stay under, in KiB.
const MAX_RSS_KIB: u64 = 100 * 1024;
/// The peak RSS a push must stay under, in KiB (the encoders' budget is 120 MiB).
const MAX_PUSH_RSS_KIB: u64 = 150 * 1024;

/// Adds a generated 1 GiB file to the chroot store `src` with real Nix; its store path.
fn add_big_file(tmp: &std::path::Path, src: &std::path::Path) -> String {
    let file = tmp.join("big-blob");
    {
        // Not all zeros, so the compressor and the decompressor do real work.
        let mut f = std::io::BufWriter::new(std::fs::File::create(&file).unwrap());
        let mut block = vec![0u8; 1 << 20];
        for i in 0..SIZE / block.len() {
            for (j, b) in block.iter_mut().enumerate().step_by(4096) {
                *b = (i + j) as u8;
            }
            f.write_all(&block).unwrap();
        }
    }
    let out = nix(tmp, "nix-store", &["--store", src.to_str().unwrap(), "--add", file.to_str().unwrap()]);
    check(&out, "nix-store --add");
    std::fs::remove_file(&file).unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn one_gib_nar_streams_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let path = add_big_file(tmp.path(), &src);
    let cache = format!("file://{}?compression=zstd", tmp.path().join("cache").display());
    check(&nix(tmp.path(), "nix", &["copy", "--from", src.to_str().unwrap(), "--to", &cache, &path]), "nix copy to the cache");
    std::fs::remove_dir_all(&src).ok();

    let dest = tmp.path().join("dest");
    let rss = tmp.path().join("rss");
    let mut cmd = sluice_measured(tmp.path(), &rss);
    let cache_url = format!("file://{}", tmp.path().join("cache").display());
    cmd.args(["copy", "--from", &cache_url, "--to", dest.to_str().unwrap(), "--no-check-sigs", &path]);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "sluice copy of the 1 GiB NAR failed: {}", stderr(&o));
    let rss_kib = measured_rss(&rss);
    eprintln!("sluice copy of a 1 GiB NAR: peak RSS {} MiB", rss_kib / 1024);
    assert!(rss_kib < MAX_RSS_KIB, "peak RSS {rss_kib} KiB for a 1 GiB NAR (limit {MAX_RSS_KIB} KiB)");
    assert_nix_verifies(tmp.path(), &dest);
    let len = std::fs::metadata(dest.join("nix/store").join(path.trim_start_matches("/nix/store/"))).unwrap().len();
    assert_eq!(len, SIZE as u64);
}

#[test]
fn one_gib_nar_is_pushed_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let path = add_big_file(tmp.path(), &src);
    for compression in ["zstd", "xz"] {
        for parallel in [false, true] {
            let cache = tmp.path().join(format!("cache-{compression}-{parallel}"));
            let rss = tmp.path().join("rss");
            let mut cmd = sluice_measured(tmp.path(), &rss);
            let url = format!("file://{}?compression={compression}&parallel-compression={parallel}", cache.display());
            cmd.args(["copy", "--from", src.to_str().unwrap(), "--to", &url, &path]);
            let o = cmd.output().unwrap();
            assert!(o.status.success(), "sluice push of the 1 GiB NAR with {compression}, parallel {parallel} failed: {}", stderr(&o));
            let rss_kib = measured_rss(&rss);
            eprintln!("sluice push of a 1 GiB NAR, {compression}, parallel-compression={parallel}: peak RSS {} MiB", rss_kib / 1024);
            assert!(
                rss_kib < MAX_PUSH_RSS_KIB,
                "{compression}, parallel {parallel}: peak RSS {rss_kib} KiB (limit {MAX_PUSH_RSS_KIB} KiB)"
            );
            let nars: Vec<_> =
                std::fs::read_dir(cache.join("nar")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            let ext = if compression == "xz" { ".nar.xz" } else { ".nar.zst" };
            assert!(nars.len() == 1 && nars[0].ends_with(ext), "{nars:?}");
            std::fs::remove_dir_all(&cache).unwrap();
        }
    }
}
