//! The layer's features in real axum routers: header styles, scopes, several limits at once,
//! refunds by outcome, shadow mode, spoofing, missing keys and hostile input.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode};
use axum::response::Response;
use axum::{routing::get, routing::post, Router};
use fleetlimit::key::{self, PeerIp, TrustedProxies};
use fleetlimit::store::RedisStore;
use fleetlimit::{
    Algorithm, Denial, HeaderStyle, Limiter, ManualClock, MemoryStore, MissingKey, OnStoreError,
    Quota, RateLimitInfo, RateLimitLayer, Rule, Scope,
};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn rule(name: &str, limit: u64) -> Rule {
    Rule::new(
        name,
        Quota::per_minute(limit)
            .algorithm(Algorithm::SlidingLog)
            .build()
            .unwrap(),
    )
    .unwrap()
}

fn memory_limiter(rules: Vec<Rule>) -> Limiter {
    let store = MemoryStore::builder()
        .clock(ManualClock::default())
        .build()
        .unwrap();
    rules
        .into_iter()
        .fold(Limiter::builder(store), |b, r| b.rule(r))
        .build()
        .unwrap()
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/fail",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
        )
        .route(
            "/login",
            post(|body: String| async move {
                if body == "right" {
                    (StatusCode::OK, "welcome")
                } else {
                    (StatusCode::UNAUTHORIZED, "no")
                }
            }),
        )
        .route("/import", post(|| async { "imported" }))
        .layer(layer)
}

struct Req {
    method: Method,
    path: &'static str,
    peer: [u8; 4],
    headers: Vec<(&'static str, HeaderValue)>,
    body: &'static str,
}

impl Req {
    fn get(path: &'static str) -> Req {
        Req {
            method: Method::GET,
            path,
            peer: [198, 51, 100, 7],
            headers: Vec::new(),
            body: "",
        }
    }
    fn post(path: &'static str, body: &'static str) -> Req {
        Req {
            method: Method::POST,
            body,
            ..Req::get(path)
        }
    }
    fn peer(mut self, peer: [u8; 4]) -> Req {
        self.peer = peer;
        self
    }
    fn header(mut self, name: &'static str, value: &str) -> Req {
        self.headers
            .push((name, HeaderValue::from_str(value).unwrap()));
        self
    }
    fn raw_header(mut self, name: &'static str, value: HeaderValue) -> Req {
        self.headers.push((name, value));
        self
    }
    async fn send(self, app: &Router) -> Response {
        let mut b = Request::builder().method(self.method).uri(self.path);
        for (n, v) in self.headers {
            b = b.header(n, v);
        }
        let mut req = b.body(Body::from(self.body)).unwrap();
        req.extensions_mut()
            .insert(SocketAddr::from((self.peer, 5555)));
        app.clone().oneshot(req).await.unwrap()
    }
}

fn h(r: &Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Parse `RateLimit-Policy` / `RateLimit` with a real Structured Field parser: (name, params).
fn sf_list(value: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .expect("a valid Structured Field list");
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .expect("a String item")
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.as_integer().map_or(-1, i64::from)))
                    .collect();
                (name, params)
            }
            sfv::ListEntry::InnerList(_) => panic!("no inner lists"),
        })
        .collect()
}

