//! What the limiter reports through the `metrics` facade (feature `metrics`; you install the
//! exporter). Labels are rule names, outcomes and store operations only, never keys: the number
//! of series does not grow with the number of clients.
//!
//! Handles are registered when the limiter is built: install your exporter's recorder first.
//!
//! | Metric | Type | Labels |
//! |---|---|---|
//! | `fleetlimit_decisions_total` | counter | `rule`, `outcome` |
//! | `fleetlimit_near_limit_total` | counter | `rule`: admitted with less than 10% left |
//! | `fleetlimit_store_call_seconds` | histogram | `call`: `apply`, `refund`, `lease` |
//! | `fleetlimit_store_errors_total` | counter | |
//! | `fleetlimit_lease_blocks_total` | counter | `rule`: blocks leased |
//! | `fleetlimit_lease_permits_returned_total` | counter | `rule`: unspent permits given back |
//! | `fleetlimit_lease_permits_expired_total` | counter | `rule`: unspent permits that could not be given back |
//! | `fleetlimit_breakers_open` | gauge | breakers refusing store calls now, over every limiter in the process (a count over the failure domains: a label per cluster slot would be 16,384 series); brought up to date when one opens, closes or ends its cool-down (even with no traffic), and when `stats()` is read |
//!
//! Outcomes: `allowed` and `denied` (the store decided), `lease_allowed` (spent from a leased
//! block; `lease_denied` is reserved: a leased key's refusals are the store's or remembered),
//! `cache_denied` (a remembered denial), `fallback_allowed` and `fallback_denied` (the local
//! fallback during an outage), `outage_allowed` and `outage_denied` (fail open, fail closed; an allow-listed key admitted during an outage is
//! `outage_allowed`, a listed key refused then is `cache_denied`); the layer adds
//! `shadow_denied` (shadow mode let through a request the limiter denied, which also counts as
//! `denied`).

use std::time::Duration;

use crate::{Decision, Rule};

/// Outcomes, in the order of their counters.
#[cfg(feature = "metrics")]
const OUTCOMES: [&str; 10] = [
    "allowed",
    "denied",
    "lease_allowed",
    "lease_denied",
    "cache_denied",
    "fallback_allowed",
    "fallback_denied",
    "outage_allowed",
    "outage_denied",
    "shadow_denied",
];

#[cfg(feature = "metrics")]
fn outcome(d: &Decision) -> usize {
    use crate::Source;
    match (d.source, d.allowed) {
        (Source::Store, true) => 0,
        (Source::Store, false) => 1,
        (Source::Lease, true) => 2,
        (Source::Lease, false) => 3,
        (Source::Cache, false) => 4,
        // Only a remembered allow listing admits from the cache, while the store is away.
        (Source::Cache, true) => 7,
        (Source::Fallback, true) => 5,
        (Source::Fallback, false) => 6,
        (Source::Policy, true) => 7,
        (Source::Policy, false) => 8,
    }
}

/// The limiter's metric handles, registered once when it is built (a decision increments a
/// handle: no lookup, no allocation). Handles bind to the recorder installed at that moment:
/// install the exporter before building limiters.
pub(crate) struct Telemetry {
    #[cfg(feature = "metrics")]
    rules: Vec<RuleMetrics>,
    #[cfg(feature = "metrics")]
    calls: [metrics::Histogram; 3],
    #[cfg(feature = "metrics")]
    errors: metrics::Counter,
}

#[cfg(feature = "metrics")]
struct RuleMetrics {
    outcomes: [metrics::Counter; 10],
    near_limit: metrics::Counter,
    lease_blocks: metrics::Counter,
}

impl Telemetry {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(rules: &[Rule]) -> Telemetry {
        Telemetry {
            #[cfg(feature = "metrics")]
            rules: rules
                .iter()
                .map(|rule| {
                    let name = rule.shared_name().clone();
                    RuleMetrics {
                        outcomes: OUTCOMES.map(|outcome| {
                            metrics::counter!(
                                "fleetlimit_decisions_total",
                                "rule" => name.clone(),
                                "outcome" => outcome
                            )
                        }),
                        near_limit: metrics::counter!(
                            "fleetlimit_near_limit_total",
                            "rule" => name.clone()
                        ),
                        lease_blocks: metrics::counter!(
                            "fleetlimit_lease_blocks_total",
                            "rule" => name
                        ),
                    }
                })
                .collect(),
            #[cfg(feature = "metrics")]
            calls: ["apply", "refund", "lease"]
                .map(|call| metrics::histogram!("fleetlimit_store_call_seconds", "call" => call)),
            #[cfg(feature = "metrics")]
            errors: metrics::counter!("fleetlimit_store_errors_total"),
        }
    }

