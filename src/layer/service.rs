use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::layer::{Config, Plan};
use super::{ResponseBody, ResponseFuture};

/// The service made by [`RateLimitLayer`](super::RateLimitLayer).
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimitService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        RateLimitService { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ReqBody: http_body::Body,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Backpressure is the inner service's; the rate-limit decision is made per request.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (parts, body) = req.into_parts();
        // Asked only of a layer that charges by body size.
        let body_len = if self.config.after.meters_bodies {
            http_body::Body::size_hint(&body).exact()
        } else {
            None
        };
        let plan = self.config.plan(&parts, body_len);
        let grpc = super::response::is_grpc(&parts);
        let req = Request::from_parts(parts, body);
        match plan {
            Plan::Pass => ResponseFuture::pass(self.inner.call(req)),
            Plan::NoKey => {
                super::future::release_readiness(&mut self.inner);
                ResponseFuture::answer(super::verdict::no_key(grpc))
            }
            Plan::MissingKey => {
                super::future::release_readiness(&mut self.inner);
                ResponseFuture::answer(super::verdict::missing_key(grpc))
            }
            Plan::Check { targets } => match self
                .config
                .limiter
                .consume_now(&targets, self.config.counting())
            {
                // Decided on the spot (an in-process store, a leased block, a remembered
                // denial): the ready service is called now, as it would be without the layer.
                Some(decisions) => ResponseFuture::decided(
                    self.config.clone(),
                    targets,
                    decisions,
                    grpc,
                    &mut self.inner,
                    req,
                ),
                None => {
                    // The call waits for the store: keep the instance driven to readiness for
                    // it and leave a fresh clone behind (the Tower-documented pattern).
                    let clone = self.inner.clone();
                    let inner = std::mem::replace(&mut self.inner, clone);
                    ResponseFuture::check(self.config.clone(), targets, grpc, inner, req)
                }
            },
        }
    }
}
