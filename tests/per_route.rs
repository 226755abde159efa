//! The per-route example behaves as it says.

#[path = "../examples/per_route.rs"]
#[allow(dead_code)]
mod per_route;

use std::net::SocketAddr;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use tower::ServiceExt;

async fn send(
    app: &axum::Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> StatusCode {
    let mut b = Request::builder().method(method).uri(path);
    for (n, v) in headers {
        b = b.header(*n, *v);
    }
    let mut req = b.body(Body::from(body)).unwrap();
    req.extensions_mut()
        .insert(SocketAddr::from(([192, 0, 2, 1], 1)));
    app.clone().oneshot(req).await.unwrap().status()
}

#[tokio::test]
async fn routes_plans_and_costs() {
    let app = per_route::app().unwrap();
    for _ in 0..20 {
        assert_eq!(
            send(&app, "POST", "/login", &[], "open sesame").await,
            StatusCode::OK
        );
    }
    for i in 0..7 {
        let s = send(&app, "POST", "/login", &[], "guess").await;
        assert_eq!(
            s == StatusCode::TOO_MANY_REQUESTS,
            i >= 5,
            "failure {i}: {s}"
        );
    }
    let free = [("x-tenant", "acme"), ("x-plan", "free")];
    for _ in 0..10 {
        assert_eq!(
            send(&app, "POST", "/import", &free, "").await,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(&app, "GET", "/", &free, "").await,
        StatusCode::TOO_MANY_REQUESTS,
        "10 imports × 10 = the free plan's 100"
    );
    let paid = [("x-tenant", "bigco"), ("x-plan", "paid")];
    assert_eq!(send(&app, "GET", "/", &paid, "").await, StatusCode::OK);
}
