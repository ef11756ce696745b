//! Reading what `deploy/` queries and what the processes export: the Prometheus text format
//! (`prometheus-parse`), the metric selectors of PromQL expressions (dashboard panels, template
//! variables, alert rules; a small scanner: no crate parses PromQL), and the Grafana dashboard
//! (`serde_json`).

use std::collections::BTreeMap;

use serde_json::Value;

// ---- The exposition format ----------------------------------------------------------------

/// Series names in a `/metrics` text, each with the label sets its samples carry.
pub type Exported = BTreeMap<String, Vec<BTreeMap<String, String>>>;

/// Adds the series of `text` to `into`. A histogram's buckets count as the `<name>_bucket`
/// series PromQL names them by (their `_sum` and `_count` come as series of their own).
pub fn parse_exposition(text: &str, into: &mut Exported) {
    let lines = text.lines().map(|line| Ok(line.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("lines of a string always read");
    for sample in scrape.samples {
        let labels: BTreeMap<String, String> = sample
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let name = match sample.value {
            prometheus_parse::Value::Histogram(_) => format!("{}_bucket", sample.metric),
            _ => sample.metric,
        };
        into.entry(name).or_default().push(labels);
    }
}

// ---- PromQL: the metric selectors of an expression ----------------------------------------

/// A vector selector in a query: a metric name and its `label="literal"` matchers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The metric name.
    pub metric: String,
    /// Its `label="literal"` matchers.
    pub equals: Vec<(String, String)>,
}

/// Keywords, aggregation operators and literals: identifiers that are not metric names.
const PROMQL_WORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "atan2",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "inf",
    "nan",
];

/// Words followed by a parenthesised list of label names, not expressions.
const LABEL_LIST_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// A small cursor over PromQL text.
struct Lexer<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Lexer<'a> {
    fn new(s: &'a str) -> Self {
        Lexer {
            s: s.as_bytes(),
            i: 0,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(c) = self.peek() {
            if c.is_ascii_whitespace() {
                self.i += 1;
            } else if c == b'#' {
                while self.peek().is_some_and(|c| c != b'\n') {
                    self.i += 1;
                }
            } else {
                break;
            }
        }
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_ws();
        if self.s[self.i..].starts_with(token.as_bytes()) {
            self.i += token.len();
            true
        } else {
            false
        }
    }

    fn ident(&mut self) -> Option<String> {
        self.skip_ws();
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
        {
            self.i += 1;
        }
        (self.i > start).then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    /// A quoted string (`"`, `'` or backtick), unescaped.
    fn string(&mut self) -> Option<String> {
        self.skip_ws();
        let quote = self.peek().filter(|c| matches!(c, b'"' | b'\'' | b'`'))?;
        self.i += 1;
        let mut out = Vec::new();
        while let Some(c) = self.peek() {
            self.i += 1;
            if c == quote {
                return Some(String::from_utf8_lossy(&out).into_owned());
            }
            if c == b'\\' && quote != b'`' {
                if let Some(n) = self.peek() {
                    self.i += 1;
                    out.push(match n {
                        b'n' => b'\n',
                        b't' => b'\t',
                        other => other,
                    });
                }
            } else {
                out.push(c);
            }
        }
        None
    }

    /// Skips a bracketed group starting at the opening byte, nesting and strings included.
    fn skip_group(&mut self, open: u8, close: u8) {
        let mut depth = 0usize;
        while let Some(c) = self.peek() {
            if matches!(c, b'"' | b'\'' | b'`') {
                let _ = self.string();
                continue;
            }
            self.i += 1;
            if c == open {
                depth += 1;
            } else if c == close {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return;
                }
            }
        }
    }

    /// `{label op "value", ...}`: the `=` matchers with their values.
    fn matchers(&mut self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        self.i += 1; // '{'
        loop {
            if self.eat("}") {
                break;
            }
            let Some(label) = self.ident() else {
                self.skip_group(b'{', b'}');
                break;
            };
            let op = ["=~", "!~", "!=", "="]
                .into_iter()
                .find(|op| self.eat(op))
                .unwrap_or("?");
            let value = self.string().unwrap_or_default();
            if op == "=" {
                out.push((label, value));
            }
            if !self.eat(",") {
                let _ = self.eat("}");
                break;
            }
        }
        out
    }
}

/// Every vector selector with a metric name in a PromQL expression.
pub fn selectors(expr: &str) -> Vec<Selector> {
    let mut lx = Lexer::new(expr);
    let mut out = Vec::new();
    let mut steps = 0usize;
    while let Some(c) = {
        lx.skip_ws();
        lx.peek()
    } {
        steps += 1;
        assert!(steps < 100_000, "the PromQL scanner is stuck in {expr:?}");
        match c {
            b'"' | b'\'' | b'`' => {
                let _ = lx.string();
            }
            b'[' => lx.skip_group(b'[', b']'),
            b'{' => {
                let _ = lx.matchers();
            }
            b'$' => {
                // A Grafana variable ($job, ${job}, $__rate_interval).
                lx.i += 1;
                if lx.peek() == Some(b'{') {
                    lx.skip_group(b'{', b'}');
                } else {
                    let _ = lx.ident();
                }
            }
            b'0'..=b'9' | b'.' => {
                while lx
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'.')
                {
                    let exp = matches!(lx.peek(), Some(b'e' | b'E'));
                    lx.i += 1;
                    if exp && matches!(lx.peek(), Some(b'+' | b'-')) {
                        lx.i += 1;
                    }
                }
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c == b':' => {
                let word = lx.ident().unwrap_or_default();
                lx.skip_ws();
                let lower = word.to_ascii_lowercase();
                if LABEL_LIST_WORDS.contains(&lower.as_str()) {
                    if lx.peek() == Some(b'(') {
                        lx.skip_group(b'(', b')');
                    }
                } else if PROMQL_WORDS.contains(&lower.as_str()) || lx.peek() == Some(b'(') {
                    // An operator, or a function: its arguments are scanned as they come.
                } else {
                    let equals = if lx.peek() == Some(b'{') {
                        lx.matchers()
                    } else {
                        Vec::new()
                    };
                    out.push(Selector {
                        metric: word,
                        equals,
                    });
                }
            }
            _ => lx.i += 1,
        }
    }
    out
}

