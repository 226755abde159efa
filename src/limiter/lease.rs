//! Hot keys: permits leased from the store in blocks and spent in process memory, and denials
//! remembered until the store said they end.
//!
//! A leased block is deducted from the shared budget when it is granted, so the fleet can never
//! spend more than the store allowed; the price is fairness (a process may hold permits another
//! needed), kept small by adaptive block sizes and by giving back what a quiet process holds.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;

use super::Inner;
use crate::error::{ConfigError, Error};
use crate::store::{Check, Op, Refund};
use crate::{Decision, Key, Quota, Rule, Source, StoreError, Taken};

/// How a rule's hot keys are leased; see [`LimiterBuilder::lease`](super::LimiterBuilder::lease).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseConfig {
    block: Option<u64>,
    promote_at: f64,
    max_block: u64,
    max_share: f64,
    max_validity: Duration,
    idle: Duration,
}

impl LeaseConfig {
    /// Lease adaptively: a key is leased once this process sees it above `promote_at`
    /// requests per second (default 300) and goes back to per-request decisions when it cools;
    /// the block size follows the observed rate (a tenth of a second of traffic), bounded by
    /// [`max_block`](LeaseConfig::max_block) and [`max_share`](LeaseConfig::max_share).
    pub fn auto() -> LeaseConfig {
        LeaseConfig {
            block: None,
            promote_at: 300.0,
            max_block: 10_000,
            max_share: 0.125,
            max_validity: Duration::from_millis(250),
            idle: Duration::from_millis(250),
        }
    }

    /// Lease every key of the rule in blocks of `block` permits (still bounded by
    /// [`max_share`](LeaseConfig::max_share) of the quota).
    pub fn fixed(block: u64) -> LeaseConfig {
        LeaseConfig {
            block: Some(block),
            max_block: block,
            ..LeaseConfig::auto()
        }
    }

    /// The request rate (per second, in this process) above which a key is leased (auto).
    pub fn promote_at(mut self, per_second: f64) -> LeaseConfig {
        self.promote_at = per_second;
        self
    }

    /// The largest block (default 10,000).
    pub fn max_block(mut self, permits: u64) -> LeaseConfig {
        self.max_block = permits;
        self
    }

    /// The largest share of the quota's capacity one block may take (default 1/8), so one
    /// process never holds what the whole fleet needs.
    pub fn max_share(mut self, share: f64) -> LeaseConfig {
        self.max_share = share;
        self
    }

    /// How long a block may be spent (default 250 ms; never past the end of the window that
    /// granted it). For the token bucket and GCRA this widens the envelope: the fleet admits at
    /// most `burst + rate × (t + max_validity)` in any interval `t`.
    pub fn max_validity(mut self, validity: Duration) -> LeaseConfig {
        self.max_validity = validity;
        self
    }

    /// A leased key unused this long gives its unspent permits back (default 250 ms).
    pub fn idle(mut self, idle: Duration) -> LeaseConfig {
        self.idle = idle;
        self
    }

    pub(crate) fn validate(&self, rule: &Rule) -> Result<(), ConfigError> {
        let invalid = |reason: String| ConfigError::Invalid {
            setting: "lease",
            reason: format!("rule {:?}: {reason}", rule.name()),
        };
        if rule.quota().algorithm() == crate::Algorithm::SlidingLog {
            return Err(invalid(
                "the sliding log cannot be leased: its promise rests on each permit's own timestamp".into(),
            ));
        }
        if self.block == Some(0) || self.max_block == 0 {
            return Err(invalid("blocks need at least one permit".into()));
        }
        if !(self.max_share > 0.0 && self.max_share <= 1.0) {
            return Err(invalid(format!(
                "max_share must be in (0, 1], got {}",
                self.max_share
            )));
        }
        if !(self.promote_at.is_finite() && self.promote_at > 0.0) {
            return Err(invalid(format!(
                "promote_at must be positive, got {}",
                self.promote_at
            )));
        }
        if self.max_validity < Duration::from_millis(1) || self.idle.is_zero() {
            return Err(invalid(
                "max_validity must be at least 1 ms and idle non-zero".into(),
            ));
        }
        Ok(())
    }

