//! Fixed window: one counter per aligned window of length `period`.
//!
//! Promise: at most `limit` permits in each aligned window `[k·period, (k+1)·period)`. A burst
//! at the end of one window and the start of the next can admit up to `2 × limit` within one
//! period: that is the price of one counter.
//!
//! Refunds: a receipt says when its permits were counted, and gives them back only while that
//! window is still the current one (afterwards they were never going to be counted again), and
//! only if the state has not been converted from another quota or created afresh since (its
//! `valid_from`), so a receipt never reaches a count it was not part of.
//!
//! Quota changes: a new limit reads the used count as it is, so while two limits write one key
//! the count never passes the larger. A new period carries the used count into the new aligned
//! window if the old window is still open (never fewer counted than before), else starts
//! afresh. A shorter period would let the old window's count go at its own window's end: the
//! count is also *held* until the old window ends, every permit taken meanwhile added to it,
//! and a longer period reads the held count back. So while an hour and a minute write one key (a
//! rolling change), the minute's instance keeps its minute and the hour's instance still finds
//! the hour's count. A refund does not lower a held count (it errs on the safe side).

use super::{never, receipt, us};

/// The most a held count holds: 2^52, above every limit (2^50 at most), exact in Lua.
pub(crate) const MAX_HELD: u64 = 1 << 52;
use crate::{Algorithm, Decision, Quota, Taken};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    /// Start of the window `count` belongs to (µs).
    pub(crate) start: u64,
    /// Permits taken in that window.
    pub(crate) count: u64,
    /// The period (µs) the window was aligned to; 0 for a fresh state.
    pub(crate) period: u64,
    /// Receipts from before this time (µs) refund nothing: the state was created or converted
    /// then. 0 until the first permit is taken.
    pub(crate) valid_from: u64,
    /// The permits a longer window than this one still counts (every permit taken since it
    /// was converted to a shorter period), until `held_until`; 0 when none.
    pub(crate) held: u64,
    /// When that longer window ends (µs).
    pub(crate) held_until: u64,
}

impl FixedWindow {
    #[inline(always)]
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let period = quota.period_us();
        let limit = quota.limit();
        let window = now - now % period;
        if self.held_until <= now {
            self.held = 0;
            self.held_until = 0;
        }
        if self.period != period {
            if self.period != 0 {
                self.valid_from = now;
            }
            let old_end = self.start + self.period;
            let end = window + period;
            // The new window counts what the old one still counts (a shorter period carries
            // its count into this window too: refused until it ends, not let go early) and
            // what a held count holds (over-counting, never under: its window may have begun
            // before this one).
            let still = if now < old_end { self.count } else { 0 };
            let count = still.max(self.held);
            // Counts whose windows outlast this one are held until they end.
            if self.held_until <= end {
                self.held = 0;
                self.held_until = 0;
            }
            if still > 0 && old_end > end {
                self.held = self.held.max(still);
                self.held_until = self.held_until.max(old_end);
            }
            self.count = count;
            self.start = window;
            self.period = period;
        }
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

    #[inline(always)]
    pub(crate) fn commit(&mut self, now: u64, cost: u64) -> Taken {
        self.count_now(now, cost);
        self.taken(now, cost)
    }

    /// Count `n` permits taken at `now`: in this window, and in a longer one that holds a count
    /// (up to [`MAX_HELD`]: every limit is far below it, and Lua's numbers stay exact).
    pub(crate) fn count_now(&mut self, now: u64, n: u64) {
        self.count += n;
        if self.held_until > now {
            self.held = self.held.saturating_add(n).min(MAX_HELD);
        }
    }

    /// Whether this state holds a longer window's count (evicted, that window would find the
    /// key fresh).
    pub(crate) fn holds(&self) -> bool {
        self.held > 0
    }

