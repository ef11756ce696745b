//! Who may read the JSON API and how much the HTTP side may do at once: [`HttpOptions`].
//!
//! - A bearer token ([`HttpToken`], `--http-token-file`), when set, guards `/api/v1/*`: a
//!   request without `Authorization: Bearer <token>`, or with another token, gets 401 and
//!   `WWW-Authenticate: Bearer`. The token is kept as its BLAKE3 hash and a presented one is
//!   hashed and compared as a hash, so the comparison is constant-time and blind to length.
//!   `/metrics` stays open (Prometheus scrapes without credentials, as is conventional; it
//!   carries counts, never names), and so do `/healthz`, `/readyz` and the page's files.
//! - At most [`HttpOptions::max_in_flight`] requests are handled at once, all routes together
//!   except the health checks; one more is answered 503 at once (load shedding) rather than
//!   queued, so a flood of HTTP requests cannot pile up work behind the registry.

use std::{path::Path, path::PathBuf};

use axum::{
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};

/// Default of [`HttpOptions::max_in_flight`]: requests handled at once. Every answer comes
/// from memory (a snapshot, the metrics), so this is far more than one dashboard and a
/// Prometheus server need, and little enough that a flood stays cheap.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

/// Shortest token accepted, in bytes (the recipe below makes 44).
pub const MIN_TOKEN_LEN: usize = 16;

/// How to make a token, for error messages and docs.
pub const TOKEN_RECIPE: &str =
    "head -c 32 /dev/urandom | base64 > http_token && chmod 600 http_token";

/// How the HTTP server guards itself. `Default`: no token, [`DEFAULT_MAX_IN_FLIGHT`].
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Most requests handled at once (0 counts as 1); the next one is answered 503.
    pub max_in_flight: usize,
    /// The token `/api/v1/*` requires (`None`: open).
    pub token: Option<HttpToken>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            token: None,
        }
    }
}

/// Why a token could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The token file could not be read.
    #[error("reading the HTTP token from {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The token is too short to resist guessing.
    #[error(
        "the HTTP token is {len} bytes, fewer than {MIN_TOKEN_LEN}; make one with: {TOKEN_RECIPE}"
    )]
    TooShort {
        /// Its length.
        len: usize,
    },
    /// The token holds bytes a header cannot carry as is (spaces, controls, non-ASCII).
    #[error("the HTTP token must be printable ASCII without spaces; make one with: {TOKEN_RECIPE}")]
    NotPrintable,
}

/// The bearer token `/api/v1/*` requires, kept only as its hash.
#[derive(Clone)]
pub struct HttpToken {
    hash: blake3::Hash,
}

impl std::fmt::Debug for HttpToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HttpToken(..)")
    }
}

impl HttpToken {
    /// A token: at least [`MIN_TOKEN_LEN`] printable ASCII characters, no spaces.
    pub fn new(token: &str) -> Result<HttpToken, TokenError> {
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotPrintable);
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort { len: token.len() });
        }
        Ok(HttpToken {
            hash: blake3::hash(token.as_bytes()),
        })
    }

    /// The token in `path` (one trailing newline ignored).
    pub fn from_file(path: &Path) -> Result<HttpToken, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::File {
            path: path.to_owned(),
            source,
        })?;
        let trimmed = text.strip_suffix('\n').unwrap_or(&text);
        HttpToken::new(trimmed.strip_suffix('\r').unwrap_or(trimmed))
    }

    /// Whether `presented` is this token (constant-time: hashes are compared).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        // `blake3::Hash`'s equality is constant-time.
        blake3::hash(presented) == self.hash
    }
}

/// The credentials of an `Authorization: Bearer <token>` header, if it is one.
fn bearer(value: &HeaderValue) -> Option<&[u8]> {
    let value = value.as_bytes();
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let start = rest.iter().position(|&b| b != b' ')?;
    Some(&rest[start..])
}

/// Middleware: lets a request through only with the right bearer token.
pub(crate) async fn require_token(
    State(token): State<HttpToken>,
    request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(bearer);
    match presented {
        Some(t) if token.accepts(t) => next.run(request).await,
        Some(_) => unauthorized(
            "Bearer realm=\"tensor-broker\", error=\"invalid_token\"",
            "wrong bearer token",
        ),
        None => unauthorized(
            "Bearer realm=\"tensor-broker\"",
            "this API needs a bearer token (Authorization: Bearer <token>)",
        ),
    }
}

fn unauthorized(challenge: &'static str, body: &'static str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, challenge)],
        body,
    )
        .into_response()
}

/// What a shed request gets: 503, try again in a second.
pub(crate) async fn overloaded(_: tower::BoxError) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        "busy: too many HTTP requests at once, retry shortly",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_compared_by_hash() {
        let token = HttpToken::new("0123456789abcdef").expect("token");
        assert!(token.accepts(b"0123456789abcdef"));
        assert!(!token.accepts(b"0123456789abcdeF"));
        assert!(!token.accepts(b"0123456789abcdef0"));
        assert!(!token.accepts(b""));
        assert!(matches!(
            HttpToken::new("short"),
            Err(TokenError::TooShort { len: 5 })
        ));
        assert!(matches!(
            HttpToken::new("0123456789 abcdef"),
            Err(TokenError::NotPrintable)
        ));
        assert!(matches!(
            HttpToken::new("0123456789abcdeé"),
            Err(TokenError::NotPrintable)
        ));
        let message = TokenError::TooShort { len: 5 }.to_string();
        assert!(message.contains("/dev/urandom"), "{message}");
        assert_eq!(format!("{token:?}"), "HttpToken(..)");
    }

    #[test]
    fn token_files_lose_one_trailing_newline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("token");
        std::fs::write(&file, "0123456789abcdef\r\n").expect("write");
        let token = HttpToken::from_file(&file).expect("token");
        assert!(token.accepts(b"0123456789abcdef"));
        assert!(matches!(
            HttpToken::from_file(&dir.path().join("missing")),
            Err(TokenError::File { .. })
        ));
    }

    #[test]
    fn bearer_headers_are_parsed() {
        let h = |s: &'static str| HeaderValue::from_static(s);
        assert_eq!(bearer(&h("Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer(&h("bearer   abc")), Some(&b"abc"[..]));
        assert_eq!(bearer(&h("Basic abc")), None);
        assert_eq!(bearer(&h("Bearer")), None);
        assert_eq!(bearer(&h("Bearer ")), None);
    }
}
