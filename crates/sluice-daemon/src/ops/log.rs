//! AddBuildLog (Nix `daemon.cc`, `wopAddBuildLog`; the store side is `LocalStore::addBuildLog`):
//! a trusted client hands over a derivation's build log, which is kept bzip2-compressed where
//! Nix's `nix log` and `nix-store --read-log` look for it:
//! `<log dir>/drvs/<first 2 characters of the base name>/<rest of the base name>.bz2`.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::AddBuildLog;
use sluice_nix::wire::{write_u64, FramedReader};

use super::add::finish_framed;
use crate::conn::{Conn, Fail, OpResult};

/// AddBuildLog: derivation (its base name, as Nix clients send it; a full store path is also
/// accepted), then the log as a framed stream → 1. Only for trusted clients. The stream is
/// always read to its end, so a refusal leaves the connection usable. A log already stored
/// for the derivation is kept, as Nix keeps it.
pub(super) fn add_build_log(c: &mut Conn, AddBuildLog { drv }: AddBuildLog) -> OpResult {
    let drv =
        StorePath::from_base_name(&drv).or_else(|_| c.dir().parse_path(&drv)).map_err(|e| Fail::Op(format!("cannot add a build log: {e}")));
    let target = drv.and_then(|drv| {
        if !c.peer.trusted {
            return Err(Fail::Op("you are not privileged to add logs".into()));
        }
        if !drv.is_derivation() {
            return Err(Fail::Op(format!("cannot add a build log for '{}': it is not a derivation", c.dir().display_path(&drv))));
        }
        let base = drv.base_name();
        Ok(c.store().log_dir().join("drvs").join(&base[..2]).join(format!("{}.bz2", &base[2..])))
    });
    let mut framed = FramedReader::new(&mut c.r);
    let stored = target.and_then(|file| if file.exists() { Ok(()) } else { write_log(&file, &mut framed) });
    // After a broken stream there is nothing left to drain.
    if !matches!(stored, Err(Fail::Fatal(_))) {
        finish_framed(&mut framed)?;
    }
    stored?;
    c.reply(|w, _| write_u64(w, 1))
}

/// Compresses `log` with bzip2 into a temporary file beside `file`, then renames it to
/// `file`. A failure to read `log` is fatal to the connection (the stream is broken); a
/// failure to write is an operation error naming the file, and the rest of `log` is left for
/// the caller to drain.
fn write_log(file: &Path, log: &mut impl Read) -> Result<(), Fail> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let failed = |what: &str, path: &Path, e: std::io::Error| Fail::Op(format!("storing the build log: {what} {}: {e}", path.display()));
    fs::create_dir_all(dir).map_err(|e| failed("creating", dir, e))?;
    let temp = tempfile::Builder::new()
        .prefix(".tmp-")
        .permissions(fs::Permissions::from_mode(0o644))
        .tempfile_in(dir)
        .map_err(|e| failed("creating a temporary file in", dir, e))?;
    let temp_path: PathBuf = temp.path().to_owned();
    let mut encoder = bzip2::write::BzEncoder::new(temp, bzip2::Compression::default());
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = log.read(&mut buf).map_err(|e| Fail::Fatal(format!("reading the framed build log: {e}")))?;
        if n == 0 {
            break;
        }
        encoder.write_all(&buf[..n]).map_err(|e| failed("writing", &temp_path, e))?;
    }
    let temp = encoder.finish().map_err(|e| failed("writing", &temp_path, e))?;
    temp.persist(file).map_err(|e| failed("renaming a temporary file to", file, e.error))?;
    Ok(())
}