    /// A receipt for `cost` permits counted at `now`, in the current window.
    pub(crate) fn taken(&mut self, now: u64, cost: u64) -> Taken {
        let at = now.max(self.start);
        receipt(&mut self.valid_from, at, cost, Algorithm::FixedWindow)
    }

    pub(crate) fn refund(&mut self, taken: Taken) {
        if taken.at < self.valid_from || self.period == 0 {
            return;
        }
        if taken.at - taken.at % self.period == self.start {
            self.count = self.count.saturating_sub(taken.cost);
        }
    }

    pub(crate) fn expires_at(&self) -> u64 {
        let own = if self.count == 0 {
            0
        } else {
            self.start + self.period
        };
        if self.held == 0 {
            own
        } else {
            own.max(self.held_until)
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
    fn refund_gives_back_within_its_window() {
        let q = quota(2, 1000);
        let mut s = Sim::new(&q, T0);
        s.consume(1);
        let first = s.last_taken();
        assert!(s.consume(1).allowed);
        s.refund(first);
        assert!(s.consume(1).allowed);
        assert!(!s.consume(1).allowed);
    }

    /// The soundness issue's first scenario: a request counted at 0.999 s and refunded in the
    /// next window must not give that window a fourth permit.
    #[test]
    fn refund_across_a_window_boundary_gives_nothing() {
        let q = quota(3, 1000);
        let mut s = Sim::new(&q, T0 + 999_000);
        assert!(s.consume(1).allowed);
        let early = s.last_taken();
        s.advance_ms(1);
        for left in [2, 1, 0] {
            assert_eq!(s.consume(1).remaining, left);
        }
        s.refund(early);
        s.advance_us(20);
        assert!(!s.consume(1).allowed, "4 admitted in the second window");
    }

    /// A receipt from before a period change refunds nothing, even when the state is read
    /// under its quota again (A at 3 per 1 s, B at 3 per 10 s, on one key).
    #[test]
    fn a_receipt_from_before_a_conversion_refunds_nothing() {
        let a = quota(3, 1_000);
        let b = quota(3, 10_000);
        let mut s = Sim::new(&a, T0 + 100_000);
        s.consume(1);
        let early = s.last_taken();
        let mut on_b = s.with_quota(&b);
        on_b.now = T0 + 500_000;
        assert!(on_b.consume(2).allowed, "B's window carries A's 1");
        let mut back = on_b.with_quota(&a);
        back.now = T0 + 800_000;
        assert!(!back.consume(1).allowed, "3 counted in the window A reads");
        back.refund(early);
        assert!(!back.consume(1).allowed, "the old receipt created a permit");
    }

    #[test]
    fn a_new_limit_reads_the_used_count_and_a_new_period_carries_it() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(8).allowed);
        let smaller = quota(5, 1000);
        assert!(!s.with_quota(&smaller).consume(1).allowed);
        let longer = quota(10, 60_000);
        let mut l = s.with_quota(&longer);
        assert_eq!(
            l.peek().remaining,
            2,
            "the open window's count carries over"
        );
        l.advance_ms(60_000);
        assert_eq!(l.peek().remaining, 10);
    }

