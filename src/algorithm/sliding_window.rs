//! Sliding window counter: this window's count plus the previous window's, weighted by how much
//! of the previous window the sliding window still covers.
//!
//! Estimate at elapsed `e` (whole milliseconds into the current window of `P` ms):
//! `previous × (P − e) / P + current`. A request of cost `c` is admitted when
//! `estimate + c ≤ limit`. All of it is computed in integers, multiplied through by `P`.
//!
//! Promise: the estimate never exceeds the limit. The estimate assumes the previous window's
//! permits were spread evenly, so against the exact log it can admit a little more or a little
//! less; the README reports the measured disagreement (`cargo run --release --example accuracy`).
//!
//! Refunds: a receipt says when its permits were counted; they are taken off that window's count
//! while it is still the current or the previous one (the estimate is then what it would be had
//! the request never come), and nothing is given back after that, nor to a state converted from
//! another quota or created afresh since (its `valid_from`).
//!
//! Quota changes: a new limit reads both counts as they are, so the estimate never passes the
//! larger limit while two limits write one key. A new period moves every permit still counted
//! into the current window of the new alignment: conservative (it may refuse a little longer than
//! either quota would), never more permissive.

use super::{never, receipt, us};
use crate::{Algorithm, Decision, Quota, Taken};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    /// Start of the current window (µs).
    pub(crate) start: u64,
    /// Permits taken in the window before it.
    pub(crate) previous: u64,
    /// Permits taken in the current window.
    pub(crate) current: u64,
    /// The period (µs) the windows were aligned to; 0 for a fresh state.
    pub(crate) period: u64,
    /// Receipts from before this time (µs) refund nothing: the state was created or converted
    /// then. 0 until the first permit is taken.
    pub(crate) valid_from: u64,
}

