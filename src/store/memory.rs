//! The in-memory store: the embedded default, for one process and for tests.
//!
//! The map is split into shards, each behind its own mutex, so concurrent requests on different
//! keys rarely meet. Memory is bounded two ways: state that can no longer affect a decision is
//! swept as the map grows, and a maximum key count evicts the keys closest to expiry first, so a
//! client spraying random keys cannot grow memory without bound.

use std::hash::BuildHasher;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use hashbrown::{DefaultHashBuilder, HashTable};

use std::time::Duration;

use super::{BoxFuture, Check, Lease, Op, Store};
use crate::algorithm::State;
use crate::error::ConfigError;
use crate::{Clock, Decision, StoreError, SystemClock};

/// The default maximum number of (rule, key) entries kept.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Entries a shard holds before its first sweep for expired state.
const FIRST_SWEEP: usize = 64;

/// An in-process [`Store`]: same algorithms and semantics as the Redis store, for one process.
///
/// ```
/// use fleetlimit::{MemoryStore, ManualClock};
///
/// let store = MemoryStore::new();
/// let for_tests = MemoryStore::builder().clock(ManualClock::default()).max_keys(10_000).build()?;
/// # let _ = (store, for_tests);
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    shard_capacity: usize,
}

struct Shard {
    table: HashTable<Entry>,
    /// The store's hasher, to place entries again when the table grows.
    hasher: DefaultHashBuilder,
    /// Sweep expired entries when the shard reaches this size.
    next_sweep: usize,
}

/// Kept small (no cached hash, the key's bytes boxed): a table of many keys is bound by cache
/// misses, and smaller entries miss less.
struct Entry {
    rule: Arc<str>,
    key: Box<[u8]>,
    state: State,
    /// From this time on the state equals a fresh one and can be dropped.
    expires_at: u64,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field(
                "max_keys",
                &(self.inner.shard_capacity * self.inner.shards.len()),
            )
            .field("clock", &self.inner.clock)
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// A store on the system clock holding at most [`DEFAULT_MAX_KEYS`] entries.
    pub fn new() -> MemoryStore {
        // The defaults are valid by construction.
        MemoryStoreBuilder::default().build_unchecked()
    }

    /// Configure the clock, the key bound and the sharding.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder::default()
    }

    /// How many (rule, key) entries are held right now.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).table.len()).sum()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Apply `op` to `checks` atomically, synchronously. [`Store::apply`] wraps this.
    pub fn apply_now(&self, op: Op, checks: &[Check<'_>]) -> Vec<Decision> {
        self.inner.apply(op, checks)
    }

    /// Apply `op` to one check, synchronously, without allocating: the in-process hot path.
    pub fn check(&self, op: Op, check: &Check<'_>) -> Decision {
        self.inner.apply_one(op, check, self.inner.clock.now_us())
    }
}

/// Builder for [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    max_keys: usize,
    shards: usize,
}

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock),
            max_keys: DEFAULT_MAX_KEYS,
            shards: (cores * 8).next_power_of_two().clamp(16, 256),
        }
    }
}

impl MemoryStoreBuilder {
    /// Read time from this clock (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Keep at most about this many (rule, key) entries (default [`DEFAULT_MAX_KEYS`]). When
    /// full, entries closest to expiry are evicted first; an evicted key starts afresh.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The number of shards (rounded up to a power of two; default 8 per core, 16 to 256).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Validate and build.
    pub fn build(self) -> Result<MemoryStore, ConfigError> {
        if self.shards == 0 || self.shards > 1 << 16 {
            return Err(ConfigError::Invalid {
                setting: "shards",
                reason: format!("must be between 1 and 65536, got {}", self.shards),
            });
        }
        if self.max_keys < self.shards.next_power_of_two() {
            return Err(ConfigError::Invalid {
                setting: "max_keys",
                reason: format!(
                    "must be at least the number of shards ({}), got {}",
                    self.shards.next_power_of_two(),
                    self.max_keys
                ),
            });
        }
        Ok(self.build_unchecked())
    }

