//! NAR compression by the narinfo's `Compression` field (`xz`, `zstd`, `bzip2`, `br`,
//! `gzip`, `lz4`, `lzip`, `none`; Nix `src/libutil/compression.cc` decodes all but `br` and
//! `none` through libarchive's filters, which is how it reads `lz4` and `lzip` caches):
//! decoders checked against the stream's magic bytes so that a cache whose field disagrees
//! with its bytes gets a clear error instead of garbage (zstd and lz4 streams may begin with
//! a skippable frame, as `pzstd` writes them, which their decoders skip), and encoders for
//! writing a cache (`makeCompressionSink`).
//!
//! zstd is written as Nix 2.35 writes it, as independent 16 MiB frames, and such frames, like
//! the blocks of a multi-threaded xz stream, are decoded on several cores at once
//! ([`zstd_frames`], [`xz_streams`]); single-stream NARs are decoded as one stream.

pub mod encoder_memory;
mod lz4_frames;
mod xz_streams;
pub mod zstd_channel;
pub(crate) mod zstd_frames;
mod zstd_stream;

use std::io::{BufReader, Read, Write};

use crate::encoder_memory::{xz_preset, EncoderPlan};

/// The cores this process may run on (`std::thread::available_parallelism`, at least 1),
/// found once: each call of the standard function reads the cgroup's CPU quota files (three
/// to five system calls), which a push paid twice per path.
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// A NAR compression method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Xz,
    Zstd,
    Bzip2,
    Brotli,
    Gzip,
    Lz4,
    Lzip,
}

/// Errors choosing or starting a decompressor.
#[derive(Debug, thiserror::Error)]
pub enum CompressionError {
    #[error("unknown compression method {0:?}")]
    Unknown(String),
    #[error("Compression is {declared} but the data starts like {actual}")]
    Mismatch { declared: &'static str, actual: &'static str },
    /// The data starts like no format sluice knows (`head`: its first bytes, escaped).
    #[error("Compression is {declared} but the data starts with {head}, which is no known format")]
    Unrecognised { declared: &'static str, head: String },
    #[error("reading the start of the compressed data: {0}")]
    Io(#[from] std::io::Error),
}

/// Bytes read to recognise a format: the longest of [`MAGICS`] (a NAR's).
const MAGIC_LEN: usize = 21;

const MAGICS: [(Compression, &[u8]); 7] = [
    (Compression::Xz, b"\xfd7zXZ\x00"),
    (Compression::Lz4, b"\x04\x22\x4d\x18"),
    (Compression::Lzip, b"LZIP"),
    (Compression::Zstd, b"\x28\xb5\x2f\xfd"),
    (Compression::Bzip2, b"BZh"),
    (Compression::Gzip, b"\x1f\x8b"),
    (Compression::None, b"\x0d\x00\x00\x00\x00\x00\x00\x00nix-archive-1"),
];

impl Compression {
    /// Parses a narinfo `Compression` value (empty means `none`).
    pub fn parse(s: &str) -> Result<Self, CompressionError> {
        Ok(match s {
            "" | "none" => Compression::None,
            "xz" => Compression::Xz,
            "zstd" => Compression::Zstd,
            "bzip2" => Compression::Bzip2,
            "br" => Compression::Brotli,
            "gzip" => Compression::Gzip,
            "lz4" => Compression::Lz4,
            "lzip" => Compression::Lzip,
            other => return Err(CompressionError::Unknown(other.to_string())),
        })
    }

    /// Nix's name for the method.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Xz => "xz",
            Compression::Zstd => "zstd",
            Compression::Bzip2 => "bzip2",
            Compression::Brotli => "br",
            Compression::Gzip => "gzip",
            Compression::Lz4 => "lz4",
            Compression::Lzip => "lzip",
        }
    }

