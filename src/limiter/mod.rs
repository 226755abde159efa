//! The limiter: rules × key → one decision, through a store; and what happens when the store
//! fails.
//!
//! Its parts, each with its promise and tests beside it: [`policy`] (the outage policy and the
//! one deadline of a decision), [`breaker`] (a circuit breaker per failure domain), [`leases`]
//! (hot keys spent from leased blocks), [`denials`] (remembered store denials), [`listings`]
//! (remembered allow, deny and block entries), [`rate`] (how often a key is seen), `penalty`
//! (the penalty box), `heavy` (the heaviest keys), `domains` (calls across cluster slots) and
//! `waiting` (waiting for a permit). This file is the public API and the order in which they
//! are asked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::store::{Check, Listing, Op, Refund, Store};
use crate::{Clock, ConfigError, Decision, Key, Quota, Rule, StoreError, Taken};

pub(crate) mod breaker;
mod builder;
mod denials;
mod domains;
mod heavy;
mod lease_config;
mod leases;
mod listings;
mod penalty;
pub(crate) mod policy;
mod rate;
pub(crate) mod telemetry;
pub(crate) mod waiting;

pub use breaker::BreakerConfig;
use breaker::Breakers;
pub use builder::{
    InfallibleStore, LimiterBuilder, PolicyUnset, DEFAULT_DEADLINE, DEFAULT_DENY_CACHE_MAX_AGE,
};
use denials::{Asked, DenialCache};
pub use heavy::HeavyHitter;
use heavy::HeavyHitters;
pub use lease_config::LeaseConfig;
use leases::Leases;
use penalty::Penalties;
pub use penalty::Penalty;
pub use policy::OnStoreError;
use policy::{Deadline, Policy};

/// What an admission took from the shared budget, to give back with [`Limiter::refund`].
///
/// A receipt is neither `Clone` nor `Copy`: each is refunded at most once, and a refund undoes
/// only what is still outstanding where the permits were taken (the window they were counted in,
/// the log entries they added, the bucket's debt not yet refilled), so a refund can never create
/// a permit, whenever it comes.
#[derive(Debug)]
#[must_use = "a receipt does nothing unless it is refunded"]
pub struct Receipt {
    /// The limiter that issued it (rule indexes are its own).
    issuer: u64,
    parts: smallvec::SmallVec<[RefundPart; 2]>,
}

/// Permits to give back: the target they were taken for (its rule and key, and the quota
/// resolved for its request, which a refund must count under as the decision did) and where
/// they were taken (with their cost).
pub(crate) type RefundPart = (Target, Taken);

impl Receipt {
    /// How many permits it would give back at most (summed over its rules).
    pub fn cost(&self) -> u64 {
        self.parts.iter().map(|(_, t)| t.cost()).sum()
    }
}

/// Counters of what the limiter did; see [`Limiter::stats`]. With the `serde` feature, it
/// serialises as a JSON object of these fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct LimiterStats {
    /// Decisions made by the outage policy instead of the store.
    pub degraded_decisions: u64,
    /// Store calls that failed or missed the deadline.
    pub store_errors: u64,
    /// Times a breaker opened.
    pub breaker_opened: u64,
    /// Breakers refusing store calls right now.
    pub open_breakers: u64,
    /// Lease requests made to the store.
    pub lease_calls: u64,
    /// Keys in leased mode right now.
    pub leased_keys: u64,
}

/// What [`Limiter::inspect`] reads of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyState {
    /// Its allow, deny or block entry, if one is in force.
    pub listing: Option<Listing>,
    /// Every rule's state for it, in the limiter's order.
    pub rules: Vec<RuleState>,
}

/// One rule's state for a key, as [`Limiter::inspect`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RuleState {
    /// The rule's name.
    pub rule: String,
    /// The decision a request of cost 1 would get now (taking nothing): `limit`,
    /// `remaining`, `reset_after`, and for a refused key `retry_after`.
    pub decision: Decision,
}

/// Decides requests against one or more [`Rule`]s through a [`Store`]. Cheap to clone: clones
/// share the same store, rules and breakers, so every clone enforces the same limits.
///
/// ```
/// use fleetlimit::{Key, Limiter, MemoryStore, Quota, Rule};
///
/// # tokio_test(async {
/// let limiter = Limiter::builder(MemoryStore::new())
///     .rule(Rule::new("api", Quota::per_minute(2).build()?)?)
///     .build()?;
/// let key = Key::new("tenant-1");
/// assert!(limiter.consume(&key, 1).await?.allowed);
/// assert!(limiter.consume(&key, 1).await?.allowed);
/// let denied = limiter.consume(&key, 1).await?;
/// assert!(!denied.allowed);
/// assert!(denied.retry_after.is_some());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # });
/// # fn tokio_test<F: std::future::Future<Output = Result<(), Box<dyn std::error::Error>>>>(f: F) {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f).unwrap()
/// # }
/// ```
///
/// A networked store needs an outage policy; leaving it out does not compile:
///
#[cfg_attr(feature = "redis", doc = "```compile_fail")]
#[cfg_attr(not(feature = "redis"), doc = "```ignore")]
/// # use fleetlimit::{Limiter, Rule, RedisStore};
/// fn no_policy(store: RedisStore, rule: Rule) {
///     let _ = Limiter::builder(store).rule(rule).build();
/// }
/// ```
///
#[cfg_attr(feature = "redis", doc = "```")]
#[cfg_attr(not(feature = "redis"), doc = "```ignore")]
/// # use fleetlimit::{Limiter, OnStoreError, Rule, RedisStore};
/// fn with_policy(store: RedisStore, rule: Rule) {
///     let _ = Limiter::builder(store).rule(rule).on_store_error(OnStoreError::FailOpen).build();
/// }
/// ```
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

struct Inner {
    /// Unique among the limiters of this process, so a receipt is refunded only by its issuer.
    id: u64,
    /// This limiter, for the tasks that give leased permits back.
    me: std::sync::Weak<Inner>,
    store: Arc<dyn Store>,
    /// The rules in force: names and order fixed, quotas replaceable while running.
    rules: arc_swap::ArcSwap<Vec<Rule>>,
    /// Serialises quota changes (readers never wait).
    changing: parking_lot::Mutex<()>,
    /// Quotas of single keys (see [`Limiter::set_override`]); empty for most limiters.
    overrides: arc_swap::ArcSwap<Overrides>,
    /// The penalty box, when configured.
    penalties: Option<Penalties>,
    /// The keys refused most recently.
    heavy: Option<HeavyHitters>,
    /// Metric handles (feature `metrics`).
    telemetry: telemetry::Telemetry,
    /// `None` for a store that cannot fail.
    policy: Option<Policy>,
    deadline: Duration,
    breakers: Breakers,
    clock: Arc<dyn Clock>,
    leases: Leases,
    denials: Option<DenialCache>,
    /// The listed keys seen (used only for a store that can fail).
    listings: listings::ListingMemory,
    degraded: AtomicU64,
    /// Callers of [`Limiter::until_ready`] waiting their turn, per key.
    lines: waiting::Lines,
    /// A quota resolved for a request under another algorithm than its rule's: a
    /// misconfiguration every such request would report, said once in a while.
    other_algorithm_said: telemetry::Throttled,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("rules", &self.inner.rules.load())
            .field("deadline", &self.inner.deadline)
            .finish_non_exhaustive()
    }
}

