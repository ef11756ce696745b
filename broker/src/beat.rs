//! [`PeerBeats`]: a broker heartbeats to every other broker, as workers heartbeat to brokers,
//! so each broker judges its peers' liveness by the same rule and timeout as workers'
//! (`state::liveness`): a broker that stops answering is marked dead in the registry, which
//! `tb status`, the HTTP API and the dashboard show.
//!
//! Each round heartbeats every peer at once and lasts at most one interval, so a dead peer
//! (whose dial would last a whole connect timeout) delays no one else's heartbeat. A beat the
//! round cuts off on a link that was up before the round counts as failed, and the next round
//! dials afresh ([`CutOff`]).

use std::{collections::HashMap, sync::Mutex, time::Duration};

use iroh::{Endpoint, EndpointId, endpoint::Connection};
use ractor::ActorRef;
use tb_link::{
    PeerAddr,
    framing::{read_frame, write_frame},
};
use tb_proto::{ClusterKey, CtlRequest, CtlResponse, Role};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::{actor::BrokerMsg, broker::peer_brokers, sync};

/// Heartbeats this broker sends to its peers, every `interval`.
pub(crate) struct PeerBeats {
    pub(crate) actor: ActorRef<BrokerMsg>,
    pub(crate) endpoint: Endpoint,
    pub(crate) key: ClusterKey,
    /// The brokers this one was told to join (peers the membership table may not know yet).
    pub(crate) join: Vec<PeerAddr>,
    /// This broker's addresses and life, as its heartbeats announce them.
    pub(crate) addrs: Vec<String>,
    pub(crate) epoch: u64,
    pub(crate) interval: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) cancel: CancellationToken,
}

impl PeerBeats {
    /// Heartbeats every peer broker each `interval` until cancelled, then closes its links.
    pub(crate) async fn run(self) {
        let links = Mutex::new(HashMap::new());
        let me = self.endpoint.id();
        loop {
            let started = tokio::time::Instant::now();
            let peers = peer_brokers(&self.actor, &self.join, me, self.request_timeout).await;
            tracing::trace!(peers = peers.len(), "heartbeating peer brokers");
            let beats = n0_future::join_all(peers.iter().map(|peer| self.beat(peer, &links)));
            // A beat still under way after one interval is dropped: a dead peer's dial would
            // hold the round for a whole connect timeout, and every live peer's next heartbeat
            // with it, past their liveness timeout.
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                _ = tokio::time::timeout(self.interval, beats) => {}
            }
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                () = tokio::time::sleep_until(started + self.interval) => {}
            }
        }
        let links = links.into_inner().unwrap_or_else(|p| p.into_inner());
        for conn in links.into_values() {
            conn.close(0u32.into(), b"shutdown");
        }
    }

    /// One heartbeat to `peer`, on its cached link or a fresh one; a link that fails is closed
    /// and forgotten, and so is a cached one that the round's end cuts off.
    async fn beat(&self, peer: &PeerAddr, links: &Mutex<HashMap<EndpointId, Connection>>) {
        let cached = lock(links)
            .get(&peer.id)
            .filter(|c| c.close_reason().is_none())
            .cloned();
        // Only a link that was up before this round is forgotten when the round cuts its beat
        // off: one just dialed reached the peer, and a first answer slower than what is left
        // of the round (under load) is no reason to dial again.
        let mut cut_off = CutOff {
            peer: peer.id,
            conn: cached.clone(),
            links,
            cancel: &self.cancel,
        };
        let conn = match cached {
            Some(conn) => conn,
            None => match sync::dial(&self.endpoint, &self.key, self.connect_timeout, peer).await {
                Ok(conn) => {
                    lock(links).insert(peer.id, conn.clone());
                    conn
                }
                Err(e) => {
                    debug!(peer = %peer.id.fmt_short(), %e, "peer broker unreachable");
                    return;
                }
            },
        };
        let request = CtlRequest::Heartbeat {
            role: Role::Broker,
            addrs: self.addrs.clone(),
            epoch: self.epoch,
            stats: None,
        };
        let sent = tokio::time::timeout(self.request_timeout, exchange(&conn, &request)).await;
        cut_off.disarm();
        let failure = match sent {
            Ok(Ok(())) => {
                tracing::trace!(peer = %peer.id.fmt_short(), "heartbeat to a peer broker answered");
                return;
            }
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {:?}", self.request_timeout),
        };
        debug!(peer = %peer.id.fmt_short(), %failure, "heartbeat to a peer broker failed");
        lock(links).remove(&peer.id);
        conn.close(0u32.into(), b"unresponsive");
    }
}

/// Forgets and closes the cached link `conn` to `peer` when dropped while it still holds it:
/// the round's end cut off a beat on a link that was up before the round, which counts as
/// failed, as a beat that timed out would. A peer that dies without closing its links (SIGKILL,
/// a host lost) leaves them looking open until QUIC's idle timeout (30 s); beats on such a link
/// are cut off at each round's end, before their `request_timeout`, so without this the link
/// was reused round after round. A peer restarted at the same address then never heard this
/// broker: it judged it dead, and again one timeout after each refutation, until the idle
/// timeout closed the link.
struct CutOff<'a> {
    peer: EndpointId,
    /// The link, while the beat on it has neither been answered nor failed.
    conn: Option<Connection>,
    links: &'a Mutex<HashMap<EndpointId, Connection>>,
    /// The broker's shutdown: a beat dropped by it was not cut off (the links close as
    /// the broker's, after the round).
    cancel: &'a CancellationToken,
}

impl CutOff<'_> {
    /// The beat was answered, or failed and is handled as such.
    fn disarm(&mut self) {
        self.conn = None;
    }
}

impl Drop for CutOff<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.cancel.is_cancelled() {
            return;
        }
        debug!(peer = %self.peer.fmt_short(), "heartbeat to a peer broker unanswered within the round; redialing");
        let mut links = lock(self.links);
        if links
            .get(&self.peer)
            .is_some_and(|c| c.stable_id() == conn.stable_id())
        {
            links.remove(&self.peer);
        }
        drop(links);
        conn.close(0u32.into(), b"unresponsive");
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `request` on a stream of its own; `Ok` when the peer answers `Ok`.
async fn exchange(conn: &Connection, request: &CtlRequest) -> Result<(), String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    write_frame(&mut send, request)
        .await
        .map_err(|e| e.to_string())?;
    let _ = send.finish();
    match read_frame::<CtlResponse>(&mut recv).await {
        Ok(CtlResponse::Ok) => Ok(()),
        Ok(CtlResponse::Error { code, message }) => Err(format!("refused: {code:?}: {message}")),
        Ok(_) => Err("an unexpected answer".into()),
        Err(e) => Err(e.into_error("the answer").to_string()),
    }
}
