//! Quotas: how many permits per period, counted by which algorithm.

use std::fmt;
use std::time::Duration;

use crate::error::ConfigError;

/// The largest product a quota may need. Redis scripts run in Lua, whose numbers are IEEE
/// doubles, exact up to 2^53; 2^50 leaves room for the sums of these products with timestamps.
pub(crate) const EXACT_MAX: u128 = 1 << 50;

/// The largest integer a Structured Field (RFC 8941) can carry, and so the largest limit or burst.
pub const MAX_HEADER_INTEGER: u64 = 999_999_999_999_999;

/// The longest period accepted: long enough for any real quota, short enough that every timestamp
/// sum stays exact.
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

/// The default cap on a sliding window log's limit (one entry per admitted permit).
pub const DEFAULT_MAX_LOG_LEN: u64 = 10_000;

/// How many sub-windows the sliding window counter splits its period into by default: chosen by
/// measurement on a realistic trace (`cargo run --release --example trace`, table in the
/// README), the fewest that meet its error targets.
pub const DEFAULT_SUB_WINDOWS: u64 = 20;

/// The most sub-windows a sliding window counter may have (state and script time grow with it).
pub const MAX_SUB_WINDOWS: u64 = 100;

/// A divisor a quota fixes, divided by with two multiplications: a hardware 64-bit division
/// takes tens of cycles, and a decision made several of them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Divisor(strength_reduce::StrengthReducedU64);

impl Divisor {
    /// `d`; 1 for 0 (a divisor the quota's algorithm does not divide by).
    fn new(d: u64) -> Divisor {
        Divisor(strength_reduce::StrengthReducedU64::new(d.max(1)))
    }

    pub(crate) fn get(self) -> u64 {
        self.0.get()
    }
}

impl std::ops::Div<Divisor> for u64 {
    type Output = u64;

    fn div(self, d: Divisor) -> u64 {
        self / d.0
    }
}

impl std::ops::Rem<Divisor> for u64 {
    type Output = u64;

    fn rem(self, d: Divisor) -> u64 {
        self % d.0
    }
}

// Made from the quota's other fields: equal when they are.
impl PartialEq for Divisor {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for Divisor {}

impl std::hash::Hash for Divisor {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.get().hash(state);
    }
}

/// How the sliding window counter counts the sub-window sliding out of the period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum WindowEstimate {
    /// In proportion to how much of it the sliding window still covers (its permits assumed
    /// spread evenly): errs both ways by at most that sub-window's count. The default.
    #[default]
    Weighted,
    /// Whole, until it has slid out: **never more than the limit in any trailing period**; the
    /// price is refusing, while a non-empty sub-window slides out, what its permits that have
    /// already left the period would have allowed (a limit held over the period plus at most
    /// one sub-window).
    Bounded,
}

/// How permits are counted. Each has a promise, stated here and proved by the test suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// One counter per aligned window. At most `limit` per window, but up to `2 × limit` across
    /// a window boundary. The cheapest.
    FixedWindow,
    /// One timestamp per admitted permit. Exact: at most `limit` in every window of length
    /// `period`. State grows with the limit, so the limit is capped.
    SlidingLog,
    /// The period split into sub-windows (default [`DEFAULT_SUB_WINDOWS`], see
    /// [`QuotaBuilder::sub_windows`]) with one counter each, the sub-window sliding out weighted
    /// by how much of it the sliding window still covers. At most `limit` by that estimate,
    /// which errs against the exact log by at most the sliding-out sub-window's count; the error
    /// measured on a realistic trace is in the README. With one sub-window it is the classic
    /// two-counter version. The default.
    #[default]
    SlidingWindow,
    /// A bucket of `burst` tokens refilled at `limit / period`; each request takes `cost`
    /// tokens. Never more than `burst + rate × t` in any interval of length `t`.
    TokenBucket,
    /// The generic cell rate algorithm: the token bucket's envelope with one timestamp of
    /// state. Its emission interval is rounded up to a whole microsecond, so it is never faster
    /// than configured.
    Gcra,
}

impl Algorithm {
    /// Every algorithm, in a stable order.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ];

    /// The algorithm's name as written on command lines: `fixed-window`, `sliding-log`,
    /// `sliding-window`, `token-bucket`, `gcra`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed-window",
            Algorithm::SlidingLog => "sliding-log",
            Algorithm::SlidingWindow => "sliding-window",
            Algorithm::TokenBucket => "token-bucket",
            Algorithm::Gcra => "gcra",
        }
    }

    fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| ConfigError::Invalid {
                setting: "algorithm",
                reason: format!(
                    "unknown algorithm {s:?}; expected one of fixed-window, sliding-log, sliding-window, token-bucket, gcra"
                ),
            })
    }
}

