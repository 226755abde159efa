//! Keys: what a limit counts against (an account, an API key, a client address).
//!
//! A [`Key`] is an opaque byte string with a one-byte kind tag in front, so that a user key
//! `"10.0.0.1"` and the peer address `10.0.0.1` never share a bucket. Long keys are replaced by
//! their SHA-256, so a hostile client cannot make the store keep kilobytes per key. `Debug`
//! never prints a user key: it shows a short fingerprint instead, so API keys stay out of logs.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use bytes::{BufMut, Bytes, BytesMut};
use sha2::{Digest, Sha256};

#[cfg(feature = "body")]
mod body;
pub(crate) mod extract;
mod forwarded;

#[cfg(feature = "body")]
pub use body::{form_field, json_field, BodyField};
pub use extract::{from_fn, global, header, FnExtractor, Global, HeaderKey, KeyExtractor, PeerIp};
pub use forwarded::{client_ip, ForwardedHeader, TrustedProxies};

/// User keys longer than this many bytes are stored as their SHA-256.
pub const MAX_KEY_LEN: usize = 128;

const TAG_USER: u8 = b'k';
const TAG_HASHED: u8 = b'h';
const TAG_IP: u8 = b'i';
const TAG_GLOBAL: u8 = b'g';
const TAG_KEYLESS: u8 = b'n';

/// What a limit counts against.
///
/// ```
/// use fleetlimit::Key;
///
/// let a = Key::new("tenant-42");
/// let b = Key::from(std::net::IpAddr::from([10, 0, 0, 1]));
/// assert_ne!(Key::new("10.0.0.1"), b, "user keys and addresses never collide");
/// assert!(Key::new(vec![b'x'; 10_000]).as_bytes().len() <= 64, "long keys are hashed");
/// # let _ = a;
/// ```
#[derive(Clone)]
pub struct Key(Repr);

/// Short encodings (every address, most account ids and API keys) live inline, so building a
/// key on each request allocates nothing; longer ones share one allocation between clones.
#[derive(Clone)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Shared(Bytes),
}

/// The longest encoding kept inline: an address, a UUID or a 32-character API key with its tag;
/// a key stays 40 bytes.
const INLINE: usize = 38;

impl Repr {
    fn new(tag: u8, body: &[u8]) -> Repr {
        if body.len() < INLINE {
            let mut bytes = [0u8; INLINE];
            bytes[0] = tag;
            bytes[1..=body.len()].copy_from_slice(body);
            // `body.len() < INLINE`, so the length fits a byte.
            Repr::Inline {
                len: (1 + body.len()) as u8,
                bytes,
            }
        } else {
            let mut b = BytesMut::with_capacity(1 + body.len());
            b.put_u8(tag);
            b.put_slice(body);
            Repr::Shared(b.freeze())
        }
    }
}

/// Whether two inline encodings are equal, in 8-byte words: the compiler calls `bcmp` for an
/// array of this size.
fn same_inline(x: &[u8; INLINE], y: &[u8; INLINE]) -> bool {
    let word = |b: &[u8]| {
        let mut w = [0u8; 8];
        w[..b.len()].copy_from_slice(b);
        u64::from_ne_bytes(w)
    };
    x.chunks(8)
        .zip(y.chunks(8))
        .fold(0, |differ, (a, b)| differ | (word(a) ^ word(b)))
        == 0
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        match (&self.0, &other.0) {
            // Bytes past `len` are always zero, so whole arrays compare: a few word compares
            // instead of a call, on every lookup.
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                a == b && same_inline(x, y)
            }
            (Repr::Shared(x), Repr::Shared(y)) => x == y,
            // A shared encoding is longer than any inline one.
            _ => false,
        }
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl Key {
    /// A key from user data (an account id, an API key, a tenant). Any bytes are allowed.
    pub fn new(key: impl AsRef<[u8]>) -> Key {
        let key = key.as_ref();
        if key.len() > MAX_KEY_LEN {
            return Key(Repr::new(TAG_HASHED, &Sha256::digest(key)));
        }
        Key(Repr::new(TAG_USER, key))
    }

    /// A key for a client address. IPv6 addresses are grouped by `/ipv6_prefix` (a host
    /// usually owns a whole /64 and could otherwise rotate through it); IPv4 is kept whole, and
    /// IPv4-mapped IPv6 addresses count as the IPv4 address.
    pub fn from_ip(ip: IpAddr, ipv6_prefix: u8) -> Key {
        // Binary, not text: an address key is built on every request, and formatting one costs
        // more than the rest of the key. Tag, then 4 address bytes, or 16 and the prefix length.
        let mut b = [0u8; 17];
        let len = match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => ipv4_key(&mut b, v4.octets()),
                None => {
                    let prefix = ipv6_prefix.min(128);
                    b[..16].copy_from_slice(&mask_v6(v6, prefix).octets());
                    b[16] = prefix;
                    17
                }
            },
            IpAddr::V4(v4) => ipv4_key(&mut b, v4.octets()),
        };
        Key(Repr::new(TAG_IP, &b[..len]))
    }

    /// The one key every request shares (a global limit).
    pub fn global() -> Key {
        Key(Repr::new(TAG_GLOBAL, &[]))
    }

    /// The one bucket shared by requests without a key (`MissingKey::Shared`); no user key
    /// can equal it.
    pub(crate) fn keyless() -> Key {
        Key(Repr::new(TAG_KEYLESS, &[]))
    }

    /// Whether every request (or every request without a key) shares this key: blocking it
    /// would refuse everyone for one client's flood.
    pub(crate) fn is_shared(&self) -> bool {
        *self == Key::global() || *self == Key::keyless()
    }

    /// The encoded key: a kind tag, then the user's bytes or a digest. Distinct keys have
    /// distinct encodings.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Shared(b) => b,
        }
    }

    /// The key as the user gave it, when it is text kept whole (for operators who opted in to
    /// raw keys); `None` for hashed, binary or address keys (their `Display` is readable).
    pub(crate) fn readable(&self) -> Option<String> {
        match self.as_bytes().split_first() {
            Some((&TAG_USER, text)) => std::str::from_utf8(text).ok().map(str::to_owned),
            _ => None,
        }
    }
}