#[tokio::test]
async fn every_header_style_on_allowed_denied_and_error_responses() {
    for style in [
        HeaderStyle::Draft6,
        HeaderStyle::Ietf,
        HeaderStyle::Legacy,
        HeaderStyle::None,
    ] {
        let limiter = memory_limiter(vec![rule("api", 2)]);
        let app = app(RateLimitLayer::builder(limiter)
            .headers(style)
            .build()
            .unwrap());
        let ok = Req::get("/").send(&app).await;
        let err = Req::get("/fail").send(&app).await;
        let denied = Req::get("/").send(&app).await;
        assert_eq!(
            (ok.status(), err.status(), denied.status()),
            (
                StatusCode::OK,
                StatusCode::INTERNAL_SERVER_ERROR,
                StatusCode::TOO_MANY_REQUESTS
            )
        );
        assert!(h(&denied, "retry-after").is_some(), "{style:?}");
        let remaining = |r: &Response| match style {
            HeaderStyle::Draft6 => h(r, "ratelimit-remaining"),
            HeaderStyle::Legacy => h(r, "x-ratelimit-remaining"),
            HeaderStyle::Ietf => {
                let v = h(r, "ratelimit")?;
                let list = sf_list(&v);
                Some(list[0].1.iter().find(|(k, _)| k == "r")?.1.to_string())
            }
            _ => None,
        };
        match style {
            HeaderStyle::None => {
                for r in [&ok, &err, &denied] {
                    assert!(r
                        .headers()
                        .keys()
                        .all(|k| !k.as_str().contains("ratelimit")));
                }
            }
            _ => {
                assert_eq!(remaining(&ok).as_deref(), Some("1"), "{style:?}");
                assert_eq!(remaining(&err).as_deref(), Some("0"), "{style:?}");
                assert_eq!(remaining(&denied).as_deref(), Some("0"), "{style:?}");
            }
        }
        if style == HeaderStyle::Ietf {
            let policy = sf_list(&h(&ok, "ratelimit-policy").unwrap());
            assert_eq!(
                policy,
                vec![(
                    "api".to_owned(),
                    vec![("q".to_owned(), 2), ("w".to_owned(), 60)]
                )]
            );
            // Retry-After is never earlier than the denied policy's `t`.
            let state = sf_list(&h(&denied, "ratelimit").unwrap());
            let t = state[0].1.iter().find(|(k, _)| k == "t").unwrap().1;
            let retry_after: i64 = h(&denied, "retry-after").unwrap().parse().unwrap();
            assert!(
                retry_after >= t && t > 0,
                "Retry-After {retry_after}, t {t}"
            );
        }
    }
}

#[tokio::test]
async fn ietf_lists_one_item_per_rule_and_the_strictest_governs_single_values() {
    let limiter = memory_limiter(vec![rule("per-account", 100), rule("per-ip", 3)]);
    let ietf = app(RateLimitLayer::builder(limiter.clone())
        .key(key::header("x-account"))
        .scope("per-ip", Scope::new().key(PeerIp::default()))
        .headers(HeaderStyle::Ietf)
        .build()
        .unwrap());
    let r = Req::get("/").header("x-account", "a1").send(&ietf).await;
    let policy = sf_list(&h(&r, "ratelimit-policy").unwrap());
    let names: Vec<&str> = policy.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["per-account", "per-ip"]);
    let state = sf_list(&h(&r, "ratelimit").unwrap());
    assert_eq!(state[0].1[0], ("r".to_owned(), 99));
    assert_eq!(state[1].1[0], ("r".to_owned(), 2));

    let draft6 = app(RateLimitLayer::builder(limiter)
        .key(key::header("x-account"))
        .scope("per-ip", Scope::new().key(PeerIp::default()))
        .build()
        .unwrap());
    let r = Req::get("/").header("x-account", "a1").send(&draft6).await;
    assert_eq!(
        h(&r, "ratelimit-limit").as_deref(),
        Some("3"),
        "the per-IP rule is strictest"
    );
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("1"));
}

/// Per account AND per IP (credential stuffing): a request denied by one rule consumes nothing
/// from the other, in both directions.
async fn all_or_nothing(limiter: Limiter) {
    let app = app(RateLimitLayer::builder(limiter)
        .key(key::header("x-account"))
        .scope("per-ip", Scope::new().key(PeerIp::default()))
        .build()
        .unwrap());
    // One IP tries many accounts: the per-IP rule (3) denies; no account loses a permit.
    for i in 0..10 {
        let account = format!("victim-{i}");
        let r = Req::get("/")
            .header("x-account", &account)
            .peer([203, 0, 113, 1])
            .send(&app)
            .await;
        assert_eq!(r.status() == StatusCode::OK, i < 3, "attempt {i}");
    }
    for i in 3..10 {
        // Each victim still has its full per-account budget (5) from a clean IP.
        let account = format!("victim-{i}");
        for n in 0..5 {
            let peer = [192, 0, 2, (i * 10 + n) as u8];
            let r = Req::get("/")
                .header("x-account", &account)
                .peer(peer)
                .send(&app)
                .await;
            assert_eq!(r.status(), StatusCode::OK, "{account} request {n}");
        }
    }
    // The reverse: one account from many IPs: the account rule (5) denies; the IPs keep theirs.
    for n in 0..8 {
        let r = Req::get("/")
            .header("x-account", "busy")
            .peer([100, 64, 0, n])
            .send(&app)
            .await;
        assert_eq!(r.status() == StatusCode::OK, n < 5, "attempt {n}");
    }
    for n in 5..8 {
        for _ in 0..3 {
            let r = Req::get("/")
                .header("x-account", &format!("fresh-{n}"))
                .peer([100, 64, 0, n])
                .send(&app)
                .await;
            assert_eq!(
                r.status(),
                StatusCode::OK,
                "IP 100.64.0.{n} kept its 3 permits"
            );
        }
    }
}

