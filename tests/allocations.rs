//! What the layer allocates per request on its hot path, counted by a global allocator: a
//! decision on the memory store (every algorithm but the log, whose entries are its state) and
//! on a leased Redis key, admitted and refused, through axum as `axum::serve` runs a router,
//! against the same router behind a layer that does nothing.
//!
//! The decision itself (the key, the targets, the store or the leased block, the headers, the
//! denial's body, the futures) allocates nothing. Two allocations remain on an admission, both
//! of the API's shape rather than the decision's: the `RateLimitInfo` extension
//! (`http::Extensions` boxes every value), and axum boxing the layer's response body again
//! (`axum::body::Body::new` keeps only its own type unboxed). A refusal's own response takes the
//! place of the handler's, and costs one allocation more than it.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use fleetlimit::store::{MemoryStore, RedisStore};
use fleetlimit::{
    Algorithm, HeaderStyle, LeaseConfig, Limiter, OnStoreError, Quota, RateLimitLayer, Rule,
};
use http::{Request, Response, StatusCode};
use http_body::Body as _;
use support::redis::RedisServer;
use tower::{Service, ServiceExt};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn tally() {
    // `try_with`: the thread may be exiting, its locals gone.
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// thread-local cells that never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        tally();
        // SAFETY: the caller's contract is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        tally();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        tally();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const PEER: [u8; 4] = [203, 0, 113, 7];

/// A request as axum's server hands it to the router: the peer's address in its extensions.
fn request() -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((PEER, 40_000))));
    req
}

fn poll_now<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(output) => output,
        // A leased key is decided without waiting, like the memory store.
        Poll::Pending => panic!("the call waited: it was not decided on the hot path"),
    }
}

/// Serve one request to its end (the body read, the response dropped) on this thread, and
/// count the allocations made from the call on. The request is built before counting.
fn serve_counted(router: &mut Router, req: Request<Body>) -> (StatusCode, u64) {
    let mut cx = Context::from_waker(Waker::noop());
    assert!(<Router as Service<Request<Body>>>::poll_ready(router, &mut cx).is_ready());
    COUNTING.with(|on| on.set(true));
    let before = ALLOCATIONS.with(Cell::get);
    let response: Response<Body> = match poll_now(router.call(req)) {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let mut body = response.into_body();
    while let Poll::Ready(Some(frame)) = std::pin::Pin::new(&mut body).poll_frame(&mut cx) {
        drop(frame);
    }
    drop(body);
    let counted = ALLOCATIONS.with(Cell::get) - before;
    COUNTING.with(|on| on.set(false));
    (status, counted)
}

/// Allocations per request over `n` requests, after `warm` that fill lazily built tables (the
/// store's entry for the key, header values, buffers).
fn per_request(router: &mut Router, expect: StatusCode, warm: usize, n: u64) -> f64 {
    for _ in 0..warm {
        let (status, _) = serve_counted(router, request());
        assert_eq!(status, expect);
    }
    let mut total = 0;
    for _ in 0..n {
        let (status, counted) = serve_counted(router, request());
        assert_eq!(status, expect);
        total += counted;
    }
    total as f64 / n as f64
}

fn app() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

/// A router as `axum::serve` runs it: its handlers made into services once, not per request.
fn served(router: Router) -> Router {
    router.with_state(())
}

fn with_layer(limiter: Limiter) -> Router {
    served(app().layer(RateLimitLayer::new(limiter)))
}

/// The same router behind a layer that does nothing (it maps each response to itself): what
/// axum's `Router::layer` costs any layer per request (a clone of the layered route, a box for
/// its future).
fn with_any_layer() -> Router {
    served(app().layer(tower::util::MapResponseLayer::new(
        |response: Response<Body>| response,
    )))
}

/// What the rate-limit layer allocates per admitted request beyond a layer that does nothing:
/// the `RateLimitInfo` extension on the request, and axum boxing the layer's response body again.
const ADMITTED_EXTRA: f64 = 2.0;
/// What a refusal allocates beyond a layer that does nothing. The route is not called: the
/// refusal's own response (its header map, its extensions with the `RateLimitInfo`, its body
/// boxed by axum) takes the place of the handler's, one allocation more than the handler's own.
/// Its JSON body is carved from a shared buffer, not allocated.
const REFUSED_EXTRA: f64 = 1.0;
/// Header values for numbers past the static table and denial bodies share a 4 KiB buffer:
/// two allocations per about 80 denial bodies (0.025 per refusal), fewer for numbers alone.
const AMORTISED: f64 = 0.03;

fn check(any_layer: f64, allowed: f64, denied: f64) {
    check_within(any_layer, allowed, denied, AMORTISED);
}

/// [`check`], with `amortised` for what the shared buffer's refills cost per request.
fn check_within(any_layer: f64, allowed: f64, denied: f64, amortised: f64) {
    eprintln!(
        "allocations per request: any layer {any_layer:.3}, admitted {allowed:.3}, refused {denied:.3}"
    );
    for (what, n, extra) in [
        ("an admitted", allowed, ADMITTED_EXTRA),
        ("a refused", denied, REFUSED_EXTRA),
    ] {
        assert!(
            (n - any_layer - extra).abs() <= amortised,
            "{what} request allocates {n:.3} per request, a layer that does nothing \
             {any_layer:.3}: expected exactly {extra} more"
        );
    }
}

#[test]
fn the_memory_store_decides_without_allocating() {
    let any_layer = per_request(&mut with_any_layer(), StatusCode::OK, 50, 1_000);
    // The default algorithm and the defaults of the layer; a quota no test run exhausts, with
    // remainders past the static table of small numbers.
    let roomy = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("api", Quota::per_second(1_000_000).build().unwrap()).unwrap())
        .build()
        .unwrap();
    let allowed = per_request(&mut with_layer(roomy), StatusCode::OK, 50, 1_000);
    let tight = Limiter::builder(MemoryStore::new())
        .rule(Rule::new("api", Quota::per_hour(1).build().unwrap()).unwrap())
        .build()
        .unwrap();
    let mut refused = with_layer(tight);
    let (first, _) = serve_counted(&mut refused, request());
    assert_eq!(first, StatusCode::OK);
    let denied = per_request(&mut refused, StatusCode::TOO_MANY_REQUESTS, 50, 1_000);
    check(any_layer, allowed, denied);
}

