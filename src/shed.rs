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
//! A shed request gets `503 Service Unavailable` with `Retry-After: 1` (gRPC `UNAVAILABLE`), and
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
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
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
    /// How many priorities are shed, from the least critical (0 to 3).
    level: AtomicU8,
    /// When the level last changed (µs since `epoch`).
    changed_at: AtomicU64,
    epoch: std::time::Instant,
    step_up: Duration,
    step_down: Duration,
}

impl WorkerUtilisation {
    /// Shed once more than `target` requests are in this process's handlers.
    pub fn new(target: u64) -> WorkerUtilisation {
        WorkerUtilisation {
            state: Arc::new(WorkerState {
                target,
                in_flight: AtomicU64::new(0),
                level: AtomicU8::new(0),
                changed_at: AtomicU64::new(0),
                epoch: std::time::Instant::now(),
                step_up: Duration::from_millis(100),
                step_down: Duration::from_secs(1),
            }),
        }
    }

    /// How many priorities are shed now, from the least critical (0: none; 3: all but
    /// critical).
    pub fn level(&self) -> u8 {
        self.state.level.load(Ordering::Relaxed)
    }

    /// Requests in this process's handlers now.
    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::Relaxed)
    }

    /// Adjust the level to the load, one step at a time, and say whether `priority` goes on.
    fn admit(&self, priority: Priority) -> bool {
        let s = &self.state;
        let now = crate::algorithm::micros(s.epoch.elapsed());
        let since = Duration::from_micros(now.saturating_sub(s.changed_at.load(Ordering::Relaxed)));
        let level = s.level.load(Ordering::Relaxed);
        let in_flight = s.in_flight.load(Ordering::Relaxed);
        let next = if in_flight >= s.target && level < 3 && since >= s.step_up {
            level + 1
        } else if in_flight * 10 < s.target * 8 && level > 0 && since >= s.step_down {
            level - 1
        } else {
            level
        };
        if next != level
            && s.level
                .compare_exchange(level, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            s.changed_at.store(now, Ordering::Relaxed);
            tracing::info!(
                from = level,
                to = next,
                in_flight,
                target = s.target,
                "fleetlimit: worker load shedding level changed"
            );
        }
        // Level n sheds the n least critical priorities; critical never.
        priority == Priority::Critical || priority.rank() < 4 - usize::from(next)
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
        let budget = self.slots.limit() as f64;
        // A share above zero is at least one slot, however small the budget.
        let limit = (budget * share).floor() as u64;
        if share > 0.0 {
            limit.max(1)
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

/// The fleet's one key.
fn fleet_key() -> Key {
    Key::new("fleet")
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
            let shed = |reason| Ok(shed_response(priority, reason, grpc).map(ResponseBody::full));
            if let Some(worker) = &config.worker {
                if !worker.admit(priority) {
                    return shed(ShedReason::WorkerUtilisation);
                }
            }
            let slot = match &config.fleet {
                None => None,
                Some(fleet) => {
                    let limit = fleet.limit_for(priority);
                    match fleet.slots.acquire_within(&fleet_key(), limit).await {
                        Acquired::Held(slot) => Some(slot),
                        _ => return shed(ShedReason::FleetUsage),
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

fn shed_response(priority: Priority, reason: ShedReason, grpc: bool) -> Response<bytes::Bytes> {
    let mut response = if grpc {
        crate::layer::grpc_refusal("14", "overloaded")
    } else {
        crate::layer::json_refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"error":"overloaded"}"#.to_owned(),
        )
    };
    response
        .headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
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
            w.state.level.store(level, Ordering::Relaxed);
            // Below the target and within the step times: the level holds.
            w.state.changed_at.store(u64::MAX / 2, Ordering::Relaxed);
            let admitted: Vec<Priority> =
                Priority::ALL.into_iter().filter(|p| w.admit(*p)).collect();
            assert_eq!(admitted.len(), 4 - usize::from(level).min(3), "{level}");
            assert!(admitted.contains(&Priority::Critical));
        }
    }
}
