//! Failure is a decision: real redis-server processes killed, paused and restarted under load.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetlimit::store::{Op, RedisStore};
use fleetlimit::{
    Algorithm, BreakerConfig, Decision, Key, Limiter, OnStoreError, Quota, Rule, Source,
};
use support::redis::{RedisCluster, RedisServer};
use tokio::sync::Mutex;

/// Generous for a loaded 2-core CI machine, and still what every request is held to.
const DEADLINE: Duration = Duration::from_millis(200);
/// Scheduling slack on top of the deadline.
const MARGIN: Duration = Duration::from_millis(300);

fn rule(limit: u64) -> Rule {
    Rule::new(
        "outage",
        Quota::per_hour(limit)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap(),
    )
    .unwrap()
}

async fn limiter(url: &str, policy: OnStoreError, limit: u64) -> Limiter {
    let store = RedisStore::builder().connect(url).await.unwrap();
    Limiter::builder(store)
        .rule(rule(limit))
        .on_store_error(policy)
        .deadline(DEADLINE)
        // These tests watch every decision reach Redis (or the policy); remembered denials, which
        // would answer some of them in process, are tested in tests/leasing.rs.
        .deny_cache(0)
        .breaker(BreakerConfig {
            failures: 3,
            cool_down: Duration::from_millis(200),
        })
        .build()
        .unwrap()
}

/// A limiter of `rules` on `server`, the store and the limiter on `clock`, with `policy`.
fn on_a_manual_clock(
    server: &RedisServer,
    clock: &fleetlimit::ManualClock,
    rules: Vec<Rule>,
    policy: OnStoreError,
) -> impl std::future::Future<Output = Limiter> {
    let (url, clock) = (server.url(), clock.clone());
    async move {
        let store = RedisStore::builder()
            .clock(clock.clone())
            .connect_timeout(Duration::from_secs(2))
            .connect(&url)
            .await
            .unwrap();
        rules
            .into_iter()
            .fold(Limiter::builder(store), |b, r| b.rule(r))
            .on_store_error(policy)
            .deadline(DEADLINE)
            .clock(clock)
            .build()
            .unwrap()
    }
}

/// One decision, timed.
#[derive(Debug, Clone)]
struct Sample {
    started: Instant,
    took: Duration,
    decision: Decision,
    key: usize,
}

