//! Builds through a real Nix daemon (`sluice daemon --build-via unix://PATH`). sluice does not
//! build or sandbox: derivation outputs that no substituter has are built by the `nix-daemon`
//! named, which serves the same store. Before forwarding, sluice substitutes every input a
//! cache has (so the Nix daemon only builds; it is asked not to substitute). The forwarded
//! operation is Nix's own (BuildPaths, BuildPathsWithResults, BuildDerivation, as
//! `remote-store.cc` sends them); the Nix daemon's log lines, activities and results are
//! relayed to the client as they come, and its result reaches the client in the client's
//! protocol version. The client's trust is checked by sluice before forwarding (sluice is a
//! trusted client of the Nix daemon): see `docs/daemon-trust.md`.

use std::collections::{BTreeMap, BTreeSet};

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::{ClientSettings, SetOptions};
use sluice_nix::wire::StderrMessage;
use sluice_store::remote::{DaemonConnection, Relay, RemoteError};

use super::query::{derivation_outputs, fixed_outputs_of, load_derivation};
use super::realise::realise_by_substitution;
use crate::conn::{Conn, Fail};

/// Whether builds can be delegated (`--build-via` was given).
pub(super) fn enabled(c: &Conn) -> bool {
    c.daemon.build_via.is_some()
}

/// Whether the outputs of floating content-addressed derivations are realised: builds are
/// delegated and the daemon's `experimental-features` has `ca-derivations`. Their paths are
/// known only once built, from the realisations the Nix daemon registers in the shared
/// database, so what needs them (building, output maps, realisations) is the Nix daemon's.
pub(super) fn floating_ca(c: &Conn) -> Result<bool, Fail> {
    Ok(enabled(c) && c.options.settings()?.experimental_features.iter().any(|f| f == "ca-derivations"))
}

/// Runs `op` on a new connection to the Nix daemon of `--build-via` (with the client's numeric
/// settings, substitution off, and the overrides sluice accepted from it except the
/// substitution settings: `ClientOptions::forwarded`), relaying its messages to the client. The Nix daemon's error
/// becomes the operation's error, in its own words; the client going away ends the
/// connection, which makes the Nix daemon stop the build.
pub(super) fn forward<T>(c: &mut Conn, op: impl FnOnce(&mut DaemonConnection, Relay) -> Result<T, RemoteError>) -> Result<T, Fail> {
    let Some(socket) = c.daemon.build_via.as_deref() else { return Err(Fail::Op("no --build-via daemon to build with".into())) };
    let why = |e: RemoteError| match e {
        RemoteError::Relay { source, .. } => Fail::Output(source),
        RemoteError::Daemon { message, .. } => Fail::Op(message),
        e => Fail::Op(format!("building through the Nix daemon: {e}")),
    };
    let mut nix = DaemonConnection::connect(socket, false).map_err(why)?;
    // useSubstitutes: sluice has substituted what any cache has.
    let settings = ClientSettings { use_substitutes: false, ..c.options.numeric };
    nix.set_options(&SetOptions { settings, overrides: c.options.forwarded.clone() }).map_err(why)?;
    let stderr = c.stderr();
    let w = &mut c.w;
    let mut relay = |m: &StderrMessage| {
        stderr.forward(w, m)?;
        std::io::Write::flush(w)
    };
    op(&mut nix, &mut relay).map_err(why)
}

/// Substitutes what building `drvs` needs and a cache has: their input sources and the wanted
/// outputs of their input derivations; for an input output that no cache has, the same for its
/// derivation, and so on down, as Nix's `queryMissing` walks (`misc.cc`). What stays invalid is
/// for the Nix daemon to build.
pub(super) fn substitute_build_inputs(c: &mut Conn, drvs: Vec<StorePath>) -> Result<(), Fail> {
    let mut seen: BTreeSet<StorePath> = drvs.iter().cloned().collect();
    let mut todo = drvs;
    while !todo.is_empty() {
        let mut inputs = BTreeSet::new();
        let mut producers: BTreeMap<StorePath, StorePath> = BTreeMap::new();
        let mut fixed = sluice_store::closure::ContentAddresses::new();
        for drv in &todo {
            let Some(d) = load_derivation(c, drv)? else { continue };
            inputs.extend(d.input_srcs.iter().cloned());
            for (input, wanted) in &d.input_drvs {
                fixed.extend(fixed_outputs_of(c, input)?);
                for (name, path) in derivation_outputs(c, input)?.unwrap_or_default() {
                    if let Some(p) = path.filter(|_| wanted.outputs.contains(&name)) {
                        producers.insert(p.clone(), input.clone());
                        inputs.insert(p);
                    }
                }
            }
        }
        let inputs: Vec<StorePath> = inputs.into_iter().collect();
        let (_, valid) = realise_by_substitution(c, &inputs, fixed)?;
        todo = producers.into_iter().filter(|(p, _)| !valid.contains(p)).map(|(_, d)| d).filter(|d| seen.insert(d.clone())).collect();
    }
    Ok(())
}
