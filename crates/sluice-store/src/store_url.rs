//! Store URLs as Nix writes them (`src/libstore/store-reference.cc`, `store-api.cc`
//! `openStore`, Nix 2.26): a kind's own form (`local`, `file:///dir`, …; every kind registered
//! in `registry/` names its forms, parameters and Nix sources in its module doc), or
//! `auto` (or the empty string: the local store if its state directory, `$NIX_STATE_DIR` or
//! `/nix/var/nix`, is writable, else the daemon if its socket exists, else the local store;
//! Nix's `getStoreType` in `store-api.cc`, without 2.8's fallback to a store under
//! `~/.local/share/nix/root` when `/nix` does not exist), each followed by `?name=value&…`
//! parameters (percent-decoded, as Nix's `decodeQuery` in `src/libutil/url.cc`).
//!
//! Every parameter Nix 2.26 accepts for a kind of store is accepted here for that kind, read as
//! Nix reads its setting type (`src/libutil/config.cc`): Booleans `true`/`yes`/`1` and
//! `false`/`no`/`0`; integers with an optional `K`/`M`/`G`/`T` suffix
//! (`string2IntWithUnitPrefix`); paths must be absolute and are canonicalised (`canonPath`), and
//! may not be empty (except `root`, where empty means none). Anything else is an error naming
//! the URL, the parameter and the value, raised before any store is opened: an unknown
//! parameter (Nix only warns), a parameter of another kind of store, one given twice, one
//! without `=`, a bad value. (Nix ignores a parameter without `=` with a warning and keeps the
//! first of two with the same name.)
//!
//! The parameters every kind takes (`COMMON`, Nix's `StoreConfig`, `store-api.hh`):
//!
//! | parameter | in sluice |
//! |---|---|
//! | `store` | must be `/nix/store` (sluice's store directory is fixed), except for a binary cache used as a substituter ([`CommonParams::store_dir`]) |
//! | `priority` | caches: overrides `nix-cache-info` (an int, negative too); the other kinds that can be substituters ([`StoreUrl::as_substituter`]): their priority as one, default 0 (Nix's `StoreConfig::priority`); others: accepted, no effect (only substituters have one) |
//! | `want-mass-query` | caches: overrides `nix-cache-info`; others: accepted, no effect |
//! | `trusted` | substituters: [`CommonParams::trusted`], their paths need no signature by a trusted key (Nix's `isTrusted`, which only the substitution goal reads); the source or destination of a copy: no effect, as in Nix: a copy from it checks signatures (unless `--no-check-sigs`), and whether a push into it needs signatures is the far end's decision (an `ssh-ng://` daemon checks them unless the client is in its `trusted-users`; `nix-store --serve --write` checks none, `nix-store.cc`), which no parameter of ours changes |
//! | `path-info-cache-size`, `system-features` | accepted, no effect (sluice keeps no path-info cache and does not build) |
//!
//! Those of a local file system store (`LOCAL_FS`, Nix's `LocalFSStoreConfig`,
//! `local-fs-store.hh`), which the local and daemon kinds take: `root`, `state`, `log`, `real`
//! ([`LocalFsDirs`]). Parameters accepted with no effect are kept, validated, in
//! [`CommonParams::unused`]; none of them changes what Nix would do with the store in the
//! operations sluice performs, so none is refused.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use crate::config::Settings;
use crate::registry::{StoreConfig, StoreKind};
use crate::store::{Store, StoreFuture};
pub use sluice_binary_cache::url::{CacheKind, CacheUrl, CacheWriteParams, S3Params, DEFAULT_COMPRESSION};
pub use sluice_local_store::config::{CommonParams, LocalFsDirs, LocalStoreConfig};
use sluice_nix::store_path::StoreDir;

/// A parsed store URL: its kind and the configuration the kind parsed from it.
#[derive(Debug)]
pub struct StoreUrl {
    url: String,
    kind: &'static StoreKind,
    config: Box<dyn StoreConfig>,
}

/// The only logical store directory sluice supports (the `store` parameter).
pub(crate) const STORE_DIR: &str = "/nix/store";