/// The selectors of a Grafana template-variable query (`label_values(metric{..}, label)`
/// names a metric and then a label) or a plain PromQL query.
pub fn variable_selectors(query: &str) -> Vec<Selector> {
    let q = query.trim();
    if let Some(args) = q
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
    {
        // The last top-level comma separates the label; with no comma there is no metric.
        let mut depth = 0i32;
        let mut split = None;
        for (i, c) in args.char_indices() {
            match c {
                '(' | '{' | '[' => depth += 1,
                ')' | '}' | ']' => depth -= 1,
                ',' if depth == 0 => split = Some(i),
                _ => {}
            }
        }
        return split.map(|i| selectors(&args[..i])).unwrap_or_default();
    }
    if q.starts_with("label_names(") || q.starts_with("metrics(") {
        return Vec::new();
    }
    selectors(q)
}

// ---- The Grafana dashboard -----------------------------------------------------------------

/// Every panel (rows' nested panels included), depth first.
pub fn all_panels<'a>(panels: &'a [Value], out: &mut Vec<&'a Value>) {
    for p in panels {
        out.push(p);
        if let Some(Value::Array(inner)) = p.get("panels") {
            all_panels(inner, out);
        }
    }
}

/// The PromQL of the dashboard: each panel target's `expr`, and the template variables'
/// queries, labelled with where they are.
pub fn dashboard_queries(dashboard: &Value) -> Vec<(String, Vec<Selector>)> {
    let mut out = Vec::new();
    let mut panels = Vec::new();
    if let Some(Value::Array(top)) = dashboard.get("panels") {
        all_panels(top, &mut panels);
    }
    for p in panels {
        let title = p.get("title").and_then(Value::as_str).unwrap_or("?");
        if let Some(Value::Array(targets)) = p.get("targets") {
            for t in targets {
                if let Some(expr) = t.get("expr").and_then(Value::as_str) {
                    out.push((format!("panel {title:?}: {expr}"), selectors(expr)));
                }
            }
        }
    }
    if let Some(Value::Array(vars)) = dashboard.get("templating").and_then(|t| t.get("list")) {
        for v in vars {
            if v.get("type").and_then(Value::as_str) != Some("query") {
                continue;
            }
            let query = match v.get("query") {
                Some(Value::String(q)) => q.clone(),
                Some(q @ Value::Object(_)) => match q.get("query") {
                    Some(Value::String(q)) => q.clone(),
                    _ => continue,
                },
                _ => continue,
            };
            out.push((format!("variable: {query}"), variable_selectors(&query)));
        }
    }
    out
}

/// The `expr:` of every rule in a rules file: single-line values and `|`/`>` blocks.
pub fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let indent = line.len() - line.trim_start().len();
        let Some(value) = line.trim_start().strip_prefix("expr:") else {
            i += 1;
            continue;
        };
        let value = value.trim();
        i += 1;
        if value.starts_with('|') || value.starts_with('>') {
            let mut block = Vec::new();
            while i < lines.len()
                && (lines[i].trim().is_empty()
                    || lines[i].len() - lines[i].trim_start().len() > indent)
            {
                block.push(lines[i].trim());
                i += 1;
            }
            out.push(block.join("\n"));
        } else {
            let unquoted = value
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .map(|v| v.replace("''", "'"))
                .unwrap_or_else(|| value.to_string());
            out.push(unquoted);
        }
    }
    out
}

#[test]
fn promql_scanner_finds_metric_selectors() {
    let names = |e: &str| {
        selectors(e)
            .into_iter()
            .map(|s| s.metric)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(
            r#"histogram_quantile(0.99, sum by (le, kind) (rate(tb_transfer_duration_seconds_bucket{job=~"$job"}[$__rate_interval])))"#
        ),
        ["tb_transfer_duration_seconds_bucket"]
    );
    assert_eq!(
        names(
            "a_total / clamp_min(sum without (x) (b) + 1e-9, 2) > bool 0.5 and on () count(up == 1) offset 5m"
        ),
        ["a_total", "b", "up"]
    );
    assert_eq!(
        names("sum(x) by (instance) or vector(0) unless time() - y_seconds{a=\"}\"}"),
        ["x", "y_seconds"]
    );
    let s =
        selectors(r#"m{direction="in", kind=~"push|pull", result!="ok", instance=~"$instance"}"#);
    assert_eq!(
        s,
        [Selector {
            metric: "m".into(),
            equals: vec![("direction".into(), "in".into())],
        }]
    );
    assert_eq!(
        variable_selectors(r#"label_values(tb_build_info{job=~"$job"}, instance)"#)
            .into_iter()
            .map(|s| s.metric)
            .collect::<Vec<_>>(),
        ["tb_build_info"]
    );
    assert!(variable_selectors("label_values(instance)").is_empty());
    let yaml = "- alert: A\n  expr: up == 0\n- alert: B\n  expr: |\n    sum(x_total)\n      > 1\n  for: 1m\n";
    assert_eq!(rule_exprs(yaml), ["up == 0", "sum(x_total)\n> 1"]);
}
