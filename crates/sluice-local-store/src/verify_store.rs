//! `nix-store --verify [--check-contents] [--repair]`: Nix 2.8's `LocalStore::verifyStore` and
//! `verifyPath` (`src/libstore/local-store.cc`), with their messages. Under a shared hold of
//! `gc.lock` (no collection runs meanwhile): every valid path must exist (one that vanished is
//! unregistered if no valid path refers to it, otherwise reported and, with repair,
//! substituted again); with contents checked, every `.links` entry must hash to its name (a
//! modified one is removed with repair) and every valid path's NAR to its registered hash
//! (a modified one is, with repair, substituted again), the paths hashed on every core at once
//! and reported in Nix's order. Repairs go through the caller's
//! `repair` (the substitution pipeline, [`LocalStore::try_begin_repair`]); the replacement's
//! NAR hash must be the registered one, and it replaces the tree in one atomic exchange.

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rustix::fs::{flock, FlockOperation};
use sluice_nix::hash::{Hash, HashAlgo, Hasher};
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;

use super::tree::sorted_entries;
use super::{io_err, lock, LocalStore, LocalStoreError};

/// A message of the verification, at Nix's level.
#[derive(Debug)]
pub enum VerifyMessage<'a> {
    /// `printInfo`.
    Info(&'a str),
    /// `printError`: shown without a prefix.
    Error(&'a str),
    /// `logError` of an exception: shown as `error: …`.
    LoggedError(&'a str),
    /// `warn`/`logWarning`: shown as `warning: …`.
    Warning(&'a str),
}

/// Substitutes a damaged valid path again; the error says why it could not.
pub type Repairer<'r> = &'r mut dyn FnMut(&StorePath) -> Result<(), String>;

impl LocalStore {
    /// Verifies the store as Nix does (see the module documentation); returns whether errors
    /// remain (Nix's result, which makes `nix-store --verify` exit 1). `repair` is `None`
    /// unless the caller may repair.
    pub fn verify_store(
        &self,
        check_contents: bool,
        mut repair: Option<Repairer<'_>>,
        say: &mut dyn FnMut(VerifyMessage<'_>),
    ) -> Result<bool, LocalStoreError> {
        say(VerifyMessage::Info("reading the Nix store..."));
        let lock_path = self.layout.state_dir.join("gc.lock");
        let gc_lock = lock::open_lock_file(&lock_path).map_err(io_err("opening the GC lock", &lock_path))?;
        flock(&gc_lock, FlockOperation::LockShared).map_err(|e| io_err("locking", &lock_path)(e.into()))?;
        let real = &self.layout.real_store_dir;
        let present: HashSet<Vec<u8>> =
            sorted_entries(std::os::fd::AsFd::as_fd(&self.store_fd)).map_err(io_err("reading directory", real))?.into_iter().collect();
        say(VerifyMessage::Info("checking path existence..."));
        let mut errors = false;
        let mut walk = Walk { store: self, present, done: HashSet::new(), valid: BTreeSet::new() };
        for path in self.query_all_valid_paths()? {
            walk.verify_path(&path, &mut repair, &mut errors, say)?;
        }
        if !check_contents {
            return Ok(errors);
        }
        say(VerifyMessage::Info("checking link hashes..."));
        let links = self.links_path();
        let links_fd = super::tree::open_dir(std::os::fd::AsFd::as_fd(&self.store_fd), super::optimise::LINKS_DIR.as_bytes())
            .map_err(io_err("opening directory", &links))?;
        for name in sorted_entries(std::os::fd::AsFd::as_fd(&links_fd)).map_err(io_err("reading directory", &links))? {
            let shown_name = String::from_utf8_lossy(&name).into_owned();
            let link = links.join(&shown_name);
            let hash = super::optimise::nar_hash(std::os::fd::AsFd::as_fd(&links_fd), &name).map_err(io_err("hashing", &link))?.to_nix32();
            if hash != shown_name {
                say(VerifyMessage::Error(&format!("link '{}' was modified! expected hash '{shown_name}', got '{hash}'", link.display())));
                if repair.is_some() {
                    rustix::fs::unlinkat(std::os::fd::AsFd::as_fd(&links_fd), name.as_slice(), rustix::fs::AtFlags::empty())
                        .map_err(|e| io_err("removing corrupt link", &link)(e.into()))?;
                    say(VerifyMessage::Info(&format!("removed link '{}'", link.display())));
                } else {
                    errors = true;
                }
            }
        }
        say(VerifyMessage::Info("checking store hashes..."));
        let valid: Vec<&StorePath> = walk.valid.iter().collect();
        let hashed = self.hash_paths(&valid);
        for (path, checked) in valid.into_iter().zip(hashed) {
            let shown = self.store_dir.display_path(path);
            let outcome = match checked {
                Ok((info, current)) if current != info.nar_hash => {
                    say(VerifyMessage::Error(&format!(
                        "path '{shown}' was modified! expected hash '{}', got '{}'",
                        info.nar_hash.to_nix32_prefixed(),
                        current.to_nix32_prefixed()
                    )));
                    match &mut repair {
                        Some(repair) => repair(path).map_err(|e| format!("cannot repair path '{shown}': {e}")),
                        None => {
                            errors = true;
                            Ok(())
                        }
                    }
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = outcome {
                // A path collected meanwhile is only worth a warning (Nix's words).
                if self.is_valid_path(path)? {
                    say(VerifyMessage::LoggedError(&e));
                } else {
                    say(VerifyMessage::Warning(&e));
                }
                errors = true;
            }
        }
        Ok(errors)
    }
}

/// A path's registration and its current NAR hash, or why it could not be hashed.
type Hashed = Result<(ValidPathInfo, Hash), LocalStoreError>;

/// A path's registration as read (`None`: not valid), or why it could not be read.
type Registration = Result<Option<ValidPathInfo>, LocalStoreError>;

impl LocalStore {
    /// The registration and current NAR hash of each of `paths`, in order: the registrations
    /// read in one database transaction (Nix queries each path's, a read lock each), then the
    /// trees hashed on as many threads as there are cores (Nix hashes one path at a time).
    fn hash_paths(&self, paths: &[&StorePath]) -> Vec<Hashed> {
        let owned: Vec<StorePath> = paths.iter().map(|p| (*p).clone()).collect();
        let infos = self.query_path_infos(&owned);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(paths.len().max(1));
        let next = AtomicUsize::new(0);
        let slots: Vec<Mutex<Option<Hashed>>> = paths.iter().map(|_| Mutex::new(None)).collect();
        let infos: Vec<Mutex<Option<Registration>>> = infos.into_iter().map(|i| Mutex::new(Some(i))).collect();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let (Some(path), Some(slot), Some(info)) = (paths.get(i), slots.get(i), infos.get(i)) else { break };
                    let info = info.lock().unwrap_or_else(|p| p.into_inner()).take();
                    let hashed = self.hash_path(path, info);
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(hashed);
                });
            }
        });
        slots
            .into_iter()
            .zip(paths)
            .map(|(slot, path)| {
                let unhashed = || Err(LocalStoreError::NotValid { path: self.store_dir.display_path(path) });
                slot.into_inner().unwrap_or_else(|p| p.into_inner()).unwrap_or_else(unhashed)
            })
            .collect()
    }

    /// The registration `info` of `path` (as read, `None` if it is not valid) and the sha256
    /// of its NAR as it is now.
    fn hash_path(&self, path: &StorePath, info: Option<Registration>) -> Hashed {
        let not_valid = || LocalStoreError::NotValid { path: self.store_dir.display_path(path) };
        let info = info.ok_or_else(not_valid)??.ok_or_else(not_valid)?;
        let real_path = self.real_path(path);
        let mut hasher = Hasher::new(HashAlgo::Sha256);
        let mut writer = NarWriter::new(&mut hasher).map_err(io_err("hashing", &real_path))?;
        super::dump::dump(std::os::fd::AsFd::as_fd(&self.store_fd), path.base_name().as_bytes(), &mut writer)
            .map_err(io_err("hashing", &real_path))?;
        Ok((info, hasher.finish()))
    }
}

/// The existence check's state (Nix's `verifyPath` arguments).
struct Walk<'s> {
    store: &'s LocalStore,
    /// The names in the store directory.
    present: HashSet<Vec<u8>>,
    done: HashSet<StorePath>,
    /// The paths that exist (and so stay valid).
    valid: BTreeSet<StorePath>,
}

