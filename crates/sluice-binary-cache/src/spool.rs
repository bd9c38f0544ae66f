//! Where a compressed NAR waits for its upload: in memory when it is small and the process's
//! budget allows ([`SPOOL_NAR_MAX`], [`SPOOL_MEMORY`]), else in a temporary file (always, for
//! a `file://` cache: there the file is written in the cache's directory and renamed into
//! place). Over HTTP and S3 the corpus's NARs (12 KB compressed on average) each made,
//! reopened, read through `tokio::fs` and deleted a file in the temporary directory: on this
//! machine's ext4 that was a fifth of a push's CPU, and a blocking-thread hand-off per read.

use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest compressed NAR kept in memory; a larger one goes to a file as it grows past it.
pub(crate) const SPOOL_NAR_MAX: usize = 1 << 20;

/// Bytes of compressed NARs kept in memory at once, by the whole process (NARs wait for their
/// upload slot and their references' narinfos, so their number is not otherwise bounded);
/// beyond it they go to files. The NARs being compressed (at most the destination's
/// parallelism, each up to [`SPOOL_NAR_MAX`]) come on top.
pub(crate) const SPOOL_MEMORY: u64 = 64 << 20;

/// Bytes of compressed NARs in memory now.
static SPOOLED: AtomicU64 = AtomicU64::new(0);

/// A new temporary file in `dir` for a cache file written there and renamed into place, or
/// uploaded from there, with the mode Nix's `writeFile` gives a cache file (`0666` less the
/// umask; `tempfile`'s own default is `0600`).
pub(crate) fn staging_file(dir: &Path) -> io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt as _;
    tempfile::Builder::new().prefix(".sluice-upload-").permissions(std::fs::Permissions::from_mode(0o666)).tempfile_in(dir)
}

/// A compressed NAR, ready to upload.
pub enum Compressed {
    /// In memory, counted in [`SPOOL_MEMORY`] until dropped.
    Memory(bytes::Bytes, Spooled),
    /// In a temporary file (deleted when dropped, unless persisted).
    File(tempfile::NamedTempFile),
}

impl Compressed {
    /// `len` bytes from `offset` (a part of a multipart upload).
    pub fn part(&self, offset: u64, len: usize) -> io::Result<bytes::Bytes> {
        match self {
            Compressed::Memory(bytes, _) => {
                let start = usize::try_from(offset).map_err(io::Error::other)?;
                bytes.get(start..start + len).map(|s| bytes.slice_ref(s)).ok_or_else(|| io::ErrorKind::UnexpectedEof.into())
            }
            Compressed::File(file) => {
                let mut file = file.reopen()?;
                let mut part = vec![0; len];
                file.seek(SeekFrom::Start(offset))?;
                file.read_exact(&mut part)?;
                Ok(part.into())
            }
        }
    }
}

/// A share of [`SPOOL_MEMORY`], given back when dropped.
pub struct Spooled(u64);

impl Spooled {
    /// `bytes` of the budget, if that many are left.
    fn take(bytes: u64) -> Option<Spooled> {
        SPOOLED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| used.checked_add(bytes).filter(|&u| u <= SPOOL_MEMORY))
            .ok()
            .map(|_| Spooled(bytes))
    }
}