    fn build_unchecked(self) -> MemoryStore {
        let shards = self.shards.next_power_of_two();
        let shard_capacity = self.max_keys / shards;
        let hasher = DefaultHashBuilder::default();
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards)
                    .map(|_| {
                        Mutex::new(Shard {
                            table: HashTable::new(),
                            hasher,
                            next_sweep: FIRST_SWEEP.min(shard_capacity),
                        })
                    })
                    .collect(),
                hasher,
                clock: self.clock,
                shard_capacity,
            }),
        }
    }
}

/// Shard locks are held for a few dozen nanoseconds: parking_lot's mutex spins briefly before
/// parking, which keeps a contended hot key cheap, and it has no poisoning (a panic elsewhere
/// leaves a valid rate-limit state behind).
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock()
}

impl Inner {
    fn hash(&self, check: &Check<'_>) -> u64 {
        self.hasher
            .hash_one((check.rule.name(), check.key.as_bytes()))
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The low bits pick the bucket inside the table; use the high bits for the shard.
        (hash >> 48) as usize & (self.shards.len() - 1)
    }

    fn apply(&self, op: Op, checks: &[Check<'_>]) -> Vec<Decision> {
        let now = self.clock.now_us();
        match checks {
            [] => Vec::new(),
            [check] => vec![self.apply_one(op, check, now)],
            _ => self.apply_many(op, checks, now),
        }
    }

    fn apply_one(&self, op: Op, check: &Check<'_>, now: u64) -> Decision {
        let hash = self.hash(check);
        let mut shard = lock(&self.shards[self.shard_of(hash)]);
        let decision = shard.decide(op, check, hash, now);
        if op == Op::Consume && decision.allowed {
            shard.commit(check, hash, now, self.shard_capacity);
        }
        decision
    }

    /// Several checks: lock every shard involved, in index order so two requests can never
    /// deadlock, then decide all before committing any.
    fn apply_many(&self, op: Op, checks: &[Check<'_>], now: u64) -> Vec<Decision> {
        let hashes: Vec<u64> = checks.iter().map(|c| self.hash(c)).collect();
        let mut order: Vec<usize> = hashes.iter().map(|&h| self.shard_of(h)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        let slot = |hash: u64| {
            let shard = self.shard_of(hash);
            order.iter().position(|&i| i == shard).unwrap_or(0)
        };
        let mut decisions: Vec<Decision> = checks
            .iter()
            .zip(&hashes)
            .map(|(c, &h)| guards[slot(h)].decide(op, c, h, now))
            .collect();
        if op == Op::Consume {
            if decisions.iter().all(|d| d.allowed) {
                for (c, &h) in checks.iter().zip(&hashes) {
                    guards[slot(h)].commit(c, h, now, self.shard_capacity);
                }
            } else {
                // Nothing is taken: report the permits as still there.
                for (d, c) in decisions.iter_mut().zip(checks) {
                    if d.allowed {
                        d.remaining += c.cost;
                    }
                }
            }
        }
        decisions
    }
}

impl Shard {
    fn find(&mut self, check: &Check<'_>, hash: u64) -> Option<&mut Entry> {
        let rule = check.rule.shared_name();
        let key = check.key.as_bytes();
        self.table.find_mut(hash, |e| {
            *e.key == *key && (Arc::ptr_eq(&e.rule, rule) || *e.rule == **rule)
        })
    }

    /// Decide one check. For a refund the permits are given back here too.
    fn decide(&mut self, op: Op, check: &Check<'_>, hash: u64, now: u64) -> Decision {
        let quota = check.rule.quota();
        let mut fresh;
        let state = match self.find(check, hash) {
            Some(entry) => {
                if !entry.state.fits(quota) {
                    entry.state = State::new(quota);
                }
                if op == Op::Refund {
                    entry.state.decide(now, quota, 1);
                    entry.state.refund(now, quota, check.cost);
                    entry.expires_at = entry.state.expires_at(quota);
                }
                &mut entry.state
            }
            None => {
                fresh = State::new(quota);
                &mut fresh
            }
        };
        let cost = if op == Op::Refund { 1 } else { check.cost };
        let mut decision = state.decide(now, quota, cost);
        if op != Op::Consume && decision.allowed {
            decision.remaining += cost;
        }
        decision
    }

    /// Run `f` on the check's state, creating the entry if needed, then store its new expiry
    /// (dropping the entry if its state no longer matters).
    fn with_entry<T>(
        &mut self,
        check: &Check<'_>,
        hash: u64,
        now: u64,
        capacity: usize,
        f: impl FnOnce(&mut State) -> T,
    ) -> T {
        let quota = check.rule.quota();
        if self.find(check, hash).is_none() {
            if self.table.len() >= self.next_sweep {
                self.sweep(now, capacity);
            }
            self.insert(hash, check, State::new(quota), 0);
        }
        let Some(entry) = self.find(check, hash) else {
            unreachable!("the entry was just found or inserted")
        };
        if !entry.state.fits(quota) {
            entry.state = State::new(quota);
        }
        let out = f(&mut entry.state);
        entry.expires_at = entry.state.expires_at(quota);
        out
    }

    /// Take the permits of an admitted check, creating its entry if needed.
    fn commit(&mut self, check: &Check<'_>, hash: u64, now: u64, capacity: usize) {
        let quota = check.rule.quota();
        if let Some(entry) = self.find(check, hash) {
            entry.state.commit(now, quota, check.cost);
            entry.expires_at = entry.state.expires_at(quota);
            return;
        }
        if self.table.len() >= self.next_sweep {
            self.sweep(now, capacity);
        }
        let mut state = State::new(quota);
        state.decide(now, quota, check.cost);
        state.commit(now, quota, check.cost);
        let expires_at = state.expires_at(quota);
        self.insert(hash, check, state, expires_at);
    }

    fn insert(&mut self, hash: u64, check: &Check<'_>, state: State, expires_at: u64) {
        let hasher = &self.hasher;
        self.table.insert_unique(
            hash,
            Entry {
                rule: check.rule.shared_name().clone(),
                key: check.key.as_bytes().into(),
                state,
                expires_at,
            },
            |e| hasher.hash_one((&*e.rule, &*e.key)),
        );
    }

    /// Drop expired state; if the shard is still full, evict the entries closest to expiry
    /// until it is 7/8 full. The next sweep waits until the shard has doubled (or is full), so
    /// the cost per insert stays constant.
    fn sweep(&mut self, now: u64, capacity: usize) {
        self.table.retain(|e| e.expires_at > now);
        if self.table.len() >= capacity {
            let keep = capacity - capacity / 8;
            let drop = self.table.len() + 1 - keep.max(1);
            let mut expiries: Vec<u64> = self.table.iter().map(|e| e.expires_at).collect();
            let (_, &mut threshold, _) = expiries.select_nth_unstable(drop - 1);
            let mut dropped = 0;
            self.table.retain(|e| {
                if e.expires_at < threshold || (e.expires_at == threshold && dropped < drop) {
                    dropped += 1;
                    false
                } else {
                    true
                }
            });
        }
        self.next_sweep = (self.table.len() * 2).clamp(FIRST_SWEEP.min(capacity), capacity);
    }
}

impl MemoryStore {
    /// [`Store::lease`], synchronously.
    pub fn lease_now(&self, check: Check<'_>, max_validity: Duration) -> Result<Lease, StoreError> {
        let inner = &self.inner;
        let now = inner.clock.now_us();
        let quota = check.rule.quota();
        if !State::leasable(quota) {
            return Err(StoreError::Script(format!(
                "{} cannot be leased",
                quota.algorithm()
            )));
        }
        let hash = inner.hash(&check);
        let mut shard = lock(&inner.shards[inner.shard_of(hash)]);
        let max_validity_us = max_validity.as_micros().min(u128::from(u64::MAX / 4)) as u64;
        let (granted, decision) =
            shard.with_entry(&check, hash, now, inner.shard_capacity, |state| {
                let granted = state.lease(now, quota, check.cost, max_validity_us);
                (granted, peek(state, now, quota))
            });
        let granted = granted.ok_or_else(|| StoreError::Script("cannot be leased".into()))?;
        Ok(Lease::new(
            granted.permits,
            granted.valid_until,
            Duration::from_micros(granted.valid_until.saturating_sub(now)),
            decision,
        ))
    }

    /// [`Store::release`], synchronously.
    pub fn release_now(&self, check: Check<'_>, valid_until_us: u64) -> Decision {
        let inner = &self.inner;
        let now = inner.clock.now_us();
        let quota = check.rule.quota();
        let hash = inner.hash(&check);
        let mut shard = lock(&inner.shards[inner.shard_of(hash)]);
        shard.with_entry(&check, hash, now, inner.shard_capacity, |state| {
            state.release(now, quota, check.cost, valid_until_us);
            peek(state, now, quota)
        })
    }
}

/// What a request of cost 1 would get now, without taking anything.
fn peek(state: &mut State, now: u64, quota: &crate::Quota) -> Decision {
    let mut d = state.decide(now, quota, 1);
    if d.allowed {
        d.remaining += 1;
    }
    d
}

impl Store for MemoryStore {
    fn apply_now(&self, op: Op, checks: &[Check<'_>]) -> Option<Vec<Decision>> {
        Some(self.inner.apply(op, checks))
    }

    fn check_now(&self, op: Op, check: &Check<'_>) -> Option<Decision> {
        Some(self.check(op, check))
    }

    fn lease<'a>(
        &'a self,
        check: Check<'a>,
        max_validity: Duration,
    ) -> BoxFuture<'a, Result<Lease, StoreError>> {
        Box::pin(std::future::ready(self.lease_now(check, max_validity)))
    }

    fn release<'a>(
        &'a self,
        check: Check<'a>,
        valid_until_us: u64,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(std::future::ready(Ok(
            self.release_now(check, valid_until_us)
        )))
    }

    fn apply<'a>(
        &'a self,
        op: Op,
        checks: &'a [Check<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        let decisions = self.inner.apply(op, checks);
        Box::pin(std::future::ready(Ok(decisions)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Key, ManualClock, Quota, Rule};
    use std::time::Duration;

    fn rule(name: &str, algorithm: Algorithm, limit: u64) -> Rule {
        Rule::new(
            name,
            Quota::per_second(limit)
                .algorithm(algorithm)
                .build()
                .unwrap(),
        )
        .unwrap()
    }

    fn store(clock: &ManualClock, max_keys: usize) -> MemoryStore {
        MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(max_keys)
            .shards(1)
            .build()
            .unwrap()
    }

    #[test]
    fn rules_and_keys_are_separate() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let a = rule("a", Algorithm::FixedWindow, 1);
        let b = rule("b", Algorithm::FixedWindow, 1);
        let (k1, k2) = (Key::new("1"), Key::new("2"));
        let one = |r, k| {
            s.apply_now(
                Op::Consume,
                &[Check {
                    rule: r,
                    key: k,
                    cost: 1,
                }],
            )[0]
        };
        assert!(one(&a, &k1).allowed);
        assert!(!one(&a, &k1).allowed);
        assert!(one(&a, &k2).allowed);
        assert!(one(&b, &k1).allowed);
    }

    #[test]
    fn denial_by_one_rule_takes_nothing_from_the_others() {
        let clock = ManualClock::default();
        let s = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let wide = rule("wide", Algorithm::SlidingLog, 10);
        let narrow = rule("narrow", Algorithm::FixedWindow, 2);
        let (acct, ip) = (Key::new("acct"), Key::new("ip"));
        let checks = [
            Check {
                rule: &wide,
                key: &acct,
                cost: 1,
            },
            Check {
                rule: &narrow,
                key: &ip,
                cost: 1,
            },
        ];
        for _ in 0..2 {
            assert!(s.apply_now(Op::Consume, &checks).iter().all(|d| d.allowed));
        }
        for _ in 0..5 {
            let d = s.apply_now(Op::Consume, &checks);
            assert!(d[0].allowed && !d[1].allowed);
            assert_eq!(d[0].remaining, 8, "the wide rule keeps its permits");
        }
        let peek = s.apply_now(Op::Peek, &checks[..1]);
        assert_eq!(peek[0].remaining, 8);
    }

    #[test]
    fn peek_and_refund() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let r = rule("r", Algorithm::TokenBucket, 5);
        let k = Key::new("k");
        let check = |cost| {
            [Check {
                rule: &r,
                key: &k,
                cost,
            }]
        };
        assert_eq!(s.apply_now(Op::Peek, &check(1))[0].remaining, 5);
        assert!(s.is_empty(), "a peek creates no state");
        assert_eq!(s.apply_now(Op::Consume, &check(3))[0].remaining, 2);
        assert_eq!(s.apply_now(Op::Peek, &check(1))[0].remaining, 2);
        assert_eq!(s.apply_now(Op::Refund, &check(2))[0].remaining, 4);
        assert_eq!(s.apply_now(Op::Refund, &check(9))[0].remaining, 5);
    }

