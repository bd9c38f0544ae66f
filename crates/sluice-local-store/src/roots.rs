//! The garbage collector's roots, as Nix's `findRoots` finds them (`src/libstore/gc.cc`): the
//! `gcroots` and `profiles` trees, runtime roots, and the live holders' temporary roots.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use sluice_nix::store_path::StorePath;

use super::gc::Roots;
use super::{io_err, LocalStore, LocalStoreError};

impl LocalStore {
    /// The roots as Nix's `findRoots(censor)` finds them: the `gcroots` and `profiles` trees,
    /// runtime roots and temporary roots; with `censor`, runtime and temporary roots are
    /// labelled `{censored}`.
    pub fn find_roots(&self, censor: bool) -> Result<Roots, LocalStoreError> {
        let mut roots = self.find_roots_no_temp(censor)?;
        for (path, labels) in self.find_temp_roots()? {
            let entry = roots.entry(path).or_default();
            if censor {
                entry.insert(CENSORED.to_owned());
            } else {
                entry.extend(labels);
            }
        }
        Ok(roots)
    }

    /// Nix's `findRootsNoTemp`.
    pub(crate) fn find_roots_no_temp(&self, censor: bool) -> Result<Roots, LocalStoreError> {
        let mut roots = Roots::new();
        self.find_roots_in(&self.layout.state_dir.join("gcroots"), &mut roots)?;
        self.find_roots_in(&self.layout.state_dir.join("profiles"), &mut roots)?;
        self.find_runtime_roots(censor, &mut roots)?;
        Ok(roots)
    }

    /// Nix's `findRoots(path, type, roots)`: `top` and, for a directory, everything below.
    /// Entries that cannot be read (EACCES, ENOENT, ENOTDIR) are skipped. Users write below
    /// `gcroots/per-user`, so the directories still to read are kept on a heap stack, not by
    /// recursion per level.
    fn find_roots_in(&self, top: &Path, roots: &mut Roots) -> Result<(), LocalStoreError> {
        let mut pending = vec![top.to_owned()];
        while let Some(path) = pending.pop() {
            self.find_root_at(&path, roots, &mut pending)?;
        }
        Ok(())
    }

