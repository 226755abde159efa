//! Stores: the only place shared state lives.
//!
//! A [`Store`] applies an [`Op`] to a batch of [`Check`]s atomically: every check is decided
//! on the same state, and a consume takes permits from all of them only if every one admits.
//! Stores never build HTTP responses and never choose what happens on their own failure: that
//! is the [`Limiter`](crate::Limiter)'s job.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::{Decision, Key, Rule, StoreError, Taken};

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(test)]
pub(crate) mod testing;

#[cfg(feature = "redis")]
pub use self::redis::{RedisStore, RedisStoreBuilder};
pub use memory::MemoryStore;

/// The longest a call waits for its answer on a standalone or Sentinel connection (redis-rs's
/// own 500 ms would cut short a call made in the background: a lease nobody waits for, a
/// give-back). A call sent may run in Redis until then, so whatever waits for such a call in the
/// background waits longer (see `leases::background_bound`); finite, so that calls on a
/// connection that stopped answering do not pile up in it. A limiter deadline above it is cut
/// to it. Cluster connections have none: a hung master's calls are abandoned at their deadline
/// and the store looks past it, where a timeout inside redis-rs would read as a dead node and
/// drop the connection every master's calls share.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

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
}

/// Permits to give back: what an admission took from `rule`'s state for `key`, as its decision
/// recorded it. A refund undoes only what is still outstanding there, so it can never create a
/// permit; give each back once.
#[derive(Debug, Clone, Copy)]
pub struct Refund<'a> {
    /// The rule the permits were taken under.
    pub rule: &'a Rule,
    /// The key they were counted against.
    pub key: &'a Key,
    /// Where they were taken.
    pub taken: Taken,
}

impl<'a> Refund<'a> {
    /// The check this refund gives back to (its rule and key, at the cost taken): for routing
    /// it to its failure domain.
    pub(crate) fn check(&self) -> Check<'a> {
        Check {
            rule: self.rule,
            key: self.key,
            cost: self.taken.cost(),
        }
    }
}

/// A block of permits taken from the shared budget at once, to be spent in process memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// Permits granted (already deducted from the shared budget); 0 when none could be.
    pub permits: u64,
    /// Until when they may be spent, in µs on the store's clock.
    pub valid_until_us: u64,
    /// How long they may be spent, from the moment the store granted them.
    pub valid_for: Duration,
    /// The shared state right after the grant (as a peek would see it).
    pub state: Decision,
    /// Where the permits were taken: unspent ones go back through [`Store::refund`].
    pub taken: Taken,
    /// The key is listed (allowed, denied or blocked): no permits are granted, and `state` is
    /// the decision of each of its requests, which are decided by the listing one by one.
    pub listed: bool,
}

/// An administrator's entry for a key, across every rule of a store (of one key prefix, for
/// Redis): it outranks the key's quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Listing {
    /// Never limited: every decision admits and counts nothing.
    Allow,
    /// Always refused, until the entry is removed (a `Retry-After` of [`DENY_RETRY_AFTER`]).
    Deny,
    /// Refused for this long from when it was set (read back: for how long still).
    Block(Duration),
}

/// The wait a denied key is told: a deny-list entry has no end, and clients should not come
/// back soon.
pub const DENY_RETRY_AFTER: Duration = Duration::from_secs(86_400);

