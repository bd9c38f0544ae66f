//! `file://` binary caches: files under a directory. Writing (Nix's
//! `LocalBinaryCacheStore::upsertFile`, `local-binary-cache-store.cc`): each file is written
//! beside its place under a temporary name and renamed into place, so that a reader never sees
//! a partial file.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::spool::{staging_file, Compressed};
use super::upload::PreparedNar;
use super::{CacheError, Upload};

/// A file opened for streaming, and its size.
pub type Opened = (std::fs::File, u64);

/// Reads cache files from a local directory.
#[derive(Debug, Clone)]
pub struct FileTransport {
    dir: PathBuf,
}

impl FileTransport {
    /// A transport for the directory of a `file://` URL.
    pub fn new(dir: PathBuf) -> Self {
        FileTransport { dir }
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel.split('?').next().unwrap_or(rel).trim_start_matches('/'))
    }

    /// Reads a whole file; `None` when it does not exist. The read is made on the calling
    /// thread, as [`FileTransport::open`] opens: cache files are small local files (narinfos:
    /// about 1 KiB), read in less time than handing the read to a blocking thread takes
    /// (`tokio::fs` would: a thread hand-off per narinfo). The file is read up to the size it
    /// has when opened, with no read past it to find its end (`std::fs::read` makes one): a
    /// cache's files are written whole under another name and renamed into place, so that
    /// size is the file's (`sluice serve` reads a narinfo per request: four system calls).
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let Some((file, len)) = self.open(rel)? else { return Ok(None) };
        let mut data = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        match file.take(len).read_to_end(&mut data) {
            Ok(_) => Ok(Some(data)),
            Err(source) => Err(CacheError::Io { url: self.path(rel).display().to_string(), source }),
        }
    }

    /// Opens a file for streaming, with its size; `None` when it does not exist.
    pub fn open(&self, rel: &str) -> Result<Option<Opened>, CacheError> {
        let path = self.path(rel);
        let io = |source| CacheError::Io { url: path.display().to_string(), source };
        match std::fs::File::open(&path) {
            Ok(f) => {
                let len = f.metadata().map_err(io)?.len();
                Ok(Some((f, len)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(io(source)),
        }
    }

    /// What tells one version of `rel` from another (device, inode, size, modification
    /// time), `None` when it does not exist: a file replaced (a rename over it) or rewritten
    /// has another. Asked on the calling thread.
    pub fn stamp(&self, rel: &str) -> Result<Option<FileStamp>, CacheError> {
        use std::os::unix::fs::MetadataExt;
        let path = self.path(rel);
        match std::fs::metadata(&path) {
            Ok(m) => Ok(Some(FileStamp { dev: m.dev(), ino: m.ino(), len: m.len(), mtime: (m.mtime(), m.mtime_nsec()) })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CacheError::Io { url: path.display().to_string(), source }),
        }
    }

    /// Whether `rel` exists, asked on the calling thread (as [`FileTransport::get`] reads).
    pub fn exists(&self, rel: &str) -> Result<bool, CacheError> {
        let path = self.path(rel);
        path.try_exists().map_err(|source| CacheError::Io { url: path.display().to_string(), source })
    }

    /// The size of `rel`, `None` when it does not exist (asked on the calling thread, as
    /// [`FileTransport::exists`]).
    pub fn size(&self, rel: &str) -> Result<Option<u64>, CacheError> {
        let path = self.path(rel);
        match std::fs::metadata(&path) {
            Ok(meta) => Ok(Some(meta.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CacheError::Io { url: path.display().to_string(), source }),
        }
    }

    /// Creates the cache's directory and its `nar` directory, as Nix's
    /// `LocalBinaryCacheStore::init` does before writing (`local-binary-cache-store.cc`).
    pub(crate) fn create_dirs(&self) -> Result<(), CacheError> {
        let nar = self.dir.join("nar");
        std::fs::create_dir_all(&nar).map_err(|source| CacheError::Io { url: nar.display().to_string(), source })
    }

    /// Creates or replaces `rel` with `upload` in a directory [`FileTransport::create_dirs`]
    /// made, on the calling thread: a prepared NAR was written in this directory and is renamed
    /// into place (one system call); bytes (a narinfo, `nix-cache-info`, a listing, a NAR in
    /// memory) are written
    /// to a temporary file beside it and renamed. Handing these to a blocking thread cost more
    /// than they do: two hand-offs per path pushed, most of a `file://` push's 20,000 `futex`
    /// calls.
    pub fn put(&self, rel: &str, upload: Upload) -> Result<(), CacheError> {
        let path = self.path(rel);
        let io = |source| CacheError::Io { url: path.display().to_string(), source };
        let file = match upload {
            Upload::Nar(PreparedNar { compressed: Compressed::File(file), .. }) => file,
            Upload::Bytes(bytes) | Upload::Nar(PreparedNar { compressed: Compressed::Memory(bytes, _), .. }) => {
                let mut f = staging_file(&self.dir).map_err(io)?;
                f.write_all(&bytes).map_err(io)?;
                f
            }
        };
        file.persist(&path).map(drop).map_err(|e| io(e.error))
    }
}

/// One version of a cache file ([`FileTransport::stamp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    /// Seconds and nanoseconds.
    mtime: (i64, i64),
}