/// One rule (by its index in [`Limiter::rules`]) applied to one key at one cost: a request
/// charged by size on one rule and 1 on another is one atomic decision over two targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) rule: usize,
    pub(crate) key: Key,
    pub(crate) cost: u64,
    /// The rule with the quota resolved for this request (a tenant's plan), in place of the
    /// rule's own; a per-key override ([`Limiter::set_override`]) outranks it.
    /// Boxed: most requests have none, and targets are moved on the hot path.
    pub(crate) resolved: Option<Box<Rule>>,
}

/// A refusal that earned `key` a block of the penalty box says so: it waits the block out at
/// least (a client that came back at the rule's own wait would be refused by the block).
fn wait_out_block(targets: &Targets, decisions: &mut [Decision], key: &Key, block: Duration) {
    for (target, decision) in targets.iter().zip(decisions.iter_mut()) {
        if target.key != *key || decision.allowed {
            continue;
        }
        if let Some(wait) = decision.retry_after.as_mut() {
            *wait = (*wait).max(block);
        }
        decision.reset_after = decision.reset_after.max(block);
    }
}

/// How a consume's decisions count, beyond deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counting {
    /// A request's decisions: in the decision metrics and the heavy hitters, and its refusals
    /// in the penalty box.
    Request,
    /// A request's, in shadow mode: counted, but a refusal let through earns no block (a
    /// block is a real listing, refusing the key in every limiter on the store).
    Shadowed,
    /// A charge for a request already decided: what a settled cost found beyond its
    /// reservation, a metered body's frames. Not counted at all: one request would count once
    /// per frame, and a refusal here is the budget running out under an admitted request, not
    /// a client coming back while refused.
    Charge,
}

type Targets = [Target];

impl Limiter {
    /// The limiter's rules, with the quotas in force now (see [`set_quota`](Limiter::set_quota)).
    pub fn rules(&self) -> Arc<Vec<Rule>> {
        self.inner.rules.load_full()
    }

    /// Replace one rule's quota while the limiter runs; see [`set_quotas`](Limiter::set_quotas).
    pub fn set_quota(&self, rule: &str, quota: Quota) -> Result<(), ConfigError> {
        self.set_quotas([(rule, quota)])
    }

    /// Replace several rules' quotas at once: every decision sees all the old quotas or all the
    /// new ones. The rules' state carries over as it is, read under the new quota by the rule
    /// every store applies to a quota change (see the README's "Refunds and quota changes"): a
    /// window's count stays counted, a bucket keeps its debt. So instances of a fleet that
    /// change a few seconds apart (a rolling deploy, a rules file reloaded) never admit more on
    /// one key than the larger of the old and new limits in the changeover. This process forgets
    /// its remembered denials at once; other instances within their
    /// [`deny_cache_max_age`](crate::LimiterBuilder::deny_cache_max_age); a local fallback takes
    /// its share of the new quotas.
    ///
    /// Rules keep their names, order and algorithm (a state's format is its algorithm's; change
    /// it under a new rule name). Nothing changes unless every quota is accepted: an unknown
    /// rule, another algorithm, or a quota a leased rule cannot lease is a [`ConfigError`].
    ///
    /// ```
    /// # use fleetlimit::{Key, Limiter, MemoryStore, Quota, Rule};
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limiter = Limiter::builder(MemoryStore::new())
    ///     .rule(Rule::new("api", Quota::per_minute(1).build()?)?)
    ///     .build()?;
    /// let key = Key::new("tenant-1");
    /// assert!(limiter.consume(&key, 1).await?.allowed);
    /// assert!(!limiter.consume(&key, 1).await?.allowed);
    /// limiter.set_quota("api", Quota::per_minute(2).build()?)?;
    /// assert!(limiter.consume(&key, 1).await?.allowed, "the window's count carried over");
    /// assert!(!limiter.consume(&key, 1).await?.allowed);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn set_quotas<'a>(
        &self,
        quotas: impl IntoIterator<Item = (&'a str, Quota)>,
    ) -> Result<(), ConfigError> {
        let inner = &self.inner;
        let _one_change_at_a_time = inner.changing.lock();
        let mut rules: Vec<Rule> = inner.rules.load().as_ref().clone();
        for (name, quota) in quotas {
            let invalid = |reason: String| ConfigError::Invalid {
                setting: "set_quota",
                reason,
            };
            let Some(i) = rules.iter().position(|r| r.name() == name) else {
                return Err(invalid(format!(
                    "the limiter has no rule named {name:?} (adding or removing rules takes a new limiter)"
                )));
            };
            if quota.algorithm() != rules[i].quota().algorithm() {
                return Err(invalid(format!(
                    "rule {name:?} is {:?}, not {:?}: a new algorithm needs a new rule name",
                    rules[i].quota().algorithm(),
                    quota.algorithm()
                )));
            }
            let rule = Rule::new(name, quota)?;
            if let Some(config) = inner.leases.config(i) {
                config.validate(&rule)?;
            }
            rules[i] = rule;
        }
        let local = match &inner.policy {
            Some(policy) => policy.local_rules(&rules)?,
            None => None,
        };
        if let (Some(policy), Some(local)) = (&inner.policy, local) {
            policy.set_local_rules(local);
        }
        inner.rules.store(Arc::new(rules));
        // After the rules: a refill that sees the new generation sees the new rules too.
        inner.leases.quotas_changed();
        if let Some(denials) = &inner.denials {
            denials.clear();
        }
        Ok(())
    }

