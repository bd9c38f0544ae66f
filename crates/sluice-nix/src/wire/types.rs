//! Serialisers of the protocol's store types, by protocol version (`worker-protocol.cc`,
//! `common-protocol.cc`; in Nix 2.8 `worker-protocol.cc`, `path-info.cc` and `daemon.cc`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};

use super::primitives::{
    read_bool, read_count, read_string, read_u64, write_bool, write_bytes, write_bytes_joined, write_string_pairs, write_u64,
};
use super::{ProtocolVersion, WireError};
use crate::content_address::ContentAddress;
use crate::hash::{Hash, HashAlgo};
use crate::path_info::ValidPathInfo;
use crate::store_path::{StoreDir, StorePath};

/// Longest store path string accepted (store directory + `/` + base name), in bytes.
pub const MAX_PATH_LEN: u64 = 4096;
/// Longest content address, hash, signature or output-name list accepted, in bytes.
const MAX_SHORT_LEN: u64 = 4096;
/// Longest build error message or realisation accepted, in bytes.
const MAX_ERROR_LEN: u64 = 1 << 20;
/// Most references, signatures or derived paths accepted in one list.
pub(crate) const MAX_LIST: u64 = 1 << 22;

/// Reads a full store path (`/nix/store/<hash>-<name>`) in `dir`.
pub fn read_store_path(r: &mut (impl Read + ?Sized), dir: &StoreDir, what: &'static str) -> Result<StorePath, WireError> {
    let s = read_string(r, MAX_PATH_LEN, what)?;
    dir.parse_path(&s).map_err(|e| WireError::invalid(what, e))
}

/// Reads an optional store path: the empty string is `None`.
pub fn read_optional_store_path(r: &mut (impl Read + ?Sized), dir: &StoreDir, what: &'static str) -> Result<Option<StorePath>, WireError> {
    let s = read_string(r, MAX_PATH_LEN, what)?;
    if s.is_empty() {
        return Ok(None);
    }
    dir.parse_path(&s).map(Some).map_err(|e| WireError::invalid(what, e))
}

/// Reads a set of store paths: a count, then the paths.
pub fn read_store_path_set(r: &mut (impl Read + ?Sized), dir: &StoreDir, what: &'static str) -> Result<BTreeSet<StorePath>, WireError> {
    let n = read_count(r, MAX_LIST, what)?;
    let mut out = BTreeSet::new();
    for _ in 0..n {
        out.insert(read_store_path(r, dir, what)?);
    }
    Ok(out)
}

/// Writes a full store path.
pub fn write_store_path(w: &mut (impl Write + ?Sized), dir: &StoreDir, path: &StorePath) -> io::Result<()> {
    // As `dir.display_path(path)`, without making that string for every path of a reply.
    write_bytes_joined(w, &[dir.as_str().as_bytes(), b"/", path.base_name().as_bytes()])
}

/// Writes an optional store path (`None` as the empty string).
pub fn write_optional_store_path(w: &mut (impl Write + ?Sized), dir: &StoreDir, path: Option<&StorePath>) -> io::Result<()> {
    match path {
        Some(p) => write_store_path(w, dir, p),
        None => write_bytes(w, b""),
    }
}

/// Writes a count and the paths, in the iterator's order.
pub fn write_store_path_set<'a>(
    w: &mut (impl Write + ?Sized),
    dir: &StoreDir,
    paths: impl ExactSizeIterator<Item = &'a StorePath>,
) -> io::Result<()> {
    write_u64(w, paths.len() as u64)?;
    for p in paths {
        write_store_path(w, dir, p)?;
    }
    Ok(())
}

/// Reads an optional content address (`text:…`/`fixed:…`; the empty string is `None`).
pub fn read_content_address(r: &mut (impl Read + ?Sized), what: &'static str) -> Result<Option<ContentAddress>, WireError> {
    let s = read_string(r, MAX_SHORT_LEN, what)?;
    if s.is_empty() {
        return Ok(None);
    }
    ContentAddress::parse(&s).map(Some).map_err(|e| WireError::invalid(what, e))
}

