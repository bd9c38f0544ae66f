//! Settings from `nix.conf` and `NIX_CONFIG`, as Nix reads them (`src/libutil/config.cc`,
//! `src/libstore/globals.cc` `loadConfFile`, `getUserConfigFiles`, and `getConfigDirs` in
//! `src/libutil/util.cc`): `name = value` lines, `#` comments, `include`/`!include`,
//! `extra-NAME` appending to a list setting, old names ([`ALIASES`]) standing for their
//! settings. Files: `$NIX_CONF_DIR/nix.conf` (default `/etc/nix/nix.conf`), then the user
//! files — the `:`-separated `$NIX_USER_CONF_FILES` if set, otherwise `nix/nix.conf` in
//! `$XDG_CONFIG_HOME` (or `~/.config`) and in each of `$XDG_CONFIG_DIRS` (default
//! `/etc/xdg`) — applied last to first, so that the first one wins; then the lines of
//! `$NIX_CONFIG`. Later ones win, and command-line flags win over all. A name no Nix knows
//! is kept aside and reported as Nix reports it ([`RawConfig::unknown_settings`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use sluice_binary_cache::http::HttpOptions;
use sluice_local_store::{SignaturePolicy, TrustedKeysError};

/// Every setting name Nix 2.8 or 2.26 knows (`nix show-config` / `nix config show` of each,
/// plus the flake settings 2.26 hides while `flakes` is disabled), and sluice's own `lock-cpu`.
/// A setting with any other name gets Nix's `warning: unknown setting 'NAME'`.
pub(crate) const KNOWN_SETTINGS: &[&str] = &[
    "abort-on-warn",
    "accept-flake-config",
    "access-tokens",
    "allow-dirty",
    "allow-import-from-derivation",
    "allow-new-privileges",
    "allow-symlinked-store",
    "allow-unsafe-native-code-during-evaluation",
    "allowed-impure-host-deps",
    "allowed-uris",
    "allowed-users",
    "always-allow-substitutes",
    "auto-optimise-store",
    "bash-prompt",
    "bash-prompt-prefix",
    "bash-prompt-suffix",
    "build-dir",
    "build-hook",
    "build-poll-interval",
    "build-users-group",
    "builders",
    "builders-use-substitutes",
    "commit-lock-file-summary",
    "commit-lockfile-summary",
    "compress-build-log",
    "connect-timeout",
    "cores",
    "debugger-on-trace",
    "debugger-on-warn",
    "diff-hook",
    "download-attempts",
    "download-buffer-size",
    "download-speed",
    "enforce-determinism",
    "eval-cache",
    "eval-system",
    "experimental-features",
    "extra-platforms",
    "fallback",
    "filter-syscalls",
    "flake-registry",
    "fsync-metadata",
    "fsync-store-paths",
    "gc-reserved-space",
    "hashed-mirrors",
    "http-connections",
    "http2",
    "id-count",
    "ignore-try",
    "ignored-acls",
    "impersonate-linux-26",
    "keep-build-log",
    "keep-derivations",
    "keep-env-derivations",
    "keep-failed",
    "keep-going",
    "keep-outputs",
    "log-lines",
    "max-build-log-size",
    "max-call-depth",
    "max-free",
    "max-jobs",
    "max-silent-time",
    "max-substitution-jobs",
    "min-free",
    "min-free-check-interval",
    "nar-buffer-size",
    "narinfo-cache-negative-ttl",
    "narinfo-cache-positive-ttl",
    "netrc-file",
    "nix-path",
    "nix-shell-always-looks-for-shell-nix",
    "nix-shell-shebang-arguments-relative-to-script",
    "plugin-files",
    "post-build-hook",
    "pre-build-hook",
    "preallocate-contents",
    "print-missing",
    "pure-eval",
    "repeat",
    "require-drop-supplementary-groups",
    "require-sigs",
    "restrict-eval",
    "run-diff-hook",
    "sandbox",
    "sandbox-build-dir",
    "sandbox-dev-shm-size",
    "sandbox-fallback",
    "sandbox-paths",
    "secret-key-files",
    "show-trace",
    "ssl-cert-file",
    "stalled-download-timeout",
    "start-id",
    "store",
    "substitute",
    "substituters",
    "sync-before-registering",
    "system",
    "system-features",
    "tarball-ttl",
    "timeout",
    "trace-function-calls",
    "trace-verbose",
    "trust-tarballs-from-git-forges",
    "trusted-public-keys",
    "trusted-substituters",
    "trusted-users",
    "upgrade-nix-store-path-url",
    "use-case-hack",
    "use-cgroups",
    "use-registries",
    "use-sqlite-wal",
    "use-xdg-base-directories",
    "user-agent-suffix",
    "warn-dirty",
    "warn-large-path-threshold",
    "lock-cpu",
];

