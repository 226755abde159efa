//! A memory store across a faulty link, for tests of what the limiter does around a store that
//! is slow or loses a call (the real Redis tests cover the rest).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{BoxFuture, Check, Lease, Listing, Op, Refund, SlotOp, Store};
use crate::{Clock, Decision, Key, MemoryStore, Rule, StoreError};

/// Tokio's time (paused, in the tests that use it) as a clock, from a fixed epoch.
#[derive(Debug)]
pub(crate) struct TokioClock(tokio::time::Instant);

impl TokioClock {
    pub(crate) fn new() -> TokioClock {
        TokioClock(tokio::time::Instant::now())
    }
}

impl Clock for TokioClock {
    fn now_us(&self) -> u64 {
        1_735_689_600_000_000 + self.0.elapsed().as_micros() as u64
    }
}

/// `store` behind a link that takes `delay` (tokio time) per decision, lease and refund, whose
/// decisions' and concurrency slots' replies take `reply_after` more once decided, and that never answers the first
/// `lost_renewals` concurrency-slot renewals.
pub(crate) struct Link {
    pub(crate) store: MemoryStore,
    pub(crate) delay: Duration,
    pub(crate) reply_after: Duration,
    pub(crate) lost_renewals: AtomicU32,
}

impl Link {
    /// `store` behind a link of `delay` per call, answering `reply_after` late, losing no
    /// renewal.
    pub(crate) fn new(store: MemoryStore, delay: Duration, reply_after: Duration) -> Link {
        Link {
            store,
            delay,
            reply_after,
            lost_renewals: AtomicU32::new(0),
        }
    }

    async fn crossed(&self) {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }
}

impl super::sealed::Sealed for Link {}

impl Store for Link {
    fn apply<'a>(
        &'a self,
        op: Op,
        checks: &'a [Check<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        Box::pin(async move {
            self.crossed().await;
            let decided = self.store.apply(op, checks).await;
            if !self.reply_after.is_zero() {
                tokio::time::sleep(self.reply_after).await;
            }
            decided
        })
    }

    fn lease<'a>(
        &'a self,
        check: Check<'a>,
        max_validity: Duration,
    ) -> BoxFuture<'a, Result<Lease, StoreError>> {
        Box::pin(async move {
            self.crossed().await;
            self.store.lease(check, max_validity).await
        })
    }

    fn refund<'a>(
        &'a self,
        refunds: &'a [Refund<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        Box::pin(async move {
            self.crossed().await;
            self.store.refund(refunds).await
        })
    }

    fn pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.store.pause(rule, key, pause)
    }

    fn extend_pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.store.extend_pause(rule, key, pause)
    }

    fn paused_for<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
    ) -> BoxFuture<'a, Result<Option<Duration>, StoreError>> {
        self.store.paused_for(rule, key)
    }

    fn set_listing<'a>(
        &'a self,
        key: &'a Key,
        listing: Option<Listing>,
    ) -> BoxFuture<'a, Result<Option<Listing>, StoreError>> {
        self.store.set_listing(key, listing)
    }

    fn listing<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Listing>, StoreError>> {
        self.store.listing(key)
    }

    fn block_unless_listed<'a>(
        &'a self,
        key: &'a Key,
        block: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.store.block_unless_listed(key, block)
    }

    fn reset<'a>(&'a self, rule: &'a Rule, key: &'a Key) -> BoxFuture<'a, Result<(), StoreError>> {
        self.store.reset(rule, key)
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
        let lost = op == SlotOp::Renew
            && self
                .lost_renewals
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if lost {
            return Box::pin(std::future::pending());
        }
        let call = self.store.slots(op, name, key, slot, limit, ttl);
        let reply_after = self.reply_after;
        Box::pin(async move {
            let answer = call.await;
            if !reply_after.is_zero() {
                tokio::time::sleep(reply_after).await;
            }
            answer
        })
    }
}
