//! Serve-protocol serialisers (Nix 2.26 `serve-protocol.cc`: `UnkeyedValidPathInfo`,
//! `BuildResult`, `ServeProto::BuildOptions`; `export-import.cc`: an exported path's trailer).

use std::collections::BTreeSet;
use std::io::{self, Read, Write};

use super::super::primitives::read_count;
use super::super::types::{parse_nar_hash, MAX_LIST};
use super::super::{
    read_bool, read_content_address, read_optional_store_path, read_store_path, read_store_path_set, read_string, read_strings, read_u64,
    write_bool, write_bytes, write_content_address, write_optional_store_path, write_store_path, write_store_path_set, write_string_pairs,
    write_strings, write_u64, BuildResult, BuildStatus, MAX_PATH_LEN,
};
use super::serve_at_least;
use crate::path_info::ValidPathInfo;
use crate::store_path::{StoreDir, StorePath};
use crate::wire::{ProtocolVersion, WireError};

/// The word after each NAR of an export stream (`exportMagic`, `export-import.cc`).
pub const EXPORT_MAGIC: u64 = 0x4558_494e;

/// Longest signature, content address or hash accepted, in bytes.
const MAX_SHORT: u64 = 4096;
/// Longest build error message or realisation accepted, in bytes.
const MAX_MESSAGE: u64 = 1 << 20;

/// Build settings sent with BuildPaths and BuildDerivation (`ServeProto::BuildOptions`): max
/// silent time and build timeout; from 2.2 max log size; from 2.3 repeats and determinism
/// enforcement; from 2.7 keep-failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BuildOptions {
    pub max_silent_time: u64,
    pub build_timeout: u64,
    pub max_log_size: u64,
    pub nr_repeats: u64,
    pub enforce_determinism: bool,
    pub keep_failed: bool,
}

impl BuildOptions {
    /// Reads the options as a client of `version` sends them (fields it cannot send are 0).
    pub fn read(r: &mut dyn Read, version: ProtocolVersion) -> Result<Self, WireError> {
        let mut o = BuildOptions {
            max_silent_time: read_u64(r, "max silent time")?,
            build_timeout: read_u64(r, "build timeout")?,
            ..Default::default()
        };
        if serve_at_least(version, 2) {
            o.max_log_size = read_u64(r, "max log size")?;
        }
        if serve_at_least(version, 3) {
            o.nr_repeats = read_u64(r, "build repeats")?;
            o.enforce_determinism = read_bool(r, "enforce determinism flag")?;
        }
        if serve_at_least(version, 7) {
            o.keep_failed = read_bool(r, "keep failed flag")?;
        }
        Ok(o)
    }

    /// Writes the options for `version`.
    pub fn write(&self, w: &mut dyn Write, version: ProtocolVersion) -> io::Result<()> {
        write_u64(w, self.max_silent_time)?;
        write_u64(w, self.build_timeout)?;
        if serve_at_least(version, 2) {
            write_u64(w, self.max_log_size)?;
        }
        if serve_at_least(version, 3) {
            write_u64(w, self.nr_repeats)?;
            write_bool(w, self.enforce_determinism)?;
        }
        if serve_at_least(version, 7) {
            write_bool(w, self.keep_failed)?;
        }
        Ok(())
    }
}

/// Writes one entry of a QueryPathInfos answer: the path, its deriver, references, download
/// size (the NAR size, as Nix says it), NAR size and, from 2.4, its NAR hash (nix32 with
/// `sha256:`), content address and signatures. The answer ends with an empty string.
pub fn write_path_info_entry(w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion, info: &ValidPathInfo) -> io::Result<()> {
    write_store_path(w, dir, &info.path)?;
    write_optional_store_path(w, dir, info.deriver.as_ref())?;
    write_store_path_set(w, dir, info.references.iter())?;
    write_u64(w, info.nar_size)?;
    write_u64(w, info.nar_size)?;
    if serve_at_least(version, 4) {
        write_bytes(w, info.nar_hash.to_nix32_prefixed().as_bytes())?;
        write_content_address(w, info.ca.as_ref())?;
        write_strings(w, info.sigs.iter())?;
    }
    Ok(())
}

