//! A tonic client against a gRPC service behind the layer, over a real HTTP/2 connection.

#[path = "../examples/grpc.rs"]
mod grpc;

use tonic::transport::Channel;
use tonic::Code;

#[tokio::test]
async fn a_tonic_client_sees_resource_exhausted_with_retry_information() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(grpc::serve(listener, grpc::app(2).unwrap()));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    for _ in 0..2 {
        let ok = grpc::say(channel.clone(), "hi").await.unwrap();
        assert_eq!(ok.get_ref().as_ref(), b"echo: hi");
        assert!(
            ok.metadata().get("ratelimit-remaining").is_some(),
            "headers on admitted calls too"
        );
    }
    let status = grpc::say(channel.clone(), "hi").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "rate limit exceeded");
    let pushback: i64 = status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let retry_after: i64 = status
        .metadata()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pushback > 59_000 && pushback <= 60_000, "{pushback}");
    assert_eq!(retry_after, 60);
    assert_eq!(status.metadata().get("ratelimit-remaining").unwrap(), "0");
    server.abort();
}

/// tonic's own server: the layer reads the peer from tonic's connect info.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn on_tonic_server_too() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(grpc::serve_tonic(listener, 1));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    assert!(grpc::say(channel.clone(), "hi").await.is_ok());
    let status = grpc::say(channel, "hi").await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    server.abort();
}

/// Counting only failed logins over gRPC: a tonic handler's `Err(Status::unauthenticated(..))`
/// travels as HTTP 200 with `grpc-status: 16`, and `refund_if(|s| s.is_success())` must read it
/// as the 401 it stands for, not refund it as a success (every wrong password given back, and
/// guessing unlimited). A call that succeeds is still refunded.
#[tokio::test]
async fn a_failed_grpc_call_is_judged_by_its_grpc_status() {
    use axum::routing::post;
    let app = failing_logins(axum::Router::new().route(
        grpc::METHOD,
        post(|req: http::Request<axum::body::Body>| async move {
            let mut echo = tonic::server::Grpc::new(grpc::RawCodec);
            echo.unary(EchoOk, req).await
        }),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(grpc::serve(listener, app));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Successes are given back: never limited.
    for _ in 0..5 {
        assert!(grpc::say(channel.clone(), "hi").await.is_ok());
    }
    let login = || async {
        let mut client = tonic::client::Grpc::new(channel.clone());
        client.ready().await.unwrap();
        client
            .unary::<_, bytes::Bytes, _>(
                tonic::Request::new(bytes::Bytes::from_static(b"guess")),
                http::uri::PathAndQuery::from_static(LOGIN),
                grpc::RawCodec,
            )
            .await
            .unwrap_err()
    };
    for _ in 0..2 {
        assert_eq!(login().await.code(), Code::Unauthenticated);
    }
    let third = login().await;
    assert_eq!(third.code(), Code::ResourceExhausted, "{third:?}");
    server.abort();
}

/// The same failed login sent by a client that does not say gRPC (another content type, or
/// none): tonic answers it all the same, as gRPC, and the failure is read from that answer.
/// Judged by the request, it read as HTTP 200 and was refunded: guessing without limit.
#[tokio::test]
async fn a_grpc_failure_is_judged_by_the_answer_whatever_the_request_said() {
    use tower::ServiceExt;

    for content_type in [Some("application/octet-stream"), None] {
        let app = failing_logins(axum::Router::new());
        let mut statuses = Vec::new();
        for _ in 0..3 {
            let mut req = http::Request::post(LOGIN);
            if let Some(content_type) = content_type {
                req = req.header("content-type", content_type);
            }
            let req = req
                .extension(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                    [203, 0, 113, 9],
                    4000,
                ))))
                .body(axum::body::Body::empty())
                .unwrap();
            statuses.push(app.clone().oneshot(req).await.unwrap().status().as_u16());
        }
        assert_eq!(statuses, [200, 200, 429], "{content_type:?}");
    }
}

const LOGIN: &str = "/demo.Auth/Login";

/// A login method that always fails as tonic answers a handler's `Err(Status)` (trailers only,
/// `UNAUTHENTICATED`), with a rule of 2 a minute that counts failures only (`refund_if`
/// success), over `others` too.
fn failing_logins(others: axum::Router) -> axum::Router {
    use fleetlimit::layer::Scope;
    use fleetlimit::{Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("logins", Quota::per_minute(2).build().unwrap()).unwrap())
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(limiter)
        .scope("logins", Scope::new().refund_if(|s| s.is_success()))
        .build()
        .unwrap();
    axum::Router::new()
        .route(
            LOGIN,
            axum::routing::post(|| async {
                http::Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", "16")
                    .header("grpc-message", "wrong password")
                    .body(axum::body::Body::empty())
                    .unwrap()
            }),
        )
        .merge(others)
        .layer(layer)
}

/// Answers every call with its request: a success.
#[derive(Clone, Copy)]
struct EchoOk;

impl tonic::server::UnaryService<bytes::Bytes> for EchoOk {
    type Response = bytes::Bytes;
    type Future = std::future::Ready<Result<tonic::Response<bytes::Bytes>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<bytes::Bytes>) -> Self::Future {
        std::future::ready(Ok(tonic::Response::new(request.into_inner())))
    }
}
