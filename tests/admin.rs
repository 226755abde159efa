//! Key administration, fleet-wide: inspect, reset, block, allow and deny lists, on the memory
//! store and on a real redis-server.

mod support;

use std::time::Duration;

use fleetlimit::store::{Listing, Op, RedisStore, DENY_RETRY_AFTER};
use fleetlimit::{Algorithm, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, Rule};
use support::admitted;
use support::redis::RedisServer;

/// 2025-01-01T00:00:00Z in µs: aligned to every whole-second period.
const T0: u64 = 1_735_689_600_000_000;

fn rules() -> Vec<Rule> {
    let q = |n, a| Quota::per_minute(n).algorithm(a).build().unwrap();
    vec![
        Rule::new("account", q(10, Algorithm::FixedWindow)).unwrap(),
        Rule::new("burst", q(5, Algorithm::Gcra)).unwrap(),
    ]
}

enum Backend {
    Memory(MemoryStore),
    Redis(RedisServer),
}

impl Backend {
    /// An instance of the service: a limiter on the shared backend, with the defaults a user
    /// gets (the denial cache on, for Redis).
    async fn instance(&self, clock: &ManualClock) -> Limiter {
        match self {
            Backend::Memory(store) => rules()
                .into_iter()
                .fold(Limiter::builder(store.clone()), |b, r| b.rule(r))
                .build()
                .unwrap(),
            Backend::Redis(server) => {
                let store = RedisStore::builder()
                    .connect_timeout(Duration::from_secs(2))
                    .clock(clock.clone())
                    .connect(&server.url())
                    .await
                    .unwrap();
                rules()
                    .into_iter()
                    .fold(Limiter::builder(store), |b, r| b.rule(r))
                    .on_store_error(OnStoreError::fail_closed())
                    .deadline(Duration::from_secs(2))
                    .clock(clock.clone())
                    .build()
                    .unwrap()
            }
        }
    }
}

