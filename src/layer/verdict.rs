//! One place that turns a request's decisions, or an error, into what the client sees: the
//! denial response, the rate-limit headers, the `RateLimitInfo` extension and the refunds a
//! response's status calls for.

use crate::limiter::Counting;
use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::layer::{Config, Targets};
use super::meter::{BodyMeter, Meter, Stopped};
use super::{response, RateLimitInfo};
use crate::store::{BoxFuture, Op};
use crate::{Decision, Error, Source};

pub(crate) type Decisions = smallvec::SmallVec<[Decision; 2]>;

/// Put in the extensions of every response a layer writes itself (a denial, a missing key, an
/// unavailable limiter): an outer layer that admitted the request gives its permits back, so
/// stacked layers are all or nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Refused;

/// What was decided for one request, kept until the response is out.
pub(crate) struct Verdict {
    config: Arc<Config>,
    targets: Targets,
    decisions: Decisions,
    governing: Decision,
    /// Shadow mode let through a request that would have been denied.
    would_deny: bool,
    /// An outer fleetlimit layer admitted the request first: it learns this layer's outcome
    /// from the response's extensions.
    nested: bool,
    grpc: bool,
    /// Rules charged by body size, metered as the body is read.
    meter: Option<Arc<Meter>>,
}

impl Verdict {
    #[inline]
    pub(crate) fn new(
        config: Arc<Config>,
        targets: Targets,
        decisions: Decisions,
        grpc: bool,
    ) -> Verdict {
        let governing = governing(&decisions);
        let would_deny = !governing.allowed && config.shadow;
        if would_deny {
            for (t, d) in targets.iter().zip(decisions.iter()) {
                if !d.allowed {
                    config.limiter.shadow_denied(t.rule);
                }
            }
            // Per request, so at `debug`: a client over its limit must not fill the logs (the
            // `shadow_denied` outcome counts these).
            tracing::debug!(
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
            nested: false,
            grpc,
            meter: None,
        }
    }

    /// Whether the request goes on to the service (admitted, or let through by shadow mode).
    pub(crate) fn admits(&self) -> bool {
        self.governing.allowed || self.would_deny
    }

    /// Pass an admitted request on: its extensions get the outcome for the handler (the most
    /// restrictive of every layer's so far).
    pub(crate) fn admit<B>(&mut self, req: &mut http::Request<B>) {
        let ours = self.info();
        // An outer layer's outcome is replaced by the two merged.
        if let Some(outer) = req.extensions_mut().insert(ours) {
            self.nested = true;
            req.extensions_mut().insert(merge(ours, Some(outer)));
        }
        if let Some(meter) = self.meter_for_body() {
            // Beside an outer layer's meter, never in its place: each layer's rules are charged
            // as the body is read.
            match req.extensions_mut().get_mut::<BodyMeter>() {
                Some(outer) => outer.0.push(meter.clone()),
                None => {
                    req.extensions_mut().insert(BodyMeter(vec![meter.clone()]));
                }
            }
            self.meter = Some(meter);
        }
    }

    /// A meter for the rules charged by body size, when the request was charged for real.
    fn meter_for_body(&self) -> Option<Arc<Meter>> {
        if !self.config.after.meters_bodies {
            return None;
        }
        // Shadow mode never refuses, a body included: it is charged up front only.
        if self.config.shadow {
            return None;
        }
        let scopes = &self.config.scopes;
        let mut meter: Option<Meter> = None;
        for (index, (target, decision)) in self.targets.iter().zip(&self.decisions).enumerate() {
            if !counted(decision) {
                continue; // not charged for real (fail open): nothing to meter
            }
            if let Some(unit) = scopes[target.rule].body_unit {
                meter
                    .get_or_insert_with(|| Meter::new(self.config.limiter.clone()))
                    .add(index, target, unit);
            }
        }
        meter.filter(|m| !m.is_empty()).map(Arc::new)
    }

    /// The response in place of the service's when a metered body was refused more bytes (or
    /// could not be charged): the handler saw its body end with an error.
    pub(crate) fn body_refusal(&mut self) -> Option<Response<Bytes>> {
        let meter = self.meter.as_ref()?;
        match meter.stopped()? {
            Stopped::Denied(refused) => {
                let latest = meter.latest();
                for (index, decision) in latest.into_iter().chain(refused) {
                    if let Some(d) = self.decisions.get_mut(index) {
                        *d = decision;
                    }
                }
                self.governing = governing(&self.decisions);
                Some(self.denial())
            }
            Stopped::Failed(error) => {
                Some(failure(&error, self.grpc, self.config.unavailable_status))
            }
        }
    }

    /// The response refusing the request.
    pub(crate) fn denial(&self) -> Response<Bytes> {
        let grpc = self.grpc;
        let c = &self.config;
        let statuses = response::Statuses {
            unavailable: c.unavailable_status,
            cost_exceeds_limit: c.cost_exceeds_limit_status,
        };
        let mut response = response::denied(&self.governing, &c.denial, grpc, statuses);
        if matches!(c.denial, super::Denial::Custom(_)) {
            // A custom denial's own rate-limit headers are kept; the others are added.
            let mut ours = http::HeaderMap::new();
            self.write_headers(&self.governing, &mut ours);
            let headers = response.headers_mut();
            for (name, value) in ours.iter() {
                if !headers.contains_key(name) {
                    headers.insert(name.clone(), value.clone());
                }
            }
        } else {
            self.write_headers(&self.governing, response.headers_mut());
        }
        response.extensions_mut().insert(self.info());
        response.extensions_mut().insert(Refused);
        response
    }

    /// This layer's headers, the single-valued styles showing `shown` (the most restrictive
    /// decision of this layer and those inside it).
    fn write_headers(&self, shown: &Decision, headers: &mut http::HeaderMap) {
        let style = self.config.headers;
        // Only the IETF style names the rules; the others need no list.
        if style != super::HeaderStyle::Ietf {
            return style.write(&[], &self.decisions, shown, headers);
        }
        let limiter = &self.config.limiter;
        limiter.with_rules_deciding(&self.targets, &self.decisions, |rules| {
            style.write(rules, &self.decisions, shown, headers)
        });
    }

    pub(crate) fn info(&self) -> RateLimitInfo {
        RateLimitInfo {
            decision: self.governing,
            would_deny: self.would_deny,
        }
    }

    /// The inner service failed (an `Err`, not a response): what its rules give back for a
    /// server error (`refund_if`), refunded in the background, since the error goes out as it
    /// came. Such a failure is the service's own, which `refund_if(|s| s.is_server_error())`
    /// is meant not to count.
    pub(crate) fn on_error(&mut self) {
        let failed = Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(())
            .unwrap_or_default();
        if let Some(refund) = self.refund(false, &failed) {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(refund);
                }
                Err(_) => tracing::warn!(
                    "fleetlimit: no runtime to give back an inner service error's permits"
                ),
            }
        }
    }

    /// Finish the service's response: the refund its status calls for (or every permit, when
    /// a layer inside refused the request), the rate-limit headers counting what is given back
    /// and merged with those of layers inside, and the outcome for outer middleware. The
    /// refund, if any, is to run before the response is returned.
    pub(crate) fn on_response<B>(
        &mut self,
        response: &mut Response<B>,
    ) -> Option<BoxFuture<'static, ()>> {
        let inside = response.extensions().get::<RateLimitInfo>().copied();
        let refused_inside = response.extensions().get::<Refused>().is_some();
        if let Some(meter) = &self.meter {
            if !meter.attached() {
                warn_unmetered();
            }
            for (index, decision) in meter.latest() {
                if let Some(d) = self.decisions.get_mut(index) {
                    let taken = d.taken.take();
                    *d = Decision { taken, ..decision };
                }
            }
            self.governing = governing(&self.decisions);
        }
        let refund = self.refund(refused_inside, response);
        let shown = merge(self.info(), inside);
        let from_fleetlimit = inside.is_some() || refused_inside;
        if !from_fleetlimit && self.config.headers == super::HeaderStyle::Ietf {
            // Only an inner fleetlimit layer's lists (a rate limit's, or a concurrency or
            // shedding refusal's) are joined to this layer's: a handler's or an upstream's own
            // (another draft's syntax, say) are replaced, as every other style replaces its
            // headers.
            super::headers::clear_ietf(response.headers_mut());
        }
        self.write_headers(&shown.decision, response.headers_mut());
        if self.would_deny || self.nested || inside.is_some() {
            response.extensions_mut().insert(shown);
        }
        refund
    }

    /// The rules of this response settled at its body's size, to count as it is sent.
    pub(crate) fn body_settle(&self) -> Option<BodySettle> {
        if !self.config.after.settles {
            return None;
        }
        if !self.governing.allowed || self.would_deny {
            return None;
        }
        let scopes = &self.config.scopes;
        let targets: Vec<(crate::Target, Option<crate::Taken>, u64)> = self
            .targets
            .iter()
            .zip(self.decisions.iter())
            .filter_map(|(target, decision)| {
                if !counted(decision) {
                    return None;
                }
                let unit = scopes[target.rule].settle.as_ref()?.body_unit()?;
                // Refunded already (refund_if, a refusal inside): nothing left to settle. (The
                // local fallback's admissions have no receipt either: they keep their
                // reservation, since a refund that had nothing to give back leaves no mark
                // here to tell a refunded request from one to charge.)
                let taken = decision.taken?;
                Some((target.clone(), Some(taken), unit))
            })
            .collect();
        (!targets.is_empty()).then(|| BodySettle {
            limiter: self.config.limiter.clone(),
            targets,
            bytes: 0,
        })
    }

    /// Give back what was taken: everything when a layer inside refused the request, else the
    /// rules whose `refund_if` accepts `status`. The decisions then count the permits as there
    /// again.
    fn refund<B>(
        &mut self,
        refused_inside: bool,
        response: &Response<B>,
    ) -> Option<BoxFuture<'static, ()>> {
        let after = self.config.after;
        if !refused_inside && self.meter.is_none() && !after.refunds && !after.settles {
            return None; // no scope gives anything back for this response
        }
        let status = super::response::outcome_status(response, self.grpc);
        if !self.governing.allowed || self.would_deny {
            return None; // nothing was taken from the shared budget
        }
        let mut refunds: Vec<crate::limiter::RefundPart> = Vec::new();
        // Costs found above their reservation: charged after the response.
        let mut extra: Vec<crate::Target> = Vec::new();
        let scopes = &self.config.scopes;
        for (index, (target, decision)) in self
            .targets
            .iter()
            .zip(self.decisions.iter_mut())
            .enumerate()
        {
            if !counted(decision) {
                continue; // the outage policy's own answer: nothing taken anywhere
            }
            let refund = refused_inside
                || scopes[target.rule]
                    .refund_if
                    .as_ref()
                    .is_some_and(|refund| refund(status));
            if !refund {
                let settle = scopes[target.rule].settle.as_ref();
                if let Some(actual) = settle.and_then(|s| s.actual(response)) {
                    settle_one(target, decision, actual, &mut refunds, &mut extra);
                }
                continue;
            }
            if let Some(taken) = decision.taken.take() {
                decision.remaining = decision
                    .remaining
                    .saturating_add(taken.cost())
                    .min(decision.limit);
                refunds.push((target.clone(), taken));
            }
            if let Some(meter) = &self.meter {
                for taken in meter.receipts(index) {
                    decision.remaining = decision
                        .remaining
                        .saturating_add(taken.cost())
                        .min(decision.limit);
                    refunds.push((target.clone(), taken));
                }
            }
        }
        if refunds.is_empty() && extra.is_empty() {
            return None;
        }
        self.governing = governing(&self.decisions);
        let limiter = self.config.limiter.clone();
        let work = async move {
            if !refunds.is_empty() {
                if let Err(error) = limiter.refund_parts(&refunds).await {
                    tracing::warn!(%error, "fleetlimit: refund failed; the permits stay taken");
                }
            }
            if !extra.is_empty() {
                charge_extra(&limiter, &extra).await;
            }
        };
        // A task of its own, waited for: a response future dropped meanwhile (a client's
        // reset, an outer timeout) must not take a charge past the reservation with it.
        Some(match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let task = runtime.spawn(work);
                Box::pin(async move {
                    let _ = task.await;
                })
            }
            Err(_) => Box::pin(work),
        })
    }
}

