use std::sync::Arc;

use http::request::Parts;
use http::StatusCode;
use tower_layer::Layer;

use super::{Denial, HeaderStyle, RateLimitService, Scope};
use crate::error::ConfigError;
use crate::key::{KeyExtractor, PeerIp};
use crate::{Key, Limiter, Target};

/// What to do with a request for which no key can be found.
///
/// For the layer's key ([`RateLimitLayerBuilder::on_missing_key`]): no extractor matched and the
/// peer address is unknown, a server misconfiguration (axum served without
/// `into_make_service_with_connect_info`, say); the default, `Reject`, answers `500` with
/// `{"error":"no_rate_limit_key"}` and logs an error. For a scope's own key
/// ([`Scope::on_missing_key`]): the client did not send it; the default there is `Skip`, and
/// `Reject` answers `400` with `{"error":"missing_rate_limit_key"}`, logged at `debug`: client
/// input never causes a server error. A scope's setting, when given, also replaces the layer's
/// for a scope keyed by the layer's key (a login rule may skip anonymous requests while the
/// layer rejects keyless ones elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Refuse the request (500 for the layer's key, 400 for a scope's own key).
    #[default]
    Reject,
    /// Let the request through without that rule.
    Skip,
    /// Count it in one bucket shared by every keyless request.
    Shared,
}

/// Rate-limits every request through a [`Limiter`].
///
/// The key comes from the extractor set with [`key`](RateLimitLayerBuilder::key), falling back
/// to the peer address (axum's `ConnectInfo<SocketAddr>`, tonic's connect info, or a
/// `SocketAddr` extension; forwarding headers only from trusted proxies). Every response the
/// limiter decided, admitted or denied, carries the rate-limit headers (an outage policy's
/// answer counted nothing and carries none); a denial is a `429 Too Many Requests` with
/// `Retry-After` in whole seconds, rounded up (gRPC calls get `RESOURCE_EXHAUSTED`), unless
/// the cost can never be admitted.
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
/// let layer = RateLimitLayer::builder(limiter)
///     .key(key::header("x-api-key"))
///     .build()?;
/// let app: Router = Router::new().route("/", get(|| async { "ok" })).layer(layer);
/// # let _ = app;
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct RateLimitLayer {
    pub(crate) config: Arc<Config>,
}

pub(crate) type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) key: Option<Arc<dyn KeyExtractor>>,
    pub(crate) peer: PeerIp,
    /// One entry per limiter rule, in the limiter's order.
    pub(crate) scopes: Box<[Scope]>,
    pub(crate) cost: Option<CostFn>,
    pub(crate) headers: HeaderStyle,
    pub(crate) denial: Denial,
    pub(crate) unavailable_status: StatusCode,
    pub(crate) cost_exceeds_limit_status: StatusCode,
    pub(crate) missing_key: MissingKey,
    pub(crate) shadow: bool,
    /// What any scope does once a request is admitted, worked out when the layer is built so
    /// that a request whose scopes do none of it skips the work.
    pub(crate) after: AfterAdmission,
}

/// Whether any of a layer's scopes meters request bodies, settles at the response, or refunds
/// by status.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AfterAdmission {
    pub(crate) meters_bodies: bool,
    pub(crate) settles: bool,
    pub(crate) refunds: bool,
}

/// The (rule, key, cost) a request counts against; most requests have one or two.
pub(crate) type Targets = smallvec::SmallVec<[Target; 2]>;

/// What the layer does with one request.
pub(crate) enum Plan {
    /// No rule applies (or the request costs nothing): straight to the service.
    Pass,
    /// No key at all for the layer's key (no peer address): the server is misconfigured.
    NoKey,
    /// A scope's own key is missing and its rule says reject: the client's request is incomplete.
    MissingKey,
    /// Consume from these targets, each at its own cost, all or nothing.
    Check { targets: Targets },
}

impl Config {
    /// How this layer's decisions count: in shadow mode, a refusal let through earns no block.
    pub(crate) fn counting(&self) -> crate::limiter::Counting {
        if self.shadow {
            crate::limiter::Counting::Shadowed
        } else {
            crate::limiter::Counting::Request
        }
    }

