//! A daemon's Unix socket: `unix://PATH`, or `daemon` (and `unix://`) for the default socket
//! (`$NIX_DAEMON_SOCKET_PATH`, else `daemon-socket/socket` in the store's state directory:
//! `state`, else `ROOT/nix/var/nix` with `root`, else `$NIX_STATE_DIR` or `/nix/var/nix`:
//! [`crate::env_dirs::daemon_socket`]); Nix's `UDSRemoteStore`
//! (`src/libstore/uds-remote-store.cc`), which adds no parameters of its own.
//!
//! | parameter | Nix source | in sluice |
//! |---|---|---|
//! | `root`, `state` | `local-fs-store.hh` | the directory of the default socket (as Nix 2.35's `getDaemonSocketPath`) |
//! | `log`, `real` | `local-fs-store.hh` | accepted, no effect (sluice's daemon client only queries) |
//! | `max-connections`, `max-connection-age` | `remote-store.hh` | accepted, no effect (sluice's client holds one connection) |

use std::path::PathBuf;
use std::sync::Arc;

use super::{StoreConfig, StoreKind};
use crate::config::Settings;
use crate::remote::DaemonStore;
use crate::store::{Store, StoreFuture};
use crate::store_url::{CommonParams, ParamType, Query, StoreUrlError, LOCAL_FS};

/// The daemon's kind.
pub(super) const KIND: StoreKind = StoreKind {
    name: "daemon store",
    forms: "daemon, unix://",
    claims: |main| main == "daemon" || main.starts_with("unix://"),
    params: &[LOCAL_FS, &[("max-connections", ParamType::Int), ("max-connection-age", ParamType::Int)]],
    parse,
};

/// A daemon store's configuration: the socket to connect to.
#[derive(Debug)]
struct DaemonConfig {
    socket: PathBuf,
    common: CommonParams,
}

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, mut q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    let dirs = q.take_dirs(None)?;
    let socket = match main.strip_prefix("unix://").unwrap_or("") {
        "" => crate::env_dirs::daemon_socket(&dirs.state)?,
        path if path.starts_with('/') => PathBuf::from(path),
        _ => return Err(StoreUrlError::Unsupported(url.to_string())),
    };
    Ok(Box::new(DaemonConfig { socket, common: q.finish()? }))
}

impl StoreConfig for DaemonConfig {
    fn open<'a>(&'a self, url: &'a str, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move { Ok(Arc::new(DaemonStore::connect(url, &self.socket, settings.lock_cpu, settings.require_sigs)?) as Arc<dyn Store>) })
    }

    /// Usable as a substituter (`substituters = daemon`), one connection per run opened on the
    /// first path asked of it (`crate::substituter_source`); its paths' signatures are checked
    /// as a cache's are unless `?trusted=true`.
    fn as_substituter(&self) -> Option<&CommonParams> {
        Some(&self.common)
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;
    use std::path::PathBuf;

    use crate::store_url::StoreUrl;

    fn socket(url: &str) -> PathBuf {
        let parsed = StoreUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        let config: &dyn Any = parsed.config();
        config.downcast_ref::<super::DaemonConfig>().map(|c| c.socket.clone()).unwrap_or_else(|| panic!("{url}: {parsed:?}"))
    }

    #[test]
    fn daemon_forms() {
        assert_eq!(socket("unix:///tmp/d/socket?real=/x&root=/r&state=/s&log=/l&max-connections=4&max-connection-age=60"), PathBuf::from("/tmp/d/socket"));
        if std::env::var_os("NIX_DAEMON_SOCKET_PATH").is_none() && std::env::var_os("NIX_STATE_DIR").is_none() {
            assert_eq!(socket("daemon?store=/nix/store"), PathBuf::from("/nix/var/nix/daemon-socket/socket"));
            assert_eq!(socket("unix://"), PathBuf::from("/nix/var/nix/daemon-socket/socket"));
            assert_eq!(socket("daemon?root=/r"), PathBuf::from("/r/nix/var/nix/daemon-socket/socket"));
            assert_eq!(socket("unix://?root=/r&state=/s"), PathBuf::from("/s/daemon-socket/socket"));
        }
    }
}
