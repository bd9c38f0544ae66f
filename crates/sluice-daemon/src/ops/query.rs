//! Read-only queries: validity, path info (of one path, of a set: QueryPathInfos, or of a
//! closure: sluice's QueryClosureInfos), referrers, all paths, hash-part lookup, derivers and
//! derivation outputs (Nix 2.8 `daemon.cc`, the `wopQuery*` and `wopIsValidPath` cases;
//! DeterminateSystems' for op 50).

use sluice_nix::derivation::{drv_name, Derivation};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::wire::ops::{
    IsValidPath, Op, QueryAllValidPaths, QueryClosureInfos, QueryDerivationOutputMap, QueryPathFromHashPart, QueryPathInfo, QueryPathInfos,
    QueryReferrers, QueryValidDerivers, QueryValidPaths,
};
use sluice_nix::wire::OutputKind;
use sluice_nix::wire::{
    write_bool, write_bytes, write_keyed_path_info, write_optional_store_path, write_store_path_set, write_u64, write_unkeyed_path_info,
    MAX_PATH_LEN,
};
use sluice_store::closure::ContentAddresses;

use super::delegate;
use crate::conn::{op_err, Conn, Fail, OpResult};

/// IsValidPath: path → bool.
pub(super) fn is_valid_path(c: &mut Conn, IsValidPath { path }: IsValidPath) -> OpResult {
    let valid = c.store().is_valid_path(&path).map_err(op_err)?;
    c.reply(|w, _| write_bool(w, valid))
}

/// QueryValidPaths: path set, (≥ 1.27) substitute flag → the valid subset, after trying to
/// substitute the others when asked.
pub(super) fn valid_paths(c: &mut Conn, QueryValidPaths { paths, substitute }: QueryValidPaths) -> OpResult {
    let paths: Vec<StorePath> = paths.into_iter().collect();
    if substitute && c.options.use_substitutes() {
        let missing: Vec<StorePath> = {
            let valid = c.store().query_valid_paths(&paths).map_err(op_err)?;
            paths.iter().filter(|p| !valid.contains(*p)).cloned().collect()
        };
        if !missing.is_empty() {
            // Paths that cannot be substituted are simply not valid in the answer.
            super::realise::substitute(c, missing.into())?;
        }
    }
    let valid = c.store().query_valid_paths(&paths).map_err(op_err)?;
    c.reply(|w, dir| write_store_path_set(w, dir, valid.iter()))
}

/// Most QueryPathInfo requests answered together.
const PATH_INFO_BATCH: usize = 1024;

/// QueryPathInfo: path → (≥ 1.17) bool then the unkeyed info; before 1.17 an invalid path
/// is an error. Further QueryPathInfo requests that have already arrived whole (from a client
/// that pipelines) are answered with this one, their paths read from the database in one
/// transaction; each gets its own reply, in order.
pub(super) fn path_info(c: &mut Conn, QueryPathInfo { path }: QueryPathInfo) -> OpResult {
    let mut paths = vec![path];
    // A later request that cannot be read ends the connection, after the earlier ones' replies.
    let mut unreadable = None;
    while unreadable.is_none() && paths.len() < PATH_INFO_BATCH && c.take_buffered_request(Op::QueryPathInfo, MAX_PATH_LEN) {
        match c.read_request::<QueryPathInfo>() {
            Ok((QueryPathInfo { path }, _)) => paths.push(path),
            Err(e) => unreadable = Some(e),
        }
    }
    answer_path_infos(c, &paths)?;
    unreadable.map_or(Ok(()), Err)
}

/// The replies to QueryPathInfo requests for `paths`, in order; a request that fails gets
/// its `ERROR` in its place, as `serve` would send it.
fn answer_path_infos(c: &mut Conn, paths: &[StorePath]) -> OpResult {
    let infos = c.store().query_path_infos(paths);
    for (path, info) in paths.iter().zip(infos) {
        match info.map_err(op_err).and_then(|info| answer_path_info(c, path, info)) {
            Err(Fail::Op(msg)) => c.stderr().error(&mut c.w, &msg)?,
            other => other?,
        }
    }
    Ok(())
}