#[tokio::test]
async fn several_limits_are_all_or_nothing_on_memory() {
    all_or_nothing(memory_limiter(vec![
        rule("per-account", 5),
        rule("per-ip", 3),
    ]))
    .await;
}

#[tokio::test]
async fn several_limits_are_all_or_nothing_on_redis() {
    let server = support::redis::RedisServer::start();
    let store = RedisStore::builder()
        .connect_timeout(Duration::from_secs(2))
        .connect(&server.url())
        .await
        .unwrap();
    let limiter = Limiter::builder(store)
        .rule(rule("per-account", 5))
        .rule(rule("per-ip", 3))
        .on_store_error(OnStoreError::fail_closed())
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    all_or_nothing(limiter).await;
}

#[tokio::test]
async fn counting_only_failed_logins_never_locks_out_real_users() {
    let limiter = memory_limiter(vec![rule("login", 5)]);
    let app = app(RateLimitLayer::builder(limiter)
        .scope(
            "login",
            Scope::new()
                .route(Method::POST, "/login")
                .refund_if(|status| status.is_success()),
        )
        .build()
        .unwrap());
    for i in 0..1_000 {
        let r = Req::post("/login", "right").send(&app).await;
        assert_eq!(r.status(), StatusCode::OK, "successful login {i}");
    }
    let mut denied = 0;
    for _ in 0..20 {
        if Req::post("/login", "wrong").send(&app).await.status() == StatusCode::TOO_MANY_REQUESTS {
            denied += 1;
        }
    }
    assert_eq!(denied, 15, "exactly 5 failed attempts pass");
    // Other routes are not limited by the login rule at all.
    let r = Req::get("/").send(&app).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(h(&r, "ratelimit-limit").is_none());
}

