//! Key extractors: how a request is turned into the key its limits count against.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

/// The IPv6 groupings [`PeerIp`] makes (and the admin router names).
pub(crate) const IPV6_PREFIXES: std::ops::RangeInclusive<u8> = 32..=128;

use http::request::Parts;
use http::HeaderName;

use super::forwarded::{is_private, single_value_ip};
use super::{client_ip, ForwardedHeader, Key, TrustedProxies};
use crate::ConfigError;

/// Chooses the key a request counts against.
///
/// Returning `None` means "no key from me": the layer falls back to the peer address.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key for this request, if this extractor can tell.
    fn extract(&self, parts: &Parts) -> Option<Key>;

    /// Whether this extractor is usable; checked when the layer is built, so a bad setting (an
    /// invalid header name) is a configuration error, never a failure on a request.
    fn check(&self) -> Result<(), ConfigError> {
        Ok(())
    }

    /// Whether a client picks this key freely (a header it sends): such a key alone does not
    /// limit a client that sends a new value each time.
    fn chosen_by_client(&self) -> bool {
        false
    }

    /// Whether this request carries the key where this extractor cannot read it (a gRPC
    /// call's body, a stream never buffered): a rule that skips requests without a key would
    /// let such a one through unlimited, so it shares the keyless bucket instead (see
    /// [`MissingKey::Skip`](crate::MissingKey::Skip)). Asked only when
    /// [`extract`](KeyExtractor::extract) found nothing.
    fn unreadable(&self, _parts: &Parts) -> bool {
        false
    }

    /// Whether this extractor keys by client address.
    fn per_address(&self) -> bool {
        false
    }
}

/// A [`KeyExtractor`] from a closure over the request's parts; see [`from_fn`].
#[derive(Clone)]
pub struct FnExtractor<F>(F);

impl<F> fmt::Debug for FnExtractor<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnExtractor")
    }
}

/// An extractor from a closure: the tenant, the account, an API key, anything in the request.
///
/// ```
/// use fleetlimit::key::{from_fn, KeyExtractor};
/// use fleetlimit::Key;
///
/// let by_api_key = from_fn(|parts| {
///     parts.headers.get("x-api-key").map(|v| Key::new(v.as_bytes()))
/// });
/// let (parts, _) = http::Request::builder().header("x-api-key", "abc").body(()).unwrap().into_parts();
/// assert_eq!(by_api_key.extract(&parts), Some(Key::new("abc")));
/// ```
pub fn from_fn<F>(f: F) -> FnExtractor<F>
where
    F: Fn(&Parts) -> Option<Key> + Send + Sync + 'static,
{
    FnExtractor(f)
}

impl<F> KeyExtractor for FnExtractor<F>
where
    F: Fn(&Parts) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<Key> {
        (self.0)(parts)
    }
}

/// A request header's value as the key (an API key, a tenant id). The name is case-insensitive
/// (`"X-Api-Key"` works); an invalid name is a configuration error when the layer is built. Any
/// bytes are accepted as the value; a request without the header has no key from this
/// extractor (the layer falls back to the peer address). Values over 128 bytes are hashed, like
/// every long key.
///
/// A client chooses this value: on its own, a client sending a new value each time is never
/// limited. Validate it first (an authentication layer), or put a per-address rule in front (the
/// README's "Keys an attacker controls"). The key is the header's *first* line, byte for byte:
/// validating is enough only if the validator reads exactly those bytes. One that accepts the
/// header when any line is valid, or the last, or after trimming or lowercasing, lets a client
/// send `x-api-key: <random>` before its real key and be counted against a fresh bucket each
/// time; key on what the authentication layer stored in the request's extensions instead
/// (with [`from_fn`]).
///
/// ```
/// use fleetlimit::key::{header, KeyExtractor};
/// use fleetlimit::Key;
///
/// let by_api_key = header("X-Api-Key");
/// let (parts, _) = http::Request::builder().header("x-api-key", "abc").body(()).unwrap().into_parts();
/// assert_eq!(by_api_key.extract(&parts), Some(Key::new("abc")));
/// ```
pub fn header(name: &str) -> HeaderKey {
    HeaderKey(
        HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(|e| {
            ConfigError::Invalid {
                setting: "key header",
                reason: format!("{name:?} is not a header name: {e}"),
            }
        }),
    )
}

/// A [`KeyExtractor`] reading a request header; see [`header`].
#[derive(Debug, Clone)]
pub struct HeaderKey(Result<HeaderName, ConfigError>);

