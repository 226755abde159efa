//! Remembered store denials: a key the store refused until T is refused in process until T, so a
//! flood on an exhausted key costs one store call per retry period, not one per request.
//!
//! Promise: a remembered denial answers only the request it proves (the same rule, key and
//! cost), never after the store's own retry time nor longer than `max_age` after the store said
//! it (so a reset, a block lifted, a quota raised or a Redis restarted empty is seen by every
//! instance within `max_age`, and at once by the instance that made the change, even by a reply
//! already in flight then), and with headers computed at the moment of the answer
//! (`retry_after` and `reset_after` count down from the store's answer). While the store cannot
//! be asked, a denial stands up to the store's own retry time (a blocked or deny-listed key stays
//! refused through an outage). Bounded: at most the configured number of keys, those past
//! `max_age` and those that end first forgotten first.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::algorithm::micros;
use crate::{Decision, Key, Source};

/// A rule (by index) and a key.
pub(crate) type SlotKey = (usize, Key);

#[derive(Debug, Clone, Copy)]
struct Remembered {
    /// Answered from here until (µs, the limiter's clock): the store's retry time, or `max_age`
    /// after its answer if that comes first.
    until: u64,
    /// The store's retry time (µs), counted from when the call was asked: how long the
    /// denial may be answered from here.
    retry_at: u64,
    /// The store's retry time counted from when its answer came (µs), for `retry_after`.
    shown_retry_at: u64,
    /// For requests of exactly this cost.
    cost: u64,
    /// Full again at (µs), for `reset_after`.
    reset_at: u64,
    /// When the call the store answered with this denial was made (µs).
    asked_at: u64,
    decision: Decision,
}

type Shard = Mutex<HashMap<SlotKey, Remembered>>;

/// A bounded cache of store denials.
#[derive(Debug)]
pub(crate) struct DenialCache {
    shards: Box<[Shard]>,
    per_shard: usize,
    /// How long a store's denial is trusted (µs).
    max_age: u64,
    hasher: hashbrown::DefaultHashBuilder,
    /// Denials held, over every shard (kept by [`Locked`]): an admission, which may lift one,
    /// looks no further while there are none, as is nearly always so.
    held: AtomicUsize,
    /// Per shard, moved on by every [`forget`](DenialCache::forget) of a key of the shard and
    /// by [`clear`](DenialCache::clear): a denial answering a call asked before one (see
    /// [`Asked`]) is not remembered. A reply still in flight when a key is reset or unblocked
    /// would otherwise put the refusal the reset lifted back, for up to `max_age`, or through an
    /// outage to its old retry time. Per shard, so that a flood of forgets (the penalty box
    /// blocking keys under attack) keeps the other keys' refusals coming in.
    generations: Box<[AtomicU64]>,
}

/// When a store call was asked: the limiter's clock, and the key's
/// [`generation`](DenialCache::generation) then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked {
    pub(crate) at: u64,
    pub(crate) generation: u64,
    /// When the answer came (µs; `at` until it has): the store counted its waits from a moment
    /// in between, so the waits shown are counted from here (never early), and how long the
    /// denial is remembered from `at` (never outlasting the store's).
    pub(crate) answered_at: u64,
}

/// A shard, locked; on unlock, the change in its size goes into the cache's count.
struct Locked<'a> {
    map: std::sync::MutexGuard<'a, HashMap<SlotKey, Remembered>>,
    before: usize,
    held: &'a AtomicUsize,
}

impl std::ops::Deref for Locked<'_> {
    type Target = HashMap<SlotKey, Remembered>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.map
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let after = self.map.len();
        if after > self.before {
            self.held.fetch_add(after - self.before, Ordering::Relaxed);
        } else if after < self.before {
            self.held.fetch_sub(self.before - after, Ordering::Relaxed);
        }
    }
}

const SHARDS: usize = 16;

