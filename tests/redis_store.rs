//! The Redis store against real redis-server processes (standalone and a 3-master cluster)
//! started by the test harness on free loopback ports.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleetlimit::store::{Check, Listing, Op, RedisStore, Refund, Store};
use fleetlimit::{
    Algorithm, Clock, Decision, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, Rule,
    Taken,
};
use support::redis::{RedisCluster, RedisServer, RespValue};

/// A store with a deadline generous enough for a loaded 2-core CI machine.
fn test_store() -> fleetlimit::store::RedisStoreBuilder {
    RedisStore::builder().connect_timeout(Duration::from_secs(2))
}

/// SplitMix64, so every run replays the same sequences.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn rule(
    name: &str,
    algorithm: Algorithm,
    limit: u64,
    period: Duration,
    burst: Option<u64>,
) -> Rule {
    let mut q = Quota::new(limit, period).algorithm(algorithm);
    if let Some(b) = burst {
        q = q.burst(b);
    }
    Rule::new(name, q.build().unwrap()).unwrap()
}

/// A random quota for one algorithm, named `name`: mostly small, sometimes large (where Lua's
/// doubles must stay exact). Periods are 10 s to 60 s (with `wide`, a small quota's can also be
/// milliseconds, seconds or hours), but a large bucket's key can still live only microseconds
/// per permit owed; [`differential`] keeps its clock up with real time.
fn random_rule(rng: &mut Rng, algorithm: Algorithm, name: &str, wide: bool) -> Rule {
    loop {
        let large = rng.below(4) == 0 && algorithm != Algorithm::SlidingLog;
        let limit = if large {
            1 + rng.below(2_000_000_000)
        } else {
            1 + rng.below(12)
        };
        // `wide`: small quotas also over milliseconds, seconds and hours. (A large one's state
        // lives microseconds per permit; Redis drops a key on its own clock, to the
        // millisecond, and the logical clock cannot always keep up with that over a longer
        // period's faster rate.)
        // A log's are never under 10 s: lengthened, a log counts the entries it still holds,
        // and whether Redis still holds them would depend on how fast the machine ran.
        let log = algorithm == Algorithm::SlidingLog;
        let period = match (wide && !large).then(|| rng.below(4)) {
            Some(0) if !log => Duration::from_millis(1 + rng.below(1_000)),
            Some(1) if !log => Duration::from_millis(1_000 + rng.below(9_000)),
            Some(2) => Duration::from_secs(3_600 + rng.below(86_400)),
            _ => Duration::from_millis(10_000 + rng.below(50_000)),
        };
        let burst = matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra).then(|| {
            if large {
                1 + rng.below(limit)
            } else {
                1 + rng.below(12)
            }
        });
        let mut q = Quota::new(limit, period).algorithm(algorithm);
        if let Some(b) = burst {
            q = q.burst(b);
        }
        // The sliding window counter: the default sub-windows, the two-counter version, or any.
        if algorithm == Algorithm::SlidingWindow {
            match rng.below(3) {
                0 => {}
                1 => q = q.sub_windows(1),
                _ => q = q.sub_windows(1 + rng.below(40)),
            }
            if rng.below(2) == 0 {
                q = q.estimate(fleetlimit::WindowEstimate::Bounded);
            }
        }
        // Some large combinations are out of the exact range: draw again.
        if let Ok(q) = q.build() {
            return Rule::new(name, q).unwrap();
        }
    }
}

/// Moves a differential's manual clock from one step to the next: mostly small steps, sometimes
/// across windows, and never less than the real time the step took. Redis counts a key's TTL
/// down in real time, to the millisecond; a clock kept only ahead of the real time since the
/// start stood still through a run of steps without a gap while Redis went on counting, and a
/// state living microseconds per permit was dropped there and not in the memory store.
struct Steps {
    clock: ManualClock,
    last: std::time::Instant,
}

impl Steps {
    fn new(clock: &ManualClock) -> Steps {
        Steps {
            clock: clock.clone(),
            last: std::time::Instant::now(),
        }
    }

    /// The next step; the gap drawn (µs).
    fn next(&mut self, rng: &mut Rng) -> u64 {
        let gap = match rng.below(10) {
            0..=3 => 0,
            4..=7 => rng.below(3_000_000),
            _ => rng.below(70_000_000),
        };
        let now = std::time::Instant::now();
        self.clock
            .advance(Duration::from_micros(gap).max(now - self.last));
        self.last = now;
        gap
    }
}

/// The same random sequence of consumes, peeks, refunds by receipt, leases and give-backs, quota
/// changes and clock moves through the memory store and the Redis store (both on one manual
/// clock) must give identical decisions, field by field (receipts included).
/// `one_slot`: batches of checks share a key (a cluster decides a batch on one slot; the limiter
/// composes slots, see `a_limiter_on_a_cluster_decides_exactly_like_one_on_memory`). `wide`: quotas beyond 10 s to 60 s (see
/// [`random_rule`]), costs beyond the quota, and listings and resets.
async fn differential(
    redis: RedisStore,
    clock: ManualClock,
    seed: u64,
    steps: usize,
    one_slot: bool,
    wide: bool,
) {
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(seed);
    let keys: Vec<Key> = (0..4).map(|i| Key::new(format!("k{i}:{{x}}"))).collect();
    let mut quota_changes = 0;
    let mut refunds = 0;
    let mut steps_clock = Steps::new(&clock);
    for algorithm in Algorithm::ALL {
        let names = [
            format!("{}-0", algorithm.name()),
            format!("{}-1", algorithm.name()),
        ];
        let mut rules: Vec<Rule> = names
            .iter()
            .map(|n| random_rule(&mut rng, algorithm, n, wide))
            .collect();
        // Receipts of admissions and leases: (rule, key, where taken).
        let mut receipts: Vec<(usize, Key, Taken)> = Vec::new();
        for step in 0..steps {
            let gap = steps_clock.next(&mut rng);
            let op = match rng.below(if wide { 18 } else { 14 }) {
                0 => Op::Peek,
                // A rule's quota changes (a deploy, a live change): both stores read the old
                // state under the new quota.
                1 => {
                    let i = step % 2;
                    rules[i] = random_rule(&mut rng, algorithm, &names[i], wide);
                    if std::env::var_os("TRACE").is_some() {
                        eprintln!(
                            "{step} @{} quota {} {:?}",
                            clock.now_us(),
                            names[i],
                            rules[i].quota()
                        );
                    }
                    quota_changes += 1;
                    continue;
                }
                // A refund by receipt, possibly windows or refills later.
                2 | 3 => {
                    if receipts.is_empty() {
                        continue;
                    }
                    let (r, key, taken) =
                        receipts.swap_remove(rng.below(receipts.len() as u64) as usize);
                    let refund = [Refund {
                        rule: &rules[r],
                        key: &key,
                        taken,
                    }];
                    let expected = memory.refund(&refund).await.unwrap();
                    let got = redis.refund(&refund).await.unwrap();
                    if std::env::var_os("TRACE").is_some() {
                        eprintln!(
                            "{step} +{gap} refund {} {key:?} {taken:?} -> {expected:?}",
                            rules[r].name()
                        );
                    }
                    assert_eq!(got, expected, "{algorithm} step {step}: refund");
                    refunds += 1;
                    continue;
                }
                // Leases, for the algorithms that can be leased; their receipts give back.
                12 | 13 if algorithm != Algorithm::SlidingLog => {
                    let r = step % 2;
                    let key = &keys[rng.below(keys.len() as u64) as usize];
                    let check = Check {
                        rule: &rules[r],
                        key,
                        cost: 1 + rng.below(8),
                    };
                    let validity = Duration::from_micros(rng.below(20_000_000));
                    let expected = memory.lease(check, validity).await.unwrap();
                    let got = redis.lease(check, validity).await.unwrap();
                    if std::env::var_os("TRACE").is_some() {
                        eprintln!(
                            "{step} @{} lease {} {key:?} cost {} validity {validity:?} -> {expected:?}",
                            clock.now_us(),
                            rules[r].name(),
                            check.cost
                        );
                    }
                    assert_eq!(got, expected, "{algorithm} step {step}: lease");
                    if expected.permits > 0 {
                        let unspent = 1 + rng.below(expected.permits);
                        receipts.push((r, key.clone(), expected.taken.part(unspent)));
                    }
                    continue;
                }
                // `wide`: a key's listing (it outranks every quota) set, or a penalty block
                // unless listed; read back; a rule's state of a key reset.
                14..=17 if wide => {
                    let key = &keys[rng.below(keys.len() as u64) as usize];
                    // Whole milliseconds and a half: Redis keeps a block to the millisecond,
                    // rounded up, on its own clock.
                    let block = Duration::from_micros(1_000 * rng.below(5_000) + 500);
                    let what = match rng.below(4) {
                        0 => {
                            let listing = match rng.below(9) {
                                0 => Some(Listing::Allow),
                                1 => Some(Listing::Deny),
                                2 | 3 => Some(Listing::Block(block)),
                                // Ends a block, nothing else.
                                4 => Some(Listing::Block(Duration::ZERO)),
                                _ => None,
                            };
                            let expected = memory.set_listing(key, listing).await.unwrap();
                            let got = redis.set_listing(key, listing).await.unwrap();
                            assert_eq!(got, expected, "{algorithm} step {step}: set {listing:?}");
                            format!("listing {listing:?}")
                        }
                        1 => {
                            let expected = memory.block_unless_listed(key, block).await.unwrap();
                            let got = redis.block_unless_listed(key, block).await.unwrap();
                            assert_eq!(got, expected, "{algorithm} step {step}: penalty");
                            format!("penalty {block:?} -> {expected}")
                        }
                        2 => {
                            let rule = &rules[step % 2];
                            memory.reset(rule, key).await.unwrap();
                            redis.reset(rule, key).await.unwrap();
                            format!("reset {}", rule.name())
                        }
                        _ => String::new(),
                    };
                    let expected = memory.listing(key).await.unwrap();
                    let got = redis.listing(key).await.unwrap();
                    if std::env::var_os("TRACE").is_some() {
                        eprintln!("{step} @{} {what} {key:?} -> {expected:?}", clock.now_us());
                    }
                    assert_eq!(got, expected, "{algorithm} step {step}: {what} listing");
                    continue;
                }
                _ => Op::Consume,
            };
            let key = &keys[rng.below(keys.len() as u64) as usize];
            let other = if one_slot {
                key
            } else {
                &keys[rng.below(keys.len() as u64) as usize]
            };
            let r = step % 2;
            let capacity = rules[r]
                .quota()
                .capacity()
                .min(rules[1 - r].quota().capacity());
            let cost = match rng.below(if wide { 14 } else { 10 }) {
                10 => 0,
                11 => capacity + 1,
                12 => capacity.saturating_mul(1 + rng.below(3)),
                13 => [u64::from(u32::MAX), 1 << 53, u64::MAX][rng.below(3) as usize],
                0 => 1 + rng.below(20),
                1..=3 => 1 + rng.below(4),
                4 => 1 + rng.below(capacity),
                _ => 1,
            };
            // Sometimes one rule, sometimes both (all-or-nothing), on different keys.
            let checks: Vec<Check<'_>> = if rng.below(3) == 0 {
                vec![
                    Check {
                        rule: &rules[0],
                        key,
                        cost,
                    },
                    Check {
                        rule: &rules[1],
                        key: other,
                        cost,
                    },
                ]
            } else {
                vec![Check {
                    rule: &rules[r],
                    key,
                    cost,
                }]
            };
            let expected = memory.apply(op, &checks).await.unwrap();
            let got = redis.apply(op, &checks).await.unwrap();
            if std::env::var_os("TRACE").is_some() {
                eprintln!(
                    "{step} +{gap} {op:?} {:?} -> {expected:?}",
                    checks
                        .iter()
                        .map(|c| (
                            c.rule.name(),
                            c.rule.quota().limit(),
                            c.rule.quota().period(),
                            c.key.clone(),
                            c.cost
                        ))
                        .collect::<Vec<_>>()
                );
            }
            assert_eq!(
                got,
                expected,
                "{algorithm} step {step}: {op:?} cost {cost} on {} check(s)",
                checks.len()
            );
            for (c, d) in checks.iter().zip(&expected) {
                if let (true, Some(taken)) = (d.allowed, d.taken()) {
                    let i = if std::ptr::eq(c.rule, &rules[0]) {
                        0
                    } else {
                        1
                    };
                    receipts.push((i, c.key.clone(), taken));
                }
            }
        }
    }
    assert!(
        quota_changes > 20 && refunds > 50,
        "{quota_changes} quota changes, {refunds} refunds"
    );
}

