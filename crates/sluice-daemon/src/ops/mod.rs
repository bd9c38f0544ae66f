//! The worker-protocol operations, by number (`WorkerProto::Op` in Nix's
//! `worker-protocol.hh`), grouped by kind: queries, additions, realisation (substitution),
//! BuildDerivation, build logs, realisations of content-addressed derivations, GC roots,
//! maintenance.

mod add;
mod build;
mod log;
mod maintenance;
mod payload;
mod query;
mod realisation;
mod realise;

use sluice_nix::content_address::ContentAddress;
use sluice_nix::wire::PathInfo;
use sluice_store::path_info::ValidPathInfo;

use crate::conn::{op_err, Conn, Fail, OpResult};
use crate::{options, roots};

/// Runs operation `op` on `c`. An unknown number is fatal to the connection (its arguments
/// cannot be skipped).
pub(crate) fn dispatch(c: &mut Conn, op: u64) -> OpResult {
    match op {
        1 => query::is_valid_path(c),
        6 => query::referrers(c),
        7 => add::add_to_store(c),
        8 => add::add_text_to_store(c),
        9 => realise::build_paths(c, false),
        10 => realise::ensure_path(c),
        11 => roots::add_temp_root(c),
        12 => roots::add_indirect_root(c),
        13 => roots::sync_with_gc(c),
        14 => roots::find_roots(c),
        19 => options::set_options(c),
        20 => maintenance::collect_garbage(c),
        23 => query::all_valid_paths(c),
        26 => query::path_info(c),
        29 => query::path_from_hash_part(c),
        30 => realise::substitutable_path_infos(c),
        31 => query::valid_paths(c),
        32 => realise::substitutable_paths(c),
        33 => query::valid_derivers(c),
        34 => maintenance::optimise_store(c),
        35 => maintenance::verify_store(c),
        36 => build::build_derivation(c),
        37 => maintenance::add_signatures(c),
        38 => maintenance::nar_from_path(c),
        39 => add::add_to_store_nar(c),
        40 => realise::query_missing(c),
        41 => query::derivation_output_map(c),
        42 => realisation::register_drv_output(c),
        43 => realisation::query_realisation(c),
        44 => add::add_multiple_to_store(c),
        45 => log::add_build_log(c),
        46 => realise::build_paths(c, true),
        47 => roots::add_perm_root(c),
        _ => Err(Fail::Fatal(format!("invalid operation {op}"))),
    }
}

/// Whether operation `op` only reads the database or the connection's state, so that replies
/// to pipelined requests before it may wait to leave together with its own. Before any other
/// operation (an addition, a substitution, a scan of the GC roots, …) they are sent first.
pub(crate) fn is_quick(op: u64) -> bool {
    matches!(op, 1 | 6 | 11 | 13 | 19 | 26 | 29 | 33 | 41 | 43)
}

/// The wire form of a store's path info. Fails if the database holds an unparsable content
/// address.
pub(crate) fn to_wire(info: ValidPathInfo) -> Result<PathInfo, Fail> {
    let ca = info.ca.as_deref().map(ContentAddress::parse).transpose().map_err(op_err)?;
    Ok(PathInfo {
        path: info.path,
        deriver: info.deriver,
        nar_hash: info.nar_hash,
        references: info.references,
        registration_time: info.registration_time.max(0) as u64,
        nar_size: info.nar_size,
        ultimate: info.ultimate,
        sigs: info.sigs,
        ca,
    })
}

/// The store form of a path info received from a client.
pub(crate) fn from_wire(info: PathInfo) -> ValidPathInfo {
    ValidPathInfo::from_wire(info)
}
