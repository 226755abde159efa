//! Leasing: taking a block of permits at once, to spend them in process memory, and giving back
//! what was not spent.
//!
//! A lease deducts its permits from the shared state when it is granted, so the fleet can never
//! spend more than the state allowed. It is valid until `valid_until`:
//! - window algorithms (fixed window, sliding window counter): at most the end of the window
//!   that granted the permits, so they are spent inside that window;
//! - bucket algorithms (token bucket, GCRA): `max_validity` after the grant. A permit spent up to
//!   `max_validity` after it was deducted is seen by the bucket as older than it is, so in any
//!   interval `t` the fleet admits at most `burst + rate × (t + max_validity)`: the bucket's
//!   envelope, widened by the validity. (Holding back refill at grant time cannot close that gap:
//!   direct requests may take what was held back.) For an exact bound, lease a window algorithm.
//!
//! The sliding window log cannot be leased: its promise rests on each permit's own timestamp.

//!
//! Unspent permits go back through the block's receipt, as any refund: a window's permits while
//! that window lasts, a bucket's as far as it has not refilled them since the grant.

use super::State;
use crate::{Quota, Taken};

/// What a lease granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Granted {
    pub(crate) permits: u64,
    /// Until when they may be spent (µs, the store's clock).
    pub(crate) valid_until: u64,
    /// Where they were taken: give unspent ones back through it.
    pub(crate) taken: Taken,
}

impl State {
    /// Whether this algorithm can be leased.
    pub(crate) fn leasable(quota: &Quota) -> bool {
        !matches!(quota.algorithm(), crate::Algorithm::SlidingLog)
    }

    /// Take up to `max` permits for at most `max_validity` µs. `None` for the sliding log.
    pub(crate) fn lease(
        &mut self,
        now: u64,
        quota: &Quota,
        max: u64,
        max_validity: u64,
    ) -> Option<Granted> {
        // Bring the state up to `now` first (a decision changes nothing else).
        self.decide(now, quota, 1);
        let until = now + max_validity;
        let granted = match self {
            State::FixedWindow(s) => {
                let permits = max.min(quota.limit().saturating_sub(s.count));
                s.count_now(now, permits);
                Granted {
                    permits,
                    valid_until: until.min(s.start + s.period),
                    taken: s.taken(now, permits),
                }
            }
            State::SlidingWindow(s) => {
                let (permits, spend_by) = s.lease(now, quota, max);
                Granted {
                    permits,
                    valid_until: until.min(spend_by),
                    taken: s.taken(now, permits),
                }
            }
            State::TokenBucket(s) => {
                let permits = s.take_up_to(quota, max);
                Granted {
                    permits,
                    valid_until: until,
                    taken: s.taken(permits),
                }
            }
            State::Gcra(s) => {
                let t = quota.emission_us();
                let horizon = quota.burst() * t;
                let tat = s.tat.max(now);
                let permits = max.min(horizon.saturating_sub(tat - now) / t);
                s.tat = tat + permits * t;
                Granted {
                    permits,
                    valid_until: until,
                    taken: s.taken(now, permits),
                }
            }
            State::SlidingLog(_) => return None,
        };
        Some(granted)
    }

    /// Give back `unspent` permits of a block granted as `taken`.
    #[cfg(test)]
    pub(crate) fn release(&mut self, now: u64, quota: &Quota, taken: Taken, unspent: u64) {
        self.decide(now, quota, 1);
        self.refund(now, quota, taken.part(unspent));
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::Algorithm;

    #[test]
    fn window_leases_end_with_the_window() {
        let q = quota_of(Algorithm::FixedWindow, 10, 1000, None);
        let mut s = Sim::new(&q, T0 + 900_000);
        let g = s.state.lease(s.now, &q, 4, 5_000_000).unwrap();
        assert_eq!((g.permits, g.valid_until), (4, T0 + 1_000_000));
        let g = s.state.lease(s.now, &q, 100, 50_000).unwrap();
        assert_eq!(
            (g.permits, g.valid_until),
            (6, T0 + 950_000),
            "what is left, for max_validity"
        );
        assert!(
            !s.consume(1).allowed,
            "leased permits are taken from the shared budget"
        );
        s.state.release(s.now, &q, g.taken, 3);
        assert_eq!(s.peek().remaining, 3, "unspent permits come back");
        s.state.release(T0 + 960_000, &q, g.taken, 3);
        s.now = T0 + 960_000;
        assert_eq!(
            s.peek().remaining,
            6,
            "a window's permits come back until the window ends, past the block's validity"
        );
        s.now = T0 + 1_000_000;
        s.state.release(s.now, &q, g.taken, 3);
        assert_eq!(
            s.peek().remaining,
            10,
            "nothing owed to a window that is over"
        );
    }

    #[test]
    fn bucket_leases_take_what_is_there_for_max_validity() {
        for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let q = quota_of(algorithm, 10, 1000, Some(10));
            let mut s = Sim::new(&q, T0);
            let g = s.state.lease(s.now, &q, 4, 100_000).unwrap();
            assert_eq!((g.permits, g.valid_until), (4, T0 + 100_000));
            let g = s.state.lease(s.now, &q, 100, 100_000).unwrap();
            assert_eq!(g.permits, 6, "{algorithm}");
            assert_eq!(s.peek().remaining, 0);
            s.state.release(s.now, &q, g.taken, 6);
            assert_eq!(s.peek().remaining, 6, "{algorithm}");
        }
    }

