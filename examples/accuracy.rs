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
//! cargo run --release --example accuracy [-- --keys 2000 --minutes 10 --seed 7 --sub-windows 1 --plot docs/accuracy.svg]
//! ```
//!
//! `--plot FILE.svg` also draws one key at twice its limit: what the exact log counted in the
//! trailing minute and what the counter estimated, against the limit.

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
    /// The counter's sub-windows (`None`: the default; 1 is the two-counter estimate).
    pub sub_windows: Option<u64>,
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

/// One decision on the traced key: when, what the exact log held over the trailing period, and
/// what the counter estimated (limit − its remaining), both after the decision.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    /// Seconds since the start.
    pub at_s: f64,
    /// Permits admitted in the trailing period, counted exactly.
    pub exact: u64,
    /// The counter's estimate of the same.
    pub counter: u64,
}

/// Replay the workload; one report per demand class, in the order of `w.demand`.
pub fn run(w: &Workload) -> Vec<Report> {
    run_traced(w, None).0
}

/// [`run`], and the timeline of key `traced`.
pub fn run_traced(w: &Workload, traced: Option<u64>) -> (Vec<Report>, Vec<Point>) {
    let mut timeline = Vec::new();
    let start = 1_735_689_600_000_000u64;
    let clock = ManualClock::new(start);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(usize::MAX / 2)
        .build()
        .unwrap_or_else(|e| panic!("store: {e}"));
    let quota = |a| {
        let mut q = Quota::new(w.limit_per_minute, Duration::from_secs(60))
            .algorithm(a)
            .max_log_len(w.limit_per_minute);
        if let (Some(n), Algorithm::SlidingWindow) = (w.sub_windows, a) {
            q = q.sub_windows(n);
        }
        q.build().unwrap_or_else(|e| panic!("quota: {e}"))
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
        let decision = store.apply_now(
            Op::Consume,
            &[Check {
                rule: &counter,
                key: &key,
                cost: 1,
            }],
        )[0];
        let by_counter = decision.allowed;
        let log = &mut admitted[k as usize];
        while log.front().is_some_and(|&ts| ts + period <= t) {
            log.pop_front();
        }
        let by_exact = (log.len() as u64) < w.limit_per_minute;
        if by_counter {
            log.push_back(t);
        }
        if traced == Some(k) {
            timeline.push(Point {
                at_s: (t - start) as f64 / 1e6,
                exact: log.len() as u64,
                counter: w.limit_per_minute.saturating_sub(decision.remaining),
            });
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
    (reports, timeline)
}

/// Draw `timeline` (one key at `demand` × its limit) as an SVG: the permits admitted in the
/// trailing minute, counted exactly and as the counter estimated them, against the limit.
pub fn plot(path: &str, timeline: &[Point], limit: u64, demand: f64) -> Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let end = timeline.last().map_or(60.0, |p| p.at_s);
    let top = (limit as f64 * 1.25).ceil() as u64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "One key at {demand}× its limit of {limit}/min: admitted in the trailing minute"
            ),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..end, 0u64..top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("permits in the trailing 60 s")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new(
            [(0.0, limit), (end, limit)],
            RED.stroke_width(2),
        ))
        .map_err(|e| e.to_string())?
        .label("the limit")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RED));
    chart
        .draw_series(LineSeries::new(
            timeline.iter().map(|p| (p.at_s, p.exact)),
            &BLUE,
        ))
        .map_err(|e| e.to_string())?
        .label("exact sliding log of what was admitted")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLUE));
    chart
        .draw_series(LineSeries::new(
            timeline.iter().map(|p| (p.at_s, p.counter)),
            GREEN.mix(0.8),
        ))
        .map_err(|e| e.to_string())?
        .label("sliding window counter's estimate")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], GREEN));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
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
        sub_windows: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut plot_to: Option<String> = None;
    for pair in args.chunks(2) {
        if pair[0] == "--plot" {
            plot_to = pair.get(1).cloned();
            continue;
        }
        let value = pair.get(1).and_then(|v| v.parse().ok());
        match (pair[0].as_str(), value) {
            ("--keys", Some(v)) => w.keys = v,
            ("--minutes", Some(v)) => w.minutes = v,
            ("--limit", Some(v)) => w.limit_per_minute = v,
            ("--seed", Some(v)) => w.seed = v,
            ("--sub-windows", Some(v)) => w.sub_windows = Some(v),
            _ => {
                eprintln!(
                    "usage: accuracy [--keys N] [--minutes N] [--limit N] [--seed N] [--sub-windows N] [--plot FILE.svg]"
                );
                std::process::exit(2);
            }
        }
    }
    // The quotas below are built from the limit: a bad one is said here, not in a panic.
    let log = Quota::new(w.limit_per_minute, Duration::from_secs(60))
        .algorithm(Algorithm::SlidingLog)
        .max_log_len(w.limit_per_minute)
        .build();
    let mut counter = Quota::new(w.limit_per_minute, Duration::from_secs(60));
    if let Some(n) = w.sub_windows {
        counter = counter.sub_windows(n);
    }
    if let Err(e) = log.and(counter.build()) {
        eprintln!(
            "--limit {} --sub-windows {:?}: {e}",
            w.limit_per_minute, w.sub_windows
        );
        std::process::exit(2);
    }
    if w.keys == 0 || w.minutes == 0 {
        eprintln!("--keys and --minutes must be at least 1");
        std::process::exit(2);
    }
    // The traced key: the first of the class at twice its limit.
    let hot = w.demand.iter().position(|&d| d == 2.0).unwrap_or(0) as u64;
    let (reports, timeline) = run_traced(&w, Some(hot));
    if let Some(path) = &plot_to {
        let demand = w.demand.get(hot as usize).copied().unwrap_or(1.0);
        if let Err(e) = plot(path, &timeline, w.limit_per_minute, demand) {
            eprintln!("--plot {path}: {e}");
            std::process::exit(1);
        }
        eprintln!("wrote {path}");
    }
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
