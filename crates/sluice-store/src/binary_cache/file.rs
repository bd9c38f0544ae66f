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

    /// Creates or replaces `rel` with `upload` (a prepared NAR is renamed into place: it was
    /// written in this directory).
    pub async fn put(&self, rel: &str, upload: Upload) -> Result<(), CacheError> {
        let path = self.path(rel);
        let dir = self.dir.clone();
        let url = path.display().to_string();
        let io = |source| CacheError::Io { url: url.clone(), source };
        tokio::task::spawn_blocking(move || {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let file = match upload {
                Upload::Nar(nar) => nar.file,
                Upload::Bytes(bytes) => {
                    let mut f = tempfile::Builder::new().prefix(".sluice-upload-").tempfile_in(&dir)?;
                    f.write_all(&bytes)?;
                    f
                }
            };
            // Nix's files are world-readable (the temporary file's mode is 0600).
            std::fs::set_permissions(file.path(), std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
            file.persist(&path).map(drop).map_err(|e| e.error)
        })
        .await
        .map_err(|e| io(std::io::Error::other(e)))?
        .map_err(io)
    }
}
