//! Request bodies read before the rate-limit decision, so keys and costs can come from them
//! (the account name of a JSON login, a form field), and put back for the handler.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{header, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tower_layer::Layer;
use tower_service::Service;

use super::{ResponseBody, Scope};

/// The body of a request as [`BufferBodyLayer`] read it, in the request's extensions, for
/// extractors ([`key::json_field`](crate::key::json_field),
/// [`key::form_field`](crate::key::form_field)) and cost functions (`parts.extensions`).
#[derive(Debug, Clone)]
pub struct BufferedBody(Bytes);

impl BufferedBody {
    /// The body's bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Put `body` in `parts` as if a [`BufferBodyLayer`] had read it (doc examples and tests).
    #[doc(hidden)]
    pub fn __for_tests(parts: &mut Parts, body: &[u8]) {
        parts
            .extensions
            .insert(BufferedBody(Bytes::copy_from_slice(body)));
    }
}

/// Reads the bodies of chosen requests (at most `max_bytes` each) before the layers inside it,
/// so a [`RateLimitLayer`](super::RateLimitLayer) inside can key or charge by what the body
/// says, and hands the handler the same bytes.
///
/// By default it reads the bodies axum's `Json` and `Form` read: JSON (`application/json`,
/// `…+json`) and form (any content type starting `application/x-www-form-urlencoded`) bodies,
/// but never a gRPC call's stream (see [`key::json_field`](crate::key::json_field)); narrow it to the routes that need it with
/// [`route`](BufferBodyLayer::route) or [`when`](BufferBodyLayer::when). Other requests pass
/// untouched, their bodies streaming as before. A body over `max_bytes` (declared or read) is
/// answered `413` with `{"error":"body_too_large"}`, a body that fails to arrive `400`, one
/// slower than [`read_timeout`](BufferBodyLayer::read_timeout) (10 s) `408`: none reaches a
/// rate-limit decision or the handler. Every rule inside decides a buffered request only once
/// its body is read, so buffer only the routes whose rules need the body.
///
/// Put it outside the rate-limit layer (in axum, the later `.layer` call):
///
/// ```
/// use axum::{routing::post, Router};
/// use fleetlimit::layer::{BufferBodyLayer, Scope};
/// use fleetlimit::{key, Limiter, MemoryStore, MissingKey, Quota, RateLimitLayer, Rule};
/// use http::Method;
///
/// let limiter = Limiter::builder(MemoryStore::new())
///     .rule(Rule::new("login-account", Quota::per_minute(5).build()?)?)
///     .build()?;
/// let login = Scope::new()
///     .route(Method::POST, "/login")
///     .key(key::json_field("/account"))
///     .on_missing_key(MissingKey::Reject);
/// let app: Router = Router::new()
///     .route("/login", post(|body: String| async move { body }))
///     .layer(RateLimitLayer::builder(limiter).scope("login-account", login).build()?)
///     .layer(BufferBodyLayer::new(16 * 1024).route(Method::POST, "/login"));
/// # let _ = app;
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Clone, Debug)]
pub struct BufferBodyLayer {
    config: Arc<BufferConfig>,
}

#[derive(Clone, Debug)]
struct BufferConfig {
    max_bytes: usize,
    only: Option<Scope>,
    read_timeout: std::time::Duration,
}

/// How long [`BufferBodyLayer`] waits for a whole body by default.
pub const DEFAULT_BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl BufferBodyLayer {
    /// Read JSON and form bodies of at most `max_bytes`, each within
    /// [`DEFAULT_BODY_READ_TIMEOUT`] (10 s).
    pub fn new(max_bytes: usize) -> BufferBodyLayer {
        BufferBodyLayer {
            config: Arc::new(BufferConfig {
                max_bytes,
                only: None,
                read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            }),
        }
    }

    /// How long a body may take to arrive whole (default 10 s); a slower one is answered `408`
    /// with `{"error":"body_timeout"}`. Every rate-limit decision inside waits for the body: a
    /// client trickling bytes would otherwise hold a connection and up to `max_bytes` of memory
    /// for as long as it likes, out of reach of every rule (its per-address rule included).
    /// A zero timeout answers 408 to any body not already whole when the request arrives.
    pub fn read_timeout(mut self, timeout: std::time::Duration) -> Self {
        Arc::make_mut(&mut self.config).read_timeout = timeout;
        self
    }

    fn only(mut self, f: impl FnOnce(Scope) -> Scope) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.only = Some(f(config.only.take().unwrap_or_default()));
        self
    }

    /// Only requests with this method and path ([`Scope::route`]'s syntax), whatever their
    /// content type.
    ///
    /// # Panics
    ///
    /// On a path that could not match as written (`/users/{id`, `/files/{*rest}/meta`), as
    /// axum's `Router::route` does: this layer has no build step to return the error from, and
    /// taken, the path would buffer nothing, and a rule keyed on the body would be skipped.
    pub fn route(self, method: Method, path: &str) -> Self {
        if let Some(reason) = super::scope::path_error(path) {
            panic!("BufferBodyLayer::route: {path:?}: {reason}");
        }
        self.only(|scope| scope.route(method, path))
    }

    /// Only requests for which `predicate` is true, whatever their content type.
    pub fn when(self, predicate: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.only(|scope| scope.when(predicate))
    }
}

