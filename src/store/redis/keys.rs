//! Redis key names and cluster slots.

use crate::{Algorithm, Key, Rule};

/// `<prefix>{<key>}:<rule>:<algorithm>`, with key and rule percent-encoded: every byte outside
/// `[A-Za-z0-9._-]` becomes `%XX`. The encoding is injective and never yields `{`, `}` or `:`,
/// so different (rule, key) pairs never share a Redis key. The hash tag is the key alone: every
/// rule on one key lives on one cluster slot and decides in one atomic call.
pub(crate) fn redis_key(prefix: &str, rule: &Rule, key: &Key) -> Vec<u8> {
    let key_bytes = key.as_bytes();
    let mut out = Vec::with_capacity(prefix.len() + rule.name().len() + 3 * key_bytes.len() + 8);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    encode(key_bytes, &mut out);
    out.push(b'}');
    out.push(b':');
    encode(rule.name().as_bytes(), &mut out);
    out.extend_from_slice(match rule.quota().algorithm() {
        Algorithm::FixedWindow => b":fw",
        Algorithm::SlidingLog => b":sl",
        Algorithm::SlidingWindow => b":sw",
        Algorithm::TokenBucket => b":tb",
        Algorithm::Gcra => b":gc",
    });
    out
}

/// `<prefix>{<key>}:listing`: the key's allow/deny/block entry, beside its states (same slot);
/// no state key ends so (they end with the algorithm).
pub(crate) fn listing_key(prefix: &str, key: &Key) -> Vec<u8> {
    let key_bytes = key.as_bytes();
    let mut out = Vec::with_capacity(prefix.len() + 3 * key_bytes.len() + 10);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    encode(key_bytes, &mut out);
    out.extend_from_slice(b"}:listing");
    out
}

/// `<prefix>{<key>}:slots=<name>`: the concurrency slots held for the key (same slot as its
/// states).
pub(crate) fn slots_key(prefix: &str, name: &str, key: &Key) -> Vec<u8> {
    named_key(prefix, key, b"slots", name)
}

/// `<prefix>{<key>}:pause=<rule>`: a pause of the key under a rule (same slot as its states).
/// Per rule name, not per algorithm as states are: a rule reconfigured to another algorithm is
/// still paused, as on the memory store.
pub(crate) fn pause_key(prefix: &str, rule: &str, key: &Key) -> Vec<u8> {
    named_key(prefix, key, b"pause", rule)
}

/// `<prefix>{<key>}:<kind>=<name>`. The encoding never yields `=`, so no state key
/// (`:<rule>:<algorithm>`, where a rule named like `kind` once met one named after an
/// algorithm), nor the listing, nor a key of another kind is ever one.
fn named_key(prefix: &str, key: &Key, kind: &[u8], name: &str) -> Vec<u8> {
    let key_bytes = key.as_bytes();
    let mut out = Vec::with_capacity(prefix.len() + 3 * (key_bytes.len() + name.len()) + 10);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    encode(key_bytes, &mut out);
    out.extend_from_slice(b"}:");
    out.extend_from_slice(kind);
    out.push(b'=');
    encode(name.as_bytes(), &mut out);
    out
}

fn encode(bytes: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-' {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
}

/// The Redis Cluster slot of a key (a hook for tests and tools): CRC16 (XMODEM) of its hash tag (or of the whole key when it
/// has none), modulo 16384.
#[doc(hidden)]
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tagged) % 16384
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;

    fn rule(name: &str) -> Rule {
        Rule::new(name, Quota::per_second(1).build().unwrap()).unwrap()
    }

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(
            slot(b"foo{}{bar}"),
            crc16(b"foo{}{bar}") % 16384,
            "an empty first tag: the whole key is hashed"
        );
        assert_ne!(slot(b"foo{}{bar}"), slot(b"bar"));
    }

    #[test]
    fn hostile_pairs_never_collide() {
        let a = redis_key("p:", &rule("a"), &Key::new("b:c"));
        let b = redis_key("p:", &rule("a:b"), &Key::new("c"));
        assert_ne!(a, b);
        let braces = redis_key("p:", &rule("r"), &Key::new("}{x"));
        let tag_end = braces.iter().position(|&c| c == b'}').unwrap();
        assert_eq!(&braces[tag_end..], b"}:r:sw", "no brace inside the tag");
        let k = Key::new("acct");
        assert_eq!(
            slot(&redis_key("p:", &rule("a"), &k)),
            slot(&redis_key("p:", &rule("b"), &k)),
            "rules on one key share a slot"
        );
        // Concurrency slots never share a key with a state or a listing, whatever the names.
        for (name, algorithm) in [
            ("tb", Algorithm::TokenBucket),
            ("fw", Algorithm::FixedWindow),
            ("sl", Algorithm::SlidingLog),
            ("sw", Algorithm::SlidingWindow),
            ("gc", Algorithm::Gcra),
        ] {
            let quota = crate::Quota::per_second(1)
                .algorithm(algorithm)
                .build()
                .unwrap();
            for kind in ["slots", "pause"] {
                let state = redis_key("p:", &Rule::new(kind, quota.clone()).unwrap(), &k);
                assert_ne!(slots_key("p:", name, &k), state, "{name}");
                assert_ne!(pause_key("p:", name, &k), state, "{name}");
            }
        }
        assert_ne!(slots_key("p:", "listing", &k), listing_key("p:", &k));
        assert_ne!(pause_key("p:", "listing", &k), listing_key("p:", &k));
        assert_ne!(pause_key("p:", "a", &k), slots_key("p:", "a", &k));
        assert_eq!(
            slot(&pause_key("p:", "partner", &k)),
            slot(&listing_key("p:", &k))
        );
        assert_eq!(
            slot(&slots_key("p:", "in-flight", &k)),
            slot(&listing_key("p:", &k))
        );
    }
}
