//! A kernel that refuses the shm channel's mappings (forced here by a test hook, as on a
//! kernel that cannot map sealed memfds): the channel is switched off for the whole process
//! once, before any tensor is copied into a memfd, with one warning and a metric, and
//! same-host transfers use QUIC, byte-identical. Its own test binary: the hook is
//! process-wide.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tb_node::{
    DType, Tensor,
    proto::{ChannelKind, ContentHash},
};
use tb_tests::{node, pattern, test_config, within};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::{
    layer::{Context, Layer, SubscriberExt},
    util::SubscriberInitExt,
};

const LIMIT: Duration = Duration::from_secs(30);

/// Counts warnings from the node library.
struct Warnings(Arc<AtomicUsize>);

impl<S: Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() == Level::WARN && meta.target().starts_with("tb_node") {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_refusing_memfd_mappings_switches_shm_off_once() {
    let warnings = Arc::new(AtomicUsize::new(0));
    tracing_subscriber::registry()
        .with(Warnings(warnings.clone()))
        .init();
    tb_node::force_map_failures_for_tests();
    let (holder, reader) = (node(test_config()).await, node(test_config()).await);
    let len = (4 << 20) + 7;
    let tensor = Tensor::new(DType::U8, vec![len as u64], pattern(len, 3)).expect("tensor");
    holder
        .publish_local("off/t", tensor.clone())
        .expect("publish");
    for _ in 0..3 {
        let got = within(LIMIT, "pull", reader.pull(holder.addr(), "off/t", None))
            .await
            .expect("pull over QUIC");
        assert_eq!(ContentHash::of(got.buffer.data()), tensor.hash());
        assert_eq!(got.buffer.data(), tensor.data());
    }
    for n in [&holder, &reader] {
        let channels = &n.metrics().channels;
        assert!(
            channels.is_unavailable(ChannelKind::Shm),
            "the metric says shm is off"
        );
        assert_eq!(
            channels.transfers(ChannelKind::Shm),
            0,
            "nothing went over shm"
        );
        assert_eq!(
            channels.fallbacks(ChannelKind::Shm),
            0,
            "no shm attempt to fall back from"
        );
    }
    assert_eq!(reader.metrics().channels.transfers(ChannelKind::Quic), 3);
    assert_eq!(
        warnings.load(Ordering::Relaxed),
        1,
        "one warning for the process"
    );
    holder.shutdown().await;
    reader.shutdown().await;
}
