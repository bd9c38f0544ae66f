//! Nix's builtin builders, run by sluice itself: `builtin:buildenv` (the user environments of
//! `nix-env -i` and `nix profile`), `builtin:fetchurl` (`<nix/fetchurl.nix>`) and
//! `builtin:unpack-channel` (`nix-channel --update`), which Nix runs in its own process instead
//! of a builder program (`src/libstore/builtins/buildenv.cc`, `builtins/fetchurl.cc`,
//! `builtins/unpack-channel.cc`). Their outputs are registered as Nix's
//! `LocalDerivationGoal::registerOutputs` does (`build/local-derivation-goal.cc`): the output
//! is serialised as a NAR ([`Spool`]), scanned for the hash parts of the paths it may refer to
//! (the closure of the derivation's inputs, and itself: [`RefScanner`]), and added through the
//! store's one verification boundary (`begin_add → unpack → commit`), with the derivation as
//! its deriver. A fixed output's hash is the boundary's content-address check; a mismatch is
//! Nix's "hash mismatch in fixed-output derivation" and nothing is registered (Nix registers
//! the output under the path of the hash it got; sluice keeps nothing it was not asked for).

mod buildenv;
mod fetchurl;
mod refs;
mod unpack_channel;
mod view;

pub use refs::RefScanner;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Seek, Write};
use std::sync::Arc;

use sluice_nix::content_address::ContentAddress;
use sluice_nix::derivation::Derivation;
use sluice_nix::hash::{Hash, HashAlgo, Hasher};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::StorePath;
use sluice_nix::wire::{BasicDerivation, OutputKind};

use crate::config::Settings;
use sluice_local_store::{LocalStore, LocalStoreError, SignaturePolicy, TempRoots};

/// The builtin builders sluice runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// `builtin:buildenv`.
    Buildenv,
    /// `builtin:fetchurl`.
    Fetchurl,
    /// `builtin:unpack-channel`.
    UnpackChannel,
}

impl Builtin {
    /// The builtin a derivation's `builder` names, if sluice runs it (every builtin of Nix
    /// 2.8 and 2.26).
    pub fn of(builder: &[u8]) -> Option<Builtin> {
        match builder {
            b"builtin:buildenv" => Some(Builtin::Buildenv),
            b"builtin:fetchurl" => Some(Builtin::Fetchurl),
            b"builtin:unpack-channel" => Some(Builtin::UnpackChannel),
            _ => None,
        }
    }
}

/// What a builtin builds from: the derivation's path, name, builder, environment and outputs
/// (from a `.drv` in the store or a `BasicDerivation` a client sent).
#[derive(Debug, Clone)]
pub struct BuiltinDerivation {
    /// The `.drv` path (the outputs' deriver).
    pub path: StorePath,
    /// The derivation name (the `.drv` name without `.drv`).
    pub name: String,
    pub builtin: Builtin,
    /// Environment variables (as the builtin reads its attributes).
    pub env: BTreeMap<String, String>,
    pub outputs: BTreeMap<String, OutputKind>,
}

impl BuiltinDerivation {
    /// The derivation `drv` at `path`, if its builder is one sluice runs.
    pub fn from_derivation(path: &StorePath, drv: &Derivation) -> Option<Self> {
        let env = drv.env.iter().map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), String::from_utf8_lossy(v).into_owned())).collect();
        Some(BuiltinDerivation {
            path: path.clone(),
            name: drv.name.clone(),
            builtin: Builtin::of(&drv.builder)?,
            env,
            outputs: drv.outputs.clone(),
        })
    }

    /// The derivation a client sent whole (BuildDerivation) for `path`, if its builder is one
    /// sluice runs.
    pub fn from_basic(path: &StorePath, drv: &BasicDerivation) -> Option<Self> {
        let name = path.name().strip_suffix(".drv")?.to_owned();
        let outputs = drv.outputs.iter().map(|o| (o.name.clone(), o.kind.clone())).collect();
        Some(BuiltinDerivation {
            path: path.clone(),
            name,
            builtin: Builtin::of(drv.builder.as_bytes())?,
            env: drv.env.iter().cloned().collect(),
            outputs,
        })
    }

    /// The attribute `name` (Nix's "attribute 'NAME' missing").
    fn attr(&self, name: &str) -> Result<&str, BuiltinError> {
        self.env.get(name).map(String::as_str).ok_or_else(|| BuiltinError::Failed(format!("attribute '{name}' missing")))
    }
}

