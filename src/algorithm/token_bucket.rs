//! Token bucket: `burst` tokens, refilled continuously at `limit / period`; a request takes
//! `cost` tokens.
//!
//! Tokens are counted in integer units so that refilling is exact: one token is `scale` units and
//! the bucket gains `rate` units per microsecond, where `scale / rate = period / limit` in lowest
//! terms.
//!
//! Promise: never more than `burst + limit × t / period` permits in any interval of length `t`.
//!
//! Refunds: a receipt names when the bucket was debited. Had the request never come, the bucket
//! would hold its cost more, less whatever refill a full bucket would have wasted since, at most
//! `rate × elapsed`. A refund gives back `cost − rate × elapsed` (nothing once the bucket could
//! have refilled the debt), so it never lifts the bucket above what it would be without the
//! request.
//!
//! Quota changes: the state is what a full bucket misses, with its scale (units per token) and
//! rate; a state written under another quota is first refilled at its own rate up to now (what
//! that quota let go stays let go, as it would had the store dropped the expired state), then
//! converted to the same number of missing tokens, rounded up (a full bucket stays full). The debt is kept even where it exceeds a smaller bucket, so two
//! quotas writing one key never hold more than the larger burst, and refill at most at the
//! faster rate.

use super::{div_ceil, never, receipt, rescale_ceil, us, RESCALE_CAP};
use crate::{Algorithm, Decision, Quota, Taken};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    /// Units missing from a full bucket at `last` (a full bucket misses none, whatever the
    /// quota).
    pub(crate) missing: u64,
    /// When `missing` was last brought up to date (µs).
    pub(crate) last: u64,
    /// Units per token when `missing` was written.
    pub(crate) scale: u64,
    /// Units refilled per µs when `missing` was written.
    pub(crate) rate: u64,
    /// Receipts from before this time (µs) refund nothing: the state was created, or written
    /// under another quota, then (a refund assumes the refill rate since the debit was its own).
    /// 0 until the first permit is taken.
    pub(crate) valid_from: u64,
}

/// Units per token and units refilled per microsecond, in lowest terms.
fn scale_and_rate(quota: &Quota) -> (u64, u64) {
    (quota.token_units(), quota.refill_units())
}

impl TokenBucket {
    pub(crate) fn full(quota: &Quota) -> TokenBucket {
        TokenBucket {
            missing: 0,
            last: 0,
            scale: quota.token_units(),
            rate: quota.refill_units(),
            valid_from: 0,
        }
    }

    #[inline(always)]
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let (scale, rate) = scale_and_rate(quota);
        let burst = quota.burst();
        let full = burst * scale;
        if self.scale != scale || self.rate != rate {
            // The time since the last write refills at the rate it was written under, before
            // the conversion: a state that rate has refilled is a full bucket under any quota,
            // as it is once expired (Redis drops its key, the memory store may sweep it).
            // Refilled at the new rate, a debt long paid under a fast quota came back whole
            // under a slow one, and only where the state had not been dropped yet.
            self.refill(now, self.rate.max(1));
            self.missing = rescale_ceil(self.missing, self.scale, scale);
            self.scale = scale;
            self.rate = rate;
            self.valid_from = now;
        }
        // A state left by a rule with a larger burst may miss more than this whole bucket: it
        // keeps that debt, so the larger rule reading it back never sees permits come back.
        self.refill(now, rate);
        // The bucket refills from `last` on: after a clock that stepped back, `now` has that far
        // to go first, and the waits are counted from `now`.
        let behind = self.last - now;

