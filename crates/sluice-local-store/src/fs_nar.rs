//! NARs of arbitrary file-system objects, outside any store: `nix-store --dump PATH` and
//! `nix-store --restore DIR`. The same walker and unpacker the store uses, so the same rules
//! hold (entries sorted by name bytes, nothing followed, nothing overwritten).

use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use sluice_nix::nar::reader::{parse_whole, NarError};
use sluice_nix::nar::writer::NarWriter;

use super::{dump, tree, unpack};

/// The parent directory of `path` (opened without following symlinks) and `path`'s name.
fn parent_and_name(path: &Path) -> io::Result<(std::os::fd::OwnedFd, &[u8])> {
    let name =
        path.file_name().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{} has no file name", path.display())))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = rustix::fs::open(
        parent,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    Ok((dir, name.as_bytes()))
}

/// Writes the NAR serialisation of the object at `path` (a final symlink is dumped as a
/// symlink) to `out`, byte-identical to `nix-store --dump`.
pub fn dump_fs_path(path: &Path, out: &mut dyn Write) -> io::Result<()> {
    use std::os::fd::AsFd;
    let (dir, name) = parent_and_name(path)?;
    let mut writer = NarWriter::new(out)?;
    dump::dump(dir.as_fd(), name, &mut writer)
}

/// Unpacks the NAR read from `nar` at `dest`, which must not exist yet; returns the NAR's
/// size in bytes. Files are created as `nix-store --restore` creates them (0666, or 0777 if
/// executable, less the umask).
/// The NAR must be the whole of `nar`: data after its end is refused
/// ([`parse_whole`]). A NAR that turns out to be invalid leaves nothing at `dest`. Unlike a store's tree, a tree
/// restored here may be deeper than `PATH_MAX` (as `tar -x` makes one): it is not Nix's to
/// read.
pub fn restore_nar(nar: &mut dyn Read, dest: &Path) -> Result<u64, NarError> {
    use std::os::fd::AsFd;
    let (dir, name) = parent_and_name(dest).map_err(|source| NarError::Io { offset: 0, source })?;
    if rustix::fs::statat(dir.as_fd(), name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).is_ok() {
        let source = io::Error::new(io::ErrorKind::AlreadyExists, format!("{} exists already", dest.display()));
        return Err(NarError::Io { offset: 0, source });
    }
    let mut unpacker = unpack::Unpacker::new(dir.as_fd(), name, None, unpack::FileModes::RESTORE, unpack::Creation::Fchmod, usize::MAX);
    let result = parse_whole(nar, &mut unpacker);
    if result.is_err() {
        // The parse error is the one to report.
        let _ = tree::remove_tree(dir.as_fd(), name);
    }
    result
}
