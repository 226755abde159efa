//! Limits that change while the fleet runs: quotas replaced live, on memory and on a real
//! redis-server, with a rolling change across two instances.

mod support;

use std::time::Duration;

use fleetlimit::store::RedisStore;
use fleetlimit::{
    Algorithm, ConfigError, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, Rule,
};
use support::admitted;
use support::redis::RedisServer;

/// 2025-01-01T00:00:00Z in µs: aligned to every whole-second period.
const T0: u64 = 1_735_689_600_000_000;

/// Per minute, not per second: Redis expires keys in real time whatever the store's clock, and
/// a bucket's key at a second's period lives only milliseconds per permit owed, so a stall of
/// the machine could free a debt the manual clock still counts.
fn quota(algorithm: Algorithm, per_minute: u64) -> Quota {
    Quota::per_minute(per_minute)
        .algorithm(algorithm)
        .build()
        .unwrap()
}

enum Backend {
    Memory(MemoryStore),
    Redis(RedisServer),
}

impl Backend {
    async fn limiter(&self, quota: Quota, clock: &ManualClock) -> Limiter {
        self.limiter_named("api", quota, clock).await
    }

    async fn limiter_named(&self, name: &str, quota: Quota, clock: &ManualClock) -> Limiter {
        let rule = Rule::new(name, quota).unwrap();
        match self {
            Backend::Memory(store) => Limiter::builder(store.clone()).rule(rule).build().unwrap(),
            Backend::Redis(server) => {
                let store = RedisStore::builder()
                    .connect_timeout(Duration::from_secs(2))
                    .clock(clock.clone())
                    .connect(&server.url())
                    .await
                    .unwrap();
                // The denial cache stays on (the default): a change must not be hidden by it.
                Limiter::builder(store)
                    .rule(rule)
                    .on_store_error(OnStoreError::LocalShare(2))
                    .deadline(Duration::from_secs(2))
                    .clock(clock.clone())
                    .build()
                    .unwrap()
            }
        }
    }
}

