//! # fleetlimit
//!
//! Rate limits that hold across a whole fleet of app servers.
//!
//! An in-process counter is wrong by the fleet size: fifty servers each allowing 100/min allow
//! 5,000/min. fleetlimit keeps the counter in a shared store, decides atomically there, and
//! wraps it all in a Tower layer for axum, tonic and hyper. The in-memory store is the embedded
//! default, for one process and for tests.
//!
//! ## Quick start
//!
//! ```no_run
//! use std::net::SocketAddr;
//!
//! use axum::{routing::get, Router};
//! use fleetlimit::{key, Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // 100 requests per minute per API key (or per client address without one). The client
//!     // chooses this header: in a real service, key on what authentication established, with a
//!     // per-address rule in front (README: "Keys an attacker controls").
//!     let limiter = Limiter::builder(MemoryStore::new())
//!         .rule(Rule::new("api", Quota::per_minute(100).build()?)?)
//!         .build()?;
//!     let layer = RateLimitLayer::builder(limiter).key(key::header("x-api-key")).build()?;
//!
//!     let app = Router::new().route("/", get(|| async { "ok" })).layer(layer);
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     // Connect info gives the layer the peer address to fall back on.
//!     axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//!     Ok(())
//! }
//! ```
//!
//! ## Layers of the crate
//!
//! - [`RateLimitLayer`]: the Tower face (keys, headers, the 429).
//! - [`Limiter`]: rules × key → one [`Decision`].
//! - [`Store`]: atomic consumption of permits; [`MemoryStore`] here.
//! - The algorithms ([`Algorithm`]), each with a stated, tested promise.
#![warn(missing_docs, unreachable_pub)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

#[cfg(feature = "admin")]
pub mod admin;
mod algorithm;
mod clock;
pub mod concurrency;
#[cfg(feature = "serde")]
pub mod config;
mod decision;
mod error;
pub mod key;
pub mod layer;
mod limiter;
pub mod outbound;
mod quota;
mod quota_cache;
mod rule;
pub mod shed;
pub mod store;

pub use clock::{Clock, ManualClock, SystemClock};
/// The deadpool-redis this crate was built with (0.23), for
/// [`RedisStore::from_pool`](store::RedisStore::from_pool).
#[cfg(feature = "redis")]
pub use deadpool_redis;
pub use decision::{Decision, Source, Taken};
pub use error::{ConfigError, Error, StoreError};
pub use key::{Key, KeyExtractor};
pub use layer::{
    Denial, HeaderStyle, MissingKey, RateLimitInfo, RateLimitLayer, RateLimitLayerBuilder, Scope,
};
pub(crate) use limiter::Target;
pub use limiter::{
    BreakerConfig, HeavyHitter, InfallibleStore, KeyState, LeaseConfig, Limiter, LimiterBuilder,
    LimiterStats, OnStoreError, Penalty, PolicyUnset, Receipt, RuleState, DEFAULT_DEADLINE,
    DEFAULT_DENY_CACHE_MAX_AGE,
};
pub use quota::{
    Algorithm, Quota, QuotaBuilder, WindowEstimate, DEFAULT_MAX_LOG_LEN, DEFAULT_SUB_WINDOWS,
    MAX_HEADER_INTEGER, MAX_PERIOD, MAX_SUB_WINDOWS,
};
pub use quota_cache::QuotaCache;
/// The redis-rs this crate was built with (1.x), so a [`RedisStore`] can be made from your own
/// clients and connections without matching versions by hand.
#[cfg(feature = "redis")]
pub use redis;
pub use rule::{Rule, MAX_RULE_NAME_LEN};
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{MemoryStore, Store};

/// The README's code blocks are compiled as doc tests, so its quick start cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