/// A validated quota: `limit` permits per `period`, counted by an [`Algorithm`].
///
/// Build one with [`Quota::per_second`], [`Quota::per_minute`], [`Quota::per_hour`],
/// [`Quota::per_day`] or [`Quota::new`], then [`QuotaBuilder::build`]:
///
/// ```
/// use fleetlimit::{Algorithm, Quota};
///
/// let quota = Quota::per_minute(100).build()?;
/// assert_eq!(quota.limit(), 100);
///
/// // A token bucket refilling 10 per second that holds at most 50.
/// let bucket = Quota::per_second(10).algorithm(Algorithm::TokenBucket).burst(50).build()?;
/// assert_eq!(bucket.burst(), 50);
///
/// // Invalid quotas are errors, not panics.
/// assert!(Quota::per_second(0).build().is_err());
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: u64,
    period_us: u64,
    burst: u64,
    algorithm: Algorithm,
    /// GCRA's emission interval, rounded up to a whole microsecond.
    emission_us: u64,
    /// Token bucket: units per token and units refilled per microsecond, in lowest terms, so
    /// refilling is exact integer arithmetic.
    token_units: u64,
    refill_units: u64,
    /// The sliding window counter's sub-windows per period (1 for the other algorithms).
    sub_windows: u64,
    /// How the sliding window counter counts the sub-window sliding out.
    estimate: WindowEstimate,
    /// Divisors of every decision, made once: GCRA's emission interval, the sliding window
    /// counter's sub-window in µs and in ms, and the capacity (`burst`).
    emission: Divisor,
    sub_window: Divisor,
    sub_window_ms: Divisor,
    capacity: Divisor,
}