    /// An hour's count read under a minute (a rolling change of the period) is held until the
    /// hour ends, with every permit the minute takes meanwhile: the hour's quota reads it back
    /// and finds the key used, not fresh, while the minute keeps its own windows.
    #[test]
    fn a_shorter_period_holds_the_longer_windows_count_until_it_ends() {
        let hour = quota(100, 3_600_000);
        let minute = quota(10, 60_000);
        let mut h = Sim::new(&hour, T0);
        assert!(h.consume(100).allowed);
        h.advance_ms(30_000);
        let mut m = h.with_quota(&minute);
        let d = m.consume(1);
        assert!(!d.allowed, "the hour's count carried into this minute");
        assert_eq!(d.retry_after, Some(ms(30_000)));
        // The next minute is the minute's own.
        m.advance_ms(60_000);
        for _ in 0..10 {
            assert!(m.consume(1).allowed);
        }
        assert!(!m.consume(1).allowed);
        assert_retry_is_exact(&m, 1);
        // The hour reads back its 100 and the minute's 10: nothing more this hour.
        let mut back = m.with_quota(&hour);
        let d = back.consume(1);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 0);
        assert_eq!(d.retry_after, Some(ms(3_510_000)), "until the hour's end");
        assert_eq!(m.state.expires_at(&minute), T0 + 3_600_000_000);
        // Once the hour is over, nothing is held.
        m.advance_ms(3_510_000);
        assert!(m.with_quota(&hour).consume(100).allowed);
    }

    /// Periods that do not nest (10 and 15 minutes): a window of either counts what the other
    /// admitted while it lasts, so it holds at most the two limits together (before: A's window
    /// found its own count dropped, and took 10 more on top of 16).
    #[test]
    fn periods_that_do_not_nest_keep_each_others_counts() {
        let ten = quota(10, 600_000);
        let fifteen = quota(15, 900_000);
        let minute = |m: u64| T0 + m * 60_000_000;
        let mut a = Sim::new(&ten, minute(10));
        assert!(a.consume(10).allowed);
        let mut b = a.with_quota(&fifteen);
        b.now = minute(12);
        assert!(b.consume(5).allowed, "15 in B's window [0, 15)");
        assert!(!b.consume(1).allowed);
        b.now = minute(15) + 30_000_000;
        assert!(b.consume(1).allowed, "B's own next window");
        let mut back = b.with_quota(&ten);
        back.now = minute(16);
        let d = back.consume(1);
        assert!(!d.allowed, "A's window [10, 20) holds 16: {d:?}");
        assert_eq!(d.retry_after, Some(ms(240_000)));
    }

    /// Three periods, rolled one after the other (a day's 1,000, then an hour's 100, then a
    /// minute's 10): the day's count is held through both, and the hour never starts afresh
    /// while the minute writes.
    #[test]
    fn a_days_count_is_held_through_an_hour_and_a_minute() {
        let day = quota(1_000, 86_400_000);
        let hour = quota(100, 3_600_000);
        let minute = quota(10, 60_000);
        let at = |h: u64, m: u64| T0 + (h * 60 + m) * 60_000_000;
        let mut d = Sim::new(&day, at(9, 0));
        assert!(d.consume(950).allowed);
        let mut h = d.with_quota(&hour);
        h.now = at(10, 0);
        assert!(
            !h.consume(1).allowed,
            "the day's 950 carried into this hour"
        );
        let mut m = h.with_quota(&minute);
        m.now = at(12, 5);
        assert!(
            !m.consume(1).allowed,
            "the held count carried into this minute"
        );
        m.now = at(12, 6);
        assert!(m.consume(10).allowed, "the minute's own next window");
        let mut h = m.with_quota(&hour);
        h.now = at(12, 6) + 40_000_000;
        assert!(
            !h.consume(1).allowed,
            "the hour reads the day's count, not a fresh hour"
        );
        let mut d = h.with_quota(&day);
        d.now = at(12, 10);
        let back = d.consume(1);
        assert_eq!(
            back.remaining,
            1_000 - 960 - 1,
            "the day's 950, the minute's 10, and this one"
        );
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
        fn admits_exactly_what_fits_its_window(
            limit in 1u64..20,
            period_ms in 1u64..50,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = quota(limit, period_ms);
            let p = q.period_us();
            run_against_reference(&q, &arrivals, |admitted, t, cost| {
                let counted: u64 = admitted
                    .iter()
                    .filter(|(at, _)| at / p == t / p)
                    .map(|(_, c)| c)
                    .sum();
                counted + cost <= limit
            })?;
        }

        #[test]
        fn retry_after_is_exact(limit in 1u64..20, period_ms in 1u64..50, arrivals in arrivals_strategy(60, 30)) {
            check_retry_exact_over(&quota(limit, period_ms), &arrivals)?;
        }
    }
}
