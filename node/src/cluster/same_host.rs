//! [`SameHost`]: a node's requests to a broker on its own host go down the shm channel's unix
//! socket (`DataRequest::Ctl`, see `channel/shm/ctl.rs`) instead of the QUIC `tb/ctl/1` link:
//! a publish, a look-up or a listing then costs a unix-socket round trip, not a QUIC one
//! through two runtimes (~300 us between processes on the development VM, most of a small
//! `put`).
//!
//! Which brokers are on this host is learnt in the background, never on a request's path: the
//! first eligible request to a broker starts a task that links to the broker's node on
//! `tb/data/1` (the broker runs a node on its endpoint) and asks the pair's channel; an shm
//! route is kept for the broker, anything else (QUIC, a failed dial) is asked again after
//! [`NOT_LOCAL_FOR`] or [`FAILED_FOR`]. Until then, and whenever the socket fails before an
//! answer, requests take the QUIC link. Heartbeats and anti-entropy stay on QUIC: a broker
//! judges a member's life and leave by its ctl link.
//!
//! Subscriptions go on the socket too, each on a connection of its own
//! ([`SameHost::subscribe`]): a broker's events then cost it a socket write per subscriber,
//! not a QUIC packet, and the subscriber a socket read. A subscription opened on QUIC before
//! the broker was known to be on this host moves to the socket once it is.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use iroh::EndpointId;
use tb_proto::{CtlRequest, CtlResponse};
use tracing::{debug, warn};

use super::failover::{self, Failure};
use crate::{
    PeerAddr,
    channel::{ChannelError, Route, ShmRoute},
    node::WeakNode,
};

/// How long a broker whose pair's channel is not shm (another host) is not asked again.
const NOT_LOCAL_FOR: Duration = Duration::from_secs(600);
/// How long after a failed look (dial, channel exchange) or a socket that failed.
const FAILED_FOR: Duration = Duration::from_secs(30);

/// What is known of one broker.
enum State {
    /// A task is finding out.
    Finding,
    /// On this host: its node's same-host socket.
    Local(ShmRoute),
    /// Not usable on the socket before then.
    Not(Instant),
}

/// The brokers on this host and their routes.
#[derive(Default)]
pub(crate) struct SameHost {
    node: OnceLock<WeakNode>,
    /// Shared with the tasks finding out.
    brokers: Arc<Mutex<HashMap<EndpointId, State>>>,
}

impl std::fmt::Debug for SameHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let local = lock(&self.brokers)
            .values()
            .filter(|s| matches!(s, State::Local(_)))
            .count();
        f.debug_struct("SameHost").field("local", &local).finish()
    }
}

fn lock(
    brokers: &Mutex<HashMap<EndpointId, State>>,
) -> std::sync::MutexGuard<'_, HashMap<EndpointId, State>> {
    brokers.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `request` may go on the socket as a request and its answer: everything but
/// heartbeats, subscriptions (which stream: [`SameHost::subscribe`]) and anti-entropy.
pub(super) fn eligible(request: &CtlRequest) -> bool {
    !matches!(
        request,
        CtlRequest::Heartbeat { .. }
            | CtlRequest::Subscribe { .. }
            | CtlRequest::SyncBuckets { .. }
            | CtlRequest::SyncNames { .. }
    )
}

impl SameHost {
    /// The node whose links and socket requests use (set once, when it starts).
    pub(super) fn attach(&self, node: WeakNode) {
        let _ = self.node.set(node);
    }

    /// `broker`'s answer to `request` on the same-host socket; `None`: send it on QUIC (the
    /// broker is not known to be on this host, or the socket failed before any answer).
    /// A first answer later than `first_within` counts as a failed socket (the QUIC race then
    /// tries this broker and the others).
    pub(super) async fn call(
        &self,
        broker: &PeerAddr,
        request: &CtlRequest,
        first_within: Duration,
        timeout: Duration,
    ) -> Option<Result<Vec<CtlResponse>, Failure>> {
        let route = self.route(broker)?;
        let node = self.node.get()?.upgrade()?;
        let ctx = node.ctx().clone();
        drop(node);
        let exchange = crate::channel::shm_ctl_exchange;
        let answered = exchange(&ctx, &route, request, first_within, timeout).await;
        match answered {
            Ok(mut frames) => match frames.pop() {
                // Its node runs no broker (a broker answers on another node's endpoint, or a
                // broker from before this answered): QUIC from now on.
                Some(CtlResponse::Error {
                    code: tb_proto::ErrorCode::Unsupported,
                    ..
                }) => {
                    lock(&self.brokers)
                        .insert(broker.id, State::Not(Instant::now() + NOT_LOCAL_FOR));
                    None
                }
                Some(CtlResponse::Error { code, message }) => {
                    let name = broker.id.fmt_short().to_string();
                    Some(Err(failover::answer_error(name, code, message)))
                }
                Some(last) => {
                    frames.push(last);
                    Some(Ok(frames))
                }
                None => None,
            },
            Err(ChannelError::ViaQuic) => None,
            Err(ChannelError::Fallback(e) | ChannelError::Final(e)) => {
                self.socket_failed(&ctx, broker, &e);
                None
            }
        }
    }

