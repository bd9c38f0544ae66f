//! One NAR file fetched from an upstream once, however many clients ask for it meanwhile
//! (`sluice serve --upstream`, [`crate::upstream`]): the bytes, as the upstream compressed
//! them, go into a temporary file that every client reads from the start at its own pace
//! ([`Follower`]) while a verifier decompresses them and checks `NarHash`/`NarSize` (and the
//! file's own `FileHash`/`FileSize`). A client gets the last byte only once everything checked
//! out: a NAR that fails ends every client's body in an error, so no client ever holds a whole
//! NAR that was not verified. As Nix's `BinaryCacheStore::narFromPath` checks what it
//! downloads (`src/libstore/binary-cache-store.cc`), but once for all clients.
//!
//! An upstream cannot make the fetch go on for ever: the file is read up to its `FileSize`
//! (the `NarSize` of an uncompressed one, else the largest NAR the server takes) and no
//! further, the verifier decompresses no more than `NarSize` and a byte, and the verifier's
//! failure (a file that does not decompress, or decompresses to more) stops the fetch at once.
//! A fetch fails either because the file is not what its narinfo says ([`Failure::Corrupt`])
//! or because it was not got whole ([`Failure::Unfetched`]).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use sluice_binary_cache::BinaryCache;
use sluice_compress::Compression;
use sluice_nix::hash::{Hash, HashAlgo, Hasher};
use tokio::sync::watch;

/// Bytes read from the upstream at a time.
const CHUNK: usize = 64 * 1024;

/// How far the fetch is.
#[derive(Clone, Debug)]
enum State {
    /// This many bytes are in the file, more to come.
    Writing(u64),
    /// All the bytes are in the file; being checked.
    Written(u64),
    /// Checked: the file is whole and right.
    Verified(u64),
    /// Failed, and why.
    Failed(String),
}

/// What the NAR file must be, from the narinfo it was fetched by.
#[derive(Clone, Debug)]
pub struct Expected {
    pub compression: Compression,
    pub nar_hash: Hash,
    pub nar_size: u64,
    pub file_hash: Option<Hash>,
    pub file_size: Option<u64>,
    /// The most bytes spooled of a compressed file whose narinfo gives no `FileSize` (the
    /// largest NAR the server takes, `--upstream-max-nar-size`).
    pub max_size: u64,
}

/// Why a fetch failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The file is not what its narinfo says (its hash or size, or it does not decompress):
    /// never to be fetched from that upstream again.
    Corrupt(String),
    /// The file was not got whole (the upstream does not have it, the transfer broke, or it
    /// could not be spooled): it may be fetched again later.
    Unfetched(String),
}

impl Failure {
    /// The failure, its reason prefixed with `context`.
    fn within(self, context: &str) -> Failure {
        match self {
            Failure::Corrupt(why) => Failure::Corrupt(format!("{context}: {why}")),
            Failure::Unfetched(why) => Failure::Unfetched(format!("{context}: {why}")),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Corrupt(why) | Failure::Unfetched(why) => f.write_str(why),
        }
    }
}

/// A NAR file being fetched; clients follow it with [`Flight::follow`].
pub struct Flight {
    file: Arc<File>,
    state: watch::Receiver<State>,
}

/// The outcome of a fetch, once it ends: the verified file, or why it failed.
pub type Outcome = tokio::task::JoinHandle<Result<Fetched, Failure>>;

/// What a fetch that checked out leaves: the file, its sha256 and size.
pub struct Fetched {
    pub file: tempfile::NamedTempFile,
    pub file_hash: Hash,
    pub file_size: u64,
}

impl Flight {
    /// Starts fetching `rel` from `upstream` into `spool`, checked against `expected`; the
    /// flight, and the fetch's outcome (the verified file, or why it failed).
    pub fn start(
        upstream: Arc<BinaryCache>,
        rel: String,
        spool: tempfile::NamedTempFile,
        expected: Expected,
    ) -> std::io::Result<(Arc<Flight>, Outcome)> {
        let file = Arc::new(spool.reopen()?);
        let (tx, rx) = watch::channel(State::Writing(0));
        let flight = Arc::new(Flight { file: file.clone(), state: rx.clone() });
        let url = format!("{}/{rel}", upstream.url());
        let fetch = tokio::spawn(async move {
            let outcome = fetch(&upstream, &rel, spool, &tx, Follower { file, state: rx, offset: 0, verifier: true }, expected).await;
            let outcome = outcome.map_err(|e| e.within(&url));
            tx.send_replace(match &outcome {
                Ok(f) => State::Verified(f.file_size),
                Err(e) => State::Failed(e.to_string()),
            });
            outcome
        });
        Ok((flight, fetch))
    }

    /// A reader of the file from its start (to be read on a blocking thread).
    pub fn follow(&self) -> Follower {
        Follower { file: self.file.clone(), state: self.state.clone(), offset: 0, verifier: false }
    }
}

