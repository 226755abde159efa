//! What the limiter reports through the `metrics` facade (feature `metrics`; you install the
//! exporter). Labels are rule names, outcomes and store operations only, never keys: the number
//! of series does not grow with the number of clients.
//!
//! | Metric | Type | Labels |
//! |---|---|---|
//! | `fleetlimit_decisions_total` | counter | `rule`, `outcome` |
//! | `fleetlimit_near_limit_total` | counter | `rule`: admitted with less than 10% left |
//! | `fleetlimit_store_call_seconds` | histogram | `call`: `apply`, `refund`, `lease` |
//! | `fleetlimit_store_errors_total` | counter | |
//! | `fleetlimit_lease_blocks_total` | counter | `rule`: blocks leased |
//! | `fleetlimit_lease_permits_returned_total` | counter | `rule`: unspent permits given back |
//! | `fleetlimit_breakers_open` | gauge | breakers refusing store calls (one per failure domain) |
//!
//! Outcomes: `allowed` and `denied` (the store decided), `lease_allowed`/`lease_denied`
//! (spent from a leased block), `cache_denied` (a remembered denial), `fallback_allowed` and
//! `fallback_denied` (the local fallback during an outage), `outage_allowed` and
//! `outage_denied` (fail open, fail closed); the layer adds `shadow_denied` (shadow mode let
//! through a request the limiter denied, which also counts as `denied`).

use std::time::Duration;

use crate::{Decision, Rule};

/// Count one decision of `rule`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn decision(rule: &Rule, d: &Decision) {
    #[cfg(feature = "metrics")]
    {
        use crate::Source;
        let outcome = match (d.source, d.allowed) {
            (Source::Store, true) => "allowed",
            (Source::Store, false) => "denied",
            (Source::Lease, true) => "lease_allowed",
            (Source::Lease, false) => "lease_denied",
            (Source::Cache, _) => "cache_denied",
            (Source::Fallback, true) => "fallback_allowed",
            (Source::Fallback, false) => "fallback_denied",
            (Source::Policy, true) => "outage_allowed",
            (Source::Policy, false) => "outage_denied",
        };
        let name = rule.shared_name().clone();
        metrics::counter!("fleetlimit_decisions_total", "rule" => name.clone(), "outcome" => outcome)
            .increment(1);
        let counted = matches!(d.source, Source::Store | Source::Lease);
        if d.allowed && counted && d.remaining.saturating_mul(10) < d.limit {
            metrics::counter!("fleetlimit_near_limit_total", "rule" => name).increment(1);
        }
    }
}

/// Shadow mode let through a request `rule` denied.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn shadow_denied(rule: &Rule) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "fleetlimit_decisions_total",
        "rule" => rule.shared_name().clone(),
        "outcome" => "shadow_denied"
    )
    .increment(1);
}

/// A store call took `took`; `failed` when it did not answer.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn store_call(call: &'static str, took: Duration, failed: bool) {
    #[cfg(feature = "metrics")]
    {
        metrics::histogram!("fleetlimit_store_call_seconds", "call" => call)
            .record(took.as_secs_f64());
        if failed {
            metrics::counter!("fleetlimit_store_errors_total").increment(1);
        }
    }
}

/// A block was leased for `rule`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn lease_block(rule: &Rule) {
    #[cfg(feature = "metrics")]
    metrics::counter!("fleetlimit_lease_blocks_total", "rule" => rule.shared_name().clone())
        .increment(1);
}

/// `permits` leased under `rule` went back unspent.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn lease_returned(rule: &Rule, permits: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "fleetlimit_lease_permits_returned_total",
        "rule" => rule.shared_name().clone()
    )
    .increment(permits);
}

/// Breakers refusing store calls now (set when one opens or closes).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn breakers_open(open: u64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("fleetlimit_breakers_open").set(open as f64);
}