/// Old names of settings that Nix still accepts (the alias lists of the `Setting`s in
/// `src/libstore/globals.hh`; each checked against Nix 2.8 and 2.26): `(alias, setting)`.
pub(crate) const ALIASES: &[(&str, &str)] = &[
    ("binary-cache-public-keys", "trusted-public-keys"),
    ("binary-caches", "substituters"),
    ("binary-caches-parallel-connections", "http-connections"),
    ("build-chroot-dirs", "sandbox-paths"),
    ("build-compress-log", "compress-build-log"),
    ("build-cores", "cores"),
    ("build-fallback", "fallback"),
    ("build-impersonate-linux-26", "impersonate-linux-26"),
    ("build-keep-log", "keep-build-log"),
    ("build-max-jobs", "max-jobs"),
    ("build-max-log-size", "max-build-log-size"),
    ("build-max-silent-time", "max-silent-time"),
    ("build-repeat", "repeat"),
    ("build-sandbox-paths", "sandbox-paths"),
    ("build-timeout", "timeout"),
    ("build-use-chroot", "sandbox"),
    ("build-use-sandbox", "sandbox"),
    ("build-use-substitutes", "substitute"),
    ("env-keep-derivations", "keep-env-derivations"),
    ("gc-keep-derivations", "keep-derivations"),
    ("gc-keep-outputs", "keep-outputs"),
    ("substitution-max-jobs", "max-substitution-jobs"),
    ("trusted-binary-caches", "trusted-substituters"),
];

/// The setting a name sets, as Nix's `Config::set` resolves it: `(true, NAME)` for
/// `extra-NAME` (which appends), and an alias ([`ALIASES`]) replaced by its setting's name.
/// E.g. `extra-binary-caches` → `(true, "substituters")`, `build-timeout` → `(false, "timeout")`.
pub fn setting_of(name: &str) -> (bool, &str) {
    let (extra, base) = match name.strip_prefix("extra-") {
        Some(base) => (true, base),
        None => (false, name),
    };
    (extra, ALIASES.iter().find(|(alias, _)| *alias == base).map_or(base, |(_, setting)| setting))
}

/// Raw settings: name → value, after aliases were resolved and `extra-` lists merged.
#[derive(Debug, Clone, Default)]
pub struct RawConfig {
    values: BTreeMap<String, String>,
    /// Names set that no Nix knows, as they were written (`extra-` included).
    unknown: BTreeSet<String>,
}

/// Errors reading configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}:{line}: {what}")]
    Syntax { file: String, line: usize, what: String },
    #[error("cannot read {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("setting {name}: {value:?} is not {expected}")]
    BadValue { name: String, value: String, expected: &'static str },
}

/// `$NIX_CONF_DIR`, or `/etc/nix` (Nix's `settings.nixConfDir`).
pub(crate) fn nix_conf_dir() -> PathBuf {
    std::env::var_os("NIX_CONF_DIR").map_or_else(|| PathBuf::from("/etc/nix"), PathBuf::from)
}

/// The user configuration files, highest precedence first (Nix's `getUserConfigFiles`).
pub(crate) fn user_config_files() -> Vec<PathBuf> {
    if let Some(files) = std::env::var_os("NIX_USER_CONF_FILES") {
        return std::env::split_paths(&files).filter(|p| !p.as_os_str().is_empty()).collect();
    }
    let home = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
    let dirs = std::env::var_os("XDG_CONFIG_DIRS").unwrap_or_else(|| "/etc/xdg".into());
    let dirs = std::env::split_paths(&dirs).filter(|p| !p.as_os_str().is_empty());
    home.into_iter().chain(dirs).map(|d| d.join("nix/nix.conf")).collect()
}

