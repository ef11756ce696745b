//! Fetching a large version in pieces from several sources at once, each piece verified on
//! arrival.
//!
//! The version is cut the way every node cuts it (`tb_proto::piece`: pieces of a few MiB,
//! each a subtree of the version's BLAKE3 tree). The fetch asks each source of the broker's
//! set (the first `sources` holders of a look-up: its place in the chain and the helpers with
//! capacity to spare) for the version's pieces (`DataRequest::Pieces`): the first answer's
//! outline (every piece's chaining value) must merge into the hash the registry lists, and
//! every later one must equal it. A source that holds the version serves every piece; one
//! still receiving it names the pieces it has verified, then each new one (`Have`), so this
//! node only ever asks a source for a piece it has — fetchers that are each other's sources
//! never wait on each other.
//!
//! Each source takes up to [`DEPTH`] piece requests at a time (`Pull`s of the piece's range,
//! on the pooled link), the lowest piece missing that it has first, so bytes arrive nearly in
//! order and this node's own pullers (cut-through) get them soon. A piece is checked against
//! its chaining value as it lands; a wrong one drops its source. A piece outstanding longer
//! than [`late_after`] (a few times what the best source takes for a piece) is asked of
//! another source that has it as well, and the first verified copy wins; a source that loses
//! [`MAX_LATE`] such races, or fails a request, is dropped for the rest of the fetch and
//! excluded from its look-ups. Every [`REFRESH`] the fetch looks up again (which keeps its
//! fan-out slots fresh): sources that joined the broker's set are added, those that left it
//! get no new requests while a source in the set may serve (so a fetcher the broker moves
//! to a chain's tail leaves its old source to the fetchers that need it).
//!
//! Verified pieces are published to this node's pullers at once (`Receiving::piece`), in
//! whatever order they land. When no source can offer pieces (a version held on a device,
//! a source receiving in one stream), the fetch says so and the caller takes the version in
//! one stream instead.

use std::{
    collections::HashSet,
    future::Future,
    ops::Range,
    pin::Pin,
    time::{Duration, Instant},
};

use bytes::Bytes;
use iroh::endpoint::{RecvStream, SendStream, VarInt};
use n0_future::{FuturesUnordered, StreamExt};
use tb_dashboard::TransferKind;
use tb_proto::{
    CloseCode, DataRequest, DataResponse, HolderAddr, MAX_LOOKUP_EXCLUDE, NodeId, TensorMeta,
    TensorName,
    piece::{self, MAX_SOURCES},
};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::sources::{REFRESH, Reports};
use crate::cluster::{Cluster, calls::Holders};
use crate::{
    PeerAddr,
    channel::verify::Pieces,
    client,
    error::{Error, Result},
    node::Node,
    tensor::Outline,
    wire,
};

/// Tensors of at least this many bytes are fetched in pieces (four or more).
pub(super) const MIN_BYTES: u64 = piece::MULTI_SOURCE_MIN_BYTES;
/// Piece requests one source has outstanding at a time (two keep its link busy between
/// requests).
const DEPTH: usize = 2;
/// Races for late pieces a source may lose before it is dropped as slow.
const MAX_LATE: usize = 2;
/// A piece is late after this many times what the best source takes for one.
const LATE_FACTOR: u32 = 4;
/// Nor before this long.
const LATE_MIN: Duration = Duration::from_millis(500);
/// Before any piece has arrived, a piece is late after this long.
const LATE_FIRST: Duration = Duration::from_secs(3);
/// Look-ups that may find no usable source before the fetch gives up.
const ROUNDS: usize = 2;

type Job<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a fetch in pieces ended well.
pub(super) enum Swarmed {
    /// Every piece is in the destination, verified against this outline.
    Filled(Outline),
    /// No source could offer pieces: fetch the version in one stream.
    OneStream,
}

/// What one source offers.
#[derive(Debug)]
enum Offer {
    /// Connecting, or its outline not in yet.
    Unknown,
    /// Every piece.
    All,
    /// These pieces (indexed by piece).
    Some(Vec<bool>),
    /// It has no pieces to offer (answered `Pieces` with an error): not a failure.
    None,
}