    /// The block to ask for, given the key's observed rate.
    fn block_size(&self, quota: &Quota, rate: f64, cost: u64) -> u64 {
        let cap =
            ((quota.capacity() as f64 * self.max_share).floor() as u64).clamp(1, self.max_block);
        let wanted = self.block.unwrap_or((rate / 10.0).ceil() as u64);
        wanted.clamp(1, cap).max(cost)
    }
}

/// One block of leased permits.
#[derive(Debug)]
struct Block {
    permits: AtomicU64,
    /// Spend only before this (µs, the limiter's clock).
    deadline: u64,
    /// Where the block's permits were taken: spent ones are refunded, and unspent ones given
    /// back, through it.
    taken: Option<Taken>,
    /// The store refused the key until `deadline` for requests costing at least `.1`: deny
    /// those locally.
    denied: Option<(Decision, u64)>,
    /// The shared state as last seen (after the grant).
    seen: Decision,
}

impl Block {
    fn empty() -> Block {
        Block {
            permits: AtomicU64::new(0),
            deadline: 0,
            taken: None,
            denied: None,
            seen: Decision::admit(0, 0, Duration::ZERO),
        }
    }
}

/// A key in leased mode.
#[derive(Debug)]
struct Slot {
    block: ArcSwap<Block>,
    /// One lease request in flight per key in this process.
    refill: tokio::sync::Mutex<()>,
    last_used: AtomicU64,
    rate: RateMeter,
}

/// Requests per second of one key in this process: a count per one-second bucket.
#[derive(Debug, Default)]
struct RateMeter {
    /// Bucket start (µs) in the high bits' stead: kept apart, updated racily; it is a hint.
    bucket: AtomicU64,
    count: AtomicU64,
    last_rate: AtomicU64,
}

impl RateMeter {
    /// Count one request; returns the rate of the last complete second, or the current one's
    /// pace if higher.
    fn tick(&self, now: u64) -> f64 {
        let bucket = now / 1_000_000;
        if self.bucket.swap(bucket, Ordering::Relaxed) != bucket {
            let last = self.count.swap(0, Ordering::Relaxed);
            self.last_rate.store(last, Ordering::Relaxed);
        }
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let into = (now % 1_000_000).max(50_000) as f64 / 1e6;
        (self.last_rate.load(Ordering::Relaxed) as f64).max(count as f64 / into)
    }
}

type SlotKey = (usize, Key);

/// A remembered denial: refused until (µs), for requests costing at least, as decided.
type Denial = (u64, u64, Decision);
type DenialShard = Mutex<HashMap<SlotKey, Denial>>;

/// Remembered denials of keys not in leased mode: bounded, and never kept past the store's own
/// retry time.
#[derive(Debug)]
struct DenialCache {
    shards: Box<[DenialShard]>,
    per_shard: usize,
    hasher: hashbrown::DefaultHashBuilder,
}

impl DenialCache {
    fn new(capacity: usize) -> DenialCache {
        let shards = 16;
        DenialCache {
            shards: (0..shards).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: (capacity / shards).max(1),
            hasher: hashbrown::DefaultHashBuilder::default(),
        }
    }

    fn shard(&self, key: &SlotKey) -> std::sync::MutexGuard<'_, HashMap<SlotKey, Denial>> {
        let i = self.hasher.hash_one(key) as usize % self.shards.len();
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A remembered denial for a request of `cost` at `now`, with its wait brought up to date.
    fn get(&self, key: &SlotKey, cost: u64, now: u64) -> Option<Decision> {
        let mut shard = self.shard(key);
        match shard.get(key) {
            Some(&(until, denied_cost, d)) if now < until && cost >= denied_cost => {
                let mut d = d;
                d.retry_after = Some(Duration::from_micros(until - now));
                d.source = Source::Cache;
                Some(d)
            }
            Some(_) => {
                shard.remove(key);
                None
            }
            None => None,
        }
    }

    fn insert(&self, key: SlotKey, until: u64, cost: u64, decision: Decision, now: u64) {
        let mut shard = self.shard(&key);
        if shard.len() >= self.per_shard {
            shard.retain(|_, (u, _, _)| *u > now);
            if shard.len() >= self.per_shard {
                // Still full of live denials: forget the one that ends first.
                if let Some(k) = shard
                    .iter()
                    .min_by_key(|(_, (u, _, _))| *u)
                    .map(|(k, _)| k.clone())
                {
                    shard.remove(&k);
                }
            }
        }
        shard.insert(key, (until, cost, decision));
    }
}

