//! Quotas and rules as configuration (feature `serde`), and rules files in TOML (feature
//! `toml`, on by default).
//!
//! A rule is written as its name and its quota's fields; periods as `500ms`, `60s`, `1m`, `1h`
//! or `1d`:
//!
//! ```toml
//! [[rule]]
//! name = "api"
//! algorithm = "sliding-window"   # optional; the default
//! limit = 100
//! period = "60s"
//!
//! [[rule]]
//! name = "burst"
//! algorithm = "token-bucket"
//! limit = 10
//! period = "1s"
//! burst = 50
//! ```
//!
//! Every value is validated as [`Quota`]'s builder validates it: a file that deserialises is a
//! file whose rules can be used.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Algorithm, ConfigError, Quota, Rule, WindowEstimate};

/// Parse a period: a whole number followed by `ms`, `s`, `m`, `h` or `d` (`500ms`, `60s`).
pub fn parse_period(text: &str) -> Result<Duration, ConfigError> {
    let invalid = || ConfigError::Invalid {
        setting: "period",
        reason: format!("{text:?}: expected a whole number and a unit (500ms, 60s, 1m, 1h, 1d)"),
    };
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let n: u64 = number.parse().map_err(|_| invalid())?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(invalid()),
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(invalid)
}

/// A period as [`parse_period`] reads it, in the largest unit that writes it exactly.
pub fn format_period(period: Duration) -> String {
    let ms = period.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// A quota's fields as written in configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaFields {
    #[serde(default, with = "algorithm_name")]
    algorithm: Algorithm,
    limit: u64,
    period: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    burst: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sub_windows: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    estimate: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_log_len: Option<u64>,
}

impl TryFrom<QuotaFields> for Quota {
    type Error = ConfigError;

    fn try_from(f: QuotaFields) -> Result<Quota, ConfigError> {
        let mut b = Quota::new(f.limit, parse_period(&f.period)?).algorithm(f.algorithm);
        if let Some(burst) = f.burst {
            b = b.burst(burst);
        }
        if let Some(n) = f.sub_windows {
            b = b.sub_windows(n);
        }
        if let Some(cap) = f.max_log_len {
            // In a file it is a typo or a misunderstanding, as a burst on a window would be.
            if f.algorithm != Algorithm::SlidingLog {
                return Err(ConfigError::Invalid {
                    setting: "max_log_len",
                    reason: format!(
                        "only meaningful for the sliding window log, not {}",
                        f.algorithm
                    ),
                });
            }
            b = b.max_log_len(cap);
        }
        match f.estimate.as_deref() {
            None => {}
            Some("weighted") => b = b.estimate(WindowEstimate::Weighted),
            Some("bounded") => b = b.estimate(WindowEstimate::Bounded),
            Some(other) => {
                return Err(ConfigError::Invalid {
                    setting: "estimate",
                    reason: format!("{other:?}: expected weighted or bounded"),
                })
            }
        }
        b.build()
    }
}

impl From<&Quota> for QuotaFields {
    fn from(q: &Quota) -> QuotaFields {
        let sliding = q.algorithm() == Algorithm::SlidingWindow;
        QuotaFields {
            algorithm: q.algorithm(),
            limit: q.limit(),
            period: format_period(q.period()),
            burst: matches!(q.algorithm(), Algorithm::TokenBucket | Algorithm::Gcra)
                .then_some(q.burst()),
            sub_windows: sliding.then_some(q.sub_windows()),
            estimate: (sliding && q.estimate() == WindowEstimate::Bounded)
                .then(|| "bounded".to_owned()),
            max_log_len: (q.algorithm() == Algorithm::SlidingLog).then_some(q.limit()),
        }
    }
}

