//! Streaming, strict NAR reader. Rejects: bad magic, unknown or misplaced tokens (`executable`
//! after `contents`, `name` after `node`), non-zero padding, truncation, entry names that are
//! empty, `.`, `..`, or contain `/` or NUL, and unsorted or duplicate directory entries.
//! Tokens other than file contents are bounded in length (no allocation by declared length).
//!
//! Bounds: entry names ≤ [`MAX_NAME_LEN`] bytes, symlink targets 1..=[`MAX_TARGET_LEN`]
//! bytes, other tokens ≤ [`MAX_TOKEN_LEN`] bytes, directory nesting ≤ [`MAX_DEPTH`]. The parser
//! is iterative (no recursion per directory level).
//!
//! The reader issues small reads on `reader` and never reads ahead; wrap an unbuffered source
//! in a `BufReader` yourself if the bytes after the NAR do not matter.

use std::io::Read;

use super::{check_name, show_bytes as show, NarVisitor, MAGIC};

/// Longest entry name accepted (Linux `NAME_MAX`).
pub(crate) const MAX_NAME_LEN: usize = 255;
/// Longest symlink target accepted (Linux `PATH_MAX` less its NUL: `symlink` refuses 4096
/// bytes with `ENAMETOOLONG`, as it does for Nix 2.26's `nix-store --restore`).
pub(crate) const MAX_TARGET_LEN: usize = 4095;
/// Longest structural token accepted (`(`, `type`, `executable`, …).
pub(crate) const MAX_TOKEN_LEN: usize = 64;
/// Deepest directory nesting accepted (a deeper tree cannot be unpacked within `PATH_MAX`).
pub(crate) const MAX_DEPTH: usize = 2048;

/// Why a NAR was rejected, with the byte offset where it was noticed.
#[derive(Debug, thiserror::Error)]
pub enum NarError {
    #[error("NAR: unexpected end of input at byte {offset}")]
    Truncated { offset: u64 },
    #[error("NAR: {what} at byte {offset}")]
    Invalid { offset: u64, what: String },
    #[error("NAR: I/O error at byte {offset}: {source}")]
    Io {
        offset: u64,
        #[source]
        source: std::io::Error,
    },
}

impl NarError {
    /// The byte offset in the NAR where the problem was noticed.
    pub fn offset(&self) -> u64 {
        match self {
            NarError::Truncated { offset } | NarError::Invalid { offset, .. } | NarError::Io { offset, .. } => *offset,
        }
    }
}

/// Copies one NAR from `reader` into `copy`, exactly its bytes, checking it as [`parse`] does
/// (Nix's `copyNAR`: how the end of a NAR is found on a stream that goes on after it). Returns
/// the NAR's length; an error of `copy` is a [`NarError::Io`].
pub fn copy_nar<R: std::io::Read, W: std::io::Write + ?Sized>(reader: R, copy: &mut W) -> Result<u64, NarError> {
    parse(Tee { inner: reader, copy }, &mut super::Discard)
}

/// Copies what is read from `inner` into `copy`.
struct Tee<'a, R, W: ?Sized> {
    inner: R,
    copy: &'a mut W,
}

impl<R: std::io::Read, W: std::io::Write + ?Sized> std::io::Read for Tee<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.copy.write_all(&buf[..n])?;
        Ok(n)
    }
}

/// Parses one NAR from `reader`, calling `visitor` for each node, and returns the number of
/// bytes the NAR took. Reads exactly the NAR: no byte after its end is consumed. Errors from
/// the visitor are returned as [`NarError::Io`], or as [`NarError::Invalid`] if their kind is
/// `InvalidData` (the visitor refused the NAR's contents); errors reading a file's contents
/// as [`NarError::Io`] (or [`NarError::Truncated`]).
pub fn parse<R: std::io::Read, V: super::NarVisitor + ?Sized>(reader: R, visitor: &mut V) -> Result<u64, NarError> {
    let mut p = Parser { r: reader, pos: 0 };
    p.archive(visitor)?;
    Ok(p.pos)
}

