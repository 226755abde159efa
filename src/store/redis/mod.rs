//! The Redis store: every decision is one Lua script call, atomic inside Redis, on Redis's
//! clock, on a standalone server or a cluster.
//!
//! The scripts (`*.lua` beside this file) are the same arithmetic as `src/algorithm/`, line for
//! line; a differential test holds the two together. They are joined into one script at compile
//! time and run with EVALSHA (loaded again on NOSCRIPT, as after a server restart).
//!
//! Key layout: `<prefix>{<key>}:<rule>:<algorithm>`. Key and rule are percent-encoded, so `:`,
//! `{` and `}` never appear inside them and no two (rule, key) pairs share a Redis key; keys over
//! 128 bytes were already replaced by their SHA-256 (see [`Key`]). The hash tag is
//! the key, so all the rules on one key decide in one atomic call on a cluster too.
//!
//! The scripts need Redis 5.0 or newer (script effects replication, which lets a script read
//! `TIME` and then write); [`RedisStoreBuilder::connect`] checks the server's version.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, RedisError, Script};

use super::{BoxFuture, Check, Lease, Listing, Op, Refund, SlotOp, Store, RESPONSE_TIMEOUT};
use crate::algorithm::us;
use crate::decision::ByListing;
use crate::error::{ConfigError, Error};
use crate::{Algorithm, Clock, Decision, Key, Rule, StoreError, Taken};

mod keys;

pub use keys::slot;
use keys::{listing_key, pause_key, redis_key, slots_key};

/// The Redis key of `rule`'s state for `key` under the default prefix, as text (the encoding
/// is ASCII), for tools such as `redis-cli`. A hook for benchmarks and audits.
#[doc(hidden)]
pub fn display_key(rule: &crate::Rule, key: &crate::Key) -> String {
    String::from_utf8_lossy(&redis_key(DEFAULT_PREFIX, rule, key)).into_owned()
}

/// The default time allowed to establish a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "fleetlimit:";

/// The oldest Redis the scripts run on: 5.0 replicates a script's effects, so a script may read
/// `TIME` and then write.
pub const MIN_REDIS_VERSION: (u32, u32) = (5, 0);

/// Numbers the script answers per check.
const PER_DECISION: usize = 6;
/// Which listing made a decision, from the anchor the script answers for it (nothing taken):
/// -2 the allow list, -3 the deny list, -(4 + µs left) a block; a real anchor is never negative.
fn by_listing(anchor: i64) -> ByListing {
    match anchor {
        -2 => ByListing::ALLOW,
        -3 => ByListing::DENY,
        block if block <= -4 => ByListing::block(Duration::from_micros(
            block.saturating_add(4).unsigned_abs(),
        )),
        _ => ByListing::NONE,
    }
}

/// Reads and sets a key's listing (`listing.lua`); admin calls are rare, so it is sent whole.
const LISTING_SCRIPT: &str = include_str!("listing.lua");

/// A pause in whole milliseconds, as Redis keeps it: rounded up (a pause never ends early), at
/// least 1 (a zero `PX` is an error), at most about 49 days.
fn pause_ms(pause: Duration) -> u64 {
    pause
        .as_nanos()
        .div_ceil(1_000_000)
        .clamp(1, u128::from(u32::MAX)) as u64
}

/// A pause that only grows: set unless the one in force ends later.
/// (`PTTL` before a write needs effects replication too, on a Redis 5.0–6.2 set otherwise.)
const EXTEND_PAUSE_SCRIPT: &str = "redis.replicate_commands() \
     if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then \
     redis.call('SET', KEYS[1], 1, 'PX', ARGV[1]) end return 1";

/// Concurrency slots (`slots.lua`), sent whole with `EVAL` (one command on every kind of
/// connection, cluster included).
const SLOTS_SCRIPT: &str = include_str!("slots.lua");

const SCRIPT: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("fixed_window.lua"),
    include_str!("sliding_log.lua"),
    include_str!("sliding_window.lua"),
    include_str!("token_bucket.lua"),
    include_str!("gcra.lua"),
    include_str!("apply.lua"),
);

/// A [`Store`] in Redis: standalone ([`connect`](RedisStore::connect)), Redis Cluster
/// ([`cluster`](RedisStore::cluster)) or through a `deadpool-redis` pool
/// ([`from_pool`](RedisStoreBuilder::pool)). Cheap to clone; clones share one connection.
///
/// ```no_run
/// use fleetlimit::store::RedisStore;
///
/// # async fn run() -> Result<(), fleetlimit::Error> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let cluster = RedisStore::cluster(&["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]).await?;
/// # let _ = (store, cluster);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    script: Script,
    /// The hashes of the small scripts (listings, concurrency slots), run with EVALSHA.
    listing_hash: Box<str>,
    slots_hash: Box<str>,
    extend_pause_hash: Box<str>,
    prefix: Box<str>,
    connect_timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
}

/// A connection made on first use (or when the store is built, if Redis answers then), so a
/// store can be built while Redis is away: until it answers, calls fail and the limiter's outage
/// policy decides.
enum Conn {
    /// One multiplexed, pipelined connection that reconnects by itself after an I/O error;
    /// replaced when it may never see one (see [`Inner::on_single`]).
    Single {
        client: Box<redis::Client>,
        conn: Arc<Connector<ConnectionManager>>,
        /// A probe of the connection is in flight (one at a time).
        probing: Arc<AtomicBool>,
    },
    /// A cluster connection, made again (with a fresh slot map) after it fails, or in the
    /// background when a hung master's replica has taken over: a master that failed over
    /// lives at another address, which a new connection learns.
    Cluster {
        client: Box<redis::cluster::ClusterClient>,
        /// The URLs given, for a connection made while a node hangs ([`Seeds::without`]).
        seeds: Arc<Seeds>,
        conn: Arc<Connector<ClusterConnection>>,
        /// Which master serves each slot, as the last connection learnt it.
        masters: Arc<Masters>,
    },
    /// A user's pool: one connection is taken out and shared (multiplexed) until it fails, so
    /// the hot path never pays a checkout.
    Pool {
        pool: deadpool_redis::Pool,
        conn: Arc<Connector<MultiplexedConnection>>,
    },
    /// The master Sentinel names: one multiplexed connection to it, found again (through the
    /// Sentinels) after it fails, so a failover is followed.
    Sentinel {
        sentinels: Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>,
        conn: Arc<Connector<MultiplexedConnection>>,
    },
}

/// The `host:port` a URL names, as written (an IPv6 host bracketed).
fn url_node(url: &str) -> &str {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    host_port.split(['/', '?']).next().unwrap_or(host_port)
}

/// `address` (`host:port`, as `CLUSTER SLOTS` names a node) as a URL writes it.
fn in_url(address: &str) -> String {
    match address.rsplit_once(':') {
        Some((host, port)) if host.contains(':') => format!("[{host}]:{port}"),
        _ => address.to_owned(),
    }
}

/// Which of `urls` reach `address` (a node as `CLUSTER SLOTS` names it): name it as written,
/// or stand for one of its socket addresses, a name on either side looked up (a URL without a
/// port is at 6379). Every lookup runs at once, within `limit` in all; what is not found by then
/// counts as not reaching it. (A lookup given up on still ends on its own blocking thread, as
/// every `getaddrinfo` does.)
async fn reaching(urls: &[String], address: &str, limit: Duration) -> Vec<bool> {
    let hung = in_url(address);
    let mut nodes: Vec<String> = urls.iter().map(|u| with_port(url_node(u))).collect();
    nodes.push(hung.clone());
    let mut found = vec![Vec::new(); nodes.len()];
    let mut lookups = tokio::task::JoinSet::new();
    for (i, node) in nodes.into_iter().enumerate() {
        lookups.spawn(async move { (i, socket_addresses(&node).await) });
    }
    let _ = tokio::time::timeout(limit, async {
        while let Some(done) = lookups.join_next().await {
            if let Ok((i, addresses)) = done {
                found[i] = addresses;
            }
        }
    })
    .await;
    let hung_at = found.pop().unwrap_or_default();
    urls.iter()
        .zip(&found)
        .map(|(url, at)| url_node(url) == hung || at.iter().any(|a| hung_at.contains(a)))
        .collect()
}

/// `node` (`host:port` as a URL writes it) with Redis's port when it names none.
fn with_port(node: &str) -> String {
    let has_port = match node.rsplit_once(']') {
        Some((_, after)) => after.starts_with(':'),
        None => node.contains(':'),
    };
    if has_port {
        node.to_owned()
    } else {
        format!("{node}:6379")
    }
}

/// The socket addresses `node` (`host:port`) stands for: itself when it is one, else what its
/// name resolves to (nothing when it cannot be looked up).
async fn socket_addresses(node: &str) -> Vec<std::net::SocketAddr> {
    if let Ok(address) = node.parse() {
        return vec![address];
    }
    match tokio::net::lookup_host(node).await {
        Ok(found) => found.collect(),
        Err(_) => Vec::new(),
    }
}

/// `url` naming `other` (`host:port`, as `CLUSTER SLOTS` names a node) in place of its own
/// node, its scheme, credentials and database kept.
fn url_at(url: &str, other: &str) -> String {
    let node = url_node(url);
    // `url_node` is a slice of `url`: replace exactly it.
    let start = node.as_ptr() as usize - url.as_ptr() as usize;
    let mut moved = url.to_owned();
    moved.replace_range(start..start + node.len(), &in_url(other));
    moved
}

/// How a cluster store makes a client for some nodes: the same settings as its own.
type ClientFor =
    dyn Fn(Vec<&str>) -> redis::RedisResult<redis::cluster::ClusterClient> + Send + Sync;

/// The URLs a cluster store was given. redis-rs connects to every node it is given, and waits
/// for a hung one up to the connect timeout: a connection made to get past a hung node must
/// not be given it.
struct Seeds {
    urls: Vec<String>,
    client_for: Box<ClientFor>,
}

impl Seeds {
    /// A client for the URLs given but those that reach `address`, a hung node, by its address
    /// or by a name (see [`reaching`]); when every URL reaches it, for the same URLs pointed at
    /// `others`, the other masters. `None` when no URL reaches it (the store's own client will
    /// do).
    async fn without(
        &self,
        address: &str,
        others: &[String],
        limit: Duration,
    ) -> Option<redis::cluster::ClusterClient> {
        let reach = reaching(&self.urls, address, limit).await;
        let rest: Vec<&str> = self
            .urls
            .iter()
            .zip(&reach)
            .filter(|(_, reaches)| !**reaches)
            .map(|(url, _)| url.as_str())
            .collect();
        if rest.len() == self.urls.len() {
            return None;
        }
        if !rest.is_empty() {
            return (self.client_for)(rest).ok();
        }
        let moved: Vec<String> = self
            .urls
            .iter()
            .flat_map(|url| others.iter().map(|other| url_at(url, other)))
            .collect();
        if moved.is_empty() {
            return None;
        }
        (self.client_for)(moved.iter().map(String::as_str).collect()).ok()
    }
}

