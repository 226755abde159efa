//! One layer for a whole service: a cost per rule decided in one atomic step, stacked layers
//! that are all or nothing and agree on their headers, keys from the body, per-scope settings
//! and axum route patterns, and a denial cache that forgets on time.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::response::Response;
use axum::{routing::get, routing::post, Router};
use fleetlimit::key::{self, PeerIp};
use fleetlimit::layer::{BufferBodyLayer, MeterBodyLayer, Scope};
use fleetlimit::store::{Op, RedisStore};
use fleetlimit::{
    Algorithm, HeaderStyle, Key, Limiter, ManualClock, MemoryStore, MissingKey, OnStoreError,
    Quota, RateLimitInfo, RateLimitLayer, Rule, Source,
};
use http_body_util::BodyExt;
use tower::ServiceExt;

const KIB: u64 = 1024;

fn rule(name: &str, limit: u64) -> Rule {
    Rule::new(
        name,
        Quota::per_minute(limit)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .unwrap(),
    )
    .unwrap()
}

fn limiter(rules: Vec<Rule>) -> Limiter {
    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    rules
        .into_iter()
        .fold(Limiter::builder(store), |b, r| b.rule(r))
        .build()
        .unwrap()
}

/// The upload's declared size in KiB, rounded up; at least 1.
fn kib(parts: &http::request::Parts) -> u64 {
    parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .unwrap_or(0)
        .div_ceil(KIB)
        .max(1)
}

async fn send(app: &Router, method: Method, path: &str, headers: &[(&str, &str)]) -> Response {
    send_body(app, method, path, headers, Vec::new()).await
}

async fn send_body(
    app: &Router,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Response {
    let mut b = Request::builder().method(method).uri(path);
    for (n, v) in headers {
        b = b.header(*n, *v);
    }
    let mut req = b.body(Body::from(body)).unwrap();
    req.extensions_mut()
        .insert(SocketAddr::from(([198, 51, 100, 7], 5555)));
    app.clone().oneshot(req).await.unwrap()
}

fn h(r: &Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

async fn body_json(r: Response) -> serde_json::Value {
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

/// What `rule` has left for `key`, consuming nothing.
async fn left(limiter: &Limiter, rule: &str, key: &Key) -> u64 {
    limiter.apply_to(Op::Peek, &[(rule, key)], 1).await.unwrap()[0].remaining
}

fn upload(bytes: u64) -> [(&'static str, String); 2] {
    [
        ("x-api-key", "tenant-1".to_owned()),
        ("content-length", bytes.to_string()),
    ]
}

async fn put(app: &Router, bytes: u64) -> Response {
    let headers = upload(bytes);
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    send(app, Method::POST, "/upload", &headers).await
}

fn routes() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/upload", post(|| async { "stored" }))
}

#[tokio::test]
async fn each_rule_has_its_own_cost_in_one_atomic_step() {
    let limiter = limiter(vec![rule("plan", 60), rule("uploads", 1000)]);
    let app = routes().layer(
        RateLimitLayer::builder(limiter.clone())
            .key(key::header("x-api-key"))
            .scope(
                "uploads",
                Scope::new().route(Method::POST, "/upload").cost(kib),
            )
            .cost_exceeds_limit_status(StatusCode::PAYLOAD_TOO_LARGE)
            .build()
            .unwrap(),
    );
    let tenant = Key::new("tenant-1");
    for n in 0..3 {
        assert_eq!(put(&app, 300 * KIB).await.status(), StatusCode::OK, "{n}");
    }
    // 900 of 1000 KiB used: the 4th 300 KiB upload is refused by the upload rule, and the
    // headers say so (not the plan rule's 57 left).
    let r = put(&app, 300 * KIB).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h(&r, "ratelimit-limit").as_deref(), Some("1000"));
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("100"));
    assert!(h(&r, "retry-after").is_some());
    // All or nothing: the refused upload took nothing from the plan.
    assert_eq!(left(&limiter, "plan", &tenant).await, 57);
    assert_eq!(left(&limiter, "uploads", &tenant).await, 100);
    // A 100 KiB upload fits: 1 from the plan, 100 from the uploads.
    assert_eq!(put(&app, 100 * KIB).await.status(), StatusCode::OK);
    assert_eq!(left(&limiter, "plan", &tenant).await, 56);
    assert_eq!(left(&limiter, "uploads", &tenant).await, 0);
    // 2 MiB can never fit in 1000 KiB: 413, with no Retry-After, and nothing taken.
    let r = put(&app, 2048 * KIB).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(h(&r, "retry-after").is_none());
    assert_eq!(body_json(r).await["error"], "cost_exceeds_limit");
    assert_eq!(left(&limiter, "plan", &tenant).await, 56);
    // Other routes cost 1 on the plan only.
    let r = send(&app, Method::GET, "/", &[("x-api-key", "tenant-1")]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("55"));
}

#[tokio::test]
async fn a_scope_cost_of_zero_leaves_the_request_out_of_that_rule() {
    let limiter = limiter(vec![rule("plan", 10), rule("writes", 1)]);
    let app = routes().layer(
        RateLimitLayer::builder(limiter.clone())
            .key(key::header("x-api-key"))
            .scope(
                "writes",
                Scope::new().cost(|p| u64::from(p.method == Method::POST)),
            )
            .build()
            .unwrap(),
    );
    for _ in 0..3 {
        let r = send(&app, Method::GET, "/", &[("x-api-key", "t")]).await;
        assert_eq!(r.status(), StatusCode::OK);
    }
    assert_eq!(put(&app, 1).await.status(), StatusCode::OK);
    assert_eq!(
        put(&app, 1).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "one write per minute, reads not counted on it"
    );
}

/// The issue's run-time fault: an outer layer (the plan) and an inner one on the upload route.
fn stacked(outer: &Limiter, inner: &Limiter, style: HeaderStyle) -> Router {
    let uploads = RateLimitLayer::builder(inner.clone())
        .key(key::header("x-api-key"))
        .cost(kib)
        .headers(style)
        .cost_exceeds_limit_status(StatusCode::PAYLOAD_TOO_LARGE)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/upload",
            post(
                |info: axum::Extension<RateLimitInfo>| async move { info.decision.limit.to_string() },
            )
            .layer(uploads),
        )
        .layer(
            RateLimitLayer::builder(outer.clone())
                .key(key::header("x-api-key"))
                .headers(style)
                .build()
                .unwrap(),
        )
}

