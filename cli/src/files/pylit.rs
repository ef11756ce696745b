//! A parser for the few Python literals a `.npy` header is made of: strings, integers,
//! `True`/`False`/`None`, tuples, lists and dicts. Bounded: its input is the header (at most
//! [`MAX_HEADER_LEN`](super::npy::MAX_HEADER_LEN) bytes) and the nesting depth is capped.

/// Parses `text` as one literal followed only by whitespace, nested at most `max_depth` deep.
pub(super) fn parse(text: &str, max_depth: usize) -> Result<Lit, String> {
    Parser {
        text,
        pos: 0,
        max_depth,
    }
    .document()
}

impl Lit {
    /// What kind of value this is, for errors ("a tuple").
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Lit::Str(_) => "a string",
            Lit::Int(_) => "a number",
            Lit::Bool(_) => "a bool",
            Lit::None => "None",
            Lit::Tuple(_) => "a tuple",
            Lit::List(_) => "a list",
            Lit::Dict(_) => "a dict",
        }
    }
}

/// A Python literal, as far as `.npy` headers use them.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Lit {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Lit>),
    List(Vec<Lit>),
    Dict(Vec<(Lit, Lit)>),
}

/// A recursive-descent parser over `text`, at byte `pos`.
struct Parser<'a> {
    text: &'a str,
    pos: usize,
    max_depth: usize,
}

