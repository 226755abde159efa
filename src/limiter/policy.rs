//! What happens when the store cannot decide, and how long a decision may wait for it.
//!
//! Promise: every decision has one deadline, set when it starts, covering every wait on its
//! behalf (a refill lock, a lease call, a second store call); when the store has not answered by
//! then, the outage policy decides. Policy decisions are marked degraded and never carry a
//! receipt for the shared budget (a refund of one must not reach the store).

use std::sync::Arc;
use std::time::Duration;

use crate::error::ConfigError;
use crate::store::{Check, Op};
use crate::{Clock, Decision, MemoryStore, Quota, Rule, Source, StoreError};

/// What to do when the store cannot decide (down, slow, erroring). There is no default: a
/// limiter on a networked store does not build until you choose.
///
/// - `FailOpen`: admit, marked degraded. Availability first; the limit is off during the outage.
/// - `FailClosed`: refuse, marked degraded. The layer answers `503 Service Unavailable` (the
///   client did nothing wrong; configurable to 429) with `Retry-After: retry_after`.
/// - `Local(quota)`: decide in this process with `quota` in place of every rule (e.g. the fleet
///   limit divided by the number of servers).
/// - `LocalShare(n)`: decide in this process with every rule's own quota divided by `n` (limit and
///   burst; at least 1), the same algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Admit every request while the store is unavailable.
    FailOpen,
    /// Refuse every request while the store is unavailable.
    FailClosed {
        /// The `Retry-After` given to refused clients.
        retry_after: Duration,
    },
    /// Decide in process with this quota for every rule.
    Local(Quota),
    /// Decide in process with each rule's quota divided by this many servers; a request under
    /// a quota of its own (a key's override, a tenant's plan) gets its share of that one.
    LocalShare(u64),
}

