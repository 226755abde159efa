//! Priority load shedding: when the fleet or one worker is overloaded, refuse the least
//! critical requests first, and recover gradually.
//!
//! Requests are classified by your function into a [`Priority`]. Two shedders, in one layer:
//!
//! - the **fleet usage** shedder ([`FleetUsage`]): a fleet-wide budget of requests in flight
//!   (slots in the store, as [`concurrency`](crate::concurrency) holds them), of which each
//!   priority may fill only its share; the rest stays for more critical traffic (by default
//!   best effort 50%, normal 70%, important 80%, critical all of it);
//! - the **worker utilisation** shedder ([`WorkerUtilisation`]): per process; when requests in
//!   this process's handlers pass a target, it sheds best effort, then normal, then important
//!   traffic, one step at a time, and steps back down one level per second once below 80% of
//!   the target (hysteresis: no cliff either way). Critical requests are never shed by it.
//!
//! A shed request gets `503 Service Unavailable` with `Retry-After: 1` (gRPC `UNAVAILABLE`, the
//! wait also in `grpc-retry-pushback-ms`), and
//! a [`Shed`] extension saying why, for outer middleware and logs.
//!
//! ```
//! use axum::{routing::get, Router};
//! use fleetlimit::shed::{LoadShedLayer, Priority, WorkerUtilisation};
//!
//! let shed = LoadShedLayer::builder(|parts| match parts.method {
//!     http::Method::GET => Priority::Normal,
//!     _ => Priority::Important,
//! })
//! .worker(WorkerUtilisation::new(256))
//! .build()?;
//! let app: Router = Router::new().route("/", get(|| async { "ok" })).layer(shed);
//! # let _ = app;
//! # Ok::<(), fleetlimit::ConfigError>(())
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

use crate::concurrency::{Acquired, ConcurrencyLimiter, HeldBody, Slot};
use crate::layer::ResponseBody;
use crate::{ConfigError, Key};

/// How much a request matters, most critical first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Never shed by a worker; may use the whole fleet budget.
    Critical,
    /// Shed last.
    Important,
    /// Most traffic.
    Normal,
    /// Shed first (batch jobs, prefetches, test traffic).
    BestEffort,
}

impl Priority {
    /// Every priority, most critical first.
    pub const ALL: [Priority; 4] = [
        Priority::Critical,
        Priority::Important,
        Priority::Normal,
        Priority::BestEffort,
    ];

    fn rank(self) -> usize {
        self as usize
    }
}

/// Why a request was shed: in the extensions of the 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// The request's priority.
    pub priority: Priority,
    /// Which shedder refused it.
    pub reason: ShedReason,
}

/// Which shedder refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShedReason {
    /// The fleet's budget for this priority is in use.
    FleetUsage,
    /// This worker is overloaded.
    WorkerUtilisation,
    /// The fleet budget's store could not answer, and its outage policy refused (fail closed):
    /// the 503 carries that policy's `Retry-After`.
    StoreUnavailable,
}

/// The worker utilisation shedder: see the [module](self).
#[derive(Debug, Clone)]
pub struct WorkerUtilisation {
    state: Arc<WorkerState>,
}

#[derive(Debug)]
struct WorkerState {
    target: u64,
    in_flight: AtomicU64,
    /// How many priorities are shed, from the least critical (0 to 3), in the low 8 bits, and
    /// when that last changed (µs since `epoch`) above them: a step is decided on both and taken
    /// in one compare-and-swap, so requests racing at an overload step once, not once each.
    shedding: AtomicU64,
    /// When a request last found the worker at 80% of the target or more (µs since `epoch`,
    /// to the millisecond): quiet, the time steps down count from, starts after it.
    busy_at: AtomicU64,
    clock: Arc<dyn crate::Clock>,
    /// When the worker was made, on `clock` (µs): times are counted from here.
    epoch: u64,
    step_up: Duration,
    step_down: Duration,
}

impl WorkerUtilisation {
    /// Shed once more than `target` requests are in this process's handlers.
    pub fn new(target: u64) -> WorkerUtilisation {
        WorkerUtilisation::with_clock(target, crate::SystemClock)
    }