/// [`parse`] of an input that is one NAR and nothing else (a NAR file, `nix-store
/// --restore`'s standard input): a byte after the NAR's end is refused as
/// [`NarError::Invalid`] at the offset where the NAR ended, so that two NARs one after the
/// other, or a damaged stream, are not cut silently. Nix 2.8 and 2.26 (`parseDump` in
/// `src/libutil/archive.cc`) stop reading at the NAR's end and ignore the rest; a NAR framed
/// in a larger stream (the daemon protocol, a cache's decompressed file, checked against its
/// `NarHash` and `NarSize`) is read with [`parse`], as Nix reads it.
pub fn parse_whole<R: std::io::Read, V: super::NarVisitor + ?Sized>(mut reader: R, visitor: &mut V) -> Result<u64, NarError> {
    let len = parse(&mut reader, visitor)?;
    let mut after = [0u8; 16];
    let n = loop {
        match reader.read(&mut after) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => return Err(NarError::Io { offset: len, source }),
        }
    };
    if n > 0 {
        let what =
            format!("data after the end of the archive (the NAR ends here, then {} follows)", show(after.get(..n).unwrap_or_default()));
        return Err(NarError::Invalid { offset: len, what });
    }
    Ok(len)
}

/// Checks that `reader` holds one valid NAR (see [`parse`]); returns its length.
pub fn validate<R: std::io::Read>(reader: R) -> Result<u64, NarError> {
    parse(reader, &mut super::Discard)
}

struct Parser<R> {
    r: R,
    pos: u64,
}

/// The contents of a regular file, as handed to the visitor: at most `left` bytes of the NAR.
/// A regular file's contents as the visitor reads them; `failed` keeps the error the input
/// gave (its kind and message), which the parser reports even if the visitor replaced it.
struct Contents<'a, R> {
    r: &'a mut R,
    left: u64,
    pos: &'a mut u64,
    failed: Option<std::io::Error>,
}

impl<R: Read> Read for Contents<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = match self.r.read(buf.get_mut(..want).unwrap_or_default()) {
            Ok(0) => {
                self.failed = Some(std::io::ErrorKind::UnexpectedEof.into());
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Err(e),
            Err(e) => {
                self.failed = Some(std::io::Error::new(e.kind(), e.to_string()));
                return Err(e);
            }
        };
        self.left -= n as u64;
        *self.pos += n as u64;
        Ok(n)
    }
}

impl<R: Read> Parser<R> {
    fn invalid<T>(&self, offset: u64, what: impl Into<String>) -> Result<T, NarError> {
        Err(NarError::Invalid { offset, what: what.into() })
    }

    fn io_err(&self, e: std::io::Error) -> NarError {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            NarError::Truncated { offset: self.pos }
        } else {
            NarError::Io { offset: self.pos, source: e }
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), NarError> {
        let mut done = 0;
        while done < buf.len() {
            match self.r.read(buf.get_mut(done..).unwrap_or_default()) {
                Ok(0) => return Err(NarError::Truncated { offset: self.pos }),
                Ok(n) => {
                    done += n;
                    self.pos += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_err(e)),
            }
        }
        Ok(())
    }

    fn u64(&mut self) -> Result<u64, NarError> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Reads the zero padding after `len` bytes of data.
    fn padding(&mut self, len: u64) -> Result<(), NarError> {
        let pad = ((8 - len % 8) % 8) as usize;
        let mut b = [0u8; 8];
        let start = self.pos;
        let b = b.get_mut(..pad).unwrap_or_default();
        self.read_exact(b)?;
        if b.iter().any(|&x| x != 0) {
            return self.invalid(start, "non-zero padding");
        }
        Ok(())
    }

    /// Reads a length-prefixed string of at most `max` bytes; `what` names it in errors.
    fn string(&mut self, max: usize, what: &str) -> Result<Vec<u8>, NarError> {
        let start = self.pos;
        let len = self.u64()?;
        if len > max as u64 {
            return self.invalid(start, format!("{what} too long ({len} bytes; at most {max})"));
        }
        let mut buf = vec![0u8; len as usize];
        self.read_exact(&mut buf)?;
        self.padding(len)?;
        Ok(buf)
    }

    fn token(&mut self) -> Result<(u64, Vec<u8>), NarError> {
        let start = self.pos;
        Ok((start, self.string(MAX_TOKEN_LEN, "token")?))
    }

    fn expect(&mut self, want: &str) -> Result<(), NarError> {
        let (start, t) = self.token()?;
        if t != want.as_bytes() {
            return self.invalid(start, format!("expected '{want}', got {}", show(&t)));
        }
        Ok(())
    }

