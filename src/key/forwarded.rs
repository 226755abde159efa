//! The real client address behind reverse proxies, without letting clients spoof it.
//!
//! Forwarding headers (`Forwarded`, `X-Forwarded-For`) are believed only when the TCP peer is a
//! trusted proxy. The chain is then walked from the right (the peer being the last hop), skipping
//! trusted proxies; the first untrusted hop is the client. Anything we cannot parse on the way
//! makes us fall back to the peer: we never return an address the client could pick freely.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use http::HeaderMap;
use ipnet::IpNet;

/// At most this many forwarding elements (counted from the right) are looked at.
const MAX_HOPS: usize = 32;
/// Header lines longer than this many bytes make the chain malformed.
const MAX_LINE: usize = 8 * 1024;

/// Proxies whose forwarding headers are believed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
}

impl TrustedProxies {
    /// No proxy is trusted (forwarding headers are always ignored).
    pub fn none() -> Self {
        Self::default()
    }

    /// Parse CIDR ranges or single addresses (`"10.0.0.0/8"`, `"192.168.1.7"`, `"::1"`,
    /// `"fd00::/8"`). A single address means /32 or /128. Host bits of a range are cleared.
    ///
    /// Returns `Err` naming the first entry that is neither a range nor an address.
    pub fn new<I, S>(ranges: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut nets = Vec::new();
        for entry in ranges {
            let raw = entry.as_ref();
            let s = raw.trim();
            let net = if s.contains('/') {
                s.parse::<IpNet>().ok().map(|n| n.trunc())
            } else {
                s.parse::<IpAddr>().ok().map(IpNet::from)
            };
            match net {
                Some(net) => nets.push(net),
                None => return Err(format!("invalid trusted proxy range {raw:?}")),
            }
        }
        Ok(Self { nets })
    }

    /// Loopback and private ranges: 127.0.0.0/8, 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16,
    /// ::1/128, fc00::/7.
    pub fn private_networks() -> Self {
        const RANGES: [&str; 6] = [
            "127.0.0.0/8",
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "::1/128",
            "fc00::/7",
        ];
        let nets = RANGES.iter().filter_map(|r| r.parse().ok()).collect();
        Self { nets }
    }

    /// Whether `ip` is trusted (IPv4-mapped IPv6 addresses are compared as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let canonical = ip.to_canonical();
        self.nets
            .iter()
            .any(|net| net.contains(&canonical) || net.contains(&ip))
    }

    /// Whether no range is configured.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }
}

/// Which forwarding header(s) to read: the one your proxies set. Read only that one: a proxy
/// that appends `X-Forwarded-For` usually passes a client's own `Forwarded` header through
/// untouched, and reading it would let the client choose its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedHeader {
    /// RFC 7239 `Forwarded` (the `for=` parameter) if present, else `X-Forwarded-For`: only for
    /// proxies that set (or strip) both.
    Both,
    /// Only `Forwarded`.
    Forwarded,
    /// Only `X-Forwarded-For`, what most proxies and load balancers append. The default.
    #[default]
    XForwardedFor,
}

/// The client address: `peer` unless `peer` is trusted, in which case the right-most untrusted
/// address of the forwarding chain (peer appended as the last hop). If every hop is trusted, the
/// left-most hop. If the chain is malformed or contains an unusable hop (`unknown`, obfuscated
/// `_x`, garbage) at or before the position we would pick, return `peer` (fail safe: never an
/// address the client could have chosen freely).
///
/// With [`ForwardedHeader::Both`], a present `Forwarded` header is used even if it turns out to be
/// unusable; `X-Forwarded-For` is read only when no `Forwarded` line exists. At most the last 32
/// elements are examined; if they are all trusted and more exist, the result is `peer`.
pub fn client_ip(
    peer: IpAddr,
    headers: &HeaderMap,
    trusted: &TrustedProxies,
    which: ForwardedHeader,
) -> IpAddr {
    let peer = peer.to_canonical();
    if !trusted.contains(peer) {
        return peer;
    }
    let use_forwarded = match which {
        ForwardedHeader::Both => headers.contains_key(http::header::FORWARDED),
        ForwardedHeader::Forwarded => true,
        ForwardedHeader::XForwardedFor => false,
    };
    let hops = if use_forwarded {
        chain(headers, "forwarded", push_forwarded)
    } else {
        chain(headers, "x-forwarded-for", push_xff)
    };
    let Some(hops) = hops else { return peer };
    // `hops` runs right to left; `None` is a hop we cannot use.
    let mut leftmost = peer;
    for (i, hop) in hops.iter().enumerate() {
        if i >= MAX_HOPS {
            return peer;
        }
        match *hop {
            Some(ip) if trusted.contains(ip) => leftmost = ip,
            Some(ip) => return ip,
            None => return peer,
        }
    }
    leftmost
}

