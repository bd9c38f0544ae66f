//! How much memory a NAR encoder may take, and how many threads it gets within that: one
//! budget ([`ENCODER_MEMORY`]) shared by every encoder of a push, so that a push's peak RSS
//! does not grow with the cores or with the NARs compressed at once.
//!
//! Nix (`src/libutil/compression.cc`, `makeCompressionSink`) gives the xz encoder
//! `lzma_cputhreads()` threads and zstd `ZSTD_c_nbWorkers` = the cores when
//! `parallel-compression` is on, whatever that costs: a preset-6 xz thread is ~118 MiB (its
//! 8 MiB dictionary's match finder, one 24 MiB block in, one out). Here a [`EncoderPlan`] takes
//! as many threads as fit in the budget (at least one), and shrinks xz's dictionary to the
//! NAR's size, as the `xz` tool does for an input of known size (the output decodes the same
//! and compresses the same: no match can reach further back than the input's start).

use crate::Compression;

/// Bytes all encoders of one push may use at once, by the estimates below (one preset-6 xz
/// thread with blocks, 117 MiB by liblzma's estimate, fits): a 1 GiB NAR pushed with xz or
/// zstd, parallel or not, stays under 150 MiB of peak RSS.
pub const ENCODER_MEMORY: u64 = 120 << 20;

/// The smallest dictionary LZMA2 accepts (`LZMA_DICT_SIZE_MIN`).
const XZ_MIN_DICT: u64 = 4096;

/// How one NAR is to be compressed: threads, xz dictionary, and the memory that takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderPlan {
    /// Encoder threads (1: the single-threaded encoder).
    pub threads: u32,
    /// xz: the LZMA2 dictionary in bytes (the preset's, or less for a small NAR).
    pub xz_dict: u32,
    /// xz with `parallel-compression`: independent blocks of this many bytes of NAR, which a
    /// reader may decompress on several cores: the dictionary's size, where liblzma's default
    /// is three times that (a thread holds a block in and one out: preset 6 with 24 MiB blocks
    /// is 165 MiB a thread by liblzma's estimate, with 8 MiB blocks 101 MiB).
    pub xz_block: Option<u64>,
    /// Estimated bytes the encoder holds (liblzma's own estimate for xz; see
    /// [`zstd_worker_memory`] for zstd).
    pub memory: u64,
}

impl EncoderPlan {
    /// The plan for a NAR of `nar_size` bytes compressed with `method` at `level` (`None`:
    /// the method's default), on up to `cores` threads when `parallel`, within `budget` bytes.
    /// A level whose single thread exceeds the budget (xz -9: ~674 MiB) still gets one thread.
    pub fn new(method: Compression, level: Option<i32>, parallel: bool, nar_size: u64, cores: u32, budget: u64) -> Self {
        let max_threads = if parallel && matches!(method, Compression::Xz | Compression::Zstd) { cores.max(1) } else { 1 };
        let xz_dict = xz_dict(level, nar_size);
        let xz_block = (parallel && method == Compression::Xz).then(|| u64::from(xz_dict));
        let cost = |threads: u32| match method {
            Compression::Xz => xz_memory(level, xz_dict, xz_block, threads),
            Compression::Zstd => zstd_worker_memory(level) * u64::from(threads) + zstd_frame_memory(nar_size),
            Compression::Brotli => 64 << 20,
            Compression::Bzip2 => 8 << 20,
            _ => 1 << 20,
        };
        let threads = (1..=max_threads).rev().find(|t| *t == 1 || cost(*t) <= budget).unwrap_or(1);
        EncoderPlan { threads, xz_dict, xz_block, memory: cost(threads) }
    }
}

/// The xz preset of `level` (`compression-level`; Nix's default -1 is liblzma's 6).
pub(crate) fn xz_preset(level: Option<i32>) -> u32 {
    level.map_or(6, |l| l.clamp(0, 9) as u32)
}

/// The preset's dictionary, or the smallest power of two holding the whole NAR if less.
fn xz_dict(level: Option<i32>, nar_size: u64) -> u32 {
    // liblzma's presets 0–9 (`lzma_lzma_preset`).
    const PRESET_DICT: [u64; 10] = [256 << 10, 1 << 20, 2 << 20, 4 << 20, 4 << 20, 8 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20];
    PRESET_DICT[xz_preset(level) as usize].min(nar_size.max(XZ_MIN_DICT).next_power_of_two()) as u32
}

