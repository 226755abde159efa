//! Store calls across call groups and failure domains: each call goes through its failure
//! domain's breaker (a cluster master's) within the decision's one deadline; checks in several
//! call groups (cluster slots) are consumed group by group, and a later denial gives the
//! earlier groups back through their receipts.
//!
//! Promise: a request on several domains is all-or-nothing as far as the store can tell (permits
//! are held briefly, never granted twice); when one domain cannot answer, what the others took is
//! given back and the outage policy decides the request, except where a domain that answered
//! refused: its refusal stands (an exhausted account is not admitted because its address's
//! master is down).

use super::policy::Deadline;
use super::Inner;
use crate::store::{Check, Op, Refund};
use crate::{Decision, StoreError};

impl Inner {
    /// The store decides; checks in different call groups (cluster slots) are consumed group by
    /// group, and a later denial gives the earlier groups back through their receipts. When a
    /// group cannot answer, the refusals of those that did stand and the policy decides the
    /// rest.
    pub(super) async fn decide_in_store(
        &self,
        op: Op,
        checks: &[Check<'_>],
        deadline: Deadline,
    ) -> Vec<Decision> {
        let asked = self.asked(checks.first().map(|c| c.key));
        let asked_at = asked.at;
        let groups = self.domain_groups(checks.iter().map(std::slice::from_ref));
        if groups.len() <= 1 {
            return match self
                .call_store("apply", checks, deadline, self.store.apply(op, checks))
                .await
            {
                Some(decisions) => {
                    self.learn_listings(checks, &decisions, asked_at);
                    if let ([check], [d], Op::Consume) = (checks, decisions.as_slice(), op) {
                        self.remember(check, d, asked);
                    } else {
                        self.lift_disproved(checks, &decisions, asked);
                    }
                    decisions
                }
                None => self.fallback(op, checks, Vec::new()),
            };
        }
        let mut out: Vec<Option<Decision>> = vec![None; checks.len()];
        let mut taken: Vec<usize> = Vec::new();
        let (mut denied, mut failed) = (false, false);
        for members in &groups {
            let group: Vec<Check<'_>> = members.iter().map(|&i| checks[i]).collect();
            // Once one domain refused or could not answer, the others are only asked: for a
            // refusal that decides the request (within what is left of the deadline).
            let group_op = if denied || failed { Op::Peek } else { op };
            let Some(decisions) = self
                .call_store(
                    "apply",
                    &group,
                    deadline,
                    self.store.apply(group_op, &group),
                )
                .await
            else {
                failed = true;
                continue;
            };
            self.learn_listings(&group, &decisions, asked_at);
            self.lift_disproved(&group, &decisions, asked);
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
        if denied || failed {
            self.compensate(checks, &mut out, &taken, deadline).await;
        }
        if failed {
            // What the domains that answered refused stands; the policy decides the rest.
            let refused = out.into_iter().map(|d| d.filter(|d| !d.allowed)).collect();
            return self.fallback(op, checks, refused);
        }
        match out.into_iter().collect::<Option<Vec<_>>>() {
            Some(decisions) => decisions,
            None => self.fallback(op, checks, Vec::new()),
        }
    }

    /// Learn which keys the store decided by their listing (and which no longer), for an outage.
    pub(super) fn learn_listings(
        &self,
        checks: &[Check<'_>],
        decisions: &[Decision],
        asked_at: u64,
    ) {
        for (c, d) in checks.iter().zip(decisions) {
            self.listings.observe(c.key, d, asked_at);
        }
    }

    /// Give back what the `taken` checks' decisions took; they report the permits as still there.
    async fn compensate(
        &self,
        checks: &[Check<'_>],
        out: &mut [Option<Decision>],
        taken: &[usize],
        deadline: Deadline,
    ) {
        let refunds: Vec<Refund<'_>> = taken
            .iter()
            .filter_map(|&i| {
                let d = out[i].as_mut()?;
                // A listed key's decision took nothing (an allowed one reads its permits as
                // they are): nothing to give back, and nothing to add.
                let taken = d.taken.take()?;
                d.remaining = d.remaining.saturating_add(checks[i].cost);
                Some(Refund {
                    rule: checks[i].rule,
                    key: checks[i].key,
                    taken,
                })
            })
            .collect();
        if !refunds.is_empty() && !self.give_back(&refunds, deadline).await {
            tracing::warn!(
                "fleetlimit: could not give back permits after a denial on another slot; they stay taken until they expire"
            );
        }
    }

    /// Refunds, one store call per failure domain, within `deadline`; false if any was sent
    /// and failed. What the deadline leaves unsent (another domain held the call to it) goes
    /// later, in the background, with a deadline of its own. A refund that was sent is never
    /// sent again, even if it failed: it may have landed, and would give back twice.
    pub(super) async fn give_back(&self, refunds: &[Refund<'_>], deadline: Deadline) -> bool {
        if self.policy.is_none() {
            let given = self.store.refund(refunds).await.is_ok();
            if given {
                self.refunded(refunds);
            }
            return given;
        }
        let checks: Vec<Check<'_>> = refunds.iter().map(Refund::check).collect();
        let mut all = true;
        let mut unsent: Vec<Refund<'_>> = Vec::new();
        for members in self.domain_groups(checks.iter().map(std::slice::from_ref)) {
            let group: Vec<Refund<'_>> = members.iter().map(|&i| refunds[i]).collect();
            if deadline.passed() {
                unsent.extend(group);
                continue;
            }
            let group_checks: Vec<Check<'_>> = members.iter().map(|&i| checks[i]).collect();
            let given = self
                .call_store("refund", &group_checks, deadline, self.store.refund(&group))
                .await
                .is_some();
            if given {
                self.refunded(&group);
            }
            all &= given;
        }
        if !unsent.is_empty() {
            self.give_back_unsent(&unsent);
        }
        all
    }

    /// Permits went back to these refunds' keys: a denial remembered for one under the same
    /// rule may be wrong now, and is lifted. (Only once given: lifted in an outage, a refusal
    /// would be left to the policy, which may admit.)
    fn refunded(&self, refunds: &[Refund<'_>]) {
        let Some(denials) = self.denials.as_ref().filter(|c| !c.is_empty()) else {
            return;
        };
        let rules = self.rules.load();
        for r in refunds {
            // By name and quota, not by address: a refund given in the background holds a
            // copy of its rule. (An override's quota is no rule's: nothing is remembered for it.)
            let rule = rules
                .iter()
                .position(|x| x.name() == r.rule.name() && x.quota() == r.rule.quota());
            if let Some(index) = rule {
                denials.lift(&(index, r.key.clone()));
            }
        }
    }

    /// [`give_back`](Inner::give_back) in the background, within a deadline of its own (each
    /// round sends at least one domain's refunds, so this ends).
    fn give_back_unsent(&self, refunds: &[Refund<'_>]) {
        let owned: Vec<(crate::Rule, crate::Key, crate::Taken)> = refunds
            .iter()
            .map(|r| (r.rule.clone(), r.key.clone(), r.taken))
            .collect();
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        runtime.spawn(async move {
            let refunds: Vec<Refund<'_>> = owned
                .iter()
                .map(|(rule, key, taken)| Refund {
                    rule,
                    key,
                    taken: *taken,
                })
                .collect();
            if !me.give_back(&refunds, Deadline::after(me.deadline)).await {
                tracing::warn!(
                    "fleetlimit: could not give back permits left unsent by a deadline; they stay taken until they expire"
                );
            }
        });
    }

    /// Indexes of `items` grouped by the call they can share (a cluster's slot).
    fn domain_groups<'c>(&self, items: impl Iterator<Item = &'c [Check<'c>]>) -> Vec<Vec<usize>> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, checks) in items.enumerate() {
            let domain = self.store.call_group(checks);
            match groups.iter_mut().find(|(d, _)| *d == domain) {
                Some((_, members)) => members.push(i),
                None => groups.push((domain, vec![i])),
            }
        }
        groups.into_iter().map(|(_, members)| members).collect()
    }

    /// Call the store for `checks` (one failure domain) through its breaker, within the
    /// decision's deadline. `None`: the store could not decide.
    pub(super) async fn call_store<T>(
        &self,
        what: &'static str,
        checks: &[Check<'_>],
        deadline: Deadline,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        let domain = self.store.failure_domain(checks);
        let rule = checks.first().map_or("?", |c| c.rule.name());
        let started = std::time::Instant::now();
        // Only calls made are measured: one the breaker skipped, or past the deadline, is no
        // store error, and its zero latency would show the store fast just while it is down.
        let made = std::sync::atomic::AtomicBool::new(false);
        let call = async {
            made.store(true, std::sync::atomic::Ordering::Relaxed);
            call.await
        };
        let answer = self
            .breakers
            .call(domain, rule, || self.clock.now_us(), deadline, call)
            .await;
        if made.load(std::sync::atomic::Ordering::Relaxed) {
            self.telemetry
                .store_call(what, started.elapsed(), answer.is_none());
        }
        if answer.is_none() {
            self.watch_breakers();
        }
        answer
    }

    /// A cool-down can end with no request to notice, and `fleetlimit_breakers_open` would
    /// show the breaker open until the next store call or `stats()`: an alert on it would go on
    /// firing on an idle service. While it shows one of this limiter's breakers open, one task
    /// brings it up to date after every cool-down (with the `metrics` feature, on a Tokio
    /// runtime). It holds the limiter weakly, and ends with it.
    fn watch_breakers(&self) {
        if !cfg!(feature = "metrics") {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.breakers.claim_watch() {
            return;
        }
        let watch = Watch(Some(self.me.clone()));
        let cool_down = self
            .breakers
            .cool_down()
            .max(std::time::Duration::from_millis(1));
        runtime.spawn(async move {
            let mut watch = watch;
            loop {
                tokio::time::sleep(cool_down).await;
                let Some(inner) = watch.0.as_ref().and_then(std::sync::Weak::upgrade) else {
                    return;
                };
                if inner.breakers.report_open(inner.clock.now_us()) == 0
                    && inner.breakers.end_watch()
                {
                    watch.0 = None;
                    return;
                }
            }
        });
    }
}

/// The breakers' watch, held by its task: dropped before the task ended it (the runtime shut
/// down), it gives the watch up, so that the next opening starts another.
struct Watch(Option<std::sync::Weak<Inner>>);

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(inner) = self.0.as_ref().and_then(std::sync::Weak::upgrade) {
            inner.breakers.give_up_watch();
        }
    }
}