impl OnStoreError {
    /// [`OnStoreError::FailClosed`] with a `Retry-After` of one second.
    pub fn fail_closed() -> OnStoreError {
        OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The wait the local fallback answers for a cost its share can never hold (the rule's whole
/// quota can): as long as [`OnStoreError::fail_closed`]'s.
const LOCAL_NEVER_RETRY: Duration = Duration::from_secs(1);

/// The outage policy, resolved when the limiter is built.
pub(crate) enum Policy {
    Open,
    Closed {
        retry_after: Duration,
    },
    Local {
        store: MemoryStore,
        /// Each rule's local quota, replaced when the limiter's quotas change.
        rules: arc_swap::ArcSwap<Vec<LocalRule>>,
        /// How a rule's quota becomes its local one.
        local: LocalQuota,
    },
}

/// A rule as the local fallback decides it, and the quota its local one was derived from.
pub(crate) struct LocalRule {
    rule: Rule,
    from: Quota,
}

/// How a local fallback derives each rule's local quota.
#[derive(Clone)]
pub(crate) enum LocalQuota {
    Fixed(Quota),
    Share(u64),
}

impl LocalQuota {
    fn of(&self, quota: &Quota) -> Result<Quota, ConfigError> {
        match self {
            LocalQuota::Fixed(q) => Ok(q.clone()),
            LocalQuota::Share(servers) => share(quota, *servers),
        }
    }

    fn rule(&self, rule: &Rule) -> Result<Rule, ConfigError> {
        Ok(rule.with_quota(self.of(rule.quota())?))
    }

    fn rules(&self, rules: &[Rule]) -> Result<Vec<LocalRule>, ConfigError> {
        rules
            .iter()
            .map(|r| {
                Ok(LocalRule {
                    rule: self.rule(r)?,
                    from: r.quota().clone(),
                })
            })
            .collect()
    }
}

impl Policy {
    /// Resolve `on_error` for these rules; a local fallback gets its own memory store on `clock`.
    pub(crate) fn resolve(
        on_error: OnStoreError,
        rules: &[Rule],
        clock: &Arc<dyn Clock>,
    ) -> Result<Policy, ConfigError> {
        match on_error {
            OnStoreError::FailOpen => Ok(Policy::Open),
            OnStoreError::FailClosed { retry_after } => {
                if retry_after.is_zero() {
                    return Err(ConfigError::Invalid {
                        setting: "on_store_error",
                        reason: "FailClosed needs a retry_after above zero".into(),
                    });
                }
                Ok(Policy::Closed { retry_after })
            }
            OnStoreError::Local(quota) => local(rules, clock, LocalQuota::Fixed(quota)),
            OnStoreError::LocalShare(0) => Err(ConfigError::Invalid {
                setting: "on_store_error",
                reason: "LocalShare needs at least one server".into(),
            }),
            OnStoreError::LocalShare(servers) => local(rules, clock, LocalQuota::Share(servers)),
        }
    }

    /// The local quotas for `rules` (their quotas changed), checked before anything changes.
    pub(crate) fn local_rules(
        &self,
        rules: &[Rule],
    ) -> Result<Option<Vec<LocalRule>>, ConfigError> {
        match self {
            Policy::Local { local, .. } => local.rules(rules).map(Some),
            _ => Ok(None),
        }
    }

    /// Put in force local quotas made by [`local_rules`](Policy::local_rules).
    pub(crate) fn set_local_rules(&self, local_rules: Vec<LocalRule>) {
        if let Policy::Local { rules, .. } = self {
            rules.store(Arc::new(local_rules));
        }
    }

    /// The rule the local fallback decides `rule` by (a rule under its own quota, an override or
    /// a tenant's plan, gets its share of that quota); `None` without a local fallback.
    pub(crate) fn local_rule(&self, rule: &Rule) -> Option<Rule> {
        let Policy::Local {
            rules, local: how, ..
        } = self
        else {
            return None;
        };
        let rules = rules.load();
        match rules.iter().find(|l| l.rule.name() == rule.name()) {
            Some(local) if local.from == *rule.quota() => Some(local.rule.clone()),
            Some(local) if matches!(how, LocalQuota::Fixed(_)) => Some(local.rule.clone()),
            _ => how.rule(rule).ok(),
        }
    }

    /// Decide `checks` without the store. Every decision is degraded; none carries a receipt.
    pub(crate) fn decide(&self, op: Op, checks: &[Check<'_>]) -> Vec<Decision> {
        let synthetic = |allowed: bool, retry_after: Option<Duration>| {
            checks
                .iter()
                .map(|c| {
                    let limit = c.rule.quota().capacity();
                    let mut d = if allowed {
                        Decision::admit(limit, limit, Duration::ZERO)
                    } else {
                        Decision::deny(limit, 0, Duration::ZERO, retry_after)
                    };
                    d.source = Source::Policy;
                    d.degraded = true;
                    d
                })
                .collect()
        };
        match self {
            Policy::Open => synthetic(true, None),
            Policy::Closed { retry_after } => synthetic(false, Some(*retry_after)),
            Policy::Local {
                store,
                rules,
                local: how,
            } => {
                let rules = rules.load();
                // A check under a quota of its own (a key's override, a tenant's plan) gets
                // its share of that quota, not of the rule's: a throttled key stays throttled
                // and a bigger plan stays bigger while the store is away.
                let of = |c: &Check<'_>| rules.iter().find(|l| l.rule.name() == c.rule.name());
                let own: Vec<Option<Rule>> = checks
                    .iter()
                    .map(|c| match (of(c), how) {
                        (Some(local), _) if local.from == *c.rule.quota() => None,
                        (_, LocalQuota::Share(_)) => how.rule(c.rule).ok(),
                        (_, LocalQuota::Fixed(_)) => None,
                    })
                    .collect();
                let local: Vec<Check<'_>> = checks
                    .iter()
                    .zip(&own)
                    .map(|(c, own)| Check {
                        rule: match own {
                            Some(rule) => rule,
                            None => of(c).map_or(c.rule, |local| &local.rule),
                        },
                        key: c.key,
                        cost: c.cost,
                    })
                    .collect();
                let mut decisions = store.apply_now(op, &local);
                for (c, d) in checks.iter().zip(&mut decisions) {
                    d.source = Source::Fallback;
                    d.degraded = true;
                    // Taken from this process's fallback, not the shared budget.
                    d.taken = None;
                    // A cost the local quota can never hold but the rule's can: refused for
                    // now, not "never" (a 413, a gRPC "do not retry"), as the store may be back.
                    if !d.allowed && d.retry_after.is_none() && c.cost <= c.rule.quota().capacity()
                    {
                        d.retry_after = Some(LOCAL_NEVER_RETRY);
                    }
                }
                decisions
            }
        }
    }
}

/// `quota` divided between `servers`: limit and burst, at least 1 each, the same algorithm
/// with the same settings (a sliding window's sub-windows and estimate: a `Bounded` window
/// must stay bounded in an outage).
///
/// A bucket's share can miss the 2^50 bound its whole quota meets (dividing the limit changes the
/// units a token is counted in): the share's limit is then rounded down, to whole tens,
/// hundreds and so on, until it fits (its burst stays the fair share); a little less than a
/// fair share, never a valid rule refused.
fn share(quota: &Quota, servers: u64) -> Result<Quota, ConfigError> {
    let exact = share_of(quota, servers, 1);
    let mut round = 10u64;
    let mut answer = exact.clone();
    while matches!(answer, Err(ConfigError::Overflow { .. })) && round < quota.limit() / servers {
        answer = share_of(quota, servers, round);
        round = round.saturating_mul(10);
    }
    answer.or(exact)
}

/// [`share`]'s limit rounded down to a multiple of `round`, its burst the fair share (at least
/// 1 each).
fn share_of(quota: &Quota, servers: u64, round: u64) -> Result<Quota, ConfigError> {
    let limit = quota.limit() / servers;
    let limit = (limit - limit % round).max(1);
    let built = build_share(quota, servers, limit);
    if quota.algorithm() != crate::Algorithm::Gcra || built.is_ok() {
        return built;
    }
    // GCRA counts whole µs, and a fair share whose interval rounds up by over a tenth is
    // refused when built (a million a second among three, 333,333, is one permit every 4 µs):
    // then the share is the rate that interval allows, 250,000. Only then: the rounding down
    // cut ordinary shares too (10 a second among three ran at 2, not 3).
    let interval = quota.period_us().div_ceil(limit);
    build_share(quota, servers, (quota.period_us() / interval).max(1))
}

/// A share of `quota` among `servers` with `limit` permits a period.
fn build_share(quota: &Quota, servers: u64, limit: u64) -> Result<Quota, ConfigError> {
    let part = |n: u64| (n / servers).max(1);
    let mut b = Quota::new(limit, quota.period())
        .algorithm(quota.algorithm())
        .max_log_len(quota.limit());
    match quota.algorithm() {
        crate::Algorithm::TokenBucket | crate::Algorithm::Gcra => {
            b = b.burst(part(quota.burst()));
        }
        crate::Algorithm::SlidingWindow => {
            b = b
                .sub_windows(quota.sub_windows())
                .estimate(quota.estimate());
        }
        _ => {}
    }
    b.build()
}

fn local(rules: &[Rule], clock: &Arc<dyn Clock>, local: LocalQuota) -> Result<Policy, ConfigError> {
    let rules = local.rules(rules)?;
    let store = MemoryStore::builder()
        .clock(SharedClock(clock.clone()))
        .build()?;
    Ok(Policy::Local {
        store,
        rules: arc_swap::ArcSwap::from_pointee(rules),
        local,
    })
}

/// A clock shared with the limiter.
#[derive(Debug)]
struct SharedClock(Arc<dyn Clock>);

impl Clock for SharedClock {
    fn now_us(&self) -> u64 {
        self.0.now_us()
    }
}

/// The one deadline of a decision.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    at: tokio::time::Instant,
    budget: Duration,
}

impl Deadline {
    /// A deadline `budget` from now.
    pub(crate) fn after(budget: Duration) -> Deadline {
        Deadline {
            // A century at most: a caller's `Duration::MAX` must not overflow the clock.
            at: super::waiting::after(budget),
            budget,
        }
    }

    /// Half of what is left of this deadline, from now.
    pub(crate) fn halfway(&self) -> Deadline {
        let now = tokio::time::Instant::now();
        Deadline {
            at: now + self.at.saturating_duration_since(now) / 2,
            budget: self.budget,
        }
    }

    /// Whether the deadline has passed: a call started now could not be answered in time.
    pub(crate) fn passed(&self) -> bool {
        tokio::time::Instant::now() >= self.at
    }

    /// Run `work` until the deadline; past it, a [`StoreError::Timeout`].
    pub(crate) async fn run<T>(
        self,
        work: impl std::future::Future<Output = T>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout_at(self.at, work)
            .await
            .map_err(|_| StoreError::Timeout(self.budget))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Key, ManualClock};

    fn rule(limit: u64, algorithm: Algorithm, burst: Option<u64>) -> Rule {
        let mut q = Quota::per_second(limit).algorithm(algorithm);
        if let Some(b) = burst {
            q = q.burst(b);
        }
        Rule::new("r", q.build().unwrap()).unwrap()
    }

    fn clock() -> Arc<dyn Clock> {
        Arc::new(ManualClock::default())
    }

    /// A share keeps every setting but the numbers divided: a sliding window's sub-windows
    /// and estimate too (a `Bounded` window fell back to the weighted default in an outage).
    #[test]
    fn a_share_keeps_the_windows_settings() {
        let bounded = Quota::per_second(100)
            .sub_windows(1)
            .estimate(crate::WindowEstimate::Bounded)
            .build()
            .unwrap();
        assert_eq!(share(&bounded, 1).unwrap(), bounded);
        let half = share(&bounded, 2).unwrap();
        assert_eq!(half.limit(), 50);
        assert_eq!(half.sub_windows(), 1);
        assert_eq!(half.estimate(), crate::WindowEstimate::Bounded);
    }

    /// A valid bucket whose exact share would miss the 2^50 bound (its limit divided by 7 shares
    /// no factor with a day in µs) gets a share rounded down a little, not a refused rule.
    #[test]
    fn a_large_buckets_share_is_rounded_not_refused() {
        let day = Quota::per_day(86_400_000)
            .algorithm(Algorithm::TokenBucket)
            .build()
            .unwrap();
        assert!(matches!(
            share_of(&day, 7, 1),
            Err(ConfigError::Overflow { .. })
        ));
        let shared = share(&day, 7).unwrap();
        let fair = 86_400_000 / 7;
        assert!(
            shared.limit() <= fair && shared.limit() * 1000 >= fair * 999,
            "{shared:?}"
        );
        assert_eq!(shared.burst(), fair, "the burst stays the fair share");
        let r = Rule::new("d", day).unwrap();
        assert!(Policy::resolve(OnStoreError::LocalShare(7), &[r], &clock()).is_ok());
    }

    /// A cost above the local share but within the rule's quota is refused for a second, not
    /// "never": the 6 MiB upload a 10 MiB quota admits must not be told it is too large
    /// because the store is away. A cost above the rule's quota stays "never".
    #[test]
    fn a_cost_only_the_local_share_cannot_hold_is_refused_for_now() {
        let r = rule(10, Algorithm::FixedWindow, None);
        let k = Key::new("k");
        let local = Policy::resolve(
            OnStoreError::LocalShare(2),
            std::slice::from_ref(&r),
            &clock(),
        )
        .unwrap();
        let check = |cost| Check {
            rule: &r,
            key: &k,
            cost,
        };
        let d = local.decide(Op::Consume, &[check(6)])[0];
        assert!(!d.allowed && d.degraded);
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        let d = local.decide(Op::Consume, &[check(11)])[0];
        assert!(!d.allowed);
        assert_eq!(
            d.retry_after, None,
            "the rule's own quota cannot hold it either"
        );
        assert!(local.decide(Op::Consume, &[check(5)])[0].allowed);
    }

    /// A GCRA rule at a permit a µs shared among three: the share is what a whole-µs interval
    /// allows (250,000 a second), not a quota refused as slower than it says.
    #[test]
    fn a_gcra_share_is_what_its_interval_allows() {
        let fast = Quota::per_second(1_000_000)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        let shared = share(&fast, 3).unwrap();
        assert_eq!(shared.limit(), 250_000);
        assert_eq!(shared.emission_us(), 4);
        let r = Rule::new("fast", fast).unwrap();
        assert!(Policy::resolve(OnStoreError::LocalShare(3), &[r], &clock()).is_ok());
        // An ordinary share is the fair one, its interval rounded up by a µs at most: 10 a
        // second among three is 3 (it was 2), and a whole quota is itself.
        let ten = Quota::per_second(10)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        assert_eq!(share(&ten, 3).unwrap().limit(), 3);
        let three = Quota::per_second(3)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        assert_eq!(share(&three, 1).unwrap(), three);
    }

    #[test]
    fn fail_open_and_closed_count_nothing() {
        let r = rule(5, Algorithm::FixedWindow, None);
        let k = Key::new("k");
        let check = [Check {
            rule: &r,
            key: &k,
            cost: 1,
        }];
        let open =
            Policy::resolve(OnStoreError::FailOpen, std::slice::from_ref(&r), &clock()).unwrap();
        let d = open.decide(Op::Consume, &check)[0];
        assert!(d.allowed && d.degraded && d.source == Source::Policy && d.taken.is_none());
        let closed = Policy::resolve(
            OnStoreError::fail_closed(),
            std::slice::from_ref(&r),
            &clock(),
        )
        .unwrap();
        let d = closed.decide(Op::Consume, &check)[0];
        assert!(!d.allowed && d.degraded);
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        assert!(Policy::resolve(
            OnStoreError::FailClosed {
                retry_after: Duration::ZERO
            },
            &[r],
            &clock()
        )
        .is_err());
    }

    #[test]
    fn local_share_divides_limit_and_burst_and_decides_in_process() {
        let rules = [
            rule(100, Algorithm::SlidingWindow, None),
            Rule::new(
                "b",
                Quota::per_second(10)
                    .algorithm(Algorithm::TokenBucket)
                    .burst(30)
                    .build()
                    .unwrap(),
            )
            .unwrap(),
        ];
        let Policy::Local { rules: local, .. } =
            Policy::resolve(OnStoreError::LocalShare(4), &rules, &clock()).unwrap()
        else {
            panic!("a local policy");
        };
        let local = local.load();
        assert_eq!(local[0].rule.quota().limit(), 25);
        assert_eq!(
            (local[1].rule.quota().limit(), local[1].rule.quota().burst()),
            (2, 7)
        );
        let tiny = Policy::resolve(OnStoreError::LocalShare(1_000), &rules, &clock()).unwrap();
        let k = Key::new("k");
        let check = [Check {
            rule: &rules[0],
            key: &k,
            cost: 1,
        }];
        let d = tiny.decide(Op::Consume, &check)[0];
        assert!(d.allowed && d.source == Source::Fallback && d.taken.is_none());
        assert_eq!(d.limit, 1, "at least one per server");
        assert!(!tiny.decide(Op::Consume, &check)[0].allowed);
        assert!(Policy::resolve(OnStoreError::LocalShare(0), &rules, &clock()).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_is_set_once_and_covers_every_wait() {
        let deadline = Deadline::after(Duration::from_millis(50));
        let started = tokio::time::Instant::now();
        // A first wait uses 30 ms of the budget; the second gets the remaining 20, not 50.
        deadline
            .run(tokio::time::sleep(Duration::from_millis(30)))
            .await
            .unwrap();
        let late = deadline
            .run(tokio::time::sleep(Duration::from_millis(40)))
            .await;
        assert!(matches!(late, Err(StoreError::Timeout(_))));
        assert_eq!(started.elapsed(), Duration::from_millis(50));
    }
}
