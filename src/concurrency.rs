//! Concurrency limits across the fleet: how many requests of one key may be in flight at once
//! ("20 requests in progress at a time"), whichever instance serves them.
//!
//! A request takes a **slot** when it starts and gives it back when its response body ends, or
//! when the request is dropped or cancelled. Slots live in the store with an expiry that the
//! holder renews while the request runs (every third of [`DEFAULT_SLOT_TTL`]), so the slots of a
//! process killed mid-request free themselves within that time. On Redis a key's slots are one
//! sorted set (`<prefix>{key}:slots=<name>`, scored by expiry), changed by one script call per
//! acquire, renewal and release; the memory store has a twin.
//!
//! ```
//! use axum::{routing::get, Router};
//! use fleetlimit::concurrency::{ConcurrencyLimitLayer, ConcurrencyLimiter};
//! use fleetlimit::{key, MemoryStore};
//!
//! let limiter = ConcurrencyLimiter::builder(MemoryStore::new(), "in-flight", 20).build()?;
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "ok" }))
//!     .layer(ConcurrencyLimitLayer::builder(limiter).key(key::header("x-api-key")).build()?);
//! # let _ = app;
//! # Ok::<(), fleetlimit::ConfigError>(())
//! ```

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::key::{KeyExtractor, PeerIp};
use crate::layer::ResponseBody;
use crate::limiter::breaker::Breakers;
use crate::limiter::policy::Deadline;
use crate::store::{Check, SlotOp, Store};
use crate::{
    BreakerConfig, ConfigError, InfallibleStore, Key, MemoryStore, OnStoreError, PolicyUnset, Rule,
    StoreError,
};

/// How long a slot lives unless its holder renews it: the longest a killed process's slots
/// stay taken.
pub const DEFAULT_SLOT_TTL: Duration = Duration::from_secs(5);

/// What [`ConcurrencyLimiter::acquire`] answers.
#[derive(Debug)]
#[non_exhaustive]
pub enum Acquired {
    /// A slot, held until dropped.
    Held(Slot),
    /// Every slot is taken.
    Full {
        /// The limit.
        limit: u64,
        /// Slots held now.
        in_flight: u64,
    },
    /// The store could not answer, and the outage policy refuses.
    Unavailable {
        /// When to try again.
        retry_after: Duration,
    },
}

/// What happens when the store cannot answer.
enum Fallback {
    Open,
    Closed {
        retry_after: Duration,
    },
    /// Slots in this process, `limit` of them per key.
    Local {
        store: MemoryStore,
        limit: u64,
    },
}

struct Inner {
    store: Arc<dyn Store>,
    name: Arc<str>,
    /// The name as a rule: which failure domain (cluster master) a key's slots live in.
    rule: Rule,
    limit: u64,
    ttl: Duration,
    deadline: Duration,
    /// `None` for a store that cannot fail.
    fallback: Option<Fallback>,
    /// A breaker per failure domain, as the rate limiter's: while one is open, acquisitions
    /// follow the outage policy at once instead of each waiting out its deadline.
    breakers: Breakers,
    /// The breakers' clock (Tokio's, so that paused time drives it in tests).
    epoch: tokio::time::Instant,
    /// An outage's start is said at most once in a while (a store failing some calls and
    /// answering others, a cluster master down under mixed traffic, would say it per request).
    said: crate::limiter::telemetry::Throttled,
    /// An outage was said and the store has not answered since: its end is said too.
    said_outage: AtomicBool,
}

impl Inner {
    /// Microseconds on the breakers' clock (from 1).
    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    /// The failure domain of `key`'s slots.
    fn domain(&self, key: &Key) -> usize {
        let check = Check {
            rule: &self.rule,
            key,
            cost: 1,
        };
        self.store.failure_domain(std::slice::from_ref(&check))
    }

    /// The store answered: an outage, if there was one, is over.
    fn answered(&self) {
        if self.said_outage.load(Ordering::Relaxed)
            && self.said_outage.swap(false, Ordering::Relaxed)
        {
            tracing::info!(name = %self.name, "fleetlimit: concurrency slots available again");
        }
    }
}

/// A fleet-wide limit on requests in flight per key. Cheap to clone.
#[derive(Clone)]
pub struct ConcurrencyLimiter {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ConcurrencyLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyLimiter")
            .field("name", &self.inner.name)
            .field("limit", &self.inner.limit)
            .field("ttl", &self.inner.ttl)
            .finish_non_exhaustive()
    }
}

