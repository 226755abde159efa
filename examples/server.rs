//! The demo server: `GET /` (200, `ok`) behind a rate limit keyed by `x-api-key`, else the peer
//! address.
//!
//! ```text
//! cargo run --release --example server -- [--port 3000]
//!     [--store memory|redis://HOST:PORT|rediss://HOST:PORT|redis-cluster://HOST:PORT,HOST:PORT,...|redis-sentinel://HOST:PORT,.../MASTER]
//!     [--algorithm fixed-window|sliding-log|sliding-window|token-bucket|gcra]
//!     [--limit 100] [--period 60s] [--burst N] [--on-store-error open|closed|local]
//!     [--headers draft6|ietf|legacy|none] [--lease auto|off|BLOCK]
//!     [--max-keys N] [--refund-status LIST]
//!     [--trusted-proxies CIDR[,CIDR...] | --trusted-hops N]
//!     [--redis-ca FILE]                         (with --store rediss://HOST:PORT)
//!     [--rules FILE]                            (in place of --algorithm/--limit/--period/--burst)
//!     [--admin-token TOKEN]                     (key administration at /admin)
//!     [--concurrency N]                         (at most N requests in flight per key, fleet-wide)
//!     [--metrics ADDR]                          (Prometheus text at http://ADDR/metrics)
//! ```
//!
//! `--store` also takes `rediss://HOST:PORT` (TLS; `--redis-ca` names the CA to trust) and
//! `redis-sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME`. A Redis store that does not answer
//! yet is no reason not to start: the outage policy decides until it does.
//!
//! Durations are written `500ms`, `60s`, `1m`, `1h`. For `token-bucket` and `gcra`, `--limit`
//! per `--period` is the refill rate and `--burst` the capacity (default: the limit). Once ready
//! it prints `listening on http://127.0.0.1:PORT` (`--port 0` picks a free port).
//!
//! Routes: `GET /` answers `ok`; `GET /status/{code}` answers with that status (200-999; a 1xx
//! is a 400); on both, `?sleep_ms=N` delays the answer by N ms (a slow handler; above 600000,
//! a 400). SIGINT or SIGTERM stops the server: it waits up to 5 s for the requests in flight,
//! gives its leased permits back and exits 0. `--refund-status 500-599,429` gives
//! the permits of requests answered with one of those statuses back (through their receipts).
//! `--max-keys N` bounds the memory store. `--trusted-proxies` (address ranges) or
//! `--trusted-hops` (a count of proxies in front) makes requests without an API key count
//! against the client address the proxies report, not the proxy's. `--rules FILE` takes the
//! rules from a TOML file (`[[rule]]` tables with `name`, `algorithm`, `limit`, `period`, optional
//! `burst`; every rule keyed like the single one unless its `scope` names a key) and reloads it when it changes, once two polls
//! 250 ms apart read the new text alike (never half-written), logging what changed; a file that cannot be used keeps the running rules and logs why.
//! `--admin-token TOKEN` mounts the key administration endpoints
//! of `fleetlimit::admin` at `/admin` (`GET /admin/keys/{key}`, `DELETE /admin/keys/{key}`,
//! `POST /admin/keys/{key}/block?seconds=N`, ...; `{key}` is the `x-api-key` value), answering
//! 401 to any request without `Authorization: Bearer TOKEN`; they are not rate limited.
//! `--concurrency N` adds a fleet-wide limit of N requests in flight per key (the rate limit's
//! key; slots expire 5 s after a killed process stops renewing them), and `GET /inflight`
//! answers how many requests this process has in its handlers (a plain integer, not limited).
//! `--metrics ADDR` serves the limiter's metrics (listed in the README's "Metrics") as
//! Prometheus text at `http://ADDR/metrics`.
//! `--help` prints the usage;
//! an invalid command line exits 2 with a message on stderr, a failure to start exits 1.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::extract::{Path, Query};
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use axum::{routing::get, Router};
use fleetlimit::concurrency::{ConcurrencyLimitLayer, ConcurrencyLimiter};
use fleetlimit::config::RuleSet;
use fleetlimit::key::{PeerIp, TrustedProxies};
use fleetlimit::store::RedisStore;
use fleetlimit::{
    key, Algorithm, HeaderStyle, LeaseConfig, Limiter, MemoryStore, OnStoreError, Quota,
    RateLimitLayer, Rule, Scope,
};

const USAGE: &str = "usage: server [--port 3000] \
[--store memory|redis://HOST:PORT|rediss://HOST:PORT|redis-cluster://HOST:PORT,...|\
redis-sentinel://HOST:PORT,.../MASTER] \
[--algorithm fixed-window|sliding-log|sliding-window|token-bucket|gcra] \
[--limit 100] [--period 60s] [--burst N] [--on-store-error open|closed|local] \
[--headers draft6|ietf|legacy|none] [--lease auto|off|BLOCK] \
[--max-keys N] [--refund-status LIST (e.g. 500-599,429)] \
[--trusted-proxies CIDR[,CIDR...] | --trusted-hops N] [--redis-ca FILE] [--rules FILE] \
[--admin-token TOKEN] [--concurrency N] [--metrics ADDR]";

/// The longest `?sleep_ms=` the demo honours.
const MAX_SLEEP_MS: u64 = 600_000;

