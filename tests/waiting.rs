//! Waiting for a quota (`Limiter::until_ready`): first come, first served, at the quota's pace,
//! refused at once when the wait would not do, and cancellation-safe. Time is tokio's paused
//! clock, which the store reads too, so no test sleeps for real.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleetlimit::store::Listing;
use fleetlimit::{
    Algorithm, Clock, Key, Limiter, LimiterBuilder, MemoryStore, Penalty, Quota, Rule,
};
use tokio::time::Instant;

/// The store's clock, on tokio's (paused) time.
#[derive(Debug)]
struct TokioClock {
    start: Instant,
}

impl Clock for TokioClock {
    fn now_us(&self) -> u64 {
        1_735_689_600_000_000 + self.start.elapsed().as_micros() as u64
    }
}

/// 10 per second, one at a time: a permit every 100 ms.
fn limiter() -> Limiter {
    limiter_with(|b| b)
}

/// [`limiter`], with more built on.
fn limiter_with(
    more: impl FnOnce(LimiterBuilder<MemoryStore>) -> LimiterBuilder<MemoryStore>,
) -> Limiter {
    let quota = Quota::per_second(10)
        .algorithm(Algorithm::Gcra)
        .burst(1)
        .build()
        .unwrap();
    more(builder_of(quota)).build().unwrap()
}

/// A limiter of rule "partner" with `quota`, on a memory store on tokio's clock.
fn builder_of(quota: Quota) -> LimiterBuilder<MemoryStore> {
    let store = MemoryStore::builder()
        .clock(TokioClock {
            start: Instant::now(),
        })
        .build()
        .unwrap();
    Limiter::builder(store).rule(Rule::new("partner", quota).unwrap())
}

