//! zstd as independent frames: the encoder Nix writes with (`ZstdMultiFrameCompressionSink`
//! in Nix's `src/libutil/compression.cc`: a frame per 16 MiB of input, each pledged at its
//! exact size so that its header carries its content size), and a decoder that decodes such
//! frames on several cores at once, in order, with bounded memory.
//!
//! Decoding. The caller's thread reads the input one whole frame at a time (its end is found
//! from its block headers, `ZSTD_findFrameCompressedSize`) and decodes the frame it must
//! return next itself; while it does, the following frames go to helper threads, as many as
//! are free. Helpers are shared by the whole process: at most [`helper_limit`] (the cores
//! but one) decode at once, whatever the number of NARs being read, and a reader holds at most
//! one frame more than the helpers it got. Memory is therefore bounded by
//! (cores) × ([`MAX_FRAME`] of output + its compressed bytes) over the process, plus one
//! frame per reader. A frame without a content size in its header, or with one above
//! [`MAX_FRAME`] (one stream, as `zstd` and Nix before 2.35 write it), ends the frame-wise
//! decoding: the rest of the input goes through the streaming decoder as before.

use std::collections::VecDeque;
use std::io::{self, Cursor, Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, OnceLock};

/// Uncompressed bytes per frame the encoder writes (Nix's `bytesPerFrame`).
pub(crate) const FRAME_SIZE: usize = 16 * 1024 * 1024;

/// Largest content size (bytes) of a frame decoded whole; larger frames are streamed.
pub(super) const MAX_FRAME: u64 = 64 * 1024 * 1024;

/// Bytes asked of the input per read while a frame is gathered.
const READ_CHUNK: usize = 256 * 1024;

/// Helper threads decoding frames now, across the process.
static HELPERS_BUSY: AtomicUsize = AtomicUsize::new(0);

/// Helper threads that may decode at once: the cores but the one the reader runs on.
fn helper_limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from).saturating_sub(1))
}

/// A helper slot, released on drop.
struct HelperSlot;

impl HelperSlot {
    fn try_take() -> Option<HelperSlot> {
        HELPERS_BUSY
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |busy| (busy < helper_limit()).then_some(busy + 1))
            .ok()
            .map(|_| HelperSlot)
    }
}

impl Drop for HelperSlot {
    fn drop(&mut self) {
        HELPERS_BUSY.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The content size of the frame `head` starts if [`FrameDecoder`] decodes it whole: a
/// frame (not a skippable one) whose header holds a content size of at most [`MAX_FRAME`].
pub(super) fn whole_frame_size(head: &[u8]) -> Option<usize> {
    match zstd::zstd_safe::get_frame_content_size(head) {
        Ok(Some(n)) if n <= MAX_FRAME && !super::skippable_frame(head) => Some(n as usize),
        _ => None,
    }
}

/// One frame, compressed, and its content size in bytes.
struct Frame {
    bytes: Vec<u8>,
    content_size: usize,
}

impl Frame {
    fn decode(&self) -> io::Result<Vec<u8>> {
        // Fails unless the output is exactly the header's content size (zstd checks it).
        zstd::bulk::decompress(&self.bytes, self.content_size)
    }
}

/// A frame in order: to be decoded by the reader, or being decoded by a helper.
enum Slot {
    Here(Frame),
    Helper(mpsc::Receiver<io::Result<Vec<u8>>>),
}

/// Decodes a zstd input frame by frame on several cores (see the module documentation).
pub(super) struct FrameDecoder<'a> {
    input: Box<dyn Read + Send + 'a>,
    /// Input read past the last frame taken.
    pending: Vec<u8>,
    input_done: bool,
    /// Frames taken from the input, in order, not returned yet.
    slots: VecDeque<Slot>,
    /// The decoded frame being returned.
    out: Cursor<Vec<u8>>,
    /// The streaming decoder of the rest of the input, once a frame is not decoded whole.
    rest: Option<Box<dyn Read + Send + 'a>>,
}

impl<'a> FrameDecoder<'a> {
    pub(super) fn new(input: Box<dyn Read + Send + 'a>) -> Self {
        FrameDecoder { input, pending: Vec::new(), input_done: false, slots: VecDeque::new(), out: Cursor::new(Vec::new()), rest: None }
    }

