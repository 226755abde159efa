//! Real `redis-server` processes for integration tests.
//!
//! [`RedisServer`] runs one throw-away server bound to `127.0.0.1` on a free port, with no
//! persistence and its own temporary working directory. [`RedisCluster`] runs three such
//! servers as cluster masters and joins them with `redis-cli --cluster create`. Everything is
//! killed (by PID) and cleaned up on drop.
//!
//! The harness talks to the servers with redis-rs's blocking client ([`resp_command`],
//! [`RedisServer::cmd`]) and signals them with the `kill` command, so it is Unix-only. Every
//! server it starts is killed by the kernel if the *thread* that started it ends (Linux's
//! parent-death signal follows the thread): a test binary killed mid-run leaves no server
//! behind, but a server started or restarted on a short-lived thread (a `spawn_blocking` pool
//! thread, retired after 10 s idle) dies with it, so start and restart servers on the test's
//! own thread. Each works in its own temporary directory.
//!
//! It is also the harness of the examples and benchmarks that start their own Redis
//! (`#[path = "../tests/support/redis.rs"] mod redis_harness;`).
//!
//! It is safe to use from parallel test threads and from several test binaries at once:
//! ports are reserved in-process, and a server that loses a port race to another process is
//! restarted on a new port (up to five times).
//!
//! ```ignore
//! mod support;
//! use support::redis::{RedisCluster, RedisServer};
//!
//! let server = RedisServer::start();
//! assert_eq!(server.cmd(&["DBSIZE"]).unwrap().as_int(), Some(0));
//!
//! let cluster = RedisCluster::start(); // 2-3 s: `redis-cli --cluster create` is slow
//! let slot = cluster.keyslot(b"user:1");
//! let owner = cluster.node_for_slot(slot);
//! ```

use std::collections::hash_map::RandomState;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// The only interface the servers listen on.
const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// The host part of every address handed out.
const HOST: &str = "127.0.0.1";
/// The system's own redis: never picked, never touched.
const SYSTEM_REDIS_PORT: u16 = 6379;

/// How long a freshly spawned server gets to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How often readiness is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// Connect/read timeout of a single readiness probe.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// How many ports a fresh server tries before giving up (port races with other processes).
const START_ATTEMPTS: usize = 5;
/// How many times [`RedisServer::restart`] tries to re-bind the same port.
const RESTART_ATTEMPTS: usize = 10;
/// Pause between two [`RedisServer::restart`] attempts.
const RESTART_BACKOFF: Duration = Duration::from_millis(200);
/// Connect, read and write timeout of [`RedisServer::cmd`].
pub const CMD_TIMEOUT: Duration = Duration::from_secs(3);
/// How long to wait for a process to be reaped after `SIGKILL`.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Name of the server's log file inside its working directory.
const LOG_FILE: &str = "redis.log";

/// A cluster node's bus listens on its port plus this offset.
const CLUSTER_BUS_OFFSET: u16 = 10_000;
/// Cluster nodes get ports below this, so that the bus port is a valid port.
const MAX_CLUSTER_PORT: u16 = 50_000;
/// Number of hash slots in a Redis cluster.
pub const CLUSTER_SLOTS: u16 = 16_384;
/// Default `--cluster-node-timeout`, in milliseconds.
pub const DEFAULT_NODE_TIMEOUT_MS: u64 = 2_000;
/// Number of masters in a [`RedisCluster`].
pub const CLUSTER_SIZE: usize = 3;
/// How long `redis-cli --cluster create` may run.
const CLUSTER_CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a created cluster gets to report `cluster_state:ok` everywhere.
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often cluster health is polled.
const CLUSTER_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How many times a whole cluster is rebuilt when creating it fails.
const CLUSTER_START_ATTEMPTS: usize = 3;

/// Ports (and cluster bus ports) handed to live servers of this process.
static RESERVED_PORTS: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

// ---------------------------------------------------------------------------------------------
// Prerequisites
// ---------------------------------------------------------------------------------------------

/// Panics with installation advice unless `redis-server` and `redis-cli` are on `PATH`.
///
/// [`RedisServer::start`] and [`RedisCluster::start`] call this themselves.
pub fn require_redis() {
    static FOUND: OnceLock<bool> = OnceLock::new();
    let found = *FOUND.get_or_init(|| on_path("redis-server") && on_path("redis-cli"));
    if !found {
        panic!(
            "redis-server/redis-cli not found: run scripts/test.sh (it installs Debian's \
             redis-server package) or `apt-get install redis-server`"
        );
    }
}

/// Whether an executable file called `program` is in one of the `PATH` directories.
fn on_path(program: &str) -> bool {
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| is_executable(&dir.join(program)))
}

#[cfg(unix)]
fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file())
}

// ---------------------------------------------------------------------------------------------
// RESP client
// ---------------------------------------------------------------------------------------------

/// One RESP2 reply.
///
/// A Redis error reply is a value ([`RespValue::Error`]), not an `Err`: the `Err` of
/// [`RedisServer::cmd`] means the command could not be sent or the reply could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`, without the leading `-`.
    Error(String),
    /// `:42`
    Int(i64),
    /// `$3\r\nfoo`; `None` is the null bulk string (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `*2\r\n...`; `None` is the null array (`*-1`).
    Array(Option<Vec<RespValue>>),
}

