//! GCRA, the generic cell rate algorithm: the token bucket's envelope kept as one timestamp,
//! the theoretical arrival time (TAT) of the next request if the key sent exactly at its rate.
//!
//! Each permit moves the TAT forward by the emission interval `T = period / limit` (rounded up
//! to a whole microsecond, so never faster than configured). A request is admitted when the new
//! TAT lies at most `burst × T` ahead of now.
//!
//! Promise: never more than `burst + t / T` permits in any interval of length `t`.
//!
//! Refunds: as for the token bucket, a receipt names when the TAT was moved. Had the request
//! never come, the TAT would be `cost × T` earlier, less the time since (a TAT never falls
//! behind now), so a refund moves it back by `cost × T − elapsed` at most, never before now.
//!
//! Quota changes: the state records its emission interval. A TAT written under another interval
//! is converted to the same number of permits used (`ahead × T_new / T_old`, rounded up; kept
//! even past the new burst, so the other quota reading it back sees the same debt), so two
//! quotas writing one key never admit more than the larger burst. Receipts from before a change
//! of interval refund nothing, even when the key was idle at the change: their debt would be
//! sized by the new interval.

use super::{never, receipt, rescale_ceil, us, RESCALE_CAP};
use crate::{Algorithm, Decision, Quota, Taken};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Gcra {
    /// The theoretical arrival time (µs); in the past means a full burst is available.
    pub(crate) tat: u64,
    /// The emission interval (µs) the TAT was written under; 0 for a fresh state.
    pub(crate) emission: u64,
    /// Receipts from before this time (µs) refund nothing: the state was created, or written
    /// under another interval, then. 0 until the first permit is taken.
    pub(crate) valid_from: u64,
    /// The latest time (µs) the state was decided at. A refund measures the debt already paid
    /// back from it, not from a clock that stepped back (an NTP step, a failover to a replica
    /// behind, an instance's own clock behind another's), which would give back debt the
    /// state had already let go: permits made from nothing.
    pub(crate) latest: u64,
}

