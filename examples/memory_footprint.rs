//! Memory per entry of the memory store, measured as a user would see it: the process's resident
//! set before and after holding N live (rule, key) entries.
//!
//! ```text
//! cargo run --release --example memory_footprint [-- --keys 1000000 --algorithm sliding-window --sub-windows 20 --key-bytes 13]
//! cargo run --release --example memory_footprint -- --blocks true   # listings: N keys blocked
//! ```

use std::time::Duration;

use fleetlimit::store::{Check, Op};
use fleetlimit::{Algorithm, Key, MemoryStore, Quota, Rule};

/// Resident set size in bytes, from /proc (Linux).
fn rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut keys: usize = 1_000_000;
    let mut algorithm = Algorithm::SlidingWindow;
    let mut sub_windows = None;
    let mut key_bytes: usize = 13;
    let mut blocks = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--keys" => keys = value.parse()?,
            "--algorithm" => algorithm = value.parse()?,
            "--sub-windows" => sub_windows = Some(value.parse()?),
            // The key's length: `user-00000001` is 13; past 37 bytes a key is held in an
            // allocation of its own, past 128 hashed to 32 bytes.
            "--key-bytes" => key_bytes = value.parse()?,
            // Listings instead of states: each key blocked for an hour (as the penalty box or an
            // operator blocks it), held in the store's listings table.
            "--blocks" => blocks = value.parse()?,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let mut quota = Quota::new(100, Duration::from_secs(3600)).algorithm(algorithm);
    if let Some(n) = sub_windows {
        quota = quota.sub_windows(n);
    }
    let rule = Rule::new("api", quota.build()?)?;
    let store = MemoryStore::builder().max_keys(keys + keys / 4).build()?;
    if blocks {
        let limiter = fleetlimit::Limiter::builder(store.clone())
            .rule(rule)
            .build()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()?;
        let before = rss().ok_or("no /proc/self/status")?;
        for i in 0..keys {
            let key = Key::new(format!("user-{i:0>width$}", width = key_bytes.max(13) - 5));
            runtime.block_on(limiter.block(&key, Duration::from_secs(3600)))?;
        }
        let after = rss().ok_or("no /proc/self/status")?;
        println!(
            "blocks: {keys} keys blocked, {:.0} MB resident, {:.0} bytes per block",
            (after - before) as f64 / 1e6,
            (after - before) as f64 / keys as f64
        );
        return Ok(());
    }
    let before = rss().ok_or("no /proc/self/status")?;
    for i in 0..keys {
        // Short keys by default, as an API key prefix or an account id would be.
        let key = Key::new(format!("user-{i:0>width$}", width = key_bytes.max(13) - 5));
        store.check(
            Op::Consume,
            &Check {
                rule: &rule,
                key: &key,
                cost: 1,
            },
        );
    }
    let after = rss().ok_or("no /proc/self/status")?;
    let held = store.len();
    println!(
        "{algorithm}: {held} entries, {:.0} MB resident, {:.0} bytes per entry",
        (after - before) as f64 / 1e6,
        (after - before) as f64 / held as f64
    );
    Ok(())
}
