//! Quotas from arbitrary numbers: an error or a quota, never a panic; a built quota is within
//! the bounds its algorithm computes exactly.
#![no_main]

use std::time::Duration;

use fleetlimit::{Algorithm, Quota, MAX_HEADER_INTEGER, MAX_PERIOD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, u64, u32, Option<u64>, u8, u64)| {
    let (limit, secs, nanos, burst, alg, max_log) = input;
    let algorithm = Algorithm::ALL[usize::from(alg) % Algorithm::ALL.len()];
    let mut b = Quota::new(limit, Duration::new(secs, nanos % 1_000_000_000))
        .algorithm(algorithm)
        .max_log_len(max_log);
    if let Some(burst) = burst {
        b = b.burst(burst);
    }
    if let Ok(q) = b.build() {
        assert!(q.limit() >= 1 && q.limit() <= MAX_HEADER_INTEGER);
        assert!(q.burst() >= 1 && q.burst() <= MAX_HEADER_INTEGER);
        assert!(q.period() >= Duration::from_millis(1) && q.period() <= MAX_PERIOD);
        assert_eq!(q.period().subsec_nanos() % 1_000_000, 0);
        assert_eq!(q.capacity(), q.burst());
    }
});
