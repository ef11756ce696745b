//! A get through the cluster: ask a broker where a version is, pull it from the holders it
//! names (best first, resuming where a failed holder left off), keep it, and tell the broker
//! this node holds it now.
//!
//! A holder that fails (unreachable, connection lost, wrong or corrupt bytes) is dropped for
//! this get and the next one is tried. A holder still receiving the version (`complete:
//! false`) that has not started yet is skipped for now, not dropped. When the list runs out,
//! the broker is asked once more and the holders not dropped are tried; after that the get
//! fails with `NoHolder`.
//!
//! While it receives, this node serves the version to its own pullers (cut-through, see
//! `inflight`): the receive is registered before the look-up when the version is known (a
//! puller the broker points here may arrive before the look-up's answer does), and its bytes
//! are published as they land. Only the verified tensor reaches the store.
//!
//! While it pulls a version over QUIC, the get asks the broker again every [`REFRESH`]
//! (which also keeps its fan-out slot fresh) and moves, resuming at the byte it reached, when
//! the broker now names another source first (it moves slow fetchers off sources that fast
//! ones need, onto a chain's tail) or when `pace` judges the current source slow: it
//! delivered under a quarter of the best rate this get has seen. A slow source is dropped for
//! the rest of the get and excluded from its look-ups. The source loses nothing: its stream is
//! stopped as a finished one, and the abandoned pull counts as no transfer.
//!
//! When nothing of the version has arrived yet and the pair's channel is not QUIC, the holder
//! hands it over whole on that channel (`by_channel`): on this host as its sealed memfd
//! (shm: zero-copy), or over verified TCP sockets. A holder still receiving the version
//! declines shm (Busy) and answers a TCP pull over QUIC on the ticket's stream, so QUIC
//! carries it cut-through as between hosts.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use iroh::EndpointId;
use tb_dashboard::TransferKind;
use tb_proto::{HolderAddr, MAX_LOOKUP_EXCLUDE, NodeId, TensorMeta, TensorName};
use tracing::{debug, warn};

use super::{Cluster, calls::Holders, pace::Pace, resume, swarm};
use crate::{
    channel::{self, Channel, HostBuf},
    client::{self, Failure, Pulled},
    endpoint::PeerAddr,
    error::{Error, Result},
    inflight::Receiving,
    node::Node,
    pool::LinkGuard,
    progress::TransferProgress,
    store::{Inserted, Lookup, Store},
    tensor::{Outline, Tensor},
};

/// Rounds of holders: the broker's first answer, then one more look-up.
const ROUNDS: usize = 2;
/// Pause before the second look-up, so holders still receiving the version can finish.
const RELOOKUP_DELAY: Duration = Duration::from_millis(100);
/// How often a pull in progress asks the broker again.
pub(crate) const REFRESH: Duration = Duration::from_millis(500);
/// Most moves to another source in one get; after that it stays with the source it has.
const MAX_MOVES: usize = 64;

/// Gets `version` (the newest if `None`) of `name` through the cluster, recording the bytes
/// received on `progress` as they land.
pub(crate) async fn fetch(
    node: &Node,
    cluster: &Arc<Cluster>,
    name: TensorName,
    version: Option<u64>,
    progress: Option<&TransferProgress>,
) -> Result<Pulled<Tensor>> {
    let store = &node.ctx().store;
    if let Some(v) = version
        && let Lookup::Found(v, tensor) = store.get(&name, Some(v))
    {
        return Ok(pulled(name, v, tensor, progress));
    }
    cluster.ensure_joined().await?;
    let inflight = &node.ctx().inflight;
    let early = version.map(|v| inflight.start(&name, v, None));
    let holders = match look_up(cluster, store, &name, version).await? {
        Found::Holders(holders) => holders,
        Found::Held(v, tensor) => return Ok(pulled(name, v, tensor, progress)),
    };
    let (v, meta) = (holders.version, holders.meta.clone());
    if let Some(p) = progress {
        p.set_total(meta.byte_len);
    }
    let mut receiving = match early {
        Some(receiving) => {
            receiving.set_meta(&meta);
            receiving
        }
        None => inflight.start(&name, v, Some(meta.clone())),
    };
    if let Lookup::Found(_, tensor) = store.get(&name, Some(v))
        && tensor.hash() == meta.hash
    {
        receiving.done(tensor.clone());
        return Ok(pulled(name, v, tensor, progress));
    }
    let len = memory_len(&meta)?;
    if let Err(e) = cluster.fetching(&name, v, true).await {
        debug!(%name, v, %e, "broker did not take the fetch start");
    }
    let feed = Feed {
        receiving: &mut receiving,
        progress,
    };
    let mut dest = HostBuf::new(len)?;
    let fetched = from_holders(node, cluster, &name, holders, feed, dest.as_mut()).await;
    fetch_ended(node, cluster, &name, v);
    let tensor = match fetched? {
        Received::Whole(whole) => whole,
        Received::Filled(outline) => {
            let tensor = dest.into_tensor(meta.clone())?;
            match outline {
                Some(outline) => tensor.with_outline(outline),
                None => tensor,
            }
        }
    };
    let inserted = store.insert_at(name.clone(), v, tensor.clone());
    receiving.done(tensor.clone());
    if inserted == Inserted::Stored && cluster.serves {
        let op = cluster.holder_op(&name, v, true);
        if let Err(e) = cluster.announce(vec![op]).await {
            warn!(%name, v, %e, "fetched, but could not tell the broker this node holds it");
        }
    }
    Ok(Pulled {
        name,
        version: v,
        meta,
        buffer: tensor,
    })
}

