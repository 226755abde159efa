//! The limiter: rules × key → one decision, through a store; and what happens when the store
//! fails.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{ConfigError, Error};
use crate::store::{Check, Op, Refund, Store};
use crate::{
    Clock, Decision, Key, MemoryStore, Quota, Rule, Source, StoreError, SystemClock, Taken,
};

mod breaker;
mod lease;

use breaker::{Admission, Breaker, Transition};
pub use breaker::{BreakerConfig, BreakerState};
pub use lease::LeaseConfig;

/// The default deadline for a decision from a networked store.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(50);

/// What to do when the store cannot decide (down, slow, erroring). There is no default: a
/// limiter on a networked store does not build until you choose.
///
/// - `FailOpen`: admit, marked degraded. Availability first; the limit is off during the outage.
/// - `FailClosed`: refuse, marked degraded. The layer answers `503 Service Unavailable` (the
///   client did nothing wrong; configurable to 429) with `Retry-After: retry_after`.
/// - `Local(quota)`: decide in this process with `quota` in place of every rule (e.g. the fleet
///   limit divided by the number of servers).
/// - `LocalShare(n)`: decide in this process with every rule's own quota divided by `n` (limit and
///   burst; at least 1), the same algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Admit every request while the store is unavailable.
    FailOpen,
    /// Refuse every request while the store is unavailable.
    FailClosed {
        /// The `Retry-After` given to refused clients.
        retry_after: Duration,
    },
    /// Decide in process with this quota for every rule.
    Local(Quota),
    /// Decide in process with each rule's quota divided by this many servers.
    LocalShare(u64),
}

impl OnStoreError {
    /// [`OnStoreError::FailClosed`] with a `Retry-After` of one second.
    pub fn fail_closed() -> OnStoreError {
        OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The builder's state before an outage policy is chosen.
#[derive(Debug, Clone, Copy)]
pub struct PolicyUnset;

/// A store that cannot fail, so a limiter on it needs no outage policy.
pub trait InfallibleStore: Store {}

impl InfallibleStore for MemoryStore {}

/// Counters of what the limiter did; see [`Limiter::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LimiterStats {
    /// Decisions made by the outage policy instead of the store.
    pub degraded_decisions: u64,
    /// Store calls that failed or missed the deadline.
    pub store_errors: u64,
    /// Times a breaker opened.
    pub breaker_opened: u64,
    /// Breakers open right now.
    pub open_breakers: u64,
    /// Lease requests made to the store.
    pub lease_calls: u64,
    /// Keys in leased mode right now.
    pub leased_keys: u64,
}

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
    issuer: usize,
    parts: smallvec::SmallVec<[(usize, Key, Taken); 2]>,
}

impl Receipt {
    /// How many permits it would give back at most (summed over its rules).
    pub fn cost(&self) -> u64 {
        self.parts.iter().map(|(_, _, t)| t.cost).sum()
    }
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
/// ```compile_fail
/// # use fleetlimit::{Limiter, Rule, RedisStore};
/// fn no_policy(store: RedisStore, rule: Rule) {
///     let _ = Limiter::builder(store).rule(rule).build();
/// }
/// ```
///
/// ```
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
    /// This limiter, for the task that gives back idle leases.
    me: std::sync::Weak<Inner>,
    leases: lease::Leases,
    store: Arc<dyn Store>,
    rules: Box<[Rule]>,
    policy: Option<Policy>,
    deadline: Duration,
    breakers: Box<[Breaker]>,
    breaker_config: BreakerConfig,
    clock: Arc<dyn Clock>,
    degraded: AtomicU64,
    store_errors: AtomicU64,
    opened: AtomicU64,
}

/// The outage policy, resolved when the limiter is built.
enum Policy {
    Open,
    Closed {
        retry_after: Duration,
    },
    Local {
        store: MemoryStore,
        rules: Box<[Rule]>,
    },
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("rules", &self.inner.rules)
            .field("deadline", &self.inner.deadline)
            .finish_non_exhaustive()
    }
}

