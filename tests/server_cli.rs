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
        "build the example first: cargo build --example server ({p:?})"
    );
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
    let mut child = Command::new(server_binary())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .strip_prefix("listening on http://127.0.0.1:")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    Server(child, port)
}

fn get(port: u16, api_key: Option<&str>) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let key = api_key
        .map(|k| format!("x-api-key: {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
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
fn invalid_flags_exit_non_zero_with_a_message() {
    for args in [
        &["--limit", "0"][..],
        &["--period", "10"],
        &["--algorithm", "leaky-bucket"],
        &["--burst", "5"],
        &["--port", "70000"],
        &["--frobnicate"],
        &["--lease", "0"],
        &["--algorithm", "sliding-log", "--lease", "auto"],
    ] {
        let out = Command::new(server_binary()).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
}

mod support;

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
    assert!(get(demo.1, Some("r")).starts_with("HTTP/1.1 200"));
    assert!(get(demo.1, Some("r")).starts_with("HTTP/1.1 429"));
    // A second demo on the same Redis shares the limit: one fleet, one limit.
    let other = start(&args);
    assert!(get(other.1, Some("r")).starts_with("HTTP/1.1 429"));

    let cluster = support::redis::RedisCluster::start();
    let nodes = format!("redis-cluster://{}", cluster.addrs().join(","));
    let demo = start(&[
        "--port",
        "0",
        "--store",
        &nodes,
        "--on-store-error",
        "open",
        "--limit",
        "2",
        "--period",
        "1m",
    ]);
    assert!(get(demo.1, Some("c")).starts_with("HTTP/1.1 200"));
    assert!(get(demo.1, Some("c")).starts_with("HTTP/1.1 200"));
    assert!(get(demo.1, Some("c")).starts_with("HTTP/1.1 429"));
}

#[test]
fn redis_without_an_outage_policy_is_refused() {
    let out = Command::new(server_binary())
        .args(["--store", "redis://127.0.0.1:6379"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--on-store-error"));
}