    #[test]
    fn a_rule_reconfigured_with_a_smaller_bucket_never_panics() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let big = Rule::new(
            "r",
            Quota::per_second(10)
                .algorithm(Algorithm::TokenBucket)
                .burst(10)
                .build()
                .unwrap(),
        )
        .unwrap();
        let small = Rule::new(
            "r",
            Quota::per_second(10)
                .algorithm(Algorithm::TokenBucket)
                .burst(2)
                .build()
                .unwrap(),
        )
        .unwrap();
        let k = Key::new("k");
        s.apply_now(
            Op::Consume,
            &[Check {
                rule: &big,
                key: &k,
                cost: 1,
            }],
        );
        let d = s.apply_now(
            Op::Consume,
            &[Check {
                rule: &small,
                key: &k,
                cost: 1,
            }],
        );
        assert!(d[0].allowed && d[0].remaining <= 1);
        // Absurd refunds are capped, not overflowed.
        let d = s.apply_now(
            Op::Refund,
            &[Check {
                rule: &small,
                key: &k,
                cost: u64::MAX,
            }],
        );
        assert_eq!(d[0].remaining, 2);
        let gcra = Rule::new(
            "g",
            Quota::per_day(1)
                .algorithm(Algorithm::Gcra)
                .build()
                .unwrap(),
        )
        .unwrap();
        let d = s.apply_now(
            Op::Refund,
            &[Check {
                rule: &gcra,
                key: &k,
                cost: 1 << 40,
            }],
        );
        assert_eq!(d[0].remaining, 1);
    }

    #[test]
    fn expired_state_is_swept_and_key_count_is_bounded() {
        let clock = ManualClock::default();
        let s = store(&clock, 1_000);
        let r = rule("r", Algorithm::Gcra, 10);
        for i in 0..5_000u32 {
            let k = Key::new(i.to_be_bytes());
            s.apply_now(
                Op::Consume,
                &[Check {
                    rule: &r,
                    key: &k,
                    cost: 1,
                }],
            );
            assert!(s.len() <= 1_000, "bounded at {} keys", s.len());
        }
        // Everything expires; new traffic sweeps it out.
        clock.advance(Duration::from_secs(2));
        for i in 0..100u32 {
            let k = Key::new(format!("new-{i}"));
            s.apply_now(
                Op::Consume,
                &[Check {
                    rule: &r,
                    key: &k,
                    cost: 1,
                }],
            );
        }
        assert!(s.len() <= 100, "expired entries swept, {} left", s.len());
    }

    #[test]
    fn eviction_prefers_entries_closest_to_expiry() {
        let clock = ManualClock::default();
        let s = store(&clock, 64);
        let short = rule("short", Algorithm::FixedWindow, 5);
        let long = Rule::new(
            "long",
            Quota::per_hour(5)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let hot = Key::new("hot");
        for _ in 0..5 {
            s.apply_now(
                Op::Consume,
                &[Check {
                    rule: &long,
                    key: &hot,
                    cost: 1,
                }],
            );
        }
        for i in 0..1_000u32 {
            let k = Key::new(i.to_be_bytes());
            s.apply_now(
                Op::Consume,
                &[Check {
                    rule: &short,
                    key: &k,
                    cost: 1,
                }],
            );
        }
        let d = s.apply_now(
            Op::Consume,
            &[Check {
                rule: &long,
                key: &hot,
                cost: 1,
            }],
        );
        assert!(!d[0].allowed, "the long-lived entry survived the spray");
    }
}
