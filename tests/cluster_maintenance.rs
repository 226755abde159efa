//! Cluster maintenance is not an outage: slots moved under load (`redis-cli --cluster reshard`),
//! a master added and the slots rebalanced onto it cost no policy decision and no lost count;
//! a master failing over to its replica (killed, or hung) costs only its own keys a short
//! window, measured.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetlimit::store::RedisStore;
use fleetlimit::{Algorithm, Key, Limiter, ManualClock, OnStoreError, Quota, Rule};
use support::redis::RedisCluster;

const KEYS: usize = 200;

/// One cluster at a time: each test measures what maintenance costs a decision at the default
/// deadline, not what three clusters and their load competing for two cores cost.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the limiter logged about failed store calls while a test ran (one subscriber for this
/// binary, at `debug`, where every failed call is said).
static LOGGED: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

struct Logged;
impl std::io::Write for Logged {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        LOGGED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_store_failures() {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(|| Logged)
        .with_ansi(false)
        .try_init();
    LOGGED.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// The failed store calls logged since [`log_store_failures`], as (cluster slot, error).
fn store_failures() -> Vec<(usize, String)> {
    let logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    String::from_utf8_lossy(&logged)
        .lines()
        .filter(|l| l.contains("fleetlimit: store") && l.contains(" error="))
        .map(|l| {
            let slot = l
                .split(" domain=")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(usize::MAX);
            let error = l.split(" error=").nth(1).unwrap_or("").to_string();
            (slot, error)
        })
        .collect()
}

/// A missed deadline is the one failure maintenance may cause here: on two shared cores, three
/// Redis servers, `redis-cli` moving keys and four request streams can starve a call past the
/// 50 ms default. Any other failure (MOVED, ASK, TRYAGAIN, a refused connection) is a redirection
/// the store failed to follow.
fn is_missed_deadline(error: &str) -> bool {
    error.starts_with("store did not answer within")
}

/// The contention allowance: at most one decision in a hundred left to the policy, all of them
/// missed deadlines (locally, with the machine to itself, it is none).
fn assert_only_missed_deadlines(out: &Outcome, what: &str) {
    let degraded: usize = out.degraded.iter().map(Vec::len).sum();
    let failures = store_failures();
    let not_deadline: Vec<_> = failures
        .iter()
        .filter(|(_, e)| !is_missed_deadline(e))
        .collect();
    eprintln!(
        "{what}: {} decisions, {degraded} left to the policy ({} failed store calls logged, all \
         missed deadlines: {})",
        out.decisions,
        failures.len(),
        not_deadline.is_empty()
    );
    assert!(
        not_deadline.is_empty(),
        "{what}: store failures other than a missed deadline: {:?}",
        &not_deadline[..not_deadline.len().min(5)]
    );
    assert!(
        degraded as u64 * 100 <= out.decisions,
        "{what}: {degraded} of {} decisions left to the policy",
        out.decisions
    );
}

fn rules(limit: u64) -> [Rule; 2] {
    // Two rules on each key: every decision is one script over two keys of one slot, which a
    // migration can split (TRYAGAIN).
    [
        Rule::new(
            "maint",
            Quota::per_hour(limit)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap(),
        Rule::new("maint-burst", Quota::per_minute(1_000_000).build().unwrap()).unwrap(),
    ]
}

/// Two instances on the cluster, failing closed, with the defaults otherwise.
async fn fleet(cluster: &RedisCluster, limit: u64) -> Vec<Limiter> {
    fleet_through(&cluster.urls(), limit).await
}

/// [`fleet`], connected through `urls` only.
async fn fleet_through(urls: &[String], limit: u64) -> Vec<Limiter> {
    let mut fleet = Vec::new();
    for _ in 0..2 {
        // A clock that stands still (both instances on the same time): on Redis's own clock a
        // run across an hour's boundary would give every key its limit again.
        let store = RedisStore::builder()
            .clock(ManualClock::default())
            .cluster(urls)
            .await
            .unwrap();
        let [a, b] = rules(limit);
        fleet.push(
            Limiter::builder(store)
                .rule(a)
                .rule(b)
                .on_store_error(OnStoreError::fail_closed())
                .deny_cache(0)
                .build()
                .unwrap(),
        );
    }
    fleet
}

struct Outcome {
    decisions: u64,
    /// Per key: admitted by the store, left to the policy (with when), and when the store last
    /// decided it.
    admitted: Vec<u64>,
    degraded: Vec<Vec<Instant>>,
    last_decided: Vec<Option<Instant>>,
}

/// Two streams per instance over every key while `maintenance` runs in a thread, and at least
/// `min_decisions` per stream.
async fn under_load(
    fleet: &[Limiter],
    keys: &[Key],
    min_decisions: u64,
    maintenance: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Outcome {
    let admitted: Arc<Vec<AtomicU64>> = Arc::new(keys.iter().map(|_| AtomicU64::new(0)).collect());
    let degraded = Arc::new(std::sync::Mutex::new(vec![Vec::new(); keys.len()]));
    let last_decided = Arc::new(std::sync::Mutex::new(vec![None; keys.len()]));
    let busy = Arc::new(AtomicBool::new(true));
    let worker = {
        let busy = busy.clone();
        std::thread::spawn(move || {
            let result = maintenance();
            busy.store(false, Ordering::Relaxed);
            result
        })
    };
    let mut streams = Vec::new();
    for limiter in fleet {
        for stream in 0..2 {
            let (limiter, keys, admitted, degraded, last_decided, busy) = (
                limiter.clone(),
                keys.to_vec(),
                admitted.clone(),
                degraded.clone(),
                last_decided.clone(),
                busy.clone(),
            );
            streams.push(tokio::spawn(async move {
                let (mut i, mut decisions) = (stream * 7, 0u64);
                while (busy.load(Ordering::Relaxed) || decisions < min_decisions)
                    && decisions < 400_000
                {
                    let k = i % keys.len();
                    let d = limiter.consume(&keys[k], 1).await.unwrap();
                    if d.degraded {
                        degraded.lock().unwrap()[k].push(Instant::now());
                    } else {
                        last_decided.lock().unwrap()[k] = Some(Instant::now());
                        if d.allowed {
                            admitted[k].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    i += 1;
                    decisions += 1;
                }
                decisions
            }));
        }
    }
    let mut decisions = 0;
    for s in streams {
        decisions += s.await.unwrap();
    }
    worker.join().unwrap().unwrap();
    let degraded = degraded.lock().unwrap().clone();
    let last_decided = last_decided.lock().unwrap().clone();
    Outcome {
        decisions,
        admitted: admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect(),
        degraded,
        last_decided,
    }
}

/// Every key admitted its limit, never more; fewer only by a decision that missed its deadline
/// after the store counted it.
fn assert_exact(out: &Outcome, limit: u64) {
    for (k, n) in out.admitted.iter().enumerate() {
        let missed = out.degraded[k].len() as u64;
        assert!(
            *n <= limit && *n + missed >= limit,
            "key {k}: {n} admitted, {missed} missed deadlines, limit {limit}"
        );
    }
}

fn keys() -> Vec<Key> {
    (0..KEYS).map(|i| Key::new(format!("tenant-{i}"))).collect()
}

/// Two instances, 200 keys at 30 per hour, two request streams per key per instance, while
/// 3,000 slots move twice: every key admits exactly its limit, and no decision is left to the
/// policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_under_load_costs_no_policy_decision() {
    let _alone = ONE_AT_A_TIME.lock().await;
    log_store_failures();
    let cluster = Arc::new(RedisCluster::start());
    let fleet = fleet(&cluster, 30).await;
    let keys = keys();
    let moving = cluster.clone();
    let out = under_load(&fleet, &keys, 2_000, move || {
        moving.reshard(0, 1, 3_000)?;
        moving.reshard(1, 2, 3_000)
    })
    .await;
    assert_only_missed_deadlines(&out, "reshard under load");
    assert_exact(&out, 30);
}

/// A master added and the slots rebalanced onto it, under load: the same promise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_added_under_load_costs_no_policy_decision() {
    let _alone = ONE_AT_A_TIME.lock().await;
    log_store_failures();
    let mut cluster = RedisCluster::start();
    cluster.add_master(5_000).unwrap();
    let cluster = Arc::new(cluster);
    let fleet = fleet(&cluster, 30).await;
    let keys = keys();
    let rebalancing = cluster.clone();
    let out = under_load(&fleet, &keys, 2_000, move || rebalancing.rebalance()).await;
    assert_only_missed_deadlines(&out, "master added and rebalanced under load");
    let new_master = cluster.nodes().len() - 1;
    let owned = cluster
        .slot_map()
        .iter()
        .filter(|r| cluster.nodes()[new_master].port() == r.port)
        .count();
    assert!(owned > 0, "the new master owns slots after the rebalance");
    assert_exact(&out, 30);
}

/// Three masters with a replica each, two instances under load; one master is taken away
/// (killed, or hung) and the load goes on for `after`. What happened to every key, which keys
/// were on the victim, and when it was taken away.
/// The URLs the instances are given.
#[derive(Clone, Copy)]
enum Seeds {
    All,
    /// The victim's alone: the other masters are learnt from it.
    VictimOnly,
    /// The victim's alone, by a host name (`localhost`) where the cluster names its nodes by
    /// address, as a DNS name in a configuration does.
    VictimByName,
}

struct Failover {
    /// Kept running until the checks are done.
    _cluster: RedisCluster,
    fleet: Vec<Limiter>,
    keys: Vec<Key>,
    on_victim: Vec<bool>,
    before: Outcome,
    out: Outcome,
    cut_at: Instant,
    healthy_failures: Vec<(usize, String)>,
}

async fn fail_over(cut: fn(&mut RedisCluster, usize), after: Duration, seeds: Seeds) -> Failover {
    log_store_failures();
    let mut cluster = RedisCluster::start_with_replicas(1, 1_000);
    // Every replica in sync with its master (a replica that never synced may not fail over).
    let started = Instant::now();
    while !cluster.nodes().iter().all(|n| {
        n.info("replication")
            .is_ok_and(|i| i.contains("role:master") || i.contains("master_link_status:up"))
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "replicas never synced"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let keys = keys();
    let store_for_slots = RedisStore::cluster(&cluster.urls()).await.unwrap();
    let [rule, _] = rules(1_000_000);
    let slot_of = |k: &Key| fleetlimit::store::redis::slot(&store_for_slots.key_for(&rule, k));
    let victim = cluster.node_for_slot(slot_of(&keys[0]));
    let urls = match seeds {
        Seeds::All => cluster.urls(),
        Seeds::VictimOnly => vec![cluster.nodes()[victim].url()],
        Seeds::VictimByName => vec![format!(
            "redis://localhost:{}",
            cluster.nodes()[victim].port()
        )],
    };
    let fleet = fleet_through(&urls, 1_000_000).await;
    let on_victim: Vec<bool> = keys
        .iter()
        .map(|k| cluster.node_for_slot(slot_of(k)) == victim)
        .collect();
    // Load before the failure: everything is counted by the store.
    let before = under_load(&fleet, &keys, 500, || Ok(())).await;
    assert_only_missed_deadlines(&before, "before the failover");
    log_store_failures();
    let cut_at = Instant::now();
    cut(&mut cluster, victim);
    let out = under_load(&fleet, &keys, 300, move || {
        std::thread::sleep(after);
        Ok(())
    })
    .await;
    let healthy_slots: std::collections::HashSet<usize> = keys
        .iter()
        .zip(&on_victim)
        .filter(|(_, on)| !**on)
        .map(|(k, _)| slot_of(k) as usize)
        .collect();
    let healthy_failures = store_failures()
        .into_iter()
        .filter(|(slot, e)| healthy_slots.contains(slot) && !is_missed_deadline(e))
        .collect();
    Failover {
        _cluster: cluster,
        fleet,
        keys,
        on_victim,
        before,
        out,
        cut_at,
        healthy_failures,
    }
}

impl Failover {
    /// The other masters' keys never notice: no failure but a missed deadline on their slots,
    /// and no more of those than contention allows.
    fn assert_healthy_masters_unaffected(&self) {
        assert!(
            self.healthy_failures.is_empty(),
            "healthy masters' keys failed: {:?}",
            &self.healthy_failures[..self.healthy_failures.len().min(5)]
        );
        let healthy_degraded: u64 = self
            .out
            .degraded
            .iter()
            .zip(&self.on_victim)
            .filter(|(_, on)| !**on)
            .map(|(t, _)| t.len() as u64)
            .sum();
        assert!(
            healthy_degraded * 100 <= self.out.decisions,
            "{healthy_degraded} decisions on healthy masters left to the policy"
        );
    }

    /// The victim's keys followed the policy for a while, then came back to the store (a
    /// decision by the promoted replica after their last policy decision): how long after the
    /// victim was taken away.
    fn recovery(&self) -> Duration {
        let on_victim = |per_key: &[Vec<Instant>]| -> Vec<Instant> {
            per_key
                .iter()
                .zip(&self.on_victim)
                .filter(|(_, on)| **on)
                .flat_map(|(t, _)| t.iter().copied())
                .collect()
        };
        let last_degraded = on_victim(&self.out.degraded).into_iter().max();
        assert!(
            last_degraded.is_some(),
            "the lost master's keys followed the policy for a while"
        );
        let back = self
            .out
            .last_decided
            .iter()
            .zip(&self.on_victim)
            .filter(|(_, on)| **on)
            .filter_map(|(t, _)| *t)
            .max();
        assert!(
            back.is_some_and(|back| last_degraded.is_none_or(|d| back > d)),
            "the lost master's keys never came back to the store"
        );
        last_degraded.map_or(Duration::ZERO, |t| t.duration_since(self.cut_at))
    }
}

/// Three masters with a replica each; under load, one master is killed. Its keys follow the
/// policy until its replica is promoted, then decide on the new master with no restart; the
/// other masters' keys never notice. Prints the recovery time and the counts lost to
/// asynchronous replication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_failover_costs_only_its_keys_a_short_window() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let f = fail_over(RedisCluster::kill_node, Duration::from_secs(8), Seeds::All).await;
    f.assert_healthy_masters_unaffected();
    let recovery = f.recovery();
    // What the promoted replica counts, against what the store acknowledged.
    let probe = &f.fleet[0];
    // A call abandoned at the deadline may still have run and been replicated: counted, not
    // acknowledged.
    let (mut acknowledged, mut abandoned, mut counted) = (0u64, 0u64, 0u64);
    for (k, key) in f.keys.iter().enumerate() {
        if !f.on_victim[k] {
            continue;
        }
        acknowledged += f.before.admitted[k] + f.out.admitted[k];
        abandoned += (f.before.degraded[k].len() + f.out.degraded[k].len()) as u64;
        counted += 1_000_000 - probe.peek(key).await.unwrap().remaining;
    }
    let lost = acknowledged.saturating_sub(counted);
    eprintln!(
        "cluster master failover: keys back on the promoted replica {recovery:?} after the kill \
         (node timeout 1 s); {acknowledged} admissions acknowledged on its keys, {counted} counted, \
         {lost} lost to asynchronous replication"
    );
    assert!(
        recovery < Duration::from_secs(6),
        "recovered only after {recovery:?}"
    );
    assert!(
        counted <= acknowledged + abandoned,
        "{counted} counted, {acknowledged} acknowledged, {abandoned} abandoned"
    );
}

/// The same master hung instead (stopped: its connections stay open and answer nothing, as
/// across a partition). No call fails, each is abandoned at its deadline; the store asks the
/// other masters for the slot map, sees the replica promoted, and connects to it in the
/// background, while the other masters' keys go on being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_is_replaced_by_its_promoted_replica() {
    hung_master_replaced(Seeds::All).await;
}

/// The same when the hung master was the only URL the instances were given: the new
/// connection goes through the other masters, at the same URL otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_given_as_the_only_url_is_replaced() {
    hung_master_replaced(Seeds::VictimOnly).await;
}

/// The same when that URL names the hung master by a host name: it is recognised by what the
/// name resolves to. (The replacement was given the hung node, and waited for it until it
/// answered again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_master_given_by_name_is_replaced() {
    hung_master_replaced(Seeds::VictimByName).await;
}

async fn hung_master_replaced(seeds: Seeds) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let hang = |cluster: &mut RedisCluster, victim: usize| cluster.nodes()[victim].pause();
    let f = fail_over(hang, Duration::from_secs(12), seeds).await;
    f.assert_healthy_masters_unaffected();
    let recovery = f.recovery();
    eprintln!(
        "cluster master hung: keys back on the promoted replica {recovery:?} after it stopped \
         (node timeout 1 s)"
    );
    assert!(
        recovery < Duration::from_secs(6),
        "recovered only after {recovery:?}"
    );
}

/// A slot starting to move to a master just added (which owns no slot yet, so the store's
/// cluster connection has no link to it) answers ASK for keys it does not hold: that call
/// cannot be followed and goes to the policy, but the connection every master's calls share
/// stays (it was dropped, as if a node had died, and every decision on every master then
/// waited for a new connection, which would have had no link to the new master either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_to_a_master_just_added_keeps_the_connection() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let mut cluster = RedisCluster::start();
    let store = RedisStore::builder()
        .clock(ManualClock::default())
        .cluster(&cluster.urls())
        .await
        .unwrap();
    let [rule, _] = rules(1_000);
    let limiter = Limiter::builder(store.clone())
        .rule(rule.clone())
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let slot_of = |k: &Key| fleetlimit::store::redis::slot(&store.key_for(&rule, k));
    let (moving, steady) = (Key::new("moving"), Key::new("steady"));
    let source = cluster.node_for_slot(slot_of(&moving));
    let other = (0..3).find(|&n| n != source).unwrap();
    let steady = (0..10_000)
        .map(|i| Key::new(format!("steady-{i}")))
        .find(|k| cluster.node_for_slot(slot_of(k)) == other)
        .unwrap_or(steady);
    assert!(!limiter.consume(&steady, 1).await.unwrap().degraded);
    let added = cluster.add_master(5_000).unwrap();
    let id = |n: usize| {
        cluster.nodes()[n]
            .cmd(&["CLUSTER", "MYID"])
            .unwrap()
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (source_id, added_id) = (id(source), id(added));
    let slot = slot_of(&moving).to_string();
    cluster.nodes()[added]
        .cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source_id])
        .unwrap();
    cluster.nodes()[source]
        .cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &added_id])
        .unwrap();
    let connections = |n: usize| {
        let stats = cluster.nodes()[n].info("stats").unwrap();
        support::redis::info_field(&stats, "total_connections_received")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap()
    };
    let asked = limiter.consume(&moving, 1).await.unwrap();
    assert!(asked.degraded, "not followed: {asked:?}");
    // redis-rs refreshes its own links on that error, in the background: let it finish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before: Vec<u64> = (0..3).map(connections).collect();
    assert!(!limiter.consume(&steady, 1).await.unwrap().degraded);
    let after: Vec<u64> = (0..3).map(connections).collect();
    // Each count is read over a connection of its own: one more per master, nothing else.
    let expected: Vec<u64> = before.iter().map(|n| n + 1).collect();
    assert_eq!(after, expected, "the next decision made no new connection");
    for n in [source, added] {
        cluster.nodes()[n]
            .cmd(&["CLUSTER", "SETSLOT", &slot, "STABLE"])
            .unwrap();
    }
}