/// The leasing state of a limiter.
pub(crate) struct Leases {
    configs: Box<[Option<LeaseConfig>]>,
    slots: ArcSwap<HashMap<SlotKey, Arc<Slot>>>,
    /// Rates of keys not (yet) leased, for promotion; bounded.
    candidates: Mutex<HashMap<SlotKey, (u64, u64)>>,
    denials: Option<DenialCache>,
    sweeper: AtomicBool,
    lease_calls: AtomicU64,
}

/// The most keys whose rate is tracked for promotion.
const MAX_CANDIDATES: usize = 10_000;
/// The most keys in leased mode at once; further hot keys are decided by the store.
const MAX_LEASED_KEYS: usize = 4_096;

impl Leases {
    pub(crate) fn new(configs: Box<[Option<LeaseConfig>]>, deny_cache: usize) -> Leases {
        Leases {
            configs,
            slots: ArcSwap::from_pointee(HashMap::new()),
            candidates: Mutex::new(HashMap::new()),
            denials: (deny_cache > 0).then(|| DenialCache::new(deny_cache)),
            sweeper: AtomicBool::new(false),
            lease_calls: AtomicU64::new(0),
        }
    }

    /// No rule is leased: every decision can go straight to the store.
    pub(crate) fn is_idle(&self) -> bool {
        self.configs.iter().all(Option::is_none)
    }

    pub(crate) fn lease_calls(&self) -> u64 {
        self.lease_calls.load(Ordering::Relaxed)
    }

    pub(crate) fn leased_keys(&self) -> usize {
        self.slots.load().len()
    }

    /// Remember a store denial of a single-rule consume (rule `index`) until its retry time.
    pub(crate) fn remember_denial(&self, index: usize, check: &Check<'_>, d: &Decision, now: u64) {
        let (Some(cache), false, Some(retry)) = (&self.denials, d.allowed, d.retry_after) else {
            return;
        };
        let until = now + retry.as_micros() as u64;
        cache.insert((index, check.key.clone()), until, check.cost, *d, now);
    }

    /// Should this key be leased now? Counts the request toward its rate.
    fn promote(&self, config: &LeaseConfig, key: &SlotKey, now: u64) -> bool {
        if config.block.is_some() {
            return true;
        }
        let mut candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        let second = now / 1_000_000;
        if candidates.len() >= MAX_CANDIDATES && !candidates.contains_key(key) {
            candidates.retain(|_, (s, _)| *s + 1 >= second);
            if candidates.len() >= MAX_CANDIDATES {
                return false;
            }
        }
        let entry = candidates.entry(key.clone()).or_insert((second, 0));
        if entry.0 != second {
            *entry = (second, 0);
        }
        entry.1 += 1;
        let into = (now % 1_000_000).max(100_000) as f64 / 1e6;
        let hot = entry.1 as f64 / into >= config.promote_at;
        if hot {
            candidates.remove(key);
        }
        hot
    }
}

impl Inner {
    /// Decide a single-rule consume without a store round trip when this process can: from a
    /// leased block, or from a remembered denial. `Ok(None)`: ask the store.
    pub(super) async fn decide_locally(
        &self,
        index: usize,
        check: &Check<'_>,
    ) -> Result<Option<Decision>, Error> {
        let now = self.clock.now_us();
        let key: SlotKey = (index, check.key.clone());
        let leases = &self.leases;
        let leasable = check.cost <= check.rule.quota().capacity();
        if let Some(config) = leases
            .configs
            .get(index)
            .copied()
            .flatten()
            .filter(|_| leasable)
        {
            let slot = leases.slots.load().get(&key).cloned();
            let slot = match slot {
                Some(slot) => slot,
                None if leases.slots.load().len() < MAX_LEASED_KEYS
                    && leases.promote(&config, &key, now) =>
                {
                    self.insert_slot(key.clone(), now)
                }
                None => return Ok(self.remembered_denial(&key, check.cost, now)),
            };
            slot.last_used.store(now, Ordering::Relaxed);
            let rate = slot.rate.tick(now);
            if let Some(d) = spend(&slot.block.load(), check.cost, now) {
                return Ok(Some(d));
            }
            return self.refill(&slot, &config, check, rate).await.map(Some);
        }
        Ok(self.remembered_denial(&key, check.cost, now))
    }

