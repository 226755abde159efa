//! An axum router exposing key administration as JSON endpoints (feature `admin`), for you to
//! mount behind your own authentication:
//!
//! | Request | Does | Answer |
//! |---|---|---|
//! | `GET /keys/{key}` | [`Limiter::inspect`] | 200, JSON below |
//! | `DELETE /keys/{key}` | [`Limiter::reset`] | 204 |
//! | `DELETE /keys/{key}/rules/{rule}` | [`Limiter::reset_rule`] | 204; 404 for an unknown rule |
//! | `POST /keys/{key}/block?seconds=N` | [`Limiter::block`] | 204; 400 without a whole `N` ≥ 1 |
//! | `POST /keys/{key}/deny` | [`Limiter::deny`] | 204 |
//! | `POST /keys/{key}/allow` | [`Limiter::allow`] | 204 |
//! | `POST /keys/{key}/unblock` | [`Limiter::unblock`] | 204 |
//! | `GET /heavy-hitters?n=N` | [`Limiter::heavy_hitters`] | 200, `{"keys": [{"key": "...", "denials": N}]}` (default 10, at most 100) |
//!
//! `{key}` is the key as your extractor makes it (percent-encoded in the path). Every
//! `/keys/{key}` route also exists as `/ips/{addr}`, for the keys of clients limited by
//! address ([`PeerIp`](crate::key::PeerIp), the fallback key): `{addr}` is an IPv4 or IPv6
//! address, IPv6 grouped by `/64` as `PeerIp` groups it by default, or by `/N` written after
//! it (`2001:db8::%2F56`, the slash percent-encoded; N from 32 to 128, the groupings `PeerIp`
//! makes); a malformed one is `400` with
//! `{"error":"invalid_address"}`. A store that cannot answer gives `503` with
//! `{"error":"store_unavailable"}`. `GET` answers:
//!
//! ```json
//! {"key": "tenant-1", "listing": null,
//!  "rules": [{"rule": "api", "limit": 100, "remaining": 42, "reset_ms": 31000,
//!             "blocked_until_ms": null}]}
//! ```
//!
//! `listing` is `"allow"`, `"deny"`, `"block"` or `null`; `blocked_until_ms` is when a block
//! ends (Unix time, ms), `null` when there is none. **Security**: these endpoints reset and
//! block any client; the router has no authentication of its own. Mount it on an internal
//! listener, or behind a middleware that checks an operator's credentials, never on the public
//! routes as they are:
//!
//! ```
//! use axum::{middleware, Router};
//! use fleetlimit::{admin, Limiter, MemoryStore, Quota, Rule};
//!
//! let limiter = Limiter::builder(MemoryStore::new())
//!     .rule(Rule::new("api", Quota::per_minute(100).build()?)?)
//!     .build()?;
//! let app: Router = Router::new().nest(
//!     "/admin",
//!     admin::router(limiter).layer(middleware::from_fn(
//!         |req: axum::extract::Request, next: middleware::Next| async move {
//!             // Check an operator's credentials here.
//!             next.run(req).await
//!         },
//!     )),
//! );
//! # let _ = app;
//! # Ok::<(), fleetlimit::ConfigError>(())
//! ```

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{FromRequestParts, Path, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{header, Response, StatusCode};
use axum::routing::{delete, get, post};
use axum::Router;

use crate::store::Listing;
use crate::{Error, Key, Limiter};

type Source = Arc<dyn Fn() -> Limiter + Send + Sync>;

/// The admin router for `limiter`.
pub fn router(limiter: Limiter) -> Router {
    router_with(move || limiter.clone())
}

/// The admin router for whichever limiter `current` returns at each request (one replaced
/// while the service runs, say).
pub fn router_with(current: impl Fn() -> Limiter + Send + Sync + 'static) -> Router {
    let source: Source = Arc::new(current);
    let mut router = Router::new();
    for named in ["/keys/{key}", "/ips/{addr}"] {
        router = router
            .route(named, get(inspect).delete(reset))
            .route(&format!("{named}/rules/{{rule}}"), delete(reset_rule))
            .route(&format!("{named}/block"), post(block))
            .route(&format!("{named}/deny"), post(deny))
            .route(&format!("{named}/allow"), post(allow))
            .route(&format!("{named}/unblock"), post(unblock));
    }
    router
        .route("/heavy-hitters", get(heavy_hitters))
        .with_state(source)
}

/// The key a request names: `/keys/{key}` (as the extractor made it) or `/ips/{addr}` (a
/// client's address), and the rule it names, if any.
struct Named {
    key: Key,
    /// The key as the path wrote it.
    shown: String,
    rule: Option<String>,
}

impl<S: Send + Sync> FromRequestParts<S> for Named {
    type Rejection = Response<Body>;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Ok(Path(mut params)) =
            Path::<Vec<(String, String)>>::from_request_parts(parts, state).await
        else {
            // A key that is not text (a header value may hold any byte, a path parameter must
            // decode to UTF-8): its bytes from the raw path, so the operator can name it too.
            let path = parts.uri.path();
            return raw_key(path).ok_or_else(|| {
                // An address that is not text is still a malformed address.
                let address = path.split('/').any(|segment| segment == "ips");
                let why = if address {
                    "invalid_address"
                } else {
                    "invalid_path"
                };
                error(StatusCode::BAD_REQUEST, why)
            });
        };
        let mut param = |name: &str| {
            let at = params.iter().position(|(n, _)| n == name)?;
            Some(params.swap_remove(at).1)
        };
        let rule = param("rule");
        let (key, shown) = match (param("key"), param("addr")) {
            (Some(text), _) => (Key::new(&text), text),
            (None, Some(text)) => match address_key(&text) {
                Some(key) => (key, text),
                None => return Err(error(StatusCode::BAD_REQUEST, "invalid_address")),
            },
            (None, None) => return Err(error(StatusCode::BAD_REQUEST, "invalid_path")),
        };
        Ok(Named { key, shown, rule })
    }
}