/// The cluster's masters as the store last learnt them (`CLUSTER SLOTS`, read by each new
/// connection): a number per master address, in order of first sight, and each slot's master.
/// The limiter keeps one circuit breaker per master, so a hung master's breaker opens after a
/// few failures on any of its slots, and a recovering master gets one probe, not one per slot.
#[derive(Default)]
struct Masters {
    addresses: parking_lot::Mutex<Vec<String>>,
    /// Each slot's master number; [`Masters::UNKNOWN`] until a map is learnt.
    of_slot: arc_swap::ArcSwap<Vec<u8>>,
    /// When a call abandoned at its deadline last made the store ask the cluster whether a
    /// master was replaced (see [`Inner::suspect_hung_master`]).
    asked_at: parking_lot::Mutex<Option<std::time::Instant>>,
}

impl Masters {
    /// More masters than a cluster is run with; past it, a slot has a breaker of its own.
    const MAX: usize = 255;
    const UNKNOWN: u8 = u8::MAX;

    /// The breaker of every slot before any map is learnt (no master has answered yet).
    const NO_MAP: usize = Self::MAX + 16_384;

    /// The breaker of `slot`: its master's; one of its own while a learnt map names no master
    /// for it; one for them all before any map is learnt (a breaker per slot then let a
    /// cluster unreachable from the start cost nearly every decision its whole deadline).
    fn breaker(&self, slot: u16) -> usize {
        match self.of_slot.load().get(usize::from(slot)) {
            Some(&master) if master != Self::UNKNOWN => usize::from(master),
            Some(_) => Self::MAX + usize::from(slot),
            None => Self::NO_MAP,
        }
    }

    /// `address`'s number, given one if it has none and there is room.
    fn number(addresses: &mut Vec<String>, address: &str) -> Option<u8> {
        if let Some(i) = addresses.iter().position(|a| a == address) {
            return u8::try_from(i).ok();
        }
        if addresses.len() >= Self::MAX {
            tracing::warn!(
                "fleetlimit: more than {} cluster masters; the others' slots get a breaker each",
                Self::MAX
            );
            return None;
        }
        addresses.push(address.to_owned());
        u8::try_from(addresses.len() - 1).ok()
    }

    /// Learn the slot map from a `CLUSTER SLOTS` answer, numbering its masters afresh (so
    /// masters gone since free their numbers; a breaker's state outlives a renumbering by at
    /// most its cool-down). A master whose endpoint the answer cannot name (`?`, empty, null)
    /// is left unknown, never merged with another. An answer not shaped as one changes nothing.
    fn learn(&self, answer: &redis::Value) {
        let redis::Value::Array(ranges) = answer else {
            return;
        };
        let mut of_slot = vec![Self::UNKNOWN; 16_384];
        let mut addresses = Vec::new();
        for range in ranges {
            let redis::Value::Array(parts) = range else {
                continue;
            };
            let (Some(redis::Value::Int(first)), Some(redis::Value::Int(last))) =
                (parts.first(), parts.get(1))
            else {
                continue;
            };
            let Some(redis::Value::Array(master)) = parts.get(2) else {
                continue;
            };
            let host = match master.first() {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(redis::Value::SimpleString(s)) => s.clone(),
                _ => continue,
            };
            let Some(redis::Value::Int(port)) = master.get(1) else {
                continue;
            };
            if host.is_empty() || host == "?" {
                continue;
            }
            let Some(number) = Self::number(&mut addresses, &format!("{host}:{port}")) else {
                continue;
            };
            let (first, last) = ((*first).max(0) as usize, (*last).clamp(0, 16_383) as usize);
            for slot in of_slot.iter_mut().take(last + 1).skip(first) {
                *slot = number;
            }
        }
        *self.addresses.lock() = addresses;
        self.of_slot.store(Arc::new(of_slot));
    }

    /// The address of `slot`'s master, if known.
    fn address_of(&self, slot: u16) -> Option<String> {
        let number = *self.of_slot.load().get(usize::from(slot))?;
        self.addresses.lock().get(usize::from(number)).cloned()
    }

    /// Whether a `CLUSTER SLOTS` answer names another master for `slot` than this map does
    /// (one this map does not know counts; an answer that names none does not).
    fn moved_away(&self, slot: u16, answer: &redis::Value) -> bool {
        let seen = Masters::default();
        seen.learn(answer);
        seen.address_of(slot)
            .is_some_and(|theirs| self.address_of(slot).as_ref() != Some(&theirs))
    }

    /// Whether a suspicion may be checked now: at most one check a second.
    fn may_ask(&self) -> bool {
        let mut asked_at = self.asked_at.lock();
        let now = std::time::Instant::now();
        if asked_at.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
            return false;
        }
        *asked_at = Some(now);
        true
    }

    /// A MOVED answer: `slot` is now served at `address`.
    fn moved(&self, slot: u16, address: &str) {
        let mut addresses = self.addresses.lock();
        let number = Self::number(&mut addresses, address).unwrap_or(Self::UNKNOWN);
        let mut of_slot = (**self.of_slot.load()).clone();
        if let Some(owner) = of_slot.get_mut(usize::from(slot)) {
            *owner = number;
            self.of_slot.store(Arc::new(of_slot));
        }
    }
}

/// A connection made in the background, one attempt at a time, each bounded by the connect
/// timeout. Callers wait for it within their own deadline, and a caller that stops waiting
/// stops nothing: a decision's deadline is tens of milliseconds, and connecting can take
/// longer (a cluster with a hung node, TLS across a slow link). Were the attempt the caller's
/// own, every caller would abandon it and none would ever connect.
struct Connector<C> {
    /// Read on every call: lock-free.
    current: arc_swap::ArcSwapOption<C>,
    /// The attempt in flight: its outcome is published when it ends.
    attempt: parking_lot::Mutex<Option<Outcome<C>>>,
}

type Outcome<C> = tokio::sync::watch::Receiver<Option<Result<Arc<C>, StoreError>>>;

impl<C: Clone + Send + Sync + 'static> Connector<C> {
    fn new() -> Arc<Connector<C>> {
        Arc::new(Connector {
            current: arc_swap::ArcSwapOption::empty(),
            attempt: parking_lot::Mutex::new(None),
        })
    }

    fn current(&self) -> Option<Arc<C>> {
        self.current.load_full()
    }

    /// Forget `failed`, the connection a call failed on, if it is still the current one: the
    /// next caller connects again. A call still in flight on a connection already replaced (by
    /// an earlier failure's caller, or in the background) can fail after the replacement is
    /// made; it must not throw the new connection away too. True when it was forgotten.
    fn forget(&self, failed: &Arc<C>) -> bool {
        let before = self.current.compare_and_swap(failed, None);
        before.as_ref().is_some_and(|c| Arc::ptr_eq(c, failed))
    }

    /// The connection, made by `connect` (within `limit`) if there is none and no attempt is
    /// in flight; else the attempt's outcome.
    async fn get<F>(
        self: &Arc<Self>,
        limit: Duration,
        connect: impl FnOnce() -> F,
    ) -> Result<Arc<C>, StoreError>
    where
        F: std::future::Future<Output = Result<C, StoreError>> + Send + 'static,
    {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let (mut outcome, run) = {
            let mut attempt = self.attempt.lock();
            // Made while this caller waited for the lock: no second attempt.
            if let Some(conn) = self.current() {
                return Ok(conn);
            }
            match attempt.as_ref() {
                Some(outcome) => (outcome.clone(), None),
                None => {
                    let (outcome, run) = self.start(&mut attempt, limit, connect());
                    (outcome, Some(run))
                }
            }
        };
        if let Some(run) = run {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(run);
                }
                Err(_) => run.await,
            }
        }
        let ended = outcome
            .wait_for(Option::is_some)
            .await
            .map_err(|_| StoreError::Connection("the connection attempt was dropped".into()))?;
        match &*ended {
            Some(result) => result.clone(),
            None => Err(StoreError::Connection("no connection".into())),
        }
    }
}

impl<C: Clone + Send + Sync + 'static> Connector<C> {
    /// A new attempt, recorded in `attempt` (held locked): its outcome, and the work to run,
    /// which publishes the connection it makes.
    fn start<F>(
        self: &Arc<Self>,
        attempt: &mut Option<Outcome<C>>,
        limit: Duration,
        work: F,
    ) -> (
        Outcome<C>,
        impl std::future::Future<Output = ()> + Send + 'static,
    )
    where
        F: std::future::Future<Output = Result<C, StoreError>> + Send + 'static,
    {
        let (publish, outcome) = tokio::sync::watch::channel(None);
        *attempt = Some(outcome.clone());
        let ends = EndsAttempt(self.clone(), outcome.clone());
        let run = async move {
            let result = tokio::time::timeout(limit, work)
                .await
                .unwrap_or(Err(StoreError::Timeout(limit)))
                .map(Arc::new);
            if let Ok(conn) = &result {
                ends.0.current.store(Some(conn.clone()));
            }
            drop(ends);
            let _ = publish.send(Some(result));
        };
        (outcome, run)
    }

    /// Make a new connection in the background, by `connect` (within `limit`), while the
    /// current one goes on serving its calls: it takes over once made, and a failed attempt
    /// changes nothing (it is logged). Nothing is started while another attempt is in flight:
    /// false.
    fn replace<F>(self: &Arc<Self>, limit: Duration, connect: impl FnOnce() -> F) -> bool
    where
        F: std::future::Future<Output = Result<C, StoreError>> + Send + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let (outcome, run) = {
            let mut attempt = self.attempt.lock();
            if attempt.is_some() {
                return false;
            }
            self.start(&mut attempt, limit, connect())
        };
        // Spawned with the lock released: a runtime shutting down drops the task at once, and
        // its `EndsAttempt` takes the lock.
        runtime.spawn(async move {
            run.await;
            if let Some(Err(error)) = &*outcome.borrow() {
                tracing::warn!(%error, "fleetlimit: connecting again in the background failed; the current connection goes on");
            }
        });
        true
    }
}

/// Clears its attempt when the attempt ends, however it ends: completed, or its task dropped
/// (its runtime shut down, a panic). Left in place, a dead attempt would answer every later
/// caller, and the store would never connect again.
struct EndsAttempt<C>(Arc<Connector<C>>, Outcome<C>);

impl<C> Drop for EndsAttempt<C> {
    fn drop(&mut self) {
        let mut attempt = self.0.attempt.lock();
        if attempt.as_ref().is_some_and(|a| a.same_channel(&self.1)) {
            *attempt = None;
        }
    }
}

/// A connection ready for one call.
enum Ready {
    /// As the connector holds it: replaced if it turns out dead or a replica's.
    Single(Arc<ConnectionManager>),
    /// As the connector holds it: a call that finds a node dead forgets this one, not a newer.
    Cluster(Arc<ClusterConnection>),
    /// Shared until it fails (a pool's, or Sentinel's master's): then forgotten.
    Shared(Arc<MultiplexedConnection>),
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner.conn {
            Conn::Single { .. } => "standalone",
            Conn::Cluster { .. } => "cluster",
            Conn::Pool { .. } => "pool",
            Conn::Sentinel { .. } => "sentinel",
        };
        f.debug_struct("RedisStore")
            .field("kind", &kind)
            .field("prefix", &self.inner.prefix)
            .field("connect_timeout", &self.inner.connect_timeout)
            .field("explicit_clock", &self.inner.clock.is_some())
            .finish()
    }
}

/// Configures a [`RedisStore`].
#[must_use = "a builder does nothing until it connects"]
pub struct RedisStoreBuilder {
    prefix: String,
    connect_timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
    /// The master's username (if not the default user) and password, with Sentinel.
    master_auth: Option<(Option<String>, String)>,
    #[cfg(feature = "tls")]
    tls: Option<redis::TlsCertificates>,
}