/// Writes an optional content address (`None` as the empty string).
pub fn write_content_address(w: &mut (impl Write + ?Sized), ca: Option<&ContentAddress>) -> io::Result<()> {
    write_bytes(w, ca.map(|c| c.to_string()).unwrap_or_default().as_bytes())
}

/// Writes an optional trusted flag (protocol ≥ 1.35 handshake): 0 unknown, 1 trusted, 2 not.
pub fn write_trusted_flag(w: &mut (impl Write + ?Sized), trusted: Option<bool>) -> io::Result<()> {
    write_u64(
        w,
        match trusted {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        },
    )
}

/// Reads an optional trusted flag (the inverse of [`write_trusted_flag`]; Nix's
/// `Serialise<std::optional<TrustedFlag>>::read`): `None` when the daemon does not say.
pub fn read_trusted_flag(r: &mut (impl Read + ?Sized), what: &'static str) -> Result<Option<bool>, WireError> {
    match read_u64(r, what)? {
        0 => Ok(None),
        1 => Ok(Some(true)),
        2 => Ok(Some(false)),
        n => Err(WireError::invalid(what, format!("{n} is not 0 (unknown), 1 (trusted) or 2 (not trusted)"))),
    }
}

/// Writes the unkeyed part of `info` (everything but `path`) for protocol `version`; the
/// ultimate flag, signatures and content address only from 1.16.
pub fn write_unkeyed_path_info(
    w: &mut (impl Write + ?Sized),
    dir: &StoreDir,
    version: ProtocolVersion,
    info: &ValidPathInfo,
) -> io::Result<()> {
    write_optional_store_path(w, dir, info.deriver.as_ref())?;
    write_bytes(w, info.nar_hash.to_base16().as_bytes())?;
    write_store_path_set(w, dir, info.references.iter())?;
    // A time before the epoch does not occur; Nix writes `time_t` as an unsigned number.
    write_u64(w, u64::try_from(info.registration_time).unwrap_or(0))?;
    write_u64(w, info.nar_size)?;
    if version.at_least(16) {
        write_bool(w, info.ultimate)?;
        write_u64(w, info.sigs.len() as u64)?;
        for s in &info.sigs {
            write_bytes(w, s.as_bytes())?;
        }
        write_content_address(w, info.ca.as_ref())?;
    }
    Ok(())
}

/// Writes `info` with its path first (`ValidPathInfo`).
pub fn write_keyed_path_info(
    w: &mut (impl Write + ?Sized),
    dir: &StoreDir,
    version: ProtocolVersion,
    info: &ValidPathInfo,
) -> io::Result<()> {
    write_store_path(w, dir, &info.path)?;
    write_unkeyed_path_info(w, dir, version, info)
}

/// Reads the unkeyed part of a path's metadata for `path` (the inverse of
/// [`write_unkeyed_path_info`]). The NAR hash may be base16, nixbase32 or base64, with or
/// without a `sha256:` prefix, as Nix's `Hash::parseAny` accepts.
pub fn read_unkeyed_path_info(
    r: &mut (impl Read + ?Sized),
    dir: &StoreDir,
    version: ProtocolVersion,
    path: StorePath,
) -> Result<ValidPathInfo, WireError> {
    let deriver = read_optional_store_path(r, dir, "deriver")?;
    let hash_text = read_string(r, MAX_SHORT_LEN, "NAR hash")?;
    let nar_hash = parse_nar_hash(&hash_text)?;
    let references = read_store_path_set(r, dir, "references")?;
    // Beyond `i64` (no real time) is clamped.
    let registration_time = i64::try_from(read_u64(r, "registration time")?).unwrap_or(i64::MAX);
    let nar_size = read_u64(r, "NAR size")?;
    let (mut ultimate, mut sigs, mut ca) = (false, BTreeSet::new(), None);
    if version.at_least(16) {
        ultimate = read_bool(r, "ultimate flag")?;
        let n = read_count(r, MAX_LIST, "signatures")?;
        for _ in 0..n {
            sigs.insert(read_string(r, MAX_SHORT_LEN, "signature")?);
        }
        ca = read_content_address(r, "content address")?;
    }
    Ok(ValidPathInfo { path, deriver, nar_hash, references, registration_time, nar_size, ultimate, sigs, ca })
}

