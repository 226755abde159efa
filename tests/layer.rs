//! The layer inside real axum routers: headers on every response, the 429, the key fallback.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use fleetlimit::{
    key, key::PeerIp, Algorithm, Key, Limiter, ManualClock, MemoryStore, Quota, RateLimitLayer,
    Rule,
};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn limiter(clock: &ManualClock, quota: Quota) -> Limiter {
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    Limiter::builder(store)
        .rule(Rule::new("test", quota).unwrap())
        .build()
        .unwrap()
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/fail",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        )
        .layer(layer)
}

fn api_key_layer(limiter: Limiter) -> RateLimitLayer {
    RateLimitLayer::builder(limiter)
        .key(key::header("x-api-key"))
        .build()
        .unwrap()
}

async fn get_with(app: &Router, path: &str, api_key: Option<&str>) -> axum::response::Response {
    let mut req = Request::get(path);
    if let Some(k) = api_key {
        req = req.header("x-api-key", k);
    }
    app.clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

fn header(r: &axum::response::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

async fn body_json(r: axum::response::Response) -> serde_json::Value {
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn retry_after_rounds_up_to_whole_seconds() {
    let clock = ManualClock::default();
    // One permit per 2.5 s: the first denial waits 2.5 s, announced as 3.
    let quota = Quota::new(2, Duration::from_secs(5))
        .algorithm(Algorithm::Gcra)
        .burst(1)
        .build()
        .unwrap();
    let app = app(api_key_layer(limiter(&clock, quota)));
    assert_eq!(
        get_with(&app, "/", Some("k")).await.status(),
        StatusCode::OK
    );
    let r = get_with(&app, "/", Some("k")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&r, "retry-after").as_deref(), Some("3"));
    assert_eq!(body_json(r).await["retry_after_ms"], 2500);

    // 1 ms before the retry time: still denied; at it: admitted. Never a "Retry-After: 0".
    clock.advance(Duration::from_millis(2499));
    let r = get_with(&app, "/", Some("k")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&r, "retry-after").as_deref(), Some("1"));
    assert_eq!(body_json(r).await["retry_after_ms"], 1);
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        get_with(&app, "/", Some("k")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn falls_back_to_peer_ip_and_the_extractor_wins_when_it_has_a_key() {
    let clock = ManualClock::default();
    let quota = Quota::per_minute(1).build().unwrap();
    let app = app(api_key_layer(limiter(&clock, quota)))
        .layer(MockConnectInfo(SocketAddr::from(([10, 0, 0, 1], 4000))));

    // No API key: keyed by 10.0.0.1.
    assert_eq!(get_with(&app, "/", None).await.status(), StatusCode::OK);
    assert_eq!(
        get_with(&app, "/", None).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Same peer, with an API key: the extractor's key counts, fresh bucket.
    assert_eq!(
        get_with(&app, "/", Some("key-1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        get_with(&app, "/", Some("key-1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // An API key that happens to equal the peer address text is still its own bucket.
    assert_eq!(
        get_with(&app, "/", Some("10.0.0.1")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn cost_beyond_capacity_says_never() {
    let clock = ManualClock::default();
    let quota = Quota::per_minute(5).build().unwrap();
    let l = limiter(&clock, quota);
    let d = l.consume(&Key::new("x"), 6).await.unwrap();
    assert!(d.never_admissible());
    assert!(
        l.consume(&Key::new("x"), 0).await.is_err(),
        "zero cost is an error"
    );
}

#[tokio::test]
async fn clones_of_the_service_share_one_limit() {
    let clock = ManualClock::default();
    let quota = Quota::per_minute(3)
        .algorithm(Algorithm::SlidingLog)
        .build()
        .unwrap();
    let app = app(api_key_layer(limiter(&clock, quota)));
    let mut statuses = Vec::new();
    for _ in 0..5 {
        // Each oneshot runs on a fresh clone of the router and its layers.
        statuses.push(get_with(&app, "/", Some("shared")).await.status());
    }
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(ok, 3, "{statuses:?}");
}

/// A real server on loopback, with axum's connect info: every header style on admitted, inner
/// error and denied responses, end to end.
#[tokio::test]
async fn real_server_over_tcp_in_every_header_style() {
    use fleetlimit::HeaderStyle;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        support::exchange(addr, &req).await.to_ascii_lowercase()
    }

    for (style, marker) in [
        (HeaderStyle::Draft6, "ratelimit-remaining:"),
        (HeaderStyle::Ietf, "ratelimit: \"tcp\";r="),
        (HeaderStyle::Legacy, "x-ratelimit-remaining:"),
    ] {
        let quota = Quota::per_minute(2).build().unwrap();
        let limiter = Limiter::builder(MemoryStore::new())
            .rule(Rule::new("tcp", quota).unwrap())
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder(limiter)
            .headers(style)
            .build()
            .unwrap();
        let app = app(layer);
        let (addr, server) = support::serve(app).await;
        let ok = get(addr, "/").await;
        let failed = get(addr, "/fail").await;
        let denied = get(addr, "/").await;
        server.abort();
        assert!(ok.starts_with("http/1.1 200"), "{ok}");
        assert!(failed.starts_with("http/1.1 500"), "{failed}");
        assert!(denied.starts_with("http/1.1 429"), "{denied}");
        for r in [&ok, &failed, &denied] {
            assert!(r.contains(marker), "{style:?}: {r}");
        }
        assert!(denied.contains("retry-after: "), "{denied}");
    }
}

/// An inner service whose readiness reserves a slot (as `tower::limit::ConcurrencyLimit` holds
/// a permit from `poll_ready` to `call`): a refusal must not leave the slot held by the
/// instance the layer keeps for the next request.
#[tokio::test]
async fn a_refusal_releases_what_the_inner_service_reserved_when_ready() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use tower::Service;

    /// Counts reserved slots; a slot is reserved by `poll_ready` and given back by `call` or
    /// when the instance holding it is dropped. A clone holds nothing.
    struct Reserving {
        held: Arc<AtomicUsize>,
        mine: bool,
    }
    impl Clone for Reserving {
        fn clone(&self) -> Self {
            Reserving {
                held: self.held.clone(),
                mine: false,
            }
        }
    }
    impl Drop for Reserving {
        fn drop(&mut self) {
            if self.mine {
                self.held.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    impl Service<Request<Body>> for Reserving {
        type Response = axum::response::Response;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            if !self.mine {
                self.mine = true;
                self.held.fetch_add(1, Ordering::SeqCst);
            }
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Request<Body>) -> Self::Future {
            if std::mem::take(&mut self.mine) {
                self.held.fetch_sub(1, Ordering::SeqCst);
            }
            std::future::ready(Ok(axum::response::Response::new(Body::empty())))
        }
    }

    let held = Arc::new(AtomicUsize::new(0));
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("api", Quota::per_hour(1).build().unwrap()).unwrap())
        .build()
        .unwrap();
    let mut svc = tower::Layer::layer(
        &RateLimitLayer::new(limiter),
        Reserving {
            held: held.clone(),
            mine: false,
        },
    );
    let request = || {
        let mut req = Request::get("/").body(Body::empty()).unwrap();
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::from((
                [198, 51, 100, 4],
                1,
            ))));
        req
    };
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let response = svc.ready().await.unwrap().call(request()).await.unwrap();
        statuses.push(response.status());
    }
    assert_eq!(statuses, [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    assert_eq!(
        held.load(Ordering::SeqCst),
        0,
        "the refused request's reservation was given back"
    );
}

/// A server that records its own connection-info type (tonic over TLS records
/// `TlsConnectInfo<TcpConnectInfo>`): without `PeerIp::connect_info` every request has no key;
/// with it, requests are keyed by that address.
#[tokio::test]
async fn the_peer_address_from_a_connection_info_type_of_the_servers() {
    #[derive(Clone)]
    struct Accepted {
        remote: SocketAddr,
    }
    let clock = ManualClock::default();
    let quota = Quota::per_minute(1).build().unwrap();
    let send = |app: Router, from: [u8; 4]| async move {
        let mut req = Request::get("/").body(Body::empty()).unwrap();
        req.extensions_mut().insert(Accepted {
            remote: SocketAddr::from((from, 443)),
        });
        app.oneshot(req).await.unwrap().status()
    };
    let unknown = app(RateLimitLayer::new(limiter(&clock, quota.clone())));
    assert_eq!(
        send(unknown, [203, 0, 113, 9]).await,
        StatusCode::INTERNAL_SERVER_ERROR,
        "no key: the type is not one the crate knows"
    );
    let named = app(RateLimitLayer::builder(limiter(&clock, quota))
        .peer_ip(PeerIp::default().connect_info(|a: &Accepted| Some(a.remote)))
        .build()
        .unwrap());
    assert_eq!(send(named.clone(), [203, 0, 113, 9]).await, StatusCode::OK);
    assert_eq!(
        send(named.clone(), [203, 0, 113, 9]).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(named, [203, 0, 113, 10]).await,
        StatusCode::OK,
        "another peer, another bucket"
    );
}

/// Only a POST is a gRPC call: a GET that claims the gRPC content type is refused as HTTP, with
/// a 429, not a gRPC `200 OK` that a cache or a monitor would take for success.
#[tokio::test]
async fn a_get_with_the_grpc_content_type_is_refused_as_http() {
    let clock = ManualClock::default();
    let quota = Quota::per_minute(1).build().unwrap();
    let app = app(api_key_layer(limiter(&clock, quota)));
    let send = |method: &str| {
        let req = Request::builder()
            .method(method)
            .uri("/")
            .header("x-api-key", "k")
            .header("content-type", "application/grpc")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(req)
    };
    assert_eq!(send("GET").await.unwrap().status(), StatusCode::OK);
    let refused = send("GET").await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().get("grpc-status").is_none());
    let grpc = send("POST").await.unwrap();
    assert_eq!(grpc.status(), StatusCode::OK, "a gRPC call's denial");
    assert_eq!(header(&grpc, "grpc-status").as_deref(), Some("8"));
}

/// An inner service that fails with an `Err` (a hyper or tonic service, a timeout inside the
/// layer) failed on its own: `refund_if(|s| s.is_server_error())` gives its permit back, and
/// the error goes out as it came.
#[tokio::test]
async fn an_inner_error_is_refunded_as_a_server_error() {
    use tower::Layer;
    let clock = ManualClock::default();
    let layer = RateLimitLayer::builder(limiter(&clock, Quota::per_minute(1).build().unwrap()))
        .key(key::header("x-api-key"))
        .scope(
            "test",
            fleetlimit::Scope::new().refund_if(|s| s.is_server_error()),
        )
        .build()
        .unwrap();
    let failing = layer.layer(tower::service_fn(|_: Request<Body>| async {
        Err::<axum::response::Response, _>(std::io::Error::other("down"))
    }));
    let call = || {
        let req = Request::get("/")
            .header("x-api-key", "k")
            .body(Body::empty())
            .unwrap();
        failing.clone().oneshot(req)
    };
    for attempt in 0..3 {
        let outcome = call().await;
        assert_eq!(
            outcome.err().map(|e| e.to_string()).as_deref(),
            Some("down"),
            "attempt {attempt}: admitted, the error as it came"
        );
        // The refund runs beside the error: let it land.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }
}
