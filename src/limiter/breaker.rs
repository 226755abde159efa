//! A circuit breaker per failure domain: after consecutive store failures, stop paying the
//! deadline on every request for a cool-down, then let one probe through.
//!
//! Promise: a failure is charged to the domain whose call failed, and only to it (one dead
//! cluster master never opens a healthy master's breaker); each state change is logged once, and
//! the first failure after a success at most once in 10 s (failures spread between successes
//! are each a "first"), naming the rule, the domain (a cluster master) and the error; an open
//! breaker's state is read from the clock, not from the next call.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::policy::Deadline;
use crate::StoreError;

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
pub(crate) enum BreakerState {
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
    /// The first failure after a success is said at `warn` once in a while, not each time:
    /// failures spread between successes never open the breaker, and each would be "first".
    first_failure_said: super::telemetry::Throttled,
    consecutive_failures: AtomicU32,
    /// 0 while closed; else when the next probe may go (µs on the limiter's clock).
    open_until: AtomicU64,
    probing: AtomicBool,
}

/// What a reported outcome changed, so the caller can log state changes once.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    None,
    /// The first failure since the last success, not enough to open.
    FirstFailure,
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

    /// The state at `now`: open while calls are refused, that is during the cool-down and while
    /// its probe is out. Once the cool-down has passed with no probe yet, the next call goes to
    /// the store, so an idle breaker does not report an outage nobody has seen for a while.
    pub(crate) fn state(&self, now: u64) -> BreakerState {
        let until = self.open_until.load(Ordering::Acquire);
        if until != 0 && (now < until || self.probing.load(Ordering::Acquire)) {
            BreakerState::Open
        } else {
            BreakerState::Closed
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
        let reopen = now.saturating_add(crate::algorithm::micros(config.cool_down));
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
        if failures == 1 {
            Transition::FirstFailure
        } else {
            Transition::None
        }
    }

    /// A probe that ended without an answer either way (its request was dropped).
    pub(crate) fn abandon_probe(&self) {
        self.probing.store(false, Ordering::Release);
    }
}

/// Frees an open breaker's probe slot if the request is dropped before the store answers.
struct ProbeGuard<'a>(Option<&'a Breaker>);

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.0 {
            b.abandon_probe();
        }
    }
}

/// One breaker per failure domain of a store, with the counters the limiter reports.
#[derive(Debug)]
pub(crate) struct Breakers {
    breakers: Box<[Breaker]>,
    config: BreakerConfig,
    store_errors: AtomicU64,
    opened: AtomicU64,
    /// This limiter's open breakers as last added to the process-wide gauge: each limiter adds
    /// and takes back its own, so two in one process never overwrite each other's.
    reported: AtomicU64,
    /// A task brings the gauge up to date after each cool-down while it shows one of ours open
    /// (see [`Breakers::watch`]).
    watching: AtomicBool,
    /// Whether these breakers count in the process-wide gauge (a concurrency limiter's do not:
    /// nothing would bring the gauge up to date after a cool-down while it is idle).
    gauged: bool,
}

impl Drop for Breakers {
    fn drop(&mut self) {
        super::telemetry::breakers_open_changed(self.reported.load(Ordering::Relaxed), 0);
    }
}

impl Breakers {
    /// Bring the gauge up to date with this limiter's open breakers at `now` (on every opening
    /// and closing, and whenever the stats are read, which also sees a cool-down that ended).
    pub(crate) fn report_open(&self, now: u64) -> u64 {
        let open = self.open_at(now);
        if !self.gauged {
            return open;
        }
        let before = self.reported.swap(open, Ordering::Relaxed);
        super::telemetry::breakers_open_changed(before, open);
        open
    }

    pub(crate) fn new(domains: usize, config: BreakerConfig) -> Breakers {
        let mut breakers = Breakers::ungauged(domains, config);
        breakers.gauged = true;
        breakers
    }

    /// Breakers left out of the process-wide gauge of open breakers.
    pub(crate) fn ungauged(domains: usize, config: BreakerConfig) -> Breakers {
        Breakers {
            breakers: (0..domains.max(1)).map(|_| Breaker::default()).collect(),
            config,
            store_errors: AtomicU64::new(0),
            opened: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            watching: AtomicBool::new(false),
            gauged: false,
        }
    }

    /// This limiter's open breakers, as the gauge shows them.
    pub(crate) fn reported(&self) -> u64 {
        self.reported.load(Ordering::Relaxed)
    }

    /// How long an open breaker waits before its probe.
    pub(crate) fn cool_down(&self) -> Duration {
        self.config.cool_down
    }

