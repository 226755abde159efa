//! The real client address behind reverse proxies, without letting clients spoof it.
//!
//! Forwarding headers (`Forwarded`, `X-Forwarded-For`) are believed only when the TCP peer is a
//! trusted proxy. The chain is then read from the right (the peer being the last hop), one
//! element at a time, skipping trusted proxies; the first untrusted hop is the client. Only the
//! elements that trusted proxies appended are ever read: whatever a client put to the left of
//! them (malformed, non-ASCII, oversized, unbalanced quotes, thousands of hops) never changes the
//! result, and the work stops at the element picked.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use http::HeaderMap;
use ipnet::IpNet;

/// At most this many forwarding elements (counted from the right) are looked at.
const MAX_HOPS: usize = 32;
/// An `X-Forwarded-For` element or a `for=` value longer than this many bytes is no address.
const MAX_ELEMENT: usize = 512;

/// Proxies whose forwarding headers are believed: address ranges, or a number of hops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
    /// Trust by count: this many proxies stand in front of the service (the peer is the
    /// nearest); 0 when trusting by range.
    hops: u8,
}

/// Whether a trusted range is wider than any network of proxies: an IPv4 range wider than a /8
/// (IPv4-mapped IPv6 ranges alike), an IPv6 range wider than a /7 (`fc00::/7`, every unique
/// local address, is the widest private one).
fn too_wide(net: &IpNet) -> bool {
    const MAPPED: IpNet = IpNet::V6(
        match ipnet::Ipv6Net::new(std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96) {
            Ok(net) => net,
            Err(_) => panic!("a valid prefix"),
        },
    );
    match net {
        IpNet::V4(v4) => v4.prefix_len() < 8,
        IpNet::V6(v6) if v6.prefix_len() < 7 => true,
        // Covering IPv4-mapped addresses: judged as the IPv4 range it holds.
        IpNet::V6(v6) => {
            (net.contains(&MAPPED) || MAPPED.contains(net)) && v6.prefix_len() < 96 + 8
        }
    }
}

impl TrustedProxies {
    /// No proxy is trusted (forwarding headers are always ignored).
    pub fn none() -> Self {
        Self::default()
    }

    /// Parse CIDR ranges or single addresses (`"10.0.0.0/8"`, `"192.168.1.7"`, `"::1"`,
    /// `"fd00::/8"`). A single address means /32 or /128. Host bits of a range are cleared.
    ///
    /// An entry that is neither a range nor an address is a [`ConfigError`](crate::ConfigError),
    /// as is a range wider than an IPv4 /8 or an IPv6 /7 (`0.0.0.0/0` trusts every client to
    /// name its own address; [`hops`](TrustedProxies::hops) trusts whatever stands in front).
    pub fn new<I, S>(ranges: I) -> Result<Self, crate::ConfigError>
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
                Some(net) if too_wide(&net) => {
                    return Err(crate::ConfigError::Invalid {
                        setting: "trusted proxies",
                        reason: format!(
                            "{raw:?} trusts a large part of the internet (wider than an IPv4 \
                             /8 or an IPv6 /7): any client would choose its own address with a \
                             forwarding header; to trust whatever proxy stands in front, use \
                             TrustedProxies::hops"
                        ),
                    })
                }
                Some(net) => nets.push(net),
                None => {
                    return Err(crate::ConfigError::Invalid {
                        setting: "trusted proxies",
                        reason: format!("{raw:?} is neither an address nor a CIDR range"),
                    })
                }
            }
        }
        Ok(Self { nets, hops: 0 })
    }

    /// Trust by count, as express's `trust proxy: N`: exactly `hops` proxies (1 to 32) stand in
    /// front of the service, the peer being the nearest; the client is the `hops`-th address
    /// from the right of the forwarding chain (the left-most when the chain is shorter). Only
    /// sound when no client can reach the service without passing through all of them: a
    /// client that bypasses one chooses its address.
    pub fn hops(hops: u8) -> Result<Self, crate::ConfigError> {
        if hops == 0 || usize::from(hops) > MAX_HOPS {
            return Err(crate::ConfigError::Invalid {
                setting: "trusted hops",
                reason: format!("must be between 1 and {MAX_HOPS}, got {hops}"),
            });
        }
        Ok(Self {
            nets: Vec::new(),
            hops,
        })
    }

    /// Loopback and private ranges: 127.0.0.0/8, 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16,
    /// ::1/128, fc00::/7.
    pub fn private_networks() -> Self {
        Self {
            nets: private_nets(),
            hops: 0,
        }
    }

    /// Whether `ip` is trusted (IPv4-mapped IPv6 addresses are compared as IPv4). When trusting
    /// by count, the peer always is.
    pub fn contains(&self, ip: IpAddr) -> bool {
        if self.hops > 0 {
            return true;
        }
        // Both forms of an IPv4 address: a proxy written as `::ffff:10.0.0.1` (as a dual-stack
        // listener reports it) is the peer `10.0.0.1` once canonical.
        let canonical = ip.to_canonical();
        let mapped = match canonical {
            IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
            IpAddr::V6(_) => canonical,
        };
        self.nets
            .iter()
            .any(|net| net.contains(&canonical) || net.contains(&mapped))
    }

    /// Whether no proxy is trusted.
    pub fn is_empty(&self) -> bool {
        self.nets.is_empty() && self.hops == 0
    }
}