/// Where a get's bytes are: with the holders a broker named, or in this node's store.
pub(super) enum Found {
    /// Pull from these.
    Holders(Holders),
    /// This node holds the version (and no other live node does).
    Held(u64, Tensor),
}

/// Asks a broker where `version` (the newest when `None`) of `name` is. The broker never
/// names the asker as a source: when this node is the only live holder (it published the
/// version itself), the answer is "no holder", and what it holds is the version to get.
pub(super) async fn look_up(
    cluster: &Cluster,
    store: &Store,
    name: &TensorName,
    version: Option<u64>,
) -> Result<Found> {
    match cluster.lookup(name, version).await {
        Ok(holders) => Ok(Found::Holders(holders)),
        Err(e @ Error::NotFound { .. }) => match store.get(name, version) {
            Lookup::Found(v, tensor) => Ok(Found::Held(v, tensor)),
            _ => Err(e),
        },
        Err(e) => Err(e),
    }
}

/// The byte length of a tensor as an in-memory length.
pub(super) fn memory_len(meta: &TensorMeta) -> Result<usize> {
    usize::try_from(meta.byte_len)
        .map_err(|_| Error::TooLarge(format!("{} bytes do not fit in memory", meta.byte_len)))
}

/// A version this node held already: all its bytes count as received.
fn pulled(
    name: TensorName,
    version: u64,
    tensor: Tensor,
    progress: Option<&TransferProgress>,
) -> Pulled<Tensor> {
    if let Some(p) = progress {
        p.set_total(tensor.byte_len());
        p.reached(tensor.byte_len());
    }
    Pulled {
        name,
        version,
        meta: tensor.meta().clone(),
        buffer: tensor,
    }
}

/// Tells the broker, from a task, that this node stopped fetching (frees its fan-out slot).
pub(super) fn fetch_ended(node: &Node, cluster: &Arc<Cluster>, name: &TensorName, version: u64) {
    let (cluster, name) = (cluster.clone(), name.clone());
    let ctx = node.ctx();
    let cancel = ctx.cancel.clone();
    ctx.tracker.spawn(async move {
        tokio::select! {
            _ = cancel.cancelled() => {}
            ended = cluster.fetching(&name, version, false) => if let Err(e) = ended {
                debug!(%name, version, %e, "broker did not take the fetch end");
            }
        }
    });
}

/// The holders tried so far and how the last one failed.
#[derive(Debug, Default)]
struct Tries {
    dropped: HashSet<NodeId>,
    count: usize,
    last: Option<Error>,
}

impl Tries {
    /// Notes `holder`'s failure: dropped for this get unless it is a holder still receiving
    /// the version that does not have it yet.
    fn failed(&mut self, holder: &HolderAddr, error: Error) {
        let not_yet = !holder.complete && matches!(error, Error::NotFound { .. });
        if !not_yet {
            self.dropped.insert(holder.node);
        }
        self.last = Some(error);
    }

    /// The sources to exclude from a look-up: those dropped, at most the protocol's limit.
    fn excluded(&self) -> Vec<NodeId> {
        let mut dropped: Vec<NodeId> = self.dropped.iter().copied().collect();
        dropped.sort();
        dropped.truncate(MAX_LOOKUP_EXCLUDE);
        dropped
    }

    fn exhausted(self, what: String) -> Error {
        let last = self.last.map_or_else(
            || "the broker named no other holder".into(),
            |e| e.to_string(),
        );
        Error::NoHolder {
            what,
            tried: self.count,
            last,
        }
    }
}

