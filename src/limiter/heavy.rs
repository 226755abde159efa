//! Heavy hitters: the keys refused most over a recent period, in bounded memory.
//!
//! A space-saving summary per period: at most `capacity` keys are counted; a new key takes the
//! place of the smallest count, inheriting it (so counts may be overestimated by at most that
//! inheritance, never underestimated, and any key refused more than 1/capacity of the time is
//! sure to be held). The report adds the current period to the one before it.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::Key;

/// One of the keys refused most recently, as [`Limiter::heavy_hitters`](crate::Limiter::heavy_hitters)
/// reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct HeavyHitter {
    /// The key: fingerprinted (`Key(sha256 …)`; addresses as they are) unless raw keys were
    /// asked for ([`LimiterBuilder::heavy_hitters`](crate::LimiterBuilder::heavy_hitters)).
    pub key: String,
    /// Refusals counted over the last one to two periods (at most that many more, for a key
    /// that took another's place in the summary).
    pub denials: u64,
}

#[derive(Default)]
struct Summary {
    counts: HashMap<Key, u64>,
}

impl Summary {
    fn add(&mut self, key: &Key, capacity: usize) {
        if let Some(n) = self.counts.get_mut(key) {
            *n += 1;
            return;
        }
        if self.counts.len() < capacity {
            self.counts.insert(key.clone(), 1);
            return;
        }
        let smallest = self
            .counts
            .iter()
            .min_by_key(|(_, n)| **n)
            .map(|(k, n)| (k.clone(), *n));
        if let Some((k, n)) = smallest {
            self.counts.remove(&k);
            self.counts.insert(key.clone(), n + 1);
        }
    }
}

struct State {
    current: Summary,
    previous: Summary,
    started: u64,
}

pub(crate) struct HeavyHitters {
    capacity: usize,
    period_us: u64,
    raw: bool,
    state: Mutex<State>,
}

impl HeavyHitters {
    pub(crate) fn new(capacity: usize, period: Duration, raw: bool) -> HeavyHitters {
        HeavyHitters {
            capacity: capacity.max(1),
            period_us: u64::try_from(period.as_micros()).unwrap_or(u64::MAX).max(1),
            raw,
            state: Mutex::new(State {
                current: Summary::default(),
                previous: Summary::default(),
                started: 0,
            }),
        }
    }

    fn roll(&self, state: &mut State, now: u64) {
        let elapsed = now.saturating_sub(state.started);
        if elapsed >= 2 * self.period_us {
            state.previous = Summary::default();
            state.current = Summary::default();
            state.started = now;
        } else if elapsed >= self.period_us {
            state.previous = std::mem::take(&mut state.current);
            state.started = now;
        }
    }

    pub(crate) fn denied(&self, key: &Key, now: u64) {
        let mut state = self.state.lock();
        self.roll(&mut state, now);
        state.current.add(key, self.capacity);
    }

    pub(crate) fn top(&self, n: usize, now: u64) -> Vec<HeavyHitter> {
        let mut state = self.state.lock();
        self.roll(&mut state, now);
        let mut totals: HashMap<&Key, u64> = HashMap::new();
        for (k, c) in state
            .current
            .counts
            .iter()
            .chain(state.previous.counts.iter())
        {
            *totals.entry(k).or_default() += c;
        }
        let mut top: Vec<(&Key, u64)> = totals.into_iter().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        top.into_iter()
            .take(n)
            .map(|(k, denials)| HeavyHitter {
                key: if self.raw {
                    k.readable().unwrap_or_else(|| k.to_string())
                } else {
                    k.to_string()
                },
                denials,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn the_most_refused_keys_in_bounded_memory_over_a_recent_period() {
        let hh = HeavyHitters::new(10, Duration::from_secs(60), true);
        // One loud key among 1,000 quiet ones.
        for i in 0..1_000 {
            hh.denied(&Key::new(format!("quiet-{i}")), S);
            if i % 2 == 0 {
                hh.denied(&Key::new("loud"), S);
            }
        }
        let top = hh.top(3, 2 * S);
        assert_eq!(top[0].key, "loud");
        assert!(top[0].denials >= 500, "{top:?}");
        assert!(hh.state.lock().current.counts.len() <= 10);
        // Still reported one period on (the previous period), gone after two.
        assert_eq!(hh.top(1, 61 * S)[0].key, "loud");
        assert!(hh.top(1, 200 * S).is_empty());
        // Fingerprinted unless raw keys were asked for.
        let hidden = HeavyHitters::new(10, Duration::from_secs(60), false);
        hidden.denied(&Key::new("secret-api-key"), S);
        let shown = &hidden.top(1, S)[0].key;
        assert!(!shown.contains("secret"), "{shown}");
    }
}