    /// Which rules apply to the request with these `parts`, each at its cost. `body_len`: the
    /// exact length its body's framing gives (`size_hint`), for the rules charged by body
    /// size; `None` when unknown or not asked.
    pub(crate) fn plan(&self, parts: &Parts, body_len: Option<u64>) -> Plan {
        let mut layer_cost: Option<u64> = None;
        let mut default_key: Option<Option<Key>> = None;
        let mut targets = Targets::new();
        for (i, scope) in self.scopes.iter().enumerate() {
            if !scope.matches(parts) {
                continue;
            }
            let cost = match (scope.body_unit, &scope.cost) {
                (Some(unit), _) => body_cost(parts, body_len, unit),
                (None, Some(cost)) => cost(parts),
                (None, None) => *layer_cost
                    .get_or_insert_with(|| self.cost.as_ref().map_or(1, |cost| cost(parts))),
            };
            if cost == 0 {
                continue; // this rule charges nothing for this request
            }
            // A scope keyed by address misses its key only when the server records no peer
            // address: a misconfiguration, answered as the layer's own key would be (by
            // default 500, and an error logged), never a rule silently skipped for every
            // request.
            let own_missing = |per_address: bool| match (scope.missing_key, per_address) {
                (Some(missing), _) => (missing, per_address),
                (None, true) => (self.missing_key, true),
                (None, false) => (MissingKey::Skip, false),
            };
            let (key, (missing, no_peer)) = match &scope.key {
                Some(_) if scope.by_layer_peer => (self.peer.extract(parts), own_missing(true)),
                Some(extractor) => (
                    extractor.extract(parts),
                    own_missing(extractor.per_address()),
                ),
                None => (
                    default_key
                        .get_or_insert_with(|| {
                            self.key
                                .as_ref()
                                .and_then(|e| e.extract(parts))
                                .or_else(|| self.peer.extract(parts))
                        })
                        .clone(),
                    (scope.missing_key.unwrap_or(self.missing_key), true),
                ),
            };
            let unreadable = || scope.key.as_ref().is_some_and(|e| e.unreadable(parts));
            let key = match (key, missing) {
                (Some(key), _) => key,
                (None, MissingKey::Shared) => Key::keyless(),
                (None, MissingKey::Skip) if unreadable() => Key::keyless(),
                (None, MissingKey::Skip) => {
                    tracing::debug!(
                        rule = self.limiter.rules().get(i).map_or("?", |r| r.name()),
                        "fleetlimit: no key for this rule in the request; the rule is skipped"
                    );
                    continue;
                }
                // Shadow mode never refuses: the rule is skipped, and said as the refusal would be.
                (None, MissingKey::Reject) if self.shadow => {
                    if no_peer {
                        super::verdict::say_no_key();
                    } else {
                        tracing::debug!(
                            "fleetlimit: shadow mode let through a request without the key a rule requires"
                        );
                    }
                    continue;
                }
                // A scope's own key comes from the client: its absence is the client's fault.
                (None, MissingKey::Reject) if !no_peer => return Plan::MissingKey,
                (None, MissingKey::Reject) => return Plan::NoKey,
            };
            let resolved = scope
                .quota
                .as_ref()
                .and_then(|quota| quota(parts))
                .and_then(|q| self.limiter.resolved(i, q));
            targets.push(Target {
                rule: i,
                key,
                cost,
                resolved,
            });
        }
        if targets.is_empty() {
            Plan::Pass
        } else {
            Plan::Check { targets }
        }
    }
}

/// The up-front cost of a rule charged by body size: the declared length in `unit`s started;
/// without a `Content-Length`, the length the body's framing gives (`body_len`: none at all for
/// a GET over HTTP/1.1 or a request whose HTTP/2 headers end the stream, which costs nothing),
/// else one unit (the rest is metered as it is read).
fn body_cost(parts: &Parts, body_len: Option<u64>, unit: u64) -> u64 {
    let unit = unit.max(1);
    match parts.headers.get(http::header::CONTENT_LENGTH) {
        Some(length) => length
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            // An unreadable length is the client's; hyper refuses it before we see it.
            .map_or(1, |bytes| bytes.div_ceil(unit)),
        None => body_len.map_or(1, |bytes| bytes.div_ceil(unit)),
    }
}

