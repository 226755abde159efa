//! Building a limiter: rules, the outage policy (required for stores that can fail, by type),
//! the deadline, breakers, leases and the denial cache, all validated before anything runs.

use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use super::breaker::Breakers;
use super::denials::DenialCache;
use super::heavy::HeavyHitters;
use super::leases::Leases;
use super::penalty::{Penalties, Penalty};
use super::policy::Policy;
use super::{BreakerConfig, Inner, LeaseConfig, Limiter, OnStoreError};
use crate::error::ConfigError;
use crate::store::Store;
use crate::{Clock, MemoryStore, Rule, SystemClock};

/// The default deadline for a decision from a networked store.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(50);

/// Remembered denials kept by default for a store that can fail.
const DEFAULT_DENY_CACHE: usize = 10_000;

/// Keys the heavy-hitter summary counts at once, by default.
const DEFAULT_HEAVY_HITTERS: usize = 100;

/// Keys the penalty box keeps a record of at once.
const PENALTY_RECORDS: usize = 10_000;

/// How long a remembered store denial is trusted by default: the bound within which every
/// instance sees a reset, a lifted block, a raised quota or a Redis restarted empty.
pub const DEFAULT_DENY_CACHE_MAX_AGE: Duration = Duration::from_secs(1);

/// The builder's state before an outage policy is chosen.
#[derive(Debug, Clone, Copy)]
pub struct PolicyUnset;

/// A store that cannot fail, so a limiter on it needs no outage policy. Sealed (as [`Store`]
/// is): only the in-process [`MemoryStore`] is one.
pub trait InfallibleStore: Store {}

impl InfallibleStore for MemoryStore {}

/// Builder for [`Limiter`]; [`build`](LimiterBuilder::build) validates. On a store that can fail,
/// `build` exists only once [`on_store_error`](LimiterBuilder::on_store_error) has been chosen.
#[must_use = "a limiter builder does nothing until `build` is called"]
pub struct LimiterBuilder<S, P = PolicyUnset> {
    store: S,
    rules: Vec<Rule>,
    leases: Vec<(String, LeaseConfig)>,
    deny_cache: Option<usize>,
    deny_cache_max_age: Duration,
    policy: Option<OnStoreError>,
    deadline: Duration,
    breaker: BreakerConfig,
    clock: Arc<dyn Clock>,
    penalty: Option<Penalty>,
    /// Heavy hitters: capacity (0: off), period, raw keys.
    heavy: (usize, Duration, bool),
    _policy: PhantomData<P>,
}

impl<S, P> std::fmt::Debug for LimiterBuilder<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimiterBuilder")
            .field("rules", &self.rules)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Limiter {
    /// Start building a limiter on `store`.
    pub fn builder<S: Store>(store: S) -> LimiterBuilder<S> {
        LimiterBuilder {
            store,
            rules: Vec::new(),
            leases: Vec::new(),
            deny_cache: None,
            deny_cache_max_age: DEFAULT_DENY_CACHE_MAX_AGE,
            policy: None,
            deadline: DEFAULT_DEADLINE,
            breaker: BreakerConfig::default(),
            clock: Arc::new(SystemClock),
            penalty: None,
            heavy: (DEFAULT_HEAVY_HITTERS, Duration::from_secs(60), false),
            _policy: PhantomData,
        }
    }
}

