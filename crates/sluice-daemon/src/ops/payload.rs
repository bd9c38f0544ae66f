//! Content-addressed additions (AddToStore, AddTextToStore): the client's data is spooled
//! (memory up to 16 MiB, 1 MiB for an untrusted client, then a temporary file) while it is
//! hashed, the store path follows
//! from the hash (`ContentAddress::store_path`), and only a path that is not valid yet is
//! unpacked. Nix 2.8: `LocalStore::addToStoreFromDump`, `addTextToStore`.

use std::collections::BTreeSet;
use std::io::{self, Read, Seek, Write};
use std::sync::Arc;

use sluice_local_store::{LocalStore, SignaturePolicy};
use sluice_nix::content_address::ContentAddress;
use sluice_nix::hash::{HashAlgo, Hasher};
use sluice_nix::nar::writer::NarWriter;
use sluice_nix::nar::{NarPath, NarVisitor};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use tempfile::SpooledTempFile;

use crate::conn::{op_err, Fail, Kept};
use crate::limits::FREE_REQUEST_BYTES;

/// Spooled data of a trusted client stays in memory up to this many bytes.
const IN_MEMORY: usize = 16 << 20;

/// How many bytes of its data a client's spool keeps in memory: [`IN_MEMORY`] for a trusted
/// client; for an untrusted one, no more than any request of it holds before it takes from
/// the shares of request memory ([`FREE_REQUEST_BYTES`]), since each of an untrusted user's
/// hundreds of connections may spool at once (see [`crate::limits`]).
pub(super) fn in_memory(trusted: bool) -> usize {
    match trusted {
        true => IN_MEMORY,
        false => FREE_REQUEST_BYTES as usize,
    }
}

/// How the client's data becomes a store path (the method part of a content address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ingestion {
    /// `text:sha256`: the data is a file's contents, hashed with sha256.
    Text,
    /// `fixed:<algo>`: the data is a file's contents.
    Flat(HashAlgo),
    /// `fixed:r:<algo>`: the data is a NAR.
    Nar(HashAlgo),
}

impl Ingestion {
    /// Parses a content-address method as AddToStore (≥ 1.25) sends it.
    pub(super) fn parse(method: &str) -> Result<Self, String> {
        let algo = |a: &str| HashAlgo::parse(a).map_err(|e| format!("content-address method {method:?}: {e}"));
        if let Some(a) = method.strip_prefix("text:") {
            return match algo(a)? {
                HashAlgo::Sha256 => Ok(Ingestion::Text),
                _ => Err(format!("content-address method {method:?}: text hashing must use sha256")),
            };
        }
        match method.strip_prefix("fixed:") {
            Some(rest) => match rest.strip_prefix("r:") {
                Some(a) => Ok(Ingestion::Nar(algo(a)?)),
                None => Ok(Ingestion::Flat(algo(rest)?)),
            },
            None => Err(format!("unsupported content-address method {method:?} (expected text:sha256, fixed:ALGO or fixed:r:ALGO)")),
        }
    }
}

/// Reads all of `data` into a spool that keeps `in_memory` bytes in memory, hashing it with
/// `algo`. The first `in_memory` bytes are read in one go (most additions are small files: no
/// per-call buffer to clear); only larger data goes through a copy loop. A read error is
/// fatal to the connection: the request stream is broken.
fn spool(data: &mut dyn Read, algo: HashAlgo, in_memory: usize) -> Result<(SpooledTempFile, Hasher, u64), Fail> {
    let read_err = |e: io::Error| Fail::Fatal(format!("reading the data to add: {e}"));
    let spool_err = |e: io::Error| Fail::Op(format!("spooling the data to add: {e}"));
    let mut hasher = Hasher::new(algo);
    let mut head = Vec::new();
    data.take(in_memory as u64).read_to_end(&mut head).map_err(read_err)?;
    hasher.update(&head);
    let mut len = head.len() as u64;
    let mut file = SpooledTempFile::new(in_memory);
    file.write_all(&head).map_err(spool_err)?;
    if head.len() == in_memory {
        let mut buf = head;
        loop {
            let n = match data.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read_err(e)),
            };
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n]).map_err(spool_err)?;
            len += n as u64;
        }
    }
    file.rewind().map_err(spool_err)?;
    Ok((file, hasher, len))
}

