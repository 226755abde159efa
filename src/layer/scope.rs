//! Which rules apply to a request, with which key and cost, and when their permits are given
//! back.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::{Method, StatusCode};

use super::layer::CostFn;
use super::MissingKey;
use crate::key::KeyExtractor;

type Predicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;
type RefundIf = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
type QuotaFn = Arc<dyn Fn(&Parts) -> Option<crate::Quota> + Send + Sync>;

/// Where and how one rule of the limiter applies, set with
/// [`RateLimitLayerBuilder::scope`](super::RateLimitLayerBuilder::scope). A rule without a scope
/// applies to every request, keyed by the layer's key, at the layer's cost.
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
/// // Only for tenants on the free plan, as your authentication middleware found it (never a
/// // header the client sends: a free client would leave it out).
/// #[derive(Clone, PartialEq)]
/// enum Plan { Free, Paid }
/// let free = Scope::new().when(|parts| parts.extensions.get::<Plan>() == Some(&Plan::Free));
/// // Uploads, charged per KiB of their declared length.
/// let uploads = Scope::new()
///     .route(Method::PUT, "/files/{name}")
///     .method(Method::POST)
///     .cost(|parts| {
///         let bytes = parts.headers.get(http::header::CONTENT_LENGTH)
///             .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
///             .unwrap_or(0);
///         bytes.div_ceil(1024).max(1)
///     });
/// # let _ = (login, free, uploads);
/// ```
#[derive(Clone, Default)]
pub struct Scope {
    /// Empty: any method.
    pub(crate) methods: Vec<Method>,
    pub(crate) path: Option<PathMatch>,
    pub(crate) when: Option<Predicate>,
    pub(crate) key: Option<Arc<dyn KeyExtractor>>,
    /// The key is the client's address as the layer's [`PeerIp`](crate::key::PeerIp) reads it
    /// (see [`Scope::key_by_peer`]); `key` then holds a default `PeerIp` for the layer's checks.
    pub(crate) by_layer_peer: bool,
    /// `None`: `Skip` for the scope's own key (the layer's setting for an address key: see
    /// [`Scope::on_missing_key`]), the layer's setting for the layer's key.
    pub(crate) missing_key: Option<MissingKey>,
    pub(crate) cost: Option<CostFn>,
    /// The quota for a request, when it has its own (a tenant's plan).
    pub(crate) quota: Option<QuotaFn>,
    /// Where the real cost is found after the response (see [`Scope::settle`]).
    pub(crate) settle: Option<Settle>,
    /// Charged by the body's bytes, in units of this many bytes (see [`Scope::cost_body`]).
    pub(crate) body_unit: Option<u64>,
    pub(crate) refund_if: Option<RefundIf>,
}

/// Where [`Scope::settle`] reads a request's real cost after the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settle(SettleFrom);

#[derive(Debug, Clone, PartialEq, Eq)]
enum SettleFrom {
    /// An invalid name is kept as its error, for the layer's builder to report.
    Header(Result<http::HeaderName, crate::ConfigError>),
    Extension,
    /// The response body's size, in units of this many bytes.
    BodyBytes(u64),
}

/// The real cost of a request, put in the response's extensions by the handler for
/// [`Settle::extension`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualCost(pub u64);

impl Settle {
    /// From a response header holding a whole number (`x-tokens-used: 1234`). A response
    /// without it, or with anything else in it, keeps its reservation. An invalid header name
    /// is a [`ConfigError`](crate::ConfigError) when the layer is built.
    pub fn header(name: &str) -> Settle {
        let parsed =
            http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(|_| {
                crate::ConfigError::Invalid {
                    setting: "Settle::header",
                    reason: format!("{name:?} is not a header name"),
                }
            });
        Settle(SettleFrom::Header(parsed))
    }

    pub(crate) fn check(&self) -> Result<(), crate::ConfigError> {
        match &self.0 {
            SettleFrom::Header(Err(e)) => Err(e.clone()),
            SettleFrom::BodyBytes(0) => Err(crate::ConfigError::Invalid {
                setting: "Settle::body_bytes",
                reason: "a unit of 0 bytes".into(),
            }),
            _ => Ok(()),
        }
    }

    /// From the [`ActualCost`] response extension.
    pub fn extension() -> Settle {
        Settle(SettleFrom::Extension)
    }

