//! [`ChannelMetrics`]: bytes, transfers and fallbacks by data channel (`shm`, `quic`, `tcp`).
//!
//! Every kind's series exist from the start (at zero), and each is a plain atomic picked by
//! index, so counting a transfer on the data path takes no lock and no label look-up.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use tb_proto::ChannelKind;

use crate::metrics::MetricsError;

/// Which way a transfer's bytes went, from this node's side (the `direction` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Received by this node.
    In,
    /// Sent by this node.
    Out,
}

impl Direction {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

const KINDS: usize = ChannelKind::ALL.len();

/// `tb_channel_bytes_total{channel,direction}`, `tb_channel_transfers_total{channel}`,
/// `tb_channel_fallbacks_total{channel}`, `tb_channel_refused_total{channel}` and
/// `tb_channel_unavailable{channel}`. Clones
/// share the counts.
#[derive(Debug, Clone)]
pub struct ChannelMetrics {
    /// `[kind][0 = in, 1 = out]`.
    bytes: [[IntCounter; 2]; KINDS],
    transfers: [IntCounter; KINDS],
    fallbacks: [IntCounter; KINDS],
    refused: [IntCounter; KINDS],
    unavailable: [IntGauge; KINDS],
}

impl ChannelMetrics {
    /// Creates the four families in `registry`, every channel's series at zero.
    pub(crate) fn new(registry: &Registry) -> Result<Self, MetricsError> {
        let bytes = family(
            registry,
            "tb_channel_bytes_total",
            "Tensor payload bytes moved, by data channel and direction",
            &["channel", "direction"],
        )?;
        let transfers = family(
            registry,
            "tb_channel_transfers_total",
            "Transfers finished, by the data channel that carried their bytes",
            &["channel"],
        )?;
        let fallbacks = family(
            registry,
            "tb_channel_fallbacks_total",
            "Transfers that started on this channel and finished on QUIC",
            &["channel"],
        )?;
        let refused = family(
            registry,
            "tb_channel_refused_total",
            "Connections to this node's channel closed before any tensor byte (no valid token, or over its limit of sockets)",
            &["channel"],
        )?;
        let unavailable = IntGaugeVec::new(
            Opts::new(
                "tb_channel_unavailable",
                "1 when this node is configured for the channel but could not start it (a kernel that refuses sealed memfd mappings, no TCP port)",
            ),
            &["channel"],
        )?;
        registry.register(Box::new(unavailable.clone()))?;
        Ok(ChannelMetrics {
            bytes: ChannelKind::ALL.map(|k| {
                [Direction::In, Direction::Out]
                    .map(|d| bytes.with_label_values(&[k.as_str(), d.as_str()]))
            }),
            transfers: ChannelKind::ALL.map(|k| transfers.with_label_values(&[k.as_str()])),
            fallbacks: ChannelKind::ALL.map(|k| fallbacks.with_label_values(&[k.as_str()])),
            refused: ChannelKind::ALL.map(|k| refused.with_label_values(&[k.as_str()])),
            unavailable: ChannelKind::ALL.map(|k| unavailable.with_label_values(&[k.as_str()])),
        })
    }

    /// Counts one finished transfer of `bytes` payload bytes on `channel`.
    pub fn transfer(&self, channel: ChannelKind, direction: Direction, bytes: u64) {
        let k = index(channel);
        self.bytes[k][direction as usize].inc_by(bytes);
        self.transfers[k].inc();
    }

    /// Counts one finished transfer on `channel` whose bytes were counted as they moved.
    pub fn finished(&self, channel: ChannelKind) {
        self.transfers[index(channel)].inc();
    }

    /// The counter of `channel`'s bytes in `direction` (for a [`Meter`](crate::Meter)).
    pub(crate) fn bytes_counter(&self, channel: ChannelKind, direction: Direction) -> IntCounter {
        self.bytes[index(channel)][direction as usize].clone()
    }

