//! The fleet-level property: random interleavings of consumes (various costs), peeks, refunds by
//! receipt (across window boundaries and after refills), two versions of a quota writing one key
//! (a rolling deploy), leases spent in process and given back, and clock moves, on the memory
//! store and on a real redis-server. Every admission is checked against an exact reference:
//!
//! - fixed window: at most the larger limit in every aligned window;
//! - sliding log: at most the larger limit alive at every admission, and (liveness) a request is
//!   admitted exactly when the log has room for it under the quota it was asked with;
//! - sliding window counter: its own estimate never above the larger limit;
//! - token bucket, GCRA: at most the larger burst plus the faster rate × (t + the leases'
//!   validity) in any interval t.
//!
//! A refunded admission counts as long as its refund gave nothing back (a window that ended,
//! an entry that left the log); a bucket's refunded admissions are left out, which is what the
//! refund rule promises (the bucket is never above what it would hold without the request).

mod support;

use std::collections::HashMap;
use std::time::Duration;

use fleetlimit::store::{Check, Op, RedisStore, Refund, Store};
use fleetlimit::{Algorithm, Clock, Key, ManualClock, MemoryStore, Quota, Rule, Taken};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::redis::RedisServer;

/// 2025-01-01T00:00:00Z in µs: aligned to every whole-second period.
const T0: u64 = 1_735_689_600_000_000;
const PERIOD_MS: u64 = 1000;
const KEYS: usize = 2;

#[derive(Debug, Clone)]
struct Case {
    algorithm: Algorithm,
    /// (limit, burst) of the two versions.
    versions: [(u64, u64); 2],
    ops: Vec<(u64, Action)>,
}

#[derive(Debug, Clone, Copy)]
enum Action {
    Consume {
        version: usize,
        key: usize,
        cost: u64,
    },
    Peek {
        version: usize,
        key: usize,
    },
    Refund {
        pick: usize,
    },
    Lease {
        version: usize,
        key: usize,
        want: u64,
        validity_ms: u64,
    },
    Spend {
        key: usize,
    },
    GiveBack {
        key: usize,
    },
}

fn case() -> impl Strategy<Value = Case> {
    let algorithm = prop::sample::select(Algorithm::ALL.to_vec());
    (algorithm, 1u64..12, 1u64..12, 1u64..12, 1u64..12).prop_flat_map(
        |(algorithm, l1, l2, b1, b2)| {
            let bucket = matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra);
            let versions = if bucket {
                [(l1, b1), (l2, b2)]
            } else {
                [(l1, l1), (l2, l2)]
            };
            let leasable = algorithm != Algorithm::SlidingLog;
            let action = (
                0u8..12,
                0usize..2,
                0usize..KEYS,
                1u64..5,
                0usize..64,
                1u64..400,
            )
                .prop_map(move |(kind, version, key, cost, pick, ms)| match kind {
                    0..=4 => Action::Consume {
                        version,
                        key,
                        cost: if pick % 5 == 0 { cost * 3 } else { cost.min(2) },
                    },
                    5 => Action::Peek { version, key },
                    6 | 7 => Action::Refund { pick },
                    8 if leasable => Action::Lease {
                        version,
                        key,
                        want: cost * 2,
                        validity_ms: ms,
                    },
                    9 | 10 if leasable => Action::Spend { key },
                    11 if leasable => Action::GiveBack { key },
                    _ => Action::Consume {
                        version,
                        key,
                        cost: 1,
                    },
                });
            let gap = prop_oneof![3 => Just(0u64), 5 => 0u64..200_000, 1 => 0u64..2_500_000];
            prop::collection::vec((gap, action), 1..160).prop_map(move |ops| Case {
                algorithm,
                versions,
                ops,
            })
        },
    )
}

/// One admission, as the reference sees it.
#[derive(Debug, Clone, Copy)]
struct Admission {
    at: u64,
    cost: u64,
    /// When its receipt was refunded.
    refunded: Option<u64>,
    /// Spent from a leased block (no receipt of its own).
    leased: bool,
}

/// A leased block held by the (single, simulated) process.
struct Block {
    permits: u64,
    valid_until: u64,
    taken: Taken,
    version: usize,
}

