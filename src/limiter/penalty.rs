//! The penalty box: a key that keeps hammering a limit is blocked, each repeat longer.
//!
//! Denials are counted in this process (no store call per denial: the denial cache keeps
//! floods off Redis, and counting them must not bring them back); the block itself is a
//! fleet-wide listing ([`Limiter::block`](crate::Limiter::block)). So a client is blocked once
//! any one instance has refused it `denials` times within `within` (the sliding window counter's
//! estimate of the trailing `within`: a client timing two bursts to the windows' ends gets up
//! to `2 × (denials − 1)` refusals within `within` without a block, never more).

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::algorithm::micros;
use crate::error::ConfigError;
use crate::Key;

/// Blocks for keys that keep coming back while refused: denied `denials` times within `within`
/// (by one instance), a key is blocked under every rule for `block`; each new block within
/// `forgive_after` of the last one's end is twice as long, up to `max_block`. Set with
/// [`LimiterBuilder::penalty`](crate::LimiterBuilder::penalty).
///
/// ```
/// use std::time::Duration;
/// use fleetlimit::Penalty;
///
/// // 20 refusals within a minute: blocked 1 minute, then 2, 4, ... at most an hour.
/// let penalty = Penalty::new(20, Duration::from_secs(60), Duration::from_secs(60))
///     .max_block(Duration::from_secs(3600));
/// # let _ = penalty;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Penalty {
    denials: u32,
    within: Duration,
    block: Duration,
    max_block: Duration,
    forgive_after: Duration,
}

impl Penalty {
    /// Block for `block` a key denied `denials` times within `within`; repeats double, up to
    /// 64 × `block` by default, forgiven after a day without a block.
    pub fn new(denials: u32, within: Duration, block: Duration) -> Penalty {
        Penalty {
            denials,
            within,
            block,
            max_block: block.saturating_mul(64),
            forgive_after: Duration::from_secs(86_400),
        }
    }

    /// The longest block (default 64 × the first).
    pub fn max_block(mut self, max_block: Duration) -> Penalty {
        self.max_block = max_block;
        self
    }

    /// How long after a block ends a new one starts again from the first length (default a
    /// day).
    pub fn forgive_after(mut self, forgive_after: Duration) -> Penalty {
        self.forgive_after = forgive_after;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.denials == 0
            || self.within.is_zero()
            || self.block.is_zero()
            || self.max_block < self.block
        {
            return Err(ConfigError::Invalid {
                setting: "penalty",
                reason: "needs at least one denial, a non-zero period and block, and a max_block no shorter than the block".into(),
            });
        }
        Ok(())
    }
}

/// A key's record. Denials are counted in windows of `within` that follow one another, and the
/// window before weighs on the count as the part of it still inside the trailing `within`
/// (the sliding window counter's estimate): counted alone, a window let a client refused 19
/// times just before its end and 19 times just after it go unblocked, with a limit of 20.
#[derive(Debug, Clone, Copy)]
struct Record {
    window_start: u64,
    denials: u32,
    /// Denials in the window before.
    previous: u32,
    /// Blocks so far in the current run (0 before the first).
    blocks: u32,
    /// When the last block was earned.
    blocked_at: u64,
    blocked_until: u64,
    /// The end of the block before the last one earned: put back if that one is not set, so
    /// a repeat offender's run (and its doubling) goes on.
    blocked_before: u64,
}

impl Record {
    /// The refusals counted against the key at `now`, times `within` (so unrounded): the
    /// current window's, and the window before's in the part of it still within `within` of
    /// now. Windows that have passed by `now` are rolled on as a refusal would roll them.
    fn weight(&self, now: u64, within: u64) -> u128 {
        let elapsed = now.saturating_sub(self.window_start);
        let (current, previous, start) = if elapsed < within {
            (self.denials, self.previous, self.window_start)
        } else if elapsed < within.saturating_mul(2) {
            (0, self.denials, self.window_start + within)
        } else {
            (0, 0, now)
        };
        let left = within - now.saturating_sub(start).min(within);
        u128::from(current) * u128::from(within) + u128::from(previous) * u128::from(left)
    }
}