    /// Give `key` its own quota under `rule` ("tenant 42 gets 10×"), in place of the rule's
    /// and of any quota resolved per request; `None` removes it. Process-local configuration,
    /// like the rules: give every instance the same overrides (from your configuration). The
    /// state carries over as in [`set_quotas`](Limiter::set_quotas). The quota keeps the rule's
    /// algorithm.
    ///
    /// ```
    /// # use fleetlimit::{Key, Limiter, MemoryStore, Quota, Rule};
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limiter = Limiter::builder(MemoryStore::new())
    ///     .rule(Rule::new("api", Quota::per_minute(1).build()?)?)
    ///     .build()?;
    /// let big = Key::new("tenant-42");
    /// limiter.set_override("api", &big, Some(Quota::per_minute(10).build()?))?;
    /// for _ in 0..10 {
    ///     assert!(limiter.consume(&big, 1).await?.allowed);
    /// }
    /// assert!(!limiter.consume(&big, 1).await?.allowed);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn set_override(
        &self,
        rule: &str,
        key: &Key,
        quota: Option<Quota>,
    ) -> Result<(), ConfigError> {
        let inner = &self.inner;
        let _one_change_at_a_time = inner.changing.lock();
        let rules = inner.rules.load();
        let Some(index) = rules.iter().position(|r| r.name() == rule) else {
            return Err(ConfigError::Invalid {
                setting: "set_override",
                reason: format!("the limiter has no rule named {rule:?}"),
            });
        };
        let mut overrides: Overrides = inner.overrides.load().as_ref().clone();
        match quota {
            Some(quota) => {
                let own = rules[index].quota().algorithm();
                if quota.algorithm() != own {
                    return Err(ConfigError::Invalid {
                        setting: "set_override",
                        reason: format!(
                            "rule {rule:?} is {own}, the override {}: a key's state has one format",
                            quota.algorithm()
                        ),
                    });
                }
                overrides.insert((index, key.clone()), rules[index].with_quota(quota));
            }
            None => {
                overrides.remove(&(index, key.clone()));
            }
        }
        inner.overrides.store(Arc::new(overrides));
        // A block leased under the key's old quota is not spent under its new one (after the
        // overrides, as `set_quotas` does after the rules); the other keys' blocks go on.
        inner.leases.key_changed(index, key);
        if let Some(denials) = &inner.denials {
            denials.forget(key);
        }
        Ok(())
    }

    /// `rule` (by index) with `quota` for one request, when the quota keeps the rule's
    /// algorithm; `None` (logged) when it does not, and the rule's own quota decides.
    pub(crate) fn resolved(&self, rule: usize, quota: Quota) -> Option<Box<Rule>> {
        let rules = self.inner.rules.load();
        let own = rules.get(rule)?;
        if quota.algorithm() != own.quota().algorithm() {
            if self.inner.other_algorithm_said.due() {
                tracing::warn!(
                    rule = own.name(),
                    "fleetlimit: a quota resolved for a request has another algorithm than its rule; the rule's own quota decides"
                );
            }
            return None;
        }
        Some(Box::new(own.with_quota(quota)))
    }

    /// [`with_rules_for`](Limiter::with_rules_for), for headers of `decisions`: a decision the
    /// local fallback made names the local quota it was made under (a limit of 100 shared among
    /// four showed `q=100` beside the `r=24` of its share).
    pub(crate) fn with_rules_deciding<R>(
        &self,
        targets: &Targets,
        decisions: &[Decision],
        f: impl FnOnce(&[&Rule]) -> R,
    ) -> R {
        let policy = match &self.inner.policy {
            Some(policy)
                if decisions
                    .iter()
                    .any(|d| d.source == crate::Source::Fallback) =>
            {
                policy
            }
            _ => return self.with_rules_for(targets, f),
        };
        self.with_rules_for(targets, |rules| {
            let local: smallvec::SmallVec<[Option<Rule>; 2]> = rules
                .iter()
                .zip(decisions)
                .map(|(rule, d)| {
                    (d.source == crate::Source::Fallback)
                        .then(|| policy.local_rule(rule))
                        .flatten()
                })
                .collect();
            let deciding: smallvec::SmallVec<[&Rule; 2]> = rules
                .iter()
                .zip(local.iter().chain(std::iter::repeat(&None)))
                .map(|(rule, local)| local.as_ref().unwrap_or(rule))
                .collect();
            f(&deciding)
        })
    }

    /// Call `f` with the rules that decide `targets` now (each target's key override, its
    /// resolved quota, or its rule), borrowed: for headers.
    pub(crate) fn with_rules_for<R>(&self, targets: &Targets, f: impl FnOnce(&[&Rule]) -> R) -> R {
        let rules = self.inner.rules.load();
        let overrides = self.inner.overrides.load();
        let deciding: smallvec::SmallVec<[&Rule; 2]> = targets
            .iter()
            .filter_map(|t| Some(effective(rules.get(t.rule)?, &overrides, t)))
            .collect();
        f(&deciding)
    }

    /// Take `cost` permits for `key` from every rule, or from none if any rule denies. Returns
    /// the most restrictive rule's decision.
    pub async fn consume(&self, key: &Key, cost: u64) -> Result<Decision, Error> {
        self.consume_with_receipt(key, cost)
            .await
            .map(|(decision, _)| decision)
    }

    /// The decision a request of cost 1 would get, without taking anything; `remaining` is the
    /// count right now.
    pub async fn peek(&self, key: &Key) -> Result<Decision, Error> {
        let targets = self.every_rule(key, 1);
        let decisions = self.apply_indexed(Op::Peek, &targets).await?;
        most_restrictive(decisions)
    }

    /// [`consume`](Limiter::consume), with a receipt for what was taken when the request was
    /// admitted and counted (none for a denial, or for an admission by fail-open or the local
    /// fallback, which took nothing from the shared budget).
    ///
    /// ```
    /// # use fleetlimit::{Key, Limiter, MemoryStore, Quota, Rule};
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limiter = Limiter::builder(MemoryStore::new())
    ///     .rule(Rule::new("logins", Quota::per_minute(1).build()?)?)
    ///     .build()?;
    /// let key = Key::new("alice");
    /// let (decision, receipt) = limiter.consume_with_receipt(&key, 1).await?;
    /// assert!(decision.allowed);
    /// // The login succeeded: it should not count.
    /// limiter.refund(receipt.expect("admitted")).await?;
    /// assert!(limiter.consume(&key, 1).await?.allowed);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn consume_with_receipt(
        &self,
        key: &Key,
        cost: u64,
    ) -> Result<(Decision, Option<Receipt>), Error> {
        let targets = self.every_rule(key, cost);
        let decisions = self.apply_indexed(Op::Consume, &targets).await?;
        let receipt = self.receipt(&targets, &decisions);
        Ok((most_restrictive(decisions)?, receipt))
    }

    /// Wait until `cost` permits are admitted for `key`, for at most `max_wait`: for calls *to*
    /// a rate-limited service (a partner API's quota shared by the fleet), where the caller
    /// would rather wait its turn than be refused.
    ///
    /// Returns the admitting decision, or, as soon as it is known that `max_wait` is not enough
    /// (the store's `retry_after` ends past it, the cost can never be admitted, the outage
    /// policy refused, or the caller at the head of the line sleeps past it), that denial,
    /// without waiting in vain. Within this process, callers waiting on one key are served
    /// first come, first served; across the fleet every admission is an ordinary decision, so
    /// the shared quota holds. Nobody polls the store: the caller at the head of the line
    /// sleeps until the time the store named, then asks once. The refusals a caller waits out
    /// are not counted as requests' (in the metrics, the heavy hitters and the penalty box);
    /// the refusal it returns is, unless it is given because the callers ahead in this
    /// process's line use the whole wait (the line's, not the caller's excess). A `cost` of
    /// zero is an [`Error::InvalidCost`], as for [`consume`](Limiter::consume). Cancellation-safe: a dropped future holds no place in the
    /// line, and no permit, except on a shared store when it is dropped while its store call
    /// is on the way (the store may have taken that call's permits: at most one call's).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use fleetlimit::{Algorithm, Key, Limiter, MemoryStore, Quota, Rule};
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// let limiter = Limiter::builder(MemoryStore::new())
    ///     .rule(Rule::new("partner", Quota::per_second(20).algorithm(Algorithm::Gcra).burst(1).build()?)?)
    ///     .build()?;
    /// let partner = Key::new("api.partner.example");
    /// for _ in 0..3 {
    ///     // Each call waits its turn: 50 ms apart.
    ///     assert!(limiter.until_ready(&partner, 1, Duration::from_secs(1)).await?.allowed);
    /// }
    /// // Not worth waiting 50 ms for with a budget of 1 ms: refused at once.
    /// assert!(!limiter.until_ready(&partner, 1, Duration::from_millis(1)).await?.allowed);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn until_ready(
        &self,
        key: &Key,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, Error> {
        if cost == 0 {
            return Err(Error::InvalidCost(0));
        }
        let targets = self.every_rule(key, cost);
        // A cost a quota can never admit is the store's to answer at once (an allow-listed
        // key admits it), never after a wait in line for nothing.
        let never_fits = self.with_rules_for(&targets, |rules| {
            rules.iter().any(|r| cost > r.quota().capacity())
        });
        if never_fits {
            return most_restrictive(self.apply_indexed(Op::Consume, &targets).await?);
        }
        let give_up = waiting::after(max_wait);
        let place = self.inner.lines.join(key);
        let turn = match place.turn_by(give_up).await {
            Ok(turn) => turn,
            Err(head_wake) => {
                // The callers ahead use the whole wait: a denial taking nothing, with the
                // store's view of when this cost would be admitted (callers still ahead may
                // take it first), and never before the head of the line wakes. Not counted as
                // a request's refusal: it is this process's line, not the caller's excess.
                let decisions = self.apply_indexed(Op::Peek, &targets).await?;
                let mut now = most_restrictive(decisions)?;
                now.allowed = false;
                let ahead = head_wake.map_or(Duration::ZERO, |wake| {
                    wake.saturating_duration_since(tokio::time::Instant::now())
                });
                now.retry_after = Some(now.retry_after.unwrap_or(Duration::ZERO).max(ahead));
                return Ok(now);
            }
        };
        loop {
            // A refusal waited out is not counted as a request's (in the metrics, the heavy
            // hitters and the penalty box): the caller waits its turn, it does not hammer.
            let (mut decisions, deadline) = self.apply_uncounted(Op::Consume, &targets).await?;
            let decision = most_restrictive(decisions.clone())?;
            match waiting::wake(&decision, give_up) {
                Some(wake) => turn.sleep_until(wake).await,
                None => {
                    self.count(&targets, &mut decisions, deadline, Counting::Request)
                        .await;
                    // With the wait of a block the refusal earned.
                    return most_restrictive(decisions);
                }
            }
        }
    }

    /// Pause `key` under every rule for the whole fleet, for `pause`: what a destination's
    /// pushback does through [`OutboundLayer`](crate::outbound::OutboundLayer), which waits out
    /// pauses before calling. Within the decision deadline per rule.
    pub async fn pause(&self, key: &Key, pause: Duration) -> Result<(), Error> {
        self.pause_every_rule(key, pause, false).await
    }

    /// [`pause`](Limiter::pause), unless a pause in force ends later (per rule, in one step in
    /// the store): what several instances told to stop, each for its own time, agree on. The
    /// outbound layer pauses this way.
    pub async fn pause_at_least(&self, key: &Key, pause: Duration) -> Result<(), Error> {
        self.pause_every_rule(key, pause, true).await
    }

    /// Pause `key` under every rule, each within the deadline and through its failure domain's
    /// breaker (with the store away and the breaker open, an outbound call waits for nothing);
    /// `extend`: only where that is longer than the pause in force.
    async fn pause_every_rule(
        &self,
        key: &Key,
        pause: Duration,
        extend: bool,
    ) -> Result<(), Error> {
        let inner = &self.inner;
        for rule in inner.rules.load_full().iter() {
            let deadline = Deadline::after(inner.deadline);
            let call = if extend {
                inner.store.extend_pause(rule, key, pause)
            } else {
                inner.store.pause(rule, key, pause)
            };
            let check = Check { rule, key, cost: 1 };
            if inner
                .call_store("pause", &[check], deadline, call)
                .await
                .is_none()
            {
                return Err(Error::Store(if deadline.passed() {
                    StoreError::Timeout(inner.deadline)
                } else {
                    StoreError::Connection("the store could not be reached to pause".into())
                }));
            }
        }
        Ok(())
    }

    /// How long `key` stays paused (the longest over its rules); `None` when it is not, or when
    /// the store cannot say within the deadline (each rule through its breaker: the decision
    /// that follows goes through the outage policy anyway).
    pub async fn paused_for(&self, key: &Key) -> Option<Duration> {
        let inner = &self.inner;
        let mut longest = None;
        for rule in inner.rules.load_full().iter() {
            let deadline = Deadline::after(inner.deadline);
            let check = Check { rule, key, cost: 1 };
            let read = inner.store.paused_for(rule, key);
            if let Some(Some(left)) = inner.call_store("paused", &[check], deadline, read).await {
                longest = longest.max(Some(left));
            }
        }
        longest
    }

    /// Give back what an admission took, as far as it is still outstanding: a window's permits
    /// while that window lasts, a log's own entries, a bucket's debt not yet refilled. Nothing
    /// is created: had the request never come, the state would hold at least as much.
    pub async fn refund(&self, receipt: Receipt) -> Result<(), Error> {
        if receipt.issuer != self.id() {
            return Err(Error::ForeignReceipt);
        }
        self.refund_parts(&receipt.parts).await
    }

    /// Apply `op` to chosen rules, each with its own key (per account AND per IP, say), as one
    /// atomic step: for a consume, a denial by one takes nothing from the others. Returns one
    /// decision per target, in order. Unknown rule names are an error.
    ///
    /// ```
    /// # use fleetlimit::{Key, Limiter, MemoryStore, Quota, Rule};
    /// # use fleetlimit::store::Op;
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limiter = Limiter::builder(MemoryStore::new())
    ///     .rule(Rule::new("account", Quota::per_minute(100).build()?)?)
    ///     .rule(Rule::new("ip", Quota::per_minute(10).build()?)?)
    ///     .build()?;
    /// let (account, ip) = (Key::new("acct-7"), Key::from(std::net::IpAddr::from([203, 0, 113, 9])));
    /// let decisions = limiter.apply_to(Op::Consume, &[("account", &account), ("ip", &ip)], 1).await?;
    /// assert!(decisions.iter().all(|d| d.allowed));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn apply_to(
        &self,
        op: Op,
        targets: &[(&str, &Key)],
        cost: u64,
    ) -> Result<Vec<Decision>, Error> {
        let rules = self.inner.rules.load_full();
        let indexed = targets
            .iter()
            .map(|(name, key)| {
                let i = rules
                    .iter()
                    .position(|r| r.name() == *name)
                    .ok_or_else(|| Error::UnknownRule((*name).to_owned()))?;
                Ok(Target {
                    rule: i,
                    key: (*key).clone(),
                    cost,
                    resolved: None,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        self.apply_indexed(op, &indexed).await
    }

    /// What every rule holds for `key` and whether it is listed, consuming nothing: the
    /// decision a request of cost 1 would get from each rule now (a blocked or denied key reads
    /// as refused, with the wait). An error when the store cannot answer (never the outage
    /// policy's guess). Each rule is read under the key's override if it has one, else under
    /// the rule's own quota: a quota a scope resolves per request (a tenant's plan through
    /// [`QuotaCache`](crate::QuotaCache)) needs the request, so a key under such a plan reads
    /// with the rule's limit.
    pub async fn inspect(&self, key: &Key) -> Result<KeyState, Error> {
        let deadline = Deadline::after(self.inner.deadline);
        let listing = deadline.run(self.inner.store.listing(key)).await??;
        let targets = self.every_rule(key, 1);
        let rules = self.inner.rules.load_full();
        let overrides = self.inner.overrides.load_full();
        let checks = checks(&rules, &overrides, &targets)?;
        let decisions = deadline
            .run(self.inner.store.apply(Op::Peek, &checks))
            .await??;
        Ok(KeyState {
            listing,
            rules: rules
                .iter()
                .zip(decisions)
                .map(|(rule, decision)| RuleState {
                    rule: rule.name().to_owned(),
                    decision,
                })
                .collect(),
        })
    }

    /// Forget `key`'s state under every rule, for the whole fleet: it starts afresh (its
    /// listing, if any, stays). This process forgets its remembered denials of the key at
    /// once, the others within their denial cache's bound; a block leased before the reset is
    /// spent until it expires (250 ms by default).
    pub async fn reset(&self, key: &Key) -> Result<(), Error> {
        for rule in self.inner.rules.load_full().iter() {
            self.reset_one(rule, key).await?;
        }
        Ok(())
    }

    /// [`reset`](Limiter::reset) for one rule.
    pub async fn reset_rule(&self, key: &Key, rule: &str) -> Result<(), Error> {
        let rules = self.inner.rules.load_full();
        let rule = rules
            .iter()
            .find(|r| r.name() == rule)
            .ok_or_else(|| Error::UnknownRule(rule.to_owned()))?;
        self.reset_one(rule, key).await
    }

    async fn reset_one(&self, rule: &Rule, key: &Key) -> Result<(), Error> {
        let deadline = Deadline::after(self.inner.deadline);
        deadline.run(self.inner.store.reset(rule, key)).await??;
        if let Some(denials) = &self.inner.denials {
            denials.forget(key);
        }
        Ok(())
    }

    /// Refuse `key` under every rule for `duration`, for the whole fleet, with a `Retry-After`
    /// counting down to the end of the block. Nothing is counted while it lasts. A block
    /// replaces an earlier block (longer or shorter) and takes the key off the allow list, but
    /// never ends a [`deny`](Limiter::deny): a denied key stays denied. A `duration` of zero
    /// ends a block and nothing else (the allow and deny lists stay as they are).
    pub async fn block(&self, key: &Key, duration: Duration) -> Result<(), Error> {
        self.set_listing(key, Some(Listing::Block(duration))).await
    }

    /// Refuse `key` under every rule until [`unblock`](Limiter::unblock) (the deny list),
    /// telling it to come back in a day ([`DENY_RETRY_AFTER`](crate::store::DENY_RETRY_AFTER)).
    pub async fn deny(&self, key: &Key) -> Result<(), Error> {
        self.set_listing(key, Some(Listing::Deny)).await
    }

    /// Never limit `key` (the allow list): every decision admits it and counts nothing, until
    /// [`unblock`](Limiter::unblock).
    pub async fn allow(&self, key: &Key) -> Result<(), Error> {
        self.set_listing(key, Some(Listing::Allow)).await
    }

    /// Take `key` off the allow and deny lists and end any block: its quotas apply again.
    pub async fn unblock(&self, key: &Key) -> Result<(), Error> {
        self.set_listing(key, None).await
    }

    async fn set_listing(&self, key: &Key, listing: Option<Listing>) -> Result<(), Error> {
        let deadline = Deadline::after(self.inner.deadline);
        let listing = deadline
            .run(self.inner.store.set_listing(key, listing))
            .await??;
        self.inner.listing_changed(key);
        if let Some(penalties) = &self.inner.penalties {
            penalties.forget(key);
        }
        if self.inner.policy.is_some() {
            // Only a store that can fail has outages to remember listings for.
            let now = self.inner.clock.now_us();
            self.inner.listings.set(key, listing, now);
        }
        Ok(())
    }

    /// Give back every unspent leased permit now and leave leased mode (for a shutdown; idle
    /// keys give theirs back by themselves). Call it once the server has stopped serving (after
    /// axum's `serve` returns, not in its shutdown signal): a request still decided after it
    /// leases again, and a block leased then is given back only by the sweeper, which ends with
    /// the limiter's last clone.
    pub async fn release_leases(&self) {
        // A task of its own, waited for: a caller that stops waiting (a shutdown's timeout)
        // must not take the blocks not yet given back with it.
        let inner = self.inner.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let _ = runtime
                    .spawn(async move { inner.release_all().await })
                    .await;
            }
            Err(_) => inner.release_all().await,
        }
    }

    /// Shadow mode let through a request rule `rule` (by index) denied.
    pub(crate) fn shadow_denied(&self, rule: usize) {
        self.inner.telemetry.shadow_denied(rule);
    }

    /// The `n` keys this process refused most over the last one to two periods (see
    /// [`LimiterBuilder::heavy_hitters`](crate::LimiterBuilder::heavy_hitters)), most refused
    /// first; keys fingerprinted unless raw keys were asked for.
    pub fn heavy_hitters(&self, n: usize) -> Vec<HeavyHitter> {
        let inner = &self.inner;
        inner
            .heavy
            .as_ref()
            .map_or_else(Vec::new, |h| h.top(n, inner.clock.now_us()))
    }

    /// What the limiter has done so far: degraded decisions, store errors, breaker openings,
    /// lease requests. Breaker states are read at the moment of the call.
    pub fn stats(&self) -> LimiterStats {
        let i = &self.inner;
        LimiterStats {
            lease_calls: i.leases.lease_calls(),
            leased_keys: i.leases.leased_keys() as u64,
            degraded_decisions: i.degraded.load(Ordering::Relaxed),
            store_errors: i.breakers.store_errors(),
            breaker_opened: i.breakers.opened(),
            open_breakers: i.breakers.report_open(i.clock.now_us()),
        }
    }

    /// Decide a consume right now, without a future: everything on an in-process store; on one
    /// that can fail, a single-rule consume a leased block or a remembered denial answers.
    /// `None` means "await [`consume_counted`](Limiter::consume_counted)".
    #[inline]
    pub(crate) fn consume_now(
        &self,
        targets: &Targets,
        counting: Counting,
    ) -> Option<smallvec::SmallVec<[Decision; 2]>> {
        let inner = &self.inner;
        if targets.iter().any(|t| t.cost == 0) {
            return None;
        }
        // A store that cannot fail decides everything here; one that can (Redis) only what a
        // leased block or a remembered denial answers without it.
        let in_process = inner.policy.is_none() && inner.leases.is_idle();
        let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        let rules = inner.rules.load();
        let overrides = inner.overrides.load();
        let mut decisions: smallvec::SmallVec<[Decision; 2]> = match targets {
            [target] => {
                let check = Check {
                    rule: effective(rules.get(target.rule)?, &overrides, target),
                    key: &target.key,
                    cost: target.cost,
                };
                let decision = if in_process {
                    inner.store.check_in_process(Op::Consume, &check)?
                } else if inner.policy.is_some() {
                    inner.decide_now(target.rule, &check)?
                } else {
                    return None;
                };
                smallvec::smallvec![decision]
            }
            _ if in_process => {
                let checks = checks(&rules, &overrides, targets).ok()?;
                inner.store.apply_in_process(Op::Consume, &checks)?.into()
            }
            _ => return None,
        };
        inner.trace(targets, &decisions, started);
        if counting == Counting::Charge {
            return Some(decisions);
        }
        inner.record(targets, &decisions);
        for (key, block) in inner.earned(targets, &decisions, counting) {
            // An in-process store answers at once: no future to await on this path.
            let mut penalise = std::pin::pin!(inner.penalise(&key, block, None));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            match std::future::Future::poll(penalise.as_mut(), &mut cx) {
                std::task::Poll::Ready(Some(true)) => {
                    wait_out_block(targets, &mut decisions, &key, block)
                }
                std::task::Poll::Ready(_) => {}
                std::task::Poll::Pending => {
                    tracing::warn!("fleetlimit: the penalty box could not block a key in process")
                }
            }
        }
        Some(decisions)
    }

    /// Like [`apply_to`](Limiter::apply_to), with rules by their index in [`rules`](Limiter::rules)
    /// and a cost per target; a consume counted as a request's decisions.
    pub(crate) async fn apply_indexed(
        &self,
        op: Op,
        targets: &Targets,
    ) -> Result<Vec<Decision>, Error> {
        match op {
            Op::Consume => self.consume_counted(targets, Counting::Request).await,
            Op::Peek => Ok(self.apply_uncounted(op, targets).await?.0),
        }
    }

    /// Consume for `targets`, the decisions counted as `counting` says.
    pub(crate) async fn consume_counted(
        &self,
        targets: &Targets,
        counting: Counting,
    ) -> Result<Vec<Decision>, Error> {
        let (mut decisions, deadline) = self.apply_uncounted(Op::Consume, targets).await?;
        self.count(targets, &mut decisions, deadline, counting)
            .await;
        Ok(decisions)
    }

    /// Count a consume's decisions as `counting` says; the penalty box's blocks are set within
    /// `deadline`, the request's.
    async fn count(
        &self,
        targets: &Targets,
        decisions: &mut [Decision],
        deadline: Option<Deadline>,
        counting: Counting,
    ) {
        if counting == Counting::Charge {
            return;
        }
        self.inner.record(targets, decisions);
        for (key, block) in self.inner.earned(targets, decisions, counting) {
            if self
                .inner
                .penalise_within(key.clone(), block, deadline)
                .await
            {
                wait_out_block(targets, decisions, &key, block);
            }
        }
    }

    /// [`apply_indexed`](Limiter::apply_indexed), not counted as anything yet; with the
    /// request's deadline (`None` for a store that cannot fail).
    async fn apply_uncounted(
        &self,
        op: Op,
        targets: &Targets,
    ) -> Result<(Vec<Decision>, Option<Deadline>), Error> {
        for (i, target) in targets.iter().enumerate() {
            if target.cost == 0 {
                return Err(Error::InvalidCost(0));
            }
            if targets[..i]
                .iter()
                .any(|t| t.rule == target.rule && t.key == target.key)
            {
                let rules = self.inner.rules.load();
                let name = rules.get(target.rule).map_or("?", |r| r.name());
                return Err(Error::DuplicateTarget(name.to_owned()));
            }
        }
        if targets.is_empty() {
            return Ok((Vec::new(), None));
        }
        let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        let rules = self.inner.rules.load_full();
        let overrides = self.inner.overrides.load_full();
        let checks = checks(&rules, &overrides, targets)?;
        // One deadline for the whole request, the penalty box's blocks included: a denial that
        // earns one must not wait a second deadline for the store to record it.
        let deadline = self
            .inner
            .policy
            .is_some()
            .then(|| Deadline::after(self.inner.deadline));
        let decisions = self.inner.decide(op, &checks, deadline).await?;
        self.inner.trace(targets, &decisions, started);
        Ok((decisions, deadline))
    }

    fn every_rule(&self, key: &Key, cost: u64) -> smallvec::SmallVec<[Target; 2]> {
        (0..self.inner.rules.load().len())
            .map(|rule| Target {
                rule,
                key: key.clone(),
                cost,
                resolved: None,
            })
            .collect()
    }

    /// A receipt for the admitted, counted decisions of `targets`.
    pub(crate) fn receipt(&self, targets: &Targets, decisions: &[Decision]) -> Option<Receipt> {
        let parts: smallvec::SmallVec<[RefundPart; 2]> = targets
            .iter()
            .zip(decisions)
            .filter(|(_, d)| d.allowed)
            .filter_map(|(t, d)| Some((t.clone(), d.taken?)))
            .collect();
        (!parts.is_empty()).then(|| Receipt {
            issuer: self.id(),
            parts,
        })
    }

    /// Give back receipts' parts, one store call per failure domain, within one deadline. Each
    /// is counted under the quota that decides its target now (its key's override, its
    /// resolved quota, or its rule), as its decision was; a state written under another quota
    /// since refunds nothing (the stores check).
    pub(crate) async fn refund_parts(&self, parts: &[RefundPart]) -> Result<(), Error> {
        let rules = self.inner.rules.load_full();
        let overrides = self.inner.overrides.load_full();
        let refunds = parts
            .iter()
            .map(|(target, taken)| {
                let rule = rules
                    .get(target.rule)
                    .ok_or_else(|| Error::UnknownRule(format!("#{}", target.rule)))?;
                Ok(Refund {
                    rule: effective(rule, &overrides, target),
                    key: &target.key,
                    taken: *taken,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let deadline = Deadline::after(self.inner.deadline);
        if self.inner.give_back(&refunds, deadline).await {
            Ok(())
        } else {
            Err(Error::Store(StoreError::Connection(
                "the store could not take the refund; the permits stay taken until they expire"
                    .into(),
            )))
        }
    }

    fn id(&self) -> u64 {
        self.inner.id
    }
}

/// Quotas for single keys, by (rule index, key): see [`Limiter::set_override`].
type Overrides = HashMap<(usize, Key), Rule>;

/// `targets` as store checks on `rules` (the rules in force when the decision began): each
/// with its key's override, else the quota resolved for the request, else the rule's own.
fn checks<'a>(
    rules: &'a [Rule],
    overrides: &'a Overrides,
    targets: &'a Targets,
) -> Result<Vec<Check<'a>>, Error> {
    targets
        .iter()
        .map(|t| {
            let rule = rules
                .get(t.rule)
                .ok_or_else(|| Error::UnknownRule(format!("#{}", t.rule)))?;
            Ok(Check {
                rule: effective(rule, overrides, t),
                key: &t.key,
                cost: t.cost,
            })
        })
        .collect()
}

/// The rule that decides `target`: its key's override, else its resolved quota, else `rule`.
#[inline]
fn effective<'a>(rule: &'a Rule, overrides: &'a Overrides, target: &'a Target) -> &'a Rule {
    if !overrides.is_empty() {
        if let Some(o) = overrides.get(&(target.rule, target.key.clone())) {
            return o;
        }
    }
    target.resolved.as_deref().unwrap_or(rule)
}

/// The decision that governs: a denial over an admission, then the longer wait.
fn most_restrictive(decisions: Vec<Decision>) -> Result<Decision, Error> {
    decisions
        .into_iter()
        .reduce(Decision::more_restrictive)
        .ok_or_else(|| Error::Store(StoreError::Protocol("no decision".into())))
}

impl Inner {
    /// Decide `checks`: a single-rule consume from a remembered denial or a leased block when
    /// this process can, else the store (one call per failure domain), else the outage policy.
    /// `deadline`: the request's, if it has one already (a store that can fail).
    async fn decide(
        &self,
        op: Op,
        checks: &[Check<'_>],
        deadline: Option<Deadline>,
    ) -> Result<Vec<Decision>, Error> {
        let Some(_) = &self.policy else {
            // A store that cannot fail: no deadline, no breaker.
            return Ok(self.store.apply(op, checks).await?);
        };
        let deadline = deadline.unwrap_or_else(|| Deadline::after(self.deadline));
        if let ([check], Op::Consume) = (checks, op) {
            if let Some(index) = self.rule_index(check.rule) {
                let now = self.clock.now_us();
                if let Some(d) = self.before_the_store(index, check, now) {
                    return Ok(vec![d]);
                }
                if let Some(d) = self.decide_leased(index, check, deadline).await? {
                    return Ok(vec![d]);
                }
            }
        }
        Ok(self.decide_in_store(op, checks, deadline).await)
    }

    /// The index of `rule` among the limiter's rules (checks borrow them); `None` when the
    /// quotas changed since the check was made (it then goes to the store).
    fn rule_index(&self, rule: &Rule) -> Option<usize> {
        self.rules.load().iter().position(|r| std::ptr::eq(r, rule))
    }

    /// A single-rule consume decided without waiting: a remembered denial, or permits from a
    /// leased block. `None`: ask the store ([`decide`](Inner::decide)).
    fn decide_now(&self, index: usize, check: &Check<'_>) -> Option<Decision> {
        // An overriding or per-request quota is decided by the store, as in `decide`.
        if self.rule_index(check.rule)? != index {
            return None;
        }
        let d = self.before_the_store(index, check, self.clock.now_us())?;
        // A refusal may earn a penalty, and blocking a key waits for the store: with a
        // penalty box, `decide` answers it (it can wait).
        (d.allowed || self.penalties.is_none()).then_some(d)
    }

    /// A single-rule consume decided in process, if it can be: a remembered listing's refusal
    /// (the key is blocked or denied, whatever permits this process holds), then permits already
    /// leased (spending them never passes the limit, and a denial remembered for this cost may
    /// predate the block), then a remembered denial.
    fn before_the_store(&self, index: usize, check: &Check<'_>, now: u64) -> Option<Decision> {
        let remembered = self.remembered(check, now);
        if let Some(d) = remembered.filter(|d| d.listed.is_listed()) {
            return Some(d);
        }
        self.spend_leased(index, check, now).or(remembered)
    }

    /// A remembered denial of this single-rule consume at `now`, if there is one. (Nearly
    /// always none is held: then no lock is taken, a leased key's every decision asks this.)
    fn remembered(&self, check: &Check<'_>, now: u64) -> Option<Decision> {
        let denials = self.denials.as_ref().filter(|c| !c.is_empty())?;
        let index = self.rule_index(check.rule)?;
        denials.get(&(index, check.key.clone()), check.cost, now)
    }

    /// When a store call for `key` (the first of its checks) is asked, for
    /// [`remember`](Inner::remember).
    fn asked(&self, key: Option<&Key>) -> Asked {
        let at = self.clock.now_us();
        Asked {
            at,
            answered_at: at,
            generation: match (&self.denials, key) {
                (Some(cache), Some(key)) => cache.generation(key),
                _ => 0,
            },
        }
    }

    /// Remember a store denial of a single-rule consume.
    fn remember(&self, check: &Check<'_>, d: &Decision, asked: Asked) {
        // An admission only lifts denials: none held, nothing to do (the common case).
        if d.allowed && self.denials.as_ref().is_none_or(|c| c.is_empty()) {
            return;
        }
        if let (Some(cache), Some(index)) = (&self.denials, self.rule_index(check.rule)) {
            let answered = Asked {
                answered_at: self.clock.now_us(),
                ..asked
            };
            cache.remember((index, check.key.clone()), check.cost, d, answered);
        }
    }

    /// The store admitted these checks, each alone at its cost (whether or not their request
    /// took anything: another rule may have refused it): a denial remembered for one of them
    /// (by a single-rule request) no longer stands. Kept, it would refuse the key through an
    /// outage, up to its old retry time, though the store had since said otherwise.
    fn lift_disproved(&self, checks: &[Check<'_>], decisions: &[Decision], asked: Asked) {
        if self.denials.as_ref().is_none_or(|c| c.is_empty()) {
            return;
        }
        for (c, d) in checks.iter().zip(decisions) {
            if d.allowed {
                self.remember(c, d, asked);
            }
        }
    }

    /// Decide without the store, as the policy says. Every such decision is marked degraded.
    /// What the store told this process before it went away outranks the policy, check by
    /// check: a key it decided by its listing stays decided by it (refused until the listing's
    /// end, on any rule and at any cost, or admitted counting nothing; see [`listings`]), and a
    /// refusal the denial cache remembered (a single-rule request on the rule's own quota, at the
    /// same cost) stands until its own retry time. When one check is refused, the others are
    /// only peeked, nothing taken; allow-listed checks are left out of what the policy counts.
    /// `refused_by_store`: this request's refusals by the failure domains that did answer (a
    /// cluster slot on a live master), which stand the same way.
    fn fallback(
        &self,
        op: Op,
        checks: &[Check<'_>],
        refused_by_store: Vec<Option<Decision>>,
    ) -> Vec<Decision> {
        self.degraded.fetch_add(1, Ordering::Relaxed);
        let policy = self.policy.as_ref().unwrap_or(&Policy::Open);
        let now = self.clock.now_us();
        let mut refused_by_store = refused_by_store.into_iter();
        let known: Vec<Option<Decision>> = checks
            .iter()
            .map(|c| {
                if let Some(d) = refused_by_store.next().flatten() {
                    return Some(d);
                }
                if let Some(d) = self
                    .listings
                    .in_outage(c.key, c.rule.quota().capacity(), now)
                {
                    return Some(d);
                }
                let denials = self.denials.as_ref().filter(|_| op == Op::Consume)?;
                let index = self.rule_index(c.rule)?;
                let mut d = denials.get_in_outage(&(index, c.key.clone()), c.cost, now)?;
                d.degraded = true;
                Some(d)
            })
            .collect();
        if known.iter().all(Option::is_none) {
            return policy.decide(op, checks);
        }
        // The policy answers one decision per check; a refusal stands in for a missing one.
        let missing =
            |c: &Check<'_>| Decision::deny(c.rule.quota().capacity(), 0, Duration::ZERO, None);
        crate::store::around_known(
            op,
            checks,
            known,
            |op, rest| policy.decide(op, rest),
            missing,
        )
    }

    /// Report a consume's decisions through the metrics facade, and count its refusals among
    /// the heavy hitters.
    #[inline]
    fn record(&self, targets: &Targets, decisions: &[Decision]) {
        let mut refused: Option<&Key> = None;
        for (t, d) in targets.iter().zip(decisions) {
            self.telemetry.decision(t.rule, d);
            if !d.allowed && refused.is_none() {
                refused = Some(&t.key);
            }
        }
        if let (Some(heavy), Some(key)) = (&self.heavy, refused) {
            heavy.denied(key, self.clock.now_us());
        }
    }

    /// Count this consume's store denials in the penalty box; the keys they got blocked, and
    /// for how long.
    #[inline]
    fn earned(
        &self,
        targets: &Targets,
        decisions: &[Decision],
        counting: Counting,
    ) -> Vec<(Key, Duration)> {
        let Some(penalties) = &self.penalties else {
            return Vec::new();
        };
        if counting != Counting::Request {
            return Vec::new();
        }
        let now = self.clock.now_us();
        let mut earned: Vec<(Key, Duration)> = Vec::new();
        let mut counted: Vec<&Key> = Vec::new();
        for (t, d) in targets.iter().zip(decisions) {
            // The outage policy's refusals and costs that never fit are not the client
            // hammering, nor refusals by a listing (a block is the penalty already; counted, an
            // operator's short block would be replaced by the box's longer one). A key every
            // request shares is never blocked: one client's flood would refuse everyone.
            if d.allowed
                || d.degraded
                || d.retry_after.is_none()
                || d.listed.is_listed()
                || t.key.is_shared()
                || counted.contains(&&t.key)
            {
                continue;
            }
            counted.push(&t.key);
            if let Some(block) = penalties.denied(&t.key, now) {
                earned.push((t.key.clone(), block));
            }
        }
        earned
    }

    /// [`penalise`](Inner::penalise) with a deadline of its own, waited for within the
    /// request's (`None`: a store that cannot fail, waited for whole). The request's deadline
    /// may be nearly spent by its decision; the block is still recorded after the response.
    /// If it cannot be, the penalty box forgets it, so that the key's next refusals count again.
    /// True when this block was written, within the request's deadline.
    async fn penalise_within(&self, key: Key, block: Duration, request: Option<Deadline>) -> bool {
        let Some(request) = request else {
            let written = self.penalise(&key, block, None).await;
            if written.is_none() {
                self.not_blocked(&key);
            }
            return written == Some(true);
        };
        let record = {
            let me = self.me.clone();
            async move {
                let inner = me.upgrade()?;
                let budget = Deadline::after(inner.deadline);
                let written = inner.penalise(&key, block, Some(budget)).await;
                if written.is_none() {
                    inner.not_blocked(&key);
                    tracing::warn!(key = %key, "fleetlimit: the penalty box could not block a key");
                }
                written
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => matches!(request.run(runtime.spawn(record)).await, Ok(Ok(Some(true)))),
            Err(_) => record.await == Some(true),
        }
    }

    /// The block the penalty box counted for `key` could not be written (the store failed):
    /// the key's refusals count again, and its next block is not doubled for this one. (When an
    /// entry stands instead, that entry refuses the key: the box's record stays.)
    fn not_blocked(&self, key: &Key) {
        if let Some(penalties) = &self.penalties {
            penalties.not_blocked(key);
        }
    }

    /// `key`'s listing changed from this process: what was decided before stands no more here,
    /// at once (other instances learn it from the store, within a block's validity): its
    /// remembered denials, and its leased blocks under every rule.
    fn listing_changed(&self, key: &Key) {
        if let Some(denials) = &self.denials {
            denials.forget(key);
        }
        for index in 0..self.rules.load().len() {
            self.leases.key_changed(index, key);
        }
    }

    /// Block `key` for `block`, unless an operator's entry says more: a deny-list or
    /// allow-list entry, or a block that ends later, is never shortened or replaced. `Some(true)`
    /// when this block was written, `Some(false)` when such an entry stands, `None` when the
    /// store could not say. `deadline`: the call goes through the key's
    /// breaker within it (`None`: an in-process store, or one that cannot fail, asked
    /// directly), so that an open breaker answers at once, as it does every decision.
    async fn penalise(
        &self,
        key: &Key,
        block: Duration,
        deadline: Option<Deadline>,
    ) -> Option<bool> {
        // One step in the store: an operator's entry made meanwhile, from any instance, is
        // never overwritten by a block read as missing a moment before.
        let call = self.store.block_unless_listed(key, block);
        let answer = match deadline {
            Some(deadline) => {
                let rules = self.rules.load();
                let rule = rules.first()?;
                // Any rule will do: a key's listing lives in its own slot, whatever the rule.
                let check = Check { rule, key, cost: 1 };
                self.call_store("penalise", std::slice::from_ref(&check), deadline, call)
                    .await
                    .ok_or_else(|| {
                        StoreError::Connection(
                            "not answered (an open breaker, or the deadline)".into(),
                        )
                    })
            }
            None => call.await,
        };
        match answer {
            Ok(false) => Some(false),
            Ok(true) => {
                self.listing_changed(key);
                if self.policy.is_some() {
                    let now = self.clock.now_us();
                    self.listings.set(key, Some(Listing::Block(block)), now);
                }
                tracing::info!(key = %key, ?block, "fleetlimit: the penalty box blocked a key");
                Some(true)
            }
            Err(error) => {
                tracing::debug!(key = %key, %error, "fleetlimit: setting a penalty block failed");
                None
            }
        }
    }

    /// One `debug` event per decision and rule, keys fingerprinted; `started` is `None` when
    /// that level is off.
    #[inline]
    fn trace(&self, targets: &Targets, decisions: &[Decision], started: Option<Instant>) {
        let Some(started) = started else {
            return;
        };
        let latency_us = started.elapsed().as_micros() as u64;
        let rules = self.rules.load();
        for (t, d) in targets.iter().zip(decisions) {
            let rule = rules.get(t.rule).map_or("?", |r| r.name());
            tracing::debug!(
                rule,
                key = %t.key,
                cost = t.cost,
                allowed = d.allowed,
                remaining = d.remaining,
                source = ?d.source,
                degraded = d.degraded,
                latency_us,
                "fleetlimit: decision"
            );
        }
    }
}
