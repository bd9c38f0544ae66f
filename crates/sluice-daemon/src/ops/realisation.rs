//! Realisations of content-addressed derivations (`ca-derivations`; Nix `daemon.cc`,
//! `wopQueryRealisation`, `wopRegisterDrvOutput`). When sluice realises floating
//! content-addressed outputs ([`delegate::floating_ca`]) they are the Nix daemon's, which keeps
//! them in the `Realisations` table of the shared database (Nix `local-store.cc`); otherwise
//! sluice keeps none: queries find nothing and registrations are refused, each after its
//! request is read whole so that the connection goes on.
//!
//! Realisations are also substituted, as Nix's `DrvOutputSubstitutionGoal` does
//! (`build/drv-output-substitution-goal.cc`): a floating output that the Nix daemon has not
//! realised is looked up in the substituters (`realisations/<id>.doi` of a binary cache), its
//! path is substituted, and the realisation is then registered with the Nix daemon; QueryMissing
//! counts such outputs as substitutable, as Nix's `queryMissing` does (`misc.cc`).

use std::collections::BTreeSet;

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::{QueryRealisation, RegisterDrvOutput};
use sluice_nix::wire::{write_bytes, write_u64, BuildResult, BuildStatus, DrvOutput, OutputsSpec};
use sluice_store::closure::ContentAddresses;

use super::delegate;
use super::query::load_derivation;
use super::realise::{build_result, realise_by_substitution};
use crate::conn::{Conn, Fail, OpResult};
use crate::substitution;

/// A derivation output id as sent; a malformed id is an operation error (as Nix, which parses
/// it after the request is read).
fn drv_output(id: &str) -> Result<DrvOutput, Fail> {
    DrvOutput::parse(id).map_err(|e| Fail::Op(e.to_string()))
}

/// The `outPath` (a base name) of the realisation `json`.
fn out_path(json: &str) -> Result<String, Fail> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| Fail::Op(format!("invalid realisation JSON: {e}")))?;
    let base = value.get("outPath").and_then(serde_json::Value::as_str);
    base.map(str::to_owned).ok_or_else(|| Fail::Op("invalid realisation JSON: no string field \"outPath\"".into()))
}

/// QueryRealisation: derivation output id (`sha256:<hash>!<output>`) → its realisations: from
/// 1.31 a set of realisation JSON strings, before a set of output paths. The Nix daemon's
/// with [`delegate::floating_ca`], else always empty.
pub(super) fn query_realisation(c: &mut Conn, QueryRealisation { id }: QueryRealisation) -> OpResult {
    drv_output(&id)?;
    let found = if delegate::floating_ca(c)? { delegate::forward(c, |nix, _| nix.query_realisation(&id))? } else { Vec::new() };
    let found: Vec<String> = if c.version.at_least(31) {
        found
    } else {
        let dir = c.dir().clone();
        found.iter().map(|json| out_path(json).map(|base| format!("{}/{base}", dir.as_str()))).collect::<Result<_, _>>()?
    };
    c.reply(|w, _| {
        write_u64(w, found.len() as u64)?;
        found.iter().try_for_each(|s| write_bytes(w, s.as_bytes()))
    })
}

/// RegisterDrvOutput: from 1.31 a realisation as a JSON string (`id`, `outPath`,
/// `signatures`, `dependentRealisations`); before, a derivation output id and the output's
/// base name. Nothing is replied on success. With [`delegate::floating_ca`], a trusted
/// client's realisation is registered by the Nix daemon (Nix registers anyone's unchecked:
/// sluice, a trusted client of the Nix daemon, does not pass an untrusted one's on); otherwise
/// it fails, after reading it, since sluice keeps no realisations of its own.
pub(super) fn register_drv_output(c: &mut Conn, request: RegisterDrvOutput) -> OpResult {
    let (id, json) = match request {
        RegisterDrvOutput::Json(json) => {
            let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| Fail::Op(format!("invalid realisation JSON: {e}")))?;
            let id = value
                .get("id")
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| Fail::Op("invalid realisation JSON: no string field \"id\"".into()))?;
            (drv_output(id)?, json)
        }
        RegisterDrvOutput::Legacy { id, out_path } => {
            let parsed = drv_output(&id)?;
            StorePath::from_base_name(&out_path).map_err(|e| Fail::Op(format!("invalid output path of {parsed}: {e}")))?;
            let json = serde_json::json!({ "id": id, "outPath": out_path, "signatures": [], "dependentRealisations": {} });
            (parsed, json.to_string())
        }
    };
    if !delegate::floating_ca(c)? {
        return Err(Fail::Op(format!(
            "cannot register the realisation of {id}: the sluice daemon keeps realisations only with the experimental feature \
             'ca-derivations' and `--build-via`"
        )));
    }
    if !c.peer.trusted {
        return Err(Fail::Op(format!("cannot register the realisation of {id}: you are not in 'trusted-users'")));
    }
    delegate::forward(c, |nix, _| nix.register_drv_output(&json))?;
    c.reply(|_, _| Ok(()))
}

/// A realisation a substituter has: the output it was looked up for (`None` for one a wanted
/// realisation depends on), its id, output path and JSON text.
pub(super) struct Found {
    pub output: Option<String>,
    pub id: String,
    pub out_path: StorePath,
    pub json: String,
}

