//! NAR decompression by the narinfo's `Compression` field (`xz`, `zstd`, `bzip2`, `br`,
//! `gzip`, `lz4`, `lzip`, `none`; Nix `src/libutil/compression.cc` decodes all but `br` and
//! `none` through libarchive's filters, which is how it reads `lz4` and `lzip` caches),
//! checked against the stream's magic bytes so that a cache whose field disagrees with its
//! bytes gets a clear error instead of garbage. zstd and lz4 streams may begin with a
//! skippable frame (`pzstd` writes one before each frame), which their decoders skip.

use std::io::{BufRead, BufReader, Read};

/// A NAR compression method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression { None, Xz, Zstd, Bzip2, Brotli, Gzip, Lz4, Lzip }

/// Errors choosing or starting a decompressor.
#[derive(Debug, thiserror::Error)]
pub enum CompressionError {
    #[error("unknown compression method {0:?}")]
    Unknown(String),
    #[error("Compression is {declared} but the data starts like {actual}")]
    Mismatch { declared: &'static str, actual: &'static str },
    #[error("reading the start of the compressed data: {0}")]
    Io(#[from] std::io::Error),
}

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

    fn detect(head: &[u8]) -> Option<Compression> {
        MAGICS.iter().find(|(_, m)| head.starts_with(m)).map(|(c, _)| *c)
    }

    /// Wraps `input` in this method's decoder after checking its magic bytes. Brotli has no
    /// magic: a brotli stream is accepted unless it starts like another known format.
    pub fn decoder<'a>(self, input: impl Read + Send + 'a) -> Result<Box<dyn Read + Send + 'a>, CompressionError> {
        let mut buf = BufReader::with_capacity(256 * 1024, input);
        let head = buf.fill_buf()?;
        let head = &head[..head.len().min(21)];
        match (Compression::detect(head), self) {
            (Some(actual), declared) if actual != declared => {
                return Err(CompressionError::Mismatch { declared: declared.name(), actual: actual.name() })
            }
            (None, Compression::Brotli) => {}
            (None, Compression::Zstd | Compression::Lz4) if skippable_frame(head) => {}
            (None, declared) if !head.is_empty() => {
                return Err(CompressionError::Mismatch { declared: declared.name(), actual: "no known format" })
            }
            _ => {}
        }
        Ok(match self {
            Compression::None => Box::new(buf),
            Compression::Xz => Box::new(liblzma::bufread::XzDecoder::new_multi_decoder(buf)),
            Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(buf)?),
            Compression::Bzip2 => Box::new(bzip2::bufread::MultiBzDecoder::new(buf)),
            Compression::Brotli => Box::new(brotli::Decompressor::new(buf, 64 * 1024)),
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buf)),
            Compression::Lz4 => Box::new(lz4_flex::frame::FrameDecoder::new(buf)),
            Compression::Lzip => {
                // Every member, as `plzip` writes several; no memory limit, as libarchive's.
                let stream = liblzma::stream::Stream::new_lzip_decoder(u64::MAX, liblzma::stream::CONCATENATED).map_err(std::io::Error::other)?;
                Box::new(liblzma::bufread::XzDecoder::new_stream(buf, stream))
            }
        })
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

    #[test]
    fn mismatch_is_named() {
        let xz_bytes = b"\xfd7zXZ\x00rest".to_vec();
        let err = Compression::Zstd.decoder(&xz_bytes[..]).err().unwrap().to_string();
        assert_eq!(err, "Compression is zstd but the data starts like xz");
        assert!(matches!(Compression::parse("lz5"), Err(CompressionError::Unknown(_))));
    }
}