/// Runs `workers` tasks deciding on `keys` keys until `stop` is set; returns every sample.
fn load(
    limiter: Limiter,
    workers: usize,
    keys: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Sample>> {
    tokio::spawn(async move {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for w in 0..workers {
            let (limiter, stop, samples) = (limiter.clone(), stop.clone(), samples.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = w;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let key = i % keys;
                    i += workers;
                    let started = Instant::now();
                    let decision = limiter
                        .consume(&Key::new(format!("k{key}")), 1)
                        .await
                        .unwrap();
                    // Measured before the samples' lock, whose wait is no decision's.
                    let took = started.elapsed();
                    samples.lock().await.push(Sample {
                        started,
                        took,
                        decision,
                        key,
                    });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let samples = samples.lock().await.clone();
        samples
    })
}

fn stop_flag() -> Arc<std::sync::atomic::AtomicBool> {
    Arc::new(std::sync::atomic::AtomicBool::new(false))
}

/// The runtime's live tasks fall back to at most one more than `before` (a connection task),
/// within a second: tasks that end are reaped by a worker, later on a loaded machine.
async fn assert_tasks_settle(before: usize) {
    let started = Instant::now();
    loop {
        let now = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        if now <= before + 1 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{before} → {now} tasks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assert_within_deadline(samples: &[Sample]) {
    let worst = samples.iter().map(|s| s.took).max().unwrap_or_default();
    assert!(
        worst <= DEADLINE + MARGIN,
        "a decision took {worst:?} (deadline {DEADLINE:?})"
    );
}

/// Kill Redis under load; the decisions after the kill follow the policy.
async fn kill_mid_load(policy: OnStoreError) -> (Vec<Sample>, Instant, Limiter) {
    let mut server = RedisServer::start();
    let limiter = limiter(&server.url(), policy, 1_000).await;
    let tasks_before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let stop = stop_flag();
    let running = load(limiter.clone(), 8, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let samples = running.await.unwrap();
    assert!(samples.len() > 200, "the load ran: {}", samples.len());
    assert!(samples
        .iter()
        .any(|s| s.started < killed && !s.decision.degraded));
    assert_within_deadline(&samples);
    let stats = limiter.stats();
    assert!(stats.breaker_opened >= 1, "{stats:?}");
    assert!(stats.degraded_decisions > 0, "{stats:?}");
    // Nothing we started is left running (the connection manager's own tasks excepted).
    assert_tasks_settle(tasks_before).await;
    (samples, killed, limiter)
}

fn after(samples: &[Sample], t: Instant) -> Vec<&Sample> {
    samples.iter().filter(|s| s.started >= t).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_with_fail_open_admits_everything_marked_degraded() {
    let (samples, killed, _) = kill_mid_load(OnStoreError::FailOpen).await;
    // Requests already in flight at the kill may still fail first; from 1 deadline on, all follow
    // the policy.
    let late = after(&samples, killed + DEADLINE);
    assert!(!late.is_empty());
    for s in late {
        assert!(s.decision.allowed && s.decision.degraded, "{s:?}");
        assert_eq!(s.decision.source, Source::Policy);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_with_fail_closed_refuses_everything_with_503() {
    let (samples, killed, limiter) = kill_mid_load(OnStoreError::fail_closed()).await;
    let late = after(&samples, killed + DEADLINE);
    assert!(!late.is_empty());
    for s in late {
        assert!(!s.decision.allowed && s.decision.degraded, "{s:?}");
        assert_eq!(s.decision.retry_after, Some(Duration::from_secs(1)));
    }
    // Through the layer: 503 with a short Retry-After and no made-up rate-limit numbers.
    use tower::ServiceExt;
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(
            fleetlimit::RateLimitLayer::builder(limiter)
                .key(fleetlimit::key::global())
                .build()
                .unwrap(),
        );
    let r = app
        .oneshot(
            http::Request::get("/")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "1");
    assert!(r.headers().get("ratelimit-remaining").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_with_a_local_fallback_keeps_the_local_quota() {
    let local = Quota::per_hour(5)
        .algorithm(Algorithm::SlidingLog)
        .build()
        .unwrap();
    let (samples, _, _) = kill_mid_load(OnStoreError::Local(local)).await;
    let mut admitted_locally = [0u64; 4];
    for s in &samples {
        if s.decision.source == Source::Fallback {
            assert!(s.decision.degraded);
            admitted_locally[s.key] += u64::from(s.decision.allowed);
        }
    }
    assert!(
        samples
            .iter()
            .filter(|s| s.decision.source == Source::Fallback)
            .count()
            > 50
    );
    for (key, n) in admitted_locally.iter().enumerate() {
        assert_eq!(*n, 5, "key {key}: the local quota holds, exactly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_keeps_the_deadline_and_traffic_returns_after_sigcont() {
    let server = RedisServer::start();
    let limiter = limiter(&server.url(), OnStoreError::FailOpen, 1_000_000).await;
    let stop = stop_flag();
    let running = load(limiter.clone(), 8, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.pause();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // Opened (a snapshot of the open breakers could fall in a cool-down's probe).
    assert!(limiter.stats().breaker_opened >= 1, "{:?}", limiter.stats());
    server.resume();
    let resumed = Instant::now();
    // Long enough after the latest "back" (1 s) and its margin (0.5 s) for decisions to check.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let samples = running.await.unwrap();
    assert_within_deadline(&samples);
    // Back on Redis within about a second of SIGCONT, and nothing degraded after that.
    let back = samples
        .iter()
        .filter(|s| s.started >= resumed && s.decision.source == Source::Store)
        .map(|s| s.started)
        .min()
        .expect("decisions came from Redis again");
    assert!(
        back - resumed < Duration::from_millis(1_000),
        "{:?}",
        back - resumed
    );
    // Calls queued while Redis was stopped may still be answered late just after it.
    let back_for_good = back + DEADLINE + MARGIN;
    let after: Vec<_> = samples
        .iter()
        .filter(|s| s.started >= back_for_good)
        .collect();
    assert!(after.len() > 100, "{} decisions to check", after.len());
    assert!(after.iter().all(|s| !s.decision.degraded));
    assert_eq!(limiter.stats().open_breakers, 0);
}

/// The same at the limiter's defaults (a 50 ms deadline, the default breaker and denial
/// cache): no decision waits past the deadline (plus scheduling slack on a loaded machine),
/// and decisions are Redis's again within a second and a half of SIGCONT, most of them after
/// (a stall of the machine past 50 ms can open the breaker for a cool-down: its decisions follow
/// the policy, as they should).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_at_the_defaults_keeps_the_deadline() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(1_000_000))
        .on_store_error(OnStoreError::FailOpen)
        .build()
        .unwrap();
    let stop = stop_flag();
    let running = load(limiter.clone(), 8, 4, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.pause();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    server.resume();
    let resumed = Instant::now();
    tokio::time::sleep(Duration::from_millis(4_000)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let samples = running.await.unwrap();
    let worst = samples.iter().map(|s| s.took).max().unwrap_or_default();
    assert!(
        worst <= fleetlimit::DEFAULT_DEADLINE + Duration::from_millis(250),
        "a decision took {worst:?}"
    );
    let back = samples
        .iter()
        .filter(|s| s.started >= resumed && s.decision.source == Source::Store)
        .map(|s| s.started)
        .min()
        .expect("decisions came from Redis again");
    assert!(
        back - resumed < Duration::from_millis(1_500),
        "{:?}",
        back - resumed
    );
    let settled = back + Duration::from_millis(500);
    let after: Vec<_> = samples.iter().filter(|s| s.started >= settled).collect();
    assert!(after.len() > 100, "{} decisions to check", after.len());
    // At least 2 s watched: a stall's cool-down (250 ms) is an eighth of it, two are a quarter.
    let degraded = after.iter().filter(|s| s.decision.degraded).count();
    assert!(
        degraded * 4 <= after.len(),
        "{degraded} of {} decisions degraded after Redis came back",
        after.len()
    );
}

/// A deadline longer than half a second is the store's to use: a decision Redis answers after
/// 700 ms, within a 2 s deadline, is the store's, not the policy's (redis-rs's own response
/// timeout, 500 ms by default, gave it to the policy).
#[tokio::test]
async fn a_slow_answer_within_a_long_deadline_is_the_stores() {
    let server = RedisServer::start();
    let store = RedisStore::builder().connect(&server.url()).await.unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(10))
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let key = Key::new("slow");
    assert!(
        !limiter.consume(&key, 1).await.unwrap().degraded,
        "connected"
    );
    server.pause();
    let decision = tokio::spawn({
        let limiter = limiter.clone();
        async move { limiter.consume(&key, 1).await.unwrap() }
    });
    // The time the answer takes is what is under test.
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.resume();
    let d = decision.await.unwrap();
    assert!(d.allowed && !d.degraded, "{d:?}");
}

/// Until `limiter` decides `key` by the store again (within `bound`): how long that took.
async fn until_decided_by_the_store(limiter: &Limiter, key: &Key, bound: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let d = limiter.consume(key, 1).await.unwrap();
        if !d.degraded && d.source == Source::Store {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < bound,
            "still decided by the policy after {bound:?}: {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A failover behind a stable address (a VIP, a DNS name, a proxy): the master the store is
/// connected to turns replica, and the address now leads to the new master. The old
/// connection answers `READONLY` to every script, forever: it is left, and the next call
/// connects to the new master. At the defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_turned_replica_behind_one_address_is_left_for_the_new_one() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let address = |server: &RedisServer| server.addr().parse().unwrap();
    let relay = support::relay::Relay::start(address(&old)).await;
    let store = RedisStore::connect(&relay.url()).await.unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(1_000_000))
        .on_store_error(OnStoreError::fail_closed())
        .build()
        .unwrap();
    let key = Key::new("failover");
    until_decided_by_the_store(&limiter, &key, Duration::from_secs(5)).await;
    relay.point_at(address(&new));
    old.cmd(&["REPLICAOF", "127.0.0.1", &new.port().to_string()])
        .unwrap();
    let d = limiter.consume(&key, 1).await.unwrap();
    assert!(d.degraded, "the old master refuses the write: {d:?}");
    until_decided_by_the_store(&limiter, &key, Duration::from_secs(2)).await;
    let on_new = new.cmd(&["DBSIZE"]).unwrap().as_int().unwrap();
    assert!(on_new > 0, "the state is written on the new master");
}

/// A half-open link (a partition, or a host gone without a reset): the connection stays
/// open and nothing comes back, and the kernel would take many minutes to give up on it. A
/// call abandoned at its deadline has the connection probed, and one that does not answer is
/// replaced: decisions are the store's again within the probe's second. At the defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_connection_is_replaced() {
    let server = RedisServer::start();
    let relay = support::relay::Relay::start(server.addr().parse().unwrap()).await;
    let store = RedisStore::connect(&relay.url()).await.unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(1_000_000))
        .on_store_error(OnStoreError::fail_closed())
        .build()
        .unwrap();
    let key = Key::new("half-open");
    until_decided_by_the_store(&limiter, &key, Duration::from_secs(5)).await;
    relay.cut_existing();
    let d = limiter.consume(&key, 1).await.unwrap();
    assert!(
        d.degraded,
        "nothing comes back on the cut connection: {d:?}"
    );
    // The probe's second, a deadline, a breaker's cool-down and a new connection: about 1.3 s.
    let took = until_decided_by_the_store(&limiter, &key, Duration::from_millis(2_500)).await;
    eprintln!("decided by the store again after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_redis_is_used_again_and_limits_hold_from_its_state() {
    let mut server = RedisServer::start();
    let limiter = limiter(&server.url(), OnStoreError::fail_closed(), 3).await;
    let k = Key::new("restart");
    for _ in 0..3 {
        assert!(limiter.consume(&k, 1).await.unwrap().allowed);
    }
    assert!(!limiter.consume(&k, 1).await.unwrap().allowed);
    server.kill();
    assert!(limiter.consume(&k, 1).await.unwrap().degraded);
    server.restart(); // same port, empty, and without our script
    let started = Instant::now();
    let first = loop {
        let d = limiter.consume(&k, 1).await.unwrap();
        if !d.degraded {
            break d;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never reconnected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The restarted server is empty: its state, not a stale assumption, decides.
    assert!(first.allowed && first.remaining == 2, "{first:?}");
    assert!(limiter.consume(&k, 1).await.unwrap().allowed);
    assert!(limiter.consume(&k, 1).await.unwrap().allowed);
    let d = limiter.consume(&k, 1).await.unwrap();
    assert!(
        !d.allowed && !d.degraded && d.source == Source::Store,
        "{d:?}"
    );
}

/// A store on `cluster`'s masters.
async fn cluster_store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::builder()
        .cluster(&cluster.urls())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_master_only_degrades_its_own_keys() {
    let mut cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let r = rule(1_000_000);
    let limiter = Limiter::builder(store.clone())
        .rule(r.clone())
        .on_store_error(OnStoreError::FailOpen)
        .deadline(DEADLINE)
        .build()
        .unwrap();
    // Keys by the master that owns them.
    let mut by_node: Vec<Vec<Key>> = vec![Vec::new(); 3];
    for i in 0..300 {
        let k = Key::new(format!("spread-{i}"));
        let node = cluster.node_for_slot(fleetlimit::store::redis::slot(&store.key_for(&r, &k)));
        by_node[node].push(k);
    }
    assert!(by_node.iter().all(|keys| keys.len() > 20));
    for keys in &by_node {
        assert!(!limiter.consume(&keys[0], 1).await.unwrap().degraded);
    }
    cluster.kill_node(0);
    let until = Instant::now() + Duration::from_secs(2);
    let mut dead_degraded = 0;
    while Instant::now() < until {
        for (node, keys) in by_node.iter().enumerate() {
            for k in keys.iter().take(10) {
                let started = Instant::now();
                let d = limiter.consume(k, 1).await.unwrap();
                assert!(
                    started.elapsed() <= DEADLINE + MARGIN,
                    "{:?}",
                    started.elapsed()
                );
                if node == 0 {
                    assert!(d.allowed, "fail open");
                    dead_degraded += u64::from(d.degraded);
                } else {
                    assert!(
                        !d.degraded && d.source == Source::Store,
                        "a live master's key was degraded: {d:?}"
                    );
                }
            }
        }
    }
    assert!(dead_degraded > 0);
}

/// A cluster master hangs (SIGSTOP), and requests spray over 300 keys on 300 of its slots, at
/// the defaults: the breaker is the master's, so after a few failures on any of its slots the
/// policy decides at in-memory speed, with one probe per cool-down. (With a breaker per slot,
/// each slot paid three deadlines before its own breaker opened, and every one probed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_masters_slots_share_one_breaker() {
    let cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let r = rule(1_000_000);
    let limiter = Limiter::builder(store.clone())
        .rule(r.clone())
        .on_store_error(OnStoreError::FailOpen)
        .build()
        .unwrap();
    let hung = 0;
    let mut slots = std::collections::HashSet::new();
    let keys: Vec<Key> = (0..100_000)
        .map(|i| Key::new(format!("spray-{i}")))
        .filter(|k| {
            let slot = fleetlimit::store::redis::slot(&store.key_for(&r, k));
            cluster.node_for_slot(slot) == hung && slots.insert(slot)
        })
        .take(300)
        .collect();
    assert_eq!(keys.len(), 300);
    // The script reaches the master before the hang, within a deadline a loaded machine cannot
    // miss (the measured limiter keeps the default).
    let warm = Limiter::builder(store.clone())
        .rule(r.clone())
        .on_store_error(OnStoreError::FailOpen)
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    assert!(!warm.consume(&keys[0], 1).await.unwrap().degraded);
    cluster.nodes()[hung].pause();
    let counted = decisions_once_the_breaker_opens(&limiter, &keys).await;
    cluster.nodes()[hung].resume();
    counted.assert_few_waited();
}

/// Decisions counted after a breaker had half a second to open.
struct Counted {
    decisions: u32,
    /// Those that waited 40 ms or more: most of the default deadline.
    slow: u32,
}

impl Counted {
    /// Fewer than 1 in 20 decisions waited out the deadline, of more than 100.
    fn assert_few_waited(&self) {
        let Counted { decisions, slow } = self;
        assert!(*decisions > 100, "{decisions} decisions counted");
        assert!(
            slow * 20 < *decisions,
            "{slow} of {decisions} decisions waited out the deadline"
        );
    }
}

/// Consume `keys` in turn for 1.5 s, failing open: the decisions after the first half second.
async fn decisions_once_the_breaker_opens(limiter: &Limiter, keys: &[Key]) -> Counted {
    let mut counted = Counted {
        decisions: 0,
        slow: 0,
    };
    let started = Instant::now();
    for k in keys.iter().cycle() {
        let elapsed = started.elapsed();
        if elapsed > Duration::from_millis(1_500) {
            break;
        }
        let asked = Instant::now();
        let d = limiter.consume(k, 1).await.unwrap();
        assert!(d.allowed, "fail open: {d:?}");
        if elapsed > Duration::from_millis(500) {
            counted.decisions += 1;
            counted.slow += u32::from(asked.elapsed() >= Duration::from_millis(40));
        }
    }
    counted
}

/// A cluster unreachable from the store's start (every node hung): no slot map is known, and
/// keys on 300 slots share one breaker, so after the first failures decisions follow the policy
/// at once. With a breaker per slot, each slot paid its own three deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_hung_from_the_start_opens_one_breaker() {
    let cluster = RedisCluster::start();
    for node in cluster.nodes() {
        node.pause();
    }
    let store = cluster_store(&cluster).await;
    let r = rule(1_000_000);
    let limiter = Limiter::builder(store.clone())
        .rule(r.clone())
        .on_store_error(OnStoreError::FailOpen)
        .build()
        .unwrap();
    let mut slots = std::collections::HashSet::new();
    let keys: Vec<Key> = (0..100_000)
        .map(|i| Key::new(format!("spray-{i}")))
        .filter(|k| slots.insert(fleetlimit::store::redis::slot(&store.key_for(&r, k))))
        .take(300)
        .collect();
    let counted = decisions_once_the_breaker_opens(&limiter, &keys).await;
    for node in cluster.nodes() {
        node.resume();
    }
    counted.assert_few_waited();
}

/// A cluster whose masters have not loaded the script (a deploy with new Lua, a restart, a
/// `SCRIPT FLUSH`) while one master hangs: every key on a live master is decided by its master.
/// redis-rs loaded the script on every node, the hung one too, and waited for all of them, so
/// the first decision on each live master waited out its deadline (a deadline a loaded machine
/// cannot miss here: the hang is what is measured, not the machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_never_holds_up_another_masters_script_load() {
    let cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let r = rule(1_000_000);
    let limiter = Limiter::builder(store.clone())
        .rule(r.clone())
        .on_store_error(OnStoreError::FailOpen)
        .deadline(Duration::from_secs(1))
        .build()
        .unwrap();
    let hung = 0;
    let live: Vec<Key> = (0..1_000)
        .map(|i| Key::new(format!("live-{i}")))
        .filter(|k| {
            let slot = fleetlimit::store::redis::slot(&store.key_for(&r, k));
            cluster.node_for_slot(slot) != hung
        })
        .take(10)
        .collect();
    assert_eq!(live.len(), 10);
    for node in cluster.nodes() {
        node.cmd(&["SCRIPT", "FLUSH"]).unwrap();
    }
    cluster.nodes()[hung].pause();
    let mut decisions = Vec::new();
    for key in &live {
        decisions.push(limiter.consume(key, 1).await.unwrap());
    }
    cluster.nodes()[hung].resume();
    assert!(
        decisions.iter().all(|d| d.allowed && !d.degraded),
        "live masters' keys decided by their masters: {decisions:?}"
    );
}

/// Per account AND per address on a cluster, the two keys on different masters, failing open.
/// The address's master dies: the account's exhausted quota, on a live master, still refuses
/// (whichever check's master is asked first), instead of the policy admitting the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_masters_refusal_stands_when_another_master_is_down() {
    let mut cluster = RedisCluster::start();
    let store = cluster_store(&cluster).await;
    let per_hour = |limit| Quota::per_hour(limit).build().unwrap();
    let (account, ip) = (
        Rule::new("account", per_hour(1)).unwrap(),
        Rule::new("ip", per_hour(100)).unwrap(),
    );
    // A long deadline: the live master must answer even on a loaded machine (the dead one
    // refuses connections at once).
    let limiter = Limiter::builder(store.clone())
        .rule(account.clone())
        .rule(ip.clone())
        .on_store_error(OnStoreError::FailOpen)
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let node_of = |rule: &Rule, key: &Key| {
        cluster.node_for_slot(fleetlimit::store::redis::slot(&store.key_for(rule, key)))
    };
    let find = |rule: &Rule, node: usize| {
        (0..1000)
            .map(|i| Key::new(format!("{}-{i}", rule.name())))
            .find(|k| node_of(rule, k) == node)
            .unwrap()
    };
    let (a, b) = (find(&account, 1), find(&ip, 0));
    let both = [("account", &a), ("ip", &b)];
    let first = limiter.apply_to(Op::Consume, &both, 1).await.unwrap();
    assert!(first.iter().all(|d| d.allowed && !d.degraded), "{first:?}");
    cluster.kill_node(0);
    for targets in [both, [("ip", &b), ("account", &a)]] {
        let decisions = limiter.apply_to(Op::Consume, &targets, 1).await.unwrap();
        let account = decisions[if targets[0].0 == "account" { 0 } else { 1 }];
        assert!(
            !account.allowed && account.source == Source::Store,
            "the live master's refusal: {decisions:?}"
        );
    }
}

/// Pauses are read and written through the breaker: with Redis paused and the breaker open (the
/// default breaker), an outbound call's pause check answers at once instead of waiting a
/// deadline per rule, as every call did for the whole outage. (The test's deadline, 200 ms, is
/// longer than the default so that a loaded machine cannot degrade the first call.)
#[tokio::test]
async fn pause_checks_wait_for_no_open_breaker() {
    let server = RedisServer::start();
    let store = RedisStore::builder().connect(&server.url()).await.unwrap();
    let per_hour = |limit| Quota::per_hour(limit).build().unwrap();
    let limiter = Limiter::builder(store)
        .rule(Rule::new("a", per_hour(100)).unwrap())
        .rule(Rule::new("b", per_hour(100)).unwrap())
        .on_store_error(OnStoreError::FailOpen)
        .deadline(DEADLINE)
        .build()
        .unwrap();
    let key = Key::new("partner");
    assert!(!limiter.consume(&key, 1).await.unwrap().degraded);
    server.pause();
    for _ in 0..3 {
        assert!(limiter.consume(&key, 1).await.unwrap().degraded);
    }
    let started = Instant::now();
    assert_eq!(limiter.paused_for(&key).await, None);
    assert!(limiter
        .pause_at_least(&key, Duration::from_secs(1))
        .await
        .is_err());
    let took = started.elapsed();
    server.resume();
    // Waiting on the store would take a deadline per rule: 600 ms here.
    assert!(
        took < DEADLINE / 2,
        "{took:?}: waited on an open breaker (a deadline per rule)"
    );
}

/// The penalty box's block goes through the breaker too: with Redis paused and the breaker
/// open, a flood of remembered refusals that earns a block is answered at once, not after a
/// deadline spent on a store the breaker knows is away (each earned block used to cost its
/// request one).
#[tokio::test]
async fn a_penalty_earned_while_the_breaker_is_open_waits_for_nothing() {
    let server = RedisServer::start();
    let store = RedisStore::builder().connect(&server.url()).await.unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(1))
        .on_store_error(OnStoreError::FailOpen)
        .deadline(DEADLINE)
        .penalty(fleetlimit::Penalty::new(
            3,
            Duration::from_secs(60),
            Duration::from_secs(60),
        ))
        .build()
        .unwrap();
    let key = Key::new("flooder");
    assert!(limiter.consume(&key, 1).await.unwrap().allowed);
    // Refused by the store: remembered (the denial cache answers the flood below).
    assert!(!limiter.consume(&key, 1).await.unwrap().allowed);
    server.pause();
    for i in 0..3 {
        let d = limiter
            .consume(&Key::new(format!("other-{i}")), 1)
            .await
            .unwrap();
        assert!(d.degraded, "the store is away");
    }
    assert!(limiter.stats().open_breakers > 0, "{:?}", limiter.stats());
    let started = Instant::now();
    for _ in 0..6 {
        assert!(!limiter.consume(&key, 1).await.unwrap().allowed);
    }
    let took = started.elapsed();
    server.resume();
    assert!(
        took < DEADLINE / 2,
        "{took:?}: the penalty box waited on an open breaker"
    );
}

/// Repeated kill/restart cycles under load, bounded in time: every request answered within the
/// deadline, no stuck requests, no growth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_kill_restart_cycles() {
    let mut server = RedisServer::start();
    let local = Quota::per_hour(1_000).build().unwrap();
    let limiter = limiter(&server.url(), OnStoreError::Local(local), 1_000_000).await;
    let tasks_before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let rss = || {
        std::fs::read_to_string("/proc/self/statm")
            .ok()
            .and_then(|s| {
                s.split_whitespace()
                    .nth(1)
                    .and_then(|p| p.parse::<u64>().ok())
            })
            .map_or(0, |pages| pages * 4096)
    };
    let mut rss_after_first = 0;
    let mut total = 0;
    for cycle in 0..6 {
        let stop = stop_flag();
        let running = load(limiter.clone(), 8, 64, stop.clone());
        tokio::time::sleep(Duration::from_millis(400)).await;
        // Killing and restarting wait on the process, here on the test's own thread (not one
        // of the runtime's two workers, which the load needs): a server started on a pool
        // thread would die when that thread retires (its parent-death signal follows it).
        server.kill();
        tokio::time::sleep(Duration::from_millis(400)).await;
        server.restart();
        tokio::time::sleep(Duration::from_millis(800)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let samples = tokio::time::timeout(Duration::from_secs(10), running)
            .await
            .expect("no stuck request")
            .unwrap();
        assert_within_deadline(&samples);
        // Every cycle ends back on Redis.
        assert!(
            samples
                .iter()
                .rev()
                .take(8)
                .all(|s| s.decision.source == Source::Store),
            "cycle {cycle}"
        );
        total += samples.len();
        if cycle == 0 {
            rss_after_first = rss();
        }
    }
    assert!(total > 2_000, "{total} decisions");
    let grown = rss().saturating_sub(rss_after_first);
    assert!(grown < 32 << 20, "resident memory grew by {grown} bytes");
    assert_tasks_settle(tasks_before).await;
}

/// Decisions the outage policy made counted nothing, so a refund of them must give nothing: fail
/// open with refunds on 5xx, Redis paused (calls queued on the connection still run when it
/// resumes), 5xx responses, Redis back: no permit appeared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncounted_decisions_are_never_refunded() {
    use tower::ServiceExt;
    let server = RedisServer::start();
    let limiter = limiter(&server.url(), OnStoreError::FailOpen, 5).await;
    let app = axum::Router::new()
        .route(
            "/",
            axum::routing::get(|| async { (http::StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        )
        .layer(
            fleetlimit::RateLimitLayer::builder(limiter.clone())
                .key(fleetlimit::key::global())
                .scope(
                    "outage",
                    fleetlimit::Scope::new().refund_if(|s| s.is_server_error()),
                )
                .build()
                .unwrap(),
        );
    let send = || {
        let app = app.clone();
        async move {
            app.oneshot(
                http::Request::get("/")
                    .body(axum::body::Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap()
            .status()
        }
    };
    let k = fleetlimit::Key::global();
    // On a live server, 5xx responses give back exactly what their requests took.
    for _ in 0..10 {
        assert_eq!(send().await, http::StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(limiter.peek(&k).await.unwrap().remaining, 5);
    // Two permits taken and kept, counted by Redis.
    assert!(limiter.consume(&k, 2).await.unwrap().allowed);
    server.pause();
    for _ in 0..20 {
        assert_eq!(send().await, http::StatusCode::INTERNAL_SERVER_ERROR);
    }
    server.resume();
    let started = Instant::now();
    loop {
        let d = limiter.peek(&k).await.unwrap();
        if !d.degraded {
            // Calls abandoned at the deadline may still have run (that is why they are never
            // retried), so fewer may be left; never more.
            assert!(d.remaining <= 3, "a permit appeared: {d:?}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the store said before it went away stands until its own retry time, whatever the
/// policy: a deny-listed or blocked key, or one that spent its quota, stays refused through an
/// outage (long after the denial cache would have asked the store again), and only until then.
#[tokio::test]
async fn refusals_the_store_gave_stand_through_an_outage_until_their_retry_time() {
    let mut server = RedisServer::start();
    let clock = fleetlimit::ManualClock::new(1_900_000_000_000_000);
    let store = RedisStore::builder()
        .clock(clock.clone())
        .connect_timeout(Duration::from_secs(2))
        .connect(&server.url())
        .await
        .unwrap();
    let limiter = Limiter::builder(store)
        .rule(
            Rule::new(
                "outage",
                Quota::per_minute(2)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        )
        // The most permissive policy: only what the store said refuses anything.
        .on_store_error(OnStoreError::FailOpen)
        .deadline(DEADLINE)
        .clock(clock.clone())
        .build()
        .unwrap();
    let (denied, blocked, spent, other) = (
        Key::new("denied"),
        Key::new("blocked"),
        Key::new("spent"),
        Key::new("other"),
    );
    limiter.deny(&denied).await.unwrap();
    limiter
        .block(&blocked, Duration::from_secs(30))
        .await
        .unwrap();
    for _ in 0..2 {
        assert!(limiter.consume(&spent, 1).await.unwrap().allowed);
    }
    for key in [&denied, &blocked, &spent] {
        let d = limiter.consume(key, 1).await.unwrap();
        assert!(!d.allowed && !d.degraded, "{key:?}: the store refuses");
    }
    server.kill();
    // Past the denial cache's 1 s of trust: the store would be asked again, and cannot be.
    clock.advance(Duration::from_secs(5));
    for key in [&denied, &blocked, &spent] {
        let d = limiter.consume(key, 1).await.unwrap();
        assert!(!d.allowed, "{key:?} stays refused");
        assert!(d.degraded && d.source == Source::Cache, "{key:?}: {d:?}");
        assert!(d.retry_after.is_some_and(|r| r > Duration::ZERO));
    }
    let d = limiter.consume(&other, 1).await.unwrap();
    assert!(
        d.allowed && d.degraded,
        "the policy decides the rest: {d:?}"
    );
    // The window (60 s) and the block (30 s) are over: the policy decides those keys too; the
    // deny list's wait (a day) is not.
    clock.advance(Duration::from_secs(60));
    for key in [&blocked, &spent] {
        let d = limiter.consume(key, 1).await.unwrap();
        assert!(d.allowed && d.degraded, "{key:?}: {d:?}");
    }
    assert!(!limiter.consume(&denied, 1).await.unwrap().allowed);
}

/// A remembered denial stands through an outage only while nothing the store said since
/// disproves it: an admission of the key by a request on several rules (the cache remembers
/// single-rule refusals, but every admission of the key counts against them), or permits given
/// back to it by this instance. Kept, the key would be refused for the rest of its old wait,
/// though the store had since admitted it. (Here `FailOpen` decides a key nothing is known of.)
#[tokio::test]
async fn a_denial_the_store_disproved_since_does_not_outlive_it_in_an_outage() {
    for disproof in ["an admission on two rules", "a refund"] {
        let mut server = RedisServer::start();
        let clock = fleetlimit::ManualClock::new(1_900_000_000_000_000);
        let build = || {
            let rules = vec![
                Rule::new("per-ip", Quota::per_hour(2).build().unwrap()).unwrap(),
                Rule::new("per-user", Quota::per_hour(100).build().unwrap()).unwrap(),
            ];
            on_a_manual_clock(&server, &clock, rules, OnStoreError::FailOpen)
        };
        let (admin, open) = (build().await, build().await);
        let (ip, user) = (Key::new("203.0.113.9"), Key::new("user-7"));
        let mut receipt = None;
        for _ in 0..2 {
            let (d, r) = open.consume_with_receipt(&ip, 1).await.unwrap();
            assert!(d.allowed, "{disproof}");
            receipt = r;
        }
        // Refused on the per-IP rule alone, for the hour: remembered.
        let d = open
            .apply_to(Op::Consume, &[("per-ip", &ip)], 1)
            .await
            .unwrap();
        assert!(!d[0].allowed && !d[0].degraded, "{disproof}");
        clock.advance(Duration::from_millis(1));
        if disproof == "a refund" {
            open.refund(receipt.unwrap()).await.unwrap();
        } else {
            admin.reset(&ip).await.unwrap();
            let d = open
                .apply_to(Op::Consume, &[("per-ip", &ip), ("per-user", &user)], 1)
                .await
                .unwrap();
            assert!(d.iter().all(|d| d.allowed), "{disproof}: {d:?}");
        }
        server.kill();
        clock.advance(Duration::from_secs(5));
        let d = open
            .apply_to(Op::Consume, &[("per-ip", &ip)], 1)
            .await
            .unwrap();
        assert!(
            d[0].allowed && d[0].degraded,
            "{disproof}: the policy decides, not the old denial: {d:?}"
        );
    }
}

/// A listing the store applied keeps deciding its key through an outage, on every rule and at
/// any cost, whatever the policy, though this instance never made it: a deny-listed or blocked
/// key stays refused (until the block ends), an allow-listed one admitted, even when the request
/// is not the one refused before (two rules, another cost: the denial cache would not answer
/// it); a listing lifted before the outage is forgotten.
#[tokio::test]
async fn listings_the_store_applied_decide_their_keys_through_an_outage() {
    let mut server = RedisServer::start();
    let clock = fleetlimit::ManualClock::new(1_900_000_000_000_000);
    let build = |policy: OnStoreError| {
        let per_hour = Quota::per_hour(1_000).build().unwrap();
        let per_minute = Quota::per_minute(100).build().unwrap();
        // The rule spent below is the last: its answer is the last one seen.
        let rules = vec![
            Rule::new("per-hour", per_hour).unwrap(),
            Rule::new("per-minute", per_minute).unwrap(),
        ];
        on_a_manual_clock(&server, &clock, rules, policy)
    };
    let admin = build(OnStoreError::FailOpen).await;
    let open = build(OnStoreError::FailOpen).await;
    let closed = build(OnStoreError::fail_closed()).await;
    let key = |s: &str| Key::new(s);
    let (denied, blocked, allowed, lifted, plain) = (
        key("denied"),
        key("blocked"),
        key("allowed"),
        key("lifted"),
        key("plain"),
    );
    admin.deny(&denied).await.unwrap();
    admin
        .block(&blocked, Duration::from_secs(30))
        .await
        .unwrap();
    admin.allow(&allowed).await.unwrap();
    admin.deny(&lifted).await.unwrap();
    // Spent for the minute, then blocked for less: the store refuses it for the minute, and the
    // block alone is what applies to every rule.
    let spent_and_blocked = key("spent-and-blocked");
    assert!(open.consume(&spent_and_blocked, 100).await.unwrap().allowed);
    admin
        .block(&spent_and_blocked, Duration::from_secs(10))
        .await
        .unwrap();
    let d = open.consume(&spent_and_blocked, 1).await.unwrap();
    assert!(d.retry_after.unwrap() > Duration::from_secs(50), "{d:?}");
    for l in [&open, &closed] {
        for k in [&denied, &blocked, &lifted] {
            let d = l.consume(k, 1).await.unwrap();
            assert!(!d.allowed && !d.degraded, "{k:?}: the store refuses");
        }
        let d = l.consume(&allowed, 1).await.unwrap();
        assert!(d.allowed && !d.degraded);
    }
    admin.unblock(&lifted).await.unwrap();
    for l in [&open, &closed] {
        assert!(l.consume(&lifted, 1).await.unwrap().allowed, "lifted");
    }
    server.kill();
    clock.advance(Duration::from_secs(5));
    for (name, l) in [("fail open", &open), ("fail closed", &closed)] {
        for k in [&denied, &blocked] {
            // Another cost than the refused request's, on both rules.
            let d = l.consume(k, 3).await.unwrap();
            assert!(!d.allowed && d.degraded, "{name}, {k:?}: {d:?}");
            assert_eq!(d.source, Source::Cache, "{name}, {k:?}");
        }
        let wait = l.consume(&blocked, 1).await.unwrap().retry_after.unwrap();
        assert!(
            wait <= Duration::from_secs(25) && wait > Duration::from_secs(20),
            "{name}: the block's own end: {wait:?}"
        );
        let wait = l.consume(&denied, 1).await.unwrap().retry_after.unwrap();
        assert!(
            wait > Duration::from_secs(86_000),
            "{name}: the deny list's day"
        );
        let d = l.consume(&allowed, 7).await.unwrap();
        assert!(d.allowed && d.degraded, "{name}: allow-listed: {d:?}");
    }
    let d = open.consume(&spent_and_blocked, 1).await.unwrap();
    let wait = d.retry_after.unwrap();
    assert!(
        !d.allowed && wait <= Duration::from_secs(5),
        "the block's end, not the minute's: {d:?}"
    );
    // The rest is the policy's, the lifted listing included.
    for k in [&lifted, &plain] {
        assert!(open.consume(k, 1).await.unwrap().allowed, "{k:?}");
        assert!(!closed.consume(k, 1).await.unwrap().allowed, "{k:?}");
    }
    // The block ended: the policy decides that key too; the deny list stands.
    clock.advance(Duration::from_secs(30));
    assert!(open.consume(&blocked, 1).await.unwrap().allowed);
    assert!(open.consume(&spent_and_blocked, 1).await.unwrap().allowed);
    assert!(!open.consume(&denied, 1).await.unwrap().allowed);
}

/// Durations as long as a `Duration` goes (a deadline, a breaker's cool-down, a lease's idle
/// time) are taken as "very long", never an overflow: no decision panics, before or after the
/// store dies.
#[tokio::test]
async fn the_longest_durations_never_overflow() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(1))
        .connect(&server.url())
        .await
        .unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule(1_000_000))
        .on_store_error(OnStoreError::FailOpen)
        .deadline(Duration::MAX)
        .breaker(BreakerConfig {
            failures: 1,
            cool_down: Duration::MAX,
        })
        .lease(
            "outage",
            fleetlimit::LeaseConfig::auto().idle(Duration::MAX),
        )
        .build()
        .unwrap();
    let (key, other) = (Key::new("k"), Key::new("other"));
    let bound = Duration::from_secs(20);
    for _ in 0..500 {
        let d = tokio::time::timeout(bound, limiter.consume(&key, 1))
            .await
            .unwrap()
            .unwrap();
        assert!(d.allowed && !d.degraded, "{d:?}");
    }
    server.kill();
    for _ in 0..3 {
        let d = tokio::time::timeout(bound, limiter.consume(&other, 1))
            .await
            .unwrap()
            .unwrap();
        assert!(d.allowed && d.degraded, "{d:?}");
    }
    assert_eq!(
        limiter.stats().open_breakers,
        1,
        "open, for as long as it can be"
    );
}

/// Two nested layers on global keys: the outer on an in-process limiter of 100 a minute
/// (returned), the inner on a Redis that is away, following `policy`.
async fn nested_layers_inner_down(policy: OnStoreError) -> (axum::Router, Limiter) {
    let mut server = RedisServer::start();
    let inner = limiter(&server.url(), policy, 5).await;
    server.kill();
    let outer = Limiter::builder(fleetlimit::MemoryStore::new())
        .rule(
            fleetlimit::Rule::new("outer", fleetlimit::Quota::per_minute(100).build().unwrap())
                .unwrap(),
        )
        .build()
        .unwrap();
    let layer = |limiter: Limiter| {
        fleetlimit::RateLimitLayer::builder(limiter)
            .key(fleetlimit::key::global())
            .build()
            .unwrap()
    };
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer(inner))
        .layer(layer(outer.clone()));
    (app, outer)
}

async fn get(app: axum::Router) -> axum::response::Response {
    use tower::ServiceExt;
    let req = http::Request::get("/")
        .body(axum::body::Body::empty())
        .unwrap();
    app.oneshot(req).await.unwrap()
}

/// The inner layer fails open: its outage decision counted nothing, so it must not hide the
/// outer layer's headers, which describe what was counted.
#[tokio::test]
async fn an_inner_layers_outage_decision_never_hides_the_outer_layers_headers() {
    let (app, _) = nested_layers_inner_down(OnStoreError::FailOpen).await;
    let response = get(app).await;
    assert_eq!(response.status(), http::StatusCode::OK);
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
    assert_eq!(header("ratelimit-limit"), Some("100"));
    assert_eq!(header("ratelimit-remaining"), Some("99"));
}

/// The inner layer fails closed: its refusal (a 503) still governs what outer middleware and
/// the headers see, not the outer layer's admission, which it gave back.
#[tokio::test]
async fn an_inner_layers_outage_refusal_still_reads_as_a_refusal() {
    let (app, outer) = nested_layers_inner_down(OnStoreError::fail_closed()).await;
    let response = get(app).await;
    assert_eq!(response.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    let info = response.extensions().get::<fleetlimit::RateLimitInfo>();
    assert!(
        info.is_some_and(|i| !i.decision.allowed),
        "outer middleware sees the refusal: {info:?}"
    );
    assert!(response.headers().get("ratelimit-remaining").is_none());
    let left = outer.peek(&fleetlimit::Key::global()).await.unwrap();
    assert_eq!(left.remaining, 100, "the outer layer gave its permit back");
}

/// A refusal the store gave, then lifted (the key unblocked on another instance, and admitted
/// by the store since), does not come back in an outage: it no longer stands, though its old
/// retry time (the deny list's day) is far off.
#[tokio::test]
async fn a_denial_the_store_has_since_lifted_does_not_refuse_through_an_outage() {
    let mut server = RedisServer::start();
    let clock = fleetlimit::ManualClock::new(1_900_000_000_000_000);
    let build = || on_a_manual_clock(&server, &clock, vec![rule(100)], OnStoreError::FailOpen);
    let (a, admin) = (build().await, build().await);
    let key = Key::new("lifted");
    admin.deny(&key).await.unwrap();
    assert!(!a.consume(&key, 1).await.unwrap().allowed, "deny-listed");
    admin.unblock(&key).await.unwrap();
    clock.advance(Duration::from_secs(2));
    let d = a.consume(&key, 1).await.unwrap();
    assert!(d.allowed && !d.degraded, "the store admits it again: {d:?}");
    server.kill();
    clock.advance(Duration::from_secs(5));
    let d = a.consume(&key, 1).await.unwrap();
    assert!(d.allowed && d.degraded, "a lifted denial refused: {d:?}");
}

/// The IETF headers of a decision the local fallback made name the quota it was made under:
/// this server's share (25 of 100 among four), as `RateLimit-Limit` does in the default style.
/// They named the rule's whole quota (`q=100`) beside the share's remaining (`r=24`), and a
/// client reading them thought it had spent 76.
#[tokio::test]
async fn ietf_headers_in_an_outage_name_the_local_quota() {
    use tower::ServiceExt;
    let mut server = RedisServer::start();
    let limiter = limiter(&server.url(), OnStoreError::LocalShare(4), 100).await;
    server.kill();
    let layer = fleetlimit::RateLimitLayer::builder(limiter)
        .key(fleetlimit::key::global())
        .headers(fleetlimit::HeaderStyle::Ietf)
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    let req = http::Request::get("/")
        .body(axum::body::Body::empty())
        .unwrap();
    let response = app.oneshot(req).await.unwrap();
    assert_eq!(response.status(), http::StatusCode::OK);
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
    assert!(
        header("ratelimit-policy").is_some_and(|p| p.contains(";q=25;")),
        "{:?}",
        header("ratelimit-policy")
    );
    assert!(
        header("ratelimit").is_some_and(|r| r.contains(";r=24;")),
        "{:?}",
        header("ratelimit")
    );
}