/// Reads a path and its metadata (the inverse of [`write_keyed_path_info`]).
pub fn read_keyed_path_info(r: &mut (impl Read + ?Sized), dir: &StoreDir, version: ProtocolVersion) -> Result<ValidPathInfo, WireError> {
    let path = read_store_path(r, dir, "store path")?;
    read_unkeyed_path_info(r, dir, version, path)
}

pub(crate) fn parse_nar_hash(s: &str) -> Result<Hash, WireError> {
    let parsed = if s.contains(':') || s.contains('-') { Hash::parse(s) } else { Hash::parse_bare(s, HashAlgo::Sha256) };
    parsed.map_err(|e| WireError::invalid("NAR hash", format!("{s:?}: {e}")))
}

/// Which outputs of a derivation are wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputsSpec {
    /// `*`: every output.
    All,
    /// The named outputs (non-empty).
    Names(BTreeSet<String>),
}

/// A path to realise (`DerivedPath`): a store path as is, or outputs of a derivation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DerivedPath {
    Opaque(StorePath),
    Built { drv: StorePath, outputs: OutputsSpec },
}

impl DerivedPath {
    /// Parses the wire string of protocol `version`: from 1.30 `<path>` or
    /// `<drv path>!<out1,out2|*>` (`DerivedPath::parseLegacy`); before, Nix's
    /// `parsePathWithOutputs`, where a bare `.drv` path means all its outputs.
    pub fn parse(dir: &StoreDir, version: ProtocolVersion, s: &str) -> Result<Self, WireError> {
        let bad = |e: &dyn std::fmt::Display| WireError::invalid("derived path", format!("{s:?}: {e}"));
        match s.split_once('!') {
            None => {
                let path = dir.parse_path(s).map_err(|e| bad(&e))?;
                if !version.at_least(30) && path.is_derivation() {
                    return Ok(DerivedPath::Built { drv: path, outputs: OutputsSpec::All });
                }
                Ok(DerivedPath::Opaque(path))
            }
            Some((drv, outs)) => {
                let drv = dir.parse_path(drv).map_err(|e| bad(&e))?;
                let outputs = if outs == "*" {
                    OutputsSpec::All
                } else {
                    let names: BTreeSet<String> = outs.split(',').map(str::to_owned).collect();
                    if names.iter().any(|n| n.is_empty()) {
                        return Err(bad(&"empty output name"));
                    }
                    OutputsSpec::Names(names)
                };
                Ok(DerivedPath::Built { drv, outputs })
            }
        }
    }

    /// The wire string for protocol `version` (the inverse of [`parse`](Self::parse)). Before
    /// 1.30 all outputs of a derivation are its bare path, and a derivation file itself
    /// cannot be expressed (`None`).
    pub fn to_wire_string(&self, dir: &StoreDir, version: ProtocolVersion) -> Option<String> {
        Some(match self {
            DerivedPath::Opaque(p) if p.is_derivation() && !version.at_least(30) => return None,
            DerivedPath::Opaque(p) => dir.display_path(p),
            DerivedPath::Built { drv, outputs: OutputsSpec::All } if !version.at_least(30) => dir.display_path(drv),
            DerivedPath::Built { drv, outputs: OutputsSpec::All } => format!("{}!*", dir.display_path(drv)),
            DerivedPath::Built { drv, outputs: OutputsSpec::Names(n) } => {
                format!("{}!{}", dir.display_path(drv), n.iter().map(String::as_str).collect::<Vec<_>>().join(","))
            }
        })
    }
}

/// Reads a list of derived paths (BuildPaths, BuildPathsWithResults, QueryMissing).
pub fn read_derived_paths(r: &mut (impl Read + ?Sized), dir: &StoreDir, version: ProtocolVersion) -> Result<Vec<DerivedPath>, WireError> {
    let n = read_count(r, MAX_LIST, "derived paths")?;
    let mut out = Vec::with_capacity(n.min(1024) as usize);
    for _ in 0..n {
        let s = read_string(r, MAX_PATH_LEN + MAX_SHORT_LEN, "derived path")?;
        out.push(DerivedPath::parse(dir, version, &s)?);
    }
    Ok(out)
}

