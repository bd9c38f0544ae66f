//! The connection greeting (`processConnection` in Nix 2.8 `daemon.cc`;
//! `BasicServerConnection::handshake`/`postHandshake` in current Nix): magic numbers, version
//! negotiation by min(client, daemon) as a whole, the obsolete CPU-affinity and reserveSpace
//! fields, the daemon's version string (≥ 1.33) and trusted flag (≥ 1.35).

use std::io::{Read, Write};

use sluice_nix::wire::{
    read_bool, read_u64, write_bytes, write_trusted_flag, write_u64, ProtocolVersion, StderrWriter, WireError, WORKER_MAGIC_1,
    WORKER_MAGIC_2,
};

use crate::{MIN_CLIENT_VERSION, NIX_VERSION, PROTOCOL_VERSION};

/// A completed greeting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Greeting {
    /// The negotiated version: min(client, daemon).
    pub version: ProtocolVersion,
    /// The CPU an old client asked the worker to run on (affinity flag 1).
    pub cpu: Option<u64>,
}

/// Why a greeting failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    /// Not a Nix client: nothing is sent back.
    #[error("protocol mismatch: the client sent {0:#x} instead of the worker magic {WORKER_MAGIC_1:#x}")]
    BadMagic(u64),
    /// The client was told why (in-band `ERROR`) and the connection is to be closed.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("writing the greeting: {0}")]
    Io(#[from] std::io::Error),
}

/// Runs the greeting up to (not including) the startup `LAST`, which the caller sends once it
/// has decided whether the peer may use the daemon. `trusted` is reported to clients ≥ 1.35.
pub(crate) fn greet(r: &mut impl Read, w: &mut impl Write, trusted: bool) -> Result<Greeting, HandshakeError> {
    let magic = read_u64(r, "client magic")?;
    if magic != WORKER_MAGIC_1 {
        return Err(HandshakeError::BadMagic(magic));
    }
    write_u64(w, WORKER_MAGIC_2)?;
    write_u64(w, PROTOCOL_VERSION.to_wire())?;
    w.flush()?;
    let client = ProtocolVersion::from_wire(read_u64(r, "client version")?);
    // A client of another major version cannot be spoken to; its fields are read as a 1.x
    // client of the same minor would send them so that the refusal arrives in-band.
    let version = client.min(PROTOCOL_VERSION).min(ProtocolVersion::new(1, client.minor));
    let mut cpu = None;
    if version.at_least(14) && read_bool(r, "CPU affinity flag")? {
        cpu = Some(read_u64(r, "CPU affinity")?);
    }
    if version.at_least(11) {
        read_u64(r, "reserveSpace")?;
    }
    if version.at_least(33) {
        write_bytes(w, NIX_VERSION.as_bytes())?;
    }
    if version.at_least(35) {
        write_trusted_flag(w, Some(trusted))?;
    }
    let refusal = if client.major != 1 {
        Some(format!(
            "unsupported protocol version {client} (this daemon speaks 1.{} to 1.{})",
            MIN_CLIENT_VERSION.minor, PROTOCOL_VERSION.minor
        ))
    } else if client < MIN_CLIENT_VERSION {
        Some(format!("the Nix client version is too old: protocol {client}, the minimum is {MIN_CLIENT_VERSION}"))
    } else {
        None
    };
    if let Some(msg) = refusal {
        StderrWriter { version }.error(w, &msg)?;
        w.flush()?;
        return Err(HandshakeError::Refused(msg));
    }
    Ok(Greeting { version, cpu })
}