/// Builder for [`Limiter`]; [`build`](LimiterBuilder::build) validates. On a store that can fail,
/// `build` exists only once [`on_store_error`](LimiterBuilder::on_store_error) has been chosen.
#[must_use = "a limiter builder does nothing until `build` is called"]
pub struct LimiterBuilder<S, P = PolicyUnset> {
    store: S,
    rules: Vec<Rule>,
    leases: Vec<(String, LeaseConfig)>,
    deny_cache: Option<usize>,
    policy: Option<OnStoreError>,
    deadline: Duration,
    breaker: BreakerConfig,
    clock: Arc<dyn Clock>,
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

impl<S: Store, P> LimiterBuilder<S, P> {
    /// Add a rule. Every rule applies to every request; a request is admitted only if all
    /// admit, and a denial by one takes nothing from the others.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// The longest a decision may wait for the store (default 50 ms). A store call that takes
    /// longer is abandoned (never retried: it may have run) and the outage policy decides.
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
    /// process until T, so a flood on an exhausted key costs one store call per retry period,
    /// not one per request. Never longer than the store's own answer; single-rule requests only.
    pub fn deny_cache(mut self, capacity: usize) -> Self {
        self.deny_cache = Some(capacity);
        self
    }

    /// The clock the breaker (and a local fallback) reads (default: the system clock).
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
                return Err(ConfigError::InvalidRuleName(rule.name().to_owned()));
            }
        }
        if self.deadline.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "deadline",
                reason: "must be greater than zero".into(),
            });
        }
        if self.breaker.failures == 0 || self.breaker.cool_down.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "breaker",
                reason: "needs at least one failure and a non-zero cool-down".into(),
            });
        }
        let policy = match self.policy {
            None => None,
            Some(OnStoreError::FailOpen) => Some(Policy::Open),
            Some(OnStoreError::FailClosed { retry_after }) => Some(Policy::Closed { retry_after }),
            Some(OnStoreError::Local(quota)) => {
                Some(local_policy(&self.rules, &self.clock, |_| {
                    Ok(quota.clone())
                })?)
            }
            Some(OnStoreError::LocalShare(servers)) => {
                if servers == 0 {
                    return Err(ConfigError::Invalid {
                        setting: "on_store_error",
                        reason: "LocalShare needs at least one server".into(),
                    });
                }
                Some(local_policy(&self.rules, &self.clock, |q| {
                    let mut b = Quota::new((q.limit() / servers).max(1), q.period())
                        .algorithm(q.algorithm());
                    if matches!(
                        q.algorithm(),
                        crate::Algorithm::TokenBucket | crate::Algorithm::Gcra
                    ) {
                        b = b.burst((q.burst() / servers).max(1));
                    }
                    b.max_log_len(q.limit()).build()
                })?)
            }
        };
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
        let deny_cache = self
            .deny_cache
            .unwrap_or(if policy.is_some() { 10_000 } else { 0 });
        let leases = lease::Leases::new(lease_configs.into_boxed_slice(), deny_cache);
        let domains = self.store.failure_domains().max(1);
        Ok(Limiter {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                leases,
                store: Arc::new(self.store),
                rules: self.rules.into_boxed_slice(),
                policy,
                deadline: self.deadline,
                breakers: (0..domains).map(|_| Breaker::default()).collect(),
                breaker_config: self.breaker,
                clock: self.clock,
                degraded: AtomicU64::new(0),
                store_errors: AtomicU64::new(0),
                opened: AtomicU64::new(0),
            }),
        })
    }
}

fn local_policy(
    rules: &[Rule],
    clock: &Arc<dyn Clock>,
    quota_for: impl Fn(&Quota) -> Result<Quota, ConfigError>,
) -> Result<Policy, ConfigError> {
    let rules = rules
        .iter()
        .map(|r| Rule::new(r.name(), quota_for(r.quota())?))
        .collect::<Result<Vec<_>, _>>()?;
    let store = MemoryStore::builder()
        .clock(SharedClock(clock.clone()))
        .build()?;
    Ok(Policy::Local {
        store,
        rules: rules.into_boxed_slice(),
    })
}

