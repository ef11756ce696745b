//! The Python literals a `.npy` header is made of (strings, integers, `True`/`False`/`None`,
//! tuples, lists and dicts), parsed by the `py_literal` crate behind the limits this tool
//! keeps: its input is the header (at most [`MAX_HEADER_LEN`](super::npy::MAX_HEADER_LEN)
//! bytes, checked before), the nesting depth is capped *before* the crate sees the text (its
//! parser recurses once per level), and errors say where, in the header's own terms.
//!
//! A light scan ahead of the crate ([`scan`]) follows strings and brackets only: it enforces
//! the depth, reports unclosed strings and brackets, and writes what NumPy's own reader
//! tolerates in the form the crate reads (line breaks outside strings become spaces, and
//! Python 2's `L` after an integer is dropped), byte for byte in place so positions hold.

use py_literal::Value;

/// Parses `text` as one literal followed only by whitespace, nested at most `max_depth` deep.
pub(super) fn parse(text: &str, max_depth: usize) -> Result<Lit, String> {
    let scanned = scan(text, max_depth)?;
    let value: Value = scanned
        .parse()
        .map_err(|e: py_literal::ParseError| syntax_error(&scanned, &e.to_string()))?;
    lit(value)
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

/// The crate's value as a [`Lit`]; the literals a header never holds are errors.
fn lit(value: Value) -> Result<Lit, String> {
    let items = |items: Vec<Value>| items.into_iter().map(lit).collect::<Result<Vec<_>, _>>();
    Ok(match value {
        Value::String(s) => Lit::Str(s),
        Value::Integer(n) => Lit::Int(
            i128::try_from(&n)
                .map_err(|_| "a number in its header is too large (over 38 digits)".to_owned())?,
        ),
        Value::Boolean(b) => Lit::Bool(b),
        Value::None => Lit::None,
        Value::Tuple(v) => Lit::Tuple(items(v)?),
        Value::List(v) => Lit::List(items(v)?),
        Value::Dict(entries) => Lit::Dict(
            entries
                .into_iter()
                .map(|(k, v)| Ok((lit(k)?, lit(v)?)))
                .collect::<Result<_, String>>()?,
        ),
        Value::Float(x) => {
            return Err(format!(
                "unexpected number {x} in its header: sizes are integers (expected ',' or a \
                 closing bracket after the digits)"
            ));
        }
        Value::Complex(_) => return Err("unexpected complex number in its header".to_owned()),
        Value::Bytes(_) => return Err("unexpected bytes literal in its header".to_owned()),
        Value::Set(_) => return Err("unexpected set in its header".to_owned()),
    })
}

/// Checks nesting, strings and brackets, and returns the text the crate parses: the same
/// bytes except line breaks outside strings (spaces) and Python 2's `L` suffix of integers
/// (a space).
fn scan(text: &str, max_depth: usize) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = bytes.to_vec();
    // The closing bracket of each open one, innermost last.
    let mut open: Vec<u8> = Vec::new();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let starts_value = matches!(b, b'\'' | b'"' | b'(' | b'[' | b'{' | b'+' | b'-')
            || b.is_ascii_alphanumeric();
        if starts_value && open.len() >= max_depth {
            return Err(format!("its header nests deeper than {max_depth} levels"));
        }
        match b {
            b'\'' | b'"' => {
                i = string_end(bytes, i)?;
                continue;
            }
            b'(' => open.push(b')'),
            b'[' => open.push(b']'),
            b'{' => open.push(b'}'),
            // A mismatched bracket is the crate's to report, with its position.
            b')' | b']' | b'}' => {
                open.pop();
            }
            b'\n' | b'\r' => out[i] = b' ',
            b'L' | b'l' if i > 0 && bytes[i - 1].is_ascii_digit() => out[i] = b' ',
            _ => {}
        }
        i += 1;
    }
    if let Some(&close) = open.last() {
        return Err(format!(
            "expected ',' or '{}', found end of its header",
            char::from(close)
        ));
    }
    // Only ASCII bytes were replaced, by ASCII: still UTF-8.
    String::from_utf8(out).map_err(|e| format!("its header is not text: {e}"))
}

/// Where the string opening at `start` ends (after its closing quote); a backslash escapes
/// the byte after it.
fn string_end(bytes: &[u8], start: usize) -> Result<usize, String> {
    let quote = bytes[start];
    let mut i = start + 1;
    loop {
        match bytes.get(i) {
            None => {
                return Err(format!(
                    "a string at byte {start} of its header is never closed"
                ));
            }
            Some(b'\\') => i += 2,
            Some(&b) if b == quote => return Ok(i + 1),
            Some(_) => i += 1,
        }
    }
}

/// The crate's syntax error as this tool says it: what was found where. The crate gives the
/// position as `--> line:column` (columns in characters, from 1) in its message.
fn syntax_error(text: &str, message: &str) -> String {
    let Some(pos) = error_position(text, message) else {
        let first = message.lines().next().unwrap_or_default();
        return format!("its header is not a Python literal ({first})");
    };
    // A string's body is the last thing the crate tried when the error follows it: name what
    // comes after the string instead.
    let pos = match string_ending_at(text.as_bytes(), pos) {
        Some(end) => end + count_spaces(&text.as_bytes()[end..]),
        None => pos,
    };
    let rest = text.get(pos..).unwrap_or_default();
    let Some(c) = rest.chars().next() else {
        return "unexpected end of its header".to_owned();
    };
    let found = match c.is_ascii_alphabetic() {
        true => {
            let word: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .take(32)
                .collect();
            format!("name {word:?}")
        }
        false => format!("{c:?}"),
    };
    match depth_at(text.as_bytes(), pos) {
        0 if text.get(..pos).is_some_and(|s| s.trim_start().is_empty()) => {
            format!("unexpected {found} at byte {pos} of its header")
        }
        0 => format!("unexpected {found} at byte {pos} after its header dict"),
        _ => format!("unexpected {found} at byte {pos} of its header"),
    }
}