/// The decisions for `checks` when some are already `known` (decided by a listing, or by a
/// remembered refusal): the others are decided together by `decide`, and only peeked when a
/// known one refuses, so a refused request takes nothing; each known decision keeps its place.
/// `missing` fills a place `decide` left without a decision (it answers one per check).
pub(crate) fn around_known(
    op: Op,
    checks: &[Check<'_>],
    known: Vec<Option<Decision>>,
    decide: impl FnOnce(Op, &[Check<'_>]) -> Vec<Decision>,
    missing: impl Fn(&Check<'_>) -> Decision,
) -> Vec<Decision> {
    let refusing = known.iter().flatten().any(|d| !d.allowed);
    let unknown: Vec<Check<'_>> = checks
        .iter()
        .zip(&known)
        .filter(|(_, known)| known.is_none())
        .map(|(c, _)| *c)
        .collect();
    let mut decided = decide(if refusing { Op::Peek } else { op }, &unknown).into_iter();
    checks
        .iter()
        .zip(known)
        .map(|(c, known)| {
            known
                .or_else(|| decided.next())
                .unwrap_or_else(|| missing(c))
        })
        .collect()
}

/// What to do with a concurrency slot.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOp {
    /// Take a slot if fewer than the limit are held.
    Acquire,
    /// Extend a held slot's life; false if it expired meanwhile.
    Renew,
    /// Give a slot back.
    Release,
}

pub(crate) mod sealed {
    /// Only this crate's stores implement [`Store`](super::Store): their state formats, receipts
    /// and scripts are held together by its tests.
    pub trait Sealed {}
    impl Sealed for super::MemoryStore {}
    #[cfg(feature = "redis")]
    impl Sealed for super::RedisStore {}
}

/// Shared rate-limit state: [`MemoryStore`] and `RedisStore` (feature `redis`). Each call is
/// atomic across its checks. Sealed: the algorithms' state formats and receipts are the crate's own.
pub trait Store: sealed::Sealed + Send + Sync + 'static {
    /// Apply `op` to every check as one atomic step, returning one decision per check, in order.
    /// The checks of one call share a call group ([`call_group`](Store::call_group)): on a
    /// Redis Cluster, one slot, which every rule on one key shares. The
    /// [`Limiter`](crate::Limiter) composes checks on several groups, through receipts.
    ///
    /// For [`Op::Consume`], when any check denies, nothing is taken from any of them; the
    /// decisions of the checks that would have admitted then report `allowed: true` with the
    /// permits still there.
    fn apply<'a>(
        &'a self,
        op: Op,
        checks: &'a [Check<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>>;

    /// Take up to `check.cost` permits for `check.key` in one atomic step, valid for at most
    /// `max_validity` (never past the end of the window that grants them). Fails with
    /// [`StoreError::Script`] for the sliding log, which cannot be leased.
    fn lease<'a>(
        &'a self,
        check: Check<'a>,
        max_validity: Duration,
    ) -> BoxFuture<'a, Result<Lease, StoreError>>;

    /// Give back what admissions (or a lease's unspent permits) took, each only as far as it
    /// is still outstanding. Returns one decision per refund, as a peek right after would see it.
    fn refund<'a>(
        &'a self,
        refunds: &'a [Refund<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>>;

    /// Pause `key` under `rule` for the whole fleet for `pause` (a destination's pushback, see
    /// [`outbound`](crate::outbound)); a later pause replaces an earlier one.
    fn pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// [`pause`](Store::pause), unless a pause in force ends later: a pause only grows.
    /// Decided and set in one step, so a shorter pushback racing a longer one, from another
    /// instance, never cuts it.
    fn extend_pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// How long `key` under `rule` stays paused; `None` when it is not.
    fn paused_for<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
    ) -> BoxFuture<'a, Result<Option<Duration>, StoreError>>;

    /// Decide right now, without a future, when the store can (an in-process store); `None`
    /// means "await [`apply`](Store::apply)". Lets the layer skip a boxed future per request.
    #[doc(hidden)]
    fn apply_in_process(&self, _op: Op, _checks: &[Check<'_>]) -> Option<Vec<Decision>> {
        None
    }

    /// [`slots`](Store::slots) right now, without a future, when the store can (an in-process
    /// store); `None` means "await `slots`".
    #[doc(hidden)]
    fn slots_in_process(
        &self,
        _op: SlotOp,
        _name: &str,
        _key: &Key,
        _slot: u64,
        _limit: u64,
        _ttl: Duration,
    ) -> Option<(bool, u64)> {
        None
    }

    /// [`apply_in_process`](Store::apply_in_process) for one check, without allocating.
    #[doc(hidden)]
    fn check_in_process(&self, _op: Op, _check: &Check<'_>) -> Option<Decision> {
        None
    }

    /// Put `key` on the allow list, the deny list or block it (`Some`), or take it off
    /// (`None`), for every rule, for the whole fleet; the entry in force after the call. A block
    /// never replaces a deny-list entry (the deny stands), and a block of zero ends a block
    /// and nothing else; a block replaces an allow-list entry.
    fn set_listing<'a>(
        &'a self,
        key: &'a Key,
        listing: Option<Listing>,
    ) -> BoxFuture<'a, Result<Option<Listing>, StoreError>>;

    /// `key`'s entry, if it has one in force (a block that ended has none).
    fn listing<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Listing>, StoreError>>;

    /// Block `key` for `block` (the penalty box), unless its entry already says as much: an
    /// allow-list or deny-list entry, or a block that ends later, stands. True when this call
    /// set the block. Decided and set in one step, so an operator's entry made meanwhile, on any
    /// instance, is never replaced. The memory store past its bound on keys ends its penalty
    /// blocks that end soonest to make room (false only when operators' entries fill it).
    fn block_unless_listed<'a>(
        &'a self,
        key: &'a Key,
        block: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Forget `rule`'s state for `key`: the key starts afresh under that rule.
    fn reset<'a>(&'a self, rule: &'a Rule, key: &'a Key) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Slots of a concurrency limit (see [`concurrency`](crate::concurrency)): `op` on slot
    /// `slot` of `key` under `name`, at most `limit` held at once, each living `ttl` unless
    /// renewed. Returns whether the operation took effect (acquired, renewed, released) and the
    /// slots held after it. A renewal of a slot the store no longer holds holds it again, over
    /// the limit if need be (its request is still in flight), and answers `false`.
    #[doc(hidden)]
    fn slots<'a>(
        &'a self,
        op: SlotOp,
        name: &'a str,
        key: &'a Key,
        slot: u64,
        limit: u64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(bool, u64), StoreError>>;

    /// How many parts of the store can fail independently (a cluster's masters, and slots whose
    /// master is not known yet). The limiter keeps a circuit breaker for each, so one dead node
    /// does not take the others' keys down with it.
    fn failure_domains(&self) -> usize {
        1
    }

    /// Which failure domain (below [`failure_domains`](Store::failure_domains)) a call for
    /// these checks depends on: the limiter keeps a circuit breaker for each (a cluster's
    /// master).
    fn failure_domain(&self, _checks: &[Check<'_>]) -> usize {
        0
    }

    /// Which checks can go in one call: those with the same group (a cluster's slot; a call's
    /// keys must share one). Groups of one failure domain are still called one by one.
    fn call_group(&self, _checks: &[Check<'_>]) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Quota, Rule};

    #[test]
    fn around_known_decides_the_rest_together_and_only_peeks_it_after_a_refusal() {
        let rule = Rule::new("r", Quota::per_second(5).build().unwrap()).unwrap();
        let keys = [Key::new("a"), Key::new("b"), Key::new("c")];
        let checks: Vec<Check<'_>> = keys
            .iter()
            .map(|key| Check {
                rule: &rule,
                key,
                cost: 1,
            })
            .collect();
        let allowed = Decision::admit(9, 9, Duration::ZERO);
        let refused = Decision::deny(9, 0, Duration::ZERO, Some(Duration::from_secs(1)));
        let run = |known: Vec<Option<Decision>>| {
            let mut asked = None;
            let decisions = around_known(
                Op::Consume,
                &checks,
                known,
                |op, rest| {
                    asked = Some((op, rest.iter().map(|c| c.key.clone()).collect::<Vec<_>>()));
                    rest.iter()
                        .map(|_| Decision::admit(5, 4, Duration::ZERO))
                        .collect()
                },
                |_| unreachable!("one decision per check"),
            );
            (decisions, asked)
        };
        let (d, asked) = run(vec![None, Some(allowed), None]);
        assert_eq!(
            asked,
            Some((Op::Consume, vec![keys[0].clone(), keys[2].clone()]))
        );
        assert_eq!(d.iter().map(|d| d.limit).collect::<Vec<_>>(), [5, 9, 5]);
        let (d, asked) = run(vec![None, None, Some(refused)]);
        assert_eq!(
            asked,
            Some((Op::Peek, vec![keys[0].clone(), keys[1].clone()]))
        );
        assert!(!d[2].allowed && d[0].allowed);
    }
}
