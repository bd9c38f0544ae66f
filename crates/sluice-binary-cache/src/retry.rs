//! Retry policy and per-run health of a cache: transient failures are retried with
//! exponential backoff up to `download-attempts` times; a cache whose request still fails (or
//! that refuses our credentials) is skipped for the rest of the run, with one warning.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use super::CacheError;

/// Longest `Retry-After` honoured; a longer one is capped so a run's delay stays bounded.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(5);

/// How often and how patiently a cache's requests are retried.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryPolicy {
    /// Attempts in all (at least 1).
    pub attempts: u32,
}

impl RetryPolicy {
    /// The policy for `download-attempts`.
    pub fn new(download_attempts: u64) -> Self {
        RetryPolicy { attempts: download_attempts.clamp(1, u32::MAX as u64) as u32 }
    }

    /// The wait before attempt `attempt + 1` (`attempt` ≥ 1 attempts made): 200 ms doubling
    /// per attempt up to 6.4 s, or the server's `Retry-After` when that is longer (capped).
    pub fn backoff(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let base = Duration::from_millis(100u64 << attempt.clamp(1, 6));
        base.max(retry_after.unwrap_or_default().min(MAX_RETRY_AFTER))
    }
}

/// Whether a cache is still used in this run. While its `nix-cache-info` is being fetched
/// (see [`Health::opening`]) failures disable it without a warning: if the cache cannot be
/// opened its caller reports that, otherwise the warning follows when opening ends.
#[derive(Debug, Default)]
pub(crate) struct Health {
    disabled: OnceLock<String>,
    opening: AtomicBool,
    warned: AtomicBool,
}

impl Health {
    /// Fails with [`CacheError::Disabled`] once the cache was given up on.
    pub fn check(&self, url: &str) -> Result<(), CacheError> {
        match self.disabled.get() {
            Some(reason) => Err(CacheError::Disabled { url: url.to_string(), reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// Records the outcome of a request: an error that concerns the whole cache disables it
    /// (the first one prints the warning). Returns the result unchanged.
    pub fn observe<T>(&self, url: &str, result: Result<T, CacheError>) -> Result<T, CacheError> {
        if let Err(e) = &result {
            if e.disables_cache() && self.disabled.set(e.to_string()).is_ok() && !self.opening.load(Ordering::SeqCst) {
                self.warn(url);
            }
        }
        result
    }

    /// Marks the start of opening the cache.
    pub fn opening(&self) {
        self.opening.store(true, Ordering::SeqCst);
    }

    /// Marks the end of opening: when it succeeded, a failure seen meanwhile is warned about
    /// now; when it failed, the caller reports the cache as left out and no warning follows.
    pub fn opened(&self, url: &str, ok: bool) {
        self.opening.store(false, Ordering::SeqCst);
        if !ok {
            self.warned.store(true, Ordering::SeqCst);
        } else if self.disabled.get().is_some() {
            self.warn(url);
        }
    }

    fn warn(&self, url: &str) {
        if let Some(reason) = self.disabled.get().filter(|_| !self.warned.swap(true, Ordering::SeqCst)) {
            tracing::warn!("substituter {url} is not used for the rest of this run: {reason}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_honours_retry_after() {
        let p = RetryPolicy::new(5);
        assert_eq!(p.backoff(1, None), Duration::from_millis(200));
        assert_eq!(p.backoff(3, None), Duration::from_millis(800));
        assert_eq!(p.backoff(40, None), Duration::from_millis(6400));
        assert_eq!(p.backoff(1, Some(Duration::from_secs(1))), Duration::from_secs(1));
        assert_eq!(p.backoff(1, Some(Duration::from_secs(3600))), MAX_RETRY_AFTER);
        assert_eq!(RetryPolicy::new(0).attempts, 1);
    }

    #[test]
    fn one_failure_disables_for_the_run() {
        let h = Health::default();
        let auth = CacheError::Status { url: "http://c/x.narinfo".into(), status: 401, body: "token expired".into() };
        assert!(h.check("http://c").is_ok());
        let not_found: Result<(), _> = Err(CacheError::WrongStoreDir { url: "u".into(), expected: "a".into(), got: "b".into() });
        assert!(h.observe("http://c", not_found).is_err());
        assert!(h.check("http://c").is_ok(), "a bad file does not disable the cache");
        assert!(h.observe::<()>("http://c", Err(auth)).is_err());
        let err = h.check("http://c").unwrap_err().to_string();
        assert!(err.contains("http://c") && err.contains("401") && err.contains("token expired"), "{err}");
    }

    /// Running out of file descriptors while reading a NAR (seen in a copy under a soft limit
    /// of 1024 open files) is retried but does not make the run give up on the cache.
    #[test]
    fn a_local_shortage_does_not_disable_the_cache() {
        let h = Health::default();
        for errno in [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE, rustix::io::Errno::NOMEM] {
            let io = std::io::Error::from_raw_os_error(errno.raw_os_error());
            let wrapped = std::io::Error::other(io);
            let e = CacheError::Io { url: "file:///c/nar/x.nar.xz".into(), source: wrapped };
            assert!(e.is_transient() && e.is_local_shortage(), "{e}");
            assert!(h.observe::<()>("file:///c", Err(e)).is_err());
            assert!(h.check("file:///c").is_ok(), "{errno:?} disabled the cache");
        }
        let reset = CacheError::Io { url: "file:///c/nar/x.nar.xz".into(), source: std::io::ErrorKind::ConnectionReset.into() };
        assert!(!reset.is_local_shortage());
        assert!(h.observe::<()>("file:///c", Err(reset)).is_err());
        assert!(h.check("file:///c").is_err(), "other transient failures still disable it");
    }

    #[test]
    fn failures_while_opening_are_not_warned_twice() {
        let refused = || CacheError::Status { url: "http://c/x.narinfo".into(), status: 503, body: String::new() };
        let h = Health::default();
        h.opening();
        assert!(h.observe::<()>("http://c", Err(refused())).is_err());
        assert!(!h.warned.load(Ordering::SeqCst), "no warning while opening");
        h.opened("http://c", false);
        assert!(h.warned.load(Ordering::SeqCst), "left out: the caller's warning is the one");
        let h = Health::default();
        h.opening();
        assert!(h.observe::<()>("http://c", Err(refused())).is_err());
        h.opened("http://c", true);
        assert!(h.warned.load(Ordering::SeqCst) && h.check("http://c").is_err(), "warned once opening succeeded");
    }
}