    /// A subscription (`request`) to `broker` on the same-host socket: its connection once
    /// the broker answered `Ok`. `None`: subscribe over QUIC (the broker is not known to be on
    /// this host, serves no subscriptions on its socket, or the socket failed).
    pub(super) async fn subscribe(
        &self,
        broker: &PeerAddr,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Option<Result<crate::channel::ShmStream, Failure>> {
        let route = self.route(broker)?;
        let node = self.node.get()?.upgrade()?;
        let ctx = node.ctx().clone();
        drop(node);
        let opened = crate::channel::shm_open_subscription(&ctx, &route, request, timeout).await;
        match opened {
            Ok((conn, CtlResponse::Ok)) => Some(Ok(conn)),
            // A broker from before subscriptions on the socket: they take QUIC.
            Ok((
                _,
                CtlResponse::Error {
                    code: tb_proto::ErrorCode::Unsupported,
                    ..
                },
            )) => None,
            Ok((_, CtlResponse::Error { code, message })) => {
                let name = broker.id.fmt_short().to_string();
                Some(Err(failover::answer_error(name, code, message)))
            }
            Ok((_, _)) => {
                let e = "answered a subscription with something other than Ok";
                warn!(broker = %broker.id.fmt_short(), e, "subscribing over QUIC");
                None
            }
            Err(ChannelError::ViaQuic) => None,
            Err(ChannelError::Fallback(e) | ChannelError::Final(e)) => {
                self.socket_failed(&ctx, broker, &e);
                None
            }
        }
    }

    /// Drops the pooled socket connections to `broker`, whose socket just closed under a
    /// subscription: they lead to a process that is gone.
    pub(super) fn drop_idle(&self, broker: &EndpointId) {
        if let Some(State::Local(route)) = lock(&self.brokers).get(broker) {
            route.shm.forget(&route.peer);
        }
    }

    /// Counts and logs a failed socket to `broker`, whose requests then take QUIC for
    /// [`FAILED_FOR`].
    fn socket_failed(&self, ctx: &crate::ctx::NodeCtx, broker: &PeerAddr, e: &crate::Error) {
        warn!(broker = %broker.id.fmt_short(), %e, "a broker's same-host socket failed: its requests take QUIC for 30 s");
        ctx.metrics.channels.fallback(tb_proto::ChannelKind::Shm);
        lock(&self.brokers).insert(broker.id, State::Not(Instant::now() + FAILED_FOR));
    }

    /// Whether `broker` is known to be on this host (and reached on its socket); starts
    /// finding out when that is not known yet.
    pub(super) fn is_local(&self, broker: &PeerAddr) -> bool {
        self.route(broker).is_some()
    }

    /// The route to `broker` when it is known to be on this host; else starts finding out
    /// (once at a time, not before a backoff ends) and says `None`.
    fn route(&self, broker: &PeerAddr) -> Option<ShmRoute> {
        let mut brokers = lock(&self.brokers);
        match brokers.get(&broker.id) {
            Some(State::Local(route)) => return Some(route.clone()),
            Some(State::Finding) => return None,
            Some(State::Not(until)) if *until > Instant::now() => return None,
            Some(State::Not(_)) | None => {}
        }
        let node = self.node.get()?.upgrade()?;
        brokers.insert(broker.id, State::Finding);
        drop(brokers);
        let (ctx, addr, table) = (node.ctx().clone(), broker.clone(), self.brokers.clone());
        let weak = node.downgrade();
        drop(node);
        let tracker = ctx.tracker.clone();
        tracker.spawn(async move {
            let found = tokio::select! {
                _ = ctx.cancel.cancelled() => return,
                found = find(&ctx, &weak, &addr) => found,
            };
            lock(&table).insert(addr.id, found);
        });
        None
    }
}

/// Whether the broker at `addr` is on this host: its route on the same-host socket, or when
/// to ask again.
async fn find(ctx: &crate::ctx::NodeCtx, node: &WeakNode, addr: &PeerAddr) -> State {
    let Some(node) = node.upgrade() else {
        return State::Not(Instant::now() + FAILED_FOR);
    };
    let links = || node.link(addr);
    match crate::channel::route(ctx, &addr.id, links).await {
        Ok(Some(Route::Shm(route))) => State::Local(route),
        Ok(_) => State::Not(Instant::now() + NOT_LOCAL_FOR),
        Err(e) => {
            debug!(broker = %addr.id.fmt_short(), %e, "no data link to the broker");
            State::Not(Instant::now() + FAILED_FOR)
        }
    }
}
