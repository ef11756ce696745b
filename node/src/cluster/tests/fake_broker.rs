//! A small in-memory broker for the cluster client's tests: the `tb/ctl/1` server side over a
//! plain [`Registry`], with no gossip, liveness or fan-out. Brokers started on one
//! [`FakeCluster`] share its state, like replicas that agree instantly.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use iroh::{
    EndpointId,
    endpoint::{Connection, RecvStream, SendStream},
    protocol::{AcceptError, ProtocolHandler},
};
use tb_proto::{
    CTL_ALPN, ClusterKey, CtlRequest, CtlResponse, ErrorCode, Event, Hlc, HolderAddr, ListedEntry,
    Member, MemberStatus, NodeId, Registry, RegistryOp, Stamp, TensorMeta, TensorName,
};
use tokio::sync::broadcast;

use crate::{Config, Node, PeerAddr, auth, cluster::wall_ms, wire};

/// What the fake brokers of one cluster know and saw.
#[derive(Debug)]
pub(super) struct FakeState {
    pub(super) registry: Registry,
    hlc: Hlc,
    /// Metadata of every version published, for look-ups of older versions.
    metas: HashMap<(TensorName, u64), TensorMeta>,
    pub(super) heartbeats: usize,
    /// The stats the latest heartbeat carried.
    pub(super) last_stats: Option<tb_proto::NodeStats>,
    /// `(name, version, node, active)` per `Fetching`.
    pub(super) fetching: Vec<(TensorName, u64, NodeId, bool)>,
    /// Subscription streams open now.
    pub(super) subscribers: usize,
    /// Put first in every look-up answer (a holder that misbehaves).
    pub(super) first_holder: Option<HolderAddr>,
    /// `Lookup` requests answered.
    pub(super) lookups: usize,
    /// Inline events to send with one byte flipped (a broker that tampers).
    pub(super) tamper_inline: usize,
}

impl FakeState {
    fn stamp(&mut self) -> Stamp {
        self.hlc.now(wall_ms())
    }
}

/// The shared state of a set of fake brokers.
#[derive(Debug, Clone)]
pub(super) struct FakeCluster {
    state: Arc<Mutex<FakeState>>,
    events: broadcast::Sender<Event>,
}

impl FakeCluster {
    pub(super) fn new() -> Self {
        FakeCluster {
            state: Arc::new(Mutex::new(FakeState {
                registry: Registry::new(),
                hlc: Hlc::new(NodeId([0xbb; 32])),
                metas: HashMap::new(),
                heartbeats: 0,
                last_stats: None,
                fetching: Vec::new(),
                subscribers: 0,
                first_holder: None,
                lookups: 0,
                tamper_inline: 0,
            })),
            events: broadcast::channel(1024).0,
        }
    }

    pub(super) fn state(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().expect("fake state")
    }