#[derive(Debug, Clone)]
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
    max_keys: Option<usize>,
    refund_status: Vec<RangeInclusive<u16>>,
    trusted: Option<TrustedProxies>,
    redis_ca: Option<String>,
    /// `--rules FILE`: the rules, reloaded when the file changes.
    rules_file: Option<std::path::PathBuf>,
    /// `--admin-token TOKEN`: mount the admin endpoints at `/admin`, for this bearer token.
    admin_token: Option<String>,
    /// `--concurrency N`: at most N requests in flight per key, across the fleet.
    concurrency: Option<u64>,
    /// `--metrics ADDR`: serve Prometheus text at `http://ADDR/metrics`.
    metrics: Option<SocketAddr>,
}

/// What the command line asked for: run, or print the usage.
#[derive(Debug)]
enum Command {
    Run(Box<Options>),
    Help,
}

/// A whole number written with digits only (no sign, no spaces).
fn parse_number<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{flag} {v:?} is not a whole number"));
    }
    v.parse()
        .map_err(|_| format!("{flag} {v:?} is out of range"))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {s:?} needs a unit: ms, s, m or h (e.g. 60s)"))?;
    let (digits, unit) = s.split_at(split);
    let n: u64 = parse_number("duration", digits)
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

/// `500-599,429` → the statuses 500 to 599 and 429.
fn parse_statuses(v: &str) -> Result<Vec<RangeInclusive<u16>>, String> {
    let status = |s: &str| -> Result<u16, String> {
        let n: u16 = parse_number("--refund-status", s)?;
        if (100..=999).contains(&n) {
            Ok(n)
        } else {
            Err(format!(
                "--refund-status: {s:?} is not an HTTP status (100-999)"
            ))
        }
    };
    v.split(',')
        .map(|part| match part.split_once('-') {
            Some((from, to)) => {
                let (from, to) = (status(from)?, status(to)?);
                if from > to {
                    return Err(format!("--refund-status: {part:?} is an empty range"));
                }
                Ok(from..=to)
            }
            None => status(part).map(|n| n..=n),
        })
        .collect()
}

/// A Redis URL with its password (if any) replaced, fit for messages and logs. Without a
/// scheme (forgotten or mistyped), whatever comes before an `@` is taken for credentials.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return match url.rsplit_once('@') {
            Some((_, host)) => format!("***@{host}"),
            None => url.to_owned(),
        };
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_owned(),
    }
}

