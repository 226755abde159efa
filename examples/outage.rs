//! What a decision costs when Redis is healthy, paused (accepts, never answers) and dead.
//!
//! Starts its own `redis-server` on a free loopback port, measures decision latency through a
//! `Limiter` (fail open, default 50 ms deadline, default breaker) in each state, prints a table,
//! and kills the server it started (by PID).
//!
//! ```text
//! cargo run --release --example outage [-- --decisions 2000]
//! ```

use std::time::{Duration, Instant};

use fleetlimit::store::RedisStore;
use fleetlimit::{Key, Limiter, OnStoreError, Quota, Rule};

#[path = "../tests/support/redis.rs"]
#[allow(dead_code)]
mod redis_harness;

use redis_harness::RedisServer;

async fn measure(limiter: &Limiter, n: usize) -> (Duration, Duration, Duration, u64) {
    let mut took = Vec::with_capacity(n);
    let mut degraded = 0;
    for i in 0..n {
        let started = Instant::now();
        let d = limiter.consume(&Key::new(format!("k{}", i % 100)), 1).await;
        took.push(started.elapsed());
        degraded += d.map_or(0, |d| u64::from(d.degraded));
    }
    took.sort_unstable();
    (took[n / 2], took[n * 99 / 100], took[n - 1], degraded)
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let n = match std::env::args().skip(1).collect::<Vec<_>>().as_slice() {
        [] => 2_000,
        [flag, v] if flag == "--decisions" => v.parse().map_err(|_| "--decisions N")?,
        _ => return Err("usage: outage [--decisions N]".into()),
    };
    if n == 0 {
        return Err("--decisions must be at least 1".into());
    }
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .map_err(|e| e.to_string())?;
    let rule = Rule::new(
        "outage",
        Quota::per_second(1_000_000)
            .algorithm(fleetlimit::Algorithm::Gcra)
            .build()
            .map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let limiter = Limiter::builder(store)
        .rule(rule)
        .on_store_error(OnStoreError::FailOpen)
        .build()
        .map_err(|e| e.to_string())?;

    println!("| Redis | decisions | p50 | p99 | max | degraded |");
    println!("|---|---:|---:|---:|---:|---:|");
    let row = |state: &str, (p50, p99, max, degraded): (Duration, Duration, Duration, u64)| {
        println!("| {state} | {n} | {p50:.2?} | {p99:.2?} | {max:.2?} | {degraded} |");
    };
    row("healthy", measure(&limiter, n).await);

    server.pause();
    row("paused (SIGSTOP)", measure(&limiter, n).await);
    server.resume();

    server.kill();
    row("dead (killed)", measure(&limiter, n).await);
    Ok(())
}