/// Builder for [`ConcurrencyLimiter`]. On a store that can fail, `build` exists once
/// [`on_store_error`](ConcurrencyLimiterBuilder::on_store_error) is chosen: `FailOpen` admits
/// without a slot, `FailClosed` refuses (503), `Local`/`LocalShare(n)` hold slots in this
/// process (the limit divided by `n`; its requests in flight on the store's slots count against
/// it).
#[must_use = "a builder does nothing until `build` is called"]
pub struct ConcurrencyLimiterBuilder<S, P = PolicyUnset> {
    store: S,
    name: String,
    limit: u64,
    ttl: Duration,
    deadline: Duration,
    breaker: BreakerConfig,
    policy: Option<OnStoreError>,
    _policy: PhantomData<P>,
}

impl ConcurrencyLimiter {
    /// A limit of `limit` requests in flight per key, named `name` (it namespaces the slots in
    /// the store and appears in headers).
    pub fn builder<S: Store>(store: S, name: &str, limit: u64) -> ConcurrencyLimiterBuilder<S> {
        ConcurrencyLimiterBuilder {
            store,
            name: name.to_owned(),
            limit,
            ttl: DEFAULT_SLOT_TTL,
            deadline: crate::DEFAULT_DEADLINE,
            breaker: BreakerConfig::default(),
            policy: None,
            _policy: PhantomData,
        }
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The most requests in flight per key.
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Take a slot for `key` if fewer than the limit are held across the fleet.
    pub async fn acquire(&self, key: &Key) -> Acquired {
        self.acquire_within(key, self.inner.limit).await
    }

    /// Take a slot for `key` if fewer than `limit` are held (a share of the limit, for load
    /// shedding by priority).
    pub(crate) async fn acquire_within(&self, key: &Key, limit: u64) -> Acquired {
        let inner = &self.inner;
        let id = slot_id();
        // Driven by another executor than Tokio's, no task can renew a slot: an in-process
        // store holds it until its holder drops it (which gives it back on the spot).
        if tokio::runtime::Handle::try_current().is_err() {
            let name = &inner.name;
            let answer =
                inner
                    .store
                    .slots_in_process(SlotOp::Acquire, name, key, id, limit, LOCAL_TTL);
            match answer {
                Some((true, _)) => {
                    let sent = tokio::time::Instant::now();
                    return Acquired::Held(Slot::held(inner.clone(), key.clone(), id, sent, None));
                }
                Some((false, in_flight)) => return Acquired::Full { limit, in_flight },
                None => {}
            }
        }
        // Until the store's answer is in, the call may have taken the slot: if the deadline
        // passes, or this future is dropped (the client went away, an outer timeout), the slot
        // is given back. An open breaker sends nothing, and there is nothing to give back.
        let sent_at = AtomicBool::new(false);
        let mut pending = Pending {
            inner,
            key,
            id,
            armed: &sent_at,
        };
        let sent = tokio::time::Instant::now();
        let call = async {
            sent_at.store(true, Ordering::Relaxed);
            inner
                .store
                .slots(SlotOp::Acquire, &inner.name, key, id, limit, inner.ttl)
                .await
        };
        let answer = match &inner.fallback {
            None => call.await,
            Some(_) => {
                let deadline = Deadline::after(inner.deadline);
                let domain = inner.domain(key);
                let now = || inner.now_us();
                inner
                    .breakers
                    .call(domain, &inner.name, now, deadline, call)
                    .await
                    .ok_or_else(|| {
                        StoreError::Connection(
                            "not answered (an open breaker, an error, or the deadline)".into(),
                        )
                    })
            }
        };
        match answer {
            Ok((true, _)) => {
                pending.disarm();
                inner.answered();
                // The local fallback counts it too: requests in flight on the store's slots
                // when it stops answering are still in flight, and the local limit is this
                // process's whole share, not a share on top of them.
                let mirrored = match &inner.fallback {
                    Some(Fallback::Local { store, .. }) => {
                        store.slots_now(SlotOp::Acquire, &inner.name, key, id, u64::MAX, LOCAL_TTL);
                        Some(store.clone())
                    }
                    _ => None,
                };
                Acquired::Held(Slot::held(
                    self.inner.clone(),
                    key.clone(),
                    id,
                    sent,
                    mirrored,
                ))
            }
            Ok((false, in_flight)) => {
                pending.disarm();
                inner.answered();
                Acquired::Full { limit, in_flight }
            }
            Err(error) => self.fallback(key, id, limit, &error),
        }
    }

    fn fallback(&self, key: &Key, id: u64, share: u64, error: &StoreError) -> Acquired {
        // Once per outage at `warn` (every request would say it again), then at `debug`; the
        // first answer from the store ends the outage. Outages that come and go per request
        // (some calls failing) are said once in a while.
        // Said once per outage, and an outage that begins within 10 s of the last one said is
        // said as soon as those 10 s are up, not never.
        let say = !self.inner.said_outage.load(Ordering::Relaxed) && self.inner.said.due();
        if !say {
            tracing::debug!(name = %self.inner.name, %error, "fleetlimit: concurrency slots unavailable");
        } else {
            self.inner.said_outage.store(true, Ordering::Relaxed);
            tracing::warn!(
                name = %self.inner.name,
                %error,
                "fleetlimit: concurrency slots unavailable; the outage policy decides"
            );
        }
        match &self.inner.fallback {
            None | Some(Fallback::Open) => Acquired::Held(Slot::unheld()),
            Some(Fallback::Closed { retry_after }) => Acquired::Unavailable {
                retry_after: *retry_after,
            },
            Some(Fallback::Local { store, limit }) => {
                let name = &self.inner.name;
                let ttl = LOCAL_TTL;
                // A caller's share of the limit (load shedding) holds in the fallback too, as
                // the same fraction of this process's slots.
                let limit = &local_share(*limit, share, self.inner.limit);
                match store.slots_now(SlotOp::Acquire, name, key, id, *limit, ttl) {
                    (true, _) => {
                        Acquired::Held(Slot::local(store.clone(), name.clone(), key.clone(), id))
                    }
                    (false, in_flight) => Acquired::Full {
                        limit: *limit,
                        in_flight,
                    },
                }
            }
        }
    }
}

impl<S: Store, P> ConcurrencyLimiterBuilder<S, P> {
    /// How long a slot lives unless renewed (default [`DEFAULT_SLOT_TTL`]); its holder renews
    /// it every third of that.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The longest an acquisition waits for the store before the outage policy decides
    /// (default [`DEFAULT_DEADLINE`](crate::DEFAULT_DEADLINE)).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// When the circuit breaker opens and how long before it probes (default
    /// [`BreakerConfig::default`]: after 3 failures in a row, for 250 ms). While it is open,
    /// acquisitions follow the outage policy without asking the store; one per failure domain
    /// (a cluster's master), as the rate limiter's. Not counted in the
    /// `fleetlimit_breakers_open` gauge, which is the rate limiters'.
    pub fn breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = config;
        self
    }

