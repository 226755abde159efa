//! The arithmetic of each algorithm, pure and clock-free.
//!
//! Every function here is a state transition of `(state, now, quota, cost)`: no I/O, no clock
//! reads. [`MemoryStore`](crate::MemoryStore) runs them directly; each Redis script is the same
//! arithmetic line for line, and a differential test holds the two together.
//!
//! Times are microseconds since the Unix epoch. Every product is bounded when the [`Quota`] is
//! built so that it stays exact in a Lua double.
//!
//! Each state type has the same four steps:
//! - `decide`: bring the state up to `now` (a change that alters no future decision) and say
//!   whether `cost` permits fit. `remaining` is counted as if they were taken.
//! - `commit`: take them; call only after an admitting `decide` at the same `now`. Returns where
//!   they were taken (the receipt's contents).
//! - `refund`: give back what a receipt took, only as far as it is still outstanding: never more
//!   than the state would hold had the request never come.
//! - `expires_at`: from when the state is indistinguishable from a fresh one, so it can be
//!   dropped.

use std::time::Duration;

use crate::{Algorithm, Decision, Quota, Taken};

pub(crate) mod fixed_window;
pub(crate) mod gcra;
pub(crate) mod lease;
pub(crate) mod sliding_log;
pub(crate) mod sliding_window;
pub(crate) mod token_bucket;

pub(crate) use fixed_window::FixedWindow;
pub(crate) use gcra::Gcra;
pub(crate) use sliding_log::SlidingLog;
pub(crate) use sliding_window::SlidingWindow;
pub(crate) use token_bucket::TokenBucket;

/// The state of one key under one quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    FixedWindow(FixedWindow),
    /// Boxed: the log is large, and the other states are kept small.
    SlidingLog(Box<SlidingLog>),
    SlidingWindow(SlidingWindow),
    TokenBucket(TokenBucket),
    Gcra(Gcra),
}

impl State {
    /// A fresh state: nothing consumed yet.
    pub(crate) fn new(quota: &Quota) -> State {
        match quota.algorithm() {
            Algorithm::FixedWindow => State::FixedWindow(FixedWindow::default()),
            Algorithm::SlidingLog => State::SlidingLog(Box::default()),
            Algorithm::SlidingWindow => State::SlidingWindow(SlidingWindow::default()),
            Algorithm::TokenBucket => State::TokenBucket(TokenBucket::full(quota)),
            Algorithm::Gcra => State::Gcra(Gcra::default()),
        }
    }

    /// This state taken over by a key at `now` (a copy of a state it may have shared):
    /// receipts from before refund nothing against it, as against a fresh state.
    pub(crate) fn taken_over(mut self, now: u64) -> State {
        match &mut self {
            State::FixedWindow(s) => s.valid_from = now,
            State::SlidingWindow(s) => s.valid_from = now,
            State::TokenBucket(s) => s.valid_from = now,
            State::Gcra(s) => s.valid_from = now,
            State::SlidingLog(s) => s.valid_from = now,
        }
        self
    }

    /// Whether this state was made for the quota's algorithm (a rule may be reconfigured).
    pub(crate) fn fits(&self, quota: &Quota) -> bool {
        matches!(
            (self, quota.algorithm()),
            (State::FixedWindow(_), Algorithm::FixedWindow)
                | (State::SlidingLog(_), Algorithm::SlidingLog)
                | (State::SlidingWindow(_), Algorithm::SlidingWindow)
                | (State::TokenBucket(_), Algorithm::TokenBucket)
                | (State::Gcra(_), Algorithm::Gcra)
        )
    }

    /// Whether this state's refusals can be decided without writing
    /// ([`refusal`](State::refusal)): the store keeps nothing of them (GCRA's change nothing a
    /// later decision reads, the fixed window and the token bucket are put back, a sliding
    /// window keeps only its roll, which changes no decision). A log keeps its clean-up.
    pub(crate) fn refuses_without_writing(&self) -> bool {
        !matches!(self, State::SlidingLog(_))
    }

    /// The refusal a consume of `cost` at `now` gets, decided without writing; `None` when it
    /// would be admitted, or cannot be decided so (a log; a sliding window not yet rolled to
    /// `now`, whose copy would allocate). For a state that [`fits`](State::fits) the quota and
    /// does not [`convert`](State::converts).
    pub(crate) fn refusal(&self, now: u64, quota: &Quota, cost: u64) -> Option<Decision> {
        let decision = match self {
            State::Gcra(s) => s.clone().decide(now, quota, cost),
            State::FixedWindow(s) => s.clone().decide(now, quota, cost),
            State::TokenBucket(s) => s.clone().decide(now, quota, cost),
            State::SlidingWindow(s) if s.rolled(now, quota) => s.decide_rolled(now, quota, cost),
            State::SlidingWindow(_) | State::SlidingLog(_) => return None,
        };
        (!decision.allowed).then_some(decision)
    }

    /// Whether this state holds a longer window's count (a window after a shorter period's
    /// conversion): evicted, that window would find the key fresh.
    pub(crate) fn holds_a_longer_window(&self) -> bool {
        match self {
            State::FixedWindow(s) => s.holds(),
            State::SlidingWindow(s) => s.holds(),
            _ => false,
        }
    }