/// Right-to-left hops of header `name` (at most `MAX_HOPS + 1`), or `None` if a line is too long
/// or not visible ASCII.
fn chain(
    headers: &HeaderMap,
    name: &'static str,
    push: fn(&str, &mut Vec<Option<IpAddr>>),
) -> Option<Vec<Option<IpAddr>>> {
    let lines = headers.get_all(name);
    for line in lines.iter() {
        if line.len() > MAX_LINE || line.to_str().is_err() {
            return None;
        }
    }
    let mut hops = Vec::with_capacity(MAX_HOPS + 1);
    for line in lines.iter().rev() {
        if hops.len() > MAX_HOPS {
            break;
        }
        push(line.to_str().ok()?, &mut hops);
    }
    Some(hops)
}

/// Push the elements of one `X-Forwarded-For` line, right to left.
fn push_xff(line: &str, hops: &mut Vec<Option<IpAddr>>) {
    for element in line.rsplit(',') {
        if hops.len() > MAX_HOPS {
            return;
        }
        let element = trim_ows(element);
        let ip = match element.parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => parse_host_port(element),
        };
        hops.push(ip.map(|ip| ip.to_canonical()));
    }
}

/// Push the elements of one `Forwarded` line, right to left. A line with broken quoting counts
/// as one unusable hop.
fn push_forwarded(line: &str, hops: &mut Vec<Option<IpAddr>>) {
    let Some(elements) = split_unquoted(line, b',') else {
        hops.push(None);
        return;
    };
    for element in elements.iter().rev() {
        if hops.len() > MAX_HOPS {
            return;
        }
        hops.push(forwarded_for(element).map(|ip| ip.to_canonical()));
    }
}

/// The address in the `for=` parameter of one `Forwarded` element, if the element is well formed
/// and has exactly one usable `for=`.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    let mut seen_for = false;
    let mut found = None;
    for pair in split_unquoted(element, b';')? {
        let pair = trim_ows(pair);
        if pair.is_empty() {
            continue;
        }
        let (name, value) = pair.split_once('=')?;
        let name = trim_ows(name);
        if !is_token(name) {
            return None;
        }
        let value = unquote(trim_ows(value))?;
        if name.eq_ignore_ascii_case("for") {
            if seen_for {
                return None;
            }
            seen_for = true;
            found = parse_node(&value);
        }
    }
    found
}

/// An RFC 7239 node: `unknown` and obfuscated `_names` are unusable.
fn parse_node(node: &str) -> Option<IpAddr> {
    if node.eq_ignore_ascii_case("unknown") || node.starts_with('_') {
        return None;
    }
    parse_host_port(node)
}

/// `[v6]`, `[v6]:port`, `v4` or `v4:port`.
fn parse_host_port(s: &str) -> Option<IpAddr> {
    if let Some(rest) = s.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        let ip = v6.parse::<Ipv6Addr>().ok()?;
        return (after.is_empty() || after.strip_prefix(':').is_some_and(is_port))
            .then_some(IpAddr::V6(ip));
    }
    let (v4, port) = match s.split_once(':') {
        Some((v4, port)) => (v4, Some(port)),
        None => (s, None),
    };
    if port.is_some_and(|p| !is_port(p)) {
        return None;
    }
    v4.parse::<Ipv4Addr>().ok().map(IpAddr::V4)
}

