//! Hot keys: permits leased from the store in blocks and spent in process memory.
//!
//! Promise: a block's permits are deducted from the shared budget when granted, so the fleet
//! never spends more than the store allowed; a spent permit carries the block's receipt, so a
//! refund of it goes back where it was taken; no permit of a block is lost: unspent ones are
//! given back through the block's receipt when the block is replaced, when it expires, when its
//! key goes quiet, and at shutdown (a window's permits until the window ends, a bucket's as far as
//! it has not refilled them). One refill per key is in flight, and waiting for it is part of the
//! decision's one deadline. Lease admissions report the shared budget as last seen plus what this
//! process still holds, with `reset_after` counted down to the moment of the answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;

use super::denials::SlotKey;
use super::policy::Deadline;
use super::rate::RateMeter;
use super::Inner;
use crate::error::{ConfigError, Error};
use crate::store::{Check, Op, Refund};
use crate::{Decision, Key, Quota, Rule, Source, Taken};

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
            idle: Duration::from_millis(100),
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

    /// A leased key unused this long leaves leased mode and gives its unspent permits back
    /// (default 100 ms, shorter than the validity, so a quiet key's permits come back while its
    /// block could still have been spent).
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
    /// Where the block's permits were taken.
    taken: Option<Taken>,
    /// The shared state as last seen (after the grant).
    seen: Decision,
    /// When the shared state is full again (µs, the limiter's clock), for `reset_after`.
    reset_at: u64,
}

impl Block {
    fn empty() -> Block {
        Block {
            permits: AtomicU64::new(0),
            deadline: 0,
            taken: None,
            seen: Decision::admit(0, 0, Duration::ZERO),
            reset_at: 0,
        }
    }

    /// Spend `cost` permits at `now`; `None` means refill.
    fn spend(&self, cost: u64, now: u64) -> Option<Decision> {
        if now >= self.deadline {
            return None;
        }
        let mut left = self.permits.load(Ordering::Acquire);
        loop {
            if left < cost {
                return None;
            }
            match self.permits.compare_exchange_weak(
                left,
                left - cost,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(self.admission(left - cost, cost, now)),
                Err(now_left) => left = now_left,
            }
        }
    }

    /// An admission from this block: `remaining` is the shared budget as last seen plus what
    /// this process still holds (it never grows between store calls); its receipt is the
    /// block's.
    fn admission(&self, left: u64, cost: u64, now: u64) -> Decision {
        let mut d = Decision::admit(
            self.seen.limit,
            self.seen.remaining + left,
            Duration::from_micros(self.reset_at.saturating_sub(now)),
        );
        d.source = Source::Lease;
        d.taken = self.taken.map(|t| t.part(cost));
        d
    }

    /// Take every unspent permit out of the block, with the receipt to give them back through.
    fn drain(&self) -> Option<Taken> {
        let unspent = self.permits.swap(0, Ordering::AcqRel);
        self.taken.filter(|_| unspent > 0).map(|t| t.part(unspent))
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
    /// Set when the sweeper takes the slot out of leased mode: a refill that gets the lock
    /// afterwards decides through the store rather than strand a block in a slot nobody sees.
    retired: AtomicBool,
}

/// The most keys whose rate is tracked for promotion.
const MAX_CANDIDATES: usize = 10_000;
/// The most keys in leased mode at once; further hot keys are decided by the store.
const MAX_LEASED_KEYS: usize = 4_096;
/// How often the sweeper looks for quiet keys and expired blocks.
const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// The leasing state of a limiter.
pub(crate) struct Leases {
    configs: Box<[Option<LeaseConfig>]>,
    slots: ArcSwap<HashMap<SlotKey, Arc<Slot>>>,
    /// Rates of keys not (yet) leased, for promotion; bounded.
    candidates: Mutex<HashMap<SlotKey, RateMeter>>,
    sweeper: AtomicBool,
    lease_calls: AtomicU64,
}

impl Leases {
    pub(crate) fn new(configs: Box<[Option<LeaseConfig>]>) -> Leases {
        Leases {
            configs,
            slots: ArcSwap::from_pointee(HashMap::new()),
            candidates: Mutex::new(HashMap::new()),
            sweeper: AtomicBool::new(false),
            lease_calls: AtomicU64::new(0),
        }
    }

    /// No rule is leased: every decision can go straight to the store.
    pub(crate) fn is_idle(&self) -> bool {
        self.configs.iter().all(Option::is_none)
    }

    /// How rule `index` is leased, if it is.
    pub(crate) fn config(&self, index: usize) -> Option<LeaseConfig> {
        self.configs.get(index).copied().flatten()
    }

    pub(crate) fn lease_calls(&self) -> u64 {
        self.lease_calls.load(Ordering::Relaxed)
    }