/// A clock shared with the limiter.
#[derive(Debug)]
struct SharedClock(Arc<dyn Clock>);

impl Clock for SharedClock {
    fn now_us(&self) -> u64 {
        self.0.now_us()
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
            policy: Some(policy),
            deadline: self.deadline,
            breaker: self.breaker,
            clock: self.clock,
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

impl Limiter {
    /// Start building a limiter on `store`.
    pub fn builder<S: Store>(store: S) -> LimiterBuilder<S> {
        LimiterBuilder {
            store,
            rules: Vec::new(),
            leases: Vec::new(),
            deny_cache: None,
            policy: None,
            deadline: DEFAULT_DEADLINE,
            breaker: BreakerConfig::default(),
            clock: Arc::new(SystemClock),
            _policy: PhantomData,
        }
    }

    /// The limiter's rules.
    pub fn rules(&self) -> &[Rule] {
        &self.inner.rules
    }

    /// Take `cost` permits for `key` from every rule, or from none if any rule denies. Returns
    /// the most restrictive rule's decision.
    pub async fn consume(&self, key: &Key, cost: u64) -> Result<Decision, Error> {
        self.apply(Op::Consume, key, cost).await
    }

    /// The decision a request of cost 1 would get, without taking anything; `remaining` is the
    /// count right now.
    pub async fn peek(&self, key: &Key) -> Result<Decision, Error> {
        self.apply(Op::Peek, key, 1).await
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
        let targets: smallvec::SmallVec<[(usize, Key); 2]> = (0..self.inner.rules.len())
            .map(|i| (i, key.clone()))
            .collect();
        let decisions = self.apply_indexed(Op::Consume, &targets, cost).await?;
        let receipt = self.receipt(&targets, &decisions);
        let decision = decisions
            .into_iter()
            .reduce(Decision::more_restrictive)
            .ok_or_else(|| Error::Store(StoreError::Protocol("no decision".into())))?;
        Ok((decision, receipt))
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

    /// A receipt for the admitted, counted decisions of `targets`.
    pub(crate) fn receipt(
        &self,
        targets: &[(usize, Key)],
        decisions: &[Decision],
    ) -> Option<Receipt> {
        let parts: smallvec::SmallVec<[(usize, Key, Taken); 2]> = targets
            .iter()
            .zip(decisions)
            .filter(|(_, d)| d.allowed)
            .filter_map(|((i, key), d)| Some((*i, key.clone(), d.taken?)))
            .collect();
        (!parts.is_empty()).then(|| Receipt {
            issuer: self.id(),
            parts,
        })
    }

    /// Give back receipts' parts (rule index, key, where taken).
    pub(crate) async fn refund_parts(&self, parts: &[(usize, Key, Taken)]) -> Result<(), Error> {
        let rules = &self.inner.rules;
        let refunds = parts
            .iter()
            .map(|(i, key, taken)| {
                let rule = rules
                    .get(*i)
                    .ok_or_else(|| Error::UnknownRule(format!("#{i}")))?;
                Ok(Refund {
                    rule,
                    key,
                    taken: *taken,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        if refunds.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        let checks: Vec<Check<'_>> = refunds
            .iter()
            .map(|r| Check {
                rule: r.rule,
                key: r.key,
                cost: r.taken.cost,
            })
            .collect();
        if inner.policy.is_none() {
            inner.store.refund(&refunds).await?;
            return Ok(());
        }
        let domain = inner.store.failure_domain(&checks);
        match inner.call_store(domain, inner.store.refund(&refunds)).await {
            Some(_) => Ok(()),
            None => Err(Error::Store(StoreError::Connection(
                "the store could not take the refund; the permits stay taken until they expire"
                    .into(),
            ))),
        }
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
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
        for (i, (name, key)) in targets.iter().enumerate() {
            if targets[..i].iter().any(|(n, k)| n == name && k == key) {
                return Err(Error::DuplicateTarget((*name).to_owned()));
            }
        }
        let rules = &self.inner.rules;
        let checks = targets
            .iter()
            .map(|(name, key)| {
                let rule = rules
                    .iter()
                    .find(|r| r.name() == *name)
                    .ok_or_else(|| Error::UnknownRule((*name).to_owned()))?;
                Ok(Check { rule, key, cost })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        self.decide_checks(op, &checks).await
    }

    /// Decide a consume right now when the store is in process and nothing (leasing) needs a
    /// future; `None` means "await [`apply_indexed`](Limiter::apply_indexed)".
    pub(crate) fn consume_now(
        &self,
        targets: &[(usize, Key)],
        cost: u64,
    ) -> Option<smallvec::SmallVec<[Decision; 2]>> {
        let inner = &self.inner;
        if inner.policy.is_some() || cost == 0 || !inner.leases.is_idle() {
            return None;
        }
        let rules = &inner.rules;
        match targets {
            [(i, key)] => {
                let check = Check {
                    rule: rules.get(*i)?,
                    key,
                    cost,
                };
                let d = inner.store.check_now(Op::Consume, &check)?;
                Some(smallvec::smallvec![d])
            }
            _ => {
                let checks = targets
                    .iter()
                    .map(|(i, key)| {
                        Some(Check {
                            rule: rules.get(*i)?,
                            key,
                            cost,
                        })
                    })
                    .collect::<Option<Vec<_>>>()?;
                inner.store.apply_now(Op::Consume, &checks).map(Into::into)
            }
        }
    }

    /// Like [`apply_to`](Limiter::apply_to), with rules by their index in [`rules`](Limiter::rules).
    pub(crate) async fn apply_indexed(
        &self,
        op: Op,
        targets: &[(usize, Key)],
        cost: u64,
    ) -> Result<Vec<Decision>, Error> {
        let rules = &self.inner.rules;
        let checks = targets
            .iter()
            .map(|(i, key)| {
                let rule = rules
                    .get(*i)
                    .ok_or_else(|| Error::UnknownRule(format!("#{i}")))?;
                Ok(Check { rule, key, cost })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        self.decide_checks(op, &checks).await
    }

    async fn decide_checks(&self, op: Op, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        if checks.iter().any(|c| c.cost == 0) {
            return Err(Error::InvalidCost(0));
        }
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        self.inner.decide(op, checks).await
    }

    /// Give back every unspent leased permit now and leave leased mode (for a shutdown; idle
    /// keys give theirs back by themselves).
    pub async fn release_leases(&self) {
        self.inner.release_all().await;
    }

    /// What the limiter has done so far: degraded decisions, store errors, breaker openings,
    /// lease requests.
    pub fn stats(&self) -> LimiterStats {
        let i = &self.inner;
        LimiterStats {
            lease_calls: i.leases.lease_calls(),
            leased_keys: i.leases.leased_keys() as u64,
            degraded_decisions: i.degraded.load(Ordering::Relaxed),
            store_errors: i.store_errors.load(Ordering::Relaxed),
            breaker_opened: i.opened.load(Ordering::Relaxed),
            open_breakers: i
                .breakers
                .iter()
                .filter(|b| b.state() == BreakerState::Open)
                .count() as u64,
        }
    }

    async fn apply(&self, op: Op, key: &Key, cost: u64) -> Result<Decision, Error> {
        if cost == 0 {
            return Err(Error::InvalidCost(cost));
        }
        let decisions = match &*self.inner.rules {
            [rule] => self.inner.decide(op, &[Check { rule, key, cost }]).await?,
            rules => {
                let checks: Vec<Check<'_>> =
                    rules.iter().map(|rule| Check { rule, key, cost }).collect();
                self.inner.decide(op, &checks).await?
            }
        };
        decisions
            .into_iter()
            .reduce(Decision::more_restrictive)
            .ok_or_else(|| {
                Error::Store(StoreError::Protocol(
                    "the store returned no decision".into(),
                ))
            })
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

impl Inner {
    async fn decide(&self, op: Op, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        // A single-rule consume may be decided in process (leased block, remembered denial).
        let single = match (checks, op) {
            ([check], Op::Consume) => self
                .rules
                .iter()
                .position(|r| std::ptr::eq(r, check.rule))
                .map(|i| (i, check)),
            _ => None,
        };
        if let Some((index, check)) = single {
            if let Some(decision) = self.decide_locally(index, check).await? {
                return Ok(vec![decision]);
            }
        }
        let Some(policy) = &self.policy else {
            // An infallible store: no deadline, no breaker.
            return Ok(self.store.apply(op, checks).await?);
        };
        let domain = self.store.failure_domain(checks);
        // Measured from before the call, so a remembered denial never outlasts the store's.
        let asked_at = self.clock.now_us();
        match self.call_store(domain, self.store.apply(op, checks)).await {
            Some(decisions) => {
                if let (Some((index, check)), [d]) = (single, decisions.as_slice()) {
                    self.leases.remember_denial(index, check, d, asked_at);
                }
                Ok(decisions)
            }
            None => self.fallback(policy, op, checks).await,
        }
    }

    /// Call the store through the failure domain's circuit breaker, within the deadline.
    /// `None` means the store could not decide: the outage policy must.
    async fn call_store<T>(
        &self,
        domain: usize,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        let domain = domain % self.breakers.len();
        let breaker = &self.breakers[domain];
        let admission = breaker.admit(self.clock.now_us());
        if admission == Admission::Skip {
            return None;
        }
        let probe = admission == Admission::Probe;
        let mut guard = ProbeGuard(probe.then_some(breaker));
        let result = match tokio::time::timeout(self.deadline, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.deadline)),
        };
        guard.0 = None;
        match result {
            Ok(value) => {
                if breaker.success() == Transition::Closed {
                    tracing::info!(domain, "fleetlimit: store answers again; breaker closed");
                }
                Some(value)
            }
            Err(error) => {
                self.store_errors.fetch_add(1, Ordering::Relaxed);
                if breaker.failure(self.clock.now_us(), probe, &self.breaker_config)
                    == Transition::Opened
                {
                    self.opened.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        domain,
                        %error,
                        cool_down = ?self.breaker_config.cool_down,
                        "fleetlimit: store failing; breaker opened, decisions follow the outage policy"
                    );
                } else {
                    tracing::debug!(domain, %error, "fleetlimit: store call failed");
                }
                None
            }
        }
    }

    /// Decide without the store, as the policy says. Every such decision is marked degraded.
    async fn fallback(
        &self,
        policy: &Policy,
        op: Op,
        checks: &[Check<'_>],
    ) -> Result<Vec<Decision>, Error> {
        self.degraded.fetch_add(1, Ordering::Relaxed);
        let synthetic = |allowed: bool, retry_after: Option<Duration>| {
            checks
                .iter()
                .map(|c| {
                    let limit = c.rule.quota().capacity();
                    let mut d = if allowed {
                        Decision::admit(limit, limit, Duration::ZERO)
                    } else {
                        Decision::deny(limit, 0, Duration::ZERO, retry_after)
                    };
                    d.source = Source::Policy;
                    d.degraded = true;
                    d
                })
                .collect()
        };
        Ok(match policy {
            Policy::Open => synthetic(true, None),
            Policy::Closed { retry_after } => synthetic(false, Some(*retry_after)),
            Policy::Local { store, rules } => {
                let local: Vec<Check<'_>> = checks
                    .iter()
                    .map(|c| Check {
                        rule: rules
                            .iter()
                            .find(|r| r.name() == c.rule.name())
                            .unwrap_or(c.rule),
                        key: c.key,
                        cost: c.cost,
                    })
                    .collect();
                let mut decisions = store.apply_now(op, &local);
                for d in &mut decisions {
                    d.source = Source::Fallback;
                    d.degraded = true;
                    // Taken from this process's fallback, not the shared budget: a refund must
                    // not reach the store.
                    d.taken = None;
                }
                decisions
            }
        })
    }
}
