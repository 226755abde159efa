//! The sliding window counter against the exact sliding window, on a generated workload.

#[path = "../examples/accuracy.rs"]
mod accuracy;

#[test]
fn counter_is_exact_below_the_limit_and_bounded_above_it() {
    let w = accuracy::Workload {
        keys: 140,
        minutes: 5,
        limit_per_minute: 50,
        seed: 11,
        demand: accuracy::DEMAND.to_vec(),
    };
    let reports = accuracy::run(&w);
    let all = accuracy::total(&reports);
    assert!(all.requests > 40_000, "{all:?}");
    for (demand, r) in w.demand.iter().zip(&reports) {
        if *demand <= 0.5 {
            // Far below the limit the estimate never reaches it: no error at all.
            assert_eq!(r.wrongly_allowed + r.wrongly_denied, 0, "{demand}: {r:?}");
        }
        // Whatever the demand, a trailing window overlaps two aligned windows, each holding at
        // most the limit: never more than 2 × the limit.
        assert!(r.worst_window <= w.limit_per_minute * 2, "{demand}: {r:?}");
    }
    // The counter does make mistakes under overload; this test would catch a change that hid them.
    assert!(all.wrongly_allowed > 0 && all.wrongly_denied > 0, "{all:?}");
}