impl Parser<'_> {
    /// The whole header: one literal, then only whitespace (the padding).
    fn document(&mut self) -> Result<Lit, String> {
        let lit = self.value(0)?;
        self.skip_space();
        match self.peek() {
            None => Ok(lit),
            Some(_) => Err(format!("unexpected {} after its header dict", self.here())),
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    /// The character at the cursor, for errors.
    fn here(&self) -> String {
        match self.text.get(self.pos..).and_then(|s| s.chars().next()) {
            Some(c) => format!("{c:?} at byte {}", self.pos),
            None => "end".to_owned(),
        }
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn value(&mut self, depth: usize) -> Result<Lit, String> {
        if depth >= self.max_depth {
            return Err(format!(
                "its header nests deeper than {} levels",
                self.max_depth
            ));
        }
        self.skip_space();
        match self.peek() {
            Some(quote @ (b'\'' | b'"')) => self.string(quote).map(Lit::Str),
            Some(b'(') => self.items(b')', depth).map(Lit::Tuple),
            Some(b'[') => self.items(b']', depth).map(Lit::List),
            Some(b'{') => self.dict(depth),
            Some(c) if c.is_ascii_digit() || c == b'-' || c == b'+' => self.int(),
            Some(c) if c.is_ascii_alphabetic() => self.word(),
            _ => Err(format!("unexpected {} of its header", self.here())),
        }
    }

    /// A quoted string; a backslash keeps the character after it.
    fn string(&mut self, quote: u8) -> Result<String, String> {
        let start = self.pos;
        self.pos += 1;
        let mut out = String::new();
        loop {
            let rest = self.text.get(self.pos..).unwrap_or("");
            let mut chars = rest.chars();
            match chars.next() {
                None => {
                    return Err(format!(
                        "a string at byte {start} of its header is never closed"
                    ));
                }
                Some(c) if c == char::from(quote) => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some('\\') => match chars.next() {
                    Some(c) => {
                        out.push(c);
                        self.pos += 1 + c.len_utf8();
                    }
                    None => self.pos += 1,
                },
                Some(c) => {
                    out.push(c);
                    self.pos += c.len_utf8();
                }
            }
        }
    }

    /// An integer, with Python 2's `L` suffix allowed.
    fn int(&mut self) -> Result<Lit, String> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if matches!(self.peek(), Some(b'-' | b'+')) {
            self.pos += 1;
        }
        let digits_start = self.pos;
        let mut n: i128 = 0;
        while let Some(c) = self.peek().filter(u8::is_ascii_digit) {
            n = n
                .checked_mul(10)
                .and_then(|n| n.checked_add(i128::from(c - b'0')))
                .ok_or_else(|| format!("the number at byte {start} of its header is too large"))?;
            self.pos += 1;
        }
        if self.pos == digits_start {
            return Err(format!("unexpected {} of its header", self.here()));
        }
        if matches!(self.peek(), Some(b'L' | b'l')) {
            self.pos += 1;
        }
        Ok(Lit::Int(if negative { -n } else { n }))
    }

    /// `True`, `False` or `None`.
    fn word(&mut self) -> Result<Lit, String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        {
            self.pos += 1;
        }
        match &self.text[start..self.pos] {
            "True" => Ok(Lit::Bool(true)),
            "False" => Ok(Lit::Bool(false)),
            "None" => Ok(Lit::None),
            word => Err(format!(
                "unexpected name {:?} at byte {start} of its header",
                word.chars().take(32).collect::<String>()
            )),
        }
    }

    /// The items of a tuple or list up to `close`, a trailing comma allowed.
    fn items(&mut self, close: u8, depth: usize) -> Result<Vec<Lit>, String> {
        self.pos += 1;
        let mut items = Vec::new();
        loop {
            self.skip_space();
            if self.peek() == Some(close) {
                self.pos += 1;
                return Ok(items);
            }
            items.push(self.value(depth + 1)?);
            self.skip_space();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(c) if c == close => {}
                _ => {
                    return Err(format!(
                        "expected ',' or '{}', found {} of its header",
                        char::from(close),
                        self.here()
                    ));
                }
            }
        }
    }

    /// `{key: value, ...}`, a trailing comma allowed.
    fn dict(&mut self, depth: usize) -> Result<Lit, String> {
        self.pos += 1;
        let mut entries = Vec::new();
        loop {
            self.skip_space();
            if self.peek() == Some(b'}') {
                self.pos += 1;
                return Ok(Lit::Dict(entries));
            }
            let key = self.value(depth + 1)?;
            self.skip_space();
            if self.peek() != Some(b':') {
                return Err(format!(
                    "expected ':' after a dict key, found {} of its header",
                    self.here()
                ));
            }
            self.pos += 1;
            let value = self.value(depth + 1)?;
            entries.push((key, value));
            self.skip_space();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {}
                _ => {
                    return Err(format!(
                        "expected ',' or '}}', found {} of its header",
                        self.here()
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Lit {
        parse(text, 8).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn err(text: &str) -> String {
        parse(text, 8).expect_err(text)
    }

    #[test]
    fn tuples_are_spelled_as_python_spells_them() {
        assert_eq!(ok("()"), Lit::Tuple(vec![]));
        assert_eq!(ok("(6,)"), Lit::Tuple(vec![Lit::Int(6)]));
        assert_eq!(
            ok(" ( 2 , 3 ) "),
            Lit::Tuple(vec![Lit::Int(2), Lit::Int(3)])
        );
        assert_eq!(
            ok("[1, -2L, +3]"),
            Lit::List(vec![Lit::Int(1), Lit::Int(-2), Lit::Int(3)])
        );
    }

    #[test]
    fn a_numpy_header_parses() {
        let lit = ok("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }   \n");
        let Lit::Dict(entries) = lit else {
            panic!("not a dict")
        };
        assert_eq!(
            entries,
            [
                (Lit::Str("descr".into()), Lit::Str("<f4".into())),
                (Lit::Str("fortran_order".into()), Lit::Bool(false)),
                (
                    Lit::Str("shape".into()),
                    Lit::Tuple(vec![Lit::Int(2), Lit::Int(3)])
                ),
            ]
        );
    }

    #[test]
    fn strings_keep_escaped_characters() {
        assert_eq!(ok(r#"'a\'b'"#), Lit::Str("a'b".into()));
        assert_eq!(ok(r#""a'b\"c""#), Lit::Str("a'b\"c".into()));
        assert_eq!(ok("'é'"), Lit::Str("é".into()));
        assert_eq!(ok("None"), Lit::None);
    }

    #[test]
    fn bad_input_says_where() {
        assert!(err("'abc").contains("never closed"));
        assert!(err("'abc\\").contains("never closed"));
        assert!(err("(1 2)").contains("expected ',' or ')'"));
        assert!(err("{'a' 1}").contains("expected ':'"));
        assert!(err("{'a': 1} 2").contains("after its header dict"));
        assert!(err("true").contains("unexpected name \"true\""));
        assert!(err("-").contains("unexpected"));
        assert!(err("").contains("unexpected end of its header"));
        assert!(err("(,)").contains("unexpected ','"));
        assert!(err(&"9".repeat(40)).contains("too large"));
    }

    #[test]
    fn nesting_is_bounded() {
        assert!(matches!(
            ok(&format!("{}{}", "(".repeat(8), ")".repeat(8))),
            Lit::Tuple(_)
        ));
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(err(&deep).contains("deeper than 8"));
    }
}
