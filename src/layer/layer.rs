use std::sync::Arc;

use http::StatusCode;
use tower_layer::Layer;

use super::{HeaderStyle, RateLimitService};
use crate::key::{KeyExtractor, PeerIp};
use crate::Limiter;

/// Rate-limits every request through a [`Limiter`].
///
/// The key comes from the extractor set with [`key`](RateLimitLayer::key), falling back to the
/// peer address (axum's `ConnectInfo<SocketAddr>` or a `SocketAddr` extension). Every response,
/// admitted or denied, carries the rate-limit headers; a denial is a `429 Too Many Requests`
/// with `Retry-After` in whole seconds, rounded up.
///
/// Cheap to clone; every service it makes shares the same limiter, so every clone enforces the
/// same limit.
///
/// ```
/// use axum::{routing::get, Router};
/// use fleetlimit::{key, Key, Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
///
/// let limiter = Limiter::builder(MemoryStore::new())
///     .rule(Rule::new("api", Quota::per_minute(100).build()?)?)
///     .build()?;
/// let layer = RateLimitLayer::new(limiter)
///     .key(key::from_fn(|parts| parts.headers.get("x-api-key").map(|v| Key::new(v.as_bytes()))));
/// let app: Router = Router::new().route("/", get(|| async { "ok" })).layer(layer);
/// # let _ = app;
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct RateLimitLayer {
    pub(crate) config: Arc<Config>,
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) extractor: Option<Arc<dyn KeyExtractor>>,
    pub(crate) peer: PeerIp,
    pub(crate) headers: HeaderStyle,
    pub(crate) unavailable_status: StatusCode,
}

impl std::fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.config.limiter)
            .field("has_extractor", &self.config.extractor.is_some())
            .field("peer", &self.config.peer)
            .field("headers", &self.config.headers)
            .finish()
    }
}

impl RateLimitLayer {
    /// A layer deciding through `limiter`, keyed by the peer address until
    /// [`key`](RateLimitLayer::key) says otherwise.
    pub fn new(limiter: Limiter) -> RateLimitLayer {
        RateLimitLayer {
            config: Arc::new(Config {
                limiter,
                extractor: None,
                peer: PeerIp::default(),
                headers: HeaderStyle::default(),
                unavailable_status: StatusCode::SERVICE_UNAVAILABLE,
            }),
        }
    }

    /// Configuration happens before the layer is shared; a clone made earlier keeps its own.
    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// Key requests with `extractor`; when it returns `None`, the peer address is used.
    pub fn key(mut self, extractor: impl KeyExtractor) -> Self {
        self.config_mut().extractor = Some(Arc::new(extractor));
        self
    }

    /// How the peer-address fallback reads addresses (e.g. the IPv6 grouping prefix).
    pub fn peer_ip(mut self, peer: PeerIp) -> Self {
        self.config_mut().peer = peer;
        self
    }

    /// The status of a refusal made because the store is down and the outage policy fails
    /// closed (default 503 Service Unavailable; 429 is the other common choice).
    pub fn unavailable_status(mut self, status: StatusCode) -> Self {
        self.config_mut().unavailable_status = status;
        self
    }

    /// Which rate-limit headers to write (default [`HeaderStyle::Draft6`]).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.config_mut().headers = style;
        self
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.config.clone())
    }
}