/// Why a store URL was rejected. Each names the URL as given.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreUrlError {
    #[error("unsupported store URL {0:?} (expected {forms})", forms = crate::registry::forms())]
    Unsupported(String),
    #[error("store URL {url:?}: unknown parameter {param:?}")]
    UnknownParam { url: String, param: String },
    #[error("store URL {url:?}: parameter {param:?} is not one of a {kind}")]
    WrongKind { url: String, param: String, kind: &'static str },
    #[error("store URL {url:?}: parameter {param:?} is given twice")]
    Duplicate { url: String, param: String },
    #[error("store URL {url:?}: {text:?} is not a name=value parameter")]
    Malformed { url: String, text: String },
    #[error("store URL {url:?}: parameter {param:?} has the invalid value {value:?}: {reason}")]
    BadParam { url: String, param: String, value: String, reason: &'static str },
    #[error("environment variable {var} has the invalid value {value:?}: {reason}")]
    BadEnv { var: &'static str, value: String, reason: &'static str },
    #[error("store URL {url:?}: a relative path needs the working directory: {reason}")]
    NoWorkingDir { url: String, reason: String },
}

/// How Nix reads a setting's value (`src/libutil/config.cc`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum ParamType {
    Bool,
    Int,
    Path,
    OptionalPath,
    Text,
}

/// A parameter a kind of store takes: its name and type.
pub(crate) type Param = (&'static str, ParamType);

/// The parameters of Nix's `StoreConfig` (`store-api.hh`), which every kind takes.
pub(crate) const COMMON: &[Param] = &[
    ("store", ParamType::Path),
    ("path-info-cache-size", ParamType::Int),
    ("trusted", ParamType::Bool),
    ("priority", ParamType::Int),
    ("want-mass-query", ParamType::Bool),
    ("system-features", ParamType::Text),
];

/// The parameters of Nix's `LocalFSStoreConfig` (`local-fs-store.hh`): the local and daemon
/// kinds take them.
pub(crate) const LOCAL_FS: &[Param] =
    &[("root", ParamType::OptionalPath), ("state", ParamType::Path), ("log", ParamType::Path), ("real", ParamType::Path)];

impl StoreUrl {
    /// Parses a store URL and its parameters with the kind that claims it (see the module doc
    /// for what is accepted); nothing is opened.
    pub fn parse(url: &str) -> Result<Self, StoreUrlError> {
        let (main, query) = url.split_once('?').unwrap_or((url, ""));
        if main == "auto" || main.is_empty() {
            let main = if auto_is_daemon() { "daemon" } else { "local" };
            return StoreUrl::parse(&if query.is_empty() { main.to_owned() } else { format!("{main}?{query}") });
        }
        let kind = crate::registry::kind_of(main).ok_or_else(|| StoreUrlError::Unsupported(url.to_string()))?;
        let config = (kind.parse)(url, main, Query::parse(url, query, kind)?)?;
        Ok(StoreUrl { url: url.to_string(), kind, config })
    }

    /// The kind of store, as messages name it ("local store", "binary cache").
    pub fn kind_name(&self) -> &'static str {
        self.kind.name
    }

    /// The binary cache the URL names, for a kind that can be a substituter.
    pub fn as_cache(&self) -> Option<&CacheUrl> {
        self.config.as_cache()
    }

    /// The common parameters of a store that can be a substituter other than as a binary
    /// cache (read through the `Store` interface, `crate::substituter_source`).
    pub fn as_substituter(&self) -> Option<&CommonParams> {
        self.config.as_substituter()
    }

    /// The local store the URL names, for code that needs the local store itself.
    pub fn as_local(&self) -> Option<&LocalStoreConfig> {
        self.config.as_local()
    }

    /// Opens the store with `settings` (Nix's `openStore`).
    pub fn open<'a>(&'a self, settings: &'a Settings) -> StoreFuture<'a, Arc<dyn Store>> {
        self.config.open(&self.url, settings)
    }

    /// The configuration the kind parsed, for a kind's own tests.
    #[cfg(test)]
    pub(crate) fn config(&self) -> &dyn StoreConfig {
        self.config.as_ref()
    }
}

/// Whether `auto` means the daemon: the state directory is not writable and the daemon's
/// socket exists. (With a variable that names no absolute path, the local store, whose URL
/// then fails saying why.)
fn auto_is_daemon() -> bool {
    let Ok(state) = crate::env_dirs::state_dir() else { return false };
    let Ok(socket) = crate::env_dirs::daemon_socket(&state) else { return false };
    rustix::fs::access(&state, rustix::fs::Access::READ_OK | rustix::fs::Access::WRITE_OK).is_err() && socket.exists()
}

