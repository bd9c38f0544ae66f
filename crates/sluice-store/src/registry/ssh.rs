//! `nix-store --serve` on another host through ssh: `ssh://[user@]host[:port]`, Nix's
//! `LegacySSHStore` (`src/libstore/legacy-ssh-store.cc`, Nix 2.8 and 2.26). `remote-program`
//! (default `nix-store`) runs there with `--serve --write` (and `--store <remote-store>`) through
//! the system's `ssh` ([`crate::ssh`], which lists the SSH parameters); `sluice legacy-serve`
//! may be the far end as well. The client is [`crate::legacy_ssh::LegacySshStore`].

use std::sync::Arc;

use super::{StoreConfig, StoreKind};
use crate::config::Settings;
use crate::legacy_ssh::LegacySshStore;
use crate::ssh::{SshConfig, SSH_PARAMS};
use crate::store::{Store, StoreFuture};
use crate::store_url::{CommonParams, Query, StoreUrlError};

/// The kind's URL scheme.
const SCHEME: &str = "ssh";

/// The `ssh://` kind.
pub(super) const KIND: StoreKind = StoreKind {
    name: "SSH store",
    forms: "ssh://[user@]host[:port]",
    claims: |main| main.starts_with("ssh://"),
    params: &[SSH_PARAMS],
    parse,
};

/// An `ssh://` store's configuration: the host and how to reach it.
#[derive(Debug)]
struct LegacySshConfig {
    ssh: SshConfig,
    /// Its common parameters, for its use as a substituter.
    common: CommonParams,
}

/// Parses the kind's URL and parameters.
fn parse(url: &str, main: &str, mut q: Query<'_>) -> Result<Box<dyn StoreConfig>, StoreUrlError> {
    let ssh = SshConfig::parse(url, main, SCHEME, &mut q, "nix-store")?;
    let common = q.finish()?;
    Ok(Box::new(LegacySshConfig { ssh, common }))
}

impl StoreConfig for LegacySshConfig {
    /// A far end that moves no byte for `stalled-download-timeout` is given up.
    fn open<'a>(&'a self, _url: &'a str, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        Box::pin(async move {
            let ssh = self.ssh.clone();
            let stall = std::time::Duration::from_secs(settings.stalled_download_timeout.max(1));
            let store = tokio::task::spawn_blocking(move || LegacySshStore::open(&ssh, stall))
                .await
                .map_err(|e| crate::store::StoreError::Other(format!("ssh://{}: {e}", self.ssh.destination())))??;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }

    /// Usable as a substituter, one connection per run opened on the first path asked of it
    /// (`crate::substituter_source`); its priority defaults to 0, Nix's `StoreConfig::priority`.
    fn as_substituter(&self) -> Option<&CommonParams> {
        Some(&self.common)
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;

    use crate::store_url::StoreUrl;

    /// The SSH configuration `url` parses into.
    fn ssh(url: &str) -> crate::ssh::SshConfig {
        let parsed = StoreUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        let config: &dyn Any = parsed.config();
        config.downcast_ref::<super::LegacySshConfig>().map(|c| c.ssh.clone()).unwrap_or_else(|| panic!("{url}: {parsed:?}"))
    }

    #[test]
    fn ssh_forms() {
        let c = ssh("ssh://alice@build.example:2222?remote-store=local%3Froot%3D/r&compress=true&max-connections=1");
        assert_eq!((c.user.as_deref(), c.host.as_str(), c.port, c.compress), (Some("alice"), "build.example", Some(2222), true));
        // Nix's default remote program and arguments (legacy-ssh-store.cc).
        assert_eq!(c.remote_command(&["--serve", "--write"]), ["nix-store", "--serve", "--write", "--store", "'local?root=/r'"]);
        let c = ssh("ssh://h?remote-program=sluice%20legacy-serve");
        assert_eq!(c.remote_command(&["--serve", "--write"]), ["sluice", "legacy-serve", "--serve", "--write"]);
        assert!(StoreUrl::parse("ssh://h?compression=xz").is_err());
        assert!(StoreUrl::parse("ssh://h/path").is_err());
    }
}
