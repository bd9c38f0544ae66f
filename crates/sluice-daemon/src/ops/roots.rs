//! GC roots (Nix `gc.cc`, `local-fs-store.cc`): AddTempRoot(s), AddIndirectRoot, AddPermRoot,
//! SyncWithGC, FindRoots. Temporary roots go to a per-connection file under `temproots` (see
//! [`sluice_local_store::TempRoots`]) and indirect roots are Nix's `gcroots/auto/<hash>`
//! symlinks, so that sluice's collector and Nix's both honour them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sluice_nix::base32;
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::wire::ops::{AddIndirectRoot, AddPermRoot, AddTempRoot, AddTempRoots, FindRoots, SyncWithGc};
use sluice_nix::wire::{write_bytes, write_u64};

use crate::conn::{op_err, Conn, Fail, OpResult};

/// AddTempRoot: path → 1.
pub(super) fn add_temp_root(c: &mut Conn, AddTempRoot { path }: AddTempRoot) -> OpResult {
    c.add_temp_roots(std::slice::from_ref(&path))?;
    c.reply(|w, _| write_u64(w, 1))
}

/// AddTempRoots (op 49, DeterminateSystems' Nix): path set → 1, every path a temporary root
/// as AddTempRoot makes it, written together.
pub(super) fn add_temp_roots(c: &mut Conn, AddTempRoots { paths }: AddTempRoots) -> OpResult {
    c.add_temp_roots(&paths.into_iter().collect::<Vec<_>>())?;
    c.reply(|w, _| write_u64(w, 1))
}

/// SyncWithGC (obsolete): → 1.
pub(super) fn sync_with_gc(c: &mut Conn, _: SyncWithGc) -> OpResult {
    c.reply(|w, _| write_u64(w, 1))
}

/// AddIndirectRoot: the absolute path of a symlink to a store path → 1, after linking
/// `gcroots/auto/<sha1 of the path, nixbase32>` to it.
pub(super) fn add_indirect_root(c: &mut Conn, AddIndirectRoot { link }: AddIndirectRoot) -> OpResult {
    if !link.starts_with('/') {
        return Err(Fail::Op(format!("indirect root '{link}' is not an absolute path")));
    }
    indirect_root(c, &link)?;
    c.reply(|w, _| write_u64(w, 1))
}

/// Nix 2.26's refusal of AddPermRoot to an untrusted client.
const PERM_ROOT_REFUSED: &str =
    "you are not privileged to create perm roots\n\nhint: you can just do this client-side without special privileges, and probably want to do that instead.";

/// Whether the client may send AddPermRoot: only a trusted client, since the daemon would
/// create the symlink with its own rights. As Nix 2.26, an untrusted client is refused before
/// its request is read, so the connection ends after the error.
pub(super) fn may_add_perm_root(c: &Conn) -> Result<(), Fail> {
    match c.peer.trusted {
        true => Ok(()),
        false => Err(Fail::Fatal(PERM_ROOT_REFUSED.into())),
    }
}

/// AddPermRoot (≥ 1.36; [`may_add_perm_root`]): store path, root path → the root path, after
/// making it a symlink to the store path and an indirect root.
pub(super) fn add_perm_root(c: &mut Conn, AddPermRoot { path, root }: AddPermRoot) -> OpResult {
    if !root.starts_with('/') || root.starts_with(&format!("{}/", c.dir().as_str())) {
        return Err(Fail::Op(format!(
            "creating a garbage collector root ({root}) in the Nix store is forbidden; it must be an absolute path outside it"
        )));
    }
    replace_symlink(Path::new(&root), Path::new(&c.dir().display_path(&path)))?;
    indirect_root(c, &root)?;
    c.reply(|w, _| write_bytes(w, root.as_bytes()))
}

fn indirect_root(c: &Conn, link: &str) -> Result<(), Fail> {
    let hash = Hash::digest_bytes(HashAlgo::Sha1, link.as_bytes());
    let auto = c.store().state_dir().join("gcroots/auto").join(base32::encode(hash.digest()));
    std::fs::create_dir_all(c.store().state_dir().join("gcroots/auto")).map_err(op_err)?;
    replace_symlink(&auto, Path::new(link))
}