    fn build_inner(self) -> Result<ConcurrencyLimiter, ConfigError> {
        let invalid = |reason: &str| ConfigError::Invalid {
            setting: "concurrency limit",
            reason: reason.to_owned(),
        };
        if self.limit == 0 {
            return Err(ConfigError::ZeroLimit);
        }
        if self.ttl < Duration::from_millis(300) || self.deadline.is_zero() {
            return Err(invalid(
                "needs a slot ttl of at least 300 ms and a non-zero deadline",
            ));
        }
        // The name appears in headers and keys: the rules' name syntax.
        let rule = Rule::new(&self.name, crate::Quota::per_second(1).build()?)?;
        let fallback = match self.policy {
            None => None,
            Some(OnStoreError::FailOpen) => Some(Fallback::Open),
            Some(OnStoreError::FailClosed { retry_after }) if !retry_after.is_zero() => {
                Some(Fallback::Closed { retry_after })
            }
            Some(OnStoreError::FailClosed { .. }) => {
                return Err(invalid("FailClosed needs a retry_after above zero"))
            }
            Some(OnStoreError::Local(quota)) => Some(Fallback::Local {
                store: MemoryStore::new(),
                limit: quota.limit(),
            }),
            Some(OnStoreError::LocalShare(0)) => {
                return Err(invalid("LocalShare needs at least one server"))
            }
            Some(OnStoreError::LocalShare(n)) => Some(Fallback::Local {
                store: MemoryStore::new(),
                limit: (self.limit / n).max(1),
            }),
        };
        if self.breaker.failures == 0 || self.breaker.cool_down.is_zero() {
            return Err(invalid(
                "the breaker needs at least one failure and a non-zero cool-down",
            ));
        }
        let breakers = Breakers::ungauged(self.store.failure_domains(), self.breaker);
        Ok(ConcurrencyLimiter {
            inner: Arc::new(Inner {
                store: Arc::new(self.store),
                name: self.name.into(),
                rule,
                limit: self.limit,
                ttl: self.ttl,
                deadline: self.deadline,
                fallback,
                breakers,
                epoch: tokio::time::Instant::now(),
                said: Default::default(),
                said_outage: AtomicBool::new(false),
            }),
        })
    }
}

impl<S: Store> ConcurrencyLimiterBuilder<S, PolicyUnset> {
    /// Choose what happens when the store cannot answer. Required for stores that can fail.
    pub fn on_store_error(
        self,
        policy: OnStoreError,
    ) -> ConcurrencyLimiterBuilder<S, OnStoreError> {
        ConcurrencyLimiterBuilder {
            store: self.store,
            name: self.name,
            limit: self.limit,
            ttl: self.ttl,
            deadline: self.deadline,
            breaker: self.breaker,
            policy: Some(policy),
            _policy: PhantomData,
        }
    }
}