/// Why a builtin failed.
#[derive(Debug, thiserror::Error)]
pub enum BuiltinError {
    /// The builder itself failed, in the words of Nix's builtins.
    #[error("{0}")]
    Failed(String),
    /// A fixed output's content has another hash than the derivation specifies (Nix's
    /// words; hashes in SRI form).
    #[error("hash mismatch in fixed-output derivation '{drv}':\n  specified: {specified}\n     got:    {got}")]
    HashMismatch { drv: String, specified: String, got: String },
    /// Registering the output failed.
    #[error(transparent)]
    Store(#[from] LocalStoreError),
}

/// What a builtin may use: the store, the caller's temporary roots, the settings (HTTP,
/// `netrc-file`), the runtime the HTTP client runs on, whether `file://` URLs may be read, and
/// where warnings go (Nix's builtins log them to the build log).
pub struct Context<'a> {
    pub store: &'a Arc<LocalStore>,
    pub roots: &'a TempRoots,
    pub settings: &'a Settings,
    pub runtime: &'a tokio::runtime::Handle,
    /// Whether `builtin:fetchurl` may read `file://` URLs. The caller runs as the store's
    /// owner, where Nix runs builtins as a build user in a sandbox: only a client that could
    /// read the files anyway (a trusted one) should get this.
    pub local_files: bool,
    pub warn: &'a mut dyn FnMut(&str),
}

/// Builds `drv` from its `inputs` (input sources and input derivations' outputs, which must be
/// valid): every output that is not valid is made and registered. Returns the outputs with
/// their paths. A builtin sees only the closure of its inputs in the store (as in Nix's
/// sandbox): anything else is as absent.
pub fn build(cx: &mut Context<'_>, drv: &BuiltinDerivation, inputs: &[StorePath]) -> Result<Vec<(String, StorePath)>, BuiltinError> {
    let dir = cx.store.store_dir().clone();
    // A fixed output, whatever the builtin, is admitted only with the content its hash says.
    let (out, ca) = match drv.outputs.get("out") {
        Some(OutputKind::InputAddressed(path)) => (path.clone(), None),
        Some(kind @ OutputKind::Fixed(ca)) => {
            let path = kind.path(&dir, &drv.name, "out").map_err(|e| BuiltinError::Failed(format!("output 'out': {e}")))?;
            (path.ok_or_else(|| BuiltinError::Failed("output 'out' has no path".into()))?, Some(ca.clone()))
        }
        _ => {
            return Err(BuiltinError::Failed(format!("'builtin:{}' requires an 'out' output with a known path", builtin_name(drv.builtin))))
        }
    };
    cx.roots.add(&out)?;
    if !cx.store.is_valid_path(&out)? {
        let closure = input_closure(cx, inputs)?;
        // A fixed output's path does not depend on its references: they are not scanned.
        let candidates = match ca {
            None => closure.iter().chain([&out]).cloned().collect(),
            Some(_) => BTreeSet::new(),
        };
        let mut spool = Spool::new(&candidates)?;
        match drv.builtin {
            Builtin::Buildenv => buildenv::build(cx, drv, &closure, &out, &mut spool)?,
            Builtin::Fetchurl => fetchurl::build(cx, drv, ca.as_ref(), &mut spool)?,
            Builtin::UnpackChannel => unpack_channel::build(cx.store, &closure, drv, &mut spool)?,
        }
        register(cx, drv, &out, spool, ca)?;
    }
    Ok(vec![("out".to_owned(), out)])
}

