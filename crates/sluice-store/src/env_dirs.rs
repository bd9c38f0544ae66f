//! The directories Nix's settings take from the environment (`src/libstore/globals.cc`,
//! `Settings::Settings`, Nix 2.26), which are the defaults of a store's directories
//! (`local-fs-store.hh`: without `root`, `state` is `nixStateDir`, `log` is `nixLogDir`, and
//! `real` the store directory; `store-api.hh`: the `store` of every store is `nixStore`):
//!
//! | variable | Nix's setting | default |
//! |---|---|---|
//! | `NIX_STORE_DIR`, else `NIX_STORE` | `nixStore` | `/nix/store` |
//! | `NIX_STATE_DIR` | `nixStateDir` | `/nix/var/nix` |
//! | `NIX_LOG_DIR` | `nixLogDir` | `/nix/var/log/nix` |
//! | `NIX_DAEMON_SOCKET_PATH` | (`getDaemonSocketPath`) | `daemon-socket/socket` in the store's state directory |
//!
//! A variable that is empty counts as unset (Nix's `getEnvNonEmpty`); a value must be an
//! absolute path, canonicalised as Nix's `canonPath` does (which refuses a relative one).

use std::path::{Path, PathBuf};

use crate::store_url::{canon_path, LocalFsDirs, StoreUrlError, STORE_DIR};

/// The first of `vars` that is set and not empty, with its value canonicalised; `None` if
/// none is.
fn from_env(vars: &[&'static str]) -> Result<Option<(&'static str, PathBuf)>, StoreUrlError> {
    for var in vars {
        if let Some(value) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let text = value.to_string_lossy();
            let path =
                canon_path(&text).ok_or_else(|| StoreUrlError::BadEnv { var, value: text.to_string(), reason: "not an absolute path" })?;
            return Ok(Some((var, path)));
        }
    }
    Ok(None)
}

/// The path in `var`, else `default`.
fn dir(var: &'static str, default: &str) -> Result<PathBuf, StoreUrlError> {
    Ok(from_env(&[var])?.map_or_else(|| PathBuf::from(default), |(_, path)| path))
}

/// Refuses a logical store directory (`NIX_STORE_DIR`, else `NIX_STORE`) other than
/// `/nix/store`, the only one sluice supports, naming the variable.
pub(crate) fn check_store_dir() -> Result<(), StoreUrlError> {
    match from_env(&["NIX_STORE_DIR", "NIX_STORE"])? {
        Some((var, path)) if path != Path::new(STORE_DIR) => Err(StoreUrlError::BadEnv {
            var,
            value: path.display().to_string(),
            reason: "sluice supports only the store directory /nix/store",
        }),
        _ => Ok(()),
    }
}

/// The directories of a local file-system store under `root`, or without one those the
/// environment names (the store directory's location is `/nix/store`: see
/// [`check_store_dir`]).
pub(crate) fn local_fs_dirs(root: Option<&Path>) -> Result<LocalFsDirs, StoreUrlError> {
    match root {
        Some(_) => Ok(LocalFsDirs::under(root)),
        None => Ok(LocalFsDirs {
            root: None,
            state: state_dir()?,
            log: dir("NIX_LOG_DIR", "/nix/var/log/nix")?,
            real: PathBuf::from(STORE_DIR),
        }),
    }
}

/// The state directory of a store without `root` (`NIX_STATE_DIR`, else `/nix/var/nix`).
pub(crate) fn state_dir() -> Result<PathBuf, StoreUrlError> {
    dir("NIX_STATE_DIR", "/nix/var/nix")
}

/// The default daemon socket of a store whose state directory is `state`
/// (`NIX_DAEMON_SOCKET_PATH`, else `daemon-socket/socket` in `state`; Nix's
/// `getDaemonSocketPath`, `src/libstore/uds-remote-store.cc`): where `daemon` and `unix://`
/// connect and `sluice daemon` listens. A chroot store (`local?root=DIR`) thus has its own,
/// `DIR/nix/var/nix/daemon-socket/socket`, never the system's.
pub fn daemon_socket(state: &Path) -> Result<PathBuf, StoreUrlError> {
    match from_env(&["NIX_DAEMON_SOCKET_PATH"])? {
        Some((_, path)) => Ok(path),
        None => Ok(state.join("daemon-socket/socket")),
    }
}
