//! Waiting for a quota instead of being refused ([`Limiter::until_ready`]): one line per key in
//! this process, served first come, first served. Nobody polls the store: the waiter at the head
//! of the line asks once, sleeps until the time the store named, and asks again.
//!
//! [`Limiter::until_ready`]: super::Limiter::until_ready

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use crate::{Decision, Key};

/// `d` from now, or a century from now for a longer `d` (a caller's `Duration::MAX` must not
/// overflow the clock).
pub(crate) fn after(d: Duration) -> tokio::time::Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);
    tokio::time::Instant::now() + d.min(CENTURY)
}

/// When a caller refused with `decision` wakes to ask again, if it does before `give_up`. Only
/// a time the store named is waited for: the outage policy's refusals and costs that never fit
/// name none, and waiting would not change them.
pub(crate) fn wake(
    decision: &Decision,
    give_up: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    match decision.retry_after {
        Some(retry) if !decision.allowed && !decision.degraded => {
            Some(after(retry)).filter(|wake| *wake <= give_up)
        }
        _ => None,
    }
}

/// The lines of waiters, per key, each with how many places it has. A key's line lives while
/// someone is in it.
#[derive(Default)]
pub(crate) struct Lines {
    lines: Mutex<HashMap<Key, (Arc<Line>, usize)>>,
}

/// One key's line.
struct Line {
    /// Whose turn it is: tokio's mutex is fair, so turns come in order of asking.
    turn: tokio::sync::Mutex<()>,
    /// Until when the caller whose turn it is sleeps, if it does: nobody behind it is served
    /// before then.
    head_wakes: tokio::sync::watch::Sender<Option<tokio::time::Instant>>,
}

impl Default for Line {
    fn default() -> Line {
        Line {
            turn: tokio::sync::Mutex::new(()),
            // `watch::Sender::default` needs tokio 1.39; this crate asks for any 1.x.
            head_wakes: tokio::sync::watch::channel(None).0,
        }
    }
}

/// A place in a key's line; leaving it (dropping it, or the future holding it) lets the next one
/// on, and the last one out takes the line away.
pub(crate) struct Place<'a> {
    lines: &'a Lines,
    key: Key,
    line: Arc<Line>,
}

/// The turn of a place in its line, held until dropped.
pub(crate) struct Turn<'a> {
    line: &'a Line,
    _turn: tokio::sync::MutexGuard<'a, ()>,
}

impl Lines {
    /// Join `key`'s line, at its end.
    pub(crate) fn join(&self, key: &Key) -> Place<'_> {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let (line, places) = lines.entry(key.clone()).or_default();
        *places += 1;
        let line = line.clone();
        Place {
            lines: self,
            key: key.clone(),
            line,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Place<'_> {
    /// Wait for this place's turn, unless it cannot come by `give_up`: then `Err` with the
    /// earliest it could come, if known. It is known when the caller whose turn it is sleeps
    /// past `give_up` (then this gives up at once, without waiting in vain), and otherwise
    /// not (then this waits until `give_up`).
    pub(crate) async fn turn_by(
        &self,
        give_up: tokio::time::Instant,
    ) -> Result<Turn<'_>, Option<tokio::time::Instant>> {
        let mut head_wakes = self.line.head_wakes.subscribe();
        let mut turn = std::pin::pin!(self.line.turn.lock());
        // Ends when the head sleeps past `give_up` (every change is read: it may sleep again,
        // longer), or at `give_up`.
        let mut hopeless = std::pin::pin!(async {
            let too_late = async {
                loop {
                    let head_wake = *head_wakes.borrow_and_update();
                    if head_wake.is_some_and(|wake| wake > give_up) {
                        return head_wake;
                    }
                    if head_wakes.changed().await.is_err() {
                        // The line (and its sender) lives as long as this place.
                        std::future::pending::<()>().await;
                    }
                }
            };
            match tokio::time::timeout_at(give_up, too_late).await {
                Ok(head_wake) => head_wake,
                Err(_) => *self.line.head_wakes.borrow(),
            }
        });
        std::future::poll_fn(|cx| {
            if let Poll::Ready(guard) = turn.as_mut().poll(cx) {
                return Poll::Ready(Ok(Turn {
                    line: &self.line,
                    _turn: guard,
                }));
            }
            hopeless.as_mut().poll(cx).map(Err)
        })
        .await
    }
}

impl Turn<'_> {
    /// Sleep until `wake`, telling those behind that they are not served before.
    pub(crate) async fn sleep_until(&self, wake: tokio::time::Instant) {
        self.line.head_wakes.send_replace(Some(wake));
        tokio::time::sleep_until(wake).await;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.line.head_wakes.send_replace(None);
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut lines = self.lines.lines.lock().unwrap_or_else(|e| e.into_inner());
        // Counted, not read from the `Arc`'s count: this place's own reference goes only after
        // this function, outside the lock, and two places leaving at once could each see the
        // other's and both leave the line behind.
        if let Some((_, places)) = lines.get_mut(&self.key) {
            *places -= 1;
            if *places == 0 {
                lines.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turn with no time limit.
    async fn turn<'a>(place: &'a Place<'_>) -> Turn<'a> {
        match place.turn_by(after(Duration::MAX)).await {
            Ok(turn) => turn,
            Err(_) => panic!("a turn without a time limit comes"),
        }
    }

    #[tokio::test]
    async fn one_line_per_key_served_in_order_gone_when_empty() {
        // 'static, for the spawned waiters.
        let lines: &'static Lines = Box::leak(Box::default());
        let key = Key::new("partner");
        let head = lines.join(&key);
        let head_turn = turn(&head).await;
        // Another key's line is free while this one is held.
        let other = lines.join(&Key::new("other"));
        drop(turn(&other).await);
        drop(other);
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for n in 0..3 {
            let (place, served) = (lines.join(&key), served.clone());
            waiters.push(tokio::spawn(async move {
                let _turn = turn(&place).await;
                served.lock().unwrap().push(n);
            }));
            tokio::task::yield_now().await;
        }
        assert!(
            served.lock().unwrap().is_empty(),
            "all wait behind the head"
        );
        drop(head_turn);
        drop(head);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*served.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(lines.len(), 0);
    }

    /// Two places leaving one line at once, on two threads: the first's own reference to the
    /// line goes only after its `drop`, outside the lock, so the second can find it still
    /// there. The line must go with the last of them all the same. (The moment is too short
    /// to hit reliably from two threads; the reference held here stands in for it.)
    #[test]
    fn places_leaving_together_take_their_line_away() {
        let lines = Lines::default();
        let key = Key::new("partner");
        let (first, second) = (lines.join(&key), lines.join(&key));
        let first_reference = first.line.clone();
        drop(first);
        drop(second);
        drop(first_reference);
        assert_eq!(lines.len(), 0, "a line left with nobody in it");
    }
}