/// Without the master's password.
impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("RedisStoreBuilder");
        d.field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("clock", &self.clock)
            .field(
                "master_auth",
                &self
                    .master_auth
                    .as_ref()
                    .map(|(username, _)| (username, "<password>")),
            );
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls.is_some());
        d.finish()
    }
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        RedisStoreBuilder {
            prefix: DEFAULT_PREFIX.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            clock: None,
            master_auth: None,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl RedisStoreBuilder {
    /// With [`sentinel`](Self::sentinel): the credentials of the master the Sentinels name
    /// (`username` `None` for the default user, as `requirepass` sets; `Some` for an ACL user).
    /// A Sentinel URL's password is the Sentinels' own, never sent to the master; without this,
    /// a master that asks for a password answers every call `NOAUTH`, and every decision
    /// follows the outage policy. The other connections take credentials from their URLs.
    pub fn sentinel_master_auth(mut self, username: Option<&str>, password: &str) -> Self {
        self.master_auth = Some((username.map(str::to_owned), password.to_owned()));
        self
    }

    /// Prefix every key (default `fleetlimit:`). Must not contain `{` or `}`, which would break
    /// the hash tag that keeps a decision's keys on one cluster slot.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long establishing a connection may take (default 2 s), when the store is built and
    /// when it reconnects. The [`Limiter`](crate::Limiter)'s deadline covers each decision,
    /// connecting included; a call on a standalone or Sentinel connection also gives up after
    /// 5 s without an answer (a pool's connections have the pool's own settings).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Pass time from this clock to the scripts instead of reading Redis's `TIME`. For
    /// deterministic tests; in production the fleet should share Redis's one clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Trust this certificate authority (PEM) for `rediss://` connections, instead of the
    /// system's roots (a managed service's or your own CA). A malformed certificate is a
    /// configuration error when connecting.
    #[cfg(feature = "tls")]
    pub fn ca_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.get_or_insert_with(no_certificates).root_cert = Some(pem.into());
        self
    }

    /// Present this client certificate and key (PEM) on `rediss://` connections (mutual TLS).
    #[cfg(feature = "tls")]
    pub fn client_certificate(
        mut self,
        certificate_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.get_or_insert_with(no_certificates).client_tls = Some(redis::ClientTlsConfig {
            client_cert: certificate_pem.into(),
            client_key: key_pem.into(),
        });
        self
    }

    /// A client for `url`, with this builder's TLS settings.
    fn client(&self, url: &str) -> Result<redis::Client, ConfigError> {
        let invalid = |e: RedisError| ConfigError::Invalid {
            setting: "url",
            reason: e.to_string(),
        };
        #[cfg(feature = "tls")]
        if let Some(certificates) = &self.tls {
            install_crypto();
            return redis::Client::build_with_tls(url, certificates.clone()).map_err(invalid);
        }
        #[cfg(feature = "tls")]
        if url.starts_with("rediss://") {
            install_crypto();
        }
        redis::Client::open(url).map_err(invalid)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        #[cfg(feature = "tls")]
        if let Some(certificates) = &self.tls {
            check_certificates(certificates)?;
        }
        if self.prefix.contains(['{', '}']) {
            return Err(ConfigError::Invalid {
                setting: "prefix",
                reason: format!("{:?} must not contain '{{' or '}}'", self.prefix),
            });
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "connect_timeout",
                reason: "must be greater than zero".into(),
            });
        }
        Ok(())
    }

    fn finish(self, conn: Conn) -> RedisStore {
        RedisStore {
            inner: Arc::new(Inner {
                conn,
                script: Script::new(SCRIPT),
                listing_hash: Script::new(LISTING_SCRIPT).get_hash().into(),
                slots_hash: Script::new(SLOTS_SCRIPT).get_hash().into(),
                extend_pause_hash: Script::new(EXTEND_PAUSE_SCRIPT).get_hash().into(),
                prefix: self.prefix.into(),
                connect_timeout: self.connect_timeout,
                clock: self.clock,
            }),
        }
    }

    /// Connect to a standalone server (`redis://host:port[/db]`, `rediss://…`). A malformed URL
    /// or a server older than Redis 5.0 is an error; an unreachable server is not: the store is
    /// built, logs a warning, and connects when Redis answers (meanwhile the limiter's outage
    /// policy decides).
    pub async fn connect(self, url: &str) -> Result<RedisStore, Error> {
        self.validate()?;
        let client = self.client(url)?;
        let store = self.finish(Conn::Single {
            client: Box::new(client),
            conn: Connector::new(),
            probing: Default::default(),
        });
        store.try_first_connection().await?;
        Ok(store)
    }

    /// Connect to a Redis Cluster through any of its nodes; as [`connect`](Self::connect), an
    /// unreachable cluster is not an error.
    pub async fn cluster<U: AsRef<str>>(self, urls: &[U]) -> Result<RedisStore, Error> {
        self.validate()?;
        let nodes: Vec<&str> = urls.iter().map(AsRef::as_ref).collect();
        #[cfg(feature = "tls")]
        if nodes.iter().any(|n| n.starts_with("rediss://")) || self.tls.is_some() {
            install_crypto();
        }
        let connect_timeout = self.connect_timeout;
        #[cfg(feature = "tls")]
        let certificates = self.tls.clone();
        // No retries inside redis-rs: it would also resend a call after a broken connection,
        // when the script may have run. The store follows redirections itself, within the
        // decision's deadline (`follow_redirections`).
        let client_for = move |nodes: Vec<&str>| {
            #[allow(unused_mut)]
            let mut builder = redis::cluster::ClusterClient::builder(nodes)
                .connection_timeout(connect_timeout)
                .retries(0);
            #[cfg(feature = "tls")]
            if let Some(certificates) = &certificates {
                builder = builder.certs(certificates.clone());
            }
            builder.build()
        };
        let client = client_for(nodes).map_err(|e| ConfigError::Invalid {
            setting: "urls",
            reason: e.to_string(),
        })?;
        let seeds = Seeds {
            urls: urls.iter().map(|u| u.as_ref().to_owned()).collect(),
            client_for: Box::new(client_for),
        };
        let store = self.finish(Conn::Cluster {
            client: Box::new(client),
            seeds: Arc::new(seeds),
            conn: Connector::new(),
            masters: Arc::default(),
        });
        store.try_first_connection().await?;
        Ok(store)
    }

    /// Find the master through Redis Sentinel: `sentinels` are Sentinel URLs
    /// (`redis://host:26379`), `master` the name they monitor. The store follows a failover: when
    /// the master's connection fails (or it turned replica), the Sentinels are asked again. As
    /// [`connect`](Self::connect), unreachable Sentinels are not an error.
    ///
    /// With `rediss://` Sentinel URLs the master is reached over TLS too (verified against the
    /// system's trust store). A
    /// [`ca_certificate`](Self::ca_certificate) or client certificate is refused here: redis-rs
    /// offers no way to give them for the nodes a Sentinel names, and accepting them would
    /// connect without them.
    pub async fn sentinel<U: AsRef<str>>(
        self,
        sentinels: &[U],
        master: &str,
    ) -> Result<RedisStore, Error> {
        self.validate()?;
        #[cfg(feature = "tls")]
        if self.tls.is_some() {
            return Err(ConfigError::Invalid {
                setting: "ca_certificate",
                reason: "a CA or client certificate cannot be used with Sentinel (redis-rs cannot \
                         pass them to the master a Sentinel names); put the CA in the system's \
                         trust store"
                    .into(),
            }
            .into());
        }
        let urls: Vec<&str> = sentinels.iter().map(AsRef::as_ref).collect();
        // The master's link as secure as the Sentinels': redis-rs reaches the master it is
        // told of in plain TCP unless told otherwise.
        let tls = urls.iter().any(|u| u.starts_with("rediss://"));
        let mut node = redis::sentinel::SentinelNodeConnectionInfo::default();
        if tls {
            node = node.set_tls_mode(redis::TlsMode::Secure);
        }
        if let Some((username, password)) = &self.master_auth {
            let mut info = redis::RedisConnectionInfo::default().set_password(password);
            if let Some(username) = username {
                info = info.set_username(username);
            }
            node = node.set_redis_connection_info(info);
        }
        let node = (tls || self.master_auth.is_some()).then_some(node);
        // redis-rs takes the name as a `String` without TLS and as `impl AsRef<str>` with it.
        #[cfg(not(feature = "tls"))]
        let master = master.to_owned();
        let client = redis::sentinel::SentinelClient::build(
            urls,
            master,
            node,
            redis::sentinel::SentinelServerType::Master,
        )
        .map_err(|e| ConfigError::Invalid {
            setting: "sentinels",
            reason: e.to_string(),
        })?;
        let store = self.finish(Conn::Sentinel {
            sentinels: Arc::new(tokio::sync::Mutex::new(client)),
            conn: Connector::new(),
        });
        store.try_first_connection().await?;
        Ok(store)
    }

    /// Use connections from a `deadpool-redis` pool. One connection is checked out and shared
    /// (it is multiplexed); a new one is checked out only after it fails.
    pub fn pool(self, pool: deadpool_redis::Pool) -> Result<RedisStore, Error> {
        self.validate()?;
        Ok(self.finish(Conn::Pool {
            pool,
            conn: Connector::new(),
        }))
    }
}

impl RedisStore {
    /// Connect now if Redis answers: a server that is too old, or that refuses the credentials
    /// (a wrong password, or none where one is needed), is a configuration error; one that
    /// does not answer is only a warning.
    async fn try_first_connection(&self) -> Result<(), Error> {
        match self.inner.connection().await {
            Ok(_) => Ok(()),
            Err(StoreError::Script(reason))
                if reason.starts_with(TOO_OLD) || reason.starts_with(CREDENTIALS_REFUSED) =>
            {
                Err(ConfigError::Invalid {
                    setting: "url",
                    reason,
                }
                .into())
            }
            Err(error) => {
                tracing::warn!(
                    %error,
                    "fleetlimit: Redis does not answer yet; decisions follow the outage policy until it does"
                );
                Ok(())
            }
        }
    }
}

/// TLS with rustls needs a process-wide crypto provider: ring, unless the application installed
/// one already.
#[cfg(feature = "tls")]
fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Certificates and keys must be PEM that parses: a wrong TLS setting is a configuration error
/// when the store is built, not a failure on every call.
#[cfg(feature = "tls")]
fn check_certificates(certificates: &redis::TlsCertificates) -> Result<(), ConfigError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let invalid = |what: &str| ConfigError::Invalid {
        setting: "tls",
        reason: format!("{what} is not valid PEM"),
    };
    let certs = |pem: &[u8]| {
        let parsed: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
        parsed.is_ok_and(|c| !c.is_empty())
    };
    if let Some(root) = &certificates.root_cert {
        if !certs(root) {
            return Err(invalid("the CA certificate"));
        }
    }
    if let Some(client) = &certificates.client_tls {
        if !certs(&client.client_cert) {
            return Err(invalid("the client certificate"));
        }
        if PrivateKeyDer::from_pem_slice(&client.client_key).is_err() {
            return Err(invalid("the client key"));
        }
    }
    Ok(())
}

#[cfg(feature = "tls")]
fn no_certificates() -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: None,
    }
}

/// How a too-old server is reported.
const TOO_OLD: &str = "the server runs Redis";

