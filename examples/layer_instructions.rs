//! Requests through an axum hello-world in process, no sockets, for `scripts/bench.sh
//! instructions`, which counts the instructions each takes under valgrind's callgrind: a
//! figure that, unlike time, does not move with whatever else the machine is doing.
//!
//! ```text
//! cargo run --release --example layer_instructions -- bare|governor|governor-headers|fleetlimit|fleetlimit-denied N
//! ```
//!
//! The layers are those of `examples/baseline.rs`: tower_governor keyed by peer address, and
//! the README's quick-start `RateLimitLayer` (memory store, default algorithm, keyed by
//! `x-api-key` else the peer address), with a limit no run reaches or one spent at once.
//! `N` requests run in `measure` (what callgrind is told to count), after 2,000 to warm up.

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::{routing::get, Router};
use fleetlimit::{key, Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(kind), Some(n)) = (args.first(), args.get(1)) else {
        return Err(
            "usage: layer_instructions bare|governor|governor-headers|fleetlimit|fleetlimit-denied N".into(),
        );
    };
    let n: u64 = n.parse()?;
    let app = Router::new().route("/", get(|| async { "ok" }));
    let app = match kind.as_str() {
        "bare" => app,
        "governor" => {
            let mut config = GovernorConfigBuilder::default();
            config.per_nanosecond(1).burst_size(u32::MAX);
            app.layer(GovernorLayer::new(
                config.finish().ok_or("governor config")?,
            ))
        }
        // tower_governor with its rate-limit headers on every response, as fleetlimit's default.
        "governor-headers" => {
            let mut config = GovernorConfigBuilder::default();
            config.per_nanosecond(1).burst_size(u32::MAX);
            let mut config = config.use_headers();
            app.layer(GovernorLayer::new(
                config.finish().ok_or("governor config")?,
            ))
        }
        "fleetlimit" | "fleetlimit-denied" => {
            let quota = if kind == "fleetlimit" {
                Quota::per_second(1_000_000_000)
            } else {
                Quota::per_hour(1)
            };
            let limiter = Limiter::builder(MemoryStore::new())
                .rule(Rule::new("api", quota.build()?)?)
                .build()?;
            app.layer(
                RateLimitLayer::builder(limiter)
                    .key(key::header("x-api-key"))
                    .build()?,
            )
        }
        other => return Err(format!("unknown kind {other:?}").into()),
    };
    // As `axum::serve` runs a router: its handlers made into services once.
    let app = app.with_state(());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    warm_up(&runtime, &app, 2_000)?;
    measure(&runtime, &app, n)
}

#[inline(never)]
fn warm_up(runtime: &tokio::runtime::Runtime, app: &Router, n: u64) -> Result<(), http::Error> {
    serve(runtime, app, n)
}

/// The requests callgrind counts (`--toggle-collect=layer_instructions::measure`).
#[inline(never)]
fn measure(
    runtime: &tokio::runtime::Runtime,
    app: &Router,
    n: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    Ok(serve(runtime, app, n)?)
}

fn serve(runtime: &tokio::runtime::Runtime, app: &Router, n: u64) -> Result<(), http::Error> {
    runtime.block_on(async {
        let peer = ConnectInfo(SocketAddr::from(([192, 0, 2, 7], 4242)));
        for _ in 0..n {
            let mut req = http::Request::get("/").body(Body::empty())?;
            req.extensions_mut().insert(peer);
            let Ok(response) = app.clone().oneshot(req).await;
            std::hint::black_box(response);
        }
        Ok(())
    })
}
