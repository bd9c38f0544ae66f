//! Adding paths: AddToStore (framed ≥ 1.25 with a content-address method; legacy before),
//! AddTextToStore, AddToStoreNar (framed ≥ 1.23, pulled with `STDERR_READ` before) and
//! AddMultipleToStore (Nix 2.8 `daemon.cc`, `Store::addMultipleToStore`).
//!
//! Every path goes through the store's verification boundary (`PendingPath::commit`): its NAR
//! hash and size, its content address checked against the content, and a signature by a
//! trusted key or a content address, unless signatures are not required: `require-sigs =
//! false`, or a trusted client's `dontCheckSigs` (ignored for untrusted clients, as in Nix's
//! `daemon.cc`).
//!
//! The `repair` flag of AddToStore, AddToStoreNar and AddMultipleToStore is honoured for a
//! trusted client: a valid path's tree is replaced from the data sent, which must have the
//! registered NAR hash (the store's repair path). Nix honours it for every client; sluice
//! ignores it for untrusted ones, as it did before.

use std::io::{self, Read};
use std::sync::Arc;

use sluice_local_store::{LocalStore, SignaturePolicy, TempRoots};
use sluice_nix::nar::reader::{copy_nar, parse};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::wire::ops::{AddMultipleToStore, AddTextToStore, AddToStore, AddToStoreNar};
use sluice_nix::wire::{
    read_bytes, read_keyed_path_info, read_u64, write_bytes, write_keyed_path_info, write_u64, FramedReader, ProtocolVersion,
};

use sluice_store::BatchedAdder;

use super::payload::{add_content, in_memory, Ingestion, RootFile};
use crate::conn::{op_err, Conn, Fail, OpResult, Reader, Writer};

/// Most paths in one AddMultipleToStore.
const MAX_PATHS: u64 = 1 << 22;

/// AddToStore: ≥ 1.25 name, method, references, repair, then the framed data → the keyed
/// path info; before, name, fixed, recursive, algorithm, then a NAR → the path.
pub(super) fn add_to_store(c: &mut Conn, request: AddToStore) -> OpResult {
    let (name, method, references, repair) = match request {
        AddToStore::Modern { name, method, references, repair } => (name, method, references, repair),
        AddToStore::Legacy { name, fixed, recursive, algo } => return add_to_store_legacy(c, name, fixed, recursive, &algo),
    };
    let repair = honoured_repair(c, repair);
    let store = Arc::clone(c.store());
    let policy = policy(c, false)?;
    let mut framed = FramedReader::new(&mut c.r);
    let kept = &c.kept;
    let in_memory = in_memory(c.peer.trusted);
    let result = Ingestion::parse(&method)
        .map_err(Fail::Op)
        .and_then(|m| add_content(&store, kept, &policy, &name, m, references, &mut framed, repair, in_memory));
    finish_framed(&mut framed)?;
    let info = result?;
    let version = c.version;
    c.reply(|w, dir| write_keyed_path_info(w, dir, version, &info))
}

/// Legacy AddToStore (< 1.25): the data is a NAR on the connection, even for flat files.
fn add_to_store_legacy(c: &mut Conn, name: String, fixed: bool, recursive: u64, algo: &str) -> OpResult {
    if recursive > 1 {
        return Err(Fail::Fatal(format!("unsupported file ingestion method {recursive}")));
    }
    // Nix's compatibility rule: not fixed means sha256 over the NAR.
    let method = if fixed { format!("fixed:{}{algo}", if recursive == 1 { "r:" } else { "" }) } else { "fixed:r:sha256".to_owned() };
    let method = Ingestion::parse(&method).map_err(Fail::Fatal)?;
    let in_memory = in_memory(c.peer.trusted);
    let mut nar = tempfile::SpooledTempFile::new(in_memory);
    copy_nar(&mut c.r, &mut nar).map_err(|e| Fail::Fatal(format!("reading the NAR to add: {e}")))?;
    io::Seek::rewind(&mut nar).map_err(op_err)?;
    let policy = policy(c, false)?;
    let info = match method {
        Ingestion::Nar(_) => add_content(&c.store, &c.kept, &policy, &name, method, Default::default(), &mut nar, false, in_memory)?,
        _ => {
            let mut root = RootFile::new(in_memory);
            parse(&mut nar, &mut root).map_err(op_err)?;
            add_content(&c.store, &c.kept, &policy, &name, method, Default::default(), &mut root.contents, false, in_memory)?
        }
    };
    c.reply(|w, dir| write_bytes(w, dir.display_path(&info.path).as_bytes()))
}

