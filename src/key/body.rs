//! Keys from the request body, as [`BufferBodyLayer`](crate::layer::BufferBodyLayer) read it.

use std::sync::atomic::{AtomicBool, Ordering};

use http::request::Parts;

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
    BodyField {
        field: Field::Json(pointer),
        warned: AtomicBool::new(false),
    }
}

/// A field of an `application/x-www-form-urlencoded` body as the key (the first occurrence,
/// percent-decoded; an empty value is no key). Like [`json_field`], it needs a
/// [`BufferBodyLayer`](crate::layer::BufferBodyLayer) outside the rate-limit layer.
pub fn form_field(name: &str) -> BodyField {
    BodyField {
        field: Field::Form(name.to_owned()),
        warned: AtomicBool::new(false),
    }
}

/// A [`KeyExtractor`] reading a field of the request body; see [`json_field`] and
/// [`form_field`].
#[derive(Debug)]
pub struct BodyField {
    field: Field,
    warned: AtomicBool,
}

#[derive(Debug, Clone)]
enum Field {
    Json(String),
    Form(String),
}

impl KeyExtractor for BodyField {
    fn extract(&self, parts: &Parts) -> Option<Key> {
        let Some(body) = parts.extensions.get::<BufferedBody>() else {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "fleetlimit: a key comes from the request body but no BufferBodyLayer read \
                     it; add one outside the rate-limit layer"
                );
            }
            return None;
        };
        match &self.field {
            Field::Json(pointer) => {
                let value: serde_json::Value = serde_json::from_slice(body.bytes()).ok()?;
                match value.pointer(pointer)? {
                    serde_json::Value::String(s) if !s.is_empty() => Some(Key::new(s)),
                    serde_json::Value::Number(n) => Some(Key::new(n.to_string())),
                    serde_json::Value::Bool(b) => Some(Key::new(if *b { "true" } else { "false" })),
                    _ => None,
                }
            }
            Field::Form(name) => form_urlencoded::parse(body.bytes())
                .find(|(k, _)| k == name)
                .filter(|(_, v)| !v.is_empty())
                .map(|(_, v)| Key::new(v.as_bytes())),
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        match &self.field {
            Field::Json(p) if p.len() <= 1 => Err(ConfigError::Invalid {
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

    #[test]
    fn form_fields_decoded() {
        let p = parts_with(b"user=al%20ice&user=eve&empty=");
        assert_eq!(form_field("user").extract(&p), Some(Key::new("al ice")));
        assert_eq!(form_field("empty").extract(&p), None);
        assert_eq!(form_field("none").extract(&p), None);
    }
}
