//! `BrokerActor`: the thin shell around [`BrokerState`] that owns the registry replica.
//!
//! Requests from `tb/ctl/1` streams, gossip from other brokers, anti-entropy results and
//! ticks arrive as messages; each handler calls one [`BrokerState`] method and carries out
//! the [`Changes`] it returns: persist the changed entries and members (sled), hand the ops
//! to the gossip task, and offer the events to matching subscriptions. No handler waits on
//! the network: gossip goes out through an unbounded channel, events through `try_send`.
//!
//! Nor does it serve HTTP or wait on the disk: at most every [`SNAPSHOT_PERIOD`] it publishes
//! the registry, if it changed, on a `watch` channel the metrics server reads (a flood of
//! HTTP requests never reaches its mailbox), and its periodic flush (an fsync) runs on a
//! blocking thread, one at a time.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tb_proto::{
    Access, Event, ListedEntry, Member, NamePattern, NodeId, Registry, RegistryOp, Role, TensorName,
};
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    BrokerError, BrokerState, Changes, Holders, RegistryStore, matching, observe::RegistryView,
};

/// Events buffered per subscription before it counts as lagging: it is then ended with an
/// error (`Busy`, "fell behind") that its client sees, instead of missing events silently.
pub const SUBSCRIPTION_BUFFER: usize = 1024;

/// A subscription: its pattern, where its events go, and its lag signal.
type Subscriber = (NamePattern, mpsc::Sender<Event>, CancellationToken);

/// Default of `BrokerOptions::snapshot_period`: how often, at most, the actor publishes its
/// registry for the HTTP side (the dashboard polls every second; Prometheus every 15 s or so).
pub const SNAPSHOT_PERIOD: Duration = Duration::from_millis(250);

/// The wall clock in milliseconds, the only time `BrokerState` is fed.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What the broker actor is asked to do.
pub enum BrokerMsg {
    /// A node reports it is alive.
    Heartbeat {
        /// The authenticated sender.
        from: NodeId,
        /// Its role.
        role: Role,
        /// Where it listens.
        addrs: Vec<String>,
        /// Its restart counter.
        epoch: u64,
        /// Its upload limit, when its heartbeat carried stats (0: unlimited).
        upload_limit: Option<u64>,
        /// The answer.
        reply: RpcReplyPort<Result<(), BrokerError>>,
    },
    /// A node reports registry changes it made.
    Announce {
        /// The authenticated sender.
        from: NodeId,
        /// What its credential allows (read-only senders may only mark what they hold).
        access: Access,
        /// Its ops.
        ops: Vec<RegistryOp>,
        /// The bytes of the publish that is the first op, for subscribers' events (a
        /// `CtlRequest::Publish`, validated).
        inline: Option<Vec<u8>>,
        /// The answer (the first refusal, if any).
        reply: RpcReplyPort<Result<(), BrokerError>>,
    },
    /// The next version of a name.
    NextVersion {
        /// The name.
        name: TensorName,
        /// The answer.
        reply: RpcReplyPort<u64>,
    },
    /// Where to fetch a version from.
    Lookup {
        /// The asker.
        from: NodeId,
        /// The name.
        name: TensorName,
        /// The version, or the newest.
        version: Option<u64>,
        /// Sources the asker dropped during this fetch.
        exclude: Vec<NodeId>,
        /// The answer.
        reply: RpcReplyPort<Result<Holders, BrokerError>>,
    },
    /// A node started or stopped fetching a version.
    Fetching {
        /// The fetcher.
        from: NodeId,
        /// The name.
        name: TensorName,
        /// The version.
        version: u64,
        /// Started (true) or stopped (false).
        active: bool,
        /// The answer.
        reply: RpcReplyPort<Result<(), BrokerError>>,
    },
    /// A node closed, saying it shuts down, the ctl connection it heartbeated on at `epoch`.
    Leave {
        /// The authenticated node.
        from: NodeId,
        /// The epoch of the last heartbeat accepted on that connection.
        epoch: u64,
    },
    /// Entries under a prefix.
    List {
        /// The prefix (empty: all).
        prefix: String,
        /// At most this many.
        limit: usize,
        /// The answer.
        reply: RpcReplyPort<Vec<ListedEntry>>,
    },
    /// The membership table.
    /// `BrokerState::servers`.
    Servers {
        function: TensorName,
        reply: RpcReplyPort<Vec<tb_proto::HolderAddr>>,
    },
    /// `BrokerState::functions`.
    Functions {
        prefix: String,
        limit: usize,
        reply: RpcReplyPort<Vec<(TensorName, u32)>>,
    },
    Members {
        /// The answer.
        reply: RpcReplyPort<Vec<Member>>,
    },
    /// Start sending events matching `pattern` into `events`; answers the subscription id.
    Subscribe {
        /// The pattern.
        pattern: NamePattern,
        /// Where matching events go.
        events: mpsc::Sender<Event>,
        /// Cancelled when the subscription is dropped for lagging (its buffer was full).
        lagged: CancellationToken,
        /// The subscription's id, for `Unsubscribe`.
        reply: RpcReplyPort<u64>,
    },
    /// Stop a subscription.
    Unsubscribe {
        /// The id `Subscribe` answered.
        id: u64,
    },
    /// An op another broker gossiped (already authenticated by its envelope).
    Gossip(RegistryOp),
    /// A copy of the registry, for anti-entropy.
    Snapshot {
        /// The answer.
        reply: RpcReplyPort<Arc<Registry>>,
    },
    /// What an anti-entropy round brought back.
    Merge {
        /// Entries that differed.
        entries: Vec<(TensorName, tb_proto::Entry)>,
        /// Member rows that differed.
        members: Vec<Member>,
    },
    /// Periodic: expire silent workers, flush the store.
    Tick,
    /// Periodic: publish the registry for the HTTP side if it changed since the last time.
    Publish,
}

