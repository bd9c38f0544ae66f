//! Accepting clients: a Unix socket (one worker thread per connection; the peer's uid from
//! `SO_PEERCRED` decides trust) or one client on standard input and output (`--stdio`, as
//! `nix-daemon --stdio` serves `ssh-ng://`; that client is trusted, as in Nix).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;

use crate::trust::Peer;
use crate::{conn, Daemon, DaemonError};

/// Listens on `socket` (replacing a stale socket file, creating its directory, mode 0666 so
/// that every user can connect; `allowed-users` decides) and serves clients until the
/// process ends. Each connection runs on its own thread; a failing connection affects no
/// other.
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
    let listener = UnixListener::bind(&temp).map_err(io("binding"))?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o666)).map_err(io("setting the mode of"))?;
    std::fs::rename(&temp, socket).map_err(io("moving the new socket into place at"))?;
    tracing::info!("listening on {}", socket.display());
    for (n, stream) in listener.incoming().enumerate() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accepting a connection on {}: {e}", socket.display());
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        let (peer, pid) = match rustix::net::sockopt::get_socket_peercred(&stream) {
            Ok(cred) => (daemon.users.peer(cred.uid.as_raw(), cred.gid.as_raw()), cred.pid.as_raw_nonzero().get()),
            Err(e) => {
                tracing::warn!("connection {n}: cannot read the peer's credentials: {e}; closed");
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
        let spawned = std::thread::Builder::new()
            .name(format!("sluice-worker-{n}"))
            .spawn(move || conn::serve(&daemon, Box::new(reader), Box::new(stream), peer, Some(pid), &label));
        if let Err(e) = spawned {
            tracing::warn!("connection {n}: cannot start a worker thread: {e}; closed");
        }
    }
    Ok(())
}

/// Serves one client on standard input and output, then returns.
pub fn serve_stdio(daemon: Arc<Daemon>) -> Result<(), DaemonError> {
    let peer = Peer { name: "stdio client".into(), trusted: true, allowed: true };
    conn::serve(&daemon, Box::new(std::io::stdin()), Box::new(std::io::stdout()), peer, None, "stdio");
    Ok(())
}