impl RespValue {
    /// The integer: an [`Int`](RespValue::Int), or a simple/bulk string holding one
    /// (as `GET` returns counters).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Int(n) => Some(*n),
            RespValue::Simple(s) => s.parse().ok(),
            RespValue::Bulk(Some(bytes)) => std::str::from_utf8(bytes).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// The text of a simple string or of a UTF-8 bulk string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            RespValue::Simple(s) => Some(s.as_str()),
            RespValue::Bulk(Some(bytes)) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }

    /// The bytes of a simple or bulk string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            RespValue::Simple(s) => Some(s.as_bytes()),
            RespValue::Bulk(Some(bytes)) => Some(bytes.as_slice()),
            _ => None,
        }
    }

    /// The elements of a non-null array.
    pub fn as_array(&self) -> Option<&[RespValue]> {
        match self {
            RespValue::Array(Some(items)) => Some(items.as_slice()),
            _ => None,
        }
    }

    /// Whether this is the null bulk string or the null array.
    pub fn is_null(&self) -> bool {
        matches!(self, RespValue::Bulk(None) | RespValue::Array(None))
    }

    /// The message of an error reply.
    pub fn as_error(&self) -> Option<&str> {
        match self {
            RespValue::Error(message) => Some(message.as_str()),
            _ => None,
        }
    }
}

/// Sends one command to `addr` (`"127.0.0.1:PORT"`) on a new connection (redis-rs, blocking)
/// and reads its reply.
///
/// `timeout` bounds the connect and every read and write, so a paused or dead server yields
/// an `Err` instead of a hang. A Redis error reply is `Ok(RespValue::Error)`.
pub fn resp_command(addr: &str, args: &[&[u8]], timeout: Duration) -> Result<RespValue, String> {
    let Some((name, rest)) = args.split_first() else {
        return Err("an empty command".to_owned());
    };
    // A zero timeout is rejected by the socket options.
    let timeout = timeout.max(Duration::from_millis(1));
    let client = redis::Client::open(format!("redis://{addr}"))
        .map_err(|e| format!("invalid address {addr:?}: {e}"))?;
    let mut conn = client
        .get_connection_with_timeout(timeout)
        .map_err(|e| format!("connect to {addr} failed: {e}"))?;
    conn.set_read_timeout(Some(timeout))
        .and_then(|()| conn.set_write_timeout(Some(timeout)))
        .map_err(|e| format!("cannot set timeouts on the connection to {addr}: {e}"))?;
    let mut command = redis::cmd(&String::from_utf8_lossy(name));
    for arg in rest {
        command.arg(*arg);
    }
    match command.query::<redis::Value>(&mut conn) {
        Ok(value) => Ok(RespValue::from(value)),
        Err(e)
            if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
                || e.code().is_some() =>
        {
            Ok(RespValue::Error(e.to_string()))
        }
        Err(e) => Err(format!("{addr}: {e}")),
    }
}

impl From<redis::Value> for RespValue {
    fn from(value: redis::Value) -> RespValue {
        match value {
            redis::Value::Nil => RespValue::Bulk(None),
            redis::Value::Int(n) => RespValue::Int(n),
            redis::Value::BulkString(bytes) => RespValue::Bulk(Some(bytes)),
            redis::Value::Array(items) | redis::Value::Set(items) => {
                RespValue::Array(Some(items.into_iter().map(RespValue::from).collect()))
            }
            redis::Value::SimpleString(text) => RespValue::Simple(text),
            redis::Value::Okay => RespValue::Simple("OK".to_owned()),
            redis::Value::VerbatimString { text, .. } => RespValue::Bulk(Some(text.into_bytes())),
            other => RespValue::Simple(format!("{other:?}")),
        }
    }
}

/// The value of `field` in `INFO`-style text (`field:value` lines), trimmed.
///
/// For example `info_field(&text, "cluster_state")` or `info_field(&text, "cmdstat_evalsha")`.
pub fn info_field<'a>(text: &'a str, field: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// Whether `addr` answers `PING` with `+PONG`.
fn ping(addr: &str, timeout: Duration) -> bool {
    matches!(
        resp_command(addr, &[b"PING".as_slice()], timeout),
        Ok(RespValue::Simple(ref pong)) if pong == "PONG"
    )
}

/// The PID of the server answering on `addr`, from `INFO server`.
fn server_pid(addr: &str, timeout: Duration) -> Result<u32, String> {
    let reply = resp_command(addr, &[b"INFO".as_slice(), b"server".as_slice()], timeout)?;
    let text = reply
        .as_str()
        .ok_or_else(|| format!("unexpected INFO reply {reply:?}"))?;
    info_field(text, "process_id")
        .and_then(|pid| pid.parse().ok())
        .ok_or_else(|| "INFO server has no process_id".to_owned())
}

// ---------------------------------------------------------------------------------------------
// Ports, directories, processes
// ---------------------------------------------------------------------------------------------

/// Locks `mutex`, ignoring poisoning (a panicking test must not break the others).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `port` can be bound on the loopback interface right now.
fn port_is_free(port: u16) -> bool {
    TcpListener::bind((LOOPBACK, port)).is_ok()
}

/// A pseudo-random number (std's hasher keys are randomly seeded).
fn random_u64() -> u64 {
    RandomState::new().build_hasher().finish()
}