    fn remembered_denial(&self, key: &SlotKey, cost: u64, now: u64) -> Option<Decision> {
        self.leases.denials.as_ref()?.get(key, cost, now)
    }

    fn insert_slot(&self, key: SlotKey, now: u64) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            block: ArcSwap::from_pointee(Block::empty()),
            refill: tokio::sync::Mutex::new(()),
            last_used: AtomicU64::new(now),
            rate: RateMeter::default(),
        });
        let mut winner = slot.clone();
        self.leases.slots.rcu(|map| {
            let mut map = HashMap::clone(map);
            winner = map
                .entry(key.clone())
                .or_insert_with(|| slot.clone())
                .clone();
            map
        });
        self.start_sweeper();
        winner
    }

    /// Refill a slot's block: one lease request per key in flight; the others wait for it.
    async fn refill(
        &self,
        slot: &Slot,
        config: &LeaseConfig,
        check: &Check<'_>,
        rate: f64,
    ) -> Result<Decision, Error> {
        let _one_at_a_time = slot.refill.lock().await;
        let started = self.clock.now_us();
        // Someone may have refilled while we waited.
        if let Some(d) = spend(&slot.block.load(), check.cost, started) {
            return Ok(d);
        }
        let quota = check.rule.quota();
        let want = config.block_size(quota, rate, check.cost);
        let lease_check = Check {
            cost: want,
            ..*check
        };
        self.leases.lease_calls.fetch_add(1, Ordering::Relaxed);
        let domain = self.store.failure_domain(std::slice::from_ref(check));
        let lease = self
            .call_store(domain, self.store.lease(lease_check, config.max_validity))
            .await;
        let Some(lease) = lease else {
            return self.policy_decision(check).await;
        };
        let deadline = started + lease.valid_for.as_micros() as u64;
        if lease.permits >= check.cost {
            let left = lease.permits - check.cost;
            let block = Block {
                permits: AtomicU64::new(left),
                deadline,
                taken: Some(lease.taken),
                denied: None,
                seen: lease.state,
            };
            let decision = lease_decision(&block, left, check.cost);
            let old = slot.block.swap(Arc::new(block));
            self.give_back_later(check, &old);
            return Ok(decision);
        }
        // Not enough for this request: keep what was granted for smaller ones, and let the
        // store decide this one directly.
        let direct = self
            .call_store(
                domain,
                self.store.apply(Op::Consume, std::slice::from_ref(check)),
            )
            .await
            .and_then(|mut d| d.pop());
        let Some(d) = direct else {
            return self.policy_decision(check).await;
        };
        let block = match (lease.permits, d.allowed, d.retry_after) {
            // Refused until a known time: refuse locally until then.
            (0, false, Some(retry)) => Block {
                deadline: started + retry.as_micros() as u64,
                denied: Some((d, check.cost)),
                ..Block::empty()
            },
            _ => Block {
                permits: AtomicU64::new(lease.permits),
                deadline,
                taken: Some(lease.taken),
                denied: None,
                seen: lease.state,
            },
        };
        let old = slot.block.swap(Arc::new(block));
        self.give_back_later(check, &old);
        Ok(d)
    }

    /// The store could not decide: the outage policy decides this request.
    async fn policy_decision(&self, check: &Check<'_>) -> Result<Decision, Error> {
        let Some(policy) = &self.policy else {
            return Err(Error::Store(StoreError::Connection(
                "the store failed".into(),
            )));
        };
        self.fallback(policy, Op::Consume, std::slice::from_ref(check))
            .await?
            .pop()
            .ok_or_else(|| Error::Store(StoreError::Protocol("no decision".into())))
    }

    /// A replaced block may still hold a few permits (fewer than the request needed): give them
    /// back in the background rather than let them expire unused.
    fn give_back_later(&self, check: &Check<'_>, old: &Block) {
        let unspent = old.permits.swap(0, Ordering::AcqRel);
        let (Some(taken), true) = (old.taken, unspent > 0) else {
            return;
        };
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let (rule, key) = (check.rule.clone(), check.key.clone());
        runtime.spawn(async move {
            me.give_back(&rule, &key, taken.part(unspent)).await;
        });
    }

    /// Return unspent permits of a block through its receipt.
    async fn give_back(&self, rule: &Rule, key: &Key, taken: Taken) -> bool {
        let refund = [Refund { rule, key, taken }];
        let check = Check {
            rule,
            key,
            cost: taken.cost,
        };
        let domain = self.store.failure_domain(std::slice::from_ref(&check));
        self.call_store(domain, self.store.refund(&refund))
            .await
            .is_some()
    }

    fn start_sweeper(&self) {
        if self.leases.sweeper.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.me.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.leases.sweeper.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(sweep_idle(me));
    }

    /// Give back every unspent leased permit now (for a shutdown) and leave leased mode.
    pub(super) async fn release_all(&self) {
        let slots = self.leases.slots.swap(Arc::new(HashMap::new()));
        for ((index, key), slot) in slots.iter() {
            self.release_slot(*index, key, slot).await;
        }
    }

    async fn release_slot(&self, index: usize, key: &Key, slot: &Slot) {
        let block = slot.block.swap(Arc::new(Block::empty()));
        let unspent = block.permits.swap(0, Ordering::AcqRel);
        let (Some(rule), Some(taken), true) = (self.rules.get(index), block.taken, unspent > 0)
        else {
            return;
        };
        // A window's permits come back until the window ends, past the block's own validity; a
        // bucket's as far as it has not refilled them (the receipt knows which).
        if !self.give_back(rule, key, taken.part(unspent)).await {
            tracing::debug!(
                rule = rule.name(),
                "fleetlimit: could not give leased permits back; they expire with the lease"
            );
        }
    }
}

