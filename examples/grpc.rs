//! gRPC with fleetlimit: a tonic client calling a gRPC service behind `RateLimitLayer` sees
//! `Code::ResourceExhausted`, with the wait in `retry-after` and `grpc-retry-pushback-ms`.
//!
//! The service is served by axum over HTTP/2 (h2c) and called with tonic's client. To keep the
//! example free of protoc and code generation it carries raw bytes; a generated tonic service
//! is layered the same way (`Server::builder().layer(layer)` or a `Router`).
//!
//! ```text
//! cargo run --example grpc
//! ```

use std::future::{ready, Ready};
use std::net::SocketAddr;

use axum::{routing::post, Router};
use bytes::{Buf, BufMut, Bytes};
use fleetlimit::{Algorithm, Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
use http::uri::PathAndQuery;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The method this example serves.
pub const METHOD: &str = "/demo.Echo/Say";

/// A codec for raw bytes: no protobuf, no code generation.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Answers every call with "echo: " and the request.
#[derive(Debug, Clone, Copy)]
struct Echo;

impl tonic::server::UnaryService<Bytes> for Echo {
    type Response = Bytes;
    type Future = Ready<Result<Response<Bytes>, Status>>;

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let mut out = b"echo: ".to_vec();
        out.extend_from_slice(request.get_ref());
        ready(Ok(Response::new(Bytes::from(out))))
    }
}

/// The echo service as tonic's own server mounts generated services.
#[derive(Debug, Clone, Copy)]
pub struct EchoService;

impl tonic::server::NamedService for EchoService {
    const NAME: &'static str = "demo.Echo";
}

impl tower::Service<http::Request<tonic::body::Body>> for EchoService {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move { Ok(tonic::server::Grpc::new(RawCodec).unary(Echo, req).await) })
    }
}

/// `per_minute` calls per client address.
pub fn layer(per_minute: u64) -> Result<RateLimitLayer, fleetlimit::ConfigError> {
    let rule = Rule::new(
        "grpc",
        Quota::per_minute(per_minute)
            .algorithm(Algorithm::SlidingLog)
            .build()?,
    )?;
    let limiter = Limiter::builder(MemoryStore::new()).rule(rule).build()?;
    Ok(RateLimitLayer::new(limiter))
}

/// The service on tonic's own server, behind the layer (the peer address comes from tonic's
/// `TcpConnectInfo`, read with fleetlimit's `tonic` feature).
pub async fn serve_tonic(
    listener: tokio::net::TcpListener,
    per_minute: u64,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tonic::transport::Server::builder()
        .layer(layer(per_minute)?)
        .add_service(EchoService)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await?;
    Ok(())
}

/// The gRPC service, served by axum, behind a rate limit of `per_minute` calls per client
/// address.
pub fn app(per_minute: u64) -> Result<Router, fleetlimit::ConfigError> {
    Ok(Router::new()
        .route(
            METHOD,
            post(|req: http::Request<axum::body::Body>| async move {
                tonic::server::Grpc::new(RawCodec).unary(Echo, req).await
            }),
        )
        .layer(layer(per_minute)?))
}

/// Serve `app` on `listener` (HTTP/2 prior knowledge, as gRPC clients speak it).
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

/// Call the service once with tonic's client.
pub async fn say(channel: Channel, message: &'static str) -> Result<Response<Bytes>, Status> {
    let mut client = tonic::client::Grpc::new(channel);
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    client
        .unary(
            Request::new(Bytes::from_static(message.as_bytes())),
            PathAndQuery::from_static(METHOD),
            RawCodec,
        )
        .await
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(serve(listener, app(2)?));
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    for i in 1..=3 {
        match say(channel.clone(), "hello").await {
            Ok(r) => println!("call {i}: {}", String::from_utf8_lossy(r.get_ref())),
            Err(status) => println!(
                "call {i}: {:?} {:?}, retry-after {:?} s, grpc-retry-pushback-ms {:?}",
                status.code(),
                status.message(),
                status.metadata().get("retry-after"),
                status.metadata().get("grpc-retry-pushback-ms"),
            ),
        }
    }
    server.abort();
    Ok(())
}