/// A URL's parameters, checked against those its kind of store takes, taken one by one into
/// typed fields by the kind; the rest are validated and kept by [`Query::finish`].
pub(crate) struct Query<'a> {
    url: &'a str,
    kind: &'static StoreKind,
    params: BTreeMap<String, String>,
}

impl<'a> Query<'a> {
    pub(crate) fn parse(url: &'a str, query: &str, kind: &'static StoreKind) -> Result<Self, StoreUrlError> {
        let mut params = BTreeMap::new();
        for text in query.split('&').filter(|p| !p.is_empty()) {
            let malformed = || StoreUrlError::Malformed { url: url.to_string(), text: text.to_string() };
            let (name, value) = text.split_once('=').ok_or_else(malformed)?;
            let (name, value) = (percent_decode(name).ok_or_else(malformed)?, percent_decode(value).ok_or_else(malformed)?);
            if param_type(kind, &name).is_none() {
                return Err(match crate::registry::is_known_param(&name) {
                    true => StoreUrlError::WrongKind { url: url.to_string(), param: name, kind: kind.name },
                    false => StoreUrlError::UnknownParam { url: url.to_string(), param: name },
                });
            }
            if params.contains_key(&name) {
                return Err(StoreUrlError::Duplicate { url: url.to_string(), param: name });
            }
            params.insert(name, value);
        }
        Ok(Query { url, kind, params })
    }

    pub(crate) fn take(&mut self, name: &str) -> Option<String> {
        self.params.remove(name)
    }

    pub(crate) fn bad(&self, param: &str, value: &str, reason: &'static str) -> StoreUrlError {
        StoreUrlError::BadParam { url: self.url.to_string(), param: param.to_string(), value: value.to_string(), reason }
    }

    /// [`crate::config::nix_bool`].
    pub(crate) fn bool(&self, name: &str, value: &str) -> Result<bool, StoreUrlError> {
        crate::config::nix_bool(value).ok_or_else(|| self.bad(name, value, "not a Boolean (true, yes, 1, false, no or 0)"))
    }

    /// `string2IntWithUnitPrefix`: an integer, optionally followed by K, M, G or T.
    pub(crate) fn int(&self, name: &str, value: &str) -> Result<i64, StoreUrlError> {
        let bad = || self.bad(name, value, "not an integer (optionally followed by K, M, G or T)");
        let (digits, shift) = match value.as_bytes().last().map(u8::to_ascii_uppercase) {
            Some(b'K') => (&value[..value.len() - 1], 10),
            Some(b'M') => (&value[..value.len() - 1], 20),
            Some(b'G') => (&value[..value.len() - 1], 30),
            Some(b'T') => (&value[..value.len() - 1], 40),
            _ => (value, 0),
        };
        let n: i64 = digits.parse().map_err(|_| bad())?;
        n.checked_mul(1 << shift).ok_or_else(bad)
    }

    /// `PathSetting::parse`: a non-empty absolute path, canonicalised.
    pub(crate) fn path(&self, name: &str, value: &str) -> Result<PathBuf, StoreUrlError> {
        self.optional_path(name, value)?.ok_or_else(|| self.bad(name, value, "a path cannot be empty"))
    }

    /// `OptionalPathSetting::parse`: empty is none.
    pub(crate) fn optional_path(&self, name: &str, value: &str) -> Result<Option<PathBuf>, StoreUrlError> {
        if value.is_empty() {
            return Ok(None);
        }
        canon_path(value).map(Some).ok_or_else(|| self.bad(name, value, "not an absolute path"))
    }

    fn check(&self, name: &str, value: &str, ty: ParamType) -> Result<(), StoreUrlError> {
        match ty {
            ParamType::Bool => self.bool(name, value).map(drop),
            ParamType::Int => self.int(name, value).map(drop),
            ParamType::Path => self.path(name, value).map(drop),
            ParamType::OptionalPath => self.optional_path(name, value).map(drop),
            ParamType::Text => Ok(()),
        }
    }

    pub(crate) fn take_bool(&mut self, name: &str) -> Result<Option<bool>, StoreUrlError> {
        self.take(name).map(|v| self.bool(name, &v)).transpose()
    }