/// `real_expiry`: the store expires keys in real time (Redis counts a TTL down by its own
/// clock), so the manual clock never runs behind the real time since the case started; else a
/// stall of a few milliseconds could expire a key whose state still counts.
async fn run_case(
    store: &dyn Store,
    clock: &ManualClock,
    start: u64,
    prefix: &str,
    case: &Case,
    real_expiry: bool,
) -> Result<(), TestCaseError> {
    clock.set(start);
    let started = std::time::Instant::now();
    let name = format!("{prefix}-{}", case.algorithm.name());
    let rules: Vec<Rule> = case
        .versions
        .iter()
        .map(|&(limit, burst)| {
            let mut q =
                Quota::new(limit, Duration::from_millis(PERIOD_MS)).algorithm(case.algorithm);
            if matches!(case.algorithm, Algorithm::TokenBucket | Algorithm::Gcra) {
                q = q.burst(burst);
            }
            Rule::new(name.clone(), q.build().unwrap()).unwrap()
        })
        .collect();
    let keys: Vec<Key> = (0..KEYS)
        .map(|i| Key::new(format!("{prefix}-k{i}")))
        .collect();
    let mut admitted: Vec<Vec<Admission>> = vec![Vec::new(); KEYS];
    // Receipts: (key, index into admitted[key], version, taken).
    let mut receipts: Vec<(usize, usize, usize, Taken)> = Vec::new();
    let mut blocks: HashMap<usize, Block> = HashMap::new();
    let mut max_validity = 0u64;
    for &(gap, action) in &case.ops {
        clock.advance(Duration::from_micros(gap));
        if real_expiry {
            let real = start + started.elapsed().as_micros() as u64;
            clock.set(clock.now_us().max(real));
        }
        let now = clock.now_us();
        match action {
            Action::Consume { version, key, cost } => {
                let check = Check {
                    rule: &rules[version],
                    key: &keys[key],
                    cost,
                };
                let d = store.apply(Op::Consume, &[check]).await.unwrap()[0];
                if case.algorithm == Algorithm::SlidingLog {
                    // Liveness and safety: admitted exactly when the log has room under the
                    // quota this request was asked with.
                    let alive: u64 = admitted[key]
                        .iter()
                        .filter(|a| {
                            a.at + PERIOD_MS * 1000 > now && a.refunded.is_none_or(|r| r > now)
                        })
                        .map(|a| a.cost)
                        .sum();
                    let fits = alive + cost <= rules[version].quota().limit();
                    prop_assert_eq!(d.allowed, fits, "log: {} alive, cost {}", alive, cost);
                }
                if d.allowed {
                    admitted[key].push(Admission {
                        at: now,
                        cost,
                        refunded: None,
                        leased: false,
                    });
                    let taken = d.taken().unwrap();
                    prop_assert_eq!(taken.cost(), cost);
                    receipts.push((key, admitted[key].len() - 1, version, taken));
                } else {
                    prop_assert!(d.taken().is_none());
                }
            }
            Action::Peek { version, key } => {
                let check = Check {
                    rule: &rules[version],
                    key: &keys[key],
                    cost: 1,
                };
                let d = store.apply(Op::Peek, &[check]).await.unwrap()[0];
                prop_assert!(d.taken().is_none());
            }
            Action::Refund { pick } => {
                if receipts.is_empty() {
                    continue;
                }
                let (key, i, version, taken) = receipts.swap_remove(pick % receipts.len());
                store
                    .refund(&[Refund {
                        rule: &rules[version],
                        key: &keys[key],
                        taken,
                    }])
                    .await
                    .unwrap();
                admitted[key][i].refunded = Some(now);
            }
            Action::Lease {
                version,
                key,
                want,
                validity_ms,
            } => {
                if blocks.contains_key(&key) {
                    continue;
                }
                let check = Check {
                    rule: &rules[version],
                    key: &keys[key],
                    cost: want,
                };
                let validity = validity_ms * 1000;
                max_validity = max_validity.max(validity);
                let lease = store
                    .lease(check, Duration::from_micros(validity))
                    .await
                    .unwrap();
                prop_assert!(lease.permits <= want);
                if lease.permits > 0 {
                    blocks.insert(
                        key,
                        Block {
                            permits: lease.permits,
                            valid_until: now + lease.valid_for.as_micros() as u64,
                            taken: lease.taken,
                            version,
                        },
                    );
                }
            }
            Action::Spend { key } => {
                if let Some(b) = blocks.get_mut(&key) {
                    if b.permits > 0 && now < b.valid_until {
                        b.permits -= 1;
                        admitted[key].push(Admission {
                            at: now,
                            cost: 1,
                            refunded: None,
                            leased: true,
                        });
                    }
                }
            }
            Action::GiveBack { key } => {
                if let Some(b) = blocks.remove(&key) {
                    if b.permits > 0 {
                        store
                            .refund(&[Refund {
                                rule: &rules[b.version],
                                key: &keys[key],
                                taken: b.taken.part(b.permits),
                            }])
                            .await
                            .unwrap();
                    }
                }
            }
        }
    }
    for list in &admitted {
        check_bounds(case, list, max_validity)?;
    }
    Ok(())
}

