//! The limiter: rules × key → one decision, through a store.

use std::sync::Arc;

use crate::error::{ConfigError, Error};
use crate::store::{Check, Op, Store};
use crate::{Decision, Key, Rule};

/// Decides requests against one or more [`Rule`]s through a [`Store`]. Cheap to clone: clones
/// share the same store and rules, so every clone enforces the same limits.
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
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    rules: Box<[Rule]>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("rules", &self.inner.rules)
            .finish_non_exhaustive()
    }
}

/// Builder for [`Limiter`]; [`build`](LimiterBuilder::build) validates.
#[must_use = "a limiter builder does nothing until `build` is called"]
pub struct LimiterBuilder {
    store: Arc<dyn Store>,
    rules: Vec<Rule>,
}

impl std::fmt::Debug for LimiterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimiterBuilder")
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

impl LimiterBuilder {
    /// Add a rule. Every rule applies to every request; a request is admitted only if all
    /// admit, and a denial by one takes nothing from the others.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Validate (at least one rule, unique names) and build.
    pub fn build(self) -> Result<Limiter, ConfigError> {
        if self.rules.is_empty() {
            return Err(ConfigError::NoRules);
        }
        for (i, rule) in self.rules.iter().enumerate() {
            if self.rules[..i].iter().any(|r| r.name() == rule.name()) {
                return Err(ConfigError::InvalidRuleName(rule.name().to_owned()));
            }
        }
        Ok(Limiter {
            inner: Arc::new(Inner {
                store: self.store,
                rules: self.rules.into_boxed_slice(),
            }),
        })
    }
}

impl Limiter {
    /// Start building a limiter on `store`.
    pub fn builder(store: impl Store) -> LimiterBuilder {
        LimiterBuilder {
            store: Arc::new(store),
            rules: Vec::new(),
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

    /// Give `cost` permits back to `key` under every rule, where the algorithm allows it (a
    /// sliding log forgets its newest entries, a bucket refills, a window's count drops).
    pub async fn refund(&self, key: &Key, cost: u64) -> Result<Decision, Error> {
        self.apply(Op::Refund, key, cost).await
    }

    async fn apply(&self, op: Op, key: &Key, cost: u64) -> Result<Decision, Error> {
        if cost == 0 {
            return Err(Error::InvalidCost(cost));
        }
        let decisions = match &*self.inner.rules {
            [rule] => {
                let checks = [Check { rule, key, cost }];
                self.inner.store.apply(op, &checks).await?
            }
            rules => {
                let checks: Vec<Check<'_>> =
                    rules.iter().map(|rule| Check { rule, key, cost }).collect();
                self.inner.store.apply(op, &checks).await?
            }
        };
        decisions
            .into_iter()
            .reduce(Decision::more_restrictive)
            .ok_or_else(|| {
                Error::Store(crate::StoreError::Protocol(
                    "the store returned no decision".into(),
                ))
            })
    }
}