impl Backend {
    /// A limiter with `penalty`, on `rule` alone (fail closed on Redis).
    async fn penalised(
        &self,
        clock: &ManualClock,
        rule: Rule,
        penalty: fleetlimit::Penalty,
    ) -> Limiter {
        match self {
            Backend::Memory(store) => Limiter::builder(store.clone())
                .rule(rule)
                .penalty(penalty)
                .clock(clock.clone())
                .build()
                .unwrap(),
            Backend::Redis(server) => {
                let store = RedisStore::builder()
                    .clock(clock.clone())
                    .connect(&server.url())
                    .await
                    .unwrap();
                Limiter::builder(store)
                    .rule(rule)
                    .on_store_error(OnStoreError::fail_closed())
                    .deadline(Duration::from_secs(2))
                    .penalty(penalty)
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

async fn remaining(limiter: &Limiter, key: &Key) -> Vec<u64> {
    let state = limiter.inspect(key).await.unwrap();
    state.rules.iter().map(|r| r.decision.remaining).collect()
}

#[tokio::test]
async fn inspect_reads_every_rule_and_consumes_nothing() {
    each_backend(async |backend, clock, name| {
        let a = backend.instance(&clock).await;
        let key = Key::new("alice");
        assert_eq!(admitted(&a, &key, 3).await, 3);
        for _ in 0..3 {
            let state = a.inspect(&key).await.unwrap();
            assert_eq!(state.listing, None, "{name}");
            let names: Vec<&str> = state.rules.iter().map(|r| r.rule.as_str()).collect();
            assert_eq!(names, ["account", "burst"], "{name}");
            assert_eq!(state.rules[0].decision.limit, 10, "{name}");
            assert_eq!(remaining(&a, &key).await, [7, 2], "{name}");
        }
    })
    .await;
}

#[tokio::test]
async fn reset_starts_a_key_afresh_on_every_instance() {
    each_backend(async |backend, clock, name| {
        let a = backend.instance(&clock).await;
        let b = backend.instance(&clock).await;
        let key = Key::new("bob");
        assert_eq!(admitted(&a, &key, 8).await, 5, "{name}: the burst of 5");
        assert_eq!(
            admitted(&b, &key, 2).await,
            0,
            "{name}: b remembers the denial"
        );
        // Reset one rule: the other still refuses.
        a.reset_rule(&key, "burst").await.unwrap();
        assert_eq!(remaining(&a, &key).await, [5, 5], "{name}");
        a.reset(&key).await.unwrap();
        assert_eq!(remaining(&a, &key).await, [10, 5], "{name}");
        // B trusts what it remembered at most 1 s (DEFAULT_DENY_CACHE_MAX_AGE).
        clock.advance(Duration::from_secs(1));
        assert_eq!(admitted(&b, &key, 10).await, 5, "{name}: afresh on b too");
        assert!(a.reset_rule(&key, "nope").await.is_err());
    })
    .await;
}

#[tokio::test]
async fn a_block_refuses_everywhere_with_an_honest_wait_and_counts_nothing() {
    each_backend(async |backend, clock, name| {
        let a = backend.instance(&clock).await;
        let b = backend.instance(&clock).await;
        let key = Key::new("mallory");
        assert_eq!(admitted(&a, &key, 1).await, 1);
        a.block(&key, Duration::from_secs(30)).await.unwrap();
        clock.advance(Duration::from_millis(500));
        for limiter in [&a, &b] {
            let d = limiter.consume(&key, 1).await.unwrap();
            assert!(!d.allowed, "{name}");
            let wait = d.retry_after.unwrap();
            assert!(
                wait > Duration::from_secs(29) && wait <= Duration::from_millis(29_500),
                "{name}: {wait:?}"
            );
        }
        assert_eq!(
            a.inspect(&key).await.unwrap().listing,
            Some(Listing::Block(Duration::from_millis(29_500))),
            "{name}"
        );
        // Nothing is counted while blocked; after it, the quotas hold as before.
        clock.advance(Duration::from_secs(30));
        assert_eq!(a.inspect(&key).await.unwrap().listing, None, "{name}");
        assert_eq!(remaining(&b, &key).await[0], 9, "{name}");
        // A block ended early.
        b.block(&key, Duration::from_secs(600)).await.unwrap();
        assert_eq!(admitted(&a, &key, 1).await, 0, "{name}");
        b.unblock(&key).await.unwrap();
        clock.advance(Duration::from_secs(1));
        assert_eq!(admitted(&a, &key, 1).await, 1, "{name}");
    })
    .await;
}

#[tokio::test]
async fn allowed_keys_are_never_limited_and_denied_keys_always_refused() {
    each_backend(async |backend, clock, name| {
        let a = backend.instance(&clock).await;
        let vip = Key::new("vip");
        assert_eq!(admitted(&a, &vip, 10).await, 5);
        a.allow(&vip).await.unwrap();
        // An admission names no wait, though the quota under it is spent.
        let d = a.consume(&vip, 1).await.unwrap();
        assert!(d.allowed && d.retry_after.is_none(), "{name}: {d:?}");
        assert_eq!(admitted(&a, &vip, 100).await, 100, "{name}");
        a.unblock(&vip).await.unwrap();
        assert_eq!(
            admitted(&a, &vip, 1).await,
            0,
            "{name}: the state is as it was"
        );

        let spam = Key::new("spam");
        a.deny(&spam).await.unwrap();
        let d = a.consume(&spam, 1).await.unwrap();
        assert!(!d.allowed, "{name}");
        assert_eq!(d.retry_after, Some(DENY_RETRY_AFTER), "{name}");
        assert_eq!(a.inspect(&spam).await.unwrap().listing, Some(Listing::Deny));
        clock.advance(Duration::from_secs(3600));
        assert_eq!(admitted(&a, &spam, 3).await, 0, "{name}: no end");
    })
    .await;
}

/// A block never ends a deny (the key stays denied after it), and a block of zero ends a
/// block and nothing else: it once took the key off both lists, so an operator's
/// `block(key, 0)` un-denied a banned client, and a minute's block on a denied key set it free
/// a minute later. A block does take a key off the allow list (the operator's latest word).
#[tokio::test]
async fn a_block_never_ends_a_deny_and_a_zero_block_only_ends_a_block() {
    each_backend(async |backend, clock, name| {
        let a = backend.instance(&clock).await;
        let banned = Key::new("banned");
        a.deny(&banned).await.unwrap();
        a.block(&banned, Duration::from_secs(60)).await.unwrap();
        assert_eq!(
            a.inspect(&banned).await.unwrap().listing,
            Some(Listing::Deny),
            "{name}"
        );
        clock.advance(Duration::from_secs(61));
        assert_eq!(admitted(&a, &banned, 1).await, 0, "{name}: still denied");
        a.block(&banned, Duration::ZERO).await.unwrap();
        assert_eq!(
            admitted(&a, &banned, 1).await,
            0,
            "{name}: a zero block un-denies nothing"
        );

        let vip = Key::new("vip");
        a.allow(&vip).await.unwrap();
        a.block(&vip, Duration::ZERO).await.unwrap();
        assert_eq!(
            a.inspect(&vip).await.unwrap().listing,
            Some(Listing::Allow),
            "{name}"
        );
        a.block(&vip, Duration::from_secs(60)).await.unwrap();
        assert_eq!(
            admitted(&a, &vip, 1).await,
            0,
            "{name}: the block replaces the allow"
        );
        clock.advance(Duration::from_secs(61));
        assert_eq!(a.inspect(&vip).await.unwrap().listing, None, "{name}");

        let blocked = Key::new("blocked");
        a.block(&blocked, Duration::from_secs(60)).await.unwrap();
        assert_eq!(admitted(&a, &blocked, 1).await, 0, "{name}");
        a.block(&blocked, Duration::ZERO).await.unwrap();
        assert_eq!(
            admitted(&a, &blocked, 1).await,
            1,
            "{name}: the block ended"
        );
    })
    .await;
}

/// A blocked key refuses a request on several rules and keys (per account AND per IP) as a
/// whole: nothing is taken from the other key.
#[tokio::test]
async fn a_blocked_key_takes_nothing_from_the_others_in_its_request() {
    each_backend(async |backend, clock, name| {
        let a = backend.instance(&clock).await;
        let (account, ip) = (Key::new("acct"), Key::new("203.0.113.9"));
        a.block(&account, Duration::from_secs(60)).await.unwrap();
        let d = a
            .apply_to(Op::Consume, &[("account", &account), ("burst", &ip)], 1)
            .await
            .unwrap();
        assert!(!d[0].allowed, "{name}");
        assert_eq!(
            remaining(&a, &ip).await[1],
            5,
            "{name}: nothing taken from the IP"
        );
        // An allowed account with an unlisted IP: the IP is still counted.
        a.allow(&account).await.unwrap();
        let d = a
            .apply_to(Op::Consume, &[("account", &account), ("burst", &ip)], 1)
            .await
            .unwrap();
        assert!(d.iter().all(|d| d.allowed), "{name}");
        assert_eq!(remaining(&a, &ip).await[1], 4, "{name}");
        assert_eq!(remaining(&a, &account).await[0], 10, "{name}");
    })
    .await;
}

/// An operator's unblock of a penalty block lets the key's refusals count again at once: they
/// went uncounted until the lifted block's end (2 minutes here), so a client unblocked early
/// by hand could hammer for that long with no new block.
#[tokio::test]
async fn refusals_after_an_operators_unblock_count_at_once() {
    use fleetlimit::Penalty;
    each_backend(async |backend, clock, name| {
        let penalty = Penalty::new(3, Duration::from_secs(10), Duration::from_secs(120));
        let rule = Rule::new(
            "api",
            Quota::per_minute(1)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let a = backend.penalised(&clock, rule, penalty).await;
        let key = Key::new("hammer");
        assert_eq!(admitted(&a, &key, 4).await, 1, "{name}");
        assert!(
            matches!(
                a.inspect(&key).await.unwrap().listing,
                Some(Listing::Block(_))
            ),
            "{name}: three refusals earn a block"
        );
        a.unblock(&key).await.unwrap();
        assert_eq!(admitted(&a, &key, 3).await, 0, "{name}");
        assert!(
            matches!(
                a.inspect(&key).await.unwrap().listing,
                Some(Listing::Block(_))
            ),
            "{name}: three refusals after the unblock earn a block again"
        );
    })
    .await;
}

/// A memory store's listings past its bound on keys: every offender still earns its block (the
/// blocks ending soonest make room), and, with an outage policy, a full map is no store failure
/// (a "full" error once opened the breaker after three, and every decision followed the policy;
/// "full" answered as "an entry stands" left the box ignoring a key never blocked).
#[tokio::test]
async fn offenders_past_the_bound_on_keys_are_still_blocked() {
    for policy in [None, Some(OnStoreError::FailOpen)] {
        use fleetlimit::Penalty;
        let clock = ManualClock::new(T0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(16)
            .shards(1)
            .build()
            .unwrap();
        let rule = Rule::new(
            "api",
            Quota::per_hour(1)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let builder = Limiter::builder(store)
            .rule(rule)
            .penalty(Penalty::new(
                3,
                Duration::from_secs(600),
                Duration::from_secs(60),
            ))
            .clock(clock.clone());
        let with_policy = policy.is_some();
        let a = match policy {
            Some(policy) => builder.on_store_error(policy).build().unwrap(),
            None => builder.build().unwrap(),
        };
        for i in 0..40 {
            let key = Key::new(format!("offender{i}"));
            // Past the 16 states too, new keys share the rule's overflow state: refused or
            // not, four requests are at least three refusals.
            assert!(admitted(&a, &key, 4).await <= 1);
            assert_eq!(
                a.inspect(&key).await.unwrap().listing,
                Some(Listing::Block(Duration::from_secs(60))),
                "offender {i}, with a policy: {with_policy}"
            );
            clock.advance(Duration::from_millis(10));
        }
        let stats = a.stats();
        assert_eq!(
            (stats.store_errors, stats.breaker_opened),
            (0, 0),
            "{stats:?}"
        );
    }
}

/// A key refused 3 times within 10 s is blocked for 2 minutes, then 4, on every instance,
/// with a `Retry-After` that says so.
#[tokio::test]
async fn the_penalty_box_blocks_repeat_offenders_longer_each_time() {
    use fleetlimit::Penalty;
    each_backend(async |backend, clock, name| {
        let penalty = Penalty::new(3, Duration::from_secs(10), Duration::from_secs(120));
        let rule = || {
            Rule::new(
                "api",
                Quota::per_minute(3)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap()
        };
        let build = async || backend.penalised(&clock, rule(), penalty).await;
        let (a, b) = (build().await, build().await);
        let key = Key::new("hammer");
        for (round, block) in [(0, 120), (1, 240)] {
            assert_eq!(admitted(&a, &key, 3).await, 3, "{name} round {round}");
            // Refused twice: only the rule's wait (to the end of the minute).
            for _ in 0..2 {
                let d = a.consume(&key, 1).await.unwrap();
                assert!(d.retry_after.unwrap() <= Duration::from_secs(60), "{name}");
            }
            let third = a.consume(&key, 1).await.unwrap();
            assert!(!third.allowed);
            // It says so: come back when the block ends, not at the minute's end.
            assert_eq!(
                third.retry_after,
                Some(Duration::from_secs(block)),
                "{name} round {round}"
            );
            // The third refusal earned the block: every instance refuses for its length.
            clock.advance(Duration::from_secs(1));
            for limiter in [&a, &b] {
                let d = limiter.consume(&key, 1).await.unwrap();
                let wait = d.retry_after.unwrap();
                assert!(
                    wait > Duration::from_secs(block - 2) && wait <= Duration::from_secs(block),
                    "{name} round {round} {}: {wait:?}",
                    if std::ptr::eq(limiter, &a) { "a" } else { "b" }
                );
            }
            assert!(matches!(
                a.inspect(&key).await.unwrap().listing,
                Some(Listing::Block(_))
            ));
            clock.advance(Duration::from_secs(block));
        }
        // An operator's deny-list entry is never replaced by a penalty's block.
        a.deny(&key).await.unwrap();
        for _ in 0..6 {
            assert!(!a.consume(&key, 1).await.unwrap().allowed);
        }
        assert_eq!(
            a.inspect(&key).await.unwrap().listing,
            Some(Listing::Deny),
            "{name}"
        );
        // Refusals of other keys are counted apart.
        let other = Key::new("calm");
        assert_eq!(admitted(&a, &other, 5).await, 3, "{name}");
        assert_eq!(a.inspect(&other).await.unwrap().listing, None, "{name}");
    })
    .await;
}

/// Through the layer on Redis, refusals the denial cache answers count towards the penalty box
/// like the store's own: the third refusal blocks the client (a cached refusal is answered in
/// the call, but one that earns a block waits, within its deadline, for the store to record it).
#[tokio::test]
async fn refusals_answered_from_the_denial_cache_earn_the_penalty_too() {
    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use fleetlimit::{Penalty, RateLimitLayer};
    use tower::ServiceExt;

    let server = RedisServer::start();
    let store = RedisStore::builder().connect(&server.url()).await.unwrap();
    let limiter = Limiter::builder(store)
        .rule(
            Rule::new(
                "api",
                Quota::per_hour(3)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        )
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .penalty(Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(120),
        ))
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RateLimitLayer::new(limiter.clone()));
    let peer = std::net::SocketAddr::from(([203, 0, 113, 9], 5000));
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let mut req = http::Request::get("/").body(Body::empty()).unwrap();
        req.extensions_mut().insert(ConnectInfo(peer));
        statuses.push(app.clone().oneshot(req).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
    let listing = limiter
        .inspect(&Key::from(peer.ip()))
        .await
        .unwrap()
        .listing;
    assert!(
        matches!(listing, Some(Listing::Block(left)) if left > Duration::from_secs(110)),
        "the third refusal blocked the client: {listing:?}"
    );
}

/// The penalty box counts only a client's own refusals by its quotas: refusals by a listing
/// (an operator's 5 s block, or another instance's) never replace the block with the box's
/// longer one, and a key every request shares (a global limit) is never blocked, or one
/// client's flood would refuse everyone.
#[tokio::test]
async fn the_penalty_box_leaves_listings_and_shared_keys_alone() {
    use fleetlimit::Penalty;
    each_backend(async |backend, clock, name| {
        let penalty = Penalty::new(3, Duration::from_secs(10), Duration::from_secs(120));
        let rule = Rule::new(
            "api",
            Quota::per_minute(3)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let limiter = backend.penalised(&clock, rule, penalty).await;
        let key = Key::new("briefly-blocked");
        limiter.block(&key, Duration::from_secs(5)).await.unwrap();
        for _ in 0..30 {
            assert!(!limiter.consume(&key, 1).await.unwrap().allowed);
        }
        let listing = limiter.inspect(&key).await.unwrap().listing;
        assert!(
            matches!(listing, Some(Listing::Block(left)) if left <= Duration::from_secs(5)),
            "{name}: the operator's 5 s block stands: {listing:?}"
        );
        let everyone = Key::global();
        assert_eq!(admitted(&limiter, &everyone, 20).await, 3, "{name}");
        assert_eq!(
            limiter.inspect(&everyone).await.unwrap().listing,
            None,
            "{name}: the global key is never blocked"
        );
        clock.advance(Duration::from_secs(60));
        assert_eq!(admitted(&limiter, &everyone, 3).await, 3, "{name}");
    })
    .await;
}

/// The penalty box's block is decided and set in one step in the store: an allow-list or
/// deny-list entry, or a block ending later, stands (an operator's entry made on another
/// instance between a read and a write would otherwise be replaced, and a deny-listed key
/// freed when the block ends). On both stores.
#[tokio::test]
async fn a_penalty_block_never_replaces_an_entry_that_says_more() {
    use fleetlimit::store::Store;
    let clock = ManualClock::new(T0);
    let server = RedisServer::start();
    let stores: Vec<(&str, Box<dyn Store>)> = vec![
        (
            "memory",
            Box::new(MemoryStore::builder().clock(clock.clone()).build().unwrap()),
        ),
        (
            "redis",
            Box::new(
                RedisStore::builder()
                    .clock(clock.clone())
                    .connect(&server.url())
                    .await
                    .unwrap(),
            ),
        ),
    ];
    let minute = Duration::from_secs(60);
    for (name, store) in &stores {
        for (entry, stands) in [
            (Listing::Deny, true),
            (Listing::Allow, true),
            (Listing::Block(2 * minute), true),
            (Listing::Block(minute), true),
            (Listing::Block(Duration::from_secs(5)), false),
        ] {
            let key = Key::new(format!("{entry:?}"));
            store.set_listing(&key, Some(entry)).await.unwrap();
            let set = store.block_unless_listed(&key, minute).await.unwrap();
            assert_eq!(set, !stands, "{name}: over {entry:?}");
            let expected = if stands {
                entry
            } else {
                Listing::Block(minute)
            };
            assert_eq!(
                store.listing(&key).await.unwrap(),
                Some(expected),
                "{name}: over {entry:?}"
            );
        }
        let unlisted = Key::new("unlisted");
        assert!(store.block_unless_listed(&unlisted, minute).await.unwrap());
        assert_eq!(
            store.listing(&unlisted).await.unwrap(),
            Some(Listing::Block(minute)),
            "{name}"
        );
        // A block that ended is no entry.
        let ended = Key::new("ended");
        store
            .set_listing(&ended, Some(Listing::Block(Duration::from_secs(1))))
            .await
            .unwrap();
        clock.advance(Duration::from_secs(2));
        assert!(
            store.block_unless_listed(&ended, minute).await.unwrap(),
            "{name}"
        );
    }
}

/// A loopback proxy to `upstream` that holds every chunk a client sends for `delay`: Redis
/// across a slow link. Ends when the test's runtime does.
async fn slow_link(upstream: String, delay: Duration) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (mut from_client, mut to_client) = client.into_split();
            let (mut from_server, mut to_server) = server.into_split();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n @ 1..) = from_client.read(&mut buf).await {
                    tokio::time::sleep(delay).await;
                    if to_server.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
            });
        }
    });
    format!("redis://{addr}")
}

/// A refusal that earns a block records it within the request's own deadline: a slow store
/// never makes the penalty box wait a second deadline after the decision.
#[tokio::test]
async fn a_block_earned_on_a_slow_store_keeps_the_requests_deadline() {
    use fleetlimit::Penalty;
    let server = RedisServer::start();
    // Each store call takes 300 ms (redis-rs gives up on an answer after 500): the refusal that
    // earns a block takes 300, and a penalty awaited in full would take 300 more, past the
    // 450 ms deadline.
    let url = slow_link(server.addr(), Duration::from_millis(300)).await;
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(5))
        .connect(&url)
        .await
        .unwrap();
    let deadline = Duration::from_millis(450);
    let limiter = Limiter::builder(store)
        .rule(Rule::new("api", Quota::per_hour(1).build().unwrap()).unwrap())
        .on_store_error(OnStoreError::fail_closed())
        .deadline(deadline)
        .deny_cache(0)
        .penalty(Penalty::new(
            2,
            Duration::from_secs(60),
            Duration::from_secs(60),
        ))
        .build()
        .unwrap();
    // Connecting and loading the script take several round trips: until then, the policy.
    let warm = Key::new("warm-up");
    for _ in 0..20 {
        if !limiter.consume(&warm, 1).await.unwrap().degraded {
            break;
        }
    }
    let key = Key::new("slow");
    assert!(limiter.consume(&key, 1).await.unwrap().allowed);
    assert!(!limiter.consume(&key, 1).await.unwrap().allowed);
    let started = std::time::Instant::now();
    let earning = limiter.consume(&key, 1).await.unwrap();
    let took = started.elapsed();
    assert!(!earning.allowed);
    assert!(
        // A margin for a loaded machine, short of the 600 ms the full penalty call would take.
        took < deadline + Duration::from_millis(75),
        "the refusal that earned a block took {took:?}, past its {deadline:?} deadline"
    );
    // And it did earn one: the block reaches the store across the slow link (read past it).
    use fleetlimit::store::Store;
    let direct = RedisStore::connect(&server.url()).await.unwrap();
    let mut listing = None;
    for _ in 0..50 {
        listing = direct.listing(&key).await.unwrap();
        if listing.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        matches!(listing, Some(Listing::Block(_))),
        "the penalty box blocked the key: {listing:?}"
    );
}
