//! `builtin:unpack-channel`: the output of a channel (`nix-channel --update`) is the channel
//! tarball `src` unpacked, its one top-level entry renamed to `channelName`, as Nix 2.8/2.26
//! `src/libstore/builtins/unpack-channel.cc` makes it (`unpackTarfile` with libarchive, which
//! recognises the compression by its magic bytes).
//!
//! `src` is read through the builtin's [`View`] of the store (only the inputs' closure
//! exists, as in Nix's sandbox: sluice runs as the store's owner). The tarball is unpacked
//! into a temporary directory, never into the store; an entry whose path leaves that
//! directory (`..`, an absolute path, a link out of it) fails the build, as libarchive's
//! `SECURE_NODOTDOT` and `SECURE_SYMLINKS` make it fail. The directory is then serialised as
//! the output's NAR, so only what a NAR holds (directories, regular files with their
//! executable bit, symlinks) is kept; a device or FIFO entry fails the build. A hard link is
//! made only to an entry already inside the directory (the tar crate canonicalises its
//! target), so nothing outside it is copied into the store. The headers the tar crate keeps
//! in memory for one entry (pax, GNU long names, sparse maps) are bounded as libarchive bounds
//! them ([`MAX_HEADERS`]).

use std::cell::Cell;
use std::collections::BTreeSet;
use std::io::{self, Read};
use std::path::{Component, Path};
use std::rc::Rc;

use sluice_nix::store_path::StorePath;

use super::view::View;
use super::{BuiltinDerivation, BuiltinError, Spool};
use sluice_binary_cache::causes::causes;
use sluice_compress::Compression;
use sluice_local_store::{dump_fs_path, LocalStore};

/// Unpacks `drv`'s `src` (a tarball in the store paths `visible`) into `spool` as the NAR of
/// its output: a directory holding one entry, `channelName`.
pub(super) fn build(
    store: &LocalStore,
    visible: &BTreeSet<StorePath>,
    drv: &BuiltinDerivation,
    spool: &mut Spool,
) -> Result<(), BuiltinError> {
    let failed = BuiltinError::Failed;
    let channel_name = drv.attr("channelName")?;
    let src = drv.attr("src")?;
    let mut components = Path::new(channel_name).components();
    if !matches!((components.next(), components.next()), (Some(Component::Normal(_)), None)) || channel_name.contains('/') {
        return Err(failed(format!("channelName is not allowed to contain filesystem separators, got {channel_name}")));
    }
    let view = View::new(store, visible);
    let tarball = view.resolve(Path::new(src)).and_then(|p| view.real(&p)).and_then(std::fs::File::open);
    let tarball = tarball.map_err(|e| failed(format!("opening channel tarball '{src}': {e}")))?;
    let dir =
        tempfile::tempdir().map_err(|e| failed(format!("creating a temporary directory in {}: {e}", std::env::temp_dir().display())))?;
    let out = dir.path().join("out");
    std::fs::create_dir(&out).map_err(|e| failed(format!("creating {}: {e}", out.display())))?;
    unpack(io::BufReader::new(tarball), &out).map_err(|e| failed(format!("unpacking channel tarball '{src}': {}", causes(&e))))?;
    let mut entries = std::fs::read_dir(&out)
        .and_then(|d| d.map(|e| e.map(|e| e.file_name())).collect::<io::Result<Vec<_>>>())
        .map_err(|e| failed(format!("reading {}: {e}", out.display())))?;
    let Some(entry) = entries.pop() else { return Err(failed(format!("channel tarball '{src}' is empty"))) };
    if !entries.is_empty() {
        return Err(failed(format!("channel tarball '{src}' contains more than one file")));
    }
    std::fs::rename(out.join(&entry), out.join(channel_name)).map_err(|e| failed(format!("renaming channel directory: {e}")))?;
    dump_fs_path(&out, spool).map_err(|e| failed(format!("channel tarball '{src}': {e}")))
}

/// Bytes the tar crate may read between two entries: the pax extended headers, GNU long
/// names and sparse maps it keeps in memory for the next entry (and the headers themselves).
/// libarchive, which Nix unpacks with, refuses such a header over 1 MiB ("Special header too
/// large", `archive_read_support_format_tar.c`); unbounded, a 5 MB gzip tarball with a 1 GiB pax
/// header made sluice daemon (as root) hold 1.1 GB.
const MAX_HEADERS: u64 = 1 << 20;

/// Unpacks the tarball `input` (uncompressed, or compressed in any format sluice reads) into
/// the directory `dest`: an entry that would land outside `dest`, a device or FIFO, or more
/// than [`MAX_HEADERS`] bytes of headers for one entry is an error naming it.
fn unpack(mut input: impl io::BufRead + Send, dest: &Path) -> io::Result<()> {
    let head = input.fill_buf()?;
    let input: Box<dyn Read + Send> = match Compression::detect(head) {
        Some(c) if c != Compression::None => c.decoder(input).map_err(io::Error::other)?,
        _ => Box::new(input),
    };
    let budget = Rc::new(Cell::new(None));
    let mut archive = tar::Archive::new(Budgeted { inner: input, budget: Rc::clone(&budget) });
    archive.set_preserve_permissions(false);
    archive.set_preserve_mtime(false);
    archive.set_overwrite(true);
    let mut entries = archive.entries()?;
    loop {
        budget.set(Some(MAX_HEADERS));
        let next = entries.next();
        budget.set(None);
        let Some(entry) = next else { return Ok(()) };
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        // The tar crate writes an entry of a type it does not create as a regular file (POSIX's
        // rule for unknown types), so a device or FIFO would become an empty file; libarchive
        // creates it, and Nix's `dumpPath` then fails the build ("has an unsupported type").
        let kind = entry.header().entry_type();
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            return Err(io::Error::other(format!("entry '{}' is a device or FIFO, which a store path cannot hold", path.display())));
        }
        // `unpack_in` also skips `..` (returning false) and fails a write through a link out of
        // `dest` ("trying to unpack outside of destination path").
        let outside = path.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
        if outside || !entry.unpack_in(dest)? {
            return Err(io::Error::other(format!("entry '{}' is not inside the archive's directory", path.display())));
        }
    }
}

/// The tarball's bytes, of which at most `budget` more may be read while it is `Some` (while
/// the tar crate looks for the next entry).
struct Budgeted<R> {
    inner: R,
    budget: Rc<Cell<Option<u64>>>,
}

impl<R: Read> Read for Budgeted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(left) = self.budget.get() else { return self.inner.read(buf) };
        if left == 0 {
            return Err(io::Error::other(format!(
                "more than {MAX_HEADERS} bytes of headers (pax, GNU long names, sparse maps) for one entry"
            )));
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.budget.set(Some(left - n as u64));
        Ok(n)
    }
}