/// Settle `target` at its `actual` cost: give back what the reservation took beyond it, or
/// queue the difference to be charged.
fn settle_one(
    target: &crate::Target,
    decision: &mut Decision,
    actual: u64,
    refunds: &mut Vec<crate::limiter::RefundPart>,
    extra: &mut Vec<crate::Target>,
) {
    let (back, more) = settlement(target, decision.taken, actual);
    if let Some(back) = back {
        decision.remaining = decision
            .remaining
            .saturating_add(back.1.cost())
            .min(decision.limit);
        refunds.push(back);
    }
    if let Some(more) = more {
        decision.remaining = decision.remaining.saturating_sub(more.cost);
        extra.push(more);
    }
}

/// What settling `target` (reserved at `target.cost`, taken at `taken`) at `actual` means: a
/// part of the receipt to give back, or a cost to charge.
fn settlement(
    target: &crate::Target,
    taken: Option<crate::Taken>,
    actual: u64,
) -> (Option<crate::limiter::RefundPart>, Option<crate::Target>) {
    let reserved = target.cost;
    if actual < reserved {
        let back = taken.map(|t| (target.clone(), t.part(reserved - actual)));
        (back, None)
    } else if actual > reserved {
        let more = crate::Target {
            rule: target.rule,
            key: target.key.clone(),
            cost: actual - reserved,
            resolved: target.resolved.clone(),
        };
        (None, Some(more))
    } else {
        (None, None)
    }
}