fn parse_args(args: impl Iterator<Item = String>) -> Result<Command, String> {
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
        max_keys: None,
        refund_status: Vec::new(),
        trusted: None,
        redis_ca: None,
        rules_file: None,
        admin_token: None,
        concurrency: None,
        metrics: None,
    };
    let mut seen = HashSet::new();
    let mut args = args.peekable();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        if flag == "--help" || flag == "-h" {
            return Ok(Command::Help);
        }
        if flag.starts_with('-') && !seen.insert(flag.clone()) {
            return Err(format!("{flag} is given twice"));
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
                o.port = parse_number("--port", &v)
                    .map_err(|_| format!("--port {v:?} is not a port number (0-65535)"))?;
            }
            "--store" => o.store = value()?,
            "--algorithm" => {
                let v = value()?;
                o.algorithm = v.parse().map_err(|e| format!("--algorithm: {e}"))?;
            }
            "--limit" => o.limit = parse_number("--limit", &value()?)?,
            "--period" => {
                o.period = parse_duration(&value()?).map_err(|e| format!("--period: {e}"))?
            }
            "--lease" => {
                let v = value()?;
                o.lease = match v.as_str() {
                    "off" => None,
                    "auto" => Some(LeaseConfig::auto()),
                    n => match parse_number::<u64>("--lease", n) {
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
            "--burst" => o.burst = Some(parse_number("--burst", &value()?)?),
            "--max-keys" => o.max_keys = Some(parse_number("--max-keys", &value()?)?),
            "--refund-status" => o.refund_status = parse_statuses(&value()?)?,
            "--redis-ca" => o.redis_ca = Some(value()?),
            "--rules" => o.rules_file = Some(value()?.into()),
            "--metrics" => {
                let v = value()?;
                o.metrics = Some(v.parse().map_err(|_| {
                    format!("--metrics {v:?}: expected an address such as 127.0.0.1:9090")
                })?);
            }
            "--concurrency" => {
                let v = value()?;
                match parse_number::<u64>("--concurrency", &v) {
                    Ok(n) if n > 0 => o.concurrency = Some(n),
                    _ => {
                        return Err(format!(
                            "--concurrency {v:?}: expected a whole number, at least 1"
                        ))
                    }
                }
            }
            "--admin-token" => {
                let token = value()?;
                let printable = token.bytes().all(|b| b.is_ascii_graphic());
                if token.is_empty() || !printable {
                    return Err("--admin-token: visible ASCII characters, no spaces".into());
                }
                o.admin_token = Some(token);
            }
            "--trusted-proxies" | "--trusted-hops" if o.trusted.is_some() => {
                return Err("--trusted-proxies and --trusted-hops exclude each other".into())
            }
            "--trusted-proxies" => {
                let v = value()?;
                o.trusted = Some(
                    TrustedProxies::new(v.split(','))
                        .map_err(|e| format!("--trusted-proxies: {e}"))?,
                );
            }
            "--trusted-hops" => {
                let hops: u8 = parse_number("--trusted-hops", &value()?)?;
                o.trusted =
                    Some(TrustedProxies::hops(hops).map_err(|e| format!("--trusted-hops: {e}"))?);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let store = StoreKind::parse(&o.store)?;
    if store != StoreKind::Memory && o.on_store_error.is_none() {
        return Err(
            "--store on Redis needs --on-store-error open|closed|local: what should happen \
             to requests while Redis is unreachable?"
                .into(),
        );
    }
    if o.redis_ca.is_some() && !o.store.starts_with("rediss://") {
        return Err("--redis-ca goes with --store rediss://HOST:PORT".into());
    }
    if let Some(path) = &o.redis_ca {
        // A missing or wrong CA file is a command-line error, before anything starts.
        let pem = std::fs::read(path).map_err(|e| format!("--redis-ca {path:?}: {e}"))?;
        if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
            return Err(format!("--redis-ca {path:?} holds no PEM certificate"));
        }
    }
    if o.rules_file.is_some() {
        let single = ["--algorithm", "--limit", "--period", "--burst", "--lease"];
        if let Some(flag) = single.iter().find(|f| seen.contains(**f)) {
            return Err(format!(
                "{flag} sets the single rule of the command line; with --rules the file sets every rule"
            ));
        }
    }
    if store != StoreKind::Memory && o.max_keys.is_some() {
        return Err("--max-keys bounds the memory store; it does not apply to Redis".into());
    }
    validate(&o)?;
    Ok(Command::Run(Box::new(o)))
}

/// Everything the library would reject when the server starts, checked before: a bad quota,
/// a lease on an algorithm that cannot be leased, a key bound the store refuses.
fn validate(o: &Options) -> Result<(), String> {
    let set = load_rules(o)?;
    let store = DemoStore::Memory(memory_store(o)?);
    let limiter = build_limiter(&store, &set.rules, o)?;
    build_layer(limiter, &set, o).map(|_| ())
}

/// The rules (and their scopes): from `--rules FILE`, or the single rule of the command line.
fn load_rules(o: &Options) -> Result<RuleSet, String> {
    match &o.rules_file {
        Some(path) => read_rules(path).map_err(|e| format!("--rules {}: {e}", path.display())),
        None => Ok(RuleSet {
            rules: vec![build_rule(o)?],
            scopes: Vec::new(),
        }),
    }
}

fn read_rules(path: &std::path::Path) -> Result<RuleSet, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    RuleSet::from_toml(&text).map_err(|e| e.to_string())
}

fn memory_store(o: &Options) -> Result<MemoryStore, String> {
    match o.max_keys {
        Some(n) => MemoryStore::builder()
            .max_keys(n)
            .build()
            .map_err(|e| format!("--max-keys: {e}")),
        None => Ok(MemoryStore::new()),
    }
}

/// Where the limiter keeps its counters.
#[derive(Debug, PartialEq)]
enum StoreKind {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
    /// Sentinel URLs and the master's name.
    Sentinel(Vec<String>, String),
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
        } else if let Some(rest) = s.strip_prefix("redis-sentinel://") {
            let (nodes, master) = rest.rsplit_once('/').unwrap_or((rest, ""));
            let urls: Vec<String> = nodes
                .split(',')
                .filter(|n| !n.is_empty())
                .map(|n| format!("redis://{n}"))
                .collect();
            if urls.is_empty() || master.is_empty() {
                return Err(
                    "--store redis-sentinel:// needs HOST:PORT[,HOST:PORT...]/MASTER_NAME".into(),
                );
            }
            Ok(StoreKind::Sentinel(urls, master.to_owned()))
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(StoreKind::Redis(s.to_owned()))
        } else {
            Err(format!(
                "--store {:?}: expected memory, redis://HOST:PORT, rediss://HOST:PORT, \
                 redis-cluster://HOST:PORT,... or redis-sentinel://HOST:PORT,.../MASTER",
                redact(s)
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

/// The Redis store's settings: `--redis-ca`.
fn redis_builder(o: &Options) -> Result<fleetlimit::store::RedisStoreBuilder, String> {
    let mut builder = RedisStore::builder();
    if let Some(path) = &o.redis_ca {
        let pem =
            std::fs::read(path).map_err(|e| format!("--redis-ca {path:?} cannot be read: {e}"))?;
        builder = builder.ca_certificate(pem);
    }
    Ok(builder)
}

/// Where the counters live; kept across rule reloads, so a reloaded rule keeps its state.
#[derive(Clone)]
enum DemoStore {
    Memory(MemoryStore),
    Redis(RedisStore),
}

/// Why the store could not be opened: a value the command line gave that cannot be used (a
/// malformed URL, a certificate that does not parse: exit 2, as any bad flag), or anything else.
struct StoreFailure {
    message: String,
    bad_value: bool,
}

impl From<String> for StoreFailure {
    fn from(message: String) -> Self {
        StoreFailure {
            message,
            bad_value: true,
        }
    }
}

impl StoreFailure {
    fn of(error: &fleetlimit::Error, message: String) -> StoreFailure {
        StoreFailure {
            message,
            bad_value: matches!(error, fleetlimit::Error::Config(_)),
        }
    }
}

async fn open_store(o: &Options) -> Result<DemoStore, StoreFailure> {
    Ok(match StoreKind::parse(&o.store)? {
        StoreKind::Memory => DemoStore::Memory(memory_store(o)?),
        StoreKind::Redis(url) => {
            DemoStore::Redis(redis_builder(o)?.connect(&url).await.map_err(|e| {
                // redis-rs errors may quote the URL: never print the password.
                let message = e.to_string().replace(&url, &redact(&url));
                StoreFailure::of(&e, format!("cannot connect to {}: {message}", redact(&url)))
            })?)
        }
        StoreKind::Cluster(urls) => {
            DemoStore::Redis(redis_builder(o)?.cluster(&urls).await.map_err(|e| {
                let shown: Vec<String> = urls.iter().map(|u| redact(u)).collect();
                StoreFailure::of(&e, format!("cannot connect to the cluster {shown:?}: {e}"))
            })?)
        }
        StoreKind::Sentinel(urls, master) => DemoStore::Redis(
            redis_builder(o)?
                .sentinel(&urls, &master)
                .await
                .map_err(|e| {
                    StoreFailure::of(&e, format!("cannot use the Sentinels for {master:?}: {e}"))
                })?,
        ),
    })
}

fn build_limiter(store: &DemoStore, rules: &[Rule], o: &Options) -> Result<Limiter, String> {
    let policy = match o.on_store_error.as_deref() {
        Some("closed") => OnStoreError::fail_closed(),
        // One demo process: the local fallback keeps each rule's quota.
        Some("local") => OnStoreError::LocalShare(1),
        _ => OnStoreError::FailOpen,
    };
    match store {
        DemoStore::Memory(s) => {
            let b = rules
                .iter()
                .cloned()
                .fold(Limiter::builder(s.clone()), |b, r| b.rule(r));
            with_lease(b, o.lease).build()
        }
        DemoStore::Redis(s) => {
            let b = rules
                .iter()
                .cloned()
                .fold(Limiter::builder(s.clone()), |b, r| b.rule(r));
            with_lease(b.on_store_error(policy), o.lease).build()
        }
    }
    .map_err(|e| e.to_string())
}

fn build_layer(limiter: Limiter, set: &RuleSet, o: &Options) -> Result<RateLimitLayer, String> {
    let names: Vec<String> = limiter
        .rules()
        .iter()
        .map(|r| r.name().to_owned())
        .collect();
    let mut builder = RateLimitLayer::builder(limiter)
        .key(key::header("x-api-key"))
        .headers(o.headers);
    if let Some(trusted) = &o.trusted {
        builder = builder.peer_ip(PeerIp::default().trust(trusted.clone()));
    }
    if !o.refund_status.is_empty() {
        for name in &names {
            let statuses = o.refund_status.clone();
            builder = builder.scope(
                name,
                Scope::new().refund_if(move |s| statuses.iter().any(|r| r.contains(&s.as_u16()))),
            );
        }
    }
    // A rule's scope in the file replaces the command line's for that rule.
    let builder = set.scope(builder).map_err(|e| e.to_string())?;
    builder.build().map_err(|e| e.to_string())
}

/// Writes log lines to stderr with every secret (a Redis password) replaced.
#[derive(Clone)]
struct Redacted {
    secrets: std::sync::Arc<Vec<String>>,
}

impl std::io::Write for Redacted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut line = String::from_utf8_lossy(buf).into_owned();
        for secret in self.secrets.iter() {
            line = line.replace(secret.as_str(), "***");
        }
        std::io::stderr().write_all(line.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Redacted {
    type Writer = Redacted;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// The passwords in a store URL (`redis://user:PASSWORD@host`), to keep out of logs.
fn secrets(store: &str) -> Vec<String> {
    store
        .split(',')
        .filter_map(|part| {
            let rest = part.split_once("://").map_or(part, |(_, r)| r);
            let (userinfo, _) = rest.rsplit_once('@')?;
            let (_, password) = userinfo.split_once(':')?;
            (!password.is_empty()).then(|| password.to_owned())
        })
        .collect()
}

fn main() -> ExitCode {
    // An argument echoed in an error (a URL given where another value was due, or with no
    // flag) keeps its password out of the message, whatever flag it came with.
    let hide = |text: String, args: &[String]| {
        args.iter()
            .flat_map(|arg| secrets(arg))
            .fold(text, |text, secret| text.replace(&secret, "***"))
    };
    let mut args = Vec::new();
    for arg in std::env::args_os().skip(1) {
        match arg.into_string() {
            Ok(arg) => args.push(arg),
            Err(arg) => {
                let lossy = arg.to_string_lossy().into_owned();
                let shown = hide(lossy.clone(), &[&args[..], &[lossy]].concat());
                eprintln!("error: argument {shown:?} is not valid UTF-8");
                return ExitCode::from(2);
            }
        }
    }
    let options = match parse_args(args.iter().cloned()) {
        Ok(Command::Run(o)) => o,
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {}", hide(e.to_string(), &args));
            return ExitCode::from(2);
        }
    };
    // Logs (breakers, an unreachable Redis) go to stderr, passwords replaced.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(Redacted {
            secrets: std::sync::Arc::new(secrets(&options.store)),
        })
        .with_ansi(false)
        .try_init();
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
        if let Some(addr) = options.metrics {
            if let Err(e) = serve_metrics(addr).await {
                eprintln!("error: --metrics {addr}: {e}");
                return ExitCode::FAILURE;
            }
        }
        let store = match open_store(&options).await {
            Ok(store) => store,
            Err(failure) => {
                eprintln!("error: {}", failure.message);
                return if failure.bad_value {
                    ExitCode::from(2)
                } else {
                    ExitCode::FAILURE
                };
            }
        };
        let started = async {
            let rules = load_rules(&options)?;
            let limiter = build_limiter(&store, &rules.rules, &options)?;
            let layer = build_layer(limiter.clone(), &rules, &options)?;
            Ok::<_, String>((store, rules, limiter, layer))
        };
        let (store, rules, limiter, layer) = match started.await {
            Ok(started) => started,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        let concurrency = match options.concurrency {
            Some(n) => match build_concurrency(&store, n, &options) {
                Ok(layer) => Some(layer),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            },
            None => None,
        };
        // In-flight requests are limited inside the rate limit: a refused request is refunded.
        let routes = || match &concurrency {
            Some(layer) => routes().layer(layer.clone()),
            None => routes(),
        };
        // The limiter in force when the server stops: its leased blocks go back then.
        let in_force: Box<dyn Fn() -> Limiter + Send>;
        let (app, admin) = match &options.rules_file {
            Some(path) => {
                let active = Arc::new(ArcSwap::from_pointee(Active {
                    limiter,
                    layer,
                    scopes: rules.scopes.clone(),
                }));
                let reloader = Reloader {
                    store,
                    options: options.clone(),
                    active: active.clone(),
                    algorithms: rules
                        .rules
                        .iter()
                        .map(|r| (r.name().to_owned(), r.quota().algorithm()))
                        .collect(),
                };
                tokio::spawn(reloader.watch(path.clone(), rules));
                let current = active.clone();
                let admin = fleetlimit::admin::router_with(move || current.load().limiter.clone());
                let current = active.clone();
                in_force = Box::new(move || current.load().limiter.clone());
                (routes().layer(Current(active)), admin)
            }
            None => {
                let kept = limiter.clone();
                in_force = Box::new(move || kept.clone());
                (routes().layer(layer), fleetlimit::admin::router(limiter))
            }
        };
        let app = if concurrency.is_some() {
            IN_HANDLERS_COUNTED.store(true, std::sync::atomic::Ordering::Relaxed);
            app.route(
                "/inflight",
                get(|| async {
                    IN_HANDLERS
                        .load(std::sync::atomic::Ordering::SeqCst)
                        .to_string()
                }),
            )
        } else {
            app
        };
        let app = match &options.admin_token {
            // Not rate limited: it is how an operator lifts a limit.
            // A fallback of its own, so that unknown admin paths are behind the token too (a
            // nested router without one falls through to the app's 404, which maps the routes
            // for anyone).
            Some(token) => app.nest(
                "/admin",
                admin
                    .fallback(|| async { http::StatusCode::NOT_FOUND })
                    .layer(axum::middleware::from_fn_with_state(
                        Arc::<str>::from(format!("Bearer {token}")),
                        operator_only,
                    )),
            ),
            None => app,
        };
        if let Err(e) = serve(options.port, app).await {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        // Blocks kept past the exit would be counted until their window ends or the bucket
        // refills: on every instance a rolling deploy restarts.
        let released = tokio::time::timeout(RELEASE_TIME, in_force().release_leases()).await;
        if released.is_err() {
            eprintln!("warning: leased permits not all given back within {RELEASE_TIME:?}");
        }
        ExitCode::SUCCESS
    })
}

/// The admin endpoints answer only requests carrying the operator's bearer token.
async fn operator_only(
    axum::extract::State(expected): axum::extract::State<Arc<str>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if given.is_some_and(|g| constant_time_eq(g, expected.as_bytes())) {
        next.run(req).await
    } else {
        axum::response::IntoResponse::into_response((
            StatusCode::UNAUTHORIZED,
            [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
            "admin endpoints need Authorization: Bearer TOKEN",
        ))
    }
}

/// Compare in a time that depends on the expected token's length alone: no early return at the
/// first different byte, nor at a length that differs (no timing hint to a guesser, not even of
/// the token's length).
fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let differs = expected.iter().enumerate().fold(0u8, |acc, (i, e)| {
        acc | (e ^ given.get(i).copied().unwrap_or(0))
    });
    differs == 0 && given.len() == expected.len()
}

/// The request's `?sleep_ms=N`; a request without a query (nearly all) parses nothing.
fn slow(uri: &Uri) -> Result<Slow, axum::extract::rejection::QueryRejection> {
    match uri.query() {
        None => Ok(Slow { sleep_ms: None }),
        Some(_) => Query::try_from_uri(uri).map(|Query(slow)| slow),
    }
}

/// `?sleep_ms=N`: how long the handler takes.
#[derive(Debug, serde::Deserialize)]
struct Slow {
    sleep_ms: Option<u64>,
}

/// Install the Prometheus recorder and serve its text at `http://addr/metrics`.
async fn serve_metrics(addr: SocketAddr) -> Result<(), String> {
    // Buckets from 100 µs to 100 ms, so the dashboard can compute store latency quantiles.
    let buckets = [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    ];
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("fleetlimit_store_call_seconds".into()),
            &buckets,
        )
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| e.to_string())?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(())
}

/// Whether `/inflight` is served (`--concurrency`): only then are handlers counted.
static IN_HANDLERS_COUNTED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Requests in this process's handlers right now (`GET /inflight`).
static IN_HANDLERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts a request as in a handler while it lives.
struct InHandler;

impl InHandler {
    fn enter() -> InHandler {
        IN_HANDLERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InHandler
    }
}

impl Drop for InHandler {
    fn drop(&mut self) {
        IN_HANDLERS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A fleet-wide limit on requests in flight per key (`--concurrency N`), keyed like the rate
/// limit, with the same outage policy.
fn build_concurrency(
    store: &DemoStore,
    limit: u64,
    o: &Options,
) -> Result<ConcurrencyLimitLayer, String> {
    let policy = match o.on_store_error.as_deref() {
        Some("closed") => OnStoreError::fail_closed(),
        Some("local") => OnStoreError::LocalShare(1),
        _ => OnStoreError::FailOpen,
    };
    let limiter = match store {
        DemoStore::Memory(s) => {
            ConcurrencyLimiter::builder(s.clone(), "demo-concurrency", limit).build()
        }
        DemoStore::Redis(s) => ConcurrencyLimiter::builder(s.clone(), "demo-concurrency", limit)
            .on_store_error(policy)
            .build(),
    }
    .map_err(|e| e.to_string())?;
    let mut builder = ConcurrencyLimitLayer::builder(limiter).key(key::header("x-api-key"));
    if let Some(trusted) = &o.trusted {
        builder = builder.peer_ip(PeerIp::default().trust(trusted.clone()));
    }
    builder.build().map_err(|e| e.to_string())
}

async fn answer(status: StatusCode, slow: Slow) -> (StatusCode, &'static str) {
    let _in_handler = IN_HANDLERS_COUNTED
        .load(std::sync::atomic::Ordering::Relaxed)
        .then(InHandler::enter);
    match slow.sleep_ms {
        Some(ms) if ms > MAX_SLEEP_MS => (StatusCode::BAD_REQUEST, "sleep_ms is at most 600000"),
        Some(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            (status, "ok")
        }
        None => (status, "ok"),
    }
}

fn routes() -> Router {
    Router::new()
        .route(
            "/",
            get(|uri: Uri| async move {
                match slow(&uri) {
                    Ok(slow) => answer(StatusCode::OK, slow).await.into_response(),
                    Err(rejection) => rejection.into_response(),
                }
            }),
        )
        .route(
            "/status/{code}",
            get(
                |Path(code): Path<String>, Query(slow): Query<Slow>| async move {
                    // A 1xx is not a final answer: hyper would send a 500 in its place.
                    match parse_number::<u16>("status", &code)
                        .ok()
                        .and_then(|c| StatusCode::from_u16(c).ok())
                    {
                        Some(status) if status.is_informational() => {
                            (StatusCode::BAD_REQUEST, "not a final HTTP status (200-999)")
                        }
                        Some(status) => answer(status, slow).await,
                        None => (StatusCode::BAD_REQUEST, "not an HTTP status"),
                    }
                },
            ),
        )
}

/// How long a stopping server waits for the requests in flight.
const DRAIN_TIME: Duration = Duration::from_secs(5);

/// How long a stopping server waits for its leased blocks to go back.
const RELEASE_TIME: Duration = Duration::from_secs(2);

/// Serve until SIGINT or SIGTERM, then let the requests in flight finish, for
/// [`DRAIN_TIME`] at most (a slow handler must not hold a deploy up).
async fn serve(port: u16, app: Router) -> std::io::Result<()> {
    // Listened for before the server says it is ready: a signal sent as soon as it does must
    // stop it, not kill it.
    let stop = stop_signal()?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    let stopping = Arc::new(tokio::sync::Notify::new());
    let server = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown({
        let stopping = stopping.clone();
        async move {
            stop.await;
            stopping.notify_one();
        }
    });
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served,
        () = async {
            stopping.notified().await;
            tokio::time::sleep(DRAIN_TIME).await;
        } => {
            eprintln!("warning: requests still in flight after {DRAIN_TIME:?}, stopping anyway");
            Ok(())
        }
    }
}

/// SIGINT (Ctrl-C) or, on Unix, SIGTERM (what a deploy sends): listened for from this call on.
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (mut interrupt, mut terminate) = (
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        );
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        let ctrl_c = tokio::signal::ctrl_c();
        Ok(async move {
            let _ = ctrl_c.await;
        })
    }
}

