//! The SaaS example, run as deployed: two instances on real sockets, sharing a real Redis.

#[path = "../examples/saas.rs"]
#[allow(dead_code)]
mod saas;
mod support;

use std::net::SocketAddr;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use fleetlimit::store::RedisStore;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::redis::RedisServer;

const MIB: usize = 1024 * 1024;

/// Two instances of the service on their own loopback ports, one Redis between them.
struct Fleet {
    redis: RedisServer,
    instances: [SocketAddr; 2],
    client: Client<HttpConnector, Body>,
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

impl Fleet {
    async fn start() -> Fleet {
        let redis = RedisServer::start();
        let mut instances = Vec::new();
        for _ in 0..2 {
            let store = RedisStore::connect(&redis.url()).await.unwrap();
            let app = saas::app(saas::rate_limit(store, 2).unwrap());
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            instances.push(listener.local_addr().unwrap());
            tokio::spawn(async move {
                axum::serve(
                    listener,
                    app.into_make_service_with_connect_info::<SocketAddr>(),
                )
                .await
            });
        }
        Fleet {
            redis,
            instances: [instances[0], instances[1]],
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// Send to instance `n % 2`; the response body is read to the end.
    async fn send(
        &self,
        n: usize,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Body,
    ) -> Answer {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.instances[n % 2]));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let response = self.client.request(req.body(body).unwrap()).await.unwrap();
        let (parts, body) = response.into_parts();
        body.collect().await.unwrap();
        Answer {
            status: parts.status,
            headers: parts.headers,
        }
    }

    async fn get(&self, n: usize, path: &str, headers: &[(&str, &str)]) -> Answer {
        self.send(n, Method::GET, path, headers, Body::empty())
            .await
    }

