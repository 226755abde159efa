//! A circuit breaker per failure domain: after consecutive store failures, stop paying the
//! deadline on every request for a cool-down, then let one probe through.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// When to open and how long to stay open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (default 3).
    pub failures: u32,
    /// How long it stays open before one probe is let through (default 250 ms).
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 3,
            cool_down: Duration::from_millis(250),
        }
    }
}

/// The state a breaker is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerState {
    /// Calls go to the store.
    Closed,
    /// Calls are not made; decisions follow the outage policy.
    Open,
}

/// What the breaker lets a request do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Call the store.
    Call,
    /// Call the store as the one probe of an open breaker.
    Probe,
    /// Do not call: decide by policy.
    Skip,
}

#[derive(Debug, Default)]
pub(crate) struct Breaker {
    consecutive_failures: AtomicU32,
    /// 0 while closed; else when the next probe may go (µs on the limiter's clock).
    open_until: AtomicU64,
    probing: AtomicBool,
}

/// What a reported outcome changed, so the caller can log state changes once.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    None,
    Opened,
    Closed,
}

impl Breaker {
    pub(crate) fn admit(&self, now: u64) -> Admission {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            Admission::Call
        } else if now < until {
            Admission::Skip
        } else if self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            Admission::Probe
        } else {
            Admission::Skip
        }
    }

    pub(crate) fn state(&self) -> BreakerState {
        if self.open_until.load(Ordering::Acquire) == 0 {
            BreakerState::Closed
        } else {
            BreakerState::Open
        }
    }

    pub(crate) fn success(&self) -> Transition {
        self.consecutive_failures.store(0, Ordering::Release);
        self.probing.store(false, Ordering::Release);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            Transition::Closed
        } else {
            Transition::None
        }
    }

    pub(crate) fn failure(&self, now: u64, probe: bool, config: &BreakerConfig) -> Transition {
        let failures = self.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
        let reopen = now + config.cool_down.as_micros() as u64;
        if probe {
            // Still down: wait another cool-down before the next probe (unless a call that
            // overlapped the probe succeeded and closed the breaker meanwhile).
            let until = self.open_until.load(Ordering::Acquire);
            if until != 0 {
                let _ = self.open_until.compare_exchange(
                    until,
                    reopen.max(1),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            self.probing.store(false, Ordering::Release);
            return Transition::None;
        }
        if failures >= config.failures
            && self
                .open_until
                .compare_exchange(0, reopen.max(1), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Transition::Opened;
        }
        Transition::None
    }

    /// A probe that ended without an answer either way (its request was dropped).
    pub(crate) fn abandon_probe(&self) {
        self.probing.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_once() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        assert_eq!(b.admit(0), Admission::Call);
        assert_eq!(b.failure(0, false, &c), Transition::None);
        assert_eq!(b.failure(0, false, &c), Transition::None);
        assert_eq!(b.failure(0, false, &c), Transition::Opened);
        assert_eq!(b.failure(0, false, &c), Transition::None, "opened once");
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.admit(100), Admission::Skip);
        let after = 250_000;
        assert_eq!(b.admit(after), Admission::Probe);
        assert_eq!(b.admit(after), Admission::Skip, "one probe at a time");
        assert_eq!(b.failure(after, true, &c), Transition::None);
        assert_eq!(
            b.admit(after + 1),
            Admission::Skip,
            "a failed probe waits again"
        );
        assert_eq!(b.admit(2 * after), Admission::Probe);
        assert_eq!(b.success(), Transition::Closed);
        assert_eq!(b.admit(2 * after), Admission::Call);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_success_resets_the_count() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        b.failure(0, false, &c);
        b.failure(0, false, &c);
        assert_eq!(b.success(), Transition::None);
        assert_eq!(b.failure(0, false, &c), Transition::None);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_failed_probe_does_not_reopen_a_breaker_a_success_closed() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        for _ in 0..3 {
            b.failure(0, false, &c);
        }
        assert_eq!(b.admit(300_000), Admission::Probe);
        assert_eq!(
            b.success(),
            Transition::Closed,
            "an overlapping call succeeded"
        );
        b.failure(300_000, true, &c);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn an_abandoned_probe_frees_the_slot() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        for _ in 0..3 {
            b.failure(0, false, &c);
        }
        assert_eq!(b.admit(300_000), Admission::Probe);
        b.abandon_probe();
        assert_eq!(b.admit(300_000), Admission::Probe);
    }
}
