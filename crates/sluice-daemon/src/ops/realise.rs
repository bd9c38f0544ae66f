//! Realising paths by substitution: EnsurePath, QueryMissing, QuerySubstitutablePaths,
//! QuerySubstitutablePathInfos, BuildPaths and BuildPathsWithResults (BuildDerivation, in
//! `build`, shares its helpers). sluice does not build: a derivation output that no
//! substituter has is reported as needing a build, and BuildPaths builds it through the Nix
//! daemon of `--build-via` (`delegate`) or fails with a message saying so.

use std::collections::{BTreeMap, BTreeSet};

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::{
    BuildPaths, BuildPathsWithResults, EnsurePath, QueryMissing, QuerySubstitutablePathInfos, QuerySubstitutablePaths,
};
use sluice_nix::wire::{
    write_keyed_build_result, write_optional_store_path, write_store_path, write_store_path_set, write_u64, BuildMode, BuildResult,
    BuildStatus, DerivedPath, OutputsSpec,
};
use sluice_store::builtins::Builtin;
use sluice_store::closure::ClosureEvent;
use sluice_store::failure::{summarize, Cause};

use super::activities::SubstitutionActivities;
use super::query::{derivation_outputs, fixed_outputs_of, load_derivation};
use super::{builtin, delegate, realisation};
use crate::conn::{op_err, Conn, Fail, OpResult};
use crate::substitution::{self, Wanted};
use crate::PROTOCOL_VERSION;
use sluice_store::closure::ContentAddresses;

/// Substitutes the closures of `wanted`'s paths into the store, reporting the activities Nix's
/// worker reports ([`SubstitutionActivities`]).
/// Paths that cannot be substituted are left invalid (the caller decides whether that fails);
/// why they could not (an untrusted signature, a cache refusing us, a hash mismatch) is sent
/// to the client as `error:` log lines, grouped by cause ([`summarize`]), before that. That no
/// substituter has a path goes without saying: the caller's error says so.
pub(super) fn substitute(c: &mut Conn, wanted: Wanted) -> Result<(), Fail> {
    let settings = c.options.settings()?;
    let dir = c.dir().clone();
    let stderr = c.stderr();
    let mut activities = SubstitutionActivities::start(&mut c.w, stderr, c.daemon, dir.clone())?;
    let mut write_err = None;
    let daemon = c.daemon;
    let w = &mut c.w;
    let result = substitution::copy(daemon, &c.store, &settings, c.options.use_substitutes(), &c.temp_roots.clone(), wanted, |p| {
        if let Err(e) = activities.report(w, p).and_then(|()| std::io::Write::flush(w)) {
            write_err.get_or_insert(e);
        }
    });
    if let Some(e) = write_err {
        return Err(Fail::Output(e));
    }
    activities.finish(&mut c.w)?;
    let mut report = result.map_err(Fail::Op)?;
    report.failed.retain(|_, f| f.cause != Cause::Unknown);
    for line in summarize(&dir, &report.failed, "substituted") {
        tracing::info!("{line}");
        c.log(&format!("error: {line}"))?;
    }
    Ok(())
}

/// EnsurePath: path → 1 once it is valid (substituting it if needed).
pub(super) fn ensure_path(c: &mut Conn, EnsurePath { path }: EnsurePath) -> OpResult {
    if !c.store().is_valid_path(&path).map_err(op_err)? {
        substitute(c, vec![path.clone()].into())?;
        if !c.store().is_valid_path(&path).map_err(op_err)? {
            return Err(Fail::Op(format!(
                "path '{}' is required, but there is no substituter that can build it",
                c.dir().display_path(&path)
            )));
        }
    }
    c.reply(|w, _| write_u64(w, 1))
}

/// Substitutes the `.drv` files of `targets` that are not valid, with their closures (input
/// derivations and sources), as Nix's `DerivationGoal::loadDerivation` waits for a
/// `PathSubstitutionGoal` of the `.drv` before reading it (`build/derivation-goal.cc`). A
/// `.drv` that no substituter has stays invalid; [`wanted_paths`] then says so.
fn substitute_derivations(c: &mut Conn, targets: &[DerivedPath]) -> Result<(), Fail> {
    let drvs: BTreeSet<StorePath> =
        targets.iter().filter_map(|t| if let DerivedPath::Built { drv, .. } = t { Some(drv.clone()) } else { None }).collect();
    let drvs: Vec<StorePath> = drvs.into_iter().collect();
    realise_by_substitution(c, &drvs, ContentAddresses::new()).map(|_| ())
}