#[tokio::test]
async fn stacked_layers_are_all_or_nothing_and_show_the_most_restrictive() {
    let outer = limiter(vec![rule("plan", 60)]);
    let inner = limiter(vec![rule("uploads", 1000)]);
    let app = stacked(&outer, &inner, HeaderStyle::Draft6);
    let tenant = Key::new("tenant-1");
    for _ in 0..3 {
        let r = put(&app, 300 * KIB).await;
        assert_eq!(r.status(), StatusCode::OK);
        // The more restrictive of the two: 60 - n plan permits against 1000 - 300 n KiB.
        assert_eq!(h(&r, "ratelimit-limit").as_deref(), Some("60"));
    }
    let r = put(&app, 300 * KIB).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        h(&r, "ratelimit-limit").as_deref(),
        Some("1000"),
        "the outer layer must not overwrite the inner denial's headers"
    );
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("100"));
    let retry: u64 = h(&r, "retry-after").unwrap().parse().unwrap();
    let reset: u64 = h(&r, "ratelimit-reset").unwrap().parse().unwrap();
    assert!(
        retry >= 1 && reset >= retry.saturating_sub(1),
        "{retry} {reset}"
    );
    assert_eq!(
        left(&outer, "plan", &tenant).await,
        57,
        "the inner denial gave the outer layer's permit back"
    );
    let r = put(&app, 2048 * KIB).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(h(&r, "ratelimit-limit").as_deref(), Some("1000"));
    assert_eq!(left(&outer, "plan", &tenant).await, 57);
    // An admitted upload shows the tighter one; the handler saw the tighter decision too.
    let r = put(&app, 50 * KIB).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("50"));
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &bytes[..],
        b"1000",
        "the handler's RateLimitInfo is the tighter rule's"
    );
    assert_eq!(left(&outer, "plan", &tenant).await, 56);
}

#[tokio::test]
async fn stacked_layers_list_every_policy_in_the_ietf_style() {
    let outer = limiter(vec![rule("plan", 60)]);
    let inner = limiter(vec![rule("uploads", 1000)]);
    let app = stacked(&outer, &inner, HeaderStyle::Ietf);
    let r = put(&app, 300 * KIB).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        h(&r, "ratelimit-policy").as_deref(),
        Some("\"uploads\";q=1000;w=60, \"plan\";q=60;w=60")
    );
    let state = h(&r, "ratelimit").unwrap();
    assert!(state.starts_with("\"uploads\";r=700;t="), "{state}");
    assert!(state.contains(", \"plan\";r=59;t="), "{state}");
    for _ in 0..2 {
        put(&app, 300 * KIB).await;
    }
    let r = put(&app, 300 * KIB).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let state = h(&r, "ratelimit").unwrap();
    assert!(state.starts_with("\"uploads\";r=100;t="), "{state}");
    assert!(
        state.contains(", \"plan\";r=57;t="),
        "the plan's permit is shown given back: {state}"
    );
    // Requests the inner layer does not see carry the outer layer's policy only.
    let r = send(&app, Method::GET, "/", &[("x-api-key", "tenant-1")]).await;
    assert_eq!(
        h(&r, "ratelimit-policy").as_deref(),
        Some("\"plan\";q=60;w=60")
    );
}

#[tokio::test]
async fn a_refunded_response_shows_the_permits_given_back() {
    let limiter = limiter(vec![rule("login", 3)]);
    let app = Router::new()
        .route(
            "/login",
            post(|body: String| async move {
                if body == "right" {
                    StatusCode::OK
                } else {
                    StatusCode::UNAUTHORIZED
                }
            }),
        )
        .layer(
            RateLimitLayer::builder(limiter)
                .scope("login", Scope::new().refund_if(|s| s.is_success()))
                .build()
                .unwrap(),
        );
    let login =
        |body: &'static str| send_body(&app, Method::POST, "/login", &[], body.as_bytes().to_vec());
    let r = login("wrong").await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("2"));
    let r = login("right").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        h(&r, "ratelimit-remaining").as_deref(),
        Some("2"),
        "the successful login was given back before the headers were written"
    );
}

fn login_app(limiter: Limiter) -> Router {
    let layer = RateLimitLayer::builder(limiter)
        .headers(HeaderStyle::Ietf)
        .scope(
            "login-account",
            Scope::new()
                .route(Method::POST, "/login")
                .key(key::json_field("account"))
                .on_missing_key(MissingKey::Reject)
                .refund_if(|s| s.is_success()),
        )
        .scope(
            "login-ip",
            Scope::new()
                .route(Method::POST, "/login")
                .key(PeerIp::default()),
        )
        .build()
        .unwrap();
    Router::new()
        .route(
            "/login",
            post(|body: axum::Json<serde_json::Value>| async move {
                if body["password"] == "right" {
                    StatusCode::OK
                } else {
                    StatusCode::UNAUTHORIZED
                }
            }),
        )
        .route("/", get(|| async { "ok" }))
        .layer(layer)
        .layer(BufferBodyLayer::new(1024).route(Method::POST, "/login"))
}

async fn login(app: &Router, body: &str) -> Response {
    send_body(
        app,
        Method::POST,
        "/login",
        &[("content-type", "application/json")],
        body.as_bytes().to_vec(),
    )
    .await
}

