//! Nix's serve protocol: what `nix-store --serve [--write]` speaks on standard input and
//! output and the `ssh://` store (`LegacySSHStore`) sends it. Sources: Nix 2.26
//! `src/libstore/serve-protocol.{hh,cc}`, `serve-protocol-connection.cc` (handshake, the
//! client's requests), `legacy-ssh-store.cc` (the client), `src/nix-store/nix-store.cc`
//! `opServe` (the server) and `export-import.cc` (the ImportPaths/ExportPaths stream); Nix
//! 2.8's `serve-protocol.hh`, `legacy-ssh-store.cc` and `nix-store.cc`. Nix 2.8 and 2.26
//! both speak version 2.7.
//!
//! Unlike the worker protocol there is no stderr channel: a request is a command number and
//! its header ([`ServeRequest`], one type per command shared by the server and the client),
//! the answer follows at once, and a server that fails ends the connection (its message goes
//! to its standard error, which ssh relays).

mod requests;
mod types;

use std::io::{self, Read, Write};

use super::{read_u64, write_u64, ProtocolVersion, WireError};
use crate::store_path::StoreDir;

pub use requests::{
    AddToStoreNar, BuildDerivation, BuildPaths, DumpStorePath, ExportPaths, ImportPaths, QueryClosure, QueryPathInfos, QueryValidPaths,
};
pub use types::{
    read_export_trailer, read_path_info_entries, read_serve_build_result, write_export_trailer, write_path_info_entry,
    write_serve_build_result, BuildOptions, ExportTrailer, EXPORT_MAGIC,
};

/// The first word a client sends (`SERVE_MAGIC_1`).
pub const SERVE_MAGIC_1: u64 = 0x390c_9deb;
/// The server's answer to [`SERVE_MAGIC_1`] (`SERVE_MAGIC_2`).
pub const SERVE_MAGIC_2: u64 = 0x5452_eecb;
/// The version spoken: 2.7 (`SERVE_PROTOCOL_VERSION`, the same in Nix 2.8 and 2.26).
pub const SERVE_PROTOCOL_VERSION: ProtocolVersion = ProtocolVersion::new(2, 7);

/// Whether the negotiated serve version `v` is at least `2.minor` (`GET_PROTOCOL_MINOR(v) >=
/// minor` in Nix, which looks at the minor only: every version has major 2).
pub fn serve_at_least(v: ProtocolVersion, minor: u8) -> bool {
    v.minor >= minor
}