impl Quota {
    /// `limit` permits per `period`.
    // Returns the builder: every quota is validated by `build` before it can be used.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(limit: u64, period: Duration) -> QuotaBuilder {
        QuotaBuilder {
            limit,
            period,
            burst: None,
            algorithm: Algorithm::default(),
            max_log_len: DEFAULT_MAX_LOG_LEN,
            sub_windows: None,
            estimate: None,
        }
    }

    /// `limit` permits per second.
    pub fn per_second(limit: u64) -> QuotaBuilder {
        Quota::new(limit, Duration::from_secs(1))
    }

    /// `limit` permits per minute.
    pub fn per_minute(limit: u64) -> QuotaBuilder {
        Quota::new(limit, Duration::from_secs(60))
    }

    /// `limit` permits per hour.
    pub fn per_hour(limit: u64) -> QuotaBuilder {
        Quota::new(limit, Duration::from_secs(3600))
    }

    /// `limit` permits per day.
    pub fn per_day(limit: u64) -> QuotaBuilder {
        Quota::new(limit, Duration::from_secs(86_400))
    }

    /// Permits per period (for the token bucket and GCRA: the refill rate's numerator).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }

    /// The burst: the most permits available at once. Equals the limit for the window
    /// algorithms.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The most permits a single request can ever be granted: larger costs are never admitted.
    pub fn capacity(&self) -> u64 {
        self.burst
    }

    /// The sliding window counter's sub-windows per period (1 for the other algorithms).
    pub fn sub_windows(&self) -> u64 {
        self.sub_windows
    }

    /// How the sliding window counter counts the sub-window sliding out.
    pub fn estimate(&self) -> WindowEstimate {
        self.estimate
    }

    pub(crate) fn period_us(&self) -> u64 {
        self.period_us
    }

    pub(crate) fn emission_us(&self) -> u64 {
        self.emission_us
    }

    /// [`emission_us`](Quota::emission_us), to divide by.
    pub(crate) fn emission(&self) -> Divisor {
        self.emission
    }

    /// The sliding window counter's sub-window (µs), to divide by.
    pub(crate) fn sub_window(&self) -> Divisor {
        self.sub_window
    }

    /// The sliding window counter's sub-window (whole ms), to divide by.
    pub(crate) fn sub_window_ms(&self) -> Divisor {
        self.sub_window_ms
    }

    /// [`capacity`](Quota::capacity), to divide by.
    pub(crate) fn capacity_divisor(&self) -> Divisor {
        self.capacity
    }

    pub(crate) fn token_units(&self) -> u64 {
        self.token_units
    }

    pub(crate) fn refill_units(&self) -> u64 {
        self.refill_units
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// An unvalidated quota; [`build`](QuotaBuilder::build) checks it.
#[derive(Debug, Clone)]
#[must_use = "a quota builder does nothing until `build` is called"]
pub struct QuotaBuilder {
    limit: u64,
    period: Duration,
    burst: Option<u64>,
    algorithm: Algorithm,
    max_log_len: u64,
    sub_windows: Option<u64>,
    estimate: Option<WindowEstimate>,
}

impl QuotaBuilder {
    /// Count with this algorithm (default: [`Algorithm::SlidingWindow`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// The token bucket's capacity, or GCRA's burst: how many permits can be taken at once.
    /// Defaults to the limit. Only valid for those two algorithms.
    pub fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// The cap on a sliding window log's limit (default [`DEFAULT_MAX_LOG_LEN`]). The log keeps
    /// one entry per admitted permit, so memory and script time per key grow with the limit.
    pub fn max_log_len(mut self, cap: u64) -> Self {
        self.max_log_len = cap;
        self
    }

    /// The sliding window counter's sub-windows per period (default [`DEFAULT_SUB_WINDOWS`], at
    /// most [`MAX_SUB_WINDOWS`]). More sub-windows make the estimate closer to the exact count
    /// (its error is at most one sub-window's count) at the cost of one counter each per key;
    /// 1 is the classic two-counter version, the smallest state. Sub-windows are whole
    /// milliseconds of equal length: the count used is the largest divisor of the period in
    /// milliseconds that is at most `n` (see [`Quota::sub_windows`]). Only valid for
    /// [`Algorithm::SlidingWindow`].
    pub fn sub_windows(mut self, n: u64) -> Self {
        self.sub_windows = Some(n);
        self
    }

    /// How the sliding window counter counts the sub-window sliding out (default
    /// [`WindowEstimate::Weighted`]; [`WindowEstimate::Bounded`] never passes the limit in any
    /// trailing period). Only valid for [`Algorithm::SlidingWindow`].
    pub fn estimate(mut self, estimate: WindowEstimate) -> Self {
        self.estimate = Some(estimate);
        self
    }

    /// Validate and build the quota.
    pub fn build(self) -> Result<Quota, ConfigError> {
        let QuotaBuilder {
            limit,
            period,
            burst,
            algorithm,
            max_log_len,
            sub_windows,
            estimate,
        } = self;
        if limit == 0 {
            return Err(ConfigError::ZeroLimit);
        }
        if period < Duration::from_millis(1) {
            return Err(ConfigError::PeriodTooShort(period));
        }
        if period > MAX_PERIOD {
            return Err(ConfigError::PeriodTooLong {
                max: MAX_PERIOD,
                got: period,
            });
        }
        if period.subsec_nanos() % 1_000_000 != 0 {
            return Err(ConfigError::PeriodNotWholeMillis(period));
        }
        let period_us = period.as_micros() as u64; // at most MAX_PERIOD, fits easily
        let period_ms = period_us / 1000;
        if burst.is_some() && !algorithm.has_burst() {
            return Err(ConfigError::BurstNotApplicable(algorithm));
        }
        let burst = burst.unwrap_or(limit);
        if burst == 0 {
            return Err(ConfigError::ZeroBurst);
        }
        let exact = |what: &'static str, value: u128| {
            if value > EXACT_MAX {
                Err(ConfigError::Overflow { what, value })
            } else {
                Ok(())
            }
        };
        exact("limit", u128::from(limit))?;
        // Limits and bursts appear in headers: a Structured Field integer has 15 digits at most.
        for (what, value) in [
            ("limit (a header integer has at most 15 digits)", limit),
            ("burst (a header integer has at most 15 digits)", burst),
        ] {
            if value > MAX_HEADER_INTEGER {
                return Err(ConfigError::Overflow {
                    what,
                    value: u128::from(value),
                });
            }
        }
        let invalid_sub_windows = |reason: String| ConfigError::Invalid {
            setting: "sub_windows",
            reason,
        };
        let sub_windows = match (algorithm, sub_windows) {
            (Algorithm::SlidingWindow, n) => {
                let n = n.unwrap_or(DEFAULT_SUB_WINDOWS);
                if n == 0 || n > MAX_SUB_WINDOWS {
                    return Err(invalid_sub_windows(format!(
                        "{n} sub-windows; expected 1 to {MAX_SUB_WINDOWS}"
                    )));
                }
                (1..=n.min(period_ms))
                    .rev()
                    .find(|d| period_ms % d == 0)
                    .unwrap_or(1)
            }
            (_, None) => 1,
            (other, Some(_)) => {
                return Err(invalid_sub_windows(format!(
                    "sub-windows are only meaningful for the sliding window counter, not {other}"
                )))
            }
        };
        let estimate = match (algorithm, estimate) {
            (Algorithm::SlidingWindow, e) => e.unwrap_or_default(),
            (_, None) => WindowEstimate::default(),
            (other, Some(_)) => {
                return Err(ConfigError::Invalid {
                    setting: "estimate",
                    reason: format!(
                    "the estimate is only meaningful for the sliding window counter, not {other}"
                ),
                })
            }
        };
        let mut emission_us = 0;
        let g = gcd(period_us, limit);
        let (token_units, refill_units) = (period_us / g, limit / g);
        match algorithm {
            Algorithm::FixedWindow => {}
            Algorithm::SlidingLog => {
                if limit > max_log_len {
                    return Err(ConfigError::LogTooLong {
                        limit,
                        cap: max_log_len,
                    });
                }
            }
            Algorithm::SlidingWindow => {
                exact(
                    "limit × period in ms",
                    u128::from(limit) * u128::from(period_ms),
                )?;
            }
            Algorithm::TokenBucket => {
                exact(
                    "burst × period in µs / gcd(period in µs, limit)",
                    u128::from(burst) * u128::from(token_units),
                )?;
            }
            Algorithm::Gcra => {
                if limit > period_us {
                    return Err(ConfigError::RateTooHigh { limit, period });
                }
                emission_us = period_us.div_ceil(limit);
                // GCRA counts in whole µs: the interval is rounded up, never faster than asked,
                // but near a permit a µs, much slower (999,999 a second is 500,000).
                if u128::from(emission_us) * u128::from(limit) * 10 > u128::from(period_us) * 11 {
                    return Err(ConfigError::Invalid {
                        setting: "quota",
                        reason: format!(
                            "GCRA counts time in whole microseconds: {limit} per {period:?} is \
                             one permit every {emission_us} µs once rounded up, more than 10% \
                             slower than asked; use the token bucket, exact at any rate"
                        ),
                    });
                }
                exact(
                    "burst × emission interval in µs",
                    u128::from(burst) * u128::from(emission_us),
                )?;
            }
        }
        let sub_window_us = period_us / sub_windows;
        Ok(Quota {
            limit,
            period_us,
            burst,
            algorithm,
            emission_us,
            token_units,
            refill_units,
            sub_windows,
            estimate,
            emission: Divisor::new(emission_us),
            sub_window: Divisor::new(sub_window_us),
            sub_window_ms: Divisor::new(sub_window_us / 1000),
            capacity: Divisor::new(burst),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_divide_exactly() {
        let divisors = [
            1,
            2,
            3,
            7,
            10,
            1_000,
            1_024,
            999_999,
            1 << 40,
            u64::MAX / 3,
            u64::MAX,
        ];
        let numerators = [0, 1, 2, 999, 1_000, 1_001, 1 << 50, u64::MAX - 1, u64::MAX];
        for d in divisors {
            for n in numerators.into_iter().chain([
                d - 1,
                d,
                d.saturating_add(1),
                d.saturating_mul(3) / 2,
            ]) {
                let by = Divisor::new(d);
                assert_eq!((n / by, n % by), (n / d, n % d), "{n} / {d}");
            }
        }
        assert_eq!(
            Divisor::new(0).get(),
            1,
            "an unused divisor is 1, never a panic"
        );
    }

    #[test]
    fn valid_quotas_build() {
        for algorithm in Algorithm::ALL {
            let q = Quota::per_minute(100).algorithm(algorithm).build().unwrap();
            assert_eq!(q.limit(), 100);
            assert_eq!(q.period(), Duration::from_secs(60));
            assert_eq!(q.burst(), 100);
            assert_eq!(q.algorithm(), algorithm);
        }
        let q = Quota::per_second(3)
            .algorithm(Algorithm::Gcra)
            .build()
            .unwrap();
        assert_eq!(q.emission_us(), 333_334, "rounded up, never faster");
    }

    #[test]
    fn invalid_quotas_are_errors() {
        assert_eq!(Quota::per_second(0).build(), Err(ConfigError::ZeroLimit));
        assert!(matches!(
            Quota::new(1, Duration::ZERO).build(),
            Err(ConfigError::PeriodTooShort(_))
        ));
        assert!(matches!(
            Quota::new(1, Duration::from_micros(1500)).build(),
            Err(ConfigError::PeriodNotWholeMillis(_))
        ));
        assert!(matches!(
            Quota::new(1, Duration::from_secs(400 * 86_400)).build(),
            Err(ConfigError::PeriodTooLong { .. })
        ));
        assert_eq!(
            Quota::per_second(5)
                .algorithm(Algorithm::TokenBucket)
                .burst(0)
                .build(),
            Err(ConfigError::ZeroBurst)
        );
        assert!(matches!(
            Quota::per_second(5).burst(2).build(),
            Err(ConfigError::BurstNotApplicable(Algorithm::SlidingWindow))
        ));
        assert!(matches!(
            Quota::per_second(u64::MAX).build(),
            Err(ConfigError::Overflow { .. })
        ));
        assert!(matches!(
            Quota::per_day(1 << 40).build(),
            Err(ConfigError::Overflow { .. })
        ));
        // Within Lua's exact range, but past a header integer's 15 digits.
        assert!(matches!(
            Quota::per_day(1_000_000_000_000_000)
                .algorithm(Algorithm::FixedWindow)
                .build(),
            Err(ConfigError::Overflow { what, .. }) if what.contains("15 digits")
        ));
        assert!(Quota::per_day(999_999_999_999_999)
            .algorithm(Algorithm::FixedWindow)
            .build()
            .is_ok());
        assert!(matches!(
            Quota::per_second(2_000_000)
                .algorithm(Algorithm::Gcra)
                .build(),
            Err(ConfigError::RateTooHigh { .. })
        ));
        // Rounded up to whole µs, these would run far slower than asked: 500,000 and about
        // 333,333 a second.
        for (per_second, interval) in [(999_999, "every 2 µs"), (400_000, "every 3 µs")] {
            let err = Quota::per_second(per_second)
                .algorithm(Algorithm::Gcra)
                .build()
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(interval) && err.contains("token bucket"),
                "{err}"
            );
        }
        // Within 10%: 100,000 a second exactly, 95,000 as 90,909.
        for per_second in [1_000_000, 100_000, 95_000, 7] {
            assert!(Quota::per_second(per_second)
                .algorithm(Algorithm::Gcra)
                .build()
                .is_ok());
        }
        assert!(matches!(
            Quota::new(1 << 40, Duration::from_millis(86_400_001))
                .algorithm(Algorithm::TokenBucket)
                .build(),
            Err(ConfigError::Overflow { .. })
        ));
        let err = Quota::per_day(100_000)
            .algorithm(Algorithm::SlidingLog)
            .build()
            .unwrap_err();
        assert_eq!(
            err,
            ConfigError::LogTooLong {
                limit: 100_000,
                cap: DEFAULT_MAX_LOG_LEN
            }
        );
        assert!(err.to_string().contains("max_log_len"));
        assert!(Quota::per_day(100_000)
            .algorithm(Algorithm::SlidingLog)
            .max_log_len(100_000)
            .build()
            .is_ok());
    }

    #[test]
    fn sub_windows_divide_the_period_into_whole_milliseconds() {
        let n = |b: QuotaBuilder| b.build().map(|q| q.sub_windows());
        assert_eq!(n(Quota::per_minute(10)), Ok(DEFAULT_SUB_WINDOWS));
        assert_eq!(n(Quota::per_minute(10).sub_windows(1)), Ok(1));
        assert_eq!(
            n(Quota::per_minute(10).sub_windows(7)),
            Ok(6),
            "60 000 ms: 7 does not divide"
        );
        assert_eq!(n(Quota::new(10, Duration::from_millis(7))), Ok(7));
        assert_eq!(n(Quota::new(10, Duration::from_millis(1))), Ok(1));
        assert_eq!(
            n(Quota::new(10, Duration::from_millis(997))),
            Ok(1),
            "a prime"
        );
        for bad in [0, MAX_SUB_WINDOWS + 1] {
            let err = Quota::per_minute(10).sub_windows(bad).build().unwrap_err();
            assert!(err.to_string().contains("sub_windows"), "{err}");
        }
        for a in Algorithm::ALL {
            let q = Quota::per_minute(10).algorithm(a);
            assert_eq!(n(q.clone()).unwrap() > 1, a == Algorithm::SlidingWindow);
            assert_eq!(
                n(q.clone().sub_windows(4)).is_ok(),
                a == Algorithm::SlidingWindow
            );
            let bounded = q.estimate(WindowEstimate::Bounded).build();
            assert_eq!(
                bounded.is_ok(),
                a == Algorithm::SlidingWindow,
                "{bounded:?}"
            );
        }
    }

    #[test]
    fn algorithm_names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
        }
        assert!("leaky".parse::<Algorithm>().is_err());
    }
}