/// The reply to one QueryPathInfo of `path`, whose registration is `info`.
fn answer_path_info(c: &mut Conn, path: &StorePath, info: Option<ValidPathInfo>) -> OpResult {
    let version = c.version;
    match info {
        Some(info) => c.reply(|w, dir| {
            if version.at_least(17) {
                write_bool(w, true)?;
            }
            write_unkeyed_path_info(w, dir, version, &info)
        }),
        None if version.at_least(17) => c.reply(|w, _| write_bool(w, false)),
        None => Err(Fail::Op(format!("path '{}' is not valid", c.dir().display_path(path)))),
    }
}

/// QueryPathInfos (op 50, DeterminateSystems' Nix): path set → the count of valid paths, then
/// each one's keyed info; the paths not answered are not valid. Read in one transaction, as
/// pipelined QueryPathInfo requests are.
pub(super) fn path_infos(c: &mut Conn, QueryPathInfos { paths }: QueryPathInfos) -> OpResult {
    let paths: Vec<StorePath> = paths.into_iter().collect();
    let infos = valid_infos(c, &paths)?;
    reply_keyed_infos(c, &infos)
}

/// QueryClosureInfos (sluice's own): path set → the count, then the keyed info of every valid
/// path of the closure under references of the valid ones of the set, found one database read
/// per level of references. A path that is not valid (a root, or a reference the database
/// names without holding it) is left out, for the client to find.
pub(super) fn closure_infos(c: &mut Conn, QueryClosureInfos { paths }: QueryClosureInfos) -> OpResult {
    let mut seen = paths.clone();
    let mut level: Vec<StorePath> = paths.into_iter().collect();
    let mut closure = Vec::new();
    while !level.is_empty() {
        let infos = valid_infos(c, &level)?;
        level = infos.iter().flat_map(|i| &i.references).filter(|r| seen.insert((*r).clone())).cloned().collect();
        closure.extend(infos);
    }
    reply_keyed_infos(c, &closure)
}

/// The infos of the valid ones of `paths`, read in one transaction.
fn valid_infos(c: &Conn, paths: &[StorePath]) -> Result<Vec<ValidPathInfo>, Fail> {
    let infos = c.store().query_path_infos(paths).into_iter().collect::<Result<Vec<_>, _>>().map_err(op_err)?;
    Ok(infos.into_iter().flatten().collect())
}

/// Replies with the count of `infos`, then each keyed (QueryPathInfos' answer).
fn reply_keyed_infos(c: &mut Conn, infos: &[ValidPathInfo]) -> OpResult {
    let version = c.version;
    c.reply(|w, dir| {
        write_u64(w, infos.len() as u64)?;
        infos.iter().try_for_each(|info| write_keyed_path_info(w, dir, version, info))
    })
}

/// QueryReferrers: path → the valid paths referring to it.
pub(super) fn referrers(c: &mut Conn, QueryReferrers { path }: QueryReferrers) -> OpResult {
    let refs = c.store().query_referrers(&path).map_err(op_err)?;
    c.reply(|w, dir| write_store_path_set(w, dir, refs.iter()))
}

/// QueryAllValidPaths: → every valid path.
pub(super) fn all_valid_paths(c: &mut Conn, _: QueryAllValidPaths) -> OpResult {
    let all = c.store().query_all_valid_paths().map_err(op_err)?;
    c.reply(|w, dir| write_store_path_set(w, dir, all.iter()))
}

/// QueryPathFromHashPart: hash part → the valid path with it, or the empty string.
pub(super) fn path_from_hash_part(c: &mut Conn, QueryPathFromHashPart { hash_part }: QueryPathFromHashPart) -> OpResult {
    let found = c.store().query_path_from_hash_part(&hash_part).map_err(op_err)?;
    c.reply(|w, dir| write_optional_store_path(w, dir, found.as_ref()))
}

