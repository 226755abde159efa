//! The demo server's command-line contract, run as users run it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn server_binary() -> PathBuf {
    // target/debug/deps/server_cli-… → target/debug/examples/server
    let mut p = std::env::current_exe().unwrap();
    p.pop();
    p.pop();
    p.push("examples");
    p.push(format!("server{}", std::env::consts::EXE_SUFFIX));
    assert!(
        p.exists(),
        "build the example first: cargo build --all-features --examples ({p:?})"
    );
    // `cargo test` builds the example as a test harness, not this binary: one older than its
    // sources would test the contract of code that is gone. Its sources are what cargo says
    // it was built from (its dep-info file beside it), so the check agrees with what a build
    // would redo.
    let built = std::fs::metadata(&p).and_then(|m| m.modified()).unwrap();
    let info = std::fs::read_to_string(p.with_extension("d")).unwrap_or_default();
    let first = info.lines().next().unwrap_or_default();
    let deps = first.split_once(": ").map_or("", |(_, deps)| deps);
    // Paths are separated by spaces; a space inside one is escaped.
    let sources: Vec<PathBuf> = deps
        .replace("\\ ", "\u{0}")
        .split(' ')
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d.replace('\u{0}', " ")))
        .collect();
    assert!(!sources.is_empty(), "no dep-info beside {p:?}");
    for source in sources {
        let changed = std::fs::metadata(&source)
            .and_then(|m| m.modified())
            .unwrap();
        assert!(
            changed <= built,
            "{p:?} is older than {source:?}: build it again (cargo build --all-features --examples)"
        );
    }
    p
}

/// Kills the server (by its PID, via `Child`) even when an assertion fails.
struct Server(Child, u16);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(args: &[&str]) -> Server {
    let child = Command::new(server_binary())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Owned before anything can fail, so that a failure kills it.
    let mut server = Server(child, 0);
    server.1 = listening_port(&mut server);
    server
}

/// The port of the server's first line, `listening on http://127.0.0.1:PORT`, read within 30 s
/// (a server that never says it fails the test, killed, rather than holding the suite).
fn listening_port(server: &mut Server) -> u16 {
    let stdout = server.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the server said nothing within 30 s");
    line.trim()
        .strip_prefix("listening on http://127.0.0.1:")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap()
}

/// Run the server to its exit. One still running after 30 s (a command line it should have
/// refused, now serving) is killed and fails the test rather than holding the suite.
fn run_to_exit<A: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[A]) -> std::process::Output {
    let mut child = Command::new(server_binary())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let began = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if began.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?} still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn get(port: u16, api_key: Option<&str>) -> String {
    get_path(port, "/", api_key)
}

fn get_path(port: u16, path: &str, api_key: Option<&str>) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let key = api_key
        .map(|k| format!("x-api-key: {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn status(response: &str) -> u16 {
    response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"))
}

/// The README's first command as it shows it: no flags but the port, the defaults (100 a
/// minute per key, the sliding window counter, draft-6 headers): `ratelimit-limit: 100`,
/// `ratelimit-remaining: 99`, `ratelimit-reset` up to 63 (a period and the rest of the
/// request's sub-window), and the 101st request refused with its JSON body and a
/// `Retry-After` in whole seconds.
#[test]
fn the_defaults_answer_as_the_readme_shows() {
    let server = start(&["--port", "0"]);
    let header = |response: &str, name: &str| -> String {
        response
            .lines()
            .find_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
            })
            .unwrap_or_else(|| panic!("no {name}: {response}"))
    };
    let first = get(server.1, Some("demo"));
    assert_eq!(status(&first), 200, "{first}");
    assert_eq!(header(&first, "ratelimit-limit"), "100");
    assert_eq!(header(&first, "ratelimit-remaining"), "99");
    let reset: u64 = header(&first, "ratelimit-reset").parse().unwrap();
    assert!((61..=63).contains(&reset), "{first}");
    for _ in 1..100 {
        assert_eq!(status(&get(server.1, Some("demo"))), 200);
    }
    let refused = get(server.1, Some("demo"));
    assert_eq!(status(&refused), 429, "{refused}");
    assert_eq!(header(&refused, "ratelimit-remaining"), "0");
    let retry: u64 = header(&refused, "retry-after").parse().unwrap();
    assert!((1..=63).contains(&retry), "{refused}");
    let body = body_of(&refused);
    assert!(
        body.starts_with(r#"{"error":"rate_limited","retry_after_ms":"#),
        "{body}"
    );
}