    /// One entry of [`LocalStore::find_roots_in`]'s walk: a root it is, or a directory whose
    /// entries go onto `pending`.
    fn find_root_at(&self, path: &Path, roots: &mut Roots, pending: &mut Vec<PathBuf>) -> Result<(), LocalStoreError> {
        // Nix skips what it may not read or what went away; a tree under `gcroots/per-user`
        // is written by its user, who can nest it deeper than a path can name or loop it, and
        // that must not stop every collection: such an entry is skipped with a warning.
        let skippable = |e: &io::Error| {
            let is = |errnos: &[rustix::io::Errno]| errnos.iter().any(|n| e.raw_os_error() == Some(n.raw_os_error()));
            if is(&[rustix::io::Errno::NAMETOOLONG, rustix::io::Errno::LOOP]) {
                tracing::warn!("skipping the root '{}': {e}", path.display());
                return true;
            }
            is(&[rustix::io::Errno::ACCESS, rustix::io::Errno::NOENT, rustix::io::Errno::NOTDIR])
        };
        let meta = match std::fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if skippable(&e) => return Ok(()),
            Err(e) => return Err(io_err("reading the root", path)(e)),
        };
        if meta.is_dir() {
            let entries = match std::fs::read_dir(path) {
                Ok(entries) => entries,
                Err(e) if skippable(&e) => return Ok(()),
                Err(e) => return Err(io_err("listing the roots in", path)(e)),
            };
            for entry in entries {
                pending.push(entry.map_err(io_err("listing the roots in", path))?.path());
            }
        } else if meta.file_type().is_symlink() {
            let target = match std::fs::read_link(path) {
                Ok(target) => target,
                Err(e) if skippable(&e) => return Ok(()),
                Err(e) => return Err(io_err("reading the root", path)(e)),
            };
            if self.is_in_store(&target) {
                self.found_root(path, &target, roots)?;
            } else {
                // An indirect root: a link to a link into the store.
                let target = path.parent().unwrap_or(Path::new("/")).join(target);
                match std::fs::symlink_metadata(&target) {
                    Err(_) => {
                        if path.starts_with(self.layout.state_dir.join("gcroots/auto")) {
                            tracing::info!("removing stale link from '{}' to '{}'", path.display(), target.display());
                            let _ = std::fs::remove_file(path);
                        }
                    }
                    Ok(m) if m.file_type().is_symlink() => {
                        if let Ok(target2) = std::fs::read_link(&target) {
                            if self.is_in_store(&target2) {
                                self.found_root(&target, &target2, roots)?;
                            }
                        }
                    }
                    Ok(_) => {}
                }
            }
        } else if meta.is_file() {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if let Ok(p) = StorePath::from_base_name(&name) {
                if self.is_valid_path(&p)? {
                    roots.entry(p).or_default().insert(path.display().to_string());
                }
            }
        }
        Ok(())
    }

    /// Whether `target` is under the (logical) store directory, as Nix's `isInStore`.
    fn is_in_store(&self, target: &Path) -> bool {
        target.to_str().is_some_and(|t| t.strip_prefix(self.store_dir.as_str()).is_some_and(|rest| rest.starts_with('/')))
    }

    /// Records `link` as a root of the store path `target` leads into, if that path is valid.
    fn found_root(&self, link: &Path, target: &Path, roots: &mut Roots) -> Result<(), LocalStoreError> {
        let Ok(path) = self.store_dir.to_store_path(&target.to_string_lossy()) else { return Ok(()) };
        if self.is_valid_path(&path)? {
            roots.entry(path).or_default().insert(link.display().to_string());
        } else {
            tracing::info!("skipping invalid root from '{}' to '{}'", link.display(), target.display());
        }
        Ok(())
    }

    /// Nix's `findRuntimeRoots` on Linux: what processes run, have open, map or name in their
    /// environment, and three kernel settings. A path counts by its real name (where a chroot
    /// store's processes have it open) and by its store name (`/nix/store/…`, which Nix looks
    /// for, in a program's environment say): keeping more is safe.
    fn find_runtime_roots(&self, censor: bool, roots: &mut Roots) -> Result<(), LocalStoreError> {
        let mut prefixes = vec![format!("{}/", self.layout.real_store_dir.display()), format!("{}/", self.store_dir.as_str())];
        prefixes.dedup();
        let mut unchecked: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let link = |file: String, unchecked: &mut BTreeMap<String, BTreeSet<String>>| {
            if let Ok(target) = std::fs::read_link(&file) {
                unchecked.entry(target.to_string_lossy().into_owned()).or_default().insert(file);
            }
        };
        if let Ok(procs) = std::fs::read_dir("/proc") {
            for entry in procs.flatten() {
                let pid = entry.file_name().to_string_lossy().into_owned();
                if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
                    continue;
                }
                link(format!("/proc/{pid}/exe"), &mut unchecked);
                link(format!("/proc/{pid}/cwd"), &mut unchecked);
                if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
                    for fd in fds.flatten() {
                        link(format!("/proc/{pid}/fd/{}", fd.file_name().to_string_lossy()), &mut unchecked);
                    }
                }
                let maps = format!("/proc/{pid}/maps");
                if let Ok(text) = std::fs::read_to_string(&maps) {
                    for line in text.lines() {
                        let fields: Vec<&str> = line.split_whitespace().collect();
                        if fields.len() == 6 && fields[5].starts_with('/') {
                            unchecked.entry(fields[5].to_owned()).or_default().insert(maps.clone());
                        }
                    }
                }
                let environ = format!("/proc/{pid}/environ");
                if let Ok(env) = std::fs::read(&environ) {
                    for found in prefixes.iter().flat_map(|prefix| store_paths_in(&env, prefix.as_bytes())) {
                        unchecked.entry(found).or_default().insert(environ.clone());
                    }
                }
            }
        }
        for file in ["/proc/sys/kernel/modprobe", "/proc/sys/kernel/fbsplash", "/proc/sys/kernel/poweroff_cmd"] {
            if let Ok(text) = std::fs::read_to_string(file) {
                unchecked.entry(text).or_default().insert(file.to_owned());
            }
        }
        for (target, links) in unchecked {
            let Some(rest) = prefixes.iter().find_map(|prefix| target.strip_prefix(prefix.as_str())) else { continue };
            let Ok(path) = StorePath::from_base_name(rest.split('/').next().unwrap_or(rest)) else { continue };
            if !self.is_valid_path(&path)? {
                continue;
            }
            let entry = roots.entry(path).or_default();
            if censor {
                entry.insert(CENSORED.to_owned());
            } else {
                entry.extend(links);
            }
        }
        Ok(())
    }
}

/// What Nix shows an untrusted client instead of a temporary or runtime root's label.
const CENSORED: &str = "{censored}";

/// The store paths named in `text` (a process environment) under `prefix` (`<store dir>/`):
/// the prefix followed by `[0-9a-z]+[0-9a-zA-Z+\-._?=]*`, as Nix's `storePathRegex`.
fn store_paths_in(text: &[u8], prefix: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(i) = text[at..].windows(prefix.len()).position(|w| w == prefix) {
        let start = at + i;
        let rest = &text[start + prefix.len()..];
        let first = rest.iter().take_while(|b| b.is_ascii_digit() || b.is_ascii_lowercase()).count();
        let len = if first == 0 { 0 } else { rest.iter().take_while(|b| b.is_ascii_alphanumeric() || b"+-._?=".contains(b)).count() };
        if len > 0 {
            found.push(String::from_utf8_lossy(&text[start..start + prefix.len() + len]).into_owned());
        }
        at = start + prefix.len();
    }
    found
}

#[cfg(test)]
mod tests {
    use super::store_paths_in;

    #[test]
    fn store_paths_in_an_environment() {
        let env = b"PATH=/r/nix/store/abc-x/bin:/r/nix/store/:/usr/bin\0X=/r/nix/store/Zq\0Y=/r/nix/store/9z-y.drv?a=b";
        assert_eq!(store_paths_in(env, b"/r/nix/store/"), ["/r/nix/store/abc-x", "/r/nix/store/9z-y.drv?a=b"]);
    }
}
