//! Every algorithm against the exact rule, on a realistic trace.
//!
//! The trace: many clients, each with its own rate drawn from a heavy-tailed (log-normal)
//! distribution (median 2/min, so a few percent of clients ever pass a limit of 100/min); a share
//! of the clients are bursty, alternating phases of a few minutes at their rate and at 8× it;
//! arrivals are Poisson within each phase. Every request is decided through the memory store on a
//! manual clock, and scored against the exact rule on the same client's history:
//!
//! - **innocent denied**: refused although the client had sent at most `limit` requests in the
//!   trailing period, counting this one: any exact limiter admits it;
//! - **over the limit**: admitted although the client already had `limit` admissions in the
//!   trailing period;
//! - **worst trailing period**: the most admissions of one client in any trailing period, as a
//!   multiple of the limit.
//!
//! With `--redis URL` it also replays the first requests of the trace through a
//! [`RedisStore`](fleetlimit::store::RedisStore) on that server (with a manual clock and a prefix
//! of its own, deleted afterwards) and reports, per algorithm, the Redis time per decision (from
//! `INFO commandstats`) and the Redis memory per key (`MEMORY USAGE`, averaged over the live
//! keys); memory per key in the memory store comes from `examples/memory_footprint.rs`.
//!
//! ```text
//! cargo run --release --example trace [-- --clients 50000 --minutes 20 --seed 1 --redis redis://127.0.0.1:6379 --only "sliding"]
//! ```

use std::collections::VecDeque;
use std::time::Duration;

use fleetlimit::store::{Check, Op};
use fleetlimit::{Algorithm, Key, ManualClock, MemoryStore, Quota, Rule};

/// 2025-01-01T00:00:00Z in µs.
pub const START: u64 = 1_735_689_600_000_000;

/// What to generate.
#[derive(Debug, Clone)]
pub struct TraceSpec {
    /// Distinct clients.
    pub clients: u32,
    /// Simulated duration.
    pub minutes: u64,
    /// PRNG seed.
    pub seed: u64,
    /// Median rate per client, per minute.
    pub median_per_minute: f64,
    /// Spread of the log-normal rates (σ of the underlying normal).
    pub sigma: f64,
    /// Share of clients that are bursty.
    pub bursty: f64,
    /// A bursty client's rate in its bursts, as a multiple of its own rate.
    pub burst_factor: f64,
    /// Mean length of a bursty client's phases (each exponentially distributed).
    pub mean_phase_minutes: f64,
}

impl Default for TraceSpec {
    fn default() -> Self {
        TraceSpec {
            clients: 50_000,
            minutes: 20,
            seed: 1,
            median_per_minute: 2.0,
            sigma: 1.75,
            bursty: 0.10,
            burst_factor: 8.0,
            mean_phase_minutes: 3.0,
        }
    }
}

/// SplitMix64: a small, good, dependency-free PRNG (the replays share it).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with the given mean.
    fn exp(&mut self, mean: f64) -> f64 {
        -self.unit().ln() * mean
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        (-2.0 * self.unit().ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos()
    }
}

/// The trace: (time in µs, client), in time order.
pub fn generate(spec: &TraceSpec) -> Vec<(u64, u32)> {
    let mut rng = Rng(spec.seed);
    let end = spec.minutes as f64 * 60e6;
    let mut out = Vec::new();
    for client in 0..spec.clients {
        let per_minute = spec.median_per_minute * (spec.sigma * rng.normal()).exp();
        let per_us = per_minute / 60e6;
        let bursty = rng.unit() <= spec.bursty;
        let phase_us = spec.mean_phase_minutes * 60e6;
        // Phases: a steady client has one, at its rate, for the whole trace.
        let mut t = 0.0;
        let mut in_burst = bursty && rng.unit() < 0.5;
        while t < end {
            let phase_end = if bursty {
                (t + rng.exp(phase_us)).min(end)
            } else {
                end
            };
            let rate = if in_burst {
                per_us * spec.burst_factor
            } else {
                per_us
            };
            loop {
                t += rng.exp(1.0 / rate);
                if t >= phase_end {
                    break;
                }
                out.push((START + t as u64, client));
            }
            t = phase_end;
            in_burst = !in_burst;
        }
    }
    out.sort_unstable();
    out
}

