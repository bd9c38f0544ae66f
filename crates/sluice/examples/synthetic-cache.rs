//! Writes a synthetic signed binary cache of N narinfos (no NARs) for closure-query
//! benchmarks: a layered DAG of depth D whose top path references level 1, every path of
//! level k is referenced from level k-1, and each path also references up to 4 random paths of
//! deeper levels. Prints the top-level path.
//!
//!   cargo run --release --example synthetic-cache -- OUT_DIR N DEPTH SECRET_KEY_FILE
// A measurement tool, not library code: it stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::unreachable)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::narinfo::NarInfo;
use sluice_nix::signature::SecretKey;
use sluice_nix::store_path::{StoreDir, StorePath};

/// A small deterministic generator (splitmix64), so that runs are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let [_, out, n, depth, key] = args.as_slice() else {
        return Err("usage: synthetic-cache OUT_DIR N DEPTH SECRET_KEY_FILE".into());
    };
    let out = PathBuf::from(out);
    let n: usize = n.parse().map_err(|_| "N must be a number")?;
    let depth: usize = depth.parse().map_err(|_| "DEPTH must be a number")?;
    let key_text = std::fs::read_to_string(key).map_err(|e| format!("{key}: {e}"))?;
    let key = SecretKey::parse(key_text.trim()).map_err(|e| e.to_string())?;
    let store_dir = StoreDir::default();
    let mut rng = Rng(n as u64 * 7919 + depth as u64);
    // Level sizes: 1 top path, the rest spread evenly over levels 1..=depth.
    let mut level_of = vec![0usize];
    for i in 1..n {
        level_of.push(1 + (i - 1) * depth / (n - 1).max(1));
    }
    let paths: Vec<StorePath> = (0..n)
        .map(|i| {
            let mut digest = [0u8; 20];
            for chunk in digest.chunks_mut(8) {
                let bytes = rng.next().to_le_bytes();
                chunk.copy_from_slice(&bytes[..chunk.len()]);
            }
            StorePath::from_digest(&digest, &format!("synthetic-{i}")).map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let first_of_level = |l: usize| level_of.iter().position(|&x| x == l);
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    std::fs::write(out.join("nix-cache-info"), "StoreDir: /nix/store\nWantMassQuery: 1\nPriority: 40\n").map_err(|e| e.to_string())?;
    for i in 0..n {
        let level = level_of[i];
        let mut refs = BTreeSet::new();
        // Every path of the next level gets one parent: the path at the same relative position.
        if let (Some(start), Some(next_start)) = (first_of_level(level), first_of_level(level + 1)) {
            let next_end = first_of_level(level + 2).unwrap_or(n);
            let width = first_of_level(level + 1).unwrap_or(n) - start;
            for (j, p) in paths.iter().enumerate().take(next_end).skip(next_start) {
                if (j - next_start) % width == i - start {
                    refs.insert(p.clone());
                }
            }
            for _ in 0..rng.below(5) {
                refs.insert(paths[next_start + rng.below(n - next_start)].clone());
            }
        }
        let nar_hash = Hash::digest_bytes(HashAlgo::Sha256, paths[i].base_name().as_bytes());
        let file_hash = Hash::digest_bytes(HashAlgo::Sha256, nar_hash.digest());
        let mut info = NarInfo {
            store_path: paths[i].clone(),
            url: format!("nar/{}.nar.xz", file_hash.to_nix32()),
            compression: "xz".into(),
            file_hash: Some(file_hash),
            file_size: Some(1000 + rng.below(9000) as u64),
            nar_hash,
            nar_size: 4000 + rng.below(40000) as u64,
            references: refs.into_iter().collect(),
            deriver: None,
            signatures: Vec::new(),
            ca: None,
            system: None,
        };
        info.signatures.push(key.sign(&info.fingerprint(&store_dir)));
        std::fs::write(out.join(format!("{}.narinfo", paths[i].hash_part())), info.to_text(&store_dir)).map_err(|e| e.to_string())?;
    }
    println!("{}", store_dir.display_path(&paths[0]));
    Ok(())
}
