//! Nothing the limiter does may create a permit: refunds across window boundaries and after
//! refills, quota changes while two versions of a deploy write one key, on the memory store and
//! on a real redis-server, through the limiter and through the layer.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use fleetlimit::store::RedisStore;
use fleetlimit::{
    Algorithm, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, RateLimitLayer, Rule,
    Scope,
};
use support::redis::RedisServer;
use tower::ServiceExt;

/// 2025-01-01T00:00:00Z in µs: aligned to every whole-second period.
const T0: u64 = 1_735_689_600_000_000;

fn rule(algorithm: Algorithm, limit: u64, burst: Option<u64>) -> Rule {
    let mut q = Quota::per_second(limit).algorithm(algorithm);
    if let Some(b) = burst {
        q = q.burst(b);
    }
    Rule::new("r", q.build().unwrap()).unwrap()
}

/// Where the limiters of one test keep their state.
enum Backend {
    Memory(MemoryStore),
    Redis(RedisServer),
}

impl Backend {
    fn memory(clock: &ManualClock) -> Backend {
        Backend::Memory(MemoryStore::builder().clock(clock.clone()).build().unwrap())
    }

    /// A limiter on this backend, on the shared manual clock.
    async fn limiter(&self, rule: Rule, clock: &ManualClock) -> Limiter {
        match self {
            Backend::Memory(store) => Limiter::builder(store.clone()).rule(rule).build().unwrap(),
            Backend::Redis(server) => {
                let store = RedisStore::builder()
                    .connect_timeout(Duration::from_secs(2))
                    .clock(clock.clone())
                    .connect(&server.url())
                    .await
                    .unwrap();
                Limiter::builder(store)
                    .rule(rule)
                    .on_store_error(OnStoreError::fail_closed())
                    .deadline(Duration::from_secs(2))
                    .deny_cache(0)
                    .build()
                    .unwrap()
            }
        }
    }
}

/// `GET path` from one client (198.51.100.7): the response's status.
async fn status_of(app: Router, path: &str) -> StatusCode {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(SocketAddr::from(([198, 51, 100, 7], 5555)));
    app.oneshot(req).await.unwrap().status()
}

async fn each_backend(test: impl AsyncFn(Backend, ManualClock, &'static str)) {
    let clock = ManualClock::new(T0);
    test(Backend::memory(&clock), clock, "memory").await;
    let clock = ManualClock::new(T0);
    test(Backend::Redis(RedisServer::start()), clock, "redis").await;
}

/// Fixed window, 3 per second: consume at 0.999 s, three at 1.000 s, refund the first: a fourth
/// must not be admitted in the second window.
#[tokio::test]
async fn a_refund_in_the_next_window_gives_that_window_nothing() {
    each_backend(async |backend, clock, name| {
        clock.set(T0 + 999_000);
        let limiter = backend
            .limiter(rule(Algorithm::FixedWindow, 3, None), &clock)
            .await;
        let k = Key::new("fw");
        let (d, early) = limiter.consume_with_receipt(&k, 1).await.unwrap();
        assert!(d.allowed);
        clock.set(T0 + 1_000_000);
        for left in [2, 1, 0] {
            assert_eq!(
                limiter.consume(&k, 1).await.unwrap().remaining,
                left,
                "{name}"
            );
        }
        limiter.refund(early.unwrap()).await.unwrap();
        clock.set(T0 + 1_000_020);
        assert!(
            !limiter.consume(&k, 1).await.unwrap().allowed,
            "{name}: 4 admitted in the second window"
        );
    })
    .await;
}

/// Sliding log, 2 per second: A at 0.0 s, B at 0.5 s, A refunded at 0.6 s: C at 1.0 s is
/// admitted (only B remains), D is not.
#[tokio::test]
async fn a_log_refund_removes_its_own_entry() {
    each_backend(async |backend, clock, name| {
        let limiter = backend
            .limiter(rule(Algorithm::SlidingLog, 2, None), &clock)
            .await;
        let k = Key::new("sl");
        let (_, a) = limiter.consume_with_receipt(&k, 1).await.unwrap();
        clock.set(T0 + 500_000);
        assert!(limiter.consume(&k, 1).await.unwrap().allowed);
        clock.set(T0 + 600_000);
        limiter.refund(a.unwrap()).await.unwrap();
        clock.set(T0 + 1_000_000);
        assert!(limiter.consume(&k, 1).await.unwrap().allowed, "{name}: C");
        assert!(
            !limiter.consume(&k, 1).await.unwrap().allowed,
            "{name}: D makes B, C, D in (0, 1]"
        );
    })
    .await;
}

/// Token bucket and GCRA, burst 10 at 10/s: X at 0 s, full again by 0.2 s, ten admitted at 0.2 s,
/// X refunded: no eleventh.
#[tokio::test]
async fn a_bucket_refund_after_refill_gives_nothing() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        each_backend(async |backend, clock, name| {
            let limiter = backend.limiter(rule(algorithm, 10, Some(10)), &clock).await;
            let k = Key::new("tb");
            let (_, x) = limiter.consume_with_receipt(&k, 1).await.unwrap();
            clock.set(T0 + 200_000);
            for _ in 0..10 {
                assert!(limiter.consume(&k, 1).await.unwrap().allowed);
            }
            limiter.refund(x.unwrap()).await.unwrap();
            assert!(
                !limiter.consume(&k, 1).await.unwrap().allowed,
                "{name} {algorithm}: 11 in zero time"
            );
        })
        .await;
    }
}

