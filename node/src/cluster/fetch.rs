//! A get through the cluster: ask a broker where a version is (`held`: this node's own copy
//! is returned only when its hash is the registry's), pull it from the holders it names (best
//! first, resuming where a failed holder left off), keep it, and tell the broker this node
//! holds it now.
//!
//! A holder that fails (unreachable, connection lost, too slow, wrong bytes) is dropped for
//! this get and the next one is tried. A holder still receiving the version (`complete:
//! false`) that has not started yet is skipped for now, not dropped. When the list runs out,
//! the broker is asked once more and the holders not dropped are tried; after that the get
//! fails with `NoHolder`.
//!
//! Too slow: the stream from a source must bring `Config::min_source_rate` bytes per second
//! over each whole stall period (`Config::stall_timeout`), the first source's included; one
//! that does not fails with `Timeout` (the stream's watchdog, see `wire`), and the get
//! resumes from the next holder. A stream that ends within one period is never judged.
//!
//! Wrong bytes: the hash is checked over the whole buffer once every byte is in. When the
//! bytes came from one source it is dropped; when they came from several (the get resumed),
//! none is blamed for another's bytes: the buffer starts over and each of them is asked for
//! the whole version in turn, and from then on the get takes the version whole from one
//! source (see `tries`).
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
//!
//! A get dropped part-way (a deadline, a caller that stopped waiting) stops its streams and
//! its receive as it drops them, and hands its fan-out slot back (`slot`).

use std::{
    collections::VecDeque,
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

use super::{
    Cluster,
    calls::Holders,
    held::{self, Found},
    pace::Pace,
    resume, swarm,
    tries::Tries,
};
use crate::{
    channel::{self, Channel, HostBuf},
    client::{self, Failure, Pulled},
    endpoint::PeerAddr,
    error::{Error, Result},
    inflight::Receiving,
    node::Node,
    pool::LinkGuard,
    progress::TransferProgress,
    store::{Inserted, Lookup},
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
    cluster.ensure_joined().await?;
    let inflight = &node.ctx().inflight;
    // A version this node holds is served from its store meanwhile, not as a receive.
    let early = version
        .filter(|v| !matches!(store.get(&name, Some(*v)), Lookup::Found(..)))
        .map(|v| inflight.start(&name, v, None));
    let (holders, mut slot) = match held::look_up(node, cluster, &name, version).await? {
        Found::Holders(holders, slot) => (holders, slot),
        Found::Held(v, tensor) => {
            if let Some(receiving) = early {
                receiving.done(tensor.clone());
            }
            return Ok(pulled(name, v, tensor, progress));
        }
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
    let len = memory_len(&meta)?;
    slot.announce_start();
    let feed = Reports {
        receiving: &mut receiving,
        progress,
    };
    let mut dest = HostBuf::new(len)?;
    // Boxed: the transfer's future is deep, and callers nest gets in futures of their own
    // (the compiler's layout queries have a depth limit).
    let fetched = Box::pin(from_holders(
        node,
        cluster,
        &name,
        holders,
        feed,
        dest.as_mut(),
    ))
    .await;
    drop(slot);
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
        // From a task: the caller has its bytes now, not one broker round trip later (the op
        // is stamped, so a later "dropped it" still wins however the two arrive).
        let (op, cluster, cancel) = (
            cluster.holder_op(&name, v, true),
            cluster.clone(),
            node.ctx().cancel.clone(),
        );
        let announced_name = name.clone();
        node.ctx().tracker.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                sent = cluster.announce(vec![op]) => if let Err(e) = sent {
                    warn!(name = %announced_name, v, %e, "fetched, but could not tell the broker this node holds it");
                }
            }
        });
    }
    Ok(Pulled {
        name,
        version: v,
        meta,
        buffer: tensor,
    })
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

