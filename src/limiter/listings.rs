//! Remembered listings: the keys this process has seen the store decide by an administrator's
//! entry (allow, deny, block), so that the entry still decides them while the store cannot be
//! asked, and so that a hot key decided by its listing skips leasing.
//!
//! Promise: while the store answers, this memory decides nothing (the store is asked, and its
//! listing outranks the memory's). In an outage, a key remembered as refused stays refused until
//! the listing's own end (a block's, rounded up to the second; the deny list's day), on every
//! rule, at any cost, whatever the policy; a key remembered as allowed is admitted without
//! counting, whatever the policy, for [`ALLOW_TRUSTED`] after the store last said so (the
//! store may have lifted it since). A listing is learnt from the store's decisions and from this
//! process's own admin calls; it is forgotten when the store decides the key by its quotas
//! again, when this process lifts it, and when a block ends. An answer asked for before the
//! latest thing learnt about the key teaches nothing (a listing lifted here is not brought back
//! by an answer still in flight). Bounded: at most [`CAPACITY`] keys, those that end first
//! forgotten first, an eighth at a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::algorithm::micros;
use crate::store::Listing;
use crate::{Decision, Key, Source};

/// At most this many listed keys remembered (operators list few keys; a penalty box can block
/// many, and those end first).
pub(crate) const CAPACITY: usize = 65_536;

/// How long an allow listing is trusted in an outage after the store last applied it.
pub(crate) const ALLOW_TRUSTED: Duration = Duration::from_secs(600);

/// A listing lifted here is remembered as lifted this long, for answers still in flight (a
/// store call never outlives its deadline, and deadlines are far shorter).
const LIFTED_KEPT: u64 = 10_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Refused until (µs, the limiter's clock).
    RefusedUntil(u64),
    /// Admitted, counting nothing.
    Allowed,
    /// Lifted by this process at `learnt_at`.
    Lifted,
}

#[derive(Debug, Clone, Copy)]
struct Remembered {
    known: Known,
    /// The store's decision by the listing, for the numbers of the headers (`None` when learnt
    /// from an admin call: no numbers known).
    decision: Option<Decision>,
    /// When it was learnt (µs): the time the store was asked, or the admin call's.
    learnt_at: u64,
}

impl Remembered {
    /// When it stops mattering (µs).
    fn ends(&self) -> u64 {
        match self.known {
            Known::RefusedUntil(t) => t,
            Known::Allowed => self.learnt_at.saturating_add(micros(ALLOW_TRUSTED)),
            Known::Lifted => self.learnt_at.saturating_add(LIFTED_KEPT),
        }
    }

    /// Whether it still decides the key at `now`.
    fn decides(&self, now: u64) -> bool {
        self.known != Known::Lifted && self.ends() > now
    }
}

/// The listed keys this process knows of.
#[derive(Debug, Default)]
pub(crate) struct ListingMemory {
    keys: parking_lot::RwLock<HashMap<Key, Remembered>>,
    /// How many keys `keys` holds, read without the lock: most decisions are of unlisted keys
    /// and nothing is remembered.
    len: AtomicUsize,
}

impl ListingMemory {
    /// Learn from a store decision `d` of `key`, asked for at `asked_at` (so a remembered wait
    /// never outlasts the store's).
    #[inline]
    pub(crate) fn observe(&self, key: &Key, d: &Decision, asked_at: u64) {
        if !d.listed.is_listed() {
            if self.len.load(Ordering::Acquire) > 0 && self.keys.read().contains_key(key) {
                self.update(key, asked_at, None);
            }
            return;
        }
        let known = if d.allowed {
            Known::Allowed
        } else if let Some(left) = d.listed.block_left() {
            Known::RefusedUntil(asked_at.saturating_add(micros(left)))
        } else {
            let wait = d.retry_after.unwrap_or(crate::store::DENY_RETRY_AFTER);
            Known::RefusedUntil(asked_at.saturating_add(micros(wait)))
        };
        let r = Remembered {
            known,
            decision: Some(*d),
            learnt_at: asked_at,
        };
        self.update(key, asked_at, Some(r));
    }

    /// Learn this process's own admin call: `key` is now listed as `listing` (or not at all).
    pub(crate) fn set(&self, key: &Key, listing: Option<Listing>, now: u64) {
        let known = match listing {
            None => Known::Lifted,
            Some(Listing::Allow) => Known::Allowed,
            Some(Listing::Deny) => {
                Known::RefusedUntil(now.saturating_add(micros(crate::store::DENY_RETRY_AFTER)))
            }
            Some(Listing::Block(d)) => Known::RefusedUntil(now.saturating_add(micros(d))),
        };
        let r = Remembered {
            known,
            decision: None,
            learnt_at: now,
        };
        self.update(key, now, Some(r));
    }

