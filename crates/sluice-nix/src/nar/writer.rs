//! Canonical NAR writer: byte-identical to `nix-store --dump`. A [`NarVisitor`]: feed it the
//! nodes in NAR order (directory entries sorted by name).
//!
//! The writer checks what it is fed: entry names must pass [`super::check_name`] and come in
//! strictly ascending byte order within a directory, and a regular file's `contents` must
//! yield at least `size` bytes (only `size` are read). Violations are `InvalidInput` /
//! `UnexpectedEof` I/O errors, so a non-canonical NAR is never produced.

use std::io::{Error, ErrorKind};

use super::{check_name, NarPath, NarVisitor, MAGIC};

/// Writes a NAR to `W` as nodes are visited; writes the magic on creation.
pub struct NarWriter<W: std::io::Write> {
    out: W,
    /// For each open directory, its last entry name so far.
    dirs: Vec<Option<Vec<u8>>>,
    /// Bytes written so far.
    pos: u64,
    /// The buffer file contents pass through (grown to the largest file so far, up to
    /// [`COPY_BUF`]).
    buf: Vec<u8>,
}

const ZEROS: [u8; 8] = [0; 8];

/// Bytes of file contents read per `read` call: `std::io::copy`'s 8 KiB made a 2.6 MB file
/// 323 `read`s when `sluice serve` dumped it (`bench/serve-profile`, strace).
const COPY_BUF: usize = 256 * 1024;

impl<W: std::io::Write> NarWriter<W> {
    /// Starts a NAR (writes `nix-archive-1`).
    pub fn new(out: W) -> std::io::Result<Self> {
        let mut w = NarWriter { out, dirs: Vec::new(), pos: 0, buf: Vec::new() };
        w.str(MAGIC.as_bytes())?;
        Ok(w)
    }
    /// The underlying writer, after the root node has been visited.
    pub fn into_inner(self) -> W {
        self.out
    }
    /// Bytes written so far (after the root node: the NAR size).
    pub fn position(&self) -> u64 {
        self.pos
    }
    /// The underlying writer, to take what was written so far (e.g. drain a `Vec`).
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }
    /// The underlying writer.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Writes a regular file's tokens up to its contents (the entry, `type`, `executable`,
    /// `contents` and the `size`): the caller then writes exactly `size` bytes of contents to
    /// the underlying writer itself ([`NarWriter::get_mut`]) and ends the file with
    /// [`NarWriter::regular_trailer`]. For a reader that streams a large file's contents
    /// without copying them through this writer; [`NarVisitor::regular`] does all three.
    /// Errors: a name out of order or not allowed (`InvalidInput`), the writer's.
    pub fn regular_header(&mut self, path: &NarPath, executable: bool, size: u64) -> std::io::Result<()> {
        self.open(path, "regular")?;
        if executable {
            self.strs(&["executable", ""])?;
        }
        self.str(b"contents")?;
        self.raw(&size.to_le_bytes())
    }

    /// Ends the regular file of `size` bytes that [`NarWriter::regular_header`] started, once
    /// its contents were written: the padding and the closing tokens.
    pub fn regular_trailer(&mut self, path: &NarPath, size: u64) -> std::io::Result<()> {
        self.pos += size;
        self.pad(size)?;
        self.close(path)
    }

    fn raw(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self, len: u64) -> std::io::Result<()> {
        let pad = ((8 - len % 8) % 8) as usize;
        self.raw(ZEROS.get(..pad).unwrap_or_default())
    }

    fn str(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.raw(&(b.len() as u64).to_le_bytes())?;
        self.raw(b)?;
        self.pad(b.len() as u64)
    }

    fn strs(&mut self, tokens: &[&str]) -> std::io::Result<()> {
        tokens.iter().try_for_each(|t| self.str(t.as_bytes()))
    }

    /// Opens the node at `path`: for a non-root node, the directory entry around it.
    fn open(&mut self, path: &NarPath, ty: &str) -> std::io::Result<()> {
        if let Some(name) = path.last() {
            check_name(name).map_err(|why| Error::new(ErrorKind::InvalidInput, format!("NAR entry name: {why}")))?;
            let last = self.dirs.last_mut().ok_or_else(|| Error::new(ErrorKind::InvalidInput, "NAR entry outside a directory"))?;
            if last.as_deref().is_some_and(|prev| prev >= name.as_slice()) {
                return Err(Error::new(ErrorKind::InvalidInput, "NAR entries not in strictly ascending order"));
            }
            *last = Some(name.clone());
            self.strs(&["entry", "(", "name"])?;
            self.str(name)?;
            self.str(b"node")?;
        }
        self.strs(&["(", "type", ty])
    }

    /// Closes the node at `path` (and its directory entry, if not the root).
    fn close(&mut self, path: &NarPath) -> std::io::Result<()> {
        self.str(b")")?;
        if !path.is_empty() {
            self.str(b")")?;
        }
        Ok(())
    }
}

