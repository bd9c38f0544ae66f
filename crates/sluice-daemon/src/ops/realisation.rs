//! Realisations of content-addressed derivations (`ca-derivations`; Nix `daemon.cc`,
//! `wopQueryRealisation`, `wopRegisterDrvOutput`). When sluice realises floating
//! content-addressed outputs ([`delegate::floating_ca`]) they are the Nix daemon's, which keeps
//! them in the `Realisations` table of the shared database (Nix `local-store.cc`); otherwise
//! sluice keeps none: queries find nothing and registrations are refused, each after its
//! request is read whole so that the connection goes on.

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::{QueryRealisation, RegisterDrvOutput};
use sluice_nix::wire::{write_bytes, write_u64, DrvOutput};

use super::delegate;
use crate::conn::{Conn, Fail, OpResult};

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
