//! Token bucket: `burst` tokens, refilled continuously at `limit / period`; a request takes
//! `cost` tokens.
//!
//! Tokens are counted in integer units so that refilling is exact: one token is `scale` units and
//! the bucket gains `rate` units per microsecond, where `scale / rate = period / limit` in lowest
//! terms.
//!
//! Promise: never more than `burst + limit × t / period` permits in any interval of length `t`.

use super::{div_ceil, never, us};
use crate::{Decision, Quota};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    /// Tokens in the bucket at `last`, in units.
    pub(crate) units: u64,
    /// When `units` was last brought up to date (µs).
    pub(crate) last: u64,
}

/// Units per token and units refilled per microsecond, in lowest terms.
fn scale_and_rate(quota: &Quota) -> (u64, u64) {
    (quota.token_units(), quota.refill_units())
}

impl TokenBucket {
    pub(crate) fn full(quota: &Quota) -> TokenBucket {
        let (scale, _) = scale_and_rate(quota);
        TokenBucket {
            units: quota.burst() * scale,
            last: 0,
        }
    }

    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let (scale, rate) = scale_and_rate(quota);
        let burst = quota.burst();
        let full = burst * scale;
        // A state left by a rule with a larger burst is read as a full bucket.
        self.units = self.units.min(full);
        // Refill, without multiplying a long idle time by the rate (it could overflow).
        let elapsed = now.saturating_sub(self.last);
        let missing = full - self.units;
        if elapsed >= div_ceil(missing, rate) {
            self.units = full;
        } else {
            self.units += elapsed * rate;
        }
        self.last = self.last.max(now);

        let remaining = self.units / scale;
        let reset_after = div_ceil(full - self.units, rate);
        if cost > burst {
            return never(burst, remaining, reset_after);
        }
        let need = cost * scale;
        if self.units >= need {
            let left = self.units - need;
            Decision::admit(burst, left / scale, us(div_ceil(full - left, rate)))
        } else {
            let retry = div_ceil(need - self.units, rate);
            Decision::deny(burst, remaining, us(reset_after), Some(us(retry)))
        }
    }

    pub(crate) fn commit(&mut self, quota: &Quota, cost: u64) {
        let (scale, _) = scale_and_rate(quota);
        self.units -= cost * scale;
    }

    pub(crate) fn refund(&mut self, quota: &Quota, cost: u64) {
        let (scale, _) = scale_and_rate(quota);
        let cost = cost.min(quota.burst());
        self.units = (self.units + cost * scale).min(quota.burst() * scale);
    }

    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        let (scale, rate) = scale_and_rate(quota);
        let full = quota.burst() * scale;
        if self.units >= full {
            0
        } else {
            self.last + div_ceil(full - self.units, rate)
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
        s.refund(10);
        assert_eq!(s.peek().remaining, 5);
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