    /// Whether `key` is remembered as listed at `now` (its requests are decided one by one).
    #[inline]
    pub(crate) fn is_listed(&self, key: &Key, now: u64) -> bool {
        self.len.load(Ordering::Acquire) > 0
            && self.keys.read().get(key).is_some_and(|r| r.decides(now))
    }

    /// The listing's decision for a check of `key` under a quota of `limit` while the store
    /// cannot be asked: refused with the wait to the listing's end, or admitted counting
    /// nothing. The headers' numbers are the store's last answer when it was for a quota of
    /// the same limit (another rule's would describe that rule), else the limit alone. `None`
    /// when the key is not remembered as listed.
    pub(crate) fn in_outage(&self, key: &Key, limit: u64, now: u64) -> Option<Decision> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let r = *self.keys.read().get(key)?;
        if !r.decides(now) {
            return None;
        }
        let elapsed = Duration::from_micros(now.saturating_sub(r.learnt_at));
        let mut d = match r.decision.filter(|d| d.limit == limit) {
            Some(mut d) => {
                d.reset_after = d.reset_after.saturating_sub(elapsed);
                d
            }
            None => Decision::admit(limit, limit, Duration::ZERO),
        };
        match r.known {
            Known::RefusedUntil(t) => {
                let wait = Duration::from_micros(t.saturating_sub(now));
                d.allowed = false;
                d.remaining = 0;
                d.retry_after = Some(wait);
                d.reset_after = d.reset_after.max(wait);
            }
            Known::Allowed | Known::Lifted => {
                d.allowed = true;
                d.retry_after = None;
            }
        }
        d.source = Source::Cache;
        d.degraded = true;
        d.taken = None;
        Some(d)
    }

    /// Put `r` in `key`'s place (or take it out), unless something was learnt about the key
    /// after `asked_at` (then this is an older answer).
    fn update(&self, key: &Key, asked_at: u64, r: Option<Remembered>) {
        let mut keys = self.keys.write();
        if keys.get(key).is_some_and(|old| old.learnt_at > asked_at) {
            return;
        }
        match r {
            None => {
                keys.remove(key);
            }
            Some(r) => {
                if keys.len() >= CAPACITY && !keys.contains_key(key) {
                    make_room(&mut keys, asked_at);
                }
                keys.insert(key.clone(), r);
            }
        }
        self.len.store(keys.len(), Ordering::Release);
    }
}