/// How an error that Redis refused the credentials begins (a configuration error when the store
/// is built, not an outage).
const CREDENTIALS_REFUSED: &str = "Redis refused the credentials";

/// Whether Redis refused the connection's credentials: a wrong password, or none where one is
/// needed.
fn credentials_refused(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
        // A cluster's first connection wraps the nodes' refusals in an I/O error, kept only in
        // its text ("Failed to create initial connections - Io: Password authentication
        // failed - AuthenticationFailed").
        || (e.kind() == redis::ErrorKind::Io && e.to_string().contains("AuthenticationFailed"))
}

/// Refuse a server older than [`MIN_REDIS_VERSION`], with a clear error.
/// A server that cannot answer `INFO` (a cluster node down) is not refused for that: only a
/// version read and found too old is.
async fn check_version(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    limit: Duration,
) -> Result<(), StoreError> {
    // Within `limit`: a hung node never answers, and is not refused for that either.
    let mut cmd = redis::cmd("INFO");
    cmd.arg("server");
    let info = match tokio::time::timeout(limit, cmd.query_async::<redis::Value>(conn)).await {
        Ok(Ok(info)) => info,
        Ok(Err(e)) if credentials_refused(&e) => return Err(store_error(e)),
        _ => return Ok(()),
    };
    recent_enough(&info)
}

/// Whether every node's `INFO server` text in `info` names a Redis recent enough.
fn recent_enough(info: &redis::Value) -> Result<(), StoreError> {
    // A cluster answers one text per node: every node must be recent enough.
    let mut texts = Vec::new();
    collect_texts(info, &mut texts);
    let versions: Vec<&str> = texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|l| l.strip_prefix("redis_version:"))
        .map(str::trim)
        .collect();
    let oldest = versions
        .iter()
        .map(|v| (parse_version(v), *v))
        .min_by_key(|(parsed, _)| *parsed);
    let version = oldest.map_or("unknown", |(_, v)| v);
    match oldest.and_then(|(parsed, _)| parsed) {
        Some(v) if v >= MIN_REDIS_VERSION => Ok(()),
        _ => Err(StoreError::Script(format!(
            "{TOO_OLD} {version:?}; fleetlimit needs Redis {}.{} or newer",
            MIN_REDIS_VERSION.0, MIN_REDIS_VERSION.1
        ))),
    }
}

fn collect_texts(value: &redis::Value, out: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => out.push(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::VerbatimString { text, .. } | redis::Value::SimpleString(text) => {
            out.push(text.clone())
        }
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().for_each(|v| collect_texts(v, out))
        }
        redis::Value::Map(pairs) => pairs.iter().for_each(|(_, v)| collect_texts(v, out)),
        _ => {}
    }
}

/// `"7.0.15"` → `(7, 0)`.
fn parse_version(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

impl RedisStore {
    /// Configure prefix, deadline and clock before connecting.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }

    /// Connect to a standalone server with the defaults.
    pub async fn connect(url: &str) -> Result<RedisStore, Error> {
        RedisStore::builder().connect(url).await
    }

    /// Connect to a Redis Cluster with the defaults.
    pub async fn cluster<U: AsRef<str>>(urls: &[U]) -> Result<RedisStore, Error> {
        RedisStore::builder().cluster(urls).await
    }

    /// Use a `deadpool-redis` pool with the defaults.
    pub fn from_pool(pool: deadpool_redis::Pool) -> Result<RedisStore, Error> {
        RedisStore::builder().pool(pool)
    }

    /// The Redis key holding `rule`'s state for `key` (for inspection and tests).
    pub fn key_for(&self, rule: &crate::Rule, key: &crate::Key) -> Vec<u8> {
        redis_key(&self.inner.prefix, rule, key)
    }

    /// The Lua script every decision runs (one `EVALSHA` per decision), for audits and for
    /// measuring Redis's own ceiling with `redis-benchmark`. Its header documents the arguments.
    #[doc(hidden)]
    pub fn script() -> &'static str {
        SCRIPT
    }

    /// The script's arguments for one consume of `check` (after the key, which is
    /// [`key_for`](RedisStore::key_for)), deciding on Redis's clock.
    #[doc(hidden)]
    pub fn script_args(check: &Check<'_>) -> Vec<String> {
        let q = check.rule.quota();
        vec![
            "consume".into(),
            String::new(),
            algorithm_code(q.algorithm()).to_string(),
            q.limit().to_string(),
            q.period_us().to_string(),
            q.burst().to_string(),
            q.emission_us().to_string(),
            q.token_units().to_string(),
            q.refill_units().to_string(),
            q.sub_windows().to_string(),
            bounded(q).to_string(),
            check.cost.to_string(),
            String::new(),
        ]
    }

    /// The script's keys and arguments for one refund of `refund` with the once token `token`
    /// (on the store's clock): a hook for testing a refund sent twice.
    #[doc(hidden)]
    pub fn refund_script_call(
        &self,
        refund: &Refund<'_>,
        token: &str,
    ) -> (Vec<Vec<u8>>, Vec<String>) {
        let check = Check {
            rule: refund.rule,
            key: refund.key,
            cost: refund.taken.cost,
        };
        let state = redis_key(&self.inner.prefix, refund.rule, refund.key);
        let mut args = Self::script_args(&check);
        args[0] = "refund".into();
        if let Some(clock) = &self.inner.clock {
            args[1] = clock.now_us().to_string();
        }
        if let Some(anchor) = args.last_mut() {
            *anchor = refund.taken.at.to_string();
        }
        (vec![state.clone(), once_key(state, token)], args)
    }

    fn is_cluster(&self) -> bool {
        matches!(self.inner.conn, Conn::Cluster { .. })
    }
}

fn push(args: &mut Vec<Vec<u8>>, arg: impl redis::ToRedisArgs) {
    args.extend(arg.to_redis_args());
}

/// Redirections and refusals a cluster call follows. A slot migration causes MOVED then ASK,
/// and TRYAGAIN until a multi-key call's keys have all moved; the waits (1, 2, 4, then 8 ms) add
/// up to about 40 ms, and the decision's deadline bounds them anyway.
const MAX_REDIRECTIONS: u32 = 8;

/// Follow a cluster call's redirections (MOVED, ASK with `ASKING`) and answers that refused to run
/// it (TRYAGAIN, CLUSTERDOWN, MASTERDOWN, LOADING). Every one of them means the call did not run,
/// so sending it again is safe. Nothing else is sent again: after a broken connection or a timeout
/// the call may have run, and running a script twice would count twice (that is why redis-rs's
/// own retries are off). `again` sends the call to a node (after `ASKING` when asked to); an
/// error reply to a redirected call is followed like the first. With `until_try_again`, a
/// TRYAGAIN is returned at once, for the caller to send another call instead. A MOVED teaches
/// `masters` the slot's new owner (redis-rs relearns its own map on it, so no reconnection
/// would).
async fn follow_redirections<T, F>(
    conn: &mut ClusterConnection,
    masters: &Masters,
    slot: u16,
    until_try_again: bool,
    mut result: Result<T, RedisError>,
    mut again: impl FnMut(ClusterConnection, redis::cluster_routing::SingleNodeRoutingInfo, bool) -> F,
) -> Result<T, RedisError>
where
    F: std::future::Future<Output = Result<T, RedisError>>,
{
    use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
    use redis::RetryMethod;
    for attempt in 0..MAX_REDIRECTIONS {
        let Err(error) = &result else { break };
        if until_try_again && error.code() == Some("TRYAGAIN") {
            break;
        }
        let method = error.retry_method();
        if let (RetryMethod::MovedRedirect, Some((address, moved))) =
            (&method, error.redirect_node())
        {
            masters.moved(moved, address);
        }
        let node = error.redirect_node().and_then(|(address, _)| {
            let (host, port) = address.rsplit_once(':')?;
            Some(SingleNodeRoutingInfo::ByAddress {
                host: host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned(),
                port: port.parse().ok()?,
            })
        });
        let redirected = |answer: Result<T, RedisError>| {
            // A node the connection has no link to (a master just added, which owns no slot
            // yet: redis-rs links only to slot owners) fails this call alone. As redis-rs's
            // own error it would read as a dead node and drop the connection every master's
            // calls share, and connecting again would not link to that node either.
            answer.map_err(|e| {
                if e.kind() == redis::ErrorKind::ClusterConnectionNotFound {
                    RedisError::from((
                        redis::ErrorKind::Client,
                        "redirected to a node this cluster connection has no link to yet",
                        e.to_string(),
                    ))
                } else {
                    e
                }
            })
        };
        result = match (method, node) {
            (RetryMethod::MovedRedirect, Some(node)) => {
                tracing::debug!(slot, %error, "fleetlimit: cluster slot moved; following");
                redirected(again(conn.clone(), node, false).await)
            }
            (RetryMethod::AskRedirect, Some(node)) => {
                tracing::debug!(slot, %error, "fleetlimit: cluster slot migrating; asking its new node");
                redirected(again(conn.clone(), node, true).await)
            }
            (RetryMethod::WaitAndRetry, _) => {
                tracing::debug!(slot, %error, "fleetlimit: cluster slot unavailable for now; trying again");
                tokio::time::sleep(Duration::from_millis(1 << attempt.min(3))).await;
                let route = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                again(conn.clone(), route, false).await
            }
            _ => break,
        };
    }
    result
}

/// A small script's "now" argument: the store's own clock, or empty for Redis's (one clock for
/// the fleet).
fn arg_now(cmd: &mut redis::Cmd, now: Option<u64>) {
    match now {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
}

/// The script on one node (after `ASKING` when `asking`): by its hash, and by its text only if
/// that node has not loaded it yet (NOSCRIPT: nothing ran). Sending the text every time would
/// cost every redirected call 22 KB to send and hash.
async fn run_on(
    mut conn: ClusterConnection,
    node: redis::cluster_routing::SingleNodeRoutingInfo,
    asking: bool,
    script_hash: &str,
    keys: &[Vec<u8>],
    args: &[Vec<u8>],
) -> Result<Vec<i64>, RedisError> {
    let call = |command: &str, body: &str| {
        let mut cmd = redis::cmd(command);
        cmd.arg(body).arg(keys.len()).arg(keys).arg(args);
        cmd
    };
    let result = send(&mut conn, &node, asking, call("EVALSHA", script_hash)).await;
    if result
        .as_ref()
        .is_err_and(|e| e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript))
    {
        return send(&mut conn, &node, asking, call("EVAL", SCRIPT))
            .await
            .and_then(numbers);
    }
    result.and_then(numbers)
}

/// `cmd` on one node (after `ASKING` when `asking`); an error reply as the error it is, so it
/// can be followed.
async fn send(
    conn: &mut ClusterConnection,
    node: &redis::cluster_routing::SingleNodeRoutingInfo,
    asking: bool,
    cmd: redis::Cmd,
) -> Result<redis::Value, RedisError> {
    use redis::cluster_routing::RoutingInfo;
    if !asking {
        return conn
            .route_command(cmd, RoutingInfo::SingleNode(node.clone()))
            .await
            .and_then(redis::Value::extract_error);
    }
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING").add_command(cmd);
    conn.route_pipeline(pipe, 1, 1, node.clone())
        .await
        .and_then(|values| match <[redis::Value; 1]>::try_from(values) {
            Ok([value]) => value.extract_error(),
            Err(values) => Err(RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "ASKING pipeline",
                format!("{} answers", values.len()),
            ))),
        })
}

