//! Keys from arbitrary header bytes: never a panic, long keys hashed, user keys and addresses
//! never equal.
#![no_main]

use fleetlimit::key::{header, KeyExtractor};
use fleetlimit::{Key, MAX_RULE_NAME_LEN};
use http::HeaderValue;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = Key::new(data);
    assert!(key.as_bytes().len() <= 1 + 128.max(32));
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let (mut parts, _) = http::Request::new(()).into_parts();
    parts.headers.insert("x-api-key", value);
    let extracted = header("X-Api-Key").extract(&parts);
    if data.is_empty() {
        assert!(extracted.is_none());
    } else {
        assert_eq!(extracted, Some(Key::new(data)));
    }
    if data.len() == 4 {
        let ip = std::net::IpAddr::from([data[0], data[1], data[2], data[3]]);
        assert_ne!(Key::from(ip), key, "an address and a user key collided");
    }
    let _ = MAX_RULE_NAME_LEN;
});
