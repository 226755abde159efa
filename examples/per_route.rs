//! Limits that fit a real API, in axum, without trusting anything the client can choose:
//! - `POST /login`: 5 failed attempts per minute per client address (successful logins are
//!   given back, so users who type their password right are never locked out), via
//!   `route_layer` on that route alone;
//! - everything else, in this order (axum runs the last `.layer` first):
//!   1. 1,000/min per client address, before anything else, so a client minting API keys or
//!      sending garbage is still limited;
//!   2. authentication: the API key is looked up server-side; an unknown key is a 401 and never
//!      reaches a tenant's limit; the tenant (and its plan) go into a request extension;
//!   3. the tenant's plan, read from that extension (free 100/min, paid 10,000/min), keyed by
//!      the tenant id, where `POST /import` costs 10 and a read costs 1.
//! - IETF structured rate-limit headers.
//!
//! ```text
//! cargo run --example per_route
//! curl -i -H 'authorization: Bearer key-acme' http://127.0.0.1:3002/
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{routing::get, routing::post, Router};
use fleetlimit::key::{self, PeerIp};
use fleetlimit::{
    ConfigError, HeaderStyle, Key, Limiter, MemoryStore, Quota, RateLimitLayer, Rule, Scope,
};

/// A customer's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// 100 requests a minute.
    Free,
    /// 10,000 requests a minute.
    Paid,
}

/// Who the request is from, as the server established it (never as the client claims).
#[derive(Debug, Clone)]
pub struct Tenant {
    /// The tenant's id: its rate-limit key.
    pub id: String,
    /// Its plan.
    pub plan: Plan,
}

/// The API keys the server knows (a database, in a real service).
fn accounts() -> Arc<HashMap<&'static str, Tenant>> {
    let tenant = |id: &str, plan| Tenant {
        id: id.to_owned(),
        plan,
    };
    Arc::new(HashMap::from([
        ("key-acme", tenant("acme", Plan::Free)),
        ("key-bigco", tenant("bigco", Plan::Paid)),
    ]))
}

/// Authentication: the bearer key is looked up server-side; the tenant goes into the request's
/// extensions for the layers and handlers after this one.
async fn authenticate(
    accounts: Arc<HashMap<&'static str, Tenant>>,
    mut req: Request,
    next: Next,
) -> Response {
    let tenant = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|k| accounts.get(k))
        .cloned();
    match tenant {
        Some(tenant) => {
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        None => (StatusCode::UNAUTHORIZED, "unknown API key").into_response(),
    }
}

fn on_plan(plan: Plan) -> impl Fn(&axum::http::request::Parts) -> bool + Send + Sync + 'static {
    move |parts| {
        parts
            .extensions
            .get::<Tenant>()
            .is_some_and(|t| t.plan == plan)
    }
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

    // 1. Per client address, in front of everything (the layer's default key).
    let per_ip = Limiter::builder(store.clone())
        .rule(Rule::new("per-ip", Quota::per_minute(1_000).build()?)?)
        .build()?;
    let per_ip_layer = RateLimitLayer::builder(per_ip)
        .peer_ip(PeerIp::default())
        .headers(HeaderStyle::Ietf)
        .build()?;

    // 3. Per tenant, by plan, from the extension authentication set.
    let plans = Limiter::builder(store)
        .rule(Rule::new("free", Quota::per_minute(100).build()?)?)
        .rule(Rule::new("paid", Quota::per_minute(10_000).build()?)?)
        .build()?;
    let plan_layer = RateLimitLayer::builder(plans)
        .key(key::from_fn(|parts| {
            parts.extensions.get::<Tenant>().map(|t| Key::new(&t.id))
        }))
        .scope("free", Scope::new().when(on_plan(Plan::Free)))
        .scope("paid", Scope::new().when(on_plan(Plan::Paid)))
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
    let accounts = accounts();
    let api_routes = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/import", post(|| async { "imported" }))
        // Last added runs first: per address, then authentication, then the plan.
        .layer(plan_layer)
        .layer(middleware::from_fn(move |req, next| {
            authenticate(accounts.clone(), req, next)
        }))
        .layer(per_ip_layer);
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
