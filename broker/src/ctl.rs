//! The serving side of `tb/ctl/1` on a broker: the hello, then one task per request stream
//! that asks the [`BrokerActor`](crate::actor::BrokerActor) and writes the answer frames.
//!
//! Every request is checked against the access its sender proved at the hello (see
//! [`CtlRequest::write_action`]: publishing, deleting, version allocation, anti-entropy and
//! joining as a broker need the cluster secret) and validated before it reaches the actor; a
//! heartbeat's figures are recorded only once the actor accepted the heartbeat. Multi-frame
//! answers (`Listing`,
//! `Members`, anti-entropy) are cut with `chunk_by_size` so no frame passes the control-frame
//! cap. A subscription keeps its stream open and forwards events until either side closes.
//!
//! A connection remembers the epoch of the last heartbeat the actor accepted on it; when the
//! node closes it with [`CloseCode::Shutdown`](tb_proto::CloseCode::Shutdown), the actor is
//! told that the node left (`BrokerMsg::Leave`), so a short-lived client's row goes soon
//! after it does (see `BrokerState::leave`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use iroh::{
    endpoint::{Connection, ConnectionError, RecvStream, SendStream},
    protocol::{AcceptError, ProtocolHandler},
};
use ractor::{ActorRef, rpc::CallResult};
use tb_link::{
    auth,
    framing::{ReadFrameError, read_frame, write_frame},
};
use tb_proto::{
    Access, CTL_ALPN, ClusterKey, CtlRequest, CtlResponse, ErrorCode, LastHeartbeat,
    MAX_CHUNK_BYTES, Member, MemberStatus, chunk_by_size,
};
use tokio::sync::mpsc;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, debug_span, warn};

use crate::{
    BrokerError,
    actor::{BrokerMsg, SUBSCRIPTION_BUFFER},
    metrics::{BrokerCounters, MemberStatsBook, Refusal},
    sync,
};

/// Settings and handles the ctl protocol needs.
#[derive(Clone)]
pub(crate) struct CtlProtocol {
    pub(crate) actor: ActorRef<BrokerMsg>,
    pub(crate) key: ClusterKey,
    pub(crate) me: iroh::EndpointId,
    pub(crate) request_timeout: Duration,
    /// What connections get before their hello is verified (its own waiting slots: the
    /// data plane's are separate).
    pub(crate) admission: auth::Admission,
    pub(crate) max_tensor_bytes: u64,
    /// What anti-entropy conversations may buffer, all together.
    pub(crate) sync_budget: tb_link::budget::ByteBudget,
    pub(crate) cancel: CancellationToken,
    pub(crate) tracker: TaskTracker,
    pub(crate) counters: Arc<BrokerCounters>,
    /// Where heartbeat stats are kept for the dashboard.
    pub(crate) stats: Arc<MemberStatsBook>,
    /// Connections and subscriptions each authenticated peer holds now.
    pub(crate) per_peer: Arc<PerPeer>,
}

/// Most `tb/ctl/1` connections one node may hold to a broker at once (a node keeps one; a
/// few more cover a restart or a CLI beside a worker with the same key).
pub const MAX_CTL_CONNECTIONS_PER_PEER: usize = 8;
/// Most subscriptions one node may hold on a broker at once.
pub const MAX_SUBSCRIPTIONS_PER_PEER: usize = 256;

/// What each authenticated peer holds on this broker now, so no member can hold more than its
/// share: [`MAX_CTL_CONNECTIONS_PER_PEER`] connections, [`MAX_SUBSCRIPTIONS_PER_PEER`]
/// subscriptions. A peer's row goes when it holds nothing.
#[derive(Debug, Default)]
pub(crate) struct PerPeer {
    held: std::sync::Mutex<std::collections::HashMap<tb_proto::NodeId, [usize; 2]>>,
}

/// What a [`PerPeer`] slot counts.
#[derive(Debug, Clone, Copy)]
enum Held {
    Connection = 0,
    Subscription = 1,
}

/// A slot taken in [`PerPeer`], given back on drop.
struct PeerSlot {
    table: Arc<PerPeer>,
    peer: tb_proto::NodeId,
    what: Held,
}

