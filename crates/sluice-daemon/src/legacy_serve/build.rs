//! Builds over the serve protocol (`--write` only): sluice does not build. BuildPaths of paths
//! that are all valid already (plain paths, or derivation outputs registered valid) succeeds,
//! as Nix's would without building; anything else, and every BuildDerivation, is answered a
//! failure that says so (the client reports it, the connection stays usable).

use std::io::{Read, Write};

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::serve::{write_serve_build_result, BuildDerivation, BuildPaths};
use sluice_nix::wire::{write_bytes, write_u64, BuildResult, BuildStatus};

use super::{LegacyServeError, Session};

/// What a build request is told.
const NO_BUILDS: &str = "sluice legacy-serve does not build derivations; build them elsewhere and copy the outputs";

impl<R: Read, W: Write> Session<R, W> {
    /// BuildPaths: `0` if every path is valid (for `drv!outputs`, every named output, `*`
    /// every registered one), else exit status 1 and [`NO_BUILDS`].
    pub(super) fn build_paths(&mut self) -> Result<(), LegacyServeError> {
        self.require_write("building paths")?;
        let BuildPaths { paths, .. } = self.read()?;
        let mut all_valid = true;
        for p in &paths {
            all_valid &= self.is_built(p)?;
        }
        match all_valid {
            true => write_u64(&mut self.w, 0),
            false => write_u64(&mut self.w, 1).and_then(|_| write_bytes(&mut self.w, NO_BUILDS.as_bytes())),
        }
        .map_err(LegacyServeError::Write)
    }

    /// Whether `spec` (`/nix/store/…` or `/nix/store/….drv!out,dev` or `…!*`) is valid.
    fn is_built(&self, spec: &str) -> Result<bool, LegacyServeError> {
        let dir = self.store.store_dir();
        let (path, outputs) = spec.split_once('!').map_or((spec, None), |(p, o)| (p, Some(o)));
        let path: StorePath = dir.parse_path(path).map_err(|e| LegacyServeError::Refused(format!("path to build {spec:?}: {e}")))?;
        let Some(outputs) = outputs else { return Ok(self.store.is_valid_path(&path)?) };
        if !self.store.is_valid_path(&path)? {
            return Ok(false);
        }
        let map = self.store.query_derivation_output_map(&path)?;
        let wanted: Vec<StorePath> = match outputs {
            "*" => map.into_values().collect(),
            names => match names.split(',').map(|n| map.get(n).cloned()).collect::<Option<Vec<_>>>() {
                Some(paths) => paths,
                None => return Ok(false),
            },
        };
        Ok(self.store.query_valid_paths(&wanted)?.len() == wanted.len())
    }

    /// BuildDerivation: a [`BuildStatus::MiscFailure`] saying [`NO_BUILDS`].
    pub(super) fn build_derivation(&mut self) -> Result<(), LegacyServeError> {
        self.require_write("building paths")?;
        let BuildDerivation { drv_path, .. } = self.read()?;
        let error_msg = format!("{}: {NO_BUILDS}", self.store.store_dir().display_path(&drv_path));
        let res = BuildResult::not_built(BuildStatus::MiscFailure, error_msg);
        write_serve_build_result(&mut self.w, self.version, &res).map_err(LegacyServeError::Write)
    }
}
