//! The in-memory store: the embedded default, for one process and for tests.
//!
//! The map is split into shards, each behind its own lock, so concurrent requests on different
//! keys rarely meet; refusals that write nothing share the lock, so requests refused on one hot
//! key do not queue behind each other either. Memory is bounded: state that can no longer affect
//! a decision is swept as the map grows, and a maximum key count evicts, when full, the entries
//! closest to a fresh state (the fewest permits used), never one that has used more than half of
//! its quota. So a client
//! spraying random keys cannot reset a key it has exhausted: an eviction gives a key back at most
//! half of its limit. (A key's share is counted under the quota of its last admission or
//! refusal: after a quota is lowered, a key that has sent nothing since still reads as the share
//! of the old one it used.) When every entry of a shard has used more than that, new keys share one
//! overflow state per rule (or are refused; see [`Overflow`]) until entries expire.
//!
//! Memory per entry: about 120 bytes with the key inline (the README has the measured figure).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use hashbrown::{DefaultHashBuilder, HashTable};

use super::{BoxFuture, Check, Lease, Listing, Op, Refund, SlotOp, Store};
use crate::algorithm::State;
use crate::decision::ByListing;
use crate::error::ConfigError;
use crate::{Clock, Decision, Key, Quota, Rule, StoreError, SystemClock};

/// The default maximum number of (rule, key) entries kept.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Entries a shard holds before its first sweep for expired state.
const FIRST_SWEEP: usize = 64;

/// `used` is a fraction of the quota's capacity in 1/65535ths.
const USED_SCALE: u64 = u16::MAX as u64;
/// Entries that have used more than this share of their quota are never evicted.
const EVICTABLE: u16 = (USED_SCALE / 2) as u16;

/// What a new key gets when its shard is full and every entry in it has used more than half of
/// its quota (so evicting one would give a limited client its permits back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overflow {
    /// New keys share one state per rule (per shard) until room frees up: they are limited
    /// together, never less than one key would be. The default.
    Shared,
    /// New keys are refused, with this `Retry-After`, until room frees up.
    Refuse {
        /// The wait given to refused requests.
        retry_after: Duration,
    },
}

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
    shards: Box<[ShardCell]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    shard_capacity: usize,
    overflow: Overflow,
    /// Pauses per (rule, key), until when (µs): few, short-lived, pruned on every new one.
    pauses: Mutex<std::collections::HashMap<(Arc<str>, Key), u64>>,
    /// Allowed, denied and blocked keys; `listed` counts them, so that a store with none (the
    /// usual case) decides without looking.
    listings: RwLock<Listings>,
    listed: AtomicUsize,
    /// When the last of them ends (µs; never, with an allow or deny entry): from then on the
    /// count is pruned, so that ended blocks do not keep every decision on the mutex.
    listings_end: AtomicU64,
    /// Concurrency slots per (limit name, key).
    slots: Mutex<SlotTable>,
}

/// The listings, and how many were left by the last sweep of ended blocks: the next sweep waits
/// until the map has doubled, so that a block costs a constant amortised time (each swept the
/// whole map once, and a spray of penalty blocks cost quadratic time under the lock).
#[derive(Default)]
struct Listings {
    map: std::collections::HashMap<Key, Listed>,
    swept: usize,
    /// A full map swept and still full of operators' entries: until then (µs), a new penalty
    /// block is not written, without sweeping again.
    full_until: u64,
    /// Allow and deny entries, which never end: while there is one, decisions always look.
    forever: usize,
    /// No earlier than the latest end of a block in the map (µs): raised as blocks are
    /// written, found exactly by a sweep. Lifting a block never needs the whole map read.
    blocks_end: u64,
}

impl Listings {
    /// Put `listed` in force for `key`, keeping the counts.
    fn put(&mut self, key: &Key, listed: Listed) {
        let old = self.map.insert(key.clone(), listed);
        self.forget(old);
        match listed {
            Listed::Until(t, _) => self.blocks_end = self.blocks_end.max(t),
            Listed::Allow | Listed::Deny => self.forever += 1,
        }
    }

    /// Take `key`'s entry off, keeping the counts.
    fn take(&mut self, key: &Key) {
        let old = self.map.remove(key);
        self.forget(old);
        // The block that ended last lifted: its end no longer bounds the rest. Unknown until
        // the map is read, so the next decision reads it (once) rather than go on looking
        // until that end.
        if matches!(old, Some(Listed::Until(t, _)) if t >= self.blocks_end) {
            self.blocks_end = 0;
        }
    }

    fn forget(&mut self, old: Option<Listed>) {
        if matches!(old, Some(Listed::Allow | Listed::Deny)) {
            self.forever -= 1;
        }
    }

    /// When decisions may stop looking: never while an allow or deny entry stands, else once
    /// the last block has ended.
    fn end(&self) -> u64 {
        if self.forever > 0 {
            u64::MAX
        } else {
            self.blocks_end
        }
    }

    /// Drop the ended blocks and count again.
    fn sweep(&mut self, now: u64) {
        self.map.retain(|_, l| in_force(l, now).is_some());
        self.recount();
        self.swept = self.map.len();
    }

    fn recount(&mut self) {
        self.forever = 0;
        self.blocks_end = 0;
        for l in self.map.values() {
            match l {
                Listed::Until(t, _) => self.blocks_end = self.blocks_end.max(*t),
                Listed::Allow | Listed::Deny => self.forever += 1,
            }
        }
    }

    /// Make room in a full map: the penalty box's blocks that end soonest go (an eighth of
    /// them, and at least what makes room for one more), ending early; an operator's entry
    /// never does. None goes when they cannot make room (operators' entries fill the map).
    fn evict_penalty_blocks(&mut self, capacity: usize) {
        let mut ends: Vec<u64> = self
            .map
            .values()
            .filter_map(|l| match l {
                Listed::Until(t, true) => Some(*t),
                _ => None,
            })
            .collect();
        let needed = (self.map.len() + 1).saturating_sub(capacity);
        if needed == 0 || ends.len() < needed {
            return;
        }
        let drop = needed.max(ends.len() / 8);
        let (_, &mut threshold, _) = ends.select_nth_unstable(drop - 1);
        let below = ends.iter().filter(|&&t| t < threshold).count();
        let mut at_threshold = drop - below;
        self.map.retain(|_, l| match l {
            Listed::Until(t, true) if *t < threshold => false,
            Listed::Until(t, true) if *t == threshold && at_threshold > 0 => {
                at_threshold -= 1;
                false
            }
            _ => true,
        });
        self.recount();
    }
}

/// Concurrency slots held per (limit name, key): each slot's id and when it expires (µs).
type SlotTable = std::collections::HashMap<(Arc<str>, Key), Vec<(u64, u64)>>;

/// A key's administrative entry, as held: blocks as the time they end (µs), and whether the
/// penalty box set it (an operator's block never makes room for others).
#[derive(Debug, Clone, Copy)]
enum Listed {
    Allow,
    Deny,
    Until(u64, bool),
}

/// `listed` as the store's API names it, if still in force at `now`.
fn listing_at(listed: &Listed, now: u64) -> Option<Listing> {
    Some(match in_force(listed, now)? {
        Listed::Allow => Listing::Allow,
        Listed::Deny => Listing::Deny,
        Listed::Until(t, _) => Listing::Block(Duration::from_micros(t - now)),
    })
}

/// `listed`, if still in force at `now` (a block that ended is not).
fn in_force(listed: &Listed, now: u64) -> Option<Listed> {
    match listed {
        Listed::Until(t, _) if *t <= now => None,
        l => Some(*l),
    }
}

/// When a block of `block` set at `now` ends.
fn block_end(now: u64, block: Duration) -> u64 {
    now.saturating_add(block.as_micros().min(u128::from(u64::MAX / 2)) as u64)
}

/// `d` turned into a refusal for at least `wait` (a rule's own longer wait stands), taking
/// nothing.
fn refused(mut d: Decision, wait: Duration) -> Decision {
    let own = if d.allowed { None } else { d.retry_after };
    d.allowed = false;
    d.remaining = 0;
    d.retry_after = Some(own.map_or(wait, |own| own.max(wait)));
    d.reset_after = d.reset_after.max(wait);
    d.taken = None;
    d
}

/// Aligned to a cache line, so that in a [`ShardCell`] it starts on a line of its own: the lock
/// word, which every decision writes (a shared lock too), would otherwise share a line with the
/// table's header that every lookup reads, and two threads on one shard (one hot key) bounced
/// that line twice per decision instead of once.
#[repr(align(64))]
struct Shard {
    table: HashTable<Entry>,
    /// The store's hasher, to place entries again when the table grows.
    hasher: DefaultHashBuilder,
    /// Sweep expired entries when the shard reaches this size.
    next_sweep: usize,
    /// With [`Overflow::Shared`]: the state new keys share, per rule and algorithm, while the
    /// shard is full, with its expiry. Kept until it expires, not only while the shard is full: a key that
    /// leaves it for an entry of its own starts from it (see [`Shard::fresh`]).
    overflow: Vec<(Arc<str>, State, u64)>,
    /// The latest time a decision in this shard was made at (µs). Time read before taking the
    /// lock can be older than a decision already made under it; such a request is decided at
    /// this time instead, so states only ever move forward (see [`Shard::at`]).
    latest: u64,
    /// A full shard's last sweep freed nothing: no sweep for a new key before this time (µs).
    /// Each sweep scans the whole shard under its lock, and a key spray on a shard of
    /// restrictive entries would otherwise pay one scan per request.
    full_until: u64,
}

/// How long a full shard whose sweep freed nothing waits before sweeping for a new key again
/// (sooner when one of its entries expires).
const FULL_RETRY: u64 = 1_000_000;

/// Kept small (no cached hash): a table of many keys is bound by cache misses, and smaller
/// entries miss less. The key is held as a [`Key`]: inline up to 37 bytes, so finding an entry
/// touches the entry alone, not a second allocation.
struct Entry {
    /// The rule's [name number](Rule::name_id): a shared name here would cost an atomic
    /// reference count per insert and per drop, on a line every thread writes.
    rule: u32,
    key: Key,
    state: State,
    /// From this time on the state equals a fresh one and can be dropped.
    expires_at: u64,
    /// The share of the quota used, in 1/65535ths, as the last write counted it, and raised by
    /// any refusal since (between writes the real share only falls, with time, so this never
    /// reads as less than it is): eviction takes the lowest first. Atomic, so that a
    /// refusal decided under the shared lock raises it too: a key refused under a quota lowered
    /// since its last write reads as exhausted, not as the small share it had used of the old
    /// one (an eviction would give it the whole new limit).
    used: AtomicU16,
}

impl Entry {
    /// Whether this is the check's (rule, algorithm, key) entry. The algorithm is part of a
    /// state's identity, as it is of a Redis key's name: two limiters that give one rule name
    /// different algorithms (a reconfiguration while old clones still serve) each keep their
    /// own count, where replacing one state by a fresh one of the other algorithm wiped it on
    /// every alternate request.
    fn is_for(&self, check: &Check<'_>) -> bool {
        self.rule == check.rule.name_id()
            && self.key == *check.key
            && self.state.fits(check.rule.quota())
    }

    /// Decide a consume on a state [`Shard::held`] found, then take the permits or put the state
    /// back, as [`decide`](Shard::decide) and [`commit`](Shard::commit) do. Inlined with the
    /// algorithms' `decide` and `commit`, so the decision is written where it is returned (see
    /// [`State::decide`]).
    #[inline(always)]
    fn consume(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let undo = Undo::of(&self.state);
        let mut decision = self.state.decide(now, quota, cost);
        if decision.allowed {
            let used = used_share(&decision, quota);
            decision.taken = Some(self.state.commit(now, quota, cost));
            self.expires_at = self.state.expires_at(quota);
            *self.used.get_mut() = used;
        } else {
            undo.restore(&mut self.state);
            self.refused(&decision, quota);
        }
        decision
    }

    /// A refusal: the share of the quota it says is used is at least what the key has used.
    #[inline]
    fn refused(&self, decision: &Decision, quota: &Quota) {
        // Most refusals find nothing left: the whole quota used, no division (this runs on
        // every refusal, under the shared lock too, where it writes only when the share rises).
        let share = if decision.remaining == 0 {
            u16::MAX
        } else {
            used_share(decision, quota)
        };
        if self.used.load(Ordering::Relaxed) < share {
            self.used.store(share, Ordering::Relaxed);
        }
    }
}