/// Rules settled at the response body's size: counts the bytes sent, and settles when the
/// body ends or is dropped (at what was sent).
pub(crate) struct BodySettle {
    limiter: crate::Limiter,
    /// Each target with where its reservation was taken, and its unit.
    targets: Vec<(crate::Target, Option<crate::Taken>, u64)>,
    pub(crate) bytes: u64,
}

impl Drop for BodySettle {
    fn drop(&mut self) {
        let mut refunds = Vec::new();
        let mut extra = Vec::new();
        for (target, taken, unit) in &self.targets {
            let actual = self.bytes.div_ceil((*unit).max(1));
            let (back, more) = settlement(target, *taken, actual);
            refunds.extend(back);
            extra.extend(more);
        }
        if refunds.is_empty() && extra.is_empty() {
            return;
        }
        let limiter = self.limiter.clone();
        let settle = async move {
            if !refunds.is_empty() {
                if let Err(error) = limiter.refund_parts(&refunds).await {
                    tracing::warn!(%error, "fleetlimit: refund failed; the permits stay taken");
                }
            }
            if !extra.is_empty() {
                charge_extra(&limiter, &extra).await;
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(settle);
            }
            Err(_) => tracing::warn!(
                "fleetlimit: a response body ended outside a runtime; its reservation stays as taken"
            ),
        }
    }
}

