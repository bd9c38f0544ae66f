//! Settings from `nix.conf` and `NIX_CONFIG`, as Nix reads them (`src/libutil/config.cc`,
//! `src/libstore/globals.cc`): `name = value` lines, `#` comments, `include`/`!include`,
//! `extra-NAME` appending to a list setting. Files: `$NIX_CONF_DIR/nix.conf` (default
//! `/etc/nix/nix.conf`), then `$XDG_CONFIG_HOME/nix/nix.conf` (or `~/.config/nix/nix.conf`),
//! then the lines of `$NIX_CONFIG`; later ones win, and command-line flags win over all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Raw settings: name → value, after `extra-` lists were merged.
#[derive(Debug, Clone, Default)]
pub struct RawConfig { values: BTreeMap<String, String> }

/// Errors reading configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}:{line}: {what}")]
    Syntax { file: String, line: usize, what: String },
    #[error("cannot read {file}: {source}")]
    Io { file: String, #[source] source: std::io::Error },
    #[error("setting {name}: {value:?} is not {expected}")]
    BadValue { name: String, value: String, expected: &'static str },
}

impl RawConfig {
    /// Reads the files and `NIX_CONFIG` from the environment, as Nix does.
    pub fn from_environment() -> Result<Self, ConfigError> {
        let mut cfg = RawConfig::default();
        let conf_dir = std::env::var_os("NIX_CONF_DIR").map(PathBuf::from).unwrap_or_else(|| "/etc/nix".into());
        cfg.read_file(&conf_dir.join("nix.conf"), true)?;
        let user_dir = std::env::var_os("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
        if let Some(dir) = user_dir {
            cfg.read_file(&dir.join("nix/nix.conf"), true)?;
        }
        if let Ok(text) = std::env::var("NIX_CONFIG") {
            cfg.apply_text(&text, "NIX_CONFIG", None)?;
        }
        Ok(cfg)
    }

    fn read_file(&mut self, path: &Path, optional: bool) -> Result<(), ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if optional && e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(ConfigError::Io { file: path.display().to_string(), source }),
        };
        self.apply_text(&text, &path.display().to_string(), path.parent())
    }

    /// Applies configuration text (one setting per line); `dir` resolves relative includes.
    pub fn apply_text(&mut self, text: &str, origin: &str, dir: Option<&Path>) -> Result<(), ConfigError> {
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["include" | "!include", file] = words.as_slice() {
                let p = dir.map(|d| d.join(file)).unwrap_or_else(|| PathBuf::from(file));
                self.read_file(&p, words[0] == "!include")?;
                continue;
            }
            let Some((name, value)) = line.split_once('=') else {
                return Err(ConfigError::Syntax { file: origin.into(), line: i + 1, what: format!("expected 'name = value', got {line:?}") });
            };
            self.set(name.trim(), value.trim());
        }
        Ok(())
    }

    /// Sets one setting; `extra-NAME` appends to `NAME`.
    pub fn set(&mut self, name: &str, value: &str) {
        match name.strip_prefix("extra-") {
            Some(base) => {
                let entry = self.values.entry(base.to_string()).or_default();
                if !entry.is_empty() {
                    entry.push(' ');
                }
                entry.push_str(value);
            }
            None => {
                self.values.insert(name.to_string(), value.to_string());
            }
        }
    }

    /// The value of a setting, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }
}

/// The settings sluice uses, with Nix's defaults.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Binary-cache URLs, in the order given.
    pub substituters: Vec<String>,
    /// Public keys `name:base64`, space-separated in nix.conf.
    pub trusted_public_keys: Vec<String>,
    pub require_sigs: bool,
    /// Connections per cache for HTTP/1.1 (Nix: `http-connections`, default 25).
    pub http_connections: usize,
    /// Seconds to wait for a connection; 0 means no limit (Nix's default).
    pub connect_timeout: u64,
    /// Seconds without data before a download is abandoned (default 300).
    pub stalled_download_timeout: u64,
    /// Attempts for a download that fails transiently (5xx, resets, stalls, truncated
    /// bodies) before the cache is given up on (Nix: `download-attempts`, default 5).
    pub download_attempts: u64,
    /// Seconds a cached narinfo stays fresh (default 30 days).
    pub narinfo_cache_positive_ttl: u64,
    /// Seconds a cached absence stays fresh (default 1 hour).
    pub narinfo_cache_negative_ttl: u64,
    /// CA bundle for HTTPS (`ssl-cert-file`, `NIX_SSL_CERT_FILE`, `SSL_CERT_FILE`).
    pub ssl_cert_file: Option<PathBuf>,
    /// `keep-outputs` (alias `gc-keep-outputs`, default false): the collector keeps the
    /// outputs of live derivations.
    pub keep_outputs: bool,
    /// `keep-derivations` (alias `gc-keep-derivations`, default true): the collector keeps
    /// the derivations of live outputs.
    pub keep_derivations: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            substituters: vec!["https://cache.nixos.org/".into()],
            trusted_public_keys: vec!["cache.nixos.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=".into()],
            require_sigs: true,
            http_connections: 25,
            connect_timeout: 0,
            stalled_download_timeout: 300,
            download_attempts: 5,
            narinfo_cache_positive_ttl: 30 * 24 * 3600,
            narinfo_cache_negative_ttl: 3600,
            ssl_cert_file: None,
            keep_outputs: false,
            keep_derivations: true,
        }
    }
}

