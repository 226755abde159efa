//! The sliding window counter against the exact sliding window, on a generated workload.

#[path = "../examples/accuracy.rs"]
mod accuracy;

/// The worst trailing minute of each demand, as a multiple of the limit, on the generated
/// workload with `sub_windows` (`None`: the default).
fn worst_windows(sub_windows: Option<u64>) -> Vec<(f64, f64)> {
    let w = accuracy::Workload {
        keys: 140,
        minutes: 5,
        limit_per_minute: 50,
        seed: 11,
        demand: accuracy::DEMAND.to_vec(),
        sub_windows,
    };
    let reports = accuracy::run(&w);
    let all = accuracy::total(&reports);
    assert!(all.requests > 40_000, "{all:?}");
    for (demand, r) in w.demand.iter().zip(&reports) {
        if *demand <= 0.5 {
            // Far below the limit the estimate never reaches it: no error at all.
            assert_eq!(r.wrongly_allowed + r.wrongly_denied, 0, "{demand}: {r:?}");
        }
    }
    // The counter does make mistakes under overload; this test would catch a change that hid them.
    assert!(all.wrongly_allowed > 0 && all.wrongly_denied > 0, "{all:?}");
    w.demand
        .iter()
        .zip(&reports)
        .map(|(demand, r)| (*demand, r.worst_window as f64 / w.limit_per_minute as f64))
        .collect()
}

/// The default (20 sub-windows), pinned near where it was measured: at most 1.10 × the limit in
/// any trailing minute, near the limit and under five times its demand alike. The classic
/// two-counter version (one sub-window) reaches about 1.3 × near the limit and 1.7 × under
/// overload: it must fail the default's pins (so they tell the two apart), and holds its own.
#[test]
fn counter_is_exact_below_the_limit_and_bounded_above_it() {
    for (demand, worst) in worst_windows(None) {
        assert!(worst <= 1.12, "default, {demand}: {worst:.2} × the limit");
    }
    let two_counters = worst_windows(Some(1));
    assert!(
        two_counters.iter().any(|&(_, worst)| worst > 1.12),
        "{two_counters:?}"
    );
    for (demand, worst) in two_counters {
        if demand <= 1.1 {
            assert!(
                worst <= 1.35,
                "two counters, {demand}: {worst:.2} × the limit"
            );
        }
        assert!(
            worst <= 1.85,
            "two counters, {demand}: {worst:.2} × the limit"
        );
    }
}

use accuracy::trace;

/// On the realistic trace (heavy-tailed rates, bursty clients), the default sub-windows beat the
/// two-counter version on every score, the sliding log is exact, and the window and bucket
/// algorithms pass the limit as their promises allow.
#[test]
fn sub_windows_beat_two_counters_on_a_realistic_trace() {
    use std::time::Duration;
    let spec = trace::TraceSpec {
        clients: 3_000,
        minutes: 8,
        ..Default::default()
    };
    let requests = trace::generate(&spec);
    assert!(requests.len() > 150_000, "{}", requests.len());
    let score = |label: &str| {
        let (_, quota) = trace::configurations(100, Duration::from_secs(60))
            .into_iter()
            .find(|(l, _)| l.starts_with(label))
            .unwrap_or_else(|| panic!("no configuration {label}"));
        trace::replay(&requests, spec.clients, &quota)
    };
    let default = score("sliding window counter, 20 sub-windows (default)");
    let two = score("sliding window counter, 1 sub-window");
    assert!(default.clients_over > 0, "some clients pass the limit");
    assert!(
        default.innocent_denied < two.innocent_denied,
        "{default:?} {two:?}"
    );
    assert!(
        default.over_limit * 2 < two.over_limit,
        "{default:?} {two:?}"
    );
    assert!(
        default.worst_period < two.worst_period,
        "{default:?} {two:?}"
    );
    // The stated bound: never more than the limit plus one sub-window's count; here, where
    // clients near the limit spread their requests, within 1.25 × the limit.
    assert!(default.worst_period <= 125, "{default:?}");
    let log = score("sliding log");
    assert_eq!(
        (log.innocent_denied, log.over_limit, log.worst_period),
        (0, 0, 100)
    );
    let fixed = score("fixed window");
    assert!(
        fixed.over_limit > default.over_limit * 5 && fixed.worst_period > 150,
        "{fixed:?}"
    );
}
