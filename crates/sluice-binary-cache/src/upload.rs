//! Preparing a NAR for a binary cache, as Nix's `BinaryCacheStore::addToStoreCommon`
//! (`src/libstore/binary-cache-store.cc`) does, but streaming: the NAR is read once, checked
//! against the path's `NarHash`/`NarSize` and parsed (for its listing), while it is compressed
//! into memory or a temporary file ([`super::spool`]) whose sha256 (`FileHash`, and S3's
//! `x-amz-content-sha256`), MD5 (S3's `Content-MD5`) and size are computed on the way. Memory:
//! the encoder's (see [`EncoderPlan`]), 64 KiB of buffer and the spool's, whatever the NAR's
//! size.

use std::io::{self, Read, Write};
use std::path::Path;

use md5::Digest as _;
use sluice_nix::hash::{Hash, HashAlgo, Hasher};
use sluice_nix::nar::listing::{ListingBuilder, NarEntry};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StoreDir;

use super::spool::{Compressed, SpoolWriter};
use crate::url::CacheWriteParams;
use sluice_compress::encoder_memory::EncoderPlan;

/// A compressed NAR, ready to upload.
pub struct PreparedNar {
    /// The compressed NAR, in memory or in a temporary file.
    pub compressed: Compressed,
    /// sha256 of the compressed bytes (`FileHash`).
    pub file_hash: Hash,
    /// MD5 of the compressed bytes, when asked for (S3's `Content-MD5`).
    pub md5: Option<[u8; 16]>,
    /// Bytes of the compressed NAR (`FileSize`).
    pub file_size: u64,
    /// The NAR's listing, when `write-nar-listing` asks for it.
    pub listing: Option<NarEntry>,
}

/// Why a NAR could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("reading or compressing the NAR of {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("the NAR of {path} is invalid: {source}")]
    Nar {
        path: String,
        #[source]
        source: sluice_nix::nar::reader::NarError,
    },
    #[error("the NAR of {path} does not match its info: NarHash {expected}, NarSize {expected_size}, but the NAR has {actual} and {actual_size} bytes")]
    Mismatch { path: String, expected: String, expected_size: u64, actual: String, actual_size: u64 },
}

/// Reads `nar` (the NAR of `info.path`, on a blocking thread), checks it against `info`, and
/// compresses it as `params` and `plan` say, into memory if `in_memory` and it is small (see
/// [`SpoolWriter`]), else into a temporary file in `tmp_dir`; the MD5 of the compressed bytes
/// is computed only `with_md5`.
#[allow(clippy::too_many_arguments)] // each is one decision of the caller's; a struct would only rename them
pub fn prepare_nar(
    store_dir: &StoreDir,
    info: &ValidPathInfo,
    nar: &mut dyn Read,
    params: &CacheWriteParams,
    plan: &EncoderPlan,
    tmp_dir: &Path,
    in_memory: bool,
    with_md5: bool,
) -> Result<PreparedNar, PrepareError> {
    let path = store_dir.display_path(&info.path);
    let io_err = |source| PrepareError::Io { path: path.clone(), source };
    let out = SpoolWriter::new(tmp_dir, in_memory).map_err(io_err)?;
    let sink = DigestWriter { inner: out, sha256: Hasher::new(HashAlgo::Sha256), md5: with_md5.then(md5::Md5::new) };
    let encoder = params.compression.encoder(sink, params.compression_level, plan).map_err(io_err)?;
    let mut tee = Tee {
        inner: nar,
        buf: vec![0; TEE_CHUNK].into_boxed_slice(),
        filled: 0,
        passed: 0,
        read: 0,
        nar_hash: Hasher::new(HashAlgo::Sha256),
        out: encoder,
        error: None,
    };
    let mut listing = ListingBuilder::default();
    let parsed = sluice_nix::nar::reader::parse(&mut tee, &mut listing);
    let passed = if parsed.is_ok() { tee.pass_consumed() } else { Ok(()) };
    if let Some(e) = tee.error.take() {
        return Err(io_err(e));
    }
    parsed.map_err(|source| PrepareError::Nar { path: path.clone(), source })?;
    passed.map_err(io_err)?;
    let nar_size = tee.nar_hash.len();
    let nar_hash = std::mem::replace(&mut tee.nar_hash, Hasher::new(HashAlgo::Sha256)).finish();
    if nar_hash != info.nar_hash || nar_size != info.nar_size {
        return Err(PrepareError::Mismatch {
            path,
            expected: info.nar_hash.to_nix32_prefixed(),
            expected_size: info.nar_size,
            actual: nar_hash.to_nix32_prefixed(),
            actual_size: nar_size,
        });
    }
    let sink = tee.out.finish().map_err(io_err)?;
    let file_size = sink.sha256.len();
    Ok(PreparedNar {
        compressed: sink.inner.finish().map_err(io_err)?,
        file_hash: sink.sha256.finish(),
        md5: sink.md5.map(|m| m.finalize().into()),
        file_size,
        listing: if params.write_nar_listing { listing.finish() } else { None },
    })
}

