//! Quotas loaded asynchronously (a tenant's plan from a database or over HTTP), cached with a
//! bound, a time to live, and one load per key at a time.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::{ConfigError, Quota};

/// A bounded cache of quotas by key (a tenant id, an API key), for quotas resolved per
/// request: look the plan up in your authentication middleware with
/// [`get`](QuotaCache::get), put the quota in the request's extensions, and read it with
/// [`Scope::quota`](crate::layer::Scope::quota).
///
/// Concurrent requests for a key that is not loaded wait for one load (single flight); a
/// loaded quota (or "no quota of its own": `None`) is reused for the time to live; a failed
/// load is not cached (the next request tries again). When full, the oldest entry that holds a
/// quota goes (expired entries are the oldest), or one whose load failed, was given up or has
/// run a whole time to live; a load still in flight is dropped only when every entry is one,
/// so a spray of new keys neither breaks single flight nor grows the cache past its capacity.
/// Making room looks past the loads in flight at most, never through the whole cache. Cheap
/// to clone; clones share the cache.
///
/// ```
/// use std::time::Duration;
/// use fleetlimit::{Quota, QuotaCache};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let plans: QuotaCache<String> = QuotaCache::new(10_000, Duration::from_secs(60))?;
/// let quota = plans
///     .get(&"tenant-1".to_owned(), || async {
///         // SELECT per_minute FROM plans WHERE tenant = $1
///         Ok::<_, std::io::Error>(Some(Quota::per_minute(600).build().expect("valid")))
///     })
///     .await?;
/// assert_eq!(quota.map(|q| q.limit()), Some(600));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub struct QuotaCache<K> {
    inner: Arc<Inner<K>>,
}

impl<K> Clone for QuotaCache<K> {
    fn clone(&self) -> Self {
        QuotaCache {
            inner: self.inner.clone(),
        }
    }
}

impl<K> std::fmt::Debug for QuotaCache<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaCache")
            .field("capacity", &self.inner.capacity)
            .field("ttl", &self.inner.ttl)
            .field("len", &self.inner.held.lock().entries.len())
            .finish()
    }
}

struct Inner<K> {
    held: Mutex<Held<K>>,
    capacity: usize,
    ttl: Duration,
}

struct Held<K> {
    entries: HashMap<K, Arc<Entry>>,
    /// Every entry in the order it was made (one time to live for all: the front expires
    /// first), and entries since replaced or invalidated, skipped when met.
    order: VecDeque<(K, Weak<Entry>)>,
}

/// A cached quota, or its load. Requests hold a clone of its `Arc` while they wait on it, and
/// the order only a `Weak`: an empty entry whose only holder is the map is one nobody waits
/// on (its load failed or was given up), not a load in flight.
struct Entry {
    quota: OnceCell<Option<Quota>>,
    created: Instant,
}

impl<K: Hash + Eq + Clone> QuotaCache<K> {
    /// A cache of at most `capacity` keys, each loaded quota kept for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> Result<QuotaCache<K>, ConfigError> {
        if capacity == 0 || ttl.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "QuotaCache",
                reason: "needs a capacity of at least 1 and a non-zero time to live".into(),
            });
        }
        Ok(QuotaCache {
            inner: Arc::new(Inner {
                held: Mutex::new(Held {
                    entries: HashMap::new(),
                    order: VecDeque::new(),
                }),
                capacity,
                ttl,
            }),
        })
    }

    /// `key`'s quota: cached, or loaded by `load` (once, however many requests ask at the same
    /// time). An error from `load` is returned and not cached.
    pub async fn get<F, Fut, E>(&self, key: &K, load: F) -> Result<Option<Quota>, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Option<Quota>, E>>,
    {
        let entry = self.entry(key);
        entry.quota.get_or_try_init(load).await.cloned()
    }

    /// Forget `key`'s quota (its plan changed): the next request loads it again.
    pub fn invalidate(&self, key: &K) {
        self.inner.held.lock().entries.remove(key);
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner.held.lock().entries.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `key`'s entry, made if needed. Handed out under the lock, so an entry's holders only
    /// grow while the lock is held ([`Held::evict_one`] counts them).
    fn entry(&self, key: &K) -> Arc<Entry> {
        let inner = &self.inner;
        let now = Instant::now();
        let mut held = inner.held.lock();
        if let Some(e) = held.entries.get(key) {
            if !(e.quota.initialized() && now.duration_since(e.created) >= inner.ttl) {
                return e.clone();
            }
        }
        while held.entries.len() >= inner.capacity && !held.entries.contains_key(key) {
            if !held.evict_one(now, inner.ttl) {
                break;
            }
        }
        let fresh = Arc::new(Entry {
            quota: OnceCell::new(),
            created: now,
        });
        held.entries.insert(key.clone(), fresh.clone());
        held.order.push_back((key.clone(), Arc::downgrade(&fresh)));
        // Replaced and invalidated entries leave their place in the order behind: sweep them
        // out once they are as many as the cache holds, an amortised constant per insert.
        if held.order.len() > inner.capacity.saturating_mul(2).saturating_add(16) {
            let Held { entries, order } = &mut *held;
            order.retain(|(k, made)| current(entries, k, made).is_some());
        }
        fresh
    }
}