/// Where a check's state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Found,
    /// Not held yet, and there is room.
    Fresh,
    /// Not held, and the shard is full of restrictive entries.
    Overflow,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field(
                "max_keys",
                &(self.inner.shard_capacity * self.inner.shards.len()),
            )
            .field("overflow", &self.inner.overflow)
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
        let now = self.inner.clock.now_us();
        if let Some(d) = self
            .inner
            .apply_listed(op, std::slice::from_ref(check), now)
        {
            if let Some(d) = d.into_iter().next() {
                return d;
            }
        }
        self.inner.apply_one(op, check, now)
    }

    /// [`Store::refund`], synchronously.
    pub fn refund_now(&self, refunds: &[Refund<'_>]) -> Vec<Decision> {
        let inner = &self.inner;
        let now = inner.clock.now_us();
        refunds
            .iter()
            .map(|r| {
                let check = Check {
                    rule: r.rule,
                    key: r.key,
                    cost: 1,
                };
                let hash = inner.hash(&check);
                let mut shard = lock(&inner.shards[inner.shard_of(hash)]);
                let now = shard.at(now);
                let quota = r.rule.quota();
                match shard.find(&check, hash) {
                    // A receipt refunds only state of its own algorithm, written under the
                    // refund's quota: read under another, a state is converted to it, which a
                    // refund must never do (a key's hour of permits moved into a minute that
                    // ends). Such a receipt refunds nothing.
                    Some(entry) => {
                        if entry.state.converts(now, quota) {
                            return peek(&mut entry.state.clone(), now, quota);
                        }
                        if let State::SlidingLog(_) = entry.state {
                            // A log forgets no entry for a refund (it may come under a quota
                            // not the key's own, a shorter period), and a refund only removes
                            // entries: the log lives no longer than it did.
                            entry.state.refund(now, quota, r.taken);
                        } else {
                            entry.state.decide(now, quota, 1);
                            entry.state.refund(now, quota, r.taken);
                            entry.expires_at = entry.state.expires_at(quota);
                        }
                        peek(&mut entry.state, now, quota)
                    }
                    // Evicted or expired: nothing is outstanding any more.
                    _ => peek(&mut State::new(quota), now, quota),
                }
            })
            .collect()
    }
}

/// Builder for [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    max_keys: usize,
    /// Set by [`shards`](MemoryStoreBuilder::shards); else chosen from the cores and `max_keys`.
    shards: Option<usize>,
    overflow: Overflow,
}

/// The default shards: 8 per core, 16 to 256, and no more than `max_keys` (the largest power of
/// two not above it).
fn default_shards(cores: usize, max_keys: usize) -> usize {
    let default = cores.saturating_mul(8).next_power_of_two().clamp(16, 256);
    default.min(1usize << max_keys.max(1).ilog2())
}

/// The fewest keys a store may hold when its shards are left to the default: the fewest shards
/// the default picks, so a `max_keys` valid on one machine is valid on every machine.
const MIN_DEFAULT_MAX_KEYS: usize = 16;

impl Default for MemoryStoreBuilder {
    fn default() -> Self {
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock),
            max_keys: DEFAULT_MAX_KEYS,
            shards: None,
            overflow: Overflow::Shared,
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
    /// full, expired entries go first, then those that have used the least of their quota (never
    /// more than half of it); an evicted key starts afresh (from a copy of the rule's shared
    /// overflow state while that counts: it may have shared it). At least 16, or at least the
    /// number of [`shards`](MemoryStoreBuilder::shards) when they are set.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// What new keys get while a shard is full of entries that cannot be evicted (default
    /// [`Overflow::Shared`]).
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// The number of shards (rounded up to a power of two; default 8 per core, 16 to 256, and
    /// no more than `max_keys`).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// The shards to build: as set, or the default for this machine, at most `max_keys`.
    fn shard_count(&self) -> usize {
        self.shards.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
            default_shards(cores, self.max_keys)
        })
    }

    /// Validate and build.
    pub fn build(mut self) -> Result<MemoryStore, ConfigError> {
        if self.shards.is_none() && self.max_keys < MIN_DEFAULT_MAX_KEYS {
            return Err(ConfigError::Invalid {
                setting: "max_keys",
                reason: format!(
                    "must be at least {MIN_DEFAULT_MAX_KEYS} (or set fewer shards), got {}",
                    self.max_keys
                ),
            });
        }
        let shards = self.shard_count();
        if shards == 0 || shards > 1 << 16 {
            return Err(ConfigError::Invalid {
                setting: "shards",
                reason: format!("must be between 1 and 65536, got {shards}"),
            });
        }
        if self.max_keys < shards.next_power_of_two() {
            return Err(ConfigError::Invalid {
                setting: "max_keys",
                reason: format!(
                    "must be at least the number of shards ({}), got {}",
                    shards.next_power_of_two(),
                    self.max_keys
                ),
            });
        }
        self.shards = Some(shards);
        if let Overflow::Refuse { retry_after } = self.overflow {
            if retry_after < Duration::from_millis(1) {
                return Err(ConfigError::Invalid {
                    setting: "overflow",
                    reason: "Refuse needs a retry_after of at least 1 ms".into(),
                });
            }
        }
        Ok(self.build_unchecked())
    }

    fn build_unchecked(self) -> MemoryStore {
        let shards = self.shard_count().next_power_of_two();
        let shard_capacity = self.max_keys / shards;
        let hasher = DefaultHashBuilder::default();
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards)
                    .map(|_| ShardCell {
                        shard: RwLock::new(Shard {
                            table: HashTable::new(),
                            hasher,
                            next_sweep: FIRST_SWEEP.min(shard_capacity),
                            overflow: Vec::new(),
                            latest: 0,
                            full_until: 0,
                        }),
                        refusing: AtomicBool::new(false),
                    })
                    .collect(),
                hasher,
                clock: self.clock,
                shard_capacity,
                overflow: self.overflow,
                pauses: Mutex::new(std::collections::HashMap::new()),
                listings: RwLock::new(Listings::default()),
                listed: AtomicUsize::new(0),
                listings_end: AtomicU64::new(u64::MAX),
                slots: Mutex::new(std::collections::HashMap::new()),
            }),
        }
    }
}

/// A shard behind its lock. Shard locks are held for a few dozen nanoseconds: parking_lot's
/// lock spins briefly before parking, which keeps a contended hot key cheap, and it has no
/// poisoning (a panic elsewhere leaves a valid rate-limit state behind).
///
/// A lock for reading, not a mutex: a refusal that writes nothing is decided under a shared
/// lock ([`Shard::refusal`]), so threads refused on one hot key (an attacker's, typically) do
/// not queue behind each other.
struct ShardCell {
    shard: RwLock<Shard>,
    /// The shard's last consume decided under the exclusive lock was refused, on a state that
    /// can refuse without writing ([`State::refuses_without_writing`]): the next one tries the
    /// shared lock first. A hint only (a wrong guess costs one extra lock and lookup, and an
    /// admission clears it), so it is read and written relaxed, and only written when it
    /// changes.
    refusing: AtomicBool,
}

impl ShardCell {
    fn note(&self, refused: bool) {
        if self.refusing.load(Ordering::Relaxed) != refused {
            self.refusing.store(refused, Ordering::Relaxed);
        }
    }
}

fn lock(cell: &ShardCell) -> RwLockWriteGuard<'_, Shard> {
    cell.shard.write()
}

impl Inner {
    fn hash(&self, check: &Check<'_>) -> u64 {
        self.hasher
            .hash_one((check.rule.name_id(), check.key.as_bytes()))
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The low bits pick the bucket inside the table and the top 7 its tag: the shard takes
        // bits in between, so that even 65,536 shards leave the tags their entropy.
        (hash >> 32) as usize & (self.shards.len() - 1)
    }

    /// Pause `key` under `rule` for `pause` (at most about 49 days, as the Redis store keeps
    /// them; a zero pause lifts one), or, when `extend`, only if that ends later.
    fn pause(&self, rule: &Rule, key: &Key, pause: Duration, extend: bool) {
        let now = self.clock.now_us();
        let us = pause.as_micros().min(u128::from(u32::MAX) * 1000) as u64;
        let until = now.saturating_add(us);
        let mut pauses = self.pauses.lock();
        pauses.retain(|_, until| *until > now);
        let held = pauses
            .entry((rule.shared_name().clone(), key.clone()))
            .or_insert(until);
        *held = if extend { until.max(*held) } else { until };
    }