#[tokio::test]
async fn logins_are_keyed_by_the_account_in_the_json_body() {
    let limiter = limiter(vec![rule("login-account", 3), rule("login-ip", 20)]);
    let app = login_app(limiter.clone());
    for n in 0..3 {
        let r = login(&app, r#"{"account":"alice","password":"guess"}"#).await;
        assert_eq!(
            r.status(),
            StatusCode::UNAUTHORIZED,
            "{n}: the handler read the body"
        );
    }
    let r = login(&app, r#"{"account":"alice","password":"right"}"#).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "alice is locked");
    let r = login(&app, r#"{"account":"bob","password":"guess"}"#).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "bob is not alice");
    let r = login(&app, r#"{"account":"carol","password":"right"}"#).await;
    assert_eq!(r.status(), StatusCode::OK);
    let state = h(&r, "ratelimit").unwrap();
    assert!(
        state.starts_with("\"login-account\";r=3;"),
        "refunded on success: {state}"
    );
    // No account, a non-string account, malformed JSON: 400, never a 5xx, nothing counted.
    let ip_before = left(
        &limiter,
        "login-ip",
        &Key::from(std::net::IpAddr::from([198, 51, 100, 7])),
    )
    .await;
    for body in [
        r#"{"password":"x"}"#,
        r#"{"account":{"a":1}}"#,
        r#"{"account":"#,
        "",
    ] {
        let r = login(&app, body).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{body:?}");
        assert_eq!(body_json(r).await["error"], "missing_rate_limit_key");
    }
    // A body over the limit is refused before any decision.
    let big = format!(r#"{{"account":"dave","pad":"{}"}}"#, "x".repeat(2000));
    let r = login(&app, &big).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body_json(r).await["error"], "body_too_large");
    let ip = Key::from(std::net::IpAddr::from([198, 51, 100, 7]));
    assert_eq!(left(&limiter, "login-ip", &ip).await, ip_before);
    // Other routes are not read and not limited.
    assert_eq!(
        send(&app, Method::GET, "/", &[]).await.status(),
        StatusCode::OK
    );
}

/// `/login` served by `route`, one request per minute for each form's `user` (a missing one
/// is a 400), bodies buffered up to `max_bytes`.
fn form_keyed(route: axum::routing::MethodRouter, max_bytes: usize) -> Router {
    Router::new()
        .route("/login", route)
        .layer(
            RateLimitLayer::builder(limiter(vec![rule("login", 1)]))
                .scope(
                    "login",
                    Scope::new()
                        .key(key::form_field("user"))
                        .on_missing_key(MissingKey::Reject),
                )
                .build()
                .unwrap(),
        )
        .layer(BufferBodyLayer::new(max_bytes))
}

#[tokio::test]
async fn form_bodies_too_and_chunked_bodies_over_the_limit() {
    let app = form_keyed(post(|body: String| async move { body }), 64);
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let r = send_body(
        &app,
        Method::POST,
        "/login",
        &form,
        b"user=al%20ice&pw=1".to_vec(),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &bytes[..],
        b"user=al%20ice&pw=1",
        "the handler gets the same bytes"
    );
    let r = send_body(&app, Method::POST, "/login", &form, b"user=al+ice".to_vec()).await;
    assert_eq!(
        r.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the same user, decoded"
    );
    // A streamed body (no length) that grows past the limit.
    let mut req = Request::post("/login")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::new(support::Chunks(vec![vec![b'a'; 20]; 10])))
        .unwrap();
    req.extensions_mut()
        .insert(SocketAddr::from(([198, 51, 100, 7], 5555)));
    let r = app.clone().oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

fn metered_uploads(limiter: Limiter) -> Router {
    let layer = RateLimitLayer::builder(limiter)
        .key(key::header("x-api-key"))
        .scope(
            "upload-kib",
            Scope::new()
                .route(Method::PUT, "/files/{name}")
                .cost_body(KIB),
        )
        .cost_exceeds_limit_status(StatusCode::PAYLOAD_TOO_LARGE)
        .build()
        .unwrap();
    Router::new()
        .route(
            "/files/{name}",
            axum::routing::put(|body: bytes::Bytes| async move { body.len().to_string() }),
        )
        .layer(MeterBodyLayer)
        .layer(layer)
}

async fn put_chunks(app: &Router, chunks: usize) -> Response {
    let req = Request::put("/files/a")
        .header("x-api-key", "tenant-1")
        .body(Body::new(support::Chunks(vec![
            vec![b'x'; KIB as usize];
            chunks
        ])))
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}

/// Two rate-limit layers, each charging the body by size (a per-client byte quota outside, a
/// route's inside): the outer layer's meter is charged as the body is read too, not replaced
/// by the inner one's, so a chunked upload cannot pass the outer quota.
#[tokio::test]
async fn stacked_layers_each_charge_a_streamed_body() {
    let outer = limiter(vec![rule("client-kib", 3)]);
    let inner = limiter(vec![rule("route-kib", 1_000)]);
    let layer = |limiter: &Limiter, name: &str| {
        RateLimitLayer::builder(limiter.clone())
            .key(key::header("x-api-key"))
            .scope(name, Scope::new().cost_body(KIB))
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route(
            "/files/{name}",
            axum::routing::put(|body: bytes::Bytes| async move { body.len().to_string() }),
        )
        .layer(MeterBodyLayer)
        .layer(layer(&inner, "route-kib"))
        .layer(layer(&outer, "client-kib"));
    let r = put_chunks(&app, 8).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "8 KiB past 3");
    let tenant = Key::new("tenant-1");
    assert_eq!(left(&outer, "client-kib", &tenant).await, 0);
    // The inner layer charged its own: 1 KiB up front, then each KiB read until the outer
    // meter refused the fourth (it is asked first). At 1,000 the inner meter would have
    // charged nothing past the door.
    assert_eq!(left(&inner, "route-kib", &tenant).await, 1_000 - 3);
}

/// A per-client byte quota on every route (the README's stacked layer): a request with no body
/// at all costs nothing, over the wire as hyper frames it (a GET over HTTP/1.1 has neither
/// `Content-Length` nor `Transfer-Encoding`); each one once cost a unit, and the fourth GET
/// under 3 KiB a minute was refused. A chunked body still costs a unit up front.
#[tokio::test]
async fn a_request_without_a_body_costs_a_byte_quota_nothing() {
    let limiter = limiter(vec![rule("client-kib", 3)]);
    let layer = RateLimitLayer::builder(limiter.clone())
        .key(key::header("x-api-key"))
        .scope("client-kib", Scope::new().cost_body(KIB))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(|| async { "ok" }).post(|body: bytes::Bytes| async move { body.len().to_string() }),
        )
        .layer(MeterBodyLayer)
        .layer(layer);
    let (addr, server) = support::serve(app).await;
    let send = |request: &'static str| support::exchange(addr, request);
    let tenant = Key::new("tenant-1");
    for n in 0..5 {
        let r =
            send("GET / HTTP/1.1\r\nHost: x\r\nx-api-key: tenant-1\r\nConnection: close\r\n\r\n")
                .await;
        assert!(r.starts_with("HTTP/1.1 200"), "GET {n}: {r}");
    }
    assert_eq!(
        left(&limiter, "client-kib", &tenant).await,
        3,
        "no GET charged"
    );
    let r = send("POST / HTTP/1.1\r\nHost: x\r\nx-api-key: tenant-1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert_eq!(
        left(&limiter, "client-kib", &tenant).await,
        2,
        "a chunked body: a unit"
    );
    server.abort();
}

/// A layer charging rule "upload-kib" by the KiB of the body, keyed by `x-api-key`, that gives
/// back what server errors took.
fn kib_refunding_server_errors(limiter: &Limiter) -> RateLimitLayer {
    RateLimitLayer::builder(limiter.clone())
        .key(key::header("x-api-key"))
        .scope(
            "upload-kib",
            Scope::new()
                .cost_body(KIB)
                .refund_if(|status| status.is_server_error()),
        )
        .build()
        .unwrap()
}

/// A service that passes a body error on as its own (`?` on the body, as a hyper or tower
/// `service_fn` does): a body refused more bytes is still answered with the refusal, and what
/// was read stays charged, even under a rule that gives back what server errors took. The
/// client once got the error (a closed connection) and every KiB read was given back.
#[tokio::test]
async fn a_body_refusal_passed_on_as_the_services_error_is_still_a_refusal() {
    let limiter = limiter(vec![rule("upload-kib", 3)]);
    let service = tower::ServiceBuilder::new()
        .layer(kib_refunding_server_errors(&limiter))
        .layer(MeterBodyLayer)
        .service_fn(
            |req: Request<fleetlimit::layer::MeteredBody<Body>>| async move {
                let body = req.into_body().collect().await?.to_bytes();
                Ok::<_, axum::BoxError>(Response::new(Body::from(body.len().to_string())))
            },
        );
    let req = Request::put("/files/a")
        .header("x-api-key", "tenant-1")
        .body(Body::new(support::Chunks(vec![
            vec![b'x'; KIB as usize];
            8
        ])))
        .unwrap();
    let r = service
        .oneshot(req)
        .await
        .expect("a refusal, not the service's error");
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().get("retry-after").is_some());
    assert_eq!(left(&limiter, "upload-kib", &Key::new("tenant-1")).await, 0);
}

/// A body sent in many small chunks keeps a bounded number of receipts: a server error gives
/// back the first 1,024 charged as read (and the unit charged up front), never more, however
/// many frames came (each kept one, and a refund sent them all).
#[tokio::test]
async fn a_body_of_many_small_chunks_keeps_a_bounded_number_of_receipts() {
    let limiter = limiter(vec![rule("upload-kib", 1_000_000)]);
    let app = Router::new()
        .route(
            "/files/{name}",
            axum::routing::put(|body: bytes::Bytes| async move {
                (StatusCode::INTERNAL_SERVER_ERROR, body.len().to_string())
            }),
        )
        .layer(MeterBodyLayer)
        .layer(kib_refunding_server_errors(&limiter));
    // 1,500 KiB (under axum's 2 MiB default for a body read whole).
    let r = put_chunks(&app, 1_500).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // 1,500 KiB charged: 1 up front, 1,499 as read; 1 + 1,024 given back.
    assert_eq!(
        left(&limiter, "upload-kib", &Key::new("tenant-1")).await,
        1_000_000 - 1_500 + 1 + 1_024
    );
}

/// [`support::Chunks`], with `before(i)` run before the `i`-th frame is handed out
/// (`i` = the number of chunks for the end of the body).
struct Staged<F> {
    chunks: support::Chunks,
    next: usize,
    before: F,
}

impl<F: FnMut(usize) + Unpin> http_body::Body for Staged<F> {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        let i = self.next;
        (self.before)(i);
        self.next += 1;
        std::pin::Pin::new(&mut self.chunks).poll_frame(cx)
    }
}

/// Redis stops answering while a metered upload is read, with a policy failing open: the rest of the body is the policy's, whose decision then stands for
/// the rule. The service fails, and the rule gives back what server errors took: what the
/// store did take (the first KiB up front and the second as read) comes back. The policy's
/// decision once made the request read as never counted, and nothing came back.
#[tokio::test]
async fn permits_taken_before_an_outage_mid_body_are_given_back() {
    let server = std::sync::Arc::new(support::redis::RedisServer::start());
    let store = RedisStore::builder().connect(&server.url()).await.unwrap();
    // The log: a refund removes exactly what it took, whatever the time since.
    let hourly = Quota::per_hour(10)
        .algorithm(Algorithm::SlidingLog)
        .build()
        .unwrap();
    let rule = Rule::new("upload-kib", hourly).unwrap();
    // A deadline a loaded machine cannot miss while Redis answers: what is under test is which
    // permits come back, not the deadline.
    let limiter = |store: &RedisStore| {
        Limiter::builder(store.clone())
            .rule(rule.clone())
            .on_store_error(OnStoreError::FailOpen)
            .deadline(Duration::from_millis(500))
            .build()
            .unwrap()
    };
    let layer = kib_refunding_server_errors(&limiter(&store));
    let app = Router::new()
        .route(
            "/files/{name}",
            axum::routing::put(|_: bytes::Bytes| async { StatusCode::INTERNAL_SERVER_ERROR }),
        )
        .layer(MeterBodyLayer)
        .layer(layer);
    let redis = server.clone();
    let body = Staged {
        chunks: support::Chunks(vec![vec![b'x'; KIB as usize]; 3]),
        next: 0,
        before: move |i| match i {
            2 => redis.pause(),
            3 => redis.resume(),
            _ => {}
        },
    };
    let req = Request::put("/files/a")
        .header("x-api-key", "tenant-1")
        .body(Body::new(body))
        .unwrap();
    let r = app.oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // The third KiB's charge, answered by the policy after the deadline, still reached Redis
    // when it resumed and took its permit there: the one permit that stays taken.
    let left = limiter(&store)
        .apply_to(Op::Peek, &[("upload-kib", &Key::new("tenant-1"))], 1)
        .await
        .unwrap()[0]
        .remaining;
    assert_eq!(left, 9);
}

#[tokio::test]
async fn streamed_bodies_are_charged_by_the_bytes_read() {
    let limiter = limiter(vec![rule("upload-kib", 10)]);
    let app = metered_uploads(limiter.clone());
    let tenant = Key::new("tenant-1");
    // 4 KiB without a declared length: 1 KiB up front, 3 as the handler reads them.
    let r = put_chunks(&app, 4).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("6"));
    assert_eq!(left(&limiter, "upload-kib", &tenant).await, 6);
    // 8 KiB more: the 7th KiB is refused while the handler reads it; the client gets the
    // denial, not the handler's answer, and the budget is spent to exactly 0.
    let r = put_chunks(&app, 8).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(h(&r, "retry-after").is_some());
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(left(&limiter, "upload-kib", &tenant).await, 0);
    // A declared length is charged up front; one the quota can never hold is a 413 that
    // takes nothing, and an empty body costs nothing.
    let other = self::limiter(vec![rule("upload-kib", 10)]);
    let app = metered_uploads(other.clone());
    let declared = |bytes: usize| {
        Request::put("/files/b")
            .header("x-api-key", "tenant-1")
            .header("content-length", bytes.to_string())
            .body(Body::from(vec![b'y'; bytes]))
            .unwrap()
    };
    let r = app.clone().oneshot(declared(11 * 1024)).await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(left(&other, "upload-kib", &tenant).await, 10);
    let r = app.clone().oneshot(declared(0)).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(left(&other, "upload-kib", &tenant).await, 10);
    let r = app.clone().oneshot(declared(2500)).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        h(&r, "ratelimit-remaining").as_deref(),
        Some("7"),
        "3 KiB started"
    );
    // A unit of 0 bytes is a configuration error.
    let err = RateLimitLayer::builder(other)
        .scope("upload-kib", Scope::new().cost_body(0))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("cost_body"), "{err}");
}