    /// From the response body's size: one permit per `unit_bytes` started (a download quota in
    /// KiB: 1024), counted as the body is sent and settled when it ends (or when the client
    /// goes away: at what was sent). The response's headers show the reservation. A unit of 0
    /// is a [`ConfigError`](crate::ConfigError) when the layer is built.
    pub fn body_bytes(unit_bytes: u64) -> Settle {
        Settle(SettleFrom::BodyBytes(unit_bytes))
    }

    /// The unit, when the real cost is the response body's size.
    pub(crate) fn body_unit(&self) -> Option<u64> {
        match self.0 {
            SettleFrom::BodyBytes(unit) => Some(unit),
            _ => None,
        }
    }

    pub(crate) fn actual<B>(&self, response: &http::Response<B>) -> Option<u64> {
        match &self.0 {
            SettleFrom::Header(name) => response
                .headers()
                .get(name.as_ref().ok()?)?
                .to_str()
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))?
                .parse()
                .ok(),
            SettleFrom::Extension => response.extensions().get::<ActualCost>().map(|c| c.0),
            // Known only once the body is sent: see `verdict::BodySettle`.
            SettleFrom::BodyBytes(_) => None,
        }
    }
}

/// A path as a scope matches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PathMatch {
    Exact(String),
    /// `/api/*`: the prefix itself and everything under it.
    Prefix(String),
    /// axum's route syntax: `/users/{id}` (one segment), `/files/{*rest}` (the rest).
    Pattern {
        source: String,
        segments: Vec<Segment>,
    },
    /// A path that is none of these (an unclosed brace, `{*rest}` before the end, a query):
    /// never matched, and an error when the layer is built.
    Invalid {
        source: String,
        reason: &'static str,
    },
}

/// Why `path` is not a path a scope can match (see [`Scope::route`]), if it is not: taken, it
/// would silently match nothing (`/users/{id`, `/login?x=1`) or too much (`/files/{*rest}/meta`).
#[cfg(any(feature = "body", feature = "serde"))]
pub(crate) fn path_error(path: &str) -> Option<&'static str> {
    parse_pattern(path).err()
}

/// A path in axum's route syntax, segment by segment (`/*` at the end: a plain prefix), or why
/// it is not one.
fn parse_pattern(path: &str) -> Result<Vec<Segment>, &'static str> {
    if !path.starts_with('/') {
        return Err("a path must start with /");
    }
    if path.contains(['?', '#']) {
        return Err("a path has no query or fragment: the query is never part of it");
    }
    let (body, prefix) = match path.strip_suffix("/*") {
        Some(body) => (body, true),
        None => (path, false),
    };
    let raw: Vec<&str> = body.split('/').skip(1).collect();
    let mut segments = Vec::with_capacity(raw.len());
    for (i, text) in raw.iter().enumerate() {
        if text.starts_with('*') {
            // axum 0.8 refuses its old wildcard syntax, `/*rest`.
            return Err("* only ends a path, as /*; a wildcard is {*rest}");
        }
        if text.starts_with(':') {
            // axum 0.8 refuses its old parameter syntax too: no route is ever named so, and
            // such a scope would match nothing, silently.
            return Err(
                "a parameter is written {id}: /:id is axum 0.7's syntax, which axum 0.8 refuses",
            );
        }
        let segment = parse_segment(text)?;
        match &segment {
            Segment::Literal(_) => {}
            _ if prefix => {
                return Err("a path ending in /* is a plain prefix: write {*rest} instead");
            }
            Segment::Rest { .. } if i + 1 != raw.len() => {
                return Err("{*rest} matches to the end: nothing can follow it");
            }
            _ => {}
        }
        segments.push(segment);
    }
    Ok(segments)
}

