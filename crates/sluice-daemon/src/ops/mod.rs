//! The worker-protocol operations, by number (`WorkerProto::Op` in Nix's
//! `worker-protocol.hh`), grouped by kind: queries, additions, realisation (substitution),
//! BuildDerivation, builds delegated to a Nix daemon, build logs, realisations of content-addressed derivations, GC roots,
//! maintenance.

mod add;
mod build;
mod builtin;
mod delegate;
mod log;
mod maintenance;
mod payload;
mod query;
mod realisation;
mod realise;

use crate::conn::{Conn, Fail, OpResult};
use crate::{options, roots};

/// QueryPathInfo's number (its handler also takes further QueryPathInfo requests already read).
const QUERY_PATH_INFO: u64 = 26;

/// An operation's handler.
type Handler = fn(&mut Conn) -> OpResult;

/// The handler of operation `op`, and whether the operation is quick: it only reads the
/// database or the connection's state, so that replies to pipelined requests before it may wait
/// to leave together with its own. `None` for an unknown number.
fn handler(op: u64) -> Option<(Handler, bool)> {
    Some(match op {
        1 => (query::is_valid_path, true),
        6 => (query::referrers, true),
        7 => (add::add_to_store, false),
        8 => (add::add_text_to_store, false),
        9 => (|c: &mut Conn| realise::build_paths(c, false), false),
        10 => (realise::ensure_path, false),
        11 => (roots::add_temp_root, true),
        12 => (roots::add_indirect_root, false),
        13 => (roots::sync_with_gc, true),
        14 => (roots::find_roots, false),
        19 => (options::set_options, true),
        20 => (maintenance::collect_garbage, false),
        23 => (query::all_valid_paths, false),
        QUERY_PATH_INFO => (query::path_info, true),
        29 => (query::path_from_hash_part, true),
        30 => (realise::substitutable_path_infos, false),
        31 => (query::valid_paths, false),
        32 => (realise::substitutable_paths, false),
        33 => (query::valid_derivers, true),
        34 => (maintenance::optimise_store, false),
        35 => (maintenance::verify_store, false),
        36 => (build::build_derivation, false),
        37 => (maintenance::add_signatures, false),
        38 => (maintenance::nar_from_path, false),
        39 => (add::add_to_store_nar, false),
        40 => (realise::query_missing, false),
        41 => (query::derivation_output_map, true),
        42 => (realisation::register_drv_output, false),
        43 => (realisation::query_realisation, true),
        44 => (add::add_multiple_to_store, false),
        45 => (log::add_build_log, false),
        46 => (|c: &mut Conn| realise::build_paths(c, true), false),
        47 => (roots::add_perm_root, false),
        _ => return None,
    })
}

/// Runs operation `op` on `c`. Before an operation that is not quick (an addition, a
/// substitution, a scan of the GC roots, …) replies still waiting are sent. An unknown number
/// is fatal to the connection (its arguments cannot be skipped).
pub(crate) fn dispatch(c: &mut Conn, op: u64) -> OpResult {
    let Some((run, quick)) = handler(op) else { return Err(Fail::Fatal(format!("invalid operation {op}"))) };
    if !quick {
        std::io::Write::flush(&mut c.w)?;
    }
    run(c)
}
