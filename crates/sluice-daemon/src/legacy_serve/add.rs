//! Additions over the serve protocol (`--write` only): ImportPaths (an export stream: each
//! NAR then its trailer) and AddToStoreNar (the info, then the NAR). Nix's `opServe` adds
//! both with `NoCheckSigs`: the client is whoever may run the far end's program over ssh, as
//! trusted as `nix-daemon --stdio`'s (and `sluice daemon --stdio`'s) client. Every path still
//! goes through the store's verification boundary (`PendingPath::commit`): its NAR hash and
//! size, its content address against its content, its references valid; a client that
//! disappears mid-NAR leaves nothing registered (the unpacked tree is dropped).
//!
//! Paths are unpacked as they arrive and registered in batches ([`BatchedAdder`]: one flush and
//! one transaction per batch, where Nix commits each path); their answers (`1`) are owed until
//! the session settles them ([`Session::settle`]): before any other request, and before it
//! waits for input, so a client that sends its additions back to back (sluice's `ssh://`)
//! gets its paths committed together, and one that waits for each answer gets it.

use std::io::{self, Read, Seek, Write};
use std::sync::Arc;

use sluice_local_store::{LocalStore, SignaturePolicy, TempRoots};
use sluice_nix::hash::{HashAlgo, HashingReader};
use sluice_nix::nar::reader::copy_nar;
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::wire::serve::{read_export_trailer, AddToStoreNar, ExportTrailer};
use sluice_nix::wire::{read_u64, write_u64};
use sluice_store::BatchedAdder;

use super::{refused, LegacyServeError, Session};

/// Additions not answered yet: their paths unpacked, being committed in batches.
pub(super) struct Adding {
    adder: BatchedAdder,
    /// The `1`s owed.
    owed: usize,
}

/// The session's additions not answered yet, started if there are none.
fn adding<'a>(adding: &'a mut Option<Adding>, store: &Arc<LocalStore>, roots: &TempRoots) -> &'a mut Adding {
    adding.get_or_insert_with(|| Adding { adder: BatchedAdder::new(store, roots, SignaturePolicy::unchecked()), owed: 0 })
}

/// An ImportPaths NAR larger than this is spooled to a temporary file rather than memory.
const SPOOL_IN_MEMORY: usize = 16 << 20;

impl<R: Read, W: Write> Session<R, W> {
    /// ImportPaths: for each `1`, a NAR and its trailer; `0` ends; answered `1` (owed). Each
    /// NAR is kept (spooled) until its trailer names its path, then unpacked; a stream cut
    /// short leaves the paths before the cut, each whole.
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
        adding(&mut self.adding, &self.store, &self.roots).owed += 1;
        Ok(())
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
        adding(&mut self.adding, &self.store, &self.roots).adder.add(info, &mut spool, false).map_err(refused)
    }

    /// AddToStoreNar: the info, then exactly its NAR size of NAR → `1` (owed). A valid path's
    /// NAR is read and dropped.
    pub(super) fn add_to_store_nar(&mut self) -> Result<(), LegacyServeError> {
        self.require_write("importing paths")?;
        let AddToStoreNar { info } = self.read()?;
        let adding = adding(&mut self.adding, &self.store, &self.roots);
        let mut nar = (&mut self.r).take(info.nar_size);
        adding.adder.add(info, &mut nar, false).map_err(refused)?;
        io::copy(&mut nar, &mut io::sink()).map_err(|e| LegacyServeError::Refused(format!("reading the rest of the NAR: {e}")))?;
        adding.owed += 1;
        Ok(())
    }

    /// Waits until the additions not answered yet are committed, then answers each `1`; a
    /// path refused ends the session with its error.
    pub(super) fn settle(&mut self) -> Result<(), LegacyServeError> {
        let Some(Adding { adder, owed }) = self.adding.take() else { return Ok(()) };
        adder.finish().map_err(refused)?;
        for _ in 0..owed {
            write_u64(&mut self.w, 1).map_err(LegacyServeError::Write)?;
        }
        Ok(())
    }
}
