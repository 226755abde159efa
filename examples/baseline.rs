//! Baselines for `scripts/bench.sh`: the same hello-world as the demo server, bare or behind
//! `tower_governor`, and the Redis script the demo runs (for `redis-benchmark`).
//!
//! ```text
//! cargo run --release --example baseline -- --kind bare|governor|fleetlimit [--denied] [--port 0]
//! cargo run --release --example baseline -- --kind governor --headers [--denied] [--port 0]
//! cargo run --release --example baseline -- --kind busy --busy-us N [--port 0]
//! cargo run --release --example baseline -- --print-script
//! cargo run --release --example baseline -- --print-args     # 2 KEY LISTING ARG... of one decision
//! ```

use std::net::SocketAddr;

use axum::{routing::get, Router};
use fleetlimit::store::{Check, RedisStore};
use fleetlimit::{Key, Quota, Rule};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    if has("--print-script") {
        print!("{}", RedisStore::script());
        return Ok(());
    }
    if has("--print-args") {
        // The decision the demo server makes with `--limit 1000000000 --period 1s` (its default
        // algorithm), for one key.
        let rule = Rule::new("demo", Quota::per_second(1_000_000_000).build()?)?;
        let key = Key::new("bench");
        let store_key = fleetlimit::store::redis::display_key(&rule, &key);
        let check = Check {
            rule: &rule,
            key: &key,
            cost: 1,
        };
        // The listing key beside it (`<prefix>{<key>}:listing`), as the store sends with every
        // consume: the script reads it, and a baseline without it does less work.
        let tag_end = store_key.find('}').ok_or("a store key has a hash tag")?;
        let listing = format!("{}:listing", &store_key[..=tag_end]);
        println!(
            "2 {store_key} {listing} {}",
            RedisStore::script_args(&check)
                .iter()
                .map(|a| if a.is_empty() {
                    "\"\"".to_owned()
                } else {
                    a.clone()
                })
                .collect::<Vec<_>>()
                .join(" ")
        );
        return Ok(());
    }
    let port: u16 = value("--port").map_or(Ok(0), |p| p.parse())?;
    let app = Router::new().route("/", get(|| async { "ok" }));
    let app = match value("--kind").as_deref() {
        Some("bare") => app,
        // A handler that keeps the CPU busy for N µs before answering: what a layer's cost is
        // worth end to end, in handler time (a scale for the ratios, not a competitor).
        Some("busy") => {
            let busy = std::time::Duration::from_micros(
                value("--busy-us").ok_or("--kind busy needs --busy-us N")?.parse()?,
            );
            Router::new().route(
                "/",
                get(move || async move {
                    let started = std::time::Instant::now();
                    while started.elapsed() < busy {
                        std::hint::spin_loop();
                    }
                    "ok"
                }),
            )
        }
        // The README's quick-start layer on this same hello-world (memory store, default
        // algorithm, keyed by `x-api-key` else the peer address): the layer's own cost, without
        // the demo server's other routes and flags.
        Some("fleetlimit") => {
            let quota = if has("--denied") {
                Quota::per_hour(1)
            } else {
                Quota::per_second(1_000_000_000)
            };
            let limiter = fleetlimit::Limiter::builder(fleetlimit::MemoryStore::new())
                .rule(Rule::new("api", quota.build()?)?)
                .build()?;
            app.layer(
                fleetlimit::RateLimitLayer::builder(limiter)
                    .key(fleetlimit::key::header("x-api-key"))
                    .build()?,
            )
        }
        Some("governor") => {
            let mut config = GovernorConfigBuilder::default();
            if has("--denied") {
                config.per_second(3600).burst_size(1);
            } else {
                config.per_nanosecond(1).burst_size(u32::MAX);
            }
            // `--headers`: tower_governor's own rate-limit headers on every response (limit and
            // remaining), as fleetlimit writes by default; without it, only on denials.
            if has("--headers") {
                let mut config = config.use_headers();
                app.layer(GovernorLayer::new(config.finish().ok_or("governor config")?))
            } else {
                app.layer(GovernorLayer::new(config.finish().ok_or("governor config")?))
            }
        }
        _ => return Err("usage: baseline --kind bare|governor|fleetlimit|busy [--denied] [--headers] [--busy-us N] [--port N] | --print-script | --print-args".into()),
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