impl<S: InfallibleStore> ConcurrencyLimiterBuilder<S, PolicyUnset> {
    /// Validate and build.
    pub fn build(self) -> Result<ConcurrencyLimiter, ConfigError> {
        self.build_inner()
    }
}

impl<S: Store> ConcurrencyLimiterBuilder<S, OnStoreError> {
    /// Validate and build.
    pub fn build(self) -> Result<ConcurrencyLimiter, ConfigError> {
        self.build_inner()
    }
}

/// The slots of `local` (this process's, in an outage) a caller with `share` of the fleet's
/// `limit` may hold: the same fraction, at least one for a share above zero, but never all of
/// them (a single local slot is critical traffic's alone, as a fleet budget of 1 is). Taking the smaller
/// of `local` and `share` instead gave every priority all the local slots (with 25 local of
/// 100, best effort's 50 is more than 25), so best effort could crowd out critical requests
/// just when the store was away.
fn local_share(local: u64, share: u64, limit: u64) -> u64 {
    if share >= limit {
        return local;
    }
    let scaled = u128::from(local) * u128::from(share) / u128::from(limit.max(1));
    let scaled = u64::try_from(scaled).unwrap_or(local);
    // At least one slot for a share above zero, but never all of them: the rest is there for
    // the callers with the whole budget (critical traffic).
    if share > 0 {
        scaled.max(1).min(local.saturating_sub(1))
    } else {
        0
    }
}

/// A slot in the local fallback lives until its holder drops it (which gives it back at once).
const LOCAL_TTL: Duration = Duration::from_secs(u32::MAX as u64);

/// An acquisition whose answer is not in: gives its slot back when dropped armed (once its
/// call was sent, until the answer is in).
struct Pending<'a> {
    inner: &'a Arc<Inner>,
    key: &'a Key,
    id: u64,
    armed: &'a AtomicBool,
}

impl Pending<'_> {
    fn disarm(&mut self) {
        self.armed.store(false, Ordering::Relaxed);
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.armed.load(Ordering::Relaxed) {
            release_later(self.inner.clone(), self.key.clone(), self.id);
        }
    }
}

/// Give slot `id` back in the background (a call that timed out may have taken it, or the
/// slot was held with no task of its own). Outside a Tokio runtime there is no background:
/// an in-process store gives it back on the spot, and another store's slot expires by itself.
fn release_later(limiter: Arc<Inner>, key: Key, id: u64) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move { release(&limiter, &key, id).await });
        }
        Err(_) => {
            // Only an in-process store can be asked here: another's future needs a runtime
            // (its timeouts would panic, in a `Drop` that may run while unwinding).
            let (name, ttl) = (&limiter.name, limiter.ttl);
            let released =
                limiter
                    .store
                    .slots_in_process(SlotOp::Release, name, &key, id, limiter.limit, ttl);
            if released.is_none() {
                tracing::debug!("fleetlimit: a slot dropped outside a runtime expires by itself");
            }
        }
    }
}

/// Give slot `id` back; one that cannot be expires by itself. Sent even while the breaker is
/// open (a slow spell opens it too, and a slot not given back refuses its key for a ttl), but
/// never waited for past the slot's ttl (past it, the slot has expired anyway).
async fn release(limiter: &Inner, key: &Key, id: u64) {
    let call = limiter.store.slots(
        SlotOp::Release,
        &limiter.name,
        key,
        id,
        limiter.limit,
        limiter.ttl,
    );
    let answer = tokio::time::timeout(limiter.ttl, call)
        .await
        .unwrap_or(Err(StoreError::Timeout(limiter.ttl)));
    if let Err(error) = answer {
        tracing::debug!(%error, "fleetlimit: a slot could not be given back; it expires by itself");
    }
}

/// A slot id no other holder draws while it lives (64 random bits, as the refunds' once keys).
fn slot_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// A slot held by a request in flight: renewed while it lives, given back when dropped.
pub struct Slot {
    held: Held,
}

enum Held {
    /// In the store, renewed by a task.
    Store {
        limiter: Arc<Inner>,
        key: Key,
        id: u64,
        /// Dropped (with the slot) to have the renewing task give the slot back.
        renewal: Option<tokio::sync::oneshot::Sender<()>>,
        /// The local fallback that counts it too, for an outage while it is held.
        mirrored: Option<MemoryStore>,
    },
    /// In this process's fallback.
    Local {
        store: MemoryStore,
        name: Arc<str>,
        key: Key,
        id: u64,
    },
    /// None (fail open).
    Nothing,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.held {
            Held::Store { .. } => "store",
            Held::Local { .. } => "local",
            Held::Nothing => "none",
        };
        f.debug_struct("Slot").field("held", &kind).finish()
    }
}

