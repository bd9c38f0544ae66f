//! The CPU that Nix's binary-cache format itself demands to substitute a closure, on one core
//! and without creating a file: the lower bound of a copy. Whatever a client does about files,
//! locks and its database, it must parse each narinfo, check one signature per path, decompress
//! each NAR, hash it and parse it; this measures that part, so that a bound for `sluice copy`
//! on a 2-core machine is (stage 6) / 2 of CPU on top of the files' own system calls.
//!
//!   cargo run --release -p sluice-store --example format_cost -- CACHE_DIR KEY_FILE
//!
//! CACHE_DIR is a `file://` binary cache (every `*.narinfo` in it is one path), KEY_FILE the
//! trusted public key. Every narinfo and every NAR file is read into memory first, and each NAR
//! decompressed once for stages 4 and 5: no file read is timed. Each stage then runs over every
//! path, 5 times, on this one thread, through the functions `sluice copy` uses per path:
//!
//! 1. narinfo parse: `NarInfo::parse`, and the check that it is the path asked for (as
//!    `BinaryCache::parse_narinfo`);
//! 2. signature: `ValidPathInfo::from_narinfo` and `SignaturePolicy::vouch_all` over batches of
//!    64 paths (the fingerprints and one batch equation of ed25519), as the substitution vouches
//!    for the paths found at once (`substitute.rs`, `vouch_found`);
//! 3. decompression: `Compression::decoder_sized` read through a buffer of `read_buffer`'s
//!    size, into nothing (the bytes are counted);
//! 4. the NAR's sha256 (`Hasher`), over the whole NAR at once;
//! 5. NAR parse: `nar::reader::parse` with the `Discard` visitor (the unpacker minus its files);
//! 6. the sum of the medians of 2–5: the work per path that the format mandates beyond reading
//!    bytes and writing files (the narinfos' text, stage 1, is shown apart).
//!
//! Printed: the median thread CPU time (`CLOCK_THREAD_CPUTIME_ID`) and wall time per stage, as
//! a markdown table. Exits non-zero if a signature does not verify, a NAR does not have its
//! narinfo's NarSize and NarHash, or another thread spent CPU during a stage (zstd written as
//! frames with content sizes is decoded with helper threads, `compression/zstd_frames.rs`: the
//! figures would not be one core's).
// A measurement tool, not library code: it stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

use common::cpu_time;

use sluice_compress::{read_buffer, Compression};
use sluice_local_store::SignaturePolicy;
use sluice_nix::hash::{HashAlgo, Hasher};
use sluice_nix::nar::{reader::parse, Discard};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::StoreDir;

/// `sluice`'s allocator (`crates/sluice/src/main.rs`), so that allocations cost what they do
/// in `sluice copy`.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Runs of each stage; the median is printed.
const RUNS: usize = 5;
/// Paths vouched for together, as `substitute.rs` does at most (`VOUCH_BATCH`).
const VOUCH_BATCH: usize = 64;

/// One path of the cache, in memory.
struct Path {
    /// The narinfo's file name without `.narinfo`: the store path's hash part.
    hash_part: String,
    text: String,
    narinfo: NarInfo,
    compression: Compression,
    /// The NAR file's bytes.
    compressed: Vec<u8>,
    /// The NAR, decompressed.
    nar: Vec<u8>,
}

/// Reads the cache's narinfos, sorted by name, and their NAR files.
fn load(dir: &std::path::Path, store_dir: &StoreDir) -> Result<Vec<Path>, String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".narinfo"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let text = std::fs::read_to_string(dir.join(&name)).map_err(|e| format!("{name}: {e}"))?;
            let narinfo = NarInfo::parse(store_dir, &text).map_err(|e| format!("{name}: {e}"))?;
            let compression = Compression::parse(&narinfo.compression).map_err(|e| format!("{name}: {e}"))?;
            let compressed = std::fs::read(dir.join(&narinfo.url)).map_err(|e| format!("{}: {e}", narinfo.url))?;
            let mut nar = Vec::new();
            compression
                .decoder_sized(&compressed[..], narinfo.file_size)
                .map_err(|e| format!("{}: {e}", narinfo.url))?
                .read_to_end(&mut nar)
                .map_err(|e| format!("{}: {e}", narinfo.url))?;
            let hash_part = name.trim_end_matches(".narinfo").to_owned();
            Ok(Path { hash_part, text, narinfo, compression, compressed, nar })
        })
        .collect()
}

/// Median thread CPU and wall time of a stage, in ms.
struct Times {
    cpu: f64,
    wall: f64,
}

