//! One type per serve-protocol command: its header as `legacy-ssh-store.cc` and
//! `serve-protocol-connection.cc` write it and `nix-store.cc`'s `opServe` reads it.

use std::collections::BTreeSet;
use std::io::{self, Read, Write};

use super::super::types::{parse_nar_hash, MAX_LIST};
use super::super::{
    read_basic_derivation, read_bool, read_content_address, read_optional_store_path, read_store_path, read_store_path_set, read_string,
    read_strings, read_u64, write_basic_derivation, write_bool, write_bytes, write_content_address, write_optional_store_path,
    write_store_path, write_store_path_set, write_strings, write_u64, BasicDerivation, MAX_PATH_LEN,
};
use super::{BuildOptions, ServeCommand, ServeRequest};
use crate::path_info::ValidPathInfo;
use crate::store_path::{StoreDir, StorePath};
use crate::wire::{ProtocolVersion, WireError};

/// QueryValidPaths: lock (make the paths temporary roots, honoured only with `--write`),
/// substitute (honoured only with `--write`), paths → the valid ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryValidPaths {
    pub lock: bool,
    pub substitute: bool,
    pub paths: BTreeSet<StorePath>,
}

impl ServeRequest for QueryValidPaths {
    const CMD: ServeCommand = ServeCommand::QueryValidPaths;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let lock = read_bool(r, "lock flag")?;
        let substitute = read_bool(r, "substitute flag")?;
        Ok(QueryValidPaths { lock, substitute, paths: read_store_path_set(r, dir, "paths")? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bool(w, self.lock)?;
        write_bool(w, self.substitute)?;
        write_store_path_set(w, dir, self.paths.iter())
    }
}

/// Defines commands whose header is one field, read by `$read` and written by `$write`.
macro_rules! one_field_commands {
    ($($(#[$doc:meta])* $name:ident { $field:ident: $ty:ty } = $read:ident($what:literal), |$w:ident, $dir:ident, $v:ident| $write:expr;)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, PartialEq, Eq)]
            pub struct $name {
                pub $field: $ty,
            }

            impl ServeRequest for $name {
                const CMD: ServeCommand = ServeCommand::$name;

                fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
                    Ok($name { $field: $read(r, dir, $what)? })
                }

                fn write(&self, $w: &mut dyn Write, $dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
                    let $v = &self.$field;
                    $write
                }
            }
        )*
    };
}

one_field_commands! {
    /// QueryPathInfos: paths → for each valid one its path and info
    /// ([`super::write_path_info_entry`]), then the empty string.
    QueryPathInfos { paths: BTreeSet<StorePath> } = read_store_path_set("paths"), |w, dir, v| write_store_path_set(w, dir, v.iter());
    /// DumpStorePath: a valid path → its NAR, bare.
    DumpStorePath { path: StorePath } = read_store_path("path"), |w, dir, v| write_store_path(w, dir, v);
}

/// ImportPaths (`--write` only): no header; an export stream follows (per path `1`, its NAR,
/// [`super::write_export_trailer`]; then `0`) → `1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImportPaths;

impl ServeRequest for ImportPaths {
    const CMD: ServeCommand = ServeCommand::ImportPaths;

    fn read(_: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        Ok(ImportPaths)
    }

    fn write(&self, _: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        Ok(())
    }
}

/// ExportPaths: an obsolete word (0; sign), paths → their export stream, references first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportPaths {
    pub paths: BTreeSet<StorePath>,
}

impl ServeRequest for ExportPaths {
    const CMD: ServeCommand = ServeCommand::ExportPaths;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        read_u64(r, "export sign flag")?;
        Ok(ExportPaths { paths: read_store_path_set(r, dir, "paths")? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_u64(w, 0)?;
        write_store_path_set(w, dir, self.paths.iter())
    }
}

/// BuildPaths (`--write` only): paths with outputs as strings (`/nix/store/…drv!out,dev`),
/// build options → `0`, or a status and an error message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildPaths {
    pub paths: Vec<String>,
    pub options: BuildOptions,
}

impl ServeRequest for BuildPaths {
    const CMD: ServeCommand = ServeCommand::BuildPaths;

    fn read(r: &mut dyn Read, _: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let paths = read_strings(r, MAX_LIST, MAX_PATH_LEN + 4096, "paths to build")?;
        Ok(BuildPaths { paths, options: BuildOptions::read(r, version)? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        write_strings(w, self.paths.iter())?;
        self.options.write(w, version)
    }
}

/// QueryClosure: include outputs (of derivations), paths → the closure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryClosure {
    pub include_outputs: bool,
    pub paths: BTreeSet<StorePath>,
}

impl ServeRequest for QueryClosure {
    const CMD: ServeCommand = ServeCommand::QueryClosure;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let include_outputs = read_bool(r, "include outputs flag")?;
        Ok(QueryClosure { include_outputs, paths: read_store_path_set(r, dir, "paths")? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bool(w, self.include_outputs)?;
        write_store_path_set(w, dir, self.paths.iter())
    }
}

/// BuildDerivation (`--write` only; hydra-queue-runner's): the derivation's path, the basic
/// derivation, build options → a build result ([`super::write_serve_build_result`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildDerivation {
    pub drv_path: StorePath,
    pub drv: BasicDerivation,
    pub options: BuildOptions,
}

impl ServeRequest for BuildDerivation {
    const CMD: ServeCommand = ServeCommand::BuildDerivation;

    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let drv_path = read_store_path(r, dir, "derivation path")?;
        let drv = read_basic_derivation(r, dir)?;
        Ok(BuildDerivation { drv_path, drv, options: BuildOptions::read(r, version)? })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        write_store_path(w, dir, &self.drv_path)?;
        let name = self.drv_path.name().strip_suffix(".drv").unwrap_or(self.drv_path.name());
        write_basic_derivation(w, dir, name, &self.drv)?;
        self.options.write(w, version)
    }
}

