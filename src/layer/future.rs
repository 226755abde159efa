use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::{Config, Targets};
use super::{response, RateLimitInfo, ResponseBody};
use crate::store::{BoxFuture, Op};
use crate::{Decision, Error, Key, Rule, Source};

/// What was decided for one request, kept until the response is out.
struct Verdict {
    config: Arc<Config>,
    targets: Targets,
    decisions: Decisions,
    governing: Decision,
    /// Shadow mode let through a request that would have been denied.
    would_deny: bool,
}

impl Verdict {
    fn new(
        config: Arc<Config>,
        targets: Targets,
        decisions: Decisions,
        started: Instant,
    ) -> Verdict {
        log_decisions(&config, &targets, &decisions, started);
        let governing = decisions
            .iter()
            .copied()
            .reduce(Decision::more_restrictive)
            .unwrap_or_else(|| Decision::admit(0, 0, std::time::Duration::ZERO));
        let would_deny = !governing.allowed && config.shadow;
        if would_deny {
            tracing::info!(
                retry_after = ?governing.retry_after,
                "fleetlimit: shadow mode let through a request it would deny"
            );
        }
        Verdict {
            config,
            targets,
            decisions,
            governing,
            would_deny,
        }
    }

    /// Whether the request goes on to the service (admitted, or let through by shadow mode).
    fn admits(&self) -> bool {
        self.governing.allowed || self.would_deny
    }

    /// The response refusing the request.
    fn denial(&self, grpc: bool) -> Response<Bytes> {
        let c = &self.config;
        let mut response = response::denied(&self.governing, &c.denial, grpc, c.unavailable_status);
        self.write_headers(response.headers_mut());
        response.extensions_mut().insert(self.info());
        response
    }

    fn rules(&self) -> Vec<&Rule> {
        let rules = self.config.limiter.rules();
        self.targets
            .iter()
            .filter_map(|(i, _)| rules.get(*i))
            .collect()
    }

    fn write_headers(&self, headers: &mut http::HeaderMap) {
        let style = self.config.headers;
        // Only the IETF style names the rules; the others need no list.
        let rules = if style == super::HeaderStyle::Ietf {
            self.rules()
        } else {
            Vec::new()
        };
        style.write(&rules, &self.decisions, &self.governing, headers);
    }

    fn info(&self) -> RateLimitInfo {
        RateLimitInfo {
            decision: self.governing,
            would_deny: self.would_deny,
        }
    }

    /// The permits to give back for a response with this status, if any.
    fn refund(&self, status: StatusCode) -> Option<BoxFuture<'static, ()>> {
        let counted = matches!(self.governing.source, Source::Store | Source::Lease);
        if !self.governing.allowed || self.would_deny || !counted {
            return None; // nothing was taken from the shared budget
        }
        let refunds: Vec<(usize, Key, crate::Taken)> = self
            .targets
            .iter()
            .zip(&self.decisions)
            .filter(|((i, _), _)| {
                self.config.scopes[*i]
                    .refund_if
                    .as_ref()
                    .is_some_and(|refund| refund(status))
            })
            .filter_map(|((i, key), d)| Some((*i, key.clone(), d.taken?)))
            .collect();
        if refunds.is_empty() {
            return None;
        }
        let limiter = self.config.limiter.clone();
        Some(Box::pin(async move {
            if let Err(error) = limiter.refund_parts(&refunds).await {
                tracing::warn!(%error, "fleetlimit: refund failed; the permits stay taken");
            }
        }))
    }
}

type Decided = (Result<Vec<Decision>, Error>, Targets);
type Decisions = smallvec::SmallVec<[Decision; 2]>;