    async fn login(&self, n: usize, account: &str, password: &str) -> StatusCode {
        let body = format!(r#"{{"account":"{account}","password":"{password}"}}"#);
        let json = [("content-type", "application/json")];
        self.send(n, Method::POST, "/login", &json, Body::from(body))
            .await
            .status
    }
}

const ACME: (&str, &str) = ("authorization", "Bearer key-acme");
const BIGCO: (&str, &str) = ("authorization", "Bearer key-bigco");

#[tokio::test]
async fn plans_and_anonymous_clients_are_limited_across_both_instances() {
    let fleet = Fleet::start().await;
    // The free plan's 60 a minute, across both instances, not 60 each.
    for n in 0..60 {
        let r = fleet.get(n, "/", &[ACME]).await;
        assert_eq!(r.status, StatusCode::OK, "request {n}");
    }
    for n in 0..2 {
        let r = fleet.get(n, "/", &[ACME]).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(r.header("retry-after").is_some());
        assert_eq!(r.header("ratelimit-policy"), Some("\"free\";q=60;w=60"));
    }
    // Another tenant is untouched, with the pro plan's quota.
    let r = fleet.get(1, "/", &[BIGCO]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("ratelimit-policy"), Some("\"pro\";q=600;w=60"));
    // /health is never limited.
    for n in 0..30 {
        let r = fleet.get(n, "/health", &[ACME]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit"), None);
    }
    // Unknown keys are refused, and counted per address with anonymous clients: guessing keys
    // is limited to 20 a minute per address across the fleet.
    let guess = [("authorization", "Bearer key-guess")];
    for n in 0..10 {
        assert_eq!(
            fleet.get(n, "/", &guess).await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    for n in 0..10 {
        assert_eq!(fleet.get(n, "/", &[]).await.status, StatusCode::OK);
    }
    let r = fleet.get(0, "/", &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"anonymous\";q=20;w=60")
    );
    assert_eq!(
        fleet.get(1, "/", &guess).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A tenant's own quota is separate from its address's.
    assert_eq!(fleet.get(0, "/", &[BIGCO]).await.status, StatusCode::OK);
}

#[tokio::test]
async fn failed_logins_are_counted_per_account_from_the_body_and_per_address() {
    let fleet = Fleet::start().await;
    for n in 0..5 {
        assert_eq!(
            fleet.login(n, "alice", "guess").await,
            StatusCode::UNAUTHORIZED
        );
    }
    // Alice's account is locked on both instances, even with the right password...
    assert_eq!(
        fleet.login(0, "alice", "wonderland").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        fleet.login(1, "alice", "wonderland").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // ...Bob's is not, and his successful logins are given back: they never lock him out.
    for n in 0..6 {
        assert_eq!(fleet.login(n, "bob", "builder").await, StatusCode::OK);
    }
    assert_eq!(
        fleet.login(0, "bob", "guess").await,
        StatusCode::UNAUTHORIZED
    );
    // A login without an account is the client's error, counted nowhere.
    let json = [("content-type", "application/json")];
    let r = fleet
        .send(
            1,
            Method::POST,
            "/login",
            &json,
            Body::from(r#"{"password":"x"}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Per address: 10 failures a minute whatever the account (6 so far: alice 5, bob 1).
    for (n, account) in ["carol", "dave", "erin", "frank"].iter().enumerate() {
        assert_eq!(
            fleet.login(n, account, "guess").await,
            StatusCode::UNAUTHORIZED
        );
    }
    let r = fleet.login(0, "grace", "guess").await;
    assert_eq!(
        r,
        StatusCode::TOO_MANY_REQUESTS,
        "the address's 10 failures"
    );
}

/// A body streamed in 64 KiB chunks, with no declared length (sent chunked).
fn streamed(bytes: usize) -> Body {
    let chunks = (0..bytes.div_ceil(64 * 1024))
        .map(|i| vec![b'z'; (bytes - i * 64 * 1024).min(64 * 1024)])
        .collect();
    Body::new(support::Chunks(chunks))
}

#[tokio::test]
async fn uploads_are_charged_in_kib_declared_or_streamed() {
    let fleet = Fleet::start().await;
    let put = |n: usize, body: Body, declared: Option<usize>| {
        let length = declared.map(|l| l.to_string());
        let fleet = &fleet;
        async move {
            let mut headers = vec![ACME];
            if let Some(length) = &length {
                headers.push(("content-length", length.as_str()));
            }
            fleet
                .send(n, Method::PUT, "/files/data.bin", &headers, body)
                .await
        }
    };
    // 4 MiB on each instance: 8 of the tenant's 10 MiB a minute.
    for n in 0..2 {
        let r = put(n, Body::from(vec![b'a'; 4 * MIB]), Some(4 * MIB)).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    // A third 4 MiB file does not fit: refused before a byte is read, nothing taken.
    let r = put(0, Body::from(vec![b'a'; 4 * MIB]), Some(4 * MIB)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.header("retry-after").is_some());
    // 3 MiB streamed with no declared length: charged as read, refused at the 2 MiB left,
    // on the other instance.
    let r = put(1, streamed(3 * MIB), None).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        r.header("ratelimit")
            .is_some_and(|v| v.contains("\"upload-kib\";r=0;")),
        "{:?}",
        r.header("ratelimit")
    );
    // The budget is spent to exactly its 10 MiB: nothing more fits, on either instance.
    let r = put(0, streamed(1024), None).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    // Anonymous uploads are refused before their body is read; and a file no budget can hold
    // is a 413 for another tenant.
    let r = fleet
        .send(0, Method::PUT, "/files/x", &[], Body::from("x"))
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let eleven = (11 * MIB).to_string();
    let r = fleet
        .send(
            1,
            Method::PUT,
            "/files/huge",
            &[BIGCO, ("content-length", eleven.as_str())],
            Body::from(vec![b'h'; 11 * MIB]),
        )
        .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn with_redis_gone_each_instance_decides_on_its_share() {
    let mut fleet = Fleet::start().await;
    assert_eq!(fleet.get(0, "/", &[ACME]).await.status, StatusCode::OK);
    fleet.redis.kill();
    // Each of the 2 instances now allows half of the free plan's 60, on its own.
    for instance in 0..2 {
        let mut admitted = 0;
        for _ in 0..40 {
            let r = fleet.get(instance, "/", &[ACME]).await;
            assert!(
                matches!(r.status, StatusCode::OK | StatusCode::TOO_MANY_REQUESTS),
                "{}",
                r.status
            );
            admitted += usize::from(r.status == StatusCode::OK);
        }
        assert_eq!(admitted, 30, "instance {instance}");
    }
    // /health still answers.
    assert_eq!(fleet.get(0, "/health", &[]).await.status, StatusCode::OK);
    // An upload streamed with no declared length is metered against the instance's share of
    // the tenant's 10 MiB a minute (5 MiB), as read: 8 MiB is refused (it was charged 1 KiB
    // up front, then read unmetered). A declared 8 MiB is refused before a byte is read.
    let put = |body: Body, declared: Option<usize>| {
        let length = declared.map(|l| l.to_string());
        let fleet = &fleet;
        async move {
            let mut headers = vec![BIGCO];
            if let Some(length) = &length {
                headers.push(("content-length", length.as_str()));
            }
            fleet
                .send(1, Method::PUT, "/files/data.bin", &headers, body)
                .await
                .status
        }
    };
    assert_eq!(
        put(streamed(8 * MIB), None).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        put(Body::from(vec![b'a'; 8 * MIB]), Some(8 * MIB)).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        put(streamed(64 * 1024), None).await,
        StatusCode::TOO_MANY_REQUESTS,
        "the refused upload's 5 MiB read stay charged: the share is spent"
    );
}
