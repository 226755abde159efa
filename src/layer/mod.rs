//! The Tower face: [`RateLimitLayer`] wraps any `Service<http::Request<B>>`.
//!
//! The decision is made in `call` (the service's `poll_ready` passes straight through to the
//! inner service), and a denial is a response, never an error, so the wrapped service keeps its
//! error type (axum needs `Infallible`) and its body type (wrapped in [`ResponseBody`]).

mod body;
#[cfg(feature = "body")]
pub(crate) mod buffer;
mod future;
mod headers;
#[allow(clippy::module_inception)]
mod layer;
mod meter;
mod response;
mod scope;
mod service;
mod verdict;

pub use body::ResponseBody;
#[cfg(feature = "body")]
pub use buffer::{
    BufferBody, BufferBodyLayer, BufferFuture, BufferedBody, DEFAULT_BODY_READ_TIMEOUT,
};
pub use future::ResponseFuture;
pub use headers::HeaderStyle;
pub use layer::{MissingKey, RateLimitLayer, RateLimitLayerBuilder};
pub use meter::{BodyRateLimited, MeterBody, MeterBodyLayer, MeteredBody};
pub use response::{Denial, DenialFn};
#[cfg(feature = "serde")]
pub(crate) use scope::path_error;
pub use scope::{ActualCost, Scope, Settle};
pub use service::RateLimitService;

use crate::Decision;

pub(crate) use response::is_grpc;
pub(crate) use verdict::no_key;

/// A refusal by another fleetlimit layer, the gRPC way, marked for the layers outside.
pub(crate) fn grpc_refusal(
    code: &'static str,
    message: &'static str,
) -> http::Response<bytes::Bytes> {
    let mut r = response::grpc_status(code, message);
    r.extensions_mut().insert(verdict::Refused);
    r
}

/// When a refusal by another fleetlimit layer (concurrency, shedding) may be tried again:
/// `Retry-After` in whole seconds, rounded up (never earlier than the wait, at least 1), and
/// for a gRPC call `grpc-retry-pushback-ms` too, which gRPC clients read where they ignore
/// `Retry-After` (without it a client retrying `UNAVAILABLE` comes back after its own short
/// backoff, onto an overloaded fleet).
pub(crate) fn retry_after(
    response: &mut http::Response<bytes::Bytes>,
    wait: std::time::Duration,
    grpc: bool,
) {
    let headers = response.headers_mut();
    headers.insert(http::header::RETRY_AFTER, response::retry_after(wait));
    if grpc {
        headers.insert(
            response::GRPC_PUSHBACK.clone(),
            response::pushback(Some(wait)),
        );
    }
}

/// A refusal by another fleetlimit layer, as JSON, marked for the layers outside.
pub(crate) fn json_refusal(status: http::StatusCode, body: String) -> http::Response<bytes::Bytes> {
    let mut r = response::json(status, "application/json", body);
    r.extensions_mut().insert(verdict::Refused);
    r
}

/// No decision could be made and the outage policy refuses.
pub(crate) fn unavailable(grpc: bool, status: http::StatusCode) -> http::Response<bytes::Bytes> {
    if grpc {
        grpc_refusal("14", "rate limiter unavailable")
    } else {
        json_refusal(status, r#"{"error":"rate_limiter_unavailable"}"#.to_owned())
    }
}

/// The rate-limit outcome of a request, put in the request's extensions (so handlers can read
/// it), in a denial's, and, in shadow mode, in the response of a request that would have been
/// denied (so outer middleware can log it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimitInfo {
    /// The most restrictive decision among the rules that applied.
    pub decision: Decision,
    /// Shadow mode let the request through although it would have been denied.
    pub would_deny: bool,
}
