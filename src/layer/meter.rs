//! Request bodies charged by their bytes as the handler reads them ([`Scope::cost_body`]): the
//! rate-limit layer charges what the request declares up front and leaves a [`Meter`] in the
//! request's extensions; [`MeterBodyLayer`] wraps the body so that every byte beyond what was
//! charged is charged before the handler sees it.
//!
//! [`Scope::cost_body`]: super::Scope::cost_body

use crate::limiter::Counting;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Buf;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::store::BoxFuture;
use crate::{Decision, Error, Key, Limiter, Taken, Target};

/// Errors a metered body yields: its own (boxed) or the rate limit's.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The error a metered body ends with when its rule refuses more bytes (or no decision could be
/// made); the rate-limit layer answers the client in place of the handler.
#[derive(Debug, thiserror::Error)]
#[error("the request body exceeds its rate limit")]
pub struct BodyRateLimited;

/// One rule charged by body size, for one request.
struct Metered {
    /// Index of the target in the verdict's decisions.
    index: usize,
    rule: usize,
    key: Key,
    /// The quota resolved for the request, charged as read too.
    resolved: Option<Box<crate::Rule>>,
    unit: u64,
    /// Bytes charged so far (up front and as read).
    paid: u64,
    /// The latest decision, once bytes were charged as read.
    latest: Option<Decision>,
    /// Receipts of what was charged as read, for refunds: the first [`MAX_RECEIPTS`].
    receipts: Vec<Taken>,
}

/// The most receipts kept per rule and request. A client chooses its frames' size (hyper hands
/// on a chunk as it came), so a body sent in 1 KiB chunks for an hour would keep hundreds of
/// thousands, and a refund would send them all; past this many, what is charged as read is not
/// given back by a refund (the client loses it: never a permit made).
const MAX_RECEIPTS: usize = 1024;

/// Why a metered body stopped.
pub(crate) enum Stopped {
    /// The decisions of the refused charge, by verdict index.
    Denied(Vec<(usize, Decision)>),
    Failed(Error),
}

#[derive(Default)]
struct MeterState {
    rules: Vec<Metered>,
    stopped: Option<Stopped>,
}

/// What a rate-limit layer leaves in the request's extensions for [`MeterBodyLayer`].
pub(crate) struct Meter {
    limiter: Limiter,
    state: Mutex<MeterState>,
    attached: AtomicBool,
}

/// The request extension carrying the [`Meter`]s of every rate-limit layer the request went
/// through, outermost first.
#[derive(Clone)]
pub(crate) struct BodyMeter(pub(crate) Vec<Arc<Meter>>);

impl Meter {
    pub(crate) fn new(limiter: Limiter) -> Meter {
        Meter {
            limiter,
            state: Mutex::new(MeterState::default()),
            attached: AtomicBool::new(false),
        }
    }

    /// Meter `target` (index `index` of the verdict), charged `target.cost` units up front.
    pub(crate) fn add(&self, index: usize, target: &Target, unit: u64) {
        self.state.lock().rules.push(Metered {
            index,
            rule: target.rule,
            key: target.key.clone(),
            resolved: target.resolved.clone(),
            unit,
            paid: target.cost.saturating_mul(unit),
            latest: None,
            receipts: Vec::new(),
        });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.state.lock().rules.is_empty()
    }

    /// Whether a [`MeterBodyLayer`] wrapped the body.
    pub(crate) fn attached(&self) -> bool {
        self.attached.load(Ordering::Relaxed)
    }

    /// What `read` bytes in total still owe, per rule, as targets to consume.
    fn owed(&self, read: u64) -> Vec<Target> {
        let state = self.state.lock();
        state
            .rules
            .iter()
            .filter(|m| read > m.paid)
            .map(|m| Target {
                rule: m.rule,
                key: m.key.clone(),
                cost: (read - m.paid).div_ceil(m.unit),
                resolved: m.resolved.clone(),
            })
            .collect()
    }

    /// Record the outcome of charging `targets`: Ok if every rule admitted.
    fn settle(&self, targets: &[Target], result: Result<Vec<Decision>, Error>) -> Result<(), ()> {
        let mut state = self.state.lock();
        let decisions = match result {
            Ok(decisions) => decisions,
            Err(error) => {
                state.stopped = Some(Stopped::Failed(error));
                return Err(());
            }
        };
        if decisions.iter().any(|d| !d.allowed) {
            let by_index = targets
                .iter()
                .zip(decisions)
                .filter_map(|(target, decision)| {
                    let m = state
                        .rules
                        .iter()
                        .find(|m| m.rule == target.rule && m.key == target.key)?;
                    Some((m.index, decision))
                })
                .collect();
            state.stopped = Some(Stopped::Denied(by_index));
            return Err(());
        }
        for (target, mut decision) in targets.iter().zip(decisions) {
            let metered = state
                .rules
                .iter_mut()
                .find(|m| m.rule == target.rule && m.key == target.key);
            if let Some(m) = metered {
                m.paid = m.paid.saturating_add(target.cost.saturating_mul(m.unit));
                if m.receipts.len() < MAX_RECEIPTS {
                    m.receipts.extend(decision.taken.take());
                }
                m.latest = Some(decision);
            }
        }
        Ok(())
    }

    /// Why the body stopped, if it did.
    pub(crate) fn stopped(&self) -> Option<Stopped> {
        self.state.lock().stopped.take()
    }

    /// The latest decision of each metered rule that charged bytes as read, by verdict index.
    pub(crate) fn latest(&self) -> Vec<(usize, Decision)> {
        let state = self.state.lock();
        state
            .rules
            .iter()
            .filter_map(|m| Some((m.index, m.latest?)))
            .collect()
    }