impl std::fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.config;
        f.debug_struct("RateLimitLayer")
            .field("limiter", &c.limiter)
            .field("scopes", &c.scopes)
            .field("headers", &c.headers)
            .field("denial", &c.denial)
            .field("missing_key", &c.missing_key)
            .field("shadow", &c.shadow)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A layer with the defaults: every rule of `limiter` on every request, keyed by the peer
    /// address, draft-6 headers, JSON 429s.
    pub fn new(limiter: Limiter) -> RateLimitLayer {
        RateLimitLayer::builder(limiter).finish()
    }

    /// Configure keys, scopes, cost, headers and denials.
    pub fn builder(limiter: Limiter) -> RateLimitLayerBuilder {
        let scopes = vec![Scope::new(); limiter.rules().len()];
        RateLimitLayerBuilder {
            config: Config {
                limiter,
                key: None,
                peer: PeerIp::default(),
                scopes: scopes.into_boxed_slice(),
                cost: None,
                headers: HeaderStyle::default(),
                denial: Denial::default(),
                unavailable_status: StatusCode::SERVICE_UNAVAILABLE,
                cost_exceeds_limit_status: StatusCode::TOO_MANY_REQUESTS,
                missing_key: MissingKey::default(),
                shadow: false,
                after: AfterAdmission::default(),
            },
            errors: Vec::new(),
        }
    }
}

/// Builder for [`RateLimitLayer`]; [`build`](RateLimitLayerBuilder::build) validates.
#[must_use = "a layer builder does nothing until `build` is called"]
pub struct RateLimitLayerBuilder {
    config: Config,
    errors: Vec<ConfigError>,
}

impl std::fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .finish_non_exhaustive()
    }
}

impl RateLimitLayerBuilder {
    /// Key requests with `extractor`; when it returns `None`, the peer address is used.
    pub fn key(mut self, extractor: impl KeyExtractor) -> Self {
        self.config.key = Some(Arc::new(extractor));
        self
    }

    /// How the peer address is read: trusted proxies, IPv6 grouping.
    pub fn peer_ip(mut self, peer: PeerIp) -> Self {
        self.config.peer = peer;
        self
    }

    /// Where and how the limiter's rule `rule` applies. Rules without a scope apply to every
    /// request with the layer's key. An unknown rule name is an error at `build`.
    pub fn scope(mut self, rule: &str, scope: Scope) -> Self {
        match self
            .config
            .limiter
            .rules()
            .iter()
            .position(|r| r.name() == rule)
        {
            Some(i) => self.config.scopes[i] = scope,
            None => self.errors.push(ConfigError::Invalid {
                setting: "scope",
                reason: format!("the limiter has no rule named {rule:?}"),
            }),
        }
        self
    }

    /// The cost of a request, from its parts (a bulk import 10, a read 1), for every rule
    /// whose scope sets no cost of its own ([`Scope::cost`]). A cost of 0 lets the request
    /// through without counting it on those rules.
    pub fn cost(mut self, cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Self {
        self.config.cost = Some(Arc::new(cost));
        self
    }

    /// Which rate-limit headers to write (default [`HeaderStyle::Draft6`]).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.config.headers = style;
        self
    }

    /// How denials are answered (default [`Denial::Json`]).
    pub fn denial(mut self, denial: Denial) -> Self {
        self.config.denial = denial;
        self
    }

    /// The status of a refusal made because the store is down and the outage policy fails
    /// closed (default 503 Service Unavailable; 429 is the other common choice).
    pub fn unavailable_status(mut self, status: StatusCode) -> Self {
        self.config.unavailable_status = status;
        self
    }

    /// The status of a denial because the request costs more than a rule can ever admit
    /// (default 429, with `{"error":"cost_exceeds_limit"}` and no `Retry-After`: waiting never
    /// helps). `413 Payload Too Large` is the honest answer when the cost is the body's size.
    pub fn cost_exceeds_limit_status(mut self, status: StatusCode) -> Self {
        self.config.cost_exceeds_limit_status = status;
        self
    }

