//! The Redis store: every decision is one Lua script call, atomic inside Redis, on Redis's
//! clock, on a standalone server or a cluster.
//!
//! The scripts (`*.lua` beside this file) are the same arithmetic as `src/algorithm/`, line for
//! line; a differential test holds the two together. They are joined into one script at compile
//! time and run with EVALSHA (loaded again on NOSCRIPT, as after a server restart).
//!
//! Key layout: `<prefix>{<key>}:<rule>:<algorithm>`. Key and rule are percent-encoded, so `:`,
//! `{` and `}` never appear inside them and no two (rule, key) pairs share a Redis key; keys over
//! 128 bytes were already replaced by their SHA-256 (see [`Key`](crate::Key)). The hash tag is
//! the key, so all the rules on one key decide in one atomic call on a cluster too.
//!
//! The scripts need Redis 5.0 or newer (script effects replication, which lets a script read
//! `TIME` and then write); [`RedisStoreBuilder::connect`] checks the server's version.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script};

use super::{BoxFuture, Check, Lease, Op, Refund, Store};
use crate::algorithm::us;
use crate::error::{ConfigError, Error};
use crate::{Algorithm, Clock, Decision, StoreError, Taken};

mod keys;

use keys::redis_key;
pub use keys::slot;

/// The Redis key of `rule`'s state for `key` under the default prefix, as text (the encoding
/// is ASCII), for tools such as `redis-cli`.
pub fn display_key(rule: &crate::Rule, key: &crate::Key) -> String {
    String::from_utf8_lossy(&redis_key(DEFAULT_PREFIX, rule, key)).into_owned()
}

/// The default deadline for one store call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "fleetlimit:";

/// The oldest Redis the scripts run on: 5.0 replicates a script's effects, so a script may read
/// `TIME` and then write.
pub const MIN_REDIS_VERSION: (u32, u32) = (5, 0);

/// Numbers the script answers per check.
const PER_DECISION: usize = 6;

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
    prefix: Box<str>,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
}

enum Conn {
    /// One multiplexed, pipelined connection that reconnects by itself.
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// A user's pool: one connection is taken out and shared (multiplexed) until it fails, so
    /// the hot path never pays a checkout.
    Pool {
        pool: deadpool_redis::Pool,
        current: Mutex<Option<MultiplexedConnection>>,
    },
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner.conn {
            Conn::Single(_) => "standalone",
            Conn::Cluster(_) => "cluster",
            Conn::Pool { .. } => "pool",
        };
        f.debug_struct("RedisStore")
            .field("kind", &kind)
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("explicit_clock", &self.inner.clock.is_some())
            .finish()
    }
}

/// Configures a [`RedisStore`].
#[derive(Debug)]
#[must_use = "a builder does nothing until it connects"]
pub struct RedisStoreBuilder {
    prefix: String,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        RedisStoreBuilder {
            prefix: DEFAULT_PREFIX.into(),
            timeout: DEFAULT_TIMEOUT,
            clock: None,
        }
    }
}

impl RedisStoreBuilder {
    /// Prefix every key (default `fleetlimit:`). Must not contain `{` or `}`, which would break
    /// the hash tag that keeps a decision's keys on one cluster slot.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The deadline for each store call, connecting included (default 50 ms). A call that misses
    /// it is a [`StoreError::Timeout`], never retried: the script may have run.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Pass time from this clock to the scripts instead of reading Redis's `TIME`. For
    /// deterministic tests; in production the fleet should share Redis's one clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.prefix.contains(['{', '}']) {
            return Err(ConfigError::Invalid {
                setting: "prefix",
                reason: format!("{:?} must not contain '{{' or '}}'", self.prefix),
            });
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "timeout",
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
                prefix: self.prefix.into(),
                timeout: self.timeout,
                clock: self.clock,
            }),
        }
    }

    /// Connect to a standalone server (`redis://host:port[/db]`, `rediss://…`).
    pub async fn connect(self, url: &str) -> Result<RedisStore, Error> {
        self.validate()?;
        let client = redis::Client::open(url).map_err(|e| ConfigError::Invalid {
            setting: "url",
            reason: e.to_string(),
        })?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = tokio::time::timeout(
            self.timeout.max(Duration::from_secs(2)),
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout.max(Duration::from_secs(2))))?
        .map_err(store_error)?;
        let mut conn = manager.clone();
        check_version(&mut conn, self.timeout.max(Duration::from_secs(2))).await?;
        Ok(self.finish(Conn::Single(manager)))
    }

    /// Connect to a Redis Cluster through any of its nodes.
    pub async fn cluster<U: AsRef<str>>(self, urls: &[U]) -> Result<RedisStore, Error> {
        self.validate()?;
        let nodes: Vec<&str> = urls.iter().map(AsRef::as_ref).collect();
        let client = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(self.timeout.max(Duration::from_millis(250)))
            .response_timeout(self.timeout)
            .retries(1)
            .build()
            .map_err(|e| ConfigError::Invalid {
                setting: "urls",
                reason: e.to_string(),
            })?;
        let conn = tokio::time::timeout(
            self.timeout.max(Duration::from_secs(5)),
            client.get_async_connection(),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout.max(Duration::from_secs(5))))?
        .map_err(store_error)?;
        let mut probe = conn.clone();
        check_version(&mut probe, self.timeout.max(Duration::from_secs(5))).await?;
        Ok(self.finish(Conn::Cluster(conn)))
    }

    /// Use connections from a `deadpool-redis` pool. One connection is checked out and shared
    /// (it is multiplexed); a new one is checked out only after it fails.
    pub fn pool(self, pool: deadpool_redis::Pool) -> Result<RedisStore, Error> {
        self.validate()?;
        Ok(self.finish(Conn::Pool {
            pool,
            current: Mutex::new(None),
        }))
    }
}