/// liblzma's estimate of an xz encoder's memory (`lzma_stream_encoder_mt_memusage`; for the
/// single-threaded encoder, without blocks, that of one thread less its two blocks).
fn xz_memory(level: Option<i32>, dict: u32, block: Option<u64>, threads: u32) -> u64 {
    let Ok(mut options) = liblzma::stream::LzmaOptions::new_preset(xz_preset(level)) else { return u64::MAX };
    options.dict_size(dict);
    let mut filters = liblzma::stream::Filters::new();
    filters.lzma2(&options);
    let mut builder = liblzma::stream::MtStreamBuilder::new();
    builder.threads(threads).filters(filters).block_size(block.unwrap_or(u64::from(dict)));
    match block {
        Some(_) => builder.memusage(),
        None => builder.memusage().saturating_sub(2 * u64::from(dict)),
    }
}

/// Bytes zstd's frame encoder holds besides its workers: one frame of NAR (at most
/// [`FRAME_SIZE`](crate::zstd_frames::FRAME_SIZE)) and its compressed bound.
fn zstd_frame_memory(nar_size: u64) -> u64 {
    2 * nar_size.min(crate::zstd_frames::FRAME_SIZE as u64)
}

/// Bytes one zstd worker holds at `level`: about ten times the level's window (zstd's
/// `ZSTD_defaultCParameters` for inputs over 256 KiB: 512 KiB at level 1, 2 MiB at 3, 8 MiB
/// from 17, 32–128 MiB for the ultra levels 20–22): the match tables, one job of four
/// windows in and its bound out. Measured: level 3 on two workers, 40 MiB over the process's
/// baseline.
pub(crate) fn zstd_worker_memory(level: Option<i32>) -> u64 {
    let level = level.unwrap_or(zstd::DEFAULT_COMPRESSION_LEVEL);
    let window_log = match level {
        ..=1 => 19,
        2 => 20,
        3..=5 => 21,
        6..=16 => 22,
        17..=19 => 23,
        20 => 25,
        21 => 26,
        _ => 27,
    };
    10u64 << window_log
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn xz_threads_fit_the_budget() {
        // Preset 6 with an 8 MiB dictionary: one thread with blocks fits, two do not.
        let big = EncoderPlan::new(Compression::Xz, None, true, 1 << 30, 8, ENCODER_MEMORY);
        assert_eq!((big.threads, big.xz_dict), (1, 8 << 20));
        assert!(big.memory > 90 * MIB && big.memory <= ENCODER_MEMORY, "{}", big.memory);
        // A small NAR gets a small dictionary, and then several threads fit.
        let small = EncoderPlan::new(Compression::Xz, None, true, 300_000, 8, ENCODER_MEMORY);
        assert_eq!(small.xz_dict, 512 << 10);
        assert!(small.threads > 1 && small.memory <= ENCODER_MEMORY, "{small:?}");
        // xz -9 does not fit even alone: one thread.
        assert_eq!(EncoderPlan::new(Compression::Xz, Some(9), true, 1 << 30, 8, ENCODER_MEMORY).threads, 1);
        assert_eq!(EncoderPlan::new(Compression::Xz, None, false, 1 << 30, 8, ENCODER_MEMORY).threads, 1);
    }

    #[test]
    fn zstd_threads_fit_the_budget() {
        // Level 3: 20 MiB a worker, and 32 MiB for the 16 MiB frame in and its bound out.
        assert_eq!(EncoderPlan::new(Compression::Zstd, None, true, 1 << 30, 8, ENCODER_MEMORY).threads, 4);
        assert_eq!(EncoderPlan::new(Compression::Zstd, Some(19), true, 1 << 30, 8, ENCODER_MEMORY).threads, 1);
        assert_eq!(EncoderPlan::new(Compression::Zstd, None, true, 1 << 30, 2, ENCODER_MEMORY).threads, 2);
        assert_eq!(EncoderPlan::new(Compression::Gzip, None, true, 1 << 30, 8, ENCODER_MEMORY).threads, 1);
    }
}