impl Gcra {
    #[inline(always)]
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let t = quota.emission_us();
        let burst = quota.burst();
        let horizon = burst * t;
        if self.emission != t {
            if self.emission != 0 {
                if self.tat > now {
                    self.tat = now + rescale_ceil(self.tat - now, self.emission, t);
                }
                // Even an idle state: a receipt's debt is sized by the interval in force, and
                // one from before the change would be sized by the new one.
                self.valid_from = now;
            }
            self.emission = t;
        }
        self.latest = self.latest.max(now);
        let tat = self.tat.max(now);
        let ahead = tat - now;
        let remaining = horizon.saturating_sub(ahead) / quota.emission();
        if cost > burst {
            return never(burst, remaining, ahead);
        }
        let new_ahead = ahead + cost * t;
        if new_ahead <= horizon {
            // (horizon − new_ahead) / t, as horizon − ahead ≥ cost × t here.
            Decision::admit(burst, remaining - cost, us(new_ahead))
        } else {
            Decision::deny(burst, remaining, us(ahead), Some(us(new_ahead - horizon)))
        }
    }

    #[inline(always)]
    pub(crate) fn commit(&mut self, now: u64, quota: &Quota, cost: u64) -> Taken {
        self.tat = self.tat.max(now) + cost * quota.emission_us();
        self.taken(now, cost)
    }

    /// A receipt for `cost` permits taken at `now`.
    pub(crate) fn taken(&mut self, now: u64, cost: u64) -> Taken {
        receipt(&mut self.valid_from, now, cost, Algorithm::Gcra)
    }

    pub(crate) fn refund(&mut self, now: u64, quota: &Quota, taken: Taken) {
        if taken.at < self.valid_from {
            return;
        }
        let debt = taken.cost.min(quota.burst()) * quota.emission_us();
        let elapsed = now.max(self.latest).saturating_sub(taken.at);
        if elapsed >= debt {
            return;
        }
        self.tat = self.tat.saturating_sub(debt - elapsed).max(now);
    }

    /// Whether converting this state to `quota` at `now` cuts its lead at [`RESCALE_CAP`]: a
    /// debt past what any quota's horizon holds, refused under it whatever the cut, and lost if
    /// the cut state were kept (read back under its own interval, most of the debt gone).
    pub(crate) fn conversion_clamps(&self, now: u64, quota: &Quota) -> bool {
        self.tat > now
            && rescale_ceil(self.tat - now, self.emission, quota.emission_us()) >= RESCALE_CAP
    }

    pub(crate) fn expires_at(&self) -> u64 {
        self.tat
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::Algorithm;
    use proptest::prelude::*;

    fn quota(limit: u64, period_ms: u64, burst: u64) -> crate::Quota {
        quota_of(Algorithm::Gcra, limit, period_ms, Some(burst))
    }

    #[test]
    fn burst_then_one_per_interval() {
        let q = quota(10, 1000, 3); // T = 100 ms
        let mut s = Sim::new(&q, T0);
        for left in [2, 1, 0] {
            assert_eq!(s.consume(1).remaining, left);
        }
        let d = s.consume(1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(ms(100)));
        assert_eq!(d.reset_after, ms(300));
        assert_retry_is_exact(&s, 1);
        let d = s.consume(2);
        assert_eq!(d.retry_after, Some(ms(200)));
        assert_retry_is_exact(&s, 2);
        assert!(s.consume(4).never_admissible());
    }

    /// The clock steps back (an NTP step, a failover to a replica behind) before a refund:
    /// the debt the state had already let go by its latest time is not given back again.
    #[test]
    fn a_refund_after_the_clock_stepped_back_creates_nothing() {
        let q = quota(10, 1000, 10);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(10).allowed);
        let first = s.last_taken();
        s.advance_ms(1000);
        assert!(s.consume(10).allowed);
        s.now = T0 + 500_000;
        s.refund(first);
        s.now = T0 + 1_000_000;
        assert_eq!(
            s.peek().remaining,
            0,
            "the first ten were paid back already"
        );
    }

    #[test]
    fn refund_moves_tat_back_but_not_before_now() {
        let q = quota(10, 1000, 3);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(3).allowed);
        let three = s.last_taken();
        s.refund(three.part(1));
        assert_eq!(s.peek().remaining, 1);
        s.refund(three);
        assert_eq!(s.peek().remaining, 3);
    }

    #[test]
    fn refund_after_refill_gives_nothing() {
        let q = quota(10, 1000, 10); // T = 100 ms
        let mut s = Sim::new(&q, T0);
        s.consume(1);
        let x = s.last_taken();
        s.advance_ms(200);
        for _ in 0..10 {
            assert!(s.consume(1).allowed);
        }
        s.refund(x);
        assert!(!s.consume(1).allowed, "11 in zero time");
    }

    #[test]
    fn a_new_interval_reads_permits_used_not_time() {
        let fast = quota(20, 1000, 10); // T = 50 ms
        let mut s = Sim::new(&fast, T0);
        assert!(s.consume(10).allowed);
        // T = 100 ms: read as time, the TAT 500 ms ahead would be 5 permits used of 10.
        let slow = quota(10, 1000, 10);
        let mut l = s.with_quota(&slow);
        assert_eq!(l.peek().remaining, 0, "ten used, ten the burst");
        let mut total = 0;
        for _ in 0..30 {
            total += u64::from(l.consume(1).allowed);
        }
        assert_eq!(total, 0, "admitted on top of the other quota's burst");
    }

    proptest! {
        #[test]
        fn envelope_holds(
            limit in 1u64..20,
            period_ms in 1u64..50,
            burst in 1u64..20,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = quota(limit, period_ms, burst);
            let admitted = run(&q, &arrivals);
            check_envelope(&admitted, limit, q.period_us(), burst)?;
        }

        #[test]
        fn retry_after_is_exact(limit in 1u64..20, period_ms in 1u64..50, burst in 1u64..20, arrivals in arrivals_strategy(60, 30)) {
            check_retry_exact_over(&quota(limit, period_ms, burst), &arrivals)?;
        }
    }
}