fn check_bounds(case: &Case, list: &[Admission], slack: u64) -> Result<(), TestCaseError> {
    let period = PERIOD_MS * 1000;
    let max_limit = case.versions.iter().map(|v| v.0).max().unwrap_or(0);
    let max_burst = case.versions.iter().map(|v| v.1).max().unwrap_or(0);
    let window = |t: u64| t - t % period;
    match case.algorithm {
        Algorithm::FixedWindow => {
            let mut per_window: HashMap<u64, u64> = HashMap::new();
            for a in list {
                // A refund in the admission's own window gave it back; a later one gave nothing.
                let given_back = a.refunded.is_some_and(|r| window(r) == window(a.at));
                if !given_back {
                    *per_window.entry(window(a.at)).or_default() += a.cost;
                }
            }
            for (w, n) in per_window {
                prop_assert!(n <= max_limit, "window {}: {} > {}", w, n, max_limit);
            }
        }
        Algorithm::SlidingLog => {
            for a in list {
                let alive: u64 = list
                    .iter()
                    .filter(|b| {
                        b.at <= a.at && b.at + period > a.at && b.refunded.is_none_or(|r| r > a.at)
                    })
                    .map(|b| b.cost)
                    .sum();
                prop_assert!(alive <= max_limit, "{} alive at {}", alive, a.at);
            }
        }
        Algorithm::SlidingWindow => {
            // The default sub-windows: the estimate weighs the one sliding out, the newer whole.
            let width = period / fleetlimit::DEFAULT_SUB_WINDOWS;
            let w_ms = width / 1000;
            let sub_window = |t: u64| t - t % width;
            for a in list {
                let s = sub_window(a.at);
                let counted = |from: u64, to: u64| -> u64 {
                    list.iter()
                        .filter(|b| b.at >= from && b.at < to && b.at <= a.at)
                        // Refunded (before now) while its sub-window was still counted.
                        .filter(|b| {
                            !b.refunded
                                .is_some_and(|r| r <= a.at && r < sub_window(b.at) + period + width)
                        })
                        .map(|b| b.cost)
                        .sum()
                };
                let newer = counted((s + width).saturating_sub(period), s + width);
                let oldest = if s >= period {
                    counted(s - period, s - period + width)
                } else {
                    0
                };
                let e = (a.at - s) / 1000;
                prop_assert!(
                    oldest * (w_ms - e) + newer * w_ms <= max_limit * w_ms,
                    "estimate over {} at {}: sliding out {} newer {}",
                    max_limit,
                    a.at,
                    oldest,
                    newer
                );
            }
        }
        _ => {
            // Buckets: refunded admissions are as if they never came.
            let kept: Vec<&Admission> = list.iter().filter(|a| a.refunded.is_none()).collect();
            for i in 0..kept.len() {
                let mut sum = 0u128;
                for b in &kept[i..] {
                    sum += u128::from(b.cost);
                    let span = u128::from(b.at - kept[i].at + slack);
                    let bound =
                        u128::from(max_burst) * u128::from(period) + u128::from(max_limit) * span;
                    prop_assert!(
                        sum * u128::from(period) <= bound,
                        "{} admitted within {} µs (burst {}, limit {}, leased: {})",
                        sum,
                        span,
                        max_burst,
                        max_limit,
                        b.leased
                    );
                }
            }
        }
    }
    Ok(())
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_fleet_never_passes_the_bound_on_the_memory_store() {
    let clock = ManualClock::new(T0);
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let rt = runtime();
    let n = std::cell::Cell::new(0u64);
    runner(2048)
        .run(&case(), |case| {
            n.set(n.get() + 1);
            let n = n.get();
            rt.block_on(run_case(
                &store,
                &clock,
                T0 + n * 10_000_000_000,
                &format!("m{n}"),
                &case,
                false,
            ))
        })
        .unwrap();
}

#[test]
fn the_fleet_never_passes_the_bound_on_redis() {
    let server = RedisServer::start();
    let rt = runtime();
    let clock = ManualClock::new(T0);
    let store = rt
        .block_on(
            RedisStore::builder()
                .connect_timeout(Duration::from_secs(2))
                .clock(clock.clone())
                .connect(&server.url()),
        )
        .unwrap();
    let n = std::cell::Cell::new(0u64);
    runner(256)
        .run(&case(), |case| {
            n.set(n.get() + 1);
            let n = n.get();
            rt.block_on(run_case(
                &store,
                &clock,
                T0 + n * 10_000_000_000,
                &format!("r{n}"),
                &case,
                true,
            ))
        })
        .unwrap();
}