/// Where a get reports the bytes it receives: the cut-through feed for this node's own
/// pullers, and the caller's progress.
pub(super) struct Feed<'a> {
    pub(super) receiving: &'a mut Receiving,
    pub(super) progress: Option<&'a TransferProgress>,
}

/// The version one get is after.
#[derive(Clone, Copy)]
struct Want<'a> {
    cluster: &'a Cluster,
    name: &'a TensorName,
    version: u64,
    meta: &'a TensorMeta,
}

/// How a pull from one holder ended well.
enum Ended {
    /// The whole version came over the pair's channel.
    Whole(Tensor),
    /// Every byte is in the destination buffer, verified.
    Filled,
    /// The get moves on to these sources (the broker's latest answer) from where it got;
    /// `slow`: the holder left behind was judged slow.
    Moved {
        holders: Vec<HolderAddr>,
        slow: bool,
    },
}

/// How a get's bytes came in.
pub(super) enum Received {
    /// A holder handed the whole version over on the pair's channel.
    Whole(Tensor),
    /// Every byte is in the destination, verified: in pieces against this outline, or in
    /// one stream (`None`).
    Filled(Option<Outline>),
}

/// Receives the version `first` describes into `dest` (exactly its length): a large one in
/// pieces from the broker's set of sources (`swarm`) unless the pair's channel with the first
/// is not QUIC or no source offers pieces; otherwise in one stream from its holders, best
/// first, moving to another source when the broker names one or the current one is slow,
/// then from the holders of one more look-up.
pub(super) async fn from_holders(
    node: &Node,
    cluster: &Cluster,
    name: &TensorName,
    first: Holders,
    feed: Feed<'_>,
    dest: &mut [u8],
) -> Result<Received> {
    let Feed {
        receiving,
        progress,
    } = feed;
    if first.meta.byte_len >= swarm::MIN_BYTES && !whole_by_channel(node, cluster, &first).await {
        let feed = Feed {
            receiving: &mut *receiving,
            progress,
        };
        match swarm::fetch(node, cluster, name, &first, feed, &mut *dest).await? {
            swarm::Swarmed::Filled(outline) => return Ok(Received::Filled(Some(outline))),
            swarm::Swarmed::OneStream => {}
        }
    }
    receiving.in_one_stream();
    let Holders {
        version,
        meta,
        mut holders,
        ..
    } = first;
    let want = Want {
        cluster,
        name,
        version,
        meta: &meta,
    };
    let mut resume = resume::Resume::default();
    let reached = AtomicU64::new(0);
    let mut pace = Pace::default();
    let mut tries = Tries::default();
    let (mut round, mut moves) = (0, 0);
    while round < ROUNDS {
        let mut next = None;
        for holder in &holders {
            if holder.node == cluster.me() || tries.dropped.contains(&holder.node) {
                continue;
            }
            tries.count += 1;
            let at = resume.filled();
            let into = resume::Into {
                dest: &mut *dest,
                resume: &mut resume,
                feed: receiving,
                progress,
                reached: &reached,
            };
            let watch = (moves < MAX_MOVES).then(|| Watch {
                want,
                current: holder.node,
                exclude: tries.excluded(),
                pace: &mut pace,
            });
            match from_holder(node, holder, want, into, watch).await {
                Ok(Ended::Whole(mapped)) => return Ok(Received::Whole(mapped)),
                Ok(Ended::Filled) => return Ok(Received::Filled(None)),
                Ok(Ended::Moved { holders, slow }) => {
                    debug!(%name, version, holder = ?holder.node, at = resume.filled(), slow, "moving to another source");
                    if slow {
                        tries.dropped.insert(holder.node);
                    }
                    moves += 1;
                    next = Some(holders);
                    break;
                }
                Err(Error::Shutdown) => return Err(Error::Shutdown),
                Err(e) => {
                    debug!(%name, version, holder = ?holder.node, at, %e, "holder failed");
                    if matches!(e, Error::Corrupt(_)) {
                        resume.reset();
                        reached.store(0, Ordering::Relaxed);
                        receiving.restart();
                    }
                    tries.failed(holder, e);
                }
            }
        }
        holders = match next {
            // A move is not a round: the broker's answer is fresh.
            Some(fresh) => fresh,
            None => {
                round += 1;
                if round == ROUNDS {
                    break;
                }
                tokio::time::sleep(RELOOKUP_DELAY).await;
                let exclude = tries.excluded();
                let found = cluster.lookup_excluding(name, Some(version), &exclude);
                found.await?.holders
            }
        };
    }
    Err(tries.exhausted(format!("tensor \"{name}\" v{version}")))
}

