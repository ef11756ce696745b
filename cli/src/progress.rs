//! Progress bars for `tb put` and `tb get`: bytes, rate and ETA on stderr while a large
//! transfer runs, drawn only when stderr is a terminal (pipes, files and CI logs get no
//! control characters), then cleared; the command prints its one summary line either way.
//!
//! The node records the bytes moved on a [`TransferProgress`] (one relaxed atomic per
//! chunk); a ticker task here reads it a few times a second and moves the bar.

use std::{fmt, io::IsTerminal, sync::Arc, time::Duration};

use indicatif::{BinaryBytes, ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};
use tb_node::TransferProgress;
use tokio::{sync::oneshot, task::JoinHandle};

/// Transfers smaller than this get no bar (they are over before one would help).
pub const MIN_BAR_BYTES: u64 = 4 << 20;
/// How often the bar reads the transfer's progress.
const TICK: Duration = Duration::from_millis(100);
/// Longest wait for the ticker to clear its bar at the end.
const STOP_WAIT: Duration = Duration::from_secs(1);

/// Whether a transfer of `total` bytes gets a bar, given whether stderr is a terminal.
pub fn wants_bar(stderr_is_terminal: bool, total: u64) -> bool {
    stderr_is_terminal && total >= MIN_BAR_BYTES
}

/// A bar that follows one transfer until [`finish`](Self::finish).
pub struct Bar {
    stop: oneshot::Sender<()>,
    ticker: JoinHandle<()>,
}

impl Bar {
    /// Follows `progress` with a bar labelled `label` on stderr, once its total is known and
    /// only if it [`wants_bar`]; `None` when stderr is not a terminal (nothing is ever drawn).
    pub fn follow(label: String, progress: Arc<TransferProgress>) -> Option<Bar> {
        let terminal = std::io::stderr().is_terminal();
        if !terminal {
            return None;
        }
        let (stop, mut stopped) = oneshot::channel();
        let ticker = tokio::spawn(async move {
            let mut bar: Option<ProgressBar> = None;
            let mut tick = tokio::time::interval(TICK);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                if bar.is_none()
                    && let Some(total) = progress.total()
                    && wants_bar(terminal, total)
                {
                    bar = Some(new_bar(&label, total));
                }
                if let Some(bar) = &bar {
                    bar.set_position(progress.bytes());
                }
            }
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
        });
        Some(Bar { stop, ticker })
    }

    /// Stops following and clears the bar (the caller prints the summary next).
    pub async fn finish(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(STOP_WAIT, self.ticker).await;
    }
}

/// Ends `bar` if there is one.
pub async fn finish(bar: Option<Bar>) {
    if let Some(bar) = bar {
        bar.finish().await;
    }
}

/// Bytes, total, rate and ETA, the bar taking what the terminal's width leaves (one line,
/// never wrapped).
const TEMPLATE: &str =
    "{msg} [{wide_bar}] {binary_bytes}/{binary_total_bytes} {mean_rate} ETA {mean_eta}";
/// Before this much time has passed, the rate is not shown (a first reading after a few
/// milliseconds would claim hundreds of GiB/s).
const MIN_RATE_TIME: Duration = Duration::from_millis(250);

fn style() -> Result<ProgressStyle, indicatif::style::TemplateError> {
    Ok(ProgressStyle::with_template(TEMPLATE)?
        .with_key("mean_rate", |s: &ProgressState, w: &mut dyn fmt::Write| {
            let _ = match mean_rate(s.pos(), s.elapsed()) {
                Some(rate) => write!(w, "{}/s", BinaryBytes(rate as u64)),
                None => write!(w, "-"),
            };
        })
        .with_key("mean_eta", |s: &ProgressState, w: &mut dyn fmt::Write| {
            let left = s.len().unwrap_or(0).saturating_sub(s.pos());
            let _ = match mean_rate(s.pos(), s.elapsed()) {
                Some(rate) => write!(w, "{:.0}s", left as f64 / rate),
                None => write!(w, "-"),
            };
        })
        .progress_chars("=> "))
}

/// Bytes per second over the whole transfer so far (the bar's life), once that is long
/// enough to mean something.
fn mean_rate(bytes: u64, elapsed: Duration) -> Option<f64> {
    (elapsed >= MIN_RATE_TIME && bytes > 0).then(|| bytes as f64 / elapsed.as_secs_f64())
}

fn new_bar(label: &str, total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    // The template is a constant (tested): should it not parse, a plain bar, not a panic.
    bar.set_style(style().unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_message(label.to_string());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_only_for_large_transfers_on_a_terminal() {
        assert!(wants_bar(true, MIN_BAR_BYTES));
        assert!(wants_bar(true, 1 << 30));
        assert!(!wants_bar(true, MIN_BAR_BYTES - 1));
        assert!(!wants_bar(false, 1 << 30));
    }

    #[test]
    fn the_rate_is_the_mean_and_only_once_it_means_something() {
        assert_eq!(mean_rate(1 << 30, Duration::from_millis(5)), None);
        assert_eq!(mean_rate(0, Duration::from_secs(3)), None);
        assert_eq!(mean_rate(300, Duration::from_secs(3)), Some(100.0));
    }

    #[test]
    fn the_bar_template_parses() {
        assert!(style().is_ok());
        let bar = new_bar("get m/w", 100);
        bar.set_position(50);
        assert_eq!(bar.length(), Some(100));
        bar.finish_and_clear();
    }
}
