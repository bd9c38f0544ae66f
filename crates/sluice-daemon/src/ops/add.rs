//! Adding paths: AddToStore (framed ≥ 1.25 with a content-address method; legacy before),
//! AddTextToStore, AddToStoreNar (framed ≥ 1.23, pulled with `STDERR_READ` before) and
//! AddMultipleToStore (Nix 2.8 `daemon.cc`, `Store::addMultipleToStore`).
//!
//! Input-addressed paths (AddToStoreNar, AddMultipleToStore) need a trusted signature or a
//! matching content address unless the client is trusted and asks not to check (as Nix's
//! `dontCheckSigs`, ignored for untrusted clients).

use std::io::{self, Read};
use std::sync::Arc;

use sluice_nix::content_address::ContentAddress;
use sluice_nix::nar::reader::parse;
use sluice_nix::nar::Discard;
use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::{
    read_bool, read_bytes, read_keyed_path_info, read_store_path_set, read_string, read_u64, write_bytes, write_keyed_path_info, write_u64,
    FramedReader, ProtocolVersion,
};
use sluice_store::config::Settings;
use sluice_store::local::{LocalStore, TempRootsFile};
use sluice_store::path_info::ValidPathInfo;

use super::payload::{add_content, Ingestion, RootFile};
use super::{from_wire, to_wire};
use crate::conn::{op_err, Conn, Fail, OpResult, Reader, Writer};

/// Longest name of a new path (Nix's limit is 211 characters; the store path check says why).
const MAX_NAME: u64 = 1024;
/// Largest text accepted by AddTextToStore, in bytes.
const MAX_TEXT: u64 = 256 << 20;
/// Most paths in one AddMultipleToStore.
const MAX_PATHS: u64 = 1 << 22;

/// AddToStore: ≥ 1.25 name, method, references, repair, then the framed data → the keyed
/// path info; before, name, fixed, recursive, algorithm, then a NAR → the path.
pub(super) fn add_to_store(c: &mut Conn) -> OpResult {
    if !c.version.at_least(25) {
        return add_to_store_legacy(c);
    }
    let name = read_string(&mut c.r, MAX_NAME, "name")?;
    let method = read_string(&mut c.r, 64, "content-address method")?;
    let references = read_store_path_set(&mut c.r, c.daemon.store().store_dir(), "references")?;
    read_bool(&mut c.r, "repair flag")?;
    let store = Arc::clone(c.store());
    let mut framed = FramedReader::new(&mut c.r);
    let roots = &mut c.temp_roots;
    let result = Ingestion::parse(&method).map_err(Fail::Op).and_then(|m| add_content(&store, roots, &name, m, references, &mut framed));
    finish_framed(&mut framed)?;
    let info = to_wire(result?)?;
    let version = c.version;
    c.reply(|w, dir| write_keyed_path_info(w, dir, version, &info))
}

/// Legacy AddToStore (< 1.25): the data is a NAR on the connection, even for flat files.
fn add_to_store_legacy(c: &mut Conn) -> OpResult {
    let name = read_string(&mut c.r, MAX_NAME, "name")?;
    let fixed = read_bool(&mut c.r, "fixed flag")?;
    let recursive = read_u64(&mut c.r, "recursive flag")?;
    let algo = read_string(&mut c.r, 16, "hash algorithm")?;
    if recursive > 1 {
        return Err(Fail::Fatal(format!("unsupported file ingestion method {recursive}")));
    }
    // Nix's compatibility rule: not fixed means sha256 over the NAR.
    let method = if fixed { format!("fixed:{}{algo}", if recursive == 1 { "r:" } else { "" }) } else { "fixed:r:sha256".to_owned() };
    let method = Ingestion::parse(&method).map_err(Fail::Fatal)?;
    let mut nar = tempfile::SpooledTempFile::new(16 << 20);
    parse(Tee { inner: &mut c.r, copy: &mut nar }, &mut Discard).map_err(|e| Fail::Fatal(format!("reading the NAR to add: {e}")))?;
    io::Seek::rewind(&mut nar).map_err(op_err)?;
    let info = match method {
        Ingestion::Nar(_) => add_content(c.daemon.store(), &mut c.temp_roots, &name, method, Default::default(), &mut nar)?,
        _ => {
            let mut root = RootFile::new();
            parse(&mut nar, &mut root).map_err(op_err)?;
            add_content(c.daemon.store(), &mut c.temp_roots, &name, method, Default::default(), &mut root.contents)?
        }
    };
    c.reply(|w, dir| write_bytes(w, dir.display_path(&info.path).as_bytes()))
}

/// AddTextToStore (obsolete since 1.25): name, text, references → the path.
pub(super) fn add_text_to_store(c: &mut Conn) -> OpResult {
    let name = read_string(&mut c.r, MAX_NAME, "name")?;
    let text = read_bytes(&mut c.r, MAX_TEXT, "text")?;
    let references = read_store_path_set(&mut c.r, c.daemon.store().store_dir(), "references")?;
    let info = add_content(c.daemon.store(), &mut c.temp_roots, &name, Ingestion::Text, references, &mut text.as_slice())?;
    c.reply(|w, dir| write_bytes(w, dir.display_path(&info.path).as_bytes()))
}

