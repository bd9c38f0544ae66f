//! zstd streams (one frame or several, as `zstd` and Nix before 2.35 write them) decoded with
//! decompression contexts the process keeps: a context holds its window buffer (up to the
//! frame's window, 2 MiB at Nix's default level), and making one per NAR, then faulting in and
//! freeing its buffers, showed in a copy's profile (docs/benchmarks.md). Decoding is zstd's
//! `ZSTD_decompressStream`; as Nix's `makeDecompressionSink` (`src/libutil/compression.cc`,
//! zstd through libarchive) reads them, concatenated frames are decoded in turn and skippable
//! frames skipped.

use std::io::{self, BufRead, Read};
use std::sync::{Mutex, PoisonError};

use zstd::zstd_safe::{get_error_name, DCtx, InBuffer, OutBuffer, ResetDirective};

/// Most idle contexts kept for the next streams: enough for the unpacks that run at once on a
/// small machine; a context beyond this is freed when its stream ends.
const KEPT: usize = 8;

/// Idle contexts, reset, ready for a new stream.
static IDLE: Mutex<Vec<DCtx<'static>>> = Mutex::new(Vec::new());

/// Reads the decoded bytes of a zstd stream from `input`, with a context taken from the
/// process's idle ones (or made) and given back, reset, when dropped. A stream that ends
/// inside a frame is an [`io::ErrorKind::UnexpectedEof`] error; bad data an
/// [`io::ErrorKind::InvalidData`] error naming zstd's reason.
pub(super) struct StreamDecoder<R> {
    input: R,
    /// `None` only while being dropped.
    dctx: Option<DCtx<'static>>,
    /// Whether a frame was begun and not finished.
    in_frame: bool,
}

impl<R: BufRead> StreamDecoder<R> {
    pub(super) fn new(input: R) -> Self {
        let idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner).pop();
        StreamDecoder { input, dctx: Some(idle.unwrap_or_else(DCtx::create)), in_frame: false }
    }
}

impl<R: BufRead> Read for StreamDecoder<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(dctx) = self.dctx.as_mut() else { return Ok(0) };
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let input = self.input.fill_buf()?;
            let at_end = input.is_empty();
            if at_end && !self.in_frame {
                return Ok(0);
            }
            let (mut src, mut dst) = (InBuffer::around(input), OutBuffer::around(buf));
            let hint = dctx
                .decompress_stream(&mut dst, &mut src)
                .map_err(|code| io::Error::new(io::ErrorKind::InvalidData, format!("zstd: {}", get_error_name(code))))?;
            let (consumed, produced) = (src.pos(), dst.pos());
            self.input.consume(consumed);
            // 0: the frame is decoded and flushed whole.
            self.in_frame = hint != 0;
            if produced > 0 {
                return Ok(produced);
            }
            if at_end {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the zstd stream ends inside a frame"));
            }
        }
    }
}

impl<R> Drop for StreamDecoder<R> {
    fn drop(&mut self) {
        let Some(mut dctx) = self.dctx.take() else { return };
        if dctx.reset(ResetDirective::SessionOnly).is_ok() {
            let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
            if idle.len() < KEPT {
                idle.push(dctx);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(compressed: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        StreamDecoder::new(compressed).read_to_end(&mut out)?;
        Ok(out)
    }

    /// Contexts are reused: a stream decoded after another, broken one, with a kept context,
    /// is decoded right; concatenated frames and a leading skippable frame are decoded whole;
    /// a cut stream is an error.
    #[test]
    fn streams_share_contexts_and_end_where_zstd_says() {
        let data: Vec<u8> = (0..300_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        let whole = zstd::encode_all(&data[..], 3).unwrap();
        let cut = &whole[..whole.len() / 2];
        assert_eq!(decode(cut).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        let mut garbage = whole.clone();
        garbage[20..40].fill(0xff);
        assert_eq!(decode(&garbage).unwrap_err().kind(), io::ErrorKind::InvalidData);
        for _ in 0..3 {
            assert_eq!(decode(&whole).unwrap(), data);
        }
        let mut two = whole.clone();
        two.extend(zstd::encode_all(&b"tail"[..], 19).unwrap());
        assert_eq!(decode(&two).unwrap(), [&data[..], b"tail"].concat());
        // A skippable frame (magic 0x184D2A50, 4 bytes of length, payload) before the data.
        let mut skippable = vec![0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3];
        skippable.extend(&whole);
        assert_eq!(decode(&skippable).unwrap(), data);
        assert_eq!(decode(b"").unwrap(), b"");
    }
}
