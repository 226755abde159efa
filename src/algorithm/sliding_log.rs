//! Sliding window log: one timestamp per admitted permit.
//!
//! Promise: exact. At most `limit` permits in every window `(t - period, t]`. The price is
//! state: one entry per admitted permit, so a quota's limit is capped (see
//! [`QuotaBuilder::max_log_len`](crate::QuotaBuilder::max_log_len)).
//!
//! Refunds: a receipt names the timestamp of the entries its request added; a refund removes
//! entries of that timestamp only (never another request's), so the log is what it would be had
//! the request never come. A receipt from before the log's first permit (or, in the memory
//! store, before it was copied from the shared overflow state) refunds nothing.
//!
//! Quota changes: entries are timestamps, so a new limit or period reads them as they are. A
//! longer period sees the entries the log still holds, not those already dropped, and a store
//! drops the whole log once the shorter period has passed its last entry (Redis by its own
//! clock, to the millisecond; the memory store when it sweeps): the promise under the new period
//! holds from one new period after the change, and until then the two stores can count a
//! lengthened log differently. (The other algorithms convert a state the old quota has let go
//! to a fresh one, so there they agree.) The same holds whenever two periods reach one key (an
//! override set and lifted, two per-request plans): the longer one's entries, forgotten under
//! the shorter, are not counted again, so a log's rule is to keep one period for every key. Only a consume forgets expired entries: a peek or a
//! refund may read the log under a quota not the key's own (an inspection under the rule's
//! quota, where the key's is decided per request), and a shorter period would drop entries the
//! key's own still counts.

use std::collections::VecDeque;

use super::{never, receipt, us};
use crate::{Algorithm, Decision, Quota, Taken};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlidingLog {
    /// Admission times (µs), oldest first; a request of cost `c` adds `c` entries. An entry at
    /// `ts` counts until `ts + period`.
    pub(crate) entries: VecDeque<u64>,
    /// Receipts from before this time (µs) refund nothing: the log was created, or copied from
    /// a state it did not lend its entries to (the memory store's shared overflow state), then.
    /// Without it, an evicted predecessor's receipt removed an entry another request added in
    /// the same microsecond. 0 until the first permit is taken.
    pub(crate) valid_from: u64,
}

impl SlidingLog {
    /// Times never run backwards inside the log: a clock that stepped back is read as the
    /// newest entry.
    fn effective_now(&self, now: u64) -> u64 {
        self.entries.back().map_or(now, |&last| now.max(last))
    }