/// One source of the fetch.
#[derive(Debug)]
struct Source {
    node: NodeId,
    /// The address that linked, once one did.
    peer: Option<PeerAddr>,
    offer: Offer,
    /// Piece requests outstanding.
    busy: usize,
    /// No longer in the broker's set: asked only for pieces no other source has.
    retired: bool,
    dropped: bool,
    /// Races for late pieces lost.
    late: usize,
    /// Cancels its requests outstanding (when it leaves the broker's set).
    cancel: CancellationToken,
}

impl Source {
    fn has(&self, piece: usize) -> bool {
        match &self.offer {
            Offer::All => true,
            Offer::Some(have) => have.get(piece).copied().unwrap_or(false),
            Offer::Unknown | Offer::None => false,
        }
    }

    fn usable(&self) -> bool {
        !self.dropped && self.peer.is_some() && matches!(self.offer, Offer::All | Offer::Some(_))
    }

    /// Whether it may still come to offer pieces.
    fn pending(&self) -> bool {
        !self.dropped && matches!(self.offer, Offer::Unknown)
    }
}

/// Where one piece is.
#[derive(Debug, Clone)]
enum State {
    Missing,
    /// Requested from these sources, each at the time given (the first copy first).
    Fetching {
        from: Vec<(usize, Instant)>,
    },
    Done,
}

/// What a source's `Pieces` stream said.
enum Heard {
    /// Linked and answered (the first frame), with the stream to read on.
    Opened(PeerAddr, RecvStream, SendStream, DataResponse),
    /// A later frame.
    Frame(RecvStream, SendStream, DataResponse),
    /// The stream ended after its last frame.
    Ended,
    /// Linking, the request or the stream failed.
    Failed(Error),
}

/// A piece request's result: the bytes and their chaining value (`None`: cancelled, another
/// copy was verified first).
type Got = Result<Option<(Vec<u8>, [u8; 32])>>;

/// The fetch's whole state.
struct Swarm<'a> {
    node: &'a Node,
    cluster: &'a Cluster,
    name: &'a TensorName,
    version: u64,
    meta: &'a TensorMeta,
    pieces: Pieces,
    outline: Option<Outline>,
    state: Vec<State>,
    done: usize,
    sources: Vec<Source>,
    /// Nodes dropped during this fetch (excluded from look-ups).
    dropped: HashSet<NodeId>,
    /// Cancels the other copies of a piece once one is verified.
    tokens: Vec<CancellationToken>,
    /// The fastest piece seen from any source (for lateness).
    best_piece: Option<Duration>,
    last_error: Option<Error>,
}

/// Fetches `version` of `name` (described by `first`'s answer) in pieces from the broker's
/// set of sources into `dest` (exactly its length), publishing each verified piece to
/// `feed`.
pub(super) async fn fetch(
    node: &Node,
    cluster: &Cluster,
    name: &TensorName,
    first: &Holders,
    feed: Reports<'_>,
    dest: &mut [u8],
) -> Result<Swarmed> {
    let meta = &first.meta;
    let pieces = Pieces::fixed(meta.byte_len);
    let count = piece::piece_count(meta.byte_len);
    let mut swarm = Swarm {
        node,
        cluster,
        name,
        version: first.version,
        meta,
        pieces,
        outline: None,
        state: vec![State::Missing; count],
        done: 0,
        sources: Vec::new(),
        dropped: HashSet::new(),
        tokens: (0..count).map(|_| CancellationToken::new()).collect(),
        best_piece: None,
        last_error: None,
    };
    let timer = node.ctx().metrics.start_transfer(TransferKind::Pull);
    let result = swarm.run(first, feed, dest).await;
    match &result {
        Ok(Swarmed::Filled(_)) => {
            node.ctx()
                .metrics
                .channels
                .finished(tb_proto::ChannelKind::Quic);
            timer.ok();
        }
        Ok(Swarmed::OneStream) => timer.discard(),
        Err(_) => timer.error(),
    }
    result
}

