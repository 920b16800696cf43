//! The optional API key of the inference endpoints, as vLLM's `--api-key`: a client presents
//! it as `Authorization: Bearer <key>` over HTTP, or as the same `authorization` metadata over
//! gRPC. Health, readiness and metrics stay open, so probes and scrapers need no key.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use subtle::ConstantTimeEq;

/// The HTTP header, and the gRPC metadata key, that carries the key.
pub const AUTHORIZATION: &str = "authorization";

/// What a refused request is told: neither the key nor what the client sent is echoed.
pub const UNAUTHENTICATED_MESSAGE: &str =
    "a valid API key is required: send it as 'Authorization: Bearer <key>'";

/// The OpenAI error `code` of a refused request.
pub const INVALID_API_KEY_CODE: &str = "invalid_api_key";

/// An API key. Its `Debug` form hides the key, so logging the settings that hold it is safe.
#[derive(Clone)]
pub struct ApiKey(Arc<[u8]>);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the API key must not be empty or contain whitespace or control characters")]
pub struct InvalidApiKey;

impl FromStr for ApiKey {
    type Err = InvalidApiKey;

    fn from_str(key: &str) -> Result<Self, Self::Err> {
        // Such a key could not travel in an `Authorization` header as sent.
        if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(InvalidApiKey);
        }
        Ok(ApiKey(key.as_bytes().into()))
    }
}

impl ApiKey {
    /// Whether an `authorization` value presents this key. The comparison takes the same time
    /// whichever byte differs, so the key cannot be guessed a byte at a time by timing.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(value) = authorization else {
            return false;
        };
        // The scheme is case-insensitive (RFC 9110, section 11.1).
        let Some(token) = value
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|_| &value[7..])
        else {
            return false;
        };
        token.ct_eq(&self.0).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_key_is_accepted() {
        let key: ApiKey = "s3cret".parse().unwrap();
        assert!(key.accepts(Some(b"Bearer s3cret")));
        assert!(key.accepts(Some(b"bearer s3cret")));
        for refused in [
            None,
            Some(&b""[..]),
            Some(b"s3cret"),
            Some(b"Bearer "),
            Some(b"Bearer s3cre"),
            Some(b"Bearer s3cret2"),
            Some(b"Basic s3cret"),
            Some(b"Bearer  s3cret"),
        ] {
            assert!(!key.accepts(refused), "{refused:?}");
        }
    }

    #[test]
    fn the_key_is_not_shown_and_must_be_sendable() {
        let key: ApiKey = "s3cret".parse().unwrap();
        assert!(!format!("{key:?}").contains("s3cret"));
        for bad in ["", "a b", "a\nb"] {
            assert_eq!(bad.parse::<ApiKey>().unwrap_err(), InvalidApiKey);
        }
    }
}
