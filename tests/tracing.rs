//! Tracing, in a test binary of its own: tracing caches which call sites are enabled per
//! process, and other tests running beside it without a subscriber would race that cache.

use std::net::SocketAddr;

use axum::body::Body;
use axum::{routing::get, Router};
use fleetlimit::{key, Algorithm, Limiter, ManualClock, MemoryStore, Quota, RateLimitLayer, Rule};
use tower::ServiceExt;

/// One event per decision (rule, outcome, remaining, source, latency), and never the raw key.
#[test]
fn decisions_are_traced_without_raw_keys() {
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