/// Picks a free loopback port and reserves it in-process until [`release_port`].
///
/// For a cluster node the port is below [`MAX_CLUSTER_PORT`] and its bus port (port + 10000)
/// is free and reserved too. Another process may still take either port before the server
/// binds it; the caller retries on a new port then.
fn reserve_free_port(cluster: bool) -> u16 {
    for _ in 0..1_000 {
        let port = match TcpListener::bind((LOOPBACK, 0)).and_then(|l| l.local_addr()) {
            Ok(addr) => addr.port(),
            Err(e) => panic!("cannot bind an ephemeral port on {HOST}: {e}"),
        };
        // The kernel's ephemeral range may lie above the cluster limit; fall back to a random
        // port in 20000..50000 then.
        let port = if cluster && port >= MAX_CLUSTER_PORT {
            let span = u64::from(MAX_CLUSTER_PORT - 20_000);
            match u16::try_from(20_000 + random_u64() % span) {
                Ok(candidate) if port_is_free(candidate) => candidate,
                _ => continue,
            }
        } else {
            port
        };
        if port == SYSTEM_REDIS_PORT || port < 1_024 {
            continue;
        }
        if cluster && !port_is_free(port + CLUSTER_BUS_OFFSET) {
            continue;
        }
        let mut reserved = lock(&RESERVED_PORTS);
        if reserved.contains(&port) || (cluster && reserved.contains(&(port + CLUSTER_BUS_OFFSET)))
        {
            continue;
        }
        reserved.insert(port);
        if cluster {
            reserved.insert(port + CLUSTER_BUS_OFFSET);
        }
        return port;
    }
    panic!("found no free loopback port for redis-server after 1000 tries");
}

/// Undoes [`reserve_free_port`].
fn release_port(port: u16, cluster: bool) {
    let mut reserved = lock(&RESERVED_PORTS);
    reserved.remove(&port);
    if cluster {
        reserved.remove(&(port + CLUSTER_BUS_OFFSET));
    }
}

/// A fresh path under the temporary directory, unique per process and server.
fn unique_temp_dir() -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("fleetlimit-redis-{}-{n}", std::process::id()))
}

/// Makes `dir` an empty directory (removing leftovers, e.g. from a recycled PID).
fn reset_dir(dir: &Path) -> io::Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::create_dir_all(dir)
}

/// The contents of `path` from byte `offset` on, lossily decoded; empty if unreadable.
fn read_lossy_from(path: &Path, offset: u64) -> String {
    let Ok(bytes) = fs::read(path) else {
        return String::new();
    };
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// Sends `SIGKILL` (harmless if the process already exited) and reaps the child, waiting at
/// most [`KILL_WAIT`]. Returns whether the child was reaped. Never blocks unboundedly, even on
/// a stopped (`SIGSTOP`ped) process: `SIGKILL` terminates those too.
fn kill_and_reap(child: &mut Child) -> bool {
    let _ = child.kill();
    let deadline = Instant::now() + KILL_WAIT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return true,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
            Ok(None) | Err(_) => return false,
        }
    }
}

/// Why an attempt to launch `redis-server` failed.
enum LaunchError {
    /// Lost a port race (early exit, "Address already in use", or another server answered):
    /// worth retrying.
    Retry(String),
    /// Anything else: retrying will not help.
    Fatal(String),
}

/// Child processes that the kernel kills when the thread that started them ends, so a test
/// binary killed mid-run leaves no server behind.
trait DieWithParent {
    fn die_with_parent(&mut self) -> &mut Self;
}

impl DieWithParent for Command {
    fn die_with_parent(&mut self) -> &mut Self {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of ours.
        unsafe {
            self.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            })
        }
    }
}

/// Spawns `redis-server` on `port` in `dir` and waits until it answers `PING`.
///
/// Output is appended to `log_path`. On failure the child has been killed and reaped.
fn launch(
    port: u16,
    dir: &Path,
    log_path: &Path,
    extra_args: &[String],
) -> Result<Child, LaunchError> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .map_err(|e| LaunchError::Fatal(format!("cannot open {}: {e}", log_path.display())))?;
    let log_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
    let log_for_stderr = log
        .try_clone()
        .map_err(|e| LaunchError::Fatal(format!("cannot duplicate the log file handle: {e}")))?;
    // A config file (a Sentinel's, which Sentinel rewrites) must come first.
    let (config, extra_args) = match extra_args.split_first() {
        Some((first, rest)) if first.ends_with(".conf") => (Some(first), rest),
        _ => (None, extra_args),
    };
    let mut child = Command::new("redis-server")
        .args(config)
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", HOST])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra_args)
        .current_dir(dir)
        .die_with_parent()
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_for_stderr))
        .spawn()
        .map_err(|e| LaunchError::Fatal(format!("cannot spawn redis-server: {e}")))?;
    match wait_until_ready(&mut child, port, log_path, log_offset) {
        Ok(()) => Ok(child),
        Err(e) => {
            kill_and_reap(&mut child);
            Err(e)
        }
    }
}