    /// What to do with requests that have no key at all: no extractor matched and the peer
    /// address is unknown (default [`MissingKey::Reject`]: a 500 and an error log, since the
    /// server cannot tell its clients apart). A scope's own key has its own rule,
    /// [`Scope::on_missing_key`].
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.config.missing_key = missing;
        self
    }

    /// Shadow mode, for rolling out a new limit: decide, count, set headers and log as usual,
    /// but never deny (a request without a key a rule rejects without is let through, that rule
    /// skipped, and logged as its refusal would be). A request that would have been denied is logged at `debug` (and counted
    /// as `shadow_denied` in the metrics) and its response carries
    /// [`RateLimitInfo`](super::RateLimitInfo) with `would_deny: true`. Its refusals earn no
    /// block in the limiter's penalty box: a block is a real listing, enforced by every limiter
    /// on the store. A rule charged by body size ([`Scope::cost_body`]) is charged up front only
    /// (the declared length, or a unit for a body of unknown length): its body is not metered
    /// as it is read, so a byte quota in shadow mode reads low for streamed uploads.
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.config.shadow = shadow;
        self
    }

    /// Validate and build the layer.
    pub fn build(mut self) -> Result<RateLimitLayer, ConfigError> {
        if let Some(error) = self.errors.drain(..).next() {
            return Err(error);
        }
        self.config.peer.check()?;
        if !self.config.unavailable_status.is_client_error()
            && !self.config.unavailable_status.is_server_error()
        {
            return Err(ConfigError::Invalid {
                setting: "unavailable_status",
                reason: format!("{} is not an error status", self.config.unavailable_status),
            });
        }
        let status = self.config.cost_exceeds_limit_status;
        if !status.is_client_error() {
            return Err(ConfigError::Invalid {
                setting: "cost_exceeds_limit_status",
                reason: format!("{status} is not a client error status"),
            });
        }
        for settle in self.config.scopes.iter().filter_map(|s| s.settle.as_ref()) {
            settle.check()?;
        }
        for path in self.config.scopes.iter().filter_map(|s| s.path.as_ref()) {
            path.check()?;
        }
        if self.config.scopes.iter().any(|s| s.body_unit == Some(0)) {
            return Err(ConfigError::Invalid {
                setting: "Scope::cost_body",
                reason: "a unit of 0 bytes".into(),
            });
        }
        let c = &self.config;
        let extractors = c
            .key
            .iter()
            .chain(c.scopes.iter().filter_map(|s| s.key.as_ref()));
        for extractor in extractors {
            extractor.check()?;
        }
        self.warn_about_client_chosen_keys();
        Ok(self.finish())
    }

    /// A key the client chooses freely, with no rule counting per address in front of it, does
    /// not limit a client that sends a new value each time: say so when the layer is built.
    fn warn_about_client_chosen_keys(&self) {
        let c = &self.config;
        let chosen = c.key.as_ref().is_some_and(|k| k.chosen_by_client())
            || c.scopes
                .iter()
                .any(|s| s.key.as_ref().is_some_and(|k| k.chosen_by_client()));
        let per_address = c.scopes.iter().any(|s| match &s.key {
            Some(k) => k.per_address(),
            // A rule on the layer's key counts per address whenever the request has no key.
            None => c.key.is_none(),
        });
        if chosen && !per_address {
            tracing::warn!(
                "fleetlimit: keys come from a header the client chooses and no rule counts per \
                 client address: a client sending a new value each time is never limited. \
                 Validate the key first, or add a per-address rule (Scope::key(PeerIp))"
            );
        }
    }

    fn finish(mut self) -> RateLimitLayer {
        let scopes = &self.config.scopes;
        self.config.after = AfterAdmission {
            meters_bodies: scopes.iter().any(|s| s.body_unit.is_some()),
            settles: scopes.iter().any(|s| s.settle.is_some()),
            refunds: scopes.iter().any(|s| s.refund_if.is_some()),
        };
        RateLimitLayer {
            config: Arc::new(self.config),
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.config.clone())
    }
}
