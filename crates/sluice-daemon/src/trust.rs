//! Who may connect and who is trusted: `allowed-users` (default `*`) and `trusted-users`
//! (default `root`) from the daemon's nix.conf, matched against the peer's user name and
//! groups (`@group`), as Nix's `src/nix/unix/daemon.cc` (`matchUser`) does. The peer's uid
//! comes from `SO_PEERCRED`.

use sluice_store::config::RawConfig;

/// The daemon's user lists.
#[derive(Debug, Clone)]
pub(crate) struct Users {
    trusted: Vec<String>,
    allowed: Vec<String>,
}

/// A connected peer as the daemon sees it.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// User name (or the uid in decimal when it has no passwd entry).
    pub name: String,
    pub trusted: bool,
    pub allowed: bool,
}

impl Users {
    pub(crate) fn from_config(config: &RawConfig) -> Self {
        let list = |name: &str, default: &str| config.get(name).unwrap_or(default).split_whitespace().map(String::from).collect();
        Users { trusted: list("trusted-users", "root"), allowed: list("allowed-users", "*") }
    }

    /// Classifies the user `uid` (primary group `gid`).
    pub(crate) fn peer(&self, uid: u32, gid: u32) -> Peer {
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
        let name = passwd
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .find(|f| f.len() > 3 && f[2].parse() == Ok(uid))
            .map(|f| f[0].to_owned())
            .unwrap_or_else(|| uid.to_string());
        let groups: Vec<&str> = group
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .filter(|f| f.len() > 3 && (f[2].parse() == Ok(gid) || f[3].split(',').any(|m| m == name)))
            .map(|f| f[0])
            .collect();
        let matches =
            |list: &[String]| list.iter().any(|u| u == "*" || *u == name || u.strip_prefix('@').is_some_and(|g| groups.contains(&g)));
        let trusted = matches(&self.trusted);
        Peer { allowed: trusted || matches(&self.allowed), trusted, name }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_lists() {
        let users = Users::from_config(&RawConfig::default());
        let root = users.peer(0, 0);
        assert!(root.trusted && root.allowed);
        assert_eq!(root.name, "root");
        let nobody = users.peer(4_000_000, 4_000_000);
        assert!(!nobody.trusted && nobody.allowed);
        let mut cfg = RawConfig::default();
        cfg.set("trusted-users", "alice");
        cfg.set("allowed-users", "@wheel bob");
        let users = Users::from_config(&cfg);
        let root = users.peer(0, 0);
        assert!(!root.trusted && !root.allowed);
    }
}
