//! Calls *to* a rate-limited service: a client-side Tower layer that waits for the fleet's shared
//! quota before each call and turns the service's pushback into a pause for the whole fleet.
//!
//! ```
//! # use std::time::Duration;
//! # use fleetlimit::{Algorithm, Limiter, MemoryStore, Quota, Rule};
//! use fleetlimit::outbound::OutboundLayer;
//! # fn client<S>(http_client: S) -> Result<(), Box<dyn std::error::Error>> {
//! let partner = Limiter::builder(MemoryStore::new())
//!     .rule(Rule::new("partner", Quota::per_second(100).algorithm(Algorithm::Gcra).burst(5).build()?)?)
//!     .build()?;
//! // Keyed by the destination's host and port; each call waits at most 2 s for its turn.
//! let client = tower::ServiceBuilder::new()
//!     .layer(OutboundLayer::new(partner).max_wait(Duration::from_secs(2)))
//!     .service(http_client);
//! # let _ = client;
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

use crate::{Key, Limiter};

/// An error of an outbound call: the caller's, or the inner client's.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The fleet's quota for the destination was not available within the wait budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(self))]
pub struct NotReady {
    /// When a permit is expected, as far as is known (others may be ahead).
    pub retry_after: Option<Duration>,
    /// Why: the quota, a pause, or a store that could not decide.
    pub reason: NotReadyReason,
}

/// Why an outbound call was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotReadyReason {
    /// The fleet's quota for the destination has no permit within the wait budget.
    Quota,
    /// The destination pushed back, and its pause for the fleet ends past the wait budget.
    Paused,
    /// The limiter's store could not decide, and its outage policy refused (or the limiter
    /// failed): an outage of ours, not the destination's quota.
    StoreUnavailable,
}

fn describe(not_ready: &NotReady) -> String {
    let what = match not_ready.reason {
        NotReadyReason::Quota => {
            "the quota for this destination is not available within the wait budget"
        }
        NotReadyReason::Paused => {
            "this destination is paused for the fleet (it pushed back) past the wait budget"
        }
        NotReadyReason::StoreUnavailable => {
            "the rate limiter's store cannot decide, and its outage policy refuses"
        }
    };
    match not_ready.retry_after {
        Some(wait) => format!("{what}; try again in {wait:?}"),
        None => what.to_owned(),
    }
}

type KeyFn = dyn Fn(&http::request::Parts) -> Key + Send + Sync;

/// Waits for the fleet's quota before each call through it, and pauses the destination for the
/// whole fleet when it pushes back. See the [module](self).
#[derive(Clone)]
pub struct OutboundLayer {
    limiter: Limiter,
    key: Arc<KeyFn>,
    max_wait: Duration,
    max_pause: Duration,
}

/// The longest pause one answer sets by default: a destination (or a proxy in front of it) that
/// names a wait of weeks, or sends a reset in milliseconds where seconds are meant, would
/// otherwise stop the whole fleet that long.
pub const DEFAULT_MAX_PAUSE: Duration = Duration::from_secs(600);

impl std::fmt::Debug for OutboundLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboundLayer")
            .field("limiter", &self.limiter)
            .field("max_pause", &self.max_pause)
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

impl OutboundLayer {
    /// Calls through `limiter`'s rules, keyed by the request URI's host and port (left out when
    /// it is the scheme's, so `https://p.example/` and `https://p.example:443/` share one
    /// quota), waiting at most 1 s for a turn; a pushback pauses the destination for at
    /// most [`DEFAULT_MAX_PAUSE`].
    pub fn new(limiter: Limiter) -> Self {
        OutboundLayer {
            limiter,
            key: Arc::new(|parts: &http::request::Parts| destination(&parts.uri)),
            max_wait: Duration::from_secs(1),
            max_pause: DEFAULT_MAX_PAUSE,
        }
    }

    /// The longest pause one answer of the destination can set (default
    /// [`DEFAULT_MAX_PAUSE`]); a longer pushback pauses this long, and the next call asks again.
    pub fn max_pause(mut self, max_pause: Duration) -> Self {
        self.max_pause = max_pause;
        self
    }

    /// Key calls by `key` instead (an account at the destination, an endpoint...).
    pub fn key(
        mut self,
        key: impl Fn(&http::request::Parts) -> Key + Send + Sync + 'static,
    ) -> Self {
        self.key = Arc::new(key);
        self
    }