/// Refuse a server older than [`MIN_REDIS_VERSION`], with a clear error.
async fn check_version(
    conn: &mut impl redis::aio::ConnectionLike,
    timeout: Duration,
) -> Result<(), Error> {
    let info: redis::Value =
        tokio::time::timeout(timeout, redis::cmd("INFO").arg("server").query_async(conn))
            .await
            .map_err(|_| StoreError::Timeout(timeout))?
            .map_err(store_error)?;
    // A cluster answers one text per node: every node must be recent enough.
    let mut texts = Vec::new();
    collect_texts(&info, &mut texts);
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
        _ => Err(ConfigError::Invalid {
            setting: "url",
            reason: format!(
                "the server runs Redis {version:?}; fleetlimit needs Redis {}.{} or newer",
                MIN_REDIS_VERSION.0, MIN_REDIS_VERSION.1
            ),
        }
        .into()),
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
    pub fn script() -> &'static str {
        SCRIPT
    }

    /// The script's arguments for one consume of `check` (after the key, which is
    /// [`key_for`](RedisStore::key_for)), deciding on Redis's clock.
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
            check.cost.to_string(),
            String::new(),
        ]
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    fn is_cluster(&self) -> bool {
        matches!(self.inner.conn, Conn::Cluster(_))
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Consume => "consume",
        Op::Peek => "peek",
    }
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
    if e.is_timeout() {
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

impl Inner {
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
        let mut invocation = self.script.prepare_invoke();
        for c in checks {
            invocation.key(redis_key(&self.prefix, c.rule, c.key));
        }
        invocation.arg(op);
        match &self.clock {
            Some(clock) => invocation.arg(clock.now_us()),
            None => invocation.arg(""),
        };
        for (i, c) in checks.iter().enumerate() {
            let q = c.rule.quota();
            invocation
                .arg(algorithm_code(q.algorithm()))
                .arg(q.limit())
                .arg(q.period_us())
                .arg(q.burst())
                .arg(q.emission_us())
                .arg(q.token_units())
                .arg(q.refill_units())
                .arg(c.cost);
            match anchors.get(i) {
                Some(at) => invocation.arg(*at),
                None => invocation.arg(""),
            };
        }
        if let Some(extra) = extra {
            invocation.arg(extra);
        }
        let call = async {
            match &self.conn {
                Conn::Single(manager) => {
                    let mut conn = manager.clone();
                    invocation.invoke_async::<Vec<i64>>(&mut conn).await
                }
                Conn::Cluster(cluster) => {
                    let mut conn = cluster.clone();
                    invocation.invoke_async::<Vec<i64>>(&mut conn).await
                }
                Conn::Pool { pool, current } => {
                    let cached = current.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let mut conn = match cached {
                        Some(conn) => conn,
                        None => {
                            let fresh = pool.get().await.map_err(|e| {
                                RedisError::from(std::io::Error::other(e.to_string()))
                            })?;
                            let conn = deadpool_redis::Connection::take(fresh);
                            *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
                            conn
                        }
                    };
                    let result = invocation.invoke_async::<Vec<i64>>(&mut conn).await;
                    if let Err(e) = &result {
                        if e.is_io_error()
                            || e.is_connection_dropped()
                            || e.is_unrecoverable_error()
                        {
                            *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
                        }
                    }
                    result
                }
            }
        };
        let Ok(result) = tokio::time::timeout(self.timeout, call).await else {
            // A connection that stopped answering is not reused: the next call takes a fresh one.
            if let Conn::Pool { current, .. } = &self.conn {
                *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
            }
            return Err(StoreError::Timeout(self.timeout));
        };
        result.map_err(|e| match store_error(e) {
            StoreError::Timeout(_) => StoreError::Timeout(self.timeout),
            other => other,
        })
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
            d.taken = u64::try_from(v[5]).ok().map(|at| Taken {
                at,
                cost: check.cost,
                algorithm: check.rule.quota().algorithm(),
            });
            Ok(d)
        })
        .collect()
}

