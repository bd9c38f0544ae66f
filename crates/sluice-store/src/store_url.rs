//! Store URLs as Nix writes them (`src/libstore/store-api.cc`, `openStore`): `local`,
//! `local?root=DIR`, a bare absolute path (same as `local?root=PATH`), `file:///dir`,
//! `http://…`, `https://…`. Query parameters other than `root` and `priority` are ignored, as
//! Nix ignores unknown store settings with a warning.

use std::path::PathBuf;

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local store whose `nix/store` and `nix/var/nix` live under `root` (`/` for `local`).
    Local { root: PathBuf },
    /// A binary cache.
    BinaryCache(CacheUrl),
    /// A daemon's Unix socket: `unix://PATH`, or `daemon` for the default socket
    /// (`$NIX_DAEMON_SOCKET_PATH`, else `/nix/var/nix/daemon-socket/socket`).
    Daemon { socket: PathBuf },
}

/// The default daemon socket.
pub const DEFAULT_DAEMON_SOCKET: &str = "/nix/var/nix/daemon-socket/socket";

/// A binary cache's URL: `base` has no trailing slash and no query; `priority` overrides the
/// cache's `nix-cache-info` (`?priority=N`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheUrl {
    pub base: String,
    pub kind: CacheKind,
    pub priority: Option<u64>,
}

/// The transport of a binary cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheKind { File, Http }

/// Why a store URL was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreUrlError {
    #[error("unsupported store URL {0:?} (expected local, local?root=DIR, an absolute path, daemon, unix://, file://, http:// or https://)")]
    Unsupported(String),
    #[error("store URL {url:?}: parameter {param} has the invalid value {value:?}")]
    BadParam { url: String, param: &'static str, value: String },
}

impl StoreUrl {
    /// Parses a store URL.
    pub fn parse(url: &str) -> Result<Self, StoreUrlError> {
        let (main, query) = match url.split_once('?') {
            Some((m, q)) => (m, q),
            None => (url, ""),
        };
        let params: Vec<(&str, &str)> = query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, ""))).collect();
        let param = |name: &str| params.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        if main == "daemon" {
            let socket = std::env::var_os("NIX_DAEMON_SOCKET_PATH").map_or_else(|| PathBuf::from(DEFAULT_DAEMON_SOCKET), PathBuf::from);
            return Ok(StoreUrl::Daemon { socket });
        }
        if let Some(socket) = main.strip_prefix("unix://") {
            if !socket.starts_with('/') {
                return Err(StoreUrlError::Unsupported(url.to_string()));
            }
            return Ok(StoreUrl::Daemon { socket: PathBuf::from(socket) });
        }
        if main == "local" || main.starts_with('/') {
            let root = match (param("root"), main) {
                (Some(r), _) => PathBuf::from(r),
                (None, "local") => PathBuf::from("/"),
                (None, path) => PathBuf::from(path),
            };
            return Ok(StoreUrl::Local { root });
        }
        let kind = if let Some(dir) = main.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(StoreUrlError::Unsupported(url.to_string()));
            }
            CacheKind::File
        } else if main.starts_with("http://") || main.starts_with("https://") {
            CacheKind::Http
        } else {
            return Err(StoreUrlError::Unsupported(url.to_string()));
        };
        let priority = match param("priority") {
            Some(v) => Some(v.parse().map_err(|_| StoreUrlError::BadParam { url: url.to_string(), param: "priority", value: v.to_string() })?),
            None => None,
        };
        Ok(StoreUrl::BinaryCache(CacheUrl { base: main.trim_end_matches('/').to_string(), kind, priority }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_forms() {
        assert_eq!(StoreUrl::parse("local").unwrap(), StoreUrl::Local { root: "/".into() });
        assert_eq!(StoreUrl::parse("local?root=/tmp/r").unwrap(), StoreUrl::Local { root: "/tmp/r".into() });
        assert_eq!(StoreUrl::parse("/tmp/r").unwrap(), StoreUrl::Local { root: "/tmp/r".into() });
    }

    #[test]
    fn cache_forms() {
        assert_eq!(
            StoreUrl::parse("file:///srv/cache/?priority=10").unwrap(),
            StoreUrl::BinaryCache(CacheUrl { base: "file:///srv/cache".into(), kind: CacheKind::File, priority: Some(10) })
        );
        assert_eq!(
            StoreUrl::parse("https://cache.nixos.org").unwrap(),
            StoreUrl::BinaryCache(CacheUrl { base: "https://cache.nixos.org".into(), kind: CacheKind::Http, priority: None })
        );
        assert!(StoreUrl::parse("s4://x").is_err());
        assert_eq!(StoreUrl::parse("unix:///tmp/d/socket?real=/x").unwrap(), StoreUrl::Daemon { socket: "/tmp/d/socket".into() });
        assert!(StoreUrl::parse("unix://relative").is_err());
        assert!(StoreUrl::parse("file://relative").is_err());
        assert!(StoreUrl::parse("http://x?priority=high").is_err());
    }
}