/// A layer with rule `name`, once a minute for `scope`, keyed by the `x-account` header.
fn once_a_minute(name: &str, scope: Scope) -> RateLimitLayer {
    RateLimitLayer::builder(limiter(vec![rule(name, 1)]))
        .key(key::header("x-account"))
        .scope(name, scope)
        .build()
        .unwrap()
}

/// A scope's literal text matches a path however the client escapes it, as the service reads
/// it: axum routes on the path as sent and decodes the parameters it hands the handler, and
/// `ServeDir` decodes its file's path, so `/users/%6De` is served as `/users/me` and
/// `/files/%70rivate/x` as `/files/private/x`. An escaped `/` is no separator to the router
/// (`m%2Fe` is another user), but a catch-all reads it as one.
#[tokio::test]
async fn percent_escapes_never_dodge_a_scopes_literal_text() {
    let me = once_a_minute("me", Scope::new().route(Method::POST, "/users/me"));
    let app = Router::new()
        .route("/users/{id}", axum::routing::post(|| async { "post" }))
        .layer(me);
    admits_once(&app, Method::POST, "/users/%6De", "/users/%6d%65").await;
    assert_eq!(
        as_account(&app, Method::POST, "/users/m%2Fe").await,
        StatusCode::OK,
        "`m/e` is another user"
    );
    let private = once_a_minute(
        "private",
        Scope::new().route(Method::GET, "/files/private/*"),
    );
    let app = Router::new()
        .route("/files/{*path}", get(|| async { "file" }))
        .layer(private);
    admits_once(
        &app,
        Method::GET,
        "/files/%70rivate/a",
        "/files/priv%61te/b",
    )
    .await;
    // A catch-all (and `ServeDir`) reads an escaped `/` as one, and skips `.` and empty
    // segments: each of these is `/files/private/x` to the handler.
    for odd in [
        "/files/private%2Fx",
        "/files//private/x",
        "/files/./private/x",
    ] {
        assert_eq!(
            as_account(&app, Method::GET, odd).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{odd}"
        );
    }
    assert_eq!(
        as_account(&app, Method::GET, "/files/public/a").await,
        StatusCode::OK
    );
    let item = once_a_minute("item", Scope::new().route(Method::GET, "/items/x-{id}"));
    let app = Router::new()
        .route("/items/{id}", get(|| async { "item" }))
        .layer(item);
    admits_once(&app, Method::GET, "/items/x-1", "/items/%78-2").await;
    // A name holding an escaped `/` under a `{name}` route is one segment, as axum reads it:
    // the metadata of file `reports/download` is not a download.
    let downloads = once_a_minute(
        "downloads",
        Scope::new().route(Method::GET, "/files/{name}/download"),
    );
    let app = Router::new()
        .route("/files/{name}", get(|| async { "metadata" }))
        .route("/files/{name}/download", get(|| async { "file" }))
        .layer(downloads);
    for _ in 0..3 {
        assert_eq!(
            as_account(&app, Method::GET, "/files/reports%2Fdownload").await,
            StatusCode::OK
        );
    }
    admits_once(&app, Method::GET, "/files/a/download", "/files/b/download").await;
    // A nest's parameter escaped: `/t/%61cme/export` is tenant `acme`'s export.
    let export = once_a_minute("export", Scope::new().route(Method::POST, "/t/acme/export"));
    let app = Router::new().nest(
        "/t/{tenant}",
        Router::new()
            .route("/export", axum::routing::post(|| async { "export" }))
            .layer(export),
    );
    admits_once(&app, Method::POST, "/t/acme/export", "/t/%61cme/export").await;
    assert_eq!(
        as_account(&app, Method::POST, "/t/other/export").await,
        StatusCode::OK
    );
}