    /// A visitor's error: [`NarError::Invalid`] when it refused what the NAR holds
    /// (`InvalidData`: a name it cannot make, a path too long for its target), else
    /// [`NarError::Io`].
    fn visit<T>(&self, r: std::io::Result<T>) -> Result<T, NarError> {
        r.map_err(|source| match source.kind() {
            std::io::ErrorKind::InvalidData => NarError::Invalid { offset: self.pos, what: source.to_string() },
            _ => NarError::Io { offset: self.pos, source },
        })
    }

    fn archive<V: NarVisitor + ?Sized>(&mut self, v: &mut V) -> Result<(), NarError> {
        // Nix's words (`archive.cc`), and what stands where the header belongs.
        let not_a_nar = |head: &[u8]| {
            format!(
                "not a NAR: input doesn't look like a Nix archive (bad magic: it starts with {}, not the 'nix-archive-1' header)",
                show(head)
            )
        };
        let mut head = [0u8; 8 + 16];
        self.read_exact(&mut head[..8])?;
        if head[..8] == MAGIC.as_bytes()[..8] {
            let why = "not a NAR: it starts with the text 'nix-archive-1' without the 8-byte length a NAR puts before each string";
            return self.invalid(0, why.to_owned());
        }
        if head[..8] != (MAGIC.len() as u64).to_le_bytes() {
            return self.invalid(0, not_a_nar(&head[..8]));
        }
        self.read_exact(&mut head[8..8 + MAGIC.len()])?;
        if head[8..8 + MAGIC.len()] != *MAGIC.as_bytes() {
            return self.invalid(0, not_a_nar(&head[..8 + MAGIC.len()]));
        }
        self.padding(MAGIC.len() as u64)?;

        let mut path: Vec<Vec<u8>> = Vec::new();
        // For each open directory, the name of its last entry so far.
        let mut dirs: Vec<Option<Vec<u8>>> = Vec::new();
        loop {
            // A node at `path`.
            if self.node(&path, v)? {
                if dirs.len() >= MAX_DEPTH {
                    return self.invalid(self.pos, format!("directories nested deeper than {MAX_DEPTH}"));
                }
                self.visit(v.directory_start(&path))?;
                dirs.push(None);
            } else if path.pop().is_none() {
                return Ok(());
            } else {
                self.expect(")")?;
            }
            // Entries of the innermost open directory, until the next node starts.
            loop {
                let (start, t) = self.token()?;
                match t.as_slice() {
                    b")" => {
                        self.visit(v.directory_end(&path))?;
                        dirs.pop();
                        if path.pop().is_none() {
                            return Ok(());
                        }
                        self.expect(")")?;
                    }
                    b"entry" => {
                        self.expect("(")?;
                        let (start, t) = self.token()?;
                        match t.as_slice() {
                            b"name" => {}
                            b"node" => return self.invalid(start, "'node' before 'name' in a directory entry"),
                            _ => return self.invalid(start, format!("expected 'name', got {}", show(&t))),
                        }
                        let name_at = self.pos;
                        let name = self.string(MAX_NAME_LEN, "entry name")?;
                        if let Err(why) = check_name(&name) {
                            return self.invalid(name_at, format!("invalid file name {}: {why}", show(&name)));
                        }
                        let last = dirs.last_mut().ok_or(NarError::Invalid { offset: start, what: "entry outside a directory".into() })?;
                        match last.as_deref() {
                            Some(prev) if prev == name.as_slice() => {
                                return self.invalid(name_at, format!("duplicate directory entry {}", show(&name)));
                            }
                            Some(prev) if prev > name.as_slice() => {
                                return self.invalid(name_at, format!("directory not sorted: {} after {}", show(&name), show(prev)));
                            }
                            _ => {}
                        }
                        *last = Some(name.clone());
                        self.expect("node")?;
                        path.push(name);
                        break;
                    }
                    _ => return self.invalid(start, format!("expected 'entry' or ')', got {}", show(&t))),
                }
            }
        }
    }

    /// Reads `( type …` of a node; for a regular file or symlink through its closing `)`
    /// (returns false), for a directory only the header (returns true).
    fn node<V: NarVisitor + ?Sized>(&mut self, path: &[Vec<u8>], v: &mut V) -> Result<bool, NarError> {
        self.expect("(")?;
        self.expect("type")?;
        let (start, t) = self.token()?;
        match t.as_slice() {
            b"regular" => {
                self.regular(path, v)?;
                return Ok(false);
            }
            b"symlink" => {
                self.expect("target")?;
                let at = self.pos;
                let target = self.string(MAX_TARGET_LEN, "symlink target")?;
                if target.is_empty() {
                    return self.invalid(at, "empty symlink target");
                }
                self.visit(v.symlink(path, &target))?;
            }
            b"directory" => return Ok(true),
            _ => return self.invalid(start, format!("unknown file type {}", show(&t))),
        }
        self.expect(")")?;
        Ok(false)
    }