/// A standalone server, and a store on it that reads `clock`.
async fn standalone_on(clock: &ManualClock) -> (RedisServer, RedisStore) {
    let server = RedisServer::start();
    let url = server.url();
    let store = test_store().clock(clock.clone()).connect(&url).await;
    (server, store.unwrap())
}

/// A 3-master cluster, and a store on it that reads `clock`.
async fn cluster_on(clock: &ManualClock) -> (RedisCluster, RedisStore) {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let store = test_store().clock(clock.clone()).cluster(&urls).await;
    (cluster, store.unwrap())
}

#[tokio::test]
async fn redis_decides_exactly_like_memory_on_a_standalone_server() {
    let clock = ManualClock::default();
    let (_server, store) = standalone_on(&clock).await;
    differential(store, clock, 1, 400, false, false).await;
}

#[tokio::test]
async fn redis_decides_exactly_like_memory_on_a_cluster() {
    let clock = ManualClock::default();
    let (_cluster, store) = cluster_on(&clock).await;
    differential(store, clock, 2, 250, true, false).await;
}

/// The same with quotas over milliseconds and hours as well, costs of 0, just over the quota,
/// and huge (`u32::MAX`, 2^53, `u64::MAX`), and listings (allow, deny, blocks, penalties) and
/// resets among the steps.
#[tokio::test]
async fn redis_decides_exactly_like_memory_at_the_edges() {
    let clock = ManualClock::default();
    let (_server, store) = standalone_on(&clock).await;
    differential(store, clock, 2, 1_000, false, true).await;
}

