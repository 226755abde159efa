//! Sliding window counter: the period split into `n` sub-windows, one counter each, plus the
//! sub-window sliding out, weighted by how much of it the sliding window still covers.
//!
//! With sub-windows of `B` ms and elapsed `e` (whole ms into the current sub-window), the
//! estimate of what the trailing period holds is `oldest × (B − e) / B + newer`, where `newer`
//! is the sum of the `n` newest sub-windows (the current one included) and `oldest` the one
//! sliding out. A request of cost `c` is admitted when `estimate + c ≤ limit`. All of it is
//! computed in integers, multiplied through by `B`. With `n = 1` this is the classic two-counter
//! version (this window and the previous one).
//!
//! Promise: the estimate never exceeds the limit. It assumes the sliding-out sub-window's permits
//! were spread evenly across it, so against the exact log it errs by at most that one
//! sub-window's count: it can admit more than the limit in a trailing period only by permits
//! taken in the sub-window sliding out (at most `limit`, and at most `limit / n` from a client
//! spread at the limit's rate), and refuse a request the exact rule admits only while such a
//! sub-window is sliding out. The README reports the measured error on a realistic trace
//! (`cargo run --release --example trace`).
//!
//! Refunds: a receipt says when its permits were counted; they are taken off that sub-window's
//! count while it is still counted (the estimate is then what it would be had the request never
//! come), and nothing is given back after that, nor to a state converted from another quota or
//! created afresh since (its `valid_from`).
//!
//! Quota changes: a new limit reads the counts as they are, so the estimate never passes the
//! larger limit while two limits write one key. A new period or sub-window count moves every
//! permit still counted into the current sub-window of the new alignment: conservative (it may
//! refuse a little longer than either quota would), never more permissive. A shorter period
//! would let those permits go before the longer one does: they are also held (with every permit
//! taken since) until the longer alignment lets its last one go, and a conversion back counts
//! them, as the fixed window holds a longer window's count. Without it, a key alternating
//! between an hourly plan and a per-minute one took the hour's limit again every minute.

use super::fixed_window::MAX_HELD;
use super::{never, receipt, us};
use crate::{Algorithm, Decision, Quota, Taken, WindowEstimate};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    /// Start of the current sub-window (µs).
    pub(crate) start: u64,
    /// Permits taken per sub-window, oldest first: the one sliding out, then the `n` the period
    /// spans, the last being the current one; then the held count and until when it is held
    /// (see [`held`](SlidingWindow::held)), in the same allocation, so that the state (and
    /// every entry of the memory store, whatever its algorithm) stays as small as it was.
    /// Empty for a fresh state.
    cells: Box<[u64]>,
    /// The sum of `counts[1..]` (all but the sub-window sliding out), kept as they change so a
    /// decision does not add them up.
    pub(crate) newer: u64,
    /// The period (µs) the sub-windows were aligned to; 0 for a fresh state.
    pub(crate) period: u64,
    /// Receipts from before this time (µs) refund nothing: the state was created or converted
    /// then. 0 until the first permit is taken.
    pub(crate) valid_from: u64,
}

/// The cells after the counts: the held count, and until when.
const HELD_CELLS: usize = 2;

impl SlidingWindow {
    /// Permits taken per sub-window, oldest first (empty for a fresh state).
    pub(crate) fn counts(&self) -> &[u64] {
        let len = self.cells.len().saturating_sub(HELD_CELLS);
        &self.cells[..len]
    }

    fn counts_mut(&mut self) -> &mut [u64] {
        let len = self.cells.len().saturating_sub(HELD_CELLS);
        &mut self.cells[..len]
    }

    /// The permits a longer alignment than this one still counts (those it counted when the
    /// state was converted to a shorter period, and every permit taken since), and when that
    /// alignment lets its last one go (µs); `(0, 0)` when none.
    fn held(&self) -> (u64, u64) {
        match *self.cells {
            [.., held, until] if self.cells.len() > HELD_CELLS => (held, until),
            _ => (0, 0),
        }
    }

    fn set_held(&mut self, held: u64, until: u64) {
        if self.cells.len() > HELD_CELLS {
            let len = self.cells.len();
            self.cells[len - 2] = held;
            self.cells[len - 1] = until;
        }
    }