impl HeaderKey {
    /// A header extractor, its name checked now.
    pub fn new(name: &str) -> Result<HeaderKey, ConfigError> {
        let key = header(name);
        key.check()?;
        Ok(key)
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        parts
            .headers
            .get(self.0.as_ref().ok()?)
            .filter(|v| !v.is_empty())
            .map(|v| Key::new(v.as_bytes()))
    }

    fn check(&self) -> Result<(), ConfigError> {
        self.0.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    fn chosen_by_client(&self) -> bool {
        true
    }
}

/// One key for every request: a global limit.
pub fn global() -> Global {
    Global
}

/// A [`KeyExtractor`] giving every request the same key; see [`global`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _: &Parts) -> Option<Key> {
        Some(Key::global())
    }
}

/// The client's address: the connection's peer address (axum's `ConnectInfo<SocketAddr>`,
/// tonic's connect info, or a plain `SocketAddr` request extension), or, when that peer is a
/// trusted proxy, the right-most untrusted address of its `Forwarded`/`X-Forwarded-For` chain.
/// Forwarding headers from anyone else are ignored, so a client cannot spoof its way to a fresh
/// bucket. IPv6 clients are grouped by a prefix (default /64).
///
/// Misconfiguration is said once, at `warn`: forwarding headers from an untrusted private-range
/// peer (a proxy not configured), or the first 10,000 requests all from one address (every
/// client sharing the proxy's bucket).
///
/// ```
/// use fleetlimit::key::{PeerIp, TrustedProxies};
///
/// // Behind a load balancer on the private network.
/// let client = PeerIp::default().trust(TrustedProxies::new(["10.0.0.0/8"])?);
/// // Behind exactly two proxies (a CDN, then a load balancer), whatever their addresses.
/// let counted = PeerIp::default().trust(TrustedProxies::hops(2)?);
/// // Behind a proxy that sets one header with the client's address.
/// let real_ip = PeerIp::default()
///     .trust(TrustedProxies::new(["10.0.0.0/8"])?)
///     .client_header("X-Real-IP")?;
/// # let _ = (client, counted, real_ip);
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PeerIp {
    ipv6_prefix: u8,
    trusted: TrustedProxies,
    header: ForwardedHeader,
    client_header: Option<HeaderName>,
    connect_info: Option<ConnectInfo>,
    watch: Arc<Watch>,
}

/// The peer address read from a connection-info type given to [`PeerIp::connect_info`].
#[derive(Clone)]
struct ConnectInfo(Arc<PeerFrom>);

type PeerFrom = dyn Fn(&http::Extensions) -> Option<SocketAddr> + Send + Sync;

impl fmt::Debug for ConnectInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnectInfo(..)")
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        PeerIp {
            ipv6_prefix: 64,
            trusted: TrustedProxies::none(),
            header: ForwardedHeader::default(),
            client_header: None,
            connect_info: None,
            watch: Arc::default(),
        }
    }
}

/// Requests from one peer before the layer says that every client seems to share it.
const SAME_PEER_WARNING: u32 = 10_000;

static X_FORWARDED_FOR: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");

/// Watches for a proxy nobody configured; says so once.
#[derive(Debug, Default)]
struct Watch {
    warned_forwarding: AtomicBool,
    first_peer: OnceLock<IpAddr>,
    same_peer: AtomicU32,
    settled: AtomicBool,
}

/// About one call in 64 per thread, the first included: a proxy nobody configured forwards
/// every request, so a sample finds it without two header lookups on each.
///
/// The thread's calls are spread by a Weyl sequence (multiples of the golden ratio, top bits)
/// rather than taken as `n % 64`: several address keys are often called in a fixed order per
/// request (an outer and an inner layer, a scope's own), and with two of them `n % 64` would
/// never pick the second.
fn sampled() -> bool {
    thread_local! {
        static SEEN: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    SEEN.try_with(|seen| {
        let n = seen.get();
        seen.set(n.wrapping_add(1));
        n.wrapping_mul(0x9E37_79B9) >> (32 - FORWARDING_SAMPLE_BITS) == 0
    })
    .unwrap_or(true)
}

/// See [`sampled`]: one call in 2^6.
const FORWARDING_SAMPLE_BITS: u32 = 6;

impl Watch {
    /// `peer` sent this request for `client` (the peer itself, unless it is a trusted proxy).
    fn observe(&self, peer: IpAddr, client: IpAddr, parts: &Parts, trusted: &TrustedProxies) {
        if !self.warned_forwarding.load(Ordering::Relaxed)
            && sampled()
            && (parts.headers.contains_key(&X_FORWARDED_FOR)
                || parts.headers.contains_key(http::header::FORWARDED))
            && !trusted.contains(peer)
            && is_private(peer)
            && !self.warned_forwarding.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                %peer,
                "fleetlimit: requests from a private address carry forwarding headers, but no \
                 proxy is trusted: if this is your load balancer, every client behind it \
                 shares one limit (configure PeerIp::trust)"
            );
        }
        if self.settled.load(Ordering::Relaxed) {
            return;
        }
        // Clients, not peers: behind a trusted proxy the peer never changes, and all is well.
        if *self.first_peer.get_or_init(|| client) != client {
            self.settled.store(true, Ordering::Relaxed);
        } else if self.same_peer.fetch_add(1, Ordering::Relaxed) + 1 == SAME_PEER_WARNING {
            self.settled.store(true, Ordering::Relaxed);
            tracing::warn!(
                peer = %client,
                "fleetlimit: the first {SAME_PEER_WARNING} requests all came from one address: \
                 if it is a proxy, every client shares its limit (configure PeerIp::trust)"
            );
        }
    }
}