impl Settings {
    /// Settings from Nix's defaults overlaid with `raw` and the SSL environment variables.
    pub fn from_raw(raw: &RawConfig) -> Result<Self, ConfigError> {
        let mut s = Settings::default();
        let list = |v: &str| v.split_whitespace().map(String::from).collect::<Vec<_>>();
        if let Some(v) = raw.get("substituters") {
            s.substituters = list(v);
        }
        if let Some(v) = raw.get("trusted-public-keys") {
            s.trusted_public_keys = list(v);
        }
        if let Some(v) = raw.get("require-sigs") {
            s.require_sigs = parse_bool("require-sigs", v)?;
        }
        for (name, field) in [
            ("connect-timeout", &mut s.connect_timeout),
            ("stalled-download-timeout", &mut s.stalled_download_timeout),
            ("download-attempts", &mut s.download_attempts),
            ("narinfo-cache-positive-ttl", &mut s.narinfo_cache_positive_ttl),
            ("narinfo-cache-negative-ttl", &mut s.narinfo_cache_negative_ttl),
        ] {
            if let Some(v) = raw.get(name) {
                *field = parse_num(name, v)?;
            }
        }
        for (names, field) in [(["keep-outputs", "gc-keep-outputs"], &mut s.keep_outputs), (["keep-derivations", "gc-keep-derivations"], &mut s.keep_derivations)] {
            for name in names {
                if let Some(v) = raw.get(name) {
                    *field = parse_bool(name, v)?;
                }
            }
        }
        if let Some(v) = raw.get("http-connections") {
            s.http_connections = parse_num("http-connections", v)? as usize;
        }
        let env_cert = ["NIX_SSL_CERT_FILE", "SSL_CERT_FILE"].iter().find_map(std::env::var_os);
        s.ssl_cert_file = raw.get("ssl-cert-file").map(PathBuf::from).or(env_cert.map(PathBuf::from));
        Ok(s)
    }
}

fn parse_bool(name: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(ConfigError::BadValue { name: name.into(), value: v.into(), expected: "a Boolean (true or false)" }),
    }
}

fn parse_num(name: &str, v: &str) -> Result<u64, ConfigError> {
    v.parse().map_err(|_| ConfigError::BadValue { name: name.into(), value: v.into(), expected: "a non-negative integer" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_extra_and_comments() {
        let mut raw = RawConfig::default();
        raw.apply_text("substituters = file:///a # comment\nextra-substituters = http://b\nrequire-sigs = false\nhttp-connections = 7\ndownload-attempts = 2\n", "test", None).unwrap();
        let s = Settings::from_raw(&raw).unwrap();
        assert_eq!(s.substituters, vec!["file:///a", "http://b"]);
        assert!(!s.require_sigs);
        assert_eq!(s.http_connections, 7);
        assert_eq!(s.download_attempts, 2);
        assert_eq!(Settings::default().download_attempts, 5);
        assert_eq!(s.narinfo_cache_negative_ttl, 3600);
    }

    #[test]
    fn bad_values_are_named() {
        let mut raw = RawConfig::default();
        raw.apply_text("require-sigs = maybe", "test", None).unwrap();
        let err = Settings::from_raw(&raw).unwrap_err().to_string();
        assert!(err.contains("require-sigs") && err.contains("maybe"), "{err}");
        assert!(raw.apply_text("no equals sign", "f", None).unwrap_err().to_string().contains("f:1"));
    }
}
