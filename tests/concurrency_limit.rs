//! Fleet-wide concurrency limits: requests in flight per key, measured by the handlers, on the
//! memory store and across two instances on a real redis-server; slots freed when requests end,
//! are cancelled, or their process is killed.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use fleetlimit::concurrency::{Acquired, ConcurrencyLimitLayer, ConcurrencyLimiter};
use fleetlimit::store::RedisStore;
use fleetlimit::{key, Key, MemoryStore, OnStoreError, RateLimitLayer};
use http_body_util::BodyExt;
use support::redis::RedisServer;
use tower::ServiceExt;

/// What the handlers saw: requests in them now, and the most at once.
#[derive(Default)]
struct Handlers {
    now: AtomicU64,
    most: AtomicU64,
}

fn app(limiter: ConcurrencyLimiter, seen: Arc<Handlers>) -> Router {
    Router::new()
        .route(
            "/",
            get(move || {
                let seen = seen.clone();
                async move {
                    let n = seen.now.fetch_add(1, Ordering::SeqCst) + 1;
                    seen.most.fetch_max(n, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    seen.now.fetch_sub(1, Ordering::SeqCst);
                    "ok"
                }
            }),
        )
        .layer(
            ConcurrencyLimitLayer::builder(limiter)
                .key(key::header("x-api-key"))
                .build()
                .unwrap(),
        )
}

/// Wait until a request is in its handler (holding its slot), for 5 s at most.
async fn in_handler(seen: &Handlers) {
    let began = std::time::Instant::now();
    while seen.now.load(Ordering::SeqCst) == 0 {
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "never reached its handler"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn send(app: Router) -> (StatusCode, axum::http::HeaderMap) {
    let req = Request::get("/")
        .header("x-api-key", "tenant")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(req).await.unwrap();
    let (parts, body) = response.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// Every slot of `limiter` for "tenant" is free again (released in the background: allowed a
/// moment).
async fn all_free(limiter: &ConcurrencyLimiter) {
    let key = Key::new("tenant");
    for _ in 0..100 {
        let mut slots = Vec::new();
        for _ in 0..limiter.limit() {
            if let Acquired::Held(slot) = limiter.acquire(&key).await {
                slots.push(slot);
            }
        }
        if slots.len() as u64 == limiter.limit() {
            return;
        }
        drop(slots);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("slots still held after every request ended");
}

/// Two instances, 20 concurrent slow requests on one key, a limit of 3.
async fn fleet(a: ConcurrencyLimiter, b: ConcurrencyLimiter, name: &str) {
    let seen = Arc::new(Handlers::default());
    let apps = [app(a.clone(), seen.clone()), app(b, seen.clone())];
    let requests: Vec<_> = (0..20)
        .map(|i| tokio::spawn(send(apps[i % 2].clone())))
        .collect();
    let mut ok = 0;
    for r in requests {
        let (status, headers) = r.await.unwrap();
        match status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(headers["retry-after"], "1");
                assert_eq!(
                    headers["ratelimit-policy"],
                    "\"in-flight\";q=3;qu=\"concurrent-requests\""
                );
            }
            other => panic!("{name}: {other}"),
        }
    }
    let most = seen.most.load(Ordering::SeqCst);
    assert!(most <= 3, "{name}: {most} in flight at once");
    assert!(ok >= 3, "{name}: {ok} served");
    all_free(&a).await;
}

#[tokio::test]
async fn never_more_than_the_limit_in_flight_across_two_instances() {
    let store = MemoryStore::new();
    let limiter = || {
        ConcurrencyLimiter::builder(store.clone(), "in-flight", 3)
            .build()
            .unwrap()
    };
    fleet(limiter(), limiter(), "memory").await;

    let server = RedisServer::start();
    let mut instances = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        instances.push(
            ConcurrencyLimiter::builder(store, "in-flight", 3)
                .on_store_error(OnStoreError::fail_closed())
                .deadline(Duration::from_secs(2))
                .build()
                .unwrap(),
        );
    }
    let b = instances.pop().unwrap();
    let a = instances.pop().unwrap();
    fleet(a, b, "redis").await;
    // The probe's own slots are given back in the background too: allowed a moment.
    let held = || {
        server
            .cmd(&["ZCARD", "fleetlimit:{ktenant}:slots=in-flight"])
            .unwrap()
            .as_int()
    };
    for _ in 0..100 {
        if held() == Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(held(), Some(0), "no slot left in Redis");
    // The slots script runs by its hash: once a node has loaded it, its text never travels
    // again, however many acquires and releases follow.
    let calls = |command: &str| {
        let stats = server.info("commandstats").unwrap();
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = (calls("evalsha"), calls("eval"));
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let again = || {
        ConcurrencyLimiter::builder(store.clone(), "in-flight", 3)
            .on_store_error(OnStoreError::fail_closed())
            .deadline(Duration::from_secs(2))
            .build()
            .unwrap()
    };
    fleet(again(), again(), "redis, the script loaded").await;
    let (by_hash, with_text) = (calls("evalsha") - before.0, calls("eval") - before.1);
    assert!(
        by_hash >= 20 && with_text == 0,
        "{by_hash} EVALSHA and {with_text} EVAL for 20 more requests"
    );
}

/// A request dropped mid-way (the client went away) gives its slot back.
#[tokio::test]
async fn a_cancelled_request_frees_its_slot() {
    let limiter = ConcurrencyLimiter::builder(MemoryStore::new(), "in-flight", 1)
        .build()
        .unwrap();
    let seen = Arc::new(Handlers::default());
    let slow = app(limiter.clone(), seen.clone());
    let request = tokio::spawn(send(slow.clone()));
    in_handler(&seen).await;
    assert_eq!(send(slow.clone()).await.0, StatusCode::TOO_MANY_REQUESTS);
    request.abort();
    let _ = request.await;
    all_free(&limiter).await;
}

/// A response body that streams on: the slot is held while it streams, refused to a second
/// request (gRPC callers get `RESOURCE_EXHAUSTED` in a 200), and free again once the client
/// drops the body mid-stream, unread to its end.
#[tokio::test]
async fn a_body_dropped_mid_stream_frees_its_slot() {
    let limiter = ConcurrencyLimiter::builder(MemoryStore::new(), "in-flight", 1)
        .build()
        .unwrap();
    /// A chunk whenever asked, never the end.
    struct Endless;
    impl http_body::Body for Endless {
        type Data = axum::body::Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            let chunk = axum::body::Bytes::from_static(b"chunk");
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
        }
    }
    let endless = || async { Body::new(Endless) };
    let app = Router::new().route("/", get(endless)).layer(
        ConcurrencyLimitLayer::builder(limiter.clone())
            .key(key::header("x-api-key"))
            .build()
            .unwrap(),
    );
    let req = |grpc: bool| {
        let builder = match grpc {
            true => Request::post("/").header("content-type", "application/grpc"),
            false => Request::get("/"),
        };
        builder
            .header("x-api-key", "tenant")
            .body(Body::empty())
            .unwrap()
    };
    let streaming = app.clone().oneshot(req(false)).await.unwrap();
    let mut body = streaming.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "chunk");
    let refused = app.clone().oneshot(req(false)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let refused = app.clone().oneshot(req(true)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::OK);
    assert_eq!(refused.headers()["grpc-status"], "8");
    assert_eq!(refused.headers()["grpc-retry-pushback-ms"], "1000");
    drop(body);
    all_free(&limiter).await;
}

/// [`app`] with one request in flight per key ("in-flight") inside a rate limit of 10 a minute
/// ("api") writing `headers`, both on one memory store: the app, the rate limiter, and what
/// the handlers see.
fn rate_over_concurrency(
    headers: fleetlimit::HeaderStyle,
) -> (Router, fleetlimit::Limiter, Arc<Handlers>) {
    let store = MemoryStore::new();
    let concurrency = ConcurrencyLimiter::builder(store.clone(), "in-flight", 1)
        .build()
        .unwrap();
    let rate = fleetlimit::Limiter::builder(store)
        .rule(
            fleetlimit::Rule::new("api", fleetlimit::Quota::per_minute(10).build().unwrap())
                .unwrap(),
        )
        .build()
        .unwrap();
    let seen = Arc::new(Handlers::default());
    let app = app(concurrency, seen.clone()).layer(
        RateLimitLayer::builder(rate.clone())
            .key(key::header("x-api-key"))
            .headers(headers)
            .build()
            .unwrap(),
    );
    (app, rate, seen)
}

/// A refusal by the concurrency layer inside a rate-limit layer gives the rate permit back.
#[tokio::test]
async fn a_refusal_inside_a_rate_limit_is_refunded_there() {
    let (app, rate, seen) = rate_over_concurrency(fleetlimit::HeaderStyle::default());
    let first = tokio::spawn(send(app.clone()));
    in_handler(&seen).await;
    for _ in 0..3 {
        assert_eq!(send(app.clone()).await.0, StatusCode::TOO_MANY_REQUESTS);
    }
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    let left = rate.peek(&Key::new("tenant")).await.unwrap().remaining;
    assert_eq!(left, 9, "only the served request counted");
}

/// The same with the IETF header style: the refusal names both policies, the concurrency
/// limit's and the rate limit's (an earlier change replaced the concurrency layer's lists by
/// the rate limit's alone: a 429 that said 9 requests were left and never named the limit that
/// refused it).
#[tokio::test]
async fn a_refusal_inside_a_rate_limit_names_both_policies() {
    let (app, _, seen) = rate_over_concurrency(fleetlimit::HeaderStyle::Ietf);
    let first = tokio::spawn(send(app.clone()));
    in_handler(&seen).await;
    let (status, headers) = send(app.clone()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    for name in ["ratelimit-policy", "ratelimit"] {
        let list = headers[name].to_str().unwrap();
        assert!(
            list.contains("\"in-flight\"") && list.contains("\"api\""),
            "{name}: {list}"
        );
    }
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
}

/// An acquisition dropped while its call is in flight (the client went away, an outer timeout)
/// gives back the slot the call took in Redis, at once rather than a ttl later.
#[tokio::test]
async fn an_acquisition_dropped_in_flight_gives_its_slot_back() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let limiter = ConcurrencyLimiter::builder(store, "in-flight", 1)
        .ttl(Duration::from_secs(60))
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap();
    let key = Key::new("tenant");
    // The connection is up and the script loaded; the warm-up slot is seen under the key this
    // test reads (so a check of 0 means free, not a wrong name), and its release has landed.
    let held = || {
        redis
            .cmd(&["ZCARD", "fleetlimit:{ktenant}:slots=in-flight"])
            .unwrap()
            .as_int()
            .unwrap()
    };
    let warm = limiter.acquire(&key).await;
    assert!(matches!(warm, Acquired::Held(_)));
    assert_eq!(held(), 1);
    drop(warm);
    for _ in 0..100 {
        if held() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(held(), 0);
    redis.pause();
    let dropped = tokio::time::timeout(Duration::from_millis(300), limiter.acquire(&key)).await;
    assert!(dropped.is_err(), "dropped while Redis holds the call");
    redis.resume();
    // Redis runs the acquisition, then the release sent after it: the slot is free again well
    // within its 60 s ttl.
    tokio::time::timeout(Duration::from_secs(5), all_free(&limiter))
        .await
        .expect("the dropped acquisition's slot is still held");
}

/// The local fallback is this process's whole share: requests in flight on Redis's slots when
/// it stops answering still count (they were once forgotten, and a process held its share
/// twice over: the demo's `--concurrency 2 --on-store-error local` ran 4 at once). Defaults
/// apart from the policy and a deadline a paused Redis can be waited out within.
#[tokio::test]
async fn the_local_fallback_counts_the_slots_held_in_redis() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let limiter = ConcurrencyLimiter::builder(store, "in-flight", 2)
        .on_store_error(OnStoreError::LocalShare(1))
        .deadline(Duration::from_millis(200))
        .build()
        .unwrap();
    let key = Key::new("tenant");
    let first = limiter.acquire(&key).await;
    assert!(matches!(first, Acquired::Held(_)), "{first:?}");
    redis.pause();
    let second = limiter.acquire(&key).await;
    assert!(matches!(second, Acquired::Held(_)), "{second:?}");
    let third = limiter.acquire(&key).await;
    assert!(
        matches!(
            third,
            Acquired::Full {
                limit: 2,
                in_flight: 2
            }
        ),
        "one on Redis and one local fill the local share: {third:?}"
    );
    // The Redis slot's end frees its place in the fallback at once.
    drop(first);
    let fourth = limiter.acquire(&key).await;
    assert!(matches!(fourth, Acquired::Held(_)), "{fourth:?}");
    redis.resume();
}

/// Failing closed while Redis is away, the 503's `Retry-After` is the policy's wait in whole
/// seconds, rounded up (1.5 s is 2, never the earlier 1).
#[tokio::test]
async fn fail_closed_retry_after_rounds_up() {
    let mut redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    redis.kill();
    let limiter = ConcurrencyLimiter::builder(store, "in-flight", 1)
        .on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_millis(1500),
        })
        .build()
        .unwrap();
    let (status, headers) = send(app(limiter, Arc::new(Handlers::default()))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "2");
}

/// Two limiters on one name with different slot lifetimes (a rolling change of `ttl`, or two
/// services sharing a name): the shorter one's acquisition never shortens the key's life under
/// the longer one's slot, which Redis would otherwise drop with the whole set.
#[tokio::test]
async fn a_shorter_ttl_never_drops_a_longer_held_slot() {
    let redis = RedisServer::start();
    let build = |ttl| {
        let url = redis.url();
        async move {
            ConcurrencyLimiter::builder(RedisStore::connect(&url).await.unwrap(), "shared", 2)
                .ttl(ttl)
                .on_store_error(OnStoreError::fail_closed())
                .deadline(Duration::from_secs(2))
                .build()
                .unwrap()
        }
    };
    let long = build(Duration::from_secs(60)).await;
    let short = build(Duration::from_millis(300)).await;
    let key = Key::new("tenant");
    let held_long = long.acquire(&key).await;
    assert!(matches!(held_long, Acquired::Held(_)));
    let held_short = short.acquire(&key).await;
    assert!(matches!(held_short, Acquired::Held(_)));
    let pttl = redis
        .cmd(&["PTTL", "fleetlimit:{ktenant}:slots=shared"])
        .unwrap()
        .as_int()
        .unwrap();
    assert!(
        pttl > 59_000,
        "the set lives {pttl} ms, its longest slot 60 s"
    );
    drop((held_long, held_short));
}

/// Redis loses the slots in use (a restart without persistence, a failover to a replica that
/// never saw them; FLUSHALL here): each holder's next renewal, at the default ttl, holds its
/// slot again, so another instance is refused while the request runs on, instead of being
/// admitted beside it.
#[tokio::test]
async fn slots_redis_lost_are_held_again_by_their_renewals() {
    let redis = RedisServer::start();
    let build = || async {
        ConcurrencyLimiter::builder(
            RedisStore::connect(&redis.url()).await.unwrap(),
            "in-flight",
            1,
        )
        .on_store_error(OnStoreError::fail_closed())
        // The renewal at the default ttl is under test, not the deadline: a loaded machine
        // must not turn an acquisition into an outage.
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap()
    };
    let (a, b) = (build().await, build().await);
    let key = Key::new("tenant");
    let held = a.acquire(&key).await;
    assert!(matches!(held, Acquired::Held(_)));
    redis.cmd(&["FLUSHALL"]).unwrap();
    let slots = "fleetlimit:{ktenant}:slots=in-flight";
    let deadline = tokio::time::Instant::now() + 2 * fleetlimit::concurrency::DEFAULT_SLOT_TTL;
    while redis.cmd(&["ZCARD", slots]).unwrap().as_int() != Some(1) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no renewal held the lost slot again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(matches!(b.acquire(&key).await, Acquired::Full { .. }));
    drop(held);
    tokio::time::timeout(Duration::from_secs(5), all_free(&b))
        .await
        .expect("the slot is given back when its request ends");
}