/// `first` is admitted and `second` (the same route) refused: one rule counted both.
async fn admits_once(app: &Router, method: Method, first: &str, second: &str) {
    assert_eq!(
        as_account(app, method.clone(), first).await,
        StatusCode::OK,
        "{first}"
    );
    assert_eq!(
        as_account(app, method, second).await,
        StatusCode::TOO_MANY_REQUESTS,
        "{second}"
    );
}

/// `method path` as account "a" (the `x-account` header), its status.
async fn as_account(app: &Router, method: Method, path: &str) -> StatusCode {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("x-account", "a")
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(req).await.unwrap().status()
}

/// A router with a root (`/`) and an item (`/{id}`) route, nested at `prefix`, limited once a
/// minute by rule `name` on the pattern `/{id}` written relative to the nested router.
fn root_and_item_nested_at(prefix: &str, name: &str) -> Router {
    let layer = once_a_minute(name, Scope::new().route(Method::GET, "/{id}"));
    Router::new().nest(
        prefix,
        Router::new()
            .route("/", get(|| async { "root" }))
            .route("/{id}", get(|| async { "item" }))
            .layer(layer),
    )
}

/// The nest's root (`path`), which `/{id}` would fit alone, is never counted as an item.
async fn root_is_no_item(app: &Router, path: &str) {
    for _ in 0..3 {
        assert_eq!(
            as_account(app, Method::GET, path).await,
            StatusCode::OK,
            "the nest's root is no item"
        );
    }
}

