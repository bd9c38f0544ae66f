//! GC roots (Nix `gc.cc`, `local-fs-store.cc`): AddTempRoot(s), AddIndirectRoot, AddPermRoot,
//! SyncWithGC, FindRoots. Temporary roots go to a per-connection file under `temproots` (see
//! [`sluice_local_store::TempRoots`]) and indirect roots are Nix's `gcroots/auto/<hash>`
//! symlinks, so that sluice's collector and Nix's both honour them.

use std::path::Path;

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

fn replace_symlink(link: &Path, target: &Path) -> Result<(), Fail> {
    let tmp = link.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .and_then(|()| std::fs::rename(&tmp, link))
        .map_err(|e| Fail::Op(format!("creating the root {}: {e}", link.display())))
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