/// Reads the answer to a QueryPathInfos of `asked` up to its empty string: the infos, in the
/// order sent (registration time 0, not ultimate: the protocol does not carry them). An entry
/// for a path not in `asked`, or one answered already, is refused, so that no far end can add
/// paths to the answer or make it longer than the request (Nix's `LegacySSHStore` asks one
/// path at a time and refuses an answer about another). A server older than 2.4 sends no NAR
/// hash, which is refused, as Nix refuses it.
pub fn read_path_info_entries(
    r: &mut dyn Read,
    dir: &StoreDir,
    version: ProtocolVersion,
    asked: &BTreeSet<StorePath>,
) -> Result<Vec<ValidPathInfo>, WireError> {
    let mut infos: Vec<ValidPathInfo> = Vec::new();
    let mut unanswered: BTreeSet<&StorePath> = asked.iter().collect();
    loop {
        let path = read_string(r, MAX_PATH_LEN, "path")?;
        if path.is_empty() {
            return Ok(infos);
        }
        let path = dir.parse_path(&path).map_err(|e| WireError::invalid("path", e))?;
        if !unanswered.remove(&path) {
            let why = format!("an info for {}, which was not asked or was answered already", dir.display_path(&path));
            return Err(WireError::invalid("path", why));
        }
        let deriver = read_optional_store_path(r, dir, "deriver")?;
        let references = read_store_path_set(r, dir, "references")?;
        read_u64(r, "download size")?;
        let nar_size = read_u64(r, "NAR size")?;
        if !serve_at_least(version, 4) {
            return Err(WireError::invalid("NAR hash", format!("serve protocol {version} does not send it; it is mandatory")));
        }
        let nar_hash = parse_nar_hash(&read_string(r, MAX_SHORT, "NAR hash")?)?;
        let ca = read_content_address(r, "content address")?;
        let sigs = read_strings(r, MAX_LIST, MAX_SHORT, "signatures")?.into_iter().collect();
        infos.push(ValidPathInfo { path, deriver, nar_hash, references, registration_time: 0, nar_size, ultimate: false, sigs, ca });
    }
}

/// Writes a build result for `version`: status and message; from 2.3 times built,
/// non-determinism, start and stop times; from 2.6 the built outputs (`DrvOutput` →
/// realisation JSON).
pub fn write_serve_build_result(w: &mut dyn Write, version: ProtocolVersion, res: &BuildResult) -> io::Result<()> {
    write_u64(w, res.status as u64)?;
    write_bytes(w, res.error_msg.as_bytes())?;
    if serve_at_least(version, 3) {
        write_u64(w, res.times_built)?;
        write_bool(w, res.is_non_deterministic)?;
        write_u64(w, res.start_time)?;
        write_u64(w, res.stop_time)?;
    }
    if serve_at_least(version, 6) {
        write_string_pairs(w, res.built_outputs.iter())?;
    }
    Ok(())
}

/// Reads a build result as [`write_serve_build_result`] writes it.
pub fn read_serve_build_result(r: &mut dyn Read, version: ProtocolVersion) -> Result<BuildResult, WireError> {
    let status = BuildStatus::read(r)?;
    let error_msg = read_string(r, MAX_MESSAGE, "build error message")?;
    let mut res = BuildResult::not_built(status, error_msg);
    if serve_at_least(version, 3) {
        res.times_built = read_u64(r, "times built")?;
        res.is_non_deterministic = read_bool(r, "non-determinism flag")?;
        res.start_time = read_u64(r, "build start time")?;
        res.stop_time = read_u64(r, "build stop time")?;
    }
    if serve_at_least(version, 6) {
        for _ in 0..read_count(r, MAX_LIST, "built outputs")? {
            let id = read_string(r, MAX_SHORT, "built output id")?;
            res.built_outputs.insert(id, read_string(r, MAX_MESSAGE, "realisation")?);
        }
    }
    Ok(res)
}

/// Writes what follows a path's NAR in an export stream (`Store::exportPath`): [`EXPORT_MAGIC`],
/// the path, its references, its deriver (or the empty string) and `0` (no legacy signature).
pub fn write_export_trailer(w: &mut dyn Write, dir: &StoreDir, info: &ValidPathInfo) -> io::Result<()> {
    write_u64(w, EXPORT_MAGIC)?;
    write_store_path(w, dir, &info.path)?;
    write_store_path_set(w, dir, info.references.iter())?;
    write_optional_store_path(w, dir, info.deriver.as_ref())?;
    write_u64(w, 0)
}

/// Reads what follows a NAR in an export stream (`Store::importPaths`): the magic, the path,
/// its references and deriver; a legacy signature, if flagged, is read and ignored, as Nix
/// ignores it.
pub fn read_export_trailer(r: &mut dyn Read, dir: &StoreDir) -> Result<ExportTrailer, WireError> {
    let magic = read_u64(r, "export magic")?;
    if magic != EXPORT_MAGIC {
        return Err(WireError::invalid("export magic", format!("{magic:#x}: the NAR cannot be imported, wrong format")));
    }
    let path = read_store_path(r, dir, "path")?;
    let references = read_store_path_set(r, dir, "references")?;
    let deriver = read_optional_store_path(r, dir, "deriver")?;
    if read_bool(r, "legacy signature flag")? {
        read_string(r, MAX_SHORT, "legacy signature")?;
    }
    Ok(ExportTrailer { path, references, deriver })
}

