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
    /// The name's number in this process (see [`name_id`]): the memory store keys its entries by
    /// it, so that an entry holds no reference to count and compares in one instruction.
    id: u32,
    quota: Quota,
}

/// The number of a rule name in this process: the same for every rule of that name, another for
/// every other name; `None` once four billion names are numbered (never, for names that come
/// from configuration: that is 100 GB of names).
fn name_id(name: &str) -> Option<u32> {
    static NAMES: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<Box<str>, u32>>> =
        std::sync::OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(&id) = names.get(name) {
        return Some(id);
    }
    let id = u32::try_from(names.len()).ok()?;
    names.insert(name.into(), id);
    Some(id)
}

impl Rule {
    /// A rule named `name` enforcing `quota`. Names are 1 to 64 visible ASCII characters other
    /// than `"` and `\` (they appear in response headers). Each distinct name is numbered once
    /// and remembered for the life of the process: build rules from configuration, not a name
    /// per request.
    pub fn new(name: impl Into<String>, quota: Quota) -> Result<Rule, ConfigError> {
        let name: String = name.into();
        let visible = |b: u8| b.is_ascii_graphic() && b != b'"' && b != b'\\';
        if name.is_empty() || name.len() > MAX_RULE_NAME_LEN || !name.bytes().all(visible) {
            return Err(ConfigError::InvalidRuleName(name));
        }
        let Some(id) = name_id(&name) else {
            return Err(ConfigError::Invalid {
                setting: "rule name",
                reason: "four billion distinct rule names are numbered in this process already"
                    .into(),
            });
        };
        Ok(Rule {
            id,
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

    /// The name's number in this process: equal for two rules exactly when their names are.
    pub(crate) fn name_id(&self) -> u32 {
        self.id
    }

    /// The rule's quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// This rule (same name, so the same state) with another quota.
    pub(crate) fn with_quota(&self, quota: Quota) -> Rule {
        Rule {
            name: self.name.clone(),
            id: self.id,
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

    #[test]
    fn a_name_has_one_number() {
        let q = |n| Quota::per_second(n).build().unwrap();
        let a = Rule::new("numbered-a", q(1)).unwrap();
        let a2 = Rule::new(String::from("numbered-a"), q(2)).unwrap();
        let b = Rule::new("numbered-b", q(1)).unwrap();
        assert_eq!(a.name_id(), a2.name_id());
        assert_eq!(a.name_id(), a.with_quota(q(3)).name_id());
        assert_ne!(a.name_id(), b.name_id());
    }
}
