//! The Tower face: [`RateLimitLayer`] wraps any `Service<http::Request<B>>`.
//!
//! The decision is made in `call` (the service's `poll_ready` passes straight through to the
//! inner service), and a denial is a response, never an error, so the wrapped service keeps its
//! error type (axum needs `Infallible`) and its body type (wrapped in [`ResponseBody`]).

mod body;
#[cfg(feature = "body")]
mod buffer;
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
pub use buffer::{BufferBody, BufferBodyLayer, BufferFuture, BufferedBody};
pub use future::ResponseFuture;
pub use headers::HeaderStyle;
pub use layer::{MissingKey, RateLimitLayer, RateLimitLayerBuilder};
pub use meter::{BodyRateLimited, MeterBody, MeterBodyLayer, MeteredBody};
pub use response::{Denial, DenialFn};
pub use scope::Scope;
pub use service::RateLimitService;

use crate::Decision;

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