fn private_nets() -> Vec<IpNet> {
    const RANGES: [&str; 6] = [
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "::1/128",
        "fc00::/7",
    ];
    RANGES.iter().filter_map(|r| r.parse().ok()).collect()
}

/// Whether `ip` is loopback or in a private range (a proxy's address, usually).
pub(crate) fn is_private(ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    private_nets().iter().any(|net| net.contains(&ip))
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
/// address of the forwarding chain (peer appended as the last hop); if every hop is trusted, the
/// left-most hop. An element a trusted proxy appended that is no usable address (`unknown`, an
/// obfuscated `_x`, garbage) names no client: the proxy that appended it is the answer. Only the
/// elements up to the one picked are read, so nothing a client sent to the left of them matters;
/// past 32 trusted elements, `peer`.
///
/// With [`ForwardedHeader::Both`], a present `Forwarded` header is used; `X-Forwarded-For` is
/// read only when no `Forwarded` line exists.
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
    let forwarded = match which {
        ForwardedHeader::Both => headers.contains_key(http::header::FORWARDED),
        ForwardedHeader::Forwarded => true,
        ForwardedHeader::XForwardedFor => false,
    };
    let name = if forwarded {
        http::header::FORWARDED
    } else {
        http::header::HeaderName::from_static("x-forwarded-for")
    };
    let parse = if forwarded {
        forwarded_for
    } else {
        xff_element
    };
    // Right to left: the last line first, each line's elements from its end.
    let elements = headers
        .get_all(&name)
        .iter()
        .rev()
        .flat_map(|line| Elements::new(line.as_bytes(), forwarded));
    let mut nearest = peer;
    for (i, element) in elements.enumerate() {
        if i >= MAX_HOPS {
            return peer;
        }
        let hop = parse(element).map(|ip| ip.to_canonical());
        if trusted.hops > 0 {
            // By count: the `hops - 1` elements nearest the peer are the other proxies.
            match hop {
                Some(ip) if i + 1 >= usize::from(trusted.hops) => return ip,
                Some(ip) => nearest = ip,
                None => return nearest,
            }
            continue;
        }
        match hop {
            Some(ip) if trusted.contains(ip) => nearest = ip,
            Some(ip) => return ip,
            None => return nearest,
        }
    }
    nearest
}

/// The elements of one header line, from the right: split on `,` (outside quoted-strings for
/// `Forwarded`), each trimmed. Reading stops where the caller stops: the bytes to the left of
/// the last element taken are never examined.
struct Elements<'a> {
    rest: &'a [u8],
    quoted: bool,
    done: bool,
}

impl<'a> Elements<'a> {
    fn new(line: &'a [u8], quoted: bool) -> Self {
        Elements {
            rest: line,
            quoted,
            done: false,
        }
    }
}

impl<'a> Iterator for Elements<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.done {
            return None;
        }
        let bytes = self.rest;
        let mut in_quotes = false;
        let mut i = bytes.len();
        while i > 0 {
            i -= 1;
            let b = bytes[i];
            if self.quoted && b == b'"' {
                // A quote escaped by an odd run of backslashes is content.
                let slashes = bytes[..i].iter().rev().take_while(|&&c| c == b'\\').count();
                if slashes % 2 == 0 {
                    in_quotes = !in_quotes;
                }
            } else if b == b',' && !in_quotes {
                self.rest = &bytes[..i];
                return Some(trim_ows_bytes(&bytes[i + 1..]));
            }
        }
        self.done = true;
        Some(trim_ows_bytes(bytes))
    }
}

