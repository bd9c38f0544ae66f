//! Reference scanning: which store paths a NAR mentions, found by searching its bytes for the
//! 32-character hash parts of the paths it may refer to (Nix's `RefScanSink`,
//! `src/libstore/references.cc`). The search is streaming: a hash part cut by a chunk
//! boundary is found in the window made of the end of one chunk and the start of the next.

use std::collections::{BTreeMap, BTreeSet};

use sluice_nix::base32::ALPHABET;
use sluice_nix::store_path::StorePath;

/// Bytes of a hash part.
const HASH_LEN: usize = 32;

/// Whether `b` is a character of Nix's base-32 alphabet.
fn is_nix32(b: u8) -> bool {
    ALPHABET.contains(&b)
}

/// A streaming search for the hash parts of a set of candidate paths.
pub struct RefScanner {
    /// Candidates by hash part.
    candidates: BTreeMap<[u8; HASH_LEN], StorePath>,
    found: BTreeSet<[u8; HASH_LEN]>,
    /// The last bytes seen (fewer than [`HASH_LEN`]), for matches across chunks.
    tail: Vec<u8>,
}

impl RefScanner {
    /// A scanner for references to any of `candidates`.
    pub fn new<'a>(candidates: impl IntoIterator<Item = &'a StorePath>) -> Self {
        let candidates =
            candidates.into_iter().filter_map(|p| Some((<[u8; HASH_LEN]>::try_from(p.hash_part().as_bytes()).ok()?, p.clone()))).collect();
        RefScanner { candidates, found: BTreeSet::new(), tail: Vec::new() }
    }

    /// Scans the next bytes of the stream.
    pub fn update(&mut self, data: &[u8]) {
        if self.candidates.is_empty() {
            return;
        }
        // The end of the previous bytes with the start of these: a hash part across the two.
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(&data[..data.len().min(HASH_LEN - 1)]);
        self.search(&window);
        self.search(data);
        // Keep the last HASH_LEN - 1 bytes of the stream (`window` ends with all of `data`
        // when `data` is shorter than that).
        let last = if data.len() >= HASH_LEN - 1 { data } else { &window[..] };
        self.tail = last[last.len().saturating_sub(HASH_LEN - 1)..].to_vec();
    }

    /// Records every candidate hash part in `s`, skipping past any byte outside the alphabet.
    fn search(&mut self, s: &[u8]) {
        let mut i = 0;
        while i + HASH_LEN <= s.len() {
            if let Some(bad) = s[i..i + HASH_LEN].iter().rposition(|&b| !is_nix32(b)) {
                i += bad + 1;
                continue;
            }
            if let Ok(part) = <[u8; HASH_LEN]>::try_from(&s[i..i + HASH_LEN]) {
                if self.candidates.contains_key(&part) {
                    self.found.insert(part);
                }
            }
            i += 1;
        }
    }

    /// The candidates found so far.
    pub fn found(&self) -> BTreeSet<StorePath> {
        self.found.iter().filter_map(|h| self.candidates.get(h).cloned()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(s: &str) -> StorePath {
        StorePath::from_base_name(s).unwrap()
    }

    #[test]
    fn finds_hash_parts_across_every_chunk_boundary() {
        let a = path("1zhba591ddnyl66pbs4bdcmp3rd8nx09-glibc-2.37-8");
        let b = path("00fzg18l8dcbp13xcmh25xm61yazjh55-junnox-themes-8.40");
        let absent = path("02qflg6ykr2r2da18rn6z40nl6bm4hzy-geoip-data-2023");
        let text = format!("xx/nix/store/{}/lib\0-{}", a.base_name(), &b.base_name()[..40]);
        for chunk in 1..text.len() {
            let mut s = RefScanner::new([&a, &b, &absent]);
            for piece in text.as_bytes().chunks(chunk) {
                s.update(piece);
            }
            assert_eq!(s.found(), [a.clone(), b.clone()].into_iter().collect(), "chunks of {chunk}");
        }
        let mut s = RefScanner::new([&a]);
        s.update(&a.hash_part().as_bytes()[..31]);
        s.update(b"!");
        assert!(s.found().is_empty(), "31 characters are not a hash part");
    }
}