/// The key of a `/keys/{key}...` path from its raw, percent-encoded form, whatever bytes it
/// holds; `None` for another route (or a rule name that is not text).
fn raw_key(path: &str) -> Option<Named> {
    let segments: Vec<&str> = path.split('/').collect();
    let (raw, rule) = match segments.as_slice() {
        [.., "keys", key, "rules", rule] => (*key, Some(*rule)),
        [.., "keys", key, "block" | "deny" | "allow" | "unblock"] | [.., "keys", key] => {
            (*key, None)
        }
        _ => return None,
    };
    // Decoded as axum decodes text parameters: a `%` without two hex digits stays as it is.
    let decoded = |s: &str| percent_encoding::percent_decode_str(s).collect::<Vec<u8>>();
    let bytes = decoded(raw);
    let rule = match rule {
        Some(rule) => Some(String::from_utf8(decoded(rule)).ok()?),
        None => None,
    };
    Some(Named {
        key: Key::new(&bytes),
        shown: String::from_utf8_lossy(&bytes).into_owned(),
        rule,
    })
}

/// The key [`PeerIp`](crate::key::PeerIp) makes for `text`: an address, IPv6 grouped by `/64`
/// or by the `/N` after it.
fn address_key(text: &str) -> Option<Key> {
    let (addr, prefix) = match text.split_once('/') {
        Some((addr, prefix)) => (addr, Some(prefix)),
        None => (text, None),
    };
    let ip: IpAddr = addr.parse().ok()?;
    let prefix = match (ip, prefix) {
        (_, None) => 64,
        (IpAddr::V6(v6), Some(p))
            if v6.to_ipv4_mapped().is_none()
                && !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit()) =>
        {
            // Only a grouping `PeerIp` makes: a wider one names a key no request ever has.
            p.parse::<u8>()
                .ok()
                .filter(|p| crate::key::extract::IPV6_PREFIXES.contains(p))?
        }
        // An IPv4 address (mapped into IPv6 or not) is one client: a prefix would promise a
        // grouping that is not made.
        _ => return None,
    };
    Some(Key::from_ip(ip, prefix))
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, code: &str) -> Response<Body> {
    json(status, serde_json::json!({ "error": code }).to_string())
}

