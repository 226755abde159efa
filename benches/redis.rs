//! Decisions against a real redis-server, started by this bench on a free loopback port (or the
//! one at `FLEETLIMIT_BENCH_REDIS`, e.g. `redis://127.0.0.1:6379`):
//! - every algorithm through a `Limiter` at 1, 16, 64 and 256 concurrent callers, beside raw
//!   redis-rs EVALSHA of the same script at the same concurrency (the P1 baseline);
//! - one hot key, leased vs direct.
//!
//! Criterion reports time per decision (the inverse of decisions per second at that
//! concurrency); before it runs, the bench prints p50/p99 latency per configuration.
//!
//! `cargo bench --bench redis`

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use fleetlimit::store::{Check, RedisStore};
use fleetlimit::{Algorithm, Key, LeaseConfig, Limiter, OnStoreError, Quota, Rule};

#[path = "../tests/support/redis.rs"]
#[allow(dead_code)]
mod redis_harness;

/// The Redis to measure against: `FLEETLIMIT_BENCH_REDIS`, or one started for the run.
fn redis() -> (Option<redis_harness::RedisServer>, String) {
    if let Ok(url) = std::env::var("FLEETLIMIT_BENCH_REDIS") {
        return (None, url);
    }
    let server = redis_harness::RedisServer::start();
    let url = server.url();
    (Some(server), url)
}

fn rule(algorithm: Algorithm) -> Rule {
    // Far more than any run consumes: every decision admits, every decision is a full update.
    let q = match algorithm {
        Algorithm::SlidingLog => Quota::per_second(10_000).algorithm(algorithm),
        Algorithm::TokenBucket | Algorithm::Gcra => Quota::per_second(1_000_000)
            .algorithm(algorithm)
            .burst(1 << 40),
        _ => Quota::per_second(1_000_000_000).algorithm(algorithm),
    };
    Rule::new("bench", q.build().unwrap()).unwrap()
}

/// `iters` decisions spread over `concurrency` tasks; returns the elapsed time and latencies.
async fn drive<F, Fut>(iters: u64, concurrency: usize, one: F) -> (Duration, Vec<Duration>)
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let per = (iters / concurrency as u64).max(1);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let one = one.clone();
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(per as usize);
                for i in 0..per {
                    let s = Instant::now();
                    one(t as u64 * per + i).await;
                    lat.push(s.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    (started.elapsed(), latencies)
}

fn percentile(lat: &mut [Duration], p: f64) -> Duration {
    lat.sort_unstable();
    lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)]
}