    fn regular<V: NarVisitor + ?Sized>(&mut self, path: &[Vec<u8>], v: &mut V) -> Result<(), NarError> {
        let (mut start, mut t) = self.token()?;
        let executable = t == b"executable";
        if executable {
            let at = self.pos;
            if !self.string(MAX_TOKEN_LEN, "executable marker")?.is_empty() {
                return self.invalid(at, "executable marker has a non-empty value");
            }
            (start, t) = self.token()?;
        }
        match t.as_slice() {
            b"contents" => {}
            b"executable" => return self.invalid(start, "'executable' after 'executable'"),
            // Nix 2.26's `parse` (`src/libutil/archive.cc`) takes this `)` as the tag after
            // `type regular` and then expects another `)`, so it refuses it too (2.8 read an
            // empty file, which would never dump to this NarHash again: Nix writes an empty
            // file as `contents` of length 0).
            b")" => {
                return self
                    .invalid(start, "a regular file without 'contents' (Nix 2.26 refuses it; an empty file is 'contents' of length 0)")
            }
            _ => return self.invalid(start, format!("expected 'contents', got {}", show(&t))),
        }
        let size = self.u64()?;
        let offset = self.pos;
        let mut c = Contents { r: &mut self.r, left: size, pos: &mut self.pos, failed: None };
        let res = v.regular(path, executable, size, offset, &mut c);
        // Consume whatever the visitor did not read.
        let drained = if c.failed.is_none() && res.is_ok() { std::io::copy(&mut c, &mut std::io::sink()).err() } else { None };
        let failed = c.failed.take();
        match (failed, drained) {
            (Some(e), _) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(NarError::Truncated { offset: self.pos }),
            (Some(e), _) => return Err(NarError::Io { offset: self.pos, source: e }),
            (None, Some(e)) => return Err(self.io_err(e)),
            (None, None) => {}
        }
        self.visit(res)?;
        self.padding(size)?;
        // `executable` after `contents` lands here as an unexpected token.
        let (start, t) = self.token()?;
        if t == b"executable" {
            return self.invalid(start, "'executable' must come before 'contents'");
        }
        if t != b")" {
            return self.invalid(start, format!("expected ')', got {}", show(&t)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nar::writer::regular_file_nar;
    use crate::nar::{Discard, NarPath};

    /// Appends one NAR string token.
    fn tok(out: &mut Vec<u8>, s: &[u8]) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s);
        out.resize(out.len() + (8 - s.len() % 8) % 8, 0);
    }

    fn nar(tokens: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for t in tokens {
            tok(&mut out, t);
        }
        out
    }

    fn err(bytes: &[u8]) -> String {
        validate(bytes).unwrap_err().to_string()
    }

    #[test]
    fn structural_errors() {
        let m: &[u8] = b"nix-archive-1";
        assert!(err(&nar(&[m, b"(", b"type", b"fifo", b")"])).contains("unknown file type 'fifo'"));
        assert!(err(&nar(&[m, b"(", b"type", b"symlink", b"target", b"", b")"])).contains("empty symlink target"));
        assert!(err(&nar(&[m, b"(", b"type", b"regular", b"executable", b"x", b"contents"])).contains("non-empty value"));
        assert!(err(&nar(&[m, b"(", b"type", b"regular", b")"])).contains("a regular file without 'contents'"));
        assert!(err(&nar(&[m, b"(", b"type", b"regular", b"executable", b"", b")"])).contains("a regular file without 'contents'"));
        assert!(err(&nar(&[m, b"(", b"type", b"regular", b"size"])).contains("expected 'contents', got 'size'"));
        assert!(err(&nar(&[m, b"(", b"type", b"directory", b"bogus"])).contains("expected 'entry' or ')'"));
        assert!(err(&nar(&[m, b"[", b"type"])).contains("expected '('"));
        assert_eq!(err(&nar(&[b"nix-archive-2"])), "NAR: not a NAR: input doesn't look like a Nix archive (bad magic: it starts with '\\r\\x00\\x00\\x00\\x00\\x00\\x00\\x00nix-archive-2', not the 'nix-archive-1' header) at byte 0");
        assert!(err(b"<html><body>").contains("it starts with '<html><b'"));
        assert!(err(b"nix-archive-1\n(type regular)").contains("the text 'nix-archive-1' without the 8-byte length"));
        assert!(err(&[]).contains("unexpected end"));
        let long = vec![b'a'; MAX_NAME_LEN + 1];
        let e = err(&nar(&[m, b"(", b"type", b"directory", b"entry", b"(", b"name", &long]));
        assert!(e.contains("entry name too long"), "{e}");
        let target = vec![b'a'; MAX_TARGET_LEN + 1];
        assert!(err(&nar(&[m, b"(", b"type", b"symlink", b"target", &target])).contains("symlink target too long"));
        // Longest allowed name and target are fine.
        let ok = nar(&[
            m,
            b"(",
            b"type",
            b"directory",
            b"entry",
            b"(",
            b"name",
            &long[1..],
            b"node",
            b"(",
            b"type",
            b"symlink",
            b"target",
            &target[1..],
            b")",
            b")",
            b")",
        ]);
        assert_eq!(validate(&ok[..]).unwrap(), ok.len() as u64);
    }

    #[test]
    fn parse_whole_refuses_data_after_the_archive() {
        let one = regular_file_nar(b"hi", false);
        assert_eq!(parse_whole(&one[..], &mut Discard).unwrap(), one.len() as u64);
        let two = [one.clone(), one.clone()].concat();
        let e = parse_whole(&two[..], &mut Discard).unwrap_err();
        assert_eq!((e.offset(), e.to_string().contains("data after the end of the archive")), (one.len() as u64, true), "{e}");
        // `parse` stops at the NAR's end, the rest left to the caller.
        assert_eq!(parse(&two[..], &mut Discard).unwrap(), one.len() as u64);
    }

    #[test]
    fn depth_is_bounded_and_iterative() {
        let build = crate::nar::nested_nar;
        let ok = build(MAX_DEPTH);
        assert_eq!(validate(&ok[..]).unwrap(), ok.len() as u64);
        let tree = crate::nar::listing::list(&ok[..]).unwrap();
        assert!(tree.to_json(true, crate::nar::listing::JsonKeys::Nix2_8).len() > MAX_DEPTH);
        assert!(err(&build(MAX_DEPTH + 1)).contains("nested deeper"));
    }

    /// A visitor that reads only part of each file; the reader skips the rest.
    struct Partial(Vec<u8>);
    impl NarVisitor for Partial {
        fn regular(&mut self, _: &NarPath, _: bool, _: u64, _: u64, c: &mut dyn std::io::Read) -> std::io::Result<()> {
            let mut b = [0u8; 3];
            c.read_exact(&mut b)?;
            self.0.extend_from_slice(&b);
            Ok(())
        }
        fn symlink(&mut self, _: &NarPath, target: &[u8]) -> std::io::Result<()> {
            match target {
                b"refuse" => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "refused 'refuse'")),
                _ => Err(std::io::Error::other("no links")),
            }
        }
        fn directory_start(&mut self, _: &NarPath) -> std::io::Result<()> {
            Ok(())
        }
        fn directory_end(&mut self, _: &NarPath) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn contents_are_streamed_and_drained() {
        let data = regular_file_nar(b"hello, world", true);
        let mut p = Partial(Vec::new());
        assert_eq!(parse(&data[..], &mut p).unwrap(), data.len() as u64);
        assert_eq!(p.0, b"hel");
        // Visitor errors come back as Io, or Invalid if it refused the contents; truncation
        // inside contents as Truncated.
        let link = nar(&[b"nix-archive-1", b"(", b"type", b"symlink", b"target", b"x", b")"]);
        assert!(matches!(parse(&link[..], &mut p), Err(NarError::Io { .. })));
        let refused = nar(&[b"nix-archive-1", b"(", b"type", b"symlink", b"target", b"refuse", b")"]);
        assert_eq!(
            parse(&refused[..], &mut p).unwrap_err().to_string(),
            format!("NAR: refused 'refuse' at byte {}", refused.len() - 16),
            "after the target, before the closing ')'"
        );
        let cut = &data[..data.len() - 12];
        assert!(matches!(parse(cut, &mut p), Err(NarError::Truncated { .. })));
        assert!(matches!(parse(cut, &mut Discard), Err(NarError::Truncated { .. })));
    }
}