fn trim_ows_bytes(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// The address of one `X-Forwarded-For` element.
fn xff_element(element: &[u8]) -> Option<IpAddr> {
    if element.len() > MAX_ELEMENT {
        return None;
    }
    let element = std::str::from_utf8(element).ok()?;
    element
        .parse::<IpAddr>()
        .ok()
        .or_else(|| parse_host_port(element))
}

/// One address from a single-value client header (`X-Real-IP`, `CF-Connecting-IP`,
/// `True-Client-IP`): exactly one line holding one address.
pub(crate) fn single_value_ip(headers: &HeaderMap, name: &http::HeaderName) -> Option<IpAddr> {
    let mut lines = headers.get_all(name).iter();
    let line = lines.next()?;
    if lines.next().is_some() {
        return None;
    }
    xff_element(trim_ows_bytes(line.as_bytes())).map(|ip| ip.to_canonical())
}

/// The address in the `for=` parameter of one `Forwarded` element, if it has exactly one
/// usable `for=`. The element is a trusted proxy's, but its other parameters can carry the
/// client's bytes (a proxy that writes `host=` copies the client's `Host` header): however long,
/// non-UTF-8 or malformed they are, they never hide the `for=` the proxy wrote. Rejecting the
/// element for them would let any client pick the proxy's own bucket, out of its own and out of
/// any block on its address.
fn forwarded_for(element: &[u8]) -> Option<IpAddr> {
    let mut seen_for = false;
    let mut found = None;
    for pair in split_unquoted(element, b';')? {
        let pair = trim_ows_bytes(pair);
        let Some(eq) = pair.iter().position(|&b| b == b'=') else {
            continue; // no parameter at all: nothing the proxy said about the client
        };
        let (name, value) = (trim_ows_bytes(&pair[..eq]), trim_ows_bytes(&pair[eq + 1..]));
        if !name.eq_ignore_ascii_case(b"for") {
            continue;
        }
        if seen_for {
            return None;
        }
        seen_for = true;
        if value.len() > MAX_ELEMENT {
            return None;
        }
        let value = unquote(std::str::from_utf8(value).ok()?)?;
        found = parse_node(&value);
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
fn split_unquoted(s: &[u8], delim: u8) -> Option<Vec<&[u8]>> {
    let mut parts = Vec::new();
    let (mut start, mut in_quotes, mut escaped) = (0, false, false);
    for (i, &b) in s.iter().enumerate() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::time::{Duration, Instant};

    const PEER: &str = "10.0.0.1";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// A proxy written in its IPv4-mapped form (as a dual-stack listener reports it) is the
    /// same proxy as its IPv4 address, either way round: its clients' forwarding headers are
    /// read, not ignored with every client in the proxy's bucket.
    #[test]
    fn mapped_and_plain_ipv4_proxies_are_one() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("198.51.100.7"));
        for (written, peer) in [
            ("::ffff:10.0.0.1", "::ffff:10.0.0.1"),
            ("::ffff:10.0.0.1", "10.0.0.1"),
            ("10.0.0.1", "::ffff:10.0.0.1"),
            ("::ffff:10.0.0.0/104", "10.0.0.1"),
        ] {
            let trusted = TrustedProxies::new([written]).unwrap();
            assert!(trusted.contains(ip(peer)), "{written} holds {peer}");
            let client = client_ip(ip(peer), &h, &trusted, ForwardedHeader::XForwardedFor);
            assert_eq!(client, ip("198.51.100.7"), "{written}, peer {peer}");
        }
        let other = TrustedProxies::new(["::ffff:10.0.0.2"]).unwrap();
        assert!(!other.contains(ip("10.0.0.1")));
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
                // Unusable where the pick would be: the proxy that appended it. Left of the
                // pick: never read.
                (&["198.51.100.7, , 10.0.0.2"], "10.0.0.2"),
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
                // Unusable or malformed at the position we would pick: the proxy that wrote it.
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
                // A proxy's element whose other parameters carry the client's bytes (its
                // `Host`): however long or malformed, the proxy's `for=` still names the client.
                (
                    &[&format!(
                        r#"for=198.51.100.7;host="{}.example";proto=https"#,
                        "a".repeat(600)
                    )],
                    "198.51.100.7",
                ),
                (&["for=198.51.100.7;host=example.com:8080"], "198.51.100.7"),
                (&["host=x;;junk;for=198.51.100.7"], "198.51.100.7"),
                // A client's unbalanced quote to the left of what the proxy appended.
                (&[r#"for="6.6.6.6, for=198.51.100.9"#], "198.51.100.9"),
            ],
        );
        // Bytes that are not UTF-8 in another parameter (a `Host` the proxy copied as it came).
        let mut h = HeaderMap::new();
        let line = HeaderValue::from_bytes(b"for=\"198.51.100.7\";host=\xff\xfe").unwrap();
        h.insert("forwarded", line);
        assert_eq!(get(PEER, &h, ForwardedHeader::Both), ip("198.51.100.7"));
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

    /// The soundness of a proxied key: whatever a client writes to the left of what the trusted
    /// proxy appended (bytes ≥ 0x80, a line over 8 KB, unbalanced quotes, thousands of hops)
    /// never sends it to the proxy's bucket, nor anywhere but its own address.
    #[test]
    fn a_clients_part_of_the_chain_never_changes_the_result() {
        let hostile: Vec<Vec<u8>> = vec![
            b"\xff\xfe garbage".to_vec(),
            vec![b'a'; 20_000],
            b"\"unbalanced".to_vec(),
            "10.0.0.9, ".repeat(5_000).into_bytes(),
            b"for=\"[::1".to_vec(),
        ];
        for which in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
            let (name, appended) = match which {
                ForwardedHeader::Forwarded => ("forwarded", "for=198.51.100.7"),
                _ => ("x-forwarded-for", "198.51.100.7"),
            };
            for prefix in &hostile {
                // One line: the client's junk, then the proxy's append.
                let mut line = prefix.clone();
                line.extend_from_slice(b", ");
                line.extend_from_slice(appended.as_bytes());
                let mut h = HeaderMap::new();
                h.append(name, HeaderValue::from_bytes(&line).unwrap());
                let start = Instant::now();
                assert_eq!(
                    get(PEER, &h, which),
                    ip("198.51.100.7"),
                    "{which:?} one line"
                );
                assert!(start.elapsed() < Duration::from_millis(50));
                // Two lines: the client's own line, then the proxy's.
                let mut h = HeaderMap::new();
                h.append(name, HeaderValue::from_bytes(prefix).unwrap());
                h.append(name, HeaderValue::from_static(appended));
                assert_eq!(
                    get(PEER, &h, which),
                    ip("198.51.100.7"),
                    "{which:?} two lines"
                );
            }
        }
    }

    #[test]
    fn trust_by_hop_count() {
        let two = TrustedProxies::hops(2).unwrap();
        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-for",
            HeaderValue::from_static("6.6.6.6, 198.51.100.7, 203.0.113.5"),
        );
        // The peer (a load balancer) and one more proxy (203.0.113.5): the client is next.
        let got = client_ip(ip("192.0.2.1"), &h, &two, ForwardedHeader::XForwardedFor);
        assert_eq!(got, ip("198.51.100.7"));
        let one = TrustedProxies::hops(1).unwrap();
        let got = client_ip(ip("192.0.2.1"), &h, &one, ForwardedHeader::XForwardedFor);
        assert_eq!(got, ip("203.0.113.5"));
        // A chain shorter than the count: its left-most element.
        let five = TrustedProxies::hops(5).unwrap();
        let got = client_ip(ip("192.0.2.1"), &h, &five, ForwardedHeader::XForwardedFor);
        assert_eq!(got, ip("6.6.6.6"));
        assert!(TrustedProxies::hops(0).is_err() && TrustedProxies::hops(33).is_err());
    }

    #[test]
    fn single_value_client_headers() {
        let name = http::HeaderName::from_static("x-real-ip");
        let mut h = HeaderMap::new();
        assert_eq!(single_value_ip(&h, &name), None);
        h.append("x-real-ip", HeaderValue::from_static(" 198.51.100.7 "));
        assert_eq!(single_value_ip(&h, &name), Some(ip("198.51.100.7")));
        h.append("x-real-ip", HeaderValue::from_static("6.6.6.6"));
        assert_eq!(
            single_value_ip(&h, &name),
            None,
            "two lines: no single value"
        );
        let mut h = HeaderMap::new();
        h.append("x-real-ip", HeaderValue::from_static("1.2.3.4, 5.6.7.8"));
        assert_eq!(single_value_ip(&h, &name), None);
    }

    #[test]
    fn huge_header_is_fast() {
        let big = "10.0.0.2, ".repeat(10_240) + "198.51.100.7";
        assert!(big.len() > 100_000);
        let start = Instant::now();
        check(
            "x-forwarded-for",
            ForwardedHeader::Both,
            &[(&[&big], "198.51.100.7")],
        );
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
        assert!(err.to_string().contains("bad"), "{err}");
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
        assert!(is_private(ip("10.1.2.3")) && !is_private(ip("8.8.8.8")));
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
