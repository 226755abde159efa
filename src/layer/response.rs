//! Denial responses: JSON, RFC 9457 problem details, the user's own, and gRPC's
//! `RESOURCE_EXHAUSTED`.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use super::headers::{ceil_millis, ceil_secs};
use crate::{Decision, Source};

/// Builds a custom denial response from the decision.
pub type DenialFn = Arc<dyn Fn(&Decision) -> Response<Bytes> + Send + Sync>;

/// How a denied request is answered (gRPC requests are always answered the gRPC way).
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Denial {
    /// `429` with `{"error":"rate_limited","retry_after_ms":N}`.
    #[default]
    Json,
    /// `429` with an RFC 9457 `application/problem+json` body.
    Problem,
    /// Your own response, built from the decision. `Retry-After` and the rate-limit headers
    /// are added unless your response already has them.
    Custom(DenialFn),
}

impl Denial {
    /// A custom denial response.
    pub fn custom(f: impl Fn(&Decision) -> Response<Bytes> + Send + Sync + 'static) -> Denial {
        Denial::Custom(Arc::new(f))
    }
}

impl fmt::Debug for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::Json => f.write_str("Json"),
            Denial::Problem => f.write_str("Problem"),
            Denial::Custom(_) => f.write_str("Custom"),
        }
    }
}

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub(crate) static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// Whether the request is a gRPC call: a `POST` with `content-type: application/grpc…`. Any
/// client can send the content type; a `GET` with it is still answered as HTTP (a gRPC denial
/// is a `200 OK`, which a cache or a monitor would take for success).
pub(crate) fn is_grpc(parts: &http::request::Parts) -> bool {
    parts.method == http::Method::POST
        && parts
            .headers
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The outcome of a call as an HTTP status, for the functions that judge it (`refund_if`,
/// `refund_status`): a gRPC call's error travels as HTTP 200 with a `grpc-status`, in the
/// headers when the call failed before any message (a tonic handler's `Err(Status)`, a
/// trailers-only response), and is read as the HTTP status the gRPC code stands for
/// (`UNAUTHENTICATED` as 401, `INTERNAL` as 500, ...). A status in the trailers, after the
/// messages, comes after the headers are sent and is not seen: such a call reads as 200.
/// A call is gRPC when the request says so (`grpc`) or the response does (its content type):
/// tonic answers a call whatever the request's content type or method, so a client that sends
/// another must not have a failed login read as HTTP 200.
pub(crate) fn outcome_status<B>(response: &http::Response<B>, grpc: bool) -> StatusCode {
    let status = response.status();
    let grpc = grpc
        || response
            .headers()
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if !grpc || status != StatusCode::OK {
        return status;
    }
    let Some(code) = response.headers().get(&GRPC_STATUS) else {
        return status;
    };
    // A status that does not read as a code is UNKNOWN to a gRPC client: a failure.
    let code = std::str::from_utf8(code.as_bytes())
        .ok()
        .and_then(|c| c.parse::<u32>().ok());
    match code {
        Some(0) => status,
        None => StatusCode::INTERNAL_SERVER_ERROR,
        Some(3 | 9 | 11) => StatusCode::BAD_REQUEST,
        Some(16) => StatusCode::UNAUTHORIZED,
        Some(7) => StatusCode::FORBIDDEN,
        Some(5) => StatusCode::NOT_FOUND,
        Some(6 | 10) => StatusCode::CONFLICT,
        Some(8) => StatusCode::TOO_MANY_REQUESTS,
        // CANCELLED: the client went away ("499 Client Closed Request").
        Some(1) => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Some(12) => StatusCode::NOT_IMPLEMENTED,
        Some(14) => StatusCode::SERVICE_UNAVAILABLE,
        Some(4) => StatusCode::GATEWAY_TIMEOUT,
        // UNKNOWN, INTERNAL, DATA_LOSS, and codes gRPC does not define.
        Some(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The statuses of the denials that are not plain 429s.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Statuses {
    /// Refusals made because the store is down and the policy fails closed (503 by default:
    /// the client did nothing wrong).
    pub(crate) unavailable: StatusCode,
    /// A cost no rule can ever admit (429 by default; 413 for byte costs).
    pub(crate) cost_exceeds_limit: StatusCode,
}

/// The response to a denial.
pub(crate) fn denied(
    decision: &Decision,
    denial: &Denial,
    grpc: bool,
    statuses: Statuses,
) -> Response<Bytes> {
    let unavailable_status = statuses.unavailable;
    let status = if decision.never_admissible() {
        statuses.cost_exceeds_limit
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    let unavailable = decision.source == Source::Policy;
    let mut response = if grpc {
        grpc_denied(decision, unavailable)
    } else if unavailable {
        let ms = decision.retry_after.map_or(0, ceil_millis);
        json(
            unavailable_status,
            "application/json",
            format!(r#"{{"error":"rate_limiter_unavailable","retry_after_ms":{ms}}}"#),
        )
    } else {
        match denial {
            Denial::Json => json(status, "application/json", json_body(decision)),
            Denial::Problem => json(
                status,
                "application/problem+json",
                problem_body(decision, status),
            ),
            Denial::Custom(f) => f(decision),
        }
    };
    if let Some(retry) = decision.retry_after {
        let headers = response.headers_mut();
        if !headers.contains_key(RETRY_AFTER) {
            headers.insert(RETRY_AFTER, retry_after(retry));
        }
    }
    response
}

/// `Retry-After` for `wait`: whole seconds, rounded up, at least 1 (never earlier than the wait).
pub(crate) fn retry_after(wait: std::time::Duration) -> HeaderValue {
    super::headers::number(ceil_secs(wait).max(1))
}

/// `grpc-retry-pushback-ms` for `wait` (milliseconds, rounded up, at least 1, within gRPC's
/// 32-bit range); for a cost that can never be admitted (`None`), -1: do not retry.
pub(crate) fn pushback(wait: Option<std::time::Duration>) -> HeaderValue {
    match wait {
        Some(wait) => {
            super::headers::number(ceil_millis(wait).clamp(1, i32::MAX.unsigned_abs().into()))
        }
        None => HeaderValue::from_static("-1"),
    }
}

fn json_body(d: &Decision) -> Bytes {
    match d.retry_after {
        // A denial is the path an attacker drives: no formatting machinery, no allocation.
        Some(retry) => {
            let mut digits = [0u8; 20];
            let ms = super::headers::decimal(ceil_millis(retry), &mut digits);
            super::headers::shared_bytes(&[
                br#"{"error":"rate_limited","retry_after_ms":"#,
                ms,
                b"}",
            ])
        }
        None => Bytes::from_static(br#"{"error":"cost_exceeds_limit","retry_after_ms":null}"#),
    }
}

fn problem_body(d: &Decision, status: StatusCode) -> String {
    match d.retry_after {
        Some(retry) => {
            let ms = ceil_millis(retry);
            format!(
                r#"{{"type":"about:blank","title":"Too Many Requests","status":429,"detail":"Rate limit exceeded; retry in {ms} ms.","retry_after_ms":{ms},"limit":{},"remaining":{}}}"#,
                d.limit, d.remaining
            )
        }
        None => format!(
            r#"{{"type":"about:blank","title":"{}","status":{},"detail":"The request costs more than the limit ({}) can ever admit.","retry_after_ms":null,"limit":{},"remaining":{}}}"#,
            status.canonical_reason().unwrap_or("Client Error"),
            status.as_u16(),
            d.limit,
            d.limit,
            d.remaining
        ),
    }
}

/// A gRPC trailers-only response: HTTP 200, `grpc-status` 8 (RESOURCE_EXHAUSTED; 14,
/// UNAVAILABLE, when the store is down and the policy fails closed), a `grpc-message`, and
/// the wait as `retry-after` (seconds) and `grpc-retry-pushback-ms` (gRPC's retry design; a
/// negative value tells the client not to retry, for a cost that can never be admitted).
fn grpc_denied(d: &Decision, unavailable: bool) -> Response<Bytes> {
    let (status, message) = if unavailable {
        ("14", "rate limiter unavailable")
    } else if d.retry_after.is_some() {
        ("8", "rate limit exceeded")
    } else {
        ("8", "request cost exceeds the rate limit")
    };
    let mut response = grpc_status(status, message);
    let h = response.headers_mut();
    h.insert(GRPC_PUSHBACK.clone(), pushback(d.retry_after));
    response
}

/// A gRPC trailers-only response with this status code and message.
pub(crate) fn grpc_status(status: &'static str, message: &'static str) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert(GRPC_STATUS.clone(), HeaderValue::from_static(status));
    h.insert(GRPC_MESSAGE.clone(), HeaderValue::from_static(message));
    response
}

/// A JSON response written by the layer itself.
pub(crate) fn json(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Bytes> {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How `refund_if` sees a call's outcome: a gRPC error status in the headers as the HTTP
    /// status it stands for, one that does not read as a code as a failure (a gRPC client takes
    /// it for UNKNOWN), anything else as the HTTP status.
    #[test]
    fn a_grpc_status_reads_as_the_http_status_it_stands_for() {
        let answer = |status: u16, grpc_status: Option<&str>| {
            let mut r = http::Response::builder().status(status);
            if let Some(code) = grpc_status {
                r = r.header("grpc-status", code);
            }
            r.body(()).unwrap()
        };
        let grpc = |status, code| outcome_status(&answer(status, code), true);
        assert_eq!(grpc(200, None), StatusCode::OK);
        assert_eq!(grpc(200, Some("0")), StatusCode::OK);
        assert_eq!(grpc(200, Some("16")), StatusCode::UNAUTHORIZED);
        assert_eq!(grpc(200, Some("7")), StatusCode::FORBIDDEN);
        assert_eq!(grpc(200, Some("8")), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(grpc(200, Some("13")), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(grpc(200, Some("14")), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(grpc(200, Some(" 16")), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            grpc(200, Some("99999999999")),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            grpc(503, Some("0")),
            StatusCode::SERVICE_UNAVAILABLE,
            "HTTP's own"
        );
        let http = outcome_status(&answer(200, Some("16")), false);
        assert_eq!(http, StatusCode::OK, "not a gRPC call");
        // A gRPC answer to a request that did not say gRPC (tonic answers any content type).
        let mut answered = answer(200, Some("16"));
        answered.headers_mut().insert(
            CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        assert_eq!(
            outcome_status(&answered, false),
            StatusCode::UNAUTHORIZED,
            "the response says gRPC"
        );
    }

    const STATUSES: Statuses = Statuses {
        unavailable: StatusCode::SERVICE_UNAVAILABLE,
        cost_exceeds_limit: StatusCode::TOO_MANY_REQUESTS,
    };
    use std::time::Duration;

    #[test]
    fn the_json_denial_states_the_wait_in_whole_milliseconds_rounded_up() {
        let waits = [
            1,
            999,
            1_000,
            1_001,
            59_999_999,
            3_600_000_000,
            u64::MAX / 2,
        ];
        // Many denials, so the bodies come from more than one shared buffer.
        for (i, micros) in waits.iter().cycle().take(500).enumerate() {
            let wait = Duration::from_micros(*micros);
            let d = Decision::deny(10, 0, wait, Some(wait));
            let r = denied(&d, &Denial::Json, false, STATUSES);
            let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
            assert_eq!(body["error"], "rate_limited", "denial {i}");
            assert_eq!(body["retry_after_ms"], ceil_millis(wait), "denial {i}");
            assert_eq!(body.as_object().map(|o| o.len()), Some(2), "{body}");
        }
    }

    #[test]
    fn retry_after_never_zero() {
        let d = Decision::deny(
            1,
            0,
            Duration::from_millis(3),
            Some(Duration::from_micros(10)),
        );
        let r = denied(&d, &Denial::Json, false, STATUSES);
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[RETRY_AFTER], "1");
    }

    #[test]
    fn problem_details_are_json() {
        let d = Decision::deny(
            5,
            0,
            Duration::from_secs(3),
            Some(Duration::from_millis(1500)),
        );
        let r = denied(&d, &Denial::Problem, false, STATUSES);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["status"], 429);
        assert_eq!(v["retry_after_ms"], 1500);
        let never = Decision::deny(5, 5, Duration::ZERO, None);
        let r = denied(&never, &Denial::Problem, false, STATUSES);
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert!(v["retry_after_ms"].is_null());
        let too_large = Statuses {
            cost_exceeds_limit: StatusCode::PAYLOAD_TOO_LARGE,
            ..STATUSES
        };
        let r = denied(&never, &Denial::Problem, false, too_large);
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["status"], 413);
        assert_eq!(v["title"], "Payload Too Large");
        assert!(
            !r.headers().contains_key(RETRY_AFTER),
            "waiting never helps"
        );
    }

    #[test]
    fn grpc_is_trailers_only_resource_exhausted() {
        let d = Decision::deny(
            5,
            0,
            Duration::from_secs(3),
            Some(Duration::from_millis(1500)),
        );
        let r = denied(&d, &Denial::Json, true, STATUSES);
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.body().is_empty());
        assert_eq!(r.headers()["grpc-status"], "8");
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "1500");
        assert_eq!(r.headers()[RETRY_AFTER], "2");
        let never = Decision::deny(5, 5, Duration::ZERO, None);
        let r = denied(&never, &Denial::Json, true, STATUSES);
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "-1");
    }
}
