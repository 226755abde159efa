//! The answer to "may this request go ahead?".

use std::time::Duration;

/// Where a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// The store (memory or Redis) decided.
    Store,
    /// Permits leased from the store earlier were spent in process memory.
    Lease,
    /// This process remembered what the store said earlier: a refusal until a time still
    /// ahead, or (while the store is unavailable) the key's listing, which may admit.
    Cache,
    /// The store was unavailable and the local fallback limiter decided.
    Fallback,
    /// The store was unavailable and the outage policy admitted or refused without counting
    /// (fail open or fail closed): the numbers in the decision describe nothing.
    Policy,
}

/// Where an admitted request's permits were taken: the window they were counted in, the log
/// entries they added, or when a bucket was debited. A refund goes through it, so it can only
/// undo what is still outstanding there and never create a permit (see
/// [`Limiter::refund`](crate::Limiter::refund)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Taken {
    /// When they were taken (µs, the store's clock): the log entries' timestamp, the moment a
    /// window counted them or a bucket was debited.
    pub(crate) at: u64,
    /// Permits taken.
    pub(crate) cost: u64,
    /// The algorithm that took them: a receipt never refunds another algorithm's state.
    pub(crate) algorithm: crate::Algorithm,
}

impl Taken {
    /// How many permits were taken.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// Whether this receipt can refund state counted by `algorithm`.
    pub(crate) fn fits(&self, algorithm: crate::Algorithm) -> bool {
        self.algorithm == algorithm
    }

    /// The same place, for `cost` of its permits at most (the unspent part of a leased block,
    /// say): never more than was taken.
    pub fn part(self, cost: u64) -> Taken {
        Taken {
            cost: cost.min(self.cost),
            ..self
        }
    }
}

/// One rule's verdict on one request, with everything the rate-limit headers need.
///
/// Every field comes from the same atomic step of the store, so headers never mix two reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may go ahead.
    pub allowed: bool,
    /// The most permits available at once (the quota's limit, or the bucket's burst).
    pub limit: u64,
    /// Permits of cost 1 still available right now, after this request.
    pub remaining: u64,
    /// How long until the quota is back to full (`remaining == limit`) if nothing else arrives.
    pub reset_after: Duration,
    /// For a denial: exactly how long until a request of the same cost is admitted, if nothing
    /// else consumes meanwhile. `None` when allowed, and when the cost exceeds what the quota
    /// can ever admit (see [`Decision::never_admissible`]).
    pub retry_after: Option<Duration>,
    /// Where the decision was made.
    pub source: Source,
    /// True when the decision was made without the store (the outage policy decided).
    pub degraded: bool,
    /// For an admission that took permits from the shared budget: where. `None` for denials,
    /// peeks, and admissions that counted nothing (fail open).
    pub(crate) taken: Option<Taken>,
    /// The key's listing (an administrator's allow, deny or block entry) made this decision,
    /// not its quota: which one. This process remembers it for an outage (see
    /// `limiter::listings`).
    pub(crate) listed: ByListing,
}

/// Which administrator's entry made a decision, if one did. Four bytes, so that a [`Decision`]
/// stays as small as it was: a block's time left is kept in whole seconds, rounded up.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct ByListing(u32);

impl std::fmt::Debug for ByListing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (*self, self.block_left()) {
            (_, Some(left)) => write!(f, "Block({left:?})"),
            (ByListing::ALLOW, _) => f.write_str("Allow"),
            (ByListing::DENY, _) => f.write_str("Deny"),
            _ => f.write_str("None"),
        }
    }
}

impl ByListing {
    /// Decided by the key's quota.
    pub(crate) const NONE: ByListing = ByListing(0);
    /// The allow list admitted it.
    pub(crate) const ALLOW: ByListing = ByListing(1);
    /// The deny list refused it.
    pub(crate) const DENY: ByListing = ByListing(2);
    const BLOCK: u32 = 3;

    /// A block with `left` to run refused it.
    pub(crate) fn block(left: Duration) -> ByListing {
        let secs = crate::algorithm::ceil_secs(left);
        ByListing(Self::BLOCK.saturating_add(u32::try_from(secs).unwrap_or(u32::MAX)))
    }

    /// Whether a listing made the decision.
    pub(crate) fn is_listed(self) -> bool {
        self != Self::NONE
    }

    /// For a block, its time left when the decision was made (rounded up to whole seconds).
    pub(crate) fn block_left(self) -> Option<Duration> {
        let secs = self.0.checked_sub(Self::BLOCK)?;
        Some(Duration::from_secs(u64::from(secs)))
    }
}

impl Decision {
    /// An admitting decision from the store.
    pub fn admit(limit: u64, remaining: u64, reset_after: Duration) -> Decision {
        Decision {
            allowed: true,
            limit,
            remaining,
            reset_after,
            retry_after: None,
            source: Source::Store,
            degraded: false,
            taken: None,
            listed: ByListing::NONE,
        }
    }

    /// A denying decision from the store; `retry_after` is `None` when the request can never be
    /// admitted.
    pub fn deny(
        limit: u64,
        remaining: u64,
        reset_after: Duration,
        retry_after: Option<Duration>,
    ) -> Decision {
        Decision {
            allowed: false,
            limit,
            remaining,
            reset_after,
            retry_after,
            source: Source::Store,
            degraded: false,
            taken: None,
            listed: ByListing::NONE,
        }
    }

    /// For an admission that took permits from the shared budget: where, to give them back
    /// through [`Store::refund`](crate::Store::refund) (once). [`Limiter`](crate::Limiter)
    /// users get a [`Receipt`](crate::Receipt) instead, which cannot be refunded twice.
    pub fn taken(&self) -> Option<Taken> {
        self.taken
    }

    /// True for a denial that no amount of waiting can turn into an admission: the request's
    /// cost exceeds the quota's capacity.
    pub fn never_admissible(&self) -> bool {
        !self.allowed && self.retry_after.is_none()
    }

    /// Which of two decisions should govern single-valued headers: a denial over an admission,
    /// then the longer wait, then fewer remaining permits.
    pub(crate) fn more_restrictive(self, other: Decision) -> Decision {
        let rank = |d: &Decision| {
            (
                !d.allowed,
                d.never_admissible(),
                d.retry_after.unwrap_or(Duration::ZERO),
                std::cmp::Reverse(d.remaining),
                d.reset_after,
            )
        };
        if rank(&other) > rank(&self) {
            other
        } else {
            self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_reads_as_which_one_decided() {
        let block = ByListing::block(Duration::from_millis(1_500));
        assert_eq!(
            block.block_left(),
            Some(Duration::from_secs(2)),
            "rounded up"
        );
        assert!(block.is_listed() && ByListing::DENY.is_listed());
        assert!(!ByListing::NONE.is_listed());
        assert_eq!(ByListing::ALLOW.block_left(), None);
        assert_eq!(
            ByListing::block(Duration::MAX)
                .block_left()
                .map(|d| d.as_secs()),
            Some(u64::from(u32::MAX - 3))
        );
        let shown: Vec<String> = [ByListing::NONE, ByListing::ALLOW, ByListing::DENY, block]
            .iter()
            .map(|l| format!("{l:?}"))
            .collect();
        assert_eq!(shown, ["None", "Allow", "Deny", "Block(2s)"]);
    }
}
