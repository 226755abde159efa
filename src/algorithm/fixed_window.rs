//! Fixed window: one counter per aligned window of length `period`.
//!
//! Promise: at most `limit` permits in each aligned window `[k·period, (k+1)·period)`. A burst
//! at the end of one window and the start of the next can admit up to `2 × limit` within one
//! period: that is the price of one counter.

use super::{never, us};
use crate::{Decision, Quota};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    /// Start of the window `count` belongs to (µs).
    pub(crate) start: u64,
    /// Permits taken in that window.
    pub(crate) count: u64,
}

impl FixedWindow {
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let period = quota.period_us();
        let limit = quota.limit();
        let window = now - now % period;
        // A clock that stepped back stays in the newer window.
        if window > self.start {
            self.start = window;
            self.count = 0;
        }
        let end = self.start + period;
        let to_end = end.saturating_sub(now);
        let remaining = limit.saturating_sub(self.count);
        let reset_after = if self.count == 0 { 0 } else { to_end };
        if cost > limit {
            return never(limit, remaining, reset_after);
        }
        if self.count + cost <= limit {
            Decision::admit(limit, remaining - cost, us(to_end))
        } else {
            // The next window starts empty and any cost up to the limit fits there.
            Decision::deny(limit, remaining, us(reset_after), Some(us(to_end)))
        }
    }

    pub(crate) fn commit(&mut self, cost: u64) {
        self.count += cost;
    }

    pub(crate) fn refund(&mut self, cost: u64) {
        self.count = self.count.saturating_sub(cost);
    }

    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        if self.count == 0 {
            0
        } else {
            self.start + quota.period_us()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::Algorithm;
    use proptest::prelude::*;

    fn quota(limit: u64, period_ms: u64) -> crate::Quota {
        quota_of(Algorithm::FixedWindow, limit, period_ms, None)
    }

    #[test]
    fn admits_limit_per_window_then_denies_until_the_next() {
        let q = quota(3, 1000);
        let mut s = Sim::new(&q, T0 + 250_000);
        for left in [2, 1, 0] {
            let d = s.consume(1);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
            assert_eq!(d.reset_after, ms(750));
        }
        let d = s.consume(1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(ms(750)));
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn window_boundary_admits_two_limits_within_one_period() {
        let q = quota(5, 1000);
        let mut s = Sim::new(&q, T0 + 999_000);
        assert!(s.consume(5).allowed);
        s.advance_us(1_000);
        assert!(s.consume(5).allowed, "a fresh aligned window");
        assert!(!s.consume(1).allowed);
    }

    #[test]
    fn weighted_costs_and_never_admissible() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(7).allowed);
        let d = s.consume(4);
        assert!(!d.allowed && d.remaining == 3);
        assert_retry_is_exact(&s, 4);
        let d = s.consume(11);
        assert!(d.never_admissible());
    }

    #[test]
    fn refund_gives_back() {
        let q = quota(2, 1000);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(2).allowed);
        s.refund(1);
        assert!(s.consume(1).allowed);
        assert!(!s.consume(1).allowed);
    }

    proptest! {
        #[test]
        fn at_most_limit_per_aligned_window(
            limit in 1u64..20,
            period_ms in 1u64..50,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = quota(limit, period_ms);
            let admitted = run(&q, &arrivals);
            let period = q.period_us();
            let mut per_window = std::collections::HashMap::new();
            for (t, cost) in admitted {
                *per_window.entry(t / period).or_insert(0u64) += cost;
            }
            for (_, n) in per_window {
                prop_assert!(n <= limit);
            }
        }

        #[test]
        fn retry_after_is_exact(limit in 1u64..20, period_ms in 1u64..50, arrivals in arrivals_strategy(60, 30)) {
            check_retry_exact_over(&quota(limit, period_ms), &arrivals)?;
        }
    }
}