impl DenialCache {
    pub(crate) fn new(capacity: usize, max_age: Duration) -> DenialCache {
        DenialCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            max_age: micros(max_age),
            hasher: hashbrown::DefaultHashBuilder::default(),
            held: AtomicUsize::new(0),
            generations: (0..SHARDS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// `key`'s generation, to stamp a call with before it is asked.
    pub(crate) fn generation(&self, key: &Key) -> u64 {
        self.generations[self.index(key)].load(Ordering::SeqCst)
    }

    /// A key's shard: every rule's denial of one key in one shard, so that forgetting a key
    /// takes one lock.
    fn index(&self, key: &Key) -> usize {
        self.hasher.hash_one(key) as usize % self.shards.len()
    }

    fn lock<'a>(&'a self, shard: &'a Shard) -> Locked<'a> {
        let map = shard.lock().unwrap_or_else(|e| e.into_inner());
        Locked {
            before: map.len(),
            map,
            held: &self.held,
        }
    }

    fn shard(&self, key: &SlotKey) -> Locked<'_> {
        self.lock(&self.shards[self.index(&key.1)])
    }

    /// Whether no denial is held: an admission then has none to lift.
    pub(crate) fn is_empty(&self) -> bool {
        self.held.load(Ordering::Relaxed) == 0
    }

    /// The remembered denial of a request of `cost` at `now`, its waits counted down to now.
    pub(crate) fn get(&self, key: &SlotKey, cost: u64, now: u64) -> Option<Decision> {
        self.answer(key, cost, now, |r| r.until)
    }

    /// Like [`get`](DenialCache::get), while the store cannot be asked: a denial it gave stands
    /// until its own retry time, however long ago it was given (nothing newer can be learnt).
    pub(crate) fn get_in_outage(&self, key: &SlotKey, cost: u64, now: u64) -> Option<Decision> {
        self.answer(key, cost, now, |r| r.retry_at)
    }

    fn answer(
        &self,
        key: &SlotKey,
        cost: u64,
        now: u64,
        good_until: impl Fn(&Remembered) -> u64,
    ) -> Option<Decision> {
        let mut shard = self.shard(key);
        let r = *shard.get(key)?;
        if now >= r.retry_at {
            shard.remove(key);
            return None;
        }
        if now >= good_until(&r) || r.cost != cost {
            return None;
        }
        let mut d = r.decision;
        d.retry_after = Some(Duration::from_micros(r.shown_retry_at.saturating_sub(now)));
        d.reset_after = Duration::from_micros(r.reset_at.saturating_sub(now));
        d.source = Source::Cache;
        Some(d)
    }

    /// Remember a store denial `d` of a request of `cost`, answered for a call `asked` (so the
    /// remembered wait never outlasts the store's), unless a key was forgotten since.
    pub(crate) fn remember(&self, key: SlotKey, cost: u64, d: &Decision, asked: Asked) {
        let asked_at = asked.at;
        if d.allowed {
            if !self.is_empty() {
                self.admitted(&key, cost, asked_at);
            }
            return;
        }
        let Some(retry) = d.retry_after else {
            return;
        };
        let retry_at = asked_at.saturating_add(micros(retry));
        let until = retry_at.min(asked_at.saturating_add(self.max_age));
        let answered_at = asked.answered_at.max(asked_at);
        let shown_retry_at = answered_at.saturating_add(micros(retry));
        let reset_at = answered_at.saturating_add(micros(d.reset_after));
        let mut shard = self.shard(&key);
        // Read under the shard's lock: a forget moves the generation on before it takes the
        // shard's lock, so either this sees it or the forget removes what this inserts.
        if self.generation(&key.1) != asked.generation {
            return;
        }
        // Answers can come back out of order (two calls on two threads): a denial for an
        // earlier call never replaces what a later one said.
        if shard.get(&key).is_some_and(|r| r.asked_at > asked_at) {
            return;
        }
        if shard.len() >= self.per_shard && !shard.contains_key(&key) {
            shard.retain(|_, r| r.until > asked_at);
            if shard.len() >= self.per_shard {
                // Still full of live denials: forget the one that ends first.
                if let Some(first) = shard
                    .iter()
                    .min_by_key(|(_, r)| r.until)
                    .map(|(k, _)| k.clone())
                {
                    shard.remove(&first);
                }
            }
        }
        shard.insert(
            key,
            Remembered {
                until,
                retry_at,
                shown_retry_at,
                cost,
                reset_at,
                asked_at,
                decision: *d,
            },
        );
    }

    /// The store admitted `key` at `cost` for a call made at `asked_at`: a denial it gave for an
    /// earlier call (strictly: of two calls in one microsecond, either may be the later) no
    /// longer stands if this admission proves it (a cost no larger, or any cost
    /// against a listing: the key was reset, unblocked, its quota raised, permits came back).
    /// Kept, it would still refuse the key through an outage, up to its old retry time.
    fn admitted(&self, key: &SlotKey, cost: u64, asked_at: u64) {
        let mut shard = self.shard(key);
        let disproved = shard.get(key).is_some_and(|r| {
            r.asked_at < asked_at && (r.cost <= cost || r.decision.listed.is_listed())
        });
        if disproved {
            shard.remove(key);
        }
    }

    /// Forget the denial remembered for `key` under its rule, if any (permits went back to it).
    /// A denial asked before and answered after may still come in: as after an admission, the
    /// cache is at most that call's answer behind.
    pub(crate) fn lift(&self, key: &SlotKey) {
        self.shard(key).remove(key);
    }

    /// Forget every remembered denial (the quotas changed).
    pub(crate) fn clear(&self) {
        for (shard, generation) in self.shards.iter().zip(self.generations.iter()) {
            generation.fetch_add(1, Ordering::SeqCst);
            self.lock(shard).clear();
        }
    }

    /// Forget everything remembered about `key` under every rule.
    pub(crate) fn forget(&self, key: &Key) {
        let i = self.index(key);
        self.generations[i].fetch_add(1, Ordering::SeqCst);
        self.lock(&self.shards[i]).retain(|(_, k), _| k != key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call for `key` asked at `t` (µs), stamped with its generation now.
    fn asked(c: &DenialCache, key: &SlotKey, t: u64) -> Asked {
        Asked {
            at: t,
            generation: c.generation(&key.1),
            answered_at: t,
        }
    }

    fn denial(retry_ms: u64, reset_ms: u64) -> Decision {
        Decision::deny(
            10,
            0,
            Duration::from_millis(reset_ms),
            Some(Duration::from_millis(retry_ms)),
        )
    }

    /// The store counted its wait from some moment between the call and its answer: the wait
    /// shown is counted from the answer (never early for a client that obeys it), while the
    /// denial is answered only as long as counted from the call (never longer than the store's).
    #[test]
    fn waits_shown_count_from_the_answer_and_the_denial_ends_by_the_call() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let k = (0, Key::new("k"));
        let answered = Asked {
            answered_at: 40_000,
            ..asked(&c, &k, 0)
        };
        c.remember(k.clone(), 1, &denial(1_000, 4_000), answered);
        let d = c.get(&k, 1, 100_000).unwrap();
        assert_eq!(d.retry_after, Some(Duration::from_millis(940)));
        assert_eq!(d.reset_after, Duration::from_millis(3_940));
        assert!(c.get(&k, 1, 999_999).is_some());
        assert!(
            c.get(&k, 1, 1_000_000).is_none(),
            "the store may admit it now"
        );
    }

    #[test]
    fn answers_the_same_cost_with_waits_counted_down() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let k = (0, Key::new("k"));
        c.remember(k.clone(), 2, &denial(1_000, 4_000), asked(&c, &k, 0));
        let d = c.get(&k, 2, 250_000).unwrap();
        assert_eq!(d.retry_after, Some(Duration::from_millis(750)));
        assert_eq!(d.reset_after, Duration::from_millis(3_750));
        assert_eq!(d.source, Source::Cache);
        assert!(
            c.get(&k, 1, 250_000).is_none(),
            "a smaller cost may fit sooner"
        );
        assert!(
            c.get(&k, 3, 250_000).is_none(),
            "a larger cost waits longer"
        );
        assert!(
            c.get(&(1, Key::new("k")), 2, 250_000).is_none(),
            "another rule"
        );
        assert!(
            c.get(&k, 2, 1_000_000).is_none(),
            "never past the store's time"
        );
        assert!(c.get(&k, 2, 250_000).is_none(), "forgotten once over");
    }

    /// Answers that come back out of order: a denial for an earlier call never replaces the
    /// one a later call got (its longer wait would outlast what the store said last).
    #[test]
    fn an_earlier_calls_denial_never_replaces_a_later_ones() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let k = (0, Key::new("k"));
        c.remember(
            k.clone(),
            1,
            &denial(1_000, 1_000),
            asked(&c, &k, 20_000_000),
        );
        c.remember(
            k.clone(),
            1,
            &denial(60_000, 60_000),
            asked(&c, &k, 10_000_000),
        );
        assert!(
            c.get_in_outage(&k, 1, 22_000_000).is_none(),
            "the later call's 1 s wait is over"
        );
    }

