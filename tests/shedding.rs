//! Priority load shedding under overload, on loopback: critical requests get through while best
//! effort is shed, recovery is gradual; the fleet budget keeps a share for critical traffic.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use fleetlimit::concurrency::{ConcurrencyLimitLayer, ConcurrencyLimiter};
use fleetlimit::shed::{FleetUsage, LoadShedLayer, Priority, Shed, ShedReason, WorkerUtilisation};
use fleetlimit::store::RedisStore;
use fleetlimit::{key, MemoryStore, OnStoreError};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::redis::RedisServer;
use tower::ServiceExt;

fn classify(parts: &axum::http::request::Parts) -> Priority {
    match parts.headers.get("x-priority").map(|v| v.as_bytes()) {
        Some(b"critical") => Priority::Critical,
        Some(b"normal") => Priority::Normal,
        _ => Priority::BestEffort,
    }
}

fn slow_app(handler_ms: u64) -> Router {
    Router::new().route(
        "/",
        get(move || async move {
            tokio::time::sleep(Duration::from_millis(handler_ms)).await;
            "ok"
        }),
    )
}

/// Handlers that say when a request arrives and then wait for a permit of `Gate::open`: every
/// admitted request holds what it holds until the test lets it go.
struct Gate {
    permits: Arc<tokio::sync::Semaphore>,
    arrived: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Gate {
    /// A gate, and the arrivals at its handlers.
    fn new() -> (Gate, tokio::sync::mpsc::UnboundedReceiver<()>) {
        let (arrived, arrivals) = tokio::sync::mpsc::unbounded_channel();
        let permits = Arc::new(tokio::sync::Semaphore::new(0));
        (Gate { permits, arrived }, arrivals)
    }

    /// A router whose one handler waits at this gate.
    fn app(&self) -> Router {
        let (permits, arrived) = (self.permits.clone(), self.arrived.clone());
        Router::new().route(
            "/",
            get(move || {
                let (permits, arrived) = (permits.clone(), arrived.clone());
                async move {
                    let _ = arrived.send(());
                    let _ = permits.acquire().await;
                    "ok"
                }
            }),
        )
    }

    /// Let `n` waiting handlers answer.
    fn open(&self, n: usize) {
        self.permits.add_permits(n);
    }
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    shed: AtomicU64,
}

/// 40 clients on loopback for 2 s against one worker with a target of 8 in flight: 4 send
/// critical requests, 18 normal, 18 best effort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn critical_requests_get_through_an_overload_and_recovery_is_gradual() {
    // The worker's clock follows real time through the overload, then is stepped by hand.
    let clock = fleetlimit::ManualClock::new(1_735_689_600_000_000);
    let worker = WorkerUtilisation::with_clock(8, clock.clone());
    let ticking = tokio::spawn({
        let clock = clock.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                clock.advance(Duration::from_millis(10));
            }
        }
    });
    let app = slow_app(20).layer(
        LoadShedLayer::builder(classify)
            .worker(worker.clone())
            .build()
            .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let send = {
        let client = client.clone();
        move |priority: &'static str| {
            let client = client.clone();
            async move {
                let req = Request::get(format!("http://{addr}/"))
                    .header("x-priority", priority)
                    .body(Body::empty())
                    .unwrap();
                let response = client.request(req).await.unwrap();
                let status = response.status();
                response.into_body().collect().await.unwrap();
                status
            }
        }
    };
    let (critical, normal, best_effort) = (
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
    );
    let highest = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(2);
    let clients: Vec<_> = (0..40)
        .map(|i| {
            let send = send.clone();
            let (tally, priority) = match i {
                0..4 => (critical.clone(), "critical"),
                4..22 => (normal.clone(), "normal"),
                _ => (best_effort.clone(), "best-effort"),
            };
            let (worker, highest) = (worker.clone(), highest.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    match send(priority).await {
                        StatusCode::OK => tally.ok.fetch_add(1, Ordering::Relaxed),
                        StatusCode::SERVICE_UNAVAILABLE => {
                            tally.shed.fetch_add(1, Ordering::Relaxed)
                        }
                        other => panic!("{other}"),
                    };
                    highest.fetch_max(u64::from(worker.level()), Ordering::Relaxed);
                }
            })
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    let (c_ok, c_shed) = (
        critical.ok.load(Ordering::Relaxed),
        critical.shed.load(Ordering::Relaxed),
    );
    let (b_ok, b_shed) = (
        best_effort.ok.load(Ordering::Relaxed),
        best_effort.shed.load(Ordering::Relaxed),
    );
    assert!(
        c_ok > 0 && c_ok * 100 >= (c_ok + c_shed) * 99,
        "critical {c_ok} ok, {c_shed} shed"
    );
    assert!(b_shed > b_ok, "best effort: {b_ok} ok, {b_shed} shed");
    let top = highest.load(Ordering::Relaxed);
    assert!(
        top >= 2,
        "the worker shed best effort, then normal traffic: level {top}"
    );
    let n_shed = normal.shed.load(Ordering::Relaxed);
    assert!(n_shed > 0, "normal traffic was shed too");

    // The overload ends; a trickle of normal requests: the level steps down one a second of
    // quiet, one step each second the clock moves, however the requests come.
    ticking.abort();
    let top = worker.level();
    assert!(
        top >= 2,
        "the overload ends at level 2 or more, so the steps down are seen: {top}"
    );
    send("normal").await;
    assert_eq!(worker.level(), top, "requests alone step nothing");
    // The first step is due within a second (the quiet began with the overload's end, at a
    // moment this test does not see); each next one a second after it.
    for expected in (0..top).rev() {
        clock.advance(Duration::from_secs(1));
        send("normal").await;
        assert_eq!(worker.level(), expected, "one level a second, not a cliff");
    }
    assert_eq!(send("best-effort").await, StatusCode::OK, "recovered");
    server.abort();
}