/// How one configuration did on the trace.
#[derive(Debug, Clone, Default)]
pub struct Score {
    /// Requests decided.
    pub requests: u64,
    /// Refused although the exact rule admits them whatever it admitted before.
    pub innocent_denied: u64,
    /// Admitted while the client already had `limit` admissions in the trailing period.
    pub over_limit: u64,
    /// The most admissions of one client in any trailing period.
    pub worst_period: u64,
    /// Clients that ever sent more than `limit` in a trailing period.
    pub clients_over: u64,
}

/// Replay `trace` through the memory store under `quota`, scoring every decision.
pub fn replay(trace: &[(u64, u32)], clients: u32, quota: &Quota) -> Score {
    let clock = ManualClock::new(START);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(usize::MAX / 2)
        .build()
        .unwrap_or_else(|e| panic!("store: {e}"));
    let rule = Rule::new("trace", quota.clone()).unwrap_or_else(|e| panic!("rule: {e}"));
    let keys: Vec<Key> = (0..clients).map(|c| Key::new(c.to_be_bytes())).collect();
    let (limit, period) = (quota.limit() as usize, quota.period().as_micros() as u64);
    let mut sent: Vec<VecDeque<u64>> = vec![VecDeque::new(); clients as usize];
    let mut admitted: Vec<VecDeque<u64>> = vec![VecDeque::new(); clients as usize];
    let mut over = vec![false; clients as usize];
    let mut score = Score::default();
    for &(t, c) in trace {
        clock.set(t);
        let c = c as usize;
        let allowed = store.apply_now(
            Op::Consume,
            &[Check {
                rule: &rule,
                key: &keys[c],
                cost: 1,
            }],
        )[0]
        .allowed;
        for log in [&mut sent[c], &mut admitted[c]] {
            while log.front().is_some_and(|&at| at + period <= t) {
                log.pop_front();
            }
        }
        sent[c].push_back(t);
        if sent[c].len() > limit {
            over[c] = true;
        }
        score.requests += 1;
        if allowed {
            if admitted[c].len() >= limit {
                score.over_limit += 1;
            }
            admitted[c].push_back(t);
            score.worst_period = score.worst_period.max(admitted[c].len() as u64);
        } else if sent[c].len() <= limit {
            score.innocent_denied += 1;
        }
    }
    score.clients_over = over.iter().filter(|&&o| o).count() as u64;
    score
}

/// The configurations compared: every algorithm, and the sliding window counter at several
/// sub-window counts.
pub fn configurations(limit: u64, period: Duration) -> Vec<(String, Quota)> {
    let q = |a: Algorithm| Quota::new(limit, period).algorithm(a).max_log_len(limit);
    let build = |b: fleetlimit::QuotaBuilder| b.build().unwrap_or_else(|e| panic!("quota: {e}"));
    let mut out = vec![(
        format!(
            "sliding window counter, {} sub-windows (default)",
            fleetlimit::DEFAULT_SUB_WINDOWS
        ),
        build(q(Algorithm::SlidingWindow)),
    )];
    for n in [1, 5, 10, 30, 60] {
        let label = if n == 1 {
            "sliding window counter, 1 sub-window (two counters)".to_string()
        } else {
            format!("sliding window counter, {n} sub-windows")
        };
        out.push((label, build(q(Algorithm::SlidingWindow).sub_windows(n))));
    }
    out.push((
        format!(
            "sliding window counter, {} sub-windows, bounded estimate",
            fleetlimit::DEFAULT_SUB_WINDOWS
        ),
        build(q(Algorithm::SlidingWindow).estimate(fleetlimit::WindowEstimate::Bounded)),
    ));
    out.push(("fixed window".into(), build(q(Algorithm::FixedWindow))));
    out.push((
        "token bucket (burst = limit)".into(),
        build(q(Algorithm::TokenBucket)),
    ));
    out.push(("GCRA (burst = limit)".into(), build(q(Algorithm::Gcra))));
    out.push(("sliding log".into(), build(q(Algorithm::SlidingLog))));
    out
}

