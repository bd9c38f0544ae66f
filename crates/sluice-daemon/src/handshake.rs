//! The connection greeting (`processConnection` in Nix 2.8 `daemon.cc`;
//! `BasicServerConnection::handshake`/`postHandshake` in current Nix): magic numbers, version
//! negotiation by min(client, daemon) as a whole, the feature exchange (≥ 1.38: the client's
//! features, then the daemon's), the obsolete CPU-affinity and reserveSpace fields, the
//! daemon's version string (≥ 1.33) and trusted flag (≥ 1.35).

use std::io::{Read, Write};

use sluice_nix::wire::features::{feature_set, negotiated, read_features, write_features, FeatureSet, FEATURES_VERSION};
use sluice_nix::wire::{
    read_bool, read_u64, write_bytes, write_trusted_flag, write_u64, ProtocolVersion, StderrWriter, WireError, WORKER_MAGIC_1,
    WORKER_MAGIC_2,
};

use crate::{MIN_CLIENT_VERSION, NIX_VERSION, PROTOCOL_VERSION};

/// A completed greeting.
#[derive(Debug, Clone)]
pub(crate) struct Greeting {
    /// The negotiated version: min(client, daemon).
    pub version: ProtocolVersion,
    /// The features both sides offered (≥ 1.38; empty below).
    pub features: FeatureSet,
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
/// has decided whether the peer may use the daemon. `trusted` is reported to clients ≥ 1.35;
/// `offered`: the daemon's features.
pub(crate) fn greet(r: &mut impl Read, w: &mut impl Write, trusted: bool, offered: &[&str]) -> Result<Greeting, HandshakeError> {
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
    // The client sends its features and waits for the daemon's before it goes on.
    let mut features = FeatureSet::new();
    if version >= FEATURES_VERSION {
        features = negotiated(offered, &read_features(r, "client features")?);
        write_features(w, &feature_set(offered))?;
        w.flush()?;
    }
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
    Ok(Greeting { version, features, cpu })
}

#[cfg(test)]
mod tests {
    use sluice_nix::wire::features::{feature_set, read_features};
    use sluice_nix::wire::{read_string, write_strings};

    use super::*;

    /// The client's side of a greeting: magic, `version`, (≥ 1.38) `features`, affinity flag 0
    /// and reserveSpace 0, as Nix's `BasicClientConnection` sends them.
    fn client(version: ProtocolVersion, features: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        write_u64(&mut out, WORKER_MAGIC_1).unwrap();
        write_u64(&mut out, version.to_wire()).unwrap();
        if version >= FEATURES_VERSION {
            write_strings(&mut out, features.iter()).unwrap();
        }
        write_u64(&mut out, 0).unwrap();
        write_u64(&mut out, 0).unwrap();
        out
    }

    /// As Nix's `WorkerProtoTest.handshake_features`: a newer client offering features the
    /// daemon has and features it lacks negotiates 1.38 and the ones both have; the daemon
    /// answers with all its own, between its version and its version string.
    #[test]
    fn a_newer_client_negotiates_1_38_and_the_common_features() {
        let sent = client(ProtocolVersion::new(1, 123), &["aap", "queryPathInfos", "xyzzy"]);
        let mut answer = Vec::new();
        let g = greet(&mut sent.as_slice(), &mut answer, true, crate::FEATURES).unwrap();
        assert_eq!((g.version, g.cpu), (ProtocolVersion::new(1, 38), None));
        assert_eq!(g.features, feature_set(&["queryPathInfos"]));
        let r = &mut answer.as_slice();
        assert_eq!(read_u64(r, "magic").unwrap(), WORKER_MAGIC_2);
        assert_eq!(read_u64(r, "version").unwrap(), 0x126);
        assert_eq!(read_features(r, "features").unwrap(), feature_set(&["addTempRoots", "queryPathInfos", "sluice-query-closure"]));
        assert_eq!(read_string(r, 64, "version string").unwrap(), NIX_VERSION);
        assert_eq!(read_u64(r, "trusted").unwrap(), 1);
        assert!(r.is_empty());
    }

    /// A 1.37 client exchanges no features: the daemon's answer is its version string and
    /// trusted flag right after the version numbers, as before 1.38.
    #[test]
    fn a_1_37_client_exchanges_no_features() {
        let sent = client(ProtocolVersion::new(1, 37), &[]);
        let mut answer = Vec::new();
        let g = greet(&mut sent.as_slice(), &mut answer, false, crate::FEATURES).unwrap();
        assert_eq!(g.version, ProtocolVersion::new(1, 37));
        assert!(g.features.is_empty());
        let mut expected = Vec::new();
        for n in [WORKER_MAGIC_2, 0x126] {
            write_u64(&mut expected, n).unwrap();
        }
        write_bytes(&mut expected, NIX_VERSION.as_bytes()).unwrap();
        write_u64(&mut expected, 2).unwrap();
        assert_eq!(answer, expected);
    }
}