/// The derivation output ids (`sha256:<hash>!<output>`) of the wanted outputs of the valid
/// derivation `drv`: its hash modulo with the outputs masked, per output (Nix's
/// `staticOutputHashes`).
fn output_ids(c: &Conn, drv: &StorePath, outputs: &OutputsSpec) -> Result<Vec<(String, String)>, Fail> {
    let Some(d) = load_derivation(c, drv)? else { return Ok(Vec::new()) };
    let store = c.store();
    let hashes = d
        .hash_modulo(c.dir(), true, &mut |input| store.drv_hashes(input))
        .map_err(|e| Fail::Op(format!("{}: {e}", c.dir().display_path(drv))))?;
    let wanted = hashes.into_iter().filter(|(name, _)| !matches!(outputs, OutputsSpec::Names(names) if !names.contains(name)));
    Ok(wanted.map(|(name, h)| (format!("sha256:{}!{name}", h.to_base16()), name)).collect())
}

/// The `outPath` and `dependentRealisations` (id → base name) of the realisation `json`.
fn parse_realisation(json: &str) -> Result<(StorePath, Vec<(String, String)>), String> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("invalid realisation JSON: {e}"))?;
    let base = value.get("outPath").and_then(serde_json::Value::as_str).ok_or("invalid realisation JSON: no string field \"outPath\"")?;
    let out_path = StorePath::from_base_name(base).map_err(|e| format!("invalid realisation JSON: outPath {base:?}: {e}"))?;
    let deps = value.get("dependentRealisations").and_then(serde_json::Value::as_object).into_iter().flatten();
    let deps = deps.filter_map(|(id, path)| Some((id.clone(), path.as_str()?.to_owned()))).collect();
    Ok((out_path, deps))
}

/// The realisations the substituters have for the wanted outputs of the floating derivation
/// `drv` and, with `dependencies`, for those they depend on, as Nix's
/// `DrvOutputSubstitutionGoal` looks them up; `None` if one is missing or malformed (it is
/// logged), or if one depended on differs from the Nix daemon's (Nix then ignores the
/// substituter's: "has an incompatible realisation").
pub(super) fn substitutable(c: &mut Conn, drv: &StorePath, outputs: &OutputsSpec, dependencies: bool) -> Result<Option<Vec<Found>>, Fail> {
    let settings = c.options.settings()?;
    let mut todo: Vec<(String, Option<String>)> = output_ids(c, drv, outputs)?.into_iter().map(|(id, name)| (id, Some(name))).collect();
    if todo.is_empty() {
        return Ok(None);
    }
    let mut seen: BTreeSet<String> = todo.iter().map(|(id, _)| id.clone()).collect();
    let mut found = Vec::new();
    while !todo.is_empty() {
        let ids: Vec<String> = todo.iter().map(|(id, _)| id.clone()).collect();
        let answers = substitution::realisations(c.daemon, c.store(), &settings, c.options.use_substitutes(), &ids).map_err(Fail::Op)?;
        let mut next = Vec::new();
        for ((id, output), answer) in todo.into_iter().zip(answers) {
            let Some(json) = answer else { return Ok(None) };
            let (out_path, deps) = match parse_realisation(&json) {
                Ok(parsed) => parsed,
                Err(e) => {
                    tracing::warn!("realisation of {id}: {e}");
                    return Ok(None);
                }
            };
            for (dep, dep_path) in deps.into_iter().filter(|(dep, _)| dependencies && *dep != id) {
                let local = delegate::forward(c, |nix, _| nix.query_realisation(&dep))?;
                if local.iter().any(|l| out_path_of(l).is_some_and(|p| p.base_name() != dep_path)) {
                    tracing::warn!("a substituter has an incompatible realisation for '{dep}', ignoring it");
                    return Ok(None);
                }
                if seen.insert(dep.clone()) {
                    next.push((dep, None));
                }
            }
            found.push(Found { output, id, out_path, json });
        }
        todo = next;
    }
    Ok(Some(found))
}

/// The output path of the realisation `json`, if it is well-formed.
fn out_path_of(json: &str) -> Option<StorePath> {
    parse_realisation(json).ok().map(|(p, _)| p)
}

/// Realises the wanted outputs of the floating derivation `drv` from the substituters'
/// realisations ([`substitutable`], with those they depend on): the closures of their output
/// paths are substituted, then the realisations are registered with the Nix daemon, those
/// depended on first (Nix's `DrvOutputSubstitutionGoal::finished`). The build result (Substituted, with the wanted
/// realisations), or `None` when the outputs are to be built.
pub(super) fn realise_substitutable(c: &mut Conn, drv: &StorePath, outputs: &OutputsSpec) -> Result<Option<BuildResult>, Fail> {
    let Some(found) = substitutable(c, drv, outputs, true)? else { return Ok(None) };
    let paths: Vec<StorePath> = found.iter().map(|f| f.out_path.clone()).collect();
    let (_, valid) = realise_by_substitution(c, &paths, ContentAddresses::new())?;
    if paths.iter().any(|p| !valid.contains(p)) {
        return Ok(None);
    }
    // Those depended on first (found after their dependents): Nix refuses a realisation whose
    // dependencies it does not have.
    for f in found.iter().rev() {
        delegate::forward(c, |nix, _| nix.register_drv_output(&f.json))?;
    }
    let mut result = build_result(BuildStatus::Substituted, String::new());
    result.built_outputs = found.into_iter().filter(|f| f.output.is_some()).map(|f| (f.id, f.json)).collect();
    Ok(Some(result))
}