/// The addresses of `holder` to dial, in the broker's order (those that do not parse are
/// skipped); `PeerUnreachable` when its node id is not a valid key.
pub(super) fn peers_of(holder: &HolderAddr) -> Result<Vec<PeerAddr>> {
    let id = EndpointId::from_bytes(&holder.node.0).map_err(|e| Error::PeerUnreachable {
        peer: format!("{:?}", holder.node),
        reason: format!("not a valid node id: {e}"),
    })?;
    let addrs = holder
        .addrs
        .iter()
        .filter_map(|a| a.parse::<SocketAddr>().ok());
    Ok(addrs.map(|addr| PeerAddr { id, addr }).collect())
}

/// Pulls the rest of the version from one holder, at the first of its addresses that links:
/// the whole version over the pair's channel (nothing of it received yet), or the bytes into
/// `into.dest` over QUIC, unless `watch` moves the get elsewhere first.
#[tracing::instrument(name = "fetch", skip_all, fields(peer = ?holder.node, tensor = %want.name, version = want.version))]
async fn from_holder(
    node: &Node,
    holder: &HolderAddr,
    want: Want<'_>,
    into: resume::Into<'_>,
    watch: Option<Watch<'_>>,
) -> Result<Ended> {
    let unreachable = |reason: String| Error::PeerUnreachable {
        peer: format!("{:?}", holder.node),
        reason,
    };
    let Want {
        name,
        version,
        meta,
        ..
    } = want;
    let mut last = None;
    for peer in peers_of(holder)? {
        match node.link(&peer).await {
            Ok(link) => {
                if into.resume.filled() == 0
                    && let Some(whole) =
                        by_channel(node, &peer, name, version, meta, into.progress).await?
                {
                    return Ok(Ended::Whole(whole));
                }
                let reached = into.reached;
                let pull = pull_from(node, &peer, link, name, version, meta, into);
                return watched(node, pull, watch, reached).await;
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| unreachable("no address to dial".into())))
}

/// Runs `pull` (counted as one pull) while `watch`, if any, looks for a reason to move. A move
/// drops the pull, which stops its stream as finished, and counts as no transfer: the get's
/// pull that completes is the one counted.
async fn watched(
    node: &Node,
    pull: impl Future<Output = Result<()>>,
    watch: Option<Watch<'_>>,
    reached: &AtomicU64,
) -> Result<Ended> {
    let timer = node.ctx().metrics.start_transfer(TransferKind::Pull);
    let moved = async {
        match watch {
            Some(watch) => watch.run(reached).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        pulled = pull => {
            timer.result(pulled.is_ok());
            pulled.map(|()| Ended::Filled)
        }
        (holders, slow) = moved => {
            timer.discard();
            Ok(Ended::Moved { holders, slow })
        }
    }
}

/// Watches one pull: asks the broker again every [`REFRESH`] and judges the source's pace.
struct Watch<'a> {
    want: Want<'a>,
    /// The source being pulled from.
    current: NodeId,
    /// Sources this get dropped.
    exclude: Vec<NodeId>,
    pace: &'a mut Pace,
}

impl Watch<'_> {
    /// Returns the broker's answer when the get should move: the broker names another source
    /// first, or the current one is slow (`true`; then it is excluded from the look-up, and
    /// the get stays with it if the broker has nothing else). Never returns otherwise.
    async fn run(self, reached: &AtomicU64) -> (Vec<HolderAddr>, bool) {
        let Want {
            cluster,
            name,
            version,
            ..
        } = self.want;
        self.pace.source(reached.load(Ordering::Relaxed));
        loop {
            tokio::time::sleep(REFRESH).await;
            let slow = self
                .pace
                .slow(Instant::now(), reached.load(Ordering::Relaxed));
            let mut exclude = self.exclude.clone();
            if slow {
                exclude.truncate(MAX_LOOKUP_EXCLUDE - 1);
                exclude.push(self.current);
            }
            let holders = match cluster
                .lookup_excluding(name, Some(version), &exclude)
                .await
            {
                Ok(found) => found.holders,
                Err(e) => {
                    debug!(%name, version, %e, "a look-up while pulling failed; staying");
                    continue;
                }
            };
            let me = cluster.me();
            let best = holders
                .iter()
                .find(|h| h.node != me && !exclude.contains(&h.node));
            match best {
                Some(b) if slow || b.node != self.current => {
                    let best_rate = self.pace.best();
                    debug!(%name, version, slow, best_rate, to = ?b.node, "a better source");
                    return (holders, slow);
                }
                _ => {}
            }
        }
    }
}