/// A store on a default deadpool-redis pool for `server`.
fn pooled(server: &RedisServer) -> RedisStore {
    let pool = deadpool_redis::Config::from_url(server.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    test_store().pool(pool).unwrap()
}

#[tokio::test]
async fn a_deadpool_pool_works_and_shares_one_connection() {
    let server = RedisServer::start();
    let store = pooled(&server);
    let r = rule(
        "pool",
        Algorithm::SlidingLog,
        3,
        Duration::from_secs(60),
        None,
    );
    let k = Key::new("p");
    let mut allowed = 0;
    for _ in 0..5 {
        if store
            .apply(
                Op::Consume,
                &[Check {
                    rule: &r,
                    key: &k,
                    cost: 1,
                }],
            )
            .await
            .unwrap()[0]
            .allowed
        {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 3);
    // One long-lived connection serves every decision: no checkout (and its PING) per call.
    let clients = server.cmd(&["CLIENT", "LIST"]).unwrap();
    let others = clients
        .as_str()
        .map(|s| s.lines().filter(|l| !l.contains("cmd=client")).count());
    assert_eq!(others, Some(1), "{clients:?}");
}

/// A call still in flight on a pooled connection that has already been replaced (another call
/// was abandoned at its deadline, and the next took a fresh connection) fails late, when its
/// connection is cut: the fresh connection goes on serving. It used to be thrown away too, and
/// the next call waited for a third.
#[tokio::test]
async fn a_late_failure_on_a_replaced_pool_connection_keeps_the_new_one() {
    let server = RedisServer::start();
    let store = pooled(&server);
    let r = Arc::new(rule(
        "late",
        Algorithm::FixedWindow,
        10,
        Duration::from_secs(60),
        None,
    ));
    let k = Key::new("late");
    let consume = |store: RedisStore, r: Arc<Rule>, k: Key| async move {
        let check = [Check {
            rule: &r,
            key: &k,
            cost: 1,
        }];
        store.apply(Op::Consume, &check).await
    };
    consume(store.clone(), r.clone(), k.clone()).await.unwrap();
    // Scripts wait (they may write); reads and new connections go on.
    let paused = server.cmd(&["CLIENT", "PAUSE", "20000", "WRITE"]).unwrap();
    assert_eq!(paused.as_str(), Some("OK"));
    let stuck = tokio::spawn(consume(store.clone(), r.clone(), k.clone()));
    let abandoned = tokio::time::timeout(
        Duration::from_millis(200),
        consume(store.clone(), r.clone(), k.clone()),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the script waits while writes are paused"
    );
    assert_eq!(store.paused_for(&r, &k).await.unwrap(), None);
    let clients = server.cmd(&["CLIENT", "LIST"]).unwrap();
    let clients = clients.as_str().unwrap_or_default().to_owned();
    let old: Vec<&str> = clients
        .lines()
        .filter(|l| l.contains("cmd=evalsha"))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .collect();
    assert_eq!(old.len(), 1, "the abandoned connection: {clients}");
    let connections = |server: &RedisServer| -> u64 {
        let stats = server.info("stats").unwrap();
        support::redis::info_field(&stats, "total_connections_received")
            .and_then(|n| n.parse().ok())
            .unwrap()
    };
    let before = connections(&server);
    server.cmd(&["CLIENT", "KILL", "ID", old[0]]).unwrap();
    let late = tokio::time::timeout(Duration::from_secs(5), stuck)
        .await
        .unwrap()
        .unwrap();
    assert!(
        late.is_err(),
        "the call on the cut connection fails: {late:?}"
    );
    server.cmd(&["CLIENT", "UNPAUSE"]).unwrap();
    assert_eq!(store.paused_for(&r, &k).await.unwrap(), None);
    consume(store.clone(), r.clone(), k.clone()).await.unwrap();
    // `CLIENT KILL`, `CLIENT UNPAUSE` and the `INFO` read by `connections` each opened a
    // connection of their own since `before`.
    assert_eq!(
        connections(&server) - before,
        3,
        "the store made no connection after the late failure"
    );
}

/// Eight independent stores (eight connections, as eight app servers) hammer the same keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_eight_never_exceeds_the_limit() {
    let server = RedisServer::start();
    let mut fleet = Vec::new();
    for _ in 0..8 {
        fleet.push(
            RedisStore::builder()
                .connect_timeout(Duration::from_secs(5))
                .connect(&server.url())
                .await
                .unwrap(),
        );
    }
    const LIMIT: u64 = 200;
    let hour = Duration::from_secs(3600);
    let redis_now = || {
        let t = server.cmd(&["TIME"]).unwrap();
        let a = t.as_array().unwrap();
        a[0].as_int().unwrap() as u64
    };
    for algorithm in Algorithm::ALL {
        let r = Arc::new(rule(
            &format!("fleet-{}", algorithm.name()),
            algorithm,
            LIMIT,
            hour,
            None,
        ));
        let keys: Vec<Key> = (0..3).map(|i| Key::new(format!("hot-{i}"))).collect();
        let admitted: Arc<Vec<AtomicU64>> = Arc::new((0..3).map(|_| AtomicU64::new(0)).collect());
        let started = redis_now();
        let mut tasks = Vec::new();
        for (n, store) in fleet.iter().enumerate() {
            for worker in 0..4 {
                let (store, r, keys, admitted) =
                    (store.clone(), r.clone(), keys.clone(), admitted.clone());
                tasks.push(tokio::spawn(async move {
                    for i in 0..150usize {
                        let k = (i + n + worker) % keys.len();
                        let d = store
                            .apply(
                                Op::Consume,
                                &[Check {
                                    rule: &r,
                                    key: &keys[k],
                                    cost: 1,
                                }],
                            )
                            .await
                            .unwrap();
                        if d[0].allowed {
                            admitted[k].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
        }
        for t in tasks {
            t.await.unwrap();
        }
        let elapsed_s = redis_now() - started + 1;
        let same_window = started / 3600 == (started + elapsed_s) / 3600;
        for a in admitted.iter() {
            let n = a.load(Ordering::Relaxed);
            match algorithm {
                Algorithm::SlidingLog => assert_eq!(n, LIMIT, "{algorithm}: exact"),
                Algorithm::FixedWindow | Algorithm::SlidingWindow if same_window => {
                    assert_eq!(n, LIMIT, "{algorithm}")
                }
                Algorithm::FixedWindow | Algorithm::SlidingWindow => assert!(n <= 2 * LIMIT),
                // burst + rate × t, with t rounded up to whole seconds.
                _ => assert!(
                    n >= LIMIT && n <= LIMIT + (LIMIT * elapsed_s).div_ceil(3600),
                    "{algorithm}: {n}"
                ),
            }
        }
    }
}

fn scan_all(server: &RedisServer, pattern: &str) -> Vec<Vec<u8>> {
    let mut cursor = "0".to_string();
    let mut keys = Vec::new();
    loop {
        let reply = server
            .cmd(&["SCAN", &cursor, "MATCH", pattern, "COUNT", "1000"])
            .unwrap();
        let parts = reply.as_array().unwrap();
        cursor = parts[0].as_str().unwrap().to_string();
        for k in parts[1].as_array().unwrap() {
            keys.push(k.as_bytes().unwrap().to_vec());
        }
        if cursor == "0" {
            return keys;
        }
    }
}

#[tokio::test]
async fn on_a_cluster_keys_spread_over_every_master_and_never_cross_slots() {
    let cluster = RedisCluster::start();
    let store = test_store().cluster(&cluster.urls()).await.unwrap();
    let per_account = rule("account", Algorithm::Gcra, 5, Duration::from_secs(60), None);
    let per_ip = rule(
        "ip",
        Algorithm::SlidingLog,
        3,
        Duration::from_secs(60),
        None,
    );
    let limiter = fleetlimit::Limiter::builder(store.clone())
        .rule(per_account.clone())
        .rule(per_ip.clone())
        .on_store_error(fleetlimit::OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .deny_cache(0)
        .build()
        .unwrap();
    let mut nodes_hit = HashSet::new();
    for i in 0..60 {
        let account = Key::new(format!("acct-{i}"));
        let ip = Key::new(format!("10.0.0.{i}"));
        // Two rules whose keys sit on different slots: no CROSSSLOT, all-or-nothing kept.
        let targets = [("account", &account), ("ip", &ip)];
        for _ in 0..3 {
            let d = limiter.apply_to(Op::Consume, &targets, 1).await.unwrap();
            assert!(d.iter().all(|d| d.allowed && !d.degraded));
        }
        let d = limiter.apply_to(Op::Consume, &targets, 1).await.unwrap();
        assert!(d[0].allowed && !d[1].allowed, "the per-IP rule denies");
        assert_eq!(d[0].remaining, 2, "and the account rule keeps its permit");
        // Both rules of one key share its slot: one atomic call.
        let both = store
            .apply(
                Op::Peek,
                &[
                    Check {
                        rule: &per_account,
                        key: &account,
                        cost: 1,
                    },
                    Check {
                        rule: &per_ip,
                        key: &account,
                        cost: 1,
                    },
                ],
            )
            .await
            .unwrap();
        assert_eq!(both.len(), 2);
        let key = store.key_for(&per_account, &account);
        let server_slot = cluster.keyslot(&key);
        assert_eq!(
            fleetlimit::store::redis::slot(&key),
            server_slot,
            "our slot function agrees"
        );
        nodes_hit.insert(cluster.node_for_slot(server_slot));
    }
    assert_eq!(nodes_hit.len(), 3, "keys on every master");
    for node in cluster.nodes() {
        let n = node.cmd(&["DBSIZE"]).unwrap().as_int().unwrap();
        assert!(n > 0, "every master holds state");
    }
    // The account rule was given back through its receipt after every cross-slot denial: 3
    // taken, 2 left.
    let peek = store
        .apply(
            Op::Peek,
            &[Check {
                rule: &per_account,
                key: &Key::new("acct-0"),
                cost: 1,
            }],
        )
        .await
        .unwrap();
    assert_eq!(peek[0].remaining, 2);
}

#[tokio::test]
async fn hostile_keys_never_collide_or_break_the_hash_tag() {
    let cluster = RedisCluster::start();
    // A clock that stands still: on Redis's own clock a minute's end could expire keys
    // before they are counted.
    let store = test_store()
        .clock(ManualClock::default())
        .cluster(&cluster.urls())
        .await
        .unwrap();
    let period = Duration::from_secs(60);
    let hostile: Vec<(Rule, Key)> = vec![
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new("b:c"),
        ),
        (
            rule("a:b", Algorithm::FixedWindow, 1, period, None),
            Key::new("c"),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new("}{b"),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new("{b}"),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new("%7Bb%7D"),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new(vec![b'x'; 10_000]),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new([vec![b'x'; 9_999], vec![b'y']].concat()),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new([0xff, 0xfe, 0x00, b'{']),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new([0xff, 0xfe, 0x00, b'}']),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::from("10.0.0.1".parse::<std::net::IpAddr>().unwrap()),
        ),
        (
            rule("a", Algorithm::FixedWindow, 1, period, None),
            Key::new("10.0.0.1"),
        ),
    ];
    for (r, k) in &hostile {
        let d = store
            .apply(
                Op::Consume,
                &[Check {
                    rule: r,
                    key: k,
                    cost: 1,
                }],
            )
            .await
            .unwrap();
        assert!(d[0].allowed, "each pair has its own fresh bucket: {k:?}");
        let redis_key = store.key_for(r, k);
        assert!(redis_key.len() < 200, "long keys are hashed");
        // The server computes the same slot from the same single hash tag.
        assert_eq!(
            cluster.keyslot(&redis_key),
            fleetlimit::store::redis::slot(&redis_key)
        );
        let tag_open = redis_key.iter().filter(|&&b| b == b'{').count();
        let tag_close = redis_key.iter().filter(|&&b| b == b'}').count();
        assert_eq!((tag_open, tag_close), (1, 1), "exactly one hash tag");
    }
    let mut stored = 0;
    for node in cluster.nodes() {
        stored += node.cmd(&["DBSIZE"]).unwrap().as_int().unwrap();
    }
    assert_eq!(
        stored as usize,
        hostile.len(),
        "no two pairs share a Redis key"
    );
}

/// A pause is the rule's, whatever its algorithm, on both stores alike: a rule reconfigured to
/// another algorithm (by a rolling deploy, or a second limiter giving the name another quota)
/// still waits out the pause a destination asked for.
#[tokio::test]
async fn a_pause_belongs_to_the_rule_name_on_both_stores() {
    let server = RedisServer::start();
    let redis = test_store().connect(&server.url()).await.unwrap();
    let memory = MemoryStore::new();
    let stores: [(&str, &dyn Store); 2] = [("memory", &memory), ("redis", &redis)];
    let before = rule(
        "partner",
        Algorithm::FixedWindow,
        10,
        Duration::from_secs(1),
        None,
    );
    let after = rule(
        "partner",
        Algorithm::Gcra,
        10,
        Duration::from_secs(1),
        Some(1),
    );
    let other = rule(
        "other",
        Algorithm::FixedWindow,
        10,
        Duration::from_secs(1),
        None,
    );
    let key = Key::new("api.partner.example");
    for (name, store) in stores {
        store
            .pause(&before, &key, Duration::from_secs(60))
            .await
            .unwrap();
        let paused = store.paused_for(&after, &key).await.unwrap();
        assert!(
            paused.is_some_and(|p| p > Duration::from_secs(59)),
            "{name}: {paused:?}"
        );
        assert_eq!(
            store.paused_for(&other, &key).await.unwrap(),
            None,
            "{name}"
        );
        // A pause that only grows meets the same pause.
        store
            .extend_pause(&after, &key, Duration::from_secs(1))
            .await
            .unwrap();
        let paused = store.paused_for(&before, &key).await.unwrap();
        assert!(
            paused.is_some_and(|p| p > Duration::from_secs(59)),
            "{name}: cut to {paused:?}"
        );
    }
}

fn pttl(server: &RedisServer, key: &[u8]) -> i64 {
    server.cmd_bytes(&[b"PTTL", key]).unwrap().as_int().unwrap()
}

#[tokio::test]
async fn every_key_has_a_ttl_no_longer_than_its_state_matters() {
    let server = RedisServer::start();
    let clock = ManualClock::new(1_735_689_600_000_000 + 3_500_000); // 3.5 s into a 10 s window
    let store = test_store()
        .clock(clock.clone())
        .prefix("hygiene:")
        .connect(&server.url())
        .await
        .unwrap();
    let p = Duration::from_secs(10);
    let rules = [
        (rule("fw", Algorithm::FixedWindow, 5, p, None), 6_500),
        (rule("sl", Algorithm::SlidingLog, 5, p, None), 10_000),
        // The current sub-window (500 ms) slides out a period and a width after its start.
        (rule("sw", Algorithm::SlidingWindow, 5, p, None), 10_500),
        (rule("tb", Algorithm::TokenBucket, 5, p, Some(5)), 2_000 * 3),
        (rule("gc", Algorithm::Gcra, 5, p, Some(5)), 2_000 * 3),
    ];
    // A load over many keys, user-0's first: its TTLs are read at once, before real time
    // (which Redis counts them down in) has moved on much.
    let mut receipts = Vec::new();
    for i in 0..200 {
        let k = Key::new(format!("user-{i}"));
        for (r, _) in &rules {
            for _ in 0..3 {
                let d = store
                    .apply(
                        Op::Consume,
                        &[Check {
                            rule: r,
                            key: &k,
                            cost: 1,
                        }],
                    )
                    .await
                    .unwrap();
                if i == 0 {
                    receipts.push(d[0].taken().unwrap());
                }
            }
        }
        if i == 0 {
            // Each TTL is when the state stops mattering (allowing the real time this took, on
            // a debug build and a busy machine).
            for (r, expected_ms) in &rules {
                let ttl = pttl(&server, &store.key_for(r, &k));
                assert!(
                    ttl <= *expected_ms && ttl > expected_ms - 2_000,
                    "{}: {ttl} ms, expected {expected_ms}",
                    r.name()
                );
            }
            // Giving everything back leaves nothing that matters: the key is gone at once.
            for (j, (r, _)) in rules.iter().enumerate() {
                let key = store.key_for(r, &k);
                let exists = || server.cmd_bytes(&[b"EXISTS", &key]).unwrap().as_int();
                assert_eq!(exists(), Some(1), "{} is there before", r.name());
                let refunds: Vec<Refund<'_>> = receipts[3 * j..3 * j + 3]
                    .iter()
                    .map(|&taken| Refund {
                        rule: r,
                        key: &k,
                        taken,
                    })
                    .collect();
                store.refund(&refunds).await.unwrap();
                assert_eq!(exists(), Some(0), "{} kept an empty state", r.name());
            }
        }
    }
    // Every other user's keys, and user-0's marks of the refunds received (so that one sent
    // twice gives back once), each with a TTL.
    let keys = scan_all(&server, "hygiene:*");
    let marks = keys
        .iter()
        .filter(|k| k.starts_with(b"hygiene:{kuser-0}:"))
        .count();
    assert_eq!(marks, rules.len(), "one refund mark per rule");
    assert_eq!(keys.len(), 199 * rules.len() + marks);
    for key in &keys {
        // -1: no TTL (-2, gone since the scan, is a TTL that ended).
        let ttl = pttl(&server, key);
        assert!(
            ttl != -1,
            "{} has no TTL ({ttl})",
            String::from_utf8_lossy(key)
        );
    }
    // Denied and peeked keys leave nothing behind.
    let fresh = Key::new("never-admitted");
    for (r, _) in &rules {
        store
            .apply(
                Op::Peek,
                &[Check {
                    rule: r,
                    key: &fresh,
                    cost: 1,
                }],
            )
            .await
            .unwrap();
        store
            .apply(
                Op::Consume,
                &[Check {
                    rule: r,
                    key: &fresh,
                    cost: 99,
                }],
            )
            .await
            .unwrap();
    }
    assert!(scan_all(&server, "hygiene:*never*").is_empty());
}

#[tokio::test]
async fn skewed_app_clocks_do_not_matter_because_redis_keeps_time() {
    let server = RedisServer::start();
    let connect = |clock: Option<ManualClock>| {
        let url = server.url();
        async move {
            let mut b = RedisStore::builder().connect_timeout(Duration::from_secs(2));
            if let Some(c) = clock {
                b = b.clock(c);
            }
            b.connect(&url).await.unwrap()
        }
    };
    let r = rule(
        "skew",
        Algorithm::Gcra,
        10,
        Duration::from_secs(3600),
        Some(10),
    );
    let consume_until_denied = |a: RedisStore, b: RedisStore, key: Key| {
        let r = r.clone();
        async move {
            let mut admitted = 0;
            for i in 0..40 {
                let store = if i % 2 == 0 { &a } else { &b };
                let d: Vec<Decision> = store
                    .apply(
                        Op::Consume,
                        &[Check {
                            rule: &r,
                            key: &key,
                            cost: 1,
                        }],
                    )
                    .await
                    .unwrap();
                admitted += u64::from(d[0].allowed);
            }
            admitted
        }
    };
    // Two app servers deciding on the default clock: one limit, and the scripts read Redis's
    // TIME for every decision (an app clock would never call it: this fails if the default
    // stopped using Redis's clock, even on one machine whose clocks agree).
    let time_calls = || {
        let info = server.info("commandstats").unwrap();
        support::redis::info_field(&info, "cmdstat_time")
            .and_then(|v| {
                v.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
    };
    let before = time_calls();
    let (a, b) = (connect(None).await, connect(None).await);
    assert_eq!(consume_until_denied(a, b, Key::new("shared")).await, 10);
    assert!(time_calls() >= before + 40, "every decision read TIME");

    // The same two, deciding on their own skewed clocks instead: the late one sees the bucket
    // refilled, and the pair admits far more than the limit. This is why TIME is the default.
    let now = 1_900_000_000_000_000;
    let (a, b) = (
        connect(Some(ManualClock::new(now))).await,
        connect(Some(ManualClock::new(now + 3_600_000_000))).await,
    );
    assert!(consume_until_denied(a, b, Key::new("skewed")).await > 10);
}

/// Configuration errors against a live server that would otherwise accept the connection.
#[tokio::test]
async fn bad_configuration_is_an_error_not_a_panic() {
    let server = RedisServer::start();
    let invalid = |r: Result<RedisStore, fleetlimit::Error>, setting: &str| match r {
        Err(fleetlimit::Error::Config(fleetlimit::ConfigError::Invalid { setting: s, .. })) => {
            assert_eq!(s, setting)
        }
        other => panic!("expected an invalid {setting}, got {other:?}"),
    };
    assert!(
        test_store().connect(&server.url()).await.is_ok(),
        "the server is fine"
    );
    invalid(
        RedisStore::builder()
            .prefix("a{b")
            .connect(&server.url())
            .await,
        "prefix",
    );
    invalid(
        RedisStore::builder()
            .connect_timeout(Duration::ZERO)
            .connect(&server.url())
            .await,
        "connect_timeout",
    );
    invalid(RedisStore::connect("not a url").await, "url");
}

/// A server that is not there yet is not an error: the store is built at once, its calls fail
/// fast (so the limiter's policy decides), and it connects when Redis appears.
#[tokio::test]
async fn a_store_builds_while_redis_is_away_and_connects_when_it_comes() {
    let mut server = RedisServer::start();
    let url = server.url();
    server.kill();
    let started = std::time::Instant::now();
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_millis(300))
        .connect(&url)
        .await
        .expect("built while Redis is away");
    assert!(started.elapsed() < Duration::from_secs(2));
    let r = rule(
        "late",
        Algorithm::FixedWindow,
        2,
        Duration::from_secs(60),
        None,
    );
    let k = Key::new("k");
    let check = [Check {
        rule: &r,
        key: &k,
        cost: 1,
    }];
    assert!(store.apply(Op::Consume, &check).await.is_err());
    server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match store.apply(Op::Consume, &check).await {
            Ok(d) => {
                assert!(d[0].allowed && d[0].remaining == 1);
                break;
            }
            Err(e) => assert!(std::time::Instant::now() < deadline, "never connected: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = RespValue::Int(0);
}

#[tokio::test]
async fn a_lost_script_is_loaded_again() {
    let server = RedisServer::start();
    let store = test_store()
        .clock(ManualClock::default())
        .connect(&server.url())
        .await
        .unwrap();
    let r = rule(
        "reload",
        Algorithm::FixedWindow,
        2,
        Duration::from_secs(3600),
        None,
    );
    let k = Key::new("k");
    let check = [Check {
        rule: &r,
        key: &k,
        cost: 1,
    }];
    assert!(store.apply(Op::Consume, &check).await.unwrap()[0].allowed);
    server.cmd(&["SCRIPT", "FLUSH"]).unwrap();
    // NOSCRIPT is answered by loading the script again; the state in Redis is intact.
    assert_eq!(
        store.apply(Op::Consume, &check).await.unwrap()[0].remaining,
        0
    );
    assert!(!store.apply(Op::Consume, &check).await.unwrap()[0].allowed);
}

/// A client that lost its connection mid-call cannot know whether the call ran, and redis-rs's
/// cluster client sends it again. A refund sent twice must give back once, on every algorithm.
#[tokio::test]
async fn a_refund_sent_twice_gives_back_once() {
    let server = RedisServer::start();
    // Time stands still, so a refund gives back the whole permit on every algorithm.
    let store = test_store()
        .clock(ManualClock::new(1_735_689_600_000_000))
        .connect(&server.url())
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    let k = Key::new("resent");
    for (name, algorithm, burst) in [
        ("fw", Algorithm::FixedWindow, None),
        ("sl", Algorithm::SlidingLog, None),
        ("sw", Algorithm::SlidingWindow, None),
        ("tb", Algorithm::TokenBucket, Some(3)),
        ("gc", Algorithm::Gcra, Some(3)),
    ] {
        let r = rule(name, algorithm, 3, hour, burst);
        let consume = || async {
            store
                .apply(
                    Op::Consume,
                    &[Check {
                        rule: &r,
                        key: &k,
                        cost: 1,
                    }],
                )
                .await
                .unwrap()[0]
        };
        let mut receipts = Vec::new();
        for _ in 0..3 {
            receipts.push(consume().await.taken().unwrap());
        }
        assert!(!consume().await.allowed, "{name}: the limit is 3");

        let refund = Refund {
            rule: &r,
            key: &k,
            taken: receipts[0],
        };
        let (keys, args) = store.refund_script_call(&refund, "00000000000000ff");
        let script = RedisStore::script();
        let numkeys = keys.len().to_string();
        let mut command: Vec<&[u8]> = vec![b"EVAL", script.as_bytes(), numkeys.as_bytes()];
        command.extend(keys.iter().map(Vec::as_slice));
        command.extend(args.iter().map(String::as_bytes));
        let first = server.cmd_bytes(&command).unwrap();
        let second = server.cmd_bytes(&command).unwrap();
        assert!(
            matches!(first, RespValue::Array(Some(_))),
            "{name}: {first:?}"
        );
        assert_eq!(
            first, second,
            "{name}: the resend answers as the first send"
        );
        let ttl = pttl(&server, &keys[1]);
        assert!(ttl > 0 && ttl <= 10_000, "{name}: once key TTL {ttl} ms");

        // One permit came back, not two.
        assert!(consume().await.allowed, "{name}: the refund gave one back");
        assert!(!consume().await.allowed, "{name}: the resend gave nothing");

        // A refund through the store draws its own token: it still gives back.
        store
            .refund(&[Refund {
                rule: &r,
                key: &k,
                taken: receipts[1],
            }])
            .await
            .unwrap();
        assert!(consume().await.allowed, "{name}: a second receipt refunds");
    }
}

/// A sliding window counter key written in the two-counter layout of earlier builds (previous
/// and current window counts) is read and converted: every permit it still counts stays counted.
#[tokio::test]
async fn a_two_counter_state_from_an_earlier_build_keeps_its_permits() {
    let server = RedisServer::start();
    let start = 1_735_689_600_000_000u64; // a window start for 10 s
    let clock = ManualClock::new(start + 2_000_000);
    let store = test_store()
        .clock(clock.clone())
        .connect(&server.url())
        .await
        .unwrap();
    let r = rule(
        "old",
        Algorithm::SlidingWindow,
        5,
        Duration::from_secs(10),
        None,
    );
    let key = Key::new("tenant");
    let state = store.key_for(&r, &key);
    // 4 permits this window, 1 in the previous one.
    let (s, w) = (start.to_string(), 10_000_000u64.to_string());
    let fields: [&[u8]; 12] = [
        b"HSET",
        &state,
        b"s",
        s.as_bytes(),
        b"p",
        b"1",
        b"c",
        b"4",
        b"w",
        w.as_bytes(),
        b"v",
        s.as_bytes(),
    ];
    server.cmd_bytes(&fields).unwrap();
    let check = [Check {
        rule: &r,
        key: &key,
        cost: 1,
    }];
    let d = store.apply(Op::Consume, &check).await.unwrap();
    assert!(!d[0].allowed, "5 still counted: {d:?}");
    // Once both windows have passed, the key is fresh again, in the new layout.
    clock.advance(Duration::from_secs(20));
    let d = store.apply(Op::Consume, &check).await.unwrap();
    assert!(d[0].allowed, "{d:?}");
    let old_fields = server.cmd_bytes(&[b"HEXISTS", &state, b"c"]).unwrap();
    assert_eq!(old_fields.as_int(), Some(0), "the old fields are gone");
}

/// The clock steps back (an NTP step on the Redis host, a failover to a replica behind, or
/// instances on the app clock whose clocks differ) before a refund: the scripts measure the
/// debt paid back from the state's latest time, so a refund gives back nothing the bucket had
/// already let go, and the token bucket's wait is counted from the earlier clock.
#[tokio::test]
async fn a_refund_after_the_clock_stepped_back_creates_nothing() {
    let server = RedisServer::start();
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let start = 1_735_689_600_000_000u64;
        let clock = ManualClock::new(start);
        let store = test_store()
            .clock(clock.clone())
            .connect(&server.url())
            .await
            .unwrap();
        let r = rule("stepped", algorithm, 10, Duration::from_secs(60), Some(10));
        let key = Key::new(format!("{algorithm}"));
        let check = [Check {
            rule: &r,
            key: &key,
            cost: 10,
        }];
        let first = store.apply(Op::Consume, &check).await.unwrap()[0];
        let taken = first.taken().unwrap();
        clock.advance(Duration::from_secs(60));
        assert!(store.apply(Op::Consume, &check).await.unwrap()[0].allowed);
        clock.set(start + 30_000_000);
        let refund = [Refund {
            rule: &r,
            key: &key,
            taken,
        }];
        store.refund(&refund).await.unwrap();
        let one = [Check {
            cost: 1,
            ..check[0]
        }];
        let d = store.apply(Op::Consume, &one).await.unwrap()[0];
        assert!(!d.allowed, "{algorithm}: {d:?}");
        if algorithm == Algorithm::TokenBucket {
            assert_eq!(
                d.retry_after,
                Some(Duration::from_secs(36)),
                "6 s after the latest"
            );
        }
        clock.set(start + 60_000_000);
        let d = store.apply(Op::Consume, &one).await.unwrap()[0];
        assert!(
            !d.allowed,
            "{algorithm}: the first ten were paid back already: {d:?}"
        );
    }
}

/// A request over two cluster slots whose second master hangs: the first slot's permits are
/// given back (after the deadline, in the background), and its breaker is not charged for the
/// other master's failure, however many such requests time out at once.
#[tokio::test]
async fn a_hung_master_neither_keeps_nor_trips_another_slots_permits() {
    let cluster = RedisCluster::start();
    // A clock that stands still: on Redis's own clock a run across a minute boundary starts a
    // fresh window, and the count of permits given back cannot be read from `remaining`; and
    // an open breaker does not cool down before it is counted.
    let clock = ManualClock::new(1_735_689_600_000_000);
    let store = test_store()
        .clock(clock.clone())
        .cluster(&cluster.urls())
        .await
        .unwrap();
    let per_account = rule(
        "account",
        Algorithm::FixedWindow,
        100,
        Duration::from_secs(60),
        None,
    );
    let per_ip = rule(
        "ip",
        Algorithm::FixedWindow,
        100,
        Duration::from_secs(60),
        None,
    );
    let node_of = |r: &Rule, k: &Key| cluster.node_for_slot(cluster.keyslot(&store.key_for(r, k)));
    let account = Key::new("acct-hung-test");
    let ip = (0..1000)
        .map(|i| Key::new(format!("10.1.0.{i}")))
        .find(|ip| node_of(&per_ip, ip) != node_of(&per_account, &account))
        .unwrap();
    let limiter = fleetlimit::Limiter::builder(store.clone())
        .rule(per_account.clone())
        .rule(per_ip.clone())
        .on_store_error(fleetlimit::OnStoreError::fail_closed())
        .deadline(Duration::from_millis(300))
        .deny_cache(0)
        .clock(clock)
        .build()
        .unwrap();
    let targets = [("account", &account), ("ip", &ip)];
    // Both slots' connections are up.
    let d = limiter.apply_to(Op::Consume, &targets, 1).await.unwrap();
    assert!(d.iter().all(|d| d.allowed && !d.degraded));
    let hung = &cluster.nodes()[node_of(&per_ip, &ip)];
    hung.pause();
    let requests: Vec<_> = (0..10)
        .map(|_| {
            let (limiter, account, ip) = (limiter.clone(), account.clone(), ip.clone());
            tokio::spawn(async move {
                let targets = [("account", &account), ("ip", &ip)];
                limiter.apply_to(Op::Consume, &targets, 1).await.unwrap()
            })
        })
        .collect();
    for r in requests {
        assert!(r.await.unwrap().iter().all(|d| d.degraded));
    }
    assert_eq!(
        limiter.stats().open_breakers,
        1,
        "only the hung master's breaker opens"
    );
    let left = || async {
        let peek = store
            .apply(
                Op::Peek,
                &[Check {
                    rule: &per_account,
                    key: &account,
                    cost: 1,
                }],
            )
            .await
            .unwrap();
        peek[0].remaining
    };
    for _ in 0..100 {
        if left().await == 99 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        left().await,
        99,
        "every timed-out request's account permit is back"
    );
    hung.resume();
}

/// A cluster with one master hung (stopped, its connections open) and another killed: the
/// store reconnects to learn the slot map again, which takes longer than a decision's deadline
/// with a hung node, and goes on in the background: keys on the healthy master are decided by
/// the store again within seconds, at the default deadline.
#[tokio::test]
async fn a_reconnect_through_a_hung_master_goes_on_in_the_background() {
    let mut cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_millis(500))
        .cluster(&cluster.urls())
        .await
        .unwrap();
    let rule = rule("api", Algorithm::Gcra, 1000, Duration::from_secs(1), None);
    let on = |node: usize| {
        (0..1000)
            .map(|i| Key::new(format!("key-{i}")))
            .find(|k| cluster.node_for_slot(cluster.keyslot(&store.key_for(&rule, k))) == node)
            .unwrap()
    };
    let (hung, dead, healthy) = (0, 1, 2);
    let (on_dead, on_healthy) = (on(dead), on(healthy));
    let limiter = fleetlimit::Limiter::builder(store)
        .rule(rule)
        .on_store_error(fleetlimit::OnStoreError::FailOpen)
        .build()
        .unwrap();
    assert!(!limiter.consume(&on_healthy, 1).await.unwrap().degraded);
    cluster.nodes()[hung].pause();
    cluster.kill_node(dead);
    // The dead master's connection error makes the store connect again.
    for _ in 0..5 {
        limiter.consume(&on_dead, 1).await.unwrap();
    }
    let started = std::time::Instant::now();
    let mut decided_by_store = false;
    while started.elapsed() < Duration::from_secs(20) {
        if !limiter.consume(&on_healthy, 1).await.unwrap().degraded {
            decided_by_store = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.nodes()[hung].resume();
    assert!(
        decided_by_store,
        "a key on the healthy master still follows the outage policy after {:?}",
        started.elapsed()
    );
}

/// A limiter of `rule` on `store` with a deadline a loaded machine cannot miss: what is under
/// test is not the deadline.
fn patient(store: &RedisStore, rule: &Rule, policy: OnStoreError) -> Limiter {
    Limiter::builder(store.clone())
        .rule(rule.clone())
        .on_store_error(policy)
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap()
}

/// A cluster, a store on it, and a patient limiter failing closed with a rule of 10 a minute.
async fn cluster_limiter() -> (RedisCluster, RedisStore, Rule, Limiter) {
    let cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .cluster(&cluster.urls())
        .await
        .unwrap();
    let rule = Rule::new("moved", Quota::per_minute(10).build().unwrap()).unwrap();
    let limiter = patient(&store, &rule, OnStoreError::fail_closed());
    (cluster, store, rule, limiter)
}

/// Every node of `cluster` told that `to` serves `slot`.
fn give_slot(cluster: &RedisCluster, slot: u16, to: usize) {
    let to_id = cluster.nodes()[to].cmd(&["CLUSTER", "MYID"]).unwrap();
    let to_id = to_id.as_str().unwrap().to_owned();
    for node in cluster.nodes() {
        let reply = node
            .cmd(&["CLUSTER", "SETSLOT", &slot.to_string(), "NODE", &to_id])
            .unwrap();
        assert!(reply.as_error().is_none(), "{reply:?}");
    }
}

/// One slot moved by hand, step by step, under a key with a state, a pause and a concurrency
/// slot: the plain commands and small scripts follow ASK while the slot migrates and MOVED once
/// it has (they answered the redirection as an error, and fail-closed callers were refused);
/// decisions are made on Redis in every phase, though the key's listing key (which does not
/// exist, so never moves) makes Redis answer TRYAGAIN to a call with both until the end.
#[tokio::test]
async fn pauses_and_slots_follow_a_slot_moved_by_hand() {
    use fleetlimit::concurrency::{Acquired, ConcurrencyLimiter};
    // Long deadlines: the redirections are under test, not the deadline, and a phase takes a
    // few round trips that a loaded machine could stretch past the 50 ms default.
    let (cluster, store, rule, limiter) = cluster_limiter().await;
    let slots = ConcurrencyLimiter::builder(store.clone(), "in-flight", 5)
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let key = Key::new("mover");
    let slot = fleetlimit::store::redis::slot(&store.key_for(&rule, &key));
    let from = cluster.node_for_slot(slot);
    let to = (from + 1) % cluster.nodes().len();
    // The store learns the slot map with a first call, and the key has a state.
    limiter.pause(&key, Duration::from_millis(1)).await.unwrap();
    let decided = |phase: &'static str| {
        let limiter = limiter.clone();
        let key = key.clone();
        async move {
            let d = limiter.consume(&key, 1).await.unwrap();
            assert!(d.allowed && !d.degraded, "{phase}: {d:?}");
        }
    };
    decided("before").await;
    // A refund while the slot moves: its once key never exists before it, so never moves.
    let refunded = |phase: &'static str| {
        let (limiter, key) = (limiter.clone(), key.clone());
        async move {
            let (d, receipt) = limiter.consume_with_receipt(&key, 1).await.unwrap();
            assert!(d.allowed && !d.degraded, "{phase}: {d:?}");
            let left = limiter.peek(&key).await.unwrap().remaining;
            let back = limiter.refund(receipt.unwrap()).await;
            assert!(back.is_ok(), "{phase}: the refund failed: {back:?}");
            let now = limiter.peek(&key).await.unwrap().remaining;
            assert_eq!(now, left + 1, "{phase}: the permit is back");
        }
    };
    // A deny-listed key on the same slot, under a limiter failing open: while the slot moves its
    // listing is still read (or, when Redis cannot run the call, remembered), never dropped.
    let open = patient(&store, &rule, OnStoreError::FailOpen);
    let denied = (0..100_000)
        .map(|i| Key::new(format!("denied-{i}")))
        .find(|k| fleetlimit::store::redis::slot(&store.key_for(&rule, k)) == slot)
        .unwrap();
    open.deny(&denied).await.unwrap();
    let still_denied = |phase: &'static str| {
        let (open, denied) = (open.clone(), denied.clone());
        async move {
            let d = open.consume(&denied, 1).await.unwrap();
            assert!(!d.allowed, "{phase}: a deny-listed key admitted: {d:?}");
        }
    };
    let node = |i: usize| &cluster.nodes()[i];
    let id = |i: usize| {
        let reply = node(i).cmd(&["CLUSTER", "MYID"]).unwrap();
        reply.as_str().unwrap().to_owned()
    };
    let s = slot.to_string();
    let ok = |reply: Result<RespValue, String>| {
        let reply = reply.unwrap();
        assert!(reply.as_error().is_none(), "{reply:?}");
    };
    ok(node(to).cmd(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &id(from)]));
    ok(node(from).cmd(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &id(to)]));
    decided("migrating, the state still on the source").await;
    still_denied("migrating").await;
    refunded("migrating").await;
    // A pause set and read, and a concurrency slot held: plain commands and a small script.
    let paused_and_held = |phase: &'static str| {
        let (limiter, slots, key) = (limiter.clone(), slots.clone(), key.clone());
        async move {
            limiter.pause(&key, Duration::from_secs(60)).await.unwrap();
            assert!(limiter.paused_for(&key).await.is_some(), "{phase}");
            let held = slots.acquire(&key).await;
            assert!(matches!(held, Acquired::Held(_)), "{phase}: {held:?}");
            held
        }
    };
    // Migrating: keys not on the source any more (none of these yet) are asked of the target.
    let held = paused_and_held("migrating").await;
    // The rest of the slot's keys move, and every node is told the slot's new owner.
    let keys = node(from)
        .cmd(&["CLUSTER", "GETKEYSINSLOT", &s, "1000"])
        .unwrap();
    let keys: Vec<String> = keys
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_owned())
        .collect();
    if !keys.is_empty() {
        let port = node(to).port().to_string();
        let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        migrate.extend(keys.iter().map(String::as_str));
        ok(node(from).cmd(&migrate));
    }
    decided("migrating, the state moved").await;
    still_denied("migrating, the keys moved").await;
    refunded("migrating, the keys moved").await;
    give_slot(&cluster, slot, to);
    // Moved: the store still names the old owner, and follows.
    decided("moved").await;
    still_denied("moved").await;
    let second = paused_and_held("moved").await;
    drop((held, second));
    // The old master hangs: its breaker opens on its own keys, and the moved slot, learnt from
    // the MOVED answers, is the new master's, so its key still decides on Redis. (The master
    // map was read only at connect: the slot stayed on the old master's breaker, and was left
    // to the policy.)
    let quick = Limiter::builder(store.clone())
        .rule(rule.clone())
        .on_store_error(OnStoreError::FailOpen)
        .deadline(Duration::from_millis(200))
        .build()
        .unwrap();
    assert!(!quick.consume(&key, 1).await.unwrap().degraded);
    let on_old: Vec<Key> = (0..10_000)
        .map(|i| Key::new(format!("old-{i}")))
        .filter(|k| {
            cluster.node_for_slot(fleetlimit::store::redis::slot(&store.key_for(&rule, k))) == from
        })
        .take(5)
        .collect();
    node(from).pause();
    for k in &on_old {
        assert!(quick.consume(k, 1).await.unwrap().degraded);
    }
    let d = quick.consume(&key, 1).await.unwrap();
    node(from).resume();
    assert!(
        !d.degraded,
        "the moved slot followed its old master's breaker: {d:?}"
    );
}

/// A plain command (a pause) is the first call to meet a slot moved away: it follows the
/// MOVED, and the store keeps its cluster connection (redis-rs relearns its slot map from the
/// MOVED itself). It dropped the connection, and every call waited for a whole new one.
#[tokio::test]
async fn a_plain_command_meeting_a_moved_slot_keeps_the_connection() {
    let (cluster, store, rule, limiter) = cluster_limiter().await;
    let key = Key::new("moves");
    let slot = fleetlimit::store::redis::slot(&store.key_for(&rule, &key));
    let from = cluster.node_for_slot(slot);
    let (to, third) = ((from + 1) % 3, (from + 2) % 3);
    let node = |i: usize| &cluster.nodes()[i];
    // The store's connections to a node that takes no part in the move, by client id.
    let store_clients = || {
        let list = node(third).cmd(&["CLIENT", "LIST"]).unwrap();
        let mut ids: Vec<String> = list
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| !l.contains("cmd=client|list"))
            .filter_map(|l| l.split(' ').next().map(str::to_owned))
            .collect();
        ids.sort();
        ids
    };
    assert!(!limiter.consume(&key, 1).await.unwrap().degraded);
    // The key's state goes, and the empty slot is given to another master on every node.
    limiter.reset(&key).await.unwrap();
    let before = store_clients();
    assert!(!before.is_empty());
    give_slot(&cluster, slot, to);
    limiter.pause(&key, Duration::from_secs(60)).await.unwrap();
    assert!(limiter.paused_for(&key).await.is_some());
    assert!(!limiter.consume(&key, 1).await.unwrap().degraded);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(store_clients(), before, "the store connected again");
}

/// A limiter of two rules (per account AND per address) on a cluster, whose keys sit on
/// different slots and masters (the limiter composes the slot groups: peeks, then takes), and
/// the same limiter on the memory store (one atomic call), on one manual clock: the same random
/// requests, receipts refunded, quota changes, per-key overrides, listings, resets and
/// inspections give identical answers, each with a penalty box blocking keys refused again and
/// again. (The denial cache is off: it answers a refusal from memory on purpose.)
#[tokio::test]
async fn a_limiter_on_a_cluster_decides_exactly_like_one_on_memory() {
    let clock = ManualClock::default();
    let (_cluster, redis) = cluster_on(&clock).await;
    limiter_differential(redis, clock, 11, true).await;
}

/// The same on a standalone server, where every request is one call.
#[tokio::test]
async fn a_limiter_on_a_standalone_server_decides_exactly_like_one_on_memory() {
    let clock = ManualClock::default();
    let (_server, redis) = standalone_on(&clock).await;
    limiter_differential(redis, clock, 12, false).await;
}

/// The limiter [`limiter_differential`] compares, on `store`: a penalty box, and the denial
/// cache off (it answers a refusal from memory on purpose).
fn compared_limiter<S: Store>(
    store: S,
    rules: &[Rule],
    clock: &ManualClock,
) -> fleetlimit::LimiterBuilder<S> {
    let penalty =
        fleetlimit::Penalty::new(3, Duration::from_secs(10), Duration::from_millis(2_500));
    Limiter::builder(store)
        .rule(rules[0].clone())
        .rule(rules[1].clone())
        .deny_cache(0)
        .penalty(penalty)
        .deadline(Duration::from_secs(30))
        .clock(clock.clone())
}

/// `cluster`: the limiter's checks sit on several slots, where a request one slot refused only
/// peeks the slots after it, keeping no conversion of their states to a new quota; the memory
/// store keeps the conversions of a refused request's every check. A fixed window's conversion
/// depends on the state it converts (a window carried into a longer one stays counted until
/// that one ends), so there its period is kept: the other algorithms' conversions, and a fixed
/// window's new limits, are compared.
async fn limiter_differential(redis: RedisStore, clock: ManualClock, seed: u64, cluster: bool) {
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(seed);
    let accounts: Vec<Key> = (0..3).map(|i| Key::new(format!("acct-{i}"))).collect();
    let addresses: Vec<Key> = (0..3u8)
        .map(|i| Key::from(std::net::IpAddr::from([203, 0, 113, i])))
        .collect();
    let trace = std::env::var_os("TRACE").is_some();
    let mut steps_clock = Steps::new(&clock);
    let (mut compared, mut refunds) = (0, 0);
    for (round, (first, second)) in Algorithm::ALL
        .iter()
        .flat_map(|&a| Algorithm::ALL.iter().map(move |&b| (a, b)))
        .enumerate()
    {
        let names = [format!("account-{round}"), format!("ip-{round}")];
        let algorithms = [first, second];
        let rules: Vec<Rule> = (0..2)
            .map(|i| random_rule(&mut rng, algorithms[i], &names[i], false))
            .collect();
        let on_memory = compared_limiter(memory.clone(), &rules, &clock)
            .build()
            .unwrap();
        let on_redis = compared_limiter(redis.clone(), &rules, &clock)
            .on_store_error(OnStoreError::fail_closed())
            .build()
            .unwrap();
        let mut receipts = Vec::new();
        for step in 0..60 {
            steps_clock.next(&mut rng);
            let account = &accounts[rng.below(3) as usize];
            let address = &addresses[rng.below(3) as usize];
            let r = rng.below(2) as usize;
            let key = if r == 0 { account } else { address };
            let cost = match rng.below(6) {
                0 => 1 + rng.below(rules[r].quota().capacity() + 1),
                1 => 2,
                _ => 1,
            };
            let op = rng.below(14);
            let what = format!("round {round} ({first}, {second}) step {step} op {op}");
            match op {
                0..=6 => {
                    let op = if op == 6 { Op::Peek } else { Op::Consume };
                    let targets = [(names[0].as_str(), account), (names[1].as_str(), address)];
                    let expected = on_memory.apply_to(op, &targets, cost).await.unwrap();
                    let got = on_redis.apply_to(op, &targets, cost).await.unwrap();
                    if trace {
                        eprintln!("{what} {op:?} {account:?} {address:?} {cost} -> {expected:?}");
                    }
                    assert_eq!(got, expected, "{what}: {op:?} cost {cost}");
                    compared += 1;
                }
                7 => {
                    let (expected, a) = on_memory.consume_with_receipt(key, cost).await.unwrap();
                    let (got, b) = on_redis.consume_with_receipt(key, cost).await.unwrap();
                    assert_eq!(got, expected, "{what}: consume with a receipt");
                    assert_eq!(a.is_some(), b.is_some(), "{what}: a receipt on both");
                    if let (Some(a), Some(b)) = (a, b) {
                        receipts.push((a, b));
                    }
                    compared += 1;
                }
                8 if !receipts.is_empty() => {
                    let (a, b) = receipts.swap_remove(rng.below(receipts.len() as u64) as usize);
                    on_memory.refund(a).await.unwrap();
                    on_redis.refund(b).await.unwrap();
                    refunds += 1;
                }
                9 => {
                    let quota = random_rule(&mut rng, algorithms[r], &names[r], false)
                        .quota()
                        .clone();
                    let quota = compared_quota(quota, &rules[r], cluster);
                    on_memory.set_quota(&names[r], quota.clone()).unwrap();
                    on_redis.set_quota(&names[r], quota).unwrap();
                }
                10 => {
                    let quota = (rng.below(3) > 0).then(|| {
                        let quota = random_rule(&mut rng, algorithms[r], &names[r], false)
                            .quota()
                            .clone();
                        compared_quota(quota, &rules[r], cluster)
                    });
                    on_memory
                        .set_override(&names[r], key, quota.clone())
                        .unwrap();
                    on_redis.set_override(&names[r], key, quota).unwrap();
                }
                11 => {
                    let block = Duration::from_micros(1_000 * rng.below(5_000) + 500);
                    match rng.below(5) {
                        0 => {
                            on_memory.block(key, block).await.unwrap();
                            on_redis.block(key, block).await.unwrap();
                        }
                        1 => {
                            on_memory.deny(key).await.unwrap();
                            on_redis.deny(key).await.unwrap();
                        }
                        2 => {
                            on_memory.allow(key).await.unwrap();
                            on_redis.allow(key).await.unwrap();
                        }
                        _ => {
                            on_memory.unblock(key).await.unwrap();
                            on_redis.unblock(key).await.unwrap();
                        }
                    }
                }
                12 => {
                    on_memory.reset_rule(key, &names[r]).await.unwrap();
                    on_redis.reset_rule(key, &names[r]).await.unwrap();
                }
                _ => {
                    let expected = on_memory.inspect(key).await.unwrap();
                    let got = on_redis.inspect(key).await.unwrap();
                    assert_eq!(got, expected, "{what}: inspect {key:?}");
                    compared += 1;
                }
            }
        }
    }
    assert!(
        compared > 700 && refunds > 5,
        "{compared} compared, {refunds} refunds"
    );
}

/// `quota`, with `rule`'s period when it is a fixed window on a cluster (see
/// [`limiter_differential`]).
fn compared_quota(quota: Quota, rule: &Rule, cluster: bool) -> Quota {
    if !cluster || quota.algorithm() != Algorithm::FixedWindow {
        return quota;
    }
    Quota::new(quota.limit(), rule.quota().period())
        .algorithm(Algorithm::FixedWindow)
        .build()
        .unwrap()
}

/// The layer on the memory store and on a Redis server, the same random requests on one manual
/// clock: the same status, rate-limit headers and body. The memory store's requests are decided
/// on the spot and Redis's wait for the store, two paths through the layer's response future;
/// here with a cost per request, costs settled from the handler's header, and refunds when the
/// handler fails.
#[tokio::test]
async fn the_layer_answers_alike_on_memory_and_on_redis() {
    use axum::extract::ConnectInfo;
    use axum::response::{IntoResponse, Response};
    use fleetlimit::layer::{Scope, Settle};
    use fleetlimit::{key, RateLimitLayer};
    use http::{HeaderMap, Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    /// Answers with the status the request asks for, and the real cost it names.
    async fn handler(headers: HeaderMap) -> Response {
        let asked = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok()?.parse().ok())
        };
        let status = StatusCode::from_u16(asked("x-status").unwrap_or(200)).unwrap();
        let mut response = (status, "handled").into_response();
        if let Some(actual) = asked("x-actual") {
            response
                .headers_mut()
                .insert("x-actual-cost", actual.into());
        }
        response
    }
    fn app(limiter: Limiter, account: &str, address: &str) -> axum::Router {
        let cost = |parts: &http::request::Parts| {
            let cost = parts
                .headers
                .get("x-cost")
                .and_then(|v| v.to_str().ok()?.parse().ok());
            cost.unwrap_or(1)
        };
        let layer = RateLimitLayer::builder(limiter)
            .scope(
                account,
                Scope::new()
                    .key(key::header("x-api-key"))
                    .cost(cost)
                    .settle(Settle::header("x-actual-cost")),
            )
            .scope(
                address,
                Scope::new()
                    .key_by_peer()
                    .refund_if(|status| status.is_server_error()),
            )
            .build()
            .unwrap();
        axum::Router::new()
            .route("/", axum::routing::get(handler))
            .layer(layer)
    }
    async fn answer(app: &axum::Router, request: Request<axum::body::Body>) -> String {
        let response = app.clone().oneshot(request).await.unwrap();
        let mut seen = format!("{} ", response.status());
        for (name, value) in response.headers() {
            let name = name.as_str();
            if name.contains("ratelimit") || name == "retry-after" {
                seen += &format!("{name}={value:?} ");
            }
        }
        let body = response.into_body().collect().await.unwrap().to_bytes();
        seen + &String::from_utf8_lossy(&body)
    }

    let clock = ManualClock::default();
    let (_server, redis) = standalone_on(&clock).await;
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let mut rng = Rng(21);
    let mut steps = Steps::new(&clock);
    let mut compared = 0;
    for (round, (first, second)) in Algorithm::ALL
        .iter()
        .flat_map(|&a| Algorithm::ALL.iter().map(move |&b| (a, b)))
        .enumerate()
    {
        let names = [format!("account-{round}"), format!("ip-{round}")];
        let rules = [
            random_rule(&mut rng, first, &names[0], false),
            random_rule(&mut rng, second, &names[1], false),
        ];
        let on_memory = app(
            compared_limiter(memory.clone(), &rules, &clock)
                .build()
                .unwrap(),
            &names[0],
            &names[1],
        );
        let on_redis = app(
            compared_limiter(redis.clone(), &rules, &clock)
                .on_store_error(OnStoreError::fail_closed())
                .build()
                .unwrap(),
            &names[0],
            &names[1],
        );
        for step in 0..40 {
            steps.next(&mut rng);
            let account = format!("acct-{}", rng.below(3));
            let peer = std::net::SocketAddr::from(([203, 0, 113, rng.below(3) as u8], 40_000));
            let cost = match rng.below(6) {
                0 => 1 + rng.below(rules[0].quota().capacity() + 1),
                1 => 2,
                _ => 1,
            };
            let status = if rng.below(5) == 0 { 500 } else { 200 };
            let actual = (rng.below(3) == 0).then(|| rng.below(cost + 2));
            let request = || {
                let mut request = Request::get("/")
                    .header("x-api-key", &account)
                    .header("x-cost", cost)
                    .header("x-status", status);
                if let Some(actual) = actual {
                    request = request.header("x-actual", actual);
                }
                let mut request = request.body(axum::body::Body::empty()).unwrap();
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            };
            let expected = answer(&on_memory, request()).await;
            let got = answer(&on_redis, request()).await;
            assert_eq!(
                got, expected,
                "round {round} ({first}, {second}) step {step}: {account} from {peer}, cost \
                 {cost}, status {status}, actual {actual:?}"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 25 * 40);
}