/// The store paths a derived path stands for, or why they cannot be named: an opaque path
/// itself; a derivation's wanted outputs as its (valid) `.drv` file names them. A `.drv` that
/// is not valid gets Nix's "cannot build missing derivation" (`derivation-goal.cc`).
fn wanted_paths(c: &Conn, target: &DerivedPath) -> Result<Vec<StorePath>, String> {
    match target {
        DerivedPath::Opaque(p) => Ok(vec![p.clone()]),
        DerivedPath::Built { outputs: OutputsSpec::Names(names), .. } if names.iter().any(|n| n.contains('!')) => {
            // `drv!out!out`: an output of a derivation that is itself an output (dynamic
            // derivations), which Nix 2.26 does not build either (`Worker::makeGoal`).
            Err("Building dynamic derivations in one shot is not yet implemented.".to_owned())
        }
        DerivedPath::Built { drv, outputs } => {
            let shown = c.dir().display_path(drv);
            let all = derivation_outputs(c, drv)
                .map_err(|e| format!("{e:?}"))?
                .ok_or_else(|| format!("cannot build missing derivation '{shown}'"))?;
            let mut paths = Vec::new();
            for (name, path) in all {
                if let OutputsSpec::Names(names) = outputs {
                    if !names.contains(&name) {
                        continue;
                    }
                }
                paths.push(path.ok_or_else(|| {
                    format!(
                        "output '{name}' of '{shown}' has no fixed path: the sluice daemon realises floating content-addressed \
                         outputs only with the experimental feature 'ca-derivations' and `--build-via`"
                    )
                })?);
            }
            if let OutputsSpec::Names(names) = outputs {
                if paths.len() != names.len() {
                    return Err(format!("derivation '{shown}' does not have all of the outputs {names:?}"));
                }
            }
            Ok(paths)
        }
    }
}

/// Whether `target` wants an output whose path its (valid) derivation does not fix: a floating
/// content-addressed, deferred or impure one.
fn wants_floating(c: &Conn, target: &DerivedPath) -> bool {
    let DerivedPath::Built { drv, outputs } = target else { return false };
    let outs = derivation_outputs(c, drv).ok().flatten().unwrap_or_default();
    outs.iter().any(|(name, path)| path.is_none() && !matches!(outputs, OutputsSpec::Names(names) if !names.contains(name)))
}

/// The wanted output paths of `target`, a derivation with floating outputs, as the Nix daemon
/// knows them from its realisations (QueryDerivationOutputMap); a derivation with a wanted
/// output not realised yet (`None`) is to be built.
fn realised_paths(c: &mut Conn, drv: &StorePath, outputs: &OutputsSpec) -> Result<Option<Vec<StorePath>>, Fail> {
    let known = delegate::forward(c, |nix, _| nix.query_derivation_output_map(drv))?;
    let wanted = known.into_iter().filter(|(name, _)| !matches!(outputs, OutputsSpec::Names(names) if !names.contains(name)));
    Ok(wanted.map(|(_, path)| path).collect())
}

