//! How far the sliding window counter strays from the exact sliding window.
//!
//! Replays one generated workload: many keys, Poisson arrivals, each key at a rate below, at or
//! above its limit. The counter decides every request; beside it, the exact rule is evaluated on
//! the same history (the permits the counter actually admitted): would admitting this request
//! put more than `limit` into the trailing window? Where the two disagree the counter was wrong:
//! wrongly allowed (the exact rule would have refused) or wrongly denied (it would have
//! admitted). This is the error a user of the counter actually sees.
//!
//! ```text
//! cargo run --release --example accuracy [-- --keys 2000 --minutes 10 --seed 7]
//! ```

use std::time::Duration;

use fleetlimit::store::{Check, Op};
use fleetlimit::{Algorithm, Key, ManualClock, MemoryStore, Quota, Rule};

/// What to replay.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Distinct keys.
    pub keys: u64,
    /// Simulated duration.
    pub minutes: u64,
    /// Each key's limit per minute.
    pub limit_per_minute: u64,
    /// PRNG seed.
    pub seed: u64,
    /// Demand per key as a multiple of its limit; keys take these in turn.
    pub demand: Vec<f64>,
}

/// Disagreements between the counter and the exact rule, for one class of keys.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Requests decided.
    pub requests: u64,
    /// Admitted by the counter, refused by the exact rule.
    pub wrongly_allowed: u64,
    /// Refused by the counter, admitted by the exact rule.
    pub wrongly_denied: u64,
    /// The most permits the counter admitted within any window of one period.
    pub worst_window: u64,
}

/// The realistic-trace replay (its PRNG is shared).
#[path = "trace.rs"]
#[allow(dead_code)]
pub mod trace;
use trace::Rng;

/// Demand per key as a multiple of its limit: below, at and above.
pub const DEMAND: [f64; 7] = [0.25, 0.5, 0.9, 1.0, 1.1, 2.0, 5.0];

/// Replay the workload; one report per demand class, in the order of `w.demand`.
pub fn run(w: &Workload) -> Vec<Report> {
    let start = 1_735_689_600_000_000u64;
    let clock = ManualClock::new(start);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(usize::MAX / 2)
        .build()
        .unwrap_or_else(|e| panic!("store: {e}"));
    let quota = |a| {
        Quota::new(w.limit_per_minute, Duration::from_secs(60))
            .algorithm(a)
            .max_log_len(w.limit_per_minute)
            .build()
            .unwrap_or_else(|e| panic!("quota: {e}"))
    };
    let counter =
        Rule::new("counter", quota(Algorithm::SlidingWindow)).unwrap_or_else(|e| panic!("{e}"));
    let period = 60_000_000u64;

    // Merge every key's Poisson process into one time-ordered stream.
    let mut rng = Rng(w.seed);
    let end = start + w.minutes * 60_000_000;
    let mut arrivals: Vec<(u64, u64)> = Vec::new();
    for k in 0..w.keys {
        let per_us =
            w.demand[(k % w.demand.len() as u64) as usize] * w.limit_per_minute as f64 / 60e6;
        // Start each key at a random offset so windows are not all aligned with traffic.
        let mut t = start as f64 + rng.unit() * 60e6;
        loop {
            t += -rng.unit().ln() / per_us;
            if t >= end as f64 {
                break;
            }
            arrivals.push((t as u64, k));
        }
    }
    arrivals.sort_unstable();

    let mut reports = vec![Report::default(); w.demand.len()];
    // The exact sliding log of what the counter admitted, per key.
    let mut admitted: Vec<std::collections::VecDeque<u64>> =
        vec![Default::default(); w.keys as usize];
    for (t, k) in arrivals {
        clock.set(t);
        let key = Key::new(k.to_be_bytes());
        let by_counter = store.apply_now(
            Op::Consume,
            &[Check {
                rule: &counter,
                key: &key,
                cost: 1,
            }],
        )[0]
        .allowed;
        let log = &mut admitted[k as usize];
        while log.front().is_some_and(|&ts| ts + period <= t) {
            log.pop_front();
        }
        let by_exact = (log.len() as u64) < w.limit_per_minute;
        if by_counter {
            log.push_back(t);
        }
        let report = &mut reports[(k % w.demand.len() as u64) as usize];
        report.worst_window = report.worst_window.max(log.len() as u64);
        report.requests += 1;
        match (by_counter, by_exact) {
            (true, false) => report.wrongly_allowed += 1,
            (false, true) => report.wrongly_denied += 1,
            _ => {}
        }
    }
    reports
}

/// All classes together.
pub fn total(reports: &[Report]) -> Report {
    reports.iter().fold(Report::default(), |a, r| Report {
        requests: a.requests + r.requests,
        wrongly_allowed: a.wrongly_allowed + r.wrongly_allowed,
        wrongly_denied: a.wrongly_denied + r.wrongly_denied,
        worst_window: a.worst_window.max(r.worst_window),
    })
}

#[allow(dead_code)]
fn main() {
    let mut w = Workload {
        keys: 2_100,
        minutes: 10,
        limit_per_minute: 100,
        seed: 7,
        demand: DEMAND.to_vec(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair.get(1).and_then(|v| v.parse().ok());
        match (pair[0].as_str(), value) {
            ("--keys", Some(v)) => w.keys = v,
            ("--minutes", Some(v)) => w.minutes = v,
            ("--limit", Some(v)) => w.limit_per_minute = v,
            ("--seed", Some(v)) => w.seed = v,
            _ => {
                eprintln!("usage: accuracy [--keys N] [--minutes N] [--limit N] [--seed N]");
                std::process::exit(2);
            }
        }
    }
    let reports = run(&w);
    println!(
        "{} keys, {} simulated minutes, limit {}/min, Poisson arrivals",
        w.keys, w.minutes, w.limit_per_minute
    );
    println!("| demand × limit | requests | wrongly allowed | wrongly denied | most admitted in any 1-min window |");
    println!("|---:|---:|---:|---:|---:|");
    let pct = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
    let row = |label: String, r: &Report| {
        println!(
            "| {label} | {} | {:.4}% | {:.4}% | {} ({:.1}% of the limit) |",
            r.requests,
            pct(r.wrongly_allowed, r.requests),
            pct(r.wrongly_denied, r.requests),
            r.worst_window,
            pct(r.worst_window, w.limit_per_minute),
        );
    };
    for (d, r) in w.demand.iter().zip(&reports) {
        row(format!("{d}"), r);
    }
    row("all".into(), &total(&reports));
}