/// Two versions of a deploy on one key: the old one at 1001/min, the new at 1000/min,
/// alternating requests at one instant. Together they never pass the larger budget (1001), for
/// every algorithm.
#[tokio::test]
async fn two_quotas_on_one_key_never_pass_the_larger() {
    // Per minute: Redis expires the key in real time, and at 1000/s a full bucket's key lives
    // a second, which the 400 calls below could outlast.
    let per_minute = |algorithm, limit| {
        Rule::new(
            "r",
            Quota::per_minute(limit)
                .algorithm(algorithm)
                .build()
                .unwrap(),
        )
        .unwrap()
    };
    for algorithm in Algorithm::ALL {
        each_backend(async |backend, clock, name| {
            let old = backend.limiter(per_minute(algorithm, 1001), &clock).await;
            let new = backend.limiter(per_minute(algorithm, 1000), &clock).await;
            let k = Key::new("deploy");
            // The old version takes 1000 of its 1001; then both hammer the key.
            assert!(old.consume(&k, 1000).await.unwrap().allowed);
            let mut admitted = 1000;
            for i in 0..400 {
                let limiter = if i % 2 == 0 { &new } else { &old };
                if limiter.consume(&k, 1).await.unwrap().allowed {
                    admitted += 1;
                }
            }
            assert!(admitted <= 1001, "{name} {algorithm}: {admitted} admitted");
        })
        .await;
    }
}

/// A receipt is refunded only by the limiter that issued it, even when a new limiter takes the
/// old one's place in memory.
#[tokio::test]
async fn a_receipt_of_another_limiter_is_refused() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let first = Limiter::builder(store.clone())
        .rule(rule(Algorithm::FixedWindow, 3, None))
        .build()
        .unwrap();
    let (_, receipt) = first.consume_with_receipt(&Key::new("k"), 1).await.unwrap();
    drop(first);
    let second = Limiter::builder(store)
        .rule(rule(Algorithm::FixedWindow, 3, None))
        .build()
        .unwrap();
    assert!(matches!(
        second.refund(receipt.unwrap()).await,
        Err(fleetlimit::Error::ForeignReceipt)
    ));
}

/// The layer refunds through the receipt of the request it admitted: a slow handler that spans a
/// window boundary and fails gives the new window nothing.
#[tokio::test]
async fn a_slow_failing_handler_across_a_boundary_creates_no_permit() {
    each_backend(async |backend, clock, name| {
        clock.set(T0 + 999_000);
        let limiter = backend
            .limiter(rule(Algorithm::FixedWindow, 3, None), &clock)
            .await;
        let (gate, arrived) = (
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Notify::new()),
        );
        let (handler_gate, handler_arrived) = (gate.clone(), arrived.clone());
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/slow",
                get(move || {
                    let (gate, arrived) = (handler_gate.clone(), handler_arrived.clone());
                    async move {
                        arrived.notify_one();
                        gate.notified().await;
                        (StatusCode::INTERNAL_SERVER_ERROR, "boom")
                    }
                }),
            )
            .layer(
                RateLimitLayer::builder(limiter)
                    .scope("r", Scope::new().refund_if(|s| s.is_server_error()))
                    .build()
                    .unwrap(),
            );
        let send = |path: &'static str| status_of(app.clone(), path);
        let slow = tokio::spawn(send("/slow"));
        // The slow request is admitted (at 0.999 s) before its handler runs.
        arrived.notified().await;
        clock.set(T0 + 1_000_000);
        for _ in 0..3 {
            assert_eq!(send("/").await, StatusCode::OK, "{name}");
        }
        gate.notify_one();
        assert_eq!(slow.await.unwrap(), StatusCode::INTERNAL_SERVER_ERROR);
        clock.set(T0 + 1_000_020);
        assert_eq!(
            send("/").await,
            StatusCode::TOO_MANY_REQUESTS,
            "{name}: the refund gave the second window a fourth permit"
        );
    })
    .await;
}

