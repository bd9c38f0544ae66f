//! Nix's builtin builders run by sluice itself (`sluice_store::builtins`): a derivation whose
//! builder is `builtin:buildenv` (`nix-env -i`, `nix profile`), `builtin:fetchurl`
//! (`<nix/fetchurl.nix>`) or `builtin:unpack-channel` (`nix-channel --update`) is built in
//! the daemon once its inputs are valid (substituted first),
//! with or without `--build-via`: no builder process, no round trip to a Nix daemon. The
//! client sees Nix's `building '…'` activity, the builtin's warnings as log lines, and a build
//! result with Nix's statuses (Built; OutputRejected for a hash mismatch; TransientFailure for
//! a failed fetch, PermanentFailure for a failed user environment, as Nix's `buildDone` sets
//! them for fixed-output and other derivations). Who may build is decided by the operation
//! (BuildPaths: any client; BuildDerivation of an input-addressed derivation: trusted
//! clients only); `file://` URLs are read for trusted clients only.

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::{ActivityField, BasicDerivation, BuildResult, BuildStatus};
use sluice_store::builtins::{self, Builtin, BuiltinDerivation, BuiltinError, Context};

use super::query::{derivation_outputs, load_derivation};
use super::realise::{build_result, built_outputs, realise_by_substitution};
use crate::conn::{Conn, Fail};

/// Nix's `actBuild`.
const ACT_BUILD: u64 = 105;
/// Nix's `lvlInfo`.
const LVL_INFO: u64 = 3;

/// Builds the valid derivation `drv_path` if its builder is a builtin sluice runs and its
/// inputs (input sources, wanted outputs of input derivations) are valid or substitutable;
/// `None` otherwise (for the caller to delegate or refuse).
pub(super) fn build_stored(c: &mut Conn, drv_path: &StorePath) -> Result<Option<BuildResult>, Fail> {
    let Some(d) = load_derivation(c, drv_path)? else { return Ok(None) };
    let Some(drv) = BuiltinDerivation::from_derivation(drv_path, &d) else { return Ok(None) };
    let mut inputs: Vec<StorePath> = d.input_srcs.iter().cloned().collect();
    for (input, wanted) in &d.input_drvs {
        for (name, path) in derivation_outputs(c, input)?.unwrap_or_default() {
            match path {
                Some(p) if wanted.outputs.contains(&name) => inputs.push(p),
                Some(_) => {}
                None => return Ok(None),
            }
        }
    }
    run(c, &drv, &inputs)
}

/// [`build_stored`] for a derivation a client sent whole (BuildDerivation): its inputs are its
/// input sources.
pub(super) fn build_sent(c: &mut Conn, drv_path: &StorePath, drv: &BasicDerivation) -> Result<Option<BuildResult>, Fail> {
    let Some(built) = BuiltinDerivation::from_basic(drv_path, drv) else { return Ok(None) };
    let inputs: Vec<StorePath> = drv.input_srcs.iter().cloned().collect();
    run(c, &built, &inputs)
}

/// Substitutes `inputs`, then runs the builtin (`None` if an input stays invalid).
fn run(c: &mut Conn, drv: &BuiltinDerivation, inputs: &[StorePath]) -> Result<Option<BuildResult>, Fail> {
    let (_, valid) = realise_by_substitution(c, inputs, Default::default())?;
    if inputs.iter().any(|p| !valid.contains(p)) {
        return Ok(None);
    }
    let settings = c.options.settings()?;
    let shown = c.dir().display_path(&drv.path);
    let stderr = c.stderr();
    let id = c.daemon.activity_id();
    let fields = [ActivityField::Str(shown.clone()), ActivityField::Str(String::new()), ActivityField::Int(1), ActivityField::Int(1)];
    stderr.start_activity(&mut c.w, id, LVL_INFO, ACT_BUILD, &format!("building '{shown}'"), &fields, 0)?;
    std::io::Write::flush(&mut c.w)?;
    let start = super::payload::now().max(0) as u64;
    let mut warnings = Vec::new();
    let result = {
        let mut warn = |w: &str| warnings.push(w.to_owned());
        let mut cx = Context {
            store: c.store(),
            roots: &c.temp_roots,
            settings: &settings,
            runtime: c.daemon.runtime.handle(),
            local_files: c.peer.trusted,
            warn: &mut warn,
        };
        builtins::build(&mut cx, drv, inputs)
    };
    for w in &warnings {
        c.log(&format!("warning: {w}"))?;
    }
    stderr.stop_activity(&mut c.w, id)?;
    let mut res = match result {
        Ok(outputs) => {
            let mut res = build_result(BuildStatus::Built, String::new());
            res.times_built = 1;
            res.built_outputs = built_outputs(outputs.iter().map(|(name, p)| (name.as_str(), p)));
            res
        }
        Err(e @ BuiltinError::HashMismatch { .. }) => build_result(BuildStatus::OutputRejected, e.to_string()),
        Err(BuiltinError::Failed(msg)) => {
            let status = if drv.builtin == Builtin::Fetchurl { BuildStatus::TransientFailure } else { BuildStatus::PermanentFailure };
            build_result(status, format!("builder for '{shown}' failed: {msg}"))
        }
        Err(BuiltinError::Store(e)) => build_result(BuildStatus::MiscFailure, format!("cannot build '{shown}': {e}")),
    };
    res.start_time = start;
    res.stop_time = super::payload::now().max(0) as u64;
    Ok(Some(res))
}
