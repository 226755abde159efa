//! Keys from the request body, as [`BufferBodyLayer`](crate::layer::BufferBodyLayer) read it.

use std::sync::atomic::{AtomicBool, Ordering};

use http::request::Parts;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{Key, KeyExtractor};
use crate::layer::BufferedBody;
use crate::ConfigError;

/// A field of a JSON body as the key: `"account"` (a top-level field) or a JSON pointer
/// (`"/user/name"`). Strings, numbers and booleans make keys; a missing field, another kind of
/// value, a body that is not JSON, or no body read at all give no key, so the scope's
/// missing-key answer applies ([`Scope::on_missing_key`](crate::layer::Scope::on_missing_key);
/// `Reject` answers 400), never a server error.
///
/// The body must have been read by a [`BufferBodyLayer`](crate::layer::BufferBodyLayer)
/// outside the rate-limit layer; without one, every request has no key (said once at `warn`).
/// A gRPC call's body is a stream that layer leaves unread; gRPC calls with a JSON content type
/// (`application/grpc+json`, which axum's `Json` also reads) have no key, and where the scope
/// would skip the rule for them they share one bucket, the one of
/// [`MissingKey::Shared`](crate::MissingKey::Shared), instead.
///
/// ```
/// use fleetlimit::key::{json_field, KeyExtractor};
/// use fleetlimit::Key;
///
/// let account = json_field("account");
/// let mut parts = http::Request::post("/login").body(()).unwrap().into_parts().0;
/// # fleetlimit::layer::BufferedBody::__for_tests(&mut parts, br#"{"account":"alice","password":"x"}"#);
/// assert_eq!(account.extract(&parts), Some(Key::new("alice")));
/// ```
pub fn json_field(field: &str) -> BodyField {
    let pointer = if field.starts_with('/') {
        field.to_owned()
    } else {
        // A plain name is a top-level field; `~` and `/` are escaped as a JSON pointer needs.
        format!("/{}", field.replace('~', "~0").replace('/', "~1"))
    };
    let path = pointer
        .split('/')
        .skip(1)
        .map(|segment| segment.replace("~1", "/").replace("~0", "~"))
        .collect();
    BodyField {
        field: Field::Json { pointer, path },
        normalize: None,
        warned: AtomicBool::new(false),
    }
}

/// A field of an `application/x-www-form-urlencoded` body as the key (percent-decoded; an empty
/// value is no key). A field given twice counts as its last, as a map the handler reads the
/// form into keeps it (a typed `Form<T>` refuses such a body): counting the first would let
/// `user=anyone&user=victim` be counted against `anyone` while the handler serves `victim`. Like [`json_field`], it needs a
/// [`BufferBodyLayer`](crate::layer::BufferBodyLayer) outside the rate-limit layer. On `GET`
/// the field is read from the query string, as axum's `Form` reads it there (a body sent with a
/// GET is ignored by the handler, and by the key); on every other method, `HEAD` included, from
/// the body, as `Form` does.
pub fn form_field(name: &str) -> BodyField {
    BodyField {
        field: Field::Form(name.to_owned()),
        normalize: None,
        warned: AtomicBool::new(false),
    }
}

/// A [`KeyExtractor`] reading a field of the request body; see [`json_field`] and
/// [`form_field`].
pub struct BodyField {
    field: Field,
    normalize: Option<Box<Normalize>>,
    warned: AtomicBool,
}

/// What [`BodyField::normalized`] maps a field's value with.
type Normalize = dyn Fn(&str) -> String + Send + Sync;

impl std::fmt::Debug for BodyField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyField")
            .field("field", &self.field)
            .field("normalized", &self.normalize.is_some())
            .finish_non_exhaustive()
    }
}

impl BodyField {
    /// Key on the field's value as the application reads it: `normalize` maps the value (a
    /// number or boolean as JSON writes it) before it becomes the key, and an empty result is no
    /// key. Without it, the key is the value byte for byte, and an application that trims,
    /// lowercases or otherwise normalises what it reads (a login's account name) would give
    /// `Alice`, `alice` and `alice ` three buckets for one account.
    ///
    /// ```
    /// use fleetlimit::key::{json_field, KeyExtractor};
    /// use fleetlimit::Key;
    ///
    /// let account = json_field("account").normalized(|name| name.trim().to_lowercase());
    /// let mut parts = http::Request::post("/login").body(()).unwrap().into_parts().0;
    /// # fleetlimit::layer::BufferedBody::__for_tests(&mut parts, br#"{"account":" Alice "}"#);
    /// assert_eq!(account.extract(&parts), Some(Key::new("alice")));
    /// ```
    pub fn normalized(
        mut self,
        normalize: impl Fn(&str) -> String + Send + Sync + 'static,
    ) -> Self {
        self.normalize = Some(Box::new(normalize));
        self
    }

    /// The key for a field's value, normalised.
    fn key(&self, value: &str) -> Option<Key> {
        let value = match &self.normalize {
            Some(normalize) => std::borrow::Cow::Owned(normalize(value)),
            None => std::borrow::Cow::Borrowed(value),
        };
        (!value.is_empty()).then(|| Key::new(value.as_ref()))
    }
}

