//! Rate-limit headers and denial responses, all written from one [`Decision`].

use std::time::Duration;

use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use crate::{Decision, Source};
use bytes::Bytes;

/// Which rate-limit headers to put on responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (seconds): the widely
    /// copied style of the IETF draft's sixth revision.
    #[default]
    Draft6,
    /// No rate-limit headers (a denial still carries `Retry-After`).
    None,
}

static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");

/// Whole seconds, rounded up: a client that waits this long is never early.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Whole milliseconds, rounded up.
pub(crate) fn ceil_millis(d: Duration) -> u64 {
    let ms = d.as_millis();
    let ms = if d.as_nanos() % 1_000_000 != 0 {
        ms + 1
    } else {
        ms
    };
    u64::try_from(ms).unwrap_or(u64::MAX)
}

impl HeaderStyle {
    /// Write this style's headers for `decision` into `headers`. A decision the outage policy
    /// made without counting gets none: its numbers would describe nothing.
    pub(crate) fn write(self, decision: &Decision, headers: &mut HeaderMap) {
        if decision.source == Source::Policy {
            return;
        }
        match self {
            HeaderStyle::Draft6 => {
                headers.insert(RATELIMIT_LIMIT.clone(), HeaderValue::from(decision.limit));
                headers.insert(
                    RATELIMIT_REMAINING.clone(),
                    HeaderValue::from(decision.remaining),
                );
                headers.insert(
                    RATELIMIT_RESET.clone(),
                    HeaderValue::from(ceil_secs(decision.reset_after)),
                );
            }
            HeaderStyle::None => {}
        }
    }
}

/// The response to a denial: `Retry-After` in whole seconds (rounded up, at least 1), the
/// headers of `style`, and a JSON body.
///
/// - Over the limit: 429, `{"error":"rate_limited","retry_after_ms":N}`; a cost the quota can
///   never admit says `cost_exceeds_limit`, with no retry time.
/// - Refused because the store is down and the policy fails closed: `unavailable_status`
///   (503 by default: the client did nothing wrong), `{"error":"rate_limiter_unavailable",…}`.
pub(crate) fn denied(
    decision: &Decision,
    style: HeaderStyle,
    unavailable_status: StatusCode,
) -> Response<Bytes> {
    let mut response = if decision.source == Source::Policy {
        let ms = decision.retry_after.map_or(0, ceil_millis);
        json(
            unavailable_status,
            format!(r#"{{"error":"rate_limiter_unavailable","retry_after_ms":{ms}}}"#),
        )
    } else {
        over_limit(decision)
    };
    if let Some(retry) = decision.retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(ceil_secs(retry).max(1)));
    }
    style.write(decision, response.headers_mut());
    response
}

fn over_limit(decision: &Decision) -> Response<Bytes> {
    let body = match decision.retry_after {
        Some(retry) => format!(
            r#"{{"error":"rate_limited","retry_after_ms":{}}}"#,
            ceil_millis(retry)
        ),
        None => r#"{"error":"cost_exceeds_limit","retry_after_ms":null}"#.to_owned(),
    };
    json(StatusCode::TOO_MANY_REQUESTS, body)
}

/// A JSON response written by the layer itself.
pub(crate) fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<Bytes> {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ceil_millis(Duration::from_micros(1)), 1);
        assert_eq!(ceil_millis(Duration::from_micros(2000)), 2);
    }

    #[test]
    fn retry_after_never_zero() {
        let d = Decision::deny(
            1,
            0,
            Duration::from_millis(3),
            Some(Duration::from_micros(10)),
        );
        let r = denied(&d, HeaderStyle::Draft6, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[RETRY_AFTER], "1");
    }
}