    /// The width of one sub-window (µs); 0 for a fresh state.
    fn width(&self) -> u64 {
        match self.counts().len() {
            0 | 1 => 0,
            len => self.period / (len as u64 - 1),
        }
    }

    /// [`width`](SlidingWindow::width), read from `quota` when the state was written under it
    /// (no division).
    fn width_under(&self, quota: &Quota) -> u64 {
        if self.period == quota.period_us() && self.counts().len() as u64 == quota.sub_windows() + 1
        {
            quota.sub_window().get()
        } else {
            self.width()
        }
    }

    /// Permits still counted at `now` (by the quota the state was written under).
    fn still_counted(&self, now: u64) -> u64 {
        let (width, len) = (self.width(), self.counts().len() as u64);
        self.counts()
            .iter()
            .enumerate()
            .filter(|&(i, _)| {
                // Sub-window i starts (len − 1 − i) widths before the current one and is counted
                // until a period and a width after its start.
                let from = self.start.saturating_sub((len - 1 - i as u64) * width);
                now < from + self.period + width
            })
            .map(|(_, c)| c)
            .sum()
    }

    /// Bring the state to `now` under `quota`: converted if it was written under another
    /// alignment, rolled forward to the sub-window holding `now`.
    fn roll(&mut self, now: u64, quota: &Quota) {
        let period = quota.period_us();
        let n = quota.sub_windows();
        let width = quota.sub_window();
        let window = now - now % width;
        if self.period != period || self.counts().len() as u64 != n + 1 {
            // A hold that has ended counts nothing (between conversions it is only read where
            // its end is checked: counting permits into it, and the state's expiry).
            let (mut held, mut held_until) = self.held();
            if held_until <= now {
                (held, held_until) = (0, 0);
            }
            let still = self.still_counted(now);
            // The new alignment counts what the old one still counts and what a held count
            // holds (over-counting, never under), in its current sub-window, which it lets go
            // a period and a width on.
            let count = still.max(held);
            let released = window + period + width.get();
            if held_until <= released {
                (held, held_until) = (0, 0);
            }
            // When the old alignment lets its last permit go: from its newest non-empty
            // sub-window, which a roll that only moves `start` on (a refusal in the memory
            // store, never saved by the script) leaves where it is.
            let old_released = self.empty_from(now, self.width());
            if still > 0 && old_released > released {
                held = held.max(still);
                held_until = held_until.max(old_released);
            }
            let mut cells = vec![0; n as usize + 1 + HELD_CELLS];
            cells[n as usize] = count;
            *self = SlidingWindow {
                start: window,
                cells: cells.into_boxed_slice(),
                newer: count,
                period,
                valid_from: if self.period != 0 {
                    now
                } else {
                    self.valid_from
                },
            };
            self.set_held(held, held_until);
        }
        // A clock that stepped back stays in the newer sub-window.
        if window > self.start {
            let steps = (window - self.start) / width;
            let counts = self.counts_mut();
            let len = counts.len();
            if steps >= len as u64 {
                counts.fill(0);
            } else {
                let steps = steps as usize;
                counts.rotate_left(steps);
                counts[len - steps..].fill(0);
            }
            self.newer = self.counts().iter().skip(1).sum();
            self.start = window;
        }
    }

    /// `estimate × B`, with `B` the sub-window's width in ms: the sliding-out sub-window by
    /// what it still covers, or whole when the estimate is bounded.
    fn weighted(&self, now: u64, quota: &Quota, w_ms: u64) -> u64 {
        let elapsed_ms = match quota.estimate() {
            WindowEstimate::Bounded => 0,
            _ => (now.saturating_sub(self.start) / 1000).min(w_ms),
        };
        debug_assert_eq!(self.newer, self.counts().iter().skip(1).sum::<u64>());
        // Exact while the counts are within the limit (the quota keeps limit × B below 2^50);
        // counts converted from a much larger quota can pass it, and then saturate: refused.
        self.counts()[0]
            .saturating_mul(w_ms - elapsed_ms)
            .saturating_add(self.newer.saturating_mul(w_ms))
    }

    #[inline(always)]
    pub(crate) fn decide(&mut self, now: u64, quota: &Quota, cost: u64) -> Decision {
        self.roll(now, quota);
        self.decide_rolled(now, quota, cost)
    }

