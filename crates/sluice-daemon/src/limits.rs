//! How many connections the daemon serves at once, so that no untrusted user can stop it
//! serving others (Nix's `nix-daemon` forks a process per connection and has no such limit;
//! each of its children holds its own descriptors).
//!
//! A connection holds about [`FDS_PER_CONNECTION`] descriptors. Connections may take half of
//! what the open-file limit leaves after [`RESERVE`] (the other half stays for substitution:
//! `sluice_store::fd_budget`), and the last quarter of that share is kept for trusted users
//! (`trusted-users`, root by default): untrusted connections never take the last
//! descriptors. An untrusted user also holds at most [`MAX_PER_UNTRUSTED_USER`]; a trusted
//! one (a build farm's clients run as one user) is bounded only by the total.
//!
//! The memory an untrusted connection's request takes as it is read (a path set of a million
//! paths takes about as much memory as its bytes on the wire) is bounded the same way: past
//! the first [`FREE_REQUEST_BYTES`] of each request, the bytes read are taken from its user's
//! share ([`REQUEST_BYTES_PER_UNTRUSTED_USER`]) and from all untrusted users' share
//! ([`UNTRUSTED_REQUEST_BYTES`]) until the operation is done ([`RequestBytes`]): without it,
//! each of a user's connections could make the one daemon process hold a request's whole
//! budget (`MAX_REQUEST`), hundreds of times over, where each of Nix's forked workers holds
//! its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rustix::process::{getrlimit, Resource};
use sluice_nix::wire::ops::MAX_REQUEST;

/// Descriptors kept for the daemon itself: standard streams, the store database (SQLite:
/// database, journal, shared memory), `big-lock`, the narinfo cache, the listening socket.
const RESERVE: u64 = 64;

/// Descriptors one connection may hold: its socket twice (the reading and writing sides), its
/// temporary-roots file, and a file it reads or writes for an operation.
const FDS_PER_CONNECTION: u64 = 4;

/// Connections one untrusted user may hold at once. An interactive user runs a few Nix
/// commands at a time, each with one connection (a `nix build` of many paths too); a few
/// hundred leaves room for scripts that run many in parallel.
pub(crate) const MAX_PER_UNTRUSTED_USER: usize = 256;

/// The bytes of an untrusted connection's request read before it takes from the shares of
/// request memory: every request of a Nix client but a path set of thousands of paths.
pub(crate) const FREE_REQUEST_BYTES: u64 = 1 << 20;

/// The request bytes past [`FREE_REQUEST_BYTES`] one untrusted user's requests may hold at
/// once: one request as large as any (`MAX_REQUEST`).
pub(crate) const REQUEST_BYTES_PER_UNTRUSTED_USER: u64 = MAX_REQUEST;

/// The request bytes past [`FREE_REQUEST_BYTES`] all untrusted users' requests may hold at once.
pub(crate) const UNTRUSTED_REQUEST_BYTES: u64 = 4 * MAX_REQUEST;

/// The connection limits and the connections open now.
pub(crate) struct Limits {
    /// Connections open at once, by anyone.
    total: usize,
    /// Connections untrusted users may hold together (`total` less the trusted reserve).
    untrusted: usize,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    total: usize,
    untrusted: usize,
    by_uid: HashMap<u32, usize>,
    /// Request bytes untrusted users hold ([`RequestBytes`]), in all and by user.
    request_bytes: u64,
    request_bytes_by_uid: HashMap<u32, u64>,
}

/// An admitted connection; its place is given back when it is dropped.
pub(crate) struct Admitted {
    limits: Arc<Limits>,
    uid: u32,
    trusted: bool,
}

impl Limits {
    /// The limits under a soft limit of `open_files` open files.
    pub(crate) fn from_open_files(open_files: u64) -> Self {
        let total = usize::try_from(open_files.saturating_sub(RESERVE) / 2 / FDS_PER_CONNECTION).unwrap_or(usize::MAX).max(2);
        Limits { total, untrusted: total - (total / 4).max(1), open: Mutex::new(Open::default()) }
    }

    /// The limits under the process's soft limit on open files now.
    pub(crate) fn current() -> Self {
        Self::from_open_files(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
    }

    /// Admits a connection of user `uid` (`trusted` or not), or says which limit refuses it.
    pub(crate) fn admit(self: &Arc<Self>, uid: u32, trusted: bool) -> Result<Admitted, String> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.total >= self.total {
            return Err(format!("the daemon serves at most {} connections at once", self.total));
        }
        if !trusted {
            if open.untrusted >= self.untrusted {
                return Err(format!(
                    "untrusted users hold at most {} connections together (the other {} are kept for trusted users)",
                    self.untrusted,
                    self.total - self.untrusted
                ));
            }
            let mine = open.by_uid.entry(uid).or_default();
            if *mine >= MAX_PER_UNTRUSTED_USER {
                return Err(format!("an untrusted user holds at most {MAX_PER_UNTRUSTED_USER} connections at once"));
            }
            *mine += 1;
            open.untrusted += 1;
        }
        open.total += 1;
        Ok(Admitted { limits: Arc::clone(self), uid, trusted })
    }
}

impl Admitted {
    /// The request memory of a request of this connection, none taken yet: see [`RequestBytes`].
    pub(crate) fn request_bytes(&self) -> RequestBytes<'_> {
        RequestBytes { admitted: self, taken: 0 }
    }
}