impl PerPeer {
    /// Takes a slot of `what` for `peer`; `None` when it holds `max` already.
    fn take(self: &Arc<Self>, peer: tb_proto::NodeId, what: Held, max: usize) -> Option<PeerSlot> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let row = held.entry(peer).or_default();
        if row[what as usize] >= max {
            if *row == [0, 0] {
                held.remove(&peer);
            }
            return None;
        }
        row[what as usize] += 1;
        Some(PeerSlot {
            table: self.clone(),
            peer,
            what,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut held = self.table.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(row) = held.get_mut(&self.peer) {
            row[self.what as usize] = row[self.what as usize].saturating_sub(1);
            if *row == [0, 0] {
                held.remove(&self.peer);
            }
        }
    }
}

impl std::fmt::Debug for CtlProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CtlProtocol")
    }
}

impl ProtocolHandler for CtlProtocol {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let hello = auth::server_hello(
            &conn,
            self.me,
            &self.key,
            CTL_ALPN,
            &self.admission,
            self.max_tensor_bytes,
            |reason| self.counters.auth_failures.inc(reason),
        );
        let access = match hello.await {
            Ok(access) => access,
            Err(err) => {
                debug!(%err, "ctl hello failed");
                return Ok(());
            }
        };
        let peer = auth::node_id(&conn.remote_id());
        let Some(_slot) = self
            .per_peer
            .take(peer, Held::Connection, MAX_CTL_CONNECTIONS_PER_PEER)
        else {
            self.counters.refused.inc(Refusal::CtlConnections);
            warn!(peer = %conn.remote_id().fmt_short(), "refusing a ctl connection: the peer holds {MAX_CTL_CONNECTIONS_PER_PEER} already");
            let code = tb_proto::CloseCode::TooManyConnections.code();
            conn.close(
                iroh::endpoint::VarInt::from_u32(code),
                b"too many ctl connections from this node",
            );
            return Ok(());
        };
        // The epoch of the last heartbeat accepted on this connection (0: none yet).
        let life = Arc::new(AtomicU64::new(0));
        loop {
            let accepted = tokio::select! {
                _ = self.cancel.cancelled() => return Ok(()),
                accepted = conn.accept_bi() => accepted,
            };
            let Ok((send, recv)) = accepted else { break };
            let this = self.clone();
            let life = life.clone();
            let span = debug_span!(
                "ctl",
                me = %self.me.fmt_short(),
                peer = %conn.remote_id().fmt_short(),
                request = tracing::field::Empty,
                tensor = tracing::field::Empty,
            );
            self.tracker.spawn(
                async move {
                    tokio::select! {
                        _ = this.cancel.cancelled() => {}
                        () = this.serve_stream(peer, access, &life, send, recv) => {}
                    }
                }
                .instrument(span),
            );
        }
        let epoch = life.load(Ordering::Relaxed);
        if epoch != 0 && closed_at_shutdown(&conn) {
            // Nobody waits on the answer; a broker shutting down has no one to tell.
            let _ = self.actor.cast(BrokerMsg::Leave { from: peer, epoch });
        }
        Ok(())
    }
}

/// Whether the peer closed `conn` saying it shuts down (a clean leave).
fn closed_at_shutdown(conn: &Connection) -> bool {
    let shutdown = iroh::endpoint::VarInt::from_u32(tb_proto::CloseCode::Shutdown.code());
    matches!(conn.close_reason(), Some(ConnectionError::ApplicationClosed(close))
        if close.error_code == shutdown)
}

