//! The worker-protocol operations ([`Op`], Nix's `WorkerProto::Op` in `worker-protocol.hh`),
//! grouped by kind: queries, additions, realisation (substitution), BuildDerivation, builds
//! delegated to a Nix daemon, build logs, realisations of content-addressed derivations, GC
//! roots, settings, maintenance. Each handler takes its request, read whole by [`dispatch`]
//! (`sluice_nix::wire::ops`); the data that follows some requests (a NAR, framed data) is
//! streamed by the handler.

mod activities;
mod add;
mod build;
mod builtin;
mod delegate;
mod log;
mod maintenance;
mod options;
mod payload;
mod query;
mod realisation;
mod realise;
mod roots;

use sluice_nix::wire::ops::{Op, Request};

use crate::conn::{Conn, Fail, OpResult};

/// Whether operation `op` is quick: it only reads the database or the connection's state, so
/// that replies to pipelined requests before it may wait to leave together with its own.
fn quick(op: Op) -> bool {
    use Op::*;
    matches!(
        op,
        IsValidPath
            | QueryReferrers
            | AddTempRoot
            | AddTempRoots
            | SyncWithGC
            | SetOptions
            | QueryPathInfo
            | QueryPathInfos
            | QueryPathFromHashPart
            | QueryValidDerivers
            | QueryDerivationOutputMap
            | QueryRealisation
    )
}

/// Whether a client stays on its worker's CPU through operation number `op` (a watched
/// placement, [`crate::affinity`]): the quick operations, those that add a file or text, and
/// the queries QueryValidPaths and QueryMissing, during which Nix clients do nothing in
/// parallel (Nix 2.26's `nix path-info` asks QueryMissing before its QueryPathInfos; what it
/// would build or substitute comes with a later operation, which ends the placement); after
/// the others (NAR transfers, builds, substitutions, maintenance), clients may compress, copy
/// or download with several threads.
pub(crate) fn keeps_client_placed(op: u64) -> bool {
    Op::from_wire(op)
        .is_some_and(|op| quick(op) || matches!(op, Op::AddToStore | Op::AddTextToStore | Op::QueryValidPaths | Op::QueryMissing))
}

/// Runs operation number `op` on `c`: its request is read, then handled. Before an operation
/// that is not quick (an addition, a substitution, a scan of the GC roots, …) replies still
/// waiting are sent, and but for AddToStore and AddTextToStore (which root their path, as the
/// quick AddTempRoot does) the shared GC lock kept for the connection's temporary roots is
/// given up: the operation may run a collector or wait long. An unknown number is fatal to
/// the connection (its arguments cannot be skipped).
pub(crate) fn dispatch(c: &mut Conn, op: u64) -> OpResult {
    let Some(op) = Op::from_wire(op) else { return Err(Fail::Fatal(format!("invalid operation {op}"))) };
    if !quick(op) {
        std::io::Write::flush(&mut c.w)?;
        if !matches!(op, Op::AddToStore | Op::AddTextToStore) {
            c.kept.release();
        }
    }
    match op {
        Op::IsValidPath => run(c, query::is_valid_path),
        Op::QueryReferrers => run(c, query::referrers),
        Op::AddToStore => run(c, add::add_to_store),
        Op::AddTextToStore => run(c, add::add_text_to_store),
        Op::BuildPaths => run(c, realise::build_paths),
        Op::EnsurePath => run(c, realise::ensure_path),
        Op::AddTempRoot => run(c, roots::add_temp_root),
        Op::AddIndirectRoot => run(c, roots::add_indirect_root),
        Op::SyncWithGC => run(c, roots::sync_with_gc),
        Op::FindRoots => run(c, roots::find_roots),
        Op::SetOptions => run(c, options::set_options),
        Op::CollectGarbage => run(c, maintenance::collect_garbage),
        Op::QueryAllValidPaths => run(c, query::all_valid_paths),
        Op::QueryPathInfo => run(c, query::path_info),
        Op::QueryPathFromHashPart => run(c, query::path_from_hash_part),
        Op::QuerySubstitutablePathInfos => run(c, realise::substitutable_path_infos),
        Op::QueryValidPaths => run(c, query::valid_paths),
        Op::QuerySubstitutablePaths => run(c, realise::substitutable_paths),
        Op::QueryValidDerivers => run(c, query::valid_derivers),
        Op::OptimiseStore => run(c, maintenance::optimise_store),
        Op::VerifyStore => run(c, maintenance::verify_store),
        Op::BuildDerivation => run(c, build::build_derivation),
        Op::AddSignatures => run(c, maintenance::add_signatures),
        Op::NarFromPath => run(c, maintenance::nar_from_path),
        Op::AddToStoreNar => run(c, add::add_to_store_nar),
        Op::QueryMissing => run(c, realise::query_missing),
        Op::QueryDerivationOutputMap => run(c, query::derivation_output_map),
        Op::RegisterDrvOutput => run(c, realisation::register_drv_output),
        Op::QueryRealisation => run(c, realisation::query_realisation),
        Op::AddMultipleToStore => run(c, add::add_multiple_to_store),
        Op::AddBuildLog => run(c, log::add_build_log),
        Op::BuildPathsWithResults => run(c, realise::build_paths_with_results),
        Op::AddPermRoot => {
            // Refused before its request is read, as Nix 2.26 refuses it.
            roots::may_add_perm_root(c)?;
            run(c, roots::add_perm_root)
        }
        Op::AddTempRoots => run(c, roots::add_temp_roots),
        Op::QueryPathInfos => run(c, query::path_infos),
        Op::QueryClosureInfos => run(c, query::closure_infos),
    }
}

/// Reads the request of `handler` whole, then runs it; the request memory its reading took
/// is given back when it is done.
fn run<R: Request>(c: &mut Conn, handler: fn(&mut Conn, R) -> OpResult) -> OpResult {
    let (request, _bytes) = c.read_request::<R>()?;
    handler(c, request)
}
