//! Test helpers shared by the algorithm tests: a simulated key on a manual timeline, random
//! arrival sequences, and the checks behind each algorithm's promise.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::State;
use crate::{Algorithm, Decision, Quota, Taken};

/// 2025-01-01T00:00:00Z in µs: aligned to every whole-second period.
pub(crate) const T0: u64 = 1_735_689_600_000_000;

pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub(crate) fn quota_of(
    algorithm: Algorithm,
    limit: u64,
    period_ms: u64,
    burst: Option<u64>,
) -> Quota {
    let mut b = Quota::new(limit, ms(period_ms)).algorithm(algorithm);
    if let Some(burst) = burst {
        b = b.burst(burst);
    }
    b.build().expect("valid test quota")
}

/// One key's state driven by hand.
#[derive(Clone)]
pub(crate) struct Sim<'q> {
    pub(crate) quota: &'q Quota,
    pub(crate) state: State,
    pub(crate) now: u64,
    /// The receipt of the last admission.
    taken: Option<Taken>,
}

impl<'q> Sim<'q> {
    pub(crate) fn new(quota: &'q Quota, now: u64) -> Self {
        Sim {
            quota,
            state: State::new(quota),
            now,
            taken: None,
        }
    }

    /// The same state and time, read under another quota (a rule changed).
    pub(crate) fn with_quota<'r>(&self, quota: &'r Quota) -> Sim<'r> {
        Sim {
            quota,
            state: self.state.clone(),
            now: self.now,
            taken: None,
        }
    }

    pub(crate) fn consume(&mut self, cost: u64) -> Decision {
        let d = self.state.decide(self.now, self.quota, cost);
        if d.allowed {
            self.taken = Some(self.state.commit(self.now, self.quota, cost));
        }
        d
    }

    /// The receipt of the last admission.
    pub(crate) fn last_taken(&self) -> Taken {
        self.taken.expect("an admission before")
    }

    /// The decision a request of cost 1 would get, without taking anything.
    pub(crate) fn peek(&mut self) -> Decision {
        let mut d = self.state.decide(self.now, self.quota, 1);
        if d.allowed {
            d.remaining += 1;
        }
        d
    }

    pub(crate) fn refund(&mut self, taken: Taken) {
        self.state.decide(self.now, self.quota, 1);
        self.state.refund(self.now, self.quota, taken);
    }

    pub(crate) fn advance_ms(&mut self, n: u64) {
        self.now += n * 1000;
    }

    pub(crate) fn advance_us(&mut self, n: u64) {
        self.now += n;
    }

    fn decide_at(&self, at: u64, cost: u64) -> Decision {
        let mut state = self.state.clone();
        state.decide(at, self.quota, cost)
    }
}

/// A denial's `retry_after` is exact: admitted at `now + retry_after`, denied one microsecond
/// (and so also one millisecond) earlier, assuming nothing else arrives.
pub(crate) fn retry_exactness(sim: &Sim<'_>, cost: u64) -> Result<(), String> {
    let d = sim.decide_at(sim.now, cost);
    if d.allowed {
        return Err(format!("expected a denial, got {d:?}"));
    }
    let Some(retry) = d.retry_after else {
        return Err(format!("expected a retry time, got {d:?}"));
    };
    let retry = retry.as_micros() as u64;
    if retry == 0 {
        return Err("a denial with a zero retry time".into());
    }
    let at = sim.now + retry;
    if !sim.decide_at(at, cost).allowed {
        return Err(format!("denied at now + retry_after ({retry} µs)"));
    }
    if sim.decide_at(at - 1, cost).allowed {
        return Err(format!("admitted 1 µs before retry_after ({retry} µs)"));
    }
    if retry >= 1000 && sim.decide_at(at - 1000, cost).allowed {
        return Err(format!("admitted 1 ms before retry_after ({retry} µs)"));
    }
    Ok(())
}

pub(crate) fn assert_retry_is_exact(sim: &Sim<'_>, cost: u64) {
    if let Err(e) = retry_exactness(sim, cost) {
        panic!("{e}");
    }
}

/// Arrivals as (gap before it in µs, cost): gaps up to `max_gap_ms`, costs mostly 1.
pub(crate) fn arrivals_strategy(
    max_len: usize,
    max_gap_ms: u64,
) -> impl Strategy<Value = Vec<(u64, u64)>> {
    let gap = prop_oneof![
        3 => Just(0u64),
        5 => 0..max_gap_ms * 1000,
        1 => (0..max_gap_ms).prop_map(|m| m * 1000),
    ];
    let cost = prop_oneof![6 => Just(1u64), 3 => 1u64..4, 1 => 1u64..25];
    prop::collection::vec((gap, cost), 1..max_len)
}

/// Replays the arrivals and checks every decision both ways against an exact reference:
/// `fits(admitted so far, time, cost)` says whether the algorithm's rule admits the request.
/// An algorithm that admits too much fails safety; one that refuses what fits (a deny-everything
/// algorithm) fails liveness. Returns the admitted (time, cost) pairs.
pub(crate) fn run_against_reference(
    quota: &Quota,
    arrivals: &[(u64, u64)],
    fits: impl Fn(&[(u64, u64)], u64, u64) -> bool,
) -> Result<Vec<(u64, u64)>, TestCaseError> {
    let mut sim = Sim::new(quota, T0 + 123_457);
    let mut admitted = Vec::new();
    for &(gap, cost) in arrivals {
        sim.advance_us(gap);
        let expected = cost <= quota.capacity() && fits(&admitted, sim.now, cost);
        let d = sim.consume(cost);
        prop_assert_eq!(
            d.allowed,
            expected,
            "cost {} at {} after {:?}",
            cost,
            sim.now - T0,
            admitted.len()
        );
        if d.allowed {
            admitted.push((sim.now, cost));
        }
    }
    Ok(admitted)
}