impl PeerIp {
    /// Believe forwarding headers from these proxies (default: none).
    pub fn trust(mut self, proxies: TrustedProxies) -> Self {
        self.trusted = proxies;
        self
    }

    /// Read the client's address from this single-value header (`X-Real-IP`,
    /// `CF-Connecting-IP`, `True-Client-IP`) when the peer is a trusted proxy; a request whose
    /// header is missing or holds anything but one address falls back to the forwarding chain.
    /// Only for proxies that always set (overwrite) it.
    pub fn client_header(mut self, name: &str) -> Result<Self, ConfigError> {
        let name = HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(|e| {
            ConfigError::Invalid {
                setting: "client header",
                reason: format!("{name:?} is not a header name: {e}"),
            }
        })?;
        self.client_header = Some(name);
        Ok(self)
    }

    /// Which forwarding header trusted proxies set (default: `X-Forwarded-For`).
    pub fn forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Read the peer address from a connection-info type of the server's, tried before the
    /// types this crate knows (axum's `ConnectInfo<SocketAddr>`, tonic's `TcpConnectInfo`, a
    /// `SocketAddr`). tonic serving TLS records `TlsConnectInfo<TcpConnectInfo>` instead, and
    /// needs this (its type exists only with tonic's TLS features):
    /// `.connect_info(|i: &TlsConnectInfo<TcpConnectInfo>| i.get_ref().remote_addr())`.
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use fleetlimit::key::{KeyExtractor, PeerIp};
    ///
    /// /// What this server's acceptor records for each connection.
    /// #[derive(Clone)]
    /// struct Accepted { remote: SocketAddr }
    ///
    /// let peer = PeerIp::default().connect_info(|a: &Accepted| Some(a.remote));
    /// let mut parts = http::Request::new(()).into_parts().0;
    /// parts.extensions.insert(Accepted { remote: "203.0.113.9:443".parse().unwrap() });
    /// assert!(peer.extract(&parts).is_some());
    /// ```
    pub fn connect_info<T: Clone + Send + Sync + 'static>(
        mut self,
        peer: impl Fn(&T) -> Option<SocketAddr> + Send + Sync + 'static,
    ) -> Self {
        self.connect_info = Some(ConnectInfo(Arc::new(move |extensions| {
            extensions.get::<T>().and_then(&peer)
        })));
        self
    }

    /// The peer address: from the [`connect_info`](PeerIp::connect_info) type if one is
    /// given and recorded, else as [`peer_addr`](PeerIp::peer_addr) finds it.
    fn peer(&self, parts: &Parts) -> Option<IpAddr> {
        let custom = self.connect_info.as_ref();
        custom
            .and_then(|read| (read.0)(&parts.extensions))
            .map(|a| a.ip())
            .or_else(|| PeerIp::peer_addr(parts))
    }

    /// Group IPv6 peers by this prefix length (32–128; default 64). 128 counts every address
    /// on its own; 48 or 56 group a whole site or subscriber (which can rotate through 65,536
    /// or 256 /64s). Outside 32–128 the layer's `build` fails: a shorter prefix puts whole
    /// providers in one bucket, which the penalty box could block for everyone in it.
    pub fn ipv6_prefix(mut self, prefix: u8) -> Self {
        self.ipv6_prefix = prefix;
        self
    }

    /// The error a layer's `build` returns for these settings, if any.
    pub(crate) fn check(&self) -> Result<(), crate::ConfigError> {
        if !IPV6_PREFIXES.contains(&self.ipv6_prefix) {
            return Err(crate::ConfigError::Invalid {
                setting: "PeerIp::ipv6_prefix",
                reason: format!("must be between 32 and 128, got {}", self.ipv6_prefix),
            });
        }
        Ok(())
    }

    /// The peer address recorded in the request's extensions, if any: axum's `ConnectInfo`
    /// (or its `MockConnectInfo`, so users' router tests work), tonic's `TcpConnectInfo` (with
    /// the `tonic` feature), else a `SocketAddr`.
    pub fn peer_addr(parts: &Parts) -> Option<IpAddr> {
        #[cfg(feature = "axum")]
        {
            use axum::extract::connect_info::{ConnectInfo, MockConnectInfo};
            if let Some(info) = parts.extensions.get::<ConnectInfo<SocketAddr>>() {
                return Some(info.0.ip());
            }
            if let Some(info) = parts.extensions.get::<MockConnectInfo<SocketAddr>>() {
                return Some(info.0.ip());
            }
        }
        #[cfg(feature = "tonic")]
        if let Some(addr) = parts
            .extensions
            .get::<tonic::transport::server::TcpConnectInfo>()
            .and_then(|info| info.remote_addr())
        {
            return Some(addr.ip());
        }
        parts.extensions.get::<SocketAddr>().map(|a| a.ip())
    }
}