/// `key`'s entry, if it is still the one `made` refers to.
fn current<'a, K: Hash + Eq>(
    entries: &'a HashMap<K, Arc<Entry>>,
    key: &K,
    made: &Weak<Entry>,
) -> Option<&'a Arc<Entry>> {
    entries
        .get(key)
        .filter(|e| std::ptr::eq(Arc::as_ptr(e), made.as_ptr()))
}

impl<K: Hash + Eq> Held<K> {
    /// Drop one entry to make room: the oldest that holds a quota, that nobody waits on (its
    /// load failed or was given up) or whose load has run a whole time to live, else the oldest
    /// load in flight. Entries replaced since are swept out on the way. Whether one was dropped.
    fn evict_one(&mut self, now: Instant, ttl: Duration) -> bool {
        let mut oldest_loading = None;
        let mut i = 0;
        while let Some((key, made)) = self.order.get(i) {
            let evictable = match current(&self.entries, key, made) {
                None => {
                    self.order.remove(i);
                    continue;
                }
                Some(e) => {
                    e.quota.initialized()
                        || Arc::strong_count(e) == 1
                        || now.duration_since(e.created) >= ttl
                }
            };
            if evictable {
                return self.evict_at(i);
            }
            oldest_loading.get_or_insert(i);
            i += 1;
        }
        oldest_loading.is_some_and(|i| self.evict_at(i))
    }