    /// The receipts of what verdict target `index` was charged as read.
    pub(crate) fn receipts(&self, index: usize) -> Vec<Taken> {
        let mut state = self.state.lock();
        state
            .rules
            .iter_mut()
            .find(|m| m.index == index)
            .map(|m| std::mem::take(&mut m.receipts))
            .unwrap_or_default()
    }
}

/// Wraps request bodies so that the rules of a [`Scope::cost_body`](super::Scope::cost_body)
/// are charged as the handler reads them. Place it inside the
/// [`RateLimitLayer`](super::RateLimitLayer) (in axum, `.layer(MeterBodyLayer)` before
/// `.layer(rate_limit)`); requests that no such rule charged pass untouched. The service it
/// makes hands the inner service a [`MeteredBody`], which axum's routers accept.
///
/// ```
/// use axum::{routing::put, Router};
/// use fleetlimit::layer::{MeterBodyLayer, Scope};
/// use fleetlimit::{Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
///
/// let limiter = Limiter::builder(MemoryStore::new())
///     .rule(Rule::new("upload-kib", Quota::per_minute(10 * 1024).build()?)?)
///     .build()?;
/// let limit = RateLimitLayer::builder(limiter)
///     .scope("upload-kib", Scope::new().cost_body(1024))
///     .build()?;
/// let app: Router = Router::new()
///     .route("/files/{name}", put(|body: axum::body::Bytes| async move { body.len().to_string() }))
///     .layer(MeterBodyLayer)
///     .layer(limit);
/// # let _ = app;
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct MeterBodyLayer;

impl<S> Layer<S> for MeterBodyLayer {
    type Service = MeterBody<S>;

    fn layer(&self, inner: S) -> MeterBody<S> {
        MeterBody { inner }
    }
}

/// The service made by [`MeterBodyLayer`].
#[derive(Debug, Clone)]
pub struct MeterBody<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for MeterBody<S>
where
    S: Service<Request<MeteredBody<B>>>,
    B: Body,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> S::Future {
        let meters = req
            .extensions()
            .get::<BodyMeter>()
            .map(|m| m.0.clone())
            .unwrap_or_default();
        for meter in &meters {
            meter.attached.store(true, Ordering::Relaxed);
        }
        self.inner.call(req.map(|inner| MeteredBody {
            inner,
            meters,
            read: 0,
            pending: None,
            done: false,
        }))
    }
}

/// A charge waiting for the store, with the frame it is for and the meter it charges (the
/// frame goes on once every meter from this one on is paid).
struct Pending<D> {
    frame: Option<Frame<D>>,
    meter: usize,
    targets: Vec<Target>,
    charge: BoxFuture<'static, Result<Vec<Decision>, Error>>,
}

pin_project! {
    /// A request body whose bytes are charged as they are read (see [`MeterBodyLayer`]). It
    /// ends with [`BodyRateLimited`] when its rule refuses more.
    pub struct MeteredBody<B> {
        #[pin]
        inner: B,
        meters: Vec<Arc<Meter>>,
        read: u64,
        pending: Option<Pending<bytes::Bytes>>,
        done: bool,
    }
}

impl<B> std::fmt::Debug for MeteredBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredBody")
            .field("meters", &self.meters.len())
            .field("read", &self.read)
            .finish_non_exhaustive()
    }
}

impl<B> Body for MeteredBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<bytes::Bytes>, BoxError>>> {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        // The frame being paid for, and the first meter not yet charged for it.
        let (frame, from) = match this.pending.take() {
            Some(mut pending) => match pending.charge.as_mut().poll(cx) {
                Poll::Pending => {
                    *this.pending = Some(pending);
                    return Poll::Pending;
                }
                Poll::Ready(result) => {
                    let meter = &this.meters[pending.meter];
                    if meter.settle(&pending.targets, result).is_err() {
                        *this.done = true;
                        return Poll::Ready(Some(Err(Box::new(BodyRateLimited))));
                    }
                    (pending.frame, pending.meter + 1)
                }
            },
            None => {
                let frame = match ready!(this.inner.as_mut().poll_frame(cx)) {
                    None => return Poll::Ready(None),
                    Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
                    Some(Ok(frame)) => {
                        frame.map_data(|mut data| data.copy_to_bytes(data.remaining()))
                    }
                };
                let Some(data) = frame.data_ref() else {
                    return Poll::Ready(Some(Ok(frame)));
                };
                *this.read = this.read.saturating_add(data.len() as u64);
                (Some(frame), 0)
            }
        };
        // Each layer's meter in turn, outermost first: the frame goes on once all have paid.
        for i in from..this.meters.len() {
            let meter = &this.meters[i];
            let targets = meter.owed(*this.read);
            if targets.is_empty() {
                continue;
            }
            let result = match meter.limiter.consume_now(&targets, Counting::Charge) {
                Some(decisions) => Ok(decisions.into_vec()),
                None => {
                    let limiter = meter.limiter.clone();
                    let owed = targets.clone();
                    let mut charge: BoxFuture<'static, _> =
                        Box::pin(
                            async move { limiter.consume_counted(&owed, Counting::Charge).await },
                        );
                    match charge.as_mut().poll(cx) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            *this.pending = Some(Pending {
                                frame,
                                meter: i,
                                targets,
                                charge,
                            });
                            return Poll::Pending;
                        }
                    }
                }
            };
            if meter.settle(&targets, result).is_err() {
                *this.done = true;
                return Poll::Ready(Some(Err(Box::new(BodyRateLimited))));
            }
        }
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.done || (self.pending.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