impl PeerIp {
    /// The client's address for a request from `peer`.
    fn client(&self, peer: IpAddr, parts: &Parts) -> IpAddr {
        if self.trusted.is_empty() || !self.trusted.contains(peer) {
            return peer;
        }
        if let Some(ip) = self
            .client_header
            .as_ref()
            .and_then(|name| single_value_ip(&parts.headers, name))
        {
            return ip;
        }
        client_ip(peer, &parts.headers, &self.trusted, self.header)
    }
}

impl KeyExtractor for PeerIp {
    fn check(&self) -> Result<(), crate::ConfigError> {
        PeerIp::check(self)
    }

    fn extract(&self, parts: &Parts) -> Option<Key> {
        let peer = self.peer(parts)?;
        let client = self.client(peer, parts);
        self.watch.observe(peer, client, parts, &self.trusted);
        Some(Key::from_ip(client, self.ipv6_prefix))
    }

    fn per_address(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The "every request from one address" warning counts clients, not peers: behind a
    /// trusted load balancer the peer never changes while the clients do, and nothing is
    /// wrong. With no proxy trusted, the same traffic is one address, and it is said.
    #[test]
    fn one_trusted_proxy_is_not_one_address_for_everyone() {
        let behind = PeerIp::default().trust(TrustedProxies::new(["10.0.0.0/8"]).unwrap());
        let untrusted = PeerIp::default();
        for n in 0..SAME_PEER_WARNING {
            let mut parts = http::Request::new(()).into_parts().0;
            parts
                .extensions
                .insert(SocketAddr::from(([10, 0, 0, 1], 443)));
            let client = format!("198.51.{}.{}", n / 256, n % 256);
            parts
                .headers
                .insert("x-forwarded-for", client.parse().unwrap());
            assert!(behind.extract(&parts).is_some());
            assert!(untrusted.extract(&parts).is_some());
        }
        assert_eq!(behind.watch.same_peer.load(Ordering::Relaxed), 1);
        assert_eq!(
            untrusted.watch.same_peer.load(Ordering::Relaxed),
            SAME_PEER_WARNING
        );
    }

    /// Address keys called in a fixed order per request (2, 3 or 4 of them on a thread) are
    /// each sampled, about one call in 64 overall, and the thread's first call always is.
    #[test]
    fn every_address_key_in_a_fixed_order_is_sampled() {
        for keys in 1..=4usize {
            std::thread::spawn(move || {
                let mut per_key = vec![0u32; keys];
                let mut first = None;
                let calls = 64 * 64;
                for call in 0..calls {
                    let hit = sampled();
                    first.get_or_insert(hit);
                    if hit {
                        per_key[call % keys] += 1;
                    }
                }
                assert_eq!(first, Some(true), "the first call is sampled");
                let total: u32 = per_key.iter().sum();
                assert!(
                    (32..=128).contains(&total),
                    "{total} of {calls} calls sampled, expected about 64"
                );
                for (i, n) in per_key.iter().enumerate() {
                    assert!(*n > 0, "key {i} of {keys} is never sampled: {per_key:?}");
                }
            })
            .join()
            .unwrap();
        }
    }
}