    /// [`new`](WorkerUtilisation::new), its steps timed by `clock` (a
    /// [`ManualClock`](crate::ManualClock) in tests; it must not step back).
    pub fn with_clock(target: u64, clock: impl crate::Clock) -> WorkerUtilisation {
        let clock: Arc<dyn crate::Clock> = Arc::new(clock);
        WorkerUtilisation {
            state: Arc::new(WorkerState {
                target,
                in_flight: AtomicU64::new(0),
                shedding: AtomicU64::new(0),
                busy_at: AtomicU64::new(0),
                epoch: clock.now_us(),
                clock,
                step_up: Duration::from_millis(100),
                step_down: Duration::from_secs(1),
            }),
        }
    }

    /// How many priorities are shed now, from the least critical (0: none; 3: all but
    /// critical): the level the next request steps to, so that an idle worker's level falls
    /// with time, not only with requests.
    pub fn level(&self) -> u8 {
        let s = &self.state;
        let word = s.shedding.load(Ordering::Relaxed);
        (s.stepped(word, s.now(), s.in_flight.load(Ordering::Relaxed)) & 0xff) as u8
    }

    /// Requests in this process's handlers now.
    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::Relaxed)
    }

    /// Adjust the level to the load, and say whether `priority` goes on.
    fn admit(&self, priority: Priority) -> bool {
        let s = &self.state;
        // One reading of each for the whole step.
        let (now, in_flight) = (s.now(), s.in_flight.load(Ordering::Relaxed));
        s.note_busy(now, in_flight);
        let word = s.shedding.load(Ordering::Relaxed);
        let stepped = s.stepped(word, now, in_flight);
        let level = (word & 0xff) as u8;
        let next = (stepped & 0xff) as u8;
        let level_now = if stepped == word {
            level
        } else {
            match s
                .shedding
                .compare_exchange(word, stepped, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    tracing::info!(
                        from = level,
                        to = next,
                        in_flight,
                        target = s.target,
                        "fleetlimit: worker load shedding level changed"
                    );
                    next
                }
                // Another request stepped first: its level holds.
                Err(current) => (current & 0xff) as u8,
            }
        };
        // Level n sheds the n least critical priorities; critical never.
        priority == Priority::Critical || priority.rank() < 4 - usize::from(level_now)
    }
}

impl WorkerState {
    /// Now, in µs since `epoch`.
    fn now(&self) -> u64 {
        self.clock.now_us().saturating_sub(self.epoch)
    }

    fn below_80_percent(&self, in_flight: u64) -> bool {
        u128::from(in_flight) * 10 < u128::from(self.target) * 8
    }

