//! Remembered listings: the keys this process has seen the store decide by an administrator's
//! entry (allow, deny, block), so that the entry still decides them while the store cannot be
//! asked, and so that a hot key decided by its listing skips leasing.
//!
//! Promise: while the store answers, this memory decides nothing (the store is asked, and its
//! listing outranks the memory's). In an outage, a key remembered as refused stays refused until
//! the listing's own end (a deny-list entry: its day), on every rule, at any cost, whatever the
//! policy; a key remembered as allowed is admitted without counting, whatever the policy. A
//! listing is learnt from any store decision made by it and from this process's own admin calls;
//! it is forgotten when the store decides the key by its quotas again, when this process lifts
//! it, and when a block ends. Bounded: at most [`CAPACITY`] keys, those that end first forgotten
//! first (an allow entry ends last).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::store::Listing;
use crate::{Decision, Key, Source};

/// At most this many listed keys remembered (operators list few keys; a penalty box can block
/// many, and those end first).
pub(crate) const CAPACITY: usize = 65_536;

#[derive(Debug, Clone, Copy)]
struct Remembered {
    /// Refused until (µs, the limiter's clock); `None`: allowed.
    refused_until: Option<u64>,
    /// The store's decision by the listing, for the numbers of the headers (`None` when learnt
    /// from an admin call: no numbers known).
    decision: Option<Decision>,
    /// When it was learnt (µs), to count `reset_after` down.
    learnt_at: u64,
}

impl Remembered {
    fn ends(&self) -> u64 {
        self.refused_until.unwrap_or(u64::MAX)
    }
}

/// The listed keys this process knows of.
#[derive(Debug, Default)]
pub(crate) struct ListingMemory {
    keys: Mutex<HashMap<Key, Remembered>>,
    /// How many keys `keys` holds, read without the lock: most decisions are of unlisted keys
    /// and nothing is remembered.
    len: AtomicUsize,
}

impl ListingMemory {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Remembered>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Learn from a store decision `d` of `key`, asked for at `asked_at` (so a remembered wait
    /// never outlasts the store's).
    #[inline]
    pub(crate) fn observe(&self, key: &Key, d: &Decision, asked_at: u64) {
        if !d.listed {
            if self.len.load(Ordering::Acquire) > 0 {
                self.forget(key);
            }
            return;
        }
        let refused_until = match (d.allowed, d.retry_after) {
            (true, _) => None,
            (false, Some(wait)) => Some(asked_at.saturating_add(micros(wait))),
            // A listing always says when to come back; nothing to learn from this.
            (false, None) => return,
        };
        self.insert(
            key,
            Remembered {
                refused_until,
                decision: Some(*d),
                learnt_at: asked_at,
            },
        );
    }

    /// Learn this process's own admin call: `key` is now listed as `listing` (or not at all).
    pub(crate) fn set(&self, key: &Key, listing: Option<Listing>, now: u64) {
        let refused_until = match listing {
            None => return self.forget(key),
            Some(Listing::Allow) => None,
            Some(Listing::Deny) => Some(now.saturating_add(micros(crate::store::DENY_RETRY_AFTER))),
            Some(Listing::Block(d)) => Some(now.saturating_add(micros(d))),
        };
        self.insert(
            key,
            Remembered {
                refused_until,
                decision: None,
                learnt_at: now,
            },
        );
    }

    /// Whether `key` is remembered as listed at `now` (its requests are decided one by one).
    #[inline]
    pub(crate) fn is_listed(&self, key: &Key, now: u64) -> bool {
        self.len.load(Ordering::Acquire) > 0
            && self
                .keys()
                .get(key)
                .is_some_and(|r| r.refused_until.is_none_or(|t| t > now))
    }

    /// The listing's decision for a check of `key` under a quota of `limit` while the store
    /// cannot be asked: refused with the wait to the listing's end, or admitted counting
    /// nothing. `None` when the key is not remembered as listed.
    pub(crate) fn in_outage(&self, key: &Key, limit: u64, now: u64) -> Option<Decision> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let r = *self.keys().get(key)?;
        if r.refused_until.is_some_and(|t| t <= now) {
            self.forget(key);
            return None;
        }
        let elapsed = Duration::from_micros(now.saturating_sub(r.learnt_at));
        let mut d = match r.decision {
            Some(mut d) => {
                d.reset_after = d.reset_after.saturating_sub(elapsed);
                d
            }
            None => Decision::admit(limit, limit, Duration::ZERO),
        };
        d.allowed = r.refused_until.is_none();
        d.retry_after = r
            .refused_until
            .map(|t| Duration::from_micros(t.saturating_sub(now)));
        if !d.allowed {
            d.remaining = 0;
        }
        d.source = Source::Cache;
        d.degraded = true;
        d.taken = None;
        Some(d)
    }

