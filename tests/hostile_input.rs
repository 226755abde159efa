//! The fuzz targets' properties (`fuzz/`, run with `scripts/fuzz.sh`), as property tests the
//! suite runs on every change: forwarding chains, keys from header bytes, header rendering,
//! quotas from arbitrary numbers and the Redis key encoding.

use std::net::IpAddr;
use std::time::Duration;

use fleetlimit::key::{client_ip, header, ForwardedHeader, KeyExtractor, TrustedProxies};
use fleetlimit::store::redis::display_key;
use fleetlimit::{
    Algorithm, Decision, HeaderStyle, Key, Quota, Rule, MAX_HEADER_INTEGER, MAX_PERIOD,
};
use http::{HeaderMap, HeaderValue};
use proptest::prelude::*;

/// Bytes a client might put in a header line, biased toward the separators that matter. Every
/// one is valid in a header value (a value with another is refused before any extractor sees
/// it): filtered instead, a long line would almost never pass and its case be skipped.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(header_byte(), 0..400)
}

/// Any byte a header value may hold: visible ASCII, space, tab and obs-text (0x80 and up).
fn header_byte() -> impl Strategy<Value = u8> {
    let any_valid = any::<u8>().prop_map(|b| match b {
        b'\t' | 0x20..=0x7e | 0x80..=0xff => b,
        other => 0x21 + other % 0x5e,
    });
    prop_oneof![
        4 => any_valid,
        2 => prop::sample::select(b",;=\"\\[]: \t_".to_vec()),
        1 => prop::sample::select(b"0123456789.f".to_vec()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn a_clients_part_never_changes_the_client_found(prefix in hostile_bytes(), forwarded in any::<bool>()) {
        let (name, appended, which) = if forwarded {
            ("forwarded", "for=198.51.100.7", ForwardedHeader::Forwarded)
        } else {
            ("x-forwarded-for", "198.51.100.7", ForwardedHeader::XForwardedFor)
        };
        let trusted = TrustedProxies::private_networks();
        let peer: IpAddr = [10, 0, 0, 1].into();
        let mut line = prefix.clone();
        line.extend_from_slice(b", ");
        line.extend_from_slice(appended.as_bytes());
        let mut h = HeaderMap::new();
        h.append(name, HeaderValue::from_bytes(&line).unwrap());
        prop_assert_eq!(client_ip(peer, &h, &trusted, which), IpAddr::from([198, 51, 100, 7]));
        // The client's own line before the proxy's.
        let mut h = HeaderMap::new();
        h.append(name, HeaderValue::from_bytes(&prefix).unwrap());
        h.append(name, HeaderValue::from_static(appended));
        prop_assert_eq!(client_ip(peer, &h, &trusted, which), IpAddr::from([198, 51, 100, 7]));
    }

    #[test]
    fn keys_from_any_bytes(data in prop::collection::vec(any::<u8>(), 0..300)) {
        prop_assert!(Key::new(&data).as_bytes().len() <= 129);
    }

    #[test]
    fn keys_from_any_header_bytes(data in prop::collection::vec(header_byte(), 0..300)) {
        let value = HeaderValue::from_bytes(&data).unwrap();
        let (mut parts, _) = http::Request::new(()).into_parts();
        parts.headers.insert("x-api-key", value);
        let extracted = header("X-API-KEY").extract(&parts);
        prop_assert_eq!(extracted, (!data.is_empty()).then(|| Key::new(&data)));
    }

    #[test]
    fn headers_are_valid_for_any_decision(
        // Every algorithm at limits up to 10,000 over a second to a day (each builds), and the
        // fixed window up to the largest limit a header carries.
        (limit, period_ms, alg) in prop_oneof![
            (1u64..=10_000, 1_000u64..=86_400_000, 0usize..5),
            (1u64..=MAX_HEADER_INTEGER, 1u64..100_000_000, Just(0usize)),
        ],
        remaining in any::<u64>(),
        reset_us in any::<u64>(),
        retry_us in prop::option::of(any::<u64>()),
        allowed in any::<bool>(),
    ) {
        let quota = Quota::new(limit, Duration::from_millis(period_ms))
            .algorithm(Algorithm::ALL[alg])
            .build();
        prop_assert!(quota.is_ok(), "{:?}", quota);
        let quota = quota.unwrap();
        let rule = Rule::new("r", quota.clone()).unwrap();
        let cap = quota.capacity();
        let d = if allowed {
            Decision::admit(cap, remaining % (cap + 1), Duration::from_micros(reset_us))
        } else {
            Decision::deny(cap, remaining % (cap + 1), Duration::from_micros(reset_us), retry_us.map(Duration::from_micros))
        };
        for style in [HeaderStyle::Draft6, HeaderStyle::Ietf, HeaderStyle::Legacy] {
            let headers = style.render(&[&rule], &[d]);
            prop_assert!(!headers.is_empty());
            for (name, value) in &headers {
                let text = value.to_str();
                prop_assert!(text.is_ok(), "{}: {:?}", name, value);
                if style == HeaderStyle::Ietf {
                    let parsed = sfv::Parser::new(text.unwrap()).parse::<sfv::List>();
                    prop_assert!(parsed.is_ok(), "{}: {:?}", name, value);
                }
            }
        }
    }

    #[test]
    fn quotas_from_any_numbers(
        limit in prop_oneof![1u64..1_000_000, any::<u64>()],
        secs in prop_oneof![0u64..100_000, any::<u64>()],
        nanos in prop_oneof![(0u32..1_000).prop_map(|ms| ms * 1_000_000), any::<u32>()],
        burst in prop::option::of(any::<u64>()),
        alg in 0usize..5,
        max_log in any::<u64>(),
    ) {
        let period = Duration::new(secs, nanos % 1_000_000_000);
        let mut b = Quota::new(limit, period)
            .algorithm(Algorithm::ALL[alg])
            .max_log_len(max_log);
        if let Some(burst) = burst {
            b = b.burst(burst);
        }
        let built = b.build();
        if let Ok(q) = &built {
            prop_assert!(q.limit() >= 1 && q.limit() <= MAX_HEADER_INTEGER);
            prop_assert!(q.burst() >= 1 && q.burst() <= MAX_HEADER_INTEGER);
            prop_assert!(q.period() >= Duration::from_millis(1) && q.period() <= MAX_PERIOD);
        }
        // And the other way: a fixed window with a limit a header carries, over whole
        // milliseconds from 1 ms to the longest period, always builds.
        let valid_window = Algorithm::ALL[alg] == Algorithm::FixedWindow
            && burst.is_none()
            && (1..=MAX_HEADER_INTEGER).contains(&limit)
            && period.subsec_nanos() % 1_000_000 == 0
            && (Duration::from_millis(1)..=MAX_PERIOD).contains(&period);
        prop_assert!(!valid_window || built.is_ok(), "{:?} {:?}: {:?}", limit, period, built);
    }

    #[test]
    fn the_redis_key_encoding_is_injective(
        rule_a in "[!-~]{1,8}", key_a in prop::collection::vec(any::<u8>(), 0..20),
        rule_b in "[!-~]{1,8}", key_b in prop::collection::vec(any::<u8>(), 0..20),
        same_rule in any::<bool>(), same_key in any::<bool>(),
    ) {
        let quota = Quota::per_second(1).build().unwrap();
        let rule_b = if same_rule { rule_a.clone() } else { rule_b };
        let key_b = if same_key { key_a.clone() } else { key_b };
        let (Ok(ra), Ok(rb)) = (Rule::new(rule_a, quota.clone()), Rule::new(rule_b, quota)) else {
            return Ok(());
        };
        let (ka, kb) = (Key::new(&key_a), Key::new(&key_b));
        let (a, b) = (display_key(&ra, &ka), display_key(&rb, &kb));
        prop_assert_eq!(a == b, ra.name() == rb.name() && ka == kb);
        prop_assert_eq!(a.matches('{').count(), 1);
        prop_assert_eq!(a.matches('}').count(), 1);
    }
}