impl SlidingWindow {
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let period = quota.period_us();
        let p_ms = period / 1000;
        let limit = quota.limit();
        let window = now - now % period;
        if self.period != period {
            let old = self.period;
            let previous = if now < self.start + old {
                self.previous
            } else {
                0
            };
            let current = if now < self.start + 2 * old {
                self.current
            } else {
                0
            };
            *self = SlidingWindow {
                start: window,
                previous: 0,
                current: previous + current,
                period,
                valid_from: if old != 0 { now } else { self.valid_from },
            };
        }
        // A clock that stepped back stays in the newer window.
        if window > self.start {
            self.previous = if window == self.start + period {
                self.current
            } else {
                0
            };
            self.current = 0;
            self.start = window;
        }
        let elapsed_ms = (now.saturating_sub(self.start) / 1000).min(p_ms);
        // Both terms are at most limit × P, which the quota keeps exact.
        let weighted = self.previous * (p_ms - elapsed_ms) + self.current * p_ms;
        let capacity = limit * p_ms;
        let remaining = capacity.saturating_sub(weighted) / p_ms;
        let reset_after = self.reset_after(now, period);
        if cost > limit {
            return never(limit, remaining, reset_after);
        }
        if weighted + cost * p_ms <= capacity {
            let after = self.start + period;
            // Taking the permits makes the current window non-empty: full again once it has
            // slid out, two windows from its start.
            let reset = (after + period).saturating_sub(now);
            return Decision::admit(limit, remaining - cost, us(reset));
        }
        let retry = self.retry_at(quota, cost) - now;
        Decision::deny(limit, remaining, us(reset_after), Some(us(retry)))
    }

    /// The earliest time a request of `cost` is admitted if nothing else arrives.
    fn retry_at(&self, quota: &Quota, cost: u64) -> u64 {
        let period = quota.period_us();
        let p_ms = period / 1000;
        let limit = quota.limit();
        // Later in this window, as the previous window's weight falls:
        // previous × (P − e) ≤ (limit − current − cost) × P.
        if self.previous > 0 && self.current + cost <= limit {
            let room = (limit - self.current - cost) * p_ms;
            let e = p_ms.saturating_sub(room / self.previous);
            if e < p_ms {
                return self.start + e * 1000;
            }
        }
        // Otherwise in the next window, where this window's count becomes the previous one:
        // current × (P − e) ≤ (limit − cost) × P. At e = P this is the window after that.
        let e = ((limit - cost) * p_ms)
            .checked_div(self.current)
            .map_or(0, |room| p_ms - room.min(p_ms));
        self.start + period + e * 1000
    }

    fn reset_after(&self, now: u64, period: u64) -> u64 {
        let empty_from = if self.current > 0 {
            self.start + 2 * period
        } else if self.previous > 0 {
            self.start + period
        } else {
            now
        };
        empty_from.saturating_sub(now)
    }

    pub(crate) fn commit(&mut self, now: u64, cost: u64) -> Taken {
        self.current += cost;
        self.taken(now, cost)
    }

    /// A receipt for `cost` permits counted at `now`, in the current window.
    pub(crate) fn taken(&mut self, now: u64, cost: u64) -> Taken {
        let at = now.max(self.start);
        receipt(&mut self.valid_from, at, cost, Algorithm::SlidingWindow)
    }

    pub(crate) fn refund(&mut self, taken: Taken) {
        if taken.at < self.valid_from || self.period == 0 {
            return;
        }
        let window = taken.at - taken.at % self.period;
        if window == self.start {
            self.current = self.current.saturating_sub(taken.cost);
        } else if window + self.period == self.start {
            self.previous = self.previous.saturating_sub(taken.cost);
        }
    }

    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        let period = quota.period_us();
        if self.current > 0 {
            self.start + 2 * period
        } else if self.previous > 0 {
            self.start + period
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::Algorithm;
    use proptest::prelude::*;

    fn quota(limit: u64, period_ms: u64) -> crate::Quota {
        quota_of(Algorithm::SlidingWindow, limit, period_ms, None)
    }

    #[test]
    fn previous_window_weighs_in_proportion() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(10).allowed);
        s.advance_ms(1250); // 250 ms into the next window: previous weighs 0.75 → 7.5
        let d = s.consume(2);
        assert!(d.allowed, "7.5 + 2 ≤ 10");
        assert_eq!(d.remaining, 0, "floor(10 − 9.5)");
        let d = s.consume(1);
        assert!(!d.allowed, "7.5 + 2 + 1 > 10");
        // previous × (1000 − e) ≤ (10 − 2 − 1) × 1000 ⇒ e ≥ 300 ms, i.e. 50 ms from now.
        assert_eq!(d.retry_after, Some(ms(50)));
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn retry_crosses_into_the_next_window() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0 + 100_000);
        assert!(s.consume(8).allowed);
        let d = s.consume(5);
        assert!(!d.allowed);
        // Next window: 8 × (1000 − e) ≤ 5 × 1000 ⇒ e ≥ 375 ms; from 100 ms in: 900 + 375.
        assert_eq!(d.retry_after, Some(ms(1275)));
        assert_retry_is_exact(&s, 5);
        // A full-limit cost has to wait until both windows are empty.
        let d = s.consume(10);
        assert_eq!(d.retry_after, Some(ms(1900)));
        assert_retry_is_exact(&s, 10);
        assert!(s.consume(11).never_admissible());
    }

    #[test]
    fn refunds_follow_their_window_and_stop_when_it_slides_out() {
        let q = quota(4, 1000);
        let mut s = Sim::new(&q, T0 + 900_000);
        s.consume(2);
        let late = s.last_taken();
        s.advance_ms(200); // 100 ms into the next window: `late` is now the previous window
        s.consume(1);
        s.refund(late);
        assert_eq!(s.peek().remaining, 3, "as if the first request never came");
        let mut s = Sim::new(&q, T0);
        s.consume(2);
        let gone = s.last_taken();
        s.advance_ms(2_000);
        s.consume(4);
        s.refund(gone);
        assert!(
            !s.consume(1).allowed,
            "a window that slid out gives nothing back"
        );
    }

    #[test]
    fn a_new_period_keeps_every_counted_permit() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0 + 500_000);
        assert!(s.consume(6).allowed);
        let longer = quota(10, 10_000);
        let mut l = s.with_quota(&longer);
        assert_eq!(l.peek().remaining, 4);
        let smaller = quota(5, 1000);
        assert!(!s.with_quota(&smaller).consume(1).allowed);
    }

    #[test]
    fn skipping_a_window_forgets_everything() {
        let q = quota(3, 100);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(3).allowed);
        s.advance_ms(200);
        assert_eq!(s.peek().remaining, 3);
    }

    proptest! {
        #[test]
        fn never_admits_beyond_its_own_estimate(
            limit in 1u64..20,
            period_ms in 1u64..50,
            arrivals in arrivals_strategy(200, 30),
        ) {
            // Replay the admitted requests and recompute the weighted estimate from scratch at
            // each admission: it must never exceed the limit.
            let q = quota(limit, period_ms);
            let admitted = run(&q, &arrivals);
            let p = q.period_us();
            let p_ms = p / 1000;
            for (i, &(t, _)) in admitted.iter().enumerate() {
                let window = t - t % p;
                let sum_in = |from: u64, to: u64| admitted[..=i]
                    .iter()
                    .filter(|(ts, _)| *ts >= from && *ts < to)
                    .map(|(_, c)| c)
                    .sum::<u64>();
                let current = sum_in(window, window + p);
                let previous = if window >= p { sum_in(window - p, window) } else { 0 };
                let e = (t - window) / 1000;
                prop_assert!(previous * (p_ms - e) + current * p_ms <= limit * p_ms);
            }
        }

        #[test]
        fn admits_exactly_what_its_estimate_allows(
            limit in 1u64..20,
            period_ms in 1u64..50,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = quota(limit, period_ms);
            let p = q.period_us();
            let p_ms = p / 1000;
            run_against_reference(&q, &arrivals, |admitted, t, cost| {
                let window = t - t % p;
                let sum_in = |from: u64, to: u64| {
                    admitted
                        .iter()
                        .filter(|(at, _)| *at >= from && *at < to)
                        .map(|(_, c)| c)
                        .sum::<u64>()
                };
                let current = sum_in(window, window + p);
                let previous = if window >= p { sum_in(window - p, window) } else { 0 };
                let e = (t - window) / 1000;
                previous * (p_ms - e) + (current + cost) * p_ms <= limit * p_ms
            })?;
        }

        #[test]
        fn retry_after_is_exact(limit in 1u64..20, period_ms in 1u64..50, arrivals in arrivals_strategy(60, 30)) {
            check_retry_exact_over(&quota(limit, period_ms), &arrivals)?;
        }
    }
}