/// Where a get reports the bytes it receives: the cut-through feed for this node's own
/// pullers, and the caller's progress.
pub(super) struct Reports<'a> {
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
    feed: Reports<'_>,
    dest: &mut [u8],
) -> Result<Received> {
    let Reports {
        receiving,
        progress,
    } = feed;
    if first.meta.byte_len >= swarm::MIN_BYTES && !whole_by_channel(node, cluster, &first).await {
        let feed = Reports {
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
        holders,
        ..
    } = first;
    let want = Want {
        cluster,
        name,
        version,
        meta: &meta,
    };
    let mut one = OneStream {
        want,
        dest,
        receiving,
        progress,
        resume: resume::Resume::default(),
        reached: AtomicU64::new(0),
        pace: Pace::default(),
        tries: Tries::default(),
        moves: 0,
    };
    let mut queue = VecDeque::from(holders);
    let mut round = 0;
    loop {
        let mut next = None;
        while let Some(holder) = queue.pop_front() {
            if holder.node == cluster.me() || one.tries.dropped.contains(&holder.node) {
                continue;
            }
            match one.attempt(node, &holder).await? {
                Step::Done(received) => return Ok(received),
                Step::Moved(fresh) => {
                    next = Some(fresh);
                    break;
                }
                Step::AskWhole(sources) => {
                    for source in sources.into_iter().rev() {
                        queue.push_front(source);
                    }
                }
                Step::Next => {}
            }
        }
        queue = match next {
            // A move is not a round: the broker's answer is fresh.
            Some(fresh) => fresh.into(),
            None => {
                round += 1;
                if round == ROUNDS {
                    break;
                }
                tokio::time::sleep(RELOOKUP_DELAY).await;
                let exclude = one.tries.excluded();
                let found = cluster.lookup_excluding(name, Some(version), &exclude);
                found.await?.holders.into()
            }
        };
    }
    Err(one.tries.exhausted(format!("tensor \"{name}\" v{version}")))
}

/// One get's pull in one stream: its buffer, how far it got, and what it learned of its
/// sources.
struct OneStream<'a> {
    want: Want<'a>,
    dest: &'a mut [u8],
    receiving: &'a mut Receiving,
    progress: Option<&'a TransferProgress>,
    resume: resume::Resume,
    /// Bytes in, for the pace watch while a pull runs.
    reached: AtomicU64,
    pace: Pace,
    tries: Tries,
    moves: usize,
}

/// What the get does after one attempt.
enum Step {
    /// Every byte is in.
    Done(Received),
    /// Move on to these sources (the broker's latest answer).
    Moved(Vec<HolderAddr>),
    /// The bytes did not hash right and came from several sources: ask these for the whole
    /// version next.
    AskWhole(Vec<HolderAddr>),
    /// Go on with the next holder.
    Next,
}

impl OneStream<'_> {
    /// Pulls the rest (or, after a mismatch, the whole) of the version from `holder`; `Err`
    /// only when the node shuts down.
    async fn attempt(&mut self, node: &Node, holder: &HolderAddr) -> Result<Step> {
        let (name, version) = (self.want.name, self.want.version);
        self.tries.count += 1;
        let at = self.resume.filled();
        let into = resume::Target {
            dest: &mut *self.dest,
            resume: &mut self.resume,
            feed: &*self.receiving,
            progress: self.progress,
            reached: &self.reached,
        };
        let watch = (self.moves < MAX_MOVES && !self.tries.whole()).then(|| Watch {
            want: self.want,
            current: holder.node,
            exclude: self.tries.excluded(),
            pace: &mut self.pace,
        });
        let ended = from_holder(node, holder, self.want, into, watch).await;
        if self.resume.filled() > at {
            self.tries.contributed(holder);
        }
        match ended {
            Ok(Ended::Whole(mapped)) => Ok(Step::Done(Received::Whole(mapped))),
            Ok(Ended::Filled) => Ok(Step::Done(Received::Filled(None))),
            Ok(Ended::Moved { holders, slow }) => {
                debug!(%name, version, holder = ?holder.node, at = self.resume.filled(), slow, "moving to another source");
                if slow {
                    self.tries.dropped.insert(holder.node);
                }
                self.moves += 1;
                Ok(Step::Moved(holders))
            }
            Err(Error::Shutdown) => Err(Error::Shutdown),
            Err(e @ Error::Corrupt(_)) => {
                warn!(%name, version, holder = ?holder.node, %e, "bytes that do not hash to the registry's");
                let again = self.tries.mismatch(holder, e);
                self.start_over();
                Ok(Step::AskWhole(again))
            }
            Err(e) => {
                debug!(%name, version, holder = ?holder.node, at, %e, "holder failed");
                self.tries.failed(holder, e);
                if self.tries.whole() && self.resume.filled() > 0 {
                    self.start_over();
                }
                Ok(Step::Next)
            }
        }
    }

    /// Empties the buffer: the next source sends the whole version.
    fn start_over(&mut self) {
        self.resume.reset();
        self.reached.store(0, Ordering::Relaxed);
        self.receiving.restart();
        self.receiving.in_one_stream();
        self.tries.restarted();
    }
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
    into: resume::Target<'_>,
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
    let pull = async |route: &channel::Route| route.pull(ctx, name, Some(version)).await;
    let Some(pulled) = channel::first(ctx, &peer.id, links, TransferKind::Pull, pull).await? else {
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
    mut into: resume::Target<'_>,
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
