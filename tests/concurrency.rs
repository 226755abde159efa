//! Many threads on one key: the exact algorithms admit exactly the limit, not one more.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use fleetlimit::store::{Check, Op};
use fleetlimit::{Algorithm, Key, ManualClock, MemoryStore, Quota, Rule};

const THREADS: u64 = 8;
const ATTEMPTS: u64 = 5_000;
const LIMIT: u64 = 1_000;

fn hammer(store: &MemoryStore, rules: &[Rule], keys: &[Key]) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    thread::scope(|s| {
        for _ in 0..THREADS {
            let admitted = admitted.clone();
            s.spawn(move || {
                let checks: Vec<Check<'_>> = rules
                    .iter()
                    .zip(keys)
                    .map(|(rule, key)| Check { rule, key, cost: 1 })
                    .collect();
                for _ in 0..ATTEMPTS {
                    if store
                        .apply_now(Op::Consume, &checks)
                        .iter()
                        .all(|d| d.allowed)
                    {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    admitted.load(Ordering::Relaxed)
}

#[test]
fn exact_algorithms_admit_exactly_the_limit_under_contention() {
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::default();
        let store = MemoryStore::builder().clock(clock).build().unwrap();
        let rule = Rule::new(
            "hot",
            Quota::per_minute(LIMIT)
                .algorithm(algorithm)
                .build()
                .unwrap(),
        )
        .unwrap();
        let admitted = hammer(&store, std::slice::from_ref(&rule), &[Key::new("one")]);
        // Time stands still, so every algorithm is exact here: the window counter's previous
        // window is empty and the buckets do not refill.
        assert_eq!(admitted, LIMIT, "{algorithm}");
    }
}

#[test]
fn several_rules_stay_all_or_nothing_under_contention() {
    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    let per_account = Rule::new(
        "account",
        Quota::per_minute(LIMIT)
            .algorithm(Algorithm::SlidingLog)
            .build()
            .unwrap(),
    )
    .unwrap();
    let per_ip = Rule::new(
        "ip",
        Quota::per_minute(LIMIT / 2)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap(),
    )
    .unwrap();
    let rules = [per_account.clone(), per_ip.clone()];
    let keys = [Key::new("acct"), Key::new("ip")];
    assert_eq!(hammer(&store, &rules, &keys), LIMIT / 2);
    // The account rule gave exactly what passed both, no more.
    let left = store.apply_now(
        Op::Peek,
        &[Check {
            rule: &per_account,
            key: &keys[0],
            cost: 1,
        }],
    );
    assert_eq!(left[0].remaining, LIMIT - LIMIT / 2);
}