    pub(crate) fn leased_keys(&self) -> usize {
        self.slots.load().len()
    }

    /// Keep the rate of a key leaving leased mode among the promotion candidates.
    fn remember_rate(&self, key: SlotKey, rate: &RateMeter) {
        let mut candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        if candidates.len() < MAX_CANDIDATES {
            candidates.insert(key, rate.snapshot());
        }
    }

    /// Should this key be leased now? Counts the request toward its rate.
    fn promote(&self, config: &LeaseConfig, key: &SlotKey, now: u64) -> bool {
        if config.block.is_some() {
            return true;
        }
        let mut candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        if candidates.len() >= MAX_CANDIDATES && !candidates.contains_key(key) {
            // Forget keys not seen this second or the last.
            let second = now / 1_000_000;
            candidates.retain(|_, m| m.last_second() + 1 >= second);
            if candidates.len() >= MAX_CANDIDATES {
                return false;
            }
        }
        let hot = candidates.entry(key.clone()).or_default().tick(now) >= config.promote_at;
        if hot {
            candidates.remove(key);
        }
        hot
    }
}

impl Inner {
    /// Decide a single-rule consume from a leased block when this process can. `Ok(None)`: the
    /// rule is not leased here (or the key not hot yet): ask the store.
    pub(super) async fn decide_leased(
        &self,
        index: usize,
        check: &Check<'_>,
        deadline: Deadline,
    ) -> Result<Option<Decision>, Error> {
        let leasable = check.cost <= check.rule.quota().capacity();
        let Some(config) = self.leases.config(index).filter(|_| leasable) else {
            return Ok(None);
        };
        let now = self.clock.now_us();
        let key: SlotKey = (index, check.key.clone());
        let leases = &self.leases;
        let slot = match leases.slots.load().get(&key).cloned() {
            Some(slot) => slot,
            None if leases.slots.load().len() < MAX_LEASED_KEYS
                && leases.promote(&config, &key, now) =>
            {
                self.insert_slot(key, now)
            }
            None => return Ok(None),
        };
        slot.last_used.store(now, Ordering::Relaxed);
        let rate = slot.rate.tick(now);
        if let Some(d) = slot.block.load().spend(check.cost, now) {
            return Ok(Some(d));
        }
        self.refill(&slot, &config, check, rate, deadline)
            .await
            .map(Some)
    }

    fn insert_slot(&self, key: SlotKey, now: u64) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            block: ArcSwap::from_pointee(Block::empty()),
            refill: tokio::sync::Mutex::new(()),
            last_used: AtomicU64::new(now),
            rate: RateMeter::default(),
            retired: AtomicBool::new(false),
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

    /// Refill a slot's block: one lease request per key in flight; the others wait for it,
    /// within their own deadline.
    async fn refill(
        &self,
        slot: &Slot,
        config: &LeaseConfig,
        check: &Check<'_>,
        rate: f64,
        deadline: Deadline,
    ) -> Result<Decision, Error> {
        let Ok(_one_at_a_time) = deadline.run(slot.refill.lock()).await else {
            // Waited out the deadline behind another refill: the store did not answer in time.
            return Ok(self.policy_decision(check));
        };
        let started = self.clock.now_us();
        // Someone may have refilled while we waited, or learnt that the key is refused.
        if let Some(d) = slot.block.load().spend(check.cost, started) {
            return Ok(d);
        }
        if let Some(d) = self.remembered(check, started) {
            return Ok(d);
        }
        if slot.retired.load(Ordering::Acquire) {
            return self.decide_direct(check, deadline).await;
        }
        let want = config.block_size(check.rule.quota(), rate, check.cost);
        let lease_check = Check {
            cost: want,
            ..*check
        };
        self.leases.lease_calls.fetch_add(1, Ordering::Relaxed);
        let Some(lease) = self
            .call_store(
                std::slice::from_ref(check),
                deadline,
                self.store.lease(lease_check, config.max_validity),
            )
            .await
        else {
            return Ok(self.policy_decision(check));
        };
        let block = |permits: u64| Block {
            permits: AtomicU64::new(permits),
            deadline: started + lease.valid_for.as_micros() as u64,
            taken: Some(lease.taken),
            seen: lease.state,
            reset_at: started + lease.state.reset_after.as_micros() as u64,
        };
        if lease.permits >= check.cost {
            let fresh = block(lease.permits - check.cost);
            let decision = fresh.admission(lease.permits - check.cost, check.cost, started);
            let old = slot.block.swap(Arc::new(fresh));
            self.give_back_later(check, &old);
            return Ok(decision);
        }
        // Not enough for this request: keep what was granted for smaller ones, and let the
        // store decide this one directly, within the same deadline.
        let old = slot.block.swap(Arc::new(block(lease.permits)));
        self.give_back_later(check, &old);
        self.decide_direct(check, deadline).await
    }