    /// Whether [`roll`](SlidingWindow::roll) would leave the state as it is at `now`: written
    /// under `quota`, and already at the sub-window holding `now` (or past it).
    pub(crate) fn rolled(&self, now: u64, quota: &Quota) -> bool {
        let width = quota.sub_window();
        self.period == quota.period_us()
            && self.counts().len() as u64 == quota.sub_windows() + 1
            && now - now % width <= self.start
    }

    /// [`decide`](SlidingWindow::decide) for a state already [`rolled`](SlidingWindow::rolled)
    /// to `now`: it reads the state only.
    #[inline(always)]
    pub(crate) fn decide_rolled(&self, now: u64, quota: &Quota, cost: u64) -> Decision {
        let period = quota.period_us();
        let width = quota.sub_window().get();
        let w_ms = quota.sub_window_ms().get();
        let limit = quota.limit();
        let weighted = self.weighted(now, quota, w_ms);
        let capacity = limit * w_ms;
        let remaining = capacity.saturating_sub(weighted) / quota.sub_window_ms();
        let reset_after = || self.empty_from(now, width).saturating_sub(now);
        if cost > limit {
            return never(limit, remaining, reset_after());
        }
        if weighted.saturating_add(cost * w_ms) <= capacity {
            // Taking the permits makes the current sub-window non-empty: full again once it has
            // slid out, a period and a width from its start.
            let reset = (self.start + period + width).saturating_sub(now);
            return Decision::admit(limit, remaining - cost, us(reset));
        }
        let retry = self.retry_at(quota, cost).saturating_sub(now);
        Decision::deny(limit, remaining, us(reset_after()), Some(us(retry)))
    }

    /// The earliest time a request of `cost` is admitted if nothing else arrives.
    fn retry_at(&self, quota: &Quota, cost: u64) -> u64 {
        let width = quota.sub_window().get();
        let w_ms = quota.sub_window_ms().get();
        let limit = quota.limit();
        // `ahead` sub-windows from now, the counts have moved `ahead` places: the oldest is
        // counts[ahead], and its weight falls as that sub-window goes on:
        // oldest × (B − e) ≤ (limit − newer − cost) × B.
        let mut newer: u64 = self.counts().iter().sum();
        for (ahead, &oldest) in self.counts().iter().enumerate() {
            newer -= oldest;
            if newer + cost > limit {
                continue;
            }
            let room = (limit - newer - cost) * w_ms;
            let e = match (room.checked_div(oldest), quota.estimate()) {
                (None, _) => 0,
                // Whole until it has slid out: it fits from the start of this position or not.
                (Some(_), WindowEstimate::Bounded) if oldest.saturating_mul(w_ms) <= room => 0,
                (Some(_), WindowEstimate::Bounded) => w_ms,
                (Some(fits), _) => w_ms - fits.min(w_ms),
            };
            if e < w_ms {
                return self.start + ahead as u64 * width + e * 1000;
            }
        }
        // Once every counted sub-window has slid out.
        self.start + self.counts().len() as u64 * width
    }

    /// From when nothing is counted: the newest non-empty sub-window has slid out (`width`: the
    /// state's sub-window).
    fn empty_from(&self, now: u64, width: u64) -> u64 {
        let len = self.counts().len() as u64;
        match self.counts().iter().rposition(|&c| c > 0) {
            Some(i) => self.start - (len - 1 - i as u64) * width + self.period + width,
            None => now,
        }
    }

    #[inline(always)]
    pub(crate) fn commit(&mut self, now: u64, cost: u64) -> Taken {
        self.count_now(now, cost);
        self.taken(now, cost)
    }

    /// Count `n` more permits at `now`: in the current sub-window, and in a longer alignment
    /// that holds a count (up to [`MAX_HELD`]).
    fn count_now(&mut self, now: u64, n: u64) {
        let counts = self.counts_mut();
        let len = counts.len();
        if let Some(current) = counts.last_mut() {
            *current += n;
            if len > 1 {
                self.newer += n;
            }
        }
        let (held, until) = self.held();
        if until > now {
            self.set_held(held.saturating_add(n).min(MAX_HELD), until);
        }
    }

    /// Whether this state holds a longer alignment's count (evicted, that alignment would find
    /// the key fresh).
    pub(crate) fn holds(&self) -> bool {
        self.held().0 > 0
    }