impl Slot {
    /// A slot the store holds: one task renews it while it lives and, told by the drop, gives
    /// it back after any renewal it has sent, so a late renewal does not hold the slot again,
    /// for a ttl, for nobody. (One exception: a renewal abandoned at its timeout on a pooled
    /// or Sentinel connection, which is then replaced, can still land after the release.)
    /// `sent`: when the acquisition was sent, from which the slot's ttl may already run.
    fn held(
        limiter: Arc<Inner>,
        key: Key,
        id: u64,
        sent: tokio::time::Instant,
        mirrored: Option<MemoryStore>,
    ) -> Slot {
        let renewal = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            let (limiter, key) = (limiter.clone(), key.clone());
            let (dropped, mut released) = tokio::sync::oneshot::channel::<()>();
            runtime.spawn(async move {
                let every = limiter.ttl / 3;
                // A slot lives a ttl from the last renewal that landed: one that fails is tried
                // again soon, not a third later (two thirds after a failure, the next try came
                // when the slot had expired, and the request went on without it).
                let retry = limiter.ttl / 10;
                // The first renewal counts from the acquisition's sending: the store may have
                // taken the slot then, and a slow answer must not let it lapse.
                let mut wait = every.saturating_sub(sent.elapsed());
                loop {
                    if tokio::time::timeout(wait, &mut released).await.is_ok() {
                        break;
                    }
                    let renew = limiter.store.slots(
                        SlotOp::Renew,
                        &limiter.name,
                        &key,
                        id,
                        limiter.limit,
                        limiter.ttl,
                    );
                    wait = match tokio::time::timeout(retry, renew).await {
                        Ok(Ok((true, _))) => every,
                        Ok(Ok((false, held))) => {
                            // The request is still in flight: the store holds its slot again,
                            // so the fleet's count is true again (new requests wait for it).
                            tracing::warn!(
                                name = %limiter.name,
                                held,
                                "fleetlimit: the store had lost a concurrency slot in use (a restart, a failover, or an outage longer than its ttl); it is held again"
                            );
                            every
                        }
                        _ => retry,
                    };
                }
                release(&limiter, &key, id).await;
            });
            dropped
        });
        Slot {
            held: Held::Store {
                limiter,
                key,
                id,
                renewal,
                mirrored,
            },
        }
    }

    fn local(store: MemoryStore, name: Arc<str>, key: Key, id: u64) -> Slot {
        Slot {
            held: Held::Local {
                store,
                name,
                key,
                id,
            },
        }
    }

    fn unheld() -> Slot {
        Slot {
            held: Held::Nothing,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.held, Held::Nothing) {
            Held::Store {
                limiter,
                key,
                id,
                renewal,
                mirrored,
            } => {
                if let Some(local) = mirrored {
                    local.slots_now(SlotOp::Release, &limiter.name, &key, id, 0, Duration::ZERO);
                }
                // Its renewing task gives it back (dropping the sender tells it to).
                if renewal.is_none() {
                    release_later(limiter, key, id);
                }
            }
            Held::Local {
                store,
                name,
                key,
                id,
            } => {
                store.slots_now(SlotOp::Release, &name, &key, id, 0, Duration::ZERO);
            }
            Held::Nothing => {}
        }
    }
}

/// Limits requests in flight per key with a [`ConcurrencyLimiter`]: the key comes from the
/// extractor (else the peer address, as [`RateLimitLayer`](crate::RateLimitLayer) does); a
/// request over the limit gets `429` (or the status you choose) with `Retry-After: 1` and
/// `RateLimit-Policy: "<name>";q=<limit>;qu="concurrent-requests"`, gRPC calls
/// `RESOURCE_EXHAUSTED` (the wait in `grpc-retry-pushback-ms`). The slot is held until the response body ends or is dropped.
#[derive(Clone)]
pub struct ConcurrencyLimitLayer {
    config: Arc<LayerConfig>,
}

impl std::fmt::Debug for ConcurrencyLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyLimitLayer")
            .field("limiter", &self.config.limiter)
            .finish_non_exhaustive()
    }
}

struct LayerConfig {
    limiter: ConcurrencyLimiter,
    key: Option<Arc<dyn KeyExtractor>>,
    peer: PeerIp,
    status: StatusCode,
}

/// Builder for [`ConcurrencyLimitLayer`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct ConcurrencyLimitLayerBuilder {
    config: LayerConfig,
}