/// A new cluster connection, each master checked and the slot map learnt, each step within
/// `limit`.
async fn connect_cluster(
    client: redis::cluster::ClusterClient,
    masters: Arc<Masters>,
    limit: Duration,
) -> Result<ClusterConnection, StoreError> {
    let conn = client.get_async_connection().await.map_err(store_error)?;
    check_version(&mut conn.clone(), limit).await?;
    learn_masters(&conn, &masters, limit).await;
    Ok(conn)
}

/// How long connecting to a cluster may take: redis-rs waits for every node, each up to the
/// connect timeout (a hung one takes all of it); then each master is asked its version, as long
/// again; then one node its slot map (one round trip, as long again at worst).
fn cluster_attempt(connect_timeout: Duration) -> Duration {
    connect_timeout.saturating_mul(3)
}

/// Ask the masters other than `slot`'s, one by one, for the slot map (each within `limit`);
/// the first that answers says whether `slot` has another master now: if so (its master's
/// replica was promoted), a new connection is made in the background and takes over once
/// ready, while the current one goes on serving the other masters' slots. Only that slot
/// counts: slots moved by a reshard this map has not seen (MOVED updates it one slot at a time)
/// answer MOVED, never nothing, and reconnecting for them would only repeat a connection.
async fn look_past(
    client: redis::cluster::ClusterClient,
    seeds: Arc<Seeds>,
    conn: Arc<Connector<ClusterConnection>>,
    masters: Arc<Masters>,
    slot: u16,
    limit: Duration,
) {
    let suspect = masters.address_of(slot);
    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let Some(current) = conn.current() else {
        return;
    };
    let others: Vec<String> = masters
        .addresses
        .lock()
        .iter()
        .filter(|a| Some(*a) != suspect.as_ref())
        .cloned()
        .collect();
    for address in &others {
        let Some((host, port)) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
        else {
            continue;
        };
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let mut ask = (*current).clone();
        let node = SingleNodeRoutingInfo::ByAddress { host, port };
        let answer = ask.route_command(cmd, RoutingInfo::SingleNode(node));
        let Ok(Ok(answer)) = tokio::time::timeout(limit, answer).await else {
            continue;
        };
        if masters.moved_away(slot, &answer) {
            let client = match suspect.as_deref() {
                Some(hung) => seeds.without(hung, &others, limit).await.unwrap_or(client),
                None => client,
            };
            let fresh = masters.clone();
            let started = conn.replace(cluster_attempt(limit), || {
                connect_cluster(client, fresh, limit)
            });
            if started {
                tracing::info!(
                    suspect = suspect.as_deref().unwrap_or("?"),
                    asked = %address,
                    slot,
                    "fleetlimit: calls to a cluster master go unanswered and another master serves its slot now; connecting again in the background"
                );
            }
        }
        return;
    }
}

/// Learn which master serves each slot, from any node, within `limit`; a node that cannot say
/// leaves the map as it was (each slot then keeps a breaker of its own until one can).
async fn learn_masters(conn: &ClusterConnection, masters: &Masters, limit: Duration) {
    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let mut conn = conn.clone();
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("SLOTS");
    let ask = conn.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random));
    if let Ok(Ok(answer)) = tokio::time::timeout(limit, ask).await {
        masters.learn(&answer);
    }
}

/// Whether any of `keys` (of one slot) exists, each asked alone so that it follows its own
/// redirection; an answer that is not a clear "no" counts as yes.
async fn any_exists(conn: &ClusterConnection, masters: &Masters, keys: &[Vec<u8>]) -> bool {
    for key in keys {
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(key);
        let mut conn = conn.clone();
        let first = cmd.query_async::<redis::Value>(&mut conn).await;
        let again = |mut conn: ClusterConnection, node, asking| {
            let cmd = cmd.clone();
            async move { send(&mut conn, &node, asking, cmd).await }
        };
        let answer = follow_redirections(&mut conn, masters, slot(key), false, first, again).await;
        if !matches!(answer, Ok(redis::Value::Int(0))) {
            return true;
        }
    }
    false
}

/// The slot a plain command or small script runs on: its first key (after the hash and the
/// key count of `EVAL`/`EVALSHA`).
fn command_slot(cmd: &redis::Cmd) -> u16 {
    let mut args = cmd.args_iter().filter_map(|arg| match arg {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let name = args.next().unwrap_or_default();
    let skip = if name.eq_ignore_ascii_case(b"EVALSHA") || name.eq_ignore_ascii_case(b"EVAL") {
        2
    } else {
        0
    };
    args.nth(skip).map_or(0, slot)
}

/// The script's answer as numbers; an error reply (NOSCRIPT, MOVED, TRYAGAIN...) as the error
/// it is, so it can be followed.
fn numbers(value: redis::Value) -> Result<Vec<i64>, RedisError> {
    Vec::<i64>::from_redis_value(value.extract_error()?).map_err(RedisError::from)
}

/// The key that makes a refund call count once however often it is sent: the first check's key
/// (so the same hash tag and slot) and a token drawn for the call.
fn once_key(mut first: Vec<u8>, token: &str) -> Vec<u8> {
    first.extend_from_slice(b":once:");
    first.extend_from_slice(token.as_bytes());
    first
}

/// A token no other call in the fleet draws within the once key's lifetime (64 random bits:
/// std's hasher keys are seeded by the OS per thread, and the counter makes each draw differ).
fn once_token() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    RandomState::new().hash_one(DRAWS.fetch_add(1, Ordering::Relaxed))
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Consume => "consume",
        Op::Peek => "peek",
    }
}

/// The sliding window counter's estimate, as the script reads it: 1 when bounded.
fn bounded(q: &crate::Quota) -> u8 {
    u8::from(q.estimate() == crate::WindowEstimate::Bounded)
}

pub(crate) fn algorithm_code(a: Algorithm) -> u8 {
    match a {
        Algorithm::FixedWindow => 1,
        Algorithm::SlidingLog => 2,
        Algorithm::SlidingWindow => 3,
        Algorithm::TokenBucket => 4,
        Algorithm::Gcra => 5,
    }
}

fn store_error(e: RedisError) -> StoreError {
    if credentials_refused(&e) {
        StoreError::Script(format!("{CREDENTIALS_REFUSED}: {e}"))
    } else if e.is_timeout() {
        StoreError::Timeout(Duration::ZERO)
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreError::Connection(e.to_string())
    } else if matches!(
        e.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    ) {
        StoreError::Script(e.to_string())
    } else {
        StoreError::Protocol(e.to_string())
    }
}

/// Armed while a cluster call on `slot` runs: dropped armed, the call went unanswered until it
/// was abandoned (its decision's deadline passed, or its request was dropped), and its master
/// may be hung.
struct Unanswered<'a>(Option<(&'a Inner, u16)>);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some((store, slot)) = self.0 {
            store.suspect_hung_master(slot);
        }
    }
}

impl Inner {
    /// A cluster call on `slot` went unanswered to its deadline. A master that hangs without
    /// failing (stopped, partitioned) breaks no connection, so nothing else would make the
    /// store learn that its replica has taken over: at most once a second, the other masters
    /// are asked for the slot map in the background, and a changed map is connected to anew
    /// (see [`look_past`]).
    fn suspect_hung_master(&self, slot: u16) {
        let Conn::Cluster {
            client,
            seeds,
            conn,
            masters,
        } = &self.conn
        else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !masters.may_ask() {
            return;
        }
        runtime.spawn(look_past(
            client.as_ref().clone(),
            seeds.clone(),
            conn.clone(),
            masters.clone(),
            slot,
            self.connect_timeout,
        ));
    }

    /// The cluster's master map (an empty one for other connections, which never use it).
    fn masters(&self) -> &Masters {
        static NONE: std::sync::OnceLock<Masters> = std::sync::OnceLock::new();
        match &self.conn {
            Conn::Cluster { masters, .. } => masters,
            _ => NONE.get_or_init(Masters::default),
        }
    }

    /// One script call for `checks`, within the deadline.
    async fn invoke(&self, op: Op, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        let values = self.call(op_name(op), checks, &[], None).await?;
        parse_decisions(&values, checks)
    }

