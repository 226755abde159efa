//! Decisions per second from one process against Redis, for `scripts/bench.sh`.
//!
//! ```text
//! cargo run --release --example redis_load -- --url redis://127.0.0.1:6379 \
//!     [--concurrency 256] [--seconds 5] [--keys 1000] [--lease BLOCK]
//! ```
//! Prints `decisions_per_second N lease_calls M`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleetlimit::store::RedisStore;
use fleetlimit::{Key, LeaseConfig, Limiter, OnStoreError, Quota, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let url = value("--url").ok_or("--url redis://HOST:PORT is required")?;
    let concurrency: usize = value("--concurrency").map_or(Ok(256), |v| v.parse())?;
    let seconds: u64 = value("--seconds").map_or(Ok(5), |v| v.parse())?;
    let keys: u32 = value("--keys").map_or(Ok(1_000), |v| v.parse())?;
    if keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    let lease: Option<u64> = value("--lease").map(|v| v.parse()).transpose()?;

    // The demo server's default algorithm, with a limit no run reaches.
    let rule = Rule::new("demo", Quota::per_second(1_000_000_000).build()?)?;
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(5))
        .connect(&url)
        .await?;
    let mut builder = Limiter::builder(store)
        .rule(rule)
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(5));
    if let Some(block) = lease {
        builder = builder.lease("demo", LeaseConfig::fixed(block).max_share(1.0));
    }
    let limiter = builder.build()?;
    let keys: Arc<Vec<Key>> = Arc::new((0..keys).map(|i| Key::new(i.to_be_bytes())).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (limiter, keys, stop, done) =
                (limiter.clone(), keys.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    i = (i + 7919) % keys.len();
                    if limiter.consume(&keys[i], 1).await.is_ok() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    println!(
        "decisions_per_second {rate:.0} lease_calls {}",
        limiter.stats().lease_calls
    );
    Ok(())
}