/// The limiter and layer in force, replaced as a whole when `--rules` changes the rule names.
struct Active {
    limiter: Limiter,
    layer: RateLimitLayer,
    /// The scopes the layer was built with.
    scopes: Vec<(String, fleetlimit::config::ScopeConfig)>,
}

fn running_scopes_differ(active: &ArcSwap<Active>, set: &RuleSet) -> bool {
    active.load().scopes != set.scopes
}

/// A layer that applies whichever rate-limit layer is active at each request.
#[derive(Clone)]
struct Current(Arc<ArcSwap<Active>>);

impl<S> tower::Layer<S> for Current {
    type Service = CurrentService<S>;

    fn layer(&self, inner: S) -> CurrentService<S> {
        CurrentService {
            inner,
            active: self.0.clone(),
        }
    }
}

#[derive(Clone)]
struct CurrentService<S> {
    inner: S,
    active: Arc<ArcSwap<Active>>,
}

impl<S, B, R> tower::Service<axum::http::Request<B>> for CurrentService<S>
where
    S: tower::Service<axum::http::Request<B>, Response = axum::http::Response<R>> + Clone,
    B: http_body::Body,
{
    type Response = axum::http::Response<fleetlimit::layer::ResponseBody<R>>;
    type Error = S::Error;
    type Future = fleetlimit::layer::ResponseFuture<S, B>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        let mut service = tower::Layer::layer(&self.active.load().layer, ready);
        service.call(req)
    }
}

