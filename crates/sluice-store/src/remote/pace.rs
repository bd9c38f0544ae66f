//! How many bytes of NAR a round of [`DaemonConnection::closure_fetching`](super::DaemonConnection)
//! asks for ([`Pace`]). The daemon answers in the order it was asked: a level's answers come
//! behind the NARs asked for in the round before, so a round that asks for more than the
//! daemon sends in one round trip holds up the search by the excess, and every round after it
//! (at RTT 50 ms, a level's 9.5 MB of NAR made its round take 5 round trips). Each round asks
//! instead for about what comes in one round trip, as measured by the rounds before it; the
//! rest waits for later rounds (which have fewer NARs of their own as the levels thin out), or
//! for the closure. Nix finds the whole closure before it asks for any NAR (`copyPaths`,
//! `src/libstore/store-api.cc`).

use std::time::Duration;

/// The bytes of NAR a round asks for before any round has measured the rate.
const FIRST_BUDGET: u64 = 1 << 20;

/// The least a round asks for (the first NAR waiting goes in every round anyway).
const LEAST_BUDGET: u64 = 128 << 10;

/// The bytes of NAR a round asks for, from how long the rounds before took (see the module
/// doc).
#[derive(Debug)]
pub(super) struct Pace {
    /// The shortest round seen: its queries written to their answers read.
    round_trip: Option<Duration>,
    budget: u64,
}

impl Default for Pace {
    fn default() -> Self {
        Pace { round_trip: None, budget: FIRST_BUDGET }
    }
}

impl Pace {
    /// A round's queries were answered `took` after they were written, behind `ahead` bytes
    /// of NAR asked for in the round before. A round longer than the shortest by a quarter,
    /// behind most of the budget, was held up by those NARs: the next asks for what came in a
    /// round trip. One that was not, with the budget mostly used, asks for twice as much. (A
    /// round behind few NARs is long for other reasons: many queries, a busy machine.)
    pub(super) fn answered(&mut self, took: Duration, ahead: u64) {
        let round_trip = *self.round_trip.insert(self.round_trip.map_or(took, |r| r.min(took)));
        if ahead.saturating_mul(2) < self.budget {
            return;
        }
        if took > round_trip + round_trip / 4 {
            let per_round = u128::from(ahead) * round_trip.as_nanos() / took.as_nanos().max(1);
            self.budget = u64::try_from(per_round).unwrap_or(u64::MAX).max(LEAST_BUDGET);
        } else {
            self.budget = self.budget.saturating_mul(2);
        }
    }

    /// The bytes of NAR the next round asks for.
    pub(super) fn budget(&self) -> u64 {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_round_asks_for_what_comes_in_one_round_trip() {
        let mut pace = Pace::default();
        pace.answered(50 * MS, 0);
        assert_eq!(pace.budget(), FIRST_BUDGET, "no NAR was ahead");
        // The NARs came within the round trip, the budget used: twice as much.
        pace.answered(52 * MS, 900_000);
        assert_eq!(pace.budget(), 2 * FIRST_BUDGET);
        // Little of the budget used: no more, nor less when the round was long.
        pace.answered(50 * MS, 10_000);
        pace.answered(90 * MS, 10_000);
        assert_eq!(pace.budget(), 2 * FIRST_BUDGET);
        // 9.5 MB held the answers up for 250 ms: 1.9 MB come in the 50 ms round trip.
        pace.answered(250 * MS, 9_500_000);
        assert_eq!(pace.budget(), 1_900_000);
        pace.answered(5000 * MS, 1_000_000);
        assert_eq!(pace.budget(), LEAST_BUDGET);
    }
}
