//! Calls to a rate-limited partner, through `OutboundLayer`.
//!
//! Starts a loopback "partner" that allows `--rate` calls per second (a GCRA with a burst of 5)
//! and answers 429 past it, then `--instances` limiters (with `--store redis://...`, sharing one
//! Redis as a fleet would; by default each on its own memory store, which only holds for one
//! instance) with four callers each, calling it as fast as the layer lets them for
//! `--seconds`. Prints the calls made, the 429s received and the throughput against the quota.
//!
//! ```text
//! cargo run --release --example outbound [-- --rate 100 --seconds 5 --instances 2 --store redis://127.0.0.1:6379]
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use axum::{routing::get, Router};
use bytes::Bytes;
use fleetlimit::outbound::OutboundLayer;
use fleetlimit::store::RedisStore;
use fleetlimit::{Algorithm, Key, Limiter, MemoryStore, OnStoreError, Quota, Rule};
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{Service, ServiceBuilder, ServiceExt};

async fn partner(rate: u64, ok: Arc<AtomicU64>, refused: Arc<AtomicU64>) -> SocketAddr {
    let quota = Quota::per_second(rate)
        .algorithm(Algorithm::Gcra)
        .burst(5)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("partner", quota).unwrap_or_else(|e| panic!("{e}")))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let handler = move || {
        let (limiter, ok, refused) = (limiter.clone(), ok.clone(), refused.clone());
        async move {
            let admitted = limiter
                .consume(&Key::new("fleet"), 1)
                .await
                .is_ok_and(|d| d.allowed);
            if admitted {
                ok.fetch_add(1, Ordering::Relaxed);
                "ok".into_response()
            } else {
                refused.fetch_add(1, Ordering::Relaxed);
                (http::StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response()
            }
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let app = Router::new().route("/", get(handler));
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut rate, mut seconds, mut instances, mut store) = (100u64, 5u64, 2usize, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rate" => rate = value.parse()?,
            "--seconds" => seconds = value.parse()?,
            "--instances" => instances = value.parse()?,
            "--store" => store = Some(value),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    // Built before the partner, which takes the same rate: a bad one is said here.
    let quota = Quota::per_second(rate)
        .algorithm(Algorithm::Gcra)
        .burst(2)
        .build()
        .map_err(|e| format!("--rate {rate}: {e}"))?;
    let (ok, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let addr = partner(rate, ok.clone(), refused.clone()).await;
    let until = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut callers = Vec::new();
    for _ in 0..instances {
        let rule = Rule::new("partner", quota.clone())?;
        let limiter = match &store {
            Some(url) => Limiter::builder(RedisStore::connect(url).await?)
                .rule(rule)
                .on_store_error(OnStoreError::fail_closed())
                .build()?,
            None => Limiter::builder(MemoryStore::new()).rule(rule).build()?,
        };
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let service = ServiceBuilder::new()
            .layer(OutboundLayer::new(limiter).max_wait(Duration::from_secs(2)))
            .service(client);
        for _ in 0..4 {
            let mut service = service.clone();
            callers.push(tokio::spawn(async move {
                let mut made = 0u64;
                while Instant::now() < until {
                    let Ok(req) = http::Request::get(format!("http://{addr}/")).body(Empty::new())
                    else {
                        break;
                    };
                    let Ok(ready) = service.ready().await else {
                        break;
                    };
                    if ready.call(req).await.is_ok() {
                        made += 1;
                    }
                }
                made
            }));
        }
    }
    let mut made = 0;
    for c in callers {
        made += c.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (ok, refused) = (ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    println!(
        "{instances} instances ({}), partner quota {rate}/s, {seconds} s: {made} calls made, {ok} answered, \
         {refused} refused with 429; {:.1} calls/s answered ({:.1}% of the quota)",
        store.as_deref().map_or("each on its own memory store", |_| "sharing one Redis"),
        ok as f64 / elapsed,
        100.0 * ok as f64 / elapsed / rate as f64
    );
    Ok(())
}
