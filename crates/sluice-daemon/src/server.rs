//! Accepting clients: a Unix socket (one worker thread per connection; the peer's uid from
//! `SO_PEERCRED` decides trust; connections bounded by [`Limits`], the greeting by
//! [`HANDSHAKE_DEADLINE`]) or one client on standard input and output (`--stdio`, as
//! `nix-daemon --stdio` serves `ssh-ng://`; that client is trusted, as in Nix).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::io::{BufReader, Write};

use sluice_nix::wire::{read_u64, StderrWriter};

use crate::affinity::{Pinned, Placement};
use crate::conn::{Conn, Fail, Kept};
use crate::duplex::{duplex, ClientInput};
use crate::handshake::{greet, HandshakeError};
use crate::limits::{Admitted, Limits};
use crate::options::ClientOptions;
use crate::trust::Peer;
use crate::{ClientCpu, Daemon, DaemonError};
use sluice_nix::wire::features::SLUICE_ZSTD;

/// How long a socket client may take, from the moment its connection is accepted, to send its
/// whole greeting (Nix's client sends it at once); one that has not is disconnected, however
/// it trickles its bytes, so that idle or slow connections cannot hold the daemon's places.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// Listens on `socket` (replacing a stale socket file, creating its directory, mode 0666 so
/// that every user can connect; `allowed-users` decides) and serves clients until the
/// process ends ([`serve_listener`]). Each connection runs on its own thread; a failing connection affects no
/// other. A connection beyond the [`Limits`] of its user is accepted and closed at once, with
/// a warning in the log (before the greeting the protocol cannot carry a message).
pub fn serve_socket(daemon: Arc<Daemon>, socket: &Path) -> Result<(), DaemonError> {
    let io = |what| move |source| DaemonError::Io { what, path: socket.to_owned(), source };
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(io("creating the directory of"))?;
    }
    match std::fs::remove_file(socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io("removing the stale socket")(e)),
        _ => {}
    }
    // Bound (which also listens) and given its mode under a temporary name, then renamed: a
    // client that waits for the socket file to appear never finds one that refuses it.
    let mut temp = socket.as_os_str().to_owned();
    temp.push(format!(".tmp-{}", std::process::id()));
    let temp = std::path::PathBuf::from(temp);
    let _ = std::fs::remove_file(&temp);
    let listener = sluice_local_store::unix_socket::bind(&temp).map_err(io("binding"))?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o666)).map_err(io("setting the mode of"))?;
    std::fs::rename(&temp, socket).map_err(io("moving the new socket into place at"))?;
    serve_listener(daemon, listener, &socket.display().to_string());
    Ok(())
}

/// Serves the clients of `listener` (a socket bound by [`serve_socket`], or handed over by
/// systemd's socket activation), named `name` in the log, until the process ends: each
/// connection on its own thread, trusted by its peer's uid, within its user's [`Limits`].
pub fn serve_listener(daemon: Arc<Daemon>, listener: std::os::unix::net::UnixListener, name: &str) {
    let limits = Arc::new(Limits::current());
    tracing::info!("listening on {name}");
    for (n, stream) in listener.incoming().enumerate() {
        let accepted = Instant::now();
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accepting a connection on {name}: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        let (peer, uid, pid) = match rustix::net::sockopt::get_socket_peercred(&stream) {
            Ok(cred) => (daemon.users.peer(cred.uid.as_raw(), cred.gid.as_raw()), cred.uid.as_raw(), cred.pid.as_raw_nonzero().get()),
            Err(e) => {
                tracing::warn!("connection {n}: cannot read the peer's credentials: {e}; closed");
                continue;
            }
        };
        let admitted = match limits.admit(uid, peer.trusted) {
            Ok(a) => a,
            Err(limit) => {
                tracing::warn!(
                    "connection {n}: refused to uid {uid} ({}, {}trusted): {limit}; closed",
                    peer.name,
                    if peer.trusted { "" } else { "not " }
                );
                continue;
            }
        };
        let reader = match stream.try_clone() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("connection {n}: {e}; closed");
                continue;
            }
        };
        let daemon = Arc::clone(&daemon);
        let label = format!("connection {n} ({})", peer.name);
        let spawned = std::thread::Builder::new().name(format!("sluice-worker-{n}")).spawn(move || {
            let client = SocketClient { pid, uid, admitted, accepted };
            serve_connection(&daemon, Box::new(reader), Box::new(stream), peer, Some(&client), &label, crate::FEATURES);
        });
        if let Err(e) = spawned {
            tracing::warn!("connection {n}: cannot start a worker thread: {e}; closed");
        }
    }
}

/// Serves one client on standard input and output, then returns. With a client that offers
/// it too (sluice's `ssh-ng://`), the connection is compressed ([`SLUICE_ZSTD`]).
pub fn serve_stdio(daemon: Arc<Daemon>) -> Result<(), DaemonError> {
    let peer = Peer { name: "stdio client".into(), trusted: true, allowed: true };
    let features: Vec<&str> = crate::FEATURES.iter().copied().chain([SLUICE_ZSTD]).collect();
    serve_connection(&daemon, Box::new(std::io::stdin()), Box::new(std::io::stdout()), peer, None, "stdio", &features);
    Ok(())
}

