//! Realisations of content-addressed derivations (`ca-derivations`; Nix `daemon.cc`,
//! `wopQueryRealisation`, `wopRegisterDrvOutput`). sluice keeps none: queries find nothing and
//! registrations are refused, each after its request is read whole so that the connection
//! goes on.

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::ops::{QueryRealisation, RegisterDrvOutput};
use sluice_nix::wire::{write_u64, DrvOutput};

use crate::conn::{Conn, Fail, OpResult};

/// A derivation output id as sent; a malformed id is an operation error (as Nix, which parses
/// it after the request is read).
fn drv_output(id: &str) -> Result<DrvOutput, Fail> {
    DrvOutput::parse(id).map_err(|e| Fail::Op(e.to_string()))
}

/// QueryRealisation: derivation output id (`sha256:<hash>!<output>`) → its realisations: from
/// 1.31 a set of realisation JSON strings, before a set of output paths. Always empty here.
pub(super) fn query_realisation(c: &mut Conn, QueryRealisation { id }: QueryRealisation) -> OpResult {
    drv_output(&id)?;
    c.reply(|w, _| write_u64(w, 0))
}

/// RegisterDrvOutput: from 1.31 a realisation as a JSON string (`id`, `outPath`,
/// `signatures`, `dependentRealisations`); before, a derivation output id and the output's
/// base name. Nothing is replied on success in Nix; here it always fails, after reading it,
/// since sluice does not support content-addressed derivations.
pub(super) fn register_drv_output(_: &mut Conn, request: RegisterDrvOutput) -> OpResult {
    let id = match request {
        RegisterDrvOutput::Json(json) => {
            let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| Fail::Op(format!("invalid realisation JSON: {e}")))?;
            let id = value
                .get("id")
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| Fail::Op("invalid realisation JSON: no string field \"id\"".into()))?;
            drv_output(id)?
        }
        RegisterDrvOutput::Legacy { id, out_path } => {
            let id = drv_output(&id)?;
            StorePath::from_base_name(&out_path).map_err(|e| Fail::Op(format!("invalid output path of {id}: {e}")))?;
            id
        }
    };
    Err(Fail::Op(format!("cannot register the realisation of {id}: the sluice daemon does not support content-addressed derivations")))
}