#[derive(Debug, Clone)]
enum Field {
    /// The pointer as given, and its segments unescaped.
    Json {
        pointer: String,
        path: Vec<String>,
    },
    Form(String),
}

impl KeyExtractor for BodyField {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        if let Field::Form(name) = &self.field {
            // axum's `Form` reads a GET's query string, never its body (a HEAD's body, like
            // any other method's): the key is what the handler reads.
            if parts.method == http::Method::GET {
                let query = parts.uri.query().unwrap_or("");
                let value = form_urlencoded::parse(query.as_bytes())
                    .filter(|(k, _)| k == name)
                    .last()?
                    .1;
                return self.key(&value);
            }
        }
        let Some(body) = parts.extensions.get::<BufferedBody>() else {
            if self.unreadable(parts) {
                return None;
            }
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "fleetlimit: a key comes from the request body but no BufferBodyLayer read \
                     it; add one outside the rate-limit layer"
                );
            }
            return None;
        };
        let value = match &self.field {
            Field::Json { path, .. } => std::borrow::Cow::Owned(json_at(body.bytes(), path)?),
            Field::Form(name) => {
                form_urlencoded::parse(body.bytes())
                    .filter(|(k, _)| k == name)
                    .last()?
                    .1
            }
        };
        self.key(&value)
    }

    fn check(&self) -> Result<(), ConfigError> {
        match &self.field {
            Field::Json { pointer, .. } if pointer.len() <= 1 => Err(ConfigError::Invalid {
                setting: "json_field",
                reason: "name a field".into(),
            }),
            Field::Form(name) if name.is_empty() => Err(ConfigError::Invalid {
                setting: "form_field",
                reason: "name a field".into(),
            }),
            _ => Ok(()),
        }
    }

    fn chosen_by_client(&self) -> bool {
        true
    }

    /// A gRPC call's body is a stream, never buffered; but a handler's JSON extractor reads one
    /// sent as `application/grpc+json`. Skipped, such a call would pass the rule unlimited.
    fn unreadable(&self, parts: &Parts) -> bool {
        matches!(self.field, Field::Json { .. })
            && parts.extensions.get::<BufferedBody>().is_none()
            && crate::layer::is_grpc(parts)
            && crate::layer::buffer::is_json(parts)
    }
}

/// The value at `path` in a JSON document (a string, or a number or boolean as JSON writes it), read in one pass that skips everything else as a
/// typed handler's parse skips fields it does not know. Parsing the whole body into a
/// `serde_json::Value` refuses what such a handler accepts (a number out of range, nesting past
/// 128 levels, bad UTF-8 in a string, all in fields the handler ignores), and a refused body
/// has no key: the rule was skipped while the handler still served the request. A field given
/// twice counts as its last, as a `Value` reads it (a typed handler refuses the body).
fn json_at(body: &[u8], path: &[String]) -> Option<String> {
    let mut document = serde_json::Deserializer::from_slice(body);
    let value = At(path).deserialize(&mut document).ok()?;
    document.end().ok()?;
    value
}

/// Finds the value at a path of object fields and array indexes; everything off the path is
/// skipped without being built.
struct At<'p>(&'p [String]);