/// One segment: literal text (`{{` and `}}` are literal braces) around at most one parameter,
/// `{name}`, or `{*name}` with nothing after it.
fn parse_segment(text: &str) -> Result<Segment, &'static str> {
    let (mut before, mut after) = (String::new(), String::new());
    let mut param: Option<bool> = None; // Some(catch-all)
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let out = if param.is_some() {
            &mut after
        } else {
            &mut before
        };
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                out.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                out.push('}');
            }
            '{' => {
                if param.is_some() {
                    return Err("one parameter per segment");
                }
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some('{') | None => return Err("a parameter is {name} or {*name}"),
                        Some(c) => name.push(c),
                    }
                }
                let catch_all = name.starts_with('*');
                let name = name.strip_prefix('*').unwrap_or(&name);
                if name.is_empty() || name.contains('*') {
                    return Err("a parameter is {name} or {*name}");
                }
                param = Some(catch_all);
            }
            '}' => return Err("a } without its {: a literal brace is }}"),
            c => out.push(c),
        }
    }
    match param {
        None => Ok(Segment::Literal(before)),
        Some(false) => Ok(Segment::Param {
            prefix: before,
            suffix: after,
        }),
        Some(true) if after.is_empty() => Ok(Segment::Rest { prefix: before }),
        Some(true) => Err("{*rest} matches to the end: nothing can follow it"),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Segment {
    Literal(String),
    /// `{name}`, with literal text before or after it in the segment: a segment with that text
    /// around a non-empty value.
    Param {
        prefix: String,
        suffix: String,
    },
    /// `{*name}`, with literal text before it in the segment: the rest of the path, that text
    /// then at least one character.
    Rest {
        prefix: String,
    },
}

impl Segment {
    /// The segment with its literal text [`decoded`].
    fn decoded(self) -> Segment {
        let text = |t: String| decoded(&t).into_owned();
        match self {
            Segment::Literal(t) => Segment::Literal(text(t)),
            Segment::Param { prefix, suffix } => Segment::Param {
                prefix: text(prefix),
                suffix: text(suffix),
            },
            Segment::Rest { prefix } => Segment::Rest {
                prefix: text(prefix),
            },
        }
    }
}

impl PathMatch {
    fn parse(path: &str) -> PathMatch {
        let segments = match parse_pattern(path) {
            // Literal text as a request's path is compared: decoded.
            Ok(segments) => segments
                .into_iter()
                .map(Segment::decoded)
                .collect::<Vec<_>>(),
            Err(reason) => {
                return PathMatch::Invalid {
                    source: path.to_owned(),
                    reason,
                }
            }
        };
        let literal = |segments: &[Segment]| {
            let mut out = String::new();
            for segment in segments {
                let Segment::Literal(text) = segment else {
                    return None;
                };
                out.push('/');
                out.push_str(text);
            }
            Some(out)
        };
        if path.ends_with("/*") {
            return PathMatch::Prefix(literal(&segments).unwrap_or_default());
        }
        match literal(&segments) {
            // Escaped braces aside: axum's `MatchedPath` is the route as written.
            Some(exact) if !path.contains(['{', '}']) => PathMatch::Exact(exact),
            _ => PathMatch::Pattern {
                source: path.to_owned(),
                segments,
            },
        }
    }

    /// Against the path the layer sees and, inside a nested axum router (which strips its
    /// prefix from the URI), the full path the client sent and the route axum matched. The
    /// full path is tried only for a pattern written in full (starting with the nest's
    /// prefix): a pattern written relative to the nested router (`/{id}` under `/users`) must
    /// not match another route's full path (`GET /users`, the list).
    fn matches(&self, parts: &Parts) -> bool {
        let raw = parts.uri.path();
        let written = match self {
            PathMatch::Exact(p) | PathMatch::Prefix(p) => p.as_str(),
            PathMatch::Pattern { source, .. } => source.as_str(),
            PathMatch::Invalid { .. } => return false,
        };
        // The path as routed (escapes decoded within their segments) and, when a catch-all
        // serves it (a `{*rest}` route, or a service with no route matched: `nest_service`,
        // `ServeDir`, a plain hyper service), as a catch-all reads it (see `served`). Not for a
        // `{name}` route: a name holding an escaped `/` is one segment there, and reading it
        // as two would charge an innocent request to another route's scope.
        let catch_all = || matched_path(parts).is_none_or(|m| m.contains("{*"));
        let as_read = |path: &str, test: &dyn Fn(&str) -> bool| {
            test(&decoded(path)) || matches!(served(path), Cow::Owned(s) if catch_all() && test(&s))
        };
        let either = |test: &dyn Fn(&str) -> bool| {
            as_read(raw, test)
                || full_path(parts, raw, &decoded(written)).is_some_and(|full| as_read(full, test))
        };
        match self {
            PathMatch::Exact(p) => {
                either(&|path| path == p) || matched_path(parts) == Some(p.as_str())
            }
            PathMatch::Prefix(p) => {
                let under = |path: &str| {
                    path.strip_prefix(p.as_str())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
                };
                either(&under) || matched_path(parts).is_some_and(under)
            }
            PathMatch::Pattern { source, segments } => {
                matched_path(parts) == Some(source.as_str())
                    || either(&|path| matches_segments(segments, path))
            }
            PathMatch::Invalid { .. } => false,
        }
    }

    /// The error a path that cannot be matched is, when the layer is built.
    pub(crate) fn check(&self) -> Result<(), crate::ConfigError> {
        match self {
            PathMatch::Invalid { source, reason } => Err(crate::ConfigError::Invalid {
                setting: "Scope::route",
                reason: format!("{source:?}: {reason}"),
            }),
            _ => Ok(()),
        }
    }
}

/// `path` with its percent-escapes decoded, as axum hands a handler its parameters (and
/// `ServeDir` its file's path) while routing on the path as sent: a scope compares its literal
/// text against what the service reads, or `/users/%6De` would be served as `/users/me` outside
/// a scope on `/users/me`. An escaped `/` stays escaped (it does not split a segment, to the
/// router; a catch-all reads it as a `/`: see [`served`]), and so does an escaped `%` (`%252F`
/// must not become an escaped `/`).
fn decoded(path: &str) -> Cow<'_, str> {
    if !path.contains('%') {
        return Cow::Borrowed(path);
    }
    Cow::Owned(unescaped(path, |b| b != b'/' && b != b'%'))
}

