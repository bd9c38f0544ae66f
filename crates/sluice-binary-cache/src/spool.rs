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

/// The name prefix of [`staging_file`]s.
const STAGING_PREFIX: &str = ".sluice-upload-";

/// A new temporary file in `dir` for a cache file written there and renamed into place, or
/// uploaded from there, with the mode Nix's `writeFile` gives a cache file (`0666` less the
/// umask; `tempfile`'s own default is `0600`). It holds an exclusive `flock` while it is open,
/// which tells [`sweep_staging`] that its writer is alive; one swept between its creation and
/// the lock is made again.
pub fn staging_file(dir: &Path) -> io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt as _;
    loop {
        let file = tempfile::Builder::new().prefix(STAGING_PREFIX).permissions(std::fs::Permissions::from_mode(0o666)).tempfile_in(dir)?;
        file.as_file().lock()?;
        if names(file.path(), file.as_file())? {
            return Ok(file);
        }
    }
}

/// Whether `path` is the file `file` is open on.
fn names(path: &Path, file: &std::fs::File) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    let open = file.metadata()?;
    match std::fs::symlink_metadata(path) {
        Ok(named) => Ok((named.dev(), named.ino()) == (open.dev(), open.ino())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes the [`staging_file`]s in `dir` that no live process holds: those of a writer killed
/// mid-upload (a push, a pull-through front), which nothing names (a killed writer published
/// nothing). A file whose lock is held, by this process or another, is left alone. Returns how
/// many were removed; a file that cannot be opened (another user's) is skipped.
pub fn sweep_staging(dir: &Path) -> io::Result<usize> {
    let mut removed = 0;
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if !entry.file_name().to_str().is_some_and(|n| n.starts_with(STAGING_PREFIX)) || !entry.file_type()?.is_file() {
            continue;
        }
        let path = entry.path();
        let Ok(file) = std::fs::File::open(&path) else { continue };
        match file.try_lock() {
            Ok(()) if names(&path, &file)? => match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io::Error::new(e.kind(), format!("removing {}: {e}", path.display()))),
            },
            Ok(()) | Err(std::fs::TryLockError::WouldBlock) => {}
            Err(std::fs::TryLockError::Error(e)) => return Err(io::Error::new(e.kind(), format!("locking {}: {e}", path.display()))),
        }
    }
    Ok(removed)
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
            State::Memory(_) => {
                Err(io::Error::other(format!("spooling into {}: the NAR in memory was not moved to a file", self.dir.display())))
            }
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
    /// A staging file left by a writer that is gone (its file closed, as a killed process's)
    /// is swept; one still open is not, whoever holds it; other files are not touched.
    #[test]
    fn only_staging_files_no_one_holds_are_swept() {
        let dir = tempfile::TempDir::new().unwrap();
        let live = staging_file(dir.path()).unwrap();
        let (_, dead) = staging_file(dir.path()).unwrap().keep().unwrap();
        std::fs::write(dir.path().join(".sluice-uploaded"), b"x").unwrap();
        std::fs::write(dir.path().join("nix-cache-info"), b"StoreDir: /nix/store\n").unwrap();
        assert_eq!(sweep_staging(dir.path()).unwrap(), 1);
        assert!(!dead.exists() && live.path().exists());
        let mut left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
        left.sort();
        let mut want = vec![dir.path().join(".sluice-uploaded"), live.path().to_path_buf(), dir.path().join("nix-cache-info")];
        want.sort();
        assert_eq!(left, want);
        drop(live);
        assert_eq!(sweep_staging(dir.path().join("absent").as_path()).unwrap(), 0);
    }

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
