//! Rate-limit header styles, all written from the decisions of one store call.

use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;

use crate::{Decision, Rule, Source};

/// Which rate-limit headers to put on every response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (delay in seconds): the
    /// widely copied style of the IETF draft's sixth revision. With several rules (or layers),
    /// the most restrictive decision's numbers.
    #[default]
    Draft6,
    /// The IETF httpapi draft's current form (draft-ietf-httpapi-ratelimit-headers-11):
    /// Structured Field lists with one item per rule that applied (across every fleetlimit
    /// layer the request went through),
    /// `RateLimit-Policy: "api";q=100;w=60` and `RateLimit: "api";r=42;t=17`. For a rule that
    /// denied, `t` is the wait before a retry can succeed, so `Retry-After` is never earlier.
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (delay in seconds),
    /// for clients written against the pre-standard headers.
    Legacy,
    /// No rate-limit headers (a denial still carries `Retry-After`).
    None,
}

impl std::str::FromStr for HeaderStyle {
    type Err = crate::ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "draft6" => Ok(HeaderStyle::Draft6),
            "ietf" => Ok(HeaderStyle::Ietf),
            "legacy" => Ok(HeaderStyle::Legacy),
            "none" => Ok(HeaderStyle::None),
            other => Err(crate::ConfigError::Invalid {
                setting: "headers",
                reason: format!(
                    "unknown header style {other:?}; expected draft6, ietf, legacy or none"
                ),
            }),
        }
    }
}

static POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Numbers below this come from a static table.
const SMALL_NUMBERS: u64 = 4096;

/// A header value for a number, without an allocation per response: small numbers (most
/// limits, remainders and resets) come from a table built once; larger ones from
/// [`shared_bytes`].
pub(crate) fn number(n: u64) -> HeaderValue {
    static SMALL: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    if n < SMALL_NUMBERS {
        // Values over one static text: cloning and dropping them touch no reference count.
        let table = SMALL.get_or_init(|| {
            let text: &'static str = (0..SMALL_NUMBERS)
                .map(|n| n.to_string())
                .collect::<String>()
                .leak();
            let mut at = 0;
            (0..SMALL_NUMBERS)
                .map(|n| {
                    let len = if n < 10 { 1 } else { n.ilog10() as usize + 1 };
                    let value = HeaderValue::from_static(&text[at..at + len]);
                    at += len;
                    value
                })
                .collect()
        });
        if let Some(v) = table.get(n as usize) {
            return v.clone();
        }
    }
    let mut digits = [0u8; 20];
    let text = decimal(n, &mut digits);
    HeaderValue::from_maybe_shared(shared_bytes(&[text])).unwrap_or_else(|_| HeaderValue::from(n))
}

/// `parts` one after the other, as `Bytes` carved from a per-thread buffer that many short
/// values share, so that a response's numbers and body allocate nothing each: two allocations
/// (the buffer and its shared handle) per 4 KiB, about 80 denial bodies.
///
/// A value kept beyond its response keeps its whole buffer alive. Denials are what an attacker
/// drives, and a client can hold responses unsent (an HTTP/2 stream whose window it never
/// opens), so the buffer stays small: a held denial pins at most 4 KiB, of the order of what
/// the stream's own state costs.
#[inline]
pub(crate) fn shared_bytes(parts: &[&[u8]]) -> bytes::Bytes {
    const ARENA: usize = 4 * 1024;
    thread_local! {
        static ARENA_BUF: std::cell::RefCell<bytes::BytesMut> =
            std::cell::RefCell::new(bytes::BytesMut::new());
    }
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let carved = ARENA_BUF.try_with(|arena| {
        let mut arena = arena.borrow_mut();
        if arena.capacity() - arena.len() < len {
            *arena = bytes::BytesMut::with_capacity(ARENA.max(len));
        }
        for part in parts {
            arena.extend_from_slice(part);
        }
        arena.split().freeze()
    });
    // The thread is exiting: no buffer to share.
    carved.unwrap_or_else(|_| bytes::Bytes::from(parts.concat()))
}