impl std::fmt::Debug for ConcurrencyLimitLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyLimitLayerBuilder")
            .finish_non_exhaustive()
    }
}

impl ConcurrencyLimitLayer {
    /// Start building a layer for `limiter`.
    pub fn builder(limiter: ConcurrencyLimiter) -> ConcurrencyLimitLayerBuilder {
        ConcurrencyLimitLayerBuilder {
            config: LayerConfig {
                limiter,
                key: None,
                peer: PeerIp::default(),
                status: StatusCode::TOO_MANY_REQUESTS,
            },
        }
    }
}

impl ConcurrencyLimitLayerBuilder {
    /// Where the key comes from (default: the peer address).
    pub fn key(mut self, extractor: impl KeyExtractor) -> Self {
        self.config.key = Some(Arc::new(extractor));
        self
    }

    /// How the peer address is found (trusted proxies).
    pub fn peer_ip(mut self, peer: PeerIp) -> Self {
        self.config.peer = peer;
        self
    }

    /// The status of a refusal (default 429; 503 for load shedding, say). Must be a 4xx or 5xx.
    pub fn status(mut self, status: StatusCode) -> Self {
        self.config.status = status;
        self
    }

    /// Validate and build.
    pub fn build(self) -> Result<ConcurrencyLimitLayer, ConfigError> {
        let status = self.config.status;
        if !status.is_client_error() && !status.is_server_error() {
            return Err(ConfigError::Invalid {
                setting: "ConcurrencyLimitLayer::status",
                reason: format!("{status} is not an error status"),
            });
        }
        if let Some(key) = &self.config.key {
            key.check()?;
        }
        self.config.peer.check()?;
        Ok(ConcurrencyLimitLayer {
            config: Arc::new(self.config),
        })
    }
}

impl<S> Layer<S> for ConcurrencyLimitLayer {
    type Service = ConcurrencyLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimitService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service made by [`ConcurrencyLimitLayer`].
#[derive(Clone)]
pub struct ConcurrencyLimitService<S> {
    inner: S,
    config: Arc<LayerConfig>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for ConcurrencyLimitService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyLimitService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// The future of a [`ConcurrencyLimitService`] call.
pub type ConcurrencyFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, ResBody> Service<Request<B>> for ConcurrencyLimitService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<ResponseBody<SlotBody<ResBody>>>;
    type Error = S::Error;
    type Future = ConcurrencyFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let config = self.config.clone();
        let grpc = crate::layer::is_grpc(&parts);
        let key = config
            .key
            .as_ref()
            .and_then(|k| k.extract(&parts))
            .or_else(|| config.peer.extract(&parts));
        let req = Request::from_parts(parts, body);
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        Box::pin(async move {
            let Some(key) = key else {
                return Ok(crate::layer::no_key(grpc).map(ResponseBody::full));
            };
            let slot = match config.limiter.acquire(&key).await {
                Acquired::Held(slot) => slot,
                Acquired::Full { limit, .. } => {
                    return Ok(refusal(&config, limit, grpc).map(ResponseBody::full))
                }
                Acquired::Unavailable { retry_after } => {
                    let mut r = crate::layer::unavailable(grpc, StatusCode::SERVICE_UNAVAILABLE);
                    crate::layer::retry_after(&mut r, retry_after, grpc);
                    return Ok(r.map(ResponseBody::full));
                }
            };
            let response = inner.call(req).await?;
            Ok(response.map(|body| ResponseBody::inner(HeldBody::new(body, Some(slot)))))
        })
    }
}

/// The refusal of a request over the limit.
fn refusal(config: &LayerConfig, limit: u64, grpc: bool) -> Response<Bytes> {
    let name = config.limiter.name();
    let mut response = if grpc {
        crate::layer::grpc_refusal("8", "too many concurrent requests")
    } else {
        crate::layer::json_refusal(
            config.status,
            format!(r#"{{"error":"too_many_concurrent_requests","limit":{limit}}}"#),
        )
    };
    crate::layer::retry_after(&mut response, Duration::from_secs(1), grpc);
    let headers = response.headers_mut();
    if let Ok(v) =
        HeaderValue::from_str(&format!("\"{name}\";q={limit};qu=\"concurrent-requests\""))
    {
        headers.insert("ratelimit-policy", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";r=0")) {
        headers.insert("ratelimit", v);
    }
    response
}

pin_project! {
    /// A response body that holds something for its request (a concurrency slot, a place among
    /// a worker's requests in flight) until the body ends or is dropped.
    pub struct HeldBody<B, G> {
        #[pin]
        inner: B,
        held: Option<G>,
    }
}

/// The response body of a [`ConcurrencyLimitService`]: the slot is free when it ends.
pub type SlotBody<B> = HeldBody<B, Slot>;

impl<B, G: std::fmt::Debug> std::fmt::Debug for HeldBody<B, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldBody")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl<B, G> HeldBody<B, G> {
    pub(crate) fn new(inner: B, held: Option<G>) -> HeldBody<B, G> {
        HeldBody { inner, held }
    }
}

