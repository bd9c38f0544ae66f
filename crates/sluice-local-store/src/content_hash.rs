//! The content hash of a content-addressed path whose hash is not its NAR's sha256, computed
//! while its NAR is read (Nix's `addToStore` hashes the same bytes).

use std::io::{self, Read};

use sluice_nix::hash::{Hash, Hasher};
use sluice_nix::hash_modulo::ModuloHasher;

/// A content hash over the NAR ([`crate::verify::CaHashing::Nar`]).
pub(crate) enum ContentHasher {
    Plain(Hasher),
    Modulo(ModuloHasher),
}

impl ContentHasher {
    pub(crate) fn update(&mut self, data: &[u8]) {
        match self {
            ContentHasher::Plain(h) => h.update(data),
            ContentHasher::Modulo(h) => h.update(data),
        }
    }

    /// The content hash, and for modulo hashing the same as Nix before 2.17 computed it.
    pub(crate) fn finish(self) -> (Hash, Option<Hash>) {
        match self {
            ContentHasher::Plain(h) => (h.finish(), None),
            ContentHasher::Modulo(h) => {
                let m = h.finish();
                (m.hash, Some(m.with_offsets))
            }
        }
    }
}

/// A reader that feeds what passes through it to a content hasher, if any.
pub(crate) struct ContentHashingReader<'a> {
    pub(crate) inner: &'a mut dyn Read,
    pub(crate) hasher: Option<ContentHasher>,
}

impl Read for ContentHashingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(h) = &mut self.hasher {
            h.update(&buf[..n]);
        }
        Ok(n)
    }
}
