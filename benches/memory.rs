//! In-process cost of a keyed decision: `MemoryStore` for every algorithm next to `governor`'s
//! keyed limiter (GCRA) doing the same work, on 1 key and on 100,000 keys, from 1 and 2 threads,
//! mostly allowed and mostly denied.
//!
//! `cargo bench --bench memory` (`-- --quick` for a short run)

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use fleetlimit::store::{Check, Op};
use fleetlimit::{Algorithm, Key, MemoryStore, Quota, Rule};

const KEYS: usize = 100_000;

/// Run `iters` checks split over `threads` threads; the time per check.
fn timed(threads: usize, iters: u64, check: impl Fn(usize) + Sync) -> Duration {
    let per = iters / threads as u64;
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let check = &check;
            s.spawn(move || {
                let mut i = t * 7919;
                for _ in 0..per {
                    i = (i + 7919) % KEYS;
                    check(i);
                }
            });
        }
    });
    started.elapsed()
}

fn decisions(c: &mut Criterion) {
    let keys: Vec<Key> = (0..KEYS as u32)
        .map(|i| Key::new(i.to_be_bytes()))
        .collect();
    let mut group = c.benchmark_group("keyed-check");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    for (traffic, per_second) in [("allowed", 1_000_000_000u32), ("denied", 1)] {
        for spread in [1usize, KEYS] {
            for threads in [1usize, 2] {
                let id = |name: &str| {
                    BenchmarkId::new(name, format!("{spread}-keys/{threads}-threads/{traffic}"))
                };
                // governor, keyed, GCRA: the baseline.
                let quota = governor::Quota::per_second(
                    NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN),
                )
                .allow_burst(NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN));
                let gov = governor::RateLimiter::<Key, _, _>::dashmap(quota);
                group.bench_function(id("governor"), |b| {
                    b.iter_custom(|iters| {
                        timed(threads, iters, |i| {
                            black_box(gov.check_key(&keys[i % spread]).is_ok());
                        })
                    })
                });
                for algorithm in Algorithm::ALL {
                    let allowed = per_second > 1;
                    let quota = match (algorithm, allowed) {
                        (_, false) => Quota::per_second(1).algorithm(algorithm),
                        // Mostly allowed: a rate no benchmark can exhaust.
                        (Algorithm::SlidingLog, true) => {
                            Quota::per_second(10_000).algorithm(algorithm)
                        }
                        // A huge burst at a slow rate: each check pushes the state a second
                        // ahead, so every key's entry stays live, as governor keeps every key.
                        // (At a fast rate each entry expired microseconds after its check and
                        // was swept: on 100,000 keys the table stayed nearly empty, a kinder
                        // case than governor's.)
                        (Algorithm::TokenBucket | Algorithm::Gcra, true) => {
                            Quota::per_second(1).algorithm(algorithm).burst(1 << 29)
                        }
                        (_, true) => Quota::per_second(u64::from(per_second)).algorithm(algorithm),
                    };
                    let rule = Rule::new("bench", quota.build().unwrap()).unwrap();
                    let store = MemoryStore::new();
                    group.bench_function(id(algorithm.name()), |b| {
                        b.iter_custom(|iters| {
                            timed(threads, iters, |i| {
                                let check = Check {
                                    rule: &rule,
                                    key: &keys[i % spread],
                                    cost: 1,
                                };
                                black_box(store.check(Op::Consume, &check));
                            })
                        })
                    });
                }
            }
        }
    }
    group.finish();
}

criterion_group!(benches, decisions);
criterion_main!(benches);