/// `path` with the escapes of the bytes `decode` accepts decoded (the others, and invalid
/// escapes, kept as they are); bytes that are not UTF-8 replaced.
fn unescaped(path: &str, decode: impl Fn(u8) -> bool) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match escape_at(bytes, i).filter(|&b| decode(b)) {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `path` as a catch-all parameter (`{*path}`) or a file server (`ServeDir`) reads it: every
/// escape decoded, an escaped `/` included, and empty and `.` segments dropped. A scope on
/// `/files/private/*` must hold for `/files/private%2Fx`, `/files//private/x` and
/// `/files/./private/x`, which such a service serves as `/files/private/x`. Borrowed when there
/// is nothing to change.
fn served(path: &str) -> Cow<'_, str> {
    let odd =
        path.contains('%') || path.contains("//") || path.contains("/./") || path.ends_with("/.");
    if !odd {
        return Cow::Borrowed(path);
    }
    let text = unescaped(path, |_| true);
    let mut normal = String::with_capacity(text.len());
    for segment in text.split('/').filter(|s| !s.is_empty() && *s != ".") {
        normal.push('/');
        normal.push_str(segment);
    }
    if normal.is_empty() {
        normal.push('/');
    }
    Cow::Owned(normal)
}

/// The byte a valid `%XX` escape at `i` stands for.
fn escape_at(bytes: &[u8], i: usize) -> Option<u8> {
    let hex = |b: &u8| char::from(*b).to_digit(16);
    if bytes.get(i) != Some(&b'%') {
        return None;
    }
    let (high, low) = (hex(bytes.get(i + 1)?)?, hex(bytes.get(i + 2)?)?);
    u8::try_from(high * 16 + low).ok()
}

fn matches_segments(pattern: &[Segment], path: &str) -> bool {
    let Some(mut rest) = path.strip_prefix('/') else {
        return false;
    };
    for (i, segment) in pattern.iter().enumerate() {
        if let Segment::Rest { prefix } = segment {
            return rest
                .strip_prefix(prefix.as_str())
                .is_some_and(|r| !r.is_empty());
        }
        let (actual, after) = match rest.split_once('/') {
            Some((actual, after)) => (actual, Some(after)),
            None => (rest, None),
        };
        let fits = match segment {
            Segment::Literal(l) => actual == l,
            Segment::Param { prefix, suffix } => {
                actual.len() > prefix.len() + suffix.len()
                    && actual.starts_with(prefix.as_str())
                    && actual.ends_with(suffix.as_str())
            }
            Segment::Rest { .. } => false,
        };
        if !fits {
            return false;
        }
        match after {
            Some(after) if i + 1 < pattern.len() => rest = after,
            // Segments left in the path, or in the pattern.
            Some(_) => return false,
            None => return i + 1 == pattern.len(),
        }
    }
    false
}