    /// Reads more input into `pending`; false at its end.
    fn fill(&mut self) -> io::Result<bool> {
        if self.input_done {
            return Ok(false);
        }
        let start = self.pending.len();
        self.pending.resize(start + READ_CHUNK, 0);
        let n = loop {
            match self.input.read(&mut self.pending[start..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        self.pending.truncate(start + *n.as_ref().unwrap_or(&0));
        self.input_done = n? == 0;
        Ok(!self.input_done)
    }

    /// The next frame to decode whole; `None` at the end of the input, or when the next frame
    /// is to be streamed (then `rest` is set).
    fn next_frame(&mut self) -> io::Result<Option<Frame>> {
        if self.rest.is_some() {
            return Ok(None);
        }
        // A frame header is at most 18 bytes.
        while self.pending.len() < 18 && self.fill()? {}
        if self.pending.is_empty() {
            return Ok(None);
        }
        let content_size = match whole_frame_size(&self.pending) {
            Some(n) => n,
            None => {
                let rest = Cursor::new(std::mem::take(&mut self.pending)).chain(std::mem::replace(&mut self.input, Box::new(io::empty())));
                self.rest = Some(Box::new(zstd::stream::read::Decoder::new(rest)?));
                return Ok(None);
            }
        };
        let bound = zstd::zstd_safe::compress_bound(content_size) + 1024;
        loop {
            if let Ok(len) = zstd::zstd_safe::find_frame_compressed_size(&self.pending) {
                let rest = self.pending.split_off(len);
                return Ok(Some(Frame { bytes: std::mem::replace(&mut self.pending, rest), content_size }));
            }
            if self.pending.len() > bound {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("corrupt zstd frame: no end within {bound} bytes for {content_size} bytes of content")));
            }
            if !self.fill()? {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the zstd data ends inside a frame"));
            }
        }
    }

    /// Takes frames from the input while helpers are free to decode them ahead, and always
    /// one for this thread when none is taken.
    fn top_up(&mut self) -> io::Result<()> {
        loop {
            let slot = match self.slots.is_empty() {
                true => None,
                false => match HelperSlot::try_take() {
                    Some(slot) => Some(slot),
                    None => return Ok(()),
                },
            };
            let Some(frame) = self.next_frame()? else { return Ok(()) };
            self.slots.push_back(match slot {
                None => Slot::Here(frame),
                Some(helper) => {
                    let (tx, rx) = mpsc::sync_channel(1);
                    std::thread::spawn(move || {
                        let decoded = frame.decode();
                        drop(helper);
                        let _ = tx.send(decoded);
                    });
                    Slot::Helper(rx)
                }
            });
        }
    }
}

impl Read for FrameDecoder<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let n = self.out.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            self.top_up()?;
            let decoded = match self.slots.pop_front() {
                Some(Slot::Here(frame)) => frame.decode()?,
                Some(Slot::Helper(rx)) => rx.recv().map_err(|_| io::Error::other("a zstd decoding thread stopped"))??,
                None => return self.rest.as_mut().map_or(Ok(0), |rest| rest.read(buf)),
            };
            self.out = Cursor::new(decoded);
        }
    }
}

/// Writes zstd as independent frames of [`FRAME_SIZE`] input bytes, each with its content
/// size, on up to 4 cores per frame when parallel (Nix's `ZstdMultiFrameCompressionSink`).
pub struct FrameEncoder<W: Write> {
    out: W,
    frame: Vec<u8>,
    compressor: zstd::bulk::Compressor<'static>,
    wrote_frame: bool,
}

impl<W: Write> FrameEncoder<W> {
    /// `level`: zstd's compression level; `threads`: workers per frame (Nix caps them at 4).
    pub(super) fn new(out: W, level: i32, threads: u32) -> io::Result<Self> {
        let mut compressor = zstd::bulk::Compressor::new(level)?;
        if threads > 1 {
            compressor.set_parameter(zstd::zstd_safe::CParameter::NbWorkers(threads.min(4)))?;
        }
        Ok(FrameEncoder { out, frame: Vec::new(), compressor, wrote_frame: false })
    }

