//! Shared helpers for the integration tests (`mod support;` in each test file).

// Not every test binary uses every helper.
#![allow(dead_code)]

pub mod redis;
pub mod relay;

/// How many of `tries` consumes of one permit `limiter` admits for `key`.
pub async fn admitted(limiter: &fleetlimit::Limiter, key: &fleetlimit::Key, tries: usize) -> usize {
    let mut n = 0;
    for _ in 0..tries {
        n += usize::from(limiter.consume(key, 1).await.unwrap().allowed);
    }
    n
}

/// A request body sent as these chunks, one frame each, with no declared length (as a chunked
/// upload arrives).
pub struct Chunks(pub Vec<Vec<u8>>);

impl http_body::Body for Chunks {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        let next = (!self.0.is_empty()).then(|| self.0.remove(0));
        std::task::Poll::Ready(next.map(|c| Ok(http_body::Frame::data(bytes::Bytes::from(c)))))
    }
}

/// These chunks, then nothing ever again: a client that keeps its stream open.
pub struct OpenStream(pub Chunks);

impl http_body::Body for OpenStream {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        match std::pin::Pin::new(&mut self.0).poll_frame(cx) {
            std::task::Poll::Ready(None) => std::task::Poll::Pending,
            frame => frame,
        }
    }
}

/// `app` served on a free loopback port as `axum::serve` runs it, with the peer address: the
/// address, and the server's task (abort it when done).
pub async fn serve(app: axum::Router) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
        axum::serve(listener, app).await.unwrap();
    });
    (addr, server)
}

/// `request`, raw HTTP/1.1 text ending the connection (`Connection: close`), sent to `addr`:
/// the raw response, within 5 s.
pub async fn exchange(addr: std::net::SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    let read = s.read_to_string(&mut response);
    tokio::time::timeout(std::time::Duration::from_secs(5), read)
        .await
        .unwrap()
        .unwrap();
    response
}
