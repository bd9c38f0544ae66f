//! `file://` binary caches: files under a directory. Writing (Nix's
//! `LocalBinaryCacheStore::upsertFile`, `local-binary-cache-store.cc`): each file is written
//! beside its place under a temporary name and renamed into place, so that a reader never sees
//! a partial file.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::{CacheError, Upload};

/// Reads cache files from a local directory.
#[derive(Debug, Clone)]
pub struct FileTransport { dir: PathBuf }

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
    /// (`tokio::fs` would: a thread hand-off per narinfo).
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let path = self.path(rel);
        match std::fs::read(&path) {
            Ok(data) => Ok(Some(data)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CacheError::Io { url: path.display().to_string(), source }),
        }
    }

    /// Opens a file for streaming; `None` when it does not exist.
    pub fn open(&self, rel: &str) -> Result<Option<Box<dyn Read + Send>>, CacheError> {
        let path = self.path(rel);
        match std::fs::File::open(&path) {
            Ok(f) => Ok(Some(Box::new(f))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CacheError::Io { url: path.display().to_string(), source }),
        }
    }

    /// Whether `rel` exists.
    pub async fn exists(&self, rel: &str) -> Result<bool, CacheError> {
        let path = self.path(rel);
        tokio::fs::try_exists(&path).await.map_err(|source| CacheError::Io { url: path.display().to_string(), source })
    }

    /// Creates the cache's directory and its `nar` directory, as Nix's
    /// `LocalBinaryCacheStore::init` does before writing (`local-binary-cache-store.cc`).
    pub async fn create_dirs(&self) -> Result<(), CacheError> {
        let nar = self.dir.join("nar");
        tokio::fs::create_dir_all(&nar).await.map_err(|source| CacheError::Io { url: nar.display().to_string(), source })
    }

    /// Creates or replaces `rel` with `upload` (a prepared NAR is renamed into place: it was
    /// written in this directory) in a directory [`FileTransport::create_dirs`] made.
    pub async fn put(&self, rel: &str, upload: Upload) -> Result<(), CacheError> {
        let path = self.path(rel);
        let dir = self.dir.clone();
        let url = path.display().to_string();
        let io = |source| CacheError::Io { url: url.clone(), source };
        tokio::task::spawn_blocking(move || {
            let file = match upload {
                Upload::Nar(nar) => nar.file,
                Upload::Bytes(bytes) => {
                    let mut f = staging_file(&dir)?;
                    f.write_all(&bytes)?;
                    f
                }
            };
            file.persist(&path).map(drop).map_err(|e| e.error)
        })
        .await
        .map_err(|e| io(std::io::Error::other(e)))?
        .map_err(io)
    }
}

/// A new temporary file in `dir` for a cache file written there and renamed into place, with
/// the mode Nix's `writeFile` gives a cache file (`0666` less the umask; `tempfile`'s own
/// default is `0600`).
pub fn staging_file(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt as _;
    tempfile::Builder::new().prefix(".sluice-upload-").permissions(std::fs::Permissions::from_mode(0o666)).tempfile_in(dir)
}