impl<B: Body, G> Body for HeldBody<B, G> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let frame = this.inner.poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.held.take(); // the response is complete: let go
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::TokioClock;

    /// A limit of one slot at the default ttl, failing closed, on a memory store (on paused
    /// tokio time) whose first `lost` renewals are never answered; and the store.
    fn losing_renewals(lost: u32) -> (ConcurrencyLimiter, MemoryStore) {
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let link = crate::store::testing::Link {
            store: store.clone(),
            delay: Duration::ZERO,
            reply_after: Duration::ZERO,
            lost_renewals: lost.into(),
        };
        let limiter = ConcurrencyLimiter::builder(link, "in-flight", 1)
            .on_store_error(OnStoreError::fail_closed())
            .build()
            .unwrap();
        (limiter, store)
    }

    /// A breaker that never opens (no failure opens it) or never cools down is a configuration
    /// error, as the rate limiter's is: it would silently let every call through.
    #[test]
    fn an_invalid_breaker_is_refused_when_built() {
        for config in [
            BreakerConfig {
                failures: 0,
                cool_down: Duration::from_millis(250),
            },
            BreakerConfig {
                failures: 3,
                cool_down: Duration::ZERO,
            },
        ] {
            let built = ConcurrencyLimiter::builder(MemoryStore::new(), "in-flight", 1)
                .breaker(config)
                .build();
            assert!(
                matches!(built, Err(ConfigError::Invalid { .. })),
                "{config:?}"
            );
        }
    }

    /// A store that takes the slot but never answers in time, at the default deadline and
    /// breaker: three acquisitions wait out the deadline, then the breaker opens and the next
    /// ones follow the policy at once, until its cool-down lets one probe through. Each used to
    /// wait its whole deadline, and leave a release behind it, for the whole outage.
    #[tokio::test(start_paused = true)]
    async fn an_open_breaker_answers_acquisitions_at_once() {
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let link = crate::store::testing::Link::new(
            store.clone(),
            Duration::ZERO,
            Duration::from_secs(10),
        );
        let limiter = ConcurrencyLimiter::builder(link, "in-flight", 100)
            .on_store_error(OnStoreError::fail_closed())
            .build()
            .unwrap();
        let key = Key::new("tenant");
        let mut waits = Vec::new();
        for _ in 0..10 {
            let start = tokio::time::Instant::now();
            let answer = limiter.acquire(&key).await;
            assert!(matches!(answer, Acquired::Unavailable { .. }), "{answer:?}");
            waits.push(start.elapsed().as_millis());
        }
        assert_eq!(waits, [50, 50, 50, 0, 0, 0, 0, 0, 0, 0]);
        // The cool-down over, one probe goes to the store.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let start = tokio::time::Instant::now();
        limiter.acquire(&key).await;
        assert_eq!(start.elapsed(), Duration::from_millis(50));
    }

    /// A slow answer to an acquisition: the slot's ttl ran from when the store took it, and
    /// its first renewal comes a third of the ttl after the sending, not after the answer, so
    /// the slot never lapses while held (another instance would take it, over the limit).
    #[tokio::test(start_paused = true)]
    async fn a_slow_answer_does_not_let_a_new_slot_lapse() {
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let ttl = Duration::from_millis(300);
        let link = crate::store::testing::Link::new(
            store.clone(),
            Duration::ZERO,
            Duration::from_millis(250),
        );
        let limiter = ConcurrencyLimiter::builder(link, "in-flight", 1)
            .ttl(ttl)
            .deadline(Duration::from_secs(2))
            .on_store_error(OnStoreError::fail_closed())
            .build()
            .unwrap();
        let key = Key::new("tenant");
        let start = tokio::time::Instant::now();
        let held = limiter.acquire(&key).await;
        assert!(matches!(held, Acquired::Held(_)));
        assert_eq!(start.elapsed(), Duration::from_millis(250));
        tokio::time::sleep_until(start + Duration::from_millis(320)).await;
        let (taken, in_flight) = store.slots_now(SlotOp::Acquire, "in-flight", &key, 7, 1, ttl);
        assert!(!taken, "the slot lapsed while held: {in_flight} in flight");
    }

    /// Driven by another executor than Tokio's, a slot on the memory store has no task to
    /// renew it; given back when dropped all the same, on the spot, rather than held for its
    /// ttl by nobody; and held while its request runs, past the ttl (it once expired then, and
    /// a second request got in).
    #[test]
    fn a_slot_dropped_outside_a_runtime_is_given_back() {
        let clock = crate::ManualClock::default();
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let limiter = ConcurrencyLimiter::builder(store.clone(), "in-flight", 1)
            .build()
            .unwrap();
        let key = Key::new("tenant");
        let in_flight = || {
            store
                .slots_now(
                    SlotOp::Acquire,
                    "in-flight",
                    &key,
                    0,
                    0,
                    Duration::from_secs(5),
                )
                .1
        };
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for _ in 0..2 {
            let mut acquire = std::pin::pin!(limiter.acquire(&key));
            let std::task::Poll::Ready(Acquired::Held(slot)) = acquire.as_mut().poll(&mut cx)
            else {
                panic!("the memory store answers at once, and the slot is free");
            };
            assert_eq!(in_flight(), 1);
            clock.advance(DEFAULT_SLOT_TTL * 2);
            let mut again = std::pin::pin!(limiter.acquire(&key));
            assert!(
                matches!(
                    again.as_mut().poll(&mut cx),
                    std::task::Poll::Ready(Acquired::Full { .. })
                ),
                "held past its ttl while its request runs"
            );
            drop(slot);
            assert_eq!(in_flight(), 0, "given back at once");
        }
    }

    /// One renewal lost: the next try comes soon enough that the slot never lapses, and a
    /// second request is still refused after the first ttl has passed.
    #[tokio::test(start_paused = true)]
    async fn a_lost_renewal_is_tried_again_before_the_slot_expires() {
        // The default ttl (5 s): renewals every 1.67 s, a lost one retried 0.5 s later.
        let ttl = DEFAULT_SLOT_TTL;
        let (limiter, _) = losing_renewals(1);
        let key = Key::new("tenant");
        let held = limiter.acquire(&key).await;
        assert!(matches!(held, Acquired::Held(_)));
        let start = tokio::time::Instant::now();
        for at in [ttl + ttl / 6, 3 * ttl] {
            tokio::time::sleep_until(start + at).await;
            assert!(
                matches!(limiter.acquire(&key).await, Acquired::Full { .. }),
                "the slot lapsed by {at:?}"
            );
        }
        drop(held);
    }

    /// The store loses a slot in use (here renewals go unanswered past its ttl; on Redis a
    /// restart or failover does the same): the next renewal holds it again, so a second
    /// request is refused from then on instead of running beside the first for as long as it
    /// lasts. Dropped, the slot is given back by the task that renewed it.
    #[tokio::test(start_paused = true)]
    async fn a_slot_the_store_lost_is_held_again() {
        // At the default ttl (5 s) renewals come at 1.67 s, then a lost one is retried 0.5 s
        // after its 0.5 s timeout: four lost ones go up to 5.67 s, past the slot's expiry at 5.
        let (limiter, store) = losing_renewals(4);
        let key = Key::new("tenant");
        let held = limiter.acquire(&key).await;
        assert!(matches!(held, Acquired::Held(_)));
        let start = tokio::time::Instant::now();
        tokio::time::sleep_until(start + Duration::from_millis(5_200)).await;
        let in_flight = |store: &MemoryStore| {
            store
                .slots_now(SlotOp::Acquire, "in-flight", &key, 0, 0, DEFAULT_SLOT_TTL)
                .1
        };
        assert_eq!(in_flight(&store), 0, "the slot lapsed in the store");
        tokio::time::sleep_until(start + Duration::from_secs(6)).await;
        assert_eq!(in_flight(&store), 1, "the renewal held it again");
        assert!(matches!(limiter.acquire(&key).await, Acquired::Full { .. }));
        drop(held);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(in_flight(&store), 0, "given back when dropped");
        assert!(matches!(limiter.acquire(&key).await, Acquired::Held(_)));
    }

    #[test]
    fn a_share_of_the_local_slots_is_the_same_fraction() {
        assert_eq!(local_share(25, 50, 100), 12);
        assert_eq!(local_share(25, 100, 100), 25);
        assert_eq!(local_share(2, 4, 8), 1);
        assert_eq!(local_share(2, 1, 100), 1, "a share above zero is a slot");
        assert_eq!(local_share(2, 0, 100), 0);
        // Never all the local slots below the whole budget: one is left for critical traffic.
        assert_eq!(local_share(1, 50, 100), 0);
        assert_eq!(local_share(2, 99, 100), 1);
        assert_eq!(local_share(u64::MAX, u64::MAX - 1, u64::MAX), u64::MAX - 1);
    }
}
