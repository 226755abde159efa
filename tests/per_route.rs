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
    // (Failed-login counting is tested in tests/layer_features.rs.)
    let app = per_route::app().unwrap();
    let free = [("authorization", "Bearer key-acme")];
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
    // What the client says about its plan or tenant changes nothing: the server decides.
    let claims = [
        ("authorization", "Bearer key-acme"),
        ("x-plan", "paid"),
        ("x-tenant", "bigco"),
    ];
    assert_eq!(
        send(&app, "GET", "/", &claims, "").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let paid = [("authorization", "Bearer key-bigco")];
    assert_eq!(send(&app, "GET", "/", &paid, "").await, StatusCode::OK);
    // An unknown key never reaches a tenant's limit, and cannot lock one out.
    for _ in 0..5 {
        assert_eq!(
            send(
                &app,
                "GET",
                "/",
                &[("authorization", "Bearer key-forged")],
                ""
            )
            .await,
            StatusCode::UNAUTHORIZED
        );
    }
    assert_eq!(send(&app, "GET", "/", &paid, "").await, StatusCode::OK);
}

/// Keys minted by a client are still limited per address, in front of authentication.
#[tokio::test]
async fn a_client_minting_keys_is_limited_per_address() {
    let app = per_route::app().unwrap();
    let mut limited = 0;
    for i in 0..1_100 {
        let forged = format!("Bearer forged-{i}");
        let s = send(&app, "GET", "/", &[("authorization", &forged)], "").await;
        if s == StatusCode::TOO_MANY_REQUESTS {
            limited += 1;
        } else {
            assert_eq!(s, StatusCode::UNAUTHORIZED);
        }
    }
    assert_eq!(limited, 100, "1,000 per minute per address");
}