/// The route axum matched, when the layer runs inside a `Router` (nested routers strip their
/// prefix from the URI but not from this).
#[cfg(feature = "axum")]
fn matched_path(parts: &Parts) -> Option<&str> {
    parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str())
}

#[cfg(not(feature = "axum"))]
fn matched_path(_: &Parts) -> Option<&str> {
    None
}

/// The path the client sent, when the layer runs inside an axum `Router` (a nested router
/// strips its prefix from the URI): a full route written with other parameter names, or a
/// literal path served by a parameter route, matches there.
#[cfg(feature = "axum")]
fn original_path(parts: &Parts) -> Option<&str> {
    parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map(|o| o.0.path())
}

#[cfg(not(feature = "axum"))]
fn original_path(_: &Parts) -> Option<&str> {
    None
}

/// The full path the client sent, when the layer sees a path a nested router stripped of its
/// prefix and `written` (a scope's path) starts with that prefix: a route written in full. The
/// prefix is compared as the client sent it (`/v1`) or as the router wrote it, from the route
/// axum matched (`/t/{tenant}` for `/t/acme`), parameters named as the router names them (a
/// pattern starting with a parameter of its own, `/{id}` under `/{tenant}`, is the nested
/// router's, not the full route).
fn full_path<'a>(parts: &'a Parts, path: &str, written: &str) -> Option<&'a str> {
    let full = original_path(parts)?;
    if full == path {
        return None;
    }
    // A nest at `/users` hands `/users` on as `/`, and `/users/7` as `/7`.
    let prefix = if path == "/" {
        full.trim_end_matches('/')
    } else {
        full.strip_suffix(path)?
    };
    if prefix.is_empty() {
        return None;
    }
    let depth = prefix.split('/').count() - 1;
    let starts_like = |template: &str| {
        let mut written = written.split('/').skip(1);
        template
            .split('/')
            .skip(1)
            .take(depth)
            .all(|t| written.next() == Some(t))
            && template.split('/').count() > depth
    };
    // The prefix as routed (`/t/%61cme` is tenant `acme`), against the scope's decoded text.
    (starts_like(&decoded(prefix)) || matched_path(parts).is_some_and(starts_like)).then_some(full)
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("methods", &self.methods)
            .field("path", &self.path)
            .field("when", &self.when.is_some())
            .field("key", &self.key.is_some())
            .field("missing_key", &self.missing_key)
            .field("cost", &self.cost.is_some())
            .field("quota", &self.quota.is_some())
            .field("settle", &self.settle)
            .field("body_unit", &self.body_unit)
            .field("refund_if", &self.refund_if.is_some())
            .finish()
    }
}

impl Scope {
    /// A scope matching every request.
    pub fn new() -> Scope {
        Scope::default()
    }

    /// Only requests with this method and path (replacing any set before; add methods with
    /// [`method`](Scope::method)). Paths as axum writes routes: `/users/{id}` matches one
    /// segment in place of `{id}`, `/files/{*rest}` one or more to the end, and a path ending
    /// in `/*` matches everything under it (`/api/*` matches `/api` and `/api/users/7`); any
    /// other path matches exactly (the query is never part of it). A path that could not match
    /// as written (an unclosed brace, `{*rest}` before the end, a query, a segment starting
    /// with `*` other than a final `/*`) is an error when the layer is built. Inside an axum
    /// `Router` a pattern written in full (starting with a nested router's prefix, as the client
    /// sends it or as the router writes it; the route's own parameters named as you like) also
    /// matches
    /// the path the client sent (`OriginalUri`: a nested router strips its prefix from the URI)
    /// and the route axum matched (`MatchedPath`), so nested routers can name their full
    /// routes; a pattern written relative to the nested router matches what it sees. `GET` also matches `HEAD` (axum's `get()` serves
    /// HEAD with the GET handler, so a HEAD request must not go around a GET limit).
    pub fn route(mut self, method: Method, path: &str) -> Scope {
        self.methods = vec![method];
        self.path = Some(PathMatch::parse(path));
        self
    }

