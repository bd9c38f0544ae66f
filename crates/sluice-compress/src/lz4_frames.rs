//! lz4 as concatenated frames, as libarchive's lz4 filter reads them for Nix
//! (`archive_read_support_filter_lz4.c`: after a frame's end mark, the next frame, skippable
//! frame or legacy frame, until the input ends) and as `lz4 -m` or `cat` of several `.lz4` files
//! writes them. The frame format is the one of lz4's `doc/lz4_Frame_format.md`; the blocks are
//! decoded by lz4_flex's block decoder.
//!
//! The frames are parsed here rather than by lz4_flex's `FrameDecoder`, which gives each frame a
//! buffer of the largest block its header declares and zeroes it (4 MiB, or 8 MiB for linked
//! blocks): thousands of tiny frames from a hostile cache then cost seconds. Here one buffer
//! serves all frames; it grows to what a block can decode to (at most 255 bytes a compressed
//! byte, at most the declared block size) and is never zeroed again, so that the work is
//! proportional to the bytes read and decoded.

use std::hash::Hasher;
use std::io::{self, BufRead, Read};

use twox_hash::XxHash32;

/// The magic number of an lz4 frame.
const MAGIC: u32 = 0x184D_2204;
/// The magic number of a legacy frame (`lz4 -l`): 8 MiB blocks, independent, compressed.
const LEGACY_MAGIC: u32 = 0x184C_2102;
/// A legacy frame's largest block, decoded, and compressed (lz4's `LZ4_compressBound`).
const LEGACY_BLOCK: usize = 8 << 20;
const LEGACY_COMPRESSED_BLOCK: usize = LEGACY_BLOCK + LEGACY_BLOCK / 255 + 16;
/// How far back a linked block's matches may reach into the output before it.
const WINDOW: usize = 64 << 10;
/// The most bytes one byte of a compressed block decodes to (a match length's extra bytes
/// add 255 each; a sequence's 3 bytes of token and offset give at most 19).
const MAX_EXPANSION: usize = 255;
/// The bit of a block's size that says that the block is stored uncompressed.
const UNCOMPRESSED: u32 = 1 << 31;

/// Whether `magic` is one of a skippable frame's (`0x184D2A50` to `0x184D2A5F`).
fn skippable(magic: u32) -> bool {
    magic & 0xFFFF_FFF0 == 0x184D_2A50
}

/// An error in the lz4 data: `what`, in frame `frame` (counted from 1, skippable ones too).
fn invalid(frame: u64, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("lz4 frame {frame}: {what}"))
}

/// Reads `buf` whole; the input's end inside it is an error naming `what` and the frame.
fn read_exact(input: &mut impl Read, buf: &mut [u8], frame: u64, what: &str) -> io::Result<()> {
    input.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => io::Error::new(e.kind(), format!("lz4 frame {frame}: the data ends inside {what}")),
        _ => e,
    })
}

/// A little-endian `u32`; the input's end inside it is an error naming `what`.
fn read_u32(input: &mut impl Read, frame: u64, what: &str) -> io::Result<u32> {
    let mut b = [0; 4];
    read_exact(input, &mut b, frame, what)?;
    Ok(u32::from_le_bytes(b))
}

/// A little-endian `u32`, or `None` if the input ends before it.
fn read_u32_or_end(input: &mut impl BufRead, frame: u64, what: &str) -> io::Result<Option<u32>> {
    if input.fill_buf()?.is_empty() {
        return Ok(None);
    }
    read_u32(input, frame, what).map(Some)
}

/// What a frame's header says, and what has been decoded of it.
struct Frame {
    /// The largest block, decoded.
    block_max: usize,
    /// Whether a block's matches may reach into the blocks before it.
    linked: bool,
    legacy: bool,
    block_checksums: bool,
    /// The hash of the contents, if the frame ends with their checksum.
    content_hash: Option<XxHash32>,
    content_size: Option<u64>,
    decoded: u64,
}

impl Frame {
    /// A legacy frame, whose magic number has been read.
    fn legacy() -> Frame {
        let (linked, block_checksums, content_hash, content_size) = (false, false, None, None);
        Frame { block_max: LEGACY_BLOCK, linked, legacy: true, block_checksums, content_hash, content_size, decoded: 0 }
    }