    #[test]
    fn the_log_cannot_be_leased() {
        let q = quota_of(Algorithm::SlidingLog, 10, 1000, None);
        let mut s = Sim::new(&q, T0);
        assert_eq!(s.state.lease(s.now, &q, 5, 1000), None);
    }

    use proptest::prelude::*;

    const MAX_VALIDITY: u64 = 400_000;

    /// A fleet of 3 processes leasing from one state, spending their blocks at random times,
    /// beside direct consumes and early releases: returns every real admission (time, 1).
    fn fleet_admissions(q: &crate::Quota, events: &[(u64, u8, u64)]) -> Vec<(u64, u64)> {
        let mut s = Sim::new(q, T0 + 7_777);
        // (permits, valid_until, receipt)
        let mut blocks: [(u64, u64, Option<crate::Taken>); 3] = [(0, 0, None); 3];
        let mut admitted = Vec::new();
        for &(gap, action, arg) in events {
            s.advance_us(gap);
            let p = (arg % 3) as usize;
            match action % 4 {
                0 => {
                    if let Some(g) =
                        s.state
                            .lease(s.now, q, 1 + arg % 7, 1 + arg.wrapping_mul(7_919) % 400_000)
                    {
                        blocks[p] = (g.permits, g.valid_until, Some(g.taken));
                    }
                }
                1 => {
                    let (permits, until, _) = blocks[p];
                    if permits > 0 && s.now < until {
                        blocks[p].0 -= 1;
                        admitted.push((s.now, 1));
                    }
                }
                2 => {
                    if s.consume(1).allowed {
                        admitted.push((s.now, 1));
                    }
                }
                _ => {
                    if let (permits, _, Some(taken)) = blocks[p] {
                        s.state.release(s.now, q, taken, permits);
                    }
                    blocks[p] = (0, 0, None);
                }
            }
        }
        admitted
    }

    fn events() -> impl Strategy<Value = Vec<(u64, u8, u64)>> {
        prop::collection::vec((0u64..60_000, any::<u8>(), any::<u64>()), 1..300)
    }

    proptest! {
        #[test]
        fn leased_fixed_windows_never_exceed_the_limit(limit in 1u64..20, period_ms in 5u64..200, ev in events()) {
            let q = quota_of(Algorithm::FixedWindow, limit, period_ms, None);
            let admitted = fleet_admissions(&q, &ev);
            let mut per_window = std::collections::HashMap::new();
            for (t, c) in admitted {
                *per_window.entry(t / q.period_us()).or_insert(0u64) += c;
            }
            prop_assert!(per_window.values().all(|&n| n <= limit));
        }

        /// The default algorithm, leased: a window's count never passes the limit, so no aligned
        /// window holds more than the limit, spends from blocks included, fleet-wide.
        #[test]
        fn leased_sliding_windows_never_exceed_the_limit_per_window(limit in 1u64..20, period_ms in 5u64..200, ev in events()) {
            let q = quota_of(Algorithm::SlidingWindow, limit, period_ms, None);
            let admitted = fleet_admissions(&q, &ev);
            let mut per_window = std::collections::HashMap::new();
            for (t, c) in admitted {
                *per_window.entry(t / q.period_us()).or_insert(0u64) += c;
            }
            prop_assert!(per_window.values().all(|&n| n <= limit), "{:?}", per_window);
        }

        #[test]
        fn leased_buckets_keep_the_envelope_widened_by_the_validity(limit in 1u64..20, period_ms in 5u64..200, burst in 1u64..20, gcra in any::<bool>(), ev in events()) {
            let algorithm = if gcra { Algorithm::Gcra } else { Algorithm::TokenBucket };
            let q = quota_of(algorithm, limit, period_ms, Some(burst));
            let admitted = fleet_admissions(&q, &ev);
            check_envelope_with_slack(&admitted, limit, q.period_us(), burst, MAX_VALIDITY)?;
        }
    }
}