impl RawConfig {
    /// Reads the files and `NIX_CONFIG` from the environment, as Nix does.
    pub fn from_environment() -> Result<Self, ConfigError> {
        let mut cfg = RawConfig::default();
        cfg.read_file(&nix_conf_dir().join("nix.conf"), true)?;
        for file in user_config_files().iter().rev() {
            cfg.read_file(file, true)?;
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
    pub(crate) fn apply_text(&mut self, text: &str, origin: &str, dir: Option<&Path>) -> Result<(), ConfigError> {
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
                return Err(ConfigError::Syntax {
                    file: origin.into(),
                    line: i + 1,
                    what: format!("expected 'name = value', got {line:?}"),
                });
            };
            self.set(name.trim(), value.trim());
        }
        Ok(())
    }

    /// Sets one setting; `extra-NAME` appends to `NAME`; an alias sets its setting. A name
    /// no Nix knows is also recorded for [`Self::unknown_settings`].
    pub fn set(&mut self, name: &str, value: &str) {
        let (extra, base) = setting_of(name);
        if !KNOWN_SETTINGS.contains(&base) {
            self.unknown.insert(name.to_string());
        }
        match extra.then_some(base) {
            Some(base) => {
                let entry = self.values.entry(base.to_string()).or_default();
                if !entry.is_empty() {
                    entry.push(' ');
                }
                entry.push_str(value);
            }
            None => {
                self.values.insert(base.to_string(), value.to_string());
            }
        }
    }

    /// The names set that no Nix knows, sorted, as written: each deserves Nix's
    /// `warning: unknown setting 'NAME'` (`AbstractConfig::warnUnknownSettings`).
    pub(crate) fn unknown_settings(&self) -> impl Iterator<Item = &str> {
        self.unknown.iter().map(String::as_str)
    }

    /// Prints Nix's warning for each of [`Self::unknown_settings`] on standard error.
    pub fn warn_unknown_settings(&self) {
        for name in self.unknown_settings() {
            eprintln!("warning: unknown setting '{name}'");
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
    /// Whether signatures are checked at all (Nix's `checkSigs`; false for `--no-check-sigs`):
    /// not a nix.conf setting, a command's flag. See `SignaturePolicy::requires_sigs`.
    pub check_sigs: bool,
    /// Connections per cache for HTTP/1.1 (Nix: `http-connections`, default 25); 0 means no
    /// limit, as it does to curl's `CURLMOPT_MAX_TOTAL_CONNECTIONS` that Nix hands it to
    /// (`src/libstore/filetransfer.cc`). See [`Settings::http_connection_limit`].
    pub http_connections: usize,
    /// Substitutions the daemon runs at once when set (Nix 2.26: `max-substitution-jobs`;
    /// values below 1 count as 1). Unset, the daemon uses the pipeline's
    /// [`crate::substitute::DEFAULT_JOBS`], as `sluice copy` does, not Nix's default of 16: a
    /// Nix substitution goal is a whole download with its own transfer, where a sluice job is
    /// one NAR in flight in a pipeline that `http-connections` already bounds per cache (16
    /// made the daemon 1.36× slower than `sluice copy` at RTT 50 ms, `bench/daemon`).
    pub max_substitution_jobs: Option<usize>,
    /// The netrc file with credentials for HTTP(S) caches (`netrc-file`, default
    /// `$NIX_CONF_DIR/netrc`); a file that does not exist means no credentials.
    pub netrc_file: PathBuf,
    /// The default store URL (`store`; its default is `$NIX_REMOTE`, else `auto`: Nix's
    /// `storeUri` in `src/libstore/globals.hh`).
    pub store: String,
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
    /// `auto-optimise-store` (default false): paths added to a local store are deduplicated
    /// by hard links under `.links` ([`sluice_local_store::LocalStore::set_auto_optimise`]).
    pub auto_optimise_store: bool,
    /// `fsync-store-paths` (sluice's default true, Nix's false): a local store makes each
    /// commit's paths durable before registering them
    /// ([`sluice_local_store::LocalStore::set_fsync_store_paths`]).
    pub fsync_store_paths: bool,
    /// sluice's `lock-cpu` (default [`LOCK_CPU_DEFAULT`]): a daemon client
    /// ([`crate::remote::DaemonStore`]) pins its connection's thread to one CPU and asks the
    /// daemon to run its worker there.
    pub lock_cpu: bool,
    /// `experimental-features` (default none): what a local store lets derivations use
    /// ([`sluice_local_store::LocalStore::set_experimental_features`]).
    pub experimental_features: Vec<String>,
}

/// Whether a daemon client pins itself and its daemon worker to one CPU when no `lock-cpu`
/// setting says otherwise. Off, from `bench/daemon`'s measurement (docs/benchmarks.md): with
/// one round trip per path, pinning made `sluice path-info -r` through the daemon 1.6–2.6×
/// faster, but the client now pipelines its queries and pinning gains nothing measurable
/// (0.90–1.11×), while it can keep client and worker on a CPU that other work occupies.
pub(crate) const LOCK_CPU_DEFAULT: bool = false;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            substituters: vec!["https://cache.nixos.org/".into()],
            trusted_public_keys: vec!["cache.nixos.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=".into()],
            require_sigs: true,
            check_sigs: true,
            http_connections: 25,
            max_substitution_jobs: None,
            netrc_file: nix_conf_dir().join("netrc"),
            store: std::env::var("NIX_REMOTE").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "auto".into()),
            connect_timeout: 0,
            stalled_download_timeout: 300,
            download_attempts: 5,
            narinfo_cache_positive_ttl: 30 * 24 * 3600,
            narinfo_cache_negative_ttl: 3600,
            ssl_cert_file: None,
            keep_outputs: false,
            keep_derivations: true,
            auto_optimise_store: false,
            fsync_store_paths: true,
            lock_cpu: LOCK_CPU_DEFAULT,
            experimental_features: Vec::new(),
        }
    }
}