impl<S: Store, P> LimiterBuilder<S, P> {
    /// Add a rule. Every rule applies to every request; a request is admitted only if all
    /// admit, and a denial by one takes nothing from the others.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// The longest a decision may wait for the store (default 50 ms), counted once from the
    /// start of the decision: waiting for another request's refill of a leased key, the lease
    /// call and any second store call all come out of it. When it passes, the store call is
    /// abandoned (never retried: it may have run) and the outage policy decides. A Redis
    /// store's standalone and Sentinel connections give a call 5 s at most, whatever this is.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// When the circuit breaker opens and how long before it probes.
    pub fn breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = config;
        self
    }

    /// Lease the hot keys of rule `rule` (see [`LeaseConfig`]): blocks of permits taken from
    /// the store at once and spent in process memory, so a key at tens of thousands of requests
    /// per second costs a few store calls per second. The fleet still never exceeds the limit:
    /// permits are deducted when leased. Not for the sliding log. Requests that several rules
    /// apply to are decided by the store, one call each.
    pub fn lease(mut self, rule: &str, config: LeaseConfig) -> Self {
        self.leases.push((rule.to_owned(), config));
        self
    }

    /// Remember up to this many store denials (default 10,000 for stores that can fail, none
    /// for the memory store; 0 turns it off): a key the store refused until T is refused in
    /// process until T, or for [`deny_cache_max_age`](LimiterBuilder::deny_cache_max_age) at
    /// most, for a request of the same cost, so a flood on an exhausted key costs one store
    /// call per key and instance per second, not one per request. Single-rule requests only.
    pub fn deny_cache(mut self, capacity: usize) -> Self {
        self.deny_cache = Some(capacity);
        self
    }

    /// How long a remembered store denial is trusted (default
    /// [`DEFAULT_DENY_CACHE_MAX_AGE`], 1 s): a key reset, unblocked, given a larger quota or
    /// wiped by a Redis restart is admitted again by every instance within this bound, while a
    /// flood on an exhausted key still costs at most one store call per key and instance per
    /// this period. Must be greater than zero (turn the cache off with `deny_cache(0)`).
    pub fn deny_cache_max_age(mut self, max_age: Duration) -> Self {
        self.deny_cache_max_age = max_age;
        self
    }

    /// Count the keys refused most over the last `period` in a summary of `capacity` keys
    /// (default 100 keys, 60 s; 0 turns it off), read with
    /// [`Limiter::heavy_hitters`](crate::Limiter::heavy_hitters). Keys are reported
    /// fingerprinted unless `raw_keys` (they may be credentials or personal data).
    pub fn heavy_hitters(mut self, capacity: usize, period: Duration, raw_keys: bool) -> Self {
        self.heavy = (capacity, period, raw_keys);
        self
    }

    /// Block keys that keep coming back while refused (the penalty box): see [`Penalty`].
    pub fn penalty(mut self, penalty: Penalty) -> Self {
        self.penalty = Some(penalty);
        self
    }

    /// The clock the breaker, the leases and a local fallback read (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    fn build_inner(self) -> Result<Limiter, ConfigError> {
        if self.rules.is_empty() {
            return Err(ConfigError::NoRules);
        }
        for (i, rule) in self.rules.iter().enumerate() {
            if self.rules[..i].iter().any(|r| r.name() == rule.name()) {
                // Two rules of one name would share their state in the store.
                return Err(ConfigError::InvalidRuleName(rule.name().to_owned()));
            }
        }
        if self.deadline.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "deadline",
                reason: "must be greater than zero".into(),
            });
        }
        if self.deny_cache_max_age.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "deny_cache_max_age",
                reason: "must be greater than zero; turn the cache off with deny_cache(0)".into(),
            });
        }
        if self.breaker.failures == 0 || self.breaker.cool_down.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "breaker",
                reason: "needs at least one failure and a non-zero cool-down".into(),
            });
        }
        if let Some(penalty) = &self.penalty {
            penalty.validate()?;
        }
        if self.heavy.0 > 0 && self.heavy.1.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "heavy_hitters",
                reason: "the period must be above zero".into(),
            });
        }
        let policy = self
            .policy
            .map(|p| Policy::resolve(p, &self.rules, &self.clock))
            .transpose()?;
        let mut lease_configs = vec![None; self.rules.len()];
        for (name, config) in &self.leases {
            let Some(i) = self.rules.iter().position(|r| r.name() == name) else {
                return Err(ConfigError::Invalid {
                    setting: "lease",
                    reason: format!("the limiter has no rule named {name:?}"),
                });
            };
            config.validate(&self.rules[i])?;
            lease_configs[i] = Some(*config);
        }
        let deny_cache = self.deny_cache.unwrap_or(if policy.is_some() {
            DEFAULT_DENY_CACHE
        } else {
            0
        });
        let domains = self.store.failure_domains();
        let telemetry = super::telemetry::Telemetry::new(&self.rules);
        // Never reused, unlike an address: a receipt outlives nothing it could be confused with.
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Ok(Limiter {
            inner: Arc::new_cyclic(|me| Inner {
                id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                me: me.clone(),
                leases: Leases::new(lease_configs.into_boxed_slice()),
                denials: (deny_cache > 0)
                    .then(|| DenialCache::new(deny_cache, self.deny_cache_max_age)),
                store: Arc::new(self.store),
                rules: arc_swap::ArcSwap::from_pointee(self.rules),
                changing: parking_lot::Mutex::new(()),
                overrides: Default::default(),
                penalties: self
                    .penalty
                    .map(|p| Penalties::new(p, PENALTY_RECORDS, self.deadline)),
                other_algorithm_said: Default::default(),
                telemetry,
                heavy: (self.heavy.0 > 0)
                    .then(|| HeavyHitters::new(self.heavy.0, self.heavy.1, self.heavy.2)),
                policy,
                deadline: self.deadline,
                breakers: Breakers::new(domains, self.breaker),
                clock: self.clock,
                degraded: AtomicU64::new(0),
                listings: Default::default(),
                lines: Default::default(),
            }),
        })
    }
}