    /// The longest a call waits for its turn (and for a pause to end) before failing with
    /// [`NotReady`].
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }
}

impl<S> Layer<S> for OutboundLayer {
    type Service = Outbound<S>;

    fn layer(&self, inner: S) -> Outbound<S> {
        Outbound {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`OutboundLayer`].
#[derive(Clone, Debug)]
pub struct Outbound<S> {
    inner: S,
    layer: OutboundLayer,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Outbound<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The inner service was driven to readiness: keep that instance for this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let key = (layer.key)(&parts);
            layer.turn(&key).await?;
            let response = inner
                .call(Request::from_parts(parts, body))
                .await
                .map_err(Into::into)?;
            let pause = pushback(response.status(), response.headers(), SystemTime::now())
                .map(|pause| pause.min(layer.max_pause))
                .filter(|pause| !pause.is_zero());
            if let Some(pause) = pause {
                tracing::info!(
                    pause = ?pause,
                    status = response.status().as_u16(),
                    "fleetlimit: the destination pushed back; pausing its quota for the fleet"
                );
                // Only ever longer: another instance's answer may have asked for more. A failed
                // pause leaves the quota as it is: the destination will say it again.
                let _ = layer.limiter.pause_at_least(&key, pause).await;
            }
            Ok(response)
        })
    }
}

impl OutboundLayer {
    /// Wait out a pause the fleet set for `key`, then for a permit, all within `max_wait`. A
    /// pause set while this caller waited for its permit (another instance was told to stop)
    /// wins: the permit is forfeited, and the caller waits the pause out and queues again, so
    /// nobody calls during a pause and the callers do not all rush in when it ends.
    async fn turn(&self, key: &Key) -> Result<(), NotReady> {
        let give_up = crate::limiter::waiting::after(self.max_wait);
        loop {
            if let Some(paused) = self.limiter.paused_for(key).await {
                let until = crate::limiter::waiting::after(paused);
                if until > give_up {
                    return Err(NotReady {
                        retry_after: Some(paused),
                        reason: NotReadyReason::Paused,
                    });
                }
                tokio::time::sleep_until(until).await;
            }
            let left = give_up.saturating_duration_since(tokio::time::Instant::now());
            match self.limiter.until_ready(key, 1, left).await {
                Ok(d) if d.allowed => {}
                Ok(d) => {
                    return Err(NotReady {
                        retry_after: d.retry_after,
                        reason: if d.degraded {
                            NotReadyReason::StoreUnavailable
                        } else {
                            NotReadyReason::Quota
                        },
                    })
                }
                Err(error) => {
                    tracing::warn!(%error, "fleetlimit: an outbound call's quota could not be decided");
                    return Err(NotReady {
                        retry_after: None,
                        reason: NotReadyReason::StoreUnavailable,
                    });
                }
            }
            if self.limiter.paused_for(key).await.is_none() {
                return Ok(());
            }
        }
    }
}

/// The default outbound key: the destination's host, lowercased, with its port unless it is the
/// scheme's default (user information is left out). Without the default port, so that the key
/// is the one earlier builds made from `https://p.example/`: during a rolling deploy both count
/// in one place.
fn destination(uri: &http::Uri) -> Key {
    let Some(host) = uri.host() else {
        return Key::new("");
    };
    let default_port = match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("https") || s.eq_ignore_ascii_case("wss") => Some(443),
        Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("ws") => Some(80),
        _ => None,
    };
    let host = host.to_ascii_lowercase();
    Key::new(match uri.port_u16() {
        Some(port) if Some(port) != default_port => format!("{host}:{port}"),
        _ => host,
    })
}