fn median(mut ms: Vec<f64>) -> f64 {
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

/// Runs `stage` (over every path) [`RUNS`] times; fails if it fails or if another thread of
/// the process spent CPU meanwhile (more than 1 % of this thread's, plus 0.1 ms).
fn measure(name: &str, mut stage: impl FnMut() -> Result<(), String>) -> Result<Times, String> {
    let (mut cpu, mut wall) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let (thread0, process0, wall0) =
            (cpu_time(libc::CLOCK_THREAD_CPUTIME_ID), cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID), Instant::now());
        stage()?;
        let (elapsed, thread, process) =
            (wall0.elapsed(), cpu_time(libc::CLOCK_THREAD_CPUTIME_ID) - thread0, cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID) - process0);
        if process.saturating_sub(thread) > thread / 100 + Duration::from_micros(100) {
            return Err(format!(
                "{name}: other threads spent {:?} of CPU beside this one's {thread:?}: not one core's cost",
                process - thread
            ));
        }
        cpu.push(thread.as_secs_f64() * 1e3);
        wall.push(elapsed.as_secs_f64() * 1e3);
    }
    Ok(Times { cpu: median(cpu), wall: median(wall) })
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, cache, key] = args.as_slice() else {
        return Err("usage: format_cost CACHE_DIR KEY_FILE".into());
    };
    let store_dir = StoreDir::default();
    let key = std::fs::read_to_string(key).map_err(|e| format!("{key}: {e}"))?;
    let policy = SignaturePolicy { require_sigs: true, trusted_keys: TrustedKeys::parse(key.trim()).map_err(|e| e.to_string())? };
    let paths = load(std::path::Path::new(cache), &store_dir)?;

    let parse_narinfos = measure("narinfo parse", || {
        for p in &paths {
            let narinfo = NarInfo::parse(&store_dir, &p.text).map_err(|e| format!("{}: {e}", p.hash_part))?;
            if narinfo.store_path.hash_part() != p.hash_part {
                return Err(format!("{}.narinfo is of {}", p.hash_part, store_dir.display_path(&narinfo.store_path)));
            }
        }
        Ok(())
    })?;
    let signatures = measure("signature", || {
        for batch in paths.chunks(VOUCH_BATCH) {
            let infos = batch.iter().map(|p| ValidPathInfo::from_narinfo(&p.narinfo, 0)).collect();
            let verdicts = policy.vouch_all(&store_dir, infos).ok_or("a signature does not verify")?;
            for (p, verdict) in batch.iter().zip(verdicts) {
                verdict.map_err(|e| format!("{}: {e}", p.hash_part))?;
            }
        }
        Ok(())
    })?;
    let decompression = measure("decompression", || {
        for p in &paths {
            let n = &p.narinfo;
            let decoder = p.compression.decoder_sized(&p.compressed[..], n.file_size).map_err(|e| format!("{}: {e}", n.url))?;
            let mut reader = BufReader::with_capacity(read_buffer(Some(n.nar_size)), decoder);
            let mut total = 0u64;
            loop {
                let len = reader.fill_buf().map_err(|e| format!("{}: {e}", n.url))?.len();
                if len == 0 {
                    break;
                }
                reader.consume(len);
                total += len as u64;
            }
            if total != n.nar_size {
                return Err(format!("{}: {total} bytes, NarSize is {}", n.url, n.nar_size));
            }
        }
        Ok(())
    })?;
    let hashing = measure("sha256", || {
        for p in &paths {
            let mut hasher = Hasher::new(HashAlgo::Sha256);
            hasher.update(&p.nar);
            let hash = hasher.finish();
            if hash != p.narinfo.nar_hash {
                return Err(format!(
                    "{}: NAR hash {}, NarHash is {}",
                    p.hash_part,
                    hash.to_nix32_prefixed(),
                    p.narinfo.nar_hash.to_nix32_prefixed()
                ));
            }
        }
        Ok(())
    })?;
    let nar_parse = measure("NAR parse", || {
        for p in &paths {
            let len = parse(&p.nar[..], &mut Discard).map_err(|e| format!("{}: {e}", p.hash_part))?;
            if len != p.narinfo.nar_size {
                return Err(format!("{}: a NAR of {len} bytes, NarSize is {}", p.hash_part, p.narinfo.nar_size));
            }
        }
        Ok(())
    })?;

    let mandated = [&signatures, &decompression, &hashing, &nar_parse];
    let total = Times { cpu: mandated.iter().map(|t| t.cpu).sum(), wall: mandated.iter().map(|t| t.wall).sum() };
    let n = paths.len();
    let (nar_bytes, file_bytes): (usize, usize) = paths.iter().fold((0, 0), |(a, b), p| (a + p.nar.len(), b + p.compressed.len()));
    println!(
        "{n} paths, NARs {:.1} MB ({:.1} MB compressed); one thread, median of {RUNS} runs\n",
        nar_bytes as f64 / 1e6,
        file_bytes as f64 / 1e6
    );
    println!("| stage | thread CPU ms | CPU µs/path | wall ms | wall µs/path |");
    println!("|---|---|---|---|---|");
    let stages = [
        ("1. narinfo parse", &parse_narinfos),
        ("2. signature (fingerprint + ed25519)", &signatures),
        ("3. decompression", &decompression),
        ("4. sha256 of the NAR", &hashing),
        ("5. NAR parse (no-op visitor)", &nar_parse),
        ("6. total of 2–5", &total),
    ];
    for (name, t) in stages {
        println!("| {name} | {:.2} | {:.1} | {:.2} | {:.1} |", t.cpu, t.cpu * 1e3 / n as f64, t.wall, t.wall * 1e3 / n as f64);
    }
    println!("\nOn 2 cores, the format alone takes at least {:.1} ms of wall (stage 6's CPU / 2).", total.cpu / 2.0);
    Ok(())
}