    /// The extension Nix gives a NAR compressed with this method (`nar/<hash>.nar<ext>`,
    /// `binary-cache-store.cc` `addToStoreCommon`): none for `none` and, as Nix writes it, for
    /// `gzip`.
    pub fn nar_extension(self) -> &'static str {
        match self {
            Compression::None | Compression::Gzip => "",
            Compression::Xz => ".xz",
            Compression::Zstd => ".zst",
            Compression::Bzip2 => ".bz2",
            Compression::Brotli => ".br",
            Compression::Lz4 => ".lz4",
            Compression::Lzip => ".lz",
        }
    }

    /// Wraps `out` in this method's encoder at `level` (`compression-level`; `None`: the
    /// library's default, as Nix's -1), on `plan.threads` threads (xz and zstd; the other
    /// methods have no multi-threaded encoder, as in Nix) and with `plan.xz_dict` as xz's
    /// dictionary (see [`EncoderPlan`]); xz is written as independent blocks of `plan.xz_block`
    /// bytes when set (`parallel-compression`). zstd is written as independent frames of
    /// 16 MiB of input, parallel or not (Nix 2.35's `ZstdMultiFrameCompressionSink`), so that
    /// readers can decode it on several cores.
    /// The encoder is finished by [`Encoder::finish`]. `lz4` and `lzip` are read only: an error.
    pub fn encoder<W: Write + Send + 'static>(self, out: W, level: Option<i32>, plan: &EncoderPlan) -> std::io::Result<Encoder<W>> {
        let threads = plan.threads.max(1);
        Ok(match self {
            Compression::None => Encoder::None(out),
            Compression::Xz => {
                let mut options = liblzma::stream::LzmaOptions::new_preset(xz_preset(level))?;
                options.dict_size(plan.xz_dict);
                let mut filters = liblzma::stream::Filters::new();
                filters.lzma2(&options);
                let check = liblzma::stream::Check::Crc64;
                let stream = match plan.xz_block {
                    None => liblzma::stream::Stream::new_stream_encoder(&filters, check)?,
                    Some(block) => liblzma::stream::MtStreamBuilder::new()
                        .threads(threads)
                        .block_size(block)
                        .filters(filters)
                        .check(check)
                        .encoder()?,
                };
                Encoder::Xz(liblzma::write::XzEncoder::new_stream(out, stream))
            }
            Compression::Zstd => {
                Encoder::Zstd(zstd_frames::FrameEncoder::new(out, level.unwrap_or(zstd::DEFAULT_COMPRESSION_LEVEL), threads)?)
            }
            Compression::Bzip2 => {
                Encoder::Bzip2(bzip2::write::BzEncoder::new(out, bzip2::Compression::new(level.map_or(9, |l| l.clamp(1, 9) as u32))))
            }
            Compression::Brotli => {
                Encoder::Brotli(Box::new(brotli::CompressorWriter::new(out, 64 * 1024, level.map_or(11, |l| l.clamp(0, 11) as u32), 22)))
            }
            Compression::Gzip => {
                Encoder::Gzip(flate2::write::GzEncoder::new(out, flate2::Compression::new(level.map_or(6, |l| l.clamp(0, 9) as u32))))
            }
            Compression::Lz4 | Compression::Lzip => {
                return Err(std::io::Error::other(format!(
                    "sluice reads {} caches but does not write them (choose xz, zstd, bzip2, br, gzip or none)",
                    self.name()
                )))
            }
        })
    }

    /// The format whose magic bytes `head` starts with ([`Compression::None`] for a NAR), if
    /// any.
    pub fn detect(head: &[u8]) -> Option<Compression> {
        MAGICS.iter().find(|(_, m)| head.starts_with(m)).map(|(c, _)| *c)
    }

    /// Wraps `input` in this method's decoder after checking its magic bytes; zstd frames that
    /// carry their content size and xz blocks that carry their sizes are decoded on several
    /// cores. Brotli has no
    /// magic: a brotli stream is accepted unless it starts like another known format.
    /// The magic bytes are read to their full length (or the end of the input) first, however
    /// the input is split: over HTTP/2 a first DATA frame may hold only a few bytes.
    pub fn decoder<'a>(self, input: impl Read + Send + 'a) -> Result<Box<dyn Read + Send + 'a>, CompressionError> {
        self.decoder_sized(input, None)
    }

    /// [`Compression::decoder`] for an input of about `size` bytes (the narinfo's
    /// `FileSize`): its read buffer is no larger than that (a buffer is zeroed once when it
    /// is first filled, 256 KiB per NAR otherwise).
    pub fn decoder_sized<'a>(self, input: impl Read + Send + 'a, size: Option<u64>) -> Result<Box<dyn Read + Send + 'a>, CompressionError> {
        self.decoder_with(input, size, true)
    }

    /// [`Compression::decoder_sized`] whose zstd frames are decoded as one stream on the
    /// caller's thread (`ZSTD_decompressStream`, with a context the process keeps and its
    /// window of at most a few MiB), never frame by frame on the helper threads into buffers
    /// of a whole frame (16 MiB): for callers that read several NARs at once, a NAR per core,
    /// where frames decoded whole would only add memory (a `store verify --check-contents` of
    /// 16 NARs of 64 MiB peaked at 428 MiB of RSS and faulted in 0.6 GiB).
    pub fn decoder_streamed<'a>(
        self,
        input: impl Read + Send + 'a,
        size: Option<u64>,
    ) -> Result<Box<dyn Read + Send + 'a>, CompressionError> {
        self.decoder_with(input, size, false)
    }

    /// The decoders' common part; `whole_frames`: whether zstd frames that carry their content
    /// size are decoded whole, on several cores.
    fn decoder_with<'a>(
        self,
        mut input: impl Read + Send + 'a,
        size: Option<u64>,
        whole_frames: bool,
    ) -> Result<Box<dyn Read + Send + 'a>, CompressionError> {
        let mut head = Vec::with_capacity(MAGIC_LEN);
        (&mut input).take(MAGIC_LEN as u64).read_to_end(&mut head)?;
        let buf = BufReader::with_capacity(read_buffer(size), std::io::Cursor::new(head.clone()).chain(input));
        let head = &head[..];
        match (Compression::detect(head), self) {
            (Some(actual), declared) if actual != declared => {
                return Err(CompressionError::Mismatch { declared: declared.name(), actual: actual.name() })
            }
            (None, Compression::Brotli) => {}
            (None, Compression::Zstd | Compression::Lz4) if skippable_frame(head) => {}
            // What is not a NAR is the NAR reader's to say: where and how it is not one.
            (None, Compression::None) => {}
            (None, declared) if !head.is_empty() => {
                return Err(CompressionError::Unrecognised { declared: declared.name(), head: sluice_nix::nar::show_bytes(head) })
            }
            _ => {}
        }
        Ok(match self {
            Compression::None => Box::new(buf),
            Compression::Xz => Box::new(xz_streams::XzStreams::new(buf)?),
            Compression::Zstd if whole_frames && zstd_frames::whole_frame_size(head).is_some() => {
                Box::new(zstd_frames::FrameDecoder::new(Box::new(buf)))
            }
            Compression::Zstd => Box::new(zstd_stream::StreamDecoder::new(buf)),
            Compression::Bzip2 => Box::new(bzip2::bufread::MultiBzDecoder::new(buf)),
            Compression::Brotli => Box::new(brotli::Decompressor::new(buf, 64 * 1024)),
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buf)),
            Compression::Lz4 => Box::new(lz4_frames::Lz4Frames::new(buf)),
            Compression::Lzip => {
                // Every member, as `plzip` writes several; no memory limit, as libarchive's.
                let stream =
                    liblzma::stream::Stream::new_lzip_decoder(u64::MAX, liblzma::stream::CONCATENATED).map_err(std::io::Error::other)?;
                Box::new(liblzma::bufread::XzDecoder::new_stream(buf, stream))
            }
        })
    }
}