/// Inside a nested router (which strips its prefix from the URI), a full route matches however
/// its parameter is named (a rules file's `/v1/users/{user}` for axum's `{id}`) and a literal
/// path served by a parameter route (`/v1/users/me`): both were skipped, the routes unlimited.
#[tokio::test]
async fn full_routes_match_inside_a_nested_router_whatever_their_parameters_are_called() {
    let limiter = limiter(vec![rule("users", 1), rule("me", 1)]);
    let layer = RateLimitLayer::builder(limiter)
        .key(key::header("x-account"))
        .scope("users", Scope::new().route(Method::PUT, "/v1/users/{user}"))
        .scope("me", Scope::new().route(Method::POST, "/v1/users/me"))
        .build()
        .unwrap();
    let app = Router::new().nest(
        "/v1",
        Router::new()
            .route(
                "/users/{id}",
                axum::routing::put(|| async { "put" }).post(|| async { "post" }),
            )
            .layer(layer),
    );
    admits_once(&app, Method::PUT, "/v1/users/7", "/v1/users/8").await;
    admits_once(&app, Method::POST, "/v1/users/me", "/v1/users/me").await;
    // Nor is it dodged with percent-escapes: axum routes `/users/%6De` as sent, and hands the
    // handler `me`.
    assert_eq!(
        as_account(&app, Method::POST, "/v1/users/%6De").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another user's POST is not the literal route.
    assert_eq!(
        as_account(&app, Method::POST, "/v1/users/you").await,
        StatusCode::OK
    );

    // A pattern written relative to the nested router never matches another route's full
    // path: `/{id}` under `/users` is not `GET /users` (the list), though `/users` alone
    // would fit `/{id}`.
    let app = root_and_item_nested_at("/users", "item");
    root_is_no_item(&app, "/users").await;
    admits_once(&app, Method::GET, "/users/5", "/users/6").await;

    // A nest whose prefix has a parameter: the full route matches by the prefix as the router
    // wrote it, the route's own parameters named as the scope likes; a pattern starting with a
    // parameter of its own is the nested router's (`/{id}` is not the nest's root, `GET /acme`).
    let layer = once_a_minute(
        "tenant-users",
        Scope::new().route(Method::PUT, "/t/{tenant}/users/{user}"),
    );
    let app = Router::new().nest(
        "/t/{tenant}",
        Router::new()
            .route("/users/{id}", axum::routing::put(|| async { "put" }))
            .layer(layer),
    );
    admits_once(&app, Method::PUT, "/t/acme/users/7", "/t/acme/users/8").await;

    let app = root_and_item_nested_at("/{tenant}", "tenant-item");
    root_is_no_item(&app, "/acme").await;
    admits_once(&app, Method::GET, "/acme/7", "/acme/8").await;
}

#[tokio::test]
async fn a_scope_overrides_the_layers_missing_key_answer_and_matches_axum_routes() {
    let limiter = limiter(vec![rule("accounts", 2), rule("users", 1), rule("v1", 1)]);
    let layer = RateLimitLayer::builder(limiter)
        // The layer's key is the account; requests without one have no key at all (no peer
        // fallback: the extractor below gives nothing without the header, and these requests
        // come with no address).
        .key(key::header("x-account"))
        .scope("accounts", Scope::new().on_missing_key(MissingKey::Skip))
        .scope(
            "users",
            Scope::new()
                .route(Method::PUT, "/v1/users/{id}")
                .method(Method::PATCH)
                .key(key::header("x-account")),
        )
        .scope(
            "v1",
            Scope::new()
                .path("/v1/*")
                .key(key::header("x-account"))
                .on_missing_key(MissingKey::Skip),
        )
        .build()
        .unwrap();
    let app = Router::new().nest(
        "/v1",
        Router::new()
            .route(
                "/users/{id}",
                axum::routing::put(|| async { "put" }).patch(|| async { "patch" }),
            )
            .route("/health", get(|| async { "ok" }))
            .layer(layer),
    );
    let call = |method: Method, path: &'static str, account: Option<&'static str>| {
        let app = app.clone();
        async move {
            let mut b = Request::builder().method(method).uri(path);
            if let Some(a) = account {
                b = b.header("x-account", a);
            }
            app.oneshot(b.body(Body::empty()).unwrap())
                .await
                .unwrap()
                .status()
        }
    };
    // No account and no address: the layer alone would answer 500; the scope says skip.
    for _ in 0..5 {
        assert_eq!(call(Method::GET, "/v1/health", None).await, StatusCode::OK);
    }
    // Inside a nested router, `/v1/users/{id}` is the route axum matched: PUT and PATCH count.
    assert_eq!(
        call(Method::PUT, "/v1/users/7", Some("a")).await,
        StatusCode::OK
    );
    assert_eq!(
        call(Method::PATCH, "/v1/users/8", Some("a")).await,
        StatusCode::TOO_MANY_REQUESTS,
        "one user change per minute, PUT or PATCH"
    );
    assert_eq!(
        call(Method::PATCH, "/v1/users/8", Some("b")).await,
        StatusCode::OK
    );
    // A prefix scope matches the route axum matched too: `/v1/*` limits account "c" inside
    // the router nested at `/v1` (its URI there is `/health`).
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(call(Method::GET, "/v1/health", Some("c")).await);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == StatusCode::OK).count(),
        1,
        "one per minute under /v1: {statuses:?}"
    );
}