/// Asks the actor and waits (bounded) for its answer.
pub(crate) async fn ask<T: Send + 'static>(
    actor: &ActorRef<BrokerMsg>,
    timeout: Duration,
    msg: impl FnOnce(ractor::RpcReplyPort<T>) -> BrokerMsg,
) -> Result<T, CtlResponse> {
    match actor.call(msg, Some(timeout)).await {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(error(ErrorCode::Internal, "broker busy: no answer")),
        Ok(CallResult::SenderError) | Err(_) => {
            Err(error(ErrorCode::ShuttingDown, "broker shutting down"))
        }
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> CtlResponse {
    CtlResponse::Error {
        code,
        message: message.into(),
    }
}

fn refused(e: BrokerError) -> CtlResponse {
    error(e.code(), e.to_string())
}

impl tb_node::SocketCtl for CtlProtocol {
    /// A request a node on this host sent on the same-host socket (`DataRequest::Ctl`):
    /// admitted and answered as on the ctl link, except heartbeats, subscriptions and
    /// anti-entropy, which belong to the link (`Unsupported` here).
    fn answer(
        &self,
        peer: tb_proto::NodeId,
        access: Access,
        request: CtlRequest,
    ) -> tb_node::CtlAnswer {
        let this = self.clone();
        Box::pin(async move {
            if matches!(
                request,
                CtlRequest::Heartbeat { .. }
                    | CtlRequest::Subscribe { .. }
                    | CtlRequest::SyncBuckets { .. }
                    | CtlRequest::SyncNames { .. }
            ) {
                let message = format!("{} is sent on the ctl link", request.kind());
                return vec![error(ErrorCode::Unsupported, message)];
            }
            if let Err((code, message)) = this.admit(access, &request) {
                return vec![error(code, message)];
            }
            this.counters.socket_requests.inc();
            // No heartbeat comes this way, so no life to record.
            let life = AtomicU64::new(0);
            this.answer(peer, access, &life, request).await
        })
    }

    /// A subscription a node on this host opened on the same-host socket: admitted, bounded
    /// per peer and served as on the ctl link.
    fn subscribe(
        &self,
        peer: tb_proto::NodeId,
        access: Access,
        pattern: tb_proto::NamePattern,
    ) -> tb_node::CtlSubscribed {
        let this = self.clone();
        Box::pin(async move {
            let request = CtlRequest::Subscribe {
                pattern: pattern.clone(),
            };
            if let Err((code, message)) = this.admit(access, &request) {
                return Box::pin(n0_future::stream::once(error(code, message)))
                    as tb_node::CtlFrames;
            }
            this.counters.socket_requests.inc();
            this.subscription(peer, pattern, true).await
        })
    }
}

impl CtlProtocol {
    /// Authorizes `request` for a peer that proved `access` and validates it, counting it;
    /// the refusal's code and message otherwise (counted too).
    fn admit(&self, access: Access, request: &CtlRequest) -> Result<(), (ErrorCode, String)> {
        let allowed = tb_proto::authorize(self.key.access(), access, request.write_action());
        if let Err(e) = allowed {
            debug!(%e, request = request.kind(), "refusing a request the peer's access does not allow");
            self.counters.refused.inc(Refusal::Unauthorized);
            return Err((ErrorCode::Unauthorized, e.to_string()));
        }
        if let Err(e) = request.validate(self.max_tensor_bytes) {
            self.counters.refused.inc(Refusal::Malformed);
            return Err((ErrorCode::Malformed, e.to_string()));
        }
        self.counters.requests.inc();
        Ok(())
    }

    async fn serve_stream(
        &self,
        peer: tb_proto::NodeId,
        access: Access,
        life: &AtomicU64,
        mut send: SendStream,
        mut recv: RecvStream,
    ) {
        let request =
            match tokio::time::timeout(self.request_timeout, read_frame::<CtlRequest>(&mut recv))
                .await
            {
                Ok(Ok(request)) => request,
                Ok(Err(ReadFrameError::Closed(_))) => return,
                Ok(Err(ReadFrameError::Invalid(e))) => {
                    self.counters.refused.inc(Refusal::Malformed);
                    let _ =
                        write_frame(&mut send, &error(ErrorCode::Malformed, e.to_string())).await;
                    let _ = send.finish();
                    return;
                }
                Err(_) => return,
            };
        if let Err((code, message)) = self.admit(access, &request) {
            let _ = write_frame(&mut send, &error(code, message)).await;
            let _ = send.finish();
            return;
        }
        let span = tracing::Span::current();
        span.record("request", request.kind());
        if let Some(name) = request.tensor() {
            span.record("tensor", name.as_str());
        }
        let answers = match request {
            CtlRequest::Subscribe { pattern } => {
                let frames = self.subscription(peer, pattern, false).await;
                self.serve_subscription(frames, send, recv).await;
                return;
            }
            CtlRequest::SyncBuckets { buckets, members } => {
                let conversation = sync::Responder {
                    actor: &self.actor,
                    timeout: self.request_timeout,
                    max_tensor_bytes: self.max_tensor_bytes,
                    budget: &self.sync_budget,
                    refused: &self.counters.refused,
                };
                if let Err(e) = conversation
                    .run(buckets, members, &mut send, &mut recv)
                    .await
                {
                    debug!(%e, "anti-entropy conversation ended early");
                }
                let _ = send.finish();
                return;
            }
            request => self.answer(peer, access, life, request).await,
        };
        for frame in answers {
            if write_frame(&mut send, &frame).await.is_err() {
                return;
            }
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(self.request_timeout, send.stopped()).await;
    }

    /// The answer frames to a one-shot request; an accepted heartbeat's epoch goes in `life`.
    async fn answer(
        &self,
        from: tb_proto::NodeId,
        access: Access,
        life: &AtomicU64,
        request: CtlRequest,
    ) -> Vec<CtlResponse> {
        let (actor, t) = (&self.actor, self.request_timeout);
        let result = match request {
            CtlRequest::Heartbeat {
                role,
                addrs,
                epoch,
                stats,
            } => {
                let upload_limit = stats.as_ref().map(|s| s.upload_limit);
                let answered = ask(actor, t, |reply| BrokerMsg::Heartbeat {
                    from,
                    role,
                    addrs,
                    epoch,
                    upload_limit,
                    reply,
                })
                .await;
                // Only the figures of a heartbeat the actor accepted: a refused one (a stale
                // epoch, say) records nothing.
                if let (Ok(Ok(())), Some(stats)) = (&answered, stats) {
                    self.stats.record(from, stats, Instant::now());
                }
                if let Ok(Ok(())) = &answered {
                    life.store(epoch, Ordering::Relaxed);
                }
                answered.map(|r| r.map_or_else(refused, |()| CtlResponse::Ok))
            }
            CtlRequest::Announce { ops } => ask(actor, t, |reply| BrokerMsg::Announce {
                from,
                access,
                ops,
                inline: None,
                reply,
            })
            .await
            .map(|r| r.map_or_else(refused, |()| CtlResponse::Ok)),
            // Validated: the first op is a publish whose metadata the bytes match.
            CtlRequest::Publish { ops, bytes } => ask(actor, t, |reply| BrokerMsg::Announce {
                from,
                access,
                ops,
                inline: Some(bytes),
                reply,
            })
            .await
            .map(|r| r.map_or_else(refused, |()| CtlResponse::Ok)),
            CtlRequest::NextVersion { name } => {
                ask(actor, t, |reply| BrokerMsg::NextVersion { name, reply })
                    .await
                    .map(|version| CtlResponse::Version { version })
            }
            CtlRequest::Lookup {
                name,
                version,
                exclude,
            } => ask(actor, t, |reply| BrokerMsg::Lookup {
                from,
                name,
                version,
                exclude,
                reply,
            })
            .await
            .map(|r| r.map_or_else(refused, CtlResponse::from)),
            CtlRequest::Fetching {
                name,
                version,
                active,
            } => ask(actor, t, |reply| BrokerMsg::Fetching {
                from,
                name,
                version,
                active,
                reply,
            })
            .await
            .map(|r| r.map_or_else(refused, |()| CtlResponse::Ok)),
            CtlRequest::List { prefix, limit } => {
                let limit = limit as usize;
                let listed = ask(actor, t, |reply| BrokerMsg::List {
                    prefix,
                    limit,
                    reply,
                })
                .await;
                return match listed {
                    Ok(entries) => pieces(entries, |entries, last| CtlResponse::Listing {
                        entries,
                        last,
                    }),
                    Err(e) => vec![e],
                };
            }
            CtlRequest::Members => {
                return match ask(actor, t, |reply| BrokerMsg::Members { reply }).await {
                    Ok(members) => {
                        let rows = with_stats(members, &self.stats, Instant::now());
                        pieces(rows, |members, last| CtlResponse::Members { members, last })
                    }
                    Err(e) => vec![e],
                };
            }
            CtlRequest::Servers { function } => {
                let asked = function.clone();
                ask(actor, t, |reply| BrokerMsg::Servers { function, reply })
                    .await
                    .map(|servers| CtlResponse::Servers {
                        function: asked,
                        servers,
                    })
            }
            CtlRequest::Functions { prefix, limit } => {
                let limit = limit as usize;
                ask(actor, t, |reply| BrokerMsg::Functions {
                    prefix,
                    limit,
                    reply,
                })
                .await
                .map(|functions| CtlResponse::Functions { functions })
            }
            CtlRequest::SyncNames { .. } => Ok(error(
                ErrorCode::Malformed,
                "SyncNames outside an anti-entropy conversation",
            )),
            CtlRequest::Subscribe { .. } | CtlRequest::SyncBuckets { .. } => Ok(error(
                ErrorCode::Internal,
                "streaming request routed as one-shot",
            )),
        };
        vec![result.unwrap_or_else(|e| e)]
    }

    /// Forwards events matching `pattern` until the client goes away or the broker stops.
    /// A subscription of `peer` to `pattern`, registered with the actor: its frames, `Ok`
    /// first (a subscriber's `subscribe` returns once it read it, so a version published
    /// right after is never missed), then an `Event` per change. Falling a whole buffer
    /// behind ends it with a `Busy` error the client sees. Refused (an `Error` frame alone)
    /// past [`MAX_SUBSCRIPTIONS_PER_PEER`]. Dropping the frames unsubscribes and frees the
    /// peer's slot. `on_socket`: it is served on the same-host socket (counted apart).
    async fn subscription(
        &self,
        peer: tb_proto::NodeId,
        pattern: tb_proto::NamePattern,
        on_socket: bool,
    ) -> tb_node::CtlFrames {
        let alone = |frame| Box::pin(n0_future::stream::once(frame)) as tb_node::CtlFrames;
        let Some(slot) = self
            .per_peer
            .take(peer, Held::Subscription, MAX_SUBSCRIPTIONS_PER_PEER)
        else {
            self.counters.refused.inc(Refusal::Subscriptions);
            return alone(error(
                ErrorCode::Busy,
                format!(
                    "this node holds {MAX_SUBSCRIPTIONS_PER_PEER} subscriptions on this broker \
                     already: close some, or watch a wider pattern"
                ),
            ));
        };
        let (tx, events) = mpsc::channel(SUBSCRIPTION_BUFFER);
        let lagged = CancellationToken::new();
        let asked = ask(&self.actor, self.request_timeout, |reply| {
            BrokerMsg::Subscribe {
                pattern,
                events: tx,
                lagged: lagged.clone(),
                reply,
            }
        })
        .await;
        let id = match asked {
            Ok(id) => id,
            Err(e) => return alone(e),
        };
        self.counters.subscriptions.inc();
        if on_socket {
            self.counters.socket_subscriptions.inc();
        }
        let state = Subscribed {
            ok_sent: false,
            ended: false,
            events,
            lagged,
            counters: self.counters.clone(),
            _registered: Registered {
                actor: self.actor.clone(),
                id,
                counters: self.counters.clone(),
            },
            _slot: slot,
        };
        Box::pin(n0_future::stream::unfold(state, |mut state| async move {
            let frame = state.next().await?;
            Some((frame, state))
        }))
    }

    /// Writes a subscription's `frames` on its QUIC stream until they end, a frame cannot be
    /// written within the request timeout (a subscriber that stopped reading), or the client
    /// ends its side: the client never writes again, so its stream ending (or resetting) is
    /// the unsubscribe. The stream is finished then, after the frames that were ready.
    async fn serve_subscription(
        &self,
        mut frames: tb_node::CtlFrames,
        mut send: SendStream,
        mut recv: RecvStream,
    ) {
        use n0_future::StreamExt;

        let stall = self.request_timeout;
        let mut sink = [0u8; 64];
        loop {
            tokio::select! {
                // Every frame ready is written before the client's end is looked at: a client
                // that moves its subscription elsewhere reads this stream to its end, and
                // the events it held from before the move must be on it.
                biased;
                frame = frames.next() => {
                    let Some(frame) = frame else { break };
                    let last = matches!(frame, CtlResponse::Error { .. });
                    match tokio::time::timeout(stall, write_frame(&mut send, &frame)).await {
                        Ok(Ok(())) if !last => {}
                        _ => break,
                    }
                }
                read = recv.read(&mut sink) => {
                    if !matches!(read, Ok(Some(_))) {
                        break;
                    }
                }
            }
        }
        let _ = send.finish();
    }
}

/// A registered subscription's state, as its frames are taken.
struct Subscribed {
    ok_sent: bool,
    ended: bool,
    events: mpsc::Receiver<tb_proto::Event>,
    lagged: CancellationToken,
    counters: Arc<BrokerCounters>,
    _registered: Registered,
    _slot: PeerSlot,
}

impl Subscribed {
    /// The next frame: `Ok`, then the events, a `Busy` error when the subscriber fell behind;
    /// `None` once ended.
    async fn next(&mut self) -> Option<CtlResponse> {
        if self.ended {
            return None;
        }
        if !self.ok_sent {
            self.ok_sent = true;
            return Some(CtlResponse::Ok);
        }
        tokio::select! {
            biased;
            () = self.lagged.cancelled() => {
                self.ended = true;
                self.counters.refused.inc(Refusal::LaggedSubscription);
                Some(error(
                    ErrorCode::Busy,
                    format!(
                        "subscription ended: it fell {SUBSCRIPTION_BUFFER} events behind \
                         (subscribe again; the versions missed show as skipped)"
                    ),
                ))
            }
            event = self.events.recv() => match event {
                Some(event) => Some(CtlResponse::Event(event)),
                None => {
                    self.ended = true;
                    None
                }
            },
        }
    }
}

/// Unsubscribes when dropped (the subscription's frames were dropped).
struct Registered {
    actor: ActorRef<BrokerMsg>,
    id: u64,
    counters: Arc<BrokerCounters>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.actor.cast(BrokerMsg::Unsubscribe { id: self.id });
        self.counters.subscriptions_ended.inc();
    }
}

/// Cuts a long answer into frames under the control-frame cap, the last one marked.
/// Each member with the stats of its latest heartbeat here (none for brokers, for nodes that
/// heartbeat elsewhere, and for stats too old to show).
fn with_stats(members: Vec<Member>, book: &MemberStatsBook, now: Instant) -> Vec<MemberStatus> {
    members
        .into_iter()
        .map(|member| MemberStatus {
            heartbeat: book
                .get(&member.node, now)
                .map(|(stats, age)| LastHeartbeat {
                    stats,
                    age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                }),
            member,
        })
        .collect()
}

pub(crate) fn pieces<T: serde::Serialize>(
    items: Vec<T>,
    frame: impl Fn(Vec<T>, bool) -> CtlResponse,
) -> Vec<CtlResponse> {
    let chunks = chunk_by_size(items, MAX_CHUNK_BYTES);
    let count = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| frame(chunk, i + 1 == count))
        .collect()
}

#[cfg(test)]
mod tests {
    use tb_proto::{NodeId, NodeStats, Role, Stamp};

    use super::*;

    #[test]
    fn members_carry_the_stats_of_their_latest_heartbeat_here() {
        let row = |b: u8, role| Member {
            node: NodeId([b; 32]),
            role,
            addrs: vec!["127.0.0.1:1".into()],
            epoch: 1,
            alive: true,
            stamp: Stamp::ZERO,
        };
        let book = MemberStatsBook::default();
        let t0 = Instant::now();
        let stats = NodeStats {
            pool_links: 3,
            tensors: 2,
            ..NodeStats::default()
        };
        book.record(NodeId([2; 32]), stats.clone(), t0);
        let members = vec![
            row(1, Role::Broker),
            row(2, Role::Worker),
            row(3, Role::Worker),
        ];
        let rows = with_stats(members.clone(), &book, t0 + Duration::from_millis(1500));
        let got: Vec<_> = rows.iter().map(|r| r.member.clone()).collect();
        assert_eq!(got, members, "rows keep their order");
        assert_eq!(rows[0].heartbeat, None, "brokers send no stats");
        assert_eq!(
            rows[1].heartbeat,
            Some(LastHeartbeat {
                stats,
                age_ms: 1500
            })
        );
        assert_eq!(rows[2].heartbeat, None, "heartbeats to another broker");
    }

    #[test]
    fn a_peer_holds_at_most_its_share_and_slots_come_back() {
        let table = Arc::new(PerPeer::default());
        let (a, b) = (tb_proto::NodeId([1; 32]), tb_proto::NodeId([2; 32]));
        let held: Vec<_> = (0..3)
            .map(|_| table.take(a, Held::Subscription, 3).expect("under the cap"))
            .collect();
        assert!(table.take(a, Held::Subscription, 3).is_none(), "at the cap");
        // Another kind, another peer: their own counts.
        let conn = table.take(a, Held::Connection, 1).expect("a connection");
        assert!(table.take(a, Held::Connection, 1).is_none());
        let theirs = table.take(b, Held::Subscription, 3).expect("b's own share");
        drop(held);
        assert!(
            table.take(a, Held::Subscription, 3).is_some(),
            "freed on drop"
        );
        drop((conn, theirs));
        assert!(
            table.held.lock().expect("table").is_empty(),
            "rows of peers holding nothing are gone"
        );
    }
}