/// The keys with recent denials, bounded.
pub(crate) struct Penalties {
    config: Penalty,
    /// How long after a block is earned a refusal by quota may still be one decided before the
    /// block was written (twice the limiter's deadline: the write's, then the decision's).
    straggling: u64,
    records: Mutex<HashMap<Key, Record>>,
    capacity: usize,
}

impl Penalties {
    /// `deadline`: the limiter's, which bounds both a block's write and a decision.
    pub(crate) fn new(config: Penalty, capacity: usize, deadline: Duration) -> Penalties {
        Penalties {
            config,
            straggling: micros(deadline).saturating_mul(2),
            records: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    /// Forget the records that can no longer lead to a block or a longer one: a key never
    /// blocked once its window has passed, a blocked one once it is forgiven. If that frees
    /// nothing (a spray of keys, each refused once), forget the eighth furthest from a block:
    /// never blocked before the others, then the fewest denials as the box counts them (the
    /// window before weighing in), then the windows that started first. A full box must go on
    /// counting new keys, or a spray would switch it off for a day; and the spray's keys go
    /// before a key refused again and again (forgetting the oldest windows first forgot
    /// exactly that key, the one nearest its block; ranking by the current window alone forgot
    /// it just after its window rolled on).
    fn make_room(&self, records: &mut HashMap<Key, Record>, now: u64) {
        let c = &self.config;
        let (within, forgive) = (micros(c.within), micros(c.forgive_after));
        records.retain(|_, r| {
            r.blocked_until > now
                || if r.blocks == 0 {
                    // A window's count weighs on the next one too.
                    now.saturating_sub(r.window_start) < within.saturating_mul(2)
                } else {
                    now.saturating_sub(r.blocked_until) < forgive
                }
        });
        if records.len() < self.capacity {
            return;
        }
        let standing = |r: &Record| {
            (
                r.blocks > 0 || r.blocked_until > now,
                r.weight(now, within),
                r.window_start,
            )
        };
        let mut ranks: Vec<_> = records.values().map(standing).collect();
        let eighth = (records.len() / 8).max(1);
        let (_, &mut cut, _) = ranks.select_nth_unstable(eighth - 1);
        let mut dropped = 0;
        records.retain(|_, r| {
            let drop = dropped < eighth && standing(r) <= cut;
            dropped += usize::from(drop);
            !drop
        });
    }

    /// The block [`denied`](Penalties::denied) imposed on `key` could not be set: forget it,
    /// so that the key's refusals count again and its next block is not doubled for it.
    pub(crate) fn not_blocked(&self, key: &Key) {
        if let Some(r) = self.records.lock().get_mut(key) {
            r.blocked_until = r.blocked_before;
            r.blocks = r.blocks.saturating_sub(1);
            r.window_start = 0;
        }
    }

    /// An operator set or lifted `key`'s entry: their word replaces what the box remembers (a
    /// block it set and lifted early by hand no longer keeps the key's refusals from counting
    /// until that block's end).
    pub(crate) fn forget(&self, key: &Key) {
        self.records.lock().remove(key);
    }

    /// Count a denial of `key` at `now`; the block to impose, if this one earns it.
    pub(crate) fn denied(&self, key: &Key, now: u64) -> Option<Duration> {
        let c = &self.config;
        let mut records = self.records.lock();
        if !records.contains_key(key) && records.len() >= self.capacity {
            self.make_room(&mut records, now);
        }
        let r = records.entry(key.clone()).or_insert(Record {
            window_start: now,
            denials: 0,
            previous: 0,
            blocks: 0,
            blocked_at: 0,
            blocked_until: 0,
            blocked_before: 0,
        });
        // Refusals by the block itself never come here (they are a listing's). A refusal by
        // quota while the record says blocked is one decided before the block was written, or,
        // once those have all been answered, the sign that the block is gone (evicted from a
        // full memory store, lost in a failover, lifted from another instance): the key is
        // counted again, and its next block is the next in its run.
        if now < r.blocked_until && now.saturating_sub(r.blocked_at) < self.straggling {
            return None;
        }
        let within = micros(c.within);
        if now < r.window_start {
            // Counted again before its block's end: a window from now.
            r.window_start = now;
        }
        let elapsed = now.saturating_sub(r.window_start);
        if elapsed >= within {
            // The next window, right after this one (which weighs on it), or, after a quiet
            // window, a new one from now.
            (r.previous, r.window_start) = if elapsed < within.saturating_mul(2) {
                (r.denials, r.window_start + within)
            } else {
                (0, now)
            };
            r.denials = 0;
        }
        r.denials = r.denials.saturating_add(1);
        if r.weight(now, within) < u128::from(c.denials) * u128::from(within) {
            return None;
        }
        if r.blocks > 0 && now.saturating_sub(r.blocked_until) >= micros(c.forgive_after) {
            r.blocks = 0;
        }
        let factor = 1u32.checked_shl(r.blocks.min(31)).unwrap_or(u32::MAX);
        let block = c.block.saturating_mul(factor).min(c.max_block);
        r.blocks = r.blocks.saturating_add(1);
        r.blocked_before = r.blocked_until;
        r.blocked_at = now;
        r.blocked_until = now.saturating_add(micros(block));
        r.denials = 0;
        r.previous = 0;
        r.window_start = r.blocked_until;
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    /// A box of 100 records that blocks for 60 s a key refused `denials` times within
    /// `within_secs` (the limiter's deadline 50 ms).
    fn boxed(denials: u32, within_secs: u64) -> Penalties {
        let penalty = Penalty::new(
            denials,
            Duration::from_secs(within_secs),
            Duration::from_secs(60),
        );
        Penalties::new(penalty, 100, Duration::from_millis(50))
    }

    /// 1,000 keys refused once each, one a microsecond from `from`: none blocked, and the box
    /// kept within its bound.
    fn spray(p: &Penalties, from: u64) {
        for i in 0..1000u64 {
            assert_eq!(p.denied(&Key::new(i.to_be_bytes()), from + i), None);
        }
        assert!(p.records.lock().len() <= 100);
    }

    #[test]
    fn blocks_double_up_to_the_max_and_are_forgiven() {
        let p = Penalties::new(
            Penalty::new(3, Duration::from_secs(10), Duration::from_secs(60))
                .max_block(Duration::from_secs(200))
                .forgive_after(Duration::from_secs(1000)),
            100,
            Duration::from_millis(50),
        );
        let k = Key::new("k");
        let mut now = 0;
        let mut blocks = Vec::new();
        for _ in 0..4 {
            assert_eq!(p.denied(&k, now), None);
            assert_eq!(p.denied(&k, now + S), None);
            let block = p.denied(&k, now + 2 * S).unwrap();
            // A refusal by quota decided before the block was written: no new count.
            assert_eq!(p.denied(&k, now + 2 * S + 1), None);
            blocks.push(block.as_secs());
            now += 2 * S + block.as_secs() * S;
        }
        assert_eq!(blocks, [60, 120, 200, 200]);
        // Denials spread wider than the period never add up.
        let slow = Key::new("slow");
        for i in 0..10 {
            assert_eq!(p.denied(&slow, i * 11 * S), None);
        }
        // After the forgiveness period, the first length again.
        now += 1000 * S;
        p.denied(&k, now);
        p.denied(&k, now);
        assert_eq!(p.denied(&k, now), Some(Duration::from_secs(60)));
    }

    /// At the defaults: each block within a day of the last twice as long, up to 64 times the
    /// first; a day after the last block ends, the first length again.
    #[test]
    fn blocks_at_the_defaults_double_to_64_times_and_are_forgiven_after_a_day() {
        let minute = Duration::from_secs(60);
        let p = Penalties::new(
            Penalty::new(20, minute, minute),
            100,
            crate::DEFAULT_DEADLINE,
        );
        let k = Key::new("k");
        let mut now = 1_000 * S;
        let mut blocks = Vec::new();
        for _ in 0..9 {
            for _ in 0..19 {
                assert_eq!(p.denied(&k, now), None);
            }
            let block = p.denied(&k, now).unwrap();
            blocks.push(block.as_secs() / 60);
            now += block.as_secs() * S;
        }
        assert_eq!(blocks, [1, 2, 4, 8, 16, 32, 64, 64, 64]);
        // A day less a second after the last block's end: still the longest.
        now += 86_399 * S;
        for _ in 0..19 {
            p.denied(&k, now);
        }
        assert_eq!(p.denied(&k, now), Some(minute * 64));
        now += 64 * 60 * S + 86_400 * S;
        for _ in 0..19 {
            p.denied(&k, now);
        }
        assert_eq!(p.denied(&k, now), Some(minute), "forgiven after a day");
    }

    /// Refusals on both sides of a window's end add up: 20 within a minute, 1 at the start and
    /// 18 just before the end of the first window, then 2 just after it, is a block (counted
    /// per window alone, 37 refusals in 1.5 s earned none). Bursts a whole window apart still
    /// earn nothing, and the documented worst case (19 and 19 just inside a minute, at the two
    /// ends of the windows' weighting) is as the docs say: never more than twice the denials.
    #[test]
    fn refusals_either_side_of_a_windows_end_add_up() {
        let p = boxed(20, 60);
        let k = Key::new("k");
        assert_eq!(p.denied(&k, 0), None);
        for _ in 0..18 {
            assert_eq!(p.denied(&k, 59_500_000), None);
        }
        assert_eq!(p.denied(&k, 60_500_000), None, "19 × 0.99 + 1 is under 20");
        assert_eq!(p.denied(&k, 60_600_000), Some(Duration::from_secs(60)));

        let spread = Key::new("spread");
        for burst in 0..4 {
            for _ in 0..19 {
                assert_eq!(p.denied(&spread, burst * 130 * S), None, "burst {burst}");
            }
        }
        // The worst case: a window (from the first refusal) ending with 19, and the next one's
        // end with 19 more, all within 59.9 s, which the fading weight of the first lets by.
        let edges = Key::new("edges");
        assert_eq!(p.denied(&edges, 0), None);
        for at in [59_900_000, 119_800_000] {
            for _ in 0..(if at < 60 * S { 18 } else { 19 }) {
                assert_eq!(p.denied(&edges, at), None, "the bound: 2 × 19 in 59.9 s");
            }
        }
    }

    /// A block the store could not set is forgotten without forgetting the run: a repeat
    /// offender's next block is the doubled one (forgetting put the end of its last block at 0,
    /// "long ago", and the run was forgiven: the first length again).
    #[test]
    fn a_block_not_set_keeps_the_offenders_run() {
        let p = boxed(1, 10);
        let k = Key::new("k");
        let t0 = 1_900_000_000 * S;
        assert_eq!(p.denied(&k, t0), Some(Duration::from_secs(60)));
        assert_eq!(p.denied(&k, t0 + 61 * S), Some(Duration::from_secs(120)));
        p.not_blocked(&k);
        assert_eq!(p.denied(&k, t0 + 62 * S), Some(Duration::from_secs(120)));
    }

    /// A spray of keys, each refused once, fills the box: it goes on counting new keys (within
    /// the spray's window and after it), and a blocked key keeps its escalation.
    #[test]
    fn a_spray_of_keys_never_switches_the_box_off() {
        let p = boxed(3, 10);
        let repeat = Key::new("repeat");
        for t in [0, 1, 2] {
            p.denied(&repeat, t);
        }
        spray(&p, 10);
        let offender = Key::new("offender");
        let now = 2000;
        assert_eq!(p.denied(&offender, now), None);
        assert_eq!(p.denied(&offender, now + 1), None);
        assert_eq!(
            p.denied(&offender, now + 2),
            Some(Duration::from_secs(60)),
            "counted while the spray is in its window"
        );
        let later = Key::new("later");
        let now = 11 * S;
        p.denied(&later, now);
        p.denied(&later, now);
        assert_eq!(p.denied(&later, now), Some(Duration::from_secs(60)));
        // The first blocked key, refused again after its block: twice as long.
        let after = 61 * S;
        for _ in 0..2 {
            assert_eq!(p.denied(&repeat, after), None);
        }
        assert_eq!(p.denied(&repeat, after), Some(Duration::from_secs(120)));
    }

    /// A key refused twice of three, then a spray of keys each refused once filling the box
    /// many times over: the spray's keys are forgotten first, so the third refusal still
    /// blocks (forgetting the oldest windows first forgot the offender at the first spill).
    #[test]
    fn a_spray_never_forgets_the_key_nearest_its_block() {
        let p = boxed(3, 60);
        let offender = Key::new("offender");
        assert_eq!(p.denied(&offender, 0), None);
        assert_eq!(p.denied(&offender, 1), None);
        spray(&p, 2);
        assert_eq!(p.denied(&offender, 2000), Some(Duration::from_secs(60)));
    }

    /// The same, with the offender's refusals on both sides of its window's end: rolled on,
    /// its record counted one refusal in the current window, as each of the spray's keys did,
    /// and went first as the oldest of them (ranked by the current window alone).
    #[test]
    fn a_spray_never_forgets_the_key_nearest_its_block_across_its_windows_end() {
        let p = boxed(3, 60);
        let offender = Key::new("offender");
        assert_eq!(p.denied(&offender, 0), None);
        assert_eq!(p.denied(&offender, 1), None);
        // 1 + 2 × (60 s − 1 µs) / 60 s, rounded down: 2 of 3.
        assert_eq!(p.denied(&offender, 60 * S + 1), None);
        spray(&p, 60 * S + 2);
        assert_eq!(
            p.denied(&offender, 60 * S + 2000),
            Some(Duration::from_secs(60))
        );
    }

    /// A key refused by quota while its record says blocked: at first a refusal decided before
    /// the block was written (not counted), later the sign that the block is gone (evicted,
    /// lost, lifted elsewhere). Then the key is counted again, in a window of its own, and
    /// earns the next block of its run (before, nothing counted until the old block's end).
    #[test]
    fn a_key_refused_by_quota_during_its_block_is_counted_again() {
        let p = boxed(3, 10);
        let k = Key::new("k");
        let t0 = 1_000 * S;
        p.denied(&k, t0);
        p.denied(&k, t0);
        assert_eq!(p.denied(&k, t0), Some(Duration::from_secs(60)));
        // Stragglers: within twice the deadline.
        for _ in 0..5 {
            assert_eq!(p.denied(&k, t0 + 99_000), None);
        }
        // The block is gone 5 s in: three refusals within 10 s are the next block.
        let later = t0 + 5 * S;
        assert_eq!(p.denied(&k, later), None);
        assert_eq!(p.denied(&k, later + S), None);
        assert_eq!(p.denied(&k, later + 2 * S), Some(Duration::from_secs(120)));
        // Refusals spread wider than `within` during a block never add up.
        let spread = Key::new("spread");
        p.denied(&spread, t0);
        p.denied(&spread, t0);
        assert_eq!(p.denied(&spread, t0), Some(Duration::from_secs(60)));
        for i in 1..=5 {
            assert_eq!(p.denied(&spread, t0 + i * 11 * S), None, "{i}");
        }
    }

    #[test]
    fn invalid_penalties_are_rejected() {
        let s = Duration::from_secs(1);
        assert!(Penalty::new(0, s, s).validate().is_err());
        assert!(Penalty::new(1, Duration::ZERO, s).validate().is_err());
        assert!(Penalty::new(1, s, Duration::ZERO).validate().is_err());
        assert!(Penalty::new(1, s, s * 2).max_block(s).validate().is_err());
        assert!(Penalty::new(1, s, s).validate().is_ok());
    }
}
