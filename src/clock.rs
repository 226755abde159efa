//! Time, injected: the system clock in production, a manual clock in tests.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in microseconds since the Unix epoch.
///
/// Stores read time through a `Clock` so that tests can move time by hand instead of sleeping.
/// Microseconds since the epoch stay below 2^53 (exact in a Redis script's doubles) until the
/// year 2255.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The operating system's clock, read cheaply: the wall-clock time is taken once, and the time
/// since then is measured with the CPU's monotonic counter (a few nanoseconds per read, where a
/// system call costs tens). It never steps back, and it drifts from the wall clock only as the
/// counter does; a store on Redis reads Redis's `TIME` instead.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

struct Anchor {
    epoch_us: u64,
    /// A clock of our own, read raw: `quanta::Instant::now` looks for a mocked clock on every
    /// read.
    clock: quanta::Clock,
    at_raw: u64,
}

static ANCHOR: std::sync::OnceLock<Anchor> = std::sync::OnceLock::new();

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        let anchor = ANCHOR.get_or_init(|| {
            let clock = quanta::Clock::new();
            let at_raw = clock.raw();
            Anchor {
                // A clock set before 1970 reads as the epoch rather than panicking.
                epoch_us: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as u64),
                clock,
                at_raw,
            }
        });
        // Zero, not a wrapped difference, if a counter read on another core is behind.
        let since_ns = anchor
            .clock
            .delta_as_nanos(anchor.at_raw, anchor.clock.raw());
        anchor.epoch_us + since_ns / 1_000
    }
}

/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use fleetlimit::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000_000);
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(clock.now_us(), 1_005_000);
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `now_us` microseconds since the epoch.
    pub fn new(now_us: u64) -> ManualClock {
        ManualClock(Arc::new(AtomicU64::new(now_us)))
    }

    /// Move the clock forward, stopping at the last reading (a huge `by` never wraps it round
    /// to an earlier one).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        // The closure always answers, so the update cannot fail.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(by))
            });
    }

    /// Set the clock to an absolute reading.
    pub fn set(&self, now_us: u64) {
        self.0.store(now_us, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    /// A clock at 2025-01-01T00:00:00Z.
    fn default() -> Self {
        ManualClock::new(1_735_689_600_000_000)
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_only_moves_forward() {
        let clock = ManualClock::new(1_000);
        clock.advance(Duration::from_micros(5));
        assert_eq!(clock.now_us(), 1_005);
        clock.advance(Duration::MAX);
        assert_eq!(clock.now_us(), u64::MAX);
        clock.advance(Duration::from_secs(1));
        assert_eq!(clock.now_us(), u64::MAX);
    }
}
