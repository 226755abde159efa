//! In-process cost of a `MemoryStore` decision, per algorithm, on one hot key and spread over
//! 100,000 keys, mostly allowed and mostly denied.
//!
//! `cargo bench --bench memory`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use fleetlimit::store::{Check, Op};
use fleetlimit::{Algorithm, Key, MemoryStore, Quota, Rule};

fn decisions(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory");
    for algorithm in Algorithm::ALL {
        for (traffic, limit) in [("allowed", 1_000u64), ("denied", 1)] {
            // The log's limit is capped at its default maximum length.
            let limit = if algorithm == Algorithm::SlidingLog {
                limit.min(1_000)
            } else {
                limit * 1_000
            };
            let rule = Rule::new(
                "bench",
                Quota::per_second(limit)
                    .algorithm(algorithm)
                    .build()
                    .unwrap(),
            )
            .unwrap();
            let store = MemoryStore::new();
            let keys: Vec<Key> = (0..100_000u32).map(|i| Key::new(i.to_be_bytes())).collect();
            group.bench_function(format!("{algorithm}/1-key/{traffic}"), |b| {
                let key = &keys[0];
                b.iter(|| {
                    black_box(store.apply_now(
                        Op::Consume,
                        &[Check {
                            rule: &rule,
                            key,
                            cost: 1,
                        }],
                    ))
                })
            });
            group.bench_function(format!("{algorithm}/100k-keys/{traffic}"), |b| {
                let mut i = 0;
                b.iter(|| {
                    i = (i + 7919) % keys.len();
                    black_box(store.apply_now(
                        Op::Consume,
                        &[Check {
                            rule: &rule,
                            key: &keys[i],
                            cost: 1,
                        }],
                    ))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decisions);
criterion_main!(benches);
