//! A get in one stream: from the broker's holders, best first, resuming where a failed holder
//! left off, moving to another source when the broker names one first or `pace` judges the
//! current one slow (see the module above for the rules), then from the holders of one more
//! look-up.

use std::{
    collections::VecDeque,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use tb_dashboard::TransferKind;
use tb_proto::{HolderAddr, MAX_LOOKUP_EXCLUDE, NodeId, TensorMeta, TensorName};
use tracing::{debug, warn};

use crate::{
    LinkGuard, PeerAddr,
    client::{self, Failure},
    cluster::{Cluster, calls::Holders, pace::Pace, resume, tries::Tries},
    error::{Error, Result},
    inflight::Receiving,
    node::Node,
    progress::TransferProgress,
    tensor::Tensor,
};

use super::sources::{REFRESH, Received, Reports, by_channel, peers_of};

/// Rounds of holders: the broker's first answer, then one more look-up.
const ROUNDS: usize = 2;
/// Pause before the second look-up, so holders still receiving the version can finish.
const RELOOKUP_DELAY: Duration = Duration::from_millis(100);
/// Most moves to another source in one get; after that it stays with the source it has.
const MAX_MOVES: usize = 64;

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

/// Receives the version `first` describes into `dest` in one stream from its holders, best
/// first, moving to another source when the broker names one or the current one is slow,
/// then from the holders of one more look-up.
pub(super) async fn fetch(
    node: &Node,
    cluster: &Cluster,
    name: &TensorName,
    first: Holders,
    reports: Reports<'_>,
    dest: &mut [u8],
) -> Result<Received> {
    let Reports {
        receiving,
        progress,
    } = reports;
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
