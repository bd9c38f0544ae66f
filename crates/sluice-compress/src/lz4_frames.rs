//! lz4 as concatenated frames, as libarchive's lz4 filter reads them for Nix
//! (`archive_read_support_filter_lz4.c`: after a frame's end mark, the next frame or skippable
//! frame, until the input ends) and as `lz4 -m` or `cat` of several `.lz4` files writes them.
//! lz4_flex's decoder ends its `read`s at each frame's end (read to its end, it gave the first
//! frame only) and fails on a skippable frame, whose header it has read: here each frame gets a
//! decoder of its own (one reused across frames of different block sizes breaks lz4_flex's
//! assumptions about its buffers), and skippable frames are skipped.

use std::io::{self, BufRead, Read};

use lz4_flex::frame::FrameDecoder;

/// Decodes the lz4 frames of its input one after another, to the end of the input, skipping
/// skippable frames.
pub(super) struct Lz4Frames<R: BufRead> {
    /// The current frame's decoder (`None` only while it is being replaced).
    decoder: Option<FrameDecoder<R>>,
}

impl<R: BufRead> Lz4Frames<R> {
    pub(super) fn new(input: R) -> Self {
        Lz4Frames { decoder: Some(FrameDecoder::new(input)) }
    }
}

/// The length of the skippable frame whose header `e` says lz4_flex has just read.
fn skippable_frame(e: &io::Error) -> Option<u32> {
    match e.get_ref()?.downcast_ref::<lz4_flex::frame::Error>()? {
        lz4_flex::frame::Error::SkippableFrame(len) => Some(*len),
        _ => None,
    }
}

/// Skips the `len` bytes of a skippable frame's contents; true if the input ends after them.
fn skip(input: &mut impl BufRead, len: u32) -> io::Result<bool> {
    let skipped = io::copy(&mut input.take(u64::from(len)), &mut io::sink())?;
    if skipped < u64::from(len) {
        let what = format!("the lz4 data ends inside a skippable frame ({skipped} of its {len} bytes)");
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, what));
    }
    Ok(input.fill_buf()?.is_empty())
}

impl<R: BufRead> Read for Lz4Frames<R> {
    /// A frame's end (0 bytes) goes on with the next frame unless the input has ended.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let Some(mut decoder) = self.decoder.take() else { return Ok(0) };
            let read = decoder.read(buf);
            let next = match &read {
                Ok(0) if !buf.is_empty() => Some(0),
                Err(e) => skippable_frame(e),
                Ok(_) => None,
            };
            let Some(len) = next else {
                self.decoder = Some(decoder);
                return read;
            };
            let mut input = decoder.into_inner();
            let ended = skip(&mut input, len);
            self.decoder = Some(FrameDecoder::new(input));
            if ended? {
                return Ok(0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn lz4(data: &[u8]) -> Vec<u8> {
        let mut e = lz4_flex::frame::FrameEncoder::new(Vec::new());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    /// Frames one after another, an empty one and skippable ones among them (one first, as
    /// `pzstd`-like tools write), decode to all of their contents (before, to the first frame's,
    /// or failed on a skippable frame); a frame cut inside a block fails.
    #[test]
    fn concatenated_frames_decode_whole() {
        let (a, b) = (vec![7u8; 100_000], b"second frame".to_vec());
        let skippable = vec![0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3];
        let packed = [skippable.clone(), lz4(&a), lz4(b""), skippable, lz4(&b)].concat();
        let mut out = Vec::new();
        crate::Compression::Lz4.decoder(&packed[..]).unwrap().read_to_end(&mut out).unwrap();
        assert!(out == [a, b].concat(), "{} bytes", out.len());
        let cut = &packed[..packed.len() - 10];
        assert!(crate::Compression::Lz4.decoder(cut).unwrap().read_to_end(&mut Vec::new()).is_err());
    }
}