/// AddTextToStore (obsolete since 1.25): name, text, references → the path.
pub(super) fn add_text_to_store(c: &mut Conn, AddTextToStore { name, text, references }: AddTextToStore) -> OpResult {
    let policy = policy(c, false)?;
    let in_memory = in_memory(c.peer.trusted);
    let info = add_content(&c.store, &c.kept, &policy, &name, Ingestion::Text, references, &mut text.as_slice(), false, in_memory)?;
    c.reply(|w, dir| write_bytes(w, dir.display_path(&info.path).as_bytes()))
}

/// AddToStoreNar: the path's info (path, deriver, NAR hash, references, registration time,
/// NAR size, ultimate, signatures, content address), repair, dontCheckSigs, then the NAR
/// (framed ≥ 1.23, else pulled with `STDERR_READ`). Replies `LAST` with no result.
pub(super) fn add_to_store_nar(c: &mut Conn, AddToStoreNar { mut info, repair, dont_check_sigs }: AddToStoreNar) -> OpResult {
    let repair = honoured_repair(c, repair);
    if !c.peer.trusted {
        info.ultimate = false;
    }
    let policy = policy(c, dont_check_sigs);
    let store = Arc::clone(c.store());
    let roots = c.temp_roots.clone();
    if c.version.at_least(23) {
        let mut framed = FramedReader::new(&mut c.r);
        let result = policy.and_then(|policy| add_nar(&store, &roots, &policy, info, &mut framed, repair));
        finish_framed(&mut framed)?;
        result?;
    } else {
        add_nar(&store, &roots, &policy?, info, &mut Tunnel { r: &mut c.r, w: &mut c.w }, repair)?;
    }
    c.reply(|_, _| Ok(()))
}

/// AddMultipleToStore: repair, dontCheckSigs, then a framed stream of a count and, per path,
/// its keyed info (1.16 form) followed by its NAR. Replies `LAST` with no result.
pub(super) fn add_multiple_to_store(c: &mut Conn, AddMultipleToStore { repair, dont_check_sigs }: AddMultipleToStore) -> OpResult {
    let repair = honoured_repair(c, repair);
    let policy = policy(c, dont_check_sigs);
    let store = Arc::clone(c.store());
    let mut framed = FramedReader::new(&mut c.r);
    let trusted = c.peer.trusted;
    let result = policy.and_then(|policy| add_each(&store, &c.temp_roots, &policy, &mut framed, repair, trusted));
    finish_framed(&mut framed)?;
    result?;
    c.reply(|_, _| Ok(()))
}

/// The signatures an addition by this client needs: the daemon's `require-sigs` and
/// `trusted-public-keys`, waived by `dont_check_sigs` only for a trusted client (Nix's
/// `daemon.cc`: `if (!trusted) dontCheckSigs = false`).
fn policy(c: &Conn, dont_check_sigs: bool) -> Result<SignaturePolicy, Fail> {
    let setting = c.options.settings()?.require_sigs;
    let require_sigs = SignaturePolicy::requires_sigs(setting, c.daemon.store_require_sigs, !(dont_check_sigs && c.peer.trusted));
    Ok(SignaturePolicy { require_sigs, trusted_keys: c.options.trusted_keys()? })
}

/// The `repair` flag of an add operation, honoured for a trusted client only.
fn honoured_repair(c: &Conn, repair: bool) -> bool {
    repair && c.peer.trusted
}

