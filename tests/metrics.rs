//! The metrics the limiter reports, scraped as Prometheus text: exact counts for a known
//! traffic pattern, and a number of series that does not grow with the number of keys.

mod support;

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use fleetlimit::store::RedisStore;
use fleetlimit::{
    key, Algorithm, Key, Limiter, MemoryStore, OnStoreError, Quota, RateLimitLayer, Rule,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use support::redis::RedisServer;
use tower::ServiceExt;

/// One recorder for the whole test binary (tests use rule names of their own).
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| PrometheusBuilder::new().install_recorder().unwrap())
}

/// `metric{labels} value` lines of the scrape, by metric name and sorted labels.
fn scrape() -> HashMap<(String, Vec<(String, String)>), f64> {
    let mut series = HashMap::new();
    for line in prometheus().render().lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some((head, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match head.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (head, ""),
        };
        let mut labels: Vec<(String, String)> = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
            .collect();
        labels.sort();
        series.insert((name.to_owned(), labels), value.parse().unwrap_or(f64::NAN));
    }
    series
}

fn count(metric: &str, labels: &[(&str, &str)]) -> f64 {
    let mut labels: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    labels.sort();
    scrape()
        .get(&(metric.to_owned(), labels))
        .copied()
        .unwrap_or(0.0)
}

fn decisions(rule: &str, outcome: &str) -> f64 {
    count(
        "fleetlimit_decisions_total",
        &[("rule", rule), ("outcome", outcome)],
    )
}

/// GCRA: no window boundary the real clock could cross mid-test.
fn rule(name: &str, limit: u64) -> Rule {
    Rule::new(
        name,
        Quota::per_minute(limit)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap(),
    )
    .unwrap()
}

async fn consume(limiter: &Limiter, key: &str, n: usize) {
    for _ in 0..n {
        limiter.consume(&Key::new(key), 1).await.unwrap();
    }
}

/// A request whose body is charged by size as it is read (`cost_body` with `MeterBodyLayer`)
/// is one decision, whatever its number of frames: the charges for its frames are not
/// requests' decisions (a 4-frame upload counted as 4 requests, and a refusal mid-body fed the
/// heavy hitters and the penalty box).
#[tokio::test]
async fn a_metered_body_is_one_decision() {
    prometheus();
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(rule("m_upload_kib", 100))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(limiter.clone())
        .key(key::header("x-api-key"))
        .scope(
            "m_upload_kib",
            fleetlimit::layer::Scope::new().cost_body(1024),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            axum::routing::put(|body: bytes::Bytes| async move { body.len().to_string() }),
        )
        .layer(fleetlimit::layer::MeterBodyLayer)
        .layer(layer);
    let req = Request::put("/")
        .header("x-api-key", "k")
        .body(Body::new(support::Chunks(vec![vec![b'x'; 1024]; 4])))
        .unwrap();
    assert_eq!(app.oneshot(req).await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        limiter.peek(&Key::new("k")).await.unwrap().remaining,
        96,
        "4 KiB charged"
    );
    assert_eq!(decisions("m_upload_kib", "allowed"), 1.0);
}