/// Charge costs found above their reservations. A charge the budget cannot hold whole takes
/// what is left instead (the overrun is counted as far as the limit goes, and nothing ever
/// passes it): the key's next request is refused, rather than the overrun being forgiven.
async fn charge_extra(limiter: &crate::Limiter, extra: &[crate::Target]) {
    for target in extra {
        let mut charge = target.clone();
        let mut charged = 0;
        // A refusal says what is left, and the rest is charged; a few times at most, as another
        // request may take it meanwhile.
        for _ in 0..3 {
            let decisions = match limiter
                .consume_counted(std::slice::from_ref(&charge), Counting::Charge)
                .await
            {
                Ok(d) => d,
                Err(error) => {
                    tracing::warn!(%error, "fleetlimit: a settled cost could not be charged");
                    break;
                }
            };
            let Some(refused) = decisions.into_iter().find(|d| !d.allowed) else {
                charged = charge.cost;
                break;
            };
            // A listing or the outage policy decided: there is no budget to take from. (The
            // local fallback's refusals are degraded too, and say what its share has left.)
            let by_policy = refused.degraded && refused.source != Source::Fallback;
            if by_policy || refused.listed.is_listed() {
                break;
            }
            // A remembered refusal says what was left when the store gave it: ask the store.
            let left = if refused.source == Source::Cache {
                let peek = crate::Target {
                    cost: 1,
                    ..target.clone()
                };
                match limiter
                    .apply_indexed(Op::Peek, std::slice::from_ref(&peek))
                    .await
                {
                    Ok(d) => d.first().map_or(0, |d| d.remaining),
                    Err(_) => break,
                }
            } else {
                refused.remaining
            };
            if left == 0 || left >= charge.cost {
                break;
            }
            charge.cost = left;
        }
        if charged < target.cost {
            tracing::warn!(
                cost = target.cost,
                charged,
                "fleetlimit: a settled cost exceeded its reservation and the budget left; what was left was charged"
            );
        }
    }
}