    #[inline(always)]
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let period = quota.period_us();
        let clock = now;
        let now = self.effective_now(now);
        while self.entries.front().is_some_and(|&ts| ts + period <= now) {
            self.entries.pop_front();
        }
        self.decide_from(0, now, now - clock, quota, cost)
    }

    /// [`decide`](SlidingLog::decide) without forgetting expired entries: what a peek or a
    /// refund reads. It may read the log under a quota not the key's own (an inspection under
    /// the rule's quota, where the key's is decided per request), whose shorter period would
    /// drop entries the key's own period still counts.
    pub(crate) fn read(&self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let period = quota.period_us();
        let clock = now;
        let now = self.effective_now(now);
        let first = self.entries.partition_point(|&ts| ts + period <= now);
        self.decide_from(first, now, now - clock, quota, cost)
    }

    /// The decision on the entries from index `first` on, at `now` (already effective), the
    /// clock being `behind` it (it stepped back): the waits are the clock's, the log's time
    /// plus what the clock has yet to catch up.
    #[inline(always)]
    fn decide_from(
        &self,
        first: usize,
        now: u64,
        behind: u64,
        quota: &Quota,
        cost: u64,
    ) -> Decision {
        let period = quota.period_us();
        let limit = quota.limit();
        let count = (self.entries.len() - first) as u64;
        let remaining = limit.saturating_sub(count);
        let reset_after = match self.entries.back() {
            Some(&last) if count > 0 => last + period - now + behind,
            _ => 0,
        };
        if cost > limit {
            return never(limit, remaining, reset_after);
        }
        if count + cost <= limit {
            Decision::admit(limit, remaining - cost, us(period + behind))
        } else {
            // The request fits once the oldest `count + cost - limit` entries have expired.
            let must_expire = (count + cost - limit) as usize;
            let retry = self.entries[first + must_expire - 1] + period - now + behind;
            Decision::deny(limit, remaining, us(reset_after), Some(us(retry)))
        }
    }

    #[inline(always)]
    pub(crate) fn commit(&mut self, now: u64, cost: u64) -> Taken {
        let now = self.effective_now(now);
        self.entries.extend(std::iter::repeat_n(now, cost as usize));
        receipt(&mut self.valid_from, now, cost, Algorithm::SlidingLog)
    }

    pub(crate) fn refund(&mut self, taken: Taken) {
        if taken.at < self.valid_from {
            return;
        }
        // Entries are sorted: those of one timestamp stand together.
        let end = self.entries.partition_point(|&ts| ts <= taken.at);
        let start = self.entries.partition_point(|&ts| ts < taken.at);
        let n = (end - start).min(usize::try_from(taken.cost).unwrap_or(usize::MAX));
        self.entries.drain(end - n..end);
    }

    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        self.entries
            .back()
            .map_or(0, |&last| last + quota.period_us())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::Algorithm;
    use proptest::prelude::*;

    fn quota(limit: u64, period_ms: u64) -> crate::Quota {
        quota_of(Algorithm::SlidingLog, limit, period_ms, None)
    }

    /// After the clock steps back (a failover to a host 2.5 s behind), the waits are the
    /// clock's: counted from the newest entry's time, a client obeying them came back 2.5 s
    /// early and was refused again.
    #[test]
    fn a_clock_that_stepped_back_waits_exactly() {
        let q = quota(5, 10_000);
        let mut s = Sim::new(&q, T0 + 100_000_000);
        assert!(s.consume(5).allowed);
        s.now -= 2_500_000;
        let d = s.consume(1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(ms(12_500)));
        assert_eq!(d.reset_after, ms(12_500));
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn exact_in_every_window_across_the_boundary() {
        let q = quota(5, 1000);
        let mut s = Sim::new(&q, T0 + 999_000);
        assert!(s.consume(5).allowed);
        s.advance_us(1_000); // a new aligned window, but the log still sees all five
        let d = s.consume(1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(ms(999)));
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn retry_waits_for_enough_entries_to_expire() {
        let q = quota(4, 100);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(1).allowed); // t0
        s.advance_ms(10);
        assert!(s.consume(1).allowed); // t10
        s.advance_ms(10);
        assert!(s.consume(2).allowed); // t20 x2
        let d = s.consume(2);
        assert!(!d.allowed);
        // Two must expire: t0 at 100, t10 at 110. Now is 20: retry in 90 ms.
        assert_eq!(d.retry_after, Some(ms(90)));
        assert_retry_is_exact(&s, 2);
        assert!(s.consume(5).never_admissible());
    }

    #[test]
    fn refund_removes_its_own_entries() {
        let q = quota(2, 100);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(2).allowed);
        let both = s.last_taken();
        s.refund(both);
        assert_eq!(s.peek().remaining, 2);
    }

    /// The soundness issue's sliding-log scenario: refunding A must remove A, not B.
    #[test]
    fn refund_of_an_older_request_keeps_the_newer_one() {
        let q = quota(2, 1000);
        let mut s = Sim::new(&q, T0);
        s.consume(1);
        let a = s.last_taken();
        s.advance_ms(500);
        assert!(s.consume(1).allowed);
        s.advance_ms(100);
        s.refund(a);
        s.advance_ms(400);
        assert!(s.consume(1).allowed, "C at 1.0 s");
        assert!(!s.consume(1).allowed, "D at 1.0 s: B and C are in (0, 1]");
    }

    proptest! {
        #[test]
        fn at_most_limit_in_every_sliding_window(
            limit in 1u64..20,
            period_ms in 1u64..50,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = quota(limit, period_ms);
            let admitted = run(&q, &arrivals);
            prop_assert!(max_in_any_window(&admitted, q.period_us()) <= limit);
        }

        #[test]
        fn admits_exactly_what_fits_every_window(
            limit in 1u64..20,
            period_ms in 1u64..50,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = quota(limit, period_ms);
            let p = q.period_us();
            run_against_reference(&q, &arrivals, |admitted, t, cost| {
                let alive: u64 = admitted
                    .iter()
                    .filter(|(at, _)| at + p > t)
                    .map(|(_, c)| c)
                    .sum();
                alive + cost <= limit
            })?;
        }

        #[test]
        fn retry_after_is_exact(limit in 1u64..20, period_ms in 1u64..50, arrivals in arrivals_strategy(60, 30)) {
            check_retry_exact_over(&quota(limit, period_ms), &arrivals)?;
        }
    }
}
