//! Reserve, then settle: costs known only after the response.

#[path = "../examples/llm_tokens.rs"]
#[allow(dead_code)]
mod llm_tokens;
mod support;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use fleetlimit::layer::{ActualCost, Scope, Settle};
use fleetlimit::store::RedisStore;
use fleetlimit::{
    key, Algorithm, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, RateLimitLayer,
    Rule,
};
use support::redis::RedisServer;
use tower::ServiceExt;

async fn complete(app: &Router, max_tokens: u64, prompt_len: usize) -> StatusCode {
    let req = Request::post("/v1/completions")
        .header("x-api-key", "tenant")
        .header("x-max-tokens", max_tokens.to_string())
        .body(Body::from("p".repeat(prompt_len)))
        .unwrap();
    app.clone().oneshot(req).await.unwrap().status()
}

/// A stream of requests reserving 300 tokens each and generating 3 to 300: the budget counts
/// exactly the tokens generated, and never passes 10,000.
#[tokio::test]
async fn the_budget_counts_the_real_costs_and_is_never_passed() {
    let (app, limiter) = llm_tokens::app(MemoryStore::new()).unwrap();
    let tenant = Key::new("tenant");
    let mut generated = 0;
    let mut refused = 0;
    for i in 0..200u64 {
        let prompt = ((i * 37) % 100 + 1) as usize; // 1..=100 bytes: 3..=300 tokens
        match complete(&app, 300, prompt).await {
            StatusCode::OK => generated += (prompt as u64 * 3).min(300),
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("{other}"),
        }
        let left = limiter.peek(&tenant).await.unwrap().remaining;
        assert_eq!(10_000 - left, generated, "request {i}: taken = generated");
        assert!(generated <= 10_000);
    }
    assert!(refused > 0, "the budget ran out");
    assert!(
        generated > 10_000 - 300,
        "{generated}: only the last reservation's room is unused"
    );
    // A request asking for more than the budget can ever hold is a 413 that takes nothing.
    assert_eq!(
        complete(&app, 20_000, 1).await,
        StatusCode::PAYLOAD_TOO_LARGE
    );
}

fn under_reserving(limiter: Limiter) -> Router {
    // Reserves 10; the handler reports the real cost in the ActualCost extension.
    Router::new()
        .route(
            "/",
            get(|headers: axum::http::HeaderMap| async move {
                let used: u64 = headers["x-used"].to_str().unwrap().parse().unwrap();
                let mut response = axum::response::IntoResponse::into_response("ok");
                response.extensions_mut().insert(ActualCost(used));
                response
            }),
        )
        .layer(
            RateLimitLayer::builder(limiter)
                .key(key::header("x-api-key"))
                .scope(
                    "tokens",
                    Scope::new().cost(|_| 10).settle(Settle::extension()),
                )
                .build()
                .unwrap(),
        )
}

async fn used(app: &Router, used: u64) -> StatusCode {
    let req = Request::get("/")
        .header("x-api-key", "tenant")
        .header("x-used", used.to_string())
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(req).await.unwrap().status()
}