    /// Record that the worker is busy at `now`, if it is (written at most once a millisecond:
    /// every request of an overload would otherwise write one line).
    fn note_busy(&self, now: u64, in_flight: u64) {
        if self.below_80_percent(in_flight) {
            return;
        }
        if now >= self.busy_at.load(Ordering::Relaxed) + 1_000 {
            // Never backwards: a request that read the clock before another's store is older.
            self.busy_at.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// The level-and-time word after the steps due now: one up per `step_up` at or over the
    /// target; below 80% of it, one down per `step_down` of quiet: since the last change or the
    /// last request that found the worker busy, whichever is later, whenever the next request
    /// comes (a worker that went idle at level 3 is at 0 three seconds later; one held just
    /// under its target by shedding is not quiet, however long ago its level changed).
    fn stepped(&self, word: u64, now: u64, in_flight: u64) -> u64 {
        let (level, changed_at) = ((word & 0xff) as u8, word >> 8);
        let since = now.saturating_sub(changed_at);
        let step_down = crate::algorithm::micros(self.step_down).max(1);
        let (next, changed) = if in_flight >= self.target
            && level < 3
            && since >= crate::algorithm::micros(self.step_up)
        {
            (level + 1, now)
        } else if self.below_80_percent(in_flight) {
            let quiet_from = changed_at.max(self.busy_at.load(Ordering::Relaxed));
            let down = (now.saturating_sub(quiet_from) / step_down).min(u64::from(level));
            (level - down as u8, quiet_from + down * step_down)
        } else {
            (level, changed_at)
        };
        if next == level {
            word
        } else {
            (changed << 8) | u64::from(next)
        }
    }
}

/// Counts a request in the worker's handlers while it lives.
#[derive(Debug)]
struct InFlight(Arc<WorkerState>);

impl InFlight {
    fn enter(state: &Arc<WorkerState>) -> InFlight {
        state.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The fleet usage shedder: see the [module](self).
#[derive(Debug, Clone)]
pub struct FleetUsage {
    slots: ConcurrencyLimiter,
    shares: [f64; 4],
}

impl FleetUsage {
    /// A fleet-wide budget of requests in flight, held as the slots of `slots` (its limit is
    /// the budget; one key for the whole fleet), with the default shares.
    pub fn new(slots: ConcurrencyLimiter) -> FleetUsage {
        FleetUsage {
            slots,
            shares: [1.0, 0.8, 0.7, 0.5],
        }
    }

    /// The share of the budget `priority` may fill (0 to 1; critical traffic always 1).
    pub fn share(mut self, priority: Priority, share: f64) -> FleetUsage {
        if priority != Priority::Critical {
            self.shares[priority.rank()] = share;
        }
        self
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let ordered = self.shares.windows(2).all(|w| w[0] >= w[1]);
        if !self.shares.iter().all(|s| (0.0..=1.0).contains(s)) || !ordered {
            return Err(ConfigError::Invalid {
                setting: "FleetUsage::share",
                reason: "shares are between 0 and 1, and never larger for a less critical priority"
                    .into(),
            });
        }
        Ok(())
    }

    fn limit_for(&self, priority: Priority) -> u64 {
        let share = self.shares[priority.rank()];
        let budget = self.slots.limit();
        if priority == Priority::Critical {
            return budget;
        }
        // A share above zero is at least one slot, but never the whole budget: the rest is
        // always there for critical traffic (a budget of 1 is critical traffic's alone).
        // Rounded down, but not below a whole number the product misses by a rounding error
        // (0.57 of 100 is 56.99999999999999 in binary: 57 slots, not 56).
        let exact = budget as f64 * share;
        let limit = (exact + exact.max(1.0) * 1e-9).floor() as u64;
        if share > 0.0 {
            limit.max(1).min(budget.saturating_sub(1))
        } else {
            0
        }
    }
}

type Classify = Arc<dyn Fn(&Parts) -> Priority + Send + Sync>;

/// The load shedding layer: see the [module](self).
#[derive(Clone)]
pub struct LoadShedLayer {
    config: Arc<ShedConfig>,
}

struct ShedConfig {
    classify: Classify,
    worker: Option<WorkerUtilisation>,
    fleet: Option<FleetUsage>,
}

impl std::fmt::Debug for LoadShedLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadShedLayer")
            .field("worker", &self.config.worker)
            .field("fleet", &self.config.fleet)
            .finish_non_exhaustive()
    }
}

/// Builder for [`LoadShedLayer`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct LoadShedLayerBuilder {
    config: ShedConfig,
}

impl std::fmt::Debug for LoadShedLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadShedLayerBuilder")
            .finish_non_exhaustive()
    }
}

impl LoadShedLayer {
    /// Shed by the priorities `classify` gives requests.
    pub fn builder(
        classify: impl Fn(&Parts) -> Priority + Send + Sync + 'static,
    ) -> LoadShedLayerBuilder {
        LoadShedLayerBuilder {
            config: ShedConfig {
                classify: Arc::new(classify),
                worker: None,
                fleet: None,
            },
        }
    }
}

impl LoadShedLayerBuilder {
    /// Shed when this worker is overloaded.
    pub fn worker(mut self, worker: WorkerUtilisation) -> Self {
        self.config.worker = Some(worker);
        self
    }

    /// Shed by the fleet's usage.
    pub fn fleet(mut self, fleet: FleetUsage) -> Self {
        self.config.fleet = Some(fleet);
        self
    }

    /// Validate and build: at least one shedder.
    pub fn build(self) -> Result<LoadShedLayer, ConfigError> {
        if self.config.worker.is_none() && self.config.fleet.is_none() {
            return Err(ConfigError::Invalid {
                setting: "LoadShedLayer",
                reason: "needs a worker or a fleet shedder".into(),
            });
        }
        if let Some(w) = &self.config.worker {
            if w.state.target == 0 {
                return Err(ConfigError::Invalid {
                    setting: "WorkerUtilisation",
                    reason: "a target of 0 requests sheds everything".into(),
                });
            }
        }
        if let Some(f) = &self.config.fleet {
            f.validate()?;
        }
        Ok(LoadShedLayer {
            config: Arc::new(self.config),
        })
    }
}