fn builtin_name(b: Builtin) -> &'static str {
    match b {
        Builtin::Buildenv => "buildenv",
        Builtin::Fetchurl => "fetchurl",
        Builtin::UnpackChannel => "unpack-channel",
    }
}

/// The closure of `inputs` in the store, each made a temporary root before its validity is
/// read; an input that is not valid fails the build.
fn input_closure(cx: &Context<'_>, inputs: &[StorePath]) -> Result<BTreeSet<StorePath>, BuiltinError> {
    let mut closure: BTreeSet<StorePath> = BTreeSet::new();
    let mut todo: Vec<StorePath> = inputs.to_vec();
    while !todo.is_empty() {
        cx.roots.add_all(&todo)?;
        let infos = cx.store.query_path_infos(&todo);
        let mut next = Vec::new();
        for (path, info) in todo.iter().zip(infos) {
            let info = info?
                .ok_or_else(|| BuiltinError::Failed(format!("input path '{}' is not valid", cx.store.store_dir().display_path(path))))?;
            closure.insert(path.clone());
            next.extend(info.references.into_iter().filter(|r| !closure.contains(r)));
        }
        next.sort();
        next.dedup();
        next.retain(|p| !closure.contains(p));
        todo = next;
    }
    Ok(closure)
}

/// A builtin's output serialised as a NAR into an unnamed temporary file, hashed (sha256) and
/// scanned for references as it is written.
pub(crate) struct Spool {
    file: std::fs::File,
    hasher: Hasher,
    scanner: RefScanner,
}

impl Spool {
    /// An empty spool whose NAR will be scanned for the hash parts of `candidates`.
    fn new(candidates: &BTreeSet<StorePath>) -> Result<Spool, BuiltinError> {
        let file = tempfile::tempfile()
            .map_err(|e| BuiltinError::Failed(format!("creating a temporary file in {}: {e}", std::env::temp_dir().display())))?;
        Ok(Spool { file, hasher: Hasher::new(HashAlgo::Sha256), scanner: RefScanner::new(candidates) })
    }
}

impl Write for Spool {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.scanner.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Adds the NAR in `spool` as `out` (content address `ca`, references what the spool found in
/// it) through the verification boundary. A content-address mismatch is Nix's hash
/// mismatch of `drv`; nothing is left in the store.
fn register(
    cx: &Context<'_>,
    drv: &BuiltinDerivation,
    out: &StorePath,
    spool: Spool,
    ca: Option<ContentAddress>,
) -> Result<(), BuiltinError> {
    let Spool { mut file, hasher, scanner } = spool;
    let nar_size = hasher.len();
    let nar_hash = hasher.finish();
    let temp = || format!("the temporary NAR of {}", cx.store.store_dir().display_path(out));
    file.rewind().map_err(|e| BuiltinError::Failed(format!("rewinding {}: {e}", temp())))?;
    let info = ValidPathInfo {
        path: out.clone(),
        nar_hash,
        nar_size,
        references: scanner.found(),
        deriver: Some(drv.path.clone()),
        registration_time: 0,
        ultimate: true,
        sigs: BTreeSet::new(),
        ca,
    };
    let Some(mut pending) = cx.store.begin_add(info, cx.roots)? else { return Ok(()) };
    pending.unpack(&mut std::io::BufReader::new(file))?;
    pending.commit(&SignaturePolicy::unchecked()).map_err(|e| match e {
        LocalStoreError::CaMismatch { specified, actual, .. } => {
            BuiltinError::HashMismatch { drv: cx.store.store_dir().display_path(&drv.path), specified: sri(&specified), got: sri(&actual) }
        }
        e => e.into(),
    })
}

/// `algo:nix32` as SRI (`algo-base64`), or as it is if it does not parse.
fn sri(prefixed: &str) -> String {
    Hash::parse(prefixed).map_or_else(|_| prefixed.to_owned(), |h| h.to_sri())
}