impl<S: Store> LimiterBuilder<S, PolicyUnset> {
    /// Choose what happens when the store cannot decide. Required for stores that can fail.
    pub fn on_store_error(self, policy: OnStoreError) -> LimiterBuilder<S, OnStoreError> {
        LimiterBuilder {
            store: self.store,
            rules: self.rules,
            leases: self.leases,
            deny_cache: self.deny_cache,
            deny_cache_max_age: self.deny_cache_max_age,
            policy: Some(policy),
            deadline: self.deadline,
            breaker: self.breaker,
            clock: self.clock,
            penalty: self.penalty,
            heavy: self.heavy,
            _policy: PhantomData,
        }
    }
}

impl<S: InfallibleStore> LimiterBuilder<S, PolicyUnset> {
    /// Validate (at least one rule, unique names) and build.
    pub fn build(self) -> Result<Limiter, ConfigError> {
        self.build_inner()
    }
}

impl<S: Store> LimiterBuilder<S, OnStoreError> {
    /// Validate (at least one rule, unique names, a valid policy) and build.
    pub fn build(self) -> Result<Limiter, ConfigError> {
        self.build_inner()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Quota};

    fn rule(name: &str) -> Rule {
        Rule::new(name, Quota::per_second(5).build().unwrap()).unwrap()
    }

    fn log(name: &str) -> Rule {
        Rule::new(
            name,
            Quota::per_second(5)
                .algorithm(Algorithm::SlidingLog)
                .build()
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn every_invalid_setting_is_a_config_error() {
        let memory = MemoryStore::new;
        assert_eq!(
            Limiter::builder(memory()).build().unwrap_err(),
            ConfigError::NoRules
        );
        assert_eq!(
            Limiter::builder(memory())
                .rule(rule("a"))
                .rule(rule("a"))
                .build()
                .unwrap_err(),
            ConfigError::InvalidRuleName("a".into()),
            "duplicate names would share store state"
        );
        let invalid = |e: ConfigError, setting: &str| {
            assert!(
                matches!(&e, ConfigError::Invalid { setting: s, .. } if *s == setting),
                "{e:?}"
            )
        };
        invalid(
            Limiter::builder(memory())
                .rule(rule("a"))
                .deadline(Duration::ZERO)
                .build()
                .unwrap_err(),
            "deadline",
        );
        for breaker in [
            BreakerConfig {
                failures: 0,
                ..BreakerConfig::default()
            },
            BreakerConfig {
                cool_down: Duration::ZERO,
                ..BreakerConfig::default()
            },
        ] {
            invalid(
                Limiter::builder(memory())
                    .rule(rule("a"))
                    .breaker(breaker)
                    .build()
                    .unwrap_err(),
                "breaker",
            );
        }
        invalid(
            Limiter::builder(memory())
                .rule(rule("a"))
                .on_store_error(OnStoreError::LocalShare(0))
                .build()
                .unwrap_err(),
            "on_store_error",
        );
        invalid(
            Limiter::builder(memory())
                .rule(rule("a"))
                .lease("b", LeaseConfig::auto())
                .build()
                .unwrap_err(),
            "lease",
        );
        invalid(
            Limiter::builder(memory())
                .rule(log("a"))
                .lease("a", LeaseConfig::auto())
                .build()
                .unwrap_err(),
            "lease",
        );
        invalid(
            Limiter::builder(memory())
                .rule(rule("a"))
                .lease("a", LeaseConfig::fixed(0))
                .build()
                .unwrap_err(),
            "lease",
        );
        assert!(Limiter::builder(memory())
            .rule(rule("a"))
            .rule(rule("b"))
            .lease("a", LeaseConfig::auto())
            .build()
            .is_ok());
    }
}
