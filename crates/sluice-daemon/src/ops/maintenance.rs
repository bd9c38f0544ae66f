//! Store maintenance: CollectGarbage, OptimiseStore, VerifyStore, NarFromPath and
//! AddSignatures.

use sluice_local_store::{GcAction, GcOptions, OptimiseEvent, Repairer, VerifyMessage};
use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::{AddSignatures, CollectGarbage, NarFromPath, OptimiseStore, VerifyStore};
use sluice_nix::wire::ActivityField;
use sluice_nix::wire::{write_bool, write_bytes, write_u64};

use crate::conn::{op_err, Conn, Fail, OpResult};

/// VerifyStore: checkContents, repair → whether errors remain (Nix `daemon.cc`,
/// `wopVerifyStore`; `LocalStore::verifyStore`, see [`sluice_local_store::LocalStore::verify_store`]).
/// Only trusted clients may repair, with Nix's message. A damaged path is repaired by the
/// connection's substituters, through the store's verification boundary (its NAR must have
/// the registered hash).
pub(super) fn verify_store(c: &mut Conn, VerifyStore { check_contents, repair }: VerifyStore) -> OpResult {
    if repair && !c.peer.trusted {
        return Err(Fail::Op("you are not privileged to repair paths".into()));
    }
    let settings = c.options.settings()?;
    let (daemon, use_substitutes, roots) = (c.daemon, c.options.use_substitutes(), c.temp_roots.clone());
    let store = std::sync::Arc::clone(c.store());
    let mut repairer = |path: &StorePath| crate::substitution::repair(daemon, &store, &settings, use_substitutes, &roots, path);
    let mut write_err = None;
    let errors = store.verify_store(check_contents, repair.then_some(&mut repairer as Repairer<'_>), &mut |message| {
        let line = match message {
            VerifyMessage::Info(m) | VerifyMessage::Error(m) => m.to_owned(),
            VerifyMessage::LoggedError(m) => format!("error: {m}"),
            VerifyMessage::Warning(m) => format!("warning: {m}"),
        };
        if let Err(e) = c.log(&line) {
            write_err.get_or_insert(e);
        }
    });
    if let Some(e) = write_err {
        return Err(Fail::Output(e));
    }
    let errors = errors.map_err(op_err)?;
    c.reply(|w, _| write_bool(w, errors))
}

/// NarFromPath: path → `LAST`, then the path's NAR, unframed.
pub(super) fn nar_from_path(c: &mut Conn, NarFromPath { path }: NarFromPath) -> OpResult {
    if !c.store().is_valid_path(&path).map_err(op_err)? {
        return Err(Fail::Op(format!("path '{}' is not valid", c.dir().display_path(&path))));
    }
    c.stderr().last(&mut c.w)?;
    // Once `LAST` is out, a failure cannot be reported in-band: the connection must end.
    let store = std::sync::Arc::clone(c.store());
    store.dump_path(&path, &mut c.w).map_err(|e| Fail::Output(std::io::Error::other(e)))?;
    std::io::Write::flush(&mut c.w)?;
    Ok(())
}

/// AddSignatures: path, signatures → 1. Only for trusted clients, as in Nix 2.8 (Nix ≥ 2.17
/// lets any allowed user add signatures; see `docs/daemon-trust.md`).
pub(super) fn add_signatures(c: &mut Conn, AddSignatures { path, sigs }: AddSignatures) -> OpResult {
    if !c.peer.trusted {
        return Err(Fail::Op("you are not privileged to add signatures".into()));
    }
    c.store().add_signatures(&path, &sigs.into_iter().collect()).map_err(op_err)?;
    c.reply(|w, _| write_u64(w, 1))
}

/// CollectGarbage: action, paths, ignoreLiveness, maxFreed and three obsolete fields →
/// the paths (live, dead or deleted), the bytes freed and an obsolete 0 (Nix `daemon.cc`,
/// `wopCollectGarbage`). ignoreLiveness is refused to every client, as Nix does; untrusted
/// clients may collect. `keep-outputs` and `keep-derivations` are the connection's settings.
/// The collector's progress lines reach the client as log lines.
pub(super) fn collect_garbage(
    c: &mut Conn,
    CollectGarbage { action, paths_to_delete, ignore_liveness, max_freed }: CollectGarbage,
) -> OpResult {
    let action = GcAction::from_wire(action).ok_or_else(|| Fail::Op(format!("invalid GC action {action}")))?;
    if ignore_liveness {
        return Err(Fail::Op("you are not allowed to ignore liveness".into()));
    }
    let settings = c.options.settings()?;
    let options =
        GcOptions { action, paths_to_delete, max_freed, keep_outputs: settings.keep_outputs, keep_derivations: settings.keep_derivations };
    let store = std::sync::Arc::clone(c.store());
    let results = store
        .collect_garbage(&options, &mut |line| {
            // A client gone is noticed when the result is written.
            let _ = c.log(line);
        })
        .map_err(op_err)?;
    c.reply(|w, _| {
        write_u64(w, results.paths.len() as u64)?;
        for p in &results.paths {
            write_bytes(w, p.as_bytes())?;
        }
        write_u64(w, results.bytes_freed)?;
        write_u64(w, 0)
    })
}

/// Nix's `ActivityType::actOptimiseStore` and `ResultType::resProgress`.
const ACT_OPTIMISE_STORE: u64 = 106;
const RES_PROGRESS: u64 = 105;

/// OptimiseStore: → 1 (Nix `daemon.cc`, `wopOptimiseStore`, and `LocalStore::optimiseStore`
/// in `optimise-store.cc`): every valid path's files deduplicated by hard links under
/// `.links`, with an `actOptimiseStore` activity reporting the paths done, Nix's warnings,
/// and its closing line `<MiB> MiB freed by hard-linking <n> files` (Nix 2.8's `showBytes`).
/// Any client may optimise, as with Nix.
pub(super) fn optimise_store(c: &mut Conn, _: OptimiseStore) -> OpResult {
    let stderr = c.stderr();
    let activity = c.daemon.activity_id();
    stderr.start_activity(&mut c.w, activity, 0, ACT_OPTIMISE_STORE, "", &[], 0)?;
    let store = std::sync::Arc::clone(c.store());
    let roots = c.temp_roots.clone();
    let mut write_err = None;
    let w = &mut c.w;
    let stats = store.optimise_store(&roots, &mut |event| {
        let sent = match event {
            OptimiseEvent::Progress { done, expected } => {
                let fields = [done, expected, 0, 0].map(ActivityField::Int);
                stderr.result(w, activity, RES_PROGRESS, &fields)
            }
            OptimiseEvent::Warning(msg) => stderr.next(w, &format!("warning: {msg}\n")),
            OptimiseEvent::Info(msg) => stderr.next(w, &format!("{msg}\n")),
        };
        if let Err(e) = sent {
            write_err.get_or_insert(e);
        }
    });
    if let Some(e) = write_err {
        return Err(Fail::Output(e));
    }
    stderr.stop_activity(&mut c.w, activity)?;
    let stats = stats.map_err(op_err)?;
    c.log(&format!("{:.2} MiB freed by hard-linking {} files", stats.bytes_freed as f64 / (1024.0 * 1024.0), stats.files_linked))?;
    c.reply(|w, _| write_u64(w, 1))
}