/// QueryValidDerivers: output path → the valid derivations registered as producing it.
pub(super) fn valid_derivers(c: &mut Conn, QueryValidDerivers { path }: QueryValidDerivers) -> OpResult {
    let derivers = c.store().query_valid_derivers(&path).map_err(op_err)?;
    c.reply(|w, dir| write_store_path_set(w, dir, derivers.iter()))
}

/// QueryDerivationOutputMap: derivation path → output name → output path, as registered
/// (Nix 2.8 without `ca-derivations`: outputs whose path is not fixed are absent). A
/// derivation with such outputs, when sluice realises them ([`delegate::floating_ca`]), is
/// the Nix daemon's to answer: it finds their paths in its realisations (Nix
/// `LocalStore::queryPartialDerivationOutputMap` with `ca-derivations`), `None` for those not
/// built.
pub(super) fn derivation_output_map(c: &mut Conn, QueryDerivationOutputMap { path: drv }: QueryDerivationOutputMap) -> OpResult {
    let floating = delegate::floating_ca(c)? && derivation_outputs(c, &drv)?.is_some_and(|o| o.iter().any(|(_, p)| p.is_none()));
    let outputs: Vec<(String, Option<StorePath>)> = if floating {
        delegate::forward(c, |nix, _| nix.query_derivation_output_map(&drv))?
    } else {
        c.store().query_derivation_output_map(&drv).map_err(op_err)?.into_iter().map(|(name, p)| (name, Some(p))).collect()
    };
    c.reply(|w, dir| {
        write_u64(w, outputs.len() as u64)?;
        for (name, path) in &outputs {
            write_bytes(w, name.as_bytes())?;
            write_optional_store_path(w, dir, path.as_ref())?;
        }
        Ok(())
    })
}

/// A derivation's outputs by name, with their paths when the derivation fixes them.
pub(super) type DrvOutputs = Vec<(String, Option<StorePath>)>;

/// The outputs named in a valid derivation (read from the store), or `None` if it is not valid.
pub(super) fn derivation_outputs(c: &Conn, drv: &StorePath) -> Result<Option<DrvOutputs>, Fail> {
    let Some(d) = load_derivation(c, drv)? else { return Ok(None) };
    d.output_paths(c.dir()).map(Some).map_err(|e| Fail::Op(format!("{}: {e}", c.dir().display_path(drv))))
}

/// The paths and content addresses of the fixed outputs among `outputs` of the derivation
/// named `drv_name` (Nix's `getDerivationCA`), for the substituters of another store directory.
pub(super) fn fixed_outputs<'a>(
    dir: &StoreDir,
    drv_name: &str,
    outputs: impl IntoIterator<Item = (&'a String, &'a OutputKind)>,
) -> ContentAddresses {
    let fixed = outputs.into_iter().filter_map(|(name, kind)| match kind {
        OutputKind::Fixed(ca) => Some((kind.path(dir, drv_name, name).ok().flatten()?, ca.clone())),
        _ => None,
    });
    fixed.collect()
}

/// [`fixed_outputs`] of the valid derivation `drv` (none if it is not valid).
pub(super) fn fixed_outputs_of(c: &Conn, drv: &StorePath) -> Result<ContentAddresses, Fail> {
    Ok(load_derivation(c, drv)?.map(|d| fixed_outputs(c.dir(), drv_name(drv), &d.outputs)).unwrap_or_default())
}

/// The derivation `drv` (Nix `Store::readDerivation`), or `None` if it is not a valid `.drv`.
pub(super) fn load_derivation(c: &Conn, drv: &StorePath) -> Result<Option<Derivation>, Fail> {
    if !drv.is_derivation() || !c.store().is_valid_path(drv).map_err(op_err)? {
        return Ok(None);
    }
    let file = c.store().real_path(drv);
    let aterm = std::fs::read(&file).map_err(|e| Fail::Op(format!("reading {}: {e}", file.display())))?;
    Derivation::parse(c.dir(), drv_name(drv), &aterm).map(Some).map_err(|e| Fail::Op(format!("{}: {e}", c.dir().display_path(drv))))
}