/// Start-up input of the broker actor.
pub struct BrokerArgs {
    /// The decisions, loaded from the store.
    pub state: BrokerState,
    /// Where the replica is persisted.
    pub store: RegistryStore,
    /// Ops to broadcast go here (the gossip task drains it).
    pub gossip_out: mpsc::UnboundedSender<RegistryOp>,
    /// How often `Tick` comes.
    pub tick: Duration,
    /// Where the registry is published for the HTTP side.
    pub published: watch::Sender<Arc<RegistryView>>,
    /// How often `Publish` comes.
    pub snapshot_period: Duration,
}

/// The broker actor's state.
pub struct BrokerActorState {
    args: BrokerArgs,
    subscriptions: HashMap<u64, Subscriber>,
    next_subscription: u64,
    /// The registry as of the last change, shared with anti-entropy without copying per ask.
    snapshot: Option<Arc<Registry>>,
    /// Whether the registry changed since it was last published.
    dirty: bool,
    /// The flush under way, if any.
    flush: Option<JoinHandle<()>>,
}

/// The actor owning one broker's registry replica.
pub struct BrokerActor;

impl Actor for BrokerActor {
    type Msg = BrokerMsg;
    type State = BrokerActorState;
    type Arguments = BrokerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<BrokerMsg>,
        args: BrokerArgs,
    ) -> Result<BrokerActorState, ActorProcessingErr> {
        myself.send_interval(args.tick, || BrokerMsg::Tick);
        myself.send_interval(args.snapshot_period, || BrokerMsg::Publish);
        let mut st = BrokerActorState {
            args,
            subscriptions: HashMap::new(),
            next_subscription: 0,
            snapshot: None,
            dirty: true,
            flush: None,
        };
        // The registry as loaded, before the metrics server starts.
        publish(&mut st);
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<BrokerMsg>,
        msg: BrokerMsg,
        st: &mut BrokerActorState,
    ) -> Result<(), ActorProcessingErr> {
        let now = now_ms();
        let state = &mut st.args.state;
        match msg {
            BrokerMsg::Heartbeat {
                from,
                role,
                addrs,
                epoch,
                upload_limit,
                reply,
            } => {
                let result = state.heartbeat(from, role, addrs, epoch, now);
                if let (Ok(_), Some(limit)) = (&result, upload_limit) {
                    state.upload_limit(from, limit);
                }
                answer_with_changes(st, reply, result);
            }
            BrokerMsg::Announce {
                from,
                access,
                ops,
                inline,
                reply,
            } => {
                let published = match (&inline, ops.first()) {
                    (
                        Some(_),
                        Some(RegistryOp::Publish {
                            name,
                            version,
                            publisher,
                            ..
                        }),
                    ) if *publisher == from => Some((name.clone(), *version)),
                    _ => None,
                };
                let mut changes = Changes::default();
                let mut refused = None;
                for op in ops {
                    match state.announce_as(from, access, op, now) {
                        Ok(c) => changes.extend(c),
                        Err(e) => {
                            refused.get_or_insert(e);
                        }
                    }
                }
                if let (Some((name, version)), Some(bytes)) = (&published, &inline) {
                    changes.events = std::mem::take(&mut changes.events)
                        .into_iter()
                        .map(|e| e.with_inline((name, *version), bytes))
                        .collect();
                }
                // Answered first: the registry has the ops already, and the publisher's put
                // need not wait for the events, the write to sled or gossip.
                let _ = reply.send(refused.map_or(Ok(()), Err));
                carry_out(st, changes);
            }
            BrokerMsg::NextVersion { name, reply } => {
                let _ = reply.send(state.next_version(&name));
            }
            BrokerMsg::Lookup {
                from,
                name,
                version,
                exclude,
                reply,
            } => {
                let found = state.lookup_excluding(&name, version, from, &exclude, now);
                let _ = reply.send(found);
            }
            BrokerMsg::Fetching {
                from,
                name,
                version,
                active,
                reply,
            } => {
                let _ = reply.send(state.fetching(&name, version, from, active, now));
            }
            BrokerMsg::Leave { from, epoch } => {
                let changes = state.leave(from, epoch, now);
                carry_out(st, changes);
            }
            BrokerMsg::List {
                prefix,
                limit,
                reply,
            } => {
                let _ = reply.send(state.list(&prefix, limit));
            }
            BrokerMsg::Members { reply } => {
                let _ = reply.send(state.members());
            }
            BrokerMsg::Servers { function, reply } => {
                let _ = reply.send(state.servers(&function));
            }
            BrokerMsg::Functions {
                prefix,
                limit,
                reply,
            } => {
                let _ = reply.send(state.functions(&prefix, limit));
            }
            BrokerMsg::Subscribe {
                pattern,
                events,
                lagged,
                reply,
            } => {
                let id = st.next_subscription;
                st.next_subscription += 1;
                st.subscriptions.insert(id, (pattern, events, lagged));
                let _ = reply.send(id);
            }
            BrokerMsg::Unsubscribe { id } => {
                st.subscriptions.remove(&id);
            }
            BrokerMsg::Gossip(op) => match state.remote_op(&op, now) {
                Ok(changes) => carry_out(st, changes),
                Err(e) => debug!(%e, "dropping a gossiped op"),
            },
            BrokerMsg::Snapshot { reply } => {
                let _ = reply.send(snapshot(st));
            }
            BrokerMsg::Merge { entries, members } => {
                let changes = state.merge_entries(&entries, &members, now);
                carry_out(st, changes);
            }
            BrokerMsg::Tick => {
                let changes = state.expire(now);
                carry_out(st, changes);
                start_flush(st);
            }
            BrokerMsg::Publish => publish(st),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<BrokerMsg>,
        st: &mut BrokerActorState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(flush) = st.flush.take() {
            let _ = flush.await;
        }
        let store = st.args.store.clone();
        match tokio::task::spawn_blocking(move || store.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(%e, "flushing the registry store at shutdown"),
            Err(e) => warn!(%e, "flushing the registry store at shutdown"),
        }
        Ok(())
    }
}

