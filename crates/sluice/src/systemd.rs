//! Sockets handed over by systemd's socket activation (`sd_listen_fds(3)`): `LISTEN_FDS`
//! descriptors from 3 on, for the process `LISTEN_PID`. Nix's `nix-daemon.cc` takes its socket
//! so (`nix-daemon.socket` on NixOS); `sluice daemon` and `sluice serve` do too.

use std::os::fd::{FromRawFd, OwnedFd};

/// The first descriptor passed (`SD_LISTEN_FDS_START`).
const FIRST: libc::c_int = 3;

/// The descriptors passed by socket activation, taken: the variables are removed (so that the
/// processes this one starts do not take them too) and the descriptors made close-on-exec.
/// Empty without socket activation, or when the variables are for another process
/// (`LISTEN_PID`), as `sd_listen_fds` returns 0 then. Call before any thread starts.
pub fn listen_fds() -> Result<Vec<OwnedFd>, String> {
    let Some(count) = std::env::var_os("LISTEN_FDS") else { return Ok(Vec::new()) };
    let pid = std::env::var("LISTEN_PID").unwrap_or_default();
    for var in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
        std::env::remove_var(var);
    }
    if pid != std::process::id().to_string() {
        tracing::debug!("LISTEN_PID is {pid:?}, not this process: its sockets are not for it");
        return Ok(Vec::new());
    }
    let count: libc::c_int = count
        .to_str()
        .and_then(|c| c.parse().ok())
        .filter(|c| (1..=1024).contains(c))
        .ok_or_else(|| format!("LISTEN_FDS is {count:?}: expected the number of sockets systemd passed"))?;
    (FIRST..FIRST + count).map(take).collect()
}

/// Takes descriptor `fd`, checking that it is open, and makes it close-on-exec.
#[allow(unsafe_code)]
fn take(fd: libc::c_int) -> Result<OwnedFd, String> {
    // SAFETY: fcntl on a descriptor number only reads or sets its flags; the descriptor is
    // owned from here on by the one OwnedFd made of it (the variables that name it are gone).
    unsafe {
        if libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) != 0 {
            return Err(format!("socket activation: descriptor {fd}: {}", std::io::Error::last_os_error()));
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}