async fn each_backend(test: impl AsyncFn(Backend, ManualClock, &'static str)) {
    let clock = ManualClock::new(T0);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    test(Backend::Memory(memory), clock, "memory").await;
    let clock = ManualClock::new(T0);
    test(Backend::Redis(RedisServer::start()), clock, "redis").await;
}

/// A quota raised in the middle of a window admits the difference, not a fresh budget; lowered,
/// it admits nothing more. Remembered denials do not outlive the change.
#[tokio::test]
async fn a_live_change_carries_the_state_over() {
    for algorithm in Algorithm::ALL {
        each_backend(async |backend, clock, name| {
            let limiter = backend.limiter(quota(algorithm, 10), &clock).await;
            let key = Key::new("tenant");
            assert_eq!(admitted(&limiter, &key, 20).await, 10, "{name} {algorithm}");
            limiter.set_quota("api", quota(algorithm, 15)).unwrap();
            assert_eq!(limiter.rules()[0].quota().limit(), 15);
            let more = admitted(&limiter, &key, 20).await;
            // Buckets convert their debt to the new scale rounding up (README, "Refunds and
            // quota changes"): one permit less at most, never one more.
            let least = match algorithm {
                Algorithm::TokenBucket | Algorithm::Gcra => 4,
                _ => 5,
            };
            assert!(
                (least..=5).contains(&more),
                "{name} {algorithm}: {more} admitted when raised to 15 after 10"
            );
            limiter.set_quota("api", quota(algorithm, 10)).unwrap();
            assert_eq!(admitted(&limiter, &key, 5).await, 0, "{name} {algorithm}");
        })
        .await;
    }
}

/// A key suspended under a quota slower by far than its plan (an override of one request per
/// 366 days on a plan of 1,000 an hour) and given its plan back, again and again: the debt it
/// ran up under the plan is still owed each time. Read under the slow quota, that debt was past
/// what a conversion holds (2^52) and was cut to it, and the cut was kept: back under its plan,
/// the key had most of its burst again (857 of 1,000 for GCRA) after every suspension.
#[tokio::test]
async fn a_suspension_past_the_conversions_range_keeps_the_debt() {
    for algorithm in [Algorithm::Gcra, Algorithm::TokenBucket] {
        each_backend(async |backend, clock, name| {
            let plan = Quota::per_hour(1000).algorithm(algorithm).build().unwrap();
            let limiter = backend.limiter(plan, &clock).await;
            let key = Key::new("tenant");
            assert_eq!(
                admitted(&limiter, &key, 1000).await,
                1000,
                "{name} {algorithm}"
            );
            let suspended = Quota::new(1, Duration::from_secs(366 * 86_400))
                .algorithm(algorithm)
                .build()
                .unwrap();
            for round in 0..3 {
                limiter
                    .set_override("api", &key, Some(suspended.clone()))
                    .unwrap();
                assert!(!limiter.consume(&key, 1).await.unwrap().allowed);
                limiter.set_override("api", &key, None).unwrap();
                assert_eq!(
                    admitted(&limiter, &key, 1000).await,
                    0,
                    "{name} {algorithm}: round {round}"
                );
            }
        })
        .await;
    }
}

/// A key under a quota of a shorter period for a while (an override of 10 a minute on a rule
/// of 1,000 an hour) and then its own again: the hour's permits are still counted. The minute
/// takes the hour's count at first (refused until its window lets it go), then admits its own
/// 10; back under the hour, nothing more. The sliding window let the hour's count go with the
/// minute's: 1,000 more at once when the override was lifted (2,020 in five minutes against
/// 1,000 an hour), and every minute for a key alternating between two plans.
#[tokio::test]
async fn a_shorter_period_for_a_while_forgets_nothing_of_the_longer() {
    for algorithm in [Algorithm::SlidingWindow, Algorithm::FixedWindow] {
        each_backend(async |backend, clock, name| {
            let hourly = Quota::per_hour(1000).algorithm(algorithm).build().unwrap();
            let limiter = backend.limiter(hourly, &clock).await;
            let key = Key::new("tenant");
            assert_eq!(
                admitted(&limiter, &key, 1000).await,
                1000,
                "{name} {algorithm}"
            );
            clock.advance(Duration::from_secs(60));
            limiter
                .set_override("api", &key, Some(quota(algorithm, 10)))
                .unwrap();
            assert_eq!(admitted(&limiter, &key, 30).await, 0, "{name} {algorithm}");
            clock.advance(Duration::from_secs(140));
            assert_eq!(admitted(&limiter, &key, 30).await, 10, "{name} {algorithm}");
            clock.advance(Duration::from_secs(100));
            limiter.set_override("api", &key, None).unwrap();
            assert_eq!(
                admitted(&limiter, &key, 1000).await,
                0,
                "{name} {algorithm}: back under the hour"
            );
        })
        .await;
    }
}

/// A held count lasts as long as the longer alignment counts its permits, on both stores alike:
/// an hour's 1,000 taken at the hour's start are let go 63 minutes on (the hour and a
/// sub-window), whatever was refused in between. A refusal that moved the memory store's
/// sub-window on (the script writes nothing for one) made the memory store hold them 30
/// minutes longer than Redis.
#[tokio::test]
async fn a_held_count_ends_when_the_longer_window_lets_it_go() {
    each_backend(async |backend, clock, name| {
        let hourly = Quota::per_hour(1000)
            .algorithm(Algorithm::SlidingWindow)
            .build()
            .unwrap();
        let limiter = backend.limiter(hourly, &clock).await;
        let key = Key::new("tenant");
        assert_eq!(admitted(&limiter, &key, 1000).await, 1000, "{name}");
        clock.advance(Duration::from_secs(30 * 60));
        assert_eq!(admitted(&limiter, &key, 1).await, 0, "{name}");
        clock.advance(Duration::from_secs(60));
        limiter
            .set_override("api", &key, Some(quota(Algorithm::SlidingWindow, 100)))
            .unwrap();
        assert_eq!(admitted(&limiter, &key, 1).await, 0, "{name}");
        clock.advance(Duration::from_secs(39 * 60));
        limiter.set_override("api", &key, None).unwrap();
        assert_eq!(
            admitted(&limiter, &key, 10).await,
            10,
            "{name}: let go at 63 minutes"
        );
    })
    .await;
}

/// Two limiters giving one rule name different algorithms (a reconfiguration while the old
/// limiter's clones still serve) keep a count each, on both stores, as Redis names its keys
/// by algorithm: alternating requests admit each quota once, 20 of 100. The memory store once
/// replaced one's state by a fresh one of the other on every alternate request: all 100.
#[tokio::test]
async fn two_algorithms_on_one_rule_name_keep_their_counts() {
    each_backend(async |backend, clock, name| {
        let window = backend
            .limiter(quota(Algorithm::SlidingWindow, 10), &clock)
            .await;
        let bucket = backend
            .limiter(quota(Algorithm::TokenBucket, 10), &clock)
            .await;
        let key = Key::new("tenant");
        let mut n = 0;
        for i in 0..100 {
            let limiter = if i % 2 == 0 { &window } else { &bucket };
            n += usize::from(limiter.consume(&key, 1).await.unwrap().allowed);
        }
        assert_eq!(n, 20, "{name}");
        let peeked = window.peek(&key).await.unwrap();
        assert_eq!(
            peeked.remaining, 0,
            "{name}: a peek keeps the other's count"
        );
    })
    .await;
}

/// Two instances on one key, one still on the old quota and one on the new, hammering across
/// the change: together they never admit more than the larger of the two in a window.
#[tokio::test]
async fn a_rolling_change_never_passes_the_larger_limit() {
    for algorithm in Algorithm::ALL {
        for (old, new) in [(100, 150), (100, 50)] {
            each_backend(async |backend, clock, name| {
                let a = backend.limiter(quota(algorithm, old), &clock).await;
                let b = backend.limiter(quota(algorithm, old), &clock).await;
                let key = Key::new("rolling");
                let mut total = admitted(&a, &key, 30).await + admitted(&b, &key, 30).await;
                // B is deployed with the new quota; A still runs the old one.
                b.set_quota("api", quota(algorithm, new)).unwrap();
                for i in 0..400 {
                    let instance = if i % 2 == 0 { &a } else { &b };
                    total += usize::from(instance.consume(&key, 1).await.unwrap().allowed);
                }
                let larger = old.max(new) as usize;
                assert!(
                    total <= larger,
                    "{name} {algorithm} {old}->{new}: {total} admitted in one window"
                );
                assert!(
                    total >= old.min(new) as usize,
                    "{name} {algorithm} {old}->{new}: only {total} admitted"
                );
                // A finishes its rollout; in the next period the new quota holds alone.
                a.set_quota("api", quota(algorithm, new)).unwrap();
                clock.advance(Duration::from_secs(120));
                let next = admitted(&a, &key, 100).await + admitted(&b, &key, 100).await;
                assert_eq!(next, new as usize, "{name} {algorithm} {old}->{new}");
            })
            .await;
        }
    }
}

/// A rolling change of a window's period (an hour's 100 to a minute's 10): the instance still
/// on the hour must not find the key fresh each time the minute's instance has written it (a
/// fixed window admitted 421 in the hour, and a sliding window let the hour's count go with
/// the minute's), and once the rollout is over the minute's quota holds alone: for the fixed
/// window from the next minute on, for the sliding window once the hour's count carried into
/// its current sub-window has slid out (a minute and a sub-window).
#[tokio::test]
async fn a_rolling_change_of_the_period_never_forgets_the_longer_window() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        each_backend(async |backend, clock, name| {
            let hourly = Quota::per_hour(100).algorithm(algorithm).build().unwrap();
            let a = backend.limiter(hourly, &clock).await;
            let b = backend.limiter(quota(algorithm, 10), &clock).await;
            let key = Key::new("period");
            assert_eq!(admitted(&a, &key, 100).await, 100, "{name} {algorithm}");
            // Half an hour of a request every 10 s on each.
            let mut total = 100;
            for _ in 0..180 {
                clock.advance(Duration::from_secs(10));
                total += usize::from(a.consume(&key, 1).await.unwrap().allowed);
                total += usize::from(b.consume(&key, 1).await.unwrap().allowed);
            }
            assert_eq!(total, 100, "{name} {algorithm}: admitted within the hour");
            // The rollout is over: the minute's quota holds alone.
            clock.advance(Duration::from_secs(60));
            if algorithm == Algorithm::SlidingWindow {
                assert_eq!(admitted(&b, &key, 20).await, 0, "{name} {algorithm}");
                clock.advance(Duration::from_secs(63));
            }
            assert_eq!(admitted(&b, &key, 20).await, 10, "{name} {algorithm}");
            // And the hour's instance, back before the hour's end, still finds its hour used.
            assert_eq!(admitted(&a, &key, 10).await, 0, "{name} {algorithm}");
        })
        .await;
    }
}

