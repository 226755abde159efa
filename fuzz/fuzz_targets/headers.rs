//! Rate-limit headers for arbitrary decisions and quotas: every value is a valid header value,
//! and in the IETF style both headers parse as Structured Field lists.
#![no_main]

use std::time::Duration;

use fleetlimit::{Algorithm, Decision, HeaderStyle, Quota, Rule};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, u64, u64, u64, u64, bool, u8, u8)| {
    let (limit, period_ms, remaining, reset_us, retry_us, allowed, alg, style) = input;
    let algorithm = Algorithm::ALL[usize::from(alg) % Algorithm::ALL.len()];
    let Ok(quota) = Quota::new(limit, Duration::from_millis(period_ms))
        .algorithm(algorithm)
        .build()
    else {
        return;
    };
    let Ok(rule) = Rule::new("fuzz", quota.clone()) else {
        return;
    };
    let limit = quota.capacity();
    let remaining = remaining % (limit + 1);
    let decision = if allowed {
        Decision::admit(limit, remaining, Duration::from_micros(reset_us))
    } else {
        Decision::deny(
            limit,
            remaining,
            Duration::from_micros(reset_us),
            (retry_us % 3 != 0).then(|| Duration::from_micros(retry_us)),
        )
    };
    let style = [
        HeaderStyle::Draft6,
        HeaderStyle::Ietf,
        HeaderStyle::Legacy,
        HeaderStyle::None,
    ][usize::from(style) % 4];
    let headers = style.render(&[&rule], &[decision]);
    for (name, value) in &headers {
        let text = value.to_str().expect("visible ASCII");
        if style == HeaderStyle::Ietf {
            sfv::Parser::new(text)
                .parse::<sfv::List>()
                .unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
        }
    }
});
