//! Rules: a named quota. A limiter holds one or more; every rule that applies to a request is
//! checked, and a denial by one takes nothing from the others.

use std::sync::Arc;

use crate::error::ConfigError;
use crate::Quota;

/// The longest rule name accepted.
pub const MAX_RULE_NAME_LEN: usize = 64;

/// A named quota. The name namespaces the rule's counters in the store, so two rules never
/// share state even for the same key.
///
/// ```
/// use fleetlimit::{Quota, Rule};
///
/// let rule = Rule::new("per-account", Quota::per_minute(100).build()?)?;
/// assert_eq!(rule.name(), "per-account");
/// # Ok::<(), fleetlimit::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    name: Arc<str>,
    quota: Quota,
}

impl Rule {
    /// A rule named `name` enforcing `quota`. Names are 1 to 64 visible ASCII characters other
    /// than `"` and `\` (they appear in response headers).
    pub fn new(name: impl Into<String>, quota: Quota) -> Result<Rule, ConfigError> {
        let name: String = name.into();
        let visible = |b: u8| b.is_ascii_graphic() && b != b'"' && b != b'\\';
        if name.is_empty() || name.len() > MAX_RULE_NAME_LEN || !name.bytes().all(visible) {
            return Err(ConfigError::InvalidRuleName(name));
        }
        Ok(Rule {
            name: name.into(),
            quota,
        })
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name, shared.
    pub fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// The rule's quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// This rule (same name, so the same state) with another quota.
    pub(crate) fn with_quota(&self, quota: Quota) -> Rule {
        Rule {
            name: self.name.clone(),
            quota,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        let q = Quota::per_second(1).build().unwrap();
        assert!(Rule::new("per-ip:v2", q.clone()).is_ok());
        for bad in [
            "",
            "has space",
            "quo\"te",
            "back\\slash",
            "ünï",
            &"x".repeat(65),
        ] {
            assert!(Rule::new(bad, q.clone()).is_err(), "{bad:?}");
        }
    }
}