/// Polls until the freshly spawned `child` answers `PING` on `port` (and really is the one
/// answering), it exits, or [`START_TIMEOUT`] passes.
fn wait_until_ready(
    child: &mut Child,
    port: u16,
    log_path: &Path,
    log_offset: u64,
) -> Result<(), LaunchError> {
    let addr = format!("{HOST}:{port}");
    let pid = child.id();
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(None) => {}
            Ok(Some(status)) => {
                return Err(LaunchError::Retry(format!(
                    "redis-server (pid {pid}) on port {port} exited early ({status}); log:\n{}",
                    read_lossy_from(log_path, log_offset)
                )));
            }
            Err(e) => {
                return Err(LaunchError::Fatal(format!(
                    "cannot poll redis-server (pid {pid}): {e}"
                )));
            }
        }
        let log = read_lossy_from(log_path, log_offset);
        if log.contains("Address already in use") {
            return Err(LaunchError::Retry(format!(
                "redis-server (pid {pid}) could not bind port {port}; log:\n{log}"
            )));
        }
        if ping(&addr, PROBE_TIMEOUT) {
            match server_pid(&addr, PROBE_TIMEOUT) {
                Ok(answering) if answering == pid => return Ok(()),
                Ok(answering) => {
                    return Err(LaunchError::Retry(format!(
                        "port {port} is served by another redis-server (pid {answering}), \
                         not ours (pid {pid})"
                    )));
                }
                // Not conclusive yet: keep polling.
                Err(_) => {}
            }
        }
        if Instant::now() >= deadline {
            return Err(LaunchError::Fatal(format!(
                "redis-server (pid {pid}) did not answer PING on {addr} within \
                 {START_TIMEOUT:?}; log:\n{log}"
            )));
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Whether the extra arguments turn cluster mode on.
fn cluster_enabled(extra_args: &[String]) -> bool {
    extra_args
        .windows(2)
        .any(|pair| pair[0] == "--cluster-enabled" && pair[1].eq_ignore_ascii_case("yes"))
}

// ---------------------------------------------------------------------------------------------
// RedisServer
// ---------------------------------------------------------------------------------------------

/// A real `redis-server` child process on `127.0.0.1`, killed and cleaned up on drop.
///
/// It runs with `--save "" --appendonly no --daemonize no` in a fresh temporary directory
/// (removed on drop) and logs to `redis.log` there (see [`RedisServer::log`]).
#[derive(Debug)]
pub struct RedisServer {
    /// The TCP port; stays the same across [`RedisServer::restart`].
    port: u16,
    /// PID of the current (or last) process.
    pid: u32,
    /// The process, until it is killed. Behind a mutex so that `&self` methods can check and
    /// signal it without racing with reaping (an unreaped PID cannot be recycled).
    child: Mutex<Option<Child>>,
    /// Whether [`RedisServer::pause`] stopped the process.
    paused: AtomicBool,
    /// Working directory (`--dir`).
    dir: PathBuf,
    /// stdout/stderr of the process.
    log_path: PathBuf,
    /// Arguments after the standard ones, kept for restarts.
    extra_args: Vec<String>,
    /// Whether this is a cluster node (its bus port is reserved too).
    cluster: bool,
}

impl RedisServer {
    /// Starts a standalone server on a free port and waits until it answers `PING`.
    ///
    /// # Panics
    ///
    /// If redis is not installed or the server cannot be started (after retries on new ports).
    pub fn start() -> RedisServer {
        RedisServer::start_with_args(&[])
    }

    /// Starts a cluster-enabled server (not yet part of any cluster) with the given
    /// `--cluster-node-timeout` in milliseconds and `--cluster-require-full-coverage no`.
    pub fn start_cluster_node(node_timeout_ms: u64) -> RedisServer {
        let timeout = node_timeout_ms.to_string();
        RedisServer::start_with_args(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            timeout.as_str(),
            "--cluster-require-full-coverage",
            "no",
        ])
    }

    /// Starts a server with extra `redis-server` arguments after the standard ones
    /// (e.g. `&["--maxmemory", "10mb"]`). With `--cluster-enabled yes` the port is chosen so
    /// that the cluster bus port (port + 10000) is free as well.
    pub fn start_with_args(extra_args: &[&str]) -> RedisServer {
        require_redis();
        let extra_args: Vec<String> = extra_args.iter().map(|arg| (*arg).to_owned()).collect();
        let cluster = cluster_enabled(&extra_args);
        let dir = unique_temp_dir();
        let log_path = dir.join(LOG_FILE);
        let mut failures = Vec::new();
        for attempt in 1..=START_ATTEMPTS {
            let port = reserve_free_port(cluster);
            // Fresh directory per attempt: a node that failed to bind its cluster bus has
            // already written a nodes.conf.
            if let Err(e) = reset_dir(&dir) {
                release_port(port, cluster);
                panic!(
                    "cannot create redis working directory {}: {e}",
                    dir.display()
                );
            }
            match launch(port, &dir, &log_path, &extra_args) {
                Ok(child) => {
                    return RedisServer {
                        port,
                        pid: child.id(),
                        child: Mutex::new(Some(child)),
                        paused: AtomicBool::new(false),
                        dir,
                        log_path,
                        extra_args,
                        cluster,
                    };
                }
                Err(LaunchError::Retry(message)) => {
                    release_port(port, cluster);
                    failures.push(format!("attempt {attempt} (port {port}): {message}"));
                }
                Err(LaunchError::Fatal(message)) => {
                    release_port(port, cluster);
                    let _ = fs::remove_dir_all(&dir);
                    panic!("redis-server failed to start on port {port}: {message}");
                }
            }
        }
        let _ = fs::remove_dir_all(&dir);
        panic!(
            "redis-server failed to start in {START_ATTEMPTS} attempts:\n{}",
            failures.join("\n")
        );
    }

    /// A Sentinel monitoring the master on `master_port` as `name`, with a quorum of `quorum`
    /// and quick failure detection (1 s), in its own directory.
    pub fn start_sentinel(name: &str, master_port: u16, quorum: u8) -> RedisServer {
        let dir = unique_temp_dir();
        let _ = reset_dir(&dir);
        let conf = dir.join("sentinel.conf");
        let text = format!(
            "sentinel monitor {name} {HOST} {master_port} {quorum}\n\
             sentinel down-after-milliseconds {name} 1000\n\
             sentinel failover-timeout {name} 3000\n\
             sentinel parallel-syncs {name} 1\n"
        );
        if let Err(e) = fs::write(&conf, text) {
            panic!("cannot write {}: {e}", conf.display());
        }
        let conf = conf.to_string_lossy().into_owned();
        RedisServer::start_with_args(&[&conf, "--sentinel"])
    }

    /// The TCP port on `127.0.0.1`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://{HOST}:{}", self.port)
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("{HOST}:{}", self.port)
    }

    /// PID of the current process (of the last one after [`RedisServer::kill`]).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The working directory (removed on drop).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything the server has logged so far, across restarts (for failure messages).
    pub fn log(&self) -> String {
        read_lossy_from(&self.log_path, 0)
    }

    /// Whether the process is alive (a paused process is alive).
    pub fn is_running(&self) -> bool {
        let mut guard = lock(&self.child);
        let state = match guard.as_mut() {
            Some(child) => child.try_wait(),
            None => return false,
        };
        match state {
            Ok(None) => true,
            // Exited (now reaped) or unknowable: either way it does not serve.
            Ok(Some(_)) | Err(_) => {
                *guard = None;
                false
            }
        }
    }

    /// Whether [`RedisServer::pause`] stopped the process (and it was not resumed or killed).
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Kills the server with `SIGKILL` and reaps it: it is down when this returns.
    /// Does nothing if it is already down.
    ///
    /// # Panics
    ///
    /// If the process has not exited within 5 s of `SIGKILL`.
    pub fn kill(&mut self) {
        let child = self
            .child
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        self.paused.store(false, Ordering::SeqCst);
        if let Some(mut child) = child {
            if !kill_and_reap(&mut child) {
                panic!(
                    "redis-server (pid {}) on port {} did not exit within {KILL_WAIT:?} of SIGKILL",
                    self.pid, self.port
                );
            }
        }
    }

    /// Stops the process with `SIGSTOP` (`kill -STOP <pid>`): connections stay open but get no
    /// answers, like a server stuck in a long GC pause or a network partition.
    ///
    /// # Panics
    ///
    /// If the server is not running or the signal cannot be sent.
    pub fn pause(&self) {
        if !self.signal("STOP") {
            panic!(
                "cannot pause redis-server on port {}: it is not running",
                self.port
            );
        }
        self.paused.store(true, Ordering::SeqCst);
    }

    /// Continues a paused process with `SIGCONT`. Does nothing if the server is not running.
    ///
    /// # Panics
    ///
    /// If the signal cannot be sent.
    pub fn resume(&self) {
        self.signal("CONT");
        self.paused.store(false, Ordering::SeqCst);
    }

    /// Sends `SIG<signal>` with the `kill` command; `false` if the process is not running.
    fn signal(&self, signal: &str) -> bool {
        // Holding the lock keeps the child unreaped, so its PID cannot be recycled meanwhile.
        let mut guard = lock(&self.child);
        let state = match guard.as_mut() {
            Some(child) => child.try_wait(),
            None => return false,
        };
        match state {
            Ok(None) => {}
            Ok(Some(_)) => {
                *guard = None;
                return false;
            }
            Err(e) => panic!("cannot poll redis-server (pid {}): {e}", self.pid),
        }
        // A system call, not the `kill` program (procps, which minimal images leave out).
        let number = match signal {
            "STOP" => libc::SIGSTOP,
            "CONT" => libc::SIGCONT,
            other => panic!("no signal {other} here"),
        };
        let pid = libc::pid_t::try_from(self.pid).expect("a pid fits pid_t");
        // SAFETY: a plain system call on the child this handle started and has not reaped.
        if unsafe { libc::kill(pid, number) } == 0 {
            true
        } else {
            let e = std::io::Error::last_os_error();
            panic!(
                "cannot send SIG{signal} to redis-server (pid {}): {e}",
                self.pid
            )
        }
    }

    /// Kills the server (if running) and starts a new process on the same port, with the same
    /// options and working directory, then waits until it answers `PING`.
    ///
    /// Data is gone (no persistence), except that a cluster node keeps its `nodes.conf`, so it
    /// rejoins its cluster with the same identity and slots.
    ///
    /// # Panics
    ///
    /// If the port cannot be bound again after several attempts, or the server does not come up.
    pub fn restart(&mut self) {
        self.kill();
        let mut failures = Vec::new();
        for attempt in 1..=RESTART_ATTEMPTS {
            match launch(self.port, &self.dir, &self.log_path, &self.extra_args) {
                Ok(child) => {
                    self.pid = child.id();
                    *self.child.get_mut().unwrap_or_else(PoisonError::into_inner) = Some(child);
                    return;
                }
                Err(LaunchError::Retry(message)) => {
                    failures.push(format!("attempt {attempt}: {message}"));
                    thread::sleep(RESTART_BACKOFF);
                }
                Err(LaunchError::Fatal(message)) => {
                    panic!(
                        "redis-server failed to restart on port {}: {message}",
                        self.port
                    );
                }
            }
        }
        panic!(
            "redis-server failed to restart on port {} in {RESTART_ATTEMPTS} attempts:\n{}",
            self.port,
            failures.join("\n")
        );
    }

    /// Sends a command and returns the reply (a Redis error reply is `Ok(RespValue::Error)`).
    ///
    /// Each call uses a new connection with a [`CMD_TIMEOUT`] (3 s) connect/read/write
    /// timeout, so it returns `Err` for a killed or paused server instead of hanging.
    ///
    /// ```ignore
    /// server.cmd(&["SCAN", "0", "MATCH", "fl:*", "COUNT", "1000"])?;
    /// server.cmd(&["PTTL", "key"])?.as_int();
    /// ```
    pub fn cmd(&self, args: &[&str]) -> Result<RespValue, String> {
        let raw: Vec<&[u8]> = args.iter().map(|arg| arg.as_bytes()).collect();
        self.cmd_bytes(&raw)
    }

    /// [`RedisServer::cmd`] with binary-safe arguments.
    pub fn cmd_bytes(&self, args: &[&[u8]]) -> Result<RespValue, String> {
        resp_command(&self.addr(), args, CMD_TIMEOUT)
    }

    /// The text of `INFO <section>` (parse it with [`info_field`]).
    pub fn info(&self, section: &str) -> Result<String, String> {
        let reply = self.cmd(&["INFO", section])?;
        match reply.as_str() {
            Some(text) => Ok(text.to_owned()),
            None => Err(format!(
                "unexpected INFO reply from {}: {reply:?}",
                self.addr()
            )),
        }
    }

    /// Whether the server can be asked something without waiting for a timeout.
    fn is_responsive(&self) -> bool {
        !self.is_paused() && self.is_running()
    }
}

