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
