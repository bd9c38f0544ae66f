//! xz decoding on several cores: liblzma's multi-threaded decoder (`lzma_stream_decoder_mt`,
//! xz 5.4+) decodes the blocks of a stream in parallel when their headers carry their sizes,
//! as the multi-threaded encoder writes them (Nix's `parallel-compression=true` for xz, through
//! libarchive's `xz:threads`); a stream written by one thread (one block without sizes, as
//! Nix writes by default) is decoded on the caller's thread as before. Concatenated streams and
//! the stream padding between them are read as xz's `--single-stream`-less decoder reads them
//! (the multi-threaded decoder takes no `LZMA_CONCATENATED` flag in the bindings: each stream
//! gets its own decoder here).

use std::io::{self, BufRead, Read};

use liblzma::bufread::XzDecoder;
use liblzma::stream::{MtStreamBuilder, Stream};

/// Memory (bytes) one decoder may use for its threads before it decodes on fewer of them
/// (liblzma's `memlimit_threading`): two 24 MiB blocks (Nix's, at preset 6) in and out.
const MEMLIMIT_THREADING: u64 = 128 * 1024 * 1024;

/// Decodes the xz streams of its input one after another, each on up to every core.
pub(super) struct XzStreams<R: BufRead> {
    /// The current stream's decoder; `None` once the input has ended.
    decoder: Option<XzDecoder<R>>,
}

fn mt_stream() -> io::Result<Stream> {
    let threads = crate::cores() as u32;
    let mut builder = MtStreamBuilder::new();
    builder.threads(threads).memlimit_threading(MEMLIMIT_THREADING).memlimit_stop(u64::MAX);
    builder.decoder().map_err(io::Error::other)
}

impl<R: BufRead> XzStreams<R> {
    pub(super) fn new(input: R) -> io::Result<Self> {
        Ok(XzStreams { decoder: Some(XzDecoder::new_stream(input, mt_stream()?)) })
    }
}

/// Skips stream padding (NUL bytes, a multiple of 4 between streams); true if more input
/// follows it.
fn skip_padding(input: &mut impl BufRead) -> io::Result<bool> {
    let mut skipped = 0usize;
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            return match skipped % 4 {
                0 => Ok(false),
                _ => Err(io::Error::new(io::ErrorKind::InvalidData, "xz stream padding is not a multiple of 4 bytes")),
            };
        }
        let zeros = buf.iter().take_while(|b| **b == 0).count();
        let more = zeros < buf.len();
        input.consume(zeros);
        skipped += zeros;
        if more {
            return match skipped % 4 {
                0 => Ok(true),
                _ => Err(io::Error::new(io::ErrorKind::InvalidData, "xz stream padding is not a multiple of 4 bytes")),
            };
        }
    }
}

impl<R: BufRead> Read for XzStreams<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while let Some(mut decoder) = self.decoder.take() {
            match decoder.read(buf) {
                // The end of this stream.
                Ok(0) if !buf.is_empty() => {}
                read => {
                    self.decoder = Some(decoder);
                    return read;
                }
            }
            let mut input = decoder.into_inner();
            if skip_padding(&mut input)? {
                self.decoder = Some(XzDecoder::new_stream(input, mt_stream()?));
            }
        }
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn xz(data: &[u8], threads: u32) -> Vec<u8> {
        let mut builder = MtStreamBuilder::new();
        builder.threads(threads).preset(0).block_size(256 * 1024);
        let mut e = liblzma::write::XzEncoder::new_stream(Vec::new(), builder.encoder().unwrap());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn decode(packed: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        XzStreams::new(packed)?.read_to_end(&mut out)?;
        Ok(out)
    }

    /// Many blocks, concatenated streams and padding between them decode to the input.
    #[test]
    fn blocks_and_streams_round_trip() {
        let a: Vec<u8> = (0..3_000_000u32).map(|i| ((i % 253) ^ (i / 7919)) as u8).collect();
        let b = b"second stream".to_vec();
        let packed = [xz(&a, 2), vec![0; 8], xz(&b, 1)].concat();
        assert_eq!(decode(&packed).unwrap(), [a.clone(), b].concat());
        let odd_padding = [xz(&a, 2), vec![0; 3]].concat();
        assert_eq!(decode(&odd_padding).unwrap_err().to_string(), "xz stream padding is not a multiple of 4 bytes");
        let cut = xz(&a, 2);
        assert!(decode(&cut[..cut.len() - 10]).is_err());
    }
}
