//! The layer on a plain hyper 1.x server over a real socket.

#[path = "../examples/hyper.rs"]
mod hyper_example;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(addr: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out.to_ascii_lowercase()
}

#[tokio::test]
async fn plain_hyper_server_limits_by_peer_address() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(hyper_example::serve(
        listener,
        hyper_example::layer(2).unwrap(),
    ));
    let first = get(addr).await;
    assert!(
        first.starts_with("http/1.1 200") && first.ends_with("hello"),
        "{first}"
    );
    assert!(first.contains("ratelimit-remaining: 1"), "{first}");
    assert!(get(addr).await.starts_with("http/1.1 200"));
    let denied = get(addr).await;
    assert!(denied.starts_with("http/1.1 429"), "{denied}");
    assert!(denied.contains("retry-after: "), "{denied}");
    assert!(denied.contains("\"error\":\"rate_limited\""), "{denied}");
    server.abort();
}
