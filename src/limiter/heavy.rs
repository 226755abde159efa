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
    /// The key: fingerprinted (`Key(#1a2b3c4d)`; addresses as they are) unless raw keys were
    /// asked for ([`LimiterBuilder::heavy_hitters`](crate::LimiterBuilder::heavy_hitters));
    /// even then, a key whose text is not ASCII or starts as another key's form does (`Key(`)
    /// is fingerprinted, so that no client's text reads as an address.
    pub key: String,
    /// Refusals counted over the last one to two periods (at most that many more, for a key
    /// that took another's place in the summary).
    pub denials: u64,
}

#[derive(Default)]
struct Summary {
    counts: hashbrown::HashMap<Key, u64>,
    /// Keys that held the smallest count when it was last looked for, and that count: the next
    /// to give up their place. Counts only grow and a newcomer starts above it, so a key still at
    /// that count is at the smallest there is; one look serves many newcomers, where a look per
    /// newcomer would let a client sending new keys make every refusal scan the whole summary.
    smallest: Vec<Key>,
    smallest_count: u64,
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
        loop {
            let Some(candidate) = self.smallest.pop() else {
                let Some(&min) = self.counts.values().min() else {
                    return; // a summary of no keys (never: the capacity is at least 1)
                };
                self.smallest_count = min;
                self.smallest = self
                    .counts
                    .iter()
                    .filter(|(_, &n)| n == min)
                    .map(|(k, _)| k.clone())
                    .collect();
                continue;
            };
            if self.counts.get(&candidate) == Some(&self.smallest_count) {
                self.counts.remove(&candidate);
                self.counts.insert(key.clone(), self.smallest_count + 1);
                return;
            }
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
            period_us: crate::algorithm::micros(period).max(1),
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
        if elapsed >= self.period_us.saturating_mul(2) {
            state.previous = Summary::default();
            state.current = Summary::default();
            state.started = now;
        } else if elapsed >= self.period_us {
            // The next period starts where this one ends, not now: started late, `current`
            // would span up to two periods, and a flood nearly three periods old would still
            // be listed.
            state.previous = std::mem::take(&mut state.current);
            state.started += self.period_us;
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
                    // A client's text written like another key's form (`Key(ip …)`, in any
                    // case), or holding characters that can hide or fake it (a zero-width
                    // space, a Cyrillic К, a NUL or an escape sequence from a JSON body), is
                    // shown in its own form instead: an operator must never take it for an
                    // address.
                    k.readable()
                        .filter(|text| {
                            text.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
                                && !text
                                    .trim_start()
                                    .get(..4)
                                    .is_some_and(|start| start.eq_ignore_ascii_case("key("))
                        })
                        .unwrap_or_else(|| k.to_string())
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

    /// Periods follow one another from the first: a flood in one period is listed for the
    /// next one at most, however late the refusal that rolls it comes (a stray refusal 119 s
    /// into a minute's counting once started the next period then, and a flood nearly three
    /// minutes old was still listed).
    #[test]
    fn a_flood_is_listed_over_one_to_two_periods_only() {
        const S: u64 = 1_000_000;
        let h = HeavyHitters::new(10, Duration::from_secs(60), true);
        h.denied(&Key::new("a"), 1000 * S);
        h.denied(&Key::new("b"), 1119 * S);
        assert!(
            h.top(10, 1119 * S).iter().any(|x| x.key == "a"),
            "within two periods"
        );
        assert!(
            h.top(10, 1178 * S).iter().all(|x| x.key != "a"),
            "a flood 178 s old is past the last two periods"
        );
    }

    /// A period as long as a `Duration` goes is accepted, and never overflows a roll.
    #[test]
    fn the_longest_period_counts_and_never_overflows() {
        let h = HeavyHitters::new(10, Duration::MAX, true);
        let key = Key::new("k");
        h.denied(&key, 1_900_000_000_000_000);
        h.denied(&key, u64::MAX);
        assert_eq!(h.top(1, u64::MAX).len(), 1);
    }

    /// The summary against a direct space-saving one (a newcomer takes the place of a key with
    /// the smallest count, inheriting it plus one): the same counts, key by key, whatever the
    /// order of arrivals.
    #[test]
    fn a_newcomer_takes_the_place_of_a_smallest_count() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        for capacity in [1, 2, 5, 20] {
            let mut summary = Summary::default();
            let mut reference: Vec<(Key, u64)> = Vec::new();
            for _ in 0..3_000 {
                // A few loud keys and many quiet ones.
                let r = next();
                let key = if r % 3 == 0 {
                    Key::new(format!("loud-{}", r % 4))
                } else {
                    Key::new(format!("quiet-{}", r % 500))
                };
                summary.add(&key, capacity);
                match reference.iter().position(|(k, _)| *k == key) {
                    Some(at) => reference[at].1 += 1,
                    None if reference.len() < capacity => reference.push((key, 1)),
                    None => {
                        let min = reference.iter().map(|(_, n)| *n).min().unwrap();
                        // Which smallest key goes may differ; the multiset of counts may not.
                        let at = reference.iter().position(|(_, n)| *n == min).unwrap();
                        reference[at] = (key, min + 1);
                    }
                }
                let mut ours: Vec<u64> = summary.counts.values().copied().collect();
                let mut theirs: Vec<u64> = reference.iter().map(|(_, n)| *n).collect();
                ours.sort_unstable();
                theirs.sort_unstable();
                assert_eq!(ours, theirs, "capacity {capacity}");
                assert!(summary.counts.len() <= capacity);
            }
        }
    }

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
        // Raw, a client's text never reads as an address's key.
        let raw = HeavyHitters::new(10, Duration::from_secs(60), true);
        let address = Key::from_ip("203.0.113.7".parse().unwrap(), 64);
        for lookalike in [
            address.to_string(),
            format!("\u{200B}{address}"),
            format!(" {address}"),
            address.to_string().replacen('K', "\u{41A}", 1),
            format!("\0{address}"),
            format!("\u{1b}[2K{address}"),
            address.to_string().to_lowercase(),
        ] {
            let raw = HeavyHitters::new(10, Duration::from_secs(60), true);
            raw.denied(&Key::new(&lookalike), S);
            let shown = &raw.top(1, S)[0].key;
            assert!(shown.starts_with("Key(#"), "{lookalike:?} shown as {shown}");
        }
        // Plain text stays readable.
        raw.denied(&Key::new("tenant-42"), S);
        assert_eq!(raw.top(1, S)[0].key, "tenant-42");
    }
}