/// A rule charges by body size, but no `MeterBodyLayer` meters the bodies: said once.
fn warn_unmetered() {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "fleetlimit: a rule charges by body size (Scope::cost_body) but no MeterBodyLayer \
             inside the rate-limit layer meters the bodies: a body without a declared length is \
             charged one unit"
        );
    }
}

/// Whether `decision` took from a budget that counts (the store's, a block leased from it, or
/// the local fallback's in an outage), so that metering and charges past a reservation apply
/// to it (refunds need its receipt besides: the fallback's admissions have none, and give
/// nothing back). Each rule's own, never the governing decision's: a body read on into an
/// outage leaves the outage policy's decision in place of the one that took the permits (its
/// receipt kept), and that decision may govern. Not the policy's own answers (fail open or
/// closed): those took nothing anywhere.
fn counted(decision: &Decision) -> bool {
    decision.taken.is_some()
        || matches!(
            decision.source,
            Source::Store | Source::Lease | Source::Fallback
        )
}

/// The decision that governs a request's single-valued headers.
fn governing(decisions: &[Decision]) -> Decision {
    match decisions {
        [one] => *one,
        _ => decisions
            .iter()
            .copied()
            .reduce(Decision::more_restrictive)
            .unwrap_or_else(|| Decision::admit(0, 0, std::time::Duration::ZERO)),
    }
}

/// This layer's outcome together with another layer's: the more restrictive decision; shadow
/// mode's mark if either let a denial through.
fn merge(ours: RateLimitInfo, other: Option<RateLimitInfo>) -> RateLimitInfo {
    let Some(other) = other else {
        return ours;
    };
    // An outage policy's admission counted nothing: its numbers describe nothing, and ranked as
    // the most restrictive they would hide the other layer's, which were counted. Its refusal
    // still wins: the response is a refusal, and must not read as an admission.
    let counted_nothing =
        |info: &RateLimitInfo| info.decision.source == Source::Policy && info.decision.allowed;
    let decision = match (counted_nothing(&ours), counted_nothing(&other)) {
        (true, false) => other.decision,
        (false, true) => ours.decision,
        _ => ours.decision.more_restrictive(other.decision),
    };
    RateLimitInfo {
        decision,
        would_deny: ours.would_deny || other.would_deny,
    }
}

