//! BuildDerivation (Nix `daemon.cc`, `wopBuildDerivation`): the client sends a derivation
//! itself, as a remote builder receives it. sluice does not build: its outputs are realised by
//! substitution, with the helpers BuildPaths uses, and what no cache has is built by the Nix
//! daemon of `--build-via` (`delegate`), for trusted clients.

use sluice_nix::store_path::{StorePath, StorePathError};
use sluice_nix::wire::ops::BuildDerivation;
use sluice_nix::wire::{write_build_result, BuildMode, BuildStatus};

use super::query::fixed_outputs;
use super::realise::{build_result, built_outputs, normal_mode_only, realise_by_substitution, realised_status, BUILD_VIA_HINT};
use super::{builtin, delegate};
use crate::conn::{Conn, Fail, OpResult};
use sluice_store::closure::ContentAddresses;

/// BuildDerivation: derivation path, the derivation in wire form (`BasicDerivation`), build
/// mode → a build result in the negotiated version's form: AlreadyValid if every output path
/// is valid, Substituted if substitution made them all valid, else (with `--build-via`, for a
/// trusted client, after substituting the input sources) the Nix daemon's result, else
/// MiscFailure naming the outputs that are missing. Fixed outputs' paths are computed from their hash, not taken from
/// the client. An untrusted client may only send content-addressed (fixed, floating or
/// impure) derivations: any other gets Nix's refusal, as an operation error, whether or not
/// its outputs are valid (Nix `daemon.cc`: `if (!(drvType.isCA() || trusted)) throw`).
pub(super) fn build_derivation(c: &mut Conn, BuildDerivation { drv_path, drv, mode }: BuildDerivation) -> OpResult {
    let dir = c.dir().clone();
    let shown = dir.display_path(&drv_path);
    let cannot = |why: &dyn std::fmt::Display| Fail::Op(format!("cannot build '{shown}': {why}"));
    let name = drv_path.name().strip_suffix(".drv").ok_or_else(|| cannot(&"it is not a derivation (its name does not end in .drv)"))?;
    if !c.peer.trusted && !drv.is_content_addressed() {
        return Err(Fail::Op("you are not privileged to build input-addressed derivations".into()));
    }
    let version = c.version;
    // Nix writes an untrusted client's derivation under the path it computes itself; sluice
    // does not, so only trusted clients' derivations are handed to the Nix daemon.
    let delegated = delegate::enabled(c) && c.peer.trusted;
    if mode != BuildMode::Normal && delegated {
        let result = delegate::forward(c, |nix, relay| nix.build_derivation(&drv_path, &drv, mode, relay))?;
        return c.reply(|w, _| write_build_result(w, version, &result));
    }
    normal_mode_only(mode)?;
    let outputs = drv
        .outputs
        .iter()
        .map(|o| Ok((o.name.as_str(), o.path(&dir, name)?)))
        .collect::<Result<Vec<(&str, Option<StorePath>)>, StorePathError>>()
        .map_err(|e| cannot(&e))?;
    let known: Vec<StorePath> = outputs.iter().filter_map(|(_, p)| p.clone()).collect();
    let fixed = fixed_outputs(&dir, name, drv.outputs.iter().map(|o| (&o.name, &o.kind)));
    let (valid_before, valid) = realise_by_substitution(c, &known, fixed)?;
    let missing: Vec<String> = outputs
        .iter()
        .filter_map(|(output, path)| match path {
            Some(p) if valid.contains(p) => None,
            Some(p) => Some(format!("{output} ({})", dir.display_path(p))),
            None => Some(format!("{output} (content-addressed or deferred: no path before it is built)")),
        })
        .collect();
    let result = if outputs.is_empty() {
        build_result(BuildStatus::MiscFailure, format!("cannot build '{shown}': the derivation has no outputs"))
    } else if missing.is_empty() {
        let mut res = build_result(realised_status(&known, &valid_before), String::new());
        res.built_outputs = built_outputs(outputs.iter().filter_map(|(output, path)| path.as_ref().map(|p| (*output, p))));
        res
    } else if let Some(result) = builtin::build_sent(c, &drv_path, &drv)? {
        result
    } else if delegated {
        let srcs: Vec<StorePath> = drv.input_srcs.iter().cloned().collect();
        realise_by_substitution(c, &srcs, ContentAddresses::new())?;
        delegate::forward(c, |nix, relay| nix.build_derivation(&drv_path, &drv, mode, relay))?
    } else {
        let why = format!(
            "the sluice daemon does not build derivations (outputs not valid and not substitutable: {}; {BUILD_VIA_HINT})",
            missing.join(", ")
        );
        build_result(BuildStatus::MiscFailure, format!("cannot build '{shown}': {why}"))
    };
    c.reply(|w, _| write_build_result(w, version, &result))
}