fn ipv4_key(b: &mut [u8; 17], octets: [u8; 4]) -> usize {
    b[..4].copy_from_slice(&octets);
    4
}

fn mask_v6(ip: Ipv6Addr, prefix: u8) -> Ipv6Addr {
    let prefix = u32::from(prefix.min(128));
    let bits = u128::from(ip);
    let mask = if prefix == 0 {
        0
    } else {
        u128::MAX << (128 - prefix)
    };
    Ipv6Addr::from(bits & mask)
}

impl From<&str> for Key {
    fn from(s: &str) -> Key {
        Key::new(s)
    }
}

impl From<String> for Key {
    fn from(s: String) -> Key {
        Key::new(s)
    }
}

impl From<&[u8]> for Key {
    fn from(b: &[u8]) -> Key {
        Key::new(b)
    }
}

impl From<IpAddr> for Key {
    /// The address with IPv6 grouped by /64.
    fn from(ip: IpAddr) -> Key {
        Key::from_ip(ip, 64)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.as_bytes();
        match b.first() {
            Some(&TAG_IP) => match b.len() {
                5 => {
                    let o: [u8; 4] = b[1..5].try_into().map_err(|_| fmt::Error)?;
                    write!(f, "Key(ip {})", std::net::Ipv4Addr::from(o))
                }
                _ => {
                    let o: [u8; 16] = b
                        .get(1..17)
                        .ok_or(fmt::Error)?
                        .try_into()
                        .map_err(|_| fmt::Error)?;
                    write!(
                        f,
                        "Key(ip {}/{})",
                        Ipv6Addr::from(o),
                        b.get(17).ok_or(fmt::Error)?
                    )
                }
            },
            Some(&TAG_GLOBAL) => f.write_str("Key(global)"),
            _ => {
                let digest = Sha256::digest(b);
                write!(
                    f,
                    "Key(#{:02x}{:02x}{:02x}{:02x})",
                    digest[0], digest[1], digest[2], digest[3]
                )
            }
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_equal_exactly_when_their_encodings_are() {
        let long = "k".repeat(INLINE + 5);
        let cases = [
            Key::new(""),
            Key::new("a"),
            // The same bytes as "a" inline, one longer: only the length tells them apart.
            Key::new("a\0"),
            Key::new("b"),
            Key::new("k".repeat(INLINE - 2)),
            Key::new("k".repeat(INLINE - 1)),
            Key::new(&long),
            Key::new(format!("{long}x")),
            Key::from_ip("192.0.2.7".parse().unwrap(), 64),
        ];
        for a in &cases {
            for b in &cases {
                assert_eq!(a == b, a.as_bytes() == b.as_bytes(), "{a:?} vs {b:?}");
            }
            assert_eq!(a, &a.clone());
        }
    }

    #[test]
    fn kinds_never_collide() {
        assert_ne!(Key::new("fleetlimit:keyless"), Key::keyless());
        assert_ne!(Key::global(), Key::keyless());
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert_ne!(Key::new("10.0.0.1"), Key::from(ip));
        assert_ne!(Key::new("g"), Key::global());
        assert_ne!(Key::new(""), Key::global());
    }

    #[test]
    fn long_keys_are_hashed_and_distinct() {
        let a = Key::new(vec![b'a'; 10_000]);
        let mut other = vec![b'a'; 10_000];
        other[9_999] = b'b';
        let b = Key::new(other);
        assert_eq!(a.as_bytes().len(), 33);
        assert_ne!(a, b);
        // A short key equal to a digest's bytes is still a different key (different tag).
        assert_ne!(Key::new(&a.as_bytes()[1..]), a);
        assert_eq!(
            Key::new(vec![b'x'; MAX_KEY_LEN]).as_bytes().len(),
            MAX_KEY_LEN + 1
        );
    }

    #[test]
    fn ipv6_grouped_by_prefix() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Key::from(a), Key::from(b));
        assert_ne!(Key::from(a), Key::from(c));
        assert_ne!(Key::from_ip(a, 128), Key::from_ip(b, 128));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(
            Key::from(mapped),
            Key::from("10.0.0.1".parse::<IpAddr>().unwrap())
        );
    }

    #[test]
    fn debug_never_shows_user_keys() {
        let k = Key::new("sk_live_secret");
        let shown = format!("{k:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(
            format!("{:?}", Key::from("1.2.3.4".parse::<IpAddr>().unwrap())).contains("1.2.3.4")
        );
    }
}
