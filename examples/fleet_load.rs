//! One process of a fleet for `scripts/bench.sh fleet`: a limiter of its own on a shared Redis,
//! hammering a handful of hot keys with leasing on, for a bounded few seconds.
//!
//! ```text
//! cargo run --release --example fleet_load -- --url redis://127.0.0.1:6379 \
//!     [--keys 4] [--limit 100000] [--seconds 5] [--tasks 8]
//! ```
//!
//! Each key has a fixed window of `--limit` permits per second (so "a window over the limit" is
//! well defined), leased with the default `LeaseConfig::auto()`. Prints one line of totals,
//! `decisions N admitted A lease_calls L seconds S`, then `window KEY END ADMITTED` for every key
//! and window it admitted in: `END` is the window's end in whole seconds of the fleet's clock,
//! read from each decision (`reset_after`), so an admission counts in the window that admitted
//! it however late this process writes it down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fleetlimit::store::RedisStore;
use fleetlimit::{Algorithm, Key, LeaseConfig, Limiter, OnStoreError, Quota, Rule};

const PERIOD_US: u64 = 1_000_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let url = value("--url").ok_or("--url redis://HOST:PORT is required")?;
    let keys: u32 = value("--keys").map_or(Ok(4), |v| v.parse())?;
    let limit: u64 = value("--limit").map_or(Ok(100_000), |v| v.parse())?;
    let seconds: u64 = value("--seconds").map_or(Ok(5), |v| v.parse())?;
    let tasks: usize = value("--tasks").map_or(Ok(8), |v| v.parse())?;
    if !(1..=60).contains(&seconds) || keys == 0 || tasks == 0 {
        return Err("--seconds is 1 to 60; --keys and --tasks at least 1".into());
    }
    // One worker thread: the fleet's processes share the machine's cores.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(url, keys, limit, seconds, tasks))
}

/// Admissions per (key, window end in seconds).
type Windows = HashMap<(u32, u64), u64>;

async fn run(
    url: String,
    keys: u32,
    limit: u64,
    seconds: u64,
    tasks: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let quota = Quota::per_second(limit)
        .algorithm(Algorithm::FixedWindow)
        .build()?;
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(5))
        .connect(&url)
        .await?;
    let limiter = Limiter::builder(store)
        .rule(Rule::new("hot", quota)?)
        .on_store_error(OnStoreError::fail_closed())
        .lease("hot", LeaseConfig::auto())
        .build()?;
    let keys: Arc<Vec<Key>> = Arc::new((0..keys).map(|i| Key::new(format!("hot-{i}"))).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let decisions = Arc::new(AtomicU64::new(0));
    let windows = Arc::new(Mutex::new(Windows::new()));
    let started = Instant::now();
    let workers: Vec<_> = (0..tasks)
        .map(|t| {
            let (limiter, keys, stop, decisions, windows) = (
                limiter.clone(),
                keys.clone(),
                stop.clone(),
                decisions.clone(),
                windows.clone(),
            );
            tokio::spawn(async move {
                let mut mine = Windows::new();
                let mut made = 0u64;
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    // Yield now and then so the timer (and the other tasks) get to run: a
                    // leased decision never waits.
                    for _ in 0..256 {
                        i = (i + 1) % keys.len();
                        let Ok(d) = limiter.consume(&keys[i], 1).await else {
                            continue;
                        };
                        made += 1;
                        if d.allowed {
                            let end = window_end(d.reset_after);
                            *mine.entry((i as u32, end)).or_default() += 1;
                        }
                    }
                    tokio::task::yield_now().await;
                }
                decisions.fetch_add(made, Ordering::Relaxed);
                let mut all = windows.lock().unwrap_or_else(|e| e.into_inner());
                for (k, n) in mine {
                    *all.entry(k).or_default() += n;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let windows = windows.lock().unwrap_or_else(|e| e.into_inner());
    let admitted: u64 = windows.values().sum();
    println!(
        "decisions {} admitted {admitted} lease_calls {} seconds {elapsed:.3}",
        decisions.load(Ordering::Relaxed),
        limiter.stats().lease_calls
    );
    let mut rows: Vec<_> = windows.iter().collect();
    rows.sort();
    for ((key, end), n) in rows {
        println!("window {key} {end} {n}");
    }
    Ok(())
}

/// The end of the window a decision was made in, in whole seconds: now plus the decision's
/// `reset_after`, rounded to the nearest boundary (the clocks of this machine's processes and
/// of Redis agree far closer than half a window).
fn window_end(reset_after: Duration) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let end = now + reset_after.as_micros() as u64;
    (end + PERIOD_US / 2) / PERIOD_US
}