    /// A receipt for `cost` permits counted at `now`, in the current sub-window.
    pub(crate) fn taken(&mut self, now: u64, cost: u64) -> Taken {
        let at = now.max(self.start);
        receipt(&mut self.valid_from, at, cost, Algorithm::SlidingWindow)
    }

    pub(crate) fn refund(&mut self, taken: Taken) {
        let width = self.width();
        if taken.at < self.valid_from || width == 0 {
            return;
        }
        let window = taken.at - taken.at % width;
        if window > self.start {
            return;
        }
        let back = ((self.start - window) / width) as usize;
        let counts = self.counts_mut();
        let len = counts.len();
        if back < len {
            let i = len - 1 - back;
            let before = counts[i];
            counts[i] = before.saturating_sub(taken.cost);
            let after = counts[i];
            if i > 0 {
                self.newer -= before - after;
            }
        }
    }

    /// Lease up to `max` permits at `now` (after a `decide`): counted in the current
    /// sub-window, so they must be spent within it (the estimate assumes its permits were).
    /// Returns the permits and until when they are valid.
    pub(crate) fn lease(&mut self, now: u64, quota: &Quota, max: u64) -> (u64, u64) {
        let width = quota.sub_window().get();
        let w_ms = quota.sub_window_ms();
        let room =
            (quota.limit() * w_ms.get()).saturating_sub(self.weighted(now, quota, w_ms.get()))
                / w_ms;
        let permits = max.min(room);
        self.count_now(now, permits);
        (permits, self.start + width)
    }

    pub(crate) fn expires_at(&self, quota: &Quota) -> u64 {
        debug_assert_eq!(self.newer, self.counts().iter().skip(1).sum::<u64>());
        let own = if self.newer > 0 || self.counts().first().is_some_and(|&c| c > 0) {
            self.empty_from(0, self.width_under(quota))
        } else {
            0
        };
        match self.held() {
            (0, _) => own,
            (_, until) => own.max(until),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use proptest::prelude::*;

    /// The classic two-counter version: one sub-window per period.
    fn quota(limit: u64, period_ms: u64) -> crate::Quota {
        split(limit, period_ms, 1)
    }

    fn bounded(limit: u64, period_ms: u64, n: u64) -> crate::Quota {
        crate::Quota::new(limit, ms(period_ms))
            .sub_windows(n)
            .estimate(crate::WindowEstimate::Bounded)
            .build()
            .expect("valid test quota")
    }

    fn split(limit: u64, period_ms: u64, n: u64) -> crate::Quota {
        crate::Quota::new(limit, ms(period_ms))
            .sub_windows(n)
            .build()
            .expect("valid test quota")
    }

    /// The estimate × B an admission at `t` of `cost` would make, recomputed from the admitted
    /// history: the sub-window sliding out weighted, the `n` newer ones whole.
    fn reference(q: &crate::Quota, admitted: &[(u64, u64)], t: u64, cost: u64) -> (u64, u64) {
        let p = q.period_us();
        let b = p / q.sub_windows();
        let w_ms = b / 1000;
        let s = t - t % b;
        let sum_in = |from: u64, to: u64| {
            admitted
                .iter()
                .filter(|(at, _)| *at >= from && *at < to && *at <= t)
                .map(|(_, c)| c)
                .sum::<u64>()
        };
        let oldest = if s >= p { sum_in(s - p, s - p + b) } else { 0 };
        let newer = sum_in((s + b).saturating_sub(p), s + b);
        let e = (t - s) / 1000;
        (
            oldest * (w_ms - e) + (newer + cost) * w_ms,
            q.limit() * w_ms,
        )
    }

    #[test]
    fn previous_window_weighs_in_proportion() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(10).allowed);
        s.advance_ms(1250); // 250 ms into the next window: previous weighs 0.75 → 7.5
        let d = s.consume(2);
        assert!(d.allowed, "7.5 + 2 ≤ 10");
        assert_eq!(d.remaining, 0, "floor(10 − 9.5)");
        let d = s.consume(1);
        assert!(!d.allowed, "7.5 + 2 + 1 > 10");
        // previous × (1000 − e) ≤ (10 − 2 − 1) × 1000 ⇒ e ≥ 300 ms, i.e. 50 ms from now.
        assert_eq!(d.retry_after, Some(ms(50)));
        assert_retry_is_exact(&s, 1);
    }