/// With a key listed somewhere in the store (an operator's deny, a penalty block), every
/// decision looks its keys up in the listings: that allocated a vector per decision.
#[test]
fn a_listed_key_elsewhere_costs_no_allocation() {
    let any_layer = per_request(&mut with_any_layer(), StatusCode::OK, 50, 1_000);
    let limiter = |quota: Quota| {
        use fleetlimit::store::{Listing, Store};
        let store = MemoryStore::new();
        let other = fleetlimit::Key::new("someone-else");
        poll_now(store.set_listing(&other, Some(Listing::Deny))).unwrap();
        Limiter::builder(store)
            .rule(Rule::new("api", quota).unwrap())
            .build()
            .unwrap()
    };
    let roomy = limiter(Quota::per_second(1_000_000).build().unwrap());
    let allowed = per_request(&mut with_layer(roomy), StatusCode::OK, 50, 1_000);
    let mut refused = with_layer(limiter(Quota::per_hour(1).build().unwrap()));
    let (first, _) = serve_counted(&mut refused, request());
    assert_eq!(first, StatusCode::OK);
    let denied = per_request(&mut refused, StatusCode::TOO_MANY_REQUESTS, 50, 1_000);
    check(any_layer, allowed, denied);
}

#[test]
fn every_algorithm_decides_without_allocating() {
    let any_layer = per_request(&mut with_any_layer(), StatusCode::OK, 50, 500);
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let quota = Quota::per_second(1_000_000)
            .algorithm(algorithm)
            .build()
            .unwrap();
        let limiter = Limiter::builder(MemoryStore::new())
            .rule(Rule::new("api", quota).unwrap())
            .build()
            .unwrap();
        let allowed = per_request(&mut with_layer(limiter), StatusCode::OK, 50, 500);
        eprintln!("{algorithm:?}: {allowed:.3} per request, any layer {any_layer:.3}");
        assert!(
            (allowed - any_layer - ADMITTED_EXTRA).abs() <= AMORTISED,
            "{algorithm:?}: {allowed:.3} per admitted request against {any_layer:.3}"
        );
    }
}

