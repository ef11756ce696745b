//! The table `tb bench p2p` prints without `--json` (the one README shows): one row per
//! system, op and size with MB/s and the ratio to `raw-tcp` on the same op and size (`get`
//! for a push, since a pushed tensor also lands in the receiver's fresh memory), then the
//! 4 KiB round trips and each system's peak RSS.

use crate::fmt;

/// One system × op × size figure.
pub(crate) struct Row {
    pub(crate) system: String,
    pub(crate) op: &'static str,
    pub(crate) size_bytes: u64,
    pub(crate) mb_s: f64,
    pub(crate) first_ms: f64,
    pub(crate) channel: Option<String>,
}

/// One system's 4 KiB round trips: (p50, p99) in µs.
pub(crate) struct RttRow {
    pub(crate) system: String,
    pub(crate) pull: (f64, f64),
    pub(crate) push: Option<(f64, f64)>,
}

/// Everything the table shows.
pub(crate) struct View {
    pub(crate) rows: Vec<Row>,
    pub(crate) rtts: Vec<RttRow>,
    pub(crate) rss: Vec<(String, u64)>,
}

/// The system every throughput is compared with.
const REFERENCE: &str = "raw-tcp";

/// The reference figure for `row`, if the reference system has that op and size.
fn reference(view: &View, row: &Row) -> Option<f64> {
    let op = if row.op == "push" { "get" } else { row.op };
    view.rows
        .iter()
        .find(|r| r.system == REFERENCE && r.op == op && r.size_bytes == row.size_bytes)
        .map(|r| r.mb_s)
        .filter(|v| *v > 0.0)
}

/// The table's lines.
pub(crate) fn lines(view: &View) -> Vec<String> {
    let mut out = vec![format!(
        "{:<27} {:<9} {:>8} {:>9} {:>8} {:>9} {:<7}",
        "system", "op", "size", "MB/s", "x raw-tcp", "first ms", "channel"
    )];
    for row in &view.rows {
        let ratio =
            reference(view, row).map_or("-".to_string(), |r| format!("{:.2}", row.mb_s / r));
        out.push(format!(
            "{:<27} {:<9} {:>8} {:>9.0} {:>8} {:>9.2} {:<7}",
            row.system,
            row.op,
            fmt::bytes(row.size_bytes).replace(' ', ""),
            row.mb_s,
            ratio,
            row.first_ms,
            row.channel.as_deref().unwrap_or("-"),
        ));
    }
    out.push(String::new());
    out.push(format!(
        "{:<27} {:>12} {:>12} {:>12} {:>12}",
        "4 KiB round trip", "pull p50 us", "pull p99 us", "push p50 us", "push p99 us"
    ));
    for r in &view.rtts {
        let (p50, p99) = r.push.map_or(("-".to_string(), "-".to_string()), |(a, b)| {
            (format!("{a:.0}"), format!("{b:.0}"))
        });
        out.push(format!(
            "{:<27} {:>12.0} {:>12.0} {:>12} {:>12}",
            r.system, r.pull.0, r.pull.1, p50, p99
        ));
    }
    out.push(String::new());
    let rss: Vec<String> = view
        .rss
        .iter()
        .map(|(s, b)| format!("{s} {}", fmt::bytes(*b)))
        .collect();
    out.push(format!("peak RSS per receiver: {}", rss.join(", ")));
    out
}

/// Prints [`lines`].
pub(crate) fn print(view: &View) {
    for line in lines(view) {
        println!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(system: &str, op: &'static str, size: u64, mb_s: f64) -> Row {
        Row {
            system: system.into(),
            op,
            size_bytes: size,
            mb_s,
            first_ms: 1.0,
            channel: None,
        }
    }

    #[test]
    fn ratios_compare_with_raw_tcp_on_the_same_op_and_size() {
        let view = View {
            rows: vec![
                row("tensor-broker", "pull_into", 1 << 20, 3000.0),
                row("tensor-broker", "push", 1 << 20, 500.0),
                row("tensor-broker", "pull_into", 4096, 10.0),
                row("raw-tcp", "pull_into", 1 << 20, 1500.0),
                row("raw-tcp", "get", 1 << 20, 1000.0),
            ],
            rtts: vec![RttRow {
                system: "raw-iroh".into(),
                pull: (70.0, 90.0),
                push: None,
            }],
            rss: vec![("raw-tcp".into(), 1 << 20)],
        };
        let lines = lines(&view);
        assert!(lines[1].contains(" 2.00 "), "{}", lines[1]);
        assert!(lines[2].contains(" 0.50 "), "push vs get: {}", lines[2]);
        assert!(lines[3].contains(" - "), "no reference: {}", lines[3]);
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("raw-iroh") && l.ends_with('-'))
        );
    }
}