/// Two instances share a fleet budget of 10 in flight on Redis, at the default shares: best
/// effort fills half of it, normal traffic up to 70%, and the rest is critical traffic's alone,
/// to the last slot. Handlers wait on a gate, so every admitted request holds its slot until
/// the end.
#[tokio::test]
async fn the_fleet_budget_keeps_a_share_for_critical_traffic() {
    let redis = RedisServer::start();
    let (gate, mut arrivals) = Gate::new();
    let mut apps = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::connect(&redis.url()).await.unwrap();
        let slots = ConcurrencyLimiter::builder(store, "fleet", 10)
            .on_store_error(OnStoreError::FailOpen)
            .deadline(Duration::from_secs(2))
            .build()
            .unwrap();
        apps.push(
            gate.app().layer(
                LoadShedLayer::builder(classify)
                    .fleet(FleetUsage::new(slots))
                    .build()
                    .unwrap(),
            ),
        );
    }
    let call = |app: Router, priority: &'static str| async move {
        let req = Request::get("/")
            .header("x-priority", priority)
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(req).await.unwrap();
        let shed = response.extensions().get::<Shed>().copied();
        let status = response.status();
        let retry = response.headers().get("retry-after").cloned();
        response.into_body().collect().await.unwrap();
        (status, shed, retry)
    };
    let mut admitted = Vec::new();
    // Sent one at a time: an admitted request arrives at its handler and waits there, a shed
    // one answers at once.
    for (priority, expected) in [("best-effort", 5), ("normal", 2), ("critical", 3)] {
        let rank = match priority {
            "best-effort" => Priority::BestEffort,
            "normal" => Priority::Normal,
            _ => Priority::Critical,
        };
        for i in 0..=expected {
            let mut task = tokio::spawn(call(apps[i % 2].clone(), priority));
            tokio::select! {
                arrival = arrivals.recv() => {
                    arrival.unwrap();
                    assert!(i < expected, "{priority}: more than {expected} admitted");
                    admitted.push(task);
                }
                answer = &mut task => {
                    let (status, shed, retry) = answer.unwrap();
                    assert_eq!(i, expected, "{priority}: shed after {i} admitted, not {expected}");
                    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
                    assert_eq!(shed, Some(Shed { priority: rank, reason: ShedReason::FleetUsage }));
                    assert_eq!(retry.unwrap(), "1");
                }
            }
        }
    }
    gate.open(admitted.len());
    for task in admitted {
        assert_eq!(task.await.unwrap().0, StatusCode::OK);
    }
}