    fn evict_at(&mut self, i: usize) -> bool {
        match self.order.remove(i) {
            Some((key, _)) => self.entries.remove(&key).is_some(),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn quota(n: u64) -> Option<Quota> {
        Some(Quota::per_minute(n).build().unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn one_load_per_key_at_a_time_then_cached_for_the_ttl() {
        let cache: QuotaCache<u32> = QuotaCache::new(10, Duration::from_secs(60)).unwrap();
        let loads = Arc::new(AtomicU64::new(0));
        let load = |n: u64| {
            let loads = loads.clone();
            move || async move {
                loads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, ()>(quota(n))
            }
        };
        let waiting: Vec<_> = (0..20)
            .map(|_| {
                let cache = cache.clone();
                let load = load(600);
                tokio::spawn(async move { cache.get(&7, load).await })
            })
            .collect();
        for w in waiting {
            assert_eq!(w.await.unwrap().unwrap().map(|q| q.limit()), Some(600));
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1, "single flight");
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(cache.get(&7, load(1)).await.unwrap(), quota(600));
        assert_eq!(loads.load(Ordering::SeqCst), 1, "cached");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(cache.get(&7, load(60)).await.unwrap(), quota(60), "expired");
        assert_eq!(loads.load(Ordering::SeqCst), 2);
        cache.invalidate(&7);
        assert_eq!(cache.get(&7, load(6)).await.unwrap(), quota(6));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_not_cached_and_the_cache_is_bounded() {
        let cache: QuotaCache<u32> = QuotaCache::new(2, Duration::from_secs(60)).unwrap();
        let failed = cache
            .get(&1, || async { Err::<Option<Quota>, _>("db down") })
            .await;
        assert_eq!(failed, Err("db down"));
        let ok = cache.get(&1, || async { Ok::<_, &str>(quota(5)) }).await;
        assert_eq!(ok, Ok(quota(5)), "tried again");
        for k in 2..10 {
            cache.get(&k, || async { Ok::<_, ()>(None) }).await.unwrap();
            assert!(cache.len() <= 2);
        }
        assert!(QuotaCache::<u32>::new(0, Duration::from_secs(1)).is_err());
        assert!(QuotaCache::<u32>::new(1, Duration::ZERO).is_err());
    }

    /// A slow load for `key` started in a task, and how many loads ran for it.
    fn slow_load(
        cache: &QuotaCache<u32>,
        key: u32,
        loads: &Arc<AtomicU64>,
    ) -> tokio::task::JoinHandle<Option<Quota>> {
        let (cache, loads) = (cache.clone(), loads.clone());
        tokio::spawn(async move {
            cache
                .get(&key, || async move {
                    loads.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Ok::<_, ()>(quota(60))
                })
                .await
                .unwrap()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_spray_of_new_keys_evicts_settled_entries_before_a_load_in_flight() {
        let cache: QuotaCache<u32> = QuotaCache::new(2, Duration::from_secs(60)).unwrap();
        let loads = Arc::new(AtomicU64::new(0));
        let first = slow_load(&cache, 1, &loads);
        tokio::task::yield_now().await;
        assert_eq!(
            loads.load(Ordering::SeqCst),
            1,
            "the load of key 1 is in flight"
        );
        // New keys, each loaded at once, while key 1's load runs: the oldest entry is key 1's,
        // but it is loading, so the settled ones make room.
        for k in 2..50 {
            cache.get(&k, || async { Ok::<_, ()>(None) }).await.unwrap();
            assert!(cache.len() <= 2, "bounded: {} held", cache.len());
        }
        // A second request for key 1 joins the load in flight instead of starting another.
        let second = slow_load(&cache, 1, &loads);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(first.await.unwrap(), quota(60));
        assert_eq!(second.await.unwrap(), quota(60));
        assert_eq!(
            loads.load(Ordering::SeqCst),
            1,
            "single flight kept under the spray"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_oldest_entry_makes_room_and_a_cache_of_loads_stays_bounded() {
        let cache: QuotaCache<u32> = QuotaCache::new(3, Duration::from_secs(60)).unwrap();
        let loads = Arc::new(AtomicU64::new(0));
        let counted = |n: u64| {
            let loads = loads.clone();
            move || async move {
                loads.fetch_add(1, Ordering::SeqCst);
                Ok::<_, ()>(quota(n))
            }
        };
        for k in 1..=4 {
            cache.get(&k, counted(u64::from(k))).await.unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(loads.load(Ordering::SeqCst), 4);
        for k in 2..=4 {
            assert_eq!(
                cache.get(&k, counted(0)).await.unwrap(),
                quota(u64::from(k)),
                "key {k} kept"
            );
        }
        assert_eq!(loads.load(Ordering::SeqCst), 4, "2, 3 and 4 were cached");
        assert_eq!(cache.get(&1, counted(1)).await.unwrap(), quota(1));
        assert_eq!(
            loads.load(Ordering::SeqCst),
            5,
            "1, the oldest, made room for 4"
        );

        // Every entry a load in flight: a new key still finds room (the oldest load goes; its
        // waiters still get their quota).
        let cache: QuotaCache<u32> = QuotaCache::new(2, Duration::from_secs(60)).unwrap();
        let in_flight: Vec<_> = (0..5).map(|k| slow_load(&cache, k, &loads)).collect();
        tokio::task::yield_now().await;
        assert!(cache.len() <= 2, "bounded: {} held", cache.len());
        tokio::time::advance(Duration::from_secs(2)).await;
        for load in in_flight {
            assert_eq!(load.await.unwrap(), quota(60));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn invalidations_leave_no_trail() {
        let cache: QuotaCache<u32> = QuotaCache::new(4, Duration::from_secs(60)).unwrap();
        for round in 0..1_000u32 {
            let k = round % 8;
            cache.get(&k, || async { Ok::<_, ()>(None) }).await.unwrap();
            cache.invalidate(&k);
            // Replacing expired entries leaves places behind too.
            tokio::time::advance(Duration::from_secs(7)).await;
            let held = cache.inner.held.lock();
            assert!(held.entries.len() <= 4);
            assert!(
                held.order.len() <= 2 * 4 + 16 + 1,
                "{} places kept",
                held.order.len()
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failed_and_abandoned_loads_make_room_first() {
        let cache: QuotaCache<u32> = QuotaCache::new(3, Duration::from_secs(60)).unwrap();
        let loads = Arc::new(AtomicU64::new(0));
        // Key 1's load fails; key 2's is given up (its request dropped); key 3 is settled.
        let failed = cache
            .get(&1, || async { Err::<Option<Quota>, _>("db down") })
            .await;
        assert!(failed.is_err());
        let abandoned = slow_load(&cache, 2, &loads);
        tokio::task::yield_now().await;
        abandoned.abort();
        assert!(abandoned.await.is_err(), "given up");
        cache
            .get(&3, || async { Ok::<_, ()>(quota(3)) })
            .await
            .unwrap();
        // Two new keys: the failed and the abandoned entries make room, not key 3.
        for k in [4, 5] {
            cache.get(&k, || async { Ok::<_, ()>(None) }).await.unwrap();
        }
        let reloaded = cache
            .get(&3, || async { Ok::<_, ()>(quota(33)) })
            .await
            .unwrap();
        assert_eq!(reloaded, quota(3), "key 3 stayed cached");
        assert!(cache.len() <= 3);
    }
}