    /// Starts a broker node serving `tb/ctl/1` from this cluster's state.
    pub(super) async fn broker(&self, config: Config) -> (Node, PeerAddr) {
        let endpoint = Node::bind(&config).await.expect("bind");
        let handler = FakeBroker {
            me: endpoint.id(),
            key: config.cluster_key.clone(),
            cluster: self.clone(),
        };
        let extra: Vec<(&'static [u8], Box<dyn iroh::protocol::DynProtocolHandler>)> =
            vec![(CTL_ALPN, Box::new(handler))];
        let node = Node::spawn_on(config, endpoint, extra)
            .await
            .expect("broker starts");
        let addr = node.addr().clone();
        (node, addr)
    }

    /// The answer to one request from `sender`, and the events it makes.
    fn answer(&self, sender: NodeId, request: CtlRequest) -> (CtlResponse, Vec<Event>) {
        let mut st = self.state();
        let st = &mut *st;
        let mut events = Vec::new();
        let answer = match request {
            CtlRequest::Heartbeat {
                role,
                addrs,
                epoch,
                stats,
            } => {
                st.heartbeats += 1;
                st.last_stats = stats;
                let stamp = st.stamp();
                let member = Member {
                    node: sender,
                    role,
                    addrs,
                    epoch,
                    alive: true,
                    stamp,
                };
                st.registry.apply(&RegistryOp::Member(member));
                CtlResponse::Ok
            }
            CtlRequest::NextVersion { name } => CtlResponse::Version {
                version: st.registry.next_version(&name),
            },
            CtlRequest::Announce { ops } => announce(st, ops, &mut events),
            // As a broker does: the publish's event carries the bytes.
            CtlRequest::Publish { ops, bytes } => match ops.first() {
                Some(RegistryOp::Publish { name, version, .. }) => {
                    let (name, version) = (name.clone(), *version);
                    let answer = announce(st, ops, &mut events);
                    events = events
                        .into_iter()
                        .map(|e| e.with_inline((&name, version), &bytes))
                        .collect();
                    answer
                }
                _ => error(ErrorCode::Malformed, "publish without a publish op"),
            },
            CtlRequest::Lookup { name, version, .. } => {
                st.lookups += 1;
                lookup(st, sender, &name, version)
            }
            CtlRequest::Fetching {
                name,
                version,
                active,
            } => {
                st.fetching.push((name, version, sender, active));
                CtlResponse::Ok
            }
            CtlRequest::List { prefix, limit } => CtlResponse::Listing {
                entries: st
                    .registry
                    .list(&prefix)
                    .take(limit as usize)
                    .map(|(name, e)| ListedEntry {
                        name: name.clone(),
                        version: e.version,
                        meta: e.meta.clone(),
                        holders: e.holders_of(e.version).count() as u32,
                    })
                    .collect(),
                last: true,
            },
            CtlRequest::Members => CtlResponse::Members {
                members: st
                    .registry
                    .members()
                    .cloned()
                    .map(MemberStatus::without_stats)
                    .collect(),
                last: true,
            },
            _ => error(ErrorCode::Malformed, "not a fake broker request"),
        };
        (answer, events)
    }
}

fn error(code: ErrorCode, message: &str) -> CtlResponse {
    CtlResponse::Error {
        code,
        message: message.into(),
    }
}

fn announce(st: &mut FakeState, ops: Vec<RegistryOp>, events: &mut Vec<Event>) -> CtlResponse {
    for mut op in ops {
        let stamp = st.stamp();
        match &mut op {
            RegistryOp::Publish {
                name,
                version,
                meta,
                publisher,
                stamp: s,
            } => {
                if *version < st.registry.next_version(name) {
                    return error(ErrorCode::Busy, "stale version");
                }
                *s = stamp;
                st.metas.insert((name.clone(), *version), meta.clone());
                events.push(Event::Published {
                    name: name.clone(),
                    version: *version,
                    meta: meta.clone(),
                    publisher: *publisher,
                });
            }
            RegistryOp::AddHolder { stamp: s, .. } | RegistryOp::RemoveHolder { stamp: s, .. } => {
                *s = stamp;
            }
            RegistryOp::Delete { name, stamp: s } => {
                *s = stamp;
                events.push(Event::Deleted { name: name.clone() });
            }
            RegistryOp::Member(_) => return error(ErrorCode::Malformed, "member op"),
        }
        st.registry.apply(&op);
    }
    CtlResponse::Ok
}

fn lookup(st: &FakeState, asker: NodeId, name: &TensorName, version: Option<u64>) -> CtlResponse {
    let not_found = || error(ErrorCode::NotFound, &format!("tensor \"{name}\" not found"));
    let Some(entry) = st.registry.entry(name) else {
        return not_found();
    };
    let version = version.unwrap_or(entry.version);
    let Some(meta) = st.metas.get(&(name.clone(), version)) else {
        return not_found();
    };
    let holders: Vec<HolderAddr> = st
        .first_holder
        .iter()
        .cloned()
        .chain(
            entry
                .holders_of(version)
                .filter(|n| *n != asker)
                .filter_map(|n| st.registry.member(&n))
                .map(|m| HolderAddr {
                    node: m.node,
                    addrs: m.addrs.clone(),
                    complete: true,
                }),
        )
        .collect();
    if holders.is_empty() {
        return error(
            ErrorCode::NotFound,
            &format!("no holder of \"{name}\" v{version}"),
        );
    }
    CtlResponse::Holders {
        name: name.clone(),
        version,
        meta: meta.clone(),
        holders,
        // The fake broker's answers name one source at a time.
        sources: 1,
    }
}

/// The `tb/ctl/1` handler of one fake broker.
#[derive(Debug, Clone)]
struct FakeBroker {
    me: EndpointId,
    /// The secret it admits (the test config's; open by default).
    key: ClusterKey,
    cluster: FakeCluster,
}

impl ProtocolHandler for FakeBroker {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let key = self.key.clone();
        let admission = auth::Admission::new(&crate::Config::default());
        if auth::server_hello(&conn, self.me, &key, CTL_ALPN, &admission, 1 << 40, |_| {})
            .await
            .is_err()
        {
            return Ok(());
        }
        let sender = auth::node_id(&conn.remote_id());
        while let Ok((send, recv)) = conn.accept_bi().await {
            tokio::spawn(self.clone().serve(sender, send, recv));
        }
        Ok(())
    }
}

impl FakeBroker {
    async fn serve(self, sender: NodeId, mut send: SendStream, mut recv: RecvStream) {
        let Ok(request) = wire::read_frame::<CtlRequest>(&mut recv).await else {
            return;
        };
        if let CtlRequest::Subscribe { pattern } = request {
            let mut events = self.cluster.events.subscribe();
            self.cluster.state().subscribers += 1;
            let _ = wire::write_frame(&mut send, &CtlResponse::Ok).await;
            let mut buf = [0u8; 64];
            loop {
                let received = tokio::select! {
                    received = events.recv() => received,
                    // The subscriber closed its side, or the connection went away.
                    read = recv.read(&mut buf) => match read {
                        Ok(Some(_)) => continue,
                        Ok(None) | Err(_) => break,
                    },
                };
                let mut event = match received {
                    Ok(event) => event,
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => break,
                };
                if let Event::PublishedInline { bytes, .. } = &mut event
                    && !bytes.is_empty()
                {
                    let mut st = self.cluster.state();
                    if st.tamper_inline > 0 {
                        st.tamper_inline -= 1;
                        bytes[0] ^= 0xff;
                    }
                }
                if pattern.matches(event.name())
                    && wire::write_frame(&mut send, &CtlResponse::Event(event))
                        .await
                        .is_err()
                {
                    break;
                }
            }
            self.cluster.state().subscribers -= 1;
            return;
        }
        let (answer, events) = self.cluster.answer(sender, request);
        for event in events {
            let _ = self.cluster.events.send(event);
        }
        if wire::write_frame(&mut send, &answer).await.is_ok() {
            let _ = send.finish();
        }
    }
}