    /// Also requests with this method (`route(POST, "/files/{name}").method(PUT)`). A scope
    /// with no method matches every method.
    pub fn method(mut self, method: Method) -> Scope {
        if !self.methods.contains(&method) {
            self.methods.push(method);
        }
        self
    }

    /// Only requests for this path, with any of the scope's methods; the syntax of
    /// [`route`](Scope::route).
    pub fn path(mut self, path: &str) -> Scope {
        self.path = Some(PathMatch::parse(path));
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
        self.by_layer_peer = false;
        self
    }

    /// Key this rule by the client's address as the layer reads it: the layer's
    /// [`peer_ip`](crate::layer::RateLimitLayerBuilder::peer_ip), with its trusted proxies and
    /// IPv6 grouping, whatever key the layer's other rules use. A rules file's `key = "peer"`.
    /// (`key(PeerIp::default())` trusts no proxy: behind a load balancer every client would
    /// share its address.)
    pub fn key_by_peer(mut self) -> Scope {
        self.key = Some(Arc::new(crate::key::PeerIp::default()));
        self.by_layer_peer = true;
        self
    }

    /// What a request without this scope's key gets. For the scope's own key the default is
    /// [`MissingKey::Skip`] (the rule does not apply to it, logged at `debug`); the key comes
    /// from the client, so a missing one is never a server error: [`MissingKey::Reject`]
    /// answers `400 Bad Request`. An address key ([`key_by_peer`](Scope::key_by_peer),
    /// `key(PeerIp)`) is the exception: it is missing only when the server records no peer
    /// address, a misconfiguration, so by default the request gets the layer's own answer
    /// ([`RateLimitLayerBuilder::on_missing_key`](super::RateLimitLayerBuilder::on_missing_key):
    /// `500` with an error logged, unless set otherwise), and `Reject` here answers `500` too
    /// (set `Skip` to serve such requests unlimited by this rule, on a Unix socket say). For a
    /// scope on the layer's key, this replaces the layer's setting for this rule.
    pub fn on_missing_key(mut self, missing: MissingKey) -> Scope {
        self.missing_key = Some(missing);
        self
    }