impl<'a> Swarm<'a> {
    async fn run(
        &mut self,
        first: &Holders,
        feed: Reports<'_>,
        dest: &mut [u8],
    ) -> Result<Swarmed> {
        let Reports {
            receiving,
            progress,
        } = feed;
        let mut streams: FuturesUnordered<Job<'a, (usize, Heard)>> = FuturesUnordered::new();
        let mut requests: FuturesUnordered<Job<'a, (usize, usize, Got)>> = FuturesUnordered::new();
        self.join(&first.holders, first.sources, &mut streams);
        let start = tokio::time::Instant::now() + REFRESH;
        let mut refresh = tokio::time::interval_at(start, REFRESH);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // At most one look-up at a time, run beside the transfers.
        let mut looking: Option<Job<'a, Result<Holders>>> = None;
        let (mut rounds, mut last_piece) = (0, Instant::now());
        let stall = self.node.ctx().config.stall_timeout;
        let cancel = self.node.ctx().cancel.clone();
        while self.done < self.state.len() {
            self.schedule(&mut requests);
            let idle = requests.is_empty() && streams.is_empty() && looking.is_none();
            if idle && !self.sources.iter().any(Source::usable) {
                if let Some(instead) = self.nobody_left(&mut rounds).await? {
                    return Ok(instead);
                }
                looking = Some(self.look_up());
            }
            let look = async {
                match looking.as_mut() {
                    Some(found) => found.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return Err(Error::Shutdown),
                Some((i, heard)) = streams.next() => {
                    let had = self.outline.is_some();
                    self.heard(i, heard, &mut streams);
                    if let (false, Some(outline)) = (had, &self.outline) {
                        // This node serves its verified pieces from now on.
                        receiving.set_outline(outline.clone());
                    }
                }
                Some((i, p, got)) = requests.next() => {
                    let before = self.done;
                    self.got(i, p, got, dest, receiving);
                    if self.done > before {
                        last_piece = Instant::now();
                        let bytes = self.done as u64 * piece::piece_len(self.meta.byte_len);
                        crate::progress::reached(progress, bytes.min(self.meta.byte_len));
                    }
                }
                found = look => {
                    looking = None;
                    self.found(found, &mut streams)?;
                }
                _ = refresh.tick() => {
                    self.check_stalled(last_piece.elapsed(), stall)?;
                    if looking.is_none() {
                        looking = Some(self.look_up());
                    }
                }
            }
        }
        // Stop the sources' streams: this fetch needs nothing more from them.
        drop(streams);
        match self.outline.clone() {
            Some(outline) => Ok(Swarmed::Filled(outline)),
            // Every piece verified against an outline: one was there.
            None => Err(Error::Io("pieces without an outline".into())),
        }
    }

    /// Nobody left to ask (no source offers pieces, or every one was dropped): the version in
    /// one stream instead when that is what is left, an error once the rounds ran out, else
    /// (`None`) a look-up after a pause.
    async fn nobody_left(&mut self, rounds: &mut usize) -> Result<Option<Swarmed>> {
        if self.one_stream_only() {
            return Ok(Some(Swarmed::OneStream));
        }
        *rounds += 1;
        if *rounds > ROUNDS {
            return Err(self.exhausted());
        }
        tokio::time::sleep(REFRESH / 5).await;
        Ok(None)
    }

    /// A fetch that had its outline but got no piece for a whole stall period gives up.
    fn check_stalled(&self, quiet: Duration, stall: Duration) -> Result<()> {
        if quiet <= stall || self.outline.is_none() {
            return Ok(());
        }
        let (name, version) = (self.name, self.version);
        let (done, all) = (self.done, self.state.len());
        let what = format!("pieces of tensor \"{name}\" v{version} ({done} of {all} in)");
        Err(Error::timeout(what, stall))
    }

    /// Whether the sources left could serve the version in one stream only: none is usable,
    /// some offered no pieces (and was not dropped), and no piece came in yet.
    fn one_stream_only(&self) -> bool {
        self.done == 0
            && self
                .sources
                .iter()
                .any(|s| !s.dropped && matches!(s.offer, Offer::None))
    }

    /// Adds the first `sources` of `holders` that are not sources yet (and not this node or
    /// dropped) as sources, asking each for its pieces; retires sources no longer among them.
    fn join(
        &mut self,
        holders: &[HolderAddr],
        sources: usize,
        streams: &mut FuturesUnordered<Job<'a, (usize, Heard)>>,
    ) {
        let me = self.cluster.me();
        let set: Vec<&HolderAddr> = holders
            .iter()
            .filter(|h| h.node != me && !self.dropped.contains(&h.node))
            .take(sources.clamp(1, MAX_SOURCES))
            .collect();
        for s in &mut self.sources {
            let retired = !set.iter().any(|h| h.node == s.node);
            if retired && !s.retired {
                // Its pieces in flight go back to missing: the broker moved this fetch off
                // it, to leave its upload to fetchers that need it.
                s.cancel.cancel();
                s.cancel = CancellationToken::new();
            }
            s.retired = retired;
        }
        let nodes: Vec<_> = set.iter().map(|h| h.node).collect();
        debug!(name = %self.name, version = self.version, ?nodes, "the broker's set");
        for holder in set {
            if self.sources.iter().any(|s| s.node == holder.node) {
                continue;
            }
            let i = self.sources.len();
            self.sources.push(Source {
                node: holder.node,
                peer: None,
                offer: Offer::Unknown,
                busy: 0,
                retired: false,
                dropped: false,
                late: 0,
                cancel: CancellationToken::new(),
            });
            streams.push(Box::pin(open(
                self.node,
                holder.clone(),
                self.name.clone(),
                self.version,
                i,
            )));
        }
    }

    /// A look-up of the version that excludes the sources dropped, and those holding a late
    /// piece that no other source of the set has (so that the broker names another source
    /// to ask for it: a source that died without closing its link looks like this until its
    /// requests time out).
    fn look_up(&self) -> Job<'a, Result<Holders>> {
        let mut exclude: Vec<NodeId> = self.dropped.iter().copied().collect();
        exclude.extend(self.stuck());
        exclude.sort();
        exclude.truncate(MAX_LOOKUP_EXCLUDE);
        let (cluster, name, version) = (self.cluster, self.name, self.version);
        Box::pin(async move {
            cluster
                .lookup_excluding(name, Some(version), &exclude)
                .await
        })
    }