impl<S> Layer<S> for LoadShedLayer {
    type Service = LoadShedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadShedService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service made by [`LoadShedLayer`].
#[derive(Clone)]
pub struct LoadShedService<S> {
    inner: S,
    config: Arc<ShedConfig>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for LoadShedService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadShedService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// The future of a [`LoadShedService`] call.
pub type ShedFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// The fleet's one key: the global key, which no client's key can equal (`Key::new("fleet")`
/// was shared with a client whose key was literally `fleet`, when one limiter's name also
/// served a per-client layer).
fn fleet_key() -> Key {
    Key::global()
}

impl<S, B, ResBody> Service<Request<B>> for LoadShedService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<HeldBody<ResBody, Held>>>;
    type Error = S::Error;
    type Future = ShedFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let config = self.config.clone();
        let priority = (config.classify)(&parts);
        let grpc = crate::layer::is_grpc(&parts);
        let req = Request::from_parts(parts, body);
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        Box::pin(async move {
            let shed = |reason, retry_after| {
                let response = shed_response(priority, reason, grpc, retry_after);
                Ok(response.map(ResponseBody::full))
            };
            if let Some(worker) = &config.worker {
                if !worker.admit(priority) {
                    return shed(ShedReason::WorkerUtilisation, SHED_RETRY);
                }
            }
            let slot = match &config.fleet {
                None => None,
                Some(fleet) => {
                    let limit = fleet.limit_for(priority);
                    match fleet.slots.acquire_within(&fleet_key(), limit).await {
                        Acquired::Held(slot) => Some(slot),
                        Acquired::Unavailable { retry_after } => {
                            return shed(ShedReason::StoreUnavailable, retry_after)
                        }
                        _ => return shed(ShedReason::FleetUsage, SHED_RETRY),
                    }
                }
            };
            let counted = config.worker.as_ref().map(|w| InFlight::enter(&w.state));
            let response = inner.call(req).await?;
            Ok(response.map(|body| {
                ResponseBody::inner(HeldBody::new(
                    body,
                    Some(Held {
                        _slot: slot,
                        _counted: counted,
                    }),
                ))
            }))
        })
    }
}

/// The `Retry-After` of a request shed for load: overloads change by the second.
const SHED_RETRY: Duration = Duration::from_secs(1);

fn shed_response(
    priority: Priority,
    reason: ShedReason,
    grpc: bool,
    retry_after: Duration,
) -> Response<bytes::Bytes> {
    let mut response = match reason {
        ShedReason::StoreUnavailable => {
            crate::layer::unavailable(grpc, StatusCode::SERVICE_UNAVAILABLE)
        }
        _ if grpc => crate::layer::grpc_refusal("14", "overloaded"),
        _ => crate::layer::json_refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"error":"overloaded"}"#.to_owned(),
        ),
    };
    crate::layer::retry_after(&mut response, retry_after, grpc);
    response.extensions_mut().insert(Shed { priority, reason });
    response
}

/// What a request admitted by [`LoadShedLayer`] holds until its response body ends: its place
/// in the fleet budget and among its worker's requests in flight.
#[derive(Debug)]
pub struct Held {
    // Held for what their drop gives back.
    _slot: Option<Slot>,
    _counted: Option<InFlight>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_shed_the_least_critical_first_and_never_critical() {
        let w = WorkerUtilisation::new(10);
        for level in 0..=3u8 {
            // Below the target and within the step times (changed "later"): the level holds.
            let changed_at = u64::MAX >> 9;
            w.state
                .shedding
                .store((changed_at << 8) | u64::from(level), Ordering::Relaxed);
            let admitted: Vec<Priority> =
                Priority::ALL.into_iter().filter(|p| w.admit(*p)).collect();
            assert_eq!(admitted.len(), 4 - usize::from(level).min(3), "{level}");
            assert!(admitted.contains(&Priority::Critical));
        }
    }

