//! Calls to a rate-limited partner through `OutboundLayer`: two limiters on one real Redis keep
//! a loopback partner's quota without a single 429, and a partner's pushback stops the whole
//! fleet within a round trip until the time it named.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use axum::{routing::get, Router};
use bytes::Bytes;
use fleetlimit::outbound::{NotReady, OutboundLayer};
use fleetlimit::store::RedisStore;
use fleetlimit::{Algorithm, Limiter, MemoryStore, OnStoreError, Quota, Rule};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::redis::RedisServer;
use tower::{Service, ServiceBuilder, ServiceExt};

/// The partner's quota: 50 per second, with a burst of 10 (a partner's usual allowance for
/// network jitter: a loaded 2-core machine can hold a few calls back and release them at once).
const RATE: u64 = 50;

#[derive(Default)]
struct Partner {
    ok: AtomicU64,
    refused: AtomicU64,
    /// When set, answer 429 with `Retry-After: 2` to calls until then.
    push_back_from: Mutex<Option<Instant>>,
    push_back_armed: AtomicBool,
    arrivals: Mutex<Vec<Instant>>,
}

async fn partner(state: Arc<Partner>) -> SocketAddr {
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(
            Rule::new(
                "partner",
                Quota::per_second(RATE)
                    .algorithm(Algorithm::Gcra)
                    .burst(10)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        )
        .build()
        .unwrap();
    let handler = move || {
        let (state, limiter) = (state.clone(), limiter.clone());
        async move {
            let now = Instant::now();
            state.arrivals.lock().unwrap().push(now);
            if state.push_back_armed.swap(false, Ordering::SeqCst) {
                *state.push_back_from.lock().unwrap() = Some(now);
            }
            let pushing_back = state
                .push_back_from
                .lock()
                .unwrap()
                .is_some_and(|from| now < from + Duration::from_secs(2));
            let admitted = limiter
                .consume(&fleetlimit::Key::new("fleet"), 1)
                .await
                .unwrap()
                .allowed;
            if pushing_back || !admitted {
                state.refused.fetch_add(1, Ordering::SeqCst);
                let retry = if pushing_back { "2" } else { "1" };
                (
                    http::StatusCode::TOO_MANY_REQUESTS,
                    [("retry-after", retry)],
                )
                    .into_response()
            } else {
                state.ok.fetch_add(1, Ordering::SeqCst);
                "ok".into_response()
            }
        }
    };
    let app = Router::new().route("/", get(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Two instances of a service calling the partner, each with its own limiter on the shared Redis,
/// at the partner's rate with a burst of 2: a caller woken a little late keeps its place in the
/// schedule instead of losing that time.
async fn fleet(server: &RedisServer) -> Vec<Limiter> {
    let mut out = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let quota = Quota::per_second(RATE)
            .algorithm(Algorithm::Gcra)
            .burst(2)
            .build()
            .unwrap();
        out.push(
            Limiter::builder(store)
                .rule(Rule::new("partner", quota).unwrap())
                .on_store_error(OnStoreError::fail_closed())
                .build()
                .unwrap(),
        );
    }
    out
}

/// Four callers per instance, calling the partner through the layer (default settings) until
/// `until`; a caller told the quota is not ready waits the time it was given, as a client would.
async fn call_until(fleet: &[Limiter], addr: SocketAddr, until: Instant) {
    let mut callers = Vec::new();
    for limiter in fleet {
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let service = ServiceBuilder::new()
            .layer(OutboundLayer::new(limiter.clone()))
            .service(client);
        for _ in 0..4 {
            let mut service = service.clone();
            callers.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let req = http::Request::get(format!("http://{addr}/"))
                        .body(Empty::<Bytes>::new())
                        .unwrap();
                    let ready = service.ready().await.unwrap();
                    if let Err(e) = ready.call(req).await {
                        let wait = e
                            .downcast_ref::<NotReady>()
                            .and_then(|n| n.retry_after)
                            .unwrap_or(Duration::from_millis(10));
                        tokio::time::sleep(wait).await;
                    }
                }
            }));
        }
    }
    for c in callers {
        c.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_keeps_the_partners_quota_without_a_refusal() {
    let server = RedisServer::start();
    let state = Arc::new(Partner::default());
    let addr = partner(state.clone()).await;
    let fleet = fleet(&server).await;
    let started = Instant::now();
    let seconds = 3;
    call_until(&fleet, addr, started + Duration::from_secs(seconds)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (ok, refused) = (
        state.ok.load(Ordering::SeqCst),
        state.refused.load(Ordering::SeqCst),
    );
    eprintln!(
        "{ok} calls answered, {refused} refused, in {elapsed:.2} s: {:.1}/s against a quota of {RATE}/s",
        ok as f64 / elapsed
    );
    assert_eq!(refused, 0, "no call refused by the partner");
    assert!(
        ok as f64 >= 0.9 * RATE as f64 * seconds as f64,
        "{ok} calls in {seconds} s at {RATE}/s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partners_pushback_stops_the_whole_fleet_until_then() {
    let server = RedisServer::start();
    let state = Arc::new(Partner::default());
    let addr = partner(state.clone()).await;
    let fleet = fleet(&server).await;
    let started = Instant::now();
    let arm = {
        let state = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            state.push_back_armed.store(true, Ordering::SeqCst);
        })
    };
    call_until(&fleet, addr, started + Duration::from_millis(3_500)).await;
    arm.await.unwrap();
    let from = state.push_back_from.lock().unwrap().expect("pushed back");
    let arrivals = state.arrivals.lock().unwrap().clone();
    // Calls already on their way when the partner answered 429 may still arrive (one round
    // trip, on a loaded machine); after that, nobody in the fleet calls until the 2 s are over.
    let during = arrivals
        .iter()
        .filter(|&&t| {
            t > from + Duration::from_millis(300) && t < from + Duration::from_millis(1_950)
        })
        .count();
    let after = arrivals
        .iter()
        .filter(|&&t| t >= from + Duration::from_secs(2))
        .count();
    eprintln!(
        "pushback: {during} calls during the pause, {after} after it, {} in all",
        arrivals.len()
    );
    assert_eq!(during, 0, "the fleet kept calling during the pause");
    assert!(after > 0, "calls resumed after the pause");
}

/// A destination's answer pauses the fleet at most `max_pause` (a wait of weeks, or a reset in
/// the wrong unit, would otherwise stop every instance that long), and only ever lengthens a
/// pause: a shorter answer to a call already on its way never cuts the pause another instance
/// was told. On the memory store and on Redis.
#[tokio::test]
async fn pushback_is_bounded_and_never_shortens_a_pause() {
    let server = RedisServer::start();
    let rule = || {
        Rule::new(
            "partner",
            Quota::per_second(RATE)
                .algorithm(Algorithm::Gcra)
                .build()
                .unwrap(),
        )
        .unwrap()
    };
    let memory = Limiter::builder(MemoryStore::new())
        .rule(rule())
        .build()
        .unwrap();
    let redis = Limiter::builder(RedisStore::connect(&server.url()).await.unwrap())
        .rule(rule())
        .on_store_error(OnStoreError::fail_closed())
        .build()
        .unwrap();
    for (name, limiter) in [("memory", memory), ("redis", redis)] {
        let key = fleetlimit::Key::new("p.example");
        // The destination answers `retry_after`, after another instance was told `first`.
        let call = |first: Option<Duration>, retry_after: &'static str| {
            let other_instance = limiter.clone();
            let destination = tower::service_fn(move |_: http::Request<()>| {
                let limiter = other_instance.clone();
                async move {
                    if let Some(first) = first {
                        limiter
                            .pause_at_least(&fleetlimit::Key::new("p.example"), first)
                            .await
                            .unwrap();
                    }
                    Ok::<_, std::convert::Infallible>(
                        http::Response::builder()
                            .status(http::StatusCode::TOO_MANY_REQUESTS)
                            .header("retry-after", retry_after)
                            .body(())
                            .unwrap(),
                    )
                }
            });
            ServiceBuilder::new()
                .layer(OutboundLayer::new(limiter.clone()))
                .service(destination)
                .oneshot(http::Request::get("https://p.example/").body(()).unwrap())
        };
        call(None, "4294967295").await.unwrap();
        let paused = limiter.paused_for(&key).await.expect("paused");
        let max = fleetlimit::outbound::DEFAULT_MAX_PAUSE;
        assert!(
            paused <= max && paused > max - Duration::from_secs(5),
            "{name}: paused {paused:?}"
        );
        limiter.pause(&key, Duration::ZERO).await.unwrap();
        // Lifted (Redis keeps a zero pause for its shortest, 1 ms).
        let left = limiter.paused_for(&key).await;
        assert!(
            left.is_none_or(|left| left <= Duration::from_millis(1)),
            "{name}: {left:?}"
        );
        // A shorter answer, in flight while another instance was told a minute.
        call(Some(Duration::from_secs(60)), "1").await.unwrap();
        let paused = limiter.paused_for(&key).await.expect("paused");
        assert!(
            paused > Duration::from_secs(55),
            "{name}: cut to {paused:?}"
        );
        limiter.pause(&key, Duration::ZERO).await.unwrap();
    }
}