/// A key with its own quota (an override, per hour) spends it; a receipt refunded later must be
/// given back under that quota, not the rule's own (per minute): read under the rule's quota, the
/// hour's permits would move into a minute that ends, and the key would get its hour again.
#[tokio::test]
async fn a_refund_for_a_key_with_its_own_quota_keeps_its_quota() {
    each_backend(async |backend, clock, name| {
        let base = Rule::new("api", Quota::per_minute(100).build().unwrap()).unwrap();
        let limiter = backend.limiter(base, &clock).await;
        let tenant = Key::new("tenant-42");
        let hour = Quota::per_hour(50).build().unwrap();
        limiter.set_override("api", &tenant, Some(hour)).unwrap();
        let (d, first) = limiter.consume_with_receipt(&tenant, 1).await.unwrap();
        assert!(d.allowed);
        assert!(limiter.consume(&tenant, 49).await.unwrap().allowed);
        clock.set(T0 + 10 * 60_000_000);
        limiter.refund(first.unwrap()).await.unwrap();
        clock.set(T0 + 10 * 60_000_000 + 64_000_000);
        let admitted = support::admitted(&limiter, &tenant, 20).await;
        assert_eq!(
            admitted, 1,
            "{name}: only the refunded permit is there again"
        );
    })
    .await;
}

/// The same through the layer: a tenant's plan (a quota resolved per request) with failures
/// refunded. The refund keeps the plan's quota.
#[tokio::test]
async fn a_refund_through_the_layer_keeps_the_plan_that_decided() {
    each_backend(async |backend, clock, name| {
        let base = Rule::new("api", Quota::per_minute(100).build().unwrap()).unwrap();
        let limiter = backend.limiter(base, &clock).await;
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/fail",
                get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
            )
            .layer(
                RateLimitLayer::builder(limiter)
                    .scope(
                        "api",
                        Scope::new()
                            .quota(|_| Quota::per_hour(5).build().ok())
                            .refund_if(|s| s.is_server_error()),
                    )
                    .build()
                    .unwrap(),
            );
        let send = |path: &'static str| status_of(app.clone(), path);
        for _ in 0..4 {
            assert_eq!(send("/").await, StatusCode::OK, "{name}");
        }
        assert_eq!(send("/fail").await, StatusCode::INTERNAL_SERVER_ERROR);
        clock.set(T0 + 64_000_000);
        let mut admitted = 0;
        for _ in 0..5 {
            admitted += u64::from(send("/").await == StatusCode::OK);
        }
        assert_eq!(
            admitted, 1,
            "{name}: four of the hour's five are still spent"
        );
    })
    .await;
}

/// GCRA at 1000/s, then 1 per hour: a receipt from before the change must not give back an
/// hour's worth of permits, even when the key was idle at the change (its state then reads as
/// fresh).
#[tokio::test]
async fn a_gcra_receipt_from_before_a_quota_change_refunds_nothing() {
    each_backend(async |backend, clock, name| {
        let limiter = backend
            .limiter(rule(Algorithm::Gcra, 1000, Some(1)), &clock)
            .await;
        let k = Key::new("gcra");
        let (d, x) = limiter.consume_with_receipt(&k, 1).await.unwrap();
        assert!(d.allowed);
        clock.set(T0 + 2_000);
        let hourly = Quota::per_hour(1)
            .algorithm(Algorithm::Gcra)
            .burst(1)
            .build()
            .unwrap();
        limiter.set_quota("r", hourly).unwrap();
        assert!(limiter.consume(&k, 1).await.unwrap().allowed, "{name}: Y");
        clock.set(T0 + 1_800_000_000);
        limiter.refund(x.unwrap()).await.unwrap();
        let z = limiter.consume(&k, 1).await.unwrap();
        assert!(!z.allowed, "{name}: Z is a second permit in the hour");
        assert!(
            z.retry_after.unwrap() >= Duration::from_secs(1799),
            "{name}: {z:?}"
        );
    })
    .await;
}