    /// Claim the watch over the gauge ([`Inner::watch_breakers`](super::Inner)) while it shows
    /// one of this limiter's breakers open and nobody watches.
    pub(crate) fn claim_watch(&self) -> bool {
        self.reported() > 0
            && self
                .watching
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// The watch ends: true, unless a breaker opened meanwhile and the watch goes on.
    pub(crate) fn end_watch(&self) -> bool {
        self.give_up_watch();
        !self.claim_watch()
    }

    /// The watch's task is gone.
    pub(crate) fn give_up_watch(&self) {
        self.watching.store(false, Ordering::Release);
    }

    /// Run a store call for `domain` through its breaker, within the decision's deadline.
    /// `None` means the store could not decide (breaker open, error, deadline): the outage
    /// policy must. `rule` names what the call was for, in logs.
    pub(crate) async fn call<T>(
        &self,
        domain: usize,
        rule: &str,
        now: impl Fn() -> u64,
        deadline: Deadline,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        let domain = domain % self.breakers.len();
        let breaker = &self.breakers[domain];
        if deadline.passed() {
            // Another domain held the request to its deadline: that says nothing about this
            // one, which is neither called nor charged a failure.
            return None;
        }
        let admission = breaker.admit(now());
        if admission == Admission::Skip {
            return None;
        }
        let probe = admission == Admission::Probe;
        let mut guard = ProbeGuard(probe.then_some(breaker));
        let result = deadline.run(call).await.and_then(|r| r);
        guard.0 = None;
        match result {
            Ok(value) => {
                if breaker.success() == Transition::Closed {
                    self.report_open(now());
                    tracing::info!(
                        rule,
                        domain,
                        "fleetlimit: store answers again; breaker closed"
                    );
                }
                Some(value)
            }
            Err(error) => {
                self.store_errors.fetch_add(1, Ordering::Relaxed);
                match breaker.failure(now(), probe, &self.config) {
                    Transition::Opened => {
                        self.opened.fetch_add(1, Ordering::Relaxed);
                        self.report_open(now());
                        tracing::warn!(
                            rule,
                            domain,
                            %error,
                            cool_down = ?self.config.cool_down,
                            "fleetlimit: store failing; breaker opened, decisions follow the outage policy"
                        );
                    }
                    // Why a decision left the store (a cluster slot moving, a node gone) is
                    // worth one line per episode, not one per request, and episodes of one
                    // failure each (a store failing one call in three) a line in 10 s at most.
                    Transition::FirstFailure if breaker.first_failure_said.due() => {
                        tracing::warn!(
                            rule,
                            domain,
                            %error,
                            "fleetlimit: store call failed; this decision follows the outage policy"
                        )
                    }
                    _ => tracing::debug!(rule, domain, %error, "fleetlimit: store call failed"),
                }
                if probe {
                    // Open for another cool-down: the gauge may have seen the last one end.
                    self.report_open(now());
                }
                None
            }
        }
    }

    /// Store calls that failed or missed the deadline.
    pub(crate) fn store_errors(&self) -> u64 {
        self.store_errors.load(Ordering::Relaxed)
    }

    /// Times a breaker opened.
    pub(crate) fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Breakers refusing calls at `now`.
    pub(crate) fn open_at(&self, now: u64) -> u64 {
        self.breakers
            .iter()
            .filter(|b| b.state(now) == BreakerState::Open)
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store failing every other call never opens the breaker, and each failure follows a
    /// success: said at `warn` once, not once per failure (it was 10 of 20 calls).
    #[test]
    fn failures_spread_between_successes_are_said_once() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let breakers = Breakers::new(1, BreakerConfig::default());
        let out = super::super::telemetry::warnings(|| {
            runtime.block_on(async {
                for i in 0..20 {
                    let deadline = Deadline::after(Duration::from_secs(1));
                    let answer = if i % 2 == 0 {
                        Err(StoreError::Connection("refused".into()))
                    } else {
                        Ok(())
                    };
                    breakers
                        .call(0, "r", || 0, deadline, async move { answer })
                        .await;
                }
            })
        });
        assert_eq!(out.matches("store call failed").count(), 1, "{out}");
        assert_eq!(breakers.opened.load(Ordering::Relaxed), 0);
    }

    /// A limiter on a store that answers no call within its deadline, failing open, whose
    /// breaker opens at the first failure for 250 ms, on Tokio's (paused) time.
    #[cfg(feature = "metrics")]
    fn unanswered() -> crate::Limiter {
        use crate::store::testing::{Link, TokioClock};
        use crate::{Limiter, MemoryStore, OnStoreError, Quota, Rule};
        let link = Link::new(MemoryStore::new(), Duration::from_secs(1), Duration::ZERO);
        Limiter::builder(link)
            .rule(Rule::new("r", Quota::per_second(10).build().unwrap()).unwrap())
            .on_store_error(OnStoreError::FailOpen)
            .deadline(Duration::from_millis(10))
            .breaker(BreakerConfig {
                failures: 1,
                cool_down: Duration::from_millis(250),
            })
            .clock(TokioClock::new())
            .build()
            .unwrap()
    }

    /// The breaker opens, and nothing comes after: the gauge shows it closed once its
    /// cool-down has ended.
    #[cfg(feature = "metrics")]
    #[tokio::test(start_paused = true)]
    async fn an_idle_cool_down_ends_on_the_gauge() {
        let limiter = unanswered();
        let key = crate::Key::new("k");
        assert!(limiter.consume(&key, 1).await.unwrap().degraded);
        let breakers = &limiter.inner.breakers;
        assert_eq!(breakers.reported(), 1, "opened");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(breakers.reported(), 1, "still cooling down");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            breakers.reported(),
            0,
            "the cool-down ended with no request"
        );
        // It opens again, and is watched again.
        assert!(limiter.consume(&key, 1).await.unwrap().degraded);
        assert_eq!(breakers.reported(), 1, "opened again");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(breakers.reported(), 0);
    }