/// A caller at the head of `key`'s line, asleep until its permit (a second's budget).
async fn head_of_line(
    limiter: &Limiter,
    key: &Key,
) -> tokio::task::JoinHandle<Result<fleetlimit::Decision, fleetlimit::Error>> {
    let (limiter, key) = (limiter.clone(), key.clone());
    let head =
        tokio::spawn(async move { limiter.until_ready(&key, 1, Duration::from_secs(1)).await });
    tokio::task::yield_now().await;
    head
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_order_at_the_quota_pace() {
    let limiter = limiter();
    let start = Instant::now();
    let key = Key::new("api.partner.example");
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for n in 0..5u32 {
        let (limiter, key, served) = (limiter.clone(), key.clone(), served.clone());
        waiters.push(tokio::spawn(async move {
            let d = limiter
                .until_ready(&key, 1, Duration::from_secs(2))
                .await
                .unwrap();
            assert!(d.allowed, "{n}: {d:?}");
            served.lock().unwrap().push((n, start.elapsed()));
        }));
        // Joined in this order.
        tokio::task::yield_now().await;
    }
    for w in waiters {
        w.await.unwrap();
    }
    let served = served.lock().unwrap().clone();
    let order: Vec<u32> = served.iter().map(|(n, _)| *n).collect();
    assert_eq!(order, vec![0, 1, 2, 3, 4], "first come, first served");
    for (i, (_, at)) in served.iter().enumerate() {
        // One permit every 100 ms, each taken as soon as it is there.
        assert_eq!(at.as_millis(), 100 * i as u128, "{served:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_wait_past_the_budget_is_refused_at_once() {
    let limiter = limiter();
    let key = Key::new("api.partner.example");
    assert!(limiter.consume(&key, 1).await.unwrap().allowed);
    let start = Instant::now();
    let d = limiter
        .until_ready(&key, 1, Duration::from_millis(50))
        .await
        .unwrap();
    assert!(!d.allowed);
    assert_eq!(start.elapsed(), Duration::ZERO, "no wait in vain");
    assert_eq!(d.retry_after, Some(Duration::from_millis(100)));
    // A cost that never fits is refused at once too.
    let d = limiter
        .until_ready(&key, 2, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(!d.allowed);
    assert_eq!(start.elapsed(), Duration::ZERO);
    // With enough budget, the same call waits and is admitted.
    let d = limiter
        .until_ready(&key, 1, Duration::from_millis(100))
        .await
        .unwrap();
    assert!(d.allowed);
    assert_eq!(start.elapsed(), Duration::from_millis(100));
}

/// A caller behind others is not served before the head of the line wakes: when that is past
/// its budget, it is refused at once (with a wait that covers it), not at the end of its budget.
#[tokio::test(start_paused = true)]
async fn a_caller_behind_a_longer_sleep_is_refused_at_once() {
    let limiter = limiter();
    let key = Key::new("api.partner.example");
    let start = Instant::now();
    assert!(limiter.consume(&key, 1).await.unwrap().allowed);
    // The head of the line sleeps until the next permit, at 100 ms.
    let head = head_of_line(&limiter, &key).await;
    let d = limiter
        .until_ready(&key, 1, Duration::from_millis(50))
        .await
        .unwrap();
    assert!(!d.allowed);
    assert_eq!(start.elapsed(), Duration::ZERO, "no wait in vain");
    assert!(
        d.retry_after >= Some(Duration::from_millis(100)),
        "not before the head: {d:?}"
    );
    // With 150 ms, it waits for its turn (at 100 ms), and then the store's answer (200 ms)
    // is past its budget: refused then, not at 150 ms.
    let d = limiter
        .until_ready(&key, 1, Duration::from_millis(150))
        .await
        .unwrap();
    assert!(!d.allowed);
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(d.retry_after, Some(Duration::from_millis(100)));
    assert!(head.await.unwrap().unwrap().allowed);
}

/// Behind a caller asleep in line, a caller is answered for its own cost: one that can never
/// fit is refused at once, told never (it waited for its turn first, and then, with a short
/// budget, was told to come back in 100 ms, the wait of a cost of 1); a cost of 2 of a token
/// bucket drained is told its own wait; a cost of 0 is an error, as for `consume`.
#[tokio::test(start_paused = true)]
async fn a_caller_behind_others_is_answered_for_its_own_cost() {
    let limiter = limiter();
    let key = Key::new("api.partner.example");
    let start = Instant::now();
    assert!(limiter.consume(&key, 1).await.unwrap().allowed);
    let head = head_of_line(&limiter, &key).await;
    for budget in [Duration::from_millis(50), Duration::from_secs(10)] {
        let d = limiter.until_ready(&key, 2, budget).await.unwrap();
        assert!(d.never_admissible(), "{budget:?}: {d:?}");
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "{budget:?}: no wait in vain"
        );
    }
    assert!(matches!(
        limiter.until_ready(&key, 0, Duration::from_secs(1)).await,
        Err(fleetlimit::Error::InvalidCost(0))
    ));
    assert!(head.await.unwrap().unwrap().allowed);

    // A token bucket of 10 a second, drained: ten take a second, not the 100 ms of one.
    let bucket_quota = Quota::per_second(10)
        .algorithm(Algorithm::TokenBucket)
        .build()
        .unwrap();
    let bucket = builder_of(bucket_quota).build().unwrap();
    assert!(bucket.consume(&key, 10).await.unwrap().allowed);
    let head = head_of_line(&bucket, &key).await;
    let d = bucket
        .until_ready(&key, 10, Duration::from_millis(50))
        .await
        .unwrap();
    assert!(!d.allowed);
    assert!(
        d.retry_after >= Some(Duration::from_secs(1)),
        "ten tokens take a second: {d:?}"
    );
    assert!(head.await.unwrap().unwrap().allowed);
}

/// Callers waiting their turn are not clients hammering a limit: the refusals they wait out
/// never reach the penalty box (three within a minute would block the destination for the
/// whole fleet). A refusal a caller is given, because its budget is too short, still counts.
#[tokio::test(start_paused = true)]
async fn refusals_waited_out_earn_no_penalty() {
    let limiter = limiter_with(|b| {
        b.penalty(Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(60),
        ))
    });
    let key = Key::new("api.partner.example");
    let start = Instant::now();
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let (limiter, key) = (limiter.clone(), key.clone());
        waiters.push(tokio::spawn(async move {
            let d = limiter
                .until_ready(&key, 1, Duration::from_secs(2))
                .await
                .unwrap();
            (d.allowed, start.elapsed())
        }));
        tokio::task::yield_now().await;
    }
    for (i, w) in waiters.into_iter().enumerate() {
        let (allowed, at) = w.await.unwrap();
        assert!(allowed, "waiter {i}");
        assert_eq!(at, Duration::from_millis(100 * i as u64), "waiter {i}");
    }
    assert_eq!(limiter.inspect(&key).await.unwrap().listing, None);
    // Three refusals given back to callers (a budget of 1 ms is too short) earn the block.
    for _ in 0..3 {
        let d = limiter
            .until_ready(&key, 1, Duration::from_millis(1))
            .await
            .unwrap();
        assert!(!d.allowed);
    }
    assert!(matches!(
        limiter.inspect(&key).await.unwrap().listing,
        Some(Listing::Block(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_takes_nothing_and_leaves_the_line() {
    let limiter = limiter();
    let key = Key::new("api.partner.example");
    let start = Instant::now();
    assert!(limiter.consume(&key, 1).await.unwrap().allowed);
    // A waiter given up on after 30 ms (its caller timed out): it held the head of the line.
    let impatient = tokio::time::timeout(
        Duration::from_millis(30),
        limiter.until_ready(&key, 1, Duration::from_secs(5)),
    )
    .await;
    assert!(impatient.is_err());
    // The next one is served when the permit comes, 100 ms after the first: the dropped waiter
    // took nothing, and its place is gone.
    let d = limiter
        .until_ready(&key, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(d.allowed);
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    // A waiter dropped while behind another in the line does not block the ones after it.
    let ahead = {
        let (limiter, key) = (limiter.clone(), key.clone());
        tokio::spawn(async move { limiter.until_ready(&key, 1, Duration::from_secs(5)).await })
    };
    tokio::task::yield_now().await;
    let behind = {
        let (limiter, key) = (limiter.clone(), key.clone());
        tokio::spawn(async move { limiter.until_ready(&key, 1, Duration::from_secs(5)).await })
    };
    tokio::task::yield_now().await;
    behind.abort();
    assert!(ahead.await.unwrap().unwrap().allowed);
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    let d = limiter
        .until_ready(&key, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(d.allowed);
    assert_eq!(start.elapsed(), Duration::from_millis(300));
}

#[tokio::test(start_paused = true)]
async fn a_pause_lasts_as_long_as_it_was_set_for() {
    let limiter = limiter();
    let key = Key::new("api.partner.example");
    assert_eq!(limiter.paused_for(&key).await, None);
    limiter.pause(&key, Duration::from_secs(2)).await.unwrap();
    assert_eq!(limiter.paused_for(&key).await, Some(Duration::from_secs(2)));
    assert_eq!(limiter.paused_for(&Key::new("other")).await, None);
    tokio::time::advance(Duration::from_millis(1_500)).await;
    assert_eq!(
        limiter.paused_for(&key).await,
        Some(Duration::from_millis(500))
    );
    // A later pause replaces it.
    limiter.pause(&key, Duration::from_secs(1)).await.unwrap();
    assert_eq!(limiter.paused_for(&key).await, Some(Duration::from_secs(1)));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(limiter.paused_for(&key).await, None);
}

#[tokio::test(start_paused = true)]
async fn any_budget_is_accepted() {
    let limiter = limiter();
    let key = Key::new("api.partner.example");
    for budget in [Duration::ZERO, Duration::MAX] {
        assert!(limiter.until_ready(&key, 1, budget).await.unwrap().allowed);
        limiter.pause(&key, Duration::MAX).await.unwrap();
        assert!(limiter.paused_for(&key).await.is_some());
        limiter.pause(&key, Duration::ZERO).await.unwrap();
        assert_eq!(limiter.paused_for(&key).await, None);
        tokio::time::advance(Duration::from_millis(100)).await;
    }
}