/// Whether the first source of `holders` (not this node) would hand the whole version over
/// on a channel other than QUIC (same-host shared memory, TCP): then a large version is not
/// fetched in pieces.
async fn whole_by_channel(node: &Node, cluster: &Cluster, holders: &Holders) -> bool {
    let Some(first) = holders.holders.iter().find(|h| h.node != cluster.me()) else {
        return false;
    };
    let Some(peer) = peers_of(first).ok().and_then(|p| p.into_iter().next()) else {
        return false;
    };
    let links = || node.link(&peer);
    matches!(
        channel::route(node.ctx(), &peer.id, links).await,
        Ok(Some(_))
    )
}

/// Gets the whole version from `peer` over the pair's channel when that is not QUIC: shm
/// maps the holder's sealed memfd (zero-copy; no hash pass, as the memfd cannot change after
/// its holder verified it), tcp receives it over verified sockets. `None`: pull it over QUIC
/// (the pair runs QUIC, the holder is still receiving the version, or the channel failed and
/// the pair fell back).
async fn by_channel(
    node: &Node,
    peer: &PeerAddr,
    name: &TensorName,
    version: u64,
    expected: &TensorMeta,
    progress: Option<&TransferProgress>,
) -> Result<Option<Tensor>> {
    let ctx = node.ctx();
    let links = || node.link(peer);
    let Some(route) = channel::route(ctx, &peer.id, links).await? else {
        return Ok(None);
    };
    let pull = route.pull(ctx, name, Some(version));
    let Some(pulled) = channel::attempt(ctx, &route, TransferKind::Pull, pull).await? else {
        return Ok(None);
    };
    if pulled.version != version || pulled.meta != *expected {
        return Err(Error::InvalidTensor(format!(
            "tensor \"{name}\" v{version} at {}: the holder sent v{} with hash {}, the \
             registry says hash {}",
            peer.id.fmt_short(),
            pulled.version,
            pulled.meta.hash,
            expected.hash
        )));
    }
    crate::progress::reached(progress, pulled.meta.byte_len);
    Ok(Some(pulled.buffer))
}

/// Pulls the rest of the version on `link`; when the holder closed the link gracefully before
/// serving the request (an idle close racing with it), once more on a fresh link, from where
/// it got.
async fn pull_from(
    node: &Node,
    peer: &PeerAddr,
    mut link: LinkGuard,
    name: &TensorName,
    version: u64,
    meta: &TensorMeta,
    mut into: resume::Into<'_>,
) -> Result<()> {
    let mut redials = 0;
    loop {
        let pull = resume::pull_rest(node.ctx(), &link, name, version, meta, into.reborrow());
        let err = match pull.await {
            Ok(()) => return Ok(()),
            Err(err) => err,
        };
        match client::after_failure(&link, err) {
            Failure::Redial(err) if redials < client::REDIALS => {
                redials += 1;
                debug!(%name, version, %err, "the holder closed the link under a request: redialing");
                link = node.link(peer).await?;
            }
            Failure::Redial(err) | Failure::Final(err) => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(n: u8, complete: bool) -> HolderAddr {
        HolderAddr {
            node: NodeId([n; 32]),
            addrs: vec!["127.0.0.1:1".into()],
            complete,
        }
    }

    #[test]
    fn holders_still_receiving_are_retried_others_are_dropped() {
        let mut tries = Tries::default();
        let not_found = || Error::NotFound {
            what: "m/w v2".into(),
        };
        tries.failed(&holder(1, false), not_found());
        tries.failed(&holder(2, true), not_found());
        tries.failed(&holder(3, false), Error::Corrupt("bad".into()));
        tries.count = 3;
        assert!(!tries.dropped.contains(&NodeId([1; 32])));
        assert!(tries.dropped.contains(&NodeId([2; 32])));
        assert!(tries.dropped.contains(&NodeId([3; 32])));
        match tries.exhausted("tensor \"m/w\" v2".into()) {
            Error::NoHolder {
                what,
                tried: 3,
                last,
            } => {
                assert!(what.contains("m/w"));
                assert!(last.contains("bad"), "{last}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Tries::default().exhausted(String::new()),
            Error::NoHolder { tried: 0, .. }
        ));
    }
}