/// A real cost above the reservation is charged after the response while the budget holds it,
/// and never past it; on memory and on a real Redis.
#[tokio::test]
async fn costs_above_the_reservation_are_charged_within_the_budget() {
    let server = RedisServer::start();
    let clock = ManualClock::new(1_735_689_600_000_000);
    let rule = || {
        Rule::new(
            "tokens",
            Quota::per_minute(100)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap()
    };
    let memory = Limiter::builder(MemoryStore::builder().clock(clock.clone()).build().unwrap())
        .rule(rule())
        .build()
        .unwrap();
    let store = RedisStore::builder()
        .clock(clock.clone())
        .connect(&server.url())
        .await
        .unwrap();
    let redis = Limiter::builder(store)
        .rule(rule())
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    for (name, limiter) in [("memory", memory), ("redis", redis)] {
        let app = under_reserving(limiter.clone());
        let tenant = Key::new("tenant");
        let left = async || limiter.peek(&tenant).await.unwrap().remaining;
        assert_eq!(used(&app, 30).await, StatusCode::OK);
        assert_eq!(left().await, 70, "{name}: 10 reserved + 20 settled");
        assert_eq!(used(&app, 4).await, StatusCode::OK);
        assert_eq!(left().await, 66, "{name}: 6 of the 10 given back");
        // 90 more do not fit in the 56 left: those are taken (the overrun counts as far as
        // the limit, never past it), and the next request is refused.
        assert_eq!(used(&app, 100).await, StatusCode::OK);
        assert_eq!(left().await, 0, "{name}: the overrun drained the budget");
        assert_eq!(used(&app, 1).await, StatusCode::TOO_MANY_REQUESTS, "{name}");
    }
}

/// A settled cost that does not fit is the budget running out under a request already served,
/// not a client coming back while refused: it feeds neither the penalty box nor the heavy
/// hitters, so a client whose real costs run over is not blocked for them.
#[tokio::test]
async fn a_settled_cost_that_does_not_fit_is_not_a_refusal() {
    let clock = ManualClock::new(1_735_689_600_000_000);
    let limiter = Limiter::builder(MemoryStore::builder().clock(clock.clone()).build().unwrap())
        .rule(
            Rule::new(
                "tokens",
                Quota::per_second(100)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        )
        .clock(clock.clone())
        .heavy_hitters(100, Duration::from_secs(60), true)
        // Two refusals within a minute block the key.
        .penalty(fleetlimit::Penalty::new(
            2,
            Duration::from_secs(60),
            Duration::from_secs(60),
        ))
        .build()
        .unwrap();
    let app = under_reserving(limiter.clone());
    let tenant = Key::new("tenant");
    for second in 0..5 {
        // Reserves 10 of a fresh window's 100; the 95 more it used do not fit in the 90 left
        // (a refusal that names a wait): the 90 are taken instead.
        assert_eq!(used(&app, 105).await, StatusCode::OK, "second {second}");
        assert_eq!(limiter.peek(&tenant).await.unwrap().remaining, 0);
        clock.advance(Duration::from_secs(1));
    }
    assert!(
        limiter.heavy_hitters(10).is_empty(),
        "no refusal counted: {:?}",
        limiter.heavy_hitters(10)
    );
    // A real refusal still counts: the window spent, two refusals block the key.
    assert_eq!(used(&app, 100).await, StatusCode::OK);
    assert_eq!(limiter.peek(&tenant).await.unwrap().remaining, 0);
    assert_eq!(used(&app, 1).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(used(&app, 1).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limiter.heavy_hitters(10).len(), 1);
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        used(&app, 1).await,
        StatusCode::TOO_MANY_REQUESTS,
        "blocked by the penalty box beyond the window"
    );
}

/// A download quota in KiB: each request reserves 10 KiB, settled at the response body's size
/// once it is sent.
#[tokio::test]
async fn downloads_are_settled_at_the_bytes_sent() {
    let clock = ManualClock::new(1_735_689_600_000_000);
    let limiter = Limiter::builder(MemoryStore::builder().clock(clock).build().unwrap())
        .rule(
            Rule::new(
                "download-kib",
                Quota::per_minute(100)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|headers: axum::http::HeaderMap| async move {
                let kib: usize = headers["x-kib"].to_str().unwrap().parse().unwrap();
                vec![b'd'; kib * 1024]
            }),
        )
        .layer(
            RateLimitLayer::builder(limiter.clone())
                .key(key::header("x-api-key"))
                .scope(
                    "download-kib",
                    Scope::new().cost(|_| 10).settle(Settle::body_bytes(1024)),
                )
                .build()
                .unwrap(),
        );
    let tenant = Key::new("tenant");
    let download = async |kib: usize, read: bool| {
        let req = Request::get("/")
            .header("x-api-key", "tenant")
            .header("x-kib", kib.to_string())
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        if read {
            use http_body_util::BodyExt;
            response.into_body().collect().await.unwrap();
        }
    };
    // The settlement runs in the background once the body is done: allowed a moment.
    let settles_to = async |left: u64| {
        for _ in 0..100 {
            if limiter.peek(&tenant).await.unwrap().remaining == left {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not settled to {left}");
    };
    download(3, true).await;
    settles_to(97).await; // 10 reserved, 7 given back
    download(25, true).await;
    settles_to(72).await; // 10 reserved, 15 more charged
                          // A response dropped unread: settled at what was sent (nothing).
    download(4, false).await;
    settles_to(72).await;
    let err = RateLimitLayer::builder(limiter)
        .scope("download-kib", Scope::new().settle(Settle::body_bytes(0)))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("0 bytes"), "{err}");
}