    /// Requests racing at the first overload instant step the level once, not once each: the
    /// level and its time are one word (two atomics let a request read the old time with the
    /// new level, and step again).
    #[test]
    fn racing_requests_step_once() {
        let clock = crate::ManualClock::new(1_000_000_000);
        let w = WorkerUtilisation::with_clock(10, clock.clone());
        clock.advance(Duration::from_secs(1));
        w.state.in_flight.store(10, Ordering::Relaxed);
        let threads = 8;
        let barrier = Arc::new(std::sync::Barrier::new(threads + 1));
        let rounds = 300;
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (w, barrier) = (w.clone(), barrier.clone());
                std::thread::spawn(move || {
                    for _ in 0..rounds {
                        barrier.wait();
                        w.admit(Priority::BestEffort);
                        barrier.wait();
                    }
                })
            })
            .collect();
        for round in 0..rounds {
            // Level 0, last changed at the epoch: a second ago, so one step is due.
            w.state.shedding.store(0, Ordering::Relaxed);
            barrier.wait();
            barrier.wait();
            assert_eq!(w.level(), 1, "round {round}: stepped more than once");
        }
        for t in workers {
            t.join().unwrap();
        }
    }

    /// A worker whose overload ended steps down one level per second whether or not requests
    /// come: its first request after a quiet spell sees the level the quiet earned, and the
    /// part of a second already waited counts toward the next step.
    #[test]
    fn an_idle_worker_steps_down_with_time_not_with_requests() {
        let worker_since = |ago: Duration| {
            let clock = crate::ManualClock::new(1_000_000_000);
            let w = WorkerUtilisation::with_clock(10, clock.clone());
            clock.advance(ago);
            w
        };
        // At level 3 since the epoch, a minute ago, with nothing in flight.
        let idle = worker_since(Duration::from_secs(60));
        idle.state.shedding.store(3, Ordering::Relaxed);
        assert_eq!(idle.level(), 0, "the level falls while nobody asks");
        assert!(idle.admit(Priority::BestEffort));
        assert_eq!(idle.state.shedding.load(Ordering::Relaxed) & 0xff, 0);

        // 2.5 s after reaching level 3: two steps down, the second taken at 2 s.
        let quiet = worker_since(Duration::from_millis(2_500));
        quiet.state.shedding.store(3, Ordering::Relaxed);
        assert!(quiet.admit(Priority::Normal));
        assert!(!quiet.admit(Priority::BestEffort));
        let word = quiet.state.shedding.load(Ordering::Relaxed);
        assert_eq!(word & 0xff, 1);
        assert_eq!(
            word >> 8,
            2_000_000,
            "the next step is due at 3 s, not 3.5 s"
        );

        // Held just under its target by shedding for the whole minute since its level
        // changed, then a request finds it below 80%: quiet for half a second, not a minute.
        let held = worker_since(Duration::from_secs(60));
        held.state.shedding.store(3, Ordering::Relaxed);
        held.state.in_flight.store(9, Ordering::Relaxed);
        assert!(!held.admit(Priority::Normal));
        held.state.busy_at.store(59_500_000, Ordering::Relaxed);
        held.state.in_flight.store(7, Ordering::Relaxed);
        assert_eq!(held.level(), 3, "half a second of quiet steps nothing");
        held.state.busy_at.store(57_500_000, Ordering::Relaxed);
        assert_eq!(held.level(), 1, "two and a half seconds: two steps");

        // Still busy (at 80% of the target or more): no step down, however long ago.
        let busy = worker_since(Duration::from_secs(60));
        busy.state.shedding.store(3, Ordering::Relaxed);
        busy.state.in_flight.store(8, Ordering::Relaxed);
        assert_eq!(busy.level(), 3);
        assert!(!busy.admit(Priority::Normal));
    }

    /// However small the fleet budget, the less critical priorities never fill all of it.
    #[test]
    fn a_small_budget_always_keeps_a_slot_for_critical_traffic() {
        let usage = |budget| {
            FleetUsage::new(
                crate::concurrency::ConcurrencyLimiter::builder(
                    crate::MemoryStore::new(),
                    "fleet",
                    budget,
                )
                .build()
                .unwrap(),
            )
        };
        let one = usage(1);
        assert_eq!(one.limit_for(Priority::Critical), 1);
        for p in [Priority::Important, Priority::Normal, Priority::BestEffort] {
            assert_eq!(one.limit_for(p), 0, "{p:?}");
        }
        let two = usage(2);
        assert_eq!(two.limit_for(Priority::Critical), 2);
        assert_eq!(two.limit_for(Priority::BestEffort), 1);
        assert_eq!(two.limit_for(Priority::Important), 1);
        let ten = usage(10);
        assert_eq!(ten.limit_for(Priority::BestEffort), 5);
        assert_eq!(ten.limit_for(Priority::Important), 8);
        // Shares whose products miss a whole number in binary.
        let hundred = usage(100)
            .share(Priority::Normal, 0.57)
            .share(Priority::BestEffort, 0.29);
        assert_eq!(hundred.limit_for(Priority::Normal), 57);
        assert_eq!(hundred.limit_for(Priority::BestEffort), 29);
    }

    /// A target no load reaches (`u64::MAX`) never overflows the step-down test.
    #[test]
    fn any_target_is_accepted() {
        let w = WorkerUtilisation::new(u64::MAX);
        w.state.in_flight.store(u64::MAX - 1, Ordering::Relaxed);
        assert!(w.admit(Priority::BestEffort));
    }
}