impl Serialize for Quota {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        QuotaFields::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Quota {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Quota, D::Error> {
        Quota::try_from(QuotaFields::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A rule as written in configuration: its name and its quota's fields, side by side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFields {
    name: String,
    #[serde(default, with = "algorithm_name")]
    algorithm: Algorithm,
    limit: u64,
    period: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    burst: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sub_windows: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    estimate: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_log_len: Option<u64>,
}

impl Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let q = QuotaFields::from(self.quota());
        RuleFields {
            name: self.name().to_owned(),
            algorithm: q.algorithm,
            limit: q.limit,
            period: q.period,
            burst: q.burst,
            sub_windows: q.sub_windows,
            estimate: q.estimate,
            max_log_len: q.max_log_len,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Rule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Rule, D::Error> {
        let f = RuleFields::deserialize(d)?;
        let quota = Quota::try_from(QuotaFields {
            algorithm: f.algorithm,
            limit: f.limit,
            period: f.period,
            burst: f.burst,
            sub_windows: f.sub_windows,
            estimate: f.estimate,
            max_log_len: f.max_log_len,
        })
        .map_err(|e| serde::de::Error::custom(format!("rule {:?}: {e}", f.name)))?;
        Rule::new(f.name, quota).map_err(serde::de::Error::custom)
    }
}

mod algorithm_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::Algorithm;