/// A sliding window key that spent a large budget, read under a quota whose window is a year
/// long: the estimate multiplies counts by the sub-window's width, and must refuse, not wrap.
#[tokio::test]
async fn a_huge_count_read_under_a_year_long_window_refuses() {
    each_backend(async |backend, clock, name| {
        let big = Rule::new(
            "r",
            Quota::per_second(1_000_000_000)
                .algorithm(Algorithm::SlidingWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let limiter = backend.limiter(big, &clock).await;
        let k = Key::new("sw");
        assert!(limiter.consume(&k, 583_344_215).await.unwrap().allowed);
        let yearly = Quota::new(1000, Duration::from_secs(366 * 86_400))
            .algorithm(Algorithm::SlidingWindow)
            .sub_windows(1)
            .build()
            .unwrap();
        limiter.set_quota("r", yearly).unwrap();
        assert!(
            !limiter.consume(&k, 1).await.unwrap().allowed,
            "{name}: 583,344,215 counted is past a limit of 1000"
        );
    })
    .await;
}

/// A limiter whose rule "api" is 100 a minute by `algorithm`, with tenant-7 on its own plan of
/// 50 an hour (an override): the limiter, the tenant, and the hour's quota.
async fn tenant_on_an_hour(
    backend: &Backend,
    clock: &ManualClock,
    algorithm: Algorithm,
) -> (Limiter, Key, Quota) {
    let quota = |q: fleetlimit::QuotaBuilder| q.algorithm(algorithm).build().unwrap();
    let base = Rule::new("api", quota(Quota::per_minute(100))).unwrap();
    let limiter = backend.limiter(base, clock).await;
    let tenant = Key::new("tenant-7");
    let hour = quota(Quota::per_hour(50));
    limiter
        .set_override("api", &tenant, Some(hour.clone()))
        .unwrap();
    (limiter, tenant, hour)
}

/// A peek or an inspection reads a key under the rule's own quota when the key's real one is
/// decided per request (`Scope::quota`, a tenant's plan) or passing (a rolling change): it
/// must write nothing. Converted, the hour's permits would move into a minute that ends, and
/// the key would get its hour again.
#[tokio::test]
async fn a_peek_under_another_quota_converts_nothing() {
    // The default algorithm, and the sliding log, whose peek must forget no entry either (a
    // minute's period would drop the hour's).
    for (read, algorithm) in [
        ("peek", Algorithm::default()),
        ("inspect", Algorithm::default()),
        ("peek", Algorithm::SlidingLog),
        ("inspect", Algorithm::SlidingLog),
    ] {
        each_backend(async |backend, clock, name| {
            let (limiter, tenant, hour) = tenant_on_an_hour(&backend, &clock, algorithm).await;
            assert!(limiter.consume(&tenant, 50).await.unwrap().allowed);
            clock.set(T0 + 60_000_000);
            limiter.set_override("api", &tenant, None).unwrap();
            if read == "peek" {
                limiter.peek(&tenant).await.unwrap();
            } else {
                limiter.inspect(&tenant).await.unwrap();
            }
            limiter.set_override("api", &tenant, Some(hour)).unwrap();
            clock.set(T0 + 130_000_000);
            let admitted = support::admitted(&limiter, &tenant, 20).await;
            assert_eq!(
                admitted, 0,
                "{name}, {read}, {algorithm:?}: the hour's 50 are spent"
            );
        })
        .await;
    }
}

/// A key's quota changed and changed back between a decision and its refund (a rolling
/// configuration change): the refund, counted under the quota in force when it runs, must not
/// convert the key's state to it. Converted, the hour's permits would move into a minute that
/// ends, and the key would get its hour again once the hour quota is back.
#[tokio::test]
async fn a_refund_under_a_passing_quota_converts_nothing() {
    // A sliding log is never converted, and its refund gives back the receipt's entry (1 more
    // admitted); it must forget none of the others under the minute's period.
    for (algorithm, given_back) in [(Algorithm::default(), 0), (Algorithm::SlidingLog, 1)] {
        each_backend(async |backend, clock, name| {
            let (limiter, tenant, hour) = tenant_on_an_hour(&backend, &clock, algorithm).await;
            let (_, x) = limiter.consume_with_receipt(&tenant, 1).await.unwrap();
            assert!(limiter.consume(&tenant, 49).await.unwrap().allowed);
            clock.set(T0 + 60_000_000);
            limiter.set_override("api", &tenant, None).unwrap();
            limiter.refund(x.unwrap()).await.unwrap();
            limiter.set_override("api", &tenant, Some(hour)).unwrap();
            clock.set(T0 + 130_000_000);
            let admitted = support::admitted(&limiter, &tenant, 20).await;
            assert_eq!(
                admitted, given_back,
                "{name}, {algorithm:?}: the hour's 50 are spent"
            );
        })
        .await;
    }
}