/// Writes one derived path; an `InvalidInput` error if protocol `version` cannot express it.
pub fn write_derived_path(w: &mut (impl Write + ?Sized), dir: &StoreDir, version: ProtocolVersion, path: &DerivedPath) -> io::Result<()> {
    let s = path.to_wire_string(dir, version).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("protocol {version} cannot name a derivation file as a path to build"))
    })?;
    write_bytes(w, s.as_bytes())
}

/// How to realise paths (`BuildMode`): u64 0 normal, 1 repair, 2 check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum BuildMode {
    Normal,
    Repair,
    Check,
}

impl BuildMode {
    /// Reads a build mode; other values are an error.
    pub fn read(r: &mut (impl Read + ?Sized)) -> Result<Self, WireError> {
        match read_u64(r, "build mode")? {
            0 => Ok(BuildMode::Normal),
            1 => Ok(BuildMode::Repair),
            2 => Ok(BuildMode::Check),
            n => Err(WireError::invalid("build mode", format!("{n} (expected 0, 1 or 2)"))),
        }
    }

    /// Writes the build mode's number.
    pub fn write(self, w: &mut (impl Write + ?Sized)) -> io::Result<()> {
        write_u64(w, self as u64)
    }
}

/// A build result's status (`BuildResult::Status`), with its wire number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum BuildStatus {
    Built = 0,
    Substituted = 1,
    AlreadyValid = 2,
    PermanentFailure = 3,
    InputRejected = 4,
    OutputRejected = 5,
    TransientFailure = 6,
    CachedFailure = 7,
    TimedOut = 8,
    MiscFailure = 9,
    DependencyFailed = 10,
    LogLimitExceeded = 11,
    NotDeterministic = 12,
    ResolvesToAlreadyValid = 13,
    NoSubstituters = 14,
}

impl BuildStatus {
    /// Every status, in wire order.
    const ALL: [BuildStatus; 15] = [
        BuildStatus::Built,
        BuildStatus::Substituted,
        BuildStatus::AlreadyValid,
        BuildStatus::PermanentFailure,
        BuildStatus::InputRejected,
        BuildStatus::OutputRejected,
        BuildStatus::TransientFailure,
        BuildStatus::CachedFailure,
        BuildStatus::TimedOut,
        BuildStatus::MiscFailure,
        BuildStatus::DependencyFailed,
        BuildStatus::LogLimitExceeded,
        BuildStatus::NotDeterministic,
        BuildStatus::ResolvesToAlreadyValid,
        BuildStatus::NoSubstituters,
    ];

    /// Reads a status number; an unknown one is an error.
    pub fn read(r: &mut (impl Read + ?Sized)) -> Result<Self, WireError> {
        let n = read_u64(r, "build status")?;
        usize::try_from(n)
            .ok()
            .and_then(|i| Self::ALL.get(i))
            .copied()
            .ok_or_else(|| WireError::invalid("build status", format!("{n} (expected 0 to 14)")))
    }
}

/// The outcome of realising one derived path (`BuildResult`). Times in seconds since the
/// epoch; CPU times in microseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildResult {
    pub status: BuildStatus,
    pub error_msg: String,
    pub times_built: u64,
    pub is_non_deterministic: bool,
    pub start_time: u64,
    pub stop_time: u64,
    pub cpu_user: Option<u64>,
    pub cpu_system: Option<u64>,
    /// Built outputs as protocol ≥ 1.28 carries them: `<drv hash>!<output>` → the
    /// realisation's JSON text.
    pub built_outputs: BTreeMap<String, String>,
}