/// `n` in decimal, written at the end of `digits`: two digits per division.
pub(crate) fn decimal(n: u64, digits: &mut [u8; 20]) -> &[u8] {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let mut at = digits.len();
    let mut rest = n;
    while rest >= 100 {
        let pair = (rest % 100) as usize * 2;
        rest /= 100;
        at -= 2;
        digits[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if rest >= 10 {
        let pair = rest as usize * 2;
        at -= 2;
        digits[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        at -= 1;
        digits[at] = b'0' + rest as u8;
    }
    &digits[at..]
}

/// [`number`] for a value that repeats on every response (a rule's limit): the last few
/// written are kept per thread, by their low bits.
pub(crate) fn repeated_number(n: u64) -> HeaderValue {
    const RECENT: usize = 8;
    thread_local! {
        static LAST: std::cell::RefCell<[(u64, Option<HeaderValue>); RECENT]> =
            const { std::cell::RefCell::new([const { (0, None) }; RECENT]) };
    }
    if n < SMALL_NUMBERS {
        return number(n);
    }
    let slot = n as usize % RECENT;
    let recent = LAST.try_with(|last| match &last.borrow()[slot] {
        (m, Some(v)) if *m == n => Some(v.clone()),
        _ => None,
    });
    if let Ok(Some(v)) = recent {
        return v;
    }
    let value = number(n);
    let _ = LAST.try_with(|last| last.borrow_mut()[slot] = (n, Some(value.clone())));
    value
}

pub(crate) use crate::algorithm::ceil_secs;

/// Whole milliseconds, rounded up.
pub(crate) fn ceil_millis(d: Duration) -> u64 {
    let ms = d.as_millis() + u128::from(d.as_nanos() % 1_000_000 != 0);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

impl HeaderStyle {
    /// Write the headers for a request's decisions (`rules[i]` decided `decisions[i]`);
    /// `governing` is the most restrictive of them. Decisions the outage policy made without
    /// counting get no headers: their numbers would describe nothing.
    pub(crate) fn write(
        self,
        rules: &[&Rule],
        decisions: &[Decision],
        governing: &Decision,
        headers: &mut HeaderMap,
    ) {
        if governing.source == Source::Policy {
            return;
        }
        // Names built at compile time and moved into the map: inserting by reference clones
        // each one (a call through `Bytes`' vtable per header per response).
        let [limit, remaining, reset] = match self {
            HeaderStyle::Draft6 => {
                const {
                    [
                        HeaderName::from_static("ratelimit-limit"),
                        HeaderName::from_static("ratelimit-remaining"),
                        HeaderName::from_static("ratelimit-reset"),
                    ]
                }
            }
            HeaderStyle::Legacy => {
                const {
                    [
                        HeaderName::from_static("x-ratelimit-limit"),
                        HeaderName::from_static("x-ratelimit-remaining"),
                        HeaderName::from_static("x-ratelimit-reset"),
                    ]
                }
            }
            HeaderStyle::Ietf => return write_ietf(rules, decisions, headers),
            HeaderStyle::None => return,
        };
        headers.insert(limit, repeated_number(governing.limit));
        headers.insert(remaining, number(governing.remaining));
        headers.insert(reset, number(ceil_secs(governing.reset_after)));
    }

    /// The headers this style writes for `decisions` (`rules[i]` decided `decisions[i]`), as the
    /// layer writes them: a hook for fuzzing and property tests.
    #[doc(hidden)]
    pub fn render(self, rules: &[&Rule], decisions: &[Decision]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(governing) = decisions.iter().copied().reduce(Decision::more_restrictive) {
            self.write(rules, decisions, &governing, &mut headers);
        }
        headers
    }
}

/// Remove the IETF style's headers from a response: lists no fleetlimit layer wrote.
pub(crate) fn clear_ietf(headers: &mut HeaderMap) {
    for name in [&POLICY, &RATELIMIT] {
        headers.remove(name);
    }
}

fn write_ietf(rules: &[&Rule], decisions: &[Decision], headers: &mut HeaderMap) {
    // A rule the outage policy decided was not consulted: its figures would be invented. With
    // none consulted here, an inner layer's lists stand as they are.
    let consulted = || {
        rules
            .iter()
            .zip(decisions)
            .filter(|(_, d)| d.source != Source::Policy)
    };
    if consulted().next().is_none() {
        return;
    }
    // Written into a per-thread buffer and carved from the shared one: no allocation per
    // response once the buffer has grown to the longest list.
    thread_local! {
        static TEXT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let write = |text: &mut Vec<u8>, name: &HeaderName, headers: &HeaderMap| {
        text.clear();
        // An inner layer's items come first: one list describes every policy that applied.
        if let Some(inner) = headers
            .get(name)
            .filter(|v| v.to_str().is_ok() && !v.is_empty())
        {
            text.extend_from_slice(inner.as_bytes());
            text.extend_from_slice(b", ");
        }
        let mut digits = [0u8; 20];
        for (i, (rule, d)) in consulted().enumerate() {
            if i > 0 {
                text.extend_from_slice(b", ");
            }
            // Rule names are visible ASCII without quotes or backslashes (checked by
            // `Rule::new`), so they are valid Structured Field strings as they are. Quotas never
            // exceed the 15 digits of a Structured Field integer (checked when the quota is
            // built).
            text.push(b'"');
            text.extend_from_slice(rule.name().as_bytes());
            text.push(b'"');
            let (first, second) = if *name == POLICY {
                // `q` is the budget a client can spend at once: a bucket's burst, not its
                // refill rate; `w` the time the bucket takes to refill that much (for a
                // burst above the limit, longer than the period), so that a client pacing
                // itself at `q` per `w` keeps to the rate.
                // `q` from the decision: the quota may have changed while the handler ran,
                // and `r` (from the decision too) must never read above it.
                let window = ceil_secs(policy_window(rule.quota())).max(1);
                ((b";q=", d.limit), (b";w=", window))
            } else {
                let t = match (d.allowed, d.retry_after) {
                    (false, Some(retry)) => ceil_secs(retry).max(1),
                    _ => ceil_secs(d.reset_after),
                };
                ((b";r=", d.remaining), (b";t=", t))
            };
            for (label, n) in [first, second] {
                text.extend_from_slice(label);
                text.extend_from_slice(decimal(n, &mut digits));
            }
        }
        HeaderValue::from_maybe_shared(shared_bytes(&[text])).ok()
    };
    for name in [&POLICY, &RATELIMIT] {
        let value = TEXT
            .try_with(|text| write(&mut text.borrow_mut(), name, headers))
            .unwrap_or_else(|_| write(&mut Vec::new(), name, headers));
        if let Some(v) = value {
            headers.insert(name.clone(), v);
        }
    }
}

/// The window of a quota's IETF policy: its period, or for a bucket whose burst is above its
/// limit, the time it takes to refill the burst (`period × burst / limit`).
fn policy_window(quota: &crate::Quota) -> Duration {
    let (burst, limit) = (quota.capacity(), quota.limit());
    if burst <= limit {
        return quota.period();
    }
    let micros = quota.period_us() as u128 * burst as u128 / limit as u128;
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_render_in_decimal() {
        for n in (0..5_000).chain([999_999_999, u64::MAX]) {
            assert_eq!(number(n).to_str().unwrap(), n.to_string());
            assert_eq!(repeated_number(n).to_str().unwrap(), n.to_string());
        }
        // Enough large values to pass through several buffers.
        for n in 10_000..12_000u64 {
            assert_eq!(number(n).to_str().unwrap(), n.to_string());
        }
    }

    #[test]
    fn decimal_matches_to_string() {
        let mut digits = [0u8; 20];
        let powers = (0..20).map(|e| 10u64.pow(e));
        let edges = powers.flat_map(|p| [p - 1, p, p + 1, p.saturating_mul(9).saturating_add(9)]);
        for n in (0..2_000).chain(edges).chain([u64::MAX, u64::MAX - 1]) {
            assert_eq!(decimal(n, &mut digits), n.to_string().as_bytes(), "{n}");
        }
    }

    #[test]
    fn rounding_is_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(
            ceil_secs(Duration::MAX),
            u64::MAX,
            "saturates, never wraps to 0"
        );
        assert_eq!(ceil_millis(Duration::from_micros(1)), 1);
        assert_eq!(ceil_millis(Duration::from_micros(2000)), 2);
    }

    #[test]
    fn ietf_lists_leave_out_rules_the_outage_policy_decided() {
        let rule = |name| {
            Rule::new(
                name,
                crate::Quota::per_minute(10)
                    .algorithm(crate::Algorithm::FixedWindow)
                    .build()
                    .unwrap(),
            )
            .unwrap()
        };
        let (account, ip) = (rule("account"), rule("ip"));
        let refused = Decision::deny(
            10,
            0,
            Duration::from_secs(30),
            Some(Duration::from_secs(30)),
        );
        // The ip rule's master was away: the policy admitted it, nobody counted anything.
        let mut invented = Decision::admit(10, 10, Duration::ZERO);
        invented.source = Source::Policy;
        let mut headers = HeaderMap::new();
        HeaderStyle::Ietf.write(
            &[&account, &ip],
            &[refused, invented],
            &refused,
            &mut headers,
        );
        assert_eq!(headers[&RATELIMIT], "\"account\";r=0;t=30");
        assert_eq!(headers[&POLICY], "\"account\";q=10;w=60");
        // An outer layer whose every rule the policy decided leaves the inner lists as they
        // are (no trailing separator, no empty item).
        let inner = headers.clone();
        HeaderStyle::Ietf.write(&[&ip], &[invented], &refused, &mut headers);
        assert_eq!(headers, inner);
    }

    #[test]
    fn ietf_policy_states_a_buckets_burst_and_parses_as_structured_fields() {
        let bucket = Rule::new(
            "b",
            crate::Quota::per_second(10)
                .algorithm(crate::Algorithm::TokenBucket)
                .burst(50)
                .build()
                .unwrap(),
        )
        .unwrap();
        let d = Decision::admit(50, 49, Duration::from_millis(100));
        let mut headers = HeaderMap::new();
        HeaderStyle::Ietf.write(&[&bucket], &[d], &d, &mut headers);
        // 50 at once, refilled in 5 s: 10 a second, as configured.
        assert_eq!(headers[&POLICY], "\"b\";q=50;w=5");
        assert_eq!(headers[&RATELIMIT], "\"b\";r=49;t=1");
        // The largest quota a Structured Field integer can carry still renders and parses.
        let big = Rule::new(
            "big",
            crate::Quota::per_day(999_999_999_999_999)
                .algorithm(crate::Algorithm::FixedWindow)
                .build()
                .unwrap(),
        )
        .unwrap();
        let d = Decision::admit(999_999_999_999_999, 999_999_999_999_998, Duration::ZERO);
        let mut headers = HeaderMap::new();
        HeaderStyle::Ietf.write(&[&big], &[d], &d, &mut headers);
        for name in [&POLICY, &RATELIMIT] {
            let value = headers[name].as_bytes();
            assert!(
                sfv::Parser::new(value).parse::<sfv::List>().is_ok(),
                "{:?}",
                headers[name]
            );
        }
    }

    #[test]
    fn styles_parse() {
        for (s, style) in [
            ("draft6", HeaderStyle::Draft6),
            ("ietf", HeaderStyle::Ietf),
            ("legacy", HeaderStyle::Legacy),
            ("none", HeaderStyle::None),
        ] {
            assert_eq!(s.parse::<HeaderStyle>(), Ok(style));
        }
        assert!("x".parse::<HeaderStyle>().is_err());
    }
}
