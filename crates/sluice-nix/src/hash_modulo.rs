//! Hashing modulo self-references (Nix's `HashModuloSink`, `src/libutil/references.cc`): every
//! occurrence of a path's hash part is hashed as zero bytes. Nix before 2.17 (2.8's
//! `src/libstore/references.cc`) also hashes the byte offsets of the occurrences after the
//! data, as `|<offset>` each; since 2.17 (commit 3ebe1341ab, whose `RewritingSink` no longer
//! records them) it hashes none. The content address of a path that refers to itself is this
//! hash of its NAR, so that the address does not depend on the path it names (Nix's
//! `LocalStore::addToStore` verifies content addresses with it), and [`ModuloHasher::finish`]
//! gives both forms.

use crate::hash::{Hash, HashAlgo, Hasher};

/// An incremental hash of data modulo `modulus` (a store path's hash part: 32 non-zero bytes).
pub struct ModuloHasher {
    hasher: Hasher,
    modulus: Vec<u8>,
    /// The last `modulus.len() - 1` bytes seen, held back until a match across the next
    /// chunk's boundary is ruled out.
    held: Vec<u8>,
    /// Bytes passed on to `hasher` so far.
    pos: u64,
    /// Offsets of the occurrences replaced.
    matches: Vec<u64>,
}

impl ModuloHasher {
    /// A hasher with `algo` that zeroes occurrences of `modulus` (non-empty, without zero
    /// bytes, as a hash part is).
    pub fn new(algo: HashAlgo, modulus: &[u8]) -> Self {
        ModuloHasher { hasher: Hasher::new(algo), modulus: modulus.to_vec(), held: Vec::new(), pos: 0, matches: Vec::new() }
    }

    /// Feeds bytes.
    pub fn update(&mut self, data: &[u8]) {
        let m = self.modulus.len();
        let mut s = std::mem::take(&mut self.held);
        s.extend_from_slice(data);
        let mut from = 0;
        while let Some(k) = find(&s[from..], &self.modulus) {
            let at = from + k;
            self.matches.push(self.pos + at as u64);
            s[at..at + m].fill(0);
            from = at + m;
        }
        let keep = if s.len() < m { s.len() } else { m - 1 };
        let consumed = s.len() - keep;
        self.hasher.update(&s[..consumed]);
        self.pos += consumed as u64;
        self.held = s.split_off(consumed);
    }

    /// The hash of everything fed modulo the occurrences of the modulus, as Nix since 2.17
    /// and before it computes it.
    pub fn finish(mut self) -> ModuloHash {
        let held = std::mem::take(&mut self.held);
        self.hasher.update(&held);
        let mut with_offsets = self.hasher.clone();
        for at in &self.matches {
            with_offsets.update(format!("|{at}").as_bytes());
        }
        ModuloHash { hash: self.hasher.finish(), with_offsets: with_offsets.finish() }
    }
}

/// A hash modulo self-references in the two forms Nix has used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuloHash {
    /// Nix 2.17 and later: the data with the occurrences zeroed.
    pub hash: Hash,
    /// Nix before 2.17: then the occurrences' offsets, `|<offset>` each (the same as `hash`
    /// when there is none).
    pub with_offsets: Hash,
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_occurrences_it_is_the_plain_hash() {
        let mut h = ModuloHasher::new(HashAlgo::Sha256, b"abc");
        h.update(b"hello ");
        h.update(b"world");
        let plain = Hash::digest_bytes(HashAlgo::Sha256, b"hello world");
        assert_eq!(h.finish(), ModuloHash { hash: plain.clone(), with_offsets: plain });
    }

    #[test]
    fn occurrences_are_zeroed_and_their_offsets_hashed_before_2_17_whatever_the_chunking() {
        let data = b"xxabcyyabcab";
        let expected = ModuloHash {
            hash: Hash::digest_bytes(HashAlgo::Sha256, b"xx\0\0\0yy\0\0\0ab"),
            with_offsets: Hash::digest_bytes(HashAlgo::Sha256, b"xx\0\0\0yy\0\0\0ab|2|7"),
        };
        for split in 0..=data.len() {
            for split2 in split..=data.len() {
                let mut h = ModuloHasher::new(HashAlgo::Sha256, b"abc");
                h.update(&data[..split]);
                h.update(&data[split..split2]);
                h.update(&data[split2..]);
                assert_eq!(h.finish(), expected, "split at {split}, {split2}");
            }
        }
    }
}
