//! The directories of a local store under its root, created as Nix's `LocalStore` constructor
//! creates them (`src/libstore/local-store.cc`, Nix 2.8): `nix/store` (with `.links`),
//! `nix/var/nix/{profiles,temproots,db,gcroots}`, the symlink `gcroots/profiles` →
//! `profiles`, `profiles/per-user` and `gcroots/per-user` (mode 0755) and the current user's
//! directory in each. (`userpool` is only created by Nix when it builds with build users;
//! `db/reserved` is disk space Nix reserves for itself on its first open.) The directories are
//! the store URL's `real` and `state` ([`LocalFsDirs`], Nix's `local-fs-store.hh`).

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::config::LocalFsDirs;

/// Where a store keeps its files.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    /// `real` (default `<root>/nix/store`).
    pub(super) real_store_dir: PathBuf,
    /// `state` (default `<root>/nix/var/nix`).
    pub(super) state_dir: PathBuf,
    /// `<state>/db`.
    pub(super) db_dir: PathBuf,
    /// `<state>/db/db.sqlite`.
    pub(super) db_file: PathBuf,
    /// `log` (default `<root>/nix/var/log/nix`); not created here (Nix creates it when it
    /// first writes a build log).
    pub(super) log_dir: PathBuf,
}

impl Layout {
    pub(super) fn new(dirs: &LocalFsDirs) -> Self {
        Layout {
            real_store_dir: dirs.real.clone(),
            db_dir: dirs.state.join("db"),
            db_file: dirs.state.join("db/db.sqlite"),
            state_dir: dirs.state.clone(),
            log_dir: dirs.log.clone(),
        }
    }

    /// Creates the missing directories. Returns the first failure with the directory it
    /// concerned.
    pub(super) fn create(&self) -> Result<(), (PathBuf, io::Error)> {
        let mkdir = |dir: &Path| DirBuilder::new().recursive(true).create(dir).map_err(|e| (dir.to_owned(), e));
        let profiles = self.state_dir.join("profiles");
        let gcroots = self.state_dir.join("gcroots");
        mkdir(&self.real_store_dir)?;
        mkdir(&self.real_store_dir.join(super::optimise::LINKS_DIR))?;
        mkdir(&profiles)?;
        mkdir(&self.state_dir.join("temproots"))?;
        mkdir(&self.db_dir)?;
        if !gcroots.exists() {
            mkdir(&gcroots)?;
            let link = gcroots.join("profiles");
            // Another process opening the new store at the same moment may have made it first.
            match std::os::unix::fs::symlink(&profiles, &link) {
                Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err((link, e)),
                _ => {}
            }
        }
        let user = user_name();
        for per_user in [profiles.join("per-user"), gcroots.join("per-user")] {
            mkdir_0755(&per_user)?;
            if let Some(user) = &user {
                mkdir_0755(&per_user.join(user))?;
            }
        }
        Ok(())
    }
}

/// Creates `dir` if missing and sets its mode to 0755.
fn mkdir_0755(dir: &Path) -> Result<(), (PathBuf, io::Error)> {
    DirBuilder::new().recursive(true).mode(0o755).create(dir).map_err(|e| (dir.to_owned(), e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(|e| (dir.to_owned(), e))
}

/// The name of the effective user, as Nix's `getUserName`: from `/etc/passwd`, else `$USER`.
fn user_name() -> Option<String> {
    let uid = rustix::process::geteuid().as_raw().to_string();
    let from_passwd = fs::read_to_string("/etc/passwd").ok().and_then(|passwd| {
        passwd.lines().find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.len() > 2 && fields[2] == uid).then(|| fields[0].to_owned())
        })
    });
    from_passwd.or_else(|| std::env::var("USER").ok()).filter(|name| !name.is_empty() && !name.contains('/'))
}