/// Watches the rules file and puts its rules in force.
struct Reloader {
    store: DemoStore,
    options: Box<Options>,
    active: Arc<ArcSwap<Active>>,
    /// The algorithm of every rule name this server has run: a name removed and then added
    /// back under another algorithm would start every key afresh too.
    algorithms: std::collections::HashMap<String, Algorithm>,
}

/// How often the rules file is read (a change is in force within this, plus a decision).
const RULES_POLL: Duration = Duration::from_millis(250);

fn describe(q: &Quota) -> String {
    let mut s = format!(
        "{} {} per {}",
        q.algorithm(),
        q.limit(),
        fleetlimit::config::format_period(q.period())
    );
    if matches!(q.algorithm(), Algorithm::TokenBucket | Algorithm::Gcra) {
        s.push_str(&format!(", burst {}", q.burst()));
    }
    s
}

impl Reloader {
    async fn watch(mut self, path: std::path::PathBuf, mut running: RuleSet) {
        // No text acted on yet: the file is compared with the rules in force once it settles,
        // so an edit made while the server started is not taken as already applied.
        let mut acted: Option<String> = None;
        // The text the previous poll read: a text is acted on once two polls in a row read it,
        // so a file written in place (`cat new.toml > rules.toml`, an editor saving in place)
        // is never applied half-written.
        let mut last_read: Option<String> = None;
        loop {
            tokio::time::sleep(RULES_POLL).await;
            let text = match tokio::fs::read_to_string(&path).await {
                Ok(text) => text,
                Err(e) => {
                    if last_read.take().is_some() {
                        tracing::warn!(path = %path.display(), error = %e, "rules file unreadable; keeping the running rules");
                    }
                    continue;
                }
            };
            let settled = last_read.as_deref() == Some(text.as_str());
            last_read = Some(text.clone());
            if !settled || acted.as_deref() == Some(text.as_str()) {
                continue;
            }
            acted = Some(text.clone());
            match RuleSet::from_toml(&text) {
                Err(e) => tracing::warn!(
                    path = %path.display(),
                    error = %e,
                    "rules file invalid; keeping the running rules"
                ),
                Ok(rules) if rules == running => {}
                Ok(rules) => match self.put_in_force(&running, &rules) {
                    Ok(()) => {
                        for rule in &rules.rules {
                            self.algorithms
                                .insert(rule.name().to_owned(), rule.quota().algorithm());
                        }
                        running = rules;
                    }
                    Err(e) => tracing::warn!(
                        path = %path.display(),
                        error = %e,
                        "rules file rejected; keeping the running rules"
                    ),
                },
            }
        }
    }

