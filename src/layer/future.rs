//! The future of one call: it only polls. What a decision or an error means for the response is
//! [`verdict`](super::verdict)'s.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::{Config, Targets};
use super::verdict::{self, Verdict};
use super::ResponseBody;
use crate::store::BoxFuture;
use crate::{Decision, Error};

type Decided = (Result<Vec<Decision>, Error>, Targets);

/// What waits for a store decision. Boxed, so that the future stays small on the in-process
/// path, where it is moved a few times per request.
struct Waiting<S, B> {
    config: Arc<Config>,
    grpc: bool,
    inner: S,
    req: Request<B>,
}

pin_project! {
    /// The future of a [`RateLimitService`](super::RateLimitService) call: first the decision,
    /// then (if admitted) the inner service, whose response gets the rate-limit headers, then any
    /// refund its status calls for.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
        verdict: Option<Verdict>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        Deciding {
            decision: BoxFuture<'static, Decided>,
            waiting: Option<Box<Waiting<S, B>>>,
        },
        Calling {
            #[pin]
            future: S::Future,
        },
        Refunding {
            refund: BoxFuture<'static, ()>,
            response: Option<S::Response>,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    /// A call decided on the spot: no boxed future, no extra state. `inner` is the instance
    /// driven ready: it is called if the request is admitted, and otherwise replaced by a fresh
    /// clone, so whatever its readiness reserved (a `ConcurrencyLimit` permit) is released.
    #[inline]
    pub(crate) fn decided(
        config: Arc<Config>,
        targets: Targets,
        decisions: verdict::Decisions,
        grpc: bool,
        inner: &mut S,
        mut req: Request<B>,
    ) -> Self
    where
        S: Clone,
    {
        let mut verdict = Verdict::new(config, targets, decisions, grpc);
        if verdict.admits() {
            verdict.admit(&mut req);
            return ResponseFuture {
                state: State::Calling {
                    future: inner.call(req),
                },
                verdict: Some(verdict),
            };
        }
        release_readiness(inner);
        ResponseFuture {
            state: State::Answered {
                response: Some(verdict.denial()),
            },
            verdict: None,
        }
    }

    /// A call that waits for the store's decision.
    pub(crate) fn check(
        config: Arc<Config>,
        targets: Targets,
        grpc: bool,
        inner: S,
        req: Request<B>,
    ) -> Self {
        let limiter = config.limiter.clone();
        let counting = config.counting();
        let decision: BoxFuture<'static, Decided> = Box::pin(async move {
            let result = limiter.consume_counted(&targets, counting).await;
            (result, targets)
        });
        ResponseFuture {
            state: State::Deciding {
                decision,
                waiting: Some(Box::new(Waiting {
                    config,
                    grpc,
                    inner,
                    req,
                })),
            },
            verdict: None,
        }
    }

    pub(crate) fn pass(future: S::Future) -> Self {
        ResponseFuture {
            state: State::Calling { future },
            verdict: None,
        }
    }

    /// A response the layer writes itself, without calling the service.
    pub(crate) fn answer(response: Response<Bytes>) -> Self {
        ResponseFuture {
            state: State::Answered {
                response: Some(response),
            },
            verdict: None,
        }
    }
}

/// Drop the instance driven ready without calling it (Tower's way to give back what its
/// readiness reserved), leaving a fresh clone in its place.
pub(crate) fn release_readiness<S: Clone>(inner: &mut S) {
    let fresh = inner.clone();
    drop(std::mem::replace(inner, fresh));
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Deciding { decision, waiting } => {
                    let (result, targets) = ready!(decision.as_mut().poll(cx));
                    let Some(waiting) = waiting.take() else {
                        unreachable!("the decision completes once")
                    };
                    let Waiting {
                        config,
                        grpc,
                        mut inner,
                        mut req,
                    } = *waiting;
                    let decisions = match result {
                        Ok(d) => d,
                        Err(error) => {
                            let r = verdict::failure(&error, grpc, config.unavailable_status);
                            return Poll::Ready(Ok(r.map(ResponseBody::full)));
                        }
                    };
                    let mut verdict = Verdict::new(config, targets, decisions.into(), grpc);
                    if verdict.admits() {
                        verdict.admit(&mut req);
                        let future = inner.call(req);
                        *this.verdict = Some(verdict);
                        this.state.set(State::Calling { future });
                    } else {
                        return Poll::Ready(Ok(verdict.denial().map(ResponseBody::full)));
                    }
                }
                StateProj::Calling { future } => {
                    let mut response = match ready!(future.poll(cx)) {
                        Ok(response) => response,
                        Err(error) => {
                            let Some(verdict) = this.verdict.as_mut() else {
                                return Poll::Ready(Err(error));
                            };
                            // A body refused more bytes, which the handler passed on as its
                            // error (`?` on the body): the refusal is the answer, and what
                            // was read stays charged.
                            if let Some(refusal) = verdict.body_refusal() {
                                return Poll::Ready(Ok(refusal.map(ResponseBody::full)));
                            }
                            verdict.on_error();
                            return Poll::Ready(Err(error));
                        }
                    };
                    let Some(verdict) = this.verdict.as_mut() else {
                        return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                    };
                    if let Some(refusal) = verdict.body_refusal() {
                        return Poll::Ready(Ok(refusal.map(ResponseBody::full)));
                    }
                    match verdict.on_response(&mut response) {
                        Some(refund) => this.state.set(State::Refunding {
                            refund,
                            response: Some(response),
                        }),
                        None => {
                            let settle = verdict.body_settle();
                            return Poll::Ready(Ok(
                                response.map(|b| ResponseBody::settled(b, settle))
                            ));
                        }
                    }
                }
                StateProj::Refunding { refund, response } => {
                    ready!(refund.as_mut().poll(cx));
                    let response = response
                        .take()
                        .unwrap_or_else(|| panic!("ResponseFuture polled after completion"));
                    let settle = this.verdict.as_ref().and_then(Verdict::body_settle);
                    return Poll::Ready(Ok(response.map(|b| ResponseBody::settled(b, settle))));
                }
                StateProj::Answered { response } => {
                    let response = response
                        .take()
                        .unwrap_or_else(|| panic!("ResponseFuture polled after completion"));
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}
