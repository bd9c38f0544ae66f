//! Canonical NAR writer: byte-identical to `nix-store --dump`. A [`NarVisitor`]: feed it the
//! nodes in NAR order (directory entries sorted by name).

use super::{NarPath, NarVisitor};

/// Writes a NAR to `W` as nodes are visited; writes the magic on creation.
pub struct NarWriter<W: std::io::Write> { out: W }

impl<W: std::io::Write> NarWriter<W> {
    /// Starts a NAR (writes `nix-archive-1`).
    pub fn new(out: W) -> std::io::Result<Self> { todo!() }
    /// The underlying writer, after the root node has been visited.
    pub fn into_inner(self) -> W { self.out }
}

impl<W: std::io::Write> NarVisitor for NarWriter<W> {
    fn regular(&mut self, path: &NarPath, executable: bool, size: u64, offset: u64, contents: &mut dyn std::io::Read) -> std::io::Result<()> { todo!() }
    fn symlink(&mut self, path: &NarPath, target: &[u8]) -> std::io::Result<()> { todo!() }
    fn directory_start(&mut self, path: &NarPath) -> std::io::Result<()> { todo!() }
    fn directory_end(&mut self, path: &NarPath) -> std::io::Result<()> { todo!() }
}