#[tokio::test]
async fn a_known_traffic_pattern_gives_exact_counts() {
    prometheus();
    // Allowed, denied, near the limit: 5 requests on a limit of 3.
    let memory = Limiter::builder(MemoryStore::new())
        .rule(rule("m_basic", 3))
        .build()
        .unwrap();
    consume(&memory, "k", 5).await;
    assert_eq!(decisions("m_basic", "allowed"), 3.0);
    assert_eq!(decisions("m_basic", "denied"), 2.0);
    assert_eq!(
        count("fleetlimit_near_limit_total", &[("rule", "m_basic")]),
        1.0
    );

    // Shadow mode: a limit of 1, 3 requests through the layer, all let through.
    let shadow = Limiter::builder(MemoryStore::new())
        .rule(rule("m_shadow", 1))
        .build()
        .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(shadow)
            .key(key::header("x-api-key"))
            .shadow(true)
            .build()
            .unwrap(),
    );
    for _ in 0..3 {
        let req = Request::get("/")
            .header("x-api-key", "k")
            .body(Body::empty())
            .unwrap();
        assert_eq!(
            app.clone().oneshot(req).await.unwrap().status(),
            StatusCode::OK
        );
    }
    assert_eq!(decisions("m_shadow", "allowed"), 1.0);
    assert_eq!(decisions("m_shadow", "denied"), 2.0);
    assert_eq!(decisions("m_shadow", "shadow_denied"), 2.0);

    // A real Redis: the denial cache answers the second refusal.
    let mut server = RedisServer::start();
    let url = server.url();
    let redis = |name: &str, limit: u64, policy: OnStoreError| {
        let url = url.clone();
        let rule = rule(name, limit);
        async move {
            let store = RedisStore::connect(&url).await.unwrap();
            Limiter::builder(store)
                .rule(rule)
                .on_store_error(policy)
                .deadline(Duration::from_millis(500))
                .build()
                .unwrap()
        }
    };
    // The limiter's clock stands still, so the remembered denial cannot age out of its 1 s
    // between two calls, however slow the machine (the store's answers use Redis's clock).
    let cached = Limiter::builder(RedisStore::connect(&url).await.unwrap())
        .rule(rule("m_cache", 1))
        .on_store_error(OnStoreError::FailOpen)
        .deadline(Duration::from_millis(500))
        .clock(fleetlimit::ManualClock::new(1_800_000_000_000_000))
        .build()
        .unwrap();
    consume(&cached, "k", 3).await;
    assert_eq!(decisions("m_cache", "allowed"), 1.0);
    assert_eq!(decisions("m_cache", "denied"), 1.0);
    assert_eq!(decisions("m_cache", "cache_denied"), 1.0);
    let calls = count("fleetlimit_store_call_seconds_count", &[("call", "apply")]);
    assert!(calls >= 2.0, "store latency recorded: {calls}");

    // Redis gone: fail open, and a local fallback of 2.
    let open = redis("m_outage", 100, OnStoreError::FailOpen).await;
    let local = redis("m_fallback", 2, OnStoreError::LocalShare(1)).await;
    consume(&open, "k", 1).await;
    server.kill();
    consume(&open, "k", 4).await;
    consume(&local, "k", 3).await;
    assert_eq!(decisions("m_outage", "outage_allowed"), 4.0);
    assert_eq!(decisions("m_fallback", "fallback_allowed"), 2.0);
    assert_eq!(decisions("m_fallback", "fallback_denied"), 1.0);
    assert!(count("fleetlimit_store_errors_total", &[]) >= 5.0);

    // Calls the open breaker skips are not store calls: no error counted, and no latency sample
    // of zero to show the store fast just while it is down.
    let errors = || count("fleetlimit_store_errors_total", &[]);
    let samples = || count("fleetlimit_store_call_seconds_count", &[("call", "apply")]);
    let (errors_before, samples_before) = (errors(), samples());
    let made_before = open.stats().store_errors + local.stats().store_errors;
    consume(&open, "k", 100).await;
    let made = open.stats().store_errors + local.stats().store_errors - made_before;
    assert!(made < 10, "the breaker is open: {made} calls made");
    assert_eq!(errors() - errors_before, made as f64);
    assert_eq!(samples() - samples_before, made as f64);

    // Two more limiters whose breakers open: the process-wide gauge counts both (each limiter
    // adds its own), and reading the stats brings it up to date. The limiters above are
    // dropped first: their breakers' cool-downs end meanwhile, and the gauge follows.
    let gauge = || count("fleetlimit_breakers_open", &[]);
    drop((open, local));
    let before = gauge();
    let stays_open = |name: &str| {
        let (url, rule) = (url.clone(), rule(name, 5));
        async move {
            Limiter::builder(RedisStore::connect(&url).await.unwrap())
                .rule(rule)
                .on_store_error(OnStoreError::FailOpen)
                .deadline(Duration::from_millis(100))
                .breaker(fleetlimit::BreakerConfig {
                    failures: 1,
                    cool_down: Duration::from_secs(600),
                })
                .build()
                .unwrap()
        }
    };
    let a = stays_open("m_gauge_a").await;
    let b = stays_open("m_gauge_b").await;
    consume(&a, "k", 10).await;
    consume(&b, "k", 10).await;
    let open_now = a.stats().open_breakers + b.stats().open_breakers;
    assert_eq!(open_now, 2, "both breakers open");
    assert_eq!(gauge() - before, 2.0);
    drop((a, b));
    assert_eq!(gauge(), before, "a dropped limiter takes its breakers back");
}