    /// One script call giving back what `refunds` took (one slot).
    async fn invoke_refund(&self, refunds: &[Refund<'_>]) -> Result<Vec<Decision>, StoreError> {
        // A receipt refunds only state of its own algorithm: another's gives back nothing.
        let checks: Vec<Check<'_>> = refunds
            .iter()
            .map(|r| Check {
                rule: r.rule,
                key: r.key,
                cost: if r.taken.fits(r.rule.quota().algorithm()) {
                    r.taken.cost
                } else {
                    0
                },
            })
            .collect();
        let anchors: Vec<u64> = refunds.iter().map(|r| r.taken.at).collect();
        let values = self.call("refund", &checks, &anchors, None).await?;
        parse_decisions(&values, &checks)
    }

    /// Run the script: `op` on `checks`, with receipts' `anchors` (refunds) and `extra` as the
    /// last argument (lease).
    async fn call(
        &self,
        op: &str,
        checks: &[Check<'_>],
        anchors: &[u64],
        extra: Option<u64>,
    ) -> Result<Vec<i64>, StoreError> {
        let mut keys: Vec<Vec<u8>> = checks
            .iter()
            .map(|c| redis_key(&self.prefix, c.rule, c.key))
            .collect();
        if op == "refund" {
            if let Some(first) = keys.first() {
                keys.push(once_key(first.clone(), &format!("{:016x}", once_token())));
            }
        } else {
            // Each check's listing (allow, deny, block), read in the same atomic step.
            keys.extend(checks.iter().map(|c| listing_key(&self.prefix, c.key)));
        }
        let mut args: Vec<Vec<u8>> = Vec::with_capacity(3 + 9 * checks.len());
        push(&mut args, op);
        match &self.clock {
            Some(clock) => push(&mut args, clock.now_us()),
            None => push(&mut args, ""),
        };
        for (i, c) in checks.iter().enumerate() {
            let q = c.rule.quota();
            push(&mut args, algorithm_code(q.algorithm()));
            push(&mut args, q.limit());
            push(&mut args, q.period_us());
            push(&mut args, q.burst());
            push(&mut args, q.emission_us());
            push(&mut args, q.token_units());
            push(&mut args, q.refill_units());
            push(&mut args, q.sub_windows());
            push(&mut args, bounded(q));
            push(&mut args, c.cost);
            match anchors.get(i) {
                Some(at) => push(&mut args, *at),
                None => push(&mut args, ""),
            };
        }
        if let Some(extra) = extra {
            push(&mut args, extra);
        }
        let mut invocation = self.script.prepare_invoke();
        invocation.key(&keys).arg(&args);
        let result = match self.connection().await? {
            Ready::Single(used) => {
                let mut conn = (*used).clone();
                self.on_single(&used, invocation.invoke_async::<Vec<i64>>(&mut conn))
                    .await
            }
            Ready::Cluster(used) => {
                let mut conn = (*used).clone();
                let slot = keys.first().map_or(0, |k| slot(k));
                let hash = self.script.get_hash();
                let again = |conn, node, asking| run_on(conn, node, asking, hash, &keys, &args);
                let master = redis::cluster_routing::SingleNodeRoutingInfo::SpecificNode(
                    redis::cluster_routing::Route::new(
                        slot,
                        redis::cluster_routing::SlotAddr::Master,
                    ),
                );
                // To the slot's master alone, the script's text included when it has not loaded
                // it: redis-rs loads a script on every node, and one hung node then held up
                // every decision on the live ones (and opened their breakers).
                let mut unanswered = Unanswered(Some((self, slot)));
                let result = again(conn.clone(), master.clone(), false).await;
                unanswered.0 = None;
                // While a slot migrates, Redis refuses a call on several keys of which some
                // have moved and some have not (TRYAGAIN) until the migration ends, and the
                // keys after the states (a listing key, a refund's once key) almost never exist,
                // so never move. The states alone are then sent, at once (waiting for the
                // migration would spend the deadline): a refund's always (TRYAGAIN says the
                // call did not run, so there is nothing to send twice), a decision's when none
                // of its keys is listed (asked one by one, each following its redirection); a
                // listed key's request stays with the policy, which knows the listings this
                // process has seen.
                let masters = self.masters();
                let mut result =
                    follow_redirections(&mut conn, masters, slot, true, result, again).await;
                let try_again = |r: &Result<Vec<i64>, RedisError>| {
                    r.as_ref().is_err_and(|e| e.code() == Some("TRYAGAIN"))
                };
                let unmoved = &keys[checks.len()..];
                if try_again(&result)
                    && (op == "refund" || !any_exists(&conn, masters, unmoved).await)
                {
                    let states = &keys[..checks.len()];
                    tracing::debug!(
                        slot,
                        op,
                        "fleetlimit: cluster slot migrating; sending the states alone"
                    );
                    let again =
                        |conn, node, asking| run_on(conn, node, asking, hash, states, &args);
                    let first = again(conn.clone(), master, false).await;
                    result =
                        follow_redirections(&mut conn, masters, slot, false, first, again).await;
                }
                self.forget_dead_node(&used, &result);
                result
            }
            Ready::Shared(used) => {
                let mut conn = (*used).clone();
                self.on_shared(&used, invocation.invoke_async::<Vec<i64>>(&mut conn))
                    .await
            }
        };
        result.map_err(store_error)
    }

    /// A call on the standalone connection. Its manager reconnects after an I/O error, but two
    /// failures never give one:
    /// - a master turned replica behind a stable address (a failover, a VIP or DNS name moved
    ///   to the new master) answers `READONLY` to every script, for good: the next call
    ///   connects afresh;
    /// - a half-open link (a partition, a host gone without a reset) answers nothing, and the
    ///   kernel takes minutes to give up on it. A call abandoned at its deadline cannot tell it
    ///   from a slow server, so one `PING` goes in the background: a connection that does not
    ///   answer it within [`PROBE_TIMEOUT`] is replaced (a slow server answers, and keeps its
    ///   connection).
    async fn on_single<T>(
        &self,
        used: &Arc<ConnectionManager>,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> redis::RedisResult<T> {
        let Conn::Single { conn, probing, .. } = &self.conn else {
            return call.await;
        };
        let mut abandoned = ProbeOnDrop {
            connector: conn,
            used,
            probing,
            armed: true,
        };
        let result = call.await;
        abandoned.armed = false;
        if result.as_ref().is_err_and(turned_replica) && conn.forget(used) {
            tracing::warn!("fleetlimit: Redis answered READONLY (a failover?); connecting again");
        }
        result
    }

    /// A call on a shared connection. A call abandoned mid-way (its decision's deadline passed)
    /// leaves a connection that may have stopped answering: the next call takes a fresh one. So
    /// does one to a master that turned replica (a failover).
    async fn on_shared<T>(
        &self,
        used: &Arc<MultiplexedConnection>,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> redis::RedisResult<T> {
        let mut guard = DiscardOnDrop(match &self.conn {
            Conn::Pool { conn, .. } | Conn::Sentinel { conn, .. } => Some((conn, used)),
            _ => None,
        });
        let result = call.await;
        let broken = result.as_ref().is_err_and(|e| {
            e.is_io_error()
                || e.is_connection_dropped()
                || e.is_unrecoverable_error()
                || turned_replica(e)
        });
        if !broken {
            guard.0 = None;
        }
        result
    }

    /// One plain command (pauses, listings, slots, resets; decisions go through the script).
    async fn command<T: FromRedisValue>(&self, cmd: redis::Cmd) -> Result<T, StoreError> {
        self.query(cmd).await?.map_err(store_error)
    }

    /// One call of a small script by its hash (`EVALSHA`, then the whole text with `EVAL` if
    /// the node answering has not loaded it yet, as after a restart or a failover): the text
    /// travels once per node, not on every call. `keys_and_args` are the script's `numkeys`,
    /// keys and arguments.
    async fn run_script<T: FromRedisValue>(
        &self,
        (text, hash): (&'static str, &str),
        keys_and_args: impl Fn(&mut redis::Cmd),
    ) -> Result<T, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(hash);
        keys_and_args(&mut cmd);
        match self.query(cmd).await? {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(text);
                keys_and_args(&mut cmd);
                self.command(cmd).await
            }
            result => result.map_err(store_error),
        }
    }

    /// `cmd` on the store's connection: no connection is the outer error, Redis's answer the
    /// inner result.
    async fn query<T: FromRedisValue>(
        &self,
        cmd: redis::Cmd,
    ) -> Result<redis::RedisResult<T>, StoreError> {
        Ok(match self.connection().await? {
            Ready::Single(used) => {
                let mut conn = (*used).clone();
                self.on_single(&used, cmd.query_async(&mut conn)).await
            }
            Ready::Cluster(used) => {
                let mut conn = (*used).clone();
                let slot = command_slot(&cmd);
                let mut unanswered = Unanswered(Some((self, slot)));
                let first = cmd.query_async::<redis::Value>(&mut conn).await;
                unanswered.0 = None;
                let again = |mut conn: ClusterConnection, node, asking| {
                    let cmd = cmd.clone();
                    async move { send(&mut conn, &node, asking, cmd).await }
                };
                let masters = self.masters();
                let result =
                    follow_redirections(&mut conn, masters, slot, false, first, again).await;
                self.forget_dead_node(&used, &result);
                result.and_then(|value| T::from_redis_value(value).map_err(RedisError::from))
            }
            Ready::Shared(used) => {
                let mut conn = (*used).clone();
                self.on_shared(&used, cmd.query_async(&mut conn)).await
            }
        })
    }

    /// A node that stopped answering (a master killed before its replica took over): the next
    /// call connects again and learns the new slot map.
    fn forget_dead_node<T>(&self, used: &Arc<ClusterConnection>, result: &redis::RedisResult<T>) {
        let Err(error) = result else {
            return;
        };
        let dead = error.is_io_error()
            || error.is_connection_dropped()
            || error.is_connection_refusal()
            || error.is_unrecoverable_error()
            || error.kind() == redis::ErrorKind::ClusterConnectionNotFound;
        if let (true, Conn::Cluster { conn, .. }) = (dead, &self.conn) {
            if conn.forget(used) {
                tracing::info!(
                    %error,
                    "fleetlimit: a cluster node stopped answering; reconnecting to learn the slot map again"
                );
            }
        }
    }

    /// Run the listing script for `key`: `op` ('get', 'allow', 'deny', 'block', 'clear',
    /// 'penalty'); the listing's kind as the script names it, and the µs left of a block.
    async fn listing_script(
        &self,
        key: &Key,
        op: &str,
        block_us: u64,
    ) -> Result<(String, i64), StoreError> {
        let listing_key = listing_key(&self.prefix, key);
        let now = self.clock.as_ref().map(|c| c.now_us());
        self.run_script((LISTING_SCRIPT, &self.listing_hash), |cmd| {
            cmd.arg(1).arg(&listing_key).arg(op);
            arg_now(cmd, now);
            cmd.arg(block_us);
        })
        .await
    }

    /// The listing script's `op` for `key`, and the listing in force after it.
    async fn listing(
        &self,
        key: &Key,
        op: &str,
        block_us: u64,
    ) -> Result<Option<Listing>, StoreError> {
        let (kind, left_us) = self.listing_script(key, op, block_us).await?;
        Ok(match kind.as_str() {
            "allow" => Some(Listing::Allow),
            "deny" => Some(Listing::Deny),
            "block" | "penalty" => Some(Listing::Block(Duration::from_micros(
                u64::try_from(left_us).unwrap_or(0),
            ))),
            _ => None,
        })
    }

    /// The key holding a pause of `rule` for `key`: beside its states, in the same slot.
    fn pause_key(&self, rule: &Rule, key: &Key) -> Vec<u8> {
        pause_key(&self.prefix, rule.name(), key)
    }

    /// A connection for one call, connecting first if needed (in the background, each attempt
    /// bounded by the connect timeout; see [`Connector`]).
    async fn connection(&self) -> Result<Ready, StoreError> {
        let limit = self.connect_timeout;
        // The clients are cloned only to start an attempt, never on a call's path.
        match &self.conn {
            Conn::Single { client, conn, .. } => {
                let connect = || {
                    let client = client.as_ref().clone();
                    async move {
                        let config = ConnectionManagerConfig::new()
                            .set_response_timeout(Some(RESPONSE_TIMEOUT))
                            .set_connection_timeout(Some(limit))
                            .set_number_of_retries(2)
                            .set_max_delay(Duration::from_millis(500));
                        let manager = ConnectionManager::new_with_config(client, config)
                            .await
                            .map_err(store_error)?;
                        check_version(&mut manager.clone(), limit).await?;
                        Ok(manager)
                    }
                };
                Ok(Ready::Single(conn.get(limit, connect).await?))
            }
            Conn::Cluster {
                client,
                conn,
                masters,
                ..
            } => {
                let connect = || connect_cluster(client.as_ref().clone(), masters.clone(), limit);
                Ok(Ready::Cluster(
                    conn.get(cluster_attempt(limit), connect).await?,
                ))
            }
            Conn::Pool { pool, conn } => {
                let connect = || {
                    let pool = pool.clone();
                    async move {
                        let fresh = pool
                            .get()
                            .await
                            .map_err(|e| StoreError::Connection(e.to_string()))?;
                        Ok(deadpool_redis::Connection::take(fresh))
                    }
                };
                Ok(Ready::Shared(conn.get(limit, connect).await?))
            }
            Conn::Sentinel { sentinels, conn } => {
                let connect = || {
                    let sentinels = sentinels.clone();
                    async move {
                        let master = sentinels
                            .lock()
                            .await
                            .async_get_client()
                            .await
                            .map_err(store_error)?;
                        let config = redis::AsyncConnectionConfig::new()
                            .set_response_timeout(Some(RESPONSE_TIMEOUT));
                        let mut conn = master
                            .get_multiplexed_async_connection_with_config(&config)
                            .await
                            .map_err(store_error)?;
                        check_version(&mut conn, limit).await?;
                        Ok(conn)
                    }
                };
                // The Sentinels, then the master they name.
                let attempt = limit.saturating_mul(2);
                Ok(Ready::Shared(conn.get(attempt, connect).await?))
            }
        }
    }
}

/// Whether `error` says the node is a replica now (a failover): `READONLY`, or, before Redis
/// 7.0, a script's error wrapping it (`ERR Error running script … -READONLY …`).
fn turned_replica(error: &RedisError) -> bool {
    error.code() == Some("READONLY") || error.detail().is_some_and(|d| d.contains("READONLY"))
}

/// How long a `PING` may take before the standalone connection it was sent on is replaced.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Dropped armed (its call abandoned), sends a `PING` on the standalone connection in the
/// background, and replaces the connection if it is not answered in time.
struct ProbeOnDrop<'a> {
    connector: &'a Arc<Connector<ConnectionManager>>,
    used: &'a Arc<ConnectionManager>,
    probing: &'a Arc<AtomicBool>,
    armed: bool,
}

impl Drop for ProbeOnDrop<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (connector, used, probing) = (self.connector, self.used, self.probing);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if probing.swap(true, Ordering::AcqRel) {
            return;
        }
        /// Clears the flag however the probe ends (its runtime may drop it unfinished).
        struct Probing(Arc<AtomicBool>);
        impl Drop for Probing {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let probing = Probing(probing.clone());
        let (connector, used) = (connector.clone(), used.clone());
        runtime.spawn(async move {
            let _probing = probing;
            let mut conn = (*used).clone();
            let ping = redis::cmd("PING");
            let ping = ping.query_async::<()>(&mut conn);
            let answered = tokio::time::timeout(PROBE_TIMEOUT, ping).await;
            if !matches!(answered, Ok(Ok(()))) && connector.forget(&used) {
                tracing::warn!(
                    "fleetlimit: the Redis connection did not answer a PING within {PROBE_TIMEOUT:?}; connecting again"
                );
            }
        });
    }
}

/// Forgets the shared connection a call was made on unless defused.
struct DiscardOnDrop<'a>(
    Option<(
        &'a Connector<MultiplexedConnection>,
        &'a Arc<MultiplexedConnection>,
    )>,
);

