//! Quotas loaded asynchronously (a tenant's plan from a database or over HTTP), cached with a
//! bound, a time to live, and one load per key at a time.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
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
/// load is not cached (the next request tries again). When full, expired entries go first,
/// then any. Cheap to clone; clones share the cache.
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
            .field("len", &self.inner.entries.lock().len())
            .finish()
    }
}

struct Inner<K> {
    entries: Mutex<HashMap<K, Arc<Entry>>>,
    capacity: usize,
    ttl: Duration,
}

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
                entries: Mutex::new(HashMap::new()),
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
        self.inner.entries.lock().remove(key);
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner.entries.lock().len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn entry(&self, key: &K) -> Arc<Entry> {
        let inner = &self.inner;
        let now = Instant::now();
        let expired =
            |e: &Entry| e.quota.initialized() && now.duration_since(e.created) >= inner.ttl;
        let mut entries = inner.entries.lock();
        if let Some(e) = entries.get(key) {
            if !expired(e) {
                return e.clone();
            }
        }
        if entries.len() >= inner.capacity && !entries.contains_key(key) {
            entries.retain(|_, e| !expired(e));
            if entries.len() >= inner.capacity {
                if let Some(any) = entries.keys().next().cloned() {
                    entries.remove(&any);
                }
            }
        }
        let fresh = Arc::new(Entry {
            quota: OnceCell::new(),
            created: now,
        });
        entries.insert(key.clone(), fresh.clone());
        fresh
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
}
