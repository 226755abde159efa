//! Error types, one `#[non_exhaustive]` enum per concern.
//!
//! Configuration errors surface when a quota, limiter or layer is built, never on a request.
//! Store errors are what a request can meet at run time; the limiter turns them into decisions
//! according to the outage policy.

use std::time::Duration;

/// An invalid configuration, reported when a quota, rule, limiter or layer is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A quota with a limit of zero admits nothing; deny explicitly instead.
    #[error("a quota's limit must be at least 1")]
    ZeroLimit,
    /// A period shorter than one millisecond.
    #[error("a quota's period must be at least 1 ms (got {0:?})")]
    PeriodTooShort(Duration),
    /// Periods are counted in whole milliseconds.
    #[error("a quota's period must be a whole number of milliseconds (got {0:?})")]
    PeriodNotWholeMillis(Duration),
    /// A period longer than the arithmetic supports.
    #[error("a quota's period must be at most {max:?} (got {got:?})")]
    PeriodTooLong {
        /// The longest period accepted.
        max: Duration,
        /// The period asked for.
        got: Duration,
    },
    /// A burst of zero.
    #[error("a quota's burst must be at least 1")]
    ZeroBurst,
    /// `burst` only applies to the token bucket and GCRA.
    #[error("burst is only meaningful for the token bucket and GCRA, not {0}")]
    BurstNotApplicable(crate::Algorithm),
    /// The numbers are too large for exact integer arithmetic (Redis scripts compute in doubles;
    /// products are kept below 2^50 so that sums with timestamps stay below 2^53).
    #[error("{what} = {value} exceeds 2^50, the largest product both stores compute exactly (Redis scripts compute in doubles); use a smaller limit or a shorter period")]
    Overflow {
        /// Which product overflowed.
        what: &'static str,
        /// Its value.
        value: u128,
    },
    /// The rate asks for more than one permit per microsecond, the finest time step.
    #[error("a rate of {limit} per {period:?} is faster than one permit per microsecond, the finest time step")]
    RateTooHigh {
        /// The quota's limit.
        limit: u64,
        /// The quota's period.
        period: Duration,
    },
    /// The sliding window log keeps one entry per admitted permit, so its limit is capped.
    #[error("the sliding window log keeps one entry per permit, so its limit is capped at {cap} (got {limit}); raise the cap with `max_log_len` or use the sliding window counter")]
    LogTooLong {
        /// The quota's limit.
        limit: u64,
        /// The cap in force.
        cap: u64,
    },
    /// A rule was given an empty or duplicate name.
    #[error("invalid rule name {0:?}: names must be non-empty, unique within a limiter, and at most 64 bytes")]
    InvalidRuleName(String),
    /// A limiter was built without any rule.
    #[error("a limiter needs at least one rule")]
    NoRules,
    /// Some other invalid setting.
    #[error("invalid setting `{setting}`: {reason}")]
    Invalid {
        /// The setting's name.
        setting: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// A failure of the shared store: the decision could not be made there.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached (refused, reset, closed).
    #[error("store connection failed: {0}")]
    Connection(String),
    /// The store did not answer before the deadline.
    #[error("store did not answer within {0:?}")]
    Timeout(Duration),
    /// A script failed inside the store.
    #[error("store script failed: {0}")]
    Script(String),
    /// The store answered something that is not a valid decision.
    #[error("store protocol error: {0}")]
    Protocol(String),
}

/// Everything [`Limiter`](crate::Limiter) calls can return.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid (reported when building, never on a request).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store failed and the outage policy says to surface the failure.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A request named a rule the limiter does not have.
    #[error("no rule named {0:?}")]
    UnknownRule(String),
    /// The same rule and key twice in one request (it would count once per mention).
    #[error("rule {0:?} is named twice for the same key in one request")]
    DuplicateTarget(String),
    /// A cost of zero, or one that cannot be represented.
    #[error("invalid cost {0}: a cost must be at least 1")]
    InvalidCost(u64),
    /// A receipt given to a limiter other than the one that issued it.
    #[error("this receipt was issued by another limiter")]
    ForeignReceipt,
}
