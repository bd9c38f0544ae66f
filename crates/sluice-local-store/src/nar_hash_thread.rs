//! The sha256 of a NAR being unpacked (its `NarHash`, as Nix's `HashSink` in
//! `src/libstore/local-store.cc` `addToStore` computes it while restoring the NAR), computed
//! on a thread of its own for big NARs: the unpacking thread then only parses and writes,
//! and hashing runs beside it (and beside the decompression helpers, see
//! `compression/zstd_frames.rs`). Small NARs are hashed inline: a thread costs more than
//! their hash.

use std::io::{self, Read};
use std::sync::mpsc;
use std::thread::JoinHandle;

use sluice_nix::hash::{Hash, HashAlgo, Hasher};

/// NARs of at least this many bytes are hashed on their own thread.
pub(super) const THREADED_FROM: u64 = 4 << 20;

/// Bytes handed to the hashing thread at once.
const CHUNK: usize = 1 << 20;

/// Chunks waiting for the hashing thread: memory is bounded by (this + 2) × [`CHUNK`].
const QUEUED: usize = 4;

enum Sink {
    Here(Hasher),
    /// `chunk` is being filled; hashed chunks come back on `used`, to be filled again (a
    /// fresh 1 MiB allocation per chunk cost a page fault per 4 KiB).
    Thread {
        chunk: Vec<u8>,
        tx: mpsc::SyncSender<Vec<u8>>,
        used: mpsc::Receiver<Vec<u8>>,
        hasher: JoinHandle<Hasher>,
    },
}

/// A reader that computes the sha256 of everything read through it, on its own thread when
/// threaded.
pub(super) struct NarHashingReader<R> {
    inner: R,
    len: u64,
    sink: Sink,
}

impl<R: Read> NarHashingReader<R> {
    /// Wraps `inner`; `threaded`: hash on a thread of its own (for NARs of at least
    /// [`THREADED_FROM`] bytes).
    pub(super) fn new(inner: R, threaded: bool) -> Self {
        let sink = match threaded {
            false => Sink::Here(Hasher::new(HashAlgo::Sha256)),
            true => {
                let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(QUEUED);
                let (give_back, used) = mpsc::sync_channel::<Vec<u8>>(QUEUED + 2);
                let hasher = std::thread::Builder::new().name("nar-hash".into()).spawn(move || {
                    let mut hasher = Hasher::new(HashAlgo::Sha256);
                    for mut chunk in rx {
                        hasher.update(&chunk);
                        chunk.clear();
                        // Fails only once the reader is done; the chunk is then freed.
                        let _ = give_back.try_send(chunk);
                    }
                    hasher
                });
                match hasher {
                    Ok(hasher) => Sink::Thread { chunk: Vec::with_capacity(CHUNK), tx, used, hasher },
                    // No thread to be had: hash here.
                    Err(_) => Sink::Here(Hasher::new(HashAlgo::Sha256)),
                }
            }
        };
        NarHashingReader { inner, len: 0, sink }
    }

    /// Bytes read so far.
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// The sha256 of everything read, and the inner reader.
    pub(super) fn finish(self) -> io::Result<(Hash, R)> {
        let hash = match self.sink {
            Sink::Here(hasher) => hasher.finish(),
            Sink::Thread { chunk, tx, hasher, .. } => {
                if !chunk.is_empty() {
                    tx.send(chunk).map_err(|_| stopped())?;
                }
                drop(tx);
                hasher.join().map_err(|_| stopped())?.finish()
            }
        };
        Ok((hash, self.inner))
    }
}

fn stopped() -> io::Error {
    io::Error::other("the NAR hashing thread stopped")
}

impl<R: Read> Read for NarHashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut data = buf.get(..n).unwrap_or(&[]);
        self.len += data.len() as u64;
        match &mut self.sink {
            Sink::Here(hasher) => hasher.update(data),
            Sink::Thread { chunk, tx, used, .. } => {
                while !data.is_empty() {
                    let take = data.len().min(CHUNK - chunk.len());
                    chunk.extend_from_slice(&data[..take]);
                    data = &data[take..];
                    if chunk.len() == CHUNK {
                        let next = used.try_recv().unwrap_or_else(|_| Vec::with_capacity(CHUNK));
                        tx.send(std::mem::replace(chunk, next)).map_err(|_| stopped())?;
                    }
                }
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threaded or not, the hash and length are those of the bytes read, across chunk
    /// boundaries and reads of any size.
    #[test]
    fn threaded_hash_equals_inline_hash() {
        let data: Vec<u8> = (0..(3 * CHUNK + 12345)).map(|i| (i * 31 % 251) as u8).collect();
        let expected = Hash::digest_bytes(HashAlgo::Sha256, &data);
        for threaded in [false, true] {
            let mut reader = NarHashingReader::new(&data[..], threaded);
            let mut buf = vec![0u8; 70_001];
            let mut got = Vec::new();
            loop {
                let n = reader.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            assert_eq!(reader.len(), data.len() as u64);
            let (hash, _) = reader.finish().unwrap();
            assert_eq!(hash, expected, "threaded: {threaded}");
            assert_eq!(got, data);
        }
        assert_eq!(expected.to_base16(), sha256_hex(&data));
    }

    /// sha256 by coreutils' `sha256sum`, an independent implementation.
    fn sha256_hex(data: &[u8]) -> String {
        use std::io::Write;
        let mut child = std::process::Command::new("sha256sum")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(data).unwrap();
        let out = child.wait_with_output().unwrap();
        String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_owned()
    }
}