/// What waits for a store decision. Boxed, so that the future stays small on the in-process
/// path, where it is moved a few times per request.
struct Waiting<S, B> {
    config: Arc<Config>,
    grpc: bool,
    inner: S,
    req: Request<B>,
    started: Instant,
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
    pub(crate) fn check(
        config: Arc<Config>,
        targets: Targets,
        cost: u64,
        grpc: bool,
        mut inner: S,
        mut req: Request<B>,
    ) -> Self {
        // An in-process store decides on the spot: no boxed future, no extra state.
        if let Some(decisions) = config.limiter.consume_now(&targets, cost) {
            let started = Instant::now();
            let verdict = Verdict::new(config, targets, decisions, started);
            if verdict.admits() {
                req.extensions_mut().insert(verdict.info());
                return ResponseFuture {
                    state: State::Calling {
                        future: inner.call(req),
                    },
                    verdict: Some(verdict),
                };
            }
            return ResponseFuture {
                state: State::Answered {
                    response: Some(verdict.denial(grpc)),
                },
                verdict: None,
            };
        }
        let limiter = config.limiter.clone();
        let decision: BoxFuture<'static, Decided> = Box::pin(async move {
            let result = limiter.apply_indexed(Op::Consume, &targets, cost).await;
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
                    started: Instant::now(),
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

    /// No extractor produced a key and the peer address is unknown: the server is misconfigured
    /// (e.g. axum served without `into_make_service_with_connect_info`). Say so loudly rather than
    /// share one bucket between every client.
    pub(crate) fn no_key(grpc: bool) -> Self {
        tracing::error!(
            "fleetlimit: no rate-limit key for a request (no extractor matched and no peer address; \
             serve axum with `into_make_service_with_connect_info::<SocketAddr>()`)"
        );
        let response = if grpc {
            let mut r = Response::new(Bytes::new());
            let h = r.headers_mut();
            h.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            h.insert("grpc-status", http::HeaderValue::from_static("13"));
            h.insert(
                "grpc-message",
                http::HeaderValue::from_static("no rate-limit key"),
            );
            r
        } else {
            response::json(
                StatusCode::INTERNAL_SERVER_ERROR,
                "application/json",
                r#"{"error":"no_rate_limit_key"}"#,
            )
        };
        ResponseFuture {
            state: State::Answered {
                response: Some(response),
            },
            verdict: None,
        }
    }
}

fn log_decisions(
    config: &Config,
    targets: &[(usize, Key)],
    decisions: &[Decision],
    started: Instant,
) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let latency_us = started.elapsed().as_micros() as u64;
    for ((i, key), d) in targets.iter().zip(decisions) {
        let rule = config.limiter.rules().get(*i).map_or("?", |r| r.name());
        tracing::debug!(
            rule,
            %key,
            allowed = d.allowed,
            remaining = d.remaining,
            source = ?d.source,
            degraded = d.degraded,
            latency_us,
            "fleetlimit: decision"
        );
    }
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
                        started,
                    } = *waiting;
                    let decisions = match result {
                        Ok(d) => d,
                        Err(error) => {
                            tracing::error!(%error, "fleetlimit: rate-limit decision failed");
                            let r = response::json(
                                StatusCode::SERVICE_UNAVAILABLE,
                                "application/json",
                                r#"{"error":"rate_limiter_unavailable"}"#,
                            );
                            return Poll::Ready(Ok(r.map(ResponseBody::full)));
                        }
                    };
                    let verdict = Verdict::new(config, targets, decisions.into(), started);
                    if verdict.admits() {
                        req.extensions_mut().insert(verdict.info());
                        let future = inner.call(req);
                        *this.verdict = Some(verdict);
                        this.state.set(State::Calling { future });
                    } else {
                        return Poll::Ready(Ok(verdict.denial(grpc).map(ResponseBody::full)));
                    }
                }
                StateProj::Calling { future } => {
                    let mut response = ready!(future.poll(cx))?;
                    let Some(verdict) = this.verdict.as_ref() else {
                        return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                    };
                    verdict.write_headers(response.headers_mut());
                    if verdict.would_deny {
                        response.extensions_mut().insert(verdict.info());
                    }
                    match verdict.refund(response.status()) {
                        Some(refund) => this.state.set(State::Refunding {
                            refund,
                            response: Some(response),
                        }),
                        None => return Poll::Ready(Ok(response.map(ResponseBody::inner))),
                    }
                }
                StateProj::Refunding { refund, response } => {
                    ready!(refund.as_mut().poll(cx));
                    let response = response
                        .take()
                        .unwrap_or_else(|| panic!("ResponseFuture polled after completion"));
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
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