/// A change is all or nothing, and keeps names and algorithms.
#[tokio::test]
async fn an_invalid_change_changes_nothing() {
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("a", quota(Algorithm::FixedWindow, 10)).unwrap())
        .rule(Rule::new("b", quota(Algorithm::Gcra, 10)).unwrap())
        .build()
        .unwrap();
    let unknown = limiter
        .set_quotas([
            ("a", quota(Algorithm::FixedWindow, 20)),
            ("c", quota(Algorithm::FixedWindow, 20)),
        ])
        .unwrap_err();
    assert!(matches!(unknown, ConfigError::Invalid { .. }));
    assert!(unknown.to_string().contains("\"c\""), "{unknown}");
    let algorithm = limiter
        .set_quota("b", quota(Algorithm::TokenBucket, 20))
        .unwrap_err();
    assert!(
        algorithm.to_string().contains("new rule name"),
        "{algorithm}"
    );
    let rules = limiter.rules();
    assert_eq!(rules[0].quota().limit(), 10, "nothing changed");
    assert_eq!(rules[1].quota().limit(), 10);
}

/// A limiter on a Redis of its own (returned, to be killed) whose outage fallback decides on
/// half of each quota (`LocalShare(2)`), with rule "api" of `quota`.
async fn sharing_limiter(quota: Quota) -> (Limiter, RedisServer) {
    let clock = ManualClock::new(T0);
    let server = RedisServer::start();
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(2))
        .clock(clock.clone())
        .connect(&server.url())
        .await
        .unwrap();
    let limiter = Limiter::builder(store)
        .rule(Rule::new("api", quota).unwrap())
        .on_store_error(OnStoreError::LocalShare(2))
        .deadline(Duration::from_millis(200))
        .clock(clock)
        .build()
        .unwrap();
    (limiter, server)
}