/// The registry as of now, copied once per change.
fn snapshot(st: &mut BrokerActorState) -> Arc<Registry> {
    st.snapshot
        .get_or_insert_with(|| Arc::new(st.args.state.registry().clone()))
        .clone()
}

/// Publishes the registry for the HTTP side, if it changed since the last time.
fn publish(st: &mut BrokerActorState) {
    if !st.dirty {
        return;
    }
    st.dirty = false;
    let view = Arc::new(RegistryView::new(snapshot(st)));
    st.args.published.send_replace(view);
}

/// Flushes the store on a blocking thread, unless the last flush is still under way: an
/// fsync must not hold up the actor, and flushes must not pile up behind a slow disk.
fn start_flush(st: &mut BrokerActorState) {
    if st.flush.as_ref().is_some_and(|f| !f.is_finished()) {
        return;
    }
    let store = st.args.store.clone();
    st.flush = Some(tokio::task::spawn_blocking(move || {
        if let Err(e) = store.flush() {
            warn!(%e, "flushing the registry store");
        }
    }));
}

fn answer_with_changes(
    st: &mut BrokerActorState,
    reply: RpcReplyPort<Result<(), BrokerError>>,
    result: Result<Changes, BrokerError>,
) {
    match result {
        Ok(changes) => {
            carry_out(st, changes);
            let _ = reply.send(Ok(()));
        }
        Err(e) => {
            let _ = reply.send(Err(e));
        }
    }
}