impl Drop for RedisServer {
    /// Kills the process by PID (bounded wait, never hangs, also when paused), releases the
    /// port and removes the working directory.
    fn drop(&mut self) {
        let child = self
            .child
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut child) = child {
            // Panicking in drop could abort the test binary: a stuck process is only leaked.
            let _ = kill_and_reap(&mut child);
        }
        release_port(self.port, self.cluster);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

// ---------------------------------------------------------------------------------------------
// RedisCluster
// ---------------------------------------------------------------------------------------------

/// A contiguous range of hash slots and the port of the master serving it, from
/// `CLUSTER SLOTS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRange {
    /// First slot, inclusive.
    pub start: u16,
    /// Last slot, inclusive.
    pub end: u16,
    /// Port of the master on `127.0.0.1`.
    pub port: u16,
}

impl SlotRange {
    /// Whether `slot` is in the range.
    pub fn contains(&self, slot: u16) -> bool {
        self.start <= slot && slot <= self.end
    }
}

/// The slot map as seen by `node`.
fn slot_ranges(node: &RedisServer) -> Result<Vec<SlotRange>, String> {
    let addr = node.addr();
    let reply = node.cmd(&["CLUSTER", "SLOTS"])?;
    let entries = reply
        .as_array()
        .ok_or_else(|| format!("unexpected CLUSTER SLOTS reply from {addr}: {reply:?}"))?;
    let slot = |value: &RespValue| value.as_int().and_then(|n| u16::try_from(n).ok());
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        // [start, end, [ip, port, id, ...], replicas...]
        let parsed = match entry.as_array() {
            Some([start, end, master, ..]) => slot(start).zip(slot(end)).zip(
                master
                    .as_array()
                    .and_then(|master| master.get(1))
                    .and_then(RespValue::as_int)
                    .and_then(|port| u16::try_from(port).ok()),
            ),
            _ => None,
        };
        match parsed {
            Some(((start, end), port)) => ranges.push(SlotRange { start, end, port }),
            None => {
                return Err(format!(
                    "malformed CLUSTER SLOTS entry from {addr}: {entry:?}"
                ))
            }
        }
    }
    Ok(ranges)
}