    fn insert(&self, key: &Key, r: Remembered) {
        let mut keys = self.keys();
        if keys.len() >= CAPACITY && !keys.contains_key(key) {
            let now = r.learnt_at;
            keys.retain(|_, r| r.ends() > now);
            if keys.len() >= CAPACITY {
                if let Some(first) = keys
                    .iter()
                    .min_by_key(|(_, r)| r.ends())
                    .map(|(k, _)| k.clone())
                {
                    keys.remove(&first);
                }
            }
        }
        keys.insert(key.clone(), r);
        self.len.store(keys.len(), Ordering::Release);
    }

    fn forget(&self, key: &Key) {
        let mut keys = self.keys();
        if keys.remove(key).is_some() {
            self.len.store(keys.len(), Ordering::Release);
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> Key {
        Key::new(s)
    }

    fn by_listing(d: Decision) -> Decision {
        Decision { listed: true, ..d }
    }

    fn refused_by_listing(wait_ms: u64) -> Decision {
        by_listing(Decision::deny(
            10,
            4,
            Duration::from_secs(6),
            Some(Duration::from_millis(wait_ms)),
        ))
    }

    #[test]
    fn a_refusal_by_a_listing_stands_until_the_listing_ends_at_any_limit() {
        let m = ListingMemory::default();
        m.observe(&key("k"), &refused_by_listing(2_000), 1_000_000);
        let d = m
            .in_outage(&key("k"), 999, 2_000_000)
            .unwrap_or_else(|| panic!("remembered"));
        assert!(!d.allowed && d.degraded);
        assert_eq!(d.source, Source::Cache);
        assert_eq!(d.retry_after, Some(Duration::from_millis(1_000)));
        assert_eq!(d.reset_after, Duration::from_secs(5));
        assert_eq!((d.limit, d.remaining), (10, 0));
        assert!(m.is_listed(&key("k"), 2_999_999));
        assert!(
            m.in_outage(&key("k"), 10, 3_000_000).is_none(),
            "the block ended"
        );
        assert!(!m.is_listed(&key("k"), 3_000_000));
        assert!(m.in_outage(&key("other"), 10, 2_000_000).is_none());
    }

    #[test]
    fn an_allow_listing_admits_counting_nothing_until_the_store_says_otherwise() {
        let m = ListingMemory::default();
        let allowed = by_listing(Decision::admit(10, 7, Duration::from_secs(3)));
        m.observe(&key("k"), &allowed, 0);
        let d = m
            .in_outage(&key("k"), 10, u64::MAX / 2)
            .unwrap_or_else(|| panic!("remembered"));
        assert!(d.allowed && d.degraded && d.taken.is_none());
        assert_eq!(d.retry_after, None);
        // The store decides the key by its quotas again: the listing was lifted.
        m.observe(&key("k"), &Decision::admit(10, 7, Duration::ZERO), 5);
        assert!(m.in_outage(&key("k"), 10, 6).is_none());
        assert!(!m.is_listed(&key("k"), 6));
    }

    #[test]
    fn admin_calls_are_learnt_and_lifted() {
        let m = ListingMemory::default();
        m.set(&key("d"), Some(Listing::Deny), 0);
        m.set(&key("b"), Some(Listing::Block(Duration::from_secs(1))), 0);
        m.set(&key("a"), Some(Listing::Allow), 0);
        let deny = m
            .in_outage(&key("d"), 5, 0)
            .unwrap_or_else(|| panic!("deny"));
        assert_eq!(deny.retry_after, Some(crate::store::DENY_RETRY_AFTER));
        assert_eq!(deny.limit, 5);
        let block = m
            .in_outage(&key("b"), 5, 400_000)
            .unwrap_or_else(|| panic!("block"));
        assert_eq!(block.retry_after, Some(Duration::from_millis(600)));
        assert!(m.in_outage(&key("a"), 5, 0).is_some_and(|d| d.allowed));
        m.set(&key("d"), None, 1);
        assert!(m.in_outage(&key("d"), 5, 1).is_none());
    }

    #[test]
    fn a_decision_without_a_wait_teaches_nothing_nor_does_an_unlisted_one() {
        let m = ListingMemory::default();
        let never = by_listing(Decision::deny(1, 0, Duration::ZERO, None));
        m.observe(&key("k"), &never, 0);
        assert_eq!(m.len.load(Ordering::Acquire), 0);
        m.observe(&key("k"), &Decision::deny(1, 0, Duration::ZERO, None), 0);
        assert_eq!(m.len.load(Ordering::Acquire), 0);
    }

    #[test]
    fn full_it_forgets_what_ends_first() {
        let m = ListingMemory::default();
        for i in 0..CAPACITY as u64 {
            m.observe(&key(&format!("k{i}")), &refused_by_listing(1_000 + i), 0);
        }
        m.set(&key("allowed"), Some(Listing::Allow), 0);
        assert_eq!(m.len.load(Ordering::Acquire), CAPACITY);
        assert!(!m.is_listed(&key("k0"), 0), "the block ending first went");
        assert!(m.is_listed(&key("k1"), 0));
        assert!(m.is_listed(&key("allowed"), 0));
    }
}
