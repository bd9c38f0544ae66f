//! Additions over the serve protocol (`--write` only): ImportPaths (an export stream: each
//! NAR then its trailer) and AddToStoreNar (the info, then the NAR). Nix's `opServe` adds
//! both with `NoCheckSigs`: the client is whoever may run the far end's program over ssh, as
//! trusted as `nix-daemon --stdio`'s (and `sluice daemon --stdio`'s) client. Every path still
//! goes through the store's verification boundary (`PendingPath::commit`): its NAR hash and
//! size, its content address against its content, its references valid; a client that
//! disappears mid-NAR leaves nothing registered (the unpacked tree is dropped).

use std::io::{self, Read, Seek, Write};

use sluice_local_store::SignaturePolicy;
use sluice_nix::hash::{HashAlgo, HashingReader};
use sluice_nix::nar::reader::copy_nar;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::wire::read_u64;
use sluice_nix::wire::serve::{read_export_trailer, AddToStoreNar, ExportTrailer};

use super::{refused, LegacyServeError, Session};

/// An ImportPaths NAR larger than this is spooled to a temporary file rather than memory.
const SPOOL_IN_MEMORY: usize = 16 << 20;

impl<R: Read, W: Write> Session<R, W> {
    /// ImportPaths: for each `1`, a NAR and its trailer; `0` ends; answered `1`. Each NAR is
    /// kept (spooled) until its trailer names its path, then added; paths are added as they
    /// arrive, so a stream cut short leaves the paths before the cut, each whole.
    pub(super) fn import_paths(&mut self) -> Result<(), LegacyServeError> {
        self.require_write("importing paths")?;
        loop {
            match read_u64(&mut self.r, "export stream item")? {
                0 => break,
                1 => self.import_one()?,
                n => {
                    return Err(LegacyServeError::Refused(format!(
                        "input doesn't look like something created by 'nix-store --export' (item {n})"
                    )))
                }
            }
        }
        sluice_nix::wire::write_u64(&mut self.w, 1).map_err(LegacyServeError::Write)
    }

    /// One path of an export stream: its NAR (hashed as it is spooled), then its trailer.
    fn import_one(&mut self) -> Result<(), LegacyServeError> {
        let mut spool = tempfile::SpooledTempFile::new(SPOOL_IN_MEMORY);
        let mut hashing = HashingReader::new(&mut self.r, HashAlgo::Sha256);
        copy_nar(&mut hashing, &mut spool).map_err(|e| LegacyServeError::Refused(format!("reading the NAR of an imported path: {e}")))?;
        let nar_size = hashing.len();
        let (nar_hash, _) = hashing.finish();
        let ExportTrailer { path, references, deriver } = read_export_trailer(&mut self.r, self.store.store_dir())?;
        spool.rewind().map_err(|e| LegacyServeError::Refused(format!("rereading the spooled NAR: {e}")))?;
        let info = ValidPathInfo {
            path,
            nar_hash,
            nar_size,
            references,
            deriver,
            registration_time: 0,
            ultimate: false,
            sigs: Default::default(),
            ca: None,
        };
        self.store.add_nar_if_missing(info, &mut spool, &SignaturePolicy::unchecked(), &self.roots, false).map_err(refused)?;
        Ok(())
    }

    /// AddToStoreNar: the info, then exactly its NAR size of NAR → `1`. A valid path's NAR is
    /// read and dropped.
    pub(super) fn add_to_store_nar(&mut self) -> Result<(), LegacyServeError> {
        self.require_write("importing paths")?;
        let AddToStoreNar { info } = self.read()?;
        let mut nar = (&mut self.r).take(info.nar_size);
        self.store.add_nar_if_missing(info, &mut nar, &SignaturePolicy::unchecked(), &self.roots, false).map_err(refused)?;
        io::copy(&mut nar, &mut io::sink()).map_err(|e| LegacyServeError::Refused(format!("reading the rest of the NAR: {e}")))?;
        sluice_nix::wire::write_u64(&mut self.w, 1).map_err(LegacyServeError::Write)
    }
}