/// Adds each path of an AddMultipleToStore payload (repairing valid ones with `repair`): each
/// is unpacked as it arrives and registered in batches ([`BatchedAdder`]: one flush and one
/// transaction per batch, where Nix commits each path); the operation answers once all are
/// committed. A path refused stops the payload there (the caller drains the rest), as Nix's does.
///
/// For a `trusted` client, small NARs are read whole and unpacked on the unpacking threads
/// while the next arrive (up to 16 MiB of them held). An untrusted client's are unpacked as
/// they are read, none held whole, as its AddToStore's data keeps no more in memory than a
/// request of it may hold before it takes from its user's share ([`in_memory`]):
/// each of the hundreds of connections an untrusted user may hold ([`crate::limits`]) could
/// otherwise make the one daemon process hold 16 MiB, where each of Nix's forked workers
/// (`Store::addMultipleToStore`, `src/libstore/store-api.cc`) reads and adds one path at a time.
fn add_each(
    store: &Arc<LocalStore>,
    roots: &TempRoots,
    policy: &SignaturePolicy,
    stream: &mut dyn Read,
    repair: bool,
    trusted: bool,
) -> Result<(), Fail> {
    let dir = store.store_dir();
    let count = read_u64(stream, "path count")?;
    if count > MAX_PATHS {
        return Err(Fail::Fatal(format!("AddMultipleToStore: {count} paths, more than the maximum of {MAX_PATHS}")));
    }
    let mut adder = match trusted {
        true => BatchedAdder::new(store, roots, policy.clone()).unpacking_ahead(),
        false => BatchedAdder::new(store, roots, policy.clone()),
    };
    for _ in 0..count {
        let mut info = read_keyed_path_info(stream, dir, ProtocolVersion::new(1, 16))?;
        info.ultimate = false;
        let (nar_size, shown) = (info.nar_size, dir.display_path(&info.path));
        let mut nar = stream.take(nar_size);
        // Refused before its NAR is read, if nobody vouches for it.
        adder.add(info, &mut nar, repair).map_err(op_err)?;
        io::copy(&mut nar, &mut io::sink()).map_err(|e| Fail::Fatal(format!("reading the NAR of {shown}: {e}")))?;
    }
    adder.finish().map_err(op_err)
}

/// Adds `info`'s path from the NAR in `nar` under `policy` unless it is valid already (then
/// `nar` is skipped, so that whatever follows it can be read), or repairs it with `repair`
/// ([`LocalStore::add_nar_if_missing`]). A path refused by the store's verification boundary
/// fails the operation; the rest of its NAR is then left unread (the caller drains a framed
/// stream).
fn add_nar(
    store: &Arc<LocalStore>,
    roots: &TempRoots,
    policy: &SignaturePolicy,
    info: ValidPathInfo,
    nar: &mut dyn Read,
    repair: bool,
) -> Result<(), Fail> {
    let shown = store.store_dir().display_path(&info.path);
    // Refused before its NAR is unpacked, if nobody vouches for it.
    policy.vouch(store.store_dir(), &info).map_err(op_err)?;
    store.add_nar_if_missing(info, nar, policy, roots, repair).map_err(op_err)?;
    io::copy(nar, &mut io::sink()).map_err(|e| Fail::Fatal(format!("reading the NAR of {shown}: {e}")))?;
    Ok(())
}

/// Reads the rest of a framed payload after an operation, so that the next request can be
/// read; a broken stream is fatal.
pub(super) fn finish_framed(framed: &mut FramedReader<&mut Reader>) -> Result<(), Fail> {
    framed.drain().map(|_| ()).map_err(|e| Fail::Fatal(format!("reading the framed data: {e}")))
}

/// A reader that pulls data from the client with `STDERR_READ` (AddToStoreNar before 1.23,
/// Nix's `TunnelSource`): each request asks for up to 64 KiB and the client answers with a
/// string.
struct Tunnel<'a> {
    r: &'a mut Reader,
    w: &'a mut Writer,
}

impl Read for Tunnel<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min(64 * 1024);
        write_u64(self.w, sluice_nix::wire::stderr_tag::READ)?;
        write_u64(self.w, want as u64)?;
        io::Write::flush(self.w)?;
        let data = read_bytes(self.r, want as u64, "tunnelled data").map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if data.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the client sent no more data"));
        }
        buf[..data.len()].copy_from_slice(&data);
        Ok(data.len())
    }
}