    /// Reads the frame descriptor after the magic number of frame `n`, checking its checksum.
    fn read(input: &mut impl Read, n: u64) -> io::Result<Frame> {
        let mut descriptor = [0; 2 + 8];
        read_exact(input, &mut descriptor[..2], n, "the frame descriptor")?;
        let [flags, bd] = [descriptor[0], descriptor[1]];
        if flags >> 6 != 1 {
            return Err(invalid(n, format_args!("version {} of the frame format, not 1", flags >> 6)));
        }
        if flags & 0b10 != 0 || bd & 0x8F != 0 {
            return Err(invalid(n, format_args!("reserved bits set in the frame descriptor ({flags:#04x} {bd:#04x})")));
        }
        if flags & 1 != 0 {
            return Err(invalid(n, "a dictionary ID: dictionaries are not supported"));
        }
        let block_max = match bd >> 4 {
            4 => 64 << 10,
            5 => 256 << 10,
            6 => 1 << 20,
            7 => 4 << 20,
            other => return Err(invalid(n, format_args!("block size {other} (not 4 to 7)"))),
        };
        let mut len = 2;
        let content_size = if flags & 0b1000 != 0 {
            read_exact(input, &mut descriptor[2..10], n, "the frame descriptor")?;
            len = 10;
            let mut size = [0; 8];
            size.copy_from_slice(&descriptor[2..10]);
            Some(u64::from_le_bytes(size))
        } else {
            None
        };
        let mut checksum = [0];
        read_exact(input, &mut checksum, n, "the frame descriptor")?;
        let expected = (XxHash32::oneshot(0, &descriptor[..len]) >> 8) as u8;
        if checksum[0] != expected {
            return Err(invalid(n, format_args!("header checksum {:#04x}, not {expected:#04x}", checksum[0])));
        }
        let content_hash = (flags & 0b100 != 0).then(|| XxHash32::with_seed(0));
        Ok(Frame {
            block_max,
            linked: flags & 0x20 == 0,
            legacy: false,
            block_checksums: flags & 0x10 != 0,
            content_hash,
            content_size,
            decoded: 0,
        })
    }

    /// Checks the frame's end against its content size and checksum, which it reads.
    fn finish(self, input: &mut impl Read, n: u64) -> io::Result<()> {
        if let Some(size) = self.content_size.filter(|&size| size != self.decoded) {
            return Err(invalid(n, format_args!("{} bytes decoded, but the header says {size}", self.decoded)));
        }
        if let Some(hash) = self.content_hash {
            let (checksum, actual) = (read_u32(input, n, "the content checksum")?, hash.finish() as u32);
            if checksum != actual {
                return Err(invalid(n, format_args!("content checksum {checksum:#010x}, but the contents hash to {actual:#010x}")));
            }
        }
        Ok(())
    }
}

/// What comes where a frame's next block size is expected.
enum Next {
    /// A block of this many bytes, compressed or not.
    Block { len: usize, compressed: bool },
    /// The frame's end mark (or, for a legacy frame, the input's end).
    End,
    /// A legacy frame's end: the magic number of the frame after it, which has been read.
    Frame(u32),
}

/// Decodes the lz4 frames of its input one after another, to the end of the input, skipping
/// skippable frames.
pub(super) struct Lz4Frames<R: BufRead> {
    input: R,
    /// The frame being decoded, if any, and its number.
    frame: Option<Frame>,
    frames: u64,
    /// The magic number of the next frame, read as the end of a legacy frame.
    next_magic: Option<u32>,
    /// The compressed block, and the decoded one: both only grow, so each is zeroed at most
    /// once up to its largest size, not once a frame.
    src: Vec<u8>,
    block: Vec<u8>,
    /// The bytes of `block` not read yet.
    start: usize,
    end: usize,
    /// The last decoded bytes of a frame of linked blocks (at least [`WINDOW`] of them when
    /// there are so many, and at most twice that, so that it is moved once a [`WINDOW`]).
    window: Vec<u8>,
}

impl<R: BufRead> Lz4Frames<R> {
    pub(super) fn new(input: R) -> Self {
        let (src, block, window) = (Vec::new(), Vec::new(), Vec::new());
        Lz4Frames { input, frame: None, frames: 0, next_magic: None, src, block, start: 0, end: 0, window }
    }