/// AddToStoreNar (`--write` only, since 2.5): path, deriver, NAR hash (base16, no prefix),
/// references, registration time, NAR size, ultimate, signatures, content address; then the
/// NAR, exactly NAR size bytes → `1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddToStoreNar {
    pub info: ValidPathInfo,
}

impl ServeRequest for AddToStoreNar {
    const CMD: ServeCommand = ServeCommand::AddToStoreNar;

    fn read(r: &mut dyn Read, dir: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        let path = read_store_path(r, dir, "path")?;
        let deriver = read_optional_store_path(r, dir, "deriver")?;
        let nar_hash = parse_nar_hash(&read_string(r, 4096, "NAR hash")?)?;
        let references = read_store_path_set(r, dir, "references")?;
        let registration_time = i64::try_from(read_u64(r, "registration time")?).unwrap_or(i64::MAX);
        let nar_size = read_u64(r, "NAR size")?;
        if nar_size == 0 {
            return Err(WireError::invalid("NAR size", "0: the path info is too old and misses the NAR size"));
        }
        let ultimate = read_bool(r, "ultimate flag")?;
        let sigs = read_strings(r, MAX_LIST, 4096, "signatures")?.into_iter().collect();
        let ca = read_content_address(r, "content address")?;
        Ok(AddToStoreNar { info: ValidPathInfo { path, deriver, nar_hash, references, registration_time, nar_size, ultimate, sigs, ca } })
    }

    fn write(&self, w: &mut dyn Write, dir: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        let info = &self.info;
        write_store_path(w, dir, &info.path)?;
        write_optional_store_path(w, dir, info.deriver.as_ref())?;
        write_bytes(w, info.nar_hash.to_base16().as_bytes())?;
        write_store_path_set(w, dir, info.references.iter())?;
        write_u64(w, u64::try_from(info.registration_time).unwrap_or(0))?;
        write_u64(w, info.nar_size)?;
        write_bool(w, info.ultimate)?;
        write_strings(w, info.sigs.iter())?;
        write_content_address(w, info.ca.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, sp};
    use super::*;
    use crate::hash::{Hash, HashAlgo};
    use crate::wire::{DerivationOutput, OutputKind};

    fn words(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn round_trips() {
        let paths: BTreeSet<_> = [sp("a"), sp("b")].into();
        for minor in [4, 5, 7] {
            let bytes = round_trip(&QueryValidPaths { lock: true, substitute: false, paths: paths.clone() }, minor);
            assert_eq!(words(&bytes)[..4], [1, 1, 0, 2]);
            round_trip(&QueryPathInfos { paths: paths.clone() }, minor);
            round_trip(&DumpStorePath { path: sp("a") }, minor);
            assert_eq!(round_trip(&ImportPaths, minor), 4u64.to_le_bytes());
            assert_eq!(words(&round_trip(&ExportPaths { paths: paths.clone() }, minor))[..3], [5, 0, 2]);
            let options = BuildOptions {
                max_silent_time: 1,
                build_timeout: 2,
                max_log_size: 3,
                nr_repeats: 0,
                enforce_determinism: false,
                keep_failed: minor >= 7,
            };
            round_trip(&BuildPaths { paths: vec!["/nix/store/g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-a.drv!out".into()], options }, minor);
            round_trip(&QueryClosure { include_outputs: true, paths: paths.clone() }, minor);
            let drv = BasicDerivation {
                outputs: vec![DerivationOutput { name: "out".into(), kind: OutputKind::InputAddressed(sp("a")) }],
                input_srcs: [sp("b")].into(),
                platform: "x86_64-linux".into(),
                builder: "/bin/sh".into(),
                args: vec!["-c".into(), "true".into()],
                env: vec![("out".into(), "/nix/store/g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-a".into())],
            };
            round_trip(&BuildDerivation { drv_path: sp("a.drv"), drv, options }, minor);
            let info = ValidPathInfo {
                path: sp("a"),
                deriver: Some(sp("a.drv")),
                nar_hash: Hash::parse_bare("1b8m03r63zqhnjf7l5wnldhh7c134ap5vpj0850ymkq1iyzicy5s", HashAlgo::Sha256).unwrap(),
                references: [sp("b")].into(),
                registration_time: 1_700_000_000,
                nar_size: 120,
                ultimate: false,
                sigs: ["cache.example.org-1:c2ln".to_owned()].into(),
                ca: None,
            };
            round_trip(&AddToStoreNar { info }, minor);
        }
    }
}
