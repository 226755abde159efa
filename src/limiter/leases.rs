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
use super::lease_config::LeaseConfig;
use super::policy::Deadline;
use super::rate::RateMeter;
use super::Inner;
use crate::error::Error;
use crate::store::{Check, Op, Refund};
use crate::{Decision, Key, Rule, Source, Taken};

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
    /// The key's quotas when it was leased ([`Leases::generation_of`]): after a change, its
    /// permits are not spent, since its validity was cut to the old quota's window.
    generation: u64,
}

impl Block {
    fn empty() -> Block {
        Block {
            permits: AtomicU64::new(0),
            deadline: 0,
            taken: None,
            seen: Decision::admit(0, 0, Duration::ZERO),
            reset_at: 0,
            generation: 0,
        }
    }

    /// Spend `cost` permits at `now`, under the quotas of `generation`; `None` means refill.
    fn spend(&self, cost: u64, now: u64, generation: u64) -> Option<Decision> {
        if now >= self.deadline || generation != self.generation {
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

/// A lease's answer on its way to the request that asked for it: dropped unclaimed (the request
/// gave up at its deadline, or was dropped), it gives the permits it holds back.
struct Unclaimed(Option<LeaseAnswer>);

/// The store's answer to a lease, with what it takes to give the permits back.
struct LeaseAnswer {
    lease: Result<crate::store::Lease, crate::StoreError>,
    inner: Arc<Inner>,
    rule: Rule,
    key: Key,
    /// Where the give-back runs: the answer may be dropped outside any runtime's context.
    runtime: tokio::runtime::Handle,
}

impl Unclaimed {
    fn claim(&mut self) -> Result<crate::store::Lease, crate::StoreError> {
        match self.0.take() {
            Some(answer) => answer.lease,
            None => Err(crate::StoreError::Protocol("a lease claimed twice".into())),
        }
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        // An error answer holds no receipt to give back through: a lease that ran after the
        // connection's response timeout is lost, as a consume that ran after its deadline is.
        let Some(LeaseAnswer {
            lease: Ok(lease),
            inner,
            rule,
            key,
            runtime,
        }) = self.0.take()
        else {
            return;
        };
        if lease.listed || lease.permits == 0 {
            return;
        }
        let taken = lease.taken.part(lease.permits);
        let returning = Returning::new(inner);
        runtime.spawn(async move {
            returning.0.return_permits(&rule, &key, taken, true).await;
        });
    }
}

/// How long a store call made in the background (a lease nobody may wait for, a give-back)
/// may take: many decision deadlines, and longer than a connection waits for an answer. A lease
/// sent runs when Redis gets to it, as late as that; cut off sooner, its block would be taken
/// with nobody left to give it back.
fn background_bound(deadline: Duration) -> Duration {
    deadline
        .saturating_mul(20)
        .max(crate::store::RESPONSE_TIMEOUT + Duration::from_secs(1))
}

/// A key in leased mode.
#[derive(Debug)]
struct Slot {
    block: ArcSwap<Block>,
    /// One lease request in flight per key in this process.
    refill: tokio::sync::Mutex<()>,
    last_used: AtomicU64,
    rate: RateMeter,
    /// Set before the slot leaves leased mode (the sweeper, `release_all`): its block is spent
    /// no more, and a refill that gets the lock afterwards decides through the store rather
    /// than strand a block in a slot nobody sees.
    retired: AtomicBool,
    /// Counts changes of this key's own quota or listing ([`Leases::key_changed`]).
    quota_changes: AtomicU64,
}

/// The most keys whose rate is tracked for promotion.
const MAX_CANDIDATES: usize = 10_000;
/// The most keys in leased mode at once; further hot keys are decided by the store.
const MAX_LEASED_KEYS: usize = 4_096;
/// How often the sweeper looks for quiet keys and expired blocks.
const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// The keys whose rate is tracked for promotion, and when they were last swept.
#[derive(Default)]
struct Candidates {
    rates: HashMap<SlotKey, RateMeter>,
    /// The second of the last sweep of a full map: one a second at most, since a sweep frees
    /// only keys not seen this second or the last (a spray of new keys once paid a sweep of
    /// all 10,000 each, under this lock, every request).
    swept: Option<u64>,
    sweeps: u64,
}

/// The leasing state of a limiter.
pub(crate) struct Leases {
    configs: Box<[Option<LeaseConfig>]>,
    slots: ArcSwap<HashMap<SlotKey, Arc<Slot>>>,
    /// Rates of keys not (yet) leased, for promotion; bounded.
    candidates: Mutex<Candidates>,
    sweeper: AtomicBool,
    lease_calls: AtomicU64,
    /// Counts the limiter's quota changes ([`Leases::quotas_changed`]).
    generation: AtomicU64,
    /// Give-backs under way besides `release_all`'s own (a sweep's, a replaced block's, an
    /// unclaimed lease's), which `release_all` waits for: a sweep that had taken quiet keys
    /// out of the map was cut short by the runtime's shutdown, their blocks still counted.
    returning: std::sync::atomic::AtomicUsize,
    returned: tokio::sync::Notify,
}

/// A give-back under way, counted in [`Leases`]'s `returning` until dropped (taken before the
/// work starts, so a shutdown cannot look between the two).
struct Returning(Arc<Inner>);

impl Returning {
    fn new(inner: Arc<Inner>) -> Returning {
        inner.leases.returning.fetch_add(1, Ordering::SeqCst);
        Returning(inner)
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        let leases = &self.0.leases;
        if leases.returning.fetch_sub(1, Ordering::SeqCst) == 1 {
            leases.returned.notify_waiters();
        }
    }
}

impl Leases {
    pub(crate) fn new(configs: Box<[Option<LeaseConfig>]>) -> Leases {
        Leases {
            configs,
            slots: ArcSwap::from_pointee(HashMap::new()),
            candidates: Mutex::new(Candidates::default()),
            sweeper: AtomicBool::new(false),
            lease_calls: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            returning: Default::default(),
            returned: tokio::sync::Notify::new(),
        }
    }

    /// Until no give-back counted in `returning` is under way.
    async fn all_returned(&self) {
        loop {
            let returned = self.returned.notified();
            tokio::pin!(returned);
            returned.as_mut().enable();
            if self.returning.load(Ordering::SeqCst) == 0 {
                return;
            }
            returned.await;
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

    /// The limiter's quotas changed: every block leased before is spent no more (its validity
    /// and the store's count follow the old quota: a block leased near the end of a 2 s window
    /// and spent into a new 1 s one would pass both limits). The next request refills, and the
    /// old block's permits go back.
    pub(crate) fn quotas_changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// One key's quota changed (an override set or removed), or its listing (set from this
    /// process: an operator's deny or block, the penalty box's): its block, leased before, is
    /// spent no more, as in [`quotas_changed`](Leases::quotas_changed); the other keys' blocks
    /// go on. A key whose slot is not in the map spends nothing: it never had a block
    /// (an override's requests are decided by the store, never leased), or its slot was marked
    /// retired before it left the map.
    pub(crate) fn key_changed(&self, index: usize, key: &Key) {
        if let Some(slot) = self.slots.load().get(&(index, key.clone())) {
            slot.quota_changes.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The quotas `slot`'s block must have been leased under to be spent: the limiter's
    /// changes and the key's own, both only ever counted up. `None` once the slot is retired:
    /// out of the map, it would miss its key's next quota change.
    fn generation_of(&self, slot: &Slot) -> Option<u64> {
        if slot.retired.load(Ordering::Acquire) {
            return None;
        }
        let all = self.generation.load(Ordering::Acquire);
        Some(all.wrapping_add(slot.quota_changes.load(Ordering::Acquire)))
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
        if candidates.rates.len() < MAX_CANDIDATES {
            candidates.rates.insert(key, rate.snapshot());
        }
    }

    /// Should this key be leased now? Counts the request toward its rate.
    fn promote(&self, config: &LeaseConfig, key: &SlotKey, now: u64) -> bool {
        if config.block.is_some() {
            return true;
        }
        let mut guard = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        let candidates = &mut *guard;
        if candidates.rates.len() >= MAX_CANDIDATES && !candidates.rates.contains_key(key) {
            // Forget keys not seen this second or the last, once a second.
            let second = now / 1_000_000;
            if candidates.swept.is_some_and(|s| s >= second) {
                return false;
            }
            candidates.swept = Some(second);
            candidates.sweeps += 1;
            candidates
                .rates
                .retain(|_, m| m.last_second() + 1 >= second);
            if candidates.rates.len() >= MAX_CANDIDATES {
                return false;
            }
        }
        let rates = &mut candidates.rates;
        let hot = rates.entry(key.clone()).or_default().tick(now) >= config.promote_at;
        if hot {
            rates.remove(key);
        }
        hot
    }
}

/// Leased permits given back to the store, or not (they return when the window ends or the
/// bucket refills), in the metrics.
fn count_returned(rule: &Rule, permits: u64, given: bool) {
    if given {
        super::telemetry::lease_returned(rule, permits);
    } else {
        super::telemetry::lease_expired(rule, permits);
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
        let spent = leases
            .generation_of(&slot)
            .and_then(|generation| slot.block.load().spend(check.cost, now, generation));
        if let Some(d) = spent {
            return Ok(Some(d));
        }
        if self.listings.is_listed(check.key, now) {
            // Decided by its listing request by request: no block to wait for, and no reason
            // to queue behind the refill lock one call at a time.
            return self.decide_direct(check, deadline).await.map(Some);
        }
        self.refill(&slot, &config, check, rate, deadline)
            .await
            .map(Some)
    }

    /// Permits from the key's leased block, when it holds enough: no promotion, no refill (both
    /// wait for the store; [`decide_leased`](Inner::decide_leased) does them).
    pub(super) fn spend_leased(
        &self,
        index: usize,
        check: &Check<'_>,
        now: u64,
    ) -> Option<Decision> {
        if check.cost > check.rule.quota().capacity() {
            return None;
        }
        self.leases.config(index)?;
        let slots = self.leases.slots.load();
        let slot = slots.get(&(index, check.key.clone()))?;
        let generation = self.leases.generation_of(slot)?;
        let decision = slot.block.load().spend(check.cost, now, generation)?;
        slot.last_used.store(now, Ordering::Relaxed);
        let _rate = slot.rate.tick(now);
        Some(decision)
    }

    fn insert_slot(&self, key: SlotKey, now: u64) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            block: ArcSwap::from_pointee(Block::empty()),
            refill: tokio::sync::Mutex::new(()),
            last_used: AtomicU64::new(now),
            rate: RateMeter::default(),
            retired: AtomicBool::new(false),
            quota_changes: AtomicU64::new(0),
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
        // Queued behind other refills (each a store call) for half the deadline: the store
        // decides this one directly, side by side, with the other half. Waiting it all out
        // would leave the request to the outage policy with the store answering every call.
        let Ok(one_at_a_time) = deadline.halfway().run(slot.refill.lock()).await else {
            return self.decide_direct(check, deadline).await;
        };
        let asked = self.asked(Some(check.key));
        let started = asked.at;
        // Read before the rules: a block leased under quotas replaced meanwhile is stamped
        // with the old generation, and never spent. A retired slot, or a rule replaced since
        // the request read it: the store decides.
        let (Some(generation), Some(_)) =
            (self.leases.generation_of(slot), self.rule_index(check.rule))
        else {
            drop(one_at_a_time);
            return self.decide_direct(check, deadline).await;
        };
        // Someone may have refilled while we waited, or learnt that the key is refused.
        if let Some(d) = slot.block.load().spend(check.cost, started, generation) {
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
        // Counted when made: a lease the breaker skips is no lease request.
        let lease = async {
            self.leases.lease_calls.fetch_add(1, Ordering::Relaxed);
            self.lease_owned(lease_check, config.max_validity).await
        };
        let Some(lease) = self
            .call_store("lease", std::slice::from_ref(check), deadline, lease)
            .await
        else {
            return Ok(self.policy_decision(check));
        };
        if lease.listed {
            // Its listing decides each request, and the lease call has decided this one: no
            // second call. Whatever the old block held goes back. Its next requests go to the
            // store directly, side by side, while it stays listed.
            let old = slot.block.swap(Arc::new(Block::empty()));
            self.give_back_later(check, &old);
            let decision = Decision {
                taken: None,
                ..lease.state
            };
            self.listings.observe(check.key, &decision, started);
            self.remember(check, &decision, asked);
            return Ok(decision);
        }
        self.listings.observe(check.key, &lease.state, started);
        let block = |permits: u64| Block {
            permits: AtomicU64::new(permits),
            deadline: started + lease.valid_for.as_micros() as u64,
            taken: Some(lease.taken),
            seen: lease.state,
            reset_at: started + lease.state.reset_after.as_micros() as u64,
            generation,
        };
        if lease.permits >= check.cost {
            // A block leased and kept: what the metric counts (not a lease that granted too
            // little for this request, which goes straight back).
            if let Some(index) = self.rule_index(check.rule) {
                self.telemetry.lease_block(index);
            }
            let fresh = block(lease.permits - check.cost);
            let decision = fresh.admission(lease.permits - check.cost, check.cost, started);
            let old = slot.block.swap(Arc::new(fresh));
            self.give_back_later(check, &old);
            // An admission by the store: a denial it gave before no longer stands.
            self.remember(check, &decision, asked);
            return Ok(decision);
        }
        // Not enough for this request, though the old block and the new one together may be:
        // both go back to the store now, and the store decides this one directly, within the
        // same deadline, counting every permit this process held. (Kept, they were out of the
        // store's count while it refused the request, and the refusal was remembered.) Still
        // holding the refill: a refused key is remembered before the requests queued behind it
        // look (released first, each would lease again, for nothing).
        let old = slot.block.swap(Arc::new(Block::empty()));
        let granted = block(lease.permits);
        let taken: Vec<Taken> = [old.drain(), granted.drain()]
            .into_iter()
            .flatten()
            .collect();
        if !taken.is_empty() {
            self.give_back_now(check, taken, deadline).await;
        }
        let decision = self.decide_direct(check, deadline).await;
        drop(one_at_a_time);
        decision
    }

    /// One store decision for one check, or the policy's when the store cannot answer in time.
    async fn decide_direct(
        &self,
        check: &Check<'_>,
        deadline: Deadline,
    ) -> Result<Decision, Error> {
        let checks = std::slice::from_ref(check);
        let asked = self.asked(Some(check.key));
        let asked_at = asked.at;
        match self
            .call_store(
                "apply",
                checks,
                deadline,
                self.store.apply(Op::Consume, checks),
            )
            .await
            .and_then(|mut d| d.pop())
        {
            Some(d) => {
                self.listings.observe(check.key, &d, asked_at);
                self.remember(check, &d, asked);
                Ok(d)
            }
            None => Ok(self.policy_decision(check)),
        }
    }

    /// A lease from the store, in a task of its own: once sent, the script runs, so a lease
    /// answered after this request's deadline (or after the request was dropped) has taken its
    /// block all the same. Whoever receives it owns the permits: this request, or, when it has
    /// gone, [`Unclaimed`], which gives them back rather than leave up to a block per timeout
    /// out of the window (a whole day's quota, after a few, on a daily rule).
    async fn lease_owned(
        &self,
        check: Check<'_>,
        max_validity: Duration,
    ) -> Result<crate::store::Lease, crate::StoreError> {
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            return self.store.lease(check, max_validity).await;
        };
        let (rule, key, cost) = (check.rule.clone(), check.key.clone(), check.cost);
        let (answer, answered) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            let check = Check {
                rule: &rule,
                key: &key,
                cost,
            };
            // Bounded, so that a node that never answers leaves no task behind.
            let bound = background_bound(me.deadline);
            let lease = tokio::time::timeout(bound, me.store.lease(check, max_validity))
                .await
                .unwrap_or(Err(crate::StoreError::Timeout(bound)));
            // Refused when the request has gone: then `Unclaimed` drops here and gives back.
            let _ = answer.send(Unclaimed(Some(LeaseAnswer {
                lease,
                inner: me.clone(),
                rule: rule.clone(),
                key: key.clone(),
                runtime: tokio::runtime::Handle::current(),
            })));
        });
        match answered.await {
            Ok(mut unclaimed) => unclaimed.claim(),
            Err(_) => Err(crate::StoreError::Protocol(
                "the lease task ended without an answer".into(),
            )),
        }
    }

    /// The store could not decide: the outage policy decides this request.
    fn policy_decision(&self, check: &Check<'_>) -> Decision {
        self.fallback(Op::Consume, std::slice::from_ref(check), Vec::new())
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
        let returning = Returning::new(me);
        runtime.spawn(async move {
            returning.0.return_permits(&rule, &key, taken, false).await;
        });
    }

    /// Give back `taken` (drained blocks of `check`'s key) within `deadline`, and wait for it.
    /// The give-back runs as a task of its own: a request dropped meanwhile (a client gone, a
    /// caller's timeout) would otherwise take the permits with it, out of the store's count
    /// until the window ends or the bucket refills.
    async fn give_back_now(&self, check: &Check<'_>, taken: Vec<Taken>, deadline: Deadline) {
        let (rule, key) = (check.rule.clone(), check.key.clone());
        let give_back = move |me: Arc<Inner>| async move {
            let refunds: Vec<Refund<'_>> = taken
                .iter()
                .map(|&taken| Refund {
                    rule: &rule,
                    key: &key,
                    taken,
                })
                .collect();
            let given = me.give_back(&refunds, deadline).await;
            let permits = taken.iter().map(Taken::cost).sum();
            count_returned(&rule, permits, given);
        };
        let Some(me) = self.me.upgrade() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // A task that panicked gave back what it could; nothing more to do here.
                let _ = runtime.spawn(give_back(me)).await;
            }
            Err(_) => give_back(me).await,
        }
    }

    /// Return unspent permits through their receipt; false when the store could not take them
    /// (they come back by themselves when the window ends or the bucket refills).
    /// `unclaimed`: a lease nobody received, sent straight to the store, within a bound of its
    /// own: past the breaker, which the very timeouts that left the block unclaimed may have
    /// opened (it would skip the refund, and the permits would stay out of the window).
    async fn return_permits(&self, rule: &Rule, key: &Key, taken: Taken, unclaimed: bool) -> bool {
        let refund = [Refund { rule, key, taken }];
        let given = if unclaimed {
            let bound = background_bound(self.deadline);
            tokio::time::timeout(bound, self.store.refund(&refund))
                .await
                .is_ok_and(|r| r.is_ok())
        } else {
            self.give_back(&refund, Deadline::after(self.deadline))
                .await
        };
        count_returned(rule, taken.cost(), given);
        if !given {
            tracing::debug!(
                rule = rule.name(),
                unclaimed,
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
        // Marked retired before they leave the map (see `key_changed`), and again after,
        // for a slot inserted meanwhile.
        for slot in self.leases.slots.load().values() {
            slot.retired.store(true, Ordering::Release);
        }
        let slots = self.leases.slots.swap(Arc::new(HashMap::new()));
        for ((index, key), slot) in slots.iter() {
            self.retire(*index, key, slot).await;
        }
        // The blocks the sweeper or a background task is giving back go back too before this
        // returns (each has a deadline of its own).
        self.leases.all_returned().await;
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
        let rules = self.rules.load_full();
        if let (Some(rule), Some(taken)) = (rules.get(index), block.drain()) {
            self.return_permits(rule, key, taken, false).await;
        }
    }

    /// One pass of the sweeper at `now`: quiet keys leave leased mode, and expired blocks of
    /// busy keys give their unspent permits back.
    pub(super) async fn sweep_once(&self, now: u64) {
        // Counted before the map is read: `release_all` waits for what this sweep gives back.
        let _returning = self.me.upgrade().map(Returning::new);
        let slots = self.leases.slots.load_full();
        let mut quiet: Vec<(SlotKey, Arc<Slot>)> = Vec::new();
        for ((index, key), slot) in slots.iter() {
            let idle = self
                .leases
                .config(*index)
                .map_or(Duration::ZERO, |c| c.idle);
            let idle = crate::algorithm::micros(idle);
            if slot.last_used.load(Ordering::Relaxed).saturating_add(idle) <= now {
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
        // Retired before they leave the map: a request still holding one spends nothing from
        // it, since a quota change of its key would no longer find it (see
        // `key_changed`). Each is either removed below or was replaced already.
        for (_, slot) in &quiet {
            slot.retired.store(true, Ordering::Release);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Op;
    use crate::{Algorithm, Clock, Limiter, ManualClock, MemoryStore, OnStoreError};

    const T0: u64 = 1_735_689_600_000_000;

    /// A spray of new keys against a full candidate map sweeps it once a second, not once a
    /// key (each sweep visits all 10,000): 20,000 keys within one second, one sweep; the next
    /// second, one more, which frees the keys not seen since the second before.
    #[test]
    fn a_spray_of_keys_sweeps_the_candidates_once_a_second() {
        let leases = Leases::new(vec![Some(LeaseConfig::auto())].into_boxed_slice());
        let config = LeaseConfig::auto();
        let key = |i: u64| -> SlotKey { (0, Key::new(format!("k{i}"))) };
        for i in 0..20_000 {
            assert!(!leases.promote(&config, &key(i), T0));
        }
        let sweeps = || leases.candidates.lock().unwrap().sweeps;
        assert_eq!(sweeps(), 1);
        for i in 20_000..30_000 {
            leases.promote(&config, &key(i), T0 + 1_000_000);
        }
        assert_eq!(sweeps(), 2);
        // Two seconds on, the spray's keys are forgotten: new keys are tracked again.
        let later = T0 + 3_000_000;
        leases.promote(&config, &key(40_000), later);
        assert_eq!(sweeps(), 3);
        let candidates = leases.candidates.lock().unwrap();
        assert!(candidates.rates.contains_key(&key(40_000)));
    }

    /// Rule "hot": a fixed window of 100 a minute.
    fn hot_rule() -> Rule {
        let quota = crate::Quota::per_minute(100)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap();
        Rule::new("hot", quota).unwrap()
    }

    /// A limiter leasing rule "hot" from a memory store, on a manual clock; the store as peeked
    /// by a second, unleased limiter.
    fn fleet(config: LeaseConfig) -> (Limiter, Limiter, ManualClock) {
        let clock = ManualClock::new(T0);
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let leased = leasing(store.clone(), hot_rule(), config, &clock);
        let plain = Limiter::builder(store).rule(hot_rule()).build().unwrap();
        (leased, plain, clock)
    }

    /// [`fleet`] with blocks of 10, on a store 2 ms away (tokio's paused time).
    fn leasing_two_ms_away() -> (Limiter, Limiter, ManualClock) {
        let clock = ManualClock::new(T0);
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let link = crate::store::testing::Link::new(
            store.clone(),
            Duration::from_millis(2),
            Duration::ZERO,
        );
        let leased = Limiter::builder(link)
            .rule(hot_rule())
            .on_store_error(OnStoreError::fail_closed())
            .lease("hot", LeaseConfig::fixed(10))
            .clock(clock.clone())
            .build()
            .unwrap();
        let plain = Limiter::builder(store).rule(hot_rule()).build().unwrap();
        (leased, plain, clock)
    }

    /// A limiter leasing `rule` (named "hot") on `store` and `clock`, failing closed.
    fn leasing(
        store: MemoryStore,
        rule: Rule,
        config: LeaseConfig,
        clock: &ManualClock,
    ) -> Limiter {
        Limiter::builder(store)
            .rule(rule)
            .on_store_error(OnStoreError::fail_closed())
            .lease("hot", config)
            .clock(clock.clone())
            .build()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn spent_permits_carry_the_blocks_receipt() {
        let (leased, plain, _) = fleet(LeaseConfig::fixed(10));
        let key = Key::new("k");
        let (d, receipt) = leased.consume_with_receipt(&key, 1).await.unwrap();
        assert_eq!(d.source, Source::Lease, "the first request leases a block");
        assert_eq!(
            plain.peek(&key).await.unwrap().remaining,
            90,
            "a block of 10 taken"
        );
        let (d, second) = leased.consume_with_receipt(&key, 1).await.unwrap();
        assert_eq!(d.source, Source::Lease);
        leased.refund(second.unwrap()).await.unwrap();
        leased.refund(receipt.unwrap()).await.unwrap();
        assert_eq!(
            plain.peek(&key).await.unwrap().remaining,
            92,
            "both refunds reached the store through the block's receipt"
        );
    }

    /// A denial remembered for a cost of 5, then a block leased for a request of cost 1 (other
    /// instances gave permits back meanwhile): the next request of cost 5 is admitted from the
    /// block. It was refused by the remembered denial while the process held 9 permits.
    #[tokio::test(start_paused = true)]
    async fn permits_leased_are_spent_before_a_remembered_denial() {
        let (leased, plain, _) = fleet(LeaseConfig::fixed(10));
        let key = Key::new("k");
        let mut receipts = Vec::new();
        for _ in 0..97 {
            let (d, receipt) = plain.consume_with_receipt(&key, 1).await.unwrap();
            assert!(d.allowed);
            receipts.push(receipt.unwrap());
        }
        let refused = leased.consume(&key, 5).await.unwrap();
        assert!(!refused.allowed, "3 left of 100: {refused:?}");
        for receipt in receipts.drain(..20) {
            plain.refund(receipt).await.unwrap();
        }
        let one = leased.consume(&key, 1).await.unwrap();
        assert_eq!((one.allowed, one.source), (true, Source::Lease), "{one:?}");
        let five = leased.consume(&key, 5).await.unwrap();
        assert_eq!(
            (five.allowed, five.source),
            (true, Source::Lease),
            "{five:?}"
        );
    }

    /// A key this process has learnt is blocked (a listing's refusal, remembered) while its
    /// leased block still holds permits (the block came in after the refusal): refused, not
    /// admitted from the block.
    #[tokio::test(start_paused = true)]
    async fn a_remembered_block_refuses_before_leased_permits() {
        let (leased, plain, _) = fleet(LeaseConfig::fixed(10));
        let key = Key::new("k");
        assert_eq!(leased.consume(&key, 1).await.unwrap().source, Source::Lease);
        plain.block(&key, Duration::from_secs(60)).await.unwrap();
        let blocked = plain.consume(&key, 1).await.unwrap();
        assert!(
            !blocked.allowed && blocked.listed.is_listed(),
            "{blocked:?}"
        );
        let inner = &leased.inner;
        let rules = inner.rules.load();
        let check = Check {
            rule: &rules[0],
            key: &key,
            cost: 1,
        };
        inner.remember(&check, &blocked, inner.asked(Some(&key)));
        let d = leased.consume(&key, 1).await.unwrap();
        assert!(!d.allowed && d.listed.is_listed(), "{d:?}");
    }

    /// A block leased near the end of a 2 s window, then the quota changed to 1 s windows: the
    /// store moves the count into the new window and starts the next one afresh, so the old
    /// block's permits, spent into that next window, would pass both limits. They are not
    /// spent after the change, whether the rule's quota changed or the key got its own.
    #[tokio::test(start_paused = true)]
    async fn a_block_leased_before_a_quota_change_is_not_spent_after_it() {
        for by_override in [false, true] {
            let clock = ManualClock::new(T0 + 900_000);
            let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
            let quota = |period_s| {
                crate::Quota::new(1000, Duration::from_secs(period_s))
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap()
            };
            let rule = Rule::new("hot", quota(2)).unwrap();
            let leased = leasing(store, rule, LeaseConfig::fixed(125), &clock);
            let key = Key::new("k");
            let d = leased.consume(&key, 1).await.unwrap();
            assert_eq!(d.source, Source::Lease, "a block of 125, valid to 1.15 s");
            clock.set(T0 + 950_000);
            if by_override {
                leased.set_override("hot", &key, Some(quota(1))).unwrap();
            } else {
                leased.set_quota("hot", quota(1)).unwrap();
            }
            // Any decision under the new quota moves the count into its window, [0 s, 1 s).
            leased.peek(&key).await.unwrap();
            clock.set(T0 + 1_050_000);
            // The key's own quota removed, the rule's 2 s window reads the count of a 1 s one
            // that has ended: none of the block's permits are counted any more.
            let mut admitted = 0;
            if by_override {
                leased.set_override("hot", &key, None).unwrap();
            }
            for _ in 0..1200 {
                let d = leased.consume(&key, 1).await.unwrap();
                assert!(!d.degraded);
                admitted += u64::from(d.allowed);
            }
            assert!(
                admitted <= 1000,
                "{admitted} admitted in [1 s, 2 s) under quotas of 1000 (override: {by_override})"
            );
        }
    }

    /// An override changes one key's quota: that key's block is retired, while every other
    /// leased key goes on spending its own, with no new lease (every block was retired, and
    /// each leased key paid a lease call per override change).
    #[tokio::test(start_paused = true)]
    async fn an_override_retires_only_its_own_keys_block() {
        let (leased, _, _) = fleet(LeaseConfig::fixed(10));
        let quota = |limit| {
            crate::Quota::per_minute(limit)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap()
        };
        let (a, b) = (Key::new("a"), Key::new("b"));
        for key in [&a, &b] {
            let d = leased.consume(key, 1).await.unwrap();
            assert_eq!(d.source, Source::Lease, "{key:?} leased a block");
        }
        let calls = leased.stats().lease_calls;
        leased.set_override("hot", &a, Some(quota(200))).unwrap();
        let d = leased.consume(&b, 1).await.unwrap();
        assert_eq!(d.source, Source::Lease);
        assert_eq!(leased.stats().lease_calls, calls, "b's block goes on");
        leased.set_override("hot", &a, None).unwrap();
        let d = leased.consume(&a, 1).await.unwrap();
        assert_eq!(d.source, Source::Lease);
        assert_eq!(
            leased.stats().lease_calls,
            calls + 1,
            "a's block, leased before its quota changed twice, is not spent: a new one is"
        );
    }

    /// Quiet keys' slots are retired before the sweeper takes them out of the map: a request
    /// that picked one up before spends nothing from it, since a change of its key's quota
    /// (`set_override`) would no longer find it. Two slots, each with a refill in flight: the
    /// sweeper waits for the first one's, and the second must not sit out of the map unretired.
    #[tokio::test(start_paused = true)]
    async fn slots_are_retired_before_they_leave_the_map() {
        let (leased, _, clock) = fleet(LeaseConfig::fixed(10));
        let keys = [Key::new("a"), Key::new("b")];
        for key in &keys {
            assert_eq!(leased.consume(key, 1).await.unwrap().source, Source::Lease);
        }
        let inner = leased.inner.clone();
        let slots: Vec<Arc<Slot>> = keys
            .iter()
            .filter_map(|k| inner.leases.slots.load().get(&(0, k.clone())).cloned())
            .collect();
        assert_eq!(slots.len(), 2);
        let mut refilling = Vec::new();
        for slot in &slots {
            assert!(inner.leases.generation_of(slot).is_some());
            refilling.push(slot.refill.lock().await);
        }
        clock.advance(Duration::from_secs(10));
        let sweeper = tokio::spawn({
            let inner = inner.clone();
            let now = clock.now_us();
            async move { inner.sweep_once(now).await }
        });
        while !inner.leases.slots.load().is_empty() {
            tokio::task::yield_now().await;
        }
        for slot in &slots {
            assert_eq!(
                inner.leases.generation_of(slot),
                None,
                "out of the map, so retired: nothing is spent from it"
            );
        }
        drop(refilling);
        sweeper.await.unwrap();
    }

    /// A request larger than what the key's block holds, when the store has fewer left than
    /// it asks for: the old block and the new one together hold enough, and the request is
    /// admitted (the store decided it with neither counted, and refused it).
    #[tokio::test(start_paused = true)]
    async fn permits_split_between_the_old_block_and_the_new_lease_admit() {
        let (leased, plain, _) = fleet(LeaseConfig::fixed(10));
        let key = Key::new("k");
        for _ in 0..88 {
            assert!(plain.consume(&key, 1).await.unwrap().allowed);
        }
        for _ in 0..7 {
            let d = leased.consume(&key, 1).await.unwrap();
            assert_eq!(d.source, Source::Lease);
        }
        // The block holds 3; the store 2.
        assert_eq!(plain.peek(&key).await.unwrap().remaining, 2);
        let d = leased.consume(&key, 5).await.unwrap();
        assert!(d.allowed, "3 in the old block and 2 in the store: {d:?}");
        assert_eq!(plain.peek(&key).await.unwrap().remaining, 0);
        let d = leased.consume(&key, 1).await.unwrap();
        assert!(!d.allowed, "all 100 taken");
    }

    /// The same split, on a store 2 ms away, by a request dropped while both blocks are on
    /// their way back (a client gone, a caller's timeout): they still get there, and the 5
    /// permits are the store's again, not lost until the window ends.
    #[tokio::test(start_paused = true)]
    async fn a_request_dropped_during_the_split_give_back_loses_no_permit() {
        let (leased, plain, _) = leasing_two_ms_away();
        let key = Key::new("k");
        for _ in 0..88 {
            assert!(plain.consume(&key, 1).await.unwrap().allowed);
        }
        for _ in 0..7 {
            assert!(leased.consume(&key, 1).await.unwrap().allowed);
        }
        assert_eq!(plain.peek(&key).await.unwrap().remaining, 2);
        // The lease call answers at 2 ms (2 more permits: too few), the give-back of both
        // blocks is sent then, and lands at 4 ms; the request is dropped at 3 ms.
        let dropped = tokio::time::timeout(Duration::from_millis(3), leased.consume(&key, 5)).await;
        assert!(dropped.is_err());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(plain.peek(&key).await.unwrap().remaining, 5);
    }

    /// A shutdown's `release_leases` while the sweeper gives quiet keys' blocks back: those keys
    /// are out of the map already, one give-back at a time, and the runtime's end cut the
    /// sweep short. `release_leases` now returns once the sweep has given them all back.
    #[test]
    fn release_leases_waits_for_the_sweepers_give_backs() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let (leased, plain, clock) = runtime.block_on(async { leasing_two_ms_away() });
        let keys = [Key::new("a"), Key::new("b"), Key::new("c")];
        runtime.block_on(async {
            for key in &keys {
                assert_eq!(leased.consume(key, 1).await.unwrap().source, Source::Lease);
            }
            clock.advance(Duration::from_millis(200));
            let inner = leased.inner.clone();
            let now = clock.now_us();
            tokio::spawn(async move { inner.sweep_once(now).await });
            while !leased.inner.leases.slots.load().is_empty() {
                tokio::task::yield_now().await;
            }
            leased.release_leases().await;
        });
        drop(runtime);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        for key in &keys {
            let remaining = runtime.block_on(plain.peek(key)).unwrap().remaining;
            assert_eq!(remaining, 99, "{key:?}");
        }
    }

    /// A shutdown that stops waiting for `release_leases` (its own timeout) still gives every
    /// block back: the give-backs go on without it.
    #[tokio::test(start_paused = true)]
    async fn release_leases_given_up_on_still_gives_every_block_back() {
        let (leased, plain, _) = leasing_two_ms_away();
        let keys = [Key::new("a"), Key::new("b")];
        for key in &keys {
            assert!(leased.consume(key, 1).await.unwrap().allowed);
            assert_eq!(
                plain.peek(key).await.unwrap().remaining,
                90,
                "a block of 10 leased"
            );
        }
        let given_up =
            tokio::time::timeout(Duration::from_millis(1), leased.release_leases()).await;
        assert!(given_up.is_err());
        tokio::time::sleep(Duration::from_millis(50)).await;
        for key in &keys {
            assert_eq!(plain.peek(key).await.unwrap().remaining, 99, "{key:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_keys_and_expired_blocks_give_their_permits_back() {
        let (leased, plain, clock) = fleet(LeaseConfig::fixed(10));
        let (busy, quiet) = (Key::new("busy"), Key::new("quiet"));
        leased.consume(&busy, 1).await.unwrap();
        leased.consume(&quiet, 1).await.unwrap();
        assert_eq!(leased.stats().leased_keys, 2);
        // 80 ms later: busy is used again; both blocks are still valid.
        clock.advance(Duration::from_millis(80));
        leased.consume(&busy, 1).await.unwrap();
        leased.inner.sweep_once(clock.now_us()).await;
        assert_eq!(leased.stats().leased_keys, 2, "nothing is idle yet");
        // 120 ms later: quiet has been idle past the default 100 ms.
        clock.advance(Duration::from_millis(40));
        leased.inner.sweep_once(clock.now_us()).await;
        assert_eq!(leased.stats().leased_keys, 1);
        assert_eq!(plain.peek(&quiet).await.unwrap().remaining, 99);
        // Busy's block expires (250 ms) while it stays in leased mode: its permits come back.
        clock.advance(Duration::from_millis(150));
        // Still in use (as a request would mark it), without spending from the old block.
        for slot in leased.inner.leases.slots.load().values() {
            slot.last_used.store(clock.now_us(), Ordering::Relaxed);
        }
        leased.inner.sweep_once(clock.now_us()).await;
        assert_eq!(leased.stats().leased_keys, 1);
        assert_eq!(plain.peek(&busy).await.unwrap().remaining, 98);
    }

    /// Ten requests at once on a key whose first block is on its way (the store 2 ms away):
    /// one lease call, whose block serves them all; the others wait for it instead of each
    /// asking for a block of its own.
    #[tokio::test(start_paused = true)]
    async fn one_refill_per_key_in_flight() {
        let (leased, plain, _) = leasing_two_ms_away();
        let key = Key::new("k");
        let requests: Vec<_> = (0..10)
            .map(|_| {
                let (leased, key) = (leased.clone(), key.clone());
                tokio::spawn(async move { leased.consume(&key, 1).await.unwrap() })
            })
            .collect();
        for r in requests {
            assert!(r.await.unwrap().allowed);
        }
        assert_eq!(leased.stats().lease_calls, 1, "one block served all ten");
        assert_eq!(plain.peek(&key).await.unwrap().remaining, 90);
    }

    /// A spent leased key, a store 2 ms away, and 200 requests at once of costs 1 to 40 (the
    /// denial cache answers only costs it has seen): requests queued behind refills, each a
    /// store call, are decided by the store side by side once half their deadline has gone,
    /// never by the outage policy (which, failing open, would admit them on a spent key).
    #[tokio::test(start_paused = true)]
    async fn requests_queued_behind_refills_are_decided_by_the_store() {
        let clock = ManualClock::new(T0);
        let store = crate::store::testing::Link::new(
            MemoryStore::builder().clock(clock.clone()).build().unwrap(),
            Duration::from_millis(2),
            Duration::ZERO,
        );
        let rule = hot_rule();
        let leased = Limiter::builder(store)
            .rule(rule)
            .on_store_error(OnStoreError::FailOpen)
            .lease("hot", LeaseConfig::fixed(12))
            .clock(clock.clone())
            .build()
            .unwrap();
        let key = Key::new("k");
        let mut admitted = 0;
        while admitted < 100 {
            let d = leased.consume(&key, 1).await.unwrap();
            assert!(d.allowed && !d.degraded);
            admitted += 1;
        }
        let requests: Vec<_> = (0..200u64)
            .map(|i| {
                let (leased, key) = (leased.clone(), key.clone());
                tokio::spawn(async move { leased.consume(&key, 1 + i % 40).await.unwrap() })
            })
            .collect();
        for r in requests {
            let d = r.await.unwrap();
            assert!(!d.allowed && !d.degraded, "{d:?}");
        }
    }

    #[test]
    fn block_sizes_follow_the_rate_within_their_bounds() {
        let q = crate::Quota::per_second(1_000).build().unwrap();
        let auto = LeaseConfig::auto();
        assert_eq!(
            auto.block_size(&q, 400.0, 1),
            40,
            "a tenth of a second of traffic"
        );
        assert_eq!(
            auto.block_size(&q, 1e6, 1),
            125,
            "at most an eighth of the quota"
        );
        assert_eq!(
            auto.block_size(&q, 1.0, 5),
            5,
            "never smaller than the request"
        );
        assert_eq!(LeaseConfig::fixed(7).block_size(&q, 1e6, 1), 7);
        let _ = Op::Peek;
    }
}
