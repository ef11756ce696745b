//! [`Pace`]: how fast a get's current source delivers, next to the best rate this get has seen
//! from any of its sources, so that `fetch` drops a source that falls far behind.
//!
//! A source is judged over windows of at least [`WINDOW`], starting once it has delivered its
//! first byte: a source still receiving the version may be behind this node (after a move)
//! and sends nothing until it catches up, which says nothing about its speed. It is slow when
//! it delivered less than 1/[`SLOW_FACTOR`] of the best window rate seen in this get. The
//! best rate is a property of the get, not of the source, so a source that was never fast is
//! judged only against the others this get has had (the broker ranks sources with a low
//! upload limit last, so a first source rarely is one).
//!
//! That is a judgement between sources. Every source, the first included, must also keep up
//! with the absolute floor, `Config::min_source_rate` over each stall period: the stream's
//! watchdog (`wire::Watchdog::with_floor`) fails one that does not, and the get leaves it.

use std::time::{Duration, Instant};

/// A source delivering less than the best rate seen divided by this is slow.
pub(crate) const SLOW_FACTOR: f64 = 4.0;
/// Shortest span over which a source's rate is judged.
pub(crate) const WINDOW: Duration = Duration::from_secs(1);

/// The delivery rates of one get's sources.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    /// Best window rate seen from any source of this get, in bytes per second.
    best: f64,
    /// Bytes received when the current source started.
    started_at: u64,
    /// The current window: when it started and the bytes received then; `None` until the
    /// current source delivered a byte.
    window: Option<(Instant, u64)>,
}

impl Pace {
    /// A new source starts delivering; `reached` bytes are in.
    pub(crate) fn source(&mut self, reached: u64) {
        self.started_at = reached;
        self.window = None;
    }

    /// Looks at the current source at `now`, `reached` bytes in: true when a window just
    /// ended in which it delivered less than 1/[`SLOW_FACTOR`] of the best rate seen.
    pub(crate) fn slow(&mut self, now: Instant, reached: u64) -> bool {
        let Some((since, from)) = self.window else {
            if reached > self.started_at {
                self.window = Some((now, reached));
            }
            return false;
        };
        let elapsed = now.saturating_duration_since(since);
        if elapsed < WINDOW {
            return false;
        }
        let rate = reached.saturating_sub(from) as f64 / elapsed.as_secs_f64();
        self.window = Some((now, reached));
        let slow = rate * SLOW_FACTOR < self.best;
        self.best = self.best.max(rate);
        slow
    }

    /// The best window rate seen, in bytes per second.
    pub(crate) fn best(&self) -> f64 {
        self.best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    /// Feeds `pace` one sample per half second at `rate` bytes per second for `secs`
    /// seconds; returns whether any window was judged slow, the clock and bytes after.
    fn run(pace: &mut Pace, mut at: (Instant, u64), rate: u64, secs: u64) -> (bool, Instant, u64) {
        let mut slow = false;
        for _ in 0..secs * 2 {
            at = (at.0 + Duration::from_millis(500), at.1 + rate / 2);
            slow |= pace.slow(at.0, at.1);
        }
        (slow, at.0, at.1)
    }

    #[test]
    fn a_source_that_falls_far_behind_the_best_rate_is_slow() {
        let mut pace = Pace::default();
        let t0 = Instant::now();
        pace.source(0);
        let (slow, t, n) = run(&mut pace, (t0, 0), 40 * MB, 4);
        assert!(!slow, "a steady source");
        assert!((pace.best() - 40e6).abs() < 1.0, "{}", pace.best());
        // A quarter of the best is still fine; below it is slow.
        let (slow, t, n) = run(&mut pace, (t, n), 10 * MB, 3);
        assert!(!slow, "exactly a quarter");
        let (slow, ..) = run(&mut pace, (t, n), 9 * MB, 3);
        assert!(slow, "below a quarter");
    }

    #[test]
    fn a_source_is_judged_only_after_its_first_byte_and_a_whole_window() {
        let mut pace = Pace::default();
        let t0 = Instant::now();
        pace.source(0);
        run(&mut pace, (t0, 0), 40 * MB, 3);
        // The next source starts behind this node: nothing for five seconds, then bytes.
        let t = t0 + Duration::from_secs(3);
        pace.source(120 * MB);
        let mut at = (t, 120 * MB);
        for _ in 0..10 {
            at.0 += Duration::from_millis(500);
            assert!(!pace.slow(at.0, at.1), "judged before its first byte");
        }
        let (slow, ..) = run(&mut pace, at, 30 * MB, 4);
        assert!(!slow, "a source delivering after catching up");
        // Less than a window after a sample: no judgement however few bytes came.
        let mut pace = Pace::default();
        pace.source(0);
        assert!(!pace.slow(t0, 1));
        assert!(!pace.slow(t0 + Duration::from_millis(999), 1));
    }

    #[test]
    fn a_stall_after_the_first_bytes_is_slow_once_a_rate_is_known() {
        let mut pace = Pace::default();
        let t0 = Instant::now();
        pace.source(0);
        let (_, t, n) = run(&mut pace, (t0, 0), 20 * MB, 2);
        let (slow, ..) = run(&mut pace, (t, n), 0, 2);
        assert!(slow);
        // A get whose only source never delivered faster has nothing to compare with.
        let mut alone = Pace::default();
        alone.source(0);
        let (slow, ..) = run(&mut alone, (t0, 0), 100_000, 10);
        assert!(!slow);
    }
}
