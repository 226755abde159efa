//! The Redis key encoding is injective: two different (rule, key) pairs never map to one Redis
//! key, and the hash tag is exactly the user key's encoding.
#![no_main]

use fleetlimit::store::redis::display_key;
use fleetlimit::{Key, Quota, Rule};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (String, Vec<u8>, String, Vec<u8>)| {
    let (rule_a, key_a, rule_b, key_b) = input;
    let quota = Quota::per_second(1).build().expect("a valid quota");
    let (Ok(ra), Ok(rb)) = (Rule::new(rule_a, quota.clone()), Rule::new(rule_b, quota)) else {
        return;
    };
    let (ka, kb) = (Key::new(&key_a), Key::new(&key_b));
    let (a, b) = (display_key(&ra, &ka), display_key(&rb, &kb));
    assert_eq!(a == b, ra.name() == rb.name() && ka == kb, "{a} / {b}");
    // One tag: `{` opens it, the first `}` closes it, and neither appears elsewhere.
    assert_eq!(a.matches('{').count(), 1, "{a}");
    assert_eq!(a.matches('}').count(), 1, "{a}");
});