/// A numeric port (0-65535) or an RFC 7239 obfuscated port (`_` then ALPHA, DIGIT, `.`, `_`, `-`).
fn is_port(p: &str) -> bool {
    if let Some(obf) = p.strip_prefix('_') {
        return !obf.is_empty()
            && obf
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    }
    !p.is_empty()
        && p.len() <= 5
        && p.bytes().all(|b| b.is_ascii_digit())
        && p.parse::<u16>().is_ok()
}

/// Split on `delim` outside quoted-strings; `None` if a quoted-string is not terminated.
fn split_unquoted(s: &str, delim: u8) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let (mut start, mut in_quotes, mut escaped) = (0, false, false);
    for (i, b) in s.bytes().enumerate() {
        if escaped {
            escaped = false;
        } else if in_quotes {
            match b {
                b'\\' => escaped = true,
                b'"' => in_quotes = false,
                _ => {}
            }
        } else if b == b'"' {
            in_quotes = true;
        } else if b == delim {
            parts.push(s.get(start..i)?);
            start = i + 1;
        }
    }
    if in_quotes || escaped {
        return None;
    }
    parts.push(s.get(start..)?);
    Some(parts)
}

/// A token as is, or the content of a quoted-string with quoted-pairs resolved.
fn unquote(value: &str) -> Option<Cow<'_, str>> {
    let Some(body) = value.strip_prefix('"') else {
        return is_token(value).then_some(Cow::Borrowed(value));
    };
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push(chars.next()?),
            // The closing quote must be the last character.
            '"' => return chars.next().is_none().then_some(Cow::Owned(out)),
            c => out.push(c),
        }
    }
    None
}

