//! [`Watching`]: a subscription's `Watch` streams to the publishers of the names it hears of,
//! so that their small versions come in one hop (see [`crate::watch`] for the publisher's
//! side).
//!
//! A watch over the same-host socket also brings larger versions: up to 4 MiB copied out of
//! the publisher's memfd or read from the socket, beyond that the publisher's sealed memfd
//! mapped here (see [`crate::channel::ShmWatch`]). Such a watch brings every version of its
//! name, so news of one from the broker that comes before its offer does not fetch it: the
//! subscription waits for the offer a little ([`Carried::Expected`](super::feed::Carried)).
//!
//! Each broker event names the version's publisher. The first event of a name from a
//! publisher other than this node starts a watch task: it asks a broker for the publisher's
//! addresses (its membership table, once), opens a `Watch { name }` stream on the pooled
//! link, and puts each offer that checks out (metadata, length, BLAKE3 hash) into the
//! subscription's feed, where the broker's event for the same version later is old news. An
//! offer that does not check out ends the watch; so does any answer but offers. A watch that
//! ended is not started again for that publisher and name before a backoff (1 s, doubling to
//! 30 s); the broker's events carry on meanwhile, so nothing depends on a watch.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use iroh::EndpointId;
use tb_proto::{DataRequest, DataResponse, NodeId, TensorName};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::debug;

use super::Shared;
use crate::{
    LinkGuard, client,
    cluster::{Cluster, get::peers_of},
    ctx::NodeCtx,
    error::{Error, Result},
    node::{Node, WeakNode},
    tensor::Tensor,
    wire,
};

/// Most names one subscription watches at once (a prefix subscription over more names gets
/// the rest through its broker only).
const MAX_WATCHED: usize = 64;
/// Pause before a watch of the same name and publisher after one ended; doubles each time.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest such pause.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Most (name, publisher) pairs remembered for their backoff.
const MAX_REMEMBERED: usize = 1024;

/// Most times one watch moves from QUIC to the same-host socket ([`shm_route_appears`]).
const MOVES: u32 = 3;
/// How often a QUIC watch checks whether the pair's same-host socket is known now.
const MOVE_CHECK: Duration = Duration::from_millis(250);

/// Returns once the pair with `peer` has a same-host socket to use (its offers exchanged and
/// shm picked); never on a machine or build without one.
async fn shm_route_appears(ctx: &NodeCtx, peer: &EndpointId) {
    #[cfg(target_os = "linux")]
    loop {
        tokio::time::sleep(MOVE_CHECK).await;
        if ctx.channels.knows(peer) && ctx.channels.pick(peer) == tb_proto::ChannelKind::Shm {
            return;
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ctx, peer);
        std::future::pending::<()>().await
    }
}

/// Where a watch is worth having: small versions (inline offers) come over either way; large
/// ones only on the same-host socket, so news of a large version starts no QUIC watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reach {
    /// The same-host socket or QUIC.
    Any,
    /// The same-host socket only.
    SameHost,
}

/// One watch running: whom it watches, and the guard that stops it when dropped.
struct Running {
    publisher: NodeId,
    generation: u64,
    /// The watch runs on the same-host socket (so every version comes on it, however large).
    same_host: bool,
    _stop: DropGuard,
}

/// When a watch of a (name, publisher) may start again, and the pause after the next end.
struct Ended {
    not_before: Instant,
    backoff: Duration,
}

#[derive(Default)]
struct State {
    running: HashMap<TensorName, Running>,
    ended: HashMap<(TensorName, NodeId), Ended>,
    generation: u64,
}

/// The watches of one subscription.
pub(super) struct Watching {
    node: WeakNode,
    me: NodeId,
    cluster: Arc<Cluster>,
    shared: Arc<Shared>,
    stop: CancellationToken,
    state: Mutex<State>,
}

