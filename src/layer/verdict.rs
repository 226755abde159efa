//! One place that turns a request's decisions, or an error, into what the client sees: the
//! denial response, the rate-limit headers, the `RateLimitInfo` extension and the refunds a
//! response's status calls for.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::layer::{Config, Targets};
use super::{response, RateLimitInfo};
use crate::store::BoxFuture;
use crate::{Decision, Error, Key, Rule, Source};

pub(crate) type Decisions = smallvec::SmallVec<[Decision; 2]>;

/// What was decided for one request, kept until the response is out.
pub(crate) struct Verdict {
    config: Arc<Config>,
    targets: Targets,
    decisions: Decisions,
    governing: Decision,
    /// Shadow mode let through a request that would have been denied.
    would_deny: bool,
}

impl Verdict {
    pub(crate) fn new(config: Arc<Config>, targets: Targets, decisions: Decisions) -> Verdict {
        let governing = decisions
            .iter()
            .copied()
            .reduce(Decision::more_restrictive)
            .unwrap_or_else(|| Decision::admit(0, 0, std::time::Duration::ZERO));
        let would_deny = !governing.allowed && config.shadow;
        if would_deny {
            tracing::info!(
                retry_after = ?governing.retry_after,
                "fleetlimit: shadow mode let through a request it would deny"
            );
        }
        Verdict {
            config,
            targets,
            decisions,
            governing,
            would_deny,
        }
    }

    /// Whether the request goes on to the service (admitted, or let through by shadow mode).
    pub(crate) fn admits(&self) -> bool {
        self.governing.allowed || self.would_deny
    }

    /// The response refusing the request.
    pub(crate) fn denial(&self, grpc: bool) -> Response<Bytes> {
        let c = &self.config;
        let mut response = response::denied(&self.governing, &c.denial, grpc, c.unavailable_status);
        if matches!(c.denial, super::Denial::Custom(_)) {
            // A custom denial's own rate-limit headers are kept; the others are added.
            let mut ours = http::HeaderMap::new();
            self.write_headers(&mut ours);
            let headers = response.headers_mut();
            for (name, value) in ours.iter() {
                if !headers.contains_key(name) {
                    headers.insert(name.clone(), value.clone());
                }
            }
        } else {
            self.write_headers(response.headers_mut());
        }
        response.extensions_mut().insert(self.info());
        response
    }

    fn rules(&self) -> Vec<&Rule> {
        let rules = self.config.limiter.rules();
        self.targets
            .iter()
            .filter_map(|(i, _)| rules.get(*i))
            .collect()
    }

    fn write_headers(&self, headers: &mut http::HeaderMap) {
        let style = self.config.headers;
        // Only the IETF style names the rules; the others need no list.
        let rules = if style == super::HeaderStyle::Ietf {
            self.rules()
        } else {
            Vec::new()
        };
        style.write(&rules, &self.decisions, &self.governing, headers);
    }

    pub(crate) fn info(&self) -> RateLimitInfo {
        RateLimitInfo {
            decision: self.governing,
            would_deny: self.would_deny,
        }
    }

    /// Finish the service's response: the rate-limit headers, the outcome for outer middleware
    /// in shadow mode, and the refund its status calls for (if any), to run before it is
    /// returned.
    pub(crate) fn on_response<B>(
        &self,
        response: &mut Response<B>,
    ) -> Option<BoxFuture<'static, ()>> {
        self.write_headers(response.headers_mut());
        if self.would_deny {
            response.extensions_mut().insert(self.info());
        }
        self.refund(response.status())
    }

    /// The permits to give back for a response with this status, if any.
    fn refund(&self, status: StatusCode) -> Option<BoxFuture<'static, ()>> {
        let counted = matches!(self.governing.source, Source::Store | Source::Lease);
        if !self.governing.allowed || self.would_deny || !counted {
            return None; // nothing was taken from the shared budget
        }
        let refunds: Vec<(usize, Key, crate::Taken)> = self
            .targets
            .iter()
            .zip(&self.decisions)
            .filter(|((i, _), _)| {
                self.config.scopes[*i]
                    .refund_if
                    .as_ref()
                    .is_some_and(|refund| refund(status))
            })
            .filter_map(|((i, key), d)| Some((*i, key.clone(), d.taken?)))
            .collect();
        if refunds.is_empty() {
            return None;
        }
        let limiter = self.config.limiter.clone();
        Some(Box::pin(async move {
            if let Err(error) = limiter.refund_parts(&refunds).await {
                tracing::warn!(%error, "fleetlimit: refund failed; the permits stay taken");
            }
        }))
    }
}

/// No extractor produced a key and the peer address is unknown: the server is misconfigured
/// (e.g. axum served without `into_make_service_with_connect_info`). Said loudly rather than
/// sharing one bucket between every client.
pub(crate) fn no_key(grpc: bool) -> Response<Bytes> {
    tracing::error!(
        "fleetlimit: no rate-limit key for a request (no extractor matched and no peer address; \
         serve axum with `into_make_service_with_connect_info::<SocketAddr>()`)"
    );
    if grpc {
        return response::grpc_status("13", "no rate-limit key");
    }
    response::json(
        StatusCode::INTERNAL_SERVER_ERROR,
        "application/json",
        r#"{"error":"no_rate_limit_key"}"#,
    )
}

/// A scope's own key is missing and its rule says reject: the client's request is incomplete
/// (400, or gRPC `INVALID_ARGUMENT`), said at `debug`: a client must not be able to fill the logs.
pub(crate) fn missing_key(grpc: bool) -> Response<Bytes> {
    tracing::debug!("fleetlimit: a request without the key a rule requires was refused");
    if grpc {
        return response::grpc_status("3", "missing rate-limit key");
    }
    response::json(
        StatusCode::BAD_REQUEST,
        "application/json",
        r#"{"error":"missing_rate_limit_key"}"#,
    )
}

/// The response when no decision could be made: the limiter failed (a store error with no policy
/// to answer it, or a misconfiguration). Never a client's fault: `unavailable_status` (503 by
/// default) with a JSON body, or gRPC `UNAVAILABLE`.
pub(crate) fn failure(
    error: &Error,
    grpc: bool,
    unavailable_status: StatusCode,
) -> Response<Bytes> {
    tracing::error!(%error, "fleetlimit: rate-limit decision failed");
    if grpc {
        return response::grpc_status("14", "rate limiter unavailable");
    }
    response::json(
        unavailable_status,
        "application/json",
        r#"{"error":"rate_limiter_unavailable"}"#,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_honours_grpc_and_the_unavailable_status() {
        let error = Error::Store(crate::StoreError::Connection("down".into()));
        let http = failure(&error, false, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(http.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            http.body().as_ref(),
            br#"{"error":"rate_limiter_unavailable"}"#
        );
        let grpc = failure(&error, true, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(grpc.status(), StatusCode::OK, "trailers-only");
        assert_eq!(grpc.headers()["grpc-status"], "14");
        assert_eq!(grpc.headers()["content-type"], "application/grpc");
    }
}