/// Indexes of `items` grouped by cluster slot, in order of first appearance.
fn slot_groups(keys: impl Iterator<Item = Vec<u8>>) -> Vec<(u16, Vec<usize>)> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, key) in keys.enumerate() {
        let s = slot(&key);
        match groups.iter_mut().find(|(g, _)| *g == s) {
            Some((_, members)) => members.push(i),
            None => groups.push((s, vec![i])),
        }
    }
    groups
}

impl RedisStore {
    /// On a cluster, checks whose keys sit on different slots cannot share one script call (the
    /// rules of one key always share a slot: the hash tag is the key). They are consumed group by
    /// group; if a later group denies, what the earlier groups took is given back through their
    /// receipts, so nothing is over-admitted (permits are briefly held, never granted twice).
    async fn apply_across_slots(
        &self,
        op: Op,
        checks: &[Check<'_>],
    ) -> Result<Vec<Decision>, StoreError> {
        let prefix = &self.inner.prefix;
        let groups = slot_groups(checks.iter().map(|c| redis_key(prefix, c.rule, c.key)));
        if groups.len() == 1 {
            return self.inner.invoke(op, checks).await;
        }
        let mut out: Vec<Option<Decision>> = vec![None; checks.len()];
        let mut taken: Vec<usize> = Vec::new();
        let mut denied = false;
        for (_, members) in &groups {
            let group: Vec<Check<'_>> = members.iter().map(|&i| checks[i]).collect();
            let group_op = if denied { Op::Peek } else { op };
            let decisions = self.inner.invoke(group_op, &group).await?;
            let all_allowed = decisions.iter().all(|d| d.allowed);
            for (&i, d) in members.iter().zip(decisions) {
                out[i] = Some(d);
            }
            if group_op == Op::Consume {
                if all_allowed {
                    taken.extend(members);
                } else {
                    denied = true;
                }
            }
        }
        if denied && !taken.is_empty() {
            let refunds: Vec<Refund<'_>> = taken
                .iter()
                .filter_map(|&i| {
                    let d = out[i].as_mut()?;
                    d.remaining += checks[i].cost;
                    Some(Refund {
                        rule: checks[i].rule,
                        key: checks[i].key,
                        taken: d.taken.take()?,
                    })
                })
                .collect();
            if let Err(error) = self.refund_grouped(&refunds).await {
                tracing::warn!(%error, "fleetlimit: refund after a cross-slot denial failed; permits stay taken until they expire");
            }
        }
        out.into_iter()
            .map(|d| d.ok_or_else(|| StoreError::Protocol("a check got no decision".into())))
            .collect()
    }

    /// Refunds, one script call per slot group.
    async fn refund_grouped(&self, refunds: &[Refund<'_>]) -> Result<Vec<Decision>, StoreError> {
        if !self.is_cluster() || refunds.len() < 2 {
            return self.inner.invoke_refund(refunds).await;
        }
        let prefix = &self.inner.prefix;
        let groups = slot_groups(refunds.iter().map(|r| redis_key(prefix, r.rule, r.key)));
        let mut out: Vec<Option<Decision>> = vec![None; refunds.len()];
        for (_, members) in &groups {
            let group: Vec<Refund<'_>> = members.iter().map(|&i| refunds[i]).collect();
            for (&i, d) in members.iter().zip(self.inner.invoke_refund(&group).await?) {
                out[i] = Some(d);
            }
        }
        out.into_iter()
            .map(|d| d.ok_or_else(|| StoreError::Protocol("a refund got no decision".into())))
            .collect()
    }
}

impl Store for RedisStore {
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
            if values.len() != PER_DECISION + 4 {
                return Err(StoreError::Protocol(format!(
                    "a lease answers {} numbers, got {}",
                    PER_DECISION + 4,
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
            self.refund_grouped(refunds).await
        })
    }

    fn failure_domains(&self) -> usize {
        if self.is_cluster() {
            16_384
        } else {
            1
        }
    }

    fn failure_domain(&self, checks: &[Check<'_>]) -> usize {
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
            if self.is_cluster() && checks.len() > 1 {
                return self.apply_across_slots(op, checks).await;
            }
            self.inner.invoke(op, checks).await
        })
    }
}