/// An exported path's trailer ([`read_export_trailer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportTrailer {
    pub path: StorePath,
    pub references: std::collections::BTreeSet<StorePath>,
    pub deriver: Option<StorePath>,
}

#[cfg(test)]
mod tests {
    use super::super::tests::sp;
    use super::*;
    use crate::hash::{Hash, HashAlgo};

    fn info(name: &str) -> ValidPathInfo {
        ValidPathInfo {
            path: sp(name),
            deriver: None,
            nar_hash: Hash::parse_bare("1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s", HashAlgo::Sha256).unwrap(),
            references: [sp("b")].into(),
            registration_time: 0,
            nar_size: 120,
            ultimate: false,
            sigs: ["k:c2ln".to_owned()].into(),
            ca: None,
        }
    }

    #[test]
    fn path_info_entries_round_trip() {
        let dir = StoreDir::default();
        let v = ProtocolVersion::new(2, 7);
        let mut bytes = Vec::new();
        write_path_info_entry(&mut bytes, &dir, v, &info("a")).unwrap();
        write_path_info_entry(&mut bytes, &dir, v, &info("c")).unwrap();
        write_bytes(&mut bytes, b"").unwrap();
        let asked: BTreeSet<StorePath> = [sp("a"), sp("c"), sp("d")].into();
        let mut r = bytes.as_slice();
        assert_eq!(read_path_info_entries(&mut r, &dir, v, &asked).unwrap(), [info("a"), info("c")]);
        assert!(r.is_empty());
        // An answer about a path not asked, or about one twice, is refused.
        let err = read_path_info_entries(&mut bytes.as_slice(), &dir, v, &[sp("a")].into()).unwrap_err();
        assert!(err.to_string().contains("/nix/store/") && err.to_string().contains("-c, which was not asked"), "{err}");
        let mut twice = Vec::new();
        write_path_info_entry(&mut twice, &dir, v, &info("a")).unwrap();
        write_path_info_entry(&mut twice, &dir, v, &info("a")).unwrap();
        let err = read_path_info_entries(&mut twice.as_slice(), &dir, v, &asked).unwrap_err();
        assert!(err.to_string().contains("answered already"), "{err}");
        // The hash as Nix's opServe writes it: nix32 with its algorithm.
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("sha256:1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s"), "{text}");
        let err = read_path_info_entries(&mut bytes.as_slice(), &dir, ProtocolVersion::new(2, 3), &asked).unwrap_err();
        assert!(err.to_string().contains("mandatory"), "{err}");
    }

    #[test]
    fn build_options_and_results_by_version() {
        let o = BuildOptions {
            max_silent_time: 1,
            build_timeout: 2,
            max_log_size: 3,
            nr_repeats: 4,
            enforce_determinism: true,
            keep_failed: true,
        };
        for (minor, words) in [(1, 2), (2, 3), (3, 5), (7, 6)] {
            let v = ProtocolVersion::new(2, minor);
            let mut bytes = Vec::new();
            o.write(&mut bytes, v).unwrap();
            assert_eq!(bytes.len(), words * 8, "2.{minor}");
            let back = BuildOptions::read(&mut bytes.as_slice(), v).unwrap();
            assert_eq!(back.max_silent_time, 1);
            assert_eq!(back.keep_failed, minor >= 7);
        }
        let res = BuildResult {
            status: BuildStatus::MiscFailure,
            error_msg: "no".into(),
            times_built: 1,
            is_non_deterministic: false,
            start_time: 2,
            stop_time: 3,
            cpu_user: None,
            cpu_system: None,
            built_outputs: [("sha256:00!out".to_owned(), "{}".to_owned())].into(),
        };
        let mut bytes = Vec::new();
        write_serve_build_result(&mut bytes, ProtocolVersion::new(2, 7), &res).unwrap();
        assert_eq!(read_serve_build_result(&mut bytes.as_slice(), ProtocolVersion::new(2, 7)).unwrap(), res);
    }

    #[test]
    fn export_trailer_round_trips() {
        let dir = StoreDir::default();
        let mut bytes = Vec::new();
        write_export_trailer(&mut bytes, &dir, &info("a")).unwrap();
        let t = read_export_trailer(&mut bytes.as_slice(), &dir).unwrap();
        assert_eq!((t.path, t.references, t.deriver), (sp("a"), [sp("b")].into(), None));
        bytes[0] = 0;
        assert!(read_export_trailer(&mut bytes.as_slice(), &dir).unwrap_err().to_string().contains("wrong format"));
    }
}