/// While Redis is gone, each instance decides on its share of the quotas in force now.
#[tokio::test]
async fn the_local_fallback_takes_its_share_of_the_new_quota() {
    let (limiter, mut server) = sharing_limiter(quota(Algorithm::FixedWindow, 10)).await;
    limiter
        .set_quota("api", quota(Algorithm::FixedWindow, 40))
        .unwrap();
    server.kill();
    let key = Key::new("outage");
    assert_eq!(admitted(&limiter, &key, 30).await, 20, "half of the new 40");
    assert!(limiter.stats().degraded_decisions >= 20);
}

/// While Redis is gone, a key's own quota (an override) is shared out like the rule's: a
/// throttled key stays throttled, a bigger one stays bigger, the others keep the rule's share.
#[tokio::test]
async fn the_local_fallback_takes_its_share_of_a_keys_own_quota() {
    let (limiter, mut server) = sharing_limiter(quota(Algorithm::FixedWindow, 40)).await;
    let (throttled, big, plain) = (Key::new("throttled"), Key::new("big"), Key::new("plain"));
    limiter
        .set_override("api", &throttled, Some(quota(Algorithm::FixedWindow, 4)))
        .unwrap();
    limiter
        .set_override("api", &big, Some(quota(Algorithm::FixedWindow, 100)))
        .unwrap();
    server.kill();
    assert_eq!(
        admitted(&limiter, &throttled, 30).await,
        2,
        "half of its own 4"
    );
    assert_eq!(
        admitted(&limiter, &big, 80).await,
        50,
        "half of its own 100"
    );
    assert_eq!(
        admitted(&limiter, &plain, 30).await,
        20,
        "half of the rule's 40"
    );
    assert!(limiter.stats().degraded_decisions >= 72);
}

mod per_request {
    use super::*;
    use axum::body::Body;
    use axum::extract::Request;
    use axum::http::StatusCode;
    use axum::middleware::{self, Next};
    use axum::{routing::get, Router};
    use fleetlimit::layer::Scope;
    use fleetlimit::{key, HeaderStyle, QuotaCache, RateLimitLayer};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use tower::ServiceExt;

    fn per_minute(n: u64, algorithm: Algorithm) -> Quota {
        Quota::per_minute(n).algorithm(algorithm).build().unwrap()
    }

    /// The plans "in the database", and how often they were read.
    #[derive(Clone, Default)]
    struct Plans {
        table: Arc<Mutex<HashMap<String, Quota>>>,
        reads: Arc<AtomicU64>,
    }