/// How long the destination asks the fleet to stop, from its answer: a 429 or 503 with
/// `Retry-After` (seconds or an HTTP date), or rate-limit headers saying nothing is left
/// (`RateLimit: ...;r=0;t=N`, `RateLimit-Remaining: 0` with `RateLimit-Reset: N`, or the same
/// with `X-RateLimit-`). `None` when it does not.
pub fn pushback(status: StatusCode, headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let seconds = |v: &str| v.parse::<u64>().ok().map(Duration::from_secs);
    if matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        if let Some(v) = text("retry-after") {
            let pause = seconds(v).or_else(|| {
                httpdate::parse_http_date(v)
                    .ok()
                    .map(|at| at.duration_since(now).unwrap_or(Duration::ZERO))
            });
            if pause.is_some() {
                return pause;
            }
        }
    }
    // IETF draft: `RateLimit: "policy";r=0;t=5` (remaining r, reset t seconds), one item per
    // policy: the longest reset of those with nothing left. A list may come split over several
    // header lines, so every line is read.
    let items = headers
        .get_all("ratelimit")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','));
    let exhausted = items.filter_map(|item| {
        let param = |name: &str| {
            item.split(';')
                .filter_map(|p| p.trim().strip_prefix(name)?.strip_prefix('='))
                .find_map(|n| n.trim().parse::<u64>().ok())
        };
        match (param("r"), param("t")) {
            (Some(0), Some(t)) => Some(t),
            _ => None,
        }
    });
    if let Some(t) = exhausted.max() {
        return Some(Duration::from_secs(t));
    }
    for prefix in ["ratelimit-", "x-ratelimit-"] {
        let remaining = text(&format!("{prefix}remaining")).and_then(|v| v.parse::<u64>().ok());
        let reset = text(&format!("{prefix}reset")).and_then(|v| v.parse::<u64>().ok());
        if let (Some(0), Some(reset)) = (remaining, reset) {
            // Some services send the reset as a Unix time rather than a delay, in seconds or
            // in milliseconds.
            let epoch = now
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or(Duration::ZERO);
            let delay = if reset > 1_000_000_000_000 {
                Duration::from_millis(reset).saturating_sub(epoch)
            } else if reset > 1_000_000_000 {
                Duration::from_secs(reset).saturating_sub(epoch)
            } else {
                Duration::from_secs(reset)
            };
            return Some(delay);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn pushback_is_read_from_every_common_form() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let too_many = StatusCode::TOO_MANY_REQUESTS;
        type Case<'a> = (StatusCode, &'a [(&'a str, &'a str)], Option<u64>);
        let cases: [Case<'_>; 13] = [
            (too_many, &[("retry-after", "2")], Some(2)),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                &[("retry-after", "Fri, 15 Jan 2027 08:00:10 GMT")],
                Some(10),
            ),
            (too_many, &[("retry-after", "soon")], None),
            (StatusCode::OK, &[("retry-after", "2")], None),
            (StatusCode::OK, &[("ratelimit", "\"api\";r=0;t=7")], Some(7)),
            (StatusCode::OK, &[("ratelimit", "\"api\";r=3;t=7")], None),
            (
                StatusCode::OK,
                &[("ratelimit-remaining", "0"), ("ratelimit-reset", "4")],
                Some(4),
            ),
            (
                StatusCode::OK,
                &[
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", "1800000009"),
                ],
                Some(9),
            ),
            (
                StatusCode::OK,
                &[("x-ratelimit-remaining", "5"), ("x-ratelimit-reset", "9")],
                None,
            ),
            // A reset as a Unix time in milliseconds.
            (
                StatusCode::OK,
                &[
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", "1800000009000"),
                ],
                Some(9),
            ),
            // Several policies: the exhausted one, wherever it is in the list.
            (
                StatusCode::OK,
                &[("ratelimit", "\"sec\";r=5;t=1, \"day\";r=0;t=3600")],
                Some(3600),
            ),
            (
                StatusCode::OK,
                &[("ratelimit", "\"a\";r=0;t=2, \"b\";r=1;t=50, \"c\";r=0;t=9")],
                Some(9),
            ),
            // The same list split over two header lines.
            (
                StatusCode::OK,
                &[
                    ("ratelimit", "\"sec\";r=5;t=1"),
                    ("ratelimit", "\"day\";r=0;t=3600"),
                ],
                Some(3600),
            ),
        ];
        for (status, pairs, expected) in cases {
            let got = pushback(status, &headers(pairs), now);
            assert_eq!(got, expected.map(Duration::from_secs), "{status} {pairs:?}");
        }
    }

    /// A store that cannot decide, failing closed: the caller is told at once, and told it is
    /// the store, not the destination's quota (the policy's wait is no permit's wait: sleeping
    /// it out and asking again would hold every call for the whole budget).
    #[tokio::test(start_paused = true)]
    async fn a_store_that_cannot_decide_is_said_so_at_once() {
        use crate::store::testing::{Link, TokioClock};
        use crate::{Algorithm, MemoryStore, OnStoreError, Quota, Rule};
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let link = Link::new(store, Duration::ZERO, Duration::from_secs(10));
        let quota = Quota::per_second(10)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        let limiter = Limiter::builder(link)
            .rule(Rule::new("partner", quota).unwrap())
            .on_store_error(OnStoreError::fail_closed())
            .build()
            .unwrap();
        let layer = OutboundLayer::new(limiter).max_wait(Duration::from_secs(5));
        let start = tokio::time::Instant::now();
        let refused = layer.turn(&Key::new("p.example")).await.unwrap_err();
        assert_eq!(
            start.elapsed(),
            crate::DEFAULT_DEADLINE,
            "one deadline, no wait"
        );
        assert_eq!(refused.reason, NotReadyReason::StoreUnavailable);
        let said = refused.to_string();
        assert!(said.contains("store") && !said.contains("Some("), "{said}");
    }

    /// A caller that gets its permit after another instance was told to stop forfeits it:
    /// nobody calls during the pause. One call at 0; a second queued for the next permit (at
    /// 100 ms, 10/s); a pause of 1 s set at 50 ms. The second call goes at 1,050 ms (it went at
    /// 100 ms without the check after the permit).
    #[tokio::test(start_paused = true)]
    async fn a_permit_granted_during_a_pause_is_forfeited() {
        use crate::store::testing::TokioClock;
        use crate::{Algorithm, MemoryStore, Quota, Rule};
        use tower::{Service, ServiceExt};
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let quota = Quota::per_second(10)
            .algorithm(Algorithm::Gcra)
            .burst(1)
            .build()
            .unwrap();
        let limiter = Limiter::builder(store)
            .rule(Rule::new("partner", quota).unwrap())
            .build()
            .unwrap();
        let start = tokio::time::Instant::now();
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let destination = {
            let calls = calls.clone();
            tower::service_fn(move |_: Request<()>| {
                calls.lock().unwrap().push(start.elapsed());
                async { Ok::<_, std::convert::Infallible>(Response::new(())) }
            })
        };
        let client = OutboundLayer::new(limiter.clone())
            .max_wait(Duration::from_secs(5))
            .layer(destination);
        let request = || Request::get("https://p.example/").body(()).unwrap();
        let callers: Vec<_> = (0..2)
            .map(|_| {
                let mut client = client.clone();
                let req = request();
                tokio::spawn(async move { client.ready().await?.call(req).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        limiter
            .pause_at_least(&Key::new("p.example"), Duration::from_secs(1))
            .await
            .unwrap();
        for caller in callers {
            caller.await.unwrap().unwrap();
        }
        let calls = calls.lock().unwrap().clone();
        assert_eq!(
            calls,
            [Duration::ZERO, Duration::from_millis(1_050)],
            "no call during the pause"
        );
    }

    #[test]
    fn not_ready_says_why_in_words() {
        let quota = NotReady {
            retry_after: Some(Duration::from_millis(1500)),
            reason: NotReadyReason::Quota,
        };
        assert_eq!(
            quota.to_string(),
            "the quota for this destination is not available within the wait budget; try again in 1.5s"
        );
        let paused = NotReady {
            retry_after: None,
            reason: NotReadyReason::Paused,
        };
        assert!(
            paused.to_string().ends_with("past the wait budget"),
            "{paused}"
        );
    }

    #[test]
    fn one_destination_is_one_key_however_it_is_written() {
        let key = |uri: &str| destination(&uri.parse().unwrap());
        let api = Key::new("api.p.example");
        assert_eq!(key("https://api.p.example/v1"), api);
        assert_eq!(key("https://API.p.example:443/v1"), api);
        assert_eq!(key("https://user:secret@api.p.example/v1"), api);
        assert_eq!(key("http://api.p.example:80/"), api);
        assert_eq!(
            key("https://api.p.example:80/"),
            Key::new("api.p.example:80")
        );
        assert_eq!(
            key("http://api.p.example:8080/"),
            Key::new("api.p.example:8080")
        );
        assert_eq!(key("/relative"), Key::new(""));
    }
}