    /// A later admission by the store lifts a denial it proves wrong: one of a cost no larger,
    /// or any admission against a listing's denial; never an admission asked before it.
    #[test]
    fn a_later_admission_lifts_the_denials_it_disproves() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let k = (0, Key::new("k"));
        let admit = Decision::admit(10, 5, Duration::ZERO);
        c.remember(k.clone(), 5, &denial(30_000, 60_000), asked(&c, &k, 1_000));
        c.remember(k.clone(), 5, &admit, asked(&c, &k, 500));
        assert!(
            c.get_in_outage(&k, 5, 2_000).is_some(),
            "asked before the denial"
        );
        c.remember(k.clone(), 1, &admit, asked(&c, &k, 1_500));
        assert!(
            c.get_in_outage(&k, 5, 2_000).is_some(),
            "a smaller cost proves nothing"
        );
        c.remember(k.clone(), 5, &admit, asked(&c, &k, 1_500));
        assert!(
            c.get_in_outage(&k, 5, 2_000).is_none(),
            "the same cost fits again"
        );
        let listed = Decision {
            listed: crate::decision::ByListing::DENY,
            ..denial(86_400_000, 86_400_000)
        };
        c.remember(k.clone(), 5, &listed, asked(&c, &k, 3_000));
        c.remember(k.clone(), 1, &admit, asked(&c, &k, 3_500));
        assert!(
            c.get_in_outage(&k, 5, 4_000).is_none(),
            "the listing is gone"
        );
    }

    /// The count of denials held, which lets admissions skip the cache, follows every way in
    /// and out: remembered, lifted, over its time, forgotten, cleared.
    #[test]
    fn the_count_of_denials_held_follows_every_change() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let (a, b) = ((0, Key::new("a")), (0, Key::new("b")));
        assert!(c.is_empty());
        c.remember(a.clone(), 1, &denial(1_000, 1_000), asked(&c, &a, 0));
        c.remember(a.clone(), 1, &denial(1_000, 1_000), asked(&c, &a, 10));
        c.remember(b.clone(), 1, &denial(1_000, 1_000), asked(&c, &b, 0));
        assert_eq!(c.held.load(Ordering::Relaxed), 2, "a key counts once");
        c.remember(
            a.clone(),
            1,
            &Decision::admit(10, 5, Duration::ZERO),
            asked(&c, &a, 20),
        );
        assert_eq!(c.held.load(Ordering::Relaxed), 1, "lifted");
        assert!(c.get(&b, 1, 2_000_000).is_none());
        assert!(c.is_empty(), "over its time");
        c.remember(b.clone(), 1, &denial(1_000, 1_000), asked(&c, &b, 0));
        c.forget(&Key::new("b"));
        assert!(c.is_empty(), "forgotten");
        c.remember(b.clone(), 1, &denial(1_000, 1_000), asked(&c, &b, 0));
        c.clear();
        assert!(c.is_empty(), "cleared");
    }

    /// A reply in flight while its key is reset or unblocked (or the quotas change) lands
    /// after the cache forgot the key: the refusal the reset lifted is not put back.
    #[test]
    fn a_denial_asked_before_a_forget_is_not_remembered() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let k = (0, Key::new("k"));
        let in_flight = asked(&c, &k, 0);
        c.forget(&Key::new("k"));
        c.remember(k.clone(), 1, &denial(30_000, 60_000), in_flight);
        assert!(c.get(&k, 1, 1).is_none(), "asked before the forget");
        let in_flight = asked(&c, &k, 0);
        c.clear();
        c.remember(k.clone(), 1, &denial(30_000, 60_000), in_flight);
        assert!(c.get(&k, 1, 1).is_none(), "asked before the clear");
        c.remember(k.clone(), 1, &denial(30_000, 60_000), asked(&c, &k, 0));
        assert!(c.get(&k, 1, 1).is_some(), "asked after both");
        // Forgetting the keys of other shards (the penalty box blocking them) leaves this
        // one's replies in flight remembered.
        let other = (0, Key::new("other"));
        let in_flight = asked(&c, &other, 0);
        for i in 0..64u32 {
            let key = Key::new(i.to_be_bytes());
            if c.index(&key) != c.index(&other.1) {
                c.forget(&key);
            }
        }
        c.remember(other.clone(), 1, &denial(30_000, 60_000), in_flight);
        assert!(c.get(&other, 1, 1).is_some(), "other keys were forgotten");
    }

    /// The same, through a limiter: a refusal decided before a reset and answered after it is
    /// not remembered, so the reset key's next request goes to the store and is admitted.
    #[tokio::test(start_paused = true)]
    async fn a_refusal_in_flight_across_a_reset_is_not_remembered() {
        use crate::store::testing::Link;
        use crate::{Limiter, ManualClock, MemoryStore, Quota, Rule};
        let clock = ManualClock::new(1_900_000_000_000_000);
        let store = Link::new(
            MemoryStore::builder().clock(clock.clone()).build().unwrap(),
            Duration::ZERO,
            Duration::from_millis(50),
        );
        let rule = Rule::new("r", Quota::per_minute(1).build().unwrap()).unwrap();
        let limiter = Limiter::builder(store)
            .rule(rule)
            .on_store_error(crate::OnStoreError::fail_closed())
            .clock(clock.clone())
            .build()
            .unwrap();
        let key = Key::new("k");
        assert!(limiter.consume(&key, 1).await.unwrap().allowed);
        let in_flight = {
            let (limiter, key) = (limiter.clone(), key.clone());
            tokio::spawn(async move { limiter.consume(&key, 1).await.unwrap() })
        };
        // Decided (refused) now, answered 50 ms later: reset meanwhile.
        tokio::task::yield_now().await;
        limiter.reset(&key).await.unwrap();
        let refused = in_flight.await.unwrap();
        assert!(!refused.allowed, "decided before the reset");
        let after = limiter.consume(&key, 1).await.unwrap();
        assert!(after.allowed, "the reset stands: {after:?}");
    }

    #[test]
    fn in_an_outage_a_denial_stands_until_the_stores_retry_time() {
        let c = DenialCache::new(100, Duration::from_secs(1));
        let k = (0, Key::new("k"));
        c.remember(k.clone(), 1, &denial(30_000, 60_000), asked(&c, &k, 0));
        assert!(
            c.get(&k, 1, 5_000_000).is_none(),
            "past max_age: ask the store"
        );
        let d = c.get_in_outage(&k, 1, 5_000_000).unwrap();
        assert_eq!(d.retry_after, Some(Duration::from_secs(25)));
        assert!(c.get_in_outage(&k, 2, 5_000_000).is_none(), "another cost");
        assert!(
            c.get_in_outage(&k, 1, 30_000_000).is_none(),
            "its time has come"
        );
        assert!(
            c.get_in_outage(&k, 1, 5_000_000).is_none(),
            "forgotten once over"
        );
    }

    #[test]
    fn a_denial_is_trusted_for_max_age_at_most() {
        let c = DenialCache::new(100, Duration::from_secs(1));
        let k = (0, Key::new("k"));
        c.remember(k.clone(), 1, &denial(30_000, 60_000), asked(&c, &k, 0));
        let d = c.get(&k, 1, 999_999).unwrap();
        assert_eq!(
            d.retry_after,
            Some(Duration::from_micros(29_000_001)),
            "the store's own wait, counted down"
        );
        assert!(
            c.get(&k, 1, 1_000_000).is_none(),
            "past max_age the store is asked again"
        );
    }

    #[test]
    fn admissions_and_permanent_denials_are_not_remembered() {
        let c = DenialCache::new(100, Duration::from_secs(60));
        let k = (0, Key::new("k"));
        c.remember(
            k.clone(),
            1,
            &Decision::admit(10, 9, Duration::ZERO),
            asked(&c, &k, 0),
        );
        c.remember(
            k.clone(),
            50,
            &Decision::deny(10, 0, Duration::ZERO, None),
            asked(&c, &k, 0),
        );
        assert!(c.get(&k, 1, 1).is_none());
        assert!(c.get(&k, 50, 1).is_none());
    }

    #[test]
    fn bounded_forgetting_the_first_to_end() {
        let c = DenialCache::new(SHARDS, Duration::from_secs(60));
        for i in 0..1_000u64 {
            c.remember(
                (0, Key::new(i.to_be_bytes())),
                1,
                &denial(10 + i, 10 + i),
                asked(&c, &(0, Key::new(i.to_be_bytes())), 0),
            );
        }
        let held: usize = c.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= SHARDS, "{held}");
        c.forget(&Key::new(999u64.to_be_bytes()));
        assert!(c.get(&(0, Key::new(999u64.to_be_bytes())), 1, 1).is_none());
    }
}
