//! The Tower face: [`RateLimitLayer`] wraps any `Service<http::Request<B>>`.
//!
//! The decision is made in `call` (the service's `poll_ready` passes straight through to the
//! inner service), and a denial is a response, never an error, so the wrapped service keeps its
//! error type (axum needs `Infallible`).

mod body;
mod future;
#[allow(clippy::module_inception)]
mod layer;
mod response;
mod service;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use layer::RateLimitLayer;
pub use response::HeaderStyle;
pub use service::RateLimitService;