impl<W: std::io::Write> NarVisitor for NarWriter<W> {
    fn regular(
        &mut self,
        path: &NarPath,
        executable: bool,
        size: u64,
        _offset: u64,
        contents: &mut dyn std::io::Read,
    ) -> std::io::Result<()> {
        self.regular_header(path, executable, size)?;
        let mut n = 0;
        // A buffer as large as the file, in powers of two up to COPY_BUF: most files of a
        // store are small, and zeroing 256 KiB for each NAR dumped was 2 % of a push's time.
        let fits = usize::try_from(size).unwrap_or(usize::MAX).min(COPY_BUF).next_power_of_two();
        if self.buf.len() < fits {
            self.buf = vec![0; fits];
        }
        while n < size {
            let want = usize::try_from(size - n).unwrap_or(usize::MAX).min(self.buf.len());
            let got = match contents.read(&mut self.buf[..want]) {
                Ok(0) => return Err(Error::new(ErrorKind::UnexpectedEof, format!("file contents ended after {n} of {size} bytes"))),
                Ok(got) => got,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            self.out.write_all(&self.buf[..got])?;
            n += got as u64;
        }
        self.regular_trailer(path, size)
    }

    fn symlink(&mut self, path: &NarPath, target: &[u8]) -> std::io::Result<()> {
        self.open(path, "symlink")?;
        self.str(b"target")?;
        self.str(target)?;
        self.close(path)
    }

    fn directory_start(&mut self, path: &NarPath) -> std::io::Result<()> {
        self.open(path, "directory")?;
        self.dirs.push(None);
        Ok(())
    }

    fn directory_end(&mut self, path: &NarPath) -> std::io::Result<()> {
        self.dirs.pop();
        self.close(path)
    }
}

/// Writes the NAR of a single regular file held in memory.
pub fn regular_file_nar(contents: &[u8], executable: bool) -> Vec<u8> {
    let mut w = NarWriter { out: Vec::new(), dirs: Vec::new(), pos: 0, buf: Vec::new() };
    // Writing to a Vec cannot fail.
    let _ = w.str(MAGIC.as_bytes());
    let _ = w.regular(&[], executable, contents.len() as u64, 0, &mut &contents[..]);
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_canonical_input() {
        let n = |s: &[u8]| s.to_vec();
        let mut w = NarWriter::new(Vec::new()).unwrap();
        w.directory_start(&[]).unwrap();
        w.symlink(&[n(b"b")], b"x").unwrap();
        assert_eq!(w.symlink(&[n(b"a")], b"x").unwrap_err().kind(), ErrorKind::InvalidInput);
        assert_eq!(w.symlink(&[n(b"b")], b"x").unwrap_err().kind(), ErrorKind::InvalidInput);
        assert_eq!(w.symlink(&[n(b"..")], b"x").unwrap_err().kind(), ErrorKind::InvalidInput);
        assert_eq!(w.symlink(&[n(b"c/d")], b"x").unwrap_err().kind(), ErrorKind::InvalidInput);
        let e = w.regular(&[n(b"z")], false, 10, 0, &mut &b"short"[..]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnexpectedEof);
    }

    #[test]
    fn single_file_nar_layout() {
        let nar = regular_file_nar(b"x", false);
        // magic, "(", "type", "regular", "contents", size, 1 byte + 7 padding, ")".
        assert_eq!(nar.len(), 24 + 16 + 16 + 16 + 16 + 8 + 8 + 16);
        assert_eq!(&nar[nar.len() - 24..nar.len() - 16], b"x\0\0\0\0\0\0\0");
        let mut w = NarWriter::new(Vec::new()).unwrap();
        w.regular(&[], false, 1, 0, &mut &b"xyz"[..]).unwrap();
        assert_eq!(w.into_inner(), nar);
    }
}