/// Three real cluster masters on `127.0.0.1` covering all 16384 slots (no replicas), killed
/// and cleaned up on drop (each [`RedisServer`] kills itself).
///
/// The nodes run with `--cluster-require-full-coverage no`, so when one master dies the
/// others keep serving their own slots (the dead master's slots answer `MOVED` to it, then
/// connection errors). Two live masters out of three still form a majority, so
/// `cluster_state` stays `ok`.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts a 3-master cluster with a 2 s node timeout and waits until it is healthy.
    ///
    /// Takes 2-3 s: `redis-cli --cluster create` polls the join once a second (1-3 s), and
    /// the other nodes need about another second of gossip to see the full slot map.
    ///
    /// # Panics
    ///
    /// If redis is not installed or the cluster cannot be formed (after retries).
    pub fn start() -> RedisCluster {
        RedisCluster::start_with_node_timeout(DEFAULT_NODE_TIMEOUT_MS)
    }

    /// [`RedisCluster::start`] with another `--cluster-node-timeout` (milliseconds): how long
    /// a silent master takes to be flagged as failing.
    pub fn start_with_node_timeout(node_timeout_ms: u64) -> RedisCluster {
        RedisCluster::start_with_replicas(0, node_timeout_ms)
    }

    /// Three masters with `replicas` replicas each (`redis-cli --cluster create
    /// --cluster-replicas`), nodes timing out after `node_timeout_ms`.
    pub fn start_with_replicas(replicas: usize, node_timeout_ms: u64) -> RedisCluster {
        require_redis();
        let mut failures = Vec::new();
        for attempt in 1..=CLUSTER_START_ATTEMPTS {
            let nodes = (0..CLUSTER_SIZE * (1 + replicas))
                .map(|_| RedisServer::start_cluster_node(node_timeout_ms))
                .collect();
            let cluster = RedisCluster { nodes };
            match cluster
                .create(replicas)
                .and_then(|()| cluster.wait_until_healthy(CLUSTER_READY_TIMEOUT))
            {
                Ok(()) => return cluster,
                // Dropping `cluster` kills the nodes before the next attempt.
                Err(message) => failures.push(format!("attempt {attempt}: {message}")),
            }
        }
        panic!(
            "redis cluster failed to start in {CLUSTER_START_ATTEMPTS} attempts:\n{}",
            failures.join("\n")
        );
    }

    /// Runs `redis-cli --cluster create` over the nodes (no stdin, bounded time).
    fn create(&self, replicas: usize) -> Result<(), String> {
        let replicas = replicas.to_string();
        let addrs = self.addrs();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        self.cli(&args)
    }

    /// Waits until every running, unpaused node reports `cluster_state:ok` and a slot map
    /// covering all 16384 slots with masters from this cluster.
    ///
    /// Useful after [`RedisServer::restart`] of a node. Polls every 50 ms.
    pub fn wait_until_healthy(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.check_healthy() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("cluster not healthy after {timeout:?}: {e}"));
                }
                Err(_) => thread::sleep(CLUSTER_POLL_INTERVAL),
            }
        }
    }

    /// One health check of [`RedisCluster::wait_until_healthy`].
    fn check_healthy(&self) -> Result<(), String> {
        let mut checked = 0;
        for (i, node) in self.nodes.iter().enumerate() {
            if !node.is_responsive() {
                continue;
            }
            let reply = node.cmd(&["CLUSTER", "INFO"])?;
            let info = reply
                .as_str()
                .ok_or_else(|| format!("node {i}: unexpected CLUSTER INFO reply {reply:?}"))?;
            let state = info_field(info, "cluster_state");
            if state != Some("ok") {
                return Err(format!(
                    "node {i} ({}) has cluster_state {state:?}",
                    node.addr()
                ));
            }
            let ranges = slot_ranges(node)?;
            let covered: u32 = ranges
                .iter()
                .map(|r| u32::from(r.end) - u32::from(r.start) + 1)
                .sum();
            if covered != u32::from(CLUSTER_SLOTS) {
                return Err(format!(
                    "node {i} ({}) sees {covered} slots covered",
                    node.addr()
                ));
            }
            if let Some(stranger) = ranges.iter().find(|r| self.index_of_port(r.port).is_none()) {
                return Err(format!(
                    "node {i} ({}) maps slots to a foreign node: {stranger:?}",
                    node.addr()
                ));
            }
            checked += 1;
        }
        if checked == 0 {
            return Err("no node is running".to_owned());
        }
        Ok(())
    }

    /// The masters, in `redis-cli --cluster create` order (node 0 got the lowest slots).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The masters, mutably (to [`kill`](RedisServer::kill), [`restart`](RedisServer::restart)…).
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }

    /// `redis://127.0.0.1:PORT` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `127.0.0.1:PORT` of every node.
    pub fn addrs(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::addr).collect()
    }

    /// Index of the node listening on `port`.
    fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|node| node.port() == port)
    }

    /// The current slot map, asked from the first running, unpaused node.
    ///
    /// # Panics
    ///
    /// If no node answers.
    pub fn slot_map(&self) -> Vec<SlotRange> {
        let mut errors = Vec::new();
        for node in self.nodes.iter().filter(|node| node.is_responsive()) {
            match slot_ranges(node) {
                Ok(ranges) => return ranges,
                Err(e) => errors.push(e),
            }
        }
        panic!("no cluster node answered CLUSTER SLOTS: {errors:?}");
    }

    /// Index (into [`RedisCluster::nodes`]) of the master owning `slot`, from `CLUSTER SLOTS`.
    /// After [`kill_node`](RedisCluster::kill_node) the dead master still owns its slots.
    ///
    /// # Panics
    ///
    /// If `slot` is not below 16384, no node answers, or the slot is unassigned.
    pub fn node_for_slot(&self, slot: u16) -> usize {
        assert!(
            slot < CLUSTER_SLOTS,
            "hash slot {slot} is out of range (0..16384)"
        );
        let ranges = self.slot_map();
        ranges
            .iter()
            .find(|range| range.contains(slot))
            .and_then(|range| self.index_of_port(range.port))
            .unwrap_or_else(|| panic!("no node of this cluster serves slot {slot}: {ranges:?}"))
    }

    /// The hash slot of `key`, asked from a node with `CLUSTER KEYSLOT`.
    ///
    /// # Panics
    ///
    /// If no running, unpaused node answers.
    pub fn keyslot(&self, key: &[u8]) -> u16 {
        let args = [b"CLUSTER".as_slice(), b"KEYSLOT".as_slice(), key];
        let mut errors = Vec::new();
        for node in self.nodes.iter().filter(|node| node.is_responsive()) {
            match node.cmd_bytes(&args) {
                Ok(RespValue::Int(slot)) => match u16::try_from(slot) {
                    Ok(slot) => return slot,
                    Err(_) => errors.push(format!("{}: slot {slot} out of range", node.addr())),
                },
                Ok(other) => errors.push(format!("{}: unexpected reply {other:?}", node.addr())),
                Err(e) => errors.push(e),
            }
        }
        panic!(
            "no cluster node answered CLUSTER KEYSLOT {:?}: {errors:?}",
            String::from_utf8_lossy(key)
        );
    }

    /// Index of the master owning `key` (via [`keyslot`](RedisCluster::keyslot) and
    /// [`node_for_slot`](RedisCluster::node_for_slot)).
    pub fn node_for_key(&self, key: &[u8]) -> usize {
        self.node_for_slot(self.keyslot(key))
    }

    /// Runs `redis-cli ARGS...` to completion, bounded in time; its output is in the error.
    fn cli(&self, args: &[&str]) -> Result<(), String> {
        let first = self.nodes.first().ok_or("a cluster needs nodes")?;
        let log_path = first.dir().join("redis-cli.log");
        let log = File::create(&log_path)
            .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
        let log_for_stderr = log
            .try_clone()
            .map_err(|e| format!("cannot duplicate the log file handle: {e}"))?;
        let mut child = Command::new("redis-cli")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_for_stderr))
            .die_with_parent()
            .spawn()
            .map_err(|e| format!("cannot spawn redis-cli: {e}"))?;
        let deadline = Instant::now() + CLUSTER_CREATE_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(format!(
                        "redis-cli {args:?}: {status}; output:\n{}",
                        read_lossy_from(&log_path, 0)
                    ))
                }
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    kill_and_reap(&mut child);
                    return Err(format!(
                        "redis-cli {args:?} took longer than {CLUSTER_CREATE_TIMEOUT:?}; \
                         output:\n{}",
                        read_lossy_from(&log_path, 0)
                    ));
                }
                Err(e) => return Err(format!("cannot poll redis-cli: {e}")),
            }
        }
    }

    /// Starts a new, empty master and joins it to the cluster (`--cluster add-node`); returns
    /// its index. It owns no slot until a [`rebalance`](RedisCluster::rebalance).
    pub fn add_master(&mut self, node_timeout_ms: u64) -> Result<usize, String> {
        let node = RedisServer::start_cluster_node(node_timeout_ms);
        let existing = self.nodes[0].addr();
        self.cli(&["--cluster", "add-node", &node.addr(), &existing])?;
        self.nodes.push(node);
        // Wait until the new node knows the cluster, and every node knows the new one: until
        // gossip has spread it, `redis-cli --cluster rebalance` finds that the nodes "don't
        // agree about configuration" and gives up.
        let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
        while Instant::now() < deadline {
            let ok = self.nodes.last().is_some_and(|n| {
                n.cmd(&["CLUSTER", "INFO"])
                    .ok()
                    .and_then(|r| r.as_str().map(|i| i.contains("cluster_state:ok")))
                    .unwrap_or(false)
            });
            if ok && self.views_agree() {
                return Ok(self.nodes.len() - 1);
            }
            thread::sleep(CLUSTER_POLL_INTERVAL);
        }
        Err("the new master never joined, or the nodes never agreed on it".to_owned())
    }

    /// Whether every node sees every other one, none of them in a handshake or failed, and all
    /// see the same slot owners (what `redis-cli --cluster check` calls agreeing).
    fn views_agree(&self) -> bool {
        let mut first: Option<Vec<String>> = None;
        for node in &self.nodes {
            let Some(view) = node
                .cmd(&["CLUSTER", "NODES"])
                .ok()
                .and_then(|r| r.as_str().map(str::to_owned))
            else {
                return false;
            };
            let lines: Vec<&str> = view.lines().filter(|l| !l.trim().is_empty()).collect();
            if lines.len() != self.nodes.len()
                || lines
                    .iter()
                    .any(|l| l.contains("handshake") || l.contains("fail") || l.contains("noaddr"))
            {
                return false;
            }
            // Each node's id and the slots it owns (fields 9 on); `myself` flags differ.
            let mut owners: Vec<String> = lines
                .iter()
                .map(|l| {
                    let fields: Vec<&str> = l.split_whitespace().collect();
                    let id = fields.first().copied().unwrap_or("");
                    format!("{id} {}", fields.get(8..).unwrap_or(&[]).join(" "))
                })
                .collect();
            owners.sort();
            match &first {
                None => first = Some(owners),
                Some(seen) if *seen != owners => return false,
                Some(_) => {}
            }
        }
        true
    }

    /// Spreads slots evenly over every master, the empty ones included (`--cluster rebalance
    /// --cluster-use-empty-masters`).
    pub fn rebalance(&self) -> Result<(), String> {
        let entry = self.nodes[0].addr();
        self.cli(&[
            "--cluster",
            "rebalance",
            &entry,
            "--cluster-use-empty-masters",
            "--cluster-pipeline",
            "10",
        ])
    }

    /// Moves `slots` hash slots from node `from` to node `to` with `redis-cli --cluster reshard`
    /// (the slots migrate key by key, with ASK redirections meanwhile). Blocks until done,
    /// bounded in time.
    pub fn reshard(&self, from: usize, to: usize, slots: u32) -> Result<(), String> {
        let id = |i: usize| -> Result<String, String> {
            let node = self.nodes.get(i).ok_or("no such node")?;
            node.cmd(&["CLUSTER", "MYID"])?
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| "no node id".to_owned())
        };
        let (from_id, to_id) = (id(from)?, id(to)?);
        let entry = self.nodes[from].addr();
        let slots = slots.to_string();
        self.cli(&[
            "--cluster",
            "reshard",
            &entry,
            "--cluster-from",
            &from_id,
            "--cluster-to",
            &to_id,
            "--cluster-slots",
            &slots,
            "--cluster-yes",
            "--cluster-pipeline",
            "10",
        ])
    }

    /// Kills node `i` with `SIGKILL` (see [`RedisServer::kill`]).
    ///
    /// # Panics
    ///
    /// If `i` is not a node index.
    pub fn kill_node(&mut self, i: usize) {
        let count = self.nodes.len();
        match self.nodes.get_mut(i) {
            Some(node) => node.kill(),
            None => panic!("cluster node index {i} out of range (0..{count})"),
        }
    }
}
