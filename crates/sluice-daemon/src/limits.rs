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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rustix::process::{getrlimit, Resource};

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
}
