//! The call metrics, registered in the node's registry beside the data plane's: calls by side
//! and result, their duration, the calls in flight, the calls queued for a slot and the
//! bytes they moved, and the calls' streams by channel. No per-function
//! labels: a cluster may serve many functions, and label cardinality is a scrape's cost.

use std::time::Duration;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// `tb_calls_total{side,result}`, `tb_call_duration_seconds{side}`,
/// `tb_calls_in_flight{side}`, `tb_call_queue_depth`, `tb_call_bytes_total{direction}`,
/// `tb_call_streams_total{side,channel}`.
#[derive(Debug, Clone)]
pub struct CallMetrics {
    calls: IntCounterVec,
    durations: HistogramVec,
    in_flight: IntGaugeVec,
    queue_depth: IntGauge,
    bytes: IntCounterVec,
    streams: IntCounterVec,
}

impl CallMetrics {
    /// The families, registered in `registry` (left unregistered when it has them already:
    /// a second [`Calls`](crate::Calls) on one node counts apart, unexported).
    pub fn new(registry: &Registry) -> Self {
        let calls = IntCounterVec::new(
            Opts::new(
                "tb_calls_total",
                "Remote function calls ended, by side (server, caller) and result",
            ),
            &["side", "result"],
        )
        .expect("valid metric");
        let durations = HistogramVec::new(
            HistogramOpts::new(
                "tb_call_duration_seconds",
                "Remote function call durations, by side",
            )
            .buckets(prometheus::exponential_buckets(50e-6, 4.0, 10).expect("valid buckets")),
            &["side"],
        )
        .expect("valid metric");
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "tb_calls_in_flight",
                "Remote function calls in flight, by side",
            ),
            &["side"],
        )
        .expect("valid metric");
        let queue_depth = IntGauge::new(
            "tb_call_queue_depth",
            "Calls this node accepted to serve that wait for a free slot of their function",
        )
        .expect("valid metric");
        let bytes = IntCounterVec::new(
            Opts::new(
                "tb_call_bytes_total",
                "Argument and result bytes, by direction (in, out)",
            ),
            &["direction"],
        )
        .expect("valid metric");
        let streams = IntCounterVec::new(
            Opts::new(
                "tb_call_streams_total",
                "Calls opened (caller) or taken (server), by the channel their stream took: shm (the pair's same-host socket) or quic",
            ),
            &["side", "channel"],
        )
        .expect("valid metric");
        for family in [
            Box::new(calls.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(streams.clone()),
            Box::new(durations.clone()),
            Box::new(in_flight.clone()),
            Box::new(queue_depth.clone()),
            Box::new(bytes.clone()),
        ] {
            let _ = registry.register(family);
        }
        CallMetrics {
            calls,
            durations,
            in_flight,
            queue_depth,
            bytes,
            streams,
        }
    }

    /// A call's stream opened (`caller`) or taken (`server`), on a same-host connection
    /// (`same_host`) or a QUIC stream.
    pub fn stream(&self, side: &str, same_host: bool) {
        let channel = if same_host { "shm" } else { "quic" };
        self.streams.with_label_values(&[side, channel]).inc();
    }

    /// The calls' streams counted so far on `side` and `channel` (`shm`, `quic`).
    pub fn streams(&self, side: &str, channel: &str) -> u64 {
        self.streams.with_label_values(&[side, channel]).get()
    }

    /// A call ended on `side` with `result`.
    pub fn ended(&self, side: &str, result: &str) {
        self.calls.with_label_values(&[side, result]).inc();
    }

    /// A served call took `elapsed`.
    pub fn served_in(&self, elapsed: Duration) {
        self.durations
            .with_label_values(&["server"])
            .observe(elapsed.as_secs_f64());
    }

    /// A call made took `elapsed`.
    pub fn called_in(&self, elapsed: Duration) {
        self.durations
            .with_label_values(&["caller"])
            .observe(elapsed.as_secs_f64());
    }

    /// `n` body bytes moved `direction`.
    pub fn bytes(&self, direction: &str, n: u64) {
        self.bytes.with_label_values(&[direction]).inc_by(n);
    }

    /// One more (or fewer) call in flight on `side`.
    pub fn in_flight(&self, side: &str, delta: i64) {
        self.in_flight.with_label_values(&[side]).add(delta);
    }

    /// One more (or fewer) served call waiting for a slot.
    pub fn queued(&self, delta: i64) {
        self.queue_depth.add(delta);
    }

    /// Served calls waiting for a slot now.
    pub fn queue_depth(&self) -> i64 {
        self.queue_depth.get()
    }

    /// Body bytes moved `direction` so far.
    pub fn bytes_moved(&self, direction: &str) -> u64 {
        self.bytes.with_label_values(&[direction]).get()
    }

    /// Calls that ended on `side` with `result` so far.
    pub fn count(&self, side: &str, result: &str) -> u64 {
        self.calls.with_label_values(&[side, result]).get()
    }
}
