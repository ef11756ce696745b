//! [`TensorName`] and [`NamePattern`]: validated names like `model/layer1/w`, and the patterns
//! subscribers use (`model/*`).

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// Longest name, in bytes.
pub const MAX_NAME_LEN: usize = 256;

/// The prefix of names under which a node lends a tensor to one peer (tb-node's
/// `Node::lend`): private names, never published or stored.
pub const LEND_PREFIX: &str = ".tb/lend/";

const RULE: &str = "names are 1..=256 bytes of [A-Za-z0-9._:/-], '/' separating non-empty levels";

/// What is wrong with a tensor name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name is empty.
    #[error("empty name ({RULE})")]
    Empty,
    /// Over [`MAX_NAME_LEN`] bytes.
    #[error("name of {len} bytes is too long ({RULE})")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A character outside the allowed set.
    #[error("character {ch:?} at byte {pos} is not allowed ({RULE})")]
    BadChar {
        /// The character.
        ch: char,
        /// Its byte offset.
        pos: usize,
    },
    /// A leading, trailing or doubled `/`.
    #[error("empty level: leading, trailing or doubled '/' ({RULE})")]
    EmptyLevel,
}

/// A validated tensor name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TensorName(String);

fn allowed(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | ':' | '/' | '-')
}

impl TensorName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        if name.is_empty() {
            return Err(NameError::Empty);
        }
        if name.len() > MAX_NAME_LEN {
            return Err(NameError::TooLong { len: name.len() });
        }
        if let Some((pos, ch)) = name.char_indices().find(|(_, c)| !allowed(*c)) {
            return Err(NameError::BadChar { ch, pos });
        }
        if name.split('/').any(str::is_empty) {
            return Err(NameError::EmptyLevel);
        }
        Ok(TensorName(name))
    }

    /// Checks a listing prefix: at most [`MAX_NAME_LEN`] bytes of name characters. Unlike a
    /// name it may be empty (everything) and may end mid-level or in `/`.
    pub fn validate_prefix(prefix: &str) -> Result<(), NameError> {
        if prefix.len() > MAX_NAME_LEN {
            return Err(NameError::TooLong { len: prefix.len() });
        }
        match prefix.char_indices().find(|(_, c)| !allowed(*c)) {
            Some((pos, ch)) => Err(NameError::BadChar { ch, pos }),
            None => Ok(()),
        }
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for TensorName {
    type Err = NameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TensorName::new(s)
    }
}

impl AsRef<str> for TensorName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for TensorName {
    type Error = NameError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        TensorName::new(s)
    }
}

impl From<TensorName> for String {
    fn from(n: TensorName) -> String {
        n.0
    }
}

/// A subscription pattern: an exact name, or a prefix ending in `/*` (`*` alone: everything).
///
/// Parse it from a string; a hand-built `Prefix` must be empty or end in `/`, or it would
/// match across a level boundary (`model` would match `modelx/a`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum NamePattern {
    /// Exactly this name.
    Exact(TensorName),
    /// Every name under this prefix (stored with its trailing `/`; empty for `*`).
    Prefix(String),
}

impl NamePattern {
    /// Whether `name` matches.
    pub fn matches(&self, name: &TensorName) -> bool {
        match self {
            NamePattern::Exact(n) => n == name,
            NamePattern::Prefix(p) => name.as_str().starts_with(p.as_str()),
        }
    }
}

impl FromStr for NamePattern {
    type Err = NameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "*" {
            return Ok(NamePattern::Prefix(String::new()));
        }
        match s.strip_suffix("/*") {
            Some(prefix) => {
                let name = TensorName::new(prefix)?;
                Ok(NamePattern::Prefix(format!("{name}/")))
            }
            None => Ok(NamePattern::Exact(TensorName::new(s)?)),
        }
    }
}

impl fmt::Display for NamePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NamePattern::Exact(n) => write!(f, "{n}"),
            NamePattern::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

impl TryFrom<String> for NamePattern {
    type Error = NameError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<NamePattern> for String {
    fn from(p: NamePattern) -> String {
        p.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_rules() {
        for ok in ["w", "model/layer1/w", "a.b_c:d-e", &"x".repeat(256)] {
            assert!(TensorName::new(ok).is_ok(), "{ok}");
        }
        assert_eq!(TensorName::new(""), Err(NameError::Empty));
        assert_eq!(
            TensorName::new("x".repeat(257)),
            Err(NameError::TooLong { len: 257 })
        );
        assert_eq!(
            TensorName::new("a b"),
            Err(NameError::BadChar { ch: ' ', pos: 1 })
        );
        assert_eq!(
            TensorName::new("é"),
            Err(NameError::BadChar { ch: 'é', pos: 0 })
        );
        for bad in ["/a", "a/", "a//b", "/"] {
            assert_eq!(TensorName::new(bad), Err(NameError::EmptyLevel), "{bad}");
        }
    }

    #[test]
    fn prefixes_allow_partial_levels_but_not_other_characters() {
        for ok in ["", "m", "model/", "model/la", &"x".repeat(MAX_NAME_LEN)] {
            assert_eq!(TensorName::validate_prefix(ok), Ok(()), "{ok}");
        }
        assert_eq!(
            TensorName::validate_prefix(&"x".repeat(MAX_NAME_LEN + 1)),
            Err(NameError::TooLong { len: 257 })
        );
        assert_eq!(
            TensorName::validate_prefix("model/*"),
            Err(NameError::BadChar { ch: '*', pos: 6 })
        );
    }

    #[test]
    fn patterns_match_levels() {
        let n = |s: &str| TensorName::new(s).expect("name");
        let p: NamePattern = "model/*".parse().expect("pattern");
        assert!(p.matches(&n("model/a")));
        assert!(p.matches(&n("model/a/b")));
        assert!(!p.matches(&n("model")));
        assert!(!p.matches(&n("modelx/a")));
        let all: NamePattern = "*".parse().expect("pattern");
        assert!(all.matches(&n("anything")));
        let exact: NamePattern = "model".parse().expect("pattern");
        assert!(exact.matches(&n("model")) && !exact.matches(&n("model/a")));
        assert!("model/**".parse::<NamePattern>().is_err());
        assert_eq!(p.to_string(), "model/*");
        assert_eq!(all.to_string(), "*");
        for bad in ["", "/*", "a*", "*/a", "a/*/b", "model/ *"] {
            assert!(bad.parse::<NamePattern>().is_err(), "{bad}");
        }
    }

    #[test]
    fn errors_quote_the_rule() {
        for e in [
            NameError::Empty,
            NameError::TooLong { len: 300 },
            NameError::BadChar { ch: '*', pos: 3 },
            NameError::EmptyLevel,
        ] {
            assert!(e.to_string().contains(RULE), "{e}");
        }
        assert!(
            NameError::BadChar { ch: '*', pos: 3 }
                .to_string()
                .starts_with("character '*' at byte 3")
        );
    }

    #[test]
    fn serde_goes_through_validation() {
        let n = TensorName::new("model/w").expect("name");
        let bytes = postcard::to_stdvec(&n).expect("encode");
        assert_eq!(postcard::from_bytes::<TensorName>(&bytes), Ok(n));
        let bad = postcard::to_stdvec("a//b").expect("encode");
        assert!(postcard::from_bytes::<TensorName>(&bad).is_err());
        let p: NamePattern = "model/*".parse().expect("pattern");
        let bytes = postcard::to_stdvec(&p).expect("encode");
        assert_eq!(bytes, postcard::to_stdvec("model/*").expect("encode"));
        assert_eq!(postcard::from_bytes::<NamePattern>(&bytes), Ok(p));
    }
}
