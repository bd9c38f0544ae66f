//! A cache's NAR file read once for `sluice store verify --check-contents`: the bytes of the
//! file hashed (`FileHash`), decompressed, and the NAR hashed (`NarHash`; Nix's `nix store
//! verify`, `src/nix/verify.cc`, hashes only this one). Nothing is compared here: the caller
//! compares what this finds with the narinfo.
//!
//! The work is in two stages: this thread reads the file, hashes it and decompresses it into
//! pieces of [`PIECE`] bytes; for a NAR of at least [`PIPELINE_FROM`] bytes, a thread of its
//! own hashes the pieces, so that one NAR's work spreads over two cores when fewer NARs than
//! cores are left (the two stages cost about the same: SHA-256 of the compressed bytes and
//! the decompression, SHA-256 of the decompressed ones). Memory is bounded per NAR by the
//! decoder's window (zstd is decoded as one stream, [`Compression::decoder_streamed`]) and
//! [`PIECES`] pieces, reused from piece to piece. An uncompressed file whose `FileHash` is of
//! `NarHash`'s algorithm is the NAR itself, and is hashed once.

use std::io::{self, Read};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

use sluice_compress::Compression;
use sluice_nix::hash::{Hash, HashAlgo, Hasher, HashingReader};

/// Bytes of a piece of decompressed NAR handed to the hashing thread.
const PIECE: usize = 1024 * 1024;

/// Bytes, at most, of the piece a NAR hashed on the reading thread is decompressed into (the
/// NAR's size if smaller, at least 8 KiB): it is zeroed for every NAR, which must cost little
/// beside the hashing in a cache of many small NARs.
const SMALL_PIECE: usize = 64 * 1024;

/// Pieces of a NAR being filled or hashed at once.
const PIECES: usize = 4;

/// NAR size (bytes) from which the NAR is hashed on a thread of its own.
const PIPELINE_FROM: u64 = 4 * 1024 * 1024;

/// What reading a NAR file found.
pub(super) struct NarFile {
    /// The size and hash of the NAR the file decompressed to, or why it did not decompress to
    /// its end.
    pub decoded: Result<(u64, Hash), String>,
    /// The hash of the file's bytes, all of them (past the end of the compressed stream too).
    pub file_hash: Hash,
    /// How many bytes the file has.
    pub file_size: u64,
}

/// What the narinfo says of the file, for reading it.
pub(super) struct Expected {
    /// `Compression`.
    pub compression: Compression,
    /// The algorithm of `FileHash` (SHA-256 when there is none).
    pub file_algo: HashAlgo,
    /// `FileSize`, if given.
    pub file_size: Option<u64>,
    /// The algorithm of `NarHash`.
    pub nar_algo: HashAlgo,
    /// `NarSize`: from this size the NAR is hashed on a thread of its own.
    pub nar_size: u64,
}

/// Reads the NAR file `file` whole (see the module documentation). Blocks: call it on a
/// blocking thread. Fails only if the hashing thread stopped without its hash.
pub(super) fn read(file: Box<dyn Read + Send>, expected: &Expected) -> Result<NarFile, String> {
    let mut raw = HashingReader::new(file, expected.file_algo);
    if expected.compression == Compression::None && expected.file_algo == expected.nar_algo {
        let read = io::copy(&mut raw, &mut io::sink()).map_err(|e| e.to_string());
        let file_size = raw.len();
        let file_hash = raw.finish().0;
        return Ok(NarFile { decoded: read.map(|_| (file_size, file_hash.clone())), file_hash, file_size });
    }
    let mut sink = NarSink::new(expected.nar_algo, expected.nar_size);
    let decoded = expected
        .compression
        .decoder_streamed(&mut raw, expected.file_size)
        .map_err(|e| e.to_string())
        .and_then(|mut decoder| pump(&mut decoder, &mut sink).map_err(|e| e.to_string()));
    // The rest of the file, past the end of the compressed stream, counts for FileSize.
    let rest = io::copy(&mut raw, &mut io::sink()).map_err(|e| e.to_string());
    let file_size = raw.len();
    let nar = sink.finish()?;
    let decoded = decoded.and(rest).map(|_| (nar.len(), nar.finish()));
    Ok(NarFile { decoded, file_hash: raw.finish().0, file_size })
}

/// Decompresses `decoder` into pieces for `sink`, until its end.
fn pump(decoder: &mut impl Read, sink: &mut NarSink) -> io::Result<()> {
    let mut piece = sink.piece()?;
    let mut filled = 0;
    loop {
        let n = match decoder.read(&mut piece[filled..]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => other?,
        };
        filled += n;
        if filled == piece.len() || (n == 0 && filled > 0) {
            piece = sink.hash(piece, filled)?;
            filled = 0;
        }
        if n == 0 {
            return Ok(());
        }
    }
}

/// Where the decompressed pieces are hashed.
enum NarSink {
    /// On this thread (a small NAR, or no thread could be started).
    Here { hasher: Box<Hasher>, piece: Option<Vec<u8>> },
    /// On a thread of its own: pieces go to it filled, and come back to be filled again.
    Thread { filled: SyncSender<(Vec<u8>, usize)>, free: Receiver<Vec<u8>>, hashing: JoinHandle<Hasher> },
}

impl NarSink {
    fn new(algo: HashAlgo, nar_size: u64) -> NarSink {
        let here = || NarSink::Here {
            hasher: Box::new(Hasher::new(algo)),
            piece: Some(vec![0; (nar_size as usize).clamp(8 * 1024, SMALL_PIECE)]),
        };
        if nar_size < PIPELINE_FROM {
            return here();
        }
        let (filled, to_hash) = sync_channel::<(Vec<u8>, usize)>(PIECES);
        let (give_back, free) = sync_channel(PIECES);
        for _ in 0..PIECES {
            // The channel has room for every piece.
            let _ = give_back.send(vec![0; PIECE]);
        }
        let hashing = std::thread::Builder::new().name("nar-hash".into()).spawn(move || {
            let mut hasher = Hasher::new(algo);
            for (piece, len) in to_hash {
                hasher.update(&piece[..len]);
                // This thread's pieces are all back when the reader stopped taking them.
                let _ = give_back.send(piece);
            }
            hasher
        });
        match hashing {
            Ok(hashing) => NarSink::Thread { filled, free, hashing },
            Err(_) => here(),
        }
    }

    /// A piece to fill.
    fn piece(&mut self) -> io::Result<Vec<u8>> {
        match self {
            NarSink::Here { piece, .. } => Ok(piece.take().unwrap_or_default()),
            NarSink::Thread { free, .. } => free.recv().map_err(|_| stopped()),
        }
    }

    /// Hashes the first `len` bytes of `piece`; the next piece to fill.
    fn hash(&mut self, piece: Vec<u8>, len: usize) -> io::Result<Vec<u8>> {
        match self {
            NarSink::Here { hasher, .. } => {
                hasher.update(&piece[..len]);
                Ok(piece)
            }
            NarSink::Thread { filled, .. } => {
                filled.send((piece, len)).map_err(|_| stopped())?;
                self.piece()
            }
        }
    }

    /// The hash of every piece.
    fn finish(self) -> Result<Hasher, String> {
        match self {
            NarSink::Here { hasher, .. } => Ok(*hasher),
            NarSink::Thread { filled, hashing, .. } => {
                drop(filled);
                hashing.join().map_err(|_| stopped().to_string())
            }
        }
    }
}

fn stopped() -> io::Error {
    io::Error::other("the thread hashing the decompressed NAR stopped")
}