    /// The directories of a local file-system store (`LOCAL_FS`): `root` (else `main_root`),
    /// then `state`, `log` and `real` over the defaults under it.
    pub(crate) fn take_dirs(&mut self, main_root: Option<PathBuf>) -> Result<LocalFsDirs, StoreUrlError> {
        let root = match self.take("root") {
            Some(v) => self.optional_path("root", &v)?,
            None => main_root,
        };
        let mut dirs = crate::env_dirs::local_fs_dirs(root.as_deref())?;
        for (name, dir) in [("state", &mut dirs.state), ("log", &mut dirs.log), ("real", &mut dirs.real)] {
            if let Some(v) = self.take(name) {
                *dir = self.path(name, &v)?;
            }
        }
        Ok(dirs)
    }

    pub(crate) fn take_size(&mut self, name: &str, default: u64) -> Result<u64, StoreUrlError> {
        match self.take(name) {
            Some(v) => u64::try_from(self.int(name, &v)?).map_err(|_| self.bad(name, &v, "a size cannot be negative")),
            None => Ok(default),
        }
    }

    /// Takes the [`CommonParams`], checks `store` (`/nix/store` only) and validates and keeps
    /// the rest.
    pub(crate) fn finish(self) -> Result<CommonParams, StoreUrlError> {
        self.finish_with(false)
    }

    /// [`Query::finish`] for a binary cache, whose `store` may be any directory.
    pub(crate) fn finish_cache(self) -> Result<CommonParams, StoreUrlError> {
        self.finish_with(true)
    }

    fn finish_with(mut self, any_store_dir: bool) -> Result<CommonParams, StoreUrlError> {
        let store_dir = match self.take("store") {
            Some(v) => {
                let dir = self.path("store", &v)?;
                if !any_store_dir && dir != Path::new(STORE_DIR) {
                    return Err(self.bad("store", &v, "sluice supports only the store directory /nix/store"));
                }
                let dir = dir.to_str().and_then(|d| StoreDir::new(d).ok());
                dir.ok_or_else(|| self.bad("store", &v, "not a store directory"))?
            }
            None => {
                crate::env_dirs::check_store_dir()?;
                StoreDir::default()
            }
        };
        let priority = match self.take("priority") {
            Some(v) => Some(
                i32::try_from(self.int("priority", &v)?).map_err(|_| self.bad("priority", &v, "out of the range of Nix's int setting"))?,
            ),
            None => None,
        };
        let want_mass_query = self.take_bool("want-mass-query")?;
        let trusted = self.take_bool("trusted")?.unwrap_or(false);
        for (name, value) in &self.params {
            self.check(name, value, param_type(self.kind, name).unwrap_or(ParamType::Text))?;
        }
        Ok(CommonParams { priority, want_mass_query, trusted, store_dir, unused: self.params })
    }
}

/// The type of the parameter `name` if `kind` takes it.
fn param_type(kind: &StoreKind, name: &str) -> Option<ParamType> {
    COMMON.iter().chain(kind.params.iter().copied().flatten()).find(|(n, _)| *n == name).map(|(_, ty)| *ty)
}

