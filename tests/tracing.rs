//! Tracing, in a test binary of its own: tracing caches which call sites are enabled per
//! process, and other tests running beside it without a subscriber would race that cache.

use std::net::SocketAddr;

use axum::body::Body;
use axum::{routing::get, Router};
use fleetlimit::{key, Algorithm, Limiter, ManualClock, MemoryStore, Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);
impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with a subscriber at `level` and returns what it logged.
fn logged(level: tracing::Level, f: impl FnOnce()) -> String {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    out
}

fn get_from(app: &Router, peer: [u8; 4], headers: &[(&str, &str)]) -> http::StatusCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut req = http::Request::get("/");
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let mut req = req.body(Body::empty()).unwrap();
    req.extensions_mut().insert(SocketAddr::from((peer, 1)));
    runtime.block_on(app.clone().oneshot(req)).unwrap().status()
}

fn memory_limiter() -> Limiter {
    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    Limiter::builder(store)
        .rule(Rule::new("r", Quota::per_minute(100_000).build().unwrap()).unwrap())
        .build()
        .unwrap()
}

/// Misconfiguration is said once, at `warn`: a client-chosen key with no per-address rule, a
/// private-range peer sending forwarding headers nobody trusts, and every request from one
/// address.
#[test]
fn misconfiguration_is_said_once() {
    use fleetlimit::key::PeerIp;
    use fleetlimit::Scope;
    let out = logged(tracing::Level::WARN, || {
        let _ = RateLimitLayer::builder(memory_limiter())
            .key(key::header("X-Api-Key"))
            .build()
            .unwrap();
    });
    assert_eq!(
        out.matches("a client sending a new value each time")
            .count(),
        1,
        "{out}"
    );
    // With a per-address rule in front, nothing to say.
    let out = logged(tracing::Level::WARN, || {
        let store = MemoryStore::builder()
            .clock(ManualClock::default())
            .build()
            .unwrap();
        let limiter = Limiter::builder(store)
            .rule(Rule::new("per-ip", Quota::per_minute(10).build().unwrap()).unwrap())
            .rule(Rule::new("per-key", Quota::per_minute(10).build().unwrap()).unwrap())
            .build()
            .unwrap();
        let _ = RateLimitLayer::builder(limiter)
            .key(key::header("x-api-key"))
            .scope("per-ip", Scope::new().key(PeerIp::default()))
            .build()
            .unwrap();
    });
    assert!(!out.contains("new value each time"), "{out}");

    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(memory_limiter()));
    let out = logged(tracing::Level::WARN, || {
        // One request in 64 per thread is looked at: a proxy forwards them all.
        for _ in 0..130 {
            get_from(&app, [10, 0, 0, 5], &[("x-forwarded-for", "198.51.100.7")]);
        }
    });
    assert_eq!(out.matches("no proxy is trusted").count(), 1, "{out}");
    let out = logged(tracing::Level::WARN, || {
        for _ in 0..10_000 {
            get_from(&app, [10, 0, 0, 5], &[]);
        }
    });
    assert_eq!(out.matches("all came from one address").count(), 1, "{out}");
}

/// One event per decision (rule, outcome, remaining, source, latency), and never the raw key.
#[test]
fn decisions_are_traced_without_raw_keys() {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let store = MemoryStore::builder()
                .clock(ManualClock::default())
                .build()
                .unwrap();
            let quota = Quota::per_minute(1)
                .algorithm(Algorithm::SlidingLog)
                .build()
                .unwrap();
            let limiter = Limiter::builder(store)
                .rule(Rule::new("traced", quota).unwrap())
                .build()
                .unwrap();
            let layer = RateLimitLayer::builder(limiter)
                .key(key::header("x-api-key"))
                .build()
                .unwrap();
            let app = Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(layer);
            for _ in 0..2 {
                let mut req = http::Request::get("/")
                    .header("x-api-key", "sk_live_SECRET123")
                    .body(Body::empty())
                    .unwrap();
                req.extensions_mut()
                    .insert(SocketAddr::from(([192, 0, 2, 1], 1)));
                app.clone().oneshot(req).await.unwrap();
            }
        })
    });
    let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    let events: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("fleetlimit: decision"))
        .collect();
    assert_eq!(events.len(), 2, "{out}");
    assert!(
        events[0].contains("rule=\"traced\"") && events[0].contains("allowed=true"),
        "{out}"
    );
    assert!(
        events[1].contains("allowed=false") && events[1].contains("latency_us="),
        "{out}"
    );
    assert!(
        !out.contains("SECRET"),
        "a raw API key reached the logs: {out}"
    );
}

/// Why decisions left the store is said at `warn` once per episode (the first failure since a
/// success, then the breaker opening), not once per request.
#[test]
fn store_failures_are_said_once_per_episode() {
    use fleetlimit::store::RedisStore;
    use fleetlimit::{Key, OnStoreError};
    // A loopback port nobody listens on: every call is refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut decisions = 0;
    let out = logged(tracing::Level::WARN, || {
        runtime.block_on(async {
            let store = RedisStore::builder()
                .connect(&format!("redis://127.0.0.1:{port}"))
                .await
                .unwrap();
            let limiter = Limiter::builder(store)
                .rule(Rule::new("r", Quota::per_minute(10).build().unwrap()).unwrap())
                .on_store_error(OnStoreError::FailOpen)
                .build()
                .unwrap();
            for _ in 0..20 {
                let d = limiter.consume(&Key::new("k"), 1).await.unwrap();
                assert!(d.allowed && d.degraded, "{d:?}");
                decisions += 1;
            }
        })
    });
    assert_eq!(decisions, 20);
    assert_eq!(
        out.matches("store call failed; this decision follows the outage policy")
            .count(),
        1,
        "{out}"
    );
    assert_eq!(out.matches("breaker opened").count(), 1, "{out}");
    assert!(
        out.contains("rule=\"r\"") && out.contains("domain=0"),
        "{out}"
    );
}