/// Spend `cost` permits from a block, or say what the block knows: `None` means refill.
fn spend(block: &Block, cost: u64, now: u64) -> Option<Decision> {
    if now >= block.deadline {
        return None;
    }
    if let Some((mut denied, denied_cost)) = block.denied {
        if cost < denied_cost {
            return None; // a smaller request may fit sooner: ask the store
        }
        denied.retry_after = Some(Duration::from_micros(block.deadline - now));
        denied.source = Source::Cache;
        return Some(denied);
    }
    let mut left = block.permits.load(Ordering::Acquire);
    loop {
        if left < cost {
            return None;
        }
        match block.permits.compare_exchange_weak(
            left,
            left - cost,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return Some(lease_decision(block, left - cost, cost)),
            Err(now_left) => left = now_left,
        }
    }
}

/// An admission from a leased block. `remaining` is the shared budget as last seen plus what
/// this process still holds: it never grows between store calls.
fn lease_decision(block: &Block, left: u64, cost: u64) -> Decision {
    let mut d = Decision::admit(
        block.seen.limit,
        block.seen.remaining + left,
        block.seen.reset_after,
    );
    d.source = Source::Lease;
    // Spent from a block: a refund goes back through the block's receipt.
    d.taken = block.taken.map(|t| t.part(cost));
    d
}

/// Every 50 ms, give back the permits of leased keys that went quiet, and drop them from
/// leased mode. Ends with the limiter.
async fn sweep_idle(me: Weak<Inner>) {
    /// Lets a later lease start the sweeper again if this task ends early (its runtime shut
    /// down while the limiter lives on).
    struct Restartable(Weak<Inner>);
    impl Drop for Restartable {
        fn drop(&mut self) {
            if let Some(inner) = self.0.upgrade() {
                inner.leases.sweeper.store(false, Ordering::Release);
            }
        }
    }
    let _restartable = Restartable(me.clone());
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let Some(inner) = me.upgrade() else {
            return;
        };
        let now = inner.clock.now_us();
        let slots = inner.leases.slots.load_full();
        let idle: Vec<(SlotKey, Arc<Slot>)> = slots
            .iter()
            .filter(|((index, _), slot)| {
                let idle = inner
                    .leases
                    .configs
                    .get(*index)
                    .copied()
                    .flatten()
                    .map_or(Duration::ZERO, |c| c.idle);
                slot.last_used.load(Ordering::Relaxed) + idle.as_micros() as u64 <= now
            })
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        if idle.is_empty() {
            continue;
        }
        inner.leases.slots.rcu(|map| {
            let mut map = HashMap::clone(map);
            for (k, slot) in &idle {
                // Only the slot we judged idle, not one inserted again since.
                if map.get(k).is_some_and(|current| Arc::ptr_eq(current, slot)) {
                    map.remove(k);
                }
            }
            map
        });
        for ((index, key), slot) in &idle {
            inner.release_slot(*index, key, slot).await;
        }
    }
}
