//! What the cost benchmarks (`format_cost.rs`, `protocol_cost.rs`) share.

use std::time::Duration;

/// CPU time of `clock` (`CLOCK_THREAD_CPUTIME_ID`, `CLOCK_PROCESS_CPUTIME_ID`).
#[allow(unsafe_code)]
pub fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the struct passed to it.
    let r = unsafe { libc::clock_gettime(clock, &mut t) };
    assert_eq!(r, 0, "clock_gettime");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}