async fn redis_limiter(url: &str, clock: ManualClock) -> Limiter {
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(2))
        .connect(url)
        .await
        .unwrap();
    // A bucket refills 20 s after its last permit whenever the test runs (a fixed window could
    // be about to end).
    let bucket = Quota::per_minute(3)
        .algorithm(Algorithm::TokenBucket)
        .build()
        .unwrap();
    Limiter::builder(store)
        .rule(Rule::new("api", bucket).unwrap())
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .clock(clock)
        .build()
        .unwrap()
}

/// The issue's second run-time fault: exhaust a client on instance A, delete the shared state
/// (what an operator's reset or a Redis restarted empty does): A kept refusing from its denial
/// cache for the rest of the window while B admitted. Now A follows within the documented bound
/// (`DEFAULT_DENY_CACHE_MAX_AGE`), at the defaults.
#[tokio::test]
async fn instances_forget_remembered_denials_within_the_bound() {
    let server = support::redis::RedisServer::start();
    let clock_a = ManualClock::default();
    let a = redis_limiter(&server.url(), clock_a.clone()).await;
    let b = redis_limiter(&server.url(), ManualClock::default()).await;
    let client = Key::new("client");
    for _ in 0..3 {
        assert!(a.consume(&client, 1).await.unwrap().allowed);
    }
    let refused = a.consume(&client, 1).await.unwrap();
    assert!(!refused.allowed);
    assert!(refused.retry_after.unwrap() > Duration::from_secs(1));
    assert_eq!(a.consume(&client, 1).await.unwrap().source, Source::Cache);
    server.cmd(&["FLUSHALL"]).unwrap();
    assert!(b.consume(&client, 1).await.unwrap().allowed, "B asks Redis");
    // Within the bound A may still answer from memory...
    clock_a.advance(fleetlimit::DEFAULT_DENY_CACHE_MAX_AGE - Duration::from_millis(1));
    let d = a.consume(&client, 1).await.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.source, Source::Cache);
    assert_eq!(
        d.retry_after,
        Some(refused.retry_after.unwrap() - Duration::from_millis(999)),
        "the client is told the store's wait, counted down, not the cache's"
    );
    // ...and no longer.
    clock_a.advance(Duration::from_millis(1));
    let d = a.consume(&client, 1).await.unwrap();
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.source, Source::Store);
}

#[cfg(feature = "serde")]
#[tokio::test]
async fn stats_serialise_as_json() {
    let l = limiter(vec![rule("api", 1)]);
    l.consume(&Key::new("k"), 1).await.unwrap();
    let v = serde_json::to_value(l.stats()).unwrap();
    assert_eq!(v["store_errors"], 0);
    assert_eq!(v["open_breakers"], 0);
    assert!(v.get("leased_keys").is_some());
}

