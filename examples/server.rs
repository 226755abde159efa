//! The demo server: `GET /` (200, `ok`) behind a rate limit keyed by `x-api-key`, else the peer
//! address.
//!
//! ```text
//! cargo run --release --example server -- [--port 3000]
//!     [--store memory|redis://HOST:PORT|redis-cluster://HOST:PORT,HOST:PORT,...]
//!     [--algorithm fixed-window|sliding-log|sliding-window|token-bucket|gcra]
//!     [--limit 100] [--period 60s] [--burst N] [--on-store-error open|closed|local]
//!     [--headers draft6|ietf|legacy|none] [--lease auto|off|BLOCK]
//! ```
//!
//! Durations are written `500ms`, `60s`, `1m`, `1h`. For `token-bucket` and `gcra`, `--limit`
//! per `--period` is the refill rate and `--burst` the capacity (default: the limit). Once ready
//! it prints `listening on http://127.0.0.1:PORT` (`--port 0` picks a free port).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::{routing::get, Router};
use fleetlimit::store::RedisStore;
use fleetlimit::{
    key, Algorithm, HeaderStyle, LeaseConfig, Limiter, MemoryStore, OnStoreError, Quota,
    RateLimitLayer, Rule,
};

const USAGE: &str = "usage: server [--port 3000] \
[--store memory|redis://HOST:PORT|redis-cluster://HOST:PORT,HOST:PORT,...] \
[--algorithm fixed-window|sliding-log|sliding-window|token-bucket|gcra] \
[--limit 100] [--period 60s] [--burst N] [--on-store-error open|closed|local] \
[--headers draft6|ietf|legacy|none] [--lease auto|off|BLOCK]";

#[derive(Debug)]
struct Options {
    port: u16,
    store: String,
    algorithm: Algorithm,
    limit: u64,
    period: Duration,
    burst: Option<u64>,
    on_store_error: Option<String>,
    headers: HeaderStyle,
    lease: Option<LeaseConfig>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {s:?} needs a unit: ms, s, m or h (e.g. 60s)"))?;
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("duration {s:?} must start with a whole number"))?;
    let ms_per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => {
            return Err(format!(
                "duration {s:?} has unknown unit {unit:?}; use ms, s, m or h"
            ))
        }
    };
    n.checked_mul(ms_per_unit)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

fn parse_args(args: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut o = Options {
        port: 3000,
        store: "memory".into(),
        algorithm: Algorithm::SlidingWindow,
        limit: 100,
        period: Duration::from_secs(60),
        burst: None,
        on_store_error: None,
        headers: HeaderStyle::Draft6,
        lease: None,
    };
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--port" => {
                let v = value()?;
                o.port = v
                    .parse()
                    .map_err(|_| format!("--port {v:?} is not a port number (0-65535)"))?;
            }
            "--store" => o.store = value()?,
            "--algorithm" => {
                let v = value()?;
                o.algorithm = v.parse().map_err(|e| format!("--algorithm: {e}"))?;
            }
            "--limit" => {
                let v = value()?;
                o.limit = v
                    .parse()
                    .map_err(|_| format!("--limit {v:?} is not a whole number"))?;
            }
            "--period" => {
                o.period = parse_duration(&value()?).map_err(|e| format!("--period: {e}"))?
            }
            "--lease" => {
                let v = value()?;
                o.lease = match v.as_str() {
                    "off" => None,
                    "auto" => Some(LeaseConfig::auto()),
                    n => match n.parse::<u64>() {
                        Ok(block) if block > 0 => Some(LeaseConfig::fixed(block)),
                        _ => {
                            return Err(format!(
                                "--lease {v:?}: expected auto, off or a block size"
                            ))
                        }
                    },
                };
            }
            "--headers" => {
                let v = value()?;
                o.headers = v.parse().map_err(|e| format!("--headers: {e}"))?;
            }
            "--on-store-error" => {
                let v = value()?;
                if !["open", "closed", "local"].contains(&v.as_str()) {
                    return Err(format!(
                        "--on-store-error {v:?}: expected open, closed or local"
                    ));
                }
                o.on_store_error = Some(v);
            }
            "--burst" => {
                let v = value()?;
                o.burst = Some(
                    v.parse()
                        .map_err(|_| format!("--burst {v:?} is not a whole number"))?,
                );
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if StoreKind::parse(&o.store)? != StoreKind::Memory && o.on_store_error.is_none() {
        return Err(
            "--store on Redis needs --on-store-error open|closed|local: what should happen \
             to requests while Redis is unreachable?"
                .into(),
        );
    }
    Ok(o)
}

/// Where the limiter keeps its counters.
#[derive(Debug, PartialEq)]
enum StoreKind {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
}

impl StoreKind {
    fn parse(s: &str) -> Result<StoreKind, String> {
        if s == "memory" {
            Ok(StoreKind::Memory)
        } else if let Some(nodes) = s.strip_prefix("redis-cluster://") {
            let urls: Vec<String> = nodes
                .split(',')
                .filter(|n| !n.is_empty())
                .map(|n| format!("redis://{n}"))
                .collect();
            if urls.is_empty() {
                return Err("--store redis-cluster:// needs at least one HOST:PORT".into());
            }
            Ok(StoreKind::Cluster(urls))
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(StoreKind::Redis(s.to_owned()))
        } else {
            Err(format!(
                "--store {s:?}: expected memory, redis://HOST:PORT or redis-cluster://HOST:PORT,..."
            ))
        }
    }
}

