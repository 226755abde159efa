//! Shared helpers for the integration tests (`mod support;` in each test file).

// Not every test binary uses every helper.
#![allow(dead_code)]

pub mod redis;

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