        let units = full.saturating_sub(self.missing);
        let remaining = units / scale;
        let reset_after = behind + div_ceil(self.missing, rate);
        if cost > burst {
            return never(burst, remaining, reset_after);
        }
        let need = cost * scale;
        if units >= need {
            let left = units - need;
            Decision::admit(
                burst,
                left / scale,
                us(behind + div_ceil(full - left, rate)),
            )
        } else {
            // The wait until `missing` has fallen to `full - need` (it may exceed `full`).
            let retry = behind + div_ceil(self.missing + need - full, rate);
            Decision::deny(burst, remaining, us(reset_after), Some(us(retry)))
        }
    }

    /// Refill from `last` to `now` at `rate` units per µs, without multiplying a long idle time
    /// by the rate (it could overflow).
    #[inline(always)]
    fn refill(&mut self, now: u64, rate: u64) {
        let elapsed = now.saturating_sub(self.last);
        if elapsed >= div_ceil(self.missing, rate) {
            self.missing = 0;
        } else {
            self.missing -= elapsed * rate;
        }
        self.last = self.last.max(now);
    }

    /// Whether converting this state to `quota` at `now` cuts its debt at [`RESCALE_CAP`]: a
    /// debt past what any quota's bucket holds, refused under it whatever the cut, and lost if
    /// the cut state were kept (read back under its own quota, most of the debt gone).
    pub(crate) fn conversion_clamps(&self, now: u64, quota: &Quota) -> bool {
        let mut before = self.clone();
        before.refill(now, before.rate.max(1));
        rescale_ceil(before.missing, before.scale, quota.token_units()) >= RESCALE_CAP
    }

    #[inline(always)]
    pub(crate) fn commit(&mut self, quota: &Quota, cost: u64) -> Taken {
        self.missing += cost * quota.token_units();
        self.taken(cost)
    }

    /// A receipt for `cost` tokens debited now (at `last`).
    pub(crate) fn taken(&mut self, cost: u64) -> Taken {
        receipt(
            &mut self.valid_from,
            self.last,
            cost,
            Algorithm::TokenBucket,
        )
    }

    pub(crate) fn refund(&mut self, now: u64, quota: &Quota, taken: Taken) {
        if taken.at < self.valid_from {
            return;
        }
        let (scale, rate) = scale_and_rate(quota);
        let debt = taken.cost.min(quota.burst()) * scale;
        // From the latest time the bucket was refilled to, not a clock that stepped back
        // behind it: that would give back debt already refilled.
        let elapsed = now.max(self.last).saturating_sub(taken.at);
        if elapsed >= div_ceil(debt, rate) {
            return;
        }
        self.missing = self.missing.saturating_sub(debt - elapsed * rate);
    }

    /// Take up to `max` whole tokens; returns how many.
    pub(crate) fn take_up_to(&mut self, quota: &Quota, max: u64) -> u64 {
        let scale = quota.token_units();
        let units = (quota.burst() * scale).saturating_sub(self.missing);
        let permits = max.min(units / scale);
        self.missing += permits * scale;
        permits
    }

    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        let (_, rate) = scale_and_rate(quota);
        if self.missing == 0 {
            0
        } else {
            self.last + div_ceil(self.missing, rate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::Algorithm;
    use proptest::prelude::*;

    fn quota(limit: u64, period_ms: u64, burst: u64) -> crate::Quota {
        quota_of(Algorithm::TokenBucket, limit, period_ms, Some(burst))
    }

    /// The clock steps back before a refund: the debt already refilled by the bucket's latest
    /// time is not given back again, and a refusal's wait is counted from the earlier clock,
    /// exactly.
    #[test]
    fn a_clock_that_stepped_back_creates_nothing_and_waits_exactly() {
        let q = quota(10, 1000, 10);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(10).allowed);
        let first = s.last_taken();
        s.advance_ms(1000);
        assert!(s.consume(10).allowed);
        s.now = T0 + 500_000;
        s.refund(first);
        let d = s.consume(1);
        assert!(!d.allowed, "the first ten were refilled already: {d:?}");
        assert_eq!(
            d.retry_after,
            Some(ms(600)),
            "100 ms after the latest time, 1.1 s"
        );
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn burst_then_refill_at_rate() {
        let q = quota(10, 1000, 5); // one token per 100 ms, five at most
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(5).allowed);
        let d = s.consume(1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(ms(100)));
        assert_eq!(d.reset_after, ms(500));
        assert_retry_is_exact(&s, 1);
        s.advance_ms(250);
        let d = s.consume(2);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        let d = s.consume(3);
        assert_eq!(d.retry_after, Some(ms(250)), "0.5 tokens left, 2.5 to go");
        assert_retry_is_exact(&s, 3);
        assert!(s.consume(6).never_admissible());
    }

    #[test]
    fn uneven_rates_refill_exactly() {
        let q = quota(3, 1000, 1); // one token per 333.33… ms
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(1).allowed);
        let d = s.consume(1);
        assert_eq!(
            d.retry_after,
            Some(std::time::Duration::from_micros(333_334))
        );
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn long_idle_refills_without_overflow() {
        let q = quota(1_000_000, 1, 1_000_000);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(1_000_000).allowed);
        s.advance_ms(300 * 86_400_000);
        assert_eq!(s.peek().remaining, 1_000_000);
    }

    #[test]
    fn refund_caps_at_burst() {
        let q = quota(10, 1000, 5);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(2).allowed);
        let two = s.last_taken();
        s.refund(two);
        s.refund(two);
        assert_eq!(s.peek().remaining, 5);
    }

    /// The soundness issue's bucket scenario: X at 0 s, full again by 0.2 s, 10 admitted at
    /// 0.2 s, X refunded: no eleventh permit.
    #[test]
    fn refund_after_refill_gives_nothing() {
        let q = quota(10, 1000, 10);
        let mut s = Sim::new(&q, T0);
        s.consume(1);
        let x = s.last_taken();
        s.advance_ms(200);
        for _ in 0..10 {
            assert!(s.consume(1).allowed);
        }
        s.refund(x);
        assert!(!s.consume(1).allowed, "11 in zero time");
        // Part of a debt refilled: only the rest comes back.
        let mut s = Sim::new(&q, T0);
        s.consume(10);
        let ten = s.last_taken();
        s.advance_ms(250); // 2.5 tokens refilled
        s.refund(ten);
        assert_eq!(s.peek().remaining, 10, "2.5 + (10 − 2.5)");
        let mut s = Sim::new(&q, T0);
        s.consume(10);
        let ten = s.last_taken();
        s.advance_ms(250);
        s.consume(2);
        s.refund(ten);
        assert_eq!(s.peek().remaining, 8, "the later request stays counted");
    }

    /// Another rate refilled the bucket since the debit: the refund cannot assume its own rate,
    /// so it gives nothing (A at 1/s and B at 3/s, both burst 30, one scale).
    #[test]
    fn a_refund_after_another_rate_wrote_gives_nothing() {
        let a = quota(1, 1000, 30);
        let b = quota(3, 1000, 30);
        let mut s = Sim::new(&a, T0);
        s.consume(10);
        let x = s.last_taken();
        let mut on_b = s.with_quota(&b);
        on_b.advance_ms(2_000);
        assert!(on_b.consume(20).allowed);
        let mut back = on_b.with_quota(&a);
        back.refund(x);
        assert_eq!(
            back.peek().remaining,
            2,
            "28 missing of 30 (the 2 s before b's first write refilled at a's rate): the refund \
             gave nothing"
        );
    }

    /// The soundness issue's scale scenario: 1001/s then 1000/s on one key.
    #[test]
    fn a_new_quota_reads_tokens_not_units() {
        let before = quota(1001, 1000, 1001);
        let mut s = Sim::new(&before, T0);
        assert!(s.consume(1000).allowed);
        let after = quota(1000, 1000, 1000);
        let mut a = s.with_quota(&after);
        assert_eq!(a.peek().remaining, 0, "1000 tokens missing of 1000");
        let mut total = 0;
        for _ in 0..2000 {
            if a.consume(1).allowed {
                total += 1;
            }
        }
        assert_eq!(total, 0);
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