#[tokio::test]
async fn ten_thousand_keys_add_no_series() {
    prometheus();
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(rule("m_many", 1))
        .build()
        .unwrap();
    consume(&limiter, "first", 3).await;
    let series = || {
        prometheus()
            .render()
            .lines()
            .filter(|l| l.contains("rule=\"m_many\""))
            .count()
    };
    let before = series();
    assert!(before >= 2, "allowed and denied series exist");
    for i in 0..10_000 {
        consume(&limiter, &format!("client-{i}"), 2).await;
    }
    assert_eq!(series(), before, "no series per key");
    assert_eq!(decisions("m_many", "allowed"), 10_001.0);
    assert!(
        !prometheus().render().contains("client-"),
        "keys never appear"
    );
}

/// What a limiter built under `recorder` reports, as `name{labels} value` lines.
fn local_count(
    recorder: &metrics_exporter_prometheus::PrometheusRecorder,
    metric: &str,
    label: &str,
) -> f64 {
    recorder
        .handle()
        .render()
        .lines()
        .filter(|l| l.starts_with(metric) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Only decisions' calls go in `fleetlimit_store_call_seconds{call="apply"}`: pause reads (the
/// outbound layer asks twice per call, per rule) went there too and tripled its count. And
/// `fleetlimit_lease_blocks_total` counts blocks leased and kept, not a lease that granted
/// nothing (a key whose quota is spent).
#[tokio::test]
async fn store_call_times_and_lease_blocks_count_what_they_name() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let recorder = PrometheusBuilder::new().build_recorder();
    let hot = || rule("counted-leases", 100);
    let leased = metrics::with_local_recorder(&recorder, || {
        Limiter::builder(store.clone())
            .rule(hot())
            .on_store_error(OnStoreError::fail_closed())
            .deadline(Duration::from_secs(2))
            .lease("counted-leases", fleetlimit::LeaseConfig::fixed(10))
            .build()
            .unwrap()
    });
    let key = Key::new("k");
    for _ in 0..10 {
        assert_eq!(leased.paused_for(&key).await, None);
    }
    let apply = r#"call="apply""#;
    assert_eq!(
        local_count(&recorder, "fleetlimit_store_call_seconds_count", apply),
        0.0,
        "pause reads are no decisions"
    );
    // The quota spent by an unleased limiter on the same store: a lease grants nothing. Built
    // under this test's recorder too: its calls must not reach the process-wide series, which
    // another test counts exactly while this one runs.
    let plain = metrics::with_local_recorder(&recorder, || {
        Limiter::builder(store)
            .rule(hot())
            .on_store_error(OnStoreError::fail_closed())
            .deadline(Duration::from_secs(2))
            .build()
            .unwrap()
    });
    consume(&plain, "k", 100).await;
    assert!(!leased.consume(&key, 1).await.unwrap().allowed);
    let blocks = r#"rule="counted-leases""#;
    assert_eq!(
        local_count(&recorder, "fleetlimit_lease_blocks_total", blocks),
        0.0
    );
    // A fresh key leases a block and keeps it: counted.
    let fresh = leased.consume(&Key::new("fresh"), 1).await.unwrap();
    assert_eq!(fresh.source, fleetlimit::Source::Lease, "{fresh:?}");
    assert_eq!(
        local_count(&recorder, "fleetlimit_lease_blocks_total", blocks),
        1.0
    );
}