    pub(super) fn serialize<S: Serializer>(a: &Algorithm, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(a.name())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Algorithm, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// Where and how a rule applies, as configuration: the declarative part of a
/// [`Scope`](crate::layer::Scope) (a predicate or a cost function is code, not configuration).
///
/// ```toml
/// [[rule]]
/// name = "login"
/// limit = 5
/// period = "1m"
/// scope = { methods = ["POST"], path = "/login", key = "peer", refund_status = "200-299" }
/// ```
///
/// `key` is `"peer"` (the client address) or `"header:NAME"`; `missing_key` is `"reject"`,
/// `"skip"` or `"shared"`; `cost` a fixed cost, `cost_body` a unit in bytes
/// ([`Scope::cost_body`](crate::layer::Scope::cost_body)); `refund_status` statuses and ranges
/// (`"200-299,304"`) whose responses give their permits back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeConfig {
    /// Methods the rule applies to (empty: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// The path, as [`Scope::path`](crate::layer::Scope::path) reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `"peer"` or `"header:NAME"`; none: the layer's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `"reject"`, `"skip"` or `"shared"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_key: Option<String>,
    /// A fixed cost per request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// Charge by body size, in units of this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_body: Option<u64>,
    /// Statuses whose responses give their permits back (`"200-299,304"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refund_status: Option<String>,
}

impl ScopeConfig {
    /// The scope this configuration describes; a clear error for any value it cannot use.
    pub fn to_scope(&self) -> Result<crate::layer::Scope, ConfigError> {
        use crate::layer::{MissingKey, Scope};
        let invalid =
            |setting: &'static str, reason: String| ConfigError::Invalid { setting, reason };
        let mut scope = Scope::new();
        for m in &self.methods {
            let method = http::Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| invalid("scope.methods", format!("{m:?} is not an HTTP method")))?;
            scope = scope.method(method);
        }
        if let Some(path) = &self.path {
            if let Some(reason) = crate::layer::path_error(path) {
                return Err(invalid("scope.path", format!("{path:?}: {reason}")));
            }
            scope = scope.path(path);
        }
        match self.key.as_deref() {
            None => {}
            // The layer's peer address, with the proxies the layer trusts.
            Some("peer") => scope = scope.key_by_peer(),
            Some(other) => match other.strip_prefix("header:") {
                Some(name) => scope = scope.key(crate::key::HeaderKey::new(name)?),
                None => {
                    return Err(invalid(
                        "scope.key",
                        format!("{other:?}: expected \"peer\" or \"header:NAME\""),
                    ))
                }
            },
        }
        let missing = match self.missing_key.as_deref() {
            None => None,
            Some("reject") => Some(MissingKey::Reject),
            Some("skip") => Some(MissingKey::Skip),
            Some("shared") => Some(MissingKey::Shared),
            Some(other) => {
                return Err(invalid(
                    "scope.missing_key",
                    format!("{other:?}: expected reject, skip or shared"),
                ))
            }
        };
        if let Some(missing) = missing {
            scope = scope.on_missing_key(missing);
        }
        if self.cost.is_some() && self.cost_body.is_some() {
            return Err(invalid(
                "scope.cost",
                "a fixed cost and a cost by body size (cost_body) together; give one".into(),
            ));
        }
        if let Some(cost) = self.cost {
            if cost == 0 {
                return Err(invalid(
                    "scope.cost",
                    "a cost of 0 leaves every request out of the rule; remove the scope".into(),
                ));
            }
            scope = scope.cost(move |_| cost);
        }
        if let Some(unit) = self.cost_body {
            if unit == 0 {
                return Err(invalid("scope.cost_body", "a unit of 0 bytes".into()));
            }
            scope = scope.cost_body(unit);
        }
        if let Some(list) = &self.refund_status {
            let ranges = statuses(list).ok_or_else(|| {
                invalid(
                    "scope.refund_status",
                    format!("{list:?}: expected statuses and ranges such as 200-299,304"),
                )
            })?;
            scope = scope.refund_if(move |s| ranges.iter().any(|r| r.contains(&s.as_u16())));
        }
        Ok(scope)
    }
}

/// `"200-299,304"` as ranges of statuses (100 to 999).
fn statuses(list: &str) -> Option<Vec<std::ops::RangeInclusive<u16>>> {
    let status = |s: &str| {
        let s = s.trim();
        s.parse::<u16>()
            .ok()
            .filter(|n| (100..=999).contains(n) && s.bytes().all(|b| b.is_ascii_digit()))
    };
    list.split(',')
        .map(|part| match part.split_once('-') {
            Some((from, to)) => {
                let (from, to) = (status(from)?, status(to)?);
                (from <= to).then_some(from..=to)
            }
            None => status(part).map(|n| n..=n),
        })
        .collect()
}

/// A rules file as a layer reads it: the rules, and the scopes some of them carry.
#[cfg(feature = "toml")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleSet {
    /// The rules, in the file's order.
    pub rules: Vec<Rule>,
    /// The scopes given in the file, by rule name.
    pub scopes: Vec<(String, ScopeConfig)>,
}

#[cfg(feature = "toml")]
impl RuleSet {
    /// Read a rules file whose `[[rule]]` tables may carry a `scope` (see [`ScopeConfig`]).
    /// Every scope is checked too: a file that loads builds a layer.
    pub fn from_toml(text: &str) -> Result<RuleSet, ConfigError> {
        let mut tables = rule_tables(text)?;
        let mut scopes = Vec::new();
        for (line, fields) in &mut tables {
            let Some(scope) = fields.remove("scope") else {
                continue;
            };
            let name = fields
                .get("name")
                .and_then(toml::Value::as_str)
                .unwrap_or("")
                .to_owned();
            let scope: ScopeConfig =
                scope
                    .try_into()
                    .map_err(|e: toml::de::Error| ConfigError::Invalid {
                        setting: "rules file",
                        reason: format!(
                            "line {line}: rule {name:?}: scope: {}",
                            e.message().trim_end()
                        ),
                    })?;
            scope.to_scope().map_err(|e| at_line(*line, e))?;
            scopes.push((*line, name, scope));
        }
        let rules = rules_from_tables(tables)?;
        for (line, name, scope) in &scopes {
            let (Some(cost), Some(rule)) = (scope.cost, rules.iter().find(|r| r.name() == name))
            else {
                continue;
            };
            let capacity = rule.quota().capacity();
            if cost > capacity {
                return Err(ConfigError::Invalid {
                    setting: "rules file",
                    reason: format!(
                        "line {line}: rule {name:?}: scope.cost {cost} is above what the rule \
                         can ever admit at once ({capacity}): every request would be refused"
                    ),
                });
            }
        }
        Ok(RuleSet {
            rules,
            scopes: scopes
                .into_iter()
                .map(|(_, name, scope)| (name, scope))
                .collect(),
        })
    }

