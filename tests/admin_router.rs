//! The admin router over HTTP: keys named as the extractor makes them (`/keys/{key}`) and
//! clients limited by address (`/ips/{addr}`), which a text key can never name.
#![cfg(feature = "admin")]

use std::net::IpAddr;

use axum::body::Body;
use axum::Router;
use fleetlimit::{admin, Key, Limiter, MemoryStore, Quota, Rule};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn limiter() -> Limiter {
    Limiter::builder(MemoryStore::new())
        .rule(Rule::new("api", Quota::per_minute(10).build().unwrap()).unwrap())
        .build()
        .unwrap()
}

async fn call(app: &Router, method: &str, path: &str) -> (StatusCode, serde_json::Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (status, json)
}

fn remaining(inspected: &serde_json::Value) -> u64 {
    inspected["rules"][0]["remaining"].as_u64().unwrap()
}

/// The key `PeerIp` makes for a client at `addr` (its defaults: IPv6 grouped by /64).
fn peer(addr: &str) -> Key {
    Key::from(addr.parse::<IpAddr>().unwrap())
}

#[tokio::test]
async fn clients_limited_by_address_are_named_by_their_address() {
    let limiter = limiter();
    let app = admin::router(limiter.clone());
    let v4 = peer("203.0.113.7");
    for _ in 0..3 {
        assert!(limiter.consume(&v4, 1).await.unwrap().allowed);
    }
    let (status, inspected) = call(&app, "GET", "/ips/203.0.113.7").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(remaining(&inspected), 7, "{inspected}");
    assert_eq!(inspected["key"], "203.0.113.7");
    // The text key of the same characters is another key: untouched.
    let (_, text) = call(&app, "GET", "/keys/203.0.113.7").await;
    assert_eq!(remaining(&text), 10);

    // Denied by address: the client is refused, and allowed again once unlisted.
    assert_eq!(
        call(&app, "POST", "/ips/203.0.113.7/deny").await.0,
        StatusCode::NO_CONTENT
    );
    assert!(!limiter.consume(&v4, 1).await.unwrap().allowed);
    let (_, inspected) = call(&app, "GET", "/ips/203.0.113.7").await;
    assert_eq!(inspected["listing"], "deny");
    assert_eq!(
        call(&app, "POST", "/ips/203.0.113.7/unblock").await.0,
        StatusCode::NO_CONTENT
    );
    assert!(limiter.consume(&v4, 1).await.unwrap().allowed);
    assert_eq!(
        call(&app, "DELETE", "/ips/203.0.113.7/rules/api").await.0,
        StatusCode::NO_CONTENT
    );
    let (_, inspected) = call(&app, "GET", "/ips/203.0.113.7").await;
    assert_eq!(remaining(&inspected), 10, "reset");

    // IPv6: any address of the client's /64 names its key, as PeerIp groups it; another
    // prefix length names another key.
    let v6 = peer("2001:db8:1:2::1");
    assert!(limiter.consume(&v6, 4).await.unwrap().allowed);
    let (_, inspected) = call(&app, "GET", "/ips/2001:db8:1:2:ffff::9").await;
    assert_eq!(remaining(&inspected), 6);
    let (_, other) = call(&app, "GET", "/ips/2001:db8:1:2::1%2F128").await;
    assert_eq!(remaining(&other), 10);
    assert_eq!(
        call(&app, "POST", "/ips/2001:db8:1:2::7/block?seconds=60")
            .await
            .0,
        StatusCode::NO_CONTENT
    );
    assert!(!limiter.consume(&v6, 1).await.unwrap().allowed);
}

#[tokio::test]
async fn a_malformed_address_is_a_clear_400() {
    let app = admin::router(limiter());
    for bad in [
        "/ips/not-an-address",
        "/ips/203.0.113.7%2F24",
        "/ips/2001:db8::1%2F129",
        "/ips/2001:db8::1%2F16",
        "/ips/2001:db8::1%2F",
        "/ips/2001:db8::1%2Fx",
        "/ips/::ffff:203.0.113.7%2F96",
        "/ips/300.1.1.1/deny",
        // Not text at all: still an address that is not one.
        "/ips/%FF",
        "/ips/%FF/deny",
    ] {
        let method = if bad.ends_with("/deny") {
            "POST"
        } else {
            "GET"
        };
        let (status, body) = call(&app, method, bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(body["error"], "invalid_address", "{bad}");
    }
    // Text keys are unchanged: any text, percent-decoded.
    let (status, body) = call(&app, "GET", "/keys/tenant%207").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["key"], "tenant 7");
    let (status, body) = call(&app, "DELETE", "/keys/tenant-7/rules/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"], "unknown_rule");
}

/// `/ips/{addr}` names the key the rate-limit layer makes for a client at that address, by
/// its default `PeerIp` (an IPv6 client's /64): counted through the layer, read through the
/// admin router, from any address of the same /64.
#[tokio::test]
async fn an_address_names_the_key_the_layer_counts() {
    use axum::extract::connect_info::MockConnectInfo;
    use axum::routing::get;
    use fleetlimit::RateLimitLayer;
    use std::net::SocketAddr;

    let limiter = limiter();
    let admin = admin::router(limiter.clone());
    let client: SocketAddr = "[2001:db8:0:7:1:2:3:4]:5000".parse().unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(limiter.clone()))
        .layer(MockConnectInfo(client));
    for _ in 0..3 {
        let req = Request::get("/").body(Body::empty()).unwrap();
        assert_eq!(
            app.clone().oneshot(req).await.unwrap().status(),
            StatusCode::OK
        );
    }
    for addr in ["2001:db8:0:7:1:2:3:4", "2001:db8:0:7:ffff::1"] {
        let (status, inspected) = call(&admin, "GET", &format!("/ips/{addr}")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(remaining(&inspected), 7, "{addr}: {inspected}");
    }
    let (_, elsewhere) = call(&admin, "GET", "/ips/2001:db8:0:8::1").await;
    assert_eq!(remaining(&elsewhere), 10, "another /64");
}

/// A header value may hold any byte, and the key the layer counts holds them too: the operator
/// names such a key by its percent-encoded bytes, though they are not text.
#[tokio::test]
async fn a_key_that_is_not_text_can_be_named() {
    use axum::routing::get;
    use fleetlimit::{key, RateLimitLayer};

    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("api", Quota::per_minute(1).build().unwrap()).unwrap())
        .build()
        .unwrap();
    let admin = admin::router(limiter.clone());
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(limiter.clone())
            .key(key::header("x-api-key"))
            .build()
            .unwrap(),
    );
    let send = || async {
        let req = Request::get("/")
            .header(
                "x-api-key",
                http::HeaderValue::from_bytes(b"\xffk").unwrap(),
            )
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(req).await.unwrap().status()
    };
    assert_eq!(send().await, StatusCode::OK);
    assert_eq!(send().await, StatusCode::TOO_MANY_REQUESTS);
    let (status, inspected) = call(&admin, "GET", "/keys/%FFk").await;
    assert_eq!(status, StatusCode::OK, "{inspected}");
    assert_eq!(
        remaining(&inspected),
        0,
        "the key the layer counts: {inspected}"
    );
    let (status, _) = call(&admin, "DELETE", "/keys/%FFk").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(send().await, StatusCode::OK, "reset");
    let (status, _) = call(&admin, "POST", "/keys/%FFk/deny").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(send().await, StatusCode::TOO_MANY_REQUESTS, "denied");
    let (status, _) = call(&admin, "DELETE", "/keys/%FFk/rules/api").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // A rule name is text.
    let (status, _) = call(&admin, "DELETE", "/keys/%FFk/rules/%FF").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
