//! fleetlimit on a plain hyper 1.x server, no framework: the layer wraps a `tower` service,
//! and each connection's peer address goes into the request extensions.
//!
//! ```text
//! cargo run --example hyper        # then: curl -i http://127.0.0.1:3001/
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use fleetlimit::{Limiter, MemoryStore, Quota, RateLimitLayer, Rule};
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::{Layer, ServiceExt};

async fn hello(_req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"hello"))))
}

/// `per_minute` requests per client address.
pub fn layer(per_minute: u64) -> Result<RateLimitLayer, fleetlimit::ConfigError> {
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("hyper", Quota::per_minute(per_minute).build()?)?)
        .build()?;
    Ok(RateLimitLayer::new(limiter))
}

/// Accept connections on `listener` forever, every one behind `layer`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    layer: RateLimitLayer,
) -> std::io::Result<()> {
    let service = layer.layer(tower::service_fn(hello));
    loop {
        let (stream, peer) = listener.accept().await?;
        let service = service.clone();
        // The layer falls back to the peer address, which hyper leaves to us to provide.
        let with_peer = tower::service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert::<SocketAddr>(peer);
            service.clone().oneshot(req)
        });
        tokio::spawn(async move {
            let conn = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(with_peer));
            if let Err(error) = conn.await {
                eprintln!("connection from {peer}: {error}");
            }
        });
    }
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, layer(5)?).await?;
    Ok(())
}
