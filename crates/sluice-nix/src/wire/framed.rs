//! Framed streams (`FramedSource`/`FramedSink` in `src/libutil/serialise.hh`): a sequence of
//! frames, each a u64 length and that many bytes without padding, ended by a zero-length
//! frame. Used by AddToStore (protocol ≥ 1.25), AddToStoreNar (≥ 1.23), AddMultipleToStore
//! and AddBuildLog so that the payload's end is known without parsing it.

use std::io::{self, Read, Write};

use super::primitives::write_u64;

/// Largest frame accepted by [`FramedReader`], in bytes (Nix clients send 32 KiB frames;
/// nothing is allocated per frame, the bound only stops absurd input early).
pub const MAX_FRAME_LEN: u64 = 64 << 20;

/// Reads the payload of a framed stream. Reports end of file at the terminating empty frame;
/// a frame longer than [`MAX_FRAME_LEN`] is an `InvalidData` error naming its length, and an
/// end of input before the terminator is `UnexpectedEof`.
pub struct FramedReader<R> {
    inner: R,
    /// Bytes left in the current frame.
    remaining: u64,
    done: bool,
}

impl<R: Read> FramedReader<R> {
    /// A reader of the framed stream starting at `inner`'s current position.
    pub fn new(inner: R) -> Self {
        FramedReader { inner, remaining: 0, done: false }
    }

    /// Whether the terminating empty frame has been read.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Reads and discards the rest of the payload up to and including the terminator, so
    /// that the next message can be read from the underlying stream.
    pub fn drain(&mut self) -> io::Result<u64> {
        io::copy(self, &mut io::sink())
    }

    /// Reads the next frame header; false at the terminator.
    fn next_frame(&mut self) -> io::Result<bool> {
        let mut b = [0u8; 8];
        self.inner.read_exact(&mut b)?;
        let len = u64::from_le_bytes(b);
        if len == 0 {
            self.done = true;
            return Ok(false);
        }
        if len > MAX_FRAME_LEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("framed stream: frame of {len} bytes exceeds the maximum of {MAX_FRAME_LEN}"),
            ));
        }
        self.remaining = len;
        Ok(true)
    }
}

impl<R: Read> Read for FramedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.done {
            return Ok(0);
        }
        while self.remaining == 0 {
            if !self.next_frame()? {
                return Ok(0);
            }
        }
        let want = buf.len().min(self.remaining.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "framed stream: end of input inside a frame"));
        }
        self.remaining -= n as u64;
        Ok(n)
    }
}

/// Writes a framed stream: each non-empty `write` becomes one frame; [`finish`](Self::finish)
/// writes the terminator.
pub struct FramedWriter<W: Write> {
    inner: W,
}

impl<W: Write> FramedWriter<W> {
    /// A writer of a framed stream onto `inner`.
    pub fn new(inner: W) -> Self {
        FramedWriter { inner }
    }

    /// Writes the terminating empty frame and returns the underlying writer.
    pub fn finish(mut self) -> io::Result<W> {
        write_u64(&mut self.inner, 0)?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for FramedWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !buf.is_empty() {
            write_u64(&mut self.inner, buf.len() as u64)?;
            self.inner.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_leaves_following_data() {
        let mut w = FramedWriter::new(Vec::new());
        w.write_all(b"hello ").unwrap();
        w.write_all(b"world").unwrap();
        let mut buf = w.finish().unwrap();
        buf.extend_from_slice(b"NEXT");
        let mut src = buf.as_slice();
        let mut r = FramedReader::new(&mut src);
        let mut out = String::new();
        r.read_to_string(&mut out).unwrap();
        assert_eq!(out, "hello world");
        assert!(r.is_done());
        assert_eq!(src, b"NEXT");
    }

    #[test]
    fn oversized_and_truncated() {
        let mut buf = Vec::new();
        write_u64(&mut buf, MAX_FRAME_LEN + 1).unwrap();
        let err = FramedReader::new(buf.as_slice()).drain().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let mut buf = Vec::new();
        write_u64(&mut buf, 10).unwrap();
        buf.extend_from_slice(b"abc");
        assert_eq!(FramedReader::new(buf.as_slice()).drain().unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