    /// An authentication layer that looks the tenant's plan up (cached, one load at a time)
    /// and puts its quota in the request's extensions.
    fn app(limiter: Limiter, plans: Plans, cache: QuotaCache<String>) -> Router {
        let layer = RateLimitLayer::builder(limiter)
            .key(key::header("x-tenant"))
            .scope(
                "plan",
                Scope::new().quota(|parts| parts.extensions.get::<Quota>().cloned()),
            )
            .headers(HeaderStyle::Ietf)
            .build()
            .unwrap();
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer)
            .layer(middleware::from_fn(move |mut req: Request, next: Next| {
                let (plans, cache) = (plans.clone(), cache.clone());
                async move {
                    let tenant = req
                        .headers()
                        .get("x-tenant")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    let quota = cache
                        .get(&tenant, || async {
                            plans.reads.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, ()>(plans.table.lock().unwrap().get(&tenant).cloned())
                        })
                        .await
                        .unwrap_or(None);
                    if let Some(q) = quota {
                        req.extensions_mut().insert(q);
                    }
                    next.run(req).await
                }
            }))
    }

    async fn call(app: &Router, tenant: &str) -> axum::response::Response {
        let req = axum::http::Request::get("/")
            .header("x-tenant", tenant)
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(req).await.unwrap()
    }

    async fn admitted(app: &Router, tenant: &str, tries: usize) -> usize {
        let mut n = 0;
        for _ in 0..tries {
            n += usize::from(call(app, tenant).await.status() == StatusCode::OK);
        }
        n
    }

    /// Each tenant's plan, loaded once per tenant, decides its quota in the store; a per-key
    /// override outranks it; a plan changed mid-window never admits more than the larger.
    #[tokio::test]
    async fn quotas_resolved_per_request_and_overridden_per_key() {
        each_backend(async |backend, clock, name| {
            let fw = Algorithm::FixedWindow;
            let limiter = backend
                .limiter_named("plan", per_minute(1, fw), &clock)
                .await;
            let plans = Plans::default();
            plans.table.lock().unwrap().extend([
                ("free".to_owned(), per_minute(2, fw)),
                ("pro".to_owned(), per_minute(5, fw)),
                ("odd".to_owned(), per_minute(50, Algorithm::Gcra)),
            ]);
            let cache = QuotaCache::new(100, Duration::from_secs(60)).unwrap();
            let app = app(limiter.clone(), plans.clone(), cache.clone());
            assert_eq!(admitted(&app, "free", 10).await, 2, "{name}");
            assert_eq!(admitted(&app, "pro", 10).await, 5, "{name}");
            let r = call(&app, "pro").await;
            let policy = r.headers()["ratelimit-policy"].to_str().unwrap();
            assert_eq!(policy, "\"plan\";q=5;w=60", "{name}: the resolved quota");
            // A tenant without a plan gets the rule's own quota; a plan of another
            // algorithm is ignored (with a warning) for the same reason.
            assert_eq!(admitted(&app, "nobody", 5).await, 1, "{name}");
            assert_eq!(admitted(&app, "odd", 5).await, 1, "{name}");
            assert_eq!(
                plans.reads.load(Ordering::SeqCst),
                4,
                "{name}: one read per tenant"
            );
            // An override for one key outranks its plan.
            limiter
                .set_override("plan", &Key::new("free"), Some(per_minute(4, fw)))
                .unwrap();
            assert_eq!(admitted(&app, "free", 10).await, 2, "{name}: 2 + 2 = 4");
            limiter
                .set_override("plan", &Key::new("free"), None)
                .unwrap();
            assert!(limiter
                .set_override(
                    "plan",
                    &Key::new("free"),
                    Some(per_minute(4, Algorithm::Gcra))
                )
                .is_err());
            // The plan goes from free to pro mid-window: 5 in all, not 2 + 5.
            plans
                .table
                .lock()
                .unwrap()
                .insert("free".to_owned(), per_minute(5, fw));
            cache.invalidate(&"free".to_owned());
            assert_eq!(admitted(&app, "free", 10).await, 1, "{name}: 4 taken of 5");
        })
        .await;
    }
}

mod rules_files {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::{routing::get, routing::post, Router};
    use fleetlimit::config::RuleSet;
    use fleetlimit::{key, Limiter, MemoryStore, RateLimitLayer};
    use std::net::SocketAddr;
    use tower::ServiceExt;

    const FILE: &str = r#"
[[rule]]
name = "api"
limit = 100
period = "1m"

[[rule]]
name = "login"
algorithm = "sliding-window"
limit = 2
period = "1m"
scope = { methods = ["post"], path = "/login", key = "peer", refund_status = "200-299" }
"#;