/// QueryMissing: derived paths → willBuild, willSubstitute, unknown, downloadSize, narSize.
/// Derivation outputs that no substituter has are `willBuild` (the derivation), as are
/// floating outputs not realised yet ([`realised_paths`]). A `.drv` that
/// is not valid is `unknown`, as Nix 2.8 and 2.26 report it (`Store::queryMissing` in
/// `misc.cc`: "FIXME: we could try to substitute the derivation"): BuildPaths substitutes it.
pub(super) fn query_missing(c: &mut Conn, QueryMissing { targets }: QueryMissing) -> OpResult {
    let settings = c.options.settings()?;
    let (mut will_build, mut will_substitute, mut unknown) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    let (mut download, mut nar) = (0u64, 0u64);
    let mut roots = Vec::new();
    let mut fixed = ContentAddresses::new();
    let mut outputs_of: Vec<(StorePath, Vec<StorePath>)> = Vec::new();
    let floating_ca = delegate::floating_ca(c)?;
    for t in &targets {
        if let (DerivedPath::Built { drv, outputs }, true) = (t, floating_ca && wants_floating(c, t)) {
            let known = match realised_paths(c, drv, outputs)? {
                Some(paths) => Some(paths),
                // Outputs the substituters have realisations of are substitutable if their paths are.
                None => realisation::substitutable(c, drv, outputs, false)?.map(|found| found.into_iter().map(|f| f.out_path).collect()),
            };
            match known {
                Some(paths) => {
                    roots.extend(paths.iter().cloned());
                    outputs_of.push((drv.clone(), paths));
                }
                None => {
                    will_build.insert(drv.clone());
                }
            }
            continue;
        }
        match (t, wanted_paths(c, t)) {
            (DerivedPath::Built { drv, .. }, Ok(paths)) => {
                fixed.extend(fixed_outputs_of(c, drv)?);
                roots.extend(paths.iter().cloned());
                outputs_of.push((drv.clone(), paths));
            }
            (_, Ok(paths)) => roots.extend(paths),
            (DerivedPath::Built { drv, .. }, Err(_)) => {
                unknown.insert(drv.clone());
            }
            (DerivedPath::Opaque(p), Err(_)) => {
                unknown.insert(p.clone());
            }
        }
    }
    let events = if roots.is_empty() {
        Vec::new()
    } else {
        let wanted = Wanted { paths: roots, content_addresses: fixed };
        substitution::query(c.daemon, &c.store, &settings, c.options.use_substitutes(), wanted).map_err(Fail::Op)?
    };
    let mut missing = BTreeSet::new();
    for e in events {
        match e {
            ClosureEvent::Found { narinfo, .. } => {
                download += narinfo.file_size.unwrap_or(0);
                nar += narinfo.nar_size;
                will_substitute.insert(narinfo.store_path.clone());
            }
            ClosureEvent::Unknown(p) | ClosureEvent::Failed { path: p, .. } => {
                missing.insert(p);
            }
            ClosureEvent::Valid(_) => {}
        }
    }
    for (drv, outs) in outputs_of {
        if outs.iter().any(|o| missing.remove(o)) {
            will_build.insert(drv);
        }
    }
    unknown.extend(missing);
    c.reply(|w, dir| {
        write_store_path_set(w, dir, will_build.iter())?;
        write_store_path_set(w, dir, will_substitute.iter())?;
        write_store_path_set(w, dir, unknown.iter())?;
        write_u64(w, download)?;
        write_u64(w, nar)
    })
}

/// The narinfos the substituters have for exactly `paths` (not their references).
fn substitutable(c: &Conn, paths: Vec<StorePath>) -> Result<Vec<std::sync::Arc<sluice_nix::narinfo::NarInfo>>, Fail> {
    let wanted: BTreeSet<StorePath> = paths.iter().cloned().collect();
    let settings = c.options.settings()?;
    let events = substitution::query(c.daemon, &c.store, &settings, c.options.use_substitutes(), paths.into()).map_err(Fail::Op)?;
    Ok(events
        .into_iter()
        .filter_map(|e| match e {
            ClosureEvent::Found { narinfo, .. } if wanted.contains(&narinfo.store_path) => Some(narinfo),
            _ => None,
        })
        .collect())
}

/// QuerySubstitutablePaths: path set → the subset some substituter has.
pub(super) fn substitutable_paths(c: &mut Conn, QuerySubstitutablePaths { paths }: QuerySubstitutablePaths) -> OpResult {
    let paths = paths.into_iter().collect();
    let found: BTreeSet<StorePath> = substitutable(c, paths)?.into_iter().map(|n| n.store_path.clone()).collect();
    c.reply(|w, dir| write_store_path_set(w, dir, found.iter()))
}