/// The byte offset of the crate's `--> line:column`, if the message has one inside `text`.
fn error_position(text: &str, message: &str) -> Option<usize> {
    let (_, at) = message.split_once("--> ")?;
    let at = at.split_whitespace().next()?;
    let (line, column) = at.split_once(':')?;
    let (line, column): (usize, usize) = (line.parse().ok()?, column.parse().ok()?);
    let start: usize = text
        .split_inclusive('\n')
        .take(line.checked_sub(1)?)
        .map(str::len)
        .sum();
    let line_text = text.get(start..)?;
    let offset = match line_text.char_indices().nth(column.checked_sub(1)?) {
        Some((offset, _)) => offset,
        None => line_text.len(),
    };
    Some(start + offset)
}

/// If a string (outside any other) closes with the quote at `pos`, the byte after it.
fn string_ending_at(bytes: &[u8], pos: usize) -> Option<usize> {
    let mut i = 0;
    while i < pos {
        match bytes[i] {
            b'\'' | b'"' => {
                let end = string_end(bytes, i).ok()?;
                if end == pos + 1 {
                    return Some(end);
                }
                i = end;
            }
            _ => i += 1,
        }
    }
    None
}

/// How many brackets are open (outside strings) before `pos`.
fn depth_at(bytes: &[u8], pos: usize) -> usize {
    let (mut depth, mut i) = (0usize, 0);
    while i < pos {
        match bytes[i] {
            b'\'' | b'"' => {
                i = string_end(bytes, i).unwrap_or(bytes.len());
                continue;
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    depth
}

fn count_spaces(bytes: &[u8]) -> usize {
    bytes.iter().take_while(|b| b.is_ascii_whitespace()).count()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

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

    /// NumPy's reader takes a header over several lines, and Python 2's `3L` (files written
    /// by Python 2 NumPy); so does this one.
    #[test]
    fn line_breaks_and_python2_longs_are_tolerated() {
        assert_eq!(
            ok("{'shape':\r\n (3L, 4L),\n}\n"),
            Lit::Dict(vec![(
                Lit::Str("shape".into()),
                Lit::Tuple(vec![Lit::Int(3), Lit::Int(4)])
            )])
        );
    }

    #[test]
    fn strings_keep_escaped_characters() {
        assert_eq!(ok(r#"'a\'b'"#), Lit::Str("a'b".into()));
        assert_eq!(ok(r#""a'b\"c""#), Lit::Str("a'b\"c".into()));
        assert_eq!(ok("'é'"), Lit::Str("é".into()));
        assert_eq!(ok("'[(('"), Lit::Str("[((".into()));
        assert_eq!(ok("None"), Lit::None);
    }

    #[test]
    fn bad_input_says_where() {
        assert!(err("'abc").contains("never closed"));
        assert!(err("'abc\\").contains("never closed"));
        assert_eq!(err("(1 2)"), "unexpected '2' at byte 3 of its header");
        assert_eq!(err("{'a' 1}"), "unexpected '1' at byte 5 of its header");
        assert_eq!(
            err("{'a': 1} 2"),
            "unexpected '2' at byte 9 after its header dict"
        );
        assert_eq!(
            err("true"),
            "unexpected name \"true\" at byte 0 of its header"
        );
        assert_eq!(err("-"), "unexpected end of its header");
        assert_eq!(err(""), "unexpected end of its header");
        assert_eq!(err("(,)"), "unexpected ',' at byte 1 of its header");
        assert_eq!(err("(1,"), "expected ',' or ')', found end of its header");
        assert!(err("(1.5,)").contains("expected ','"));
        assert!(err("{1, 2}").contains("set"));
        assert!(err(&"9".repeat(40)).contains("too large"));
    }

    #[test]
    fn nesting_is_bounded() {
        // (Python reads `(())` as `()` in parentheses, not as a tuple in a tuple: lists.)
        assert!(matches!(
            ok(&format!("{}{}", "[".repeat(8), "]".repeat(8))),
            Lit::List(_)
        ));
        // A value inside the eighth level is a ninth.
        let ninth = format!("{}1{}", "(".repeat(8), ",)".repeat(8));
        assert!(err(&ninth).contains("deeper than 8"));
        // Deep enough to overflow the crate's recursive parser, were it let in.
        let deep = format!("{}{}", "[".repeat(60_000), "]".repeat(60_000));
        assert!(err(&deep).contains("deeper than 8"));
        let strings = format!("['{}']", "[".repeat(100));
        assert_eq!(ok(&strings), Lit::List(vec![Lit::Str("[".repeat(100))]));
    }

    proptest! {
        /// Any text up to a header's size, of the characters headers are made of and others:
        /// a literal or an error, never a panic or a stack overflow.
        #[test]
        fn arbitrary_text_never_panics(
            tokens in proptest::collection::vec(
                prop_oneof![
                    Just("{"), Just("}"), Just("("), Just(")"), Just("["), Just("]"),
                    Just(","), Just(":"), Just("'"), Just("\""), Just("\\"), Just(" "),
                    Just("\n"), Just("L"), Just("1"), Just("-"), Just("."), Just("e"),
                    Just("j"), Just("b"), Just("0x"), Just("True"), Just("None"),
                    Just("é"), Just("\u{0}"), Just("'''"),
                ],
                0..200,
            ),
            depth in 1usize..12,
        ) {
            let _ = parse(&tokens.concat(), depth);
        }

        #[test]
        fn arbitrary_strings_never_panic(text in any::<String>()) {
            let _ = parse(&text, 8);
        }
    }
}