    /// Count one decision of rule `rule` (its index).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn decision(&self, rule: usize, d: &Decision) {
        #[cfg(feature = "metrics")]
        if let Some(m) = self.rules.get(rule) {
            m.outcomes[outcome(d)].increment(1);
            let counted = matches!(d.source, crate::Source::Store | crate::Source::Lease);
            if d.allowed && counted && d.remaining.saturating_mul(10) < d.limit {
                m.near_limit.increment(1);
            }
        }
    }

    /// Shadow mode let through a request rule `rule` denied.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn shadow_denied(&self, rule: usize) {
        #[cfg(feature = "metrics")]
        if let Some(m) = self.rules.get(rule) {
            m.outcomes[9].increment(1);
        }
    }

    /// A block was leased for rule `rule`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn lease_block(&self, rule: usize) {
        #[cfg(feature = "metrics")]
        if let Some(m) = self.rules.get(rule) {
            m.lease_blocks.increment(1);
        }
    }

    /// A store call (`apply`, `refund`, `lease`) took `took`; `failed` when it did not answer.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn store_call(&self, call: &'static str, took: Duration, failed: bool) {
        #[cfg(feature = "metrics")]
        {
            // Only the calls the histogram's `call` label names: pause reads and writes, and
            // penalty blocks, are not decisions, and mixed into `apply` they skewed it.
            let i = match call {
                "apply" => Some(0),
                "refund" => Some(1),
                "lease" => Some(2),
                _ => None,
            };
            if let Some(i) = i {
                self.calls[i].record(took.as_secs_f64());
            }
            if failed {
                self.errors.increment(1);
            }
        }
    }
}

/// `permits` leased under `rule` went back unspent (in the background: looked up then).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn lease_returned(rule: &Rule, permits: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "fleetlimit_lease_permits_returned_total",
        "rule" => rule.shared_name().clone()
    )
    .increment(permits);
}

/// `permits` leased under `rule` could not be given back: they expire unused (they return to
/// the budget when the window ends or the bucket refills).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn lease_expired(rule: &Rule, permits: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "fleetlimit_lease_permits_expired_total",
        "rule" => rule.shared_name().clone()
    )
    .increment(permits);
}

/// One limiter's open breakers went from `before` to `now`: the process-wide gauge moves by the
/// difference (every limiter in the process adds its own).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn breakers_open_changed(before: u64, now: u64) {
    #[cfg(feature = "metrics")]
    {
        let gauge = metrics::gauge!("fleetlimit_breakers_open");
        if now > before {
            gauge.increment((now - before) as f64);
        } else if before > now {
            gauge.decrement((before - now) as f64);
        }
    }
}

/// A log line for a condition that can come and go with every request (a store failing one call
/// in three, a cluster master down under mixed traffic): said at most once in
/// [`SAID_EVERY`], whatever the flips between.
#[derive(Debug, Default)]
pub(crate) struct Throttled(std::sync::atomic::AtomicU64);

/// How often a [`Throttled`] line may be said.
pub(crate) const SAID_EVERY: Duration = Duration::from_secs(10);

impl Throttled {
    /// Whether to say it now (and then not again for [`SAID_EVERY`]).
    pub(crate) fn due(&self) -> bool {
        static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        // Milliseconds since the first line, plus one: 0 is "never said".
        let now = EPOCH.get_or_init(std::time::Instant::now).elapsed();
        self.due_at(now.as_millis() as u64 + 1)
    }

    /// [`due`](Throttled::due) at `now` (ms, above 0).
    fn due_at(&self, now: u64) -> bool {
        use std::sync::atomic::Ordering;
        let last = self.0.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < SAID_EVERY.as_millis() as u64 {
            return false;
        }
        self.0
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// What `f` logs at `warn` and above, as text (for tests of what is said how often).
#[cfg(test)]
pub(crate) fn warnings(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let out = buf.0.lock().unwrap().clone();
    String::from_utf8(out).unwrap()
}

#[cfg(test)]
mod throttled_tests {
    use super::*;

    #[test]
    fn said_once_then_quiet() {
        let t = Throttled::default();
        assert!(t.due());
        assert!(!t.due());
        assert!(!t.due());
    }

    /// A quota resolved for every request under another algorithm than its rule's (a plan
    /// table's mistake) is said once, not once per request.
    #[test]
    fn a_resolved_quota_of_another_algorithm_is_said_once() {
        use crate::{Algorithm, Limiter, MemoryStore, Quota, Rule};
        let gcra = Quota::per_minute(10)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        let limiter = Limiter::builder(MemoryStore::new())
            .rule(Rule::new("plan", gcra).unwrap())
            .build()
            .unwrap();
        let fixed = Quota::per_minute(20)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap();
        let out = warnings(|| {
            for _ in 0..20 {
                assert!(limiter.resolved(0, fixed.clone()).is_none());
            }
        });
        assert_eq!(out.matches("another algorithm").count(), 1, "{out}");
    }

    /// Once in 10 s: quiet within them, said again once they are up.
    #[test]
    fn said_again_once_the_interval_is_up() {
        let t = Throttled::default();
        assert!(t.due_at(1));
        assert!(!t.due_at(9_999));
        assert!(t.due_at(10_001));
        assert!(!t.due_at(10_002));
    }
}