/// The `.ls` file Nix writes beside a narinfo with `write-nar-listing=true`:
/// `{"version":1,"root":LISTING}` with the recursive listing and `narOffset`s.
pub fn listing_json(root: &NarEntry) -> Vec<u8> {
    let mut out = br#"{"version":1,"root":"#.to_vec();
    out.extend_from_slice(&root.to_json(true, sluice_nix::nar::listing::JsonKeys::Nix2_8));
    out.push(b'}');
    out
}

/// Bytes a [`Tee`] reads from its NAR at a time.
const TEE_CHUNK: usize = 64 << 10;

/// Reads the NAR [`TEE_CHUNK`] bytes at a time for the parser, and passes what the parser has
/// consumed through the NAR's hasher and into the writer (the encoder) a chunk at a time: the
/// parser reads each 8-byte token apart, which were a hash update and an encoder call each.
/// Bytes read past the NAR's end, which the parser never asks for, are neither hashed nor
/// written. A write failure is kept aside, to be reported as itself rather than as a NAR error.
struct Tee<'a, W: Write> {
    inner: &'a mut dyn Read,
    buf: Box<[u8]>,
    /// `buf[..filled]` came from `inner`; the parser has read `buf[..read]`, of which
    /// `buf[..passed]` went through the hasher and the writer.
    filled: usize,
    read: usize,
    passed: usize,
    nar_hash: Hasher,
    out: W,
    error: Option<io::Error>,
}

impl<W: Write> Tee<'_, W> {
    /// Hashes and writes what the parser has read and was not passed on yet.
    fn pass_consumed(&mut self) -> io::Result<()> {
        let consumed = &self.buf[self.passed..self.read];
        self.nar_hash.update(consumed);
        self.passed = self.read;
        if let Err(e) = self.out.write_all(consumed) {
            let what = e.to_string();
            self.error = Some(e);
            return Err(io::Error::other(what));
        }
        Ok(())
    }
}

impl<W: Write> Read for Tee<'_, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.read == self.filled {
            self.pass_consumed()?;
            self.filled = self.inner.read(&mut self.buf)?;
            (self.read, self.passed) = (0, 0);
        }
        let n = buf.len().min(self.filled - self.read);
        buf[..n].copy_from_slice(&self.buf[self.read..self.read + n]);
        self.read += n;
        Ok(n)
    }
}

/// A writer that hashes (sha256, and MD5 if it has one) and counts what goes through it.
struct DigestWriter<W: Write> {
    inner: W,
    sha256: Hasher,
    md5: Option<md5::Md5>,
}

impl<W: Write> Write for DigestWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sha256.update(&buf[..n]);
        if let Some(md5) = &mut self.md5 {
            md5.update(&buf[..n]);
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