/// An RFC 9110 token: one or more tchars.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Trim optional whitespace (spaces and tabs).
fn trim_ows(s: &str) -> &str {
    s.trim_matches(|c| c == ' ' || c == '\t')
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::time::{Duration, Instant};

    const PEER: &str = "10.0.0.1";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn get(peer: &str, h: &HeaderMap, which: ForwardedHeader) -> IpAddr {
        client_ip(ip(peer), h, &TrustedProxies::private_networks(), which)
    }

    /// Each case: header lines, then the expected client for `PEER` (10.0.0.1, trusted).
    fn check(name: &'static str, which: ForwardedHeader, cases: &[(&[&str], &str)]) {
        for (lines, want) in cases {
            let mut h = HeaderMap::new();
            for line in *lines {
                h.append(name, HeaderValue::from_str(line).unwrap());
            }
            assert_eq!(get(PEER, &h, which), ip(want), "{name}: {lines:?}");
        }
    }

    #[test]
    fn untrusted_peer_ignores_headers() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("1.2.3.4"));
        h.insert("forwarded", HeaderValue::from_static("for=1.2.3.4"));
        for which in [ForwardedHeader::Both, ForwardedHeader::XForwardedFor] {
            assert_eq!(get("203.0.113.9", &h, which), ip("203.0.113.9"));
        }
        let none = TrustedProxies::none();
        assert_eq!(
            client_ip(ip(PEER), &h, &none, ForwardedHeader::Both),
            ip(PEER)
        );
    }

    #[test]
    fn x_forwarded_for() {
        check(
            "x-forwarded-for",
            ForwardedHeader::Both,
            &[
                (&["6.6.6.6, 198.51.100.7"], "198.51.100.7"), // client's spoofed entry ignored
                (&["198.51.100.7, 10.0.0.2"], "198.51.100.7"), // trusted hops skipped
                (&["\t198.51.100.7 ,10.0.0.2  "], "198.51.100.7"),
                (&["[2001:db8::1]:443"], "2001:db8::1"),
                (&["[2001:db8::1]"], "2001:db8::1"),
                (&["2001:db8::1"], "2001:db8::1"),
                (&["198.51.100.7:8080"], "198.51.100.7"),
                (&["::ffff:198.51.100.7"], "198.51.100.7"),
                (&["10.0.0.3, 192.168.1.1"], "10.0.0.3"), // all trusted: left-most
                (&[], PEER),
                // Malformed at or before the pick: peer. Left of the pick: irrelevant.
                (&["198.51.100.7, , 10.0.0.2"], PEER),
                (&["garbage"], PEER),
                (&["198.51.100.7:99999"], PEER),
                (&["[1.2.3.4]"], PEER),
                (&["junk, , 198.51.100.7"], "198.51.100.7"),
                // Several lines are one list.
                (&["6.6.6.6", "198.51.100.8, 10.0.0.2"], "198.51.100.8"),
                (&["198.51.100.7", "10.0.0.2"], "198.51.100.7"),
            ],
        );
        let mapped = HeaderMap::from_iter([(
            http::header::HeaderName::from_static("x-forwarded-for"),
            HeaderValue::from_static("198.51.100.7"),
        )]);
        assert_eq!(
            get("::ffff:10.0.0.1", &mapped, ForwardedHeader::Both),
            ip("198.51.100.7")
        );
    }

    #[test]
    fn forwarded() {
        check(
            "forwarded",
            ForwardedHeader::Both,
            &[
                (&[r#"for="[2001:db8:cafe::17]:4711""#], "2001:db8:cafe::17"),
                (&[r#"for="[2001:db8:cafe::17]""#], "2001:db8:cafe::17"),
                (&["For=192.0.2.60;proto=http;by=203.0.113.43"], "192.0.2.60"),
                (&[r#"for="192.0.2.60:80""#], "192.0.2.60"),
                (&[r#"for="192.0.2.60:_p1""#], "192.0.2.60"),
                (
                    &[r#"for=192.0.2.60;ext="a,b;c\"d, e", for=10.0.0.3"#],
                    "192.0.2.60",
                ),
                (
                    &[r#"for=6.6.6.6, for="198.51.100.7";host="x,y""#],
                    "198.51.100.7",
                ),
                (&["for=unknown, for=198.51.100.1"], "198.51.100.1"),
                (
                    &["for=198.51.100.9", "for=10.0.0.2;proto=https"],
                    "198.51.100.9",
                ),
                // Unusable or malformed at the position we would pick: peer.
                (&["for=198.51.100.1, for=unknown"], PEER),
                (&["for=198.51.100.1, for=_hidden"], PEER),
                (&["for=198.51.100.1, proto=https"], PEER),
                (&["for=198.51.100.1;for=198.51.100.2"], PEER),
                (&[r#"for="198.51.100.1"#], PEER),
                (&[r#"for="198.51.100.1"x"#], PEER),
                (&["for=[2001:db8::1]"], PEER),
                (&["for=2001:db8::1"], PEER),
                (&[r#"for="2001:db8::1""#], PEER),
                (&["for"], PEER),
                (&["for=198.51.100.1, "], PEER),
                (&["for=198.51.100.9", r#"for="10.0.0.2"#], PEER),
            ],
        );
    }

    #[test]
    fn header_choice() {
        use super::ForwardedHeader::*;
        let fwd = ("forwarded", "for=192.0.2.60");
        let xff = ("x-forwarded-for", "198.51.100.7");
        for (lines, which, want) in [
            (&[fwd, xff][..], Both, "192.0.2.60"),
            (&[fwd, xff][..], Forwarded, "192.0.2.60"),
            (&[fwd, xff][..], XForwardedFor, "198.51.100.7"),
            (&[xff][..], Both, "198.51.100.7"),
            (&[xff][..], Forwarded, PEER),
            (&[fwd][..], XForwardedFor, PEER),
        ] {
            let mut h = HeaderMap::new();
            for (name, value) in lines {
                h.append(*name, HeaderValue::from_static(value));
            }
            assert_eq!(get(PEER, &h, which), ip(want), "{lines:?} {which:?}");
        }
    }

    #[test]
    fn non_ascii_value_is_peer() {
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("198.51.100.7"));
        h.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"\xff10.0.0.2").unwrap(),
        );
        assert_eq!(get(PEER, &h, ForwardedHeader::Both), ip(PEER));
        // A bad `Forwarded` is not replaced by `X-Forwarded-For`.
        h.insert("x-forwarded-for", HeaderValue::from_static("198.51.100.7"));
        h.append(
            "forwarded",
            HeaderValue::from_bytes(b"for=\xc3\xa9").unwrap(),
        );
        assert_eq!(get(PEER, &h, ForwardedHeader::Both), ip(PEER));
    }

    #[test]
    fn huge_header_is_peer_and_fast() {
        let big = "10.0.0.2, ".repeat(10_240) + "198.51.100.7";
        assert!(big.len() > 100_000);
        let start = Instant::now();
        check("x-forwarded-for", ForwardedHeader::Both, &[(&[&big], PEER)]);
        check("forwarded", ForwardedHeader::Both, &[(&[&big], PEER)]);
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn long_chains_are_bounded() {
        let mut h = HeaderMap::new();
        for i in 0..10_000u32 {
            let hop = format!("10.0.{}.{}", i / 256, i % 256);
            h.append("x-forwarded-for", HeaderValue::from_str(&hop).unwrap());
        }
        let start = Instant::now();
        // 10,000 trusted hops: more than 32, so give up and use the peer.
        assert_eq!(get(PEER, &h, ForwardedHeader::Both), ip(PEER));
        h.append(
            "x-forwarded-for",
            HeaderValue::from_static("198.51.100.7, 10.1.1.1"),
        );
        assert_eq!(get(PEER, &h, ForwardedHeader::Both), ip("198.51.100.7"));
        assert!(start.elapsed() < Duration::from_secs(2));
        // 32 trusted elements: the left-most; 33: the peer. Untrusted 32nd from the right: found.
        let (c31, c32) = (["10.9.9.9"; 31].join(", "), ["10.9.9.9"; 32].join(", "));
        check(
            "x-forwarded-for",
            ForwardedHeader::Both,
            &[
                (&[&c32], "10.9.9.9"),
                (&["10.8.8.8", &c32], PEER),
                (&["198.51.100.7", &c31], "198.51.100.7"),
                (&["198.51.100.7", &c32], PEER),
            ],
        );
    }

    #[test]
    fn trusted_proxies_parsing() {
        let err = TrustedProxies::new(["10.0.0.0/8", "bad"]).unwrap_err();
        assert!(err.contains("bad"), "{err}");
        assert!(TrustedProxies::new(["10.0.0.0/33"]).is_err());
        assert!(TrustedProxies::new([""]).is_err());
        let one = TrustedProxies::new(["192.168.1.7"]).unwrap();
        assert_eq!(one, TrustedProxies::new(["192.168.1.7/32"]).unwrap());
        assert!(one.contains(ip("192.168.1.7")) && !one.contains(ip("192.168.1.8")));
        assert!(one.contains(ip("::ffff:192.168.1.7")));
        let v6 = TrustedProxies::new(["::1", "fd00::/8"]).unwrap();
        assert_eq!(v6, TrustedProxies::new(["::1/128", "fd00::/8"]).unwrap());
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("::2")));
        let wide = TrustedProxies::new(["10.1.2.3/8"]).unwrap();
        assert!(wide.contains(ip("10.200.0.1")));
        let none = TrustedProxies::none();
        assert!(none.is_empty() && !none.contains(ip("127.0.0.1")));
        let p = TrustedProxies::private_networks();
        assert_eq!(p.nets.len(), 6);
        for a in [
            "127.0.0.1",
            "10.1.1.1",
            "172.31.0.1",
            "192.168.0.1",
            "::1",
            "fdff::1",
        ] {
            assert!(p.contains(ip(a)), "{a}");
        }
        for a in ["172.32.0.1", "8.8.8.8", "2001:db8::1", "::2"] {
            assert!(!p.contains(ip(a)), "{a}");
        }
    }
}
