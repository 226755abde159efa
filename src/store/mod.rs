//! Stores: the only place shared state lives.
//!
//! A [`Store`] applies an [`Op`] to a batch of [`Check`]s atomically: every check is decided
//! on the same state, and a consume takes permits from all of them only if every one admits.
//! Stores never build HTTP responses and never choose what happens on their own failure: that
//! is the [`Limiter`](crate::Limiter)'s job.

use std::future::Future;
use std::pin::Pin;

use crate::{Decision, Key, Rule, StoreError};

pub mod memory;
pub mod redis;

pub use self::redis::{RedisStore, RedisStoreBuilder};
pub use memory::MemoryStore;

/// A boxed future, as returned by [`Store`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One rule applied to one key, with the request's cost.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The rule: its name namespaces the state, its quota decides.
    pub rule: &'a Rule,
    /// The key the rule counts against.
    pub key: &'a Key,
    /// How many permits the request takes (at least 1).
    pub cost: u64,
}

/// What to do with a batch of checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// Take `cost` permits from every check, or from none if any denies.
    Consume,
    /// Decide as a consume would, but take nothing; `remaining` is the count before taking.
    Peek,
    /// Give `cost` permits back to every check where the algorithm allows it; the decisions
    /// describe the state afterwards.
    Refund,
}

/// Shared rate-limit state. Implementations must make each call atomic across its checks.
pub trait Store: Send + Sync + 'static {
    /// Apply `op` to every check as one atomic step, returning one decision per check, in order.
    ///
    /// For [`Op::Consume`], when any check denies, nothing is taken from any of them; the
    /// decisions of the checks that would have admitted then report `allowed: true` with the
    /// permits still there.
    fn apply<'a>(
        &'a self,
        op: Op,
        checks: &'a [Check<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>>;

    /// How many parts of the store can fail independently (a cluster's slots). The limiter keeps
    /// a circuit breaker for each, so one dead node does not take the others' keys down with it.
    fn failure_domains(&self) -> usize {
        1
    }

    /// Which failure domain (below [`failure_domains`](Store::failure_domains)) a call for
    /// these checks depends on.
    fn failure_domain(&self, _checks: &[Check<'_>]) -> usize {
        0
    }
}