/// Makes `link` a symlink to `target`, replacing what is there at once: the symlink is made
/// under a temporary name ([`temp_link`]) and renamed over `link`, as Nix's `replaceSymlink`
/// (`src/libutil/file-system.cc`) does.
fn replace_symlink(link: &Path, target: &Path) -> Result<(), Fail> {
    let tmp = temp_link(link);
    let _ = std::fs::remove_file(&tmp);
    let made = std::os::unix::fs::symlink(target, &tmp).and_then(|()| std::fs::rename(&tmp, link));
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made.map_err(|e| Fail::Op(format!("creating the root {} (through {}): {e}", link.display(), tmp.display())))
}

/// A temporary name beside `link`, its own to this call: `link` with `.tmp-<pid>-<n>` appended
/// (`n` counts the calls of the process), so that two workers replacing links at once, or
/// links that differ only in their extension (`x.a`, `x.b`), never share one. Nix's
/// `replaceSymlink` tries `.<n>_<name>` until one is free; in one process, a counter suffices.
fn temp_link(link: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut name = link.as_os_str().to_owned();
    name.push(format!(".tmp-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    PathBuf::from(name)
}

/// FindRoots: → count, then (link, store path) pairs, as Nix's `findRoots(!trusted)` finds
/// them (see [`sluice_local_store::LocalStore::find_roots`]): an indirect root is listed as
/// the user's link (`/home/u/result`), not as its `gcroots/auto` entry; runtime and temporary
/// roots are labelled `{censored}` for an untrusted client.
pub(super) fn find_roots(c: &mut Conn, _: FindRoots) -> OpResult {
    let roots = c.store().find_roots(!c.peer.trusted).map_err(op_err)?;
    c.reply(|w, dir| {
        write_u64(w, roots.values().map(|links| links.len() as u64).sum())?;
        for (path, links) in &roots {
            for link in links {
                write_bytes(w, link.as_bytes())?;
                write_bytes(w, dir.display_path(path).as_bytes())?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each call has a temporary name of its own, `link`'s whole name with a suffix: links
    /// that differ only in their extension do not share one, and neither do two calls for
    /// one link.
    #[test]
    fn temporary_names_are_the_links_own_and_the_calls_own() {
        let (a, b) = (temp_link(Path::new("/r/x.a")), temp_link(Path::new("/r/x.b")));
        let pid = std::process::id().to_string();
        for (temp, link) in [(&a, "/r/x.a.tmp-"), (&b, "/r/x.b.tmp-")] {
            let rest = temp.to_str().unwrap().strip_prefix(link).unwrap_or_else(|| panic!("{temp:?}"));
            assert_eq!(rest.split('-').next(), Some(pid.as_str()), "{temp:?}");
        }
        assert_ne!(temp_link(Path::new("/r/x.a")), a);
    }

    /// Links `x.a` and `x.b` replaced over and over by two threads each at once (as two workers
    /// of one daemon may): every replacement succeeds, each link ends pointing at its own
    /// target, and no temporary is left. Regression: all four shared `x.tmp-<pid>`, so one's
    /// rename found it gone, or moved another's symlink into place.
    #[test]
    fn links_replaced_at_once_by_several_threads_all_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let failures: Vec<String> = std::thread::scope(|scope| {
            let workers: Vec<_> = ["x.a", "x.b", "x.a", "x.b"]
                .into_iter()
                .map(|name| {
                    let (link, target) = (dir.path().join(name), Path::new("/nix/store").join(name));
                    scope.spawn(move || {
                        (0..300).filter_map(|_| replace_symlink(&link, &target).err().map(|e| format!("{e:?}"))).collect::<Vec<_>>()
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
        });
        assert!(failures.is_empty(), "{} of 1200 replacements failed, the first: {}", failures.len(), failures[0]);
        for name in ["x.a", "x.b"] {
            assert_eq!(std::fs::read_link(dir.path().join(name)).unwrap(), Path::new("/nix/store").join(name));
        }
        let mut left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["x.a", "x.b"]);
    }
}
