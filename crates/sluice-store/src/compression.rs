//! NAR decompression by the narinfo's `Compression` field (`xz`, `zstd`, `bzip2`, `br`,
//! `gzip`, `none`; Nix `src/libutil/compression.cc`), checked against the stream's magic bytes
//! so that a cache whose field disagrees with its bytes gets a clear error instead of garbage.

use std::io::{BufRead, BufReader, Read};

/// A NAR compression method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression { None, Xz, Zstd, Bzip2, Brotli, Gzip }

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

const MAGICS: [(Compression, &[u8]); 5] = [
    (Compression::Xz, b"\xfd7zXZ\x00"),
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
        })
    }
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