/// AddToStoreNar: the path's info (path, deriver, NAR hash, references, registration time,
/// NAR size, ultimate, signatures, content address), repair, dontCheckSigs, then the NAR
/// (framed ≥ 1.23, else pulled with `STDERR_READ`). Replies `LAST` with no result.
pub(super) fn add_to_store_nar(c: &mut Conn) -> OpResult {
    let mut info = from_wire(read_keyed_path_info(&mut c.r, c.daemon.store().store_dir(), ProtocolVersion::new(1, 16))?);
    read_bool(&mut c.r, "repair flag")?;
    let dont_check_sigs = read_bool(&mut c.r, "dontCheckSigs flag")? && c.peer.trusted;
    if !c.peer.trusted {
        info.ultimate = false;
    }
    let settings = c.options.settings()?;
    let store = Arc::clone(c.store());
    let checked = if dont_check_sigs { Ok(()) } else { check_trust(&info, &settings, store.store_dir()) };
    // Rooted before its validity is looked at (as Nix's `LocalStore::addToStore`).
    let checked = checked.and_then(|()| c.add_temp_root(&info.path));
    if c.version.at_least(23) {
        let mut framed = FramedReader::new(&mut c.r);
        let result = checked.and_then(|()| add_nar(&store, &info, &mut framed));
        finish_framed(&mut framed)?;
        result?;
    } else {
        checked?;
        add_nar(&store, &info, &mut Tunnel { r: &mut c.r, w: &mut c.w })?;
    }
    c.reply(|_, _| Ok(()))
}

/// AddMultipleToStore: repair, dontCheckSigs, then a framed stream of a count and, per path,
/// its keyed info (1.16 form) followed by its NAR. Replies `LAST` with no result.
pub(super) fn add_multiple_to_store(c: &mut Conn) -> OpResult {
    read_bool(&mut c.r, "repair flag")?;
    let dont_check_sigs = read_bool(&mut c.r, "dontCheckSigs flag")? && c.peer.trusted;
    let settings = c.options.settings()?;
    let store = Arc::clone(c.store());
    let mut framed = FramedReader::new(&mut c.r);
    let roots = &mut c.temp_roots;
    let result = add_each(&store, roots, &settings, dont_check_sigs, &mut framed);
    finish_framed(&mut framed)?;
    result?;
    c.reply(|_, _| Ok(()))
}

/// Adds each path of an AddMultipleToStore payload, rooting each in `roots` first.
fn add_each(store: &Arc<LocalStore>, roots: &mut Option<TempRootsFile>, settings: &Settings, dont_check_sigs: bool, stream: &mut dyn Read) -> Result<(), Fail> {
    let dir = store.store_dir();
    let count = read_u64(stream, "path count")?;
    if count > MAX_PATHS {
        return Err(Fail::Fatal(format!("AddMultipleToStore: {count} paths, more than the maximum of {MAX_PATHS}")));
    }
    for _ in 0..count {
        let mut info = from_wire(read_keyed_path_info(stream, dir, ProtocolVersion::new(1, 16))?);
        info.ultimate = false;
        if !dont_check_sigs {
            check_trust(&info, settings, dir)?;
        }
        crate::conn::add_temp_root(store, roots, &info.path)?;
        add_nar(store, &info, &mut stream.take(info.nar_size))?;
    }
    Ok(())
}

/// Adds `info`'s path from the NAR in `nar` unless it is valid already (then `nar` is
/// skipped, so that whatever follows it can be read).
fn add_nar(store: &Arc<LocalStore>, info: &ValidPathInfo, nar: &mut dyn Read) -> Result<(), Fail> {
    match store.begin_add(&info.path).map_err(op_err)? {
        None => {
            io::copy(nar, &mut io::sink()).map_err(|e| Fail::Fatal(format!("reading the NAR of {}: {e}", store.store_dir().display_path(&info.path))))?;
            Ok(())
        }
        Some(mut pending) => {
            pending.unpack(nar, None).map_err(op_err)?;
            pending.commit(info).map_err(op_err)
        }
    }
}

/// Reads the rest of a framed payload after an operation, so that the next request can be
/// read; a broken stream is fatal.
pub(super) fn finish_framed(framed: &mut FramedReader<&mut Reader>) -> Result<(), Fail> {
    framed.drain().map(|_| ()).map_err(|e| Fail::Fatal(format!("reading the framed data: {e}")))
}

/// Whether `info` may be added without the client's word: a signature by a trusted key, a
/// content address that yields its path, or `require-sigs = false`.
fn check_trust(info: &ValidPathInfo, settings: &Settings, dir: &StoreDir) -> Result<(), Fail> {
    if !settings.require_sigs {
        return Ok(());
    }
    let shown = dir.display_path(&info.path);
    if let Some(ca) = info.ca.as_deref().and_then(|c| ContentAddress::parse(c).ok()) {
        let others: Vec<StorePath> = info.references.iter().filter(|r| **r != info.path).cloned().collect();
        let self_ref = others.len() != info.references.len();
        if ca.store_path(dir, info.path.name(), &others, self_ref).ok().as_ref() == Some(&info.path) {
            return Ok(());
        }
    }
    let keys = TrustedKeys::parse(&settings.trusted_public_keys.join(" ")).map_err(|e| Fail::Op(format!("trusted-public-keys: {e}")))?;
    let refs: Vec<String> = info.references.iter().map(|r| dir.display_path(r)).collect();
    let fingerprint = format!("1;{shown};{};{};{}", info.nar_hash.to_nix32_prefixed(), info.nar_size, refs.join(","));
    if keys.count_valid(&fingerprint, &info.sigs) > 0 {
        Ok(())
    } else {
        Err(Fail::Op(format!("cannot add path '{shown}' because it lacks a signature by a trusted key")))
    }
}

/// Copies what is read from `inner` into `copy` (to keep the NAR that the parser reads).
struct Tee<'a, R: Read, W: io::Write> {
    inner: R,
    copy: &'a mut W,
}

impl<R: Read, W: io::Write> Read for Tee<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.copy.write_all(&buf[..n])?;
        Ok(n)
    }
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