/// QuerySubstitutablePathInfos: (≥ 1.22) map path → content address, or (before) a path set
/// → count, then per path: path, deriver, references, download size, NAR size.
pub(super) fn substitutable_path_infos(c: &mut Conn, QuerySubstitutablePathInfos { paths }: QuerySubstitutablePathInfos) -> OpResult {
    let paths = paths.into_iter().map(|(path, _)| path).collect();
    let infos = substitutable(c, paths)?;
    c.reply(|w, dir| {
        write_u64(w, infos.len() as u64)?;
        for n in &infos {
            write_store_path(w, dir, &n.store_path)?;
            write_optional_store_path(w, dir, n.deriver.as_ref())?;
            write_store_path_set(w, dir, n.references.iter())?;
            write_u64(w, n.file_size.unwrap_or(0))?;
            write_u64(w, n.nar_size)?;
        }
        Ok(())
    })
}

/// The build modes the daemon accepts: only normal (it cannot repair or check by rebuilding).
pub(super) fn normal_mode_only(mode: BuildMode) -> Result<(), Fail> {
    if mode != BuildMode::Normal {
        return Err(Fail::Op(format!("build mode {mode:?} is not supported by the sluice daemon (it only substitutes)")));
    }
    Ok(())
}

/// Which of `paths` are valid before and after substituting the missing ones (those of
/// `content_addresses` from substituters of another store directory too).
pub(super) fn realise_by_substitution(
    c: &mut Conn,
    paths: &[StorePath],
    content_addresses: ContentAddresses,
) -> Result<(BTreeSet<StorePath>, BTreeSet<StorePath>), Fail> {
    let before = c.store().query_valid_paths(paths).map_err(op_err)?;
    let missing: Vec<StorePath> = paths.iter().filter(|p| !before.contains(*p)).cloned().collect();
    if missing.is_empty() {
        return Ok((before.clone(), before));
    }
    substitute(c, Wanted { paths: missing, content_addresses })?;
    let after = c.store().query_valid_paths(paths).map_err(op_err)?;
    Ok((before, after))
}

/// A build result of `status` with `error_msg`, nothing built: its start and stop times are 0,
/// as Nix sets them only when a builder runs (`build/derivation-goal.cc`, `buildDone`), and
/// Nix 2.26's `nix build --json` adds them to a path's entry only when they are not 0 (which
/// it cannot do for a path that is not a derivation's output: `src/nix/build.cc`).
pub(super) fn build_result(status: BuildStatus, error_msg: String) -> BuildResult {
    BuildResult::not_built(status, error_msg)
}

/// AlreadyValid if every one of `paths` was valid in `valid_before`, else Substituted.
pub(super) fn realised_status(paths: &[StorePath], valid_before: &BTreeSet<StorePath>) -> BuildStatus {
    if paths.iter().all(|p| valid_before.contains(p)) {
        BuildStatus::AlreadyValid
    } else {
        BuildStatus::Substituted
    }
}

/// BuildPaths: derived paths, (≥ 1.15) build mode → 1 ([`realise`]).
pub(super) fn build_paths(c: &mut Conn, BuildPaths { targets, mode }: BuildPaths) -> OpResult {
    realise(c, &targets, mode, false)
}

/// BuildPathsWithResults: derived paths, build mode → one keyed build result per derived
/// path ([`realise`]).
pub(super) fn build_paths_with_results(c: &mut Conn, BuildPathsWithResults { targets, mode }: BuildPathsWithResults) -> OpResult {
    realise(c, &targets, mode, true)
}