/// A body the handler's typed parse accepts is read for its key too, whatever the fields the
/// handler ignores hold: a number out of range, deep nesting, bad UTF-8 in a string, or a
/// `+json` content type in capitals. Any of these once hid the key, and the rule (with the
/// default missing-key answer, skip) let every guess through.
#[tokio::test]
async fn a_body_the_handler_accepts_always_has_its_key() {
    #[derive(serde::Deserialize)]
    struct Login {
        account: String,
        password: String,
    }
    let limiter = limiter(vec![rule("login-account", 1)]);
    let app = Router::new()
        .route(
            "/login",
            post(|body: axum::Json<Login>| async move {
                let Login { account, password } = body.0;
                if password == "right" && !account.is_empty() {
                    StatusCode::OK
                } else {
                    StatusCode::UNAUTHORIZED
                }
            }),
        )
        .layer(
            RateLimitLayer::builder(limiter)
                .scope(
                    "login-account",
                    Scope::new().key(key::json_field("account")),
                )
                .build()
                .unwrap(),
        )
        .layer(BufferBodyLayer::new(4096));
    let deep = format!(r#","pad":{}{}"#, "[".repeat(200), "]".repeat(200));
    let cases: [(&str, &[u8]); 4] = [
        ("application/json", br#","pad":1e400"#),
        ("application/json", deep.as_bytes()),
        ("application/json", b",\"pad\":\"\xff\""),
        ("application/vnd.api+JSON", b""),
    ];
    for (n, (content_type, rest)) in cases.into_iter().enumerate() {
        let mut body = format!(r#"{{"account":"victim-{n}","password":"guess""#).into_bytes();
        body.extend_from_slice(rest);
        body.push(b'}');
        let headers = [("content-type", content_type)];
        let first = send_body(&app, Method::POST, "/login", &headers, body.clone()).await;
        assert_eq!(
            first.status(),
            StatusCode::UNAUTHORIZED,
            "{n}: the handler reads this body"
        );
        let second = send_body(&app, Method::POST, "/login", &headers, body).await;
        assert_eq!(
            second.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{n}: the second guess for one account is refused"
        );
    }
    // Sent as `application/grpc+json`, which axum's `Json` reads as well. A gRPC call's body is
    // a stream and never buffered, so such calls share one bucket (refused as gRPC) rather
    // than skipping the rule.
    let headers = [("content-type", "application/grpc+json")];
    for (n, account) in ["grpc-1", "grpc-2"].into_iter().enumerate() {
        let body = format!(r#"{{"account":"{account}","password":"guess"}}"#).into_bytes();
        let r = send_body(&app, Method::POST, "/login", &headers, body).await;
        match n {
            0 => assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "the handler reads it"),
            _ => assert_eq!(h(&r, "grpc-status").as_deref(), Some("8"), "one bucket"),
        }
    }
    // A rule told to reject requests without the key rejects them (INVALID_ARGUMENT).
    let strict_limiter = self::limiter(vec![rule("login-account", 100)]);
    let strict = Router::new()
        .route("/login", post(|| async { StatusCode::UNAUTHORIZED }))
        .layer(
            RateLimitLayer::builder(strict_limiter)
                .scope(
                    "login-account",
                    Scope::new()
                        .key(key::json_field("account"))
                        .on_missing_key(MissingKey::Reject),
                )
                .build()
                .unwrap(),
        )
        .layer(BufferBodyLayer::new(4096));
    let body = br#"{"account":"grpc-3","password":"guess"}"#.to_vec();
    let r = send_body(&strict, Method::POST, "/login", &headers, body).await;
    assert_eq!(
        h(&r, "grpc-status").as_deref(),
        Some("3"),
        "rejected, not shared"
    );
}

/// axum's `Form` reads a GET's query string, not its body: the key is the query's field, so a
/// body naming a fresh user each time cannot hand the client a fresh bucket, and a GET with
/// no form body at all is keyed too.
#[tokio::test]
async fn a_form_on_get_is_keyed_by_its_query_as_the_handler_reads_it() {
    let app = form_keyed(
        get(
            |form: axum::Form<std::collections::HashMap<String, String>>| async move {
                form.0.get("user").cloned().unwrap_or_default()
            },
        ),
        4096,
    );
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let first = send_body(
        &app,
        Method::GET,
        "/login?user=victim",
        &form,
        b"user=r1".to_vec(),
    )
    .await;
    assert_eq!(first.status(), StatusCode::OK);
    let served = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&served[..], b"victim", "the handler reads the query");
    let second = send_body(
        &app,
        Method::GET,
        "/login?user=victim",
        &form,
        b"user=r2".to_vec(),
    )
    .await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let plain = send(&app, Method::GET, "/login?user=victim", &[]).await;
    assert_eq!(
        plain.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "no body, still keyed"
    );
    let other = send(&app, Method::GET, "/login?user=other", &[]).await;
    assert_eq!(other.status(), StatusCode::OK);
    // A HEAD's form is its body, as `Form` reads it (axum calls the GET handler with it): a
    // fresh name in the query hands out no fresh bucket.
    let head = send_body(
        &app,
        Method::HEAD,
        "/login?user=fresh",
        &form,
        b"user=victim".to_vec(),
    )
    .await;
    assert_eq!(head.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// axum's `Form` reads any content type that starts with `application/x-www-form-urlencoded`
/// (`…urlencoded charset=utf-8`, without the `;`): `BufferBodyLayer` reads those bodies too, so
/// the second guess for one user is refused at the default missing-key answer, not skipped.
#[tokio::test]
async fn forms_are_read_as_a_form_handler_reads_them() {
    let limiter = limiter(vec![rule("login", 1)]);
    let app = Router::new()
        .route(
            "/login",
            post(
                |form: axum::Form<std::collections::HashMap<String, String>>| async move {
                    assert!(form.0.contains_key("user"));
                    StatusCode::UNAUTHORIZED
                },
            ),
        )
        .layer(
            RateLimitLayer::builder(limiter)
                .scope("login", Scope::new().key(key::form_field("user")))
                .build()
                .unwrap(),
        )
        .layer(BufferBodyLayer::new(4096));
    for (n, content_type) in [
        "application/x-www-form-urlencoded charset=utf-8",
        "APPLICATION/X-WWW-FORM-URLENCODED",
    ]
    .into_iter()
    .enumerate()
    {
        let headers = [("content-type", content_type)];
        let body = format!("user=victim-{n}&pw=guess").into_bytes();
        let first = send_body(&app, Method::POST, "/login", &headers, body.clone()).await;
        let second = send_body(&app, Method::POST, "/login", &headers, body).await;
        // axum matches the type with its case: the capitals are refused by the handler
        // (415), and still counted here.
        if n == 0 {
            assert_eq!(
                first.status(),
                StatusCode::UNAUTHORIZED,
                "the handler reads it"
            );
        }
        assert_eq!(
            second.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{content_type}"
        );
    }
}

/// A gRPC call is a stream, `application/grpc+json` too: `BufferBodyLayer` leaves it alone,
/// so the handler is called at once (buffered, it would wait for the client's last message,
/// which an interactive client sends only after an answer) and a large message is no JSON 413.
#[tokio::test]
async fn buffering_leaves_grpc_streams_alone() {
    let app = Router::new()
        .route("/p.S/Chat", post(|| async { "answered" }))
        .layer(BufferBodyLayer::new(16));
    let req = Request::post("/p.S/Chat")
        .header("content-type", "application/grpc+json")
        .body(Body::new(support::OpenStream(support::Chunks(vec![
            vec![b'{'; 32],
        ]))))
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(2), app.oneshot(req))
        .await
        .expect("the handler waited for the end of the stream")
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

/// A body that trickles (here: one byte, then nothing) is answered 408 after the default 10 s,
/// not held for ever out of reach of every rule inside; a per-address rule outside the buffer
/// counts it (refunded, a trickling client would reconnect for free).
#[tokio::test(start_paused = true)]
async fn a_body_that_never_ends_is_answered_408_after_10_s() {
    let limiter = limiter(vec![rule("login", 1)]);
    let per_address = self::limiter(vec![rule("address", 1)]);
    let app = Router::new()
        .route("/login", post(|body: String| async move { body }))
        .layer(
            RateLimitLayer::builder(limiter.clone())
                .scope("login", Scope::new().key(key::json_field("/user")))
                .build()
                .unwrap(),
        )
        .layer(BufferBodyLayer::new(1024))
        .layer(RateLimitLayer::new(per_address));
    let trickle = || {
        let mut req = Request::post("/login")
            .header("content-type", "application/json")
            .body(Body::new(support::OpenStream(support::Chunks(vec![
                b"{".to_vec()
            ]))))
            .unwrap();
        req.extensions_mut()
            .insert(SocketAddr::from(([198, 51, 100, 7], 5555)));
        req
    };
    let started = tokio::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(60), app.clone().oneshot(trickle()))
        .await
        .expect("still waiting for the body after a minute")
        .unwrap();
    assert_eq!(r.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    assert_eq!(body_json(r).await["error"], "body_timeout");
    let again = app.oneshot(trickle()).await.unwrap();
    assert_eq!(
        again.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the 408 was counted"
    );
}