#[test]
fn every_header_style_writes_without_allocating() {
    let any_layer = per_request(&mut with_any_layer(), StatusCode::OK, 50, 500);
    for style in [
        HeaderStyle::Draft6,
        HeaderStyle::Legacy,
        HeaderStyle::Ietf,
        HeaderStyle::None,
    ] {
        let layer = |quota: Quota| {
            let limiter = Limiter::builder(MemoryStore::new())
                .rule(Rule::new("api", quota).unwrap())
                .build()
                .unwrap();
            served(
                app().layer(
                    RateLimitLayer::builder(limiter)
                        .headers(style)
                        .build()
                        .unwrap(),
                ),
            )
        };
        let allowed = per_request(
            &mut layer(Quota::per_second(1_000_000).build().unwrap()),
            StatusCode::OK,
            50,
            500,
        );
        let mut refusing = layer(Quota::per_hour(1).build().unwrap());
        let (first, _) = serve_counted(&mut refusing, request());
        assert_eq!(first, StatusCode::OK);
        let denied = per_request(&mut refusing, StatusCode::TOO_MANY_REQUESTS, 50, 500);
        eprintln!(
            "{style:?}: admitted {allowed:.3}, refused {denied:.3}, any layer {any_layer:.3}"
        );
        // The IETF style's two lists (about 50 bytes per response) are carved from the shared
        // buffer too: a refusal's lists and body fill it about twice as fast.
        let amortised = if style == HeaderStyle::Ietf {
            2.0 * AMORTISED
        } else {
            AMORTISED
        };
        check_within(any_layer, allowed, denied, amortised);
    }
}

#[test]
fn a_leased_key_decides_without_allocating() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limiter = |name: &str, limit: u64, period: Duration| {
        runtime.block_on(async {
            let store = RedisStore::builder()
                .connect_timeout(Duration::from_secs(2))
                .connect(&server.url())
                .await
                .unwrap();
            Limiter::builder(store)
                .rule(Rule::new(name, Quota::new(limit, period).build().unwrap()).unwrap())
                .on_store_error(OnStoreError::fail_closed())
                // The default promotion; blocks valid long enough that none expires while
                // this test counts (an expiry makes the next request wait for a refill).
                .lease(
                    name,
                    LeaseConfig::fixed(100_000).max_validity(Duration::from_secs(30)),
                )
                .build()
                .unwrap()
        })
    };
    let any_layer = per_request(&mut with_any_layer(), StatusCode::OK, 50, 1_000);

    // Take the first block with the runtime driving the store; from then on the key is
    // decided from the block, in the call.
    // A day's period: the default sliding window ends a block with its sub-window (a
    // twentieth of the period), and one ending while this test counts would make the next
    // request wait for a refill.
    let hot = limiter("hot", 10_000_000, Duration::from_secs(86_400));
    let mut leased = with_layer(hot.clone());
    runtime.block_on(async {
        // Hot enough to be promoted at the default rate, then one more to take a block.
        for _ in 0..20_000 {
            let response = leased.clone().oneshot(request()).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            if hot.stats().leased_keys == 1 && hot.stats().lease_calls >= 1 {
                break;
            }
        }
    });
    assert_eq!(hot.stats().leased_keys, 1, "the key is leased");
    let calls = hot.stats().lease_calls;
    let allowed = per_request(&mut leased, StatusCode::OK, 10, 1_000);
    assert_eq!(
        hot.stats().lease_calls,
        calls,
        "every counted request spent the block"
    );

    // A key the store refused: the denial is remembered and answered in the call.
    let refused = limiter("cold", 1, Duration::from_secs(3600));
    let mut refusing = with_layer(refused);
    runtime.block_on(async {
        for expect in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
            let response = refusing.clone().oneshot(request()).await.unwrap();
            assert_eq!(response.status(), expect);
        }
    });
    let denied = per_request(&mut refusing, StatusCode::TOO_MANY_REQUESTS, 10, 1_000);
    check(any_layer, allowed, denied);
}