impl Settings {
    /// Applies to the local store `store` the settings that govern what it accepts and how it
    /// keeps paths: `auto-optimise-store`, `fsync-store-paths` and `experimental-features`.
    pub fn configure_local_store(&self, store: &sluice_local_store::LocalStore) {
        store.set_auto_optimise(self.auto_optimise_store);
        store.set_fsync_store_paths(self.fsync_store_paths);
        store.set_experimental_features(self.experimental_features.iter().map(String::as_str));
    }

    /// The signature policy of a store opened with these settings whose URL gave
    /// `store_require_sigs`: [`SignaturePolicy::requires_sigs`] with `require-sigs` and
    /// `check_sigs`, and the `trusted-public-keys` (Nix's `LocalStoreConfig::requireSigs`,
    /// `src/libstore/local-store.hh`). Errors: a key that does not parse ([`TrustedKeysError`],
    /// naming the setting).
    pub fn signature_policy(&self, store_require_sigs: Option<bool>) -> Result<SignaturePolicy, TrustedKeysError> {
        SignaturePolicy::new(
            SignaturePolicy::requires_sigs(self.require_sigs, store_require_sigs, self.check_sigs),
            &self.trusted_public_keys,
        )
    }

    /// Settings from Nix's defaults overlaid with `raw` and the SSL environment variables.
    pub fn from_raw(raw: &RawConfig) -> Result<Self, ConfigError> {
        let mut s = Settings::default();
        let list = |v: &str| v.split_whitespace().map(String::from).collect::<Vec<_>>();
        if let Some(v) = raw.get("substituters") {
            s.substituters = list(v);
        }
        if let Some(v) = raw.get("experimental-features") {
            s.experimental_features = list(v);
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
        for (names, field) in [
            (["keep-outputs", "gc-keep-outputs"], &mut s.keep_outputs),
            (["keep-derivations", "gc-keep-derivations"], &mut s.keep_derivations),
        ] {
            for name in names {
                if let Some(v) = raw.get(name) {
                    *field = parse_bool(name, v)?;
                }
            }
        }
        if let Some(v) = raw.get("fsync-store-paths") {
            s.fsync_store_paths = parse_bool("fsync-store-paths", v)?;
        }
        if let Some(v) = raw.get("auto-optimise-store") {
            s.auto_optimise_store = parse_bool("auto-optimise-store", v)?;
        }
        if let Some(v) = raw.get("lock-cpu") {
            s.lock_cpu = parse_bool("lock-cpu", v)?;
        }
        if let Some(v) = raw.get("http-connections") {
            s.http_connections = parse_num("http-connections", v)? as usize;
        }
        if let Some(v) = raw.get("max-substitution-jobs") {
            s.max_substitution_jobs = Some((parse_num("max-substitution-jobs", v)? as usize).max(1));
        }
        if let Some(v) = raw.get("netrc-file") {
            s.netrc_file = PathBuf::from(v);
        }
        if let Some(v) = raw.get("store") {
            s.store = v.to_string();
        }
        let env_cert = ["NIX_SSL_CERT_FILE", "SSL_CERT_FILE"].iter().find_map(std::env::var_os);
        s.ssl_cert_file = raw.get("ssl-cert-file").map(PathBuf::from).or(env_cert.map(PathBuf::from));
        Ok(s)
    }

    /// Connections per HTTP/1.1 cache, `None` for no limit (`http-connections = 0`).
    pub(crate) fn http_connection_limit(&self) -> Option<usize> {
        (self.http_connections > 0).then_some(self.http_connections)
    }

    /// The settings the HTTP transport of binary caches and `builtin:fetchurl` reads.
    pub fn http_options(&self) -> HttpOptions {
        HttpOptions {
            connection_limit: self.http_connection_limit(),
            connect_timeout: self.connect_timeout,
            stalled_download_timeout: self.stalled_download_timeout,
            download_attempts: self.download_attempts,
            netrc_file: self.netrc_file.clone(),
            ssl_cert_file: self.ssl_cert_file.clone(),
        }
    }
}

/// A Boolean as Nix reads a setting's value or a store URL's parameter
/// (`BaseSetting<bool>::parse`, `src/libutil/config.cc`): `true`, `yes` or `1`; `false`, `no`
/// or `0`; anything else is `None`.
pub(crate) fn nix_bool(value: &str) -> Option<bool> {
    match value {
        "true" | "yes" | "1" => Some(true),
        "false" | "no" | "0" => Some(false),
        _ => None,
    }
}

/// What a Boolean's error says it must be.
pub(crate) const NIX_BOOL: &str = "a Boolean (true, yes, 1, false, no or 0)";

fn parse_bool(name: &str, v: &str) -> Result<bool, ConfigError> {
    nix_bool(v).ok_or_else(|| ConfigError::BadValue { name: name.into(), value: v.into(), expected: NIX_BOOL })
}

fn parse_num(name: &str, v: &str) -> Result<u64, ConfigError> {
    v.parse().map_err(|_| ConfigError::BadValue { name: name.into(), value: v.into(), expected: "a non-negative integer" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_policy_of_settings() {
        let mut settings = Settings { require_sigs: false, ..Default::default() };
        assert!(settings.signature_policy(Some(true)).unwrap().require_sigs);
        settings.check_sigs = false;
        assert!(!settings.signature_policy(Some(true)).unwrap().require_sigs);
        settings.trusted_public_keys = vec!["nokey".into()];
        assert!(settings.signature_policy(None).unwrap_err().to_string().starts_with("trusted-public-keys: "));
    }

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

    /// Booleans are read as Nix reads them: a `nix.conf` with `require-sigs = no` is Nix's.
    #[test]
    fn booleans_are_nix_s() {
        for (text, value) in [("yes", true), ("1", true), ("true", true), ("no", false), ("0", false), ("false", false)] {
            let mut raw = RawConfig::default();
            raw.apply_text(&format!("require-sigs = {text}\nauto-optimise-store = {text}\nfsync-store-paths = {text}\n"), "test", None)
                .unwrap();
            let s = Settings::from_raw(&raw).unwrap();
            assert_eq!((s.require_sigs, s.auto_optimise_store, s.fsync_store_paths), (value, value, value), "{text}");
        }
        let mut raw = RawConfig::default();
        raw.apply_text("require-sigs = True\n", "test", None).unwrap();
        assert!(Settings::from_raw(&raw).unwrap_err().to_string().contains("a Boolean (true, yes, 1, false, no or 0)"));
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
