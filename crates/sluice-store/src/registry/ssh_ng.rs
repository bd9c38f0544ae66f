//! A daemon on another host through ssh: `ssh-ng://[user@]host[:port]`, Nix's `SSHStore`
//! (`src/libstore/ssh-store.cc`, Nix 2.26). `remote-program` (default `nix-daemon`) runs
//! there with `--stdio` (and `--store <remote-store>` when given) through the system's `ssh`
//! ([`crate::ssh`], which lists the SSH parameters), and the worker protocol is spoken over its
//! standard input and output by the same client as a `unix://` daemon's
//! ([`crate::remote::DaemonStore`]).
//!
//! | parameter | Nix source | in sluice |
//! |---|---|---|
//! | `ssh-key`, `base64-ssh-public-host-key`, `compress`, `remote-store`, `remote-program`, `max-connections` | `common-ssh-store-config.hh`, `ssh-store.hh` | [`crate::ssh`] |
//! | `max-connection-age` | `remote-store.hh` | accepted, no effect (one connection) |

use std::sync::Arc;

use super::{StoreConfig, StoreKind};
use crate::config::Settings;
use crate::remote::{DaemonConnection, DaemonStore, RemoteError};
use crate::ssh::{SshConfig, SshMaster, SSH_PARAMS};
use crate::store::{Store, StoreError, StoreFuture};
use crate::store_url::{CommonParams, ParamType, Query, StoreUrlError};

/// The kind's URL scheme.
const SCHEME: &str = "ssh-ng";

/// The `ssh-ng://` kind.
pub(super) const KIND: StoreKind = StoreKind {
    name: "SSH daemon store",
    forms: "ssh-ng://[user@]host[:port]",
    claims: |main| main.starts_with("ssh-ng://"),
    params: &[SSH_PARAMS, &[("max-connection-age", ParamType::Int)]],
    parse,
};

/// An `ssh-ng://` store's configuration: the host and how to reach it.
#[derive(Debug)]
struct SshNgConfig {
    ssh: SshConfig,
    /// Its common parameters, for its use as a substituter.
    common: CommonParams,
}

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, mut q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    let ssh = SshConfig::parse(url, main, SCHEME, &mut q, "nix-daemon")?;
    let common = q.finish()?;
    Ok(Box::new(SshNgConfig { ssh, common }))
}

impl StoreConfig for SshNgConfig {
    /// A far end that moves no byte either way for `stalled-download-timeout` while a reply
    /// or a request waits is given up, as `ssh://`'s is (a connection of an `ssh-ng://` store
    /// carries store operations only; builds go to the local daemon).
    fn open<'a>(&'a self, _url: &'a str, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move {
            let daemon = format!("{SCHEME}://{}", self.ssh.destination());
            let master = SshMaster::new(self.ssh.clone()).map_err(|e| StoreError::Other(format!("{daemon}: {e}")))?;
            let command = self.ssh.remote_command(&["--stdio"]);
            let name = daemon.clone();
            let stall = std::time::Duration::from_secs(settings.stalled_download_timeout.max(1));
            let connect = Box::new(move || {
                let connect_err = |e: String| RemoteError::Connect { daemon: name.clone(), source: std::io::Error::other(e) };
                let channel = master.start(&command).map_err(|e| connect_err(e.to_string()))?;
                channel.give_up_after(stall).map_err(|e| connect_err(e.to_string()))?;
                DaemonConnection::over(name.clone(), Box::new(channel.reader), Box::new(channel.writer))
            });
            Ok(Arc::new(DaemonStore::open(&daemon, &daemon, connect, settings.require_sigs)?) as Arc<dyn Store>)
        })
    }

    /// Usable as a substituter, one connection per run opened on the first path asked of it
    /// (`crate::substituter_source`); its priority defaults to 0, Nix's `StoreConfig::priority`.
    fn as_substituter(&self) -> Option<&CommonParams> {
        Some(&self.common)
    }
}
