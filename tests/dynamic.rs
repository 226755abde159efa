//! Limits that change while the fleet runs: quotas replaced live, on memory and on a real
//! redis-server, with a rolling change across two instances.

mod support;

use std::time::Duration;

use fleetlimit::store::RedisStore;
use fleetlimit::{
    Algorithm, ConfigError, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, Rule,
};
use support::redis::RedisServer;

/// 2025-01-01T00:00:00Z in µs: aligned to every whole-second period.
const T0: u64 = 1_735_689_600_000_000;

fn quota(algorithm: Algorithm, per_second: u64) -> Quota {
    Quota::per_second(per_second)
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
        let rule = Rule::new("api", quota).unwrap();
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

async fn admitted(limiter: &Limiter, key: &Key, tries: usize) -> usize {
    let mut n = 0;
    for _ in 0..tries {
        n += usize::from(limiter.consume(key, 1).await.unwrap().allowed);
    }
    n
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
                clock.advance(Duration::from_secs(2));
                let next = admitted(&a, &key, 100).await + admitted(&b, &key, 100).await;
                assert_eq!(next, new as usize, "{name} {algorithm} {old}->{new}");
            })
            .await;
        }
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

/// While Redis is gone, each instance decides on its share of the quotas in force now.
#[tokio::test]
async fn the_local_fallback_takes_its_share_of_the_new_quota() {
    let clock = ManualClock::new(T0);
    let mut server = RedisServer::start();
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(2))
        .clock(clock.clone())
        .connect(&server.url())
        .await
        .unwrap();
    let limiter = Limiter::builder(store)
        .rule(Rule::new("api", quota(Algorithm::FixedWindow, 10)).unwrap())
        .on_store_error(OnStoreError::LocalShare(2))
        .deadline(Duration::from_millis(200))
        .clock(clock.clone())
        .build()
        .unwrap();
    limiter
        .set_quota("api", quota(Algorithm::FixedWindow, 40))
        .unwrap();
    server.kill();
    let key = Key::new("outage");
    assert_eq!(admitted(&limiter, &key, 30).await, 20, "half of the new 40");
    assert!(limiter.stats().degraded_decisions >= 20);
}