/// The request memory one request of an untrusted connection holds, given back when dropped
/// (once its operation is done). A trusted connection's requests take none.
pub(crate) struct RequestBytes<'a> {
    admitted: &'a Admitted,
    taken: u64,
}

impl RequestBytes<'_> {
    /// Whether the request takes from the shares: its connection is not trusted.
    pub(crate) fn counted(&self) -> bool {
        !self.admitted.trusted
    }

    /// The bytes taken so far.
    pub(crate) fn taken(&self) -> u64 {
        self.taken
    }

    /// Takes `n` more bytes for the request, or says which share refuses them.
    pub(crate) fn take(&mut self, n: u64) -> Result<(), String> {
        if !self.counted() {
            return Ok(());
        }
        let mut open = self.admitted.limits.open.lock().unwrap_or_else(PoisonError::into_inner);
        let mine = open.request_bytes_by_uid.get(&self.admitted.uid).copied().unwrap_or(0);
        if mine + n > REQUEST_BYTES_PER_UNTRUSTED_USER {
            return Err(format!(
                "an untrusted user's requests hold at most {} MiB of the daemon's memory at once (beyond the first {} MiB of each request); this user's other requests hold {} MiB",
                REQUEST_BYTES_PER_UNTRUSTED_USER >> 20,
                FREE_REQUEST_BYTES >> 20,
                (mine - self.taken) >> 20
            ));
        }
        if open.request_bytes + n > UNTRUSTED_REQUEST_BYTES {
            return Err(format!(
                "untrusted users' requests hold at most {} MiB of the daemon's memory together (beyond the first {} MiB of each request)",
                UNTRUSTED_REQUEST_BYTES >> 20,
                FREE_REQUEST_BYTES >> 20
            ));
        }
        open.request_bytes += n;
        *open.request_bytes_by_uid.entry(self.admitted.uid).or_default() += n;
        self.taken += n;
        Ok(())
    }
}

impl Drop for RequestBytes<'_> {
    fn drop(&mut self) {
        if self.taken == 0 {
            return;
        }
        let mut open = self.admitted.limits.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.request_bytes -= self.taken;
        if let Some(n) = open.request_bytes_by_uid.get_mut(&self.admitted.uid) {
            *n -= self.taken;
            if *n == 0 {
                open.request_bytes_by_uid.remove(&self.admitted.uid);
            }
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.limits.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.total -= 1;
        if !self.trusted {
            open.untrusted -= 1;
            if let Some(n) = open.by_uid.get_mut(&self.uid) {
                *n -= 1;
                if *n == 0 {
                    open.by_uid.remove(&self.uid);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untrusted_users_leave_the_reserve_and_each_other_room() {
        let limits = Arc::new(Limits::from_open_files(256));
        assert_eq!((limits.total, limits.untrusted), (24, 18));
        let held: Vec<_> = (0..18).map(|_| limits.admit(65534, false).unwrap()).collect();
        let refused = limits.admit(1000, false).err().unwrap();
        assert_eq!(refused, "untrusted users hold at most 18 connections together (the other 6 are kept for trusted users)");
        let trusted: Vec<_> = (0..6).map(|_| limits.admit(0, true).unwrap()).collect();
        assert_eq!(limits.admit(0, true).err().unwrap(), "the daemon serves at most 24 connections at once");
        drop(held);
        drop(trusted);
        let big = Arc::new(Limits::from_open_files(1 << 20));
        let held: Vec<_> = (0..MAX_PER_UNTRUSTED_USER).map(|_| big.admit(65534, false).unwrap()).collect();
        assert_eq!(big.admit(65534, false).err().unwrap(), "an untrusted user holds at most 256 connections at once");
        assert!(big.admit(1000, false).is_ok(), "another user is not refused");
        drop(held);
        assert!(big.admit(65534, false).is_ok(), "places are given back");
    }

    #[test]
    fn untrusted_requests_share_a_bounded_memory() {
        let limits = Arc::new(Limits::from_open_files(1 << 20));
        let users: Vec<_> = (0..5).map(|uid| limits.admit(1000 + uid, false).unwrap()).collect();
        let mut first = users[0].request_bytes();
        first.take(REQUEST_BYTES_PER_UNTRUSTED_USER - 1).unwrap();
        let second_connection = limits.admit(1000, false).unwrap();
        let mut second = second_connection.request_bytes();
        assert_eq!(
            second.take(2).err().unwrap(),
            "an untrusted user's requests hold at most 128 MiB of the daemon's memory at once (beyond the first 1 MiB of each request); this user's other requests hold 127 MiB"
        );
        second.take(1).unwrap();
        let mut others: Vec<_> = users[1..4].iter().map(|u| u.request_bytes()).collect();
        others.iter_mut().for_each(|o| o.take(REQUEST_BYTES_PER_UNTRUSTED_USER).unwrap());
        assert_eq!(
            users[4].request_bytes().take(1).err().unwrap(),
            "untrusted users' requests hold at most 512 MiB of the daemon's memory together (beyond the first 1 MiB of each request)"
        );
        let trusted = limits.admit(0, true).unwrap();
        trusted.request_bytes().take(UNTRUSTED_REQUEST_BYTES).unwrap();
        drop((first, second));
        let mut again = users[0].request_bytes();
        again.take(REQUEST_BYTES_PER_UNTRUSTED_USER).unwrap();
        drop((again, others));
        let open = limits.open.lock().unwrap();
        assert_eq!((open.request_bytes, open.request_bytes_by_uid.len()), (0, 0), "every byte was given back");
    }
}