    /// A watch whose task dies with its runtime is given up: the next opening, on another
    /// runtime, is watched again.
    #[cfg(feature = "metrics")]
    #[test]
    fn a_watch_dropped_with_its_runtime_is_given_up() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap()
        };
        let key = crate::Key::new("k");
        let first = runtime();
        let limiter = first.block_on(async {
            let limiter = unanswered();
            assert!(limiter.consume(&key, 1).await.unwrap().degraded);
            limiter
        });
        assert!(limiter.inner.breakers.watching.load(Ordering::Acquire));
        drop(first);
        assert!(
            !limiter.inner.breakers.watching.load(Ordering::Acquire),
            "given up with its task"
        );
    }

    #[test]
    fn opens_after_consecutive_failures_and_probes_once() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        assert_eq!(b.admit(0), Admission::Call);
        assert_eq!(b.failure(0, false, &c), Transition::FirstFailure);
        assert_eq!(b.failure(0, false, &c), Transition::None);
        assert_eq!(b.failure(0, false, &c), Transition::Opened);
        assert_eq!(b.failure(0, false, &c), Transition::None, "opened once");
        assert_eq!(b.state(100), BreakerState::Open);
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
        assert_eq!(b.state(2 * after), BreakerState::Closed);
    }

    #[test]
    fn a_success_resets_the_count() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        b.failure(0, false, &c);
        b.failure(0, false, &c);
        assert_eq!(b.success(), Transition::None);
        assert_eq!(
            b.failure(0, false, &c),
            Transition::FirstFailure,
            "a new episode is reported again"
        );
        assert_eq!(b.failure(0, false, &c), Transition::None);
        assert_eq!(b.state(0), BreakerState::Closed);
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
        assert_eq!(b.state(300_000), BreakerState::Closed);
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

    #[tokio::test(start_paused = true)]
    async fn failures_are_charged_to_their_own_domain_and_read_from_the_clock() {
        let breakers = Breakers::new(3, BreakerConfig::default());
        let now = || 1_000u64;
        let deadline = Deadline::after(Duration::from_millis(50));
        for _ in 0..3 {
            let failed: Option<()> = breakers
                .call(1, "r", now, deadline, async {
                    Err(StoreError::Connection("down".into()))
                })
                .await;
            assert!(failed.is_none());
        }
        assert_eq!(breakers.open_at(1_000), 1);
        assert_eq!(breakers.opened(), 1);
        assert_eq!(breakers.store_errors(), 3);
        // Domain 2 is healthy and keeps calling the store.
        let ok = breakers.call(2, "r", now, deadline, async { Ok(7) }).await;
        assert_eq!(ok, Some(7));
        // Domain 1 refuses without calling.
        let skipped = breakers.call(1, "r", now, deadline, async { Ok(8) }).await;
        assert_eq!(skipped, None);
        // Once the cool-down has passed, the state reads closed before any call.
        assert_eq!(breakers.open_at(1_000 + 250_000), 0);
        // A call that outlives the deadline is a failure.
        let slow = breakers
            .call(0, "r", now, deadline, async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok(9)
            })
            .await;
        assert_eq!(slow, None);
        assert_eq!(breakers.store_errors(), 4);
    }
}