impl<'de> DeserializeSeed<'de> for At<'_> {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for At<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Option<String>, E> {
        Ok(self
            .0
            .is_empty()
            .then(|| (if v { "true" } else { "false" }).to_owned()))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Option<String>, E> {
        Ok(self.0.is_empty().then(|| v.to_string()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Option<String>, E> {
        Ok(self.0.is_empty().then(|| v.to_string()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Option<String>, E> {
        // Written as a `Value` would write it (`1.5`, `1e300`).
        let number = serde_json::Number::from_f64(v).filter(|_| self.0.is_empty());
        Ok(number.map(|n| n.to_string()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Option<String>, E> {
        Ok(self.0.is_empty().then(|| v.to_owned()))
    }

    fn visit_unit<E>(self) -> Result<Option<String>, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<String>, A::Error> {
        let mut found = None;
        match self.0.split_first() {
            Some((field, rest)) => {
                while let Some(on_path) = map.next_key_seed(Named(field))? {
                    if on_path {
                        found = map.next_value_seed(At(rest))?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            None => while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {},
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<String>, A::Error> {
        let (index, rest) = match self.0.split_first() {
            Some((segment, rest)) => (array_index(segment), rest),
            None => (None, self.0),
        };
        let mut found = None;
        for i in 0.. {
            if Some(i) == index {
                match seq.next_element_seed(At(rest))? {
                    Some(key) => found = key,
                    None => break,
                }
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
        }
        Ok(found)
    }
}

/// A JSON pointer segment as an array index: digits without a leading zero, as RFC 6901 reads
/// them.
fn array_index(segment: &str) -> Option<usize> {
    let canonical = segment == "0" || !segment.starts_with('0');
    let digits = !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit());
    (canonical && digits)
        .then(|| segment.parse().ok())
        .flatten()
}

/// Whether an object's field name is the one on the path, without keeping the name.
struct Named<'n>(&'n str);

impl<'de> DeserializeSeed<'de> for Named<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Named<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts_with(body: &[u8]) -> Parts {
        let mut parts = http::Request::post("/").body(()).unwrap().into_parts().0;
        BufferedBody::__for_tests(&mut parts, body);
        parts
    }

    #[test]
    fn json_fields_by_name_and_pointer() {
        let p = parts_with(br#"{"account":"alice","n":7,"user":{"name":"bob"},"a/b":"c"}"#);
        assert_eq!(json_field("account").extract(&p), Some(Key::new("alice")));
        assert_eq!(json_field("n").extract(&p), Some(Key::new("7")));
        assert_eq!(json_field("/user/name").extract(&p), Some(Key::new("bob")));
        assert_eq!(json_field("a/b").extract(&p), Some(Key::new("c")));
        assert_eq!(json_field("user").extract(&p), None, "an object is no key");
        assert_eq!(json_field("missing").extract(&p), None);
        assert_eq!(
            json_field("account").extract(&parts_with(b"{not json")),
            None
        );
        assert_eq!(json_field("account").extract(&parts_with(b"")), None);
        let unread = http::Request::post("/").body(()).unwrap().into_parts().0;
        assert_eq!(json_field("account").extract(&unread), None);
        assert!(json_field("").check().is_err());
    }

    /// Spellings of one account that the application reads alike share one key once
    /// normalised, in JSON and in forms; what normalises to nothing is no key.
    #[test]
    fn normalised_fields_give_one_account_one_key() {
        let lower = |name: &str| name.trim().to_lowercase();
        let json = json_field("account").normalized(lower);
        for spelling in ["alice", "Alice", " ALICE", "alice\\t"] {
            let body = format!(r#"{{"account":"{spelling}"}}"#);
            assert_eq!(
                json.extract(&parts_with(body.as_bytes())),
                Some(Key::new("alice")),
                "{spelling}"
            );
        }
        assert_eq!(json.extract(&parts_with(br#"{"account":"  "}"#)), None);
        assert_eq!(
            json.extract(&parts_with(br#"{"account":7}"#)),
            Some(Key::new("7"))
        );
        let form = form_field("user").normalized(lower);
        assert_eq!(
            form.extract(&parts_with(b"user=+Bob%20")),
            Some(Key::new("bob"))
        );
        assert_eq!(form.extract(&parts_with(b"user=")), None);
        // Without it, each spelling is a key of its own.
        assert_ne!(
            json_field("account").extract(&parts_with(br#"{"account":"Alice"}"#)),
            Some(Key::new("alice"))
        );
    }

    #[test]
    fn what_a_typed_handler_skips_never_hides_the_key() {
        let deep = format!(
            r#"{{"pad":{}{},"account":"a"}}"#,
            "[".repeat(300),
            "]".repeat(300)
        );
        let mut bad_utf8 = br#"{"pad":""#.to_vec();
        bad_utf8.extend_from_slice(b"\xff\",\"account\":\"a\"}");
        for body in [
            br#"{"pad":1e400,"account":"a"}"#.to_vec(),
            br#"{"pad":-1e400,"account":"a","more":123456789012345678901234567890}"#.to_vec(),
            deep.into_bytes(),
            bad_utf8,
            br#"{"account":"b","account":"a"}"#.to_vec(),
        ] {
            let text = String::from_utf8_lossy(&body).into_owned();
            assert_eq!(
                json_field("account").extract(&parts_with(&body)),
                Some(Key::new("a")),
                "{text}"
            );
        }
    }

    #[test]
    fn json_pointers_into_arrays_and_escaped_names() {
        let p = parts_with(br#"{"items":[{"id":1},{"id":"two"}],"a~b":{"c/d":1.5},"e":null}"#);
        assert_eq!(json_field("/items/1/id").extract(&p), Some(Key::new("two")));
        assert_eq!(json_field("/items/0/id").extract(&p), Some(Key::new("1")));
        assert_eq!(json_field("/items/01/id").extract(&p), None, "not an index");
        assert_eq!(json_field("/items/2/id").extract(&p), None);
        assert_eq!(json_field("/a~0b/c~1d").extract(&p), Some(Key::new("1.5")));
        assert_eq!(json_field("e").extract(&p), None, "null is no key");
        assert_eq!(json_field("items").extract(&p), None, "an array is no key");
        let trailing = parts_with(br#"{"account":"a"} x"#);
        assert_eq!(
            json_field("account").extract(&trailing),
            None,
            "not one document"
        );
    }

    #[test]
    fn form_fields_decoded() {
        let p = parts_with(b"user=eve&user=al%20ice&empty=");
        assert_eq!(
            form_field("user").extract(&p),
            Some(Key::new("al ice")),
            "the last, as a map reads it"
        );
        assert_eq!(form_field("empty").extract(&p), None);
        assert_eq!(form_field("none").extract(&p), None);
    }
}