/// BuildPaths and (`with_results`) BuildPathsWithResults of `targets` in `mode`. The `.drv`
/// files of derivations that are not valid are substituted first, then the wanted paths. With `--build-via`, derivations whose outputs
/// are still missing are built through the Nix daemon (after their inputs are substituted), and
/// checking or repairing (trusted clients only, as Nix) is left to it whole; without it, a
/// missing output fails with a message saying that sluice does not build.
fn realise(c: &mut Conn, targets: &[DerivedPath], mode: BuildMode, with_results: bool) -> OpResult {
    if mode == BuildMode::Repair && !c.peer.trusted {
        return Err(Fail::Fatal("repairing is not allowed because you are not in 'trusted-users'".into()));
    }
    if mode != BuildMode::Normal && delegate::enabled(c) {
        let results = delegated(c, targets, mode, with_results)?;
        return reply_results(c, targets, &results, with_results);
    }
    normal_mode_only(mode)?;
    substitute_derivations(c, targets)?;
    let floating: Vec<usize> =
        if delegate::floating_ca(c)? { (0..targets.len()).filter(|&i| wants_floating(c, &targets[i])).collect() } else { Vec::new() };
    let mut wanted: Vec<Result<Vec<StorePath>, String>> = targets.iter().map(|t| wanted_paths(c, t)).collect();
    // Built whole by the Nix daemon, which knows their realisations.
    for &i in &floating {
        wanted[i] = Ok(Vec::new());
    }
    let all: Vec<StorePath> = wanted.iter().flatten().flatten().cloned().collect();
    let mut fixed = ContentAddresses::new();
    for t in targets {
        if let DerivedPath::Built { drv, .. } = t {
            fixed.extend(fixed_outputs_of(c, drv)?);
        }
    }
    let (valid_before, mut valid) = realise_by_substitution(c, &all, fixed)?;
    let mut built: BTreeMap<usize, BuildResult> = BTreeMap::new();
    let mut to_build: Vec<usize> = (0..targets.len())
        .filter(|&i| matches!(targets[i], DerivedPath::Built { .. }) && matches!(&wanted[i], Ok(p) if p.iter().any(|p| !valid.contains(p))))
        .collect();
    for &i in &to_build {
        if let DerivedPath::Built { drv, .. } = &targets[i] {
            if let Some(result) = builtin::build_stored(c, drv)? {
                built.insert(i, result);
            }
        }
    }
    to_build.retain(|i| !built.contains_key(i));
    // Floating outputs the Nix daemon has not realised may be substituted by their realisations.
    for &i in &floating {
        if let DerivedPath::Built { drv, outputs } = &targets[i] {
            if realised_paths(c, drv, outputs)?.is_none() {
                if let Some(result) = realisation::realise_substitutable(c, drv, outputs)? {
                    built.insert(i, result);
                }
            }
        }
    }
    to_build.extend(floating.into_iter().filter(|i| !built.contains_key(i)));
    if delegate::enabled(c) && !to_build.is_empty() {
        let drvs = to_build
            .iter()
            .filter_map(|&i| if let DerivedPath::Built { drv, .. } = &targets[i] { Some(drv.clone()) } else { None })
            .collect();
        delegate::substitute_build_inputs(c, drvs)?;
        let forwarded: Vec<DerivedPath> = to_build.iter().map(|&i| targets[i].clone()).collect();
        built.extend(to_build.iter().copied().zip(delegated(c, &forwarded, mode, with_results)?));
        valid = c.store().query_valid_paths(&all).map_err(op_err)?;
    }
    let dir = c.dir().clone();
    let results: Vec<BuildResult> = targets
        .iter()
        .zip(wanted)
        .enumerate()
        .map(|(i, (t, w))| {
            if let Some(r) = built.remove(&i) {
                return r;
            }
            let paths = match w {
                Ok(p) => p,
                Err(msg) => return build_result(BuildStatus::MiscFailure, msg),
            };
            let absent: Vec<String> = paths.iter().filter(|p| !valid.contains(*p)).map(|p| dir.display_path(p)).collect();
            if !absent.is_empty() {
                let msg = match t {
                    DerivedPath::Opaque(p) => {
                        format!("path '{}' is required, but there is no substituter that can build it", dir.display_path(p))
                    }
                    DerivedPath::Built { drv, .. } => not_built(c, drv, &absent),
                };
                return build_result(BuildStatus::MiscFailure, msg);
            }
            let mut res = build_result(realised_status(&paths, &valid_before), String::new());
            if let DerivedPath::Built { drv, .. } = t {
                let outputs = derivation_outputs(c, drv).ok().flatten().unwrap_or_default();
                res.built_outputs = built_outputs(
                    outputs.iter().filter_map(|(name, p)| p.as_ref().filter(|p| paths.contains(p)).map(|p| (name.as_str(), p))),
                );
            }
            res
        })
        .collect();
    reply_results(c, targets, &results, with_results)
}

