//! Which rules apply to a request, with which key, and when their permits are given back.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::{Method, StatusCode};

use super::MissingKey;
use crate::key::KeyExtractor;

type Predicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;
type RefundIf = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// Where and how one rule of the limiter applies, set with
/// [`RateLimitLayerBuilder::scope`](super::RateLimitLayerBuilder::scope). A rule without a scope
/// applies to every request, keyed by the layer's key.
///
/// ```
/// use fleetlimit::layer::Scope;
/// use fleetlimit::key::PeerIp;
/// use http::Method;
///
/// // Failed logins only, per client address.
/// let login = Scope::new()
///     .route(Method::POST, "/login")
///     .key(PeerIp::default())
///     .refund_if(|status| status.is_success());
/// // Only for tenants on the free plan.
/// let free = Scope::new().when(|parts| parts.headers.get("x-plan").is_some_and(|p| p == "free"));
/// # let _ = (login, free);
/// ```
#[derive(Clone)]
pub struct Scope {
    pub(crate) method: Option<Method>,
    pub(crate) path: Option<PathMatch>,
    pub(crate) when: Option<Predicate>,
    pub(crate) key: Option<Arc<dyn KeyExtractor>>,
    pub(crate) missing_key: MissingKey,
    pub(crate) refund_if: Option<RefundIf>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PathMatch {
    Exact(String),
    Prefix(String),
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("when", &self.when.is_some())
            .field("key", &self.key.is_some())
            .field("missing_key", &self.missing_key)
            .field("refund_if", &self.refund_if.is_some())
            .finish()
    }
}

impl Default for Scope {
    fn default() -> Self {
        Scope {
            method: None,
            path: None,
            when: None,
            key: None,
            missing_key: MissingKey::Skip,
            refund_if: None,
        }
    }
}

impl Scope {
    /// A scope matching every request.
    pub fn new() -> Scope {
        Scope::default()
    }

    /// Only requests with this method and path. A path ending in `/*` matches everything under
    /// it (`/api/*` matches `/api` and `/api/users/7`); any other path matches exactly. `GET`
    /// also matches `HEAD` (axum's `get()` serves HEAD with the GET handler, so a HEAD request
    /// must not go around a GET limit). For axum route patterns, put a layer on the route with
    /// `route_layer` instead.
    pub fn route(mut self, method: Method, path: &str) -> Scope {
        self.method = Some(method);
        self.path = Some(match path.strip_suffix("/*") {
            Some(prefix) => PathMatch::Prefix(prefix.to_owned()),
            None => PathMatch::Exact(path.to_owned()),
        });
        self
    }

    /// Only requests for which `predicate` is true (e.g. a tenant's plan).
    pub fn when(mut self, predicate: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Scope {
        self.when = Some(Arc::new(predicate));
        self
    }

    /// Count this rule against this key instead of the layer's (per IP while the layer keys by
    /// account, say). A request for which it finds no key follows
    /// [`on_missing_key`](Scope::on_missing_key): by default the rule is skipped for it.
    pub fn key(mut self, extractor: impl KeyExtractor) -> Scope {
        self.key = Some(Arc::new(extractor));
        self
    }

    /// What a request without this scope's own key gets (default [`MissingKey::Skip`]: the
    /// rule does not apply to it, logged at `debug`). The key comes from the client, so a missing
    /// one is never a server error: [`MissingKey::Reject`] answers `400 Bad Request`.
    pub fn on_missing_key(mut self, missing: MissingKey) -> Scope {
        self.missing_key = missing;
        self
    }

    /// Give the permits back when the response status satisfies `refund` (count only failed
    /// logins: `|s| s.is_success()`; do not count the service's own failures:
    /// `|s| s.is_server_error()`). The refund completes before the response is returned.
    pub fn refund_if(
        mut self,
        refund: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Scope {
        self.refund_if = Some(Arc::new(refund));
        self
    }

    pub(crate) fn matches(&self, parts: &Parts) -> bool {
        let method_ok = self.method.as_ref().is_none_or(|m| {
            *m == parts.method || (*m == Method::GET && parts.method == Method::HEAD)
        });
        if !method_ok {
            return false;
        }
        let path = parts.uri.path();
        let path_ok = match &self.path {
            None => true,
            Some(PathMatch::Exact(p)) => path == p,
            Some(PathMatch::Prefix(p)) => path
                .strip_prefix(p.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
        };
        path_ok && self.when.as_ref().is_none_or(|w| w(parts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: Method, path: &str) -> Parts {
        http::Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn routes_match_method_and_path() {
        let login = Scope::new().route(Method::POST, "/login");
        assert!(login.matches(&parts(Method::POST, "/login")));
        assert!(login.matches(&parts(Method::POST, "/login?next=/")));
        assert!(!login.matches(&parts(Method::GET, "/login")));
        assert!(!login.matches(&parts(Method::HEAD, "/login")));
        assert!(!login.matches(&parts(Method::POST, "/login/x")));
        let api = Scope::new().route(Method::GET, "/api/*");
        assert!(api.matches(&parts(Method::GET, "/api")));
        assert!(api.matches(&parts(Method::GET, "/api/users/7")));
        assert!(
            api.matches(&parts(Method::HEAD, "/api/users/7")),
            "HEAD is served by GET handlers"
        );
        assert!(!api.matches(&parts(Method::GET, "/apix")));
        assert!(Scope::new().matches(&parts(Method::DELETE, "/anything")));
    }
}