impl Watching {
    pub(super) fn new(
        node: &Node,
        cluster: Arc<Cluster>,
        shared: Arc<Shared>,
        stop: CancellationToken,
    ) -> Arc<Watching> {
        Arc::new(Watching {
            me: crate::auth::node_id(&node.id()),
            node: node.downgrade(),
            cluster,
            shared,
            stop,
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A broker said `publisher` published a version of `name`: watch it (over what `reach`
    /// allows), unless this subscription does already, it is this node, or a backoff or the
    /// cap says not now.
    pub(super) fn heard(self: &Arc<Self>, name: &TensorName, publisher: NodeId, reach: Reach) {
        if publisher == self.me || self.stop.is_cancelled() {
            return;
        }
        let mut state = self.lock();
        if state
            .running
            .get(name)
            .is_some_and(|r| r.publisher == publisher)
        {
            return;
        }
        if state.running.len() >= MAX_WATCHED && !state.running.contains_key(name) {
            return;
        }
        let key = (name.clone(), publisher);
        if state
            .ended
            .get(&key)
            .is_some_and(|e| e.not_before > Instant::now())
        {
            return;
        }
        let Some(tracker) = self.node.upgrade().map(|n| n.ctx().tracker.clone()) else {
            return;
        };
        state.generation += 1;
        let generation = state.generation;
        let stop = self.stop.child_token();
        // A new publisher of the name replaces the watch of the old one (dropped: stopped).
        state.running.insert(
            name.clone(),
            Running {
                publisher,
                generation,
                same_host: false,
                _stop: stop.clone().drop_guard(),
            },
        );
        drop(state);
        let this = self.clone();
        let name = name.clone();
        tracker.spawn(async move {
            let ended = tokio::select! {
                _ = stop.cancelled() => return,
                ended = this.watch(&name, publisher, reach, generation) => ended,
            };
            debug!(%name, publisher = ?publisher, %ended, "a watch ended");
            this.ended(name, publisher, generation);
        });
    }

    /// Whether `publisher` offers its versions of `name` to this subscription on a same-host
    /// watch, every one however large (so a version heard from the broker first has its
    /// bytes on the way: [`Feed::published_expected`](super::feed::Feed::published_expected)).
    pub(super) fn offers_all(&self, name: &TensorName, publisher: NodeId) -> bool {
        self.lock()
            .running
            .get(name)
            .is_some_and(|r| r.publisher == publisher && r.same_host)
    }

    /// Notes that the watch of `name` (the `generation`th started) runs on the same-host
    /// socket.
    fn on_same_host(&self, name: &TensorName, generation: u64) {
        let mut state = self.lock();
        if let Some(running) = state.running.get_mut(name)
            && running.generation == generation
        {
            running.same_host = true;
        }
    }

    /// Notes that the watch of `name` (the `generation`th started) ended: another may start
    /// after the backoff.
    fn ended(&self, name: TensorName, publisher: NodeId, generation: u64) {
        let mut state = self.lock();
        if state
            .running
            .get(&name)
            .is_some_and(|r| r.generation == generation)
        {
            state.running.remove(&name);
        }
        let now = Instant::now();
        if state.ended.len() >= MAX_REMEMBERED {
            state.ended.retain(|_, e| e.not_before > now);
        }
        let entry = state.ended.entry((name, publisher)).or_insert(Ended {
            not_before: now,
            backoff: FIRST_BACKOFF,
        });
        entry.not_before = now + entry.backoff;
        entry.backoff = (entry.backoff * 2).min(MAX_BACKOFF);
    }

    /// Watches `name` at `publisher` until the stream ends; returns why it ended.
    async fn watch(
        &self,
        name: &TensorName,
        publisher: NodeId,
        reach: Reach,
        generation: u64,
    ) -> Error {
        let addrs = match self.addresses(name, publisher).await {
            Ok(addrs) => addrs,
            Err(e) => return e,
        };
        let mut last = Error::Io(format!("no address of {publisher:?} to watch \"{name}\""));
        // Each address once, and an address again when its QUIC watch moved to the
        // same-host socket (at most `MOVES` times).
        let mut moves = 0;
        let mut addrs = addrs.into_iter();
        let mut again = None;
        while let Some(addr) = again.take().or_else(|| addrs.next()) {
            // The node is held only while linking: a watch never keeps it alive.
            let Some(node) = self.node.upgrade() else {
                return Error::Shutdown;
            };
            let linked = node.link(&addr).await;
            let ctx = node.ctx().clone();
            #[cfg(target_os = "linux")]
            let same_host = match &linked {
                Ok(_) => self.same_host(&node, &addr, name).await,
                Err(_) => None,
            };
            drop(node);
            #[cfg(target_os = "linux")]
            if let Some(watch) = same_host {
                // The QUIC link is not needed while the socket carries the watch.
                drop(linked);
                self.on_same_host(name, generation);
                return self.watch_same_host(&ctx, watch, name).await;
            }
            match linked {
                Ok(_) if reach == Reach::SameHost => {
                    last = Error::Io(format!("{publisher:?} is not on this host"));
                }
                Ok(link) if moves >= MOVES => return self.watch_on(&ctx, link, name).await,
                Ok(link) => {
                    // The pair's offers may not be exchanged yet (a link that came from the
                    // other side first, one that replaced another): move to the same-host
                    // socket once they say it is there.
                    tokio::select! {
                        ended = self.watch_on(&ctx, link, name) => return ended,
                        () = shm_route_appears(&ctx, &addr.id) => {
                            debug!(%name, "a QUIC watch moves to the same-host socket");
                            moves += 1;
                            again = Some(addr);
                        }
                    }
                }
                Err(e) => last = e,
            }
        }
        last
    }

    /// The publisher's addresses, from a broker's membership table (a look-up would count
    /// this node as fetching, or answer a small version with its bytes and no holders).
    async fn addresses(
        &self,
        name: &TensorName,
        publisher: NodeId,
    ) -> Result<Vec<crate::PeerAddr>> {
        let timeout = self.cluster.request_timeout;
        let members = self.cluster.ctl.members(timeout).await?;
        let Some(row) = members.into_iter().find(|m| m.member.node == publisher) else {
            return Err(Error::NotFound {
                what: format!("the publisher of \"{name}\" among the members"),
            });
        };
        let holder = tb_proto::HolderAddr {
            node: publisher,
            addrs: row.member.addrs,
            complete: true,
        };
        peers_of(&holder)
    }

    /// A watch of `name` open on the same-host socket of the peer at `addr`, when the pair's
    /// channel is shm and the socket answers.
    #[cfg(target_os = "linux")]
    async fn same_host(
        &self,
        node: &Node,
        addr: &crate::PeerAddr,
        name: &TensorName,
    ) -> Option<crate::channel::ShmWatch> {
        let ctx = node.ctx();
        let links = || node.link(addr);
        let Ok(Some(crate::channel::Route::Shm(route))) =
            crate::channel::route(ctx, &addr.id, links).await
        else {
            return None;
        };
        match crate::channel::ShmWatch::open(ctx, &route, name).await {
            Ok(watch) => Some(watch),
            Err(e) => {
                debug!(%name, ?e, "no same-host watch; watching over QUIC");
                None
            }
        }
    }

    /// A watch on the same-host socket, until it ends; returns why it ended.
    #[cfg(target_os = "linux")]
    async fn watch_same_host(
        &self,
        ctx: &NodeCtx,
        mut watch: crate::channel::ShmWatch,
        name: &TensorName,
    ) -> Error {
        let peer = watch.peer();
        // A header or payload that failed its checks (not a link that went away) is counted
        // and logged; `take` does the same for inline frames.
        let refused = |e: Error| {
            if matches!(e, Error::Corrupt(_)) {
                ctx.metrics.watch_offers_refused.inc();
                tracing::warn!(%name, peer = %peer.fmt_short(), %e, "refused an offer");
            }
            e
        };
        loop {
            let taken = match watch.next(ctx).await {
                Ok(crate::channel::WatchOffer::Inline(frame)) => self.take(ctx, name, peer, frame),
                Ok(crate::channel::WatchOffer::Mapped { version, tensor }) => {
                    ctx.metrics.watch_offers_in.inc();
                    let meta = tensor.meta().clone();
                    self.shared
                        .update(|f| f.published_with(name, version, meta, Some(tensor)));
                    Ok(())
                }
                Ok(crate::channel::WatchOffer::Coming { version, meta }) => {
                    // Told before the bytes are read, so news of the version from the
                    // broker meanwhile does not fetch it a second time.
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let coming = Some(super::feed::Carried::Coming(rx));
                    let told = meta.clone();
                    self.shared
                        .update(|f| f.published_carrying(name, version, told, coming));
                    watch
                        .read_coming(ctx, version, &meta)
                        .await
                        .map(|tensor| {
                            ctx.metrics.watch_offers_in.inc();
                            // Gone if the version was coalesced away meanwhile.
                            let _ = tx.send(tensor);
                        })
                        .map_err(refused)
                }
                Err(e) => Err(refused(e)),
            };
            if let Err(e) = taken {
                return e;
            }
        }
    }

    /// Takes one frame of a watch of `name` from `peer`: an offer that checks out goes into
    /// the feed; anything else ends the watch.
    fn take(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        peer: EndpointId,
        frame: DataResponse,
    ) -> Result<()> {
        let DataResponse::Offer {
            version,
            meta,
            bytes,
        } = frame
        else {
            return Err(Error::Io(format!(
                "{} answered a watch with a frame that is not an offer",
                peer.fmt_short()
            )));
        };
        let max = ctx.config.max_tensor_bytes;
        if let Err(e) = tb_proto::check_offer(name, version, &meta, &bytes, max) {
            ctx.metrics.watch_offers_refused.inc();
            tracing::warn!(%name, version, peer = %peer.fmt_short(), %e, "refused an offer");
            return Err(Error::Corrupt(format!(
                "an offer of \"{name}\" v{version} from {}: {e}",
                peer.fmt_short()
            )));
        }
        ctx.metrics.watch_offers_in.inc();
        let tensor = Some(Tensor::from_verified(meta.clone(), Bytes::from(bytes)));
        self.shared
            .update(|f| f.published_with(name, version, meta, tensor));
        Ok(())
    }

    /// One watch stream on `link`, until it ends; returns why it ended.
    async fn watch_on(&self, ctx: &NodeCtx, link: LinkGuard, name: &TensorName) -> Error {
        match self.stream(ctx, &link, name).await {
            Ok(never) => match never {},
            Err(e) => e,
        }
    }

    async fn stream(
        &self,
        ctx: &NodeCtx,
        link: &LinkGuard,
        name: &TensorName,
    ) -> Result<std::convert::Infallible> {
        let (mut send, mut recv) = client::open(ctx, link).await?;
        let request = DataRequest::Watch { name: name.clone() };
        wire::write_frame_within(&mut send, &request, ctx.config.stall_timeout).await?;
        let peer: EndpointId = link.peer();
        loop {
            let frame = match wire::read_frame::<DataResponse>(&mut recv).await {
                Ok(frame) => frame,
                Err(e) => return Err(e.into_error(&format!("a watch of \"{name}\"")).into()),
            };
            match frame {
                DataResponse::Error { code, message } => {
                    return Err(client::remote_error(link, code, message));
                }
                frame => self.take(ctx, name, peer, frame)?,
            }
        }
    }
}