    /// Give `builder` this file's scopes.
    pub fn scope(
        &self,
        mut builder: crate::layer::RateLimitLayerBuilder,
    ) -> Result<crate::layer::RateLimitLayerBuilder, ConfigError> {
        for (name, scope) in &self.scopes {
            builder = builder.scope(name, scope.to_scope()?);
        }
        Ok(builder)
    }
}

/// A TOML error in one line, for logs: where, then what.
#[cfg(feature = "toml")]
fn toml_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let line = e.span().map_or(0, |s| line_of(text, s.start));
    ConfigError::Invalid {
        setting: "rules file",
        reason: format!("line {line}: {}", e.message().trim_end()),
    }
}

/// The line (from 1) of byte `at` of `text`.
#[cfg(feature = "toml")]
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// `e`, saying the line of the rule it is about.
#[cfg(feature = "toml")]
fn at_line(line: usize, e: ConfigError) -> ConfigError {
    match e {
        ConfigError::Invalid { setting, reason } => ConfigError::Invalid {
            setting,
            reason: format!("line {line}: {reason}"),
        },
        other => other,
    }
}

/// The rules of a rules file: `[[rule]]` tables (see the [module](self)), at least one, names
/// unique. Errors name the line and the field. A file with scopes is read by
/// [`RuleSet::from_toml`].
#[cfg(feature = "toml")]
pub fn rules_from_toml(text: &str) -> Result<Vec<Rule>, ConfigError> {
    rules_from_tables(rule_tables(text)?)
}

/// The file's `[[rule]]` tables, each with the line it starts on: a rule's own errors (a limit
/// of 0, an unknown field) name it, as syntax errors do.
#[cfg(feature = "toml")]
fn rule_tables(text: &str) -> Result<Vec<(usize, toml::Table)>, ConfigError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        #[serde(default)]
        rule: Vec<toml::Spanned<toml::Table>>,
    }
    let file: File = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
    Ok(file
        .rule
        .into_iter()
        .map(|table| (line_of(text, table.span().start), table.into_inner()))
        .collect())
}

#[cfg(feature = "toml")]
fn rules_from_tables(tables: Vec<(usize, toml::Table)>) -> Result<Vec<Rule>, ConfigError> {
    if tables.is_empty() {
        return Err(ConfigError::NoRules);
    }
    let mut rules: Vec<Rule> = Vec::with_capacity(tables.len());
    for (line, table) in tables {
        let rule: Rule = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Invalid {
                setting: "rules file",
                reason: format!("line {line}: {}", e.message().trim_end()),
            })?;
        if rules.iter().any(|r| r.name() == rule.name()) {
            return Err(ConfigError::Invalid {
                setting: "rules file",
                reason: format!("line {line}: two rules are named {:?}", rule.name()),
            });
        }
        rules.push(rule);
    }
    Ok(rules)
}