    /// Whether `decide` would convert this state, written under another quota.
    pub(crate) fn converts(&self, now: u64, quota: &Quota) -> bool {
        match self {
            State::FixedWindow(s) => s.period != 0 && s.period != quota.period_us(),
            State::SlidingWindow(s) => {
                s.period != 0
                    && (s.period != quota.period_us()
                        || s.counts().len() as u64 != quota.sub_windows() + 1)
            }
            State::TokenBucket(s) => {
                s.scale != quota.token_units() || s.rate != quota.refill_units()
            }
            State::Gcra(s) => s.emission != 0 && s.emission != quota.emission_us() && s.tat > now,
            State::SlidingLog(_) => false,
        }
    }

    /// Whether [`decide`](State::decide) converts this state to `quota` and cuts its debt at
    /// [`RESCALE_CAP`] (see the buckets' `conversion_clamps`): a debt past what any quota holds,
    /// refused under `quota` whatever the cut. Such a conversion is never kept: read back under
    /// its own quota, the cut debt would be gone.
    pub(crate) fn conversion_clamps(&self, now: u64, quota: &Quota) -> bool {
        self.converts(now, quota)
            && match self {
                State::TokenBucket(s) => s.conversion_clamps(now, quota),
                State::Gcra(s) => s.conversion_clamps(now, quota),
                _ => false,
            }
    }

    /// Inlined, as every algorithm's `decide` and `commit` are: a decision returned through a
    /// call is written field by field into a temporary and then copied with wide loads, which
    /// the CPU cannot serve from narrower stores still in flight. That stall was a fifth of a
    /// one-key check's time; inlined, the fields go straight to where the decision is returned.
    #[inline(always)]
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        match self {
            State::FixedWindow(s) => s.decide(now, quota, cost),
            State::SlidingLog(s) => s.decide(now, quota, cost),
            State::SlidingWindow(s) => s.decide(now, quota, cost),
            State::TokenBucket(s) => s.decide(now, quota, cost),
            State::Gcra(s) => s.decide(now, quota, cost),
        }
    }

    #[inline(always)]
    pub(crate) fn commit(&mut self, now: u64, quota: &Quota, cost: u64) -> Taken {
        match self {
            State::FixedWindow(s) => s.commit(now, cost),
            State::SlidingLog(s) => s.commit(now, cost),
            State::SlidingWindow(s) => s.commit(now, cost),
            State::TokenBucket(s) => s.commit(quota, cost),
            State::Gcra(s) => s.commit(now, quota, cost),
        }
    }

    /// Undo what `taken` took, as far as it is still outstanding. Call after a `decide` at `now`.
    /// A receipt of another algorithm refunds nothing.
    pub(crate) fn refund(&mut self, now: u64, quota: &Quota, taken: Taken) {
        if !taken.fits(quota.algorithm()) || !self.fits(quota) {
            return;
        }
        match self {
            State::FixedWindow(s) => s.refund(taken),
            State::SlidingLog(s) => s.refund(taken),
            State::SlidingWindow(s) => s.refund(taken),
            State::TokenBucket(s) => s.refund(now, quota, taken),
            State::Gcra(s) => s.refund(now, quota, taken),
        }
    }

    #[inline(always)]
    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        match self {
            State::FixedWindow(s) => s.expires_at(),
            State::SlidingLog(s) => s.expires_at(quota),
            State::SlidingWindow(s) => s.expires_at(quota),
            State::TokenBucket(s) => s.expires_at(quota),
            State::Gcra(s) => s.expires_at(),
        }
    }
}

/// Microseconds as a `Duration`.
pub(crate) fn us(micros: u64) -> Duration {
    Duration::from_micros(micros)
}

/// A `Duration` in microseconds, saturating: a caller's `Duration::MAX` means "forever" and
/// never wraps to a short time.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Whole seconds, rounded up (saturating): a client that waits this long is never early.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// `ceil(a / b)` for `b > 0`.
pub(crate) fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// A receipt for `cost` permits taken `at`, by `algorithm`. The first permits a fresh state takes
/// stamp its `valid_from`: receipts from before it (an evicted or expired predecessor's) refund
/// nothing.
pub(crate) fn receipt(valid_from: &mut u64, at: u64, cost: u64, algorithm: Algorithm) -> Taken {
    if *valid_from == 0 && cost > 0 {
        *valid_from = at;
    }
    Taken {
        at,
        cost,
        algorithm,
    }
}

/// The most a converted quantity may hold: 2^52 still adds to a timestamp exactly in a double.
pub(crate) const RESCALE_CAP: u64 = 1 << 52;

/// `value × to / from`, rounded up and then one more, at most [`RESCALE_CAP`]; 0 stays 0: a
/// quantity used (a bucket's missing units, a TAT's lead) read in another scale, never less
/// than it was. Computed in doubles exactly as the Lua twin computes it
/// (`math.min(math.ceil(value * to / from) + 1, 2^52)`): the product may pass 2^53, and below
/// the cap the result is within ½ of the exact quotient, so one more is never below it.
pub(crate) fn rescale_ceil(value: u64, from: u64, to: u64) -> u64 {
    if value == 0 || from == 0 || from == to {
        return value;
    }
    let x = (value as f64 * to as f64 / from as f64).ceil() + 1.0;
    if x >= RESCALE_CAP as f64 {
        RESCALE_CAP
    } else {
        x as u64
    }
}

/// The decision for a cost the quota can never admit, however long one waits.
pub(crate) fn never(limit: u64, remaining: u64, reset_after: u64) -> Decision {
    Decision::deny(limit, remaining, us(reset_after), None)
}

#[cfg(test)]
pub(crate) mod testing;