impl Drop for Spooled {
    fn drop(&mut self) {
        SPOOLED.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// Writes a compressed NAR into memory while it fits in [`SPOOL_NAR_MAX`], then into a
/// temporary file in its directory; [`SpoolWriter::finish`] keeps it in memory if the budget
/// has room for it.
pub(crate) struct SpoolWriter {
    state: State,
    dir: PathBuf,
}

enum State {
    Memory(Vec<u8>),
    File(BufWriter<tempfile::NamedTempFile>),
}

impl SpoolWriter {
    /// A writer spooling into memory first if `in_memory`, else straight into a temporary file
    /// in `dir` (created now).
    pub fn new(dir: &Path, in_memory: bool) -> io::Result<SpoolWriter> {
        let state = if in_memory { State::Memory(Vec::new()) } else { State::File(Self::file(dir)?) };
        Ok(SpoolWriter { state, dir: dir.to_path_buf() })
    }

    fn file(dir: &Path) -> io::Result<BufWriter<tempfile::NamedTempFile>> {
        Ok(BufWriter::with_capacity(128 << 10, staging_file(dir)?))
    }

    /// Moves what is in memory to a temporary file, which takes the rest.
    fn spill(&mut self) -> io::Result<&mut BufWriter<tempfile::NamedTempFile>> {
        if let State::Memory(bytes) = &mut self.state {
            let mut file = Self::file(&self.dir)?;
            file.write_all(bytes)?;
            self.state = State::File(file);
        }
        match &mut self.state {
            State::File(file) => Ok(file),
            State::Memory(_) => unreachable!("spilled above"),
        }
    }

    /// The compressed NAR: in memory if it stayed there and the budget has room, else in its
    /// file (flushed).
    pub fn finish(self) -> io::Result<Compressed> {
        let file = match self.state {
            State::Memory(bytes) => match Spooled::take(bytes.len() as u64) {
                Some(share) => return Ok(Compressed::Memory(bytes.into(), share)),
                None => {
                    let mut file = Self::file(&self.dir)?;
                    file.write_all(&bytes)?;
                    file
                }
            },
            State::File(file) => file,
        };
        Ok(Compressed::File(file.into_inner().map_err(|e| e.into_error())?))
    }
}

impl Write for SpoolWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.state {
            State::Memory(bytes) if bytes.len() + buf.len() <= SPOOL_NAR_MAX => {
                bytes.extend_from_slice(buf);
                Ok(buf.len())
            }
            _ => self.spill()?.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &mut self.state {
            State::Memory(_) => Ok(()),
            State::File(file) => file.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(c: &Compressed) -> Vec<u8> {
        match c {
            Compressed::Memory(bytes, _) => bytes.to_vec(),
            Compressed::File(file) => std::fs::read(file.path()).unwrap(),
        }
    }

    /// A small NAR stays in memory and is counted until dropped; one that grows past
    /// SPOOL_NAR_MAX, or finds the budget spent, goes to a file with the same bytes; a
    /// `file://` spool writes a file at once. Parts read back from either.
    #[test]
    fn small_nars_stay_in_memory_within_the_budget() {
        let dir = tempfile::TempDir::new().unwrap();
        let write = |data: &[u8], in_memory: bool| {
            let mut w = SpoolWriter::new(dir.path(), in_memory).unwrap();
            for chunk in data.chunks(100_000) {
                w.write_all(chunk).unwrap();
            }
            w.finish().unwrap()
        };
        let small: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let big: Vec<u8> = (0..SPOOL_NAR_MAX as u32 + 10).map(|i| (i / 7) as u8).collect();

        let kept = write(&small, true);
        assert!(matches!(kept, Compressed::Memory(..)) && contents(&kept) == small);
        assert_eq!(SPOOLED.load(Ordering::Acquire), small.len() as u64);
        assert_eq!(kept.part(4000, 1000).unwrap(), &small[4000..]);
        drop(kept);
        assert_eq!(SPOOLED.load(Ordering::Acquire), 0);

        let spilled = write(&big, true);
        assert!(matches!(spilled, Compressed::File(_)) && contents(&spilled) == big);
        assert_eq!(spilled.part(SPOOL_NAR_MAX as u64, 10).unwrap(), &big[SPOOL_NAR_MAX..]);
        assert!(matches!(write(&small, false), Compressed::File(_)));

        let all = Spooled::take(SPOOL_MEMORY).unwrap();
        let over = write(&small, true);
        assert!(matches!(over, Compressed::File(_)) && contents(&over) == small);
        drop(all);
        assert_eq!(SPOOLED.load(Ordering::Acquire), 0);
    }
}