fn build_rule(o: &Options) -> Result<Rule, String> {
    let mut quota = Quota::new(o.limit, o.period).algorithm(o.algorithm);
    if let Some(burst) = o.burst {
        quota = quota.burst(burst);
    }
    let quota = quota.build().map_err(|e| format!("invalid quota: {e}"))?;
    Rule::new("demo", quota).map_err(|e| e.to_string())
}

/// Lease the demo rule's hot keys when asked to.
fn with_lease<S: fleetlimit::Store, P>(
    builder: fleetlimit::LimiterBuilder<S, P>,
    lease: Option<LeaseConfig>,
) -> fleetlimit::LimiterBuilder<S, P> {
    match lease {
        Some(config) => builder.lease("demo", config),
        None => builder,
    }
}

async fn build_layer(o: &Options) -> Result<RateLimitLayer, String> {
    let rule = build_rule(o)?;
    let policy = match o.on_store_error.as_deref() {
        Some("closed") => OnStoreError::fail_closed(),
        // One demo process: the local fallback keeps the same quota.
        Some("local") => OnStoreError::Local(rule.quota().clone()),
        _ => OnStoreError::FailOpen,
    };
    let limiter = match StoreKind::parse(&o.store)? {
        StoreKind::Memory => {
            with_lease(Limiter::builder(MemoryStore::new()).rule(rule), o.lease).build()
        }
        StoreKind::Redis(url) => with_lease(
            Limiter::builder(
                RedisStore::connect(&url)
                    .await
                    .map_err(|e| format!("cannot connect to {url}: {e}"))?,
            )
            .rule(rule)
            .on_store_error(policy),
            o.lease,
        )
        .build(),
        StoreKind::Cluster(urls) => with_lease(
            Limiter::builder(
                RedisStore::cluster(&urls)
                    .await
                    .map_err(|e| format!("cannot connect to the cluster {urls:?}: {e}"))?,
            )
            .rule(rule)
            .on_store_error(policy),
            o.lease,
        )
        .build(),
    }
    .map_err(|e| e.to_string())?;
    RateLimitLayer::builder(limiter)
        .key(key::header("x-api-key"))
        .headers(o.headers)
        .build()
        .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = build_rule(&options) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let layer = match build_layer(&options).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        match serve(options.port, layer).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

async fn serve(port: u16, layer: RateLimitLayer) -> std::io::Result<()> {
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("60").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("99999999999999999999h").is_err());
    }

    #[test]
    fn flags() {
        let o = parse(&[
            "--port",
            "0",
            "--algorithm=gcra",
            "--limit",
            "5",
            "--period",
            "1s",
            "--burst",
            "2",
        ])
        .unwrap();
        assert_eq!(
            (o.port, o.algorithm, o.limit, o.burst),
            (0, Algorithm::Gcra, 5, Some(2))
        );
        assert!(parse(&["--limit"]).is_err());
        assert!(parse(&["--limit", "-1"]).is_err());
        assert!(parse(&["--nope"]).is_err());
        assert!(parse(&["--algorithm", "leaky"]).is_err());
        assert!(parse(&["--store", "postgres"]).is_err());
        assert!(parse(&["--store", "redis-cluster://"]).is_err());
        assert!(
            parse(&["--store", "redis://127.0.0.1:6379"]).is_err(),
            "policy required"
        );
        assert!(parse(&[
            "--store",
            "redis://127.0.0.1:6379",
            "--on-store-error",
            "open"
        ])
        .is_ok());
        assert!(parse(&["--on-store-error", "maybe"]).is_err());
        assert_eq!(
            parse(&["--headers", "ietf"]).unwrap().headers,
            HeaderStyle::Ietf
        );
        assert!(parse(&["--headers", "x"]).is_err());
        assert!(parse(&["--lease", "auto"]).unwrap().lease.is_some());
        assert!(parse(&["--lease", "off"]).unwrap().lease.is_none());
        assert!(parse(&["--lease", "64"]).unwrap().lease.is_some());
        assert!(parse(&["--lease", "0"]).is_err());
        assert!(parse(&["--lease", "lots"]).is_err());
        assert_eq!(
            StoreKind::parse("redis-cluster://127.0.0.1:7000,127.0.0.1:7001"),
            Ok(StoreKind::Cluster(vec![
                "redis://127.0.0.1:7000".into(),
                "redis://127.0.0.1:7001".into()
            ]))
        );
        assert_eq!(
            StoreKind::parse("redis://127.0.0.1:6379"),
            Ok(StoreKind::Redis("redis://127.0.0.1:6379".into()))
        );
        assert!(build_rule(&parse(&["--limit", "0"]).unwrap()).is_err());
        assert!(
            build_rule(&parse(&["--burst", "3"]).unwrap()).is_err(),
            "burst needs token-bucket or gcra"
        );
    }
}