    /// Joins the broker's set from a look-up's answer.
    fn found(
        &mut self,
        found: Result<Holders>,
        streams: &mut FuturesUnordered<Job<'a, (usize, Heard)>>,
    ) -> Result<()> {
        match found {
            Ok(found) if found.meta == *self.meta => {
                self.join(&found.holders, found.sources, streams);
                Ok(())
            }
            Ok(_) => Err(Error::InvalidTensor(format!(
                "tensor \"{}\" v{}: the broker now lists other bytes for this version",
                self.name, self.version
            ))),
            // No holder left (besides those dropped) is not the end while sources remain.
            Err(e) if self.sources.iter().any(|s| s.usable() || s.pending()) => {
                debug!(name = %self.name, version = self.version, %e, "a look-up while fetching pieces failed");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Takes what source `i`'s `Pieces` stream said.
    fn heard(
        &mut self,
        i: usize,
        heard: Heard,
        streams: &mut FuturesUnordered<Job<'a, (usize, Heard)>>,
    ) {
        let (recv, send, frame) = match heard {
            Heard::Opened(peer, recv, send, frame) => {
                self.sources[i].peer = Some(peer);
                (recv, send, frame)
            }
            Heard::Frame(recv, send, frame) => (recv, send, frame),
            Heard::Ended => return,
            Heard::Failed(e) => return self.drop_source(i, e),
        };
        let more = match self.take_frame(i, frame) {
            Ok(more) => more,
            Err(e) => {
                let mut send = send;
                let _ = send.reset(VarInt::from_u32(CloseCode::ProtocolError.code()));
                return self.drop_source(i, e);
            }
        };
        if more {
            streams.push(Box::pin(next_frame(i, recv, send)));
        }
    }

    /// Applies one frame of source `i`'s stream; `true` when more frames follow.
    fn take_frame(&mut self, i: usize, frame: DataResponse) -> Result<bool> {
        let count = self.state.len();
        let bad = |what: String| Error::Io(format!("pieces of tensor: {what}"));
        frame.validate().map_err(|e| bad(e.to_string()))?;
        match frame {
            DataResponse::Outline {
                piece_len,
                values,
                complete,
                have,
            } => {
                self.check_outline(piece_len, values)?;
                let offer = match complete {
                    true => Offer::All,
                    false => {
                        tb_proto::piece::check_indexes(&have, count)
                            .map_err(|e| bad(e.to_string()))?;
                        let mut map = vec![false; count];
                        for p in have {
                            map[p as usize] = true;
                        }
                        Offer::Some(map)
                    }
                };
                self.sources[i].offer = offer;
                Ok(!complete)
            }
            DataResponse::Have { pieces, complete } => {
                tb_proto::piece::check_indexes(&pieces, count).map_err(|e| bad(e.to_string()))?;
                let source = &mut self.sources[i];
                match &mut source.offer {
                    _ if complete => source.offer = Offer::All,
                    Offer::Some(map) => pieces.iter().for_each(|&p| map[p as usize] = true),
                    _ => return Err(bad("pieces named before an outline".into())),
                }
                Ok(!complete)
            }
            DataResponse::Error { code, message } => {
                // A source with no pieces to offer may serve the version in one stream (a
                // device holder, an older node), or not have it at all (restarted): look-ups
                // leave it out from now on, so the broker names others.
                debug!(source = ?self.sources[i].node, ?code, %message, "no pieces offered");
                self.sources[i].offer = Offer::None;
                self.dropped.insert(self.sources[i].node);
                Ok(false)
            }
            other => Err(bad(format!("unexpected answer {other:?}"))),
        }
    }

    /// Checks an outline: the first one against the version's hash, later ones against the
    /// first.
    fn check_outline(&mut self, piece_len: u64, values: Vec<[u8; 32]>) -> Result<()> {
        let len = self.meta.byte_len;
        tb_proto::piece::check_outline(len, piece_len, values.len())
            .map_err(|e| Error::Corrupt(format!("an outline that does not fit: {e}")))?;
        match &self.outline {
            Some(known) if **known == *values => Ok(()),
            Some(_) => Err(Error::Corrupt("an outline unlike the others".into())),
            None => match self.pieces.root_of_values(&values) {
                Some(root) if root == self.meta.hash => {
                    self.outline = Some(values.into());
                    Ok(())
                }
                _ => Err(Error::Corrupt(format!(
                    "an outline that does not hash to {}",
                    self.meta.hash
                ))),
            },
        }
    }

    /// Gives every source with room its next pieces.
    fn schedule(&mut self, requests: &mut FuturesUnordered<Job<'a, (usize, usize, Got)>>) {
        if self.outline.is_none() {
            return;
        }
        let late = self.late_after();
        let now = Instant::now();
        // Round by round, so that every source gets a piece before any gets a second.
        for depth in 1..=DEPTH {
            for i in 0..self.sources.len() {
                if !self.sources[i].usable() || self.sources[i].busy >= depth {
                    continue;
                }
                let Some(p) = self.pick(i, now, late) else {
                    continue;
                };
                let (Some(peer), Some(piece)) = (self.sources[i].peer.clone(), self.tokens.get(p))
                else {
                    continue;
                };
                let cancels = [piece.clone(), self.sources[i].cancel.clone()];
                match &mut self.state[p] {
                    State::Fetching { from } => from.push((i, now)),
                    state => {
                        *state = State::Fetching {
                            from: vec![(i, now)],
                        }
                    }
                }
                self.sources[i].busy += 1;
                let range = self.pieces.ranges()[p].clone();
                let job = fetch_piece(
                    self.node,
                    peer,
                    self.name,
                    self.version,
                    self.meta,
                    &self.pieces,
                    p,
                    range,
                    cancels,
                );
                requests.push(Box::pin(async move { (i, p, job.await) }));
            }
        }
    }

    /// The piece source `i` should fetch next: the lowest missing one it has, else a late one
    /// it has that is fetched from one source only; nothing while `i` is retired and a source
    /// in the broker's set may serve.
    fn pick(&self, i: usize, now: Instant, late: Duration) -> Option<usize> {
        let source = &self.sources[i];
        // A source that left the broker's set stays idle while one in it may serve.
        let active = |s: &Source| !s.retired && (s.usable() || s.pending());
        if source.retired && self.sources.iter().any(active) {
            return None;
        }
        let missing = (0..self.state.len())
            .find(|&p| matches!(self.state[p], State::Missing) && source.has(p));
        missing.or_else(|| {
            (0..self.state.len()).find(|&p| match &self.state[p] {
                State::Fetching { from } => match from.as_slice() {
                    [(only, since)] => {
                        *only != i && now.saturating_duration_since(*since) > late && source.has(p)
                    }
                    _ => false,
                },
                _ => false,
            })
        })
    }

    /// Sources holding a late piece that no other usable source in the set has.
    fn stuck(&self) -> Vec<NodeId> {
        let (late, now) = (self.late_after(), Instant::now());
        let mut stuck = Vec::new();
        for (p, state) in self.state.iter().enumerate() {
            let State::Fetching { from } = state else {
                continue;
            };
            let [(only, since)] = from.as_slice() else {
                continue;
            };
            let elsewhere = self
                .sources
                .iter()
                .enumerate()
                .any(|(j, s)| j != *only && !s.retired && s.usable() && s.has(p));
            if now.saturating_duration_since(*since) > late && !elsewhere {
                stuck.push(self.sources[*only].node);
            }
        }
        stuck.sort();
        stuck.dedup();
        stuck
    }

    /// How long a piece may be outstanding before another source is asked for it too.
    fn late_after(&self) -> Duration {
        match self.best_piece {
            Some(best) => (best * LATE_FACTOR).max(LATE_MIN),
            None => LATE_FIRST,
        }
    }

    /// Takes the result of source `i`'s request for piece `p`.
    fn got(
        &mut self,
        i: usize,
        p: usize,
        got: Got,
        dest: &mut [u8],
        receiving: &mut crate::inflight::Receiving,
    ) {
        self.sources[i].busy = self.sources[i].busy.saturating_sub(1);
        // When this copy was asked for; the copies still out.
        let (asked, others) = match &mut self.state[p] {
            State::Fetching { from } => {
                let asked = from.iter().find(|(s, _)| *s == i).map(|(_, at)| *at);
                from.retain(|(s, _)| *s != i);
                let others = from.clone();
                if from.is_empty() {
                    self.state[p] = State::Missing;
                }
                match asked {
                    Some(asked) => (asked, others),
                    // Its source was dropped meanwhile.
                    None => return,
                }
            }
            // A copy that lost the race (cancelled, or verified second).
            State::Done | State::Missing => return,
        };
        let (bytes, value) = match got {
            Ok(Some(got)) => got,
            Ok(None) => return,
            Err(e) => return self.drop_source(i, e),
        };
        let expected = self.outline.as_ref().and_then(|o| o.get(p)).copied();
        if expected != Some(value) {
            let e = Error::Corrupt(format!(
                "tensor \"{}\" v{}: piece {p} from {:?} does not match the outline",
                self.name, self.version, self.sources[i].node
            ));
            return self.drop_source(i, e);
        }
        let range = self.pieces.ranges()[p].clone();
        let range = range.start as usize..range.end as usize;
        dest[range.clone()].copy_from_slice(&bytes);
        // Other copies lose: they are cancelled, and the sources asked before this one were
        // late.
        for (j, at) in others {
            if at < asked {
                self.sources[j].late += 1;
                if self.sources[j].late >= MAX_LATE {
                    let e = Error::Io("too slow: lost the race for late pieces".into());
                    self.drop_source(j, e);
                }
            }
        }
        self.tokens[p].cancel();
        self.state[p] = State::Done;
        self.done += 1;
        let took = Instant::now().saturating_duration_since(asked);
        tracing::trace!(piece = p, source = ?self.sources[i].node, ?took, "piece verified");
        self.best_piece = Some(self.best_piece.map_or(took, |b| b.min(took)));
        receiving.piece(dest, p as u32, range, Some(Bytes::from(bytes)));
    }

    /// Drops source `i` for the rest of the fetch: its pieces go back to missing.
    fn drop_source(&mut self, i: usize, e: Error) {
        let source = &mut self.sources[i];
        if source.dropped {
            return;
        }
        debug!(name = %self.name, version = self.version, source = ?source.node, %e, "source dropped");
        source.dropped = true;
        self.dropped.insert(source.node);
        for state in &mut self.state {
            if let State::Fetching { from } = state {
                from.retain(|(s, _)| *s != i);
                if from.is_empty() {
                    *state = State::Missing;
                }
            }
        }
        self.last_error = Some(e);
    }

    fn exhausted(&mut self) -> Error {
        Error::NoHolder {
            what: format!("tensor \"{}\" v{}", self.name, self.version),
            tried: self.sources.len(),
            last: self.last_error.take().map_or_else(
                || "no source offered the missing pieces".into(),
                |e| e.to_string(),
            ),
        }
    }
}

/// Links to `holder` (its first address that links) and asks it for the version's pieces.
async fn open(
    node: &Node,
    holder: HolderAddr,
    name: TensorName,
    version: u64,
    i: usize,
) -> (usize, Heard) {
    let heard = async {
        let mut last = None;
        for peer in super::sources::peers_of(&holder)? {
            let link = match node.link(&peer).await {
                Ok(link) => link,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let ctx = node.ctx();
            let (mut send, mut recv) = client::open(ctx, &link).await?;
            let request = DataRequest::Pieces {
                name: name.clone(),
                version,
            };
            wire::write_frame(&mut send, &request).await?;
            let what = format!("pieces of \"{name}\" v{version}");
            let frame = client::read_response(ctx, &mut recv, &what).await?;
            return Ok(Heard::Opened(peer, recv, send, frame));
        }
        Err(last.unwrap_or_else(|| Error::PeerUnreachable {
            peer: format!("{:?}", holder.node),
            reason: "no address to dial".into(),
        }))
    };
    (i, heard.await.unwrap_or_else(Heard::Failed))
}

/// The next frame of source `i`'s `Pieces` stream (it may wait as long as the source's own
/// receive takes: the fetch drops this future when it is done).
async fn next_frame(i: usize, mut recv: RecvStream, send: SendStream) -> (usize, Heard) {
    let heard = match wire::read_frame::<DataResponse>(&mut recv).await {
        Ok(frame) => Heard::Frame(recv, send, frame),
        Err(wire::ReadFrameError::Closed(_)) => Heard::Ended,
        Err(e) => Heard::Failed(e.into_error("pieces of a tensor").into()),
    };
    (i, heard)
}

/// Pulls bytes `range` (piece `index`) of the version from `peer`, hashing them as they
/// land; stops when either of `cancel` fires (another copy of the piece was verified first,
/// or the source left the broker's set).
#[allow(clippy::too_many_arguments)]
fn fetch_piece<'a>(
    node: &'a Node,
    peer: PeerAddr,
    name: &'a TensorName,
    version: u64,
    meta: &'a TensorMeta,
    pieces: &Pieces,
    index: usize,
    range: Range<u64>,
    cancel: [CancellationToken; 2],
) -> impl Future<Output = Got> + Send + 'a {
    let mut hasher = pieces.hasher(index);
    async move {
        let pull = async {
            let ctx = node.ctx();
            let link = node.link(&peer).await?;
            let (mut send, mut recv) = client::open(ctx, &link).await?;
            let len = (range.end - range.start) as usize;
            let request = DataRequest::Pull {
                name: name.clone(),
                version: Some(version),
                range: Some(tb_proto::ByteRange {
                    offset: range.start,
                    len: len as u64,
                }),
            };
            wire::write_frame(&mut send, &request).await?;
            let _ = send.finish();
            let what = format!(
                "piece {index} of \"{name}\" v{version} at {}",
                peer.id.fmt_short()
            );
            match client::read_response(ctx, &mut recv, &what).await? {
                DataResponse::Header {
                    meta: m,
                    version: v,
                } if v == version && m == *meta => {}
                DataResponse::Header { .. } => {
                    return Err(Error::InvalidTensor(format!(
                        "{what}: other bytes than the registry lists"
                    )));
                }
                DataResponse::Error { code, message } => {
                    return Err(client::remote_error(&link, code, message));
                }
                other => return Err(Error::Io(format!("{what}: unexpected answer {other:?}"))),
            }
            let mut buf = vec![0u8; len];
            let mut watchdog = ctx.quic_watchdog(tb_dashboard::Direction::In);
            let mut filled = 0;
            while filled < len {
                let n = wire::read_some(&mut recv, &mut buf[filled..], &mut watchdog, filled, len)
                    .await?;
                hasher.update(&buf[filled..filled + n]);
                filled += n;
            }
            let value = hasher
                .finish()
                .map_err(|e| Error::Corrupt(format!("{what}: {e}")))?
                .value();
            Ok(Some((buf, value)))
        };
        let [piece, source] = cancel;
        tokio::select! {
            biased;
            _ = piece.cancelled() => Ok(None),
            _ = source.cancelled() => Ok(None),
            got = pull => got,
        }
    }
}