    /// Reads the next frame's header, skipping skippable frames; `None` at the input's end.
    fn next_frame(&mut self) -> io::Result<Option<Frame>> {
        loop {
            self.frames += 1;
            let n = self.frames;
            let magic = match self.next_magic.take() {
                Some(magic) => magic,
                None => match read_u32_or_end(&mut self.input, n, "a magic number")? {
                    Some(magic) => magic,
                    None => return Ok(None),
                },
            };
            if skippable(magic) {
                let len = read_u32(&mut self.input, n, "a skippable frame's size")?;
                let skipped = io::copy(&mut (&mut self.input).take(u64::from(len)), &mut io::sink())?;
                if skipped < u64::from(len) {
                    let what = format!("lz4 frame {n}: the data ends inside a skippable frame ({skipped} of its {len} bytes)");
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, what));
                }
                continue;
            }
            return match magic {
                LEGACY_MAGIC => Ok(Some(Frame::legacy())),
                MAGIC => Frame::read(&mut self.input, n).map(Some),
                _ => Err(invalid(n, format_args!("magic number {magic:#010x}, not an lz4 frame's"))),
            };
        }
    }

    /// What comes next in `frame`: a block, its end or (legacy frames) the next frame.
    fn next_in(&mut self, frame: &Frame) -> io::Result<Next> {
        let n = self.frames;
        if !frame.legacy {
            let size = read_u32(&mut self.input, n, "a block size")?;
            let len = (size & !UNCOMPRESSED) as usize;
            if len > frame.block_max {
                return Err(invalid(n, format_args!("a block of {len} bytes, but the header says at most {}", frame.block_max)));
            }
            return Ok(if size == 0 { Next::End } else { Next::Block { len, compressed: size & UNCOMPRESSED == 0 } });
        }
        Ok(match read_u32_or_end(&mut self.input, n, "a block size")? {
            None => Next::End,
            Some(magic) if magic == MAGIC || magic == LEGACY_MAGIC || skippable(magic) => Next::Frame(magic),
            Some(len) if len as usize > LEGACY_COMPRESSED_BLOCK => {
                return Err(invalid(n, format_args!("a legacy block of {len} bytes, more than {LEGACY_COMPRESSED_BLOCK}")));
            }
            Some(len) => Next::Block { len: len as usize, compressed: true },
        })
    }

    /// Reads and decodes a block of `len` bytes of `frame` into `block[..end]`.
    fn decode(&mut self, frame: &mut Frame, len: usize, compressed: bool) -> io::Result<()> {
        let n = self.frames;
        self.src.clear();
        let read = (&mut self.input).take(len as u64).read_to_end(&mut self.src)?;
        if read < len {
            let what = format!("lz4 frame {n}: the data ends inside a block ({read} of its {len} bytes)");
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, what));
        }
        if frame.block_checksums {
            let (checksum, actual) = (read_u32(&mut self.input, n, "a block checksum")?, XxHash32::oneshot(0, &self.src));
            if checksum != actual {
                return Err(invalid(n, format_args!("block checksum {checksum:#010x}, but the block hashes to {actual:#010x}")));
            }
        }
        let room = if compressed { frame.block_max.min(len.saturating_mul(MAX_EXPANSION)) } else { len };
        if self.block.len() < room {
            self.block.resize(room, 0);
        }
        let decoded = if compressed {
            let window = if frame.linked { &self.window[self.window.len().saturating_sub(WINDOW)..] } else { &[][..] };
            lz4_flex::block::decompress_into_with_dict(&self.src, &mut self.block[..room], window)
                .map_err(|e| invalid(n, format_args!("a block of {len} bytes does not decode: {e}")))?
        } else {
            self.block[..len].copy_from_slice(&self.src);
            len
        };
        let out = &self.block[..decoded];
        if frame.linked {
            if decoded >= WINDOW {
                self.window.clear();
            } else if self.window.len() + decoded > 2 * WINDOW {
                self.window.drain(..self.window.len() - WINDOW);
            }
            self.window.extend_from_slice(&out[decoded.saturating_sub(WINDOW)..]);
        }
        if let Some(hash) = &mut frame.content_hash {
            hash.write(out);
        }
        frame.decoded += decoded as u64;
        (self.start, self.end) = (0, decoded);
        Ok(())
    }

    /// Decodes the next block that has bytes into `block[start..end]`; false at the input's end.
    fn next_block(&mut self) -> io::Result<bool> {
        loop {
            let mut frame = match self.frame.take() {
                Some(frame) => frame,
                None => match self.next_frame()? {
                    Some(frame) => {
                        self.window.clear();
                        frame
                    }
                    None => return Ok(false),
                },
            };
            match self.next_in(&frame)? {
                Next::Block { len, compressed } => {
                    self.decode(&mut frame, len, compressed)?;
                    self.frame = Some(frame);
                    if self.end > 0 {
                        return Ok(true);
                    }
                }
                Next::End => frame.finish(&mut self.input, self.frames)?,
                Next::Frame(magic) => self.next_magic = Some(magic),
            }
        }
    }
}