impl Walk<'_> {
    fn verify_path(
        &mut self,
        path: &StorePath,
        repair: &mut Option<Repairer<'_>>,
        errors: &mut bool,
        say: &mut dyn FnMut(VerifyMessage<'_>),
    ) -> Result<(), LocalStoreError> {
        if !self.done.insert(path.clone()) {
            return Ok(());
        }
        if self.present.contains(path.base_name().as_bytes()) {
            self.valid.insert(path.clone());
            return Ok(());
        }
        // Referrers first: if none of them stays valid, this path can be unregistered too.
        let mut can_invalidate = true;
        for referrer in self.store.query_referrers(path)? {
            if referrer != *path {
                self.verify_path(&referrer, repair, errors, say)?;
                can_invalidate &= !self.valid.contains(&referrer);
            }
        }
        let shown = self.store.store_dir.display_path(path);
        if can_invalidate {
            say(VerifyMessage::Info(&format!("path '{shown}' disappeared, removing from database...")));
            self.store.registry.invalidate_checked(path)?;
            return Ok(());
        }
        say(VerifyMessage::Error(&format!("path '{shown}' disappeared, but it still has valid referrers!")));
        match repair {
            Some(repair) => {
                if let Err(e) = repair(path) {
                    say(VerifyMessage::Warning(&format!("cannot repair path '{shown}': {e}")));
                    *errors = true;
                }
            }
            None => *errors = true,
        }
        Ok(())
    }
}
