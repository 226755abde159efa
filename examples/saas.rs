//! A multi-tenant API with one rate-limit layer, as a SaaS service would run it on several
//! instances sharing Redis:
//!
//! - an authentication middleware looks the bearer key up server-side and puts the tenant (and
//!   its plan) in the request's extensions; an unknown key is refused with 401 *after* the
//!   per-address limit, so guessing keys is rate limited too;
//! - tenants get their plan's quota (free 60/min, pro 600/min), keyed by tenant;
//! - anonymous clients (and unknown keys) get 20/min per client address;
//! - `POST /login` counts failed logins per account (5/min), read from the JSON body, AND per
//!   address (10/min); a successful login is given back;
//! - `PUT /files/{name}` charges the tenant's upload budget (10 MiB/min) per KiB, by the
//!   declared length up front and by the bytes read for streamed bodies; a file the budget can
//!   never hold is a 413;
//! - `/health` is never limited;
//! - with `--redis URL` the limits hold across every instance; while Redis is out, each of the
//!   `--instances N` servers decides alone on its share (1/N) of every quota.
//!
//! ```text
//! cargo run --example saas -- --listen 127.0.0.1:3003 [--redis redis://127.0.0.1:6379 --instances 2]
//! curl -i -H 'authorization: Bearer key-acme' http://127.0.0.1:3003/
//! curl -i -H 'content-type: application/json' -d '{"account":"alice","password":"x"}' http://127.0.0.1:3003/login
//! curl -i -T big.bin -H 'authorization: Bearer key-acme' http://127.0.0.1:3003/files/big.bin
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json, Router};
use fleetlimit::key::{self, PeerIp};
use fleetlimit::layer::{BufferBodyLayer, MeterBodyLayer};
use fleetlimit::store::{RedisStore, Store};
use fleetlimit::{
    ConfigError, HeaderStyle, Key, Limiter, MemoryStore, MissingKey, OnStoreError, Quota,
    RateLimitInfo, RateLimitLayer, Rule, Scope,
};

/// A tenant's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// 60 requests a minute.
    Free,
    /// 600 requests a minute.
    Pro,
}

/// The caller, as authentication established it (never as the client claims).
#[derive(Debug, Clone)]
pub struct Tenant {
    /// The tenant's id: the key of its limits.
    pub id: String,
    /// Its plan.
    pub plan: Plan,
}

/// A bearer key that matched no tenant: refused after the per-address limit counted it.
#[derive(Debug, Clone, Copy)]
struct UnknownKey;

/// The API keys and passwords the service knows (a database, in a real service).
pub struct Accounts {
    keys: HashMap<&'static str, Tenant>,
    passwords: HashMap<&'static str, &'static str>,
}

impl Accounts {
    /// The demo's tenants (`key-acme`: free, `key-bigco`: pro) and users (alice, bob).
    pub fn demo() -> Accounts {
        let tenant = |id: &str, plan| Tenant {
            id: id.to_owned(),
            plan,
        };
        Accounts {
            keys: HashMap::from([
                ("key-acme", tenant("acme", Plan::Free)),
                ("key-bigco", tenant("bigco", Plan::Pro)),
            ]),
            passwords: HashMap::from([("alice", "wonderland"), ("bob", "builder")]),
        }
    }
}

async fn authenticate(
    State(accounts): State<Arc<Accounts>>,
    mut req: Request,
    next: Next,
) -> Response {
    let bearer = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match bearer.map(|k| accounts.keys.get(k).cloned()) {
        Some(Some(tenant)) => {
            req.extensions_mut().insert(tenant);
        }
        Some(None) => {
            req.extensions_mut().insert(UnknownKey);
        }
        None => {} // anonymous
    }
    next.run(req).await
}

async fn refuse_unknown_keys(req: Request, next: Next) -> Response {
    if req.extensions().get::<UnknownKey>().is_some() {
        return (StatusCode::UNAUTHORIZED, "unknown API key").into_response();
    }
    next.run(req).await
}

fn tenant(parts: &axum::http::request::Parts) -> Option<&Tenant> {
    parts.extensions.get::<Tenant>()
}