    fn emit_frame(&mut self) -> io::Result<()> {
        let packed = self.compressor.compress(&self.frame)?;
        self.out.write_all(&packed)?;
        self.frame.clear();
        self.wrote_frame = true;
        Ok(())
    }

    /// Writes the last frame (an empty one if nothing was written: a zstd stream has at least
    /// one frame) and returns the writer underneath.
    pub fn finish(mut self) -> io::Result<W> {
        if !self.frame.is_empty() || !self.wrote_frame {
            self.emit_frame()?;
        }
        Ok(self.out)
    }
}

impl<W: Write> Write for FrameEncoder<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(FRAME_SIZE - self.frame.len());
        self.frame.extend_from_slice(&buf[..n]);
        if self.frame.len() == FRAME_SIZE {
            self.emit_frame()?;
        }
        Ok(n)
    }

    /// Frames are written whole: flushes only the writer underneath.
    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compressible data that is not all alike, `len` bytes.
    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 7 + i / 4099) % 251) as u8).collect()
    }

    fn encode(input: &[u8], threads: u32) -> Vec<u8> {
        let mut e = FrameEncoder::new(Vec::new(), 3, threads).unwrap();
        e.write_all(input).unwrap();
        e.finish().unwrap()
    }

    fn decode(packed: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        FrameDecoder::new(Box::new(packed)).read_to_end(&mut out)?;
        Ok(out)
    }

    /// The encoder cuts a frame per 16 MiB, each with its content size; the decoder gives
    /// the input back, as the streaming decoder does.
    #[test]
    fn frames_round_trip() {
        let input = data(2 * FRAME_SIZE + 12345);
        let packed = encode(&input, 2);
        let first = zstd::zstd_safe::find_frame_compressed_size(&packed).unwrap();
        assert_eq!(zstd::zstd_safe::get_frame_content_size(&packed).unwrap(), Some(FRAME_SIZE as u64));
        let second = zstd::zstd_safe::find_frame_compressed_size(&packed[first..]).unwrap();
        let third = &packed[first + second..];
        assert_eq!(zstd::zstd_safe::get_frame_content_size(third).unwrap(), Some(12345));
        assert_eq!(zstd::zstd_safe::find_frame_compressed_size(third).unwrap(), third.len());
        assert_eq!(decode(&packed).unwrap(), input);
        assert_eq!(zstd::stream::decode_all(&packed[..]).unwrap(), input);
    }

    /// Nothing written is one empty frame.
    #[test]
    fn empty_input_is_one_empty_frame() {
        let packed = encode(b"", 1);
        assert_eq!(zstd::zstd_safe::get_frame_content_size(&packed).unwrap(), Some(0));
        assert_eq!(decode(&packed).unwrap(), b"");
    }

    /// Frames without a content size (a stream, as `zstd` writes it) after whole frames are
    /// streamed; skippable frames are skipped.
    #[test]
    fn streamed_frames_follow_whole_ones() {
        let (a, b) = (data(100_000), data(300_000));
        let mut packed = encode(&a, 1);
        packed.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]);
        let mut stream = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        stream.write_all(&b).unwrap();
        packed.extend(stream.finish().unwrap());
        assert_eq!(decode(&packed).unwrap(), [a, b].concat());
    }

    /// A frame cut short, or with a wrong checksum, fails; nothing is made up.
    #[test]
    fn damaged_frames_fail() {
        let input = data(FRAME_SIZE + 1000);
        let packed = {
            let mut c = zstd::bulk::Compressor::new(3).unwrap();
            c.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(true)).unwrap();
            [c.compress(&input[..FRAME_SIZE]).unwrap(), c.compress(&input[FRAME_SIZE..]).unwrap()].concat()
        };
        assert_eq!(decode(&packed).unwrap(), input);
        let cut = decode(&packed[..packed.len() - 3]).unwrap_err();
        assert_eq!(cut.kind(), io::ErrorKind::UnexpectedEof, "{cut}");
        let mut flipped = packed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(decode(&flipped).is_err());
    }
}