    #[test]
    fn retry_crosses_into_the_next_window() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0 + 100_000);
        assert!(s.consume(8).allowed);
        let d = s.consume(5);
        assert!(!d.allowed);
        // Next window: 8 × (1000 − e) ≤ 5 × 1000 ⇒ e ≥ 375 ms; from 100 ms in: 900 + 375.
        assert_eq!(d.retry_after, Some(ms(1275)));
        assert_retry_is_exact(&s, 5);
        // A full-limit cost has to wait until both windows are empty.
        let d = s.consume(10);
        assert_eq!(d.retry_after, Some(ms(1900)));
        assert_retry_is_exact(&s, 10);
        assert!(s.consume(11).never_admissible());
    }

    #[test]
    fn refunds_follow_their_window_and_stop_when_it_slides_out() {
        let q = quota(4, 1000);
        let mut s = Sim::new(&q, T0 + 900_000);
        s.consume(2);
        let late = s.last_taken();
        s.advance_ms(200); // 100 ms into the next window: `late` is now the previous window
        s.consume(1);
        s.refund(late);
        assert_eq!(s.peek().remaining, 3, "as if the first request never came");
        let mut s = Sim::new(&q, T0);
        s.consume(2);
        let gone = s.last_taken();
        s.advance_ms(2_000);
        s.consume(4);
        s.refund(gone);
        assert!(
            !s.consume(1).allowed,
            "a window that slid out gives nothing back"
        );
    }

    #[test]
    fn a_new_period_keeps_every_counted_permit() {
        let q = quota(10, 1000);
        let mut s = Sim::new(&q, T0 + 500_000);
        assert!(s.consume(6).allowed);
        let longer = quota(10, 10_000);
        let mut l = s.with_quota(&longer);
        assert_eq!(l.peek().remaining, 4);
        let smaller = quota(5, 1000);
        assert!(!s.with_quota(&smaller).consume(1).allowed);
    }

    #[test]
    fn skipping_a_window_forgets_everything() {
        let q = quota(3, 100);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(3).allowed);
        s.advance_ms(200);
        assert_eq!(s.peek().remaining, 3);
    }

    #[test]
    fn sub_windows_slide_out_one_by_one() {
        // 10 per second in 4 sub-windows of 250 ms.
        let q = split(10, 1000, 4);
        let mut s = Sim::new(&q, T0);
        assert!(s.consume(4).allowed); // sub-window 0
        s.advance_ms(500);
        assert!(s.consume(6).allowed); // sub-window 2: 10 counted
        assert!(!s.consume(1).allowed);
        // At 1000 ms sub-window 0 starts sliding out: 100 ms into it, it weighs 4 × 150/250.
        s.advance_ms(600);
        let d = s.consume(1);
        assert!(d.allowed, "2.4 + 6 + 1 = 9.4 ≤ 10");
        assert_eq!(d.remaining, 0);
        let d = s.consume(1);
        assert!(!d.allowed, "2.4 + 7 + 1 > 10");
        // 4 × (250 − e) ≤ (10 − 7 − 1) × 250 ⇒ e ≥ 125 ms, 25 ms from now.
        assert_eq!(d.retry_after, Some(ms(25)));
        assert_retry_is_exact(&s, 1);
        // Once sub-window 0 has slid out, only the 7 newer permits count.
        s.advance_ms(150);
        assert_eq!(s.peek().remaining, 3);
    }

    #[test]
    fn more_sub_windows_follow_the_exact_count_closer() {
        // A burst of the whole limit at the very end of a period: the two-counter version takes
        // it as spread over the whole period and soon admits again; 10 sub-windows know it came
        // in the last tenth.
        let admitted_after = |n: u64| {
            let q = split(10, 1000, n);
            let mut s = Sim::new(&q, T0 + 950_000);
            assert!(s.consume(10).allowed);
            s.advance_ms(500); // 550 ms into the next period: the burst is 450 ms old
            (0..10).filter(|_| s.consume(1).allowed).count()
        };
        assert_eq!(
            admitted_after(1),
            4,
            "10 × 450/1000 still counted: 4 more (14 in 1 s)"
        );
        assert_eq!(
            admitted_after(10),
            0,
            "exact: the burst is within the trailing second"
        );
    }

    #[test]
    fn a_new_sub_window_count_keeps_every_counted_permit() {
        let q = split(10, 1000, 10);
        let mut s = Sim::new(&q, T0 + 500_000);
        assert!(s.consume(6).allowed);
        s.advance_ms(1);
        let (q2, q50) = (quota(10, 1000), split(10, 1000, 50));
        let mut two = s.with_quota(&q2);
        assert_eq!(two.peek().remaining, 4);
        let mut fifty = s.with_quota(&q50);
        assert_eq!(fifty.peek().remaining, 4);
        // A receipt from before the conversion refunds nothing.
        let taken = s.last_taken();
        two.refund(taken);
        assert_eq!(two.peek().remaining, 4);
    }

    proptest! {
        #[test]
        fn never_admits_beyond_its_own_estimate(
            limit in 1u64..20,
            period_ms in 1u64..50,
            n in 1u64..8,
            arrivals in arrivals_strategy(200, 30),
        ) {
            // Replay the admitted requests and recompute the weighted estimate from scratch at
            // each admission: it must never exceed the limit.
            let q = split(limit, period_ms, n);
            let admitted = run(&q, &arrivals);
            for (i, &(t, _)) in admitted.iter().enumerate() {
                let (weighted, capacity) = reference(&q, &admitted[..=i], t, 0);
                prop_assert!(weighted <= capacity);
            }
        }

        #[test]
        fn admits_exactly_what_its_estimate_allows(
            limit in 1u64..20,
            period_ms in 1u64..50,
            n in 1u64..8,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = split(limit, period_ms, n);
            run_against_reference(&q, &arrivals, |admitted, t, cost| {
                let (weighted, capacity) = reference(&q, admitted, t, cost);
                weighted <= capacity
            })?;
        }

        /// The stated bound: in any trailing period, at most the limit plus what the sub-window
        /// sliding out held.
        #[test]
        fn errs_by_at_most_the_sub_window_sliding_out(
            limit in 1u64..20,
            period_ms in 1u64..50,
            n in 1u64..8,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = split(limit, period_ms, n);
            let p = q.period_us();
            let b = p / q.sub_windows();
            let admitted = run(&q, &arrivals);
            for &(t, _) in &admitted {
                let in_period: u64 = admitted
                    .iter()
                    .filter(|(at, _)| *at + p > t && *at <= t)
                    .map(|(_, c)| c)
                    .sum();
                let s = t - t % b;
                let sliding_out: u64 = admitted
                    .iter()
                    .filter(|(at, _)| s >= p && *at >= s - p && *at < s - p + b)
                    .map(|(_, c)| c)
                    .sum();
                prop_assert!(in_period <= limit + sliding_out, "{} > {} + {}", in_period, limit, sliding_out);
            }
        }

        #[test]
        fn retry_after_is_exact(limit in 1u64..20, period_ms in 1u64..50, n in 1u64..8, arrivals in arrivals_strategy(60, 30)) {
            check_retry_exact_over(&split(limit, period_ms, n), &arrivals)?;
            check_retry_exact_over(&bounded(limit, period_ms, n), &arrivals)?;
        }

        /// The bounded estimate's promise: never more than the limit in any trailing period.
        #[test]
        fn bounded_never_passes_the_limit_in_any_trailing_period(
            limit in 1u64..20,
            period_ms in 1u64..50,
            n in 1u64..8,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = bounded(limit, period_ms, n);
            let admitted = run(&q, &arrivals);
            prop_assert!(max_in_any_window(&admitted, q.period_us()) <= limit);
        }

        /// And it refuses only what it must: a request is admitted whenever everything admitted
        /// from the start of the sliding-out sub-window on, plus it, fits.
        #[test]
        fn bounded_admits_exactly_what_its_estimate_allows(
            limit in 1u64..20,
            period_ms in 1u64..50,
            n in 1u64..8,
            arrivals in arrivals_strategy(200, 30),
        ) {
            let q = bounded(limit, period_ms, n);
            let p = q.period_us();
            let b = p / q.sub_windows();
            run_against_reference(&q, &arrivals, |admitted, t, cost| {
                let from = (t - t % b).saturating_sub(p);
                let counted: u64 = admitted
                    .iter()
                    .filter(|(at, _)| *at >= from && *at <= t)
                    .map(|(_, c)| c)
                    .sum();
                counted + cost <= q.limit()
            })?;
        }
    }
}