    /// Counts `bytes` payload bytes moved on `channel` as part of a transfer counted
    /// elsewhere (one socket's share of it).
    pub fn moved(&self, channel: ChannelKind, direction: Direction, bytes: u64) {
        self.bytes[index(channel)][direction as usize].inc_by(bytes);
    }

    /// Records that this node is configured for `channel` but could not start it.
    pub fn set_unavailable(&self, channel: ChannelKind) {
        self.unavailable[index(channel)].set(1);
    }

    /// Whether this node is configured for `channel` but could not start it.
    pub fn is_unavailable(&self, channel: ChannelKind) -> bool {
        self.unavailable[index(channel)].get() == 1
    }

    /// Counts one connection to `channel` refused before any tensor byte.
    pub fn refused(&self, channel: ChannelKind) {
        self.refused[index(channel)].inc();
    }

    /// Connections to `channel` refused so far.
    pub fn refusals(&self, channel: ChannelKind) -> u64 {
        self.refused[index(channel)].get()
    }

    /// Counts one transfer that started on `channel` and finished on QUIC.
    pub fn fallback(&self, channel: ChannelKind) {
        self.fallbacks[index(channel)].inc();
    }

    /// Payload bytes moved on `channel` in `direction` so far.
    pub fn bytes(&self, channel: ChannelKind, direction: Direction) -> u64 {
        self.bytes[index(channel)][direction as usize].get()
    }

    /// Transfers finished on `channel` so far.
    pub fn transfers(&self, channel: ChannelKind) -> u64 {
        self.transfers[index(channel)].get()
    }

    /// Transfers that fell back from `channel` to QUIC so far.
    pub fn fallbacks(&self, channel: ChannelKind) -> u64 {
        self.fallbacks[index(channel)].get()
    }
}

/// `channel`'s slot in [`ChannelKind::ALL`].
fn index(channel: ChannelKind) -> usize {
    ChannelKind::ALL
        .iter()
        .position(|k| *k == channel)
        .unwrap_or(0)
}

fn family(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use crate::{Metrics, Role};

    use super::*;

    #[test]
    fn channels_count_bytes_transfers_and_fallbacks_by_label() {
        let m = Metrics::new(Role::Worker).expect("metrics");
        let text = m.encode();
        for series in [
            "tb_channel_bytes_total{channel=\"shm\",direction=\"in\"} 0",
            "tb_channel_transfers_total{channel=\"tcp\"} 0",
            "tb_channel_fallbacks_total{channel=\"shm\"} 0",
            "tb_channel_refused_total{channel=\"tcp\"} 0",
        ] {
            assert!(text.contains(series), "missing {series} in\n{text}");
        }
        m.channels.transfer(ChannelKind::Quic, Direction::In, 4096);
        m.channels.transfer(ChannelKind::Quic, Direction::Out, 10);
        m.channels.transfer(ChannelKind::Shm, Direction::In, 7);
        m.channels.fallback(ChannelKind::Tcp);
        assert_eq!(m.channels.bytes(ChannelKind::Quic, Direction::In), 4096);
        assert_eq!(m.channels.transfers(ChannelKind::Quic), 2);
        assert_eq!(m.channels.fallbacks(ChannelKind::Tcp), 1);
        assert_eq!(m.channels.fallbacks(ChannelKind::Quic), 0);
        let text = m.encode();
        for series in [
            "tb_channel_bytes_total{channel=\"quic\",direction=\"in\"} 4096",
            "tb_channel_bytes_total{channel=\"quic\",direction=\"out\"} 10",
            "tb_channel_transfers_total{channel=\"quic\"} 2",
            "tb_channel_transfers_total{channel=\"shm\"} 1",
            "tb_channel_fallbacks_total{channel=\"tcp\"} 1",
        ] {
            assert!(text.contains(series), "missing {series} in\n{text}");
        }
    }
}
