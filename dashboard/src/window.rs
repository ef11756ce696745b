//! Pure figures derived from counters: the byte rates over a sliding window, and latency
//! quantiles estimated from a histogram's buckets. No clocks or locks here, so both are tested
//! with made-up samples.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

/// How far back the throughput window reaches.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Cumulative byte counts sampled about once a second; rates are the difference between the
/// newest sample and the oldest one still inside the window.
#[derive(Debug, Clone)]
pub struct ThroughputWindow {
    span: Duration,
    samples: VecDeque<Sample>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    bytes_in: u64,
    bytes_out: u64,
}

/// Bytes per second in and out, as the window sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    /// Received bytes per second.
    pub in_per_s: f64,
    /// Sent bytes per second.
    pub out_per_s: f64,
}

impl ThroughputWindow {
    /// An empty window reaching `span` back.
    pub fn new(span: Duration) -> Self {
        ThroughputWindow {
            span,
            samples: VecDeque::new(),
        }
    }

    /// Records the cumulative totals at `at` and forgets samples the window no longer needs
    /// (it keeps the newest one at or before `at - span` as the baseline).
    pub fn record(&mut self, at: Instant, bytes_in: u64, bytes_out: u64) {
        self.samples.push_back(Sample {
            at,
            bytes_in,
            bytes_out,
        });
        let Some(horizon) = at.checked_sub(self.span) else {
            return;
        };
        // Bounded by the number of samples: each iteration removes one.
        while self.samples.len() > 1 && self.samples.get(1).is_some_and(|s| s.at <= horizon) {
            self.samples.pop_front();
        }
    }

    /// Rates over the window as of its newest sample (zero with fewer than two samples).
    pub fn rates(&self) -> Rates {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return Rates::default();
        };
        let secs = last.at.saturating_duration_since(first.at).as_secs_f64();
        if secs <= 0.0 {
            return Rates::default();
        }
        Rates {
            in_per_s: last.bytes_in.saturating_sub(first.bytes_in) as f64 / secs,
            out_per_s: last.bytes_out.saturating_sub(first.bytes_out) as f64 / secs,
        }
    }

    /// The window's span.
    pub fn span(&self) -> Duration {
        self.span
    }
}

/// The `q` quantile (0..=1) of a histogram given as `(upper bound, cumulative count)` pairs in
/// increasing bound order (the `+Inf` bucket may be left out; `total` counts every sample).
/// Interpolates linearly inside the bucket, as Prometheus' `histogram_quantile` does; a
/// quantile that falls past the last finite bound is that bound. `None` without samples.
pub fn quantile(buckets: &[(f64, u64)], total: u64, q: f64) -> Option<f64> {
    if total == 0 || !(0.0..=1.0).contains(&q) {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = 0.0;
    let mut below = 0u64;
    for &(upper, cumulative) in buckets {
        if cumulative as f64 >= rank && cumulative > below {
            let in_bucket = (cumulative - below) as f64;
            let fraction = (rank - below as f64) / in_bucket;
            return Some(lower + (upper - lower) * fraction.clamp(0.0, 1.0));
        }
        lower = upper;
        below = cumulative;
    }
    buckets.last().map(|&(upper, _)| upper)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_the_difference_over_the_window() {
        let t0 = Instant::now();
        let mut w = ThroughputWindow::new(WINDOW);
        assert_eq!(w.rates(), Rates::default(), "no samples, no rate");
        w.record(t0, 0, 0);
        assert_eq!(w.rates(), Rates::default(), "one sample, no rate");
        for s in 1..=5u64 {
            w.record(t0 + Duration::from_secs(s), s * 1000, s * 10);
        }
        let r = w.rates();
        assert!((r.in_per_s - 1000.0).abs() < 1e-9, "{r:?}");
        assert!((r.out_per_s - 10.0).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn old_traffic_leaves_the_window() {
        let t0 = Instant::now();
        let mut w = ThroughputWindow::new(WINDOW);
        w.record(t0, 0, 0);
        // 1 MB arrives in the first second, then nothing for 20 s.
        w.record(t0 + Duration::from_secs(1), 1_000_000, 0);
        for s in 2..=21 {
            w.record(t0 + Duration::from_secs(s), 1_000_000, 0);
        }
        assert_eq!(w.rates().in_per_s, 0.0);
        assert!(w.samples.len() <= 12, "kept {} samples", w.samples.len());
        // New traffic shows again: 500 KB over the 10 s span.
        w.record(t0 + Duration::from_secs(22), 1_500_000, 0);
        assert!((w.rates().in_per_s - 50_000.0).abs() < 1e-6);
    }

    #[test]
    fn a_counter_reset_reads_as_zero_not_negative() {
        let t0 = Instant::now();
        let mut w = ThroughputWindow::new(WINDOW);
        w.record(t0, 500, 500);
        w.record(t0 + Duration::from_secs(1), 100, 100);
        assert_eq!(w.rates(), Rates::default());
    }

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        // 100 samples: 50 in (0, 0.1], 40 in (0.1, 0.5], 10 in (0.5, 1].
        let buckets = [(0.1, 50), (0.5, 90), (1.0, 100)];
        assert_eq!(quantile(&buckets, 0, 0.5), None, "no samples");
        let p50 = quantile(&buckets, 100, 0.5).expect("p50");
        assert!((p50 - 0.1).abs() < 1e-12, "{p50}");
        let p25 = quantile(&buckets, 100, 0.25).expect("p25");
        assert!((p25 - 0.05).abs() < 1e-12, "{p25}");
        let p70 = quantile(&buckets, 100, 0.7).expect("p70");
        assert!((p70 - 0.3).abs() < 1e-12, "{p70}");
        let p99 = quantile(&buckets, 100, 0.99).expect("p99");
        assert!((p99 - 0.95).abs() < 1e-12, "{p99}");
    }

    #[test]
    fn quantiles_past_the_last_bound_are_that_bound() {
        // 10 samples, only 8 within the finite buckets.
        let buckets = [(0.1, 4), (1.0, 8)];
        assert_eq!(quantile(&buckets, 10, 0.99), Some(1.0));
        assert_eq!(quantile(&buckets, 10, 1.5), None, "q out of range");
        // Empty leading buckets are skipped.
        let buckets = [(0.1, 0), (0.2, 0), (0.4, 10)];
        let p50 = quantile(&buckets, 10, 0.5).expect("p50");
        assert!((p50 - 0.3).abs() < 1e-12, "{p50}");
    }
}