    /// One store decision for one check, or the policy's when the store cannot answer in time.
    async fn decide_direct(
        &self,
        check: &Check<'_>,
        deadline: Deadline,
    ) -> Result<Decision, Error> {
        let checks = std::slice::from_ref(check);
        let asked_at = self.clock.now_us();
        match self
            .call_store(checks, deadline, self.store.apply(Op::Consume, checks))
            .await
            .and_then(|mut d| d.pop())
        {
            Some(d) => {
                self.remember(check, &d, asked_at);
                Ok(d)
            }
            None => Ok(self.policy_decision(check)),
        }
    }

    /// The store could not decide: the outage policy decides this request.
    fn policy_decision(&self, check: &Check<'_>) -> Decision {
        self.fallback(Op::Consume, std::slice::from_ref(check))
            .pop()
            .unwrap_or_else(|| Decision::deny(0, 0, Duration::ZERO, None))
    }

    /// Give a replaced block's unspent permits back in the background, through its receipt.
    fn give_back_later(&self, check: &Check<'_>, old: &Block) {
        let Some(taken) = old.drain() else {
            return;
        };
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let (rule, key) = (check.rule.clone(), check.key.clone());
        runtime.spawn(async move {
            me.return_permits(&rule, &key, taken).await;
        });
    }

    /// Return unspent permits through their receipt; false when the store could not take them
    /// (they come back by themselves when the window ends or the bucket refills).
    async fn return_permits(&self, rule: &Rule, key: &Key, taken: Taken) -> bool {
        let refund = [Refund { rule, key, taken }];
        let given = self
            .give_back(&refund, Deadline::after(self.deadline))
            .await;
        if !given {
            tracing::debug!(
                rule = rule.name(),
                "fleetlimit: could not give leased permits back; they return when the window ends or the bucket refills"
            );
        }
        given
    }

    fn start_sweeper(&self) {
        if self.leases.sweeper.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.leases.sweeper.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(sweep(self.me.clone()));
    }

    /// Give back every unspent leased permit now (for a shutdown) and leave leased mode.
    pub(super) async fn release_all(&self) {
        let slots = self.leases.slots.swap(Arc::new(HashMap::new()));
        for ((index, key), slot) in slots.iter() {
            self.retire(*index, key, slot).await;
        }
    }

    /// Take a slot out of leased mode: wait for a refill in flight, then give its block back.
    async fn retire(&self, index: usize, key: &Key, slot: &Slot) {
        slot.retired.store(true, Ordering::Release);
        let _no_refill = slot.refill.lock().await;
        self.return_block(index, key, slot).await;
    }

    /// Give back what a slot's block still holds, leaving an empty block.
    async fn return_block(&self, index: usize, key: &Key, slot: &Slot) {
        let block = slot.block.swap(Arc::new(Block::empty()));
        if let (Some(rule), Some(taken)) = (self.rules.get(index), block.drain()) {
            self.return_permits(rule, key, taken).await;
        }
    }

    /// One pass of the sweeper at `now`: quiet keys leave leased mode, and expired blocks of
    /// busy keys give their unspent permits back.
    pub(super) async fn sweep_once(&self, now: u64) {
        let slots = self.leases.slots.load_full();
        let mut quiet: Vec<(SlotKey, Arc<Slot>)> = Vec::new();
        for ((index, key), slot) in slots.iter() {
            let idle = self
                .leases
                .config(*index)
                .map_or(Duration::ZERO, |c| c.idle);
            if slot.last_used.load(Ordering::Relaxed) + idle.as_micros() as u64 <= now {
                quiet.push(((*index, key.clone()), slot.clone()));
            } else if now >= slot.block.load().deadline {
                // Unless a refill is replacing the block right now (it gives the old one back).
                if let Ok(_no_refill) = slot.refill.try_lock() {
                    self.return_block(*index, key, slot).await;
                }
            }
        }
        if quiet.is_empty() {
            return;
        }
        self.leases.slots.rcu(|map| {
            let mut map = HashMap::clone(map);
            for (k, slot) in &quiet {
                // Only the slot judged quiet, not one inserted again since.
                if map.get(k).is_some_and(|current| Arc::ptr_eq(current, slot)) {
                    map.remove(k);
                }
            }
            map
        });
        for ((index, key), slot) in &quiet {
            self.retire(*index, key, slot).await;
            // A key that comes back at the same pace is leased again at once.
            self.leases.remember_rate((*index, key.clone()), &slot.rate);
        }
    }
}

/// Every 50 ms, a sweep; ends with the limiter.
async fn sweep(me: Weak<Inner>) {
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
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    loop {
        tick.tick().await;
        let Some(inner) = me.upgrade() else {
            return;
        };
        let now = inner.clock.now_us();
        inner.sweep_once(now).await;
    }
}