    fn apply(&self, op: Op, checks: &[Check<'_>]) -> Vec<Decision> {
        let now = self.clock.now_us();
        if let Some(decisions) = self.apply_listed(op, checks, now) {
            return decisions;
        }
        self.apply_unlisted(op, checks, now)
    }

    fn apply_unlisted(&self, op: Op, checks: &[Check<'_>], now: u64) -> Vec<Decision> {
        match checks {
            [] => Vec::new(),
            [check] => vec![self.apply_one(op, check, now)],
            _ => self.apply_many(op, checks, now),
        }
    }

    /// Drop the ended blocks from `listings` (held locked), and publish their count and when
    /// the last one left ends.
    fn settle_listings(&self, listings: &mut Listings, now: u64) {
        listings.sweep(now);
        self.publish(listings);
    }

    /// Publish `listings` after a change: swept once the map has doubled since the last sweep
    /// (a constant cost per change), else only their count and when decisions may stop looking.
    fn publish_listings(&self, listings: &mut Listings, now: u64) {
        if listings.map.len() >= (2 * listings.swept).max(64) {
            listings.sweep(now);
        }
        self.publish(listings);
    }

    fn publish(&self, listings: &Listings) {
        self.listings_end.store(listings.end(), Ordering::Relaxed);
        self.listed.store(listings.map.len(), Ordering::Release);
    }

    /// `key`'s entry in force at `now`.
    fn listed(&self, key: &Key, now: u64) -> Option<Listed> {
        if self.listed.load(Ordering::Acquire) == 0 {
            return None;
        }
        in_force(self.listings.read().map.get(key)?, now)
    }

    /// The most keys listed at once: the store's bound on keys. Past it, a penalty block is not
    /// written (an operator's entry always is).
    fn listings_capacity(&self) -> usize {
        self.shard_capacity.saturating_mul(self.shards.len()).max(1)
    }

    /// The decisions for `checks` when a key among them is listed; `None` when none is (the
    /// usual path, one atomic load). A refused key refuses the whole batch, taking nothing;
    /// allowed keys admit without counting, and the other checks are decided together.
    fn apply_listed(&self, op: Op, checks: &[Check<'_>], now: u64) -> Option<Vec<Decision>> {
        if self.listed.load(Ordering::Acquire) == 0 {
            return None;
        }
        if now >= self.listings_end.load(Ordering::Relaxed) {
            self.settle_listings(&mut self.listings.write(), now);
            if self.listed.load(Ordering::Acquire) == 0 {
                return None;
            }
        }
        let listed: smallvec::SmallVec<[Option<Listed>; 4]> = {
            let listings = self.listings.read();
            checks
                .iter()
                .map(|c| in_force(listings.map.get(c.key)?, now))
                .collect()
        };
        if listed.iter().all(Option::is_none) {
            return None;
        }
        // As the script does: the state as a request of cost 1 sees it.
        let peeked = |c: &Check<'_>| self.apply_one(Op::Peek, &Check { cost: 1, ..*c }, now);
        let known = checks
            .iter()
            .zip(listed)
            .map(|(c, l)| {
                Some(match l? {
                    Listed::Allow => Decision {
                        allowed: true,
                        retry_after: None,
                        listed: ByListing::ALLOW,
                        ..peeked(c)
                    },
                    Listed::Deny => Decision {
                        listed: ByListing::DENY,
                        ..refused(peeked(c), crate::store::DENY_RETRY_AFTER)
                    },
                    Listed::Until(t, _) => {
                        let left = Duration::from_micros(t.saturating_sub(now));
                        Decision {
                            listed: ByListing::block(left),
                            ..refused(peeked(c), left)
                        }
                    }
                })
            })
            .collect();
        let decide = |op, unlisted: &[Check<'_>]| self.apply_unlisted(op, unlisted, now);
        let decisions = crate::store::around_known(op, checks, known, decide, peeked);
        Some(decisions)
    }

    fn apply_one(&self, op: Op, check: &Check<'_>, now: u64) -> Decision {
        let hash = self.hash(check);
        let cell = &self.shards[self.shard_of(hash)];
        if op == Op::Consume && cell.refusing.load(Ordering::Relaxed) {
            if let Some(refusal) = cell.shard.read().refusal(check, hash, now) {
                return refusal;
            }
        }
        let mut shard = lock(cell);
        let now = shard.at(now);
        if op == Op::Consume {
            if let Some(entry) = shard.held(check, hash, now) {
                let decision = entry.consume(now, check.rule.quota(), check.cost);
                cell.note(!decision.allowed && entry.state.refuses_without_writing());
                return decision;
            }
        }
        // Only a consume may sweep: a peek writes nothing, evictions included.
        let may_sweep = op == Op::Consume;
        let (mut decision, place, undo) = shard.decide(op, check, hash, now, self, may_sweep);
        if op == Op::Consume && decision.allowed {
            decision.taken = Some(shard.commit(check, hash, now, place, &decision, self, true));
        } else {
            shard.restore(check, hash, undo);
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
        let mut guards: Vec<RwLockWriteGuard<'_, Shard>> =
            order.iter().map(|&i| lock(&self.shards[i])).collect();
        let now = guards.iter().fold(now, |now, shard| now.max(shard.latest));
        for shard in guards.iter_mut() {
            shard.latest = now;
        }
        // Make room once, before anything is decided: a sweep between deciding one check and
        // committing another could evict the state a decision was made on. Only for a consume:
        // a peek writes nothing, evictions included.
        for shard in guards.iter_mut() {
            let full = shard.table.len() >= self.shard_capacity && now >= shard.full_until;
            if op == Op::Consume && full {
                shard.sweep(now, self.shard_capacity);
            }
        }
        // A sweep that evicted moved its shard's time past `now` (see `Shard::sweep`): the
        // batch is decided after it too.
        let now = guards.iter().fold(now, |now, shard| now.max(shard.latest));
        for shard in guards.iter_mut() {
            shard.latest = now;
        }
        let slot = |hash: u64| {
            let shard = self.shard_of(hash);
            order.iter().position(|&i| i == shard).unwrap_or(0)
        };
        let mut decided: Vec<(Decision, Place, Option<State>)> = checks
            .iter()
            .zip(&hashes)
            .map(|(c, &h)| guards[slot(h)].decide(op, c, h, now, self, false))
            .collect();
        if op == Op::Consume {
            // Keys of one rule sharing a full shard's overflow state were each decided against
            // it alone: together they may take more than it holds. Each group's total is
            // decided once, and refused whole if it does not fit.
            let mut groups: Vec<(usize, u32, Vec<usize>)> = Vec::new();
            for (i, (c, &h)) in checks.iter().zip(&hashes).enumerate() {
                if decided[i].1 != Place::Overflow || !decided[i].0.allowed {
                    continue;
                }
                let (g, rule) = (slot(h), c.rule.name_id());
                match groups.iter_mut().find(|x| x.0 == g && x.1 == rule) {
                    Some(group) => group.2.push(i),
                    None => groups.push((g, rule, vec![i])),
                }
            }
            for (g, _, members) in groups.into_iter().filter(|x| x.2.len() > 1) {
                let first = &checks[members[0]];
                let quota = first.rule.quota();
                let mut shared = guards[g].overflow_state(first).1.clone();
                // One after another on a copy: the first that does not fit refuses the batch,
                // with its own wait (the total may never fit where each cost alone does).
                let refused = members.iter().find_map(|&i| {
                    let d = shared.decide(now, quota, checks[i].cost);
                    if d.allowed {
                        shared.commit(now, quota, checks[i].cost);
                        None
                    } else {
                        Some(d)
                    }
                });
                if let Some(mut refused) = refused {
                    // What the shared state holds: nothing was taken from it.
                    let alone = &decided[members[0]].0;
                    refused.remaining = alone.remaining.saturating_add(first.cost);
                    for i in members {
                        decided[i].0 = refused;
                    }
                }
            }
        }
        let commit = op == Op::Consume && decided.iter().all(|(d, _, _)| d.allowed);
        for ((c, &h), (d, place, undo)) in checks.iter().zip(&hashes).zip(decided.iter_mut()) {
            let shard = &mut guards[slot(h)];
            if commit {
                d.taken = Some(shard.commit(c, h, now, *place, d, self, false));
            } else {
                shard.restore(c, h, undo.take());
                if op == Op::Consume && d.allowed {
                    // Nothing is taken: report the permits as still there.
                    d.remaining += c.cost;
                }
            }
        }
        decided.into_iter().map(|(d, _, _)| d).collect()
    }
}

/// The share of its capacity a decision under `quota` says is used, in 1/65535ths.
fn used_share(d: &Decision, quota: &crate::Quota) -> u16 {
    let limit = d.limit.max(1);
    let used = d.limit.saturating_sub(d.remaining);
    match used.checked_mul(USED_SCALE) {
        // The quota's divisor, made once: a division on every decision costs tens of cycles.
        Some(scaled) if d.limit == quota.capacity() => (scaled / quota.capacity_divisor()) as u16,
        Some(scaled) => (scaled / limit) as u16,
        None => (u128::from(used) * u128::from(USED_SCALE) / u128::from(limit)) as u16,
    }
}

impl Shard {
    /// The time to decide at, under the shard's lock: `now`, or the latest time a decision here
    /// was made at if that is later. Two threads read the clock before taking the lock, so the
    /// later reading can be decided first; deciding the other one at an earlier time would judge
    /// it against a state already brought to the later time (a sliding window already rolled
    /// on), which can count less than is there.
    fn at(&mut self, now: u64) -> u64 {
        self.latest = self.latest.max(now);
        self.latest
    }

    fn find(&mut self, check: &Check<'_>, hash: u64) -> Option<&mut Entry> {
        self.table.find_mut(hash, |e| e.is_for(check))
    }

    /// Where the check's state is, evicting to make room for a new key if the shard is full
    /// (when `may_sweep`).
    fn locate(
        &mut self,
        check: &Check<'_>,
        hash: u64,
        now: u64,
        capacity: usize,
        may_sweep: bool,
    ) -> Place {
        if self.find(check, hash).is_some() {
            return Place::Found;
        }
        if may_sweep && self.table.len() >= capacity && now >= self.full_until {
            self.sweep(now, capacity);
        }
        if self.table.len() < capacity {
            Place::Fresh
        } else {
            Place::Overflow
        }
    }

    fn overflow_state(&mut self, check: &Check<'_>) -> &mut (Arc<str>, State, u64) {
        let quota = check.rule.quota();
        let name = check.rule.shared_name();
        let i = match self
            .overflow
            .iter()
            .position(|(r, state, _)| r == name && state.fits(quota))
        {
            Some(i) => i,
            None => {
                self.overflow.push((name.clone(), State::new(quota), 0));
                self.overflow.len() - 1
            }
        };
        &mut self.overflow[i]
    }

    /// The state a key gets when it is first held. While the rule's overflow state still counts
    /// permits, it starts from a copy of it: the key may have been counted there (sharing it
    /// while the shard was full), and starting afresh would give those permits again.
    /// Conservative for a key that never overflowed: it is limited with the overflow's keys
    /// until that state expires, as it would have been had it come a moment earlier.
    fn fresh(&self, check: &Check<'_>, now: u64) -> State {
        let quota = check.rule.quota();
        let name = check.rule.shared_name();
        self.overflow
            .iter()
            .find(|(r, state, expires_at)| r == name && *expires_at > now && state.fits(quota))
            .map_or_else(
                || State::new(quota),
                // A receipt from the key's own entry before it was evicted refunds nothing
                // against the copy, which never lent those permits.
                |(_, state, _)| state.clone().taken_over(now),
            )
    }

    /// Decide one check, and say where its state lives for the commit. `may_sweep`: a new key
    /// may make room by evicting (not in the middle of a batch).
    fn decide(
        &mut self,
        op: Op,
        check: &Check<'_>,
        hash: u64,
        now: u64,
        store: &Inner,
        may_sweep: bool,
    ) -> (Decision, Place, Option<State>) {
        let quota = check.rule.quota();
        let place = self.locate(check, hash, now, store.shard_capacity, may_sweep);
        let mut fresh = match place {
            Place::Fresh => self.fresh(check, now),
            // A peek writes nothing, the rule's shared overflow state included: it reads a
            // copy (a state the peek's quota fits, or a new one, never made for it).
            Place::Overflow if op != Op::Consume => self
                .overflow
                .iter()
                .find(|(r, state, _)| r == check.rule.shared_name() && state.fits(quota))
                .map_or_else(|| State::new(quota), |(_, state, _)| state.clone()),
            _ => State::new(quota),
        };
        let state = match place {
            Place::Found => match self.find(check, hash) {
                Some(entry) => &mut entry.state,
                None => &mut fresh,
            },
            Place::Fresh => &mut fresh,
            Place::Overflow => match store.overflow {
                Overflow::Shared if op == Op::Consume => &mut self.overflow_state(check).1,
                Overflow::Shared => &mut fresh,
                // A peek does not sweep, so it cannot know whether a consume's sweep would
                // make room: it reads the key as new, as a consume finding room would.
                Overflow::Refuse { .. } if op != Op::Consume => &mut fresh,
                Overflow::Refuse { retry_after } => {
                    let limit = quota.capacity();
                    let d = Decision::deny(limit, 0, retry_after, Some(retry_after));
                    return (d, place, None);
                }
            },
        };
        // Only a consume's conversion to another quota is kept when nothing is taken, as the
        // Redis script writes back only that; bringing a state up to date otherwise changes no
        // decision. A peek writes nothing: it may read the key under a quota that is not its own
        // (an inspection under the rule's quota, where the key's is decided per request), and
        // converted, an hour's count would move into a minute that ends. (A log's clean-up is
        // kept in both, and a log is never converted.)
        // A conversion that cuts a debt at the cap is decided on a copy, wherever the state
        // lives (a key's entry, the rule's shared overflow state): refused under this quota,
        // the state kept in its own scale (see `State::conversion_clamps`).
        if op == Op::Consume && state.conversion_clamps(now, quota) {
            let decision = state.clone().decide(now, quota, check.cost);
            if !decision.allowed {
                if place == Place::Found {
                    if let Some(entry) = self.find(check, hash) {
                        entry.refused(&decision, quota);
                    }
                }
                return (decision, place, None);
            }
        }
        let converts = op == Op::Consume && state.converts(now, quota);
        let undo = (place == Place::Found && !converts && !matches!(state, State::SlidingLog(_)))
            .then(|| state.clone());
        let mut decision = match state {
            // A log's peek forgets no entry either (its clean-up is a consume's).
            State::SlidingLog(log) if op != Op::Consume => log.read(now, quota, check.cost),
            _ => state.decide(now, quota, check.cost),
        };
        if place == Place::Found && converts {
            // The conversion may change the state's expiry and how much of it is used.
            let expires_at = state.expires_at(quota);
            if let Some(entry) = self.find(check, hash) {
                entry.expires_at = expires_at;
                entry.refused(&decision, quota);
            }
        } else if place == Place::Found && op == Op::Consume && !decision.allowed {
            if let Some(entry) = self.find(check, hash) {
                entry.refused(&decision, quota);
            }
        }
        if op != Op::Consume && decision.allowed {
            decision.remaining += check.cost;
        }
        (decision, place, undo)
    }

    /// The common case, found in one lookup: a consume of a key whose state is held under the
    /// same quota, which [`Entry::consume`] decides without allocating. `None`: take the long
    /// way ([`decide`](Shard::decide), then [`commit`](Shard::commit)).
    fn held(&mut self, check: &Check<'_>, hash: u64, now: u64) -> Option<&mut Entry> {
        let quota = check.rule.quota();
        let entry = self.find(check, hash)?;
        (!entry.state.converts(now, quota)).then_some(entry)
    }

    /// A consume's refusal decided without writing, under the shared lock: the key's state is
    /// held under the same quota, and [`State::refusal`] can decide its refusal without
    /// writing. Decided at the time [`consume`](Entry::consume) would decide at (the shard's
    /// latest, if later): the same refusal, and since nothing changes, nothing is recorded.
    /// `None`: decide under the exclusive lock.
    fn refusal(&self, check: &Check<'_>, hash: u64, now: u64) -> Option<Decision> {
        let quota = check.rule.quota();
        let now = now.max(self.latest);
        let entry = self.table.find(hash, |e| e.is_for(check))?;
        if entry.state.converts(now, quota) {
            return None;
        }
        let refusal = entry.state.refusal(now, quota, check.cost)?;
        entry.refused(&refusal, quota);
        Some(refusal)
    }

    /// Put back a state as it was before a decision that took nothing.
    fn restore(&mut self, check: &Check<'_>, hash: u64, before: Option<State>) {
        if let (Some(before), Some(entry)) = (before, self.find(check, hash)) {
            entry.state = before;
        }
    }

    /// Take the permits of an admitted check where [`decide`](Shard::decide) found its state.
    /// `may_sweep`: a new entry may sweep the shard first (not in the middle of a batch).
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        check: &Check<'_>,
        hash: u64,
        now: u64,
        place: Place,
        decision: &Decision,
        store: &Inner,
        may_sweep: bool,
    ) -> crate::Taken {
        let quota = check.rule.quota();
        let used = used_share(decision, quota);
        if place == Place::Overflow {
            let (_, state, expires_at) = self.overflow_state(check);
            let taken = state.commit(now, quota, check.cost);
            *expires_at = state.expires_at(quota);
            return taken;
        }
        if let Some(entry) = self.find(check, hash) {
            let taken = entry.state.commit(now, quota, check.cost);
            entry.expires_at = entry.state.expires_at(quota);
            *entry.used.get_mut() = used;
            return taken;
        }
        if may_sweep && self.table.len() >= self.next_sweep {
            self.sweep(now, store.shard_capacity);
        }
        let mut state = self.fresh(check, now);
        state.decide(now, quota, check.cost);
        let taken = state.commit(now, quota, check.cost);
        let expires_at = state.expires_at(quota);
        self.insert(hash, check, state, expires_at, used);
        taken
    }

    /// Run `f` on the check's state, creating the entry if needed (a lease), then store its new
    /// expiry and share used.
    fn with_entry<T>(
        &mut self,
        check: &Check<'_>,
        hash: u64,
        now: u64,
        capacity: usize,
        f: impl FnOnce(&mut State) -> T,
    ) -> Option<T> {
        let quota = check.rule.quota();
        match self.locate(check, hash, now, capacity, true) {
            Place::Overflow => return None,
            Place::Fresh => {
                let state = self.fresh(check, now);
                self.insert(hash, check, state, 0, 0)
            }
            Place::Found => {}
        }
        let entry = self.find(check, hash)?;
        let out = f(&mut entry.state);
        entry.expires_at = entry.state.expires_at(quota);
        *entry.used.get_mut() = used_share(&peek(&mut entry.state, now, quota), quota);
        Some(out)
    }

    fn insert(&mut self, hash: u64, check: &Check<'_>, state: State, expires_at: u64, used: u16) {
        let hasher = &self.hasher;
        self.table.insert_unique(
            hash,
            Entry {
                rule: check.rule.name_id(),
                key: check.key.clone(),
                state,
                expires_at,
                used: AtomicU16::new(used),
            },
            |e| hasher.hash_one((e.rule, e.key.as_bytes())),
        );
    }

    /// Drop expired state; if the shard was full and is still 7/8 full or more, evict the
    /// entries that have used the least of their quota (never more than half) until it is
    /// under 7/8 full. The next sweep waits
    /// until the shard has doubled (or is full), so the cost per insert stays constant.
    fn sweep(&mut self, now: u64, capacity: usize) {
        let was_full = self.table.len() >= capacity;
        self.table.retain(|e| e.expires_at > now);
        // A shard that was full and is still at 7/8 or over once the expired are gone: evict
        // down to below 7/8, at least one entry (expiry alone freeing a few left the shard to
        // fill again at once, and then to refuse new keys). A sweep as the shard grows evicts
        // nothing: live state is evicted only for room.
        let keep = capacity - capacity / 8;
        if was_full && self.table.len() >= keep {
            let wanted = self.table.len() + 1 - keep.max(1);
            // A state holding a longer window's count is kept as if used up.
            let used = |e: &Entry| {
                if e.state.holds_a_longer_window() {
                    u16::MAX
                } else {
                    e.used.load(Ordering::Relaxed)
                }
            };
            let mut evictable: Vec<u16> = self
                .table
                .iter()
                .map(used)
                .filter(|&u| u <= EVICTABLE)
                .collect();
            let drop = wanted.min(evictable.len());
            if drop > 0 {
                let (_, &mut threshold, _) = evictable.select_nth_unstable(drop - 1);
                // Every entry below the threshold goes, and as many at it as make up `drop`.
                let below = evictable.iter().filter(|&&u| u < threshold).count();
                let mut at_threshold = drop - below;
                self.table.retain(|e| {
                    let used = used(e);
                    if used < threshold {
                        false
                    } else if used == threshold && at_threshold > 0 {
                        at_threshold -= 1;
                        false
                    } else {
                        true
                    }
                });
                // An evicted key's next state starts after every receipt its old one gave,
                // those of this very microsecond included (see `reset`).
                self.latest = self.latest.max(now) + 1;
            }
        }
        self.overflow.retain(|(_, _, expires_at)| *expires_at > now);
        self.next_sweep = (self.table.len() * 2).clamp(FIRST_SWEEP.min(capacity), capacity);
        // A sweep that left the shard over 7/8 full freed too little to pay for itself: the
        // next, once it is full again, waits until an eighth of the entries have expired (or
        // a second, for evictions). Waiting only for the first expiry swept the whole shard
        // per insert when entries expired one by one.
        let eighth = capacity / 8;
        self.full_until = if was_full && self.table.len() >= keep {
            let mut expiries: Vec<u64> = self.table.iter().map(|e| e.expires_at).collect();
            let nth = eighth.clamp(1, expiries.len()) - 1;
            let (_, &mut then, _) = expiries.select_nth_unstable(nth);
            then.min(now.saturating_add(FULL_RETRY))
        } else {
            0
        };
    }
}

/// A state as it was before a decision, to put back if nothing is taken.
enum Undo {
    State(State),
    /// Nothing to put back: a log keeps its clean-up (as the script does), and a sliding window
    /// keeps its roll to the current sub-window. Rolling only brings the state up to date: every
    /// later decision in the shard is made at this time or after ([`Shard::at`]), and would
    /// roll it the same way, so keeping it changes no decision (the script, which runs on one
    /// clock, writes nothing back instead). Putting it back made every refusal roll it again.
    Nothing,
}

impl Undo {
    fn of(state: &State) -> Undo {
        match state {
            // Unless it converts (ruled out by the caller), GCRA writes at most the interval of
            // a state with nothing ahead, which changes no later decision.
            State::SlidingLog(_) | State::SlidingWindow(_) | State::Gcra(_) => Undo::Nothing,
            other => Undo::State(other.clone()),
        }
    }

    fn restore(self, state: &mut State) {
        if let Undo::State(before) = self {
            *state = before;
        }
    }
}

impl MemoryStore {
    /// [`Store::lease`], synchronously.
    pub fn lease_now(&self, check: Check<'_>, max_validity: Duration) -> Result<Lease, StoreError> {
        let inner = &self.inner;
        let now = inner.clock.now_us();
        let quota = check.rule.quota();
        if let Some(state) = inner.apply_listed(Op::Peek, std::slice::from_ref(&check), now) {
            // A listed key is decided request by request.
            return Ok(Lease {
                permits: 0,
                valid_until_us: now,
                valid_for: Duration::ZERO,
                state: state
                    .into_iter()
                    .next()
                    .unwrap_or_else(|| Decision::admit(0, 0, Duration::ZERO)),
                taken: crate::Taken {
                    at: now,
                    cost: 0,
                    algorithm: quota.algorithm(),
                },
                listed: true,
            });
        }
        if !State::leasable(quota) {
            return Err(StoreError::Script(format!(
                "{} cannot be leased",
                quota.algorithm()
            )));
        }
        let hash = inner.hash(&check);
        let mut shard = lock(&inner.shards[inner.shard_of(hash)]);
        let now = shard.at(now);
        let max_validity_us = max_validity.as_micros().min(u128::from(u64::MAX / 4)) as u64;
        if let Some(entry) = shard.find(&check, hash) {
            if entry.state.conversion_clamps(now, quota) {
                // A debt cut at the conversion's cap: refused under this quota, nothing to
                // lease, and the state kept in its own scale (as a consume keeps it).
                return Ok(Lease {
                    permits: 0,
                    valid_until_us: now,
                    valid_for: Duration::ZERO,
                    state: peek(&mut entry.state.clone(), now, quota),
                    taken: crate::Taken {
                        at: now,
                        cost: 0,
                        algorithm: quota.algorithm(),
                    },
                    listed: false,
                });
            }
        }
        let granted = shard.with_entry(&check, hash, now, inner.shard_capacity, |state| {
            let granted = state.lease(now, quota, check.cost, max_validity_us);
            (granted, peek(state, now, quota))
        });
        let (granted, state) = match granted {
            Some((Some(granted), state)) => (granted, state),
            Some((None, _)) => return Err(StoreError::Script("cannot be leased".into())),
            // No room for the key: lease nothing, so requests go to the store one by one.
            None => {
                let (d, _, _) = shard.decide(Op::Peek, &check, hash, now, inner, false);
                return Ok(Lease {
                    permits: 0,
                    valid_until_us: now,
                    valid_for: Duration::ZERO,
                    state: d,
                    taken: crate::Taken {
                        at: now,
                        cost: 0,
                        algorithm: quota.algorithm(),
                    },
                    listed: false,
                });
            }
        };
        Ok(Lease {
            permits: granted.permits,
            valid_until_us: granted.valid_until,
            valid_for: Duration::from_micros(granted.valid_until.saturating_sub(now)),
            state,
            taken: granted.taken,
            listed: false,
        })
    }
}

impl MemoryStore {
    /// [`Store::slots`], synchronously.
    #[doc(hidden)]
    pub fn slots_now(
        &self,
        op: SlotOp,
        name: &str,
        key: &Key,
        slot: u64,
        limit: u64,
        ttl: Duration,
    ) -> (bool, u64) {
        let now = self.inner.clock.now_us();
        let expiry = now.saturating_add(crate::algorithm::micros(ttl));
        let mut all = self.inner.slots.lock();
        let id = (Arc::<str>::from(name), key.clone());
        let held = all.entry(id.clone()).or_default();
        held.retain(|(_, until)| *until > now);
        let done = match op {
            SlotOp::Acquire if (held.len() as u64) < limit => {
                held.push((slot, expiry));
                true
            }
            SlotOp::Acquire => false,
            // A slot lost (expired before its renewal) is held again, as the script does.
            SlotOp::Renew => match held.iter_mut().find(|(s, _)| *s == slot) {
                Some(entry) => {
                    entry.1 = expiry;
                    true
                }
                None => {
                    held.push((slot, expiry));
                    false
                }
            },
            SlotOp::Release => {
                let before = held.len();
                held.retain(|(s, _)| *s != slot);
                held.len() < before
            }
        };
        let count = held.len() as u64;
        if held.is_empty() {
            all.remove(&id);
        }
        (done, count)
    }
}

/// What a request of cost 1 would get now, without taking anything.
fn peek(state: &mut State, now: u64, quota: &crate::Quota) -> Decision {
    let mut d = match state {
        State::SlidingLog(log) => log.read(now, quota, 1),
        _ => state.decide(now, quota, 1),
    };
    if d.allowed {
        d.remaining += 1;
    }
    d
}

impl Store for MemoryStore {
    fn apply_in_process(&self, op: Op, checks: &[Check<'_>]) -> Option<Vec<Decision>> {
        Some(self.inner.apply(op, checks))
    }

    fn check_in_process(&self, op: Op, check: &Check<'_>) -> Option<Decision> {
        Some(self.check(op, check))
    }

    fn slots_in_process(
        &self,
        op: SlotOp,
        name: &str,
        key: &Key,
        slot: u64,
        limit: u64,
        ttl: Duration,
    ) -> Option<(bool, u64)> {
        Some(self.slots_now(op, name, key, slot, limit, ttl))
    }

    fn lease<'a>(
        &'a self,
        check: Check<'a>,
        max_validity: Duration,
    ) -> BoxFuture<'a, Result<Lease, StoreError>> {
        Box::pin(std::future::ready(self.lease_now(check, max_validity)))
    }

    fn refund<'a>(
        &'a self,
        refunds: &'a [Refund<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        Box::pin(std::future::ready(Ok(self.refund_now(refunds))))
    }

    fn apply<'a>(
        &'a self,
        op: Op,
        checks: &'a [Check<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        let decisions = self.inner.apply(op, checks);
        Box::pin(std::future::ready(Ok(decisions)))
    }

    fn pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.pause(rule, key, pause, false);
        Box::pin(std::future::ready(Ok(())))
    }

