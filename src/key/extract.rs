//! Key extractors: how a request is turned into the key its limits count against.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use http::request::Parts;

use super::{client_ip, ForwardedHeader, Key, TrustedProxies};

/// Chooses the key a request counts against.
///
/// Returning `None` means "no key from me": the layer falls back to the peer address.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key for this request, if this extractor can tell.
    fn extract(&self, parts: &Parts) -> Option<Key>;
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

/// A request header's value as the key (an API key, a tenant id). Any bytes are accepted; a
/// request without the header has no key from this extractor (the layer falls back to the peer
/// address). Values over 128 bytes are hashed, like every long key.
///
/// ```
/// use fleetlimit::key::{header, KeyExtractor};
/// use fleetlimit::Key;
///
/// let by_api_key = header("x-api-key");
/// let (parts, _) = http::Request::builder().header("x-api-key", "abc").body(()).unwrap().into_parts();
/// assert_eq!(by_api_key.extract(&parts), Some(Key::new("abc")));
/// ```
pub fn header(name: &'static str) -> HeaderKey {
    HeaderKey(http::HeaderName::from_static(name))
}

/// A [`KeyExtractor`] reading a request header; see [`header`].
#[derive(Debug, Clone)]
pub struct HeaderKey(http::HeaderName);

impl HeaderKey {
    /// A header extractor for a name known only at run time (an error if it is not a valid
    /// header name).
    pub fn new(name: &str) -> Result<HeaderKey, crate::ConfigError> {
        http::HeaderName::try_from(name)
            .map(HeaderKey)
            .map_err(|e| crate::ConfigError::Invalid {
                setting: "header",
                reason: format!("{name:?}: {e}"),
            })
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        parts
            .headers
            .get(&self.0)
            .filter(|v| !v.is_empty())
            .map(|v| Key::new(v.as_bytes()))
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
/// ```
/// use fleetlimit::key::{PeerIp, TrustedProxies};
///
/// // Behind a load balancer on the private network.
/// let client = PeerIp::default().trust(TrustedProxies::new(["10.0.0.0/8"])?);
/// # let _ = client;
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone)]
pub struct PeerIp {
    ipv6_prefix: u8,
    trusted: TrustedProxies,
    header: ForwardedHeader,
}

impl Default for PeerIp {
    fn default() -> Self {
        PeerIp {
            ipv6_prefix: 64,
            trusted: TrustedProxies::none(),
            header: ForwardedHeader::default(),
        }
    }
}

impl PeerIp {
    /// Believe forwarding headers from these proxies (default: none).
    pub fn trust(mut self, proxies: TrustedProxies) -> Self {
        self.trusted = proxies;
        self
    }

    /// Which forwarding header trusted proxies set (default: `X-Forwarded-For`).
    pub fn forwarded_header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Group IPv6 peers by this prefix length (0–128; default 64). 128 counts every address
    /// on its own.
    pub fn ipv6_prefix(mut self, prefix: u8) -> Self {
        self.ipv6_prefix = prefix.min(128);
        self
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

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let peer = PeerIp::peer_addr(parts)?;
        let client = if self.trusted.is_empty() {
            peer
        } else {
            client_ip(peer, &parts.headers, &self.trusted, self.header)
        };
        Some(Key::from_ip(client, self.ipv6_prefix))
    }
}