/// The limits: one limiter, one layer, every rule of a request decided in one atomic step.
pub fn rate_limit<S: Store>(store: S, instances: u64) -> Result<RateLimitLayer, ConfigError> {
    let per_minute = |name: &str, limit: u64| Rule::new(name, Quota::per_minute(limit).build()?);
    let limiter = Limiter::builder(store)
        .rule(per_minute("free", 60)?)
        .rule(per_minute("pro", 600)?)
        .rule(per_minute("anonymous", 20)?)
        .rule(per_minute("login-account", 5)?)
        .rule(per_minute("login-ip", 10)?)
        .rule(per_minute("upload-kib", MAX_UPLOAD as u64 / 1024)?)
        .on_store_error(OnStoreError::LocalShare(instances))
        .build()?;
    let on_plan =
        |plan| move |p: &axum::http::request::Parts| tenant(p).is_some_and(|t| t.plan == plan);
    let login = || {
        Scope::new()
            .route(Method::POST, "/login")
            .refund_if(|s| s.is_success())
    };
    RateLimitLayer::builder(limiter)
        // The layer's key: the tenant; rules with their own key say so.
        .key(key::from_fn(|parts| tenant(parts).map(|t| Key::new(&t.id))))
        .scope("free", Scope::new().when(on_plan(Plan::Free)))
        .scope("pro", Scope::new().when(on_plan(Plan::Pro)))
        .scope(
            "anonymous",
            Scope::new()
                .when(|p| tenant(p).is_none())
                .key(PeerIp::default()),
        )
        .scope(
            "login-account",
            login()
                .key(key::json_field("account"))
                .on_missing_key(MissingKey::Reject),
        )
        .scope("login-ip", login().key(PeerIp::default()))
        .scope(
            "upload-kib",
            Scope::new()
                .route(Method::PUT, "/files/{name}")
                .when(|p| tenant(p).is_some())
                .cost_body(1024),
        )
        .cost_exceeds_limit_status(StatusCode::PAYLOAD_TOO_LARGE)
        .headers(HeaderStyle::Ietf)
        .build()
}

async fn home(
    tenant: Option<Extension<Tenant>>,
    Extension(info): Extension<RateLimitInfo>,
) -> String {
    let who = tenant.map_or("anonymous".to_owned(), |Extension(t)| t.id);
    format!("hello {who}; {} left\n", info.decision.remaining)
}

#[derive(serde::Deserialize)]
struct Login {
    account: String,
    password: String,
}

async fn login(State(accounts): State<Arc<Accounts>>, Json(login): Json<Login>) -> StatusCode {
    if accounts.passwords.get(login.account.as_str()) == Some(&login.password.as_str()) {
        StatusCode::OK
    } else {
        StatusCode::UNAUTHORIZED
    }
}

/// Uploads are for tenants: anonymous ones are refused before their body is read.
async fn tenants_only(req: Request, next: Next) -> Response {
    if req.extensions().get::<Tenant>().is_none() {
        return (StatusCode::UNAUTHORIZED, "uploads need an API key").into_response();
    }
    next.run(req).await
}

async fn upload(body: Bytes) -> String {
    format!("stored {} bytes\n", body.len())
}

/// The largest file one request may carry (the upload budget's size).
const MAX_UPLOAD: usize = 10 * 1024 * 1024;

/// The service, limited by `limits`.
pub fn app(limits: RateLimitLayer) -> Router {
    let accounts = Arc::new(Accounts::demo());
    Router::new()
        .route("/", get(home))
        .route("/login", post(login))
        .route(
            "/files/{name}",
            put(upload)
                .layer(DefaultBodyLimit::max(MAX_UPLOAD))
                .route_layer(middleware::from_fn(tenants_only)),
        )
        .with_state(accounts.clone())
        // Inside the limits, in the order a request meets them from the bottom up.
        .layer(MeterBodyLayer)
        .layer(middleware::from_fn(refuse_unknown_keys))
        .layer(limits)
        .layer(BufferBodyLayer::new(4096).route(Method::POST, "/login"))
        .layer(middleware::from_fn_with_state(accounts, authenticate))
        // Added after the layers: never limited.
        .route("/health", get(|| async { "ok" }))
}

fn usage() -> String {
    "usage: saas [--listen ADDR] [--redis URL] [--instances N]".to_owned()
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let mut listen = "127.0.0.1:3003".to_owned();
    let mut redis = None;
    let mut instances = 1;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(usage)?;
        match flag.as_str() {
            "--listen" => listen = value,
            "--redis" => redis = Some(value),
            "--instances" => instances = value.parse().map_err(|_| usage())?,
            _ => return Err(usage()),
        }
    }
    let limits = match redis {
        Some(url) => {
            let store = RedisStore::connect(&url).await.map_err(|e| e.to_string())?;
            rate_limit(store, instances)
        }
        None => rate_limit(MemoryStore::new(), instances),
    }
    .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| format!("{listen}: {e}"))?;
    println!(
        "listening on http://{}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    axum::serve(
        listener,
        app(limits).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .map_err(|e| e.to_string())
}