fn bench(c: &mut Criterion) {
    let server = redis();
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    );
    let mut group = c.benchmark_group("redis");
    group.warm_up_time(Duration::from_millis(300));
    group.measurement_time(Duration::from_secs(2));
    group.sample_size(10);
    println!("| configuration | concurrency | decisions/s | p50 | p99 |");
    println!("|---|---:|---:|---:|---:|");
    for algorithm in Algorithm::ALL {
        let r = rule(algorithm);
        let limiter = rt.block_on(async {
            let store = RedisStore::builder()
                .connect_timeout(Duration::from_secs(5))
                .connect(&server.1)
                .await
                .unwrap();
            Limiter::builder(store)
                .rule(r.clone())
                .on_store_error(OnStoreError::fail_closed())
                .deadline(Duration::from_secs(5))
                .deny_cache(0)
                .build()
                .unwrap()
        });
        let keys: Arc<Vec<Key>> =
            Arc::new((0..1_000).map(|i: u32| Key::new(i.to_be_bytes())).collect());
        for concurrency in [1usize, 16, 64, 256] {
            let one = {
                let (limiter, keys) = (limiter.clone(), keys.clone());
                move |i: u64| {
                    let (limiter, keys) = (limiter.clone(), keys.clone());
                    async move {
                        limiter
                            .consume(&keys[(i % 1_000) as usize], 1)
                            .await
                            .unwrap();
                    }
                }
            };
            let (elapsed, mut lat) = rt.block_on(drive(4_000, concurrency, one.clone()));
            println!(
                "| limiter {algorithm} | {concurrency} | {:.0} | {:?} | {:?} |",
                lat.len() as f64 / elapsed.as_secs_f64(),
                percentile(&mut lat, 0.5),
                percentile(&mut lat, 0.99)
            );
            group.bench_function(
                BenchmarkId::new(format!("limiter/{algorithm}"), concurrency),
                |b| b.iter_custom(|iters| rt.block_on(drive(iters, concurrency, one.clone())).0),
            );
            if algorithm == Algorithm::Gcra {
                // Raw redis-rs EVALSHA of the same script and arguments: the P1 baseline.
                let (conn, script) = rt.block_on(async {
                    let client = redis::Client::open(server.1.as_str()).unwrap();
                    (
                        redis::aio::ConnectionManager::new(client).await.unwrap(),
                        Arc::new(redis::Script::new(RedisStore::script())),
                    )
                });
                let store = rt.block_on(RedisStore::connect(&server.1)).unwrap();
                let redis_keys: Arc<Vec<Vec<u8>>> =
                    Arc::new(keys.iter().map(|k| store.key_for(&r, k)).collect());
                let args = Arc::new(RedisStore::script_args(&Check {
                    rule: &r,
                    key: &keys[0],
                    cost: 1,
                }));
                let raw = move |i: u64| {
                    let (mut conn, script, redis_keys, args) = (
                        conn.clone(),
                        script.clone(),
                        redis_keys.clone(),
                        args.clone(),
                    );
                    async move {
                        let mut inv = script.key(&redis_keys[(i % 1_000) as usize]);
                        for a in args.iter() {
                            inv.arg(a);
                        }
                        let _: Vec<i64> = inv.invoke_async(&mut conn).await.unwrap();
                    }
                };
                let (elapsed, mut lat) = rt.block_on(drive(4_000, concurrency, raw.clone()));
                println!(
                    "| raw redis-rs EVALSHA | {concurrency} | {:.0} | {:?} | {:?} |",
                    lat.len() as f64 / elapsed.as_secs_f64(),
                    percentile(&mut lat, 0.5),
                    percentile(&mut lat, 0.99)
                );
                group.bench_function(BenchmarkId::new("raw-evalsha/gcra", concurrency), |b| {
                    b.iter_custom(|iters| rt.block_on(drive(iters, concurrency, raw.clone())).0)
                });
            }
        }
    }
    // One hot key: leased vs direct, 64 callers.
    for (name, lease) in [
        ("hot-key/direct", None),
        (
            "hot-key/leased",
            Some(LeaseConfig::fixed(1_000).max_share(1.0)),
        ),
    ] {
        let r = rule(Algorithm::Gcra);
        let limiter = rt.block_on(async {
            let store = RedisStore::builder()
                .connect_timeout(Duration::from_secs(5))
                .connect(&server.1)
                .await
                .unwrap();
            let mut b = Limiter::builder(store)
                .rule(r.clone())
                .on_store_error(OnStoreError::fail_closed())
                .deadline(Duration::from_secs(5));
            if let Some(config) = lease {
                b = b.lease("bench", config);
            }
            b.build().unwrap()
        });
        let one = {
            let limiter = limiter.clone();
            move |_: u64| {
                let limiter = limiter.clone();
                async move {
                    limiter.consume(&Key::new("hot"), 1).await.unwrap();
                }
            }
        };
        let (elapsed, mut lat) = rt.block_on(drive(20_000, 64, one.clone()));
        println!(
            "| {name} | 64 | {:.0} | {:?} | {:?} | (lease calls so far: {})",
            lat.len() as f64 / elapsed.as_secs_f64(),
            percentile(&mut lat, 0.5),
            percentile(&mut lat, 0.99),
            limiter.stats().lease_calls
        );
        group.bench_function(name, |b| {
            b.iter_custom(|iters| rt.block_on(drive(iters, 64, one.clone())).0)
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