macro_rules! commands {
    ($($(#[$doc:meta])* $name:ident = $n:literal,)*) => {
        /// A serve-protocol command, with its wire number (`ServeProto::Command`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u64)]
        pub enum ServeCommand {
            $($(#[$doc])* $name = $n,)*
        }

        impl ServeCommand {
            /// The command numbered `n`; `None` for an unknown number.
            pub fn from_wire(n: u64) -> Option<ServeCommand> {
                match n {
                    $($n => Some(ServeCommand::$name),)*
                    _ => None,
                }
            }

            /// Nix's name of the command (`QueryValidPaths`, …).
            pub fn name(self) -> &'static str {
                match self {
                    $(ServeCommand::$name => stringify!($name),)*
                }
            }
        }
    };
}

commands! {
    QueryValidPaths = 1,
    QueryPathInfos = 2,
    DumpStorePath = 3,
    ImportPaths = 4,
    ExportPaths = 5,
    BuildPaths = 6,
    QueryClosure = 7,
    BuildDerivation = 8,
    /// Since 2.5.
    AddToStoreNar = 9,
}

impl std::fmt::Display for ServeCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A request header: what follows the command number [`ServeRequest::CMD`] on the wire.
/// Streamed data (a NAR, an export stream) follows the header and is the caller's.
pub trait ServeRequest: Sized {
    /// The command this is the request of.
    const CMD: ServeCommand;

    /// Reads the header (after the command number) as a client of version `version` sends it.
    fn read(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError>;

    /// Writes the header (without the command number) for version `version`.
    fn write(&self, w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion) -> io::Result<()>;
}

/// Writes the command number of `req`, then its header (nothing is flushed).
pub fn write_serve_request<R: ServeRequest>(w: &mut dyn Write, dir: &StoreDir, version: ProtocolVersion, req: &R) -> io::Result<()> {
    write_u64(w, R::CMD as u64)?;
    req.write(w, dir, version)
}

/// A request whose header is the same at every protocol version (2.0 to
/// [`SERVE_PROTOCOL_VERSION`]), so that it can be written before the far end's greeting has
/// told its version: [`write_unversioned_serve_request`].
pub trait Unversioned: ServeRequest {}

impl Unversioned for QueryValidPaths {}
impl Unversioned for QueryPathInfos {}
impl Unversioned for QueryClosure {}
impl Unversioned for DumpStorePath {}

/// Writes the command number of `req`, then its header, as every version reads it (nothing is
/// flushed): a client may send it right behind its greeting ([`client_hello`]), before the
/// server's answer ([`read_server_hello`]). Nix's `LegacySSHStore` waits for the answer first.
pub fn write_unversioned_serve_request<R: Unversioned>(w: &mut dyn Write, dir: &StoreDir, req: &R) -> io::Result<()> {
    write_serve_request(w, dir, SERVE_PROTOCOL_VERSION, req)
}

/// The server's side of the greeting (`ServeProto::BasicServerConnection::handshake`): reads
/// [`SERVE_MAGIC_1`], answers [`SERVE_MAGIC_2`] and [`SERVE_PROTOCOL_VERSION`] (flushed), then
/// reads the client's version; returns the lower of the two. A wrong magic is
/// [`WireError::Invalid`] naming what was sent.
pub fn server_handshake(r: &mut dyn Read, w: &mut dyn Write) -> Result<ProtocolVersion, WireError> {
    let magic = read_u64(r, "serve protocol magic")?;
    if magic != SERVE_MAGIC_1 {
        return Err(WireError::invalid("serve protocol magic", format!("protocol mismatch: {magic:#x}")));
    }
    let io = |source| WireError::Io { what: "the serve protocol greeting", source };
    write_u64(w, SERVE_MAGIC_2).map_err(io)?;
    write_u64(w, SERVE_PROTOCOL_VERSION.to_wire()).map_err(io)?;
    w.flush().map_err(io)?;
    let client = ProtocolVersion::from_wire(read_u64(r, "client serve protocol version")?);
    Ok(client.min(SERVE_PROTOCOL_VERSION))
}

/// The client's side of the greeting (`ServeProto::BasicClientConnection::handshake`): sends
/// [`SERVE_MAGIC_1`] and [`SERVE_PROTOCOL_VERSION`] (flushed), reads [`SERVE_MAGIC_2`] and the
/// server's version, whose major must be 2; returns the lower of the two.
pub fn client_handshake(r: &mut dyn Read, w: &mut dyn Write) -> Result<ProtocolVersion, WireError> {
    client_hello(w)?;
    read_server_hello(r)
}

/// The client's half of the greeting: [`SERVE_MAGIC_1`] and [`SERVE_PROTOCOL_VERSION`]
/// (flushed). The server answers it ([`read_server_hello`]) before it reads a request, so
/// requests may follow it at once ([`write_unversioned_serve_request`]).
pub fn client_hello(w: &mut dyn Write) -> Result<(), WireError> {
    let io = |source| WireError::Io { what: "the serve protocol greeting", source };
    write_u64(w, SERVE_MAGIC_1).map_err(io)?;
    write_u64(w, SERVE_PROTOCOL_VERSION.to_wire()).map_err(io)?;
    w.flush().map_err(io)
}

/// The server's answer to [`client_hello`]: [`SERVE_MAGIC_2`] and its version, whose major must
/// be 2; returns the lower of its version and ours.
pub fn read_server_hello(r: &mut dyn Read) -> Result<ProtocolVersion, WireError> {
    let magic = read_u64(r, "serve protocol magic")?;
    if magic != SERVE_MAGIC_2 {
        return Err(WireError::invalid("serve protocol magic", format!("'nix-store --serve' protocol mismatch: {magic:#x}")));
    }
    let server = ProtocolVersion::from_wire(read_u64(r, "server serve protocol version")?);
    if server.major != 2 {
        return Err(WireError::invalid(
            "server serve protocol version",
            format!("unsupported 'nix-store --serve' protocol version {server}"),
        ));
    }
    Ok(server.min(SERVE_PROTOCOL_VERSION))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store_path::StorePath;
    use std::collections::BTreeSet;

    pub(crate) fn sp(name: &str) -> StorePath {
        StorePath::from_base_name(&format!("g1w7hy3qg1w7hy3qg1w7hy3qg1w7hy3q-{name}")).unwrap()
    }

    /// Writes `req` with its command number at 2.`minor`, checks the number, reads it back and
    /// checks that every byte was read; returns the bytes.
    pub(crate) fn round_trip<R: ServeRequest + std::fmt::Debug + PartialEq>(req: &R, minor: u8) -> Vec<u8> {
        let dir = StoreDir::default();
        let version = ProtocolVersion::new(2, minor);
        let mut bytes = Vec::new();
        write_serve_request(&mut bytes, &dir, version, req).unwrap();
        let mut r = bytes.as_slice();
        assert_eq!(read_u64(&mut r, "cmd").unwrap(), R::CMD as u64);
        let back = R::read(&mut r, &dir, version).unwrap_or_else(|e| panic!("{:?} at 2.{minor}: {e}", R::CMD));
        assert_eq!(&back, req, "at 2.{minor}");
        assert!(r.is_empty(), "{:?} at 2.{minor}: {} bytes left", R::CMD, r.len());
        bytes
    }

    /// Every [`Unversioned`] request is written alike at every version from 2.0 to ours.
    #[test]
    fn unversioned_requests_are_the_same_at_every_version() {
        fn same_everywhere<R: Unversioned + std::fmt::Debug + PartialEq>(req: R) {
            let mut ours = Vec::new();
            write_unversioned_serve_request(&mut ours, &StoreDir::default(), &req).unwrap();
            for minor in 0..=SERVE_PROTOCOL_VERSION.minor {
                assert_eq!(round_trip(&req, minor), ours, "{:?} at 2.{minor}", R::CMD);
            }
        }
        let paths: BTreeSet<StorePath> = [sp("a"), sp("b")].into();
        same_everywhere(QueryValidPaths { lock: true, substitute: false, paths: paths.clone() });
        same_everywhere(QueryPathInfos { paths: paths.clone() });
        same_everywhere(QueryClosure { include_outputs: true, paths });
        same_everywhere(DumpStorePath { path: sp("c") });
    }

    #[test]
    fn command_numbers_are_nixs() {
        assert_eq!(ServeCommand::QueryValidPaths as u64, 1);
        assert_eq!(ServeCommand::AddToStoreNar as u64, 9);
        for n in 1..=9 {
            assert_eq!(ServeCommand::from_wire(n).map(|c| c as u64), Some(n));
        }
        assert_eq!(ServeCommand::from_wire(10), None);
        assert_eq!(ServeCommand::from_wire(0), None);
    }

    #[test]
    fn handshake_both_sides() {
        // The client's greeting, as Nix 2.26 sends it, and the server's answer.
        let mut from_client = Vec::new();
        write_u64(&mut from_client, SERVE_MAGIC_1).unwrap();
        write_u64(&mut from_client, 0x205).unwrap();
        let mut to_client = Vec::new();
        let v = server_handshake(&mut from_client.as_slice(), &mut to_client).unwrap();
        assert_eq!(v, ProtocolVersion::new(2, 5));
        let words: Vec<u64> = to_client.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(words, [0x5452_eecb, 0x207]);
        let mut sent = Vec::new();
        assert_eq!(client_handshake(&mut to_client.as_slice(), &mut sent).unwrap(), ProtocolVersion::new(2, 7));
        assert_eq!(sent[..8], 0x390c_9debu64.to_le_bytes());
        let mut bad = Vec::new();
        write_u64(&mut bad, 0x1234).unwrap();
        let err = server_handshake(&mut bad.as_slice(), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("protocol mismatch: 0x1234"), "{err}");
        let mut old = Vec::new();
        write_u64(&mut old, SERVE_MAGIC_2).unwrap();
        write_u64(&mut old, 0x105).unwrap();
        let err = client_handshake(&mut old.as_slice(), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("unsupported 'nix-store --serve' protocol version 1.5"), "{err}");
    }
}