/// Copies the upstream's file into `spool` while the verifier checks it.
async fn fetch(
    upstream: &BinaryCache,
    rel: &str,
    mut spool: tempfile::NamedTempFile,
    tx: &watch::Sender<State>,
    verifier: Follower,
    expected: Expected,
) -> Result<Fetched, Failure> {
    let Some(stream) = upstream.open_file(rel).await.map_err(|e| Failure::Unfetched(e.to_string()))? else {
        return Err(Failure::Unfetched("the upstream has no such file".into()));
    };
    let (compression, nar_size) = (expected.compression, expected.nar_size);
    // The most bytes read, and what says so.
    let (most, bound) = match (expected.file_size, compression) {
        (Some(size), _) => (size, "the FileSize"),
        (None, Compression::None) => (nar_size, "the NarSize"),
        (None, _) => (expected.max_size, "--upstream-max-nar-size, without a FileSize,"),
    };
    let verifier_tx = tx.clone();
    let verify = tokio::task::spawn_blocking(move || -> Result<(Hash, u64), String> {
        let checked = (|| {
            let nar = compression.decoder(verifier).map_err(|e| e.to_string())?;
            let mut hasher = Hasher::new(HashAlgo::Sha256);
            std::io::copy(&mut nar.take(nar_size.saturating_add(1)), &mut hasher).map_err(|e| format!("decompressing: {e}"))?;
            match hasher.len() {
                size if size > nar_size => Err(format!("it decompresses to more than the NarSize of {nar_size} bytes the narinfo gives")),
                size => Ok((hasher.finish(), size)),
            }
        })();
        if let Err(e) = &checked {
            // The fetch stops too.
            verifier_tx.send_replace(State::Failed(e.clone()));
        }
        checked
    });
    let tx2 = tx.clone();
    // A copy stopped by the verifier's failure fails with `None`: the verifier says why.
    let copy = tokio::task::spawn_blocking(move || -> Result<(tempfile::NamedTempFile, Hash, u64), Option<Failure>> {
        let mut reader = stream.reader;
        let mut hasher = Hasher::new(HashAlgo::Sha256);
        let mut buf = vec![0; CHUNK];
        loop {
            let n = reader.read(&mut buf).map_err(|e| Failure::Unfetched(format!("reading: {e}")))?;
            if n == 0 {
                break;
            }
            if hasher.len() + n as u64 > most {
                return Err(Some(Failure::Corrupt(format!("the upstream sent more than {bound} of {most} bytes"))));
            }
            let written = spool.as_file_mut().write_all(&buf[..n]);
            written.map_err(|e| Failure::Unfetched(format!("writing {}: {e}", spool.path().display())))?;
            hasher.update(&buf[..n]);
            let len = hasher.len();
            let going_on = |s: &mut State| match s {
                State::Failed(_) => false,
                _ => {
                    *s = State::Writing(len);
                    true
                }
            };
            if !tx2.send_if_modified(going_on) {
                return Err(None);
            }
        }
        let size = hasher.len();
        tx2.send_replace(State::Written(size));
        Ok((spool, hasher.finish(), size))
    });
    let copied = copy.await.map_err(|e| Some(Failure::Unfetched(e.to_string()))).and_then(|r| r);
    if let Err(Some(e)) = &copied {
        // The verifier waits for more bytes: it stops on the failure.
        tx.send_replace(State::Failed(e.to_string()));
    }
    let verified = verify.await.map_err(|e| Failure::Unfetched(e.to_string())).and_then(|r| r.map_err(Failure::Corrupt));
    let (file, file_hash, file_size) = match copied {
        Ok(copied) => copied,
        // Failed by itself: that is why the verifier failed too, if it did.
        Err(Some(failure)) => return Err(failure),
        Err(None) => return Err(verified.err().unwrap_or_else(|| Failure::Corrupt("the verifier stopped the fetch".into()))),
    };
    let (nar_hash, nar_size) = verified?;
    let mismatch = |what: &str, want: String, got: String| Err(Failure::Corrupt(format!("{what} is {got}, the narinfo says {want}")));
    if let Some(want) = expected.file_size.filter(|w| *w != file_size) {
        return mismatch("FileSize", want.to_string(), file_size.to_string());
    }
    if let Some(want) = expected.file_hash.filter(|w| *w != file_hash) {
        return mismatch("FileHash", want.to_nix32_prefixed(), file_hash.to_nix32_prefixed());
    }
    if nar_size != expected.nar_size {
        return mismatch("NarSize", expected.nar_size.to_string(), nar_size.to_string());
    }
    if nar_hash != expected.nar_hash {
        return mismatch("NarHash", expected.nar_hash.to_nix32_prefixed(), nar_hash.to_nix32_prefixed());
    }
    Ok(Fetched { file, file_hash, file_size })
}

/// A blocking reader of a [`Flight`]'s file from its start, waiting for the bytes still being
/// fetched. Only the verifier reads the last byte before the file is verified; a failed fetch
/// is every reader's error.
pub struct Follower {
    file: Arc<File>,
    state: watch::Receiver<State>,
    offset: u64,
    verifier: bool,
}

impl Read for Follower {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let state = self.state.borrow_and_update().clone();
            let (visible, done) = match state {
                State::Writing(n) => (if self.verifier { n } else { n.saturating_sub(1) }, false),
                State::Written(n) => (if self.verifier { n } else { n.saturating_sub(1) }, self.verifier),
                State::Verified(n) => (n, true),
                State::Failed(e) => return Err(std::io::Error::other(e)),
            };
            if self.offset < visible {
                let want = buf.len().min(usize::try_from(visible - self.offset).unwrap_or(usize::MAX));
                let n = self.file.read_at(&mut buf[..want], self.offset)?;
                if n == 0 {
                    return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the fetched file is shorter than written"));
                }
                self.offset += n as u64;
                return Ok(n);
            }
            if done || buf.is_empty() {
                return Ok(0);
            }
            if futures::executor::block_on(self.state.changed()).is_err() {
                return Err(std::io::Error::other("the fetch ended without an outcome"));
            }
        }
    }
}