/// Rules as a rules file (TOML): what [`rules_from_toml`] reads back.
#[cfg(feature = "toml")]
pub fn rules_to_toml(rules: &[Rule]) -> Result<String, ConfigError> {
    #[derive(Serialize)]
    struct File<'a> {
        rule: &'a [Rule],
    }
    toml::to_string(&File { rule: rules }).map_err(|e| ConfigError::Invalid {
        setting: "rules file",
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rule's own errors name the line of its table, as syntax errors name theirs.
    #[cfg(feature = "toml")]
    #[test]
    fn errors_name_the_rules_line() {
        let file = |second: &str| {
            format!("[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"1s\"\n\n[[rule]]\n{second}\n")
        };
        for (second, says) in [
            ("name = \"b\"\nlimit = 0\nperiod = \"1s\"", "limit"),
            (
                "name = \"b\"\nlimit = 1\nperiod = \"1s\"\ncolour = \"red\"",
                "colour",
            ),
            ("name = \"a\"\nlimit = 1\nperiod = \"1s\"", "two rules"),
            ("name = \"b\"\nlimit = 1\nperiod = \"soon\"", "period"),
        ] {
            let text = file(second);
            for error in [
                rules_from_toml(&text).unwrap_err().to_string(),
                RuleSet::from_toml(&text).unwrap_err().to_string(),
            ] {
                assert!(error.contains("line 6") && error.contains(says), "{error}");
            }
        }
        let scoped = file("name = \"b\"\nlimit = 1\nperiod = \"1s\"\nscope = { path = \"x\" }");
        let error = RuleSet::from_toml(&scoped).unwrap_err().to_string();
        assert!(
            error.contains("line 6") && error.contains("start with /"),
            "{error}"
        );
    }

    #[test]
    fn periods_read_and_write_back() {
        for (text, ms) in [
            ("500ms", 500),
            ("60s", 60_000),
            ("1m", 60_000),
            ("2h", 7_200_000),
            ("1d", 86_400_000),
        ] {
            assert_eq!(
                parse_period(text).unwrap(),
                Duration::from_millis(ms),
                "{text}"
            );
        }
        assert_eq!(format_period(Duration::from_secs(60)), "1m");
        assert_eq!(format_period(Duration::from_millis(1500)), "1500ms");
        for bad in [
            "",
            "60",
            "s",
            "1.5s",
            "-1s",
            "60 s",
            "1w",
            "99999999999999999999d",
        ] {
            assert!(parse_period(bad).is_err(), "{bad:?}");
        }
    }

    #[cfg(feature = "toml")]
    #[test]
    fn rules_files_round_trip_and_say_what_is_wrong() {
        let text = r#"
            [[rule]]
            name = "api"
            limit = 100
            period = "60s"

            [[rule]]
            name = "bucket"
            algorithm = "token-bucket"
            limit = 10
            period = "1s"
            burst = 50

            [[rule]]
            name = "exact"
            algorithm = "sliding-window"
            limit = 5
            period = "1m"
            sub_windows = 60
            estimate = "bounded"
        "#;
        let rules = rules_from_toml(text).unwrap();
        assert_eq!(rules.len(), 3);
        assert_eq!(rules[0].quota(), &Quota::per_minute(100).build().unwrap());
        assert_eq!(rules[1].quota().burst(), 50);
        assert_eq!(rules[2].quota().estimate(), WindowEstimate::Bounded);
        let again = rules_from_toml(&rules_to_toml(&rules).unwrap()).unwrap();
        assert_eq!(again, rules);
        for (bad, says) in [
            ("", "at least one rule"),
            ("[[rule]]\nname = \"a\"\nlimit = 0\nperiod = \"1s\"", "at least 1"),
            ("[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"soon\"", "soon"),
            ("[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"1s\"\nburst = 3", "burst"),
            ("[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"1s\"\nlimt = 3", "limt"),
            ("[[rule]]\nname = \"a b\"\nlimit = 1\nperiod = \"1s\"", "a b"),
            ("[[rule]]\nname = \"a\"\nalgorithm = \"leaky\"\nlimit = 1\nperiod = \"1s\"", "leaky"),
            (
                "[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"1s\"\n[[rule]]\nname = \"a\"\nlimit = 2\nperiod = \"1s\"",
                "two rules",
            ),
            ("[[rule]\n", "rules file"),
            (
                "[[rule]]\nname = \"a\"\nlimit = 1\nperiod = \"1s\"\nmax_log_len = 5",
                "max_log_len",
            ),
        ] {
            let err = rules_from_toml(bad).unwrap_err().to_string();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }
}