    fn extend_pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.pause(rule, key, pause, true);
        Box::pin(std::future::ready(Ok(())))
    }

    fn set_listing<'a>(
        &'a self,
        key: &'a Key,
        listing: Option<Listing>,
    ) -> BoxFuture<'a, Result<Option<Listing>, StoreError>> {
        let now = self.inner.clock.now_us();
        let mut listings = self.inner.listings.write();
        let current = listings.map.get(key).copied();
        match (listing, current) {
            (None, _) => listings.take(key),
            // The deny stands; a block of zero ends a block, nothing else.
            (Some(Listing::Block(_)), Some(Listed::Deny)) => {}
            (Some(Listing::Block(d)), current) if d.as_micros() == 0 => {
                if !matches!(current, Some(Listed::Allow)) {
                    listings.take(key);
                }
            }
            (Some(l), _) => {
                let held = match l {
                    Listing::Allow => Listed::Allow,
                    Listing::Deny => Listed::Deny,
                    Listing::Block(d) => Listed::Until(block_end(now, d), false),
                };
                listings.put(key, held);
            }
        }
        self.inner.publish_listings(&mut listings, now);
        let in_force = listings.map.get(key).and_then(|l| listing_at(l, now));
        Box::pin(std::future::ready(Ok(in_force)))
    }

    fn block_unless_listed<'a>(
        &'a self,
        key: &'a Key,
        block: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let now = self.inner.clock.now_us();
        let until = block_end(now, block);
        let mut listings = self.inner.listings.write();
        let stands = match listings.map.get(key) {
            Some(Listed::Allow | Listed::Deny) => true,
            Some(Listed::Until(t, _)) => *t > now && *t >= until,
            None => {
                // A full map (a spray of refused keys must not grow it past the store's bound)
                // drops its ended blocks, then the penalty blocks that end soonest. Only a map
                // full of operators' entries takes no new block (answered as when an entry
                // stands), and is tried again a second later.
                let capacity = self.inner.listings_capacity();
                if listings.map.len() >= capacity && now >= listings.full_until {
                    listings.sweep(now);
                    if listings.map.len() >= capacity {
                        listings.evict_penalty_blocks(capacity);
                    }
                    if listings.map.len() >= capacity {
                        listings.full_until = now.saturating_add(FULL_RETRY);
                    }
                }
                listings.map.len() >= capacity
            }
        };
        if !stands {
            // Extending an operator's block still in force keeps it the operator's: it never
            // makes room for others.
            let by_box =
                !matches!(listings.map.get(key), Some(Listed::Until(t, false)) if *t > now);
            listings.put(key, Listed::Until(until, by_box));
        }
        self.inner.publish_listings(&mut listings, now);
        Box::pin(std::future::ready(Ok(!stands)))
    }

    fn listing<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Listing>, StoreError>> {
        let now = self.inner.clock.now_us();
        let listing = self
            .inner
            .listed(key, now)
            .and_then(|l| listing_at(&l, now));
        Box::pin(std::future::ready(Ok(listing)))
    }

    fn slots<'a>(
        &'a self,
        op: SlotOp,
        name: &'a str,
        key: &'a Key,
        slot: u64,
        limit: u64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(bool, u64), StoreError>> {
        Box::pin(std::future::ready(Ok(
            self.slots_now(op, name, key, slot, limit, ttl)
        )))
    }

    fn reset<'a>(&'a self, rule: &'a Rule, key: &'a Key) -> BoxFuture<'a, Result<(), StoreError>> {
        let check = Check { rule, key, cost: 1 };
        let inner = &self.inner;
        let hash = inner.hash(&check);
        let mut shard = lock(&inner.shards[inner.shard_of(hash)]);
        let now = shard.at(inner.clock.now_us());
        let quota = rule.quota();
        // While the rule's shared overflow state counts, a key's new entry starts from a copy
        // of it (the key may have shared it): a reset key is started afresh in place instead,
        // for a period, as Redis starts it (its older receipts refund nothing into it).
        let overflowing = shard.overflow.iter().any(|(name, state, expires_at)| {
            name == rule.shared_name() && *expires_at > now && state.fits(quota)
        });
        // Decisions from here on are made after `now`: a receipt taken in this very microsecond
        // (the memory store makes many in one) is older than the fresh state, and refunds
        // nothing into it.
        let after = now + 1;
        shard.latest = after;
        if let Ok(mut entry) = shard.table.find_entry(hash, |e| e.is_for(&check)) {
            if overflowing {
                let e = entry.get_mut();
                e.state = State::new(quota).taken_over(after);
                e.expires_at = now.saturating_add(quota.period_us());
                e.used.store(0, Ordering::Relaxed);
            } else {
                entry.remove();
            }
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn paused_for<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
    ) -> BoxFuture<'a, Result<Option<Duration>, StoreError>> {
        let now = self.inner.clock.now_us();
        let pauses = self.inner.pauses.lock();
        let left = pauses
            .get(&(rule.shared_name().clone(), key.clone()))
            .filter(|until| **until > now)
            .map(|until| Duration::from_micros(until - now));
        Box::pin(std::future::ready(Ok(left)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Key, ManualClock, Quota, Rule};
    use std::time::Duration;

    /// One shard of `keys` entries on `clock`; `refuse`: new keys past it are refused (no
    /// shared overflow state to hide what the shard holds).
    fn one_shard(clock: &ManualClock, keys: usize, refuse: bool) -> MemoryStore {
        let builder = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .max_keys(keys);
        let builder = if refuse {
            builder.overflow(Overflow::Refuse {
                retry_after: Duration::from_secs(1),
            })
        } else {
            builder
        };
        builder.build().unwrap()
    }

    /// Rule "hourly": a fixed window of 100 an hour.
    fn hourly() -> Rule {
        let quota = Quota::per_hour(100)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap();
        Rule::new("hourly", quota).unwrap()
    }

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
    fn a_shard_does_not_share_a_cache_line_with_its_lock_word() {
        let s = MemoryStore::new();
        for cell in s.inner.shards.iter() {
            let lock = &cell.shard as *const RwLock<Shard> as usize;
            let data = &*cell.shard.read() as *const Shard as usize;
            assert_eq!(data % 64, 0, "the shard starts a line");
            assert!(
                data >= lock + 64,
                "the lock word's line holds no shard data"
            );
        }
    }

    /// Two requests read the clock before taking the shard's lock; the later reading may be
    /// decided first. The earlier one is then decided at the later time, against the state that
    /// decision left, never against a state brought forward and read backwards.
    #[test]
    fn a_decision_never_goes_back_in_time() {
        const T0: u64 = 1_900_000_000_000_000; // whole seconds
        let clock = ManualClock::new(T0);
        let s = store(&clock, 100);
        let window = rule("w", Algorithm::SlidingWindow, 10);
        let key = Key::new("k");
        let check = |cost| Check {
            rule: &window,
            key: &key,
            cost,
        };
        // 5 in the last sub-window of the first second.
        clock.set(T0 + 980_000);
        assert!(s.check(Op::Consume, &check(5)).allowed);
        // A request decided 10 ms into the next second rolls the window on.
        clock.set(T0 + 1_010_000);
        assert!(s.check(Op::Consume, &check(1)).allowed);
        let now = s.check(Op::Peek, &check(1));
        // One that read the clock 15 ms earlier, decided after it, sees the same state.
        clock.set(T0 + 995_000);
        let late = s.check(Op::Peek, &check(1));
        assert_eq!(late.remaining, now.remaining);
        assert_eq!(late.reset_after, now.reset_after);
    }

    /// A refusal decided under the shared lock (the shard's last consume was refused) is the
    /// refusal the exclusive path gives at the same time, and leaves the state as that path
    /// does: every algorithm, costs 1–3 on a limit of 3, and clock readings that sometimes come
    /// before the latest decision's. The shared path answers a refusal that writes nothing:
    /// GCRA's, the fixed window's and the token bucket's (decided on a copy), and a sliding
    /// window's once it is rolled to the current sub-window. Such a refusal records no time
    /// (the state did not move), so only the exclusive path's decisions hold a late reading
    /// back.
    #[test]
    fn refusals_under_the_shared_lock_match_the_exclusive_path() {
        const T0: u64 = 1_900_000_000_000_000;
        for algorithm in Algorithm::ALL {
            let clock = ManualClock::new(T0);
            let s = store(&clock, 100);
            let r = rule("r", algorithm, 3);
            let key = Key::new("k");
            let quota = r.quota();
            // The exclusive path, on an entry of our own.
            let mut reference = Entry {
                rule: r.name_id(),
                key: key.clone(),
                state: State::new(quota),
                expires_at: 0,
                used: AtomicU16::new(0),
            };
            let (mut t, mut latest) = (T0, T0);
            let (mut refused_before, mut shared) = (false, 0);
            for step in 0..400u64 {
                t += step * 7_919 % 150_000;
                // Every fifth request read the clock 2 ms before the latest decision's time.
                let read = if step % 5 == 4 { latest - 2_000 } else { t };
                clock.set(read);
                let cost = 1 + step % 3;
                let got = s.check(
                    Op::Consume,
                    &Check {
                        rule: &r,
                        key: &key,
                        cost,
                    },
                );
                let at = read.max(latest);
                let mut decided = reference.state.clone();
                let candidate = decided.decide(at, quota, cost);
                let writes_nothing = match algorithm {
                    Algorithm::SlidingLog => false,
                    // Only its roll would be written: the shared path answers once it is rolled.
                    Algorithm::SlidingWindow => decided == reference.state,
                    _ => true,
                };
                let want = if refused_before && writes_nothing && !candidate.allowed {
                    shared += 1;
                    candidate
                } else {
                    latest = at;
                    reference.consume(at, quota, cost)
                };
                assert_eq!(got, want, "{algorithm:?}, step {step}");
                refused_before = !got.allowed;
            }
            assert_eq!(
                shared > 20,
                algorithm != Algorithm::SlidingLog,
                "{algorithm:?}: {shared} shared-lock refusals"
            );
        }
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

    fn one<'a>(r: &'a Rule, k: &'a Key, cost: u64) -> [Check<'a>; 1] {
        [Check {
            rule: r,
            key: k,
            cost,
        }]
    }

    #[test]
    fn peek_and_refund_through_the_receipt() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let r = rule("r", Algorithm::TokenBucket, 5);
        let k = Key::new("k");
        assert_eq!(s.apply_now(Op::Peek, &one(&r, &k, 1))[0].remaining, 5);
        assert!(s.is_empty(), "a peek creates no state");
        let d = s.apply_now(Op::Consume, &one(&r, &k, 3))[0];
        assert_eq!(d.remaining, 2);
        assert_eq!(s.apply_now(Op::Peek, &one(&r, &k, 1))[0].remaining, 2);
        let taken = d.taken.unwrap();
        assert_eq!(taken.cost(), 3);
        let refund = |cost| {
            s.refund_now(&[Refund {
                rule: &r,
                key: &k,
                taken: taken.part(cost),
            }])[0]
        };
        assert_eq!(refund(2).remaining, 4);
        assert_eq!(refund(9).remaining, 5, "capped at the burst");
        let denied = s.apply_now(Op::Consume, &one(&r, &k, 6))[0];
        assert_eq!(denied.taken, None, "a denial takes nothing");
    }

    #[test]
    fn a_rule_reconfigured_with_a_smaller_bucket_never_panics() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let bucket = |burst| {
            Rule::new(
                "r",
                Quota::per_second(10)
                    .algorithm(Algorithm::TokenBucket)
                    .burst(burst)
                    .build()
                    .unwrap(),
            )
            .unwrap()
        };
        let (big, small) = (bucket(10), bucket(2));
        let k = Key::new("k");
        let taken = s.apply_now(Op::Consume, &one(&big, &k, 1))[0]
            .taken
            .unwrap();
        let d = s.apply_now(Op::Consume, &one(&small, &k, 1))[0];
        assert!(d.allowed);
        assert_eq!(d.remaining, 0, "one token missing of two, one taken");
        // The smaller bucket read what the larger one missed (one token of its two), and a
        // receipt gives back no more than it took, whatever part is asked for.
        let d = s.refund_now(&[Refund {
            rule: &small,
            key: &k,
            taken: taken.part(u64::MAX),
        }]);
        assert_eq!(d[0].remaining, 1);
        let gcra = Rule::new(
            "g",
            Quota::per_day(1)
                .algorithm(Algorithm::Gcra)
                .build()
                .unwrap(),
        )
        .unwrap();
        let taken = s.apply_now(Op::Consume, &one(&gcra, &k, 1))[0]
            .taken
            .unwrap();
        let d = s.refund_now(&[Refund {
            rule: &gcra,
            key: &k,
            taken: taken.part(1 << 40),
        }]);
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

    /// The soundness issue's eviction scenario, for every algorithm: exhausted keys survive a
    /// spray of fresh keys that fills the store many times over.
    #[test]
    fn a_key_spray_never_resets_an_exhausted_key() {
        for algorithm in Algorithm::ALL {
            let clock = ManualClock::default();
            let s = store(&clock, 64);
            let r = Rule::new(
                "r",
                Quota::per_hour(3).algorithm(algorithm).build().unwrap(),
            )
            .unwrap();
            let victims: Vec<Key> = (0..20).map(|i| Key::new(format!("victim-{i}"))).collect();
            for v in &victims {
                for _ in 0..3 {
                    assert!(s.apply_now(Op::Consume, &one(&r, v, 1))[0].allowed);
                }
                assert!(!s.apply_now(Op::Consume, &one(&r, v, 1))[0].allowed);
            }
            for i in 0..5_000u32 {
                s.apply_now(Op::Consume, &one(&r, &Key::new(i.to_be_bytes()), 1));
                clock.advance(Duration::from_millis(1));
            }
            assert!(s.len() <= 64, "{algorithm}: bounded at {}", s.len());
            for v in &victims {
                assert!(
                    !s.apply_now(Op::Consume, &one(&r, v, 1))[0].allowed,
                    "{algorithm}: an exhausted key was given its permits back"
                );
            }
        }
    }

    proptest::proptest! {
        /// Eviction's promise, over random quotas and sprays: a key refused until T is refused
        /// until T however many fresh keys pass meanwhile, and the store stays bounded.
        #[test]
        fn a_refused_key_stays_refused_through_any_spray(
            algorithm in proptest::sample::select(Algorithm::ALL.to_vec()),
            limit in 1u64..8,
            max_keys in 16usize..200,
            spray in 1usize..3_000,
            step_us in 0u64..2_000,
        ) {
            let clock = ManualClock::new(1_735_689_600_000_000);
            let s = store(&clock, max_keys);
            let r = Rule::new("r", Quota::per_minute(limit).algorithm(algorithm).build().unwrap())
                .unwrap();
            let victim = Key::new("victim");
            while s.apply_now(Op::Consume, &one(&r, &victim, 1))[0].allowed {}
            let denied = s.apply_now(Op::Consume, &one(&r, &victim, 1))[0];
            let until = clock.now_us() + denied.retry_after.unwrap().as_micros() as u64;
            for i in 0..spray {
                s.apply_now(Op::Consume, &one(&r, &Key::new(format!("spray-{i}")), 1));
                if clock.now_us() + step_us < until {
                    clock.advance(Duration::from_micros(step_us));
                }
            }
            proptest::prop_assert!(s.len() <= max_keys);
            let d = s.apply_now(Op::Consume, &one(&r, &victim, 1))[0];
            proptest::prop_assert!(!d.allowed, "reset by the spray: {:?}", d);
        }
    }

    /// Room freed in the shard does not give back what a key took while it shared the
    /// overflow state: it starts from that state, and is refused until its permits slide out.
    #[test]
    fn a_key_leaving_the_overflow_keeps_what_it_took_there() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 64);
        let r = Rule::new(
            "r",
            Quota::per_minute(2)
                .algorithm(Algorithm::SlidingLog)
                .build()
                .unwrap(),
        )
        .unwrap();
        for i in 0..64u32 {
            s.apply_now(Op::Consume, &one(&r, &Key::new(i.to_be_bytes()), 2));
        }
        clock.advance(Duration::from_secs(30));
        let late = Key::new("late");
        assert!(s.apply_now(Op::Consume, &one(&r, &late, 2))[0].allowed);
        assert!(!s.apply_now(Op::Consume, &one(&r, &late, 1))[0].allowed);
        // The first 64 entries expire: room, and `late` gets an entry of its own.
        clock.advance(Duration::from_secs(31));
        let d = s.apply_now(Op::Consume, &one(&r, &late, 1))[0];
        assert!(!d.allowed, "2 already taken in the trailing minute: {d:?}");
        assert!(s.len() < 64);
        // Once those slide out, it is admitted again.
        clock.advance(Duration::from_secs(30));
        assert!(s.apply_now(Op::Consume, &one(&r, &late, 2))[0].allowed);
    }

    #[test]
    fn when_every_entry_is_restrictive_new_keys_share_an_overflow_state() {
        let clock = ManualClock::default();
        let s = store(&clock, 64);
        let r = rule("r", Algorithm::FixedWindow, 2);
        for i in 0..64u32 {
            let k = Key::new(i.to_be_bytes());
            s.apply_now(Op::Consume, &one(&r, &k, 2));
        }
        // Every entry is exhausted: nothing can be evicted, so new keys share one state.
        let (a, b) = (Key::new("new-a"), Key::new("new-b"));
        assert!(s.apply_now(Op::Consume, &one(&r, &a, 1))[0].allowed);
        assert!(s.apply_now(Op::Consume, &one(&r, &b, 1))[0].allowed);
        assert!(!s.apply_now(Op::Consume, &one(&r, &a, 1))[0].allowed);
        assert_eq!(s.len(), 64);
        // Once entries expire, new keys get their own state again.
        clock.advance(Duration::from_secs(1));
        assert!(s.apply_now(Op::Consume, &one(&r, &a, 2))[0].allowed);
        assert!(s.apply_now(Op::Consume, &one(&r, &b, 2))[0].allowed);

        let refusing = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(16)
            .shards(1)
            .overflow(Overflow::Refuse {
                retry_after: Duration::from_secs(5),
            })
            .build()
            .unwrap();
        spray(&refusing, &r, 2);
        let d = refusing.apply_now(Op::Consume, &one(&r, &a, 1))[0];
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(Duration::from_secs(5)));
    }

    /// A receipt from an evicted entry never reaches the entry the key gets afterwards.
    /// Two new keys of one rule in one batch, in a full shard of restrictive entries: both
    /// share its overflow state, which holds one permit. Each alone fits; together they do not,
    /// and the batch is refused whole (on Redis each key has its own state).
    #[test]
    fn keys_sharing_the_overflow_in_one_batch_are_decided_together() {
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .max_keys(1)
            .build()
            .unwrap();
        let r = rule("r", Algorithm::FixedWindow, 1);
        let held = Key::new("held");
        assert!(s.check(Op::Consume, &one(&r, &held, 1)[0]).allowed);
        let (a, b) = (Key::new("a"), Key::new("b"));
        let batch = [one(&r, &a, 1)[0], one(&r, &b, 1)[0]];
        let decisions = s.apply_now(Op::Consume, &batch);
        assert!(decisions.iter().all(|d| !d.allowed), "{decisions:?}");
        assert!(
            decisions
                .iter()
                .all(|d| d.retry_after.is_some() && d.remaining == 1),
            "each fits alone: a wait, not never, and the permit still there: {decisions:?}"
        );
        // Alone, one of them fits.
        assert!(s.check(Op::Consume, &batch[0]).allowed);
    }

    /// A full shard where a few entries expired and the rest are barely used: the sweep evicts
    /// down to 7/8 as well, and the next new keys get entries of their own (a sweep that let
    /// expiry alone free a few left the shard to fill at once and refuse new keys for a
    /// second).
    #[test]
    fn a_sweep_that_expires_a_few_still_evicts_the_barely_used() {
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = one_shard(&clock, 64, true);
        let hourly = hourly();
        let brief = rule("brief", Algorithm::Gcra, 10);
        for i in 0..60u32 {
            assert!(
                s.check(Op::Consume, &one(&hourly, &Key::new(i.to_be_bytes()), 1)[0])
                    .allowed
            );
        }
        for i in 0..4u32 {
            let k = Key::new(format!("brief{i}"));
            assert!(s.check(Op::Consume, &one(&brief, &k, 1)[0]).allowed);
        }
        clock.advance(Duration::from_secs(1));
        for i in 0..9u32 {
            let k = Key::new(format!("new{i}"));
            assert!(
                s.check(Op::Consume, &one(&hourly, &k, 1)[0]).allowed,
                "new key {i} refused"
            );
        }
    }

    /// A shard too small to have an eighth to spare (7 entries) still evicts one entry for a
    /// new key; and a sweep as a shard grows evicts nothing, however full it is: live state
    /// goes only for room (both broke when eviction ran at 7/8 on every sweep).
    #[test]
    fn eviction_is_for_room_only_in_small_shards_and_large() {
        let clock = ManualClock::new(1_900_000_000_000_000);
        let hourly = hourly();
        let small = one_shard(&clock, 7, true);
        for i in 0..8u32 {
            let k = Key::new(i.to_be_bytes());
            assert!(
                small.check(Op::Consume, &one(&hourly, &k, 1)[0]).allowed,
                "key {i}"
            );
        }

        let s = one_shard(&clock, 256, false);
        let brief = rule("brief", Algorithm::Gcra, 10);
        for i in 0..136u32 {
            let k = Key::new(format!("brief{i}"));
            assert!(s.check(Op::Consume, &one(&brief, &k, 1)[0]).allowed);
        }
        for i in 0..120u32 {
            assert!(
                s.check(Op::Consume, &one(&hourly, &Key::new(i.to_be_bytes()), 1)[0])
                    .allowed
            );
        }
        clock.advance(Duration::from_secs(1));
        // Full: the expired go, nothing else; the shard grows again to its next sweep.
        for i in 0..125u32 {
            let k = Key::new(format!("more{i}"));
            assert!(s.check(Op::Consume, &one(&hourly, &k, 1)[0]).allowed);
        }
        for i in 0..120u32 {
            let d = s.check(Op::Peek, &one(&hourly, &Key::new(i.to_be_bytes()), 1)[0]);
            assert_eq!(d.remaining, 99, "key {i} was evicted with room to spare");
        }
    }

    /// A full shard whose entries expire one by one (GCRA keys that came a millisecond apart)
    /// is not swept for every new key, each sweep freeing one entry: the next sweep waits until
    /// an eighth of them have expired.
    #[test]
    fn a_shard_expiring_one_by_one_is_not_swept_per_insert() {
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = one_shard(&clock, 1024, true);
        let quota = Quota::per_minute(2)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        let r = Rule::new("r", quota).unwrap();
        let ms = Duration::from_millis(1);
        for i in 0..1024u32 {
            assert!(
                s.check(Op::Consume, &one(&r, &Key::new(i.to_be_bytes()), 2)[0])
                    .allowed
            );
            clock.advance(ms);
        }
        // The first key's state has just expired: a new key sweeps, and gets its entry.
        clock.advance(Duration::from_secs(60) - 1024 * ms);
        assert!(
            s.check(Op::Consume, &one(&r, &Key::new("first"), 1)[0])
                .allowed
        );
        let full_until = s.inner.shards[0].shard.read().full_until;
        assert!(
            full_until >= clock.now_us() + 100_000,
            "an eighth expires 127 ms on"
        );
        for i in 0..50u32 {
            clock.advance(ms);
            s.check(Op::Consume, &one(&r, &Key::new(format!("new{i}")), 1)[0]);
            assert_eq!(
                s.inner.shards[0].shard.read().full_until,
                full_until,
                "swept at {i}"
            );
        }
    }

    /// A full shard whose sweep frees nothing (every entry restrictive) is not swept again for
    /// each new key, only once an entry can expire (or a second later): a key spray must not
    /// buy one scan of the shard per request. Once entries expire, new keys get their own.
    #[test]
    fn a_full_shard_is_not_swept_for_every_new_key() {
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .max_keys(8)
            .build()
            .unwrap();
        let r = rule("r", Algorithm::FixedWindow, 1);
        for i in 0..8u8 {
            assert!(s.check(Op::Consume, &one(&r, &Key::new([i]), 1)[0]).allowed);
        }
        assert!(
            s.check(Op::Consume, &one(&r, &Key::new("new"), 1)[0])
                .allowed
        );
        let now = clock.now_us();
        let full_until = s.inner.shards[0].shard.read().full_until;
        assert!(
            full_until > now && full_until <= now + FULL_RETRY,
            "{full_until}"
        );
        for i in 0..100u32 {
            s.check(Op::Consume, &one(&r, &Key::new(i.to_be_bytes()), 1)[0]);
        }
        assert_eq!(
            s.inner.shards[0].shard.read().full_until,
            full_until,
            "no sweep"
        );
        clock.advance(Duration::from_secs(1));
        let fresh = Key::new("after");
        assert!(s.check(Op::Consume, &one(&r, &fresh, 1)[0]).allowed);
        let shard = s.inner.shards[0].shard.read();
        let hash = s.inner.hash(&one(&r, &fresh, 1)[0]);
        assert!(
            shard.table.find(hash, |e| e.key == fresh).is_some(),
            "an entry of its own"
        );
    }

    /// Once every block has ended, the listings are pruned by the next decision: an ended
    /// block does not keep every decision on the listings mutex.
    #[tokio::test]
    async fn ended_blocks_leave_the_listings() {
        use crate::store::Store;
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let r = rule("r", Algorithm::FixedWindow, 10);
        let k = Key::new("blocked");
        s.set_listing(&k, Some(Listing::Block(Duration::from_secs(1))))
            .await
            .unwrap();
        assert!(!s.check(Op::Consume, &one(&r, &k, 1)[0]).allowed);
        assert_eq!(s.inner.listed.load(Ordering::Acquire), 1);
        clock.advance(Duration::from_secs(2));
        assert!(
            s.check(Op::Consume, &one(&r, &Key::new("other"), 1)[0])
                .allowed
        );
        assert_eq!(s.inner.listed.load(Ordering::Acquire), 0, "pruned");
        assert!(s.check(Op::Consume, &one(&r, &k, 1)[0]).allowed);
    }

    /// A spray of penalty blocks holds the listings within the store's bound on keys (they grew
    /// without one, each block sweeping the whole map under its lock): each new block is
    /// written, the ones ending soonest making room; an operator's entry is never the one to
    /// go, and a map full of them takes no penalty block. Lifting a deny lets decisions stop
    /// looking once the blocks end (it once kept them looking for ever).
    #[tokio::test]
    async fn penalty_blocks_stay_within_the_bound_on_keys() {
        use crate::store::Store;
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = one_shard(&clock, 16, false);
        let operator = Key::new("operator");
        s.set_listing(&operator, Some(Listing::Block(Duration::from_secs(1))))
            .await
            .unwrap();
        let key = |i: u64| Key::new(format!("k{i}"));
        for i in 0..100 {
            let block = Duration::from_secs(60 + i);
            assert!(s.block_unless_listed(&key(i), block).await.unwrap(), "k{i}");
        }
        assert!(s.inner.listings.read().map.len() <= 16);
        assert!(
            s.listing(&key(99)).await.unwrap().is_some(),
            "the latest stands"
        );
        assert_eq!(
            s.listing(&key(0)).await.unwrap(),
            None,
            "the soonest made room"
        );
        assert!(
            s.listing(&operator).await.unwrap().is_some(),
            "never the operator's"
        );

        let full = one_shard(&clock, 16, false);
        for i in 0..16 {
            full.set_listing(&key(i), Some(Listing::Deny))
                .await
                .unwrap();
        }
        assert!(!full
            .block_unless_listed(&Key::new("new"), Duration::from_secs(60))
            .await
            .unwrap());
        for i in 0..16 {
            full.set_listing(&key(i), None).await.unwrap();
        }
        full.block_unless_listed(&Key::new("later"), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(
            full.inner.listings_end.load(Ordering::Relaxed),
            clock.now_us() + 1_000_000,
            "the denies lifted, decisions may stop looking when the block ends"
        );
    }

    /// Lifting the block that ends last lets decisions stop looking once the others end (its
    /// end bounded the rest, and decisions looked for a day after a short block); an
    /// operator's block the penalty box extends stays the operator's, never making room.
    #[tokio::test]
    async fn lifted_and_extended_blocks_keep_the_listings_honest() {
        use crate::store::Store;
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = one_shard(&clock, 16, false);
        let (long, short) = (Key::new("long"), Key::new("short"));
        s.set_listing(&long, Some(Listing::Block(Duration::from_secs(86_400))))
            .await
            .unwrap();
        assert!(s
            .block_unless_listed(&short, Duration::from_secs(1))
            .await
            .unwrap());
        s.set_listing(&long, None).await.unwrap();
        clock.advance(Duration::from_secs(2));
        let r = rule("r", Algorithm::FixedWindow, 10);
        assert!(
            s.check(Op::Consume, &one(&r, &Key::new("other"), 1)[0])
                .allowed
        );
        assert_eq!(
            s.inner.listed.load(Ordering::Acquire),
            0,
            "settled once the short one ended"
        );

        let k = Key::new("operator-blocked");
        s.set_listing(&k, Some(Listing::Block(Duration::from_secs(10))))
            .await
            .unwrap();
        assert!(s
            .block_unless_listed(&k, Duration::from_secs(60))
            .await
            .unwrap());
        for i in 0..40u64 {
            let key = Key::new(format!("sprayed{i}"));
            s.block_unless_listed(&key, Duration::from_secs(120 + i))
                .await
                .unwrap();
        }
        assert!(
            s.listing(&k).await.unwrap().is_some(),
            "the operator's, extended, stays"
        );
    }

    /// A key reset while its rule's shared overflow state counts starts afresh, as on Redis (a
    /// new entry would start from a copy of that state, which a spray had spent: the reset key
    /// was refused for minutes).
    /// Whether `k` is admitted a permit under `r` once `taken` is refunded.
    fn admits_after_refund(s: &MemoryStore, r: &Rule, k: &Key, taken: crate::Taken) -> bool {
        s.refund_now(&[Refund {
            rule: r,
            key: k,
            taken,
        }]);
        s.apply_now(Op::Consume, &one(r, k, 1))[0].allowed
    }

    /// A receipt taken in the very microsecond its key is reset (the memory store decides many
    /// requests in one) refunds nothing into the key's fresh state: 14 were admitted in the
    /// window where 10 are allowed, as the fresh state started at the receipt's time.
    #[tokio::test]
    async fn a_receipt_from_the_microsecond_of_a_reset_refunds_nothing() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let r = rule("r", Algorithm::FixedWindow, 10);
        let k = Key::new("k");
        let taken = s.apply_now(Op::Consume, &one(&r, &k, 4))[0].taken.unwrap();
        s.reset(&r, &k).await.unwrap();
        assert!(s.apply_now(Op::Consume, &one(&r, &k, 10))[0].allowed);
        assert!(!admits_after_refund(&s, &r, &k, taken));
    }

    /// The same for a key evicted in the microsecond of its receipt: its next state starts
    /// after it.
    #[test]
    fn a_receipt_from_the_microsecond_of_an_eviction_refunds_nothing() {
        let clock = ManualClock::default();
        let s = one_shard(&clock, 16, false);
        let r = rule("r", Algorithm::FixedWindow, 10);
        let k = Key::new("k");
        let taken = s.apply_now(Op::Consume, &one(&r, &k, 1))[0].taken.unwrap();
        for i in 0..16u32 {
            s.apply_now(Op::Consume, &one(&r, &Key::new(i.to_be_bytes()), 4));
        }
        let d = s.apply_now(Op::Peek, &one(&r, &k, 1))[0];
        assert_eq!(d.remaining, 10, "the least used key was evicted");
        assert!(s.apply_now(Op::Consume, &one(&r, &k, 10))[0].allowed);
        assert!(!admits_after_refund(&s, &r, &k, taken));
    }

    /// The same for a key evicted by the sweep of a batch (a request under two rules), which
    /// the batch then decides afresh.
    #[test]
    fn a_receipt_from_the_microsecond_of_a_batchs_eviction_refunds_nothing() {
        let clock = ManualClock::default();
        let s = one_shard(&clock, 16, false);
        let (r, other) = (
            rule("r", Algorithm::FixedWindow, 10),
            rule("other", Algorithm::FixedWindow, 10),
        );
        let k = Key::new("k");
        let taken = s.apply_now(Op::Consume, &one(&r, &k, 1))[0].taken.unwrap();
        for i in 0..15u32 {
            s.apply_now(Op::Consume, &one(&r, &Key::new(i.to_be_bytes()), 4));
        }
        let batch = [
            Check {
                rule: &r,
                key: &k,
                cost: 10,
            },
            Check {
                rule: &other,
                key: &k,
                cost: 1,
            },
        ];
        let d = s.apply_now(Op::Consume, &batch);
        assert!(
            d.iter().all(|d| d.allowed),
            "k evicted, then decided afresh: {d:?}"
        );
        assert!(!admits_after_refund(&s, &r, &k, taken));
    }

    /// A lease under a quota that would cut the key's debt at the conversion's cap (a plan of
    /// 1,000 an hour spent, read under one request per 366 days) takes nothing and keeps the
    /// debt, as a consume does: back under its plan, the key had 857 permits again.
    #[test]
    fn a_lease_under_a_quota_that_cuts_the_debt_keeps_it() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let gcra = |quota: crate::quota::QuotaBuilder| {
            Rule::new("r", quota.algorithm(Algorithm::Gcra).build().unwrap()).unwrap()
        };
        let plan = gcra(Quota::per_hour(1000));
        let suspended = gcra(Quota::new(1, Duration::from_secs(366 * 86_400)));
        let k = Key::new("k");
        assert!(s.apply_now(Op::Consume, &one(&plan, &k, 1000))[0].allowed);
        let lease = s
            .lease_now(
                Check {
                    rule: &suspended,
                    key: &k,
                    cost: 10,
                },
                Duration::from_secs(1),
            )
            .unwrap();
        assert_eq!(lease.permits, 0);
        assert!(!s.apply_now(Op::Consume, &one(&plan, &k, 1))[0].allowed);
    }

    #[tokio::test]
    async fn a_reset_key_starts_afresh_while_the_overflow_state_counts() {
        use crate::store::Store;
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = one_shard(&clock, 16, false);
        let quota = Quota::per_hour(10)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        let r = Rule::new("r", quota).unwrap();
        let victim = Key::new("victim");
        for _ in 0..10 {
            assert!(s.check(Op::Consume, &one(&r, &victim, 1)[0]).allowed);
        }
        for i in 0..15u32 {
            let k = Key::new(i.to_be_bytes());
            assert!(s.check(Op::Consume, &one(&r, &k, 6)[0]).allowed);
        }
        // The shard is full of entries used past half: a new key shares the overflow state,
        // and spends it.
        assert!(
            s.check(Op::Consume, &one(&r, &Key::new("x"), 10)[0])
                .allowed
        );
        s.reset(&r, &victim).await.unwrap();
        assert!(
            s.check(Op::Consume, &one(&r, &victim, 1)[0]).allowed,
            "afresh"
        );
    }

    /// Pauses are capped as the Redis store caps them: about 49 days, not a pushback date
    /// years away.
    #[tokio::test]
    async fn a_pause_is_capped_as_on_redis() {
        use crate::store::Store;
        let clock = ManualClock::new(1_900_000_000_000_000);
        let s = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let (r, k) = (rule("r", Algorithm::FixedWindow, 10), Key::new("k"));
        s.pause(&r, &k, Duration::from_secs(10 * 365 * 86_400))
            .await
            .unwrap();
        assert_eq!(
            s.paused_for(&r, &k).await.unwrap(),
            Some(Duration::from_millis(u64::from(u32::MAX)))
        );
    }

    /// 16 keys of `rule` (a spray), each taking `cost`.
    fn spray(s: &MemoryStore, rule: &Rule, cost: u64) {
        for i in 0..16u32 {
            s.apply_now(Op::Consume, &one(rule, &Key::new(i.to_be_bytes()), cost));
        }
    }

    /// A spray that fills a 16-key store with keys past half their quota (6 of 10): none of
    /// them can be evicted, so the next new key evicts whatever can be.
    fn spray_busy_keys(s: &MemoryStore) {
        spray(s, &rule("short", Algorithm::FixedWindow, 10), 6);
    }

    /// Rule "r": 10 an hour, by `algorithm`.
    fn ten_an_hour(algorithm: Algorithm) -> Rule {
        Rule::new(
            "r",
            Quota::per_hour(10).algorithm(algorithm).build().unwrap(),
        )
        .unwrap()
    }

    /// A key refused under a quota lowered since its last write has used that quota whole:
    /// a spray of keys must not evict it as one that used little (4 of the old 10), which
    /// would give it the new limit again in the same hour. Refused on either path, the
    /// exclusive lock's or the shared one's (the shard's last refusal allows the second).
    #[test]
    fn a_key_refused_under_a_lowered_quota_is_not_evicted_as_barely_used() {
        for shared_lock in [false, true] {
            let clock = ManualClock::new(1_735_689_600_000_000);
            let s = store(&clock, 16);
            let before = ten_an_hour(Algorithm::FixedWindow);
            let lowered = Rule::new(
                "r",
                Quota::per_hour(2)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap();
            let k = Key::new("k");
            assert!(s.apply_now(Op::Consume, &one(&before, &k, 4))[0].allowed);
            if shared_lock {
                // Another key's refusal on the exclusive path: the shard refuses under the
                // shared lock from then on.
                let other = Key::new("other");
                s.apply_now(Op::Consume, &one(&before, &other, 10));
                assert!(!s.apply_now(Op::Consume, &one(&before, &other, 1))[0].allowed);
            }
            assert!(!s.apply_now(Op::Consume, &one(&lowered, &k, 1))[0].allowed);
            clock.advance(Duration::from_millis(1));
            spray_busy_keys(&s);
            clock.advance(Duration::from_secs(1));
            assert!(
                !s.apply_now(Op::Consume, &one(&lowered, &k, 1))[0].allowed,
                "shared lock: {shared_lock}: evicted, and given the new limit again"
            );
        }
    }

    /// A key whose hour was converted to a minute (a rolling change of the period) holds the
    /// hour's count in a state that looks barely used (its minute rolled on): a spray of keys
    /// must not evict it, which would give the hour back whole.
    #[test]
    fn a_state_holding_a_longer_windows_count_is_not_evicted() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let hour = ten_an_hour(Algorithm::FixedWindow);
        let minute = Rule::new(
            "r",
            Quota::per_minute(100)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let k = Key::new("k");
        assert!(s.apply_now(Op::Consume, &one(&hour, &k, 10))[0].allowed);
        clock.advance(Duration::from_secs(30));
        assert!(s.apply_now(Op::Consume, &one(&minute, &k, 1))[0].allowed);
        // The next minute: its own count 0, the hour's 11 held.
        clock.advance(Duration::from_secs(60));
        assert!(s.apply_now(Op::Consume, &one(&minute, &k, 1))[0].allowed);
        spray_busy_keys(&s);
        clock.advance(Duration::from_secs(1));
        assert!(
            !s.apply_now(Op::Consume, &one(&hour, &k, 1))[0].allowed,
            "evicted, and the hour given back whole"
        );
    }

    /// Keys sharing a full shard's overflow state: a peek under another quota of the rule (an
    /// inspection under the rule's own, where a tenant's is decided per request) writes nothing
    /// there either. Converted, the hour's count would move into a minute that ends, for every
    /// key sharing the state.
    #[test]
    fn a_peek_converts_no_shared_overflow_state() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let fill = Rule::new("fill", Quota::per_hour(10).build().unwrap()).unwrap();
        spray(&s, &fill, 10);
        let hour = Rule::new("r", Quota::per_hour(50).build().unwrap()).unwrap();
        let minute = Rule::new("r", Quota::per_minute(100).build().unwrap()).unwrap();
        let k = Key::new("tenant");
        assert!(s.apply_now(Op::Consume, &one(&hour, &k, 50))[0].allowed);
        assert!(!s.apply_now(Op::Consume, &one(&hour, &k, 1))[0].allowed);
        clock.advance(Duration::from_secs(60));
        s.apply_now(Op::Peek, &one(&minute, &k, 1));
        clock.advance(Duration::from_secs(70));
        assert!(
            !s.apply_now(Op::Consume, &one(&hour, &k, 1))[0].allowed,
            "the hour's 50 are spent"
        );
    }

    /// A peek of a key the full shard does not hold evicts nothing (an allow-listed key's
    /// every request peeks each rule): `k`, the least used, kept its count.
    #[test]
    fn a_peek_evicts_nothing() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let r = ten_an_hour(Algorithm::FixedWindow);
        let k = Key::new("k");
        assert!(s.apply_now(Op::Consume, &one(&r, &k, 1))[0].allowed);
        for i in 0..15 {
            let busy = Key::new(format!("busy-{i}"));
            assert!(s.apply_now(Op::Consume, &one(&r, &busy, 6))[0].allowed);
        }
        assert_eq!(s.len(), 16);
        s.apply_now(Op::Peek, &one(&r, &Key::new("absent"), 1));
        assert_eq!(s.len(), 16, "a peek evicts nothing");
        // Nor a peek of two rules at once (per account AND per address: one batch).
        let other = Rule::new("other", Quota::per_hour(10).build().unwrap()).unwrap();
        let absent = Key::new("absent");
        let both = [
            Check {
                rule: &r,
                key: &absent,
                cost: 1,
            },
            Check {
                rule: &other,
                key: &absent,
                cost: 1,
            },
        ];
        s.apply_now(Op::Peek, &both);
        assert_eq!(s.len(), 16, "a batch's peek evicts nothing");
        assert_eq!(s.apply_now(Op::Peek, &one(&r, &k, 1))[0].remaining, 9);
        // With `Overflow::Refuse`, a peek of a new key reads it as new (a consume's sweep
        // would make room), not refused.
        let refusing = one_shard(&clock, 16, true);
        for i in 0..16 {
            let busy = Key::new(format!("busy-{i}"));
            assert!(refusing.apply_now(Op::Consume, &one(&r, &busy, 1))[0].allowed);
        }
        let peeked = refusing.apply_now(Op::Peek, &one(&r, &absent, 1))[0];
        assert_eq!((peeked.allowed, peeked.remaining), (true, 10), "{peeked:?}");
        assert!(refusing.apply_now(Op::Consume, &one(&r, &absent, 1))[0].allowed);
    }

    /// Many shards (up to 65,536) never take the hash's top 7 bits, the table's tags: with
    /// them, every entry of a shard had the same tag, and a lookup compared keys in every
    /// full slot of each group it probed.
    #[test]
    fn the_shard_leaves_the_tags_their_bits() {
        let s = MemoryStore::builder()
            .shards(65_536)
            .max_keys(1 << 20)
            .build()
            .unwrap();
        let hashes = (0u64..400_000).map(|i| {
            let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z ^ (z >> 31)
        });
        let tags: std::collections::HashSet<u64> = hashes
            .filter(|&h| s.inner.shard_of(h) == 0)
            .map(|h| h >> 57)
            .collect();
        assert!(tags.len() > 1, "one tag in a shard: {tags:?}");
    }

    #[test]
    fn a_receipt_survives_no_eviction() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let r = ten_an_hour(Algorithm::FixedWindow);
        let k = Key::new("k");
        let half = s.apply_now(Op::Consume, &one(&r, &k, 5))[0].taken.unwrap();
        clock.advance(Duration::from_millis(1));
        // Keys that used more than half cannot be evicted; `k`, at half, is the one that goes.
        // They expire a second later, leaving room for `k` to come back in the same hour.
        spray_busy_keys(&s);
        clock.advance(Duration::from_secs(1));
        let mut admitted = 0;
        while s.apply_now(Op::Consume, &one(&r, &k, 1))[0].allowed {
            admitted += 1;
        }
        assert_eq!(admitted, 10, "evicted, and back afresh");
        let _ = s.refund_now(&[Refund {
            rule: &r,
            key: &k,
            taken: half,
        }]);
        let after = s.apply_now(Op::Consume, &one(&r, &k, 1))[0];
        assert!(
            !after.allowed,
            "{admitted} admitted since the eviction, and the old receipt made room for more"
        );
    }

    /// A `max_keys` valid on one machine is valid on every machine: the default shards never
    /// outnumber it (a 64-core machine's 256 shards made `max_keys(64)` an error there).
    #[test]
    fn max_keys_is_valid_whatever_the_cores() {
        for cores in [1, 2, 9, 64, 1024] {
            assert_eq!(
                default_shards(cores, 64),
                (cores * 8).next_power_of_two().clamp(16, 64)
            );
            assert_eq!(default_shards(cores, 16), 16);
            assert_eq!(
                default_shards(cores, 100),
                (cores * 8).next_power_of_two().clamp(16, 64)
            );
            assert!(default_shards(cores, DEFAULT_MAX_KEYS) >= 16);
        }
        assert!(MemoryStore::builder().max_keys(16).build().is_ok());
        assert!(MemoryStore::builder().max_keys(15).build().is_err());
        assert!(MemoryStore::builder().max_keys(1).shards(1).build().is_ok());
        assert!(MemoryStore::builder()
            .max_keys(7)
            .shards(8)
            .build()
            .is_err());
    }

    /// A key evicted and come back as a copy of the shared overflow state: a receipt from its
    /// own entry refunds nothing against the copy, which never lent those permits (the
    /// overflow's own first permit, taken before the receipt, must not vouch for it).
    #[test]
    fn a_receipt_refunds_nothing_against_an_overflow_copy() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let r = ten_an_hour(Algorithm::FixedWindow);
        let short = rule("short", Algorithm::FixedWindow, 10);
        let fill = |from: u32| {
            for i in from..from + 16 {
                s.apply_now(Op::Consume, &one(&short, &Key::new(i.to_be_bytes()), 6));
            }
        };
        fill(0);
        // A new key shares the overflow state: its first permit.
        assert!(s.apply_now(Op::Consume, &one(&r, &Key::new("x"), 1))[0].allowed);
        clock.advance(Duration::from_secs(1));
        // `k` gets an entry of its own, a copy of the overflow (1 + 4 taken), and a receipt.
        let k = Key::new("k");
        let receipt = s.apply_now(Op::Consume, &one(&r, &k, 4))[0].taken.unwrap();
        // Pushed out by keys that used more than half; once they expire, back as a copy of the
        // overflow again (1 + 1).
        fill(100);
        clock.advance(Duration::from_secs(1));
        assert!(s.apply_now(Op::Consume, &one(&r, &k, 1))[0].allowed);
        let before = s.apply_now(Op::Peek, &one(&r, &k, 1))[0].remaining;
        let _ = s.refund_now(&[Refund {
            rule: &r,
            key: &k,
            taken: receipt,
        }]);
        let after = s.apply_now(Op::Peek, &one(&r, &k, 1))[0].remaining;
        assert_eq!(
            after, before,
            "the old receipt gave back permits the copy never lent"
        );
    }

    /// The same for a log, whose refunds remove entries of the receipt's own time: the copy
    /// holds another key's entry of that very microsecond, which the old receipt must not
    /// remove.
    #[test]
    fn a_log_receipt_removes_nothing_from_an_overflow_copy() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let log = ten_an_hour(Algorithm::SlidingLog);
        let k = Key::new("k");
        let receipt = s.apply_now(Op::Consume, &one(&log, &k, 1))[0]
            .taken
            .unwrap();
        // Keys that used more than half push `k` out; in the same microsecond, a new key is
        // counted in the overflow state.
        spray_busy_keys(&s);
        assert!(s.apply_now(Op::Consume, &one(&log, &Key::new("x"), 1))[0].allowed);
        // Once they expire, `k` comes back as a copy of the overflow.
        clock.advance(Duration::from_secs(1));
        assert!(s.apply_now(Op::Consume, &one(&log, &k, 1))[0].allowed);
        let before = s.apply_now(Op::Peek, &one(&log, &k, 1))[0].remaining;
        assert_eq!(before, 8, "the copy holds x's permit and k's new one");
        let _ = s.refund_now(&[Refund {
            rule: &log,
            key: &k,
            taken: receipt,
        }]);
        let after = s.apply_now(Op::Peek, &one(&log, &k, 1))[0].remaining;
        assert_eq!(after, before, "the old receipt removed x's entry");
    }

    /// Two checks in one full shard: deciding the second must not evict the first's state
    /// between its decision and its commit.
    #[test]
    fn a_batch_in_a_full_shard_never_loses_its_state() {
        let clock = ManualClock::new(1_735_689_600_000_000);
        let s = store(&clock, 16);
        let short = rule("short", Algorithm::FixedWindow, 5);
        let other = rule("other", Algorithm::FixedWindow, 5);
        spray(&s, &short, 1);
        clock.advance(Duration::from_secs(2)); // everything expired, nothing swept yet
        let (a, b) = (Key::new(0u32.to_be_bytes()), Key::new("new"));
        let checks = [
            Check {
                rule: &short,
                key: &a,
                cost: 1,
            },
            Check {
                rule: &other,
                key: &b,
                cost: 1,
            },
        ];
        let d = s.apply_now(Op::Consume, &checks);
        assert!(d.iter().all(|d| d.allowed && d.taken.is_some()));
        assert_eq!(s.apply_now(Op::Peek, &checks[..1])[0].remaining, 4);
    }

    #[test]
    fn a_receipt_of_another_algorithm_refunds_nothing_and_never_panics() {
        let clock = ManualClock::default();
        let s = store(&clock, 100);
        let gcra = Rule::new(
            "r",
            Quota::per_second(10)
                .algorithm(Algorithm::Gcra)
                .build()
                .unwrap(),
        )
        .unwrap();
        let window = rule("r", Algorithm::FixedWindow, 10);
        let k = Key::new("k");
        let taken = s.apply_now(Op::Consume, &one(&gcra, &k, 3))[0]
            .taken
            .unwrap();
        let d = s.refund_now(&[Refund {
            rule: &window,
            key: &k,
            taken,
        }]);
        assert_eq!(d[0].remaining, 10);
        s.apply_now(Op::Consume, &one(&window, &k, 4));
        let d = s.refund_now(&[Refund {
            rule: &window,
            key: &k,
            taken,
        }]);
        assert_eq!(
            d[0].remaining, 6,
            "a GCRA receipt gave a window permits back"
        );
    }

    #[test]
    fn eviction_takes_the_freshest_entries_first() {
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
        for _ in 0..3 {
            s.apply_now(Op::Consume, &one(&long, &hot, 1));
        }
        for i in 0..1_000u32 {
            s.apply_now(Op::Consume, &one(&short, &Key::new(i.to_be_bytes()), 1));
        }
        let d = s.apply_now(Op::Peek, &one(&long, &hot, 1))[0];
        assert_eq!(
            d.remaining, 2,
            "the entry that used 3 of 5 survived the spray"
        );
    }
}
