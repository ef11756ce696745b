//! The cluster's background tasks, each owned by the node's `TaskTracker` and stopped by its
//! cancellation token: heartbeats to the current broker, announcing the versions retention
//! evicted (so brokers stop naming this node as their holder), and the TTL sweep.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tb_proto::MAX_ANNOUNCE_OPS;
use tokio::{
    sync::mpsc::UnboundedReceiver,
    time::{Instant as TokioInstant, MissedTickBehavior},
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Cluster;
use crate::{ctx::NodeCtx, store::Evicted};

/// Shortest period of any background timer (a zero period would spin).
const MIN_PERIOD: Duration = Duration::from_millis(10);
/// Longest wait between two TTL sweeps.
const MAX_SWEEP_PERIOD: Duration = Duration::from_secs(1);

/// Spawns the tasks a node needs: heartbeats and eviction announcements with a cluster, the
/// TTL sweep with a TTL.
pub(crate) fn start(
    ctx: &Arc<NodeCtx>,
    cluster: Option<&Arc<Cluster>>,
    evictions: Option<UnboundedReceiver<Evicted>>,
) {
    let cancel = ctx.cancel.clone();
    if let Some(cluster) = cluster {
        let period = ctx.config.heartbeat_interval.max(MIN_PERIOD);
        if ctx.config.heartbeats {
            ctx.tracker
                .spawn(heartbeats(cluster.clone(), period, cancel.clone()));
        }
        if let Some(evictions) = evictions {
            ctx.tracker.spawn(announce_evictions(
                cluster.clone(),
                evictions,
                cancel.clone(),
            ));
        }
    }
    if let Some(ttl) = ctx.config.version_ttl {
        let period = (ttl / 4).clamp(MIN_PERIOD, MAX_SWEEP_PERIOD);
        let store = ctx.store.clone();
        ctx.tracker.spawn(async move {
            let mut ticker = tokio::time::interval(period);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = ticker.tick() => {}
                }
                store.expire(Instant::now());
            }
        });
    }
}

/// Heartbeats every `period`, the first one at once. A failure is logged once until the next
/// success; the next tick tries again (failing over to the next broker).
async fn heartbeats(cluster: Arc<Cluster>, period: Duration, cancel: CancellationToken) {
    let mut ticker = tokio::time::interval_at(TokioInstant::now(), period);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let sent = tokio::select! {
            _ = cancel.cancelled() => break,
            sent = cluster.heartbeat() => sent,
        };
        match sent {
            Ok(()) if failing => {
                info!("heartbeats reach a broker again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                warn!(%e, "heartbeat failed; retrying every {period:?}");
                failing = true;
            }
            Err(e) => debug!(%e, "heartbeat failed again"),
        }
    }
}

/// How long evictions are gathered into one announcement.
const EVICTION_WINDOW: Duration = Duration::from_millis(250);

/// Announces `RemoveHolder` for every version the store evicted, batching what comes within
/// [`EVICTION_WINDOW`] of the first: a name published in a loop costs its broker one
/// announcement per window, not one per version (brokers offer only the newest versions,
/// which the store keeps, so the ones evicted are seldom asked for meanwhile, and a fetcher
/// sent to a node that dropped one moves on to the next holder). A failed announcement is
/// dropped: brokers forget holders of old versions on their own, and of a dead node's
/// versions when it stops heartbeating.
async fn announce_evictions(
    cluster: Arc<Cluster>,
    mut evictions: UnboundedReceiver<Evicted>,
    cancel: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => break,
            first = evictions.recv() => match first {
                Some(first) => first,
                None => break,
            },
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            () = tokio::time::sleep(EVICTION_WINDOW) => {}
        }
        let mut ops = vec![cluster.holder_op(&first.name, first.version, false)];
        while ops.len() < MAX_ANNOUNCE_OPS {
            match evictions.try_recv() {
                Ok(e) => ops.push(cluster.holder_op(&e.name, e.version, false)),
                Err(_) => break,
            }
        }
        let count = ops.len();
        let sent = tokio::select! {
            _ = cancel.cancelled() => break,
            sent = cluster.announce(ops) => sent,
        };
        match sent {
            Ok(()) => debug!(count, "announced evicted versions"),
            Err(e) => warn!(%e, count, "could not announce evicted versions"),
        }
    }
}