/// Replays the arrivals from `T0` plus a random-looking offset; returns the admitted
/// (time, cost) pairs.
pub(crate) fn run(quota: &Quota, arrivals: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut sim = Sim::new(quota, T0 + 123_457);
    let mut admitted = Vec::new();
    for &(gap, cost) in arrivals {
        sim.advance_us(gap);
        if sim.consume(cost).allowed {
            admitted.push((sim.now, cost));
        }
    }
    admitted
}

/// The most permits admitted within any window `(t − period, t]`.
pub(crate) fn max_in_any_window(admitted: &[(u64, u64)], period: u64) -> u64 {
    let mut best = 0;
    let mut from = 0;
    let mut sum = 0;
    for &(t, cost) in admitted {
        sum += cost;
        while admitted[from].0 + period <= t {
            sum -= admitted[from].1;
            from += 1;
        }
        best = best.max(sum);
    }
    best
}

/// In every interval `[a, b]`, admitted ≤ burst + limit × (b − a) / period.
pub(crate) fn check_envelope(
    admitted: &[(u64, u64)],
    limit: u64,
    period: u64,
    burst: u64,
) -> Result<(), TestCaseError> {
    check_envelope_with_slack(admitted, limit, period, burst, 0)
}

/// In every interval `[a, b]`, admitted ≤ burst + limit × (b − a + slack) / period.
pub(crate) fn check_envelope_with_slack(
    admitted: &[(u64, u64)],
    limit: u64,
    period: u64,
    burst: u64,
    slack: u64,
) -> Result<(), TestCaseError> {
    for i in 0..admitted.len() {
        let mut sum = 0u128;
        for j in i..admitted.len() {
            sum += u128::from(admitted[j].1);
            let span = u128::from(admitted[j].0 - admitted[i].0 + slack);
            let bound = u128::from(burst) * u128::from(period) + u128::from(limit) * span;
            prop_assert!(
                sum * u128::from(period) <= bound,
                "{sum} admitted within {span} µs"
            );
        }
    }
    Ok(())
}

/// Replays the arrivals, and at every denial with a retry time checks that it is exact.
pub(crate) fn check_retry_exact_over(
    quota: &Quota,
    arrivals: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    let mut sim = Sim::new(quota, T0 + 98_765);
    for &(gap, cost) in arrivals {
        sim.advance_us(gap);
        let before = sim.clone();
        let d = sim.consume(cost);
        if !d.allowed && cost <= quota.capacity() {
            // Every denial of a cost the quota can admit says exactly when it will be.
            prop_assert!(
                d.retry_after.is_some(),
                "a denial without a retry time: {:?}",
                d
            );
            retry_exactness(&before, cost).map_err(TestCaseError::fail)?;
        }
        if cost > quota.capacity() {
            prop_assert!(d.never_admissible());
        }
    }
    Ok(())
}

/// From `expires_at` on, a state decides exactly like a fresh one (so dropping it changes
/// nothing): replays the arrivals and compares, after each, the state at its expiry with a fresh
/// state at the same time, for costs 1 and `cost`, under `quota` and read under `other` (the
/// rule changed: Redis drops an expired key whatever the next quota).
pub(crate) fn check_expiry_over(
    quota: &Quota,
    other: &Quota,
    arrivals: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    let mut sim = Sim::new(quota, T0 + 55_555);
    for &(gap, cost) in arrivals {
        sim.advance_us(gap);
        sim.consume(cost);
        let at = sim.state.expires_at(quota);
        if at <= sim.now {
            continue;
        }
        // A log keeps its timestamps, not the period that wrote them (see `SlidingLog`).
        let others = if matches!(sim.state, State::SlidingLog(_)) {
            0
        } else {
            2
        };
        let reads = [(1, quota), (cost, quota), (1, other), (cost, other)];
        for &(c, read_under) in &reads[..2 + others] {
            let mut stale = sim.state.clone();
            let mut fresh = State::new(read_under);
            prop_assert_eq!(
                stale.decide(at, read_under, c),
                fresh.decide(at, read_under, c),
                "at expiry {} (now {}), read under {:?}",
                at - T0,
                sim.now - T0,
                read_under
            );
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn every_state_is_fresh_from_its_expiry(
        alg in 0usize..5,
        limit in 1u64..20,
        period_ms in 1u64..50,
        burst in 1u64..20,
        (other_limit, other_period_ms, other_burst) in (1u64..2_000, 1u64..100_000, 1u64..20),
        arrivals in arrivals_strategy(60, 30),
    ) {
        let algorithm = Algorithm::ALL[alg];
        let bursts = matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra);
        let quota = quota_of(algorithm, limit, period_ms, bursts.then_some(burst));
        // At most one permit every 10 µs: GCRA refuses a faster rate (`RateTooHigh`), and one
        // its whole-µs interval would slow by more than 10%.
        let other_limit = other_limit.min(other_period_ms * 100);
        let other = quota_of(algorithm, other_limit, other_period_ms, bursts.then_some(other_burst));
        check_expiry_over(&quota, &other, &arrivals)?;
    }
}