fn done(result: Result<(), Error>) -> Response<Body> {
    match result {
        Ok(()) => {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
        Err(e) => failed(&e),
    }
}

fn failed(e: &Error) -> Response<Body> {
    match e {
        Error::UnknownRule(_) => error(StatusCode::NOT_FOUND, "unknown_rule"),
        _ => {
            tracing::warn!(error = %e, "fleetlimit: an admin request could not be carried out");
            error(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn inspect(State(source): State<Source>, named: Named) -> Response<Body> {
    let state = match source().inspect(&named.key).await {
        Ok(state) => state,
        Err(e) => return failed(&e),
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, millis);
    let (listing, blocked_until_ms) = match state.listing {
        None => (None, None),
        Some(Listing::Allow) => (Some("allow"), None),
        Some(Listing::Deny) => (Some("deny"), None),
        Some(Listing::Block(left)) => (Some("block"), Some(now_ms.saturating_add(millis(left)))),
    };
    let rules: Vec<serde_json::Value> = state
        .rules
        .iter()
        .map(|r| {
            serde_json::json!({
                "rule": r.rule,
                "limit": r.decision.limit,
                "remaining": r.decision.remaining,
                "reset_ms": millis(r.decision.reset_after),
                "blocked_until_ms": blocked_until_ms,
            })
        })
        .collect();
    let body = serde_json::json!({ "key": named.shown, "listing": listing, "rules": rules });
    json(StatusCode::OK, body.to_string())
}

async fn reset(State(source): State<Source>, named: Named) -> Response<Body> {
    done(source().reset(&named.key).await)
}

async fn reset_rule(State(source): State<Source>, named: Named) -> Response<Body> {
    let rule = named.rule.unwrap_or_default();
    done(source().reset_rule(&named.key, &rule).await)
}

/// `seconds=N` from the query: a whole number of seconds, at least 1.
fn seconds(query: Option<&str>) -> Option<u64> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("seconds="))
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
}

async fn block(
    State(source): State<Source>,
    RawQuery(query): RawQuery,
    named: Named,
) -> Response<Body> {
    match seconds(query.as_deref()) {
        Some(n) => done(source().block(&named.key, Duration::from_secs(n)).await),
        None => error(StatusCode::BAD_REQUEST, "seconds_required"),
    }
}

async fn heavy_hitters(State(source): State<Source>, RawQuery(query): RawQuery) -> Response<Body> {
    let n = query
        .as_deref()
        .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("n=")))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(10)
        .min(100);
    let keys: Vec<serde_json::Value> = source()
        .heavy_hitters(n)
        .into_iter()
        .map(|h| serde_json::json!({ "key": h.key, "denials": h.denials }))
        .collect();
    json(
        StatusCode::OK,
        serde_json::json!({ "keys": keys }).to_string(),
    )
}

async fn deny(State(source): State<Source>, named: Named) -> Response<Body> {
    done(source().deny(&named.key).await)
}

async fn allow(State(source): State<Source>, named: Named) -> Response<Body> {
    done(source().allow(&named.key).await)
}

async fn unblock(State(source): State<Source>, named: Named) -> Response<Body> {
    done(source().unblock(&named.key).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_whole_and_positive() {
        assert_eq!(seconds(Some("seconds=30")), Some(30));
        assert_eq!(seconds(Some("x=1&seconds=5")), Some(5));
        for bad in [
            None,
            Some(""),
            Some("seconds="),
            Some("seconds=0"),
            Some("seconds=-1"),
            Some("seconds=1.5"),
            Some("seconds=+3"),
        ] {
            assert_eq!(seconds(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn raw_keys_decode_as_axum_decodes_text() {
        let odd = raw_key("/keys/%FFk%2f%G%4").unwrap().key;
        assert_eq!(
            odd,
            Key::new(b"\xffk/%G%4"),
            "a lone % stays, as axum leaves it"
        );
        let named = raw_key("/keys/%FFk/rules/api").unwrap();
        assert_eq!(
            (named.key, named.rule.as_deref()),
            (Key::new(b"\xffk"), Some("api"))
        );
        assert!(raw_key("/keys/%FFk/block").unwrap().rule.is_none());
        assert!(raw_key("/ips/%FF").is_none());
        assert!(raw_key("/keys/%FFk/rules/%FF").is_none());
    }
}