    async fn send(app: &Router, method: &str, path: &str, body: &'static str) -> StatusCode {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("x-api-key", "k")
            .body(Body::from(body))
            .unwrap();
        req.extensions_mut()
            .insert(SocketAddr::from(([192, 0, 2, 9], 1)));
        app.clone().oneshot(req).await.unwrap().status()
    }

    /// A limiter on the memory store with the file's rules.
    fn memory_limiter(set: &RuleSet) -> Limiter {
        set.rules
            .iter()
            .cloned()
            .fold(Limiter::builder(MemoryStore::new()), |b, r| b.rule(r))
            .build()
            .unwrap()
    }

    /// A rules file's `key = "peer"` is the client's address as the layer reads it: behind a
    /// trusted proxy, each client its own bucket, not every client the proxy's.
    #[tokio::test]
    async fn a_peer_scope_believes_the_layers_proxies() {
        use fleetlimit::key::{PeerIp, TrustedProxies};
        let set = RuleSet::from_toml(FILE).unwrap();
        let limiter = memory_limiter(&set);
        let behind_one_proxy = PeerIp::default().trust(TrustedProxies::hops(1).unwrap());
        let layer = set
            .scope(RateLimitLayer::builder(limiter).peer_ip(behind_one_proxy))
            .unwrap()
            .build()
            .unwrap();
        let app = Router::new()
            .route("/login", post(|| async { StatusCode::UNAUTHORIZED }))
            .layer(layer);
        let login = |client: &'static str| {
            let mut req = Request::post("/login")
                .header("x-forwarded-for", client)
                .body(Body::empty())
                .unwrap();
            req.extensions_mut()
                .insert(SocketAddr::from(([10, 0, 0, 1], 1)));
            app.clone().oneshot(req)
        };
        for _ in 0..2 {
            let status = login("203.0.113.1").await.unwrap().status();
            assert_eq!(status, StatusCode::UNAUTHORIZED);
        }
        let status = login("203.0.113.1").await.unwrap().status();
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let status = login("203.0.113.2").await.unwrap().status();
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "another client behind the proxy"
        );
    }

    /// A rules file's scopes build the layer they describe: failed logins per address, given
    /// back on success, other routes untouched.
    #[tokio::test]
    async fn a_rules_file_with_scopes_builds_its_layer() {
        let set = RuleSet::from_toml(FILE).unwrap();
        assert_eq!(set.rules.len(), 2);
        assert_eq!(set.scopes.len(), 1);
        let limiter = memory_limiter(&set);
        let layer = set
            .scope(RateLimitLayer::builder(limiter).key(key::header("x-api-key")))
            .unwrap()
            .build()
            .unwrap();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/login",
                post(|body: String| async move {
                    if body == "right" {
                        StatusCode::OK
                    } else {
                        StatusCode::UNAUTHORIZED
                    }
                }),
            )
            .layer(layer);
        for _ in 0..5 {
            assert_eq!(send(&app, "POST", "/login", "right").await, StatusCode::OK);
        }
        for _ in 0..2 {
            assert_eq!(
                send(&app, "POST", "/login", "wrong").await,
                StatusCode::UNAUTHORIZED
            );
        }
        assert_eq!(
            send(&app, "POST", "/login", "right").await,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(send(&app, "GET", "/", "").await, StatusCode::OK);
        // Scopes are checked when the file is read.
        for (bad, says) in [
            ("key = \"cookie\"", "peer"),
            ("methods = [\"GE T\"]", "method"),
            ("path = \"login\"", "start with /"),
            // Taken as they are, these would match nothing, or too much, without a word.
            ("path = \"/users/{id\"", "parameter"),
            ("path = \"/{a}{b}\"", "one parameter per segment"),
            ("path = \"/files/{*rest}/meta\"", "nothing can follow"),
            ("path = \"/login?x=1\"", "query"),
            ("path = \"/api/*/v1\"", "only ends"),
            ("path = \"/users/{id}/*\"", "{*rest}"),
            ("cost = 0", "cost of 0"),
            // Above the rule's capacity (1): every request refused as never admissible.
            ("cost = 2", "above what the rule can ever admit at once (1)"),
            ("refund_status = \"299-200\"", "refund_status"),
            ("missing_key = \"maybe\"", "reject"),
            ("cost_body = 0", "0 bytes"),
            ("cost = 5, cost_body = 1024", "cost_body"),
            ("colour = \"red\"", "colour"),
        ] {
            let text = format!(
                "[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"1s\"\nscope = {{ {bad} }}\n"
            );
            let err = RuleSet::from_toml(&text).unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
