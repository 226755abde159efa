//! How often this process sees one key: a count per one-second bucket, lock-free.
//!
//! Promise: `tick` returns the last complete second's count, or the current second's pace if that
//! is higher (measured over at least a tenth of a second, so the first request of a second never
//! reads as a burst). A hint for leasing decisions, never a limit: concurrent ticks may race on a
//! bucket change and lose a count.

use std::sync::atomic::{AtomicU64, Ordering};

/// The shortest part of a second the current pace is measured over (µs).
const MIN_PACE_US: u64 = 100_000;

/// Requests per second of one key in this process.
#[derive(Debug, Default)]
pub(crate) struct RateMeter {
    second: AtomicU64,
    count: AtomicU64,
    last: AtomicU64,
}

impl RateMeter {
    /// A copy of this meter's counts, to carry a key's rate from one place to another.
    pub(crate) fn snapshot(&self) -> RateMeter {
        RateMeter {
            second: AtomicU64::new(self.second.load(Ordering::Relaxed)),
            count: AtomicU64::new(self.count.load(Ordering::Relaxed)),
            last: AtomicU64::new(self.last.load(Ordering::Relaxed)),
        }
    }

    /// The last second (since the epoch) a request was counted in.
    pub(crate) fn last_second(&self) -> u64 {
        self.second.load(Ordering::Relaxed)
    }

    /// Count one request at `now` (µs); returns the key's rate per second.
    pub(crate) fn tick(&self, now: u64) -> f64 {
        let second = now / 1_000_000;
        let previous = self.second.swap(second, Ordering::Relaxed);
        if previous != second {
            let last = self.count.swap(0, Ordering::Relaxed);
            // A gap of more than a second means the last complete second saw nothing.
            let last = if previous + 1 == second { last } else { 0 };
            self.last.store(last, Ordering::Relaxed);
        }
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let into = (now % 1_000_000).max(MIN_PACE_US) as f64 / 1e6;
        (self.last.load(Ordering::Relaxed) as f64).max(count as f64 / into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn reads_the_last_second_or_the_current_pace() {
        let m = RateMeter::default();
        // 50 requests in the first 100 ms of a second: a pace of 500/s.
        for i in 0..50 {
            m.tick(10 * S + i * 2_000);
        }
        assert_eq!(m.tick(10 * S + 100_000), 510.0);
        // The next second starts: the last complete second counted 51.
        assert_eq!(m.tick(11 * S + 500_000), 51.0);
    }

    #[test]
    fn the_first_request_of_a_second_is_not_a_burst() {
        let m = RateMeter::default();
        assert_eq!(m.tick(5 * S), 10.0, "one request over at least 100 ms");
    }

    #[test]
    fn a_silent_second_forgets_the_last_rate() {
        let m = RateMeter::default();
        for _ in 0..300 {
            m.tick(S + 500_000);
        }
        assert!(
            m.tick(3 * S + 900_000) < 2.0,
            "nothing was seen in second 2"
        );
    }
}
