//! Realisation-record requests of content-addressed derivations (Nix `daemon.cc`:
//! `wopQueryRealisation`, `wopRegisterDrvOutput`). Ids and JSON are kept as sent: the handler
//! parses them, so that a malformed one is an operation error, as in Nix.

use std::io::{self, Read, Write};

use super::super::{read_string, write_bytes, MAX_PATH_LEN};
use super::{Op, Request};
use crate::store_path::StoreDir;
use crate::wire::{ProtocolVersion, WireError};

/// Longest derivation output id accepted (`sha256:<hash>!<output>`), in bytes.
pub const MAX_DRV_OUTPUT_ID: u64 = 4096;
/// Longest realisation JSON accepted, in bytes.
pub const MAX_REALISATION: u64 = 16 << 20;

/// QueryRealisation: a derivation output id → its realisations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryRealisation {
    pub id: String,
}

impl Request for QueryRealisation {
    const OP: Op = Op::QueryRealisation;

    fn read(r: &mut dyn Read, _: &StoreDir, _: ProtocolVersion) -> Result<Self, WireError> {
        Ok(QueryRealisation { id: read_string(r, MAX_DRV_OUTPUT_ID, "derivation output id")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, _: ProtocolVersion) -> io::Result<()> {
        write_bytes(w, self.id.as_bytes())
    }
}

/// RegisterDrvOutput: from 1.31 a realisation's JSON; before, a derivation output id and
/// the output's base name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterDrvOutput {
    /// Protocol ≥ 1.31.
    Json(String),
    /// Protocol < 1.31.
    Legacy { id: String, out_path: String },
}

impl Request for RegisterDrvOutput {
    const OP: Op = Op::RegisterDrvOutput;

    fn read(r: &mut dyn Read, _: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        if version.at_least(31) {
            return Ok(RegisterDrvOutput::Json(read_string(r, MAX_REALISATION, "realisation")?));
        }
        let id = read_string(r, MAX_DRV_OUTPUT_ID, "derivation output id")?;
        Ok(RegisterDrvOutput::Legacy { id, out_path: read_string(r, MAX_PATH_LEN, "output path")? })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        match self {
            RegisterDrvOutput::Json(json) if version.at_least(31) => write_bytes(w, json.as_bytes()),
            RegisterDrvOutput::Legacy { id, out_path } if !version.at_least(31) => {
                write_bytes(w, id.as_bytes())?;
                write_bytes(w, out_path.as_bytes())
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("RegisterDrvOutput: this form is not the one of protocol {version}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, VERSIONS};
    use super::*;

    #[test]
    fn round_trips() {
        let id = "sha256:15e3c560894cbb27085cf65b5a2ecb18488c999497f4531b6907a7581ce6d527!baz";
        for minor in VERSIONS {
            round_trip(&QueryRealisation { id: id.into() }, minor);
            let register = if minor >= 31 {
                RegisterDrvOutput::Json(format!(
                    r#"{{"id":"{id}","outPath":"g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-baz","signatures":[],"dependentRealisations":{{}}}}"#
                ))
            } else {
                RegisterDrvOutput::Legacy { id: id.into(), out_path: "g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-baz".into() }
            };
            round_trip(&register, minor);
        }
    }
}