#[test]
fn serves_and_limits_per_api_key_then_peer() {
    let server = start(&[
        "--port",
        "0",
        "--algorithm",
        "gcra",
        "--limit",
        "2",
        "--period",
        "1h",
    ]);
    let first = get(server.1, Some("a"));
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(first.ends_with("ok"), "{first}");
    assert!(
        first
            .to_ascii_lowercase()
            .contains("ratelimit-remaining: 1"),
        "{first}"
    );
    assert!(get(server.1, Some("a")).starts_with("HTTP/1.1 200"));
    let denied = get(server.1, Some("a"));
    assert!(denied.starts_with("HTTP/1.1 429"), "{denied}");
    assert!(
        denied.to_ascii_lowercase().contains("retry-after: 1800"),
        "{denied}"
    );
    // No API key: the peer address has its own bucket.
    assert!(get(server.1, None).starts_with("HTTP/1.1 200"));
}

#[test]
fn invalid_flags_exit_2_with_a_message() {
    for args in [
        &["--limit", "0"][..],
        &["--limit", "+5"],
        &["--limit", "5", "--limit", "6"],
        &["--period", "10"],
        &["--algorithm", "leaky-bucket"],
        &["--burst", "5"],
        &["--port", "70000"],
        &["--frobnicate"],
        &["--lease", "0"],
        &["--algorithm", "sliding-log", "--lease", "auto"],
        &["--lease", "auto", "--algorithm", "sliding-log"],
        &["--max-keys", "1"],
        &["--refund-status", "600-500"],
        &[
            "--store",
            "redis://127.0.0.1:1",
            "--on-store-error",
            "open",
            "--max-keys",
            "100",
        ],
        &[
            "--store",
            "redis://127.0.0.1:notaport",
            "--on-store-error",
            "open",
        ],
        &["--trusted-proxies", "10.0.0.0/33"],
        &["--trusted-proxies", "0.0.0.0/0"],
        &["--trusted-hops", "0"],
        &["--trusted-hops", "1", "--trusted-proxies", "127.0.0.1"],
        &["--concurrency", "0"],
        &["--concurrency", "-3"],
        &["--metrics", "not-an-address"],
        &["--admin-token", ""],
        &["--admin-token", "two words"],
        // A store URL without its scheme (or a mistyped one): refused, its password unsaid.
        &["--store", "user:s3cretpw@127.0.0.1:6379"],
        &["--store", "redis:/user:s3cretpw@127.0.0.1:6379"],
        // A URL where another value is due, or with no flag: echoed, its password unsaid.
        &["redis://:s3cretpw@127.0.0.1:6379"],
        &["--port", "redis://:s3cretpw@127.0.0.1:1"],
        &["--limit", "redis://user:s3cretpw@127.0.0.1:1"],
    ] {
        let out = run_to_exit(args);
        assert_eq!(out.status.code(), Some(2), "{args:?} should exit 2");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("s3cretpw"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

/// An argument that is not UTF-8 (a Latin-1 file name) is a bad value: exit 2 with a message,
/// not a panic (exit 101).
#[cfg(unix)]
#[test]
fn an_argument_that_is_not_utf8_exits_2_with_a_message() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    for args in [
        [
            OsStr::new("--rules"),
            OsStr::from_bytes(b"/srv/r\xe8gles.toml"),
        ],
        // A password in the argument that is not UTF-8 is hidden too.
        [
            OsStr::new("--store"),
            OsStr::from_bytes(b"redis://:s3cretpw@r\xe8dis:6379"),
        ],
    ] {
        let out = run_to_exit(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{err}");
        assert!(!err.contains("s3cretpw"), "{err}");
    }
}

#[test]
fn help_prints_the_usage_on_stdout_and_exits_0() {
    for flag in ["--help", "-h"] {
        let out = run_to_exit(&[flag]);
        assert_eq!(out.status.code(), Some(0));
        let usage = String::from_utf8_lossy(&out.stdout);
        for documented in [
            "--port",
            "--store",
            "--algorithm",
            "--limit",
            "--period",
            "--burst",
            "--on-store-error",
            "--headers",
            "--lease",
            "--max-keys",
            "--refund-status",
            "--trusted-proxies",
            "--trusted-hops",
            "--redis-ca",
            "--rules",
            "--admin-token",
            "--concurrency",
            "--metrics",
            "rediss://",
            "redis-sentinel://",
        ] {
            assert!(usage.contains(documented), "{documented} missing: {usage}");
        }
        assert!(out.stderr.is_empty());
    }
}

/// Redis is not there (nothing listens on port 1): the demo starts anyway, fails open, logs
/// why, and never prints the password.
#[test]
fn starts_while_redis_is_away_and_never_prints_a_password() {
    let child = Command::new(server_binary())
        .args([
            "--port",
            "0",
            "--store",
            "redis://:s3cretpw@127.0.0.1:1",
            "--on-store-error",
            "open",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child, 0);
    server.1 = listening_port(&mut server);
    // Fail open: admitted, without rate-limit headers (nothing was counted).
    let r = get(server.1, Some("k"));
    assert_eq!(status(&r), 200, "{r}");
    assert!(
        !r.to_ascii_lowercase().contains("ratelimit-remaining"),
        "{r}"
    );
    let _ = server.0.kill();
    let _ = server.0.wait();
    let mut err = String::new();
    server
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("does not answer"), "{err}");
    assert!(!err.contains("s3cretpw"), "{err}");
}

#[test]
fn status_routes_slow_handlers_and_refunds_by_status() {
    // The log: exact, with no window to straddle on the real clock.
    let server = start(&[
        "--port",
        "0",
        "--algorithm",
        "sliding-log",
        "--limit",
        "2",
        "--period",
        "1h",
        "--refund-status",
        "500-599,429",
    ]);
    // Server errors are given back: any number of them, and the quota is intact.
    for _ in 0..5 {
        assert_eq!(status(&get_path(server.1, "/status/503", Some("k"))), 503);
    }
    let started = std::time::Instant::now();
    let slow = get_path(server.1, "/?sleep_ms=300", Some("k"));
    assert_eq!(status(&slow), 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        status(&get_path(server.1, "/status/201?sleep_ms=1", Some("k"))),
        201
    );
    assert_eq!(status(&get_path(server.1, "/", Some("k"))), 429);
    assert_eq!(
        status(&get_path(server.1, "/status/abc", Some("other"))),
        400
    );
    assert_eq!(
        status(&get_path(server.1, "/?sleep_ms=999999999", Some("x"))),
        400
    );
    // Not a final status: hyper would have answered 500 in its place, headers gone.
    for informational in ["/status/100", "/status/101", "/status/103"] {
        let r = get_path(server.1, informational, Some(informational));
        assert_eq!(status(&r), 400, "{informational}: {r}");
        assert!(r.contains("not a final HTTP status"), "{r}");
    }
}

#[test]
fn a_key_spray_does_not_reset_exhausted_clients() {
    let server = start(&[
        "--port",
        "0",
        "--limit",
        "3",
        "--period",
        "1h",
        "--max-keys",
        "64",
    ]);
    let victims: Vec<String> = (0..5).map(|i| format!("victim-{i}")).collect();
    for v in &victims {
        for _ in 0..3 {
            assert_eq!(status(&get(server.1, Some(v))), 200);
        }
        assert_eq!(status(&get(server.1, Some(v))), 429);
    }
    for i in 0..400 {
        get(server.1, Some(&format!("spray-{i}")));
    }
    for v in &victims {
        assert_eq!(status(&get(server.1, Some(v))), 429, "{v} was reset");
    }
}

mod support;

/// A Redis that refuses the URL's credentials (a wrong password, or none where one is needed)
/// is a configuration error: exit 2 at once, with a message that does not print the password.
#[test]
fn a_redis_refusing_the_credentials_exits_2_without_the_password() {
    let server = support::redis::RedisServer::start();
    server
        .cmd(&["CONFIG", "SET", "requirepass", "right-s3cretpw"])
        .unwrap();
    for url in [
        format!("redis://:wrong-s3cretpw@{}", server.addr()),
        format!("redis://{}", server.addr()),
    ] {
        let out = run_to_exit(&["--port", "0", "--store", &url, "--on-store-error", "closed"]);
        assert_eq!(out.status.code(), Some(2), "{url}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{url}: {err}");
        assert!(!err.contains("s3cretpw"), "{url}: {err}");
        assert!(out.stdout.is_empty(), "{url}");
    }
}

#[test]
fn serves_from_redis_and_a_redis_cluster() {
    let server = support::redis::RedisServer::start();
    let store = format!("redis://{}", server.addr());
    let args = [
        "--port",
        "0",
        "--store",
        &store,
        "--on-store-error",
        "closed",
        "--algorithm",
        "sliding-log",
        "--limit",
        "1",
        "--period",
        "1h",
    ];
    let demo = start(&args);
    until_the_store_answers(demo.1);
    assert!(get(demo.1, Some("r")).starts_with("HTTP/1.1 200"));
    assert!(get(demo.1, Some("r")).starts_with("HTTP/1.1 429"));
    // A second demo on the same Redis shares the limit: one fleet, one limit.
    let other = start(&args);
    until_the_store_answers(other.1);
    assert!(get(other.1, Some("r")).starts_with("HTTP/1.1 429"));

    let cluster = support::redis::RedisCluster::start();
    let nodes = format!("redis-cluster://{}", cluster.addrs().join(","));
    let demo = start(&[
        "--port",
        "0",
        "--store",
        &nodes,
        "--on-store-error",
        "closed",
        "--limit",
        "2",
        "--period",
        "1m",
    ]);
    // The first decisions may pay for connecting to the cluster and miss the 50 ms deadline
    // (a 503 with this policy): wait until the store answers, on a key of its own.
    let began = std::time::Instant::now();
    while status(&get(demo.1, Some("warm-up"))) != 200 {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the cluster never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(get(demo.1, Some("c")).starts_with("HTTP/1.1 200"));
    assert!(get(demo.1, Some("c")).starts_with("HTTP/1.1 200"));
    assert!(get(demo.1, Some("c")).starts_with("HTTP/1.1 429"));
}

#[test]
fn redis_without_an_outage_policy_is_refused() {
    // Port 1: if the check were gone, the demo must not reach a Redis it does not own.
    let out = run_to_exit(&["--store", "redis://127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--on-store-error"));
}

/// Behind a trusted proxy (here the test itself, on 127.0.0.1), anonymous requests count against
/// the client address the proxy reports; without the flag, against the proxy.
#[test]
fn trusted_proxies_key_anonymous_requests_by_the_reported_client() {
    let get_from = |port: u16, client: &str| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 6.6.6.6, {client}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        status(&out)
    };
    for flags in [
        &["--trusted-proxies", "127.0.0.0/8"][..],
        &["--trusted-hops", "1"],
    ] {
        let mut args = vec!["--port", "0", "--limit", "1", "--period", "1h"];
        args.extend_from_slice(flags);
        let server = start(&args);
        assert_eq!(get_from(server.1, "198.51.100.1"), 200, "{flags:?}");
        assert_eq!(get_from(server.1, "198.51.100.1"), 429, "{flags:?}");
        assert_eq!(
            get_from(server.1, "198.51.100.2"),
            200,
            "{flags:?}: its own bucket"
        );
    }
    let untrusting = start(&["--port", "0", "--limit", "1", "--period", "1h"]);
    assert_eq!(get_from(untrusting.1, "198.51.100.1"), 200);
    assert_eq!(
        get_from(untrusting.1, "198.51.100.2"),
        429,
        "without the flag every client shares the proxy's bucket"
    );
}

/// The status of a `GET /` for `key`, or `None` once the server no longer answers.
fn try_status(port: u16, key: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: x\r\nx-api-key: {key}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.get(9..12)?.parse().ok()
}

/// Poll `done` every 10 ms until it holds; fail the test after 30 s.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let began = std::time::Instant::now();
    while !done() {
        assert!(began.elapsed() < Duration::from_secs(30), "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Until the demo on `port` is answered by its store (not the policy's 503): a fresh Redis
/// loads the script on the first call, which a loaded machine can take past the deadline.
fn until_the_store_answers(port: u16) {
    let mut attempt = 0;
    wait_until("Redis answers", || {
        attempt += 1;
        status(&get(port, Some(&format!("warm-up-{port}-{attempt}")))) == 200
    });
}

/// The server's log once it says `text` (within `wait_until`'s bound).
fn wait_for_log(log: &std::sync::Arc<std::sync::Mutex<String>>, text: &str) -> String {
    wait_until(text, || log.lock().unwrap().contains(text));
    log.lock().unwrap().clone()
}

/// Send SIGTERM (what a deploy sends) and wait for the exit: its status, and how long it took.
fn terminate(server: &mut Server) -> (std::process::ExitStatus, Duration) {
    signal(server, "-TERM")
}

/// Send `signal` (`-TERM`, `-INT`) and wait for the exit: its status, and how long it took.
fn signal(server: &mut Server, signal: &str) -> (std::process::ExitStatus, Duration) {
    let term = Command::new("kill")
        .args([signal, &server.0.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let signalled = std::time::Instant::now();
    loop {
        if let Some(exit) = server.0.try_wait().unwrap() {
            return (exit, signalled.elapsed());
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(20),
            "still running 20 s after {signal}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGINT (Ctrl-C) stops the demo as SIGTERM does: exit 0, at once when nothing is in flight.
#[test]
fn sigint_stops_the_demo() {
    let mut server = start(&["--port", "0"]);
    assert_eq!(status(&get(server.1, Some("k"))), 200);
    let (exit, took) = signal(&mut server, "-INT");
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A port already taken is a failure to start: exit 1, with a message, nothing printed on
/// stdout (no `listening on` line a script would wait for); the `--metrics` address alike.
#[test]
fn a_taken_port_exits_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let address = format!("127.0.0.1:{port}");
    for args in [
        &["--port", port.as_str()][..],
        &["--port", "0", "--metrics", address.as_str()],
    ] {
        let out = run_to_exit(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    drop(taken);
}

/// Stopped by SIGTERM while a hot key is served from a leased block, the demo gives the block
/// back and exits 0: the fleet keeps the whole quota but what was served.
#[test]
fn a_demo_stopped_by_sigterm_gives_its_leased_permits_back() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let redis = support::redis::RedisServer::start();
    let store = format!("redis://{}", redis.addr());
    let args = |lease: &'static str| {
        [
            "--port",
            "0",
            "--store",
            &store,
            "--on-store-error",
            "closed",
            "--algorithm",
            "fixed-window",
            "--limit",
            "10000",
            "--period",
            "1h",
            "--lease",
            lease,
        ]
        .map(str::to_owned)
    };
    // Hour windows are aligned to the clock: a test crossing the top of the hour would read a
    // fresh window. Start past it when it is near.
    let in_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 3600;
    if in_hour > 3_540 {
        std::thread::sleep(Duration::from_secs(3_601 - in_hour));
    }
    let leasing = args("1000");
    let mut demo = start(&leasing.iter().map(String::as_str).collect::<Vec<_>>());
    let port = demo.1;
    wait_until("Redis answers", || {
        status(&get(port, Some("warm-up"))) == 200
    });
    let served = std::sync::Arc::new(AtomicU64::new(0));
    let hot = std::thread::spawn({
        let served = served.clone();
        move || {
            while let Some(code) = try_status(port, "hot") {
                assert_eq!(code, 200, "the hot key is far from its limit");
                served.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    wait_until("the hot key is served", || {
        served.load(Ordering::SeqCst) >= 20
    });
    let (exit, _) = terminate(&mut demo);
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    hot.join().unwrap();
    let served = served.load(Ordering::SeqCst);
    // A second instance that does not lease sees what Redis counted for the key.
    let unleased = args("off");
    let other = start(&unleased.iter().map(String::as_str).collect::<Vec<_>>());
    let r = get(other.1, Some("hot"));
    assert_eq!(status(&r), 200, "{r}");
    let expected = format!("ratelimit-remaining: {}", 10_000 - served - 1);
    assert!(
        r.to_ascii_lowercase().contains(&expected),
        "{served} served, so {expected}: {r}"
    );
}

/// A slow request in flight holds a stopping demo for its drain time (5 s), no longer.
#[test]
fn a_demo_stopped_by_sigterm_waits_for_a_slow_request_no_longer_than_5_s() {
    // `--concurrency` for `GET /inflight`, which tells when the slow request is in its handler.
    let mut demo = start(&["--port", "0", "--concurrency", "10"]);
    let port = demo.1;
    let slow = std::thread::spawn(move || get_path_checked(port, "/?sleep_ms=600000"));
    wait_until("the slow request is in its handler", || {
        get_path(port, "/inflight", None).rsplit("\r\n").next() == Some("1")
    });
    let (exit, took) = terminate(&mut demo);
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    assert!(took >= Duration::from_secs(4), "not waited for: {took:?}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    let cut_off = slow.join().unwrap();
    assert!(
        !matches!(&cut_off, Ok(r) if r.starts_with("HTTP/1.1 200")),
        "{cut_off:?}"
    );
}

/// A request's response, or an error once the server is gone.
fn get_path_checked(port: u16, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nx-api-key: slow\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Started while its Redis is down (fail closed: 503), the demo enforces on Redis as soon as
/// Redis is there, with no restart.
#[test]
fn starts_while_redis_is_down_and_enforces_once_it_is_up() {
    let mut redis = support::redis::RedisServer::start();
    let store = format!("redis://{}", redis.addr());
    redis.kill();
    let demo = start(&[
        "--port",
        "0",
        "--store",
        &store,
        "--on-store-error",
        "closed",
        "--limit",
        "2",
        "--period",
        "1h",
    ]);
    assert_eq!(status(&get(demo.1, Some("k"))), 503);
    redis.restart();
    let started = std::time::Instant::now();
    // Another key to find Redis back: a 503 whose call missed its deadline may still have been
    // counted there.
    while status(&get(demo.1, Some("warm-up"))) != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never used Redis"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The 503 above, with Redis down, took nothing.
    assert_eq!(status(&get(demo.1, Some("k"))), 200);
    assert_eq!(status(&get(demo.1, Some("k"))), 200);
    assert_eq!(status(&get(demo.1, Some("k"))), 429, "enforced on Redis");
}

/// A rules file in a directory of its own, removed when dropped.
struct RulesFile(PathBuf);

impl RulesFile {
    fn new(name: &str, text: &str) -> RulesFile {
        let dir = std::env::temp_dir().join(format!("fleetlimit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = RulesFile(dir.join("rules.toml"));
        file.write(text);
        file
    }

    /// Replace the file's contents at once (write beside it, then rename), as editors and
    /// deploy tools do.
    fn write(&self, text: &str) {
        let tmp = self.0.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.0).unwrap();
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for RulesFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A rules file of one rule, "api": `limit` an hour, counted by the log (exact, and no window
/// a test could straddle on the real clock).
fn rule_text(limit: u64) -> String {
    format!(
        "[[rule]]\nname = \"api\"\nalgorithm = \"sliding-log\"\nlimit = {limit}\nperiod = \"1h\"\n"
    )
}

/// The server's stderr, collected as it is written.
fn collect_stderr(server: &mut Server) -> std::sync::Arc<std::sync::Mutex<String>> {
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let stderr = server.0.stderr.take().unwrap();
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            sink.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    log
}

#[test]
fn the_rules_file_is_reloaded_when_it_changes_and_an_invalid_one_is_ignored() {
    let rules = RulesFile::new("reload", &rule_text(2));
    let mut server = start(&["--port", "0", "--rules", rules.path()]);
    let log = collect_stderr(&mut server);
    let port = server.1;
    assert_eq!(status(&get(port, Some("a"))), 200);
    assert_eq!(status(&get(port, Some("a"))), 200);
    assert_eq!(status(&get(port, Some("a"))), 429);
    // Raised to 5: in force within 2 s, the 2 already counted still counted.
    rules.write(&rule_text(5));
    let changed = std::time::Instant::now();
    while status(&get(port, Some("a"))) == 429 {
        assert!(
            changed.elapsed() < Duration::from_secs(2),
            "the new limit is not in force after 2 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The request that saw the change was the 3rd; 2 more, then 5 in all.
    assert_eq!(status(&get(port, Some("a"))), 200);
    assert_eq!(status(&get(port, Some("a"))), 200);
    assert_eq!(status(&get(port, Some("a"))), 429, "5 in all");
    // An invalid rewrite keeps the running rules, and says why.
    rules.write("[[rule]]\nname = \"api\"\nlimit = 0\nperiod = \"1h\"\n");
    let logged = wait_for_log(&log, "rules file invalid");
    assert!(logged.contains("at least 1"), "{logged}");
    for _ in 0..5 {
        assert_eq!(status(&get(port, Some("b"))), 200, "still 5");
    }
    assert_eq!(status(&get(port, Some("b"))), 429);
    assert!(
        log.lock().unwrap().contains("quota changed"),
        "the change was logged: {}",
        log.lock().unwrap()
    );
}

/// A rule that changes its algorithm in the rules file is rejected, the running rules kept: its
/// states are its algorithm's, so the new one would have started every key afresh (a client
/// that had spent its 2 an hour got 2 more at once, and the log called it a quota change).
#[test]
fn a_rules_file_changing_a_rules_algorithm_is_rejected() {
    let rules = RulesFile::new("algorithm", &rule_text(2));
    let mut server = start(&["--port", "0", "--rules", rules.path()]);
    let log = collect_stderr(&mut server);
    let port = server.1;
    assert_eq!(status(&get(port, Some("a"))), 200);
    assert_eq!(status(&get(port, Some("a"))), 200);
    let changed = rule_text(2).replace("sliding-log", "gcra");
    rules.write(&changed);
    let logged = wait_for_log(&log, "rules file rejected");
    assert!(logged.contains("changes its algorithm"), "{logged}");
    assert_eq!(
        status(&get(port, Some("a"))),
        429,
        "the spent quota stays spent"
    );
    // Removed, then added back under another algorithm: rejected too (it was a new rule then,
    // and every key started afresh).
    rules.write(&rule_text(2).replace("\"api\"", "\"other\""));
    wait_for_log(&log, "rule removed");
    rules.write(&changed);
    wait_until("a second rejection", || {
        log.lock().unwrap().matches("rules file rejected").count() >= 2
    });
    assert_eq!(
        status(&get(port, Some("a"))),
        200,
        "only the other rule runs"
    );
}

/// A rules file rewritten in place (`cat new.toml > rules.toml`, an editor saving in place) is
/// read half-written for a moment: that is never applied (here it would drop the second rule),
/// only the complete file, once two polls read it alike.
#[test]
fn a_rules_file_written_in_place_is_applied_only_once_complete() {
    let text = |login: u64| {
        let api =
            "[[rule]]\nname = \"api\"\nalgorithm = \"fixed-window\"\nlimit = 5\nperiod = \"1h\"\n";
        let login = format!(
            "[[rule]]\nname = \"login\"\nalgorithm = \"fixed-window\"\nlimit = {login}\nperiod = \"1h\"\n"
        );
        (api, login)
    };
    let (api, login) = text(10);
    let rules = RulesFile::new("in-place", &format!("{api}{login}"));
    let mut server = start(&["--port", "0", "--rules", rules.path()]);
    let log = collect_stderr(&mut server);
    assert_eq!(status(&get(server.1, Some("a"))), 200);
    for round in 1..=3u64 {
        let (api, login) = text(10 + round);
        // Half the file for less than a poll (250 ms), then the rest.
        let mut file = std::fs::File::create(rules.path()).unwrap();
        file.write_all(api.as_bytes()).unwrap();
        file.flush().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        file.write_all(login.as_bytes()).unwrap();
        file.flush().unwrap();
        drop(file);
        let written = std::time::Instant::now();
        while (log.lock().unwrap().matches("quota changed").count() as u64) < round {
            assert!(
                written.elapsed() < Duration::from_secs(3),
                "round {round}: the complete file is not in force: {}",
                log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // The change was seen within 50 ms of a poll: the next half-written file, 100 ms from
        // now, is there when the next poll reads.
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = log.lock().unwrap();
    assert!(
        !log.contains("rule removed") && !log.contains("rule added"),
        "a half-written file was applied: {log}"
    );
}

#[test]
fn a_rules_file_that_cannot_be_used_is_a_command_line_error() {
    let bad = RulesFile::new(
        "bad",
        "[[rule]]\nname = \"api\"\nlimit = 1\nperiod = \"soon\"\n",
    );
    let good = RulesFile::new("good", &rule_text(1));
    for args in [
        &["--rules", bad.path()][..],
        &["--rules", "/nonexistent/rules.toml"],
        &["--rules", good.path(), "--limit", "5"],
        &["--rules", good.path(), "--algorithm", "gcra"],
    ] {
        let out = run_to_exit(args);
        assert_eq!(out.status.code(), Some(2), "{args:?} should exit 2");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
}

/// A request with a method, path and headers; the whole response.
fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n"
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    write!(s, "{head}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn body_of(response: &str) -> &str {
    response.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

#[test]
fn the_admin_endpoints_inspect_reset_and_block_keys_for_the_token_holder() {
    let server = start(&[
        "--port",
        "0",
        "--limit",
        "3",
        "--admin-token",
        "s3cret-token",
    ]);
    let port = server.1;
    let operator = [("Authorization", "Bearer s3cret-token")];
    for _ in 0..3 {
        assert_eq!(status(&get(port, Some("tenant-7"))), 200);
    }
    assert_eq!(status(&get(port, Some("tenant-7"))), 429);
    // No token, a wrong one, another scheme: 401, and nothing happens.
    for headers in [
        &[][..],
        &[("Authorization", "Bearer wrong")],
        &[("Authorization", "Basic czNjcmV0LXRva2Vu")],
    ] {
        for (method, path) in [
            ("GET", "/admin/keys/tenant-7"),
            ("DELETE", "/admin/keys/tenant-7"),
            ("POST", "/admin/keys/tenant-7/block?seconds=5"),
            // Unknown admin paths too: no map of the routes without the token.
            ("GET", "/admin/nope"),
            ("GET", "/admin/keys/tenant-7/nope"),
        ] {
            let r = request(port, method, path, headers);
            assert_eq!(status(&r), 401, "{method} {path} {headers:?}: {r}");
        }
    }
    assert_eq!(status(&get(port, Some("tenant-7"))), 429, "still exhausted");
    // Inspect: the key as the demo extracts it, every rule, consuming nothing.
    let r = request(port, "GET", "/admin/keys/tenant-7", &operator);
    assert_eq!(status(&r), 200, "{r}");
    assert!(
        r.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{r}"
    );
    let json: serde_json::Value = serde_json::from_str(body_of(&r)).unwrap();
    assert_eq!(json["key"], "tenant-7");
    assert_eq!(json["rules"][0]["rule"], "demo");
    assert_eq!(json["rules"][0]["limit"], 3);
    assert_eq!(json["rules"][0]["remaining"], 0);
    assert!(json["rules"][0]["reset_ms"].as_u64().unwrap() > 0);
    assert!(json["rules"][0]["blocked_until_ms"].is_null());
    // The refused key is the heaviest hitter, fingerprinted.
    let r = request(port, "GET", "/admin/heavy-hitters", &operator);
    assert_eq!(status(&r), 200, "{r}");
    let json: serde_json::Value = serde_json::from_str(body_of(&r)).unwrap();
    assert!(json["keys"][0]["denials"].as_u64().unwrap() >= 1, "{r}");
    assert!(
        !body_of(&r).contains("tenant-7"),
        "keys are fingerprinted: {r}"
    );
    // Reset: the key starts afresh.
    let r = request(port, "DELETE", "/admin/keys/tenant-7", &operator);
    assert_eq!(status(&r), 204, "{r}");
    for _ in 0..3 {
        assert_eq!(status(&get(port, Some("tenant-7"))), 200);
    }
    // Block: 429 with Retry-After about N, reported by inspect.
    let r = request(
        port,
        "POST",
        "/admin/keys/other/block?seconds=40",
        &operator,
    );
    assert_eq!(status(&r), 204, "{r}");
    let denied = get(port, Some("other"));
    assert_eq!(status(&denied), 429);
    let retry: u64 = denied
        .to_ascii_lowercase()
        .lines()
        .find_map(|l| {
            l.strip_prefix("retry-after: ")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap();
    assert!((39..=40).contains(&retry), "{denied}");
    let r = request(port, "GET", "/admin/keys/other", &operator);
    let json: serde_json::Value = serde_json::from_str(body_of(&r)).unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let until = json["rules"][0]["blocked_until_ms"].as_u64().unwrap();
    assert!(until > now_ms + 35_000 && until <= now_ms + 41_000, "{r}");
    // A block without its length is refused.
    let r = request(port, "POST", "/admin/keys/other/block", &operator);
    assert_eq!(status(&r), 400, "{r}");
    // Unblock lifts it.
    let r = request(port, "POST", "/admin/keys/other/unblock", &operator);
    assert_eq!(status(&r), 204, "{r}");
    assert_eq!(status(&get(port, Some("other"))), 200);
}

#[test]
fn without_an_admin_token_there_are_no_admin_endpoints() {
    let server = start(&["--port", "0"]);
    let r = request(
        server.1,
        "GET",
        "/admin/keys/k",
        &[("Authorization", "Bearer x")],
    );
    assert_eq!(status(&r), 404, "{r}");
}

/// A slow request in a background thread; its response is ignored (the server may be killed).
fn slow_request(port: u16, key: &'static str) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
            let _ = write!(
                s,
                "GET /status/200?sleep_ms=20000 HTTP/1.1\r\nHost: x\r\nx-api-key: {key}\r\nConnection: close\r\n\r\n"
            );
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
        }
    })
}

fn inflight(port: u16) -> u64 {
    body_of(&get_path(port, "/inflight", None))
        .trim()
        .parse()
        .unwrap()
}

/// Two demo servers share a concurrency limit of 2 on Redis; the one holding both slots is
/// killed with SIGKILL mid-request: the other refuses until the slots expire (5 s), then serves.
#[test]
fn a_killed_instance_frees_its_concurrency_slots_within_the_expiry() {
    let redis = support::redis::RedisServer::start();
    let url = redis.url();
    let args = [
        "--port",
        "0",
        "--store",
        url.as_str(),
        "--on-store-error",
        "closed",
        "--concurrency",
        "2",
        "--limit",
        "1000",
    ];
    let mut a = start(&args);
    let b = start(&args);
    until_the_store_answers(a.1);
    until_the_store_answers(b.1);
    let _slow: Vec<_> = (0..2).map(|_| slow_request(a.1, "shared")).collect();
    let began = std::time::Instant::now();
    while inflight(a.1) < 2 {
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "the slow requests never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both slots are A's: B refuses the key, with the concurrency policy; other keys pass.
    let refused = get(b.1, Some("shared"));
    assert_eq!(status(&refused), 429, "{refused}");
    assert!(
        refused
            .to_ascii_lowercase()
            .contains("ratelimit-policy: \"demo-concurrency\";q=2;qu=\"concurrent-requests\""),
        "{refused}"
    );
    assert_eq!(status(&get(b.1, Some("other"))), 200);
    assert_eq!(inflight(b.1), 0);
    // A dies without giving anything back.
    a.0.kill().unwrap();
    a.0.wait().unwrap();
    let killed = std::time::Instant::now();
    // Until served (a 503, a call that missed its deadline, is no proof the slots are free).
    while status(&get(b.1, Some("shared"))) != 200 {
        assert!(
            killed.elapsed() < Duration::from_secs(7),
            "the killed instance's slots did not expire"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        killed.elapsed() > Duration::from_secs(2),
        "freed too early: the slots were not held in Redis"
    );
}

/// `--metrics ADDR` serves Prometheus text with the limiter's counts.
#[test]
fn metrics_are_served_as_prometheus_text() {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics_port = probe.local_addr().unwrap().port();
    drop(probe);
    let addr = format!("127.0.0.1:{metrics_port}");
    let server = start(&["--port", "0", "--limit", "2", "--metrics", &addr]);
    for _ in 0..3 {
        get(server.1, Some("m"));
    }
    let text = get_path(metrics_port, "/metrics", None);
    assert_eq!(status(&text), 200, "{text}");
    let line = |outcome: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("fleetlimit_decisions_total{")
                    && l.contains("rule=\"demo\"")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap_or("").to_owned())
    };
    assert_eq!(line("allowed").as_deref(), Some("2"), "{text}");
    assert_eq!(line("denied").as_deref(), Some("1"), "{text}");
    assert!(!text.contains("\"m\""), "keys never appear");
}