/// Redis time per decision (µs) and memory per key (bytes) for `quota`, replaying the first
/// `requests` of the trace through a `RedisStore` on `url`.
async fn on_redis(
    url: &str,
    trace: &[(u64, u32)],
    quota: &Quota,
    requests: usize,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    use fleetlimit::store::{RedisStore, Store};
    let prefix = format!("fleetlimit-trace-{}:", std::process::id());
    let clock = ManualClock::new(START);
    let store = RedisStore::builder()
        .clock(clock.clone())
        .prefix(&prefix)
        .connect(url)
        .await?;
    let client = redis::Client::open(url)?;
    let mut admin = client.get_multiplexed_async_connection().await?;
    let rule = Rule::new("trace", quota.clone())?;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await?;
    for &(t, c) in trace.iter().take(requests) {
        clock.set(t);
        let key = Key::new(c.to_be_bytes());
        store
            .apply(
                Op::Consume,
                &[Check {
                    rule: &rule,
                    key: &key,
                    cost: 1,
                }],
            )
            .await?;
    }
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin)
        .await?;
    let per_call = stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            let field = |name: &str| -> Option<f64> {
                l.split([':', ','])
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|v| v.parse().ok())
            };
            Some((field("calls=")?, field("usec=")?))
        })
        .fold((0.0, 0.0), |(c, u), (dc, du)| (c + dc, u + du));
    // The keys are still live on the trace's clock; sample them for their size, then drop them.
    let mut cursor = 0u64;
    let (mut keys, mut bytes) = (0u64, 0u64);
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut admin)
            .await?;
        for key in &batch {
            if keys < 2_000 {
                let size: Option<u64> = redis::cmd("MEMORY")
                    .arg("USAGE")
                    .arg(key)
                    .query_async(&mut admin)
                    .await?;
                if let Some(size) = size {
                    keys += 1;
                    bytes += size;
                }
            }
            let _: () = redis::cmd("UNLINK")
                .arg(key)
                .query_async(&mut admin)
                .await?;
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    Ok((
        per_call.1 / per_call.0.max(1.0),
        bytes as f64 / keys.max(1) as f64,
    ))
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut spec = TraceSpec::default();
    let mut limit = 100u64;
    let mut redis_url: Option<String> = None;
    let mut redis_requests = 200_000usize;
    let mut only: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--clients" => spec.clients = value.parse()?,
            "--minutes" => spec.minutes = value.parse()?,
            "--seed" => spec.seed = value.parse()?,
            "--limit" => limit = value.parse()?,
            "--redis" => redis_url = Some(value),
            "--redis-requests" => redis_requests = value.parse()?,
            "--only" => only = Some(value),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    // Every configuration is built from the limit: a bad one is said here, not in a panic.
    Quota::new(limit, Duration::from_secs(60))
        .algorithm(Algorithm::SlidingLog)
        .max_log_len(limit)
        .build()
        .map_err(|e| format!("--limit {limit}: {e}"))?;
    let trace = generate(&spec);
    let mut configurations = configurations(limit, Duration::from_secs(60));
    if let Some(only) = &only {
        configurations.retain(|(label, _)| label.contains(only.as_str()));
    }
    let mut rows = Vec::new();
    for (label, quota) in &configurations {
        rows.push((label, quota, replay(&trace, spec.clients, quota)));
    }
    let clients_over = rows.first().map_or(0, |r| r.2.clients_over);
    println!(
        "{} clients ({:.1}% ever over the limit), {} simulated minutes, {} requests, limit {limit}/min; seed {}",
        spec.clients,
        100.0 * clients_over as f64 / spec.clients as f64,
        spec.minutes,
        trace.len(),
        spec.seed
    );
    let pct = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
    let redis = match &redis_url {
        Some(url) => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let mut out = Vec::new();
            for (_, quota, _) in &rows {
                out.push(Some(runtime.block_on(on_redis(
                    url,
                    &trace,
                    quota,
                    redis_requests,
                ))?));
            }
            out
        }
        None => vec![None; rows.len()],
    };
    println!(
        "| configuration | innocent requests denied | admitted over the limit | most admitted in any trailing minute | Redis µs per decision | Redis bytes per key |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for ((label, _, s), redis) in rows.iter().zip(&redis) {
        let (us, bytes) = redis.map_or(("-".into(), "-".into()), |(us, b)| {
            (format!("{us:.2}"), format!("{b:.0}"))
        });
        println!(
            "| {label} | {:.4}% | {:.3}% | {:.2}× | {us} | {bytes} |",
            pct(s.innocent_denied, s.requests),
            pct(s.over_limit, s.requests),
            s.worst_period as f64 / limit as f64,
        );
    }
    if redis_url.is_some() {
        println!(
            "(Redis figures: the first {redis_requests} requests of the trace, one call each)"
        );
    }
    Ok(())
}
