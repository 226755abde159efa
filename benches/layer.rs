//! A request through `RateLimitLayer` (memory store) around a trivial axum service, next to the
//! bare service and to `tower_governor`'s layer doing the same work (keyed by peer address),
//! in process, no sockets. Allowed traffic and denied traffic.
//!
//! `cargo bench --bench layer` (the `metrics` group: the same with a Prometheus recorder off,
//! then on)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::{routing::get, Router};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use fleetlimit::{Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

fn app() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

/// A router as `axum::serve` runs it: its handlers made into services once, not per request.
fn served(router: Router) -> Router {
    router.with_state(())
}

fn fleetlimit_app(allowed: bool) -> Router {
    let quota = if allowed {
        Quota::per_second(1_000_000)
            .algorithm(fleetlimit::Algorithm::Gcra)
            .burst(1 << 40)
    } else {
        Quota::per_hour(1).algorithm(fleetlimit::Algorithm::Gcra)
    };
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("bench", quota.build().unwrap()).unwrap())
        .build()
        .unwrap();
    served(app().layer(RateLimitLayer::new(limiter)))
}

fn governor_app(allowed: bool) -> Router {
    let mut config = GovernorConfigBuilder::default();
    if allowed {
        config.per_nanosecond(1).burst_size(u32::MAX);
    } else {
        config.per_second(3600).burst_size(1);
    }
    let config = config.finish().unwrap();
    served(app().layer(GovernorLayer::new(config)))
}

fn run(rt: &tokio::runtime::Runtime, app: &Router, iters: u64) -> Duration {
    rt.block_on(async {
        let peer = ConnectInfo(SocketAddr::from(([192, 0, 2, 7], 4242)));
        let started = Instant::now();
        for _ in 0..iters {
            let mut req = http::Request::get("/").body(Body::empty()).unwrap();
            req.extensions_mut().insert(peer);
            let response = app.clone().oneshot(req).await.unwrap();
            std::hint::black_box(response);
        }
        started.elapsed()
    })
}

fn layer(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("layer");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    let bare = served(app());
    group.bench_function("bare", |b| b.iter_custom(|iters| run(&rt, &bare, iters)));
    for (traffic, allowed) in [("allowed", true), ("denied", false)] {
        let ours = fleetlimit_app(allowed);
        let theirs = governor_app(allowed);
        group.bench_function(BenchmarkId::new("fleetlimit", traffic), |b| {
            b.iter_custom(|iters| run(&rt, &ours, iters))
        });
        group.bench_function(BenchmarkId::new("tower_governor", traffic), |b| {
            b.iter_custom(|iters| run(&rt, &theirs, iters))
        });
    }
    group.finish();
}

/// The same decisions with no metrics recorder, then with a Prometheus recorder installed (it
/// stays installed: this group runs last).
fn metrics_overhead(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("metrics");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    let apps = [
        ("allowed", fleetlimit_app(true)),
        ("denied", fleetlimit_app(false)),
    ];
    for (traffic, app) in &apps {
        group.bench_function(BenchmarkId::new("off", traffic), |b| {
            b.iter_custom(|iters| run(&rt, app, iters))
        });
    }
    let _handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    // Limiters register their metric handles when built: build them again, recorder in place.
    let apps = [
        ("allowed", fleetlimit_app(true)),
        ("denied", fleetlimit_app(false)),
    ];
    for (traffic, app) in &apps {
        group.bench_function(BenchmarkId::new("on", traffic), |b| {
            b.iter_custom(|iters| run(&rt, app, iters))
        });
    }
    group.finish();
}

criterion_group!(benches, layer, metrics_overhead);
criterion_main!(benches);