/// A client of the socket.
struct SocketClient {
    /// The process that connected (`SO_PEERCRED`).
    pid: i32,
    uid: u32,
    /// Its connection's place among the socket's connections.
    admitted: Admitted,
    /// When its connection was accepted: its greeting must be done [`HANDSHAKE_DEADLINE`] later.
    accepted: Instant,
}

/// Serves one client until it disconnects or sends something unreadable. `label` names the
/// connection in the daemon's log; `client`: the socket's client, if it is one;
/// `features`: the daemon's.
fn serve_connection(
    daemon: &Daemon,
    reader: Box<dyn ClientInput>,
    writer: Box<dyn Write + Send>,
    peer: Peer,
    client: Option<&SocketClient>,
    label: &str,
    features: &[&str],
) {
    let (mut input, mut w) = duplex(reader, writer);
    if let Err(e) = input.set_deadline(client.map(|c| c.accepted + HANDSHAKE_DEADLINE)) {
        tracing::warn!("{label}: setting the handshake deadline: {e}; connection closed");
        return;
    }
    let mut r = BufReader::with_capacity(64 * 1024, input);
    let greeting = match greet(&mut r, &mut w, peer.trusted, features) {
        Ok(g) => g,
        Err(HandshakeError::BadMagic(m)) => {
            tracing::warn!("{label}: error: protocol mismatch (client sent {m:#x}); connection closed");
            return;
        }
        Err(HandshakeError::Wire(e)) if e.is_timeout() => {
            tracing::warn!("{label}: no greeting within {HANDSHAKE_DEADLINE:?} ({e}); connection closed");
            return;
        }
        Err(e) => {
            tracing::warn!("{label}: handshake failed: {e}; connection closed");
            return;
        }
    };
    // The deadline was the greeting's: a client may wait as long as it likes between requests.
    if let Err(e) = r.get_mut().set_deadline(None) {
        tracing::warn!("{label}: clearing the handshake deadline: {e}; connection closed");
        return;
    }
    let opened = match peer.allowed {
        true => daemon.connection_store().map_err(|e| e.to_string()),
        false => Err(format!("user '{}' is not allowed to connect to the Nix daemon", peer.name)),
    };
    let store = match opened {
        Ok(store) => store,
        Err(msg) => {
            tracing::warn!("{label}: {msg}");
            let _ = StderrWriter { version: greeting.version }.error(&mut w, &msg).and_then(|()| w.flush());
            return;
        }
    };
    let temp_roots = store.temp_roots();
    let kept = Kept::new(temp_roots.clone());
    r.get_mut().set_lease(Box::new(Rc::clone(&kept)));
    let admitted = client.map(|c| &c.admitted);
    let mut conn =
        Conn { daemon, r, w, version: greeting.version, options: ClientOptions::new(daemon), peer, store, temp_roots, kept, admitted };
    let _pinned = greeting.cpu.and_then(Pinned::to_cpu);
    let watched = daemon.client_cpu == ClientCpu::Auto;
    let mut placed = client
        .filter(|c| greeting.cpu.is_none() && daemon.client_cpu.places(c.pid))
        .and_then(|c| Placement::pin_client(&daemon.cpu_use, c.pid, c.uid, watched));
    tracing::debug!(
        "{label}: protocol {} features {:?} user {} trusted {}",
        conn.version,
        greeting.features,
        conn.peer.name,
        conn.peer.trusted
    );
    if let Err(e) = conn.stderr().last(&mut conn.w).and_then(|()| conn.w.flush()) {
        tracing::debug!("{label}: client gone: {e}");
        return;
    }
    if greeting.features.contains(SLUICE_ZSTD) {
        conn.r.get_mut().compress();
    }
    let mut ops = 0u64;
    loop {
        let op = match read_u64(&mut conn.r, "operation") {
            Ok(op) => op,
            Err(e) if e.is_eof() => break,
            Err(e) => {
                tracing::info!("{label}: {e}");
                break;
            }
        };
        ops += 1;
        // A watched placement ends once the client's pin was given back, or before an operation
        // after which clients work in parallel (transfers, builds, maintenance).
        if let Some(p) = placed.as_ref().filter(|p| p.watched()) {
            let given_back = p.client_given_back();
            if given_back || !crate::ops::keeps_client_placed(op) {
                let why = if given_back { "the client started a thread or a process" } else { "it may work in parallel after it" };
                tracing::debug!("{label}: placement on one CPU ended before op {op}: {why}");
                placed = None;
            }
        }
        match crate::ops::dispatch(&mut conn, op) {
            Ok(()) => {}
            Err(Fail::Op(msg)) => {
                tracing::debug!("{label}: op {op} failed: {msg}");
                if let Err(e) = conn.stderr().error(&mut conn.w, &msg) {
                    tracing::debug!("{label}: client gone: {e}");
                    break;
                }
            }
            Err(Fail::Fatal(msg)) => {
                tracing::warn!("{label}: op {op}: {msg}; connection closed");
                let _ = conn.stderr().error(&mut conn.w, &msg).and_then(|()| conn.w.flush());
                break;
            }
            Err(Fail::Output(e)) => {
                tracing::debug!("{label}: client gone: {e}");
                break;
            }
        }
    }
    if let Err(e) = conn.w.flush() {
        tracing::debug!("{label}: client gone: {e}");
    }
    tracing::debug!("{label}: {ops} operations");
}