/// Bytes of a read buffer for a stream of about `size` bytes: 256 KiB, or less for a
/// smaller stream (at least 8 KiB: the size is a hint).
pub fn read_buffer(size: Option<u64>) -> usize {
    const MAX: u64 = 256 * 1024;
    size.map_or(MAX, |s| s.clamp(8 * 1024, MAX)) as usize
}

/// Bytes of the buffer a decoded NAR is parsed from. The parser's small reads (tags, lengths,
/// names) are served from it; a file's contents, read in chunks at least this large, bypass
/// it (`BufReader` hands such reads straight to the decoder), so that the contents are copied
/// once between the decoder and the file, and a NAR does not get a buffer as large as itself,
/// to be zeroed and faulted in (docs/benchmarks.md).
pub const NAR_READ_BUFFER: usize = 8 * 1024;

/// A compressing writer made by [`Compression::encoder`].
pub enum Encoder<W: Write> {
    None(W),
    Xz(liblzma::write::XzEncoder<W>),
    Zstd(zstd_frames::FrameEncoder<W>),
    Bzip2(bzip2::write::BzEncoder<W>),
    Brotli(Box<brotli::CompressorWriter<W>>),
    Gzip(flate2::write::GzEncoder<W>),
}

impl<W: Write> Encoder<W> {
    /// Writes the end of the compressed stream and returns the writer underneath.
    pub fn finish(self) -> std::io::Result<W> {
        match self {
            Encoder::None(w) => Ok(w),
            Encoder::Xz(e) => e.finish(),
            Encoder::Zstd(e) => e.finish(),
            Encoder::Bzip2(e) => e.finish(),
            Encoder::Brotli(mut e) => {
                e.flush()?;
                Ok(e.into_inner())
            }
            Encoder::Gzip(e) => e.finish(),
        }
    }
}