/// Adds `data` as `name` with `references` by `method`; returns the path's info (also when it
/// was valid already, in which case nothing is unpacked unless `repair`: then the tree is
/// replaced by this content, which must have the registered NAR hash). The path is made a temporary root
/// of the connection (`kept.roots`) before its validity is looked at, as Nix's
/// `addToStoreFromDump` does, so that a collector cannot delete it between the look-up and the
/// client's use of it. The store checks the content address computed here against the
/// unpacked content again. The spools keep `in_memory` bytes in memory ([`in_memory`]).
#[allow(clippy::too_many_arguments)] // each is one decision of the caller's; a struct would only rename them
pub(super) fn add_content(
    store: &Arc<LocalStore>,
    kept: &Kept,
    policy: &SignaturePolicy,
    name: &str,
    method: Ingestion,
    references: BTreeSet<StorePath>,
    data: &mut dyn Read,
    repair: bool,
    in_memory: usize,
) -> Result<ValidPathInfo, Fail> {
    let algo = match method {
        Ingestion::Text => HashAlgo::Sha256,
        Ingestion::Flat(a) | Ingestion::Nar(a) => a,
    };
    let (mut file, hasher, len) = spool(data, algo, in_memory)?;
    let hash = hasher.finish();
    let ca = match method {
        Ingestion::Text => ContentAddress::Text(hash),
        Ingestion::Flat(_) => ContentAddress::Fixed { recursive: false, hash },
        Ingestion::Nar(_) => ContentAddress::Fixed { recursive: true, hash },
    };
    let dir = store.store_dir();
    let self_ref = false;
    let path = ca.store_path(dir, name, &references.iter().cloned().collect::<Vec<_>>(), self_ref).map_err(op_err)?;
    kept.roots.add_all_keeping_gc_lock(std::slice::from_ref(&path)).map_err(op_err)?;
    if let Some(info) = store.query_path_info(&path).map_err(op_err)?.filter(|_| !repair) {
        return Ok(info);
    }
    let spool_err = |e: io::Error| Fail::Op(format!("preparing the NAR of {}: {e}", dir.display_path(&path)));
    // The NAR to unpack, and its sha256 and size.
    let (mut nar, nar_hash, nar_size) = match method {
        Ingestion::Nar(HashAlgo::Sha256) => (file, ca.hash().clone(), len),
        Ingestion::Nar(_) => {
            let (f, h, n) = spool(&mut file, HashAlgo::Sha256, in_memory)?;
            (f, h.finish(), n)
        }
        Ingestion::Text | Ingestion::Flat(_) => {
            let mut tee = Tee { file: SpooledTempFile::new(in_memory), hasher: Hasher::new(HashAlgo::Sha256) };
            let mut writer = NarWriter::new(&mut tee).map_err(spool_err)?;
            writer.regular(&[], false, len, 0, &mut file).map_err(spool_err)?;
            let size = writer.position();
            drop(writer);
            let Tee { mut file, hasher } = tee;
            file.rewind().map_err(spool_err)?;
            (file, hasher.finish(), size)
        }
    };
    let info = ValidPathInfo {
        path,
        nar_hash,
        nar_size,
        references,
        deriver: None,
        registration_time: now(),
        ultimate: false,
        sigs: BTreeSet::new(),
        ca: Some(ca),
    };
    kept.keep_temp_dir(store);
    store.add_nar_if_missing(info, &mut nar, policy, &kept.roots, repair).map_err(op_err)
}

/// Seconds since the epoch.
pub(super) fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Writes to a spool and a hasher at once.
struct Tee {
    file: SpooledTempFile,
    hasher: Hasher,
}

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write_all(buf)?;
        self.hasher.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// Legacy AddToStore (< 1.25) sends a NAR even for flat files: this visitor keeps the
/// contents of the NAR's root regular file and rejects any other NAR.
pub(super) struct RootFile {
    pub contents: SpooledTempFile,
}

impl RootFile {
    /// Keeping `in_memory` bytes of the file in memory ([`in_memory`]).
    pub(super) fn new(in_memory: usize) -> Self {
        RootFile { contents: SpooledTempFile::new(in_memory) }
    }
}

fn not_regular() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "regular file expected: a flat addition must be a single regular file")
}

impl NarVisitor for RootFile {
    fn regular(&mut self, path: &NarPath, _: bool, _: u64, _: u64, contents: &mut dyn Read) -> io::Result<()> {
        if !path.is_empty() {
            return Err(not_regular());
        }
        io::copy(contents, &mut self.contents)?;
        self.contents.rewind()
    }
    fn symlink(&mut self, _: &NarPath, _: &[u8]) -> io::Result<()> {
        Err(not_regular())
    }
    fn directory_start(&mut self, _: &NarPath) -> io::Result<()> {
        Err(not_regular())
    }
    fn directory_end(&mut self, _: &NarPath) -> io::Result<()> {
        Err(not_regular())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods() {
        assert_eq!(Ingestion::parse("text:sha256"), Ok(Ingestion::Text));
        assert_eq!(Ingestion::parse("fixed:r:sha256"), Ok(Ingestion::Nar(HashAlgo::Sha256)));
        assert_eq!(Ingestion::parse("fixed:sha1"), Ok(Ingestion::Flat(HashAlgo::Sha1)));
        assert!(Ingestion::parse("text:sha1").is_err());
        assert!(Ingestion::parse("fixed:git:sha1").unwrap_err().contains("git"));
    }
}