impl Drop for DiscardOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((connector, used)) = self.0 {
            connector.forget(used);
        }
    }
}

/// The script's numbers as one decision per check (receipts name the check's cost and
/// algorithm).
fn parse_decisions(values: &[i64], checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
    if values.len() != PER_DECISION * checks.len() {
        return Err(StoreError::Protocol(format!(
            "expected {} numbers from the script, got {}",
            PER_DECISION * checks.len(),
            values.len()
        )));
    }
    values
        .chunks_exact(PER_DECISION)
        .zip(checks)
        .map(|(v, check)| {
            let non_negative = |x: i64| {
                u64::try_from(x)
                    .map_err(|_| StoreError::Protocol(format!("negative value {x} in a decision")))
            };
            let (limit, remaining, reset) = (
                non_negative(v[1])?,
                non_negative(v[2])?,
                non_negative(v[3])?,
            );
            let retry = if v[4] < 0 {
                None
            } else {
                Some(us(v[4] as u64))
            };
            let mut d = if v[0] == 1 {
                Decision::admit(limit, remaining, us(reset))
            } else {
                Decision::deny(limit, remaining, us(reset), retry)
            };
            d.listed = by_listing(v[5]);
            d.taken = u64::try_from(v[5]).ok().map(|at| Taken {
                at,
                cost: check.cost,
                algorithm: check.rule.quota().algorithm(),
            });
            Ok(d)
        })
        .collect()
}

