//! Unix-domain sockets at paths of any length. A socket address holds at most 107 bytes of path
//! (`sockaddr_un`), but the store's sockets live under directories the user chooses (a state
//! directory, a test's temporary directory). As Nix's `bindConnectProcHelper`
//! (`src/libutil/unix/unix-domain-socket.cc`) does, a longer path is reached through
//! `/proc/self/fd/<fd>/<name>`, `<fd>` an open handle of its directory.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The longest path a socket address holds (`sizeof(sun_path)` less its terminating zero).
const MAX_ADDRESS_PATH: usize = 107;

/// Binds (and listens on) a new socket at `path`. Errors: as `bind(2)`; a path whose file name
/// alone does not fit fails with `InvalidInput`.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    with_address(path, |address| UnixListener::bind(address))
}

/// Connects to the socket at `path`. Errors: as `connect(2)`, and as [`bind`] for the path.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    with_address(path, |address| UnixStream::connect(address))
}

/// Runs `f` with an address of `path` short enough for a socket address: `path` itself, or its
/// name under `/proc/self/fd/<fd>` of its directory, open while `f` runs.
fn with_address<T>(path: &Path, f: impl FnOnce(&Path) -> io::Result<T>) -> io::Result<T> {
    if path.as_os_str().len() <= MAX_ADDRESS_PATH {
        return f(path);
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: not a socket's path", path.display())));
    };
    let dir = std::fs::File::open(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })?;
    let short: PathBuf = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    if short.as_os_str().len() > MAX_ADDRESS_PATH {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: the socket's file name is too long", path.display())));
    }
    f(&short)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket under a directory whose path is longer than a socket address holds: bound,
    /// found at its real path, and connected to.
    #[test]
    fn a_socket_below_a_long_directory_is_bound_and_connected_to() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("socket");
        assert!(path.as_os_str().len() > MAX_ADDRESS_PATH);
        assert!(UnixListener::bind(&path).is_err(), "std alone cannot bind it");
        let listener = bind(&path).unwrap();
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_socket(), "the socket is at its real path");
        let _client = connect(&path).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let too_long = dir.join("n".repeat(120));
        assert_eq!(bind(&too_long).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