impl<W: Write> Write for Encoder<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Encoder::None(w) => w.write(buf),
            Encoder::Xz(e) => e.write(buf),
            Encoder::Zstd(e) => e.write(buf),
            Encoder::Bzip2(e) => e.write(buf),
            Encoder::Brotli(e) => e.write(buf),
            Encoder::Gzip(e) => e.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Encoder::None(w) => w.flush(),
            Encoder::Xz(e) => e.flush(),
            Encoder::Zstd(e) => e.flush(),
            Encoder::Bzip2(e) => e.flush(),
            Encoder::Brotli(e) => e.flush(),
            Encoder::Gzip(e) => e.flush(),
        }
    }
}

/// Whether `head` starts with a skippable frame (magic 0x184D2A50–0x184D2A5F, little
/// endian), which the zstd and lz4 frame formats share.
fn skippable_frame(head: &[u8]) -> bool {
    head.len() >= 4 && head[0] & 0xf0 == 0x50 && head[1..4] == [0x2a, 0x4d, 0x18]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Input that arrives a few bytes per read, as a first HTTP/2 DATA frame may.
    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(3);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn magic_split_over_reads_is_recognised() {
        let nar = b"\x0d\x00\x00\x00\x00\x00\x00\x00nix-archive-1\x00\x00\x00rest";
        let mut out = Vec::new();
        Compression::None.decoder(Trickle(nar)).unwrap().read_to_end(&mut out).unwrap();
        assert_eq!(out, nar);
    }

    #[test]
    fn mismatch_is_named() {
        let xz_bytes = b"\xfd7zXZ\x00rest".to_vec();
        let err = Compression::Zstd.decoder(&xz_bytes[..]).err().unwrap().to_string();
        assert_eq!(err, "Compression is zstd but the data starts like xz");
        assert!(matches!(Compression::parse("lz5"), Err(CompressionError::Unknown(_))));
        // Bytes of no known format are shown; uncompressed, they are the NAR reader's to judge.
        let page = b"<html>\n<body>".to_vec();
        let err = Compression::Xz.decoder(&page[..]).err().unwrap().to_string();
        assert_eq!(err, "Compression is xz but the data starts with '<html>\\n<body>', which is no known format");
        let mut out = Vec::new();
        Compression::None.decoder(&page[..]).unwrap().read_to_end(&mut out).unwrap();
        assert_eq!(out, page);
    }

    #[test]
    fn every_encoder_round_trips() {
        let _serial = crate::zstd_frames::tests::serial();
        let contents: Vec<u8> = (0..200_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        let data = sluice_nix::nar::writer::regular_file_nar(&contents, false);
        for c in [Compression::None, Compression::Xz, Compression::Zstd, Compression::Bzip2, Compression::Brotli, Compression::Gzip] {
            for parallel in [false, true] {
                let plan = EncoderPlan::new(c, None, parallel, data.len() as u64, 2, crate::encoder_memory::ENCODER_MEMORY);
                let mut e = c.encoder(Vec::new(), None, &plan).unwrap();
                e.write_all(&data).unwrap();
                let packed = e.finish().unwrap();
                let mut back = Vec::new();
                c.decoder(&packed[..]).unwrap().read_to_end(&mut back).unwrap();
                assert_eq!(back, data, "{} parallel={parallel}", c.name());
            }
        }
    }
}