/// Nix's `canonPath` without following symbolic links: `None` for a relative path; `.`, `..`
/// and repeated or trailing slashes removed.
pub(crate) fn canon_path(path: &str) -> Option<PathBuf> {
    if !path.starts_with('/') {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in Path::new(path).components() {
        match c {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Some(out)
}

/// Nix's `percentDecode`: `%XX` escapes decoded; `None` for a malformed one or a result that is
/// not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> StoreUrl {
        StoreUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn local(url: &str) -> LocalStoreConfig {
        let parsed = parsed(url);
        parsed.as_local().cloned().unwrap_or_else(|| panic!("{url}: {parsed:?}"))
    }

    fn cache(url: &str) -> CacheUrl {
        let parsed = parsed(url);
        parsed.as_cache().cloned().unwrap_or_else(|| panic!("{url}: {parsed:?}"))
    }

    fn default_write() -> CacheWriteParams {
        CacheWriteParams {
            compression: DEFAULT_COMPRESSION,
            compression_level: None,
            parallel_compression: false,
            write_nar_listing: false,
            secret_key_files: vec![],
        }
    }

    #[test]
    fn write_and_s3_params() {
        let c = cache("s3://bucket?region=eu-west-1&endpoint=127.0.0.1:9000&scheme=http&compression=xz&compression-level=9&secret-key=/k1&secret-keys=/k2,/k3&multipart-upload=true&multipart-chunk-size=8M");
        assert_eq!(c.write.compression, sluice_compress::Compression::Xz);
        assert_eq!(c.write.compression_level, Some(9));
        assert_eq!(c.write.secret_key_files, [PathBuf::from("/k1"), "/k2".into(), "/k3".into()]);
        // Relative key files are the working directory's, as Nix's `readFile(secretKeyFile)`.
        assert_eq!(cache("file:///c?secret-key=ci-cache.sec").write.secret_key_files, [PathBuf::from("ci-cache.sec")]);
        let CacheKind::S3(s3) = c.kind else { panic!("{c:?}") };
        assert_eq!(
            (s3.bucket.as_str(), s3.region.as_str(), s3.endpoint.as_deref(), s3.path_style),
            ("bucket", "eu-west-1", Some("127.0.0.1:9000"), true)
        );
        assert_eq!((s3.multipart_upload, s3.multipart_chunk_size, s3.multipart_threshold), (true, 8 << 20, 100 << 20));
        assert!(err("file:///c?compression=lz5").contains("\"compression\" has the invalid value \"lz5\""));
        assert!(err("file:///c?region=x").contains("\"region\" is not one of a binary cache"));
        assert!(err("s3://b?addressing-style=odd").contains("addressing-style"));
    }

    fn err(url: &str) -> String {
        StoreUrl::parse(url).err().unwrap_or_else(|| panic!("{url} was accepted")).to_string()
    }

    #[test]
    fn local_forms() {
        let system = local("local");
        assert_eq!(
            system.dirs,
            LocalFsDirs { root: None, state: "/nix/var/nix".into(), log: "/nix/var/log/nix".into(), real: "/nix/store".into() }
        );
        assert!(!system.read_only);
        assert_eq!(system.require_sigs, None);
        assert_eq!(local("local?root=/tmp/r"), LocalStoreConfig::with_root(Path::new("/tmp/r")));
        assert_eq!(local("/tmp/r"), LocalStoreConfig::with_root(Path::new("/tmp/r")));
        assert_eq!(local("/tmp/r?root=/tmp/s").dirs.root, Some("/tmp/s".into()));
        // A relative path with a `/` is a chroot store under the working directory, as Nix
        // 2.26's `isNonUriPath` and `absPath` (Nix 2.8 took `./DIR` too).
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(local("./r").dirs.root, Some(cwd.join("r")));
        assert_eq!(local("relative/path/..").dirs.root, Some(cwd.join("relative")));
        assert_eq!(
            local("local?root=/tmp/r/./x//&real=/big/store/&state=/tmp/../var/st&log=/l").dirs,
            LocalFsDirs { root: Some("/tmp/r/x".into()), state: "/var/st".into(), log: "/l".into(), real: "/big/store".into() }
        );
        let c = local("local?read-only=true&require-sigs=0&store=/nix//store/&priority=5&trusted=yes&want-mass-query=no&path-info-cache-size=1K&system-features=kvm");
        assert!(c.read_only);
        assert_eq!(c.require_sigs, Some(false));
        assert_eq!(c.common.priority, Some(5));
        assert!(c.common.trusted);
        assert_eq!(c.common.want_mass_query, Some(false));
        let unused: Vec<(&str, &str)> = c.common.unused.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(unused, [("path-info-cache-size", "1K"), ("system-features", "kvm")]);
        assert_eq!(local("local?root=").dirs.root, None, "an empty root is none, as Nix's OptionalPathSetting");
        assert_eq!(local("local?root=%2Ftmp%2Fr").dirs.root, Some("/tmp/r".into()), "percent-decoded");
    }

    #[test]
    fn cache_forms() {
        assert_eq!(
            cache("file:///srv/cache/?priority=10"),
            CacheUrl {
                base: "file:///srv/cache".into(),
                kind: CacheKind::File,
                common: CommonParams { priority: Some(10), ..Default::default() },
                write: default_write()
            }
        );
        assert_eq!(
            cache("https://cache.nixos.org"),
            CacheUrl {
                base: "https://cache.nixos.org".into(),
                kind: CacheKind::Http,
                common: CommonParams::default(),
                write: default_write()
            }
        );
        let c = cache("http://x?trusted=1&want-mass-query=true&priority=2K&compression=zstd&write-nar-listing=1&index-debug-info=0&secret-key=/k&local-nar-cache=/c&parallel-compression=true&compression-level=-1");
        assert_eq!((c.common.trusted, c.common.want_mass_query, c.common.priority), (true, Some(true), Some(2048)));
        let names: Vec<&str> = c.common.unused.keys().map(String::as_str).collect();
        assert_eq!(names, ["index-debug-info", "local-nar-cache"]);
        let write = CacheWriteParams {
            compression: sluice_compress::Compression::Zstd,
            compression_level: None,
            parallel_compression: true,
            write_nar_listing: true,
            secret_key_files: vec!["/k".into()],
        };
        assert_eq!(c.write, write);
    }

    #[test]
    fn unsupported_forms() {
        for url in [
            "s4://x",
            "s3://",
            "s3://bucket/dir",
            "gopher://host",
            "unix://relative",
            "file://relative",
            "dummy://x",
            "dummy",
            "memory://x",
        ] {
            assert_eq!(StoreUrl::parse(url).err(), Some(StoreUrlError::Unsupported(url.into())));
        }
        let expected = "(expected local, local?root=DIR, a path, daemon, unix://, ssh-ng://[user@]host[:port], file://, http://, https://, s3://BUCKET, dummy://, memory:// or ssh://[user@]host[:port])";
        assert_eq!(err("gopher://host"), format!("unsupported store URL \"gopher://host\" {expected}"));
    }

    #[test]
    fn refusals_name_url_parameter_and_value() {
        assert_eq!(err("local?rot=/tmp/x"), r#"store URL "local?rot=/tmp/x": unknown parameter "rot""#);
        assert_eq!(err("https://c?root=/r"), r#"store URL "https://c?root=/r": parameter "root" is not one of a binary cache"#);
        assert_eq!(err("local?compression=xz"), r#"store URL "local?compression=xz": parameter "compression" is not one of a local store"#);
        assert_eq!(
            err("daemon?read-only=true"),
            r#"store URL "daemon?read-only=true": parameter "read-only" is not one of a daemon store"#
        );
        assert_eq!(err("local?root=/a&root=/b"), r#"store URL "local?root=/a&root=/b": parameter "root" is given twice"#);
        assert_eq!(err("local?read-only"), r#"store URL "local?read-only": "read-only" is not a name=value parameter"#);
        assert_eq!(err("local?root=%zz"), r#"store URL "local?root=%zz": "root=%zz" is not a name=value parameter"#);
        let bad = |url: &str, param: &str, value: &str| {
            let e = err(url);
            assert!(e.starts_with(&format!("store URL {url:?}: parameter {param:?} has the invalid value {value:?}: ")), "{e}");
            e
        };
        assert!(bad("local?read-only=maybe", "read-only", "maybe").ends_with("not a Boolean (true, yes, 1, false, no or 0)"));
        assert!(bad("local?root=tmp/x", "root", "tmp/x").ends_with("not an absolute path"));
        assert!(bad("/tmp/r?state=", "state", "").ends_with("a path cannot be empty"));
        bad("local?real=rel", "real", "rel");
        bad("local?require-sigs=2", "require-sigs", "2");
        assert!(bad("http://x?priority=high", "priority", "high").ends_with("not an integer (optionally followed by K, M, G or T)"));
        assert!(bad("http://x?priority=3G", "priority", "3G").ends_with("out of the range of Nix's int setting"));
        assert_eq!(cache("http://x?priority=-1").common.priority, Some(-1), "negative, as Nix's Setting<int> takes it");
        bad("http://x?compression-level=fast", "compression-level", "fast");
        bad("unix:///s?max-connections=many", "max-connections", "many");
        bad("local?path-info-cache-size=1X", "path-info-cache-size", "1X");
        assert!(bad("local?store=/foo/store&root=/tmp/x", "store", "/foo/store")
            .ends_with("sluice supports only the store directory /nix/store"));
        assert_eq!(cache("file:///c?store=/gnu/store/").common.store_dir.as_str(), "/gnu/store", "a cache's, canonicalised");
        assert_eq!(cache("file:///c").common.store_dir.as_str(), "/nix/store");
        bad("file:///c?store=gnu", "store", "gnu");
        assert_eq!(err("dummy://?root=/r"), r#"store URL "dummy://?root=/r": parameter "root" is not one of a dummy store"#);
        bad("memory://?priority=x", "priority", "x");
    }
}