impl BufferConfig {
    fn wants(&self, parts: &Parts) -> bool {
        match &self.only {
            Some(scope) => scope.matches(parts),
            // A gRPC call (`application/grpc+json` too) is a stream: buffered, its handler
            // would wait for the client's last message, which an interactive client sends
            // only after an answer.
            None if super::response::is_grpc(parts) => false,
            // axum's `Form` reads a GET's query, never its body.
            None => is_json(parts) || (is_form(parts) && parts.method != Method::GET),
        }
    }
}

/// Whether a handler's JSON extractor would read the body: `application/json` or any `…+json`
/// (axum's `Json` reads `application/grpc+json` too), parameters aside. Media types are
/// case-insensitive (a handler's parse accepts `+JSON`).
pub(crate) fn is_json(parts: &Parts) -> bool {
    content_type(parts).is_some_and(|ct| {
        let mime = ct.split(';').next().unwrap_or("").trim();
        let suffix = mime.len().checked_sub(5).and_then(|at| mime.get(at..));
        mime.eq_ignore_ascii_case("application/json")
            || suffix.is_some_and(|s| s.eq_ignore_ascii_case("+json"))
    })
}

/// Whether a handler's form extractor would read the body: axum's `Form` takes any content type
/// that *starts* with `application/x-www-form-urlencoded` (`…urlencoded charset=utf-8`, with no
/// `;`, too), so this does as well.
fn is_form(parts: &Parts) -> bool {
    const FORM: &[u8] = b"application/x-www-form-urlencoded";
    content_type(parts)
        .and_then(|ct| ct.as_bytes().get(..FORM.len()))
        .is_some_and(|start| start.eq_ignore_ascii_case(FORM))
}

fn content_type(parts: &Parts) -> Option<&str> {
    parts.headers.get(header::CONTENT_TYPE)?.to_str().ok()
}

impl<S> Layer<S> for BufferBodyLayer {
    type Service = BufferBody<S>;

    fn layer(&self, inner: S) -> BufferBody<S> {
        BufferBody {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service made by [`BufferBodyLayer`].
#[derive(Clone, Debug)]
pub struct BufferBody<S> {
    inner: S,
    config: Arc<BufferConfig>,
}

/// The future of a [`BufferBody`] call.
pub type BufferFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

impl<S, B, ResBody> Service<Request<B>> for BufferBody<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = BufferFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (mut parts, body) = req.into_parts();
        if !self.config.wants(&parts) {
            let future = inner.call(Request::from_parts(parts, body));
            return Box::pin(async move { Ok(future.await?.map(ResponseBody::inner)) });
        }
        let (max, read_timeout) = (self.config.max_bytes, self.config.read_timeout);
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        Box::pin(async move {
            if declared.is_some_and(|n| n > max as u64) {
                return Ok(refused(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"));
            }
            let read = http_body_util::Limited::new(body, max).collect();
            let Ok(read) = tokio::time::timeout(read_timeout, read).await else {
                return Ok(refused(StatusCode::REQUEST_TIMEOUT, "body_timeout"));
            };
            let bytes = match read {
                Ok(collected) => collected.to_bytes(),
                Err(error) => {
                    if error.is::<http_body_util::LengthLimitError>() {
                        return Ok(refused(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"));
                    }
                    tracing::debug!(%error, "fleetlimit: a request body failed to arrive");
                    return Ok(refused(StatusCode::BAD_REQUEST, "body_unreadable"));
                }
            };
            parts.extensions.insert(BufferedBody(bytes.clone()));
            let response = inner
                .call(Request::from_parts(parts, B::from(bytes)))
                .await?;
            Ok(response.map(ResponseBody::inner))
        })
    }
}

/// The answer to a body that cannot be read. Not marked `Refused` (see `verdict`):
/// a rate-limit layer outside this one counts it as any request it admitted (the client's
/// fault, not a limit's: refunded, a trickling client would reconnect for free).
fn refused<B>(status: StatusCode, error: &str) -> Response<ResponseBody<B>> {
    super::response::json(
        status,
        "application/json",
        format!(r#"{{"error":"{error}"}}"#),
    )
    .map(ResponseBody::full)
}

#[cfg(test)]
mod tests {
    /// Taken, the path would buffer nothing, and a rule keyed on the body would be skipped.
    #[test]
    #[should_panic(expected = "nothing can follow it")]
    fn a_route_that_could_not_match_is_refused_at_once() {
        let _ = super::BufferBodyLayer::new(1024).route(http::Method::POST, "/files/{*rest}/meta");
    }
}
