//! How a rule's hot keys are leased: block sizes, promotion, validity and idle time.

use std::time::Duration;

use crate::error::ConfigError;
use crate::{Quota, Rule};

/// How a rule's hot keys are leased; see [`LimiterBuilder::lease`](super::LimiterBuilder::lease).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseConfig {
    pub(super) block: Option<u64>,
    pub(super) promote_at: f64,
    max_block: u64,
    max_share: f64,
    pub(super) max_validity: Duration,
    pub(super) idle: Duration,
}

impl LeaseConfig {
    /// Lease adaptively: a key is leased once this process sees it above `promote_at`
    /// requests per second (default 300) and goes back to per-request decisions when it cools;
    /// the block size follows the observed rate (a tenth of a second of traffic), bounded by
    /// [`max_block`](LeaseConfig::max_block) and [`max_share`](LeaseConfig::max_share).
    pub fn auto() -> LeaseConfig {
        LeaseConfig {
            block: None,
            promote_at: 300.0,
            max_block: 10_000,
            max_share: 0.125,
            max_validity: Duration::from_millis(250),
            idle: Duration::from_millis(100),
        }
    }

    /// Lease every key of the rule in blocks of `block` permits (still bounded by
    /// [`max_share`](LeaseConfig::max_share) of the quota).
    pub fn fixed(block: u64) -> LeaseConfig {
        LeaseConfig {
            block: Some(block),
            max_block: block,
            ..LeaseConfig::auto()
        }
    }

    /// The request rate (per second, in this process) above which a key is leased (auto).
    pub fn promote_at(mut self, per_second: f64) -> LeaseConfig {
        self.promote_at = per_second;
        self
    }

    /// The largest block (default 10,000).
    pub fn max_block(mut self, permits: u64) -> LeaseConfig {
        self.max_block = permits;
        self
    }

    /// The largest share of the quota's capacity one block may take (default 1/8), so one
    /// process never holds what the whole fleet needs.
    pub fn max_share(mut self, share: f64) -> LeaseConfig {
        self.max_share = share;
        self
    }

    /// How long a block may be spent (default 250 ms; never past the end of the window that
    /// granted it). For the token bucket and GCRA this widens the envelope: the fleet admits at
    /// most `burst + rate × (t + max_validity)` in any interval `t`.
    pub fn max_validity(mut self, validity: Duration) -> LeaseConfig {
        self.max_validity = validity;
        self
    }

    /// A leased key unused this long leaves leased mode and gives its unspent permits back
    /// (default 100 ms, shorter than the validity, so a quiet key's permits come back while its
    /// block could still have been spent).
    pub fn idle(mut self, idle: Duration) -> LeaseConfig {
        self.idle = idle;
        self
    }

    pub(crate) fn validate(&self, rule: &Rule) -> Result<(), ConfigError> {
        let invalid = |reason: String| ConfigError::Invalid {
            setting: "lease",
            reason: format!("rule {:?}: {reason}", rule.name()),
        };
        if rule.quota().algorithm() == crate::Algorithm::SlidingLog {
            return Err(invalid(
                "the sliding log cannot be leased: its promise rests on each permit's own timestamp".into(),
            ));
        }
        if self.block == Some(0) || self.max_block == 0 {
            return Err(invalid("blocks need at least one permit".into()));
        }
        if !(self.max_share > 0.0 && self.max_share <= 1.0) {
            return Err(invalid(format!(
                "max_share must be in (0, 1], got {}",
                self.max_share
            )));
        }
        if !(self.promote_at.is_finite() && self.promote_at > 0.0) {
            return Err(invalid(format!(
                "promote_at must be positive, got {}",
                self.promote_at
            )));
        }
        if self.max_validity < Duration::from_millis(1) || self.idle.is_zero() {
            return Err(invalid(
                "max_validity must be at least 1 ms and idle non-zero".into(),
            ));
        }
        Ok(())
    }

    /// The block to ask for, given the key's observed rate.
    pub(super) fn block_size(&self, quota: &Quota, rate: f64, cost: u64) -> u64 {
        let cap =
            ((quota.capacity() as f64 * self.max_share).floor() as u64).clamp(1, self.max_block);
        let wanted = self.block.unwrap_or((rate / 10.0).ceil() as u64);
        wanted.clamp(1, cap).max(cost)
    }
}