impl BuildResult {
    /// A result of `status` with `error_msg`, nothing built: no times, no outputs (Nix sets
    /// the times only when a builder runs, `build/derivation-goal.cc` `buildDone`).
    pub fn not_built(status: BuildStatus, error_msg: String) -> Self {
        BuildResult {
            status,
            error_msg,
            times_built: 0,
            is_non_deterministic: false,
            start_time: 0,
            stop_time: 0,
            cpu_user: None,
            cpu_system: None,
            built_outputs: BTreeMap::new(),
        }
    }
}

/// Writes a build result for protocol `version`: status and message; from 1.29 times built,
/// non-determinism and start/stop times; from 1.37 the optional CPU times; from 1.28 the
/// built outputs.
pub fn write_build_result(w: &mut (impl Write + ?Sized), version: ProtocolVersion, res: &BuildResult) -> io::Result<()> {
    write_u64(w, res.status as u64)?;
    write_bytes(w, res.error_msg.as_bytes())?;
    if version.at_least(29) {
        write_u64(w, res.times_built)?;
        write_bool(w, res.is_non_deterministic)?;
        write_u64(w, res.start_time)?;
        write_u64(w, res.stop_time)?;
    }
    if version.at_least(37) {
        for t in [res.cpu_user, res.cpu_system] {
            match t {
                Some(us) => {
                    write_u64(w, 1)?;
                    write_u64(w, us)?;
                }
                None => write_u64(w, 0)?,
            }
        }
    }
    if version.at_least(28) {
        write_string_pairs(w, res.built_outputs.iter())?;
    }
    Ok(())
}

/// Reads a build result as a daemon of protocol `version` writes it (the inverse of
/// [`write_build_result`]; Nix `WorkerProto::Serialise<BuildResult>::read` in
/// `worker-protocol.cc`). Built outputs keep their `DrvOutput` keys and realisation JSON.
pub fn read_build_result(r: &mut (impl Read + ?Sized), version: ProtocolVersion) -> Result<BuildResult, WireError> {
    let status = BuildStatus::read(r)?;
    let error_msg = read_string(r, MAX_ERROR_LEN, "build error message")?;
    let (mut times_built, mut is_non_deterministic, mut start_time, mut stop_time) = (0, false, 0, 0);
    if version.at_least(29) {
        times_built = read_u64(r, "times built")?;
        is_non_deterministic = read_bool(r, "non-determinism flag")?;
        start_time = read_u64(r, "build start time")?;
        stop_time = read_u64(r, "build stop time")?;
    }
    let (mut cpu_user, mut cpu_system) = (None, None);
    if version.at_least(37) {
        for t in [&mut cpu_user, &mut cpu_system] {
            if read_bool(r, "CPU time flag")? {
                *t = Some(read_u64(r, "CPU time")?);
            }
        }
    }
    let mut built_outputs = BTreeMap::new();
    if version.at_least(28) {
        for _ in 0..read_count(r, MAX_LIST, "built outputs")? {
            let id = read_string(r, MAX_SHORT_LEN, "built output id")?;
            built_outputs.insert(id, read_string(r, MAX_ERROR_LEN, "realisation")?);
        }
    }
    Ok(BuildResult { status, error_msg, times_built, is_non_deterministic, start_time, stop_time, cpu_user, cpu_system, built_outputs })
}

/// Reads a derived path and its build result (`KeyedBuildResult`, the inverse of
/// [`write_keyed_build_result`]).
pub fn read_keyed_build_result(
    r: &mut (impl Read + ?Sized),
    dir: &StoreDir,
    version: ProtocolVersion,
) -> Result<(DerivedPath, BuildResult), WireError> {
    let s = read_string(r, MAX_PATH_LEN + MAX_SHORT_LEN, "derived path")?;
    let path = DerivedPath::parse(dir, version, &s)?;
    Ok((path, read_build_result(r, version)?))
}

/// Writes a derived path and its build result (`KeyedBuildResult`).
pub fn write_keyed_build_result(
    w: &mut (impl Write + ?Sized),
    dir: &StoreDir,
    version: ProtocolVersion,
    path: &DerivedPath,
    res: &BuildResult,
) -> io::Result<()> {
    write_derived_path(w, dir, version, path)?;
    write_build_result(w, version, res)
}