/// Failing closed while the fleet budget's store is away: every priority gets the policy's
/// wait in whole seconds, rounded up, and the reason says it is the store, not the budget.
#[tokio::test]
async fn an_outage_failing_closed_sheds_with_the_policys_wait() {
    let mut redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let slots = ConcurrencyLimiter::builder(store, "fleet", 8)
        .on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_millis(29_500),
        })
        .build()
        .unwrap();
    let app = slow_app(0).layer(
        LoadShedLayer::builder(classify)
            .fleet(FleetUsage::new(slots))
            .build()
            .unwrap(),
    );
    redis.kill();
    for (priority, rank, grpc) in [
        ("critical", Priority::Critical, false),
        ("best-effort", Priority::BestEffort, false),
        ("critical", Priority::Critical, true),
    ] {
        let mut req = Request::get("/").header("x-priority", priority);
        if grpc {
            req = Request::post("/")
                .header("x-priority", priority)
                .header("content-type", "application/grpc");
        }
        let response = app
            .clone()
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let shed = response.extensions().get::<Shed>().copied();
        assert_eq!(
            shed,
            Some(Shed {
                priority: rank,
                reason: ShedReason::StoreUnavailable
            })
        );
        assert_eq!(response.headers()["retry-after"], "30");
        if grpc {
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(response.headers()["grpc-status"], "14");
            // gRPC clients read this, not `Retry-After`: the wait to the millisecond.
            assert_eq!(response.headers()["grpc-retry-pushback-ms"], "29500");
        } else {
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert!(!response.headers().contains_key("grpc-retry-pushback-ms"));
        }
    }
}

/// While the store is away, `LocalShare` holds the budget in each process, and the priorities'
/// shares hold as fractions of those local slots: a budget of 8 over 4 servers is 2 here, best
/// effort may hold 1 of them and critical requests the rest. (The local slots were once capped
/// at each priority's fleet-wide count, 4 for best effort, so best effort took both.)
#[tokio::test]
async fn in_an_outage_the_local_slots_keep_the_priorities_shares() {
    let mut redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let slots = ConcurrencyLimiter::builder(store, "fleet", 8)
        .on_store_error(OnStoreError::LocalShare(4))
        .deadline(Duration::from_millis(200))
        .build()
        .unwrap();
    let (gate, mut arrivals) = Gate::new();
    let app = gate.app().layer(
        LoadShedLayer::builder(classify)
            .fleet(FleetUsage::new(slots))
            .build()
            .unwrap(),
    );
    redis.kill();
    let call = |priority: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::get("/")
                .header("x-priority", priority)
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(req).await.unwrap();
            let status = response.status();
            response.into_body().collect().await.unwrap();
            status
        }
    };
    let first = tokio::spawn(call("best-effort"));
    arrivals.recv().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(5), call("best-effort")).await;
    assert_eq!(
        second.ok(),
        Some(StatusCode::SERVICE_UNAVAILABLE),
        "best effort's share of the 2 local slots is 1"
    );
    let critical = tokio::spawn(call("critical"));
    let entered = tokio::time::timeout(Duration::from_secs(5), arrivals.recv()).await;
    assert!(entered.is_ok(), "the critical request gets a slot");
    gate.open(2);
    assert_eq!(critical.await.unwrap(), StatusCode::OK);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
}

/// One limiter's name serving both the fleet budget and a per-client limit: a client whose key
/// is literally `fleet` holds its own slots, never the fleet budget's (the budget's key was
/// once `Key::new("fleet")`, and that client took the budget's only slot).
#[tokio::test]
async fn a_client_keyed_fleet_never_holds_the_fleet_budget() {
    let slots = ConcurrencyLimiter::builder(MemoryStore::new(), "in-flight", 1)
        .build()
        .unwrap();
    let (gate, mut arrivals) = Gate::new();
    let per_client = gate.app().layer(
        ConcurrencyLimitLayer::builder(slots.clone())
            .key(key::header("x-api-key"))
            .build()
            .unwrap(),
    );
    let fleet = slow_app(0).layer(
        LoadShedLayer::builder(classify)
            .fleet(FleetUsage::new(slots))
            .build()
            .unwrap(),
    );
    let req = Request::get("/")
        .header("x-api-key", "fleet")
        .body(Body::empty())
        .unwrap();
    let held = tokio::spawn(per_client.oneshot(req));
    arrivals.recv().await.unwrap();
    let req = Request::get("/")
        .header("x-priority", "critical")
        .body(Body::empty())
        .unwrap();
    let r = fleet.oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "the budget's slot is free");
    gate.open(1);
    assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
}