#[tokio::test]
async fn server_errors_can_be_given_back() {
    let limiter = memory_limiter(vec![rule("api", 2)]);
    let app = app(RateLimitLayer::builder(limiter)
        .scope("api", Scope::new().refund_if(|s| s.is_server_error()))
        .build()
        .unwrap());
    for _ in 0..10 {
        assert_eq!(
            Req::get("/fail").send(&app).await.status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
    assert_eq!(Req::get("/").send(&app).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn shadow_mode_never_denies_but_says_what_it_would_do() {
    let limiter = memory_limiter(vec![rule("new-limit", 2)]);
    let app = app(RateLimitLayer::builder(limiter)
        .shadow(true)
        .build()
        .unwrap());
    for i in 0..10 {
        let r = Req::get("/").send(&app).await;
        assert_eq!(r.status(), StatusCode::OK);
        // The response says when shadow mode let through what it would have denied.
        let info = r.extensions().get::<RateLimitInfo>().copied();
        assert_eq!(info.is_some_and(|i| i.would_deny), i >= 2, "request {i}");
        assert!(info.is_none_or(|i| !i.decision.allowed));
        assert_eq!(
            h(&r, "ratelimit-remaining").as_deref(),
            Some(if i == 0 { "1" } else { "0" })
        );
    }
}

/// Shadow mode never refuses, a request without a key included: a new rule rolled out in
/// shadow with its key required (`Reject`) lets keyless requests through, and the rules that
/// have their keys still count. It once answered them 400 (and 500 without a peer address).
#[tokio::test]
async fn shadow_mode_lets_requests_without_a_key_through() {
    let limiter = memory_limiter(vec![rule("per-account", 100), rule("per-ip", 100)]);
    let shadow = app(RateLimitLayer::builder(limiter.clone())
        .shadow(true)
        .scope(
            "per-account",
            Scope::new()
                .key(key::header("x-account"))
                .on_missing_key(MissingKey::Reject),
        )
        .build()
        .unwrap());
    let r = Req::get("/").send(&shadow).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        h(&r, "ratelimit-remaining").as_deref(),
        Some("99"),
        "per-ip counted"
    );
    // No peer address either: a misconfigured server, logged, but shadow mode lets it through.
    let keyless = Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(
        shadow.oneshot(keyless).await.unwrap().status(),
        StatusCode::OK
    );
}

/// The IETF style joins an inner fleetlimit layer's lists to its own, and nobody else's: a
/// handler (a proxy, say) answering with an upstream's `RateLimit` header in another draft's
/// syntax once had it joined in front of the layer's, which made the whole list unreadable.
#[tokio::test]
async fn ietf_lists_replace_a_handlers_own() {
    let limiter = memory_limiter(vec![rule("api", 100)]);
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                (
                    [
                        ("ratelimit", "limit=100, remaining=50, reset=30"),
                        ("ratelimit-policy", "100;w=60"),
                    ],
                    "ok",
                )
            }),
        )
        .layer(
            RateLimitLayer::builder(limiter)
                .headers(HeaderStyle::Ietf)
                .build()
                .unwrap(),
        );
    let r = Req::get("/").send(&app).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(h(&r, "ratelimit").as_deref(), Some(r#""api";r=99;t=60"#));
    assert_eq!(
        h(&r, "ratelimit-policy").as_deref(),
        Some(r#""api";q=100;w=60"#)
    );
}

/// Shadow mode lets refusals through, and so must not earn the client a block: a block is a
/// real listing, which every limiter on the store enforces. The same limiter enforcing blocks
/// at the third refusal, whose `Retry-After` is the block's, not the minute's.
#[tokio::test]
async fn shadow_refusals_earn_no_block_and_an_earned_block_is_in_retry_after() {
    let penalised = || {
        let store = MemoryStore::builder()
            .clock(ManualClock::default())
            .build()
            .unwrap();
        Limiter::builder(store)
            .rule(rule("api", 2))
            .penalty(fleetlimit::Penalty::new(
                3,
                Duration::from_secs(10),
                Duration::from_secs(600),
            ))
            .build()
            .unwrap()
    };
    let key = fleetlimit::Key::from_ip([198, 51, 100, 7].into(), 64);
    let shadowed = penalised();
    let app_of = |limiter: &Limiter, shadow: bool| {
        app(RateLimitLayer::builder(limiter.clone())
            .shadow(shadow)
            .build()
            .unwrap())
    };
    let shadow = app_of(&shadowed, true);
    for _ in 0..10 {
        assert_eq!(Req::get("/").send(&shadow).await.status(), StatusCode::OK);
    }
    assert_eq!(shadowed.inspect(&key).await.unwrap().listing, None);

    let enforced = penalised();
    let app = app_of(&enforced, false);
    for expected in [200, 200, 429, 429] {
        let r = Req::get("/").send(&app).await;
        assert_eq!(r.status().as_u16(), expected);
        assert!(h(&r, "retry-after").is_none_or(|s| s.parse::<u64>().unwrap() <= 60));
    }
    let third = Req::get("/").send(&app).await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h(&third, "retry-after").as_deref(), Some("600"));
    assert_eq!(h(&third, "ratelimit-reset").as_deref(), Some("600"));
    assert!(matches!(
        enforced.inspect(&key).await.unwrap().listing,
        Some(fleetlimit::store::Listing::Block(_))
    ));
}

/// Trusting every address lets any client name its own (and so its bucket) with a forwarding
/// header; grouping IPv6 by a very short prefix puts whole providers in one bucket. Both fail
/// when built, never silently.
#[test]
fn trust_and_grouping_that_hand_clients_their_buckets_fail_the_build() {
    for everyone in [
        "0.0.0.0/0",
        "1.0.0.0/7",
        "::/0",
        "::/6",
        "::ffff:0:0/96",
        "::ffff:10.0.0.0/103",
    ] {
        let err = TrustedProxies::new([everyone]).unwrap_err().to_string();
        assert!(err.contains("hops"), "{everyone}: {err}");
    }
    for network in [
        "10.0.0.0/8",
        "fc00::/7",
        "::ffff:10.0.0.0/104",
        "192.0.2.7",
        "::1",
    ] {
        assert!(TrustedProxies::new([network]).is_ok(), "{network}");
    }
    let layer = |prefix| {
        RateLimitLayer::builder(memory_limiter(vec![rule("ip", 1)]))
            .peer_ip(PeerIp::default().ipv6_prefix(prefix))
            .build()
    };
    for prefix in [0, 16, 31, 129] {
        let err = layer(prefix).unwrap_err().to_string();
        assert!(err.contains("ipv6_prefix"), "{prefix}: {err}");
    }
    for prefix in [32, 48, 56, 64, 128] {
        assert!(layer(prefix).is_ok(), "{prefix}");
    }
    // As a scope's key too.
    let scoped = RateLimitLayer::builder(memory_limiter(vec![rule("ip", 1)]))
        .scope("ip", Scope::new().key(PeerIp::default().ipv6_prefix(0)))
        .build();
    assert!(scoped.unwrap_err().to_string().contains("ipv6_prefix"));
}

#[tokio::test]
async fn forwarding_headers_are_believed_only_from_trusted_proxies() {
    let limiter = memory_limiter(vec![rule("ip", 1)]);
    let trusted = PeerIp::default()
        .trust(TrustedProxies::new(["10.0.0.0/8"]).unwrap())
        .forwarded_header(fleetlimit::key::ForwardedHeader::Both);
    let app = app(RateLimitLayer::builder(limiter)
        .peer_ip(trusted)
        .build()
        .unwrap());
    // A client spoofing X-Forwarded-For directly: ignored, its own address counts.
    let spoof = |n: u8| {
        Req::get("/")
            .peer([203, 0, 113, 50])
            .header("x-forwarded-for", &format!("1.1.1.{n}"))
    };
    assert_eq!(spoof(1).send(&app).await.status(), StatusCode::OK);
    assert_eq!(
        spoof(2).send(&app).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a fresh XFF is no fresh bucket"
    );
    // Through the trusted proxy: the right-most untrusted hop, not the client's own left-most claim.
    let via_proxy = |claimed: &str| {
        Req::get("/").peer([10, 0, 0, 5]).header(
            "x-forwarded-for",
            &format!("{claimed}, 198.51.100.77, 10.0.0.9"),
        )
    };
    assert_eq!(
        via_proxy("6.6.6.1").send(&app).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        via_proxy("6.6.6.2").send(&app).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Forwarded (RFC 7239) too.
    let fwd = Req::get("/").peer([10, 0, 0, 5]).header(
        "forwarded",
        "for=192.0.2.60;proto=https, for=\"[2001:db8:cafe::17]:4711\"",
    );
    assert_eq!(fwd.send(&app).await.status(), StatusCode::OK);
    let same_64 = Req::get("/")
        .peer([10, 0, 0, 5])
        .header("forwarded", "for=\"[2001:db8:cafe::99]\"");
    assert_eq!(
        same_64.send(&app).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "one /64, one bucket"
    );
}

#[tokio::test]
async fn a_client_forwarded_header_passed_through_by_an_xff_proxy_is_ignored() {
    // The default reads only X-Forwarded-For, what the proxy appends; a `Forwarded` header the
    // client wrote itself (and the proxy passed through) cannot pick the client's address.
    let limiter = memory_limiter(vec![rule("ip", 1)]);
    let trusted = PeerIp::default().trust(TrustedProxies::new(["10.0.0.0/8"]).unwrap());
    let app = app(RateLimitLayer::builder(limiter)
        .peer_ip(trusted)
        .build()
        .unwrap());
    let spoof = |n: u8| {
        Req::get("/")
            .peer([10, 0, 0, 5])
            .header("forwarded", &format!("for=6.6.6.{n}"))
            .header("x-forwarded-for", "198.51.100.9")
    };
    assert_eq!(spoof(1).send(&app).await.status(), StatusCode::OK);
    assert_eq!(
        spoof(2).send(&app).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn the_same_rule_and_key_twice_is_an_error() {
    let limiter = memory_limiter(vec![rule("r", 5)]);
    let k = fleetlimit::Key::new("k");
    let err = limiter
        .apply_to(fleetlimit::store::Op::Consume, &[("r", &k), ("r", &k)], 1)
        .await
        .unwrap_err();
    assert!(
        matches!(err, fleetlimit::Error::DuplicateTarget(_)),
        "{err}"
    );
}

#[tokio::test]
async fn ipv6_peers_in_one_64_share_a_bucket() {
    let limiter = memory_limiter(vec![rule("ip", 1)]);
    let app = app(RateLimitLayer::new(limiter));
    let send = |ip: &str| {
        let mut req = Request::get("/").body(Body::empty()).unwrap();
        req.extensions_mut()
            .insert(SocketAddr::new(ip.parse().unwrap(), 1));
        app.clone().oneshot(req)
    };
    assert_eq!(
        send("2001:db8:1:2::1").await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        send("2001:db8:1:2:ffff::9").await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send("2001:db8:1:3::1").await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn missing_keys_follow_the_configured_outcome() {
    let keyless = || Request::get("/").body(Body::empty()).unwrap();
    // No key and no peer address: the server cannot tell clients apart. Loud, never a bucket
    // silently shared by every client.
    let reject = app(RateLimitLayer::new(memory_limiter(vec![rule("r", 1)])));
    let r = reject.oneshot(keyless()).await.unwrap();
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = r.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"error":"no_rate_limit_key"}"#);
    let skip = app(RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .on_missing_key(MissingKey::Skip)
        .build()
        .unwrap());
    for _ in 0..3 {
        assert_eq!(
            skip.clone().oneshot(keyless()).await.unwrap().status(),
            StatusCode::OK
        );
    }
    let shared = app(RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .on_missing_key(MissingKey::Shared)
        .build()
        .unwrap());
    assert_eq!(
        shared.clone().oneshot(keyless()).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        shared.oneshot(keyless()).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A per-address rule in front of a key the client chooses, on a server that records no peer
/// address (axum served without connect info): each request is a 500 with an error logged, as
/// for a layer keyed by address, not a rule skipped for everyone while new API keys pass
/// unlimited. Set to `Skip` explicitly, the rule is skipped.
#[tokio::test]
async fn a_per_address_scope_without_a_peer_address_is_a_server_error() {
    let layer = |scope: Scope| {
        let limiter = memory_limiter(vec![rule("per-key", 100), rule("per-ip", 1)]);
        app(RateLimitLayer::builder(limiter)
            .key(key::header("x-api-key"))
            .scope("per-ip", scope)
            .build()
            .unwrap())
    };
    let send = |app: &Router, n: usize| {
        let req = Request::get("/")
            .header("x-api-key", format!("key-{n}"))
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(req)
    };
    for scope in [
        Scope::new().key_by_peer(),
        Scope::new().key(PeerIp::default()),
    ] {
        let app = layer(scope);
        for n in 0..3 {
            let r = send(&app, n).await.unwrap();
            assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
            let body = r.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, r#"{"error":"no_rate_limit_key"}"#);
        }
    }
    let skipped = layer(Scope::new().key_by_peer().on_missing_key(MissingKey::Skip));
    for n in 0..3 {
        assert_eq!(send(&skipped, n).await.unwrap().status(), StatusCode::OK);
    }
    // A layer told to skip requests without a key (a Unix socket) skips the scope too.
    let limiter = memory_limiter(vec![rule("per-key", 100), rule("per-ip", 1)]);
    let layer_skips = app(RateLimitLayer::builder(limiter)
        .key(key::header("x-api-key"))
        .on_missing_key(MissingKey::Skip)
        .scope("per-ip", Scope::new().key_by_peer())
        .build()
        .unwrap());
    for n in 0..3 {
        assert_eq!(
            send(&layer_skips, n).await.unwrap().status(),
            StatusCode::OK
        );
    }
}

#[tokio::test]
async fn problem_details_and_custom_denials() {
    let problem = app(RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .denial(Denial::Problem)
        .build()
        .unwrap());
    Req::get("/").send(&problem).await;
    let r = Req::get("/").send(&problem).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        h(&r, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let body: serde_json::Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["title"], "Too Many Requests");

    let custom = Denial::custom(|d| {
        let mut r = http::Response::new(bytes::Bytes::from(format!(
            "slow down, {} left",
            d.remaining
        )));
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        r
    });
    let custom = app(RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .denial(custom)
        .build()
        .unwrap());
    Req::get("/").send(&custom).await;
    let r = Req::get("/").send(&custom).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(h(&r, "retry-after").is_some() && h(&r, "ratelimit-limit").is_some());
    assert_eq!(
        r.into_body().collect().await.unwrap().to_bytes(),
        "slow down, 0 left"
    );
}

#[tokio::test]
async fn hostile_input_never_panics_and_has_a_defined_outcome() {
    // Both headers read, so the hostile `Forwarded` cases are really parsed.
    let trusted = PeerIp::default()
        .trust(TrustedProxies::private_networks())
        .forwarded_header(fleetlimit::key::ForwardedHeader::Both);
    let non_utf8 = HeaderValue::from_bytes(&[0xff, 0xfe, b'k', 0x80]).unwrap();
    let huge = HeaderValue::from_str(&"k".repeat(100_000)).unwrap();
    let chain = HeaderValue::from_str(&vec!["1.2.3.4"; 20_000].join(", ")).unwrap();
    let garbage =
        HeaderValue::from_str("for=\"[::1, ;;;\"\"\", _hidden, unknown, 999.1.1.1").unwrap();
    let case = |i: usize| match i {
        0 => Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("x-api-key", non_utf8.clone()),
        1 => Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("x-api-key", huge.clone()),
        2 => Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("x-forwarded-for", chain.clone()),
        3 => Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("forwarded", garbage.clone()),
        4 => Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("x-forwarded-for", non_utf8.clone()),
        _ => Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("forwarded", huge.clone()),
    };
    // Each case on a limit of 1: the same hostile request twice is one client, counted (a
    // request without a defined key would be refused as keyless, or counted elsewhere).
    for i in 0..6 {
        let limiter = memory_limiter(vec![rule("r", 1)]);
        let strict = app(RateLimitLayer::builder(limiter)
            .key(key::header("x-api-key"))
            .peer_ip(trusted.clone())
            .build()
            .unwrap());
        let started = std::time::Instant::now();
        assert_eq!(
            case(i).send(&strict).await.status(),
            StatusCode::OK,
            "case {i}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "case {i} took {:?}",
            started.elapsed()
        );
        assert_eq!(
            case(i).send(&strict).await.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "case {i}: the same request again is the same client"
        );
        // An API key, however hostile, or a forwarding chain with a client to find, is that
        // client's own bucket; a chain with none (garbage, or bytes no proxy writes) is the
        // proxy's own address, as if there were no chain.
        let proxy = Req::get("/")
            .peer([10, 1, 1, 1])
            .send(&strict)
            .await
            .status();
        let expected = if matches!(i, 3..=5) {
            StatusCode::TOO_MANY_REQUESTS
        } else {
            StatusCode::OK
        };
        assert_eq!(proxy, expected, "case {i}: the proxy's own bucket");
    }
    // Behind a trusted proxy, what the proxy appended decides: the client's own junk to the left
    // of it (20,000 hops here) never sends it to the proxy's bucket. A header the layer does not
    // read (`Forwarded`, by default) changes nothing: the proxy's own address.
    let limiter = memory_limiter(vec![rule("r", 1)]);
    let strict = app(RateLimitLayer::builder(limiter)
        .peer_ip(PeerIp::default().trust(TrustedProxies::private_networks()))
        .build()
        .unwrap());
    assert_eq!(
        Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("forwarded", garbage)
            .send(&strict)
            .await
            .status(),
        StatusCode::OK
    );
    let from_client = || {
        Req::get("/")
            .peer([10, 1, 1, 1])
            .raw_header("x-forwarded-for", chain.clone())
    };
    assert_eq!(from_client().send(&strict).await.status(), StatusCode::OK);
    assert_eq!(
        from_client().send(&strict).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "1.2.3.4 has its own bucket, and it is spent"
    );
}

#[tokio::test]
async fn unknown_scope_rule_is_an_error_when_the_layer_is_built() {
    let err = RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .scope("nope", Scope::new())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("nope"));
}

/// axum's `get()` serves HEAD with the GET handler: a HEAD request must not go around a limit
/// scoped to GET.
#[tokio::test]
async fn head_counts_against_a_get_scope() {
    let app = app(
        RateLimitLayer::builder(memory_limiter(vec![rule("reads", 2)]))
            .scope("reads", Scope::new().route(Method::GET, "/"))
            .build()
            .unwrap(),
    );
    let head = || Req {
        method: Method::HEAD,
        ..Req::get("/")
    };
    assert_eq!(head().send(&app).await.status(), StatusCode::OK);
    assert_eq!(Req::get("/").send(&app).await.status(), StatusCode::OK);
    assert_eq!(
        head().send(&app).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A scope's own key missing from a request is the client's doing: by default the rule is
/// skipped; `Reject` answers 400. Never a 500.
#[tokio::test]
async fn a_missing_scope_key_is_never_a_server_error() {
    let scoped = |missing: Option<MissingKey>| {
        let mut scope = Scope::new().key(key::header("x-account"));
        if let Some(m) = missing {
            scope = scope.on_missing_key(m);
        }
        app(
            RateLimitLayer::builder(memory_limiter(vec![rule("per-account", 1)]))
                .scope("per-account", scope)
                .build()
                .unwrap(),
        )
    };
    let default = scoped(None);
    for _ in 0..3 {
        assert_eq!(Req::get("/").send(&default).await.status(), StatusCode::OK);
    }
    let with = || Req::get("/").header("x-account", "a");
    assert_eq!(with().send(&default).await.status(), StatusCode::OK);
    assert_eq!(
        with().send(&default).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let strict = scoped(Some(MissingKey::Reject));
    let r = Req::get("/").send(&strict).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let body = r.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"error":"missing_rate_limit_key"}"#);
}

#[tokio::test]
async fn header_keys_take_any_case_and_bad_names_fail_the_build() {
    let app = app(RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .key(key::header("X-Api-Key"))
        .build()
        .unwrap());
    let with = |k: &str| Req::get("/").header("x-api-key", k);
    assert_eq!(with("a").send(&app).await.status(), StatusCode::OK);
    assert_eq!(
        with("a").send(&app).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let err = RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .key(key::header("bad name"))
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, fleetlimit::ConfigError::Invalid { setting, .. } if *setting == "key header"),
        "{err:?}"
    );
    let err = RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .scope("r", Scope::new().key(key::header("x\ny")))
        .build();
    assert!(err.is_err());
}

/// A custom denial keeps the rate-limit headers it set itself; the others are added.
#[tokio::test]
async fn a_custom_denial_keeps_its_own_headers() {
    let custom = Denial::custom(|_| {
        let mut r = http::Response::new(bytes::Bytes::from_static(b"no"));
        *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        r.headers_mut()
            .insert("ratelimit-limit", HeaderValue::from_static("mine"));
        r
    });
    let app = app(RateLimitLayer::builder(memory_limiter(vec![rule("r", 1)]))
        .denial(custom)
        .build()
        .unwrap());
    Req::get("/").send(&app).await;
    let r = Req::get("/").send(&app).await;
    assert_eq!(h(&r, "ratelimit-limit").as_deref(), Some("mine"));
    assert_eq!(h(&r, "ratelimit-remaining").as_deref(), Some("0"));
}

/// A quota lowered while the handler runs (a rules reload under a long request): the IETF
/// headers describe the decision that admitted the request, `q` included. Read from the rules
/// at the response, they said `q=10` beside `r=99`: more left than the budget.
#[tokio::test]
async fn ietf_headers_describe_the_quota_that_decided() {
    let limiter = Limiter::builder(MemoryStore::new())
        .rule(
            Rule::new(
                "api",
                Quota::per_minute(100)
                    .algorithm(Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        )
        .build()
        .unwrap();
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let wait = std::sync::Arc::new(std::sync::Mutex::new(Some(wait)));
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let wait = wait.lock().unwrap().take();
                async move {
                    if let Some(wait) = wait {
                        let _ = wait.await;
                    }
                    "ok"
                }
            }),
        )
        .layer(
            RateLimitLayer::builder(limiter.clone())
                .key(key::global())
                .headers(HeaderStyle::Ietf)
                .build()
                .unwrap(),
        );
    let request = tokio::spawn(app.oneshot(Request::get("/").body(Body::empty()).unwrap()));
    tokio::task::yield_now().await;
    limiter
        .set_quota(
            "api",
            Quota::per_minute(10)
                .algorithm(Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
    go.send(()).unwrap();
    let response = request.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let header = |name: &str| response.headers()[name].to_str().unwrap().to_owned();
    assert!(
        header("ratelimit-policy").starts_with("\"api\";q=100;"),
        "{}",
        header("ratelimit-policy")
    );
    assert!(
        header("ratelimit").starts_with("\"api\";r=99;"),
        "{}",
        header("ratelimit")
    );
}
