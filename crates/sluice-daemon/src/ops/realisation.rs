//! Realisations of content-addressed derivations (`ca-derivations`; Nix `daemon.cc`,
//! `wopQueryRealisation`, `wopRegisterDrvOutput`). sluice keeps none: queries find nothing and
//! registrations are refused, each after its request is read whole so that the connection
//! goes on.

use sluice_nix::store_path::StorePath;
use sluice_nix::wire::{read_string, write_u64, DrvOutput, MAX_PATH_LEN};

use crate::conn::{Conn, Fail, OpResult};

/// Longest derivation output id accepted (`sha512:` and 128 hex digits, `!`, an output name).
const MAX_ID_LEN: u64 = 4096;
/// Longest realisation JSON accepted (its dependent realisations make it grow).
const MAX_REALISATION_LEN: u64 = 16 << 20;

/// Reads a derivation output id string; a malformed id is an operation error (as Nix, which
/// parses it after the request is read).
fn read_drv_output(c: &mut Conn) -> Result<Result<DrvOutput, Fail>, Fail> {
    let text = read_string(&mut c.r, MAX_ID_LEN, "derivation output id")?;
    Ok(DrvOutput::parse(&text).map_err(|e| Fail::Op(e.to_string())))
}

/// QueryRealisation: derivation output id (`sha256:<hash>!<output>`) → its realisations: from
/// 1.31 a set of realisation JSON strings, before a set of output paths. Always empty here.
pub(super) fn query_realisation(c: &mut Conn) -> OpResult {
    read_drv_output(c)??;
    c.reply(|w, _| write_u64(w, 0))
}

/// RegisterDrvOutput: from 1.31 a realisation as a JSON string (`id`, `outPath`,
/// `signatures`, `dependentRealisations`); before, a derivation output id and the output's
/// base name. Nothing is replied on success in Nix; here it always fails, after reading it,
/// since sluice does not support content-addressed derivations.
pub(super) fn register_drv_output(c: &mut Conn) -> OpResult {
    let id = if c.version.at_least(31) {
        let json = read_string(&mut c.r, MAX_REALISATION_LEN, "realisation")?;
        let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| Fail::Op(format!("invalid realisation JSON: {e}")))?;
        let id = value.get("id").and_then(serde_json::Value::as_str).ok_or_else(|| Fail::Op("invalid realisation JSON: no string field \"id\"".into()))?;
        DrvOutput::parse(id).map_err(|e| Fail::Op(e.to_string()))?
    } else {
        let id = read_drv_output(c)?;
        let out = read_string(&mut c.r, MAX_PATH_LEN, "output path")?;
        let id = id?;
        StorePath::from_base_name(&out).map_err(|e| Fail::Op(format!("invalid output path of {id}: {e}")))?;
        id
    };
    Err(Fail::Op(format!("cannot register the realisation of {id}: the sluice daemon does not support content-addressed derivations")))
}