/// No extractor produced a key and the peer address is unknown: the server is misconfigured
/// (e.g. axum served without `into_make_service_with_connect_info`). Said loudly rather than
/// sharing one bucket between every client.
pub(crate) fn no_key(grpc: bool) -> Response<Bytes> {
    say_no_key();
    refusal(
        grpc,
        ("13", "no rate-limit key"),
        StatusCode::INTERNAL_SERVER_ERROR,
        r#"{"error":"no_rate_limit_key"}"#,
    )
}

/// The server's misconfiguration, said loudly (also in shadow mode, which lets the request
/// through).
pub(crate) fn say_no_key() {
    tracing::error!(
        "fleetlimit: no rate-limit key for a request (no extractor matched and no peer address; \
         serve axum with `into_make_service_with_connect_info::<SocketAddr>()`; for tonic over \
         TLS or a server of your own, name its connection info with `PeerIp::connect_info`)"
    );
}

/// A scope's own key is missing and its rule says reject: the client's request is incomplete
/// (400, or gRPC `INVALID_ARGUMENT`), said at `debug`: a client must not be able to fill the logs.
pub(crate) fn missing_key(grpc: bool) -> Response<Bytes> {
    tracing::debug!("fleetlimit: a request without the key a rule requires was refused");
    refusal(
        grpc,
        ("3", "missing rate-limit key"),
        StatusCode::BAD_REQUEST,
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
    refusal(
        grpc,
        ("14", "rate limiter unavailable"),
        unavailable_status,
        r#"{"error":"rate_limiter_unavailable"}"#,
    )
}

/// A refusal the layer writes itself, the gRPC way or as JSON, marked [`Refused`] for the
/// layers outside.
fn refusal(
    grpc: bool,
    (grpc_code, grpc_message): (&'static str, &'static str),
    status: StatusCode,
    json: &'static str,
) -> Response<Bytes> {
    let mut response = if grpc {
        response::grpc_status(grpc_code, grpc_message)
    } else {
        response::json(status, "application/json", json)
    };
    response.extensions_mut().insert(Refused);
    response
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

    /// A response future dropped while the cost past its reservation is being charged (a
    /// client's reset after the handler answered): the charge goes on without it. Reserved
    /// 10, used 50, on a store 5 ms away: 50 taken (10 before, the 40 lost with the future).
    #[tokio::test(start_paused = true)]
    async fn a_charge_past_the_reservation_outlives_a_dropped_response() {
        use crate::layer::{ActualCost, Scope, Settle};
        use crate::store::testing::{Link, TokioClock};
        use crate::{Key, Limiter, MemoryStore, OnStoreError, Quota, RateLimitLayer, Rule};
        use std::time::Duration;
        use tower::{Layer, Service, ServiceExt};
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let link = Link::new(store, Duration::from_millis(5), Duration::ZERO);
        let limiter = Limiter::builder(link)
            .rule(Rule::new("tokens", Quota::per_hour(100).build().unwrap()).unwrap())
            .on_store_error(OnStoreError::fail_closed())
            .deadline(Duration::from_secs(1))
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder(limiter.clone())
            .key(crate::key::global())
            .scope(
                "tokens",
                Scope::new().cost(|_| 10).settle(Settle::extension()),
            )
            .build()
            .unwrap();
        let mut service = layer.layer(tower::service_fn(|_: http::Request<String>| async {
            let mut response = http::Response::new(String::new());
            response.extensions_mut().insert(ActualCost(50));
            Ok::<_, std::convert::Infallible>(response)
        }));
        let ready = service.ready().await.unwrap();
        let call = ready.call(http::Request::new(String::new()));
        // Decided at 5 ms, answered at once, the 40 more sent: dropped mid-charge.
        assert!(tokio::time::timeout(Duration::from_millis(7), call)
            .await
            .is_err());
        tokio::time::sleep(Duration::from_millis(50)).await;
        let left = limiter.peek(&Key::global()).await.unwrap().remaining;
        assert_eq!(left, 50, "the 40 past the reservation charged");
    }

    /// In an outage with a local fallback, a cost past its reservation that the fallback's share
    /// cannot hold drains what the share has left, as it would the store's budget (its
    /// refusal, degraded as every fallback decision is, was taken for the outage policy's, and
    /// nothing was charged).
    #[tokio::test(start_paused = true)]
    async fn an_overrun_in_an_outage_drains_the_local_share() {
        use crate::store::testing::{Link, TokioClock};
        use crate::{Algorithm, Key, Limiter, MemoryStore, OnStoreError, Quota, Rule, Source};
        use std::time::Duration;
        let store = MemoryStore::builder()
            .clock(TokioClock::new())
            .build()
            .unwrap();
        let hung = Link::new(store, Duration::from_secs(10), Duration::ZERO);
        let quota = Quota::per_hour(100)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap();
        let limiter = Limiter::builder(hung)
            .rule(Rule::new("tokens", quota).unwrap())
            .on_store_error(OnStoreError::LocalShare(1))
            .build()
            .unwrap();
        let key = Key::new("tenant");
        let d = limiter.consume(&key, 10).await.unwrap();
        assert_eq!((d.allowed, d.source), (true, Source::Fallback), "{d:?}");
        let overrun = crate::Target {
            rule: 0,
            key: key.clone(),
            cost: 500,
            resolved: None,
        };
        charge_extra(&limiter, std::slice::from_ref(&overrun)).await;
        let d = limiter.consume(&key, 1).await.unwrap();
        assert_eq!((d.allowed, d.source), (false, Source::Fallback), "{d:?}");
    }

    /// An overrun that does not fit drains what is left, even when the denial cache answers
    /// its charge with what was left a moment ago: the store's own refusal of the rest says
    /// what is left now.
    #[tokio::test(start_paused = true)]
    async fn an_overrun_drains_what_is_left_now_not_what_a_remembered_refusal_says() {
        use crate::{Algorithm, Key, Limiter, ManualClock, MemoryStore, OnStoreError, Quota, Rule};
        use std::time::Duration;
        let clock = ManualClock::new(1_900_000_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let link = crate::store::testing::Link::new(store.clone(), Duration::ZERO, Duration::ZERO);
        let quota = Quota::per_second(100)
            .algorithm(Algorithm::TokenBucket)
            .build()
            .unwrap();
        let limiter = Limiter::builder(link)
            .rule(Rule::new("tokens", quota).unwrap())
            .on_store_error(OnStoreError::fail_closed())
            .clock(clock.clone())
            .build()
            .unwrap();
        let key = Key::new("tenant");
        let overrun = crate::Target {
            rule: 0,
            key: key.clone(),
            cost: 100,
            resolved: None,
        };
        assert!(limiter.consume(&key, 10).await.unwrap().allowed);
        // 100 more do not fit in the 90 left: refused (and remembered), the 90 taken.
        charge_extra(&limiter, std::slice::from_ref(&overrun)).await;
        assert_eq!(limiter.peek(&key).await.unwrap().remaining, 0);
        // 50 ms later, 5 have come back; the same overrun is refused from memory, which says 90.
        clock.advance(Duration::from_millis(50));
        assert_eq!(limiter.peek(&key).await.unwrap().remaining, 5);
        charge_extra(&limiter, std::slice::from_ref(&overrun)).await;
        assert_eq!(
            limiter.peek(&key).await.unwrap().remaining,
            0,
            "the 5 taken"
        );
        // Refused at 0 (remembered: 0 left), then 600 ms later 60 have come back; the same
        // overrun is refused from memory, which says 0.
        charge_extra(&limiter, std::slice::from_ref(&overrun)).await;
        clock.advance(Duration::from_millis(600));
        assert_eq!(limiter.peek(&key).await.unwrap().remaining, 60);
        charge_extra(&limiter, std::slice::from_ref(&overrun)).await;
        assert_eq!(
            limiter.peek(&key).await.unwrap().remaining,
            0,
            "the 60 taken"
        );
    }
}