    /// This rule's cost for a request (its size in KiB for an upload rule, while the plan's
    /// rule counts 1), in place of the layer's [`cost`](super::RateLimitLayerBuilder::cost).
    /// Every rule of a request is still decided in one atomic step, each at its own cost; a
    /// cost of 0 leaves the request out of this rule.
    pub fn cost(mut self, cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Scope {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// This rule's quota for a request, resolved from it: a tenant's plan that an
    /// authentication layer put in the request's extensions (or a quota an async resolver such
    /// as [`QuotaCache`](crate::QuotaCache) loaded there). `None` leaves the rule's own quota.
    /// The quota travels with the decision into the store; calls for one key with different
    /// quotas stay sound (the state is read under each call's quota, never admitting more than
    /// the larger). It must keep the rule's algorithm (another is ignored, with a warning); a
    /// per-key override ([`Limiter::set_override`](crate::Limiter::set_override)) outranks
    /// it. Requests with a resolved quota are decided by the store one by one (no leased
    /// blocks, no remembered denials).
    ///
    /// ```
    /// use fleetlimit::layer::Scope;
    /// use fleetlimit::Quota;
    ///
    /// #[derive(Clone)]
    /// struct Plan { per_minute: u64 }
    ///
    /// let plans = Scope::new().quota(|parts| {
    ///     let plan = parts.extensions.get::<Plan>()?;
    ///     Quota::per_minute(plan.per_minute).build().ok()
    /// });
    /// # let _ = plans;
    /// ```
    pub fn quota(
        mut self,
        quota: impl Fn(&Parts) -> Option<crate::Quota> + Send + Sync + 'static,
    ) -> Scope {
        self.quota = Some(Arc::new(quota));
        self
    }

    /// Reserve, then settle: the cost charged before the request runs (the layer's or the
    /// scope's cost function: an estimate, or better the most it can cost) is settled after
    /// the response at the real cost, read from `settle` (a response header, or the
    /// [`ActualCost`] extension the handler sets). What the reservation took beyond the real
    /// cost is given back through its receipt (never creating a permit); a real cost above the
    /// reservation is charged after the response, and when the budget cannot hold it whole,
    /// what is left is taken instead (logged; the key's next request is refused, and nothing
    /// ever passes the limit: reserve the most a request can cost for a hard budget). A
    /// reservation of 0 leaves the request out of the rule, settling included (as any cost of
    /// 0 does: an exempt route): when the reservation comes from the client, keep it at least 1
    /// unless such a request really costs nothing. A response without the real cost keeps the
    /// reservation, and a reservation never settled (the process died) stays spent.
    ///
    /// ```
    /// use fleetlimit::layer::{Scope, Settle};
    ///
    /// // LLM tokens: reserve the request's max_tokens, settle at the tokens generated.
    /// // At least 1: a client's `x-max-tokens: 0` must not leave the request out of the rule
    /// // (unless the handler then generates nothing).
    /// let tokens = Scope::new()
    ///     .cost(|parts| parts.headers.get("x-max-tokens")
    ///         .and_then(|v| v.to_str().ok()?.parse().ok())
    ///         .unwrap_or(1_000u64)
    ///         .max(1))
    ///     .settle(Settle::header("x-tokens-used"));
    /// # let _ = tokens;
    /// ```
    pub fn settle(mut self, settle: Settle) -> Scope {
        self.settle = Some(settle);
        self
    }

    /// Charge this rule by the request body's size, one permit per `unit_bytes` started (1024:
    /// a quota in KiB), in place of any cost function. Up front, the declared `Content-Length`
    /// is charged with the request's other rules, in one atomic step; a body without a declared
    /// length (chunked) is charged one unit up front, and a request with no body at all (a GET
    /// over HTTP/1.1, HTTP/2 headers that end the stream: the body's exact `size_hint` of 0)
    /// nothing. With a
    /// [`MeterBodyLayer`](super::MeterBodyLayer) inside this layer, every byte beyond what was
    /// charged is charged as the handler reads it: when the rule refuses more, the body ends
    /// with an error and the client gets this layer's denial (429 with `Retry-After`, or the
    /// [`cost_exceeds_limit_status`](super::RateLimitLayerBuilder::cost_exceeds_limit_status)
    /// for a body the quota can never hold) in place of the handler's response, when the
    /// handler reads its body before it answers (a handler that answers first and reads on, in
    /// a task of its own or while streaming its response, sees the body end with an error, and
    /// its response stands; the bytes read stay charged). Without that
    /// layer, bodies of unknown length are charged one unit (a warning says so once). An empty
    /// body (`Content-Length: 0`) is not charged. A `unit_bytes` of 0 is rejected when the
    /// layer is built.
    pub fn cost_body(mut self, unit_bytes: u64) -> Scope {
        self.body_unit = Some(unit_bytes);
        self
    }

    /// Give the permits back when the response status satisfies `refund` (count only failed
    /// logins: `|s| s.is_success()`; do not count the service's own failures:
    /// `|s| s.is_server_error()`). The refund completes before the response is returned, and
    /// the response's rate-limit headers count the permits as given back. A gRPC call is judged
    /// by its `grpc-status` as the HTTP status it stands for (`UNAUTHENTICATED` as 401,
    /// `INTERNAL` as 500) when the call failed before any message (a tonic handler's
    /// `Err(Status)`); a status sent in the trailers, after messages, is not seen (200).
    pub fn refund_if(
        mut self,
        refund: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Scope {
        self.refund_if = Some(Arc::new(refund));
        self
    }

    pub(crate) fn matches(&self, parts: &Parts) -> bool {
        let method_ok = self.methods.is_empty()
            || self
                .methods
                .iter()
                .any(|m| *m == parts.method || (*m == Method::GET && parts.method == Method::HEAD));
        method_ok
            && self.path.as_ref().is_none_or(|p| p.matches(parts))
            && self.when.as_ref().is_none_or(|w| w(parts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Patterns match request paths as axum routes them, outside a `Router` too (where there
    /// is no `MatchedPath` to compare).
    #[test]
    fn patterns_match_paths_as_axum_routes_them() {
        let m = |pattern: &str, path: &str| {
            PathMatch::parse(pattern).matches(&parts(Method::GET, path))
        };
        assert!(m("/users/{id}", "/users/7"));
        assert!(!m("/users/{id}", "/users/"));
        assert!(!m("/users/{id}", "/users/7/x"));
        assert!(m("/user_{name}", "/user_bob"));
        assert!(!m("/user_{name}", "/user_"));
        assert!(!m("/user_{name}", "/users_bob"));
        assert!(m("/file/{name}.json", "/file/a.json"));
        assert!(!m("/file/{name}.json", "/file/.json"));
        assert!(!m("/file/{name}.json", "/file/a.txt"));
        assert!(m("/files/{*rest}", "/files/a/b/c"));
        assert!(!m("/files/{*rest}", "/files/"));
        assert!(!m("/files/{*rest}", "/files"));
        assert!(m("/foo/bar{*c}", "/foo/barX/y"));
        assert!(!m("/foo/bar{*c}", "/foo/bar"));
        assert!(!m("/foo/bar{*c}", "/foo/baz/y"));
        assert!(m("/a/{b}/c", "/a/x/c"));
        assert!(!m("/a/{b}/c", "/a/x/d"));
        assert!(!m("/a/{b}/c", "/a/x"));
        assert!(m("/api/*", "/api"));
        assert!(m("/api/*", "/api/users/7"));
        assert!(!m("/api/*", "/apis"));
        assert!(m("/login", "/login"));
        assert!(!m("/login", "/login/"));
    }

    /// Paths a scope cannot match as written are errors when the layer is built, never a rule
    /// that silently matches nothing or too much; axum's route syntax stays valid.
    #[test]
    fn paths_that_cannot_match_as_written_are_errors() {
        // axum 0.8's syntax, as matchit reads it: a parameter with text around it in its
        // segment, a catch-all after text, literal braces escaped.
        for good in [
            "/",
            "/login",
            "/users/{id}",
            "/files/{*rest}",
            "/api/*",
            "/*",
            "/a/{b}/c",
            "/user_{name}",
            "/v{ver}/x",
            "/file/{name}.json",
            "/foo/bar{*catchall}",
            "/{{literal}}",
            "/a*b",
            "/a:b",
        ] {
            assert_eq!(path_error(good), None, "{good}");
            assert!(PathMatch::parse(good).check().is_ok(), "{good}");
        }
        for bad in [
            "login",
            "/users/{id",
            "/users/id}",
            "/users/{}",
            "/{a}{b}",
            "/files/{*rest}/meta",
            "/files/{*rest}.txt",
            "/login?x=1",
            "/a#b",
            "/api/*/v1",
            "/users/{id}/*",
            "/users/:id/login",
            "/:id",
        ] {
            assert!(path_error(bad).is_some(), "{bad}");
            let error = PathMatch::parse(bad).check().unwrap_err().to_string();
            assert!(error.contains(bad), "{error}");
            let limiter = crate::Limiter::builder(crate::MemoryStore::new())
                .rule(crate::Rule::new("r", crate::Quota::per_second(1).build().unwrap()).unwrap())
                .build()
                .unwrap();
            let layer = crate::RateLimitLayer::builder(limiter)
                .scope("r", Scope::new().route(Method::GET, bad))
                .build();
            assert!(layer.is_err(), "{bad}");
        }
    }

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

    #[test]
    fn several_methods_and_axum_patterns() {
        let users = Scope::new()
            .route(Method::PUT, "/users/{id}")
            .method(Method::PATCH);
        assert!(users.matches(&parts(Method::PUT, "/users/7")));
        assert!(users.matches(&parts(Method::PATCH, "/users/alice?x=1")));
        assert!(!users.matches(&parts(Method::POST, "/users/7")));
        assert!(!users.matches(&parts(Method::PUT, "/users/")));
        assert!(!users.matches(&parts(Method::PUT, "/users")));
        assert!(!users.matches(&parts(Method::PUT, "/users/7/keys")));
        let nested = Scope::new().path("/orgs/{org}/files/{*path}");
        assert!(nested.matches(&parts(Method::GET, "/orgs/a/files/x")));
        assert!(nested.matches(&parts(Method::DELETE, "/orgs/a/files/x/y/z")));
        assert!(!nested.matches(&parts(Method::GET, "/orgs/a/files")));
        assert!(!nested.matches(&parts(Method::GET, "/orgs/a/files/")));
        assert!(!nested.matches(&parts(Method::GET, "/orgs//files/x")));
    }
}