impl<R: BufRead> Read for Lz4Frames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.start == self.end && !self.next_block()? {
            return Ok(0);
        }
        let len = buf.len().min(self.end - self.start);
        buf[..len].copy_from_slice(&self.block[self.start..self.start + len]);
        self.start += len;
        Ok(len)
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

    /// A frame of `data` in 4 MiB blocks, `mode`'s blocks.
    fn lz4_4mib(data: &[u8], mode: lz4_flex::frame::BlockMode) -> Vec<u8> {
        let info = lz4_flex::frame::FrameInfo::new().block_size(lz4_flex::frame::BlockSize::Max4MB).block_mode(mode);
        let mut e = lz4_flex::frame::FrameEncoder::with_frame_info(info, Vec::new());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    /// Thousands of tiny frames that each declare 4 MiB blocks (independent and linked) decode
    /// in time proportional to their bytes (before, each frame zeroed a 4 MiB buffer, and 8 MiB
    /// for linked blocks: these 4000 frames took 109 s), to the right bytes.
    #[test]
    fn tiny_frames_of_large_blocks_decode_fast() {
        use lz4_flex::frame::BlockMode::{Independent, Linked};
        let (a, b) = (b"a tiny frame, a tiny frame, a tiny frame, a tiny frame.\n", b"and another one, another one!\n");
        let pair = [lz4_4mib(a, Independent), lz4_4mib(b, Linked)].concat();
        assert!(pair.len() < 100, "{} bytes: not a compressed block each", pair.len());
        let frames = 2_000;
        let packed = pair.repeat(frames);
        let start = std::time::Instant::now();
        let mut out = Vec::new();
        crate::Compression::Lz4.decoder(&packed[..]).unwrap().read_to_end(&mut out).unwrap();
        let took = start.elapsed();
        assert!(out == [&a[..], &b[..]].concat().repeat(frames), "{} bytes", out.len());
        assert!(took < std::time::Duration::from_secs(2), "{} frames of {} bytes took {took:?}", 2 * frames, packed.len());
    }

    fn decode(packed: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        crate::Compression::Lz4.decoder(packed).unwrap().read_to_end(&mut out).map(|_| out)
    }

    /// Linked 64 KiB blocks whose matches reach back across blocks, and a 4 MiB block of zeros
    /// (as compressed as lz4 gets), with block and content checksums and the content size,
    /// decode whole; a byte changed in a block, or a content size that is not the contents',
    /// fails naming what.
    #[test]
    fn linked_blocks_and_checksums() {
        use lz4_flex::frame::{BlockMode, BlockSize, FrameInfo};
        let text: Vec<u8> = (0..200_000u32).flat_map(|i| format!("line {} of {}\n", i % 7919, i % 13).into_bytes()).collect();
        let frame = |data: &[u8], size: BlockSize, content_size: Option<u64>| {
            let info = FrameInfo::new().block_size(size).block_mode(BlockMode::Linked).block_checksums(true).content_checksum(true);
            let mut e = lz4_flex::frame::FrameEncoder::with_frame_info(info.content_size(content_size), Vec::new());
            e.write_all(data).unwrap();
            e.finish().unwrap()
        };
        let zeros = vec![0u8; 4 << 20];
        let packed = [frame(&text, BlockSize::Max64KB, Some(text.len() as u64)), frame(&zeros, BlockSize::Max4MB, None)].concat();
        assert!(decode(&packed).unwrap() == [&text[..], &zeros[..]].concat());
        let mut corrupt = packed.clone();
        corrupt[1000] ^= 1;
        assert!(decode(&corrupt).unwrap_err().to_string().contains("lz4 frame 1: block checksum"));
        let mut wrong_size = packed.clone();
        wrong_size[6..14].copy_from_slice(&(text.len() as u64 + 1).to_le_bytes());
        wrong_size[14] = (XxHash32::oneshot(0, &wrong_size[4..14]) >> 8) as u8;
        let e = decode(&wrong_size).unwrap_err().to_string();
        assert!(e.contains(&format!("lz4 frame 1: {} bytes decoded, but the header says {}", text.len(), text.len() + 1)), "{e}");
    }

    /// A legacy frame (`lz4 -l`) ends at the next frame's magic number or at the input's end.
    #[test]
    fn legacy_frames() {
        let (a, b) = (b"legacy legacy legacy legacy".to_vec(), b"modern".to_vec());
        let block = lz4_flex::block::compress(&a);
        let legacy = [&0x184C_2102u32.to_le_bytes()[..], &(block.len() as u32).to_le_bytes(), &block].concat();
        assert!(decode(&[lz4(&b), legacy.clone(), lz4(&b), legacy.clone()].concat()).unwrap() == [&b[..], &a, &b, &a].concat());
        assert!(decode(&[lz4(&b), legacy[..legacy.len() - 1].to_vec()].concat()).is_err());
    }
}