/// Forget what no longer decides anything at `now`, then, if still full, the eighth that ends
/// first: the next inserts find room without a scan each.
fn make_room(keys: &mut HashMap<Key, Remembered>, now: u64) {
    keys.retain(|_, r| r.decides(now));
    if keys.len() < CAPACITY {
        return;
    }
    let mut ends: Vec<u64> = keys.values().map(Remembered::ends).collect();
    let drop = CAPACITY / 8;
    let (_, &mut threshold, _) = ends.select_nth_unstable(drop - 1);
    let mut at_threshold = drop - ends[..drop].iter().filter(|&&e| e < threshold).count();
    keys.retain(|_, r| {
        let end = r.ends();
        if end < threshold {
            false
        } else if end == threshold && at_threshold > 0 {
            at_threshold -= 1;
            false
        } else {
            true
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::ByListing;

    fn key(s: &str) -> Key {
        Key::new(s)
    }

    fn by(listed: ByListing, d: Decision) -> Decision {
        Decision { listed, ..d }
    }

    /// The store's refusal of a key blocked for `block_ms` more, whose rule's own wait is
    /// `wait_ms`.
    fn blocked(block_ms: u64, wait_ms: u64) -> Decision {
        let wait = Duration::from_millis(wait_ms.max(block_ms));
        let d = Decision::deny(10, 0, Duration::from_secs(6).max(wait), Some(wait));
        by(ByListing::block(Duration::from_millis(block_ms)), d)
    }

    #[test]
    fn a_block_stands_until_its_own_end_on_any_rule_not_the_rules_longer_wait() {
        let m = ListingMemory::default();
        // Blocked 2 s more; the rule itself would refuse for a day.
        m.observe(&key("k"), &blocked(2_000, 86_400_000), 1_000_000);
        let d = m
            .in_outage(&key("k"), 10, 2_000_000)
            .unwrap_or_else(|| panic!("remembered"));
        assert!(!d.allowed && d.degraded);
        assert_eq!(d.source, Source::Cache);
        assert_eq!(d.retry_after, Some(Duration::from_millis(1_000)));
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
    fn another_rules_numbers_are_not_shown() {
        let m = ListingMemory::default();
        m.observe(&key("k"), &blocked(5_000, 0), 0);
        let d = m
            .in_outage(&key("k"), 999, 1_000_000)
            .unwrap_or_else(|| panic!("remembered"));
        assert_eq!((d.limit, d.remaining), (999, 0));
        assert_eq!(d.retry_after, Some(Duration::from_secs(4)));
        assert!(d.reset_after >= Duration::from_secs(4));
        let same = m
            .in_outage(&key("k"), 10, 1_000_000)
            .unwrap_or_else(|| panic!("remembered"));
        assert_eq!(
            same.reset_after,
            Duration::from_secs(5),
            "the store's, counted down"
        );
    }

    #[test]
    fn a_deny_listing_stands_for_its_day() {
        let m = ListingMemory::default();
        let wait = crate::store::DENY_RETRY_AFTER;
        let denied = by(ByListing::DENY, Decision::deny(10, 0, wait, Some(wait)));
        m.observe(&key("k"), &denied, 0);
        let d = m
            .in_outage(&key("k"), 10, 3_600_000_000)
            .unwrap_or_else(|| panic!("remembered"));
        assert_eq!(d.retry_after, Some(wait - Duration::from_secs(3_600)));
    }

    #[test]
    fn an_allow_listing_admits_uncounted_until_the_store_says_otherwise_or_it_is_old() {
        let m = ListingMemory::default();
        let allowed = by(
            ByListing::ALLOW,
            Decision::admit(10, 7, Duration::from_secs(3)),
        );
        m.observe(&key("k"), &allowed, 0);
        let d = m
            .in_outage(&key("k"), 10, 1_000)
            .unwrap_or_else(|| panic!("remembered"));
        assert!(d.allowed && d.degraded && d.taken.is_none());
        assert_eq!(d.retry_after, None);
        let trusted = micros(ALLOW_TRUSTED);
        assert!(m.in_outage(&key("k"), 10, trusted - 1).is_some());
        assert!(
            m.in_outage(&key("k"), 10, trusted).is_none(),
            "too old to trust"
        );
        // Seen again, it is trusted again; then the store decides it by its quotas.
        m.observe(&key("k"), &allowed, trusted);
        assert!(m.in_outage(&key("k"), 10, trusted + 1).is_some());
        m.observe(
            &key("k"),
            &Decision::admit(10, 7, Duration::ZERO),
            trusted + 5,
        );
        assert!(m.in_outage(&key("k"), 10, trusted + 6).is_none());
        assert!(!m.is_listed(&key("k"), trusted + 6));
    }

    #[test]
    fn admin_calls_are_learnt_and_an_older_answer_does_not_undo_them() {
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
        // Lifted here at 100; an answer asked for at 50 arrives after.
        m.set(&key("d"), None, 100);
        let wait = crate::store::DENY_RETRY_AFTER;
        let in_flight = by(ByListing::DENY, Decision::deny(5, 0, wait, Some(wait)));
        m.observe(&key("d"), &in_flight, 50);
        assert!(m.in_outage(&key("d"), 5, 200).is_none());
        assert!(!m.is_listed(&key("d"), 200));
        // An answer asked for after the lift is news.
        m.observe(&key("d"), &in_flight, 150);
        assert!(m.is_listed(&key("d"), 200));
    }

    #[test]
    fn an_unlisted_answer_teaches_nothing_about_a_key_not_remembered() {
        let m = ListingMemory::default();
        m.observe(&key("k"), &Decision::deny(1, 0, Duration::ZERO, None), 0);
        assert_eq!(m.len.load(Ordering::Acquire), 0);
    }

    #[test]
    fn full_it_forgets_an_eighth_that_ends_first() {
        let m = ListingMemory::default();
        for i in 0..CAPACITY as u64 {
            m.observe(&key(&format!("k{i}")), &blocked(1_000 * (1 + i), 0), 0);
        }
        m.set(&key("allowed"), Some(Listing::Allow), 0);
        assert_eq!(m.len.load(Ordering::Acquire), CAPACITY - CAPACITY / 8 + 1);
        assert!(!m.is_listed(&key("k0"), 0), "the block ending first went");
        assert!(!m.is_listed(&key(&format!("k{}", CAPACITY / 8 - 1)), 0));
        assert!(m.is_listed(&key(&format!("k{}", CAPACITY / 8)), 0));
        assert!(m.is_listed(&key("allowed"), 0));
    }
}