impl Store for RedisStore {
    fn pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("SET");
            cmd.arg(self.inner.pause_key(rule, key))
                .arg(1)
                .arg("PX")
                .arg(pause_ms(pause));
            self.inner.command::<()>(cmd).await
        })
    }

    fn extend_pause<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
        pause: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let ms = pause_ms(pause);
            let pause_key = self.inner.pause_key(rule, key);
            self.inner
                .run_script::<i64>(
                    (EXTEND_PAUSE_SCRIPT, &self.inner.extend_pause_hash),
                    |cmd| {
                        cmd.arg(1).arg(&pause_key).arg(ms);
                    },
                )
                .await
                .map(|_| ())
        })
    }

    fn paused_for<'a>(
        &'a self,
        rule: &'a Rule,
        key: &'a Key,
    ) -> BoxFuture<'a, Result<Option<Duration>, StoreError>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("PTTL");
            cmd.arg(self.inner.pause_key(rule, key));
            // -2: no pause (-1 cannot be: a pause always expires). 0: under a millisecond
            // left, which Redis still keeps: it counts as one.
            let ms: i64 = self.inner.command(cmd).await?;
            Ok(u64::try_from(ms)
                .ok()
                .map(|ms| Duration::from_millis(ms.max(1))))
        })
    }

    fn set_listing<'a>(
        &'a self,
        key: &'a Key,
        listing: Option<Listing>,
    ) -> BoxFuture<'a, Result<Option<Listing>, StoreError>> {
        Box::pin(async move {
            let (op, block_us) = match listing {
                None => ("clear", 0),
                Some(Listing::Allow) => ("allow", 0),
                Some(Listing::Deny) => ("deny", 0),
                // Under a µs is no block (as zero is): the script ends a block then.
                Some(Listing::Block(d)) => {
                    ("block", d.as_micros().min(u128::from(u64::MAX / 4)) as u64)
                }
            };
            self.inner.listing(key, op, block_us).await
        })
    }

    fn listing<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Listing>, StoreError>> {
        Box::pin(self.inner.listing(key, "get", 0))
    }

    fn block_unless_listed<'a>(
        &'a self,
        key: &'a Key,
        block: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let block_us = block.as_micros().clamp(1, u128::from(u64::MAX / 4)) as u64;
            let (kind, _) = self.inner.listing_script(key, "penalty", block_us).await?;
            Ok(kind == "penalty")
        })
    }

    fn slots<'a>(
        &'a self,
        op: SlotOp,
        name: &'a str,
        key: &'a Key,
        slot: u64,
        limit: u64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(bool, u64), StoreError>> {
        Box::pin(async move {
            let inner = &self.inner;
            let slots_key = slots_key(&inner.prefix, name, key);
            let op = match op {
                SlotOp::Acquire => "acquire",
                SlotOp::Renew => "renew",
                SlotOp::Release => "release",
            };
            let now = inner.clock.as_ref().map(|c| c.now_us());
            let slot = format!("{slot:016x}");
            let ttl_us = ttl.as_micros().clamp(1, u128::from(u64::MAX / 4)) as u64;
            let (done, held): (i64, i64) = inner
                .run_script((SLOTS_SCRIPT, &inner.slots_hash), |cmd| {
                    cmd.arg(1).arg(&slots_key).arg(op);
                    arg_now(cmd, now);
                    cmd.arg(&slot).arg(limit).arg(ttl_us);
                })
                .await?;
            Ok((done == 1, u64::try_from(held).unwrap_or(0)))
        })
    }

    fn reset<'a>(&'a self, rule: &'a Rule, key: &'a Key) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("DEL");
            cmd.arg(redis_key(&self.inner.prefix, rule, key));
            self.inner.command::<i64>(cmd).await.map(|_| ())
        })
    }

    fn lease<'a>(
        &'a self,
        check: Check<'a>,
        max_validity: Duration,
    ) -> BoxFuture<'a, Result<Lease, StoreError>> {
        Box::pin(async move {
            let max_validity_us = max_validity.as_micros().min(u128::from(u64::MAX / 4)) as u64;
            let values = self
                .inner
                .call("lease", &[check], &[], Some(max_validity_us))
                .await?;
            if values.len() != PER_DECISION + 5 {
                return Err(StoreError::Protocol(format!(
                    "a lease answers {} numbers, got {}",
                    PER_DECISION + 5,
                    values.len()
                )));
            }
            let (decision, rest) = values.split_at(PER_DECISION);
            let state = parse_decisions(decision, std::slice::from_ref(&check))?
                .into_iter()
                .next()
                .ok_or_else(|| StoreError::Protocol("no decision".into()))?;
            let number = |x: i64| {
                u64::try_from(x)
                    .map_err(|_| StoreError::Protocol(format!("negative value {x} in a lease")))
            };
            let permits = number(rest[0])?;
            // Redis keeps the time; the caller measures `valid_for` from before it asked, so its
            // own deadline is never later than Redis's.
            Ok(Lease {
                permits,
                valid_until_us: number(rest[1])?,
                valid_for: Duration::from_micros(number(rest[2])?),
                state,
                taken: Taken {
                    at: number(rest[3])?,
                    cost: permits,
                    algorithm: check.rule.quota().algorithm(),
                },
                listed: rest[4] == 1,
            })
        })
    }

    fn refund<'a>(
        &'a self,
        refunds: &'a [Refund<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        Box::pin(async move {
            if refunds.is_empty() {
                return Ok(Vec::new());
            }
            self.inner.invoke_refund(refunds).await
        })
    }

    fn failure_domains(&self) -> usize {
        if self.is_cluster() {
            // A breaker per master, one per slot for slots whose master is not known, and one
            // for every slot before any map is learnt.
            Masters::NO_MAP + 1
        } else {
            1
        }
    }

    fn failure_domain(&self, checks: &[Check<'_>]) -> usize {
        match (&self.inner.conn, checks.first()) {
            (Conn::Cluster { masters, .. }, Some(c)) => {
                masters.breaker(slot(&redis_key(&self.inner.prefix, c.rule, c.key)))
            }
            _ => 0,
        }
    }

    fn call_group(&self, checks: &[Check<'_>]) -> usize {
        match checks.first() {
            Some(c) if self.is_cluster() => {
                usize::from(slot(&redis_key(&self.inner.prefix, c.rule, c.key)))
            }
            _ => 0,
        }
    }

    fn apply<'a>(
        &'a self,
        op: Op,
        checks: &'a [Check<'a>],
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        Box::pin(async move {
            if checks.is_empty() {
                return Ok(Vec::new());
            }
            self.inner.invoke(op, checks).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A master turned replica refuses a script's write with `READONLY`: as its own code from
    /// Redis 7.0, wrapped in the script's error before (both mean: connect again).
    #[test]
    fn readonly_is_recognised_bare_and_wrapped_in_a_scripts_error() {
        let error = |reply: &[u8]| {
            redis::parse_redis_value(reply)
                .and_then(redis::Value::extract_error)
                .unwrap_err()
        };
        let bare = error(b"-READONLY You can't write against a read only replica.\r\n");
        let wrapped = error(
            b"-ERR Error running script (call to f_1a2b): @user_script:12: -READONLY You can't write against a read only replica.\r\n",
        );
        let other = error(b"-ERR Error running script (call to f_1a2b): @user_script:12: bad\r\n");
        assert!(turned_replica(&bare));
        assert!(turned_replica(&wrapped), "{wrapped:?}");
        assert!(!turned_replica(&other));
    }

    /// Redis older than 5.0 is refused, on any node of a cluster, naming the version; a reply
    /// naming none (or one that is no version) is refused too, never taken for a recent one.
    #[test]
    fn only_a_recent_enough_redis_is_taken() {
        let text = |version: &str| {
            redis::Value::BulkString(
                format!("# Server\r\nredis_version:{version}\r\nredis_mode:standalone\r\n")
                    .into_bytes(),
            )
        };
        for version in ["5.0.0", "7.0.15", "8.2"] {
            assert!(recent_enough(&text(version)).is_ok(), "{version}");
        }
        let cluster = |versions: &[&str]| {
            redis::Value::Map(
                versions
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (redis::Value::SimpleString(format!("node-{i}")), text(v)))
                    .collect(),
            )
        };
        assert!(recent_enough(&cluster(&["7.0.15", "7.2.4", "6.2.0"])).is_ok());
        for (info, named) in [
            (text("4.0.14"), "4.0.14"),
            (cluster(&["7.0.15", "4.0.14", "7.2.4"]), "4.0.14"),
            (text("5"), "5"),
            (text("garbage"), "garbage"),
            (
                redis::Value::BulkString(b"# Server\r\nredis_mode:standalone\r\n".to_vec()),
                "unknown",
            ),
        ] {
            let error = recent_enough(&info).unwrap_err().to_string();
            assert!(error.contains(TOO_OLD) && error.contains(named), "{error}");
        }
    }

    /// The value of the connection `get` hands out (made by `connect` within a second).
    async fn value_of<F>(
        connector: &Arc<Connector<u32>>,
        connect: impl FnOnce() -> F,
    ) -> Option<u32>
    where
        F: std::future::Future<Output = Result<u32, StoreError>> + Send + 'static,
    {
        let got = connector.get(Duration::from_secs(1), connect).await;
        got.ok().as_deref().copied()
    }

    /// A pause goes to Redis in whole milliseconds, rounded up: 1.999 ms paused for 1 ms
    /// would end early.
    #[test]
    fn pauses_are_rounded_up_to_whole_milliseconds() {
        let ms = |us: u64| pause_ms(Duration::from_micros(us));
        assert_eq!(ms(1_999), 2);
        assert_eq!(ms(2_000), 2);
        assert_eq!(ms(2_001), 3);
        assert_eq!(
            pause_ms(Duration::new(0, 1_000_001)),
            2,
            "a nanosecond over counts"
        );
        assert_eq!(ms(0), 1, "a zero PX is an error");
        assert_eq!(pause_ms(Duration::MAX), u64::from(u32::MAX));
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// An attempt whose task dies with its runtime (a store shared across runtimes, a runtime
    /// per call) is cleared: the next caller connects, rather than being handed the dead
    /// attempt forever.
    #[test]
    fn an_attempt_dropped_with_its_runtime_is_made_again() {
        let connector: Arc<Connector<u32>> = Connector::new();
        let first = runtime();
        let waited = first.block_on(async {
            let never = || std::future::pending::<Result<u32, StoreError>>();
            tokio::time::timeout(
                Duration::from_millis(20),
                connector.get(Duration::from_secs(60), never),
            )
            .await
        });
        assert!(waited.is_err(), "the attempt is still in flight");
        drop(first);
        let made = runtime().block_on(async {
            let ready = || async { Ok::<u32, StoreError>(7) };
            connector.get(Duration::from_secs(1), ready).await
        });
        assert_eq!(made.ok().as_deref().copied(), Some(7));
    }

    /// A replacement is made in the background while the current connection goes on serving;
    /// it takes over once made, and a failed one changes nothing.
    #[test]
    fn a_replacement_takes_over_only_once_made() {
        let connector: Arc<Connector<u32>> = Connector::new();
        runtime().block_on(async {
            let first = || async { Ok::<u32, StoreError>(1) };
            assert_eq!(value_of(&connector, first).await, Some(1));
            let failing = || async { Err::<u32, StoreError>(StoreError::Connection("no".into())) };
            connector.replace(Duration::from_secs(1), failing);
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert_eq!(
                connector.current().as_deref().copied(),
                Some(1),
                "a failed replacement changes nothing"
            );
            let slow = || async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<u32, StoreError>(2)
            };
            connector.replace(Duration::from_secs(1), slow);
            let ignored = || async { Ok::<u32, StoreError>(3) };
            connector.replace(Duration::from_secs(1), ignored);
            assert_eq!(
                connector.current().as_deref().copied(),
                Some(1),
                "serving while it is made"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(
                connector.current().as_deref().copied(),
                Some(2),
                "one attempt at a time"
            );
        });
    }

    /// A call that fails on a connection already replaced forgets nothing: the replacement
    /// goes on serving, where it used to be thrown away too and every caller waited for a
    /// third connection. A failure on the current one still forgets it.
    #[test]
    fn a_late_failure_on_a_replaced_connection_keeps_the_new_one() {
        let connector: Arc<Connector<u32>> = Connector::new();
        runtime().block_on(async {
            let first = || async { Ok::<u32, StoreError>(1) };
            let old = connector.get(Duration::from_secs(1), first).await.ok();
            let old = old.expect("the first connection is made");
            assert!(connector.forget(&old), "failed while current: forgotten");
            let second = || async { Ok::<u32, StoreError>(2) };
            let new = connector.get(Duration::from_secs(1), second).await.ok();
            assert_eq!(new.as_deref().copied(), Some(2));
            assert!(!connector.forget(&old), "a late failure on the old one");
            assert_eq!(connector.current().as_deref().copied(), Some(2));
            let unused = || async { Ok::<u32, StoreError>(3) };
            let again = connector.get(Duration::from_secs(1), unused).await.ok();
            assert_eq!(again.as_deref().copied(), Some(2), "no third connection");
        });
    }

    /// `CLUSTER SLOTS` as Redis answers it: `[first, last, [host, port]]` per range.
    fn slots_answer(ranges: &[(i64, i64, &str, i64)]) -> redis::Value {
        use redis::Value;
        Value::Array(
            ranges
                .iter()
                .map(|&(first, last, host, port)| {
                    Value::Array(vec![
                        Value::Int(first),
                        Value::Int(last),
                        Value::Array(vec![
                            Value::BulkString(host.as_bytes().to_vec()),
                            Value::Int(port),
                        ]),
                    ])
                })
                .collect(),
        )
    }

    #[test]
    fn a_slot_moved_away_when_the_answer_names_another_master() {
        let masters = Masters::default();
        let map = [
            (0, 8_191, "10.0.0.1", 7000),
            (8_192, 16_383, "10.0.0.2", 7000),
        ];
        masters.learn(&slots_answer(&map));
        assert!(!masters.moved_away(5, &slots_answer(&map)));
        let promoted = [
            (0, 8_191, "10.0.0.3", 7000),
            (8_192, 16_383, "10.0.0.2", 7000),
        ];
        assert!(masters.moved_away(5, &slots_answer(&promoted)));
        assert!(
            !masters.moved_away(9_000, &slots_answer(&promoted)),
            "only the slot asked about counts"
        );
        let part = [(8_192, 16_383, "10.0.0.2", 7000)];
        assert!(
            !masters.moved_away(5, &slots_answer(&part)),
            "an unnamed slot counts for nothing"
        );
        assert!(
            !masters.moved_away(5, &redis::Value::Nil),
            "nor does a malformed answer"
        );
        assert!(
            Masters::default().moved_away(5, &slots_answer(&map)),
            "a map unknown until now"
        );
    }

    /// A runtime that looks names up (on a blocking thread) with its clock running.
    fn resolving() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_url_reaches_a_node_by_its_address_or_by_a_name() {
        let cases: &[(&str, &str, bool, &str)] = &[
            (
                "rediss://user:secret@127.0.0.1:7001/0",
                "127.0.0.1:7001",
                true,
                "credentials and a path",
            ),
            ("redis://[::1]:7002", "::1:7002", true, "an IPv6 host"),
            (
                "redis://[0:0:0:0:0:0:0:1]:7002",
                "::1:7002",
                true,
                "an IPv6 host written out",
            ),
            (
                "redis://127.0.0.1:70010",
                "127.0.0.1:7001",
                false,
                "a port that only starts alike",
            ),
            ("redis://127.0.0.1:7000", "10.0.0.9:7000", false, "another"),
            ("redis://127.0.0.1", "127.0.0.1:6379", true, "no port: 6379"),
            (
                "redis://localhost:7000",
                "127.0.0.1:7000",
                true,
                "a name that resolves to it",
            ),
            (
                "redis://localhost:7001",
                "127.0.0.1:7000",
                false,
                "the name at another port",
            ),
            (
                "redis://127.0.0.1:7000",
                "localhost:7000",
                true,
                "a cluster that announces names",
            ),
        ];
        for &(url, address, expected, why) in cases {
            let urls = [url.to_owned()];
            let limit = Duration::from_secs(5);
            let reach = resolving().block_on(reaching(&urls, address, limit));
            assert_eq!(reach, [expected], "{why}: {url} and {address}");
        }
    }

    /// The URLs a connection past a hung node is given: none that reaches it, by address or by
    /// name; when all do, the same URLs pointed at the other masters.
    #[test]
    fn a_connection_past_a_hung_node_is_given_no_url_that_reaches_it() {
        let given = Arc::new(parking_lot::Mutex::new(Vec::<Vec<String>>::new()));
        let seeds = |urls: &[&str]| {
            let given = given.clone();
            let client_for = move |nodes: Vec<&str>| {
                given
                    .lock()
                    .push(nodes.iter().map(|n| (*n).to_owned()).collect());
                redis::cluster::ClusterClient::new(nodes)
            };
            Seeds {
                urls: urls.iter().map(|u| (*u).to_owned()).collect(),
                client_for: Box::new(client_for),
            }
        };
        let others = ["127.0.0.1:7001".to_owned(), "127.0.0.1:7002".to_owned()];
        let limit = Duration::from_secs(5);
        let without = |urls: &[&str]| {
            resolving().block_on(seeds(urls).without("127.0.0.1:7000", &others, limit))
        };
        let by_name = without(&["redis://localhost:7000", "redis://127.0.0.1:7001"]);
        assert!(by_name.is_some());
        assert_eq!(
            given.lock().pop(),
            Some(vec!["redis://127.0.0.1:7001".to_owned()]),
            "a name for the hung node is left out"
        );
        let only = without(&["rediss://user:secret@localhost:7000/0"]);
        assert!(only.is_some());
        assert_eq!(
            given.lock().pop(),
            Some(vec![
                "rediss://user:secret@127.0.0.1:7001/0".to_owned(),
                "rediss://user:secret@127.0.0.1:7002/0".to_owned(),
            ]),
            "the only URL, pointed at the other masters"
        );
        assert!(
            without(&["redis://127.0.0.1:7001", "redis://localhost:7002"]).is_none(),
            "no URL reaches it: the store's own client"
        );
        assert!(given.lock().is_empty());
    }

    #[test]
    fn a_url_is_pointed_at_another_node_keeping_the_rest() {
        assert_eq!(
            url_at("rediss://user:secret@10.0.0.1:7000/0", "10.0.0.2:7001"),
            "rediss://user:secret@10.0.0.2:7001/0"
        );
        assert_eq!(
            url_at("redis://[::1]:7000", "::2:7001"),
            "redis://[::2]:7001"
        );
        assert_eq!(
            url_at(
                "redis://cache.internal:7000?protocol=resp3",
                "10.0.0.2:7001"
            ),
            "redis://10.0.0.2:7001?protocol=resp3"
        );
    }

    /// Callers that give up waiting stop nothing: the connection is made, and found.
    #[test]
    fn a_slow_attempt_outlives_its_callers() {
        let connector: Arc<Connector<u32>> = Connector::new();
        runtime().block_on(async {
            let slow = || async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<u32, StoreError>(3)
            };
            let gave_up = tokio::time::timeout(
                Duration::from_millis(10),
                connector.get(Duration::from_secs(1), slow),
            )
            .await;
            assert!(gave_up.is_err());
            tokio::time::sleep(Duration::from_millis(200)).await;
            let unused = || async { Err::<u32, StoreError>(StoreError::Connection("no".into())) };
            assert_eq!(value_of(&connector, unused).await, Some(3));
        });
    }
}
