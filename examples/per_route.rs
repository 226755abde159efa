//! Limits that fit a real API, in axum:
//! - `POST /login`: 5 failed attempts per minute per client address (successful logins are
//!   given back, so users who type their password right are never locked out), via
//!   `route_layer` on that route alone;
//! - everything else: per tenant by plan (`x-plan: free` 100/min, `x-plan: paid` 10,000/min,
//!   keyed by `x-tenant`), where `POST /import` costs 10 and a read costs 1, plus 1,000/min per
//!   client address whatever the tenant (both must admit);
//! - IETF structured rate-limit headers.
//!
//! ```text
//! cargo run --example per_route
//! curl -i -H 'x-tenant: acme' -H 'x-plan: free' http://127.0.0.1:3002/
//! ```

use std::net::SocketAddr;

use axum::http::{request::Parts, Method, StatusCode};
use axum::{routing::get, routing::post, Router};
use fleetlimit::key::{self, PeerIp};
use fleetlimit::{
    ConfigError, HeaderStyle, Limiter, MemoryStore, Quota, RateLimitLayer, Rule, Scope,
};

fn plan_is(plan: &'static str) -> impl Fn(&Parts) -> bool + Send + Sync + 'static {
    move |parts| parts.headers.get("x-plan").is_some_and(|v| v == plan)
}

/// The application with its limits.
pub fn app() -> Result<Router, ConfigError> {
    let store = MemoryStore::new();

    let login = Limiter::builder(store.clone())
        .rule(Rule::new("login-failures", Quota::per_minute(5).build()?)?)
        .build()?;
    let login_layer = RateLimitLayer::builder(login)
        .scope(
            "login-failures",
            Scope::new().refund_if(|status| status.is_success()),
        )
        .headers(HeaderStyle::Ietf)
        .build()?;

    let api = Limiter::builder(store)
        .rule(Rule::new("free", Quota::per_minute(100).build()?)?)
        .rule(Rule::new("paid", Quota::per_minute(10_000).build()?)?)
        .rule(Rule::new("per-ip", Quota::per_minute(1_000).build()?)?)
        .build()?;
    let api_layer = RateLimitLayer::builder(api)
        .key(key::header("x-tenant"))
        .scope("free", Scope::new().when(plan_is("free")))
        .scope("paid", Scope::new().when(plan_is("paid")))
        .scope("per-ip", Scope::new().key(PeerIp::default()))
        .cost(|parts| {
            if parts.method == Method::POST && parts.uri.path() == "/import" {
                10
            } else {
                1
            }
        })
        .headers(HeaderStyle::Ietf)
        .build()?;

    let login_route = Router::new()
        .route(
            "/login",
            post(|body: String| async move {
                if body == "open sesame" {
                    (StatusCode::OK, "welcome")
                } else {
                    (StatusCode::UNAUTHORIZED, "wrong password")
                }
            }),
        )
        .route_layer(login_layer);
    let api_routes = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/import", post(|| async { "imported" }))
        .layer(api_layer);
    Ok(login_route.merge(api_routes))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3002").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app()?.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
