use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::Config;
use super::{response, HeaderStyle, ResponseBody};
use crate::store::BoxFuture;
use crate::{Decision, Error, Key};

pin_project! {
    /// The future of a [`RateLimitService`](super::RateLimitService) call: first the decision,
    /// then (if admitted) the inner service, whose response gets the rate-limit headers.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
        config: Option<Arc<Config>>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        Deciding {
            decision: BoxFuture<'static, Result<Decision, Error>>,
            inner: Option<S>,
            req: Option<Request<B>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Decision,
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
    pub(crate) fn checking(config: Arc<Config>, key: Key, inner: S, req: Request<B>) -> Self {
        let limiter = config.limiter.clone();
        let decision: BoxFuture<'static, _> =
            Box::pin(async move { limiter.consume(&key, 1).await });
        ResponseFuture {
            state: State::Deciding {
                decision,
                inner: Some(inner),
                req: Some(req),
            },
            config: Some(config),
        }
    }

    /// No extractor produced a key and the peer address is unknown: the server is misconfigured
    /// (e.g. axum served without `into_make_service_with_connect_info`). Say so loudly rather than
    /// share one bucket between every client.
    pub(crate) fn no_key() -> Self {
        tracing::error!(
            "fleetlimit: no rate-limit key for a request (no extractor matched and no peer address; \
             serve axum with `into_make_service_with_connect_info::<SocketAddr>()`)"
        );
        let response = response::json(
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":"no_rate_limit_key"}"#,
        );
        ResponseFuture {
            state: State::Answered {
                response: Some(response),
            },
            config: None,
        }
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
                StateProj::Deciding {
                    decision,
                    inner,
                    req,
                } => {
                    let result = ready!(decision.as_mut().poll(cx));
                    let (headers, unavailable) = this.config.as_ref().map_or(
                        (HeaderStyle::default(), StatusCode::SERVICE_UNAVAILABLE),
                        |c| (c.headers, c.unavailable_status),
                    );
                    match result {
                        Ok(decision) if decision.allowed => {
                            let (Some(mut inner), Some(req)) = (inner.take(), req.take()) else {
                                unreachable!("the request is taken once, on admission")
                            };
                            let future = inner.call(req);
                            this.state.set(State::Calling { future, decision });
                        }
                        Ok(decision) => {
                            let response = response::denied(&decision, headers, unavailable);
                            return Poll::Ready(Ok(response.map(ResponseBody::full)));
                        }
                        Err(error) => {
                            tracing::error!(%error, "fleetlimit: rate-limit decision failed");
                            let response = response::json(
                                StatusCode::SERVICE_UNAVAILABLE,
                                r#"{"error":"rate_limiter_unavailable"}"#,
                            );
                            return Poll::Ready(Ok(response.map(ResponseBody::full)));
                        }
                    }
                }
                StateProj::Calling { future, decision } => {
                    let response = ready!(future.poll(cx))?;
                    let (mut parts, body) = response.into_parts();
                    if let Some(config) = this.config.as_ref() {
                        config.headers.write(decision, &mut parts.headers);
                    }
                    return Poll::Ready(Ok(Response::from_parts(parts, ResponseBody::inner(body))));
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