    /// Put `rules` in force: new quotas on the running limiter when only quotas changed, else
    /// a new limiter on the same store (so every rule keeps its state in the store).
    fn put_in_force(&self, running: &RuleSet, set: &RuleSet) -> Result<(), String> {
        let (running, rules) = (&running.rules, &set.rules);
        // A state's format is its algorithm's: under another algorithm a rule would start
        // every key afresh (a new quota's worth at once), as `set_quotas` refuses to; so would
        // a rule removed and later added back under another one.
        for new in rules {
            if let Some(&old) = self.algorithms.get(new.name()) {
                if new.quota().algorithm() != old {
                    return Err(format!(
                        "rule \"{}\" changes its algorithm ({} to {}), which would start every key afresh; give it a new name to change it",
                        new.name(),
                        old,
                        new.quota().algorithm()
                    ));
                }
            }
        }

        let same_shape = running.len() == rules.len()
            && running.iter().zip(rules).all(|(a, b)| {
                a.name() == b.name() && a.quota().algorithm() == b.quota().algorithm()
            });
        let changed: Vec<(&Rule, &Rule)> = running
            .iter()
            .filter_map(|old| {
                let new = rules.iter().find(|r| r.name() == old.name())?;
                (new.quota() != old.quota()).then_some((old, new))
            })
            .collect();
        let scopes_changed = running_scopes_differ(&self.active, set);
        if same_shape && !scopes_changed {
            let quotas = changed
                .iter()
                .map(|(_, new)| (new.name(), new.quota().clone()));
            self.active
                .load()
                .limiter
                .set_quotas(quotas)
                .map_err(|e| e.to_string())?;
        } else {
            let limiter = build_limiter(&self.store, rules, &self.options)?;
            let layer = build_layer(limiter.clone(), set, &self.options)?;
            let replaced = self.active.swap(Arc::new(Active {
                limiter,
                layer,
                scopes: set.scopes.clone(),
            }));
            // The old limiter's leased blocks go back to the store: dropped with it, they
            // would stay out of the count until their windows end.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move { replaced.limiter.release_leases().await });
            }
        }
        if scopes_changed {
            tracing::info!("rules file: scopes changed");
        }
        for (old, new) in &changed {
            tracing::info!(
                rule = new.name(),
                from = %describe(old.quota()),
                to = %describe(new.quota()),
                "rules file: quota changed"
            );
        }
        for new in rules
            .iter()
            .filter(|r| running.iter().all(|o| o.name() != r.name()))
        {
            tracing::info!(rule = new.name(), quota = %describe(new.quota()), "rules file: rule added");
        }
        for old in running
            .iter()
            .filter(|o| rules.iter().all(|r| r.name() != o.name()))
        {
            tracing::info!(rule = old.name(), "rules file: rule removed");
        }
        if changed.is_empty() && same_shape && !scopes_changed {
            tracing::info!("rules file rewritten; no rule changed");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_equal_only_when_equal() {
        let token = b"Bearer s3cret-token";
        assert!(constant_time_eq(token, token));
        for other in [
            &b""[..],
            b"Bearer s3cret-toke",
            b"Bearer s3cret-token!",
            b"Bearer s3cret-tokem",
            b"Bearer s3cret-token\0",
        ] {
            assert!(!constant_time_eq(other, token), "{other:?}");
        }
    }

    fn parse(args: &[&str]) -> Result<Options, String> {
        match parse_args(args.iter().map(|s| s.to_string()))? {
            Command::Run(o) => Ok(*o),
            Command::Help => Err("help".into()),
        }
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
        assert!(parse(&["--limit", "+5"]).is_err(), "numbers are strict");
        assert!(parse(&["--limit", " 5"]).is_err());
        assert!(
            parse(&["--limit", "5", "--limit", "6"]).is_err(),
            "repeated"
        );
        assert!(parse(&["--nope"]).is_err());
        assert!(parse(&["--algorithm", "leaky"]).is_err());
        assert!(parse(&["--store", "postgres"]).is_err());
        assert!(parse(&["--store", "redis-cluster://"]).is_err());
        assert!(parse(&["--trusted-proxies", "10.0.0.0/8,::1"])
            .unwrap()
            .trusted
            .is_some());
        assert!(parse(&["--trusted-proxies", "10.0.0.0/8,nope"]).is_err());
        assert!(parse(&["--trusted-hops", "2"]).unwrap().trusted.is_some());
        for bad in ["0", "33", "-1", "x"] {
            assert!(parse(&["--trusted-hops", bad]).is_err(), "{bad}");
        }
        assert!(parse(&["--trusted-hops", "1", "--trusted-proxies", "10.0.0.0/8"]).is_err());
        assert_eq!(
            StoreKind::parse("redis-sentinel://127.0.0.1:26379,127.0.0.1:26380/fleet"),
            Ok(StoreKind::Sentinel(
                vec![
                    "redis://127.0.0.1:26379".into(),
                    "redis://127.0.0.1:26380".into()
                ],
                "fleet".into()
            ))
        );
        for bad in [
            "redis-sentinel://127.0.0.1:26379",
            "redis-sentinel:///fleet",
        ] {
            assert!(StoreKind::parse(bad).is_err(), "{bad}");
        }
        assert!(
            parse(&["--redis-ca", "/nonexistent"]).is_err(),
            "needs rediss"
        );
        assert!(parse(&[
            "--store",
            "rediss://127.0.0.1:6380",
            "--on-store-error",
            "open",
            "--redis-ca",
            "/nonexistent"
        ])
        .is_err());
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
        assert!(parse(&["--lease", "auto", "--algorithm", "sliding-log"]).is_err());
        assert_eq!(parse(&["--max-keys", "5000"]).unwrap().max_keys, Some(5000));
        assert!(
            parse(&["--max-keys", "1"]).is_err(),
            "fewer than the shards"
        );
        assert_eq!(
            parse(&["--refund-status", "500-599,429"])
                .unwrap()
                .refund_status,
            vec![500..=599, 429..=429]
        );
        for bad in ["600-500", "99", "abc", "500-", ""] {
            assert!(parse(&["--refund-status", bad]).is_err(), "{bad:?}");
        }
        assert!(matches!(
            parse_args(["--help".to_string()].into_iter()),
            Ok(Command::Help)
        ));
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
        assert!(parse(&["--limit", "0"]).is_err());
        assert!(
            parse(&["--burst", "3"]).is_err(),
            "burst needs token-bucket or gcra"
        );
    }

    #[test]
    fn passwords_never_reach_a_message() {
        assert_eq!(
            redact("redis://:s3cretpw@127.0.0.1:6999/0"),
            "redis://:***@127.0.0.1:6999/0"
        );
        assert_eq!(
            redact("rediss://app:s3cretpw@cache:6380"),
            "rediss://app:***@cache:6380"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(
            secrets("redis://:s3cretpw@h:1"),
            vec!["s3cretpw".to_string()]
        );
        assert_eq!(
            secrets("redis://app:pw@h:1,redis://h:2"),
            vec!["pw".to_string()]
        );
        assert!(secrets("memory").is_empty());
        let err = parse(&["--store", "redis://:s3cretpw@127.0.0.1:1"]).unwrap_err();
        assert!(!err.contains("s3cretpw"), "{err}");
    }
}
