//! `file://` binary caches: files under a directory.

use std::io::Read;
use std::path::PathBuf;

use super::CacheError;

/// Reads cache files from a local directory.
#[derive(Debug, Clone)]
pub struct FileTransport { dir: PathBuf }

impl FileTransport {
    /// A transport for the directory of a `file://` URL.
    pub fn new(dir: PathBuf) -> Self {
        FileTransport { dir }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel.split('?').next().unwrap_or(rel).trim_start_matches('/'))
    }

    /// Reads a whole file; `None` when it does not exist.
    pub async fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, CacheError> {
        let path = self.path(rel);
        match tokio::fs::read(&path).await {
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
}