/// Persists, gossips and notifies what one decision changed.
fn carry_out(st: &mut BrokerActorState, changes: Changes) {
    if changes.is_empty() {
        return;
    }
    st.snapshot = None;
    st.dirty = true;
    // Subscribers first: their writers start while this actor encodes the changes for sled
    // (queued to the writer thread) and hands the ops to gossip.
    for event in &changes.events {
        let subs = st.subscriptions.iter().map(|(id, (p, _, _))| (*id, p));
        let targets: Vec<u64> = matching(subs, event).collect();
        for id in targets {
            let Some((_, tx, lagged)) = st.subscriptions.get(&id) else {
                continue;
            };
            match tx.try_send(event.clone()) {
                Ok(()) => {}
                // A subscriber this far behind is ended with an error (its handler tells it),
                // never left to miss events silently: it may subscribe again and catch up.
                Err(mpsc::error::TrySendError::Full(_)) => {
                    warn!(
                        subscription = id,
                        behind = SUBSCRIPTION_BUFFER,
                        "ending a subscription that fell behind"
                    );
                    lagged.cancel();
                    st.subscriptions.remove(&id);
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    st.subscriptions.remove(&id);
                }
            }
        }
    }
    let registry = st.args.state.registry();
    if let Err(e) = st
        .args
        .store
        .save_changed(registry, &changes.names, &changes.members)
    {
        warn!(%e, "persisting registry changes (anti-entropy will repair a restart)");
    }
    for op in changes.gossip {
        // The gossip task only goes away at shutdown; then there is nobody to tell.
        let _ = st.args.gossip_out.send(op);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use tb_proto::Role;

    use super::*;
    use crate::{BrokerConfig, ctl::ask};

    const LIMIT: Duration = Duration::from_secs(30);

    /// Opens a flush gate when dropped.
    struct OpenOnDrop(Arc<crate::persist::test_gate::FlushGate>);

    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open();
        }
    }

    /// Polls `check` every 5 ms for up to [`LIMIT`].
    async fn eventually(mut check: impl FnMut() -> bool) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < LIMIT {
            if check() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        check()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_actor_keeps_answering_while_a_flush_is_in_flight() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RegistryStore::open(dir.path()).expect("store");
        let gate = store.gate.clone();
        // The disk takes its time: every flush waits until the gate opens (and it opens when
        // the test ends, even by a failed assertion, so the runtime can stop).
        gate.close();
        let _open_at_end = OpenOnDrop(gate.clone());
        let me = NodeId([7; 32]);
        let state = BrokerState::new(me, BrokerConfig::default(), Registry::new(), now_ms());
        let (gossip_out, _outbox) = mpsc::unbounded_channel();
        let (published, view) = watch::channel(Arc::new(RegistryView::default()));
        let period = Duration::from_millis(10);
        let (actor, done) = Actor::spawn(
            None,
            BrokerActor,
            BrokerArgs {
                state,
                store,
                gossip_out,
                tick: period,
                published,
                snapshot_period: period,
            },
        )
        .await
        .expect("actor");
        assert!(
            eventually(|| gate.arrived.load(Ordering::SeqCst) >= 1).await,
            "a tick started a flush"
        );
        // A flush sits at the gate. The actor still answers every request, and still
        // publishes what they changed.
        const WORKERS: u8 = 20;
        for i in 0..WORKERS {
            let hb = ask(&actor, LIMIT, |reply| BrokerMsg::Heartbeat {
                from: NodeId([i; 32]),
                role: Role::Worker,
                addrs: vec![format!("127.0.0.1:{}", 1000 + u16::from(i))],
                epoch: 1,
                upload_limit: None,
                reply,
            })
            .await;
            assert!(matches!(hb, Ok(Ok(()))), "heartbeat {i} answered");
        }
        let members = ask(&actor, LIMIT, |reply| BrokerMsg::Members { reply }).await;
        assert_eq!(members.expect("members").len(), usize::from(WORKERS));
        assert!(
            eventually(|| view.borrow().registry.members().count() == usize::from(WORKERS)).await,
            "the registry was published while the flush waited"
        );
        // Ticks kept coming, and none started a second flush while the first was under way.
        assert_eq!(gate.arrived.load(Ordering::SeqCst), 1);
        gate.open();
        assert!(
            eventually(|| gate.arrived.load(Ordering::SeqCst) >= 2).await,
            "the next tick flushed again"
        );
        actor.stop(None);
        tokio::time::timeout(LIMIT, done)
            .await
            .expect("the actor stops")
            .expect("joined");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_a_whole_buffer_behind_is_ended_not_left_missing_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RegistryStore::open(dir.path()).expect("store");
        let state = BrokerState::new(
            NodeId([7; 32]),
            BrokerConfig::default(),
            Registry::new(),
            now_ms(),
        );
        let (gossip_out, _outbox) = mpsc::unbounded_channel();
        let (published, _view) = watch::channel(Arc::new(RegistryView::default()));
        let args = BrokerArgs {
            state,
            store,
            gossip_out,
            tick: Duration::from_secs(60),
            published,
            snapshot_period: Duration::from_secs(60),
        };
        let (actor, done) = Actor::spawn(None, BrokerActor, args).await.expect("actor");
        // A buffer of two events, never read meanwhile.
        let (events, mut rx) = mpsc::channel(2);
        let lagged = CancellationToken::new();
        let subscribed = ask(&actor, LIMIT, |reply| BrokerMsg::Subscribe {
            pattern: "m/*".parse().expect("pattern"),
            events,
            lagged: lagged.clone(),
            reply,
        })
        .await;
        subscribed.expect("subscribed");
        let publisher = NodeId([1; 32]);
        let name = TensorName::new("m/a").expect("name");
        for version in 1..=4u64 {
            let meta = tb_proto::TensorMeta::new(
                tb_proto::DType::U8,
                vec![1],
                tb_proto::ContentHash([version as u8; 32]),
            )
            .expect("meta");
            let op = RegistryOp::Publish {
                name: name.clone(),
                version,
                meta,
                publisher,
                stamp: tb_proto::Stamp::default(),
            };
            let announced = ask(&actor, LIMIT, |reply| BrokerMsg::Announce {
                from: publisher,
                access: Access::ReadWrite,
                ops: vec![op],
                inline: None,
                reply,
            })
            .await;
            assert!(matches!(announced, Ok(Ok(()))), "publish {version}");
            // The broker answers an announce before it fans the events out: one more round
            // trip to the actor means that fan-out is done.
            let listed = ask(&actor, LIMIT, |reply| BrokerMsg::List {
                prefix: String::new(),
                limit: 1,
                reply,
            })
            .await;
            assert!(listed.is_ok(), "a round trip after v{version}");
            // Two fit; the third finds the buffer full and ends the subscription.
            assert_eq!(lagged.is_cancelled(), version >= 3, "after v{version}");
        }
        // What was buffered is still there, then the channel ends: nothing after it.
        for version in 1..=2u64 {
            let got = rx.recv().await.expect("buffered");
            assert!(matches!(got, Event::Published { version: v, .. } if v == version));
        }
        assert!(rx.recv().await.is_none(), "the subscription was dropped");
        actor.stop(None);
        tokio::time::timeout(LIMIT, done)
            .await
            .expect("the actor stops")
            .expect("joined");
    }
}