/// Why the outputs `absent` of `drv` stay missing without `--build-via`: sluice does not
/// build, not even a `builtin:` it does not know (it runs Nix 2.8's and 2.26's
/// `src/libstore/builtins/` itself once their inputs are valid: `builtin`); the error names
/// the option that builds them through a `nix-daemon`.
fn not_built(c: &Conn, drv: &StorePath, absent: &[String]) -> String {
    let builtin = load_derivation(c, drv)
        .ok()
        .flatten()
        .and_then(|d| String::from_utf8(d.builder).ok())
        .filter(|b| b.starts_with("builtin:") && Builtin::of(b.as_bytes()).is_none());
    let what = match builtin {
        Some(b) => format!("does not build, not even builtins such as {b},"),
        None => "does not build,".to_owned(),
    };
    format!(
        "cannot build derivation '{}': the sluice daemon {what} and no substituter has {} ({BUILD_VIA_HINT})",
        c.dir().display_path(drv),
        absent.join(", ")
    )
}

/// How to have what sluice does not build built, for its errors.
pub(super) const BUILD_VIA_HINT: &str = "`sluice daemon --build-via unix://SOCKET` builds it through the nix-daemon listening on SOCKET";

/// Forwards BuildPaths (`with_results`: BuildPathsWithResults) of `targets` in `mode` to the
/// Nix daemon of `--build-via`. BuildPathsWithResults: a result per target, in order (one the
/// Nix daemon did not send is a MiscFailure saying so). BuildPaths: none; a failure is the
/// Nix daemon's error, in its words.
fn delegated(c: &mut Conn, targets: &[DerivedPath], mode: BuildMode, with_results: bool) -> Result<Vec<BuildResult>, Fail> {
    if !with_results {
        delegate::forward(c, |nix, relay| nix.build_paths(targets, mode, relay))?;
        return Ok(Vec::new());
    }
    let mut keyed = delegate::forward(c, |nix, relay| nix.build_paths_with_results(targets, mode, relay))?;
    let dir = c.dir().clone();
    Ok(targets
        .iter()
        .map(|t| match keyed.iter().position(|(p, _)| p == t) {
            Some(i) => keyed.swap_remove(i).1,
            None => build_result(
                BuildStatus::MiscFailure,
                format!("the Nix daemon sent no build result for {}", t.to_wire_string(&dir, PROTOCOL_VERSION).unwrap_or_default()),
            ),
        })
        .collect())
}

/// The reply of BuildPaths (1, or the results' errors as the operation's error) or of
/// BuildPathsWithResults (the keyed results, in the client's version).
fn reply_results(c: &mut Conn, targets: &[DerivedPath], results: &[BuildResult], with_results: bool) -> OpResult {
    if !with_results {
        let errors: Vec<&str> = results.iter().filter(|r| !r.error_msg.is_empty()).map(|r| r.error_msg.as_str()).collect();
        if !errors.is_empty() {
            return Err(Fail::Op(errors.join("\n")));
        }
        return c.reply(|w, _| write_u64(w, 1));
    }
    let version = c.version;
    c.reply(|w, dir| {
        write_u64(w, results.len() as u64)?;
        for (t, r) in targets.iter().zip(results) {
            write_keyed_build_result(w, dir, version, t, r)?;
        }
        Ok(())
    })
}

/// The built-outputs map of a realised derivation's `(output name, path)` pairs as protocol
/// ≥ 1.28 carries it: `<hash>!<output>` → realisation JSON. The derivation hash is a
/// placeholder of zeros (old clients only use the output name and path, as current Nix also
/// relies on).
pub(super) fn built_outputs<'a>(outputs: impl Iterator<Item = (&'a str, &'a StorePath)>) -> BTreeMap<String, String> {
    outputs
        .map(|(name, p)| {
            let id = format!("sha256:{}!{name}", "0".repeat(64));
            let json = serde_json::json!({ "dependentRealisations": {}, "id": id, "outPath": p.base_name(), "signatures": [] });
            (id, json.to_string())
        })
        .collect()
}
