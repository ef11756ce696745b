//! [`CtlClient`]: this node's `tb/ctl/1` links to the brokers, one reused connection per
//! broker (re-dialed when it closes), and requests with failover.
//!
//! A request goes on a bi-stream of its own: one `CtlRequest` frame, the send side finished,
//! then `CtlResponse` frames until one is final, each read bounded by a timeout and validated
//! before use. A call starts at the broker that worked last and moves on to the next one when a
//! broker is unusable (see `failover`); a broker's `Error` answer ends the call. Ctl links stay
//! out of the data pool, which holds `tb/data/1` links only.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use iroh::{
    Endpoint, EndpointId,
    endpoint::{Connection, RecvStream, SendStream},
};
use tb_proto::{CTL_ALPN, CloseCode, ClusterKey, CtlRequest, CtlResponse, MAX_LIST_LIMIT};
use tokio::sync::Mutex;
use tracing::debug;

use super::failover::{self, Failure};
use crate::{
    auth,
    ctx::NodeCtx,
    endpoint::PeerAddr,
    error::{Error, Result},
    wire,
};

/// Most frames one answer may have (a listing of `MAX_LIST_LIMIT` entries one per frame, and
/// the final one): a bound on a broker that never says `last`.
const MAX_ANSWER_FRAMES: usize = MAX_LIST_LIMIT as usize + 1;

/// One broker and the ctl connection to it, if one is open.
#[derive(Debug)]
struct BrokerLink {
    addr: PeerAddr,
    /// Held across a dial, so concurrent calls to one broker share it.
    conn: Mutex<Option<Connection>>,
}

/// The node's client side of `tb/ctl/1`.
#[derive(Debug)]
pub(crate) struct CtlClient {
    endpoint: Endpoint,
    key: ClusterKey,
    connect_timeout: Duration,
    max_tensor_bytes: u64,
    brokers: Vec<BrokerLink>,
    /// Index of the broker that worked last.
    current: AtomicUsize,
}

impl CtlClient {
    /// A client for the brokers in `ctx`'s config; dials nothing yet.
    pub(crate) fn new(ctx: &NodeCtx) -> Self {
        let brokers = ctx
            .config
            .brokers
            .iter()
            .map(|addr| BrokerLink {
                addr: addr.clone(),
                conn: Mutex::new(None),
            })
            .collect();
        CtlClient {
            endpoint: ctx.endpoint.clone(),
            key: ctx.config.cluster_key.clone(),
            connect_timeout: ctx.config.connect_timeout,
            max_tensor_bytes: ctx.config.max_tensor_bytes,
            brokers,
            current: AtomicUsize::new(0),
        }
    }

    /// The broker calls go to first: the one that worked last.
    pub(crate) fn current(&self) -> Option<&PeerAddr> {
        let count = self.brokers.len();
        let i = failover::order(self.current.load(Ordering::Relaxed), count).next()?;
        Some(&self.brokers[i].addr)
    }

    /// Moves calls off broker `id` (a stream to it was lost): if it is the current broker, the
    /// next call starts at the one after it.
    pub(crate) fn avoid(&self, id: &EndpointId) {
        let count = self.brokers.len();
        let Some(i) = self.brokers.iter().position(|b| b.addr.id == *id) else {
            return;
        };
        let current = self.current.load(Ordering::Relaxed);
        if failover::order(current, count).next() == Some(i) {
            let next = (i + 1) % count;
            let _ =
                self.current
                    .compare_exchange(current, next, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The brokers in the order a call tries them: see [`failover::order_avoiding`]. A broker
    /// counts as lost when its cached link is closed (a link being dialed counts as live).
    fn order(&self) -> Vec<usize> {
        let lost: Vec<bool> = self
            .brokers
            .iter()
            .map(|b| {
                b.conn.try_lock().is_ok_and(|slot| {
                    slot.as_ref()
                        .is_some_and(|c: &Connection| c.close_reason().is_some())
                })
            })
            .collect();
        let start = self.current.load(Ordering::Relaxed);
        failover::order_avoiding(start, self.brokers.len(), &lost)
    }

    /// Sends `request` and returns every frame of the answer (the last one final, none an
    /// `Error`), failing over across brokers; each read waits at most `timeout`.
    #[tracing::instrument(name = "ctl", skip_all, fields(request = request.kind(), tensor = request.tensor().map(|n| n.as_str())))]
    pub(crate) async fn call(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>> {
        let mut errors = Vec::new();
        for i in self.order() {
            match self.attempt(i, request, timeout).await {
                Ok(frames) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(frames);
                }
                Err(Failure::Answered(e)) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Err(e);
                }
                Err(Failure::Unusable(e)) => {
                    debug!(broker = %self.brokers[i].addr, %e, "broker unusable, trying the next");
                    errors.push(e);
                }
            }
        }
        Err(failover::exhausted(self.brokers.len(), errors))
    }

    /// Sends `request` to every broker at once, without failover, and returns each one's
    /// answer in list order: for questions whose answer differs per broker (`Members`: each
    /// broker knows the stats of the workers that heartbeat to it).
    pub(crate) async fn call_each(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Vec<(PeerAddr, Result<Vec<CtlResponse>>)> {
        let calls = (0..self.brokers.len()).map(|i| async move {
            let answer = self
                .attempt(i, request, timeout)
                .await
                .map_err(|f| match f {
                    Failure::Answered(e) | Failure::Unusable(e) => e,
                });
            (self.brokers[i].addr.clone(), answer)
        });
        n0_future::join_all(calls).await
    }

    /// Opens a stream for a long-lived request (`Subscribe`): writes `request` and leaves both
    /// sides open. Fails over like [`call`](Self::call); returns the broker's id too.
    pub(crate) async fn open_stream(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<(SendStream, RecvStream, EndpointId)> {
        let mut errors = Vec::new();
        for i in self.order() {
            let (conn, _) = match self.connection(i).await {
                Ok(conn) => conn,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let opened = async {
                let (mut send, recv) = open_bi(&conn, timeout).await?;
                wire::write_frame(&mut send, request).await?;
                Ok::<_, Error>((send, recv, conn.remote_id()))
            };
            match opened.await {
                Ok(streams) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(streams);
                }
                Err(e) => {
                    self.discard(i, &conn).await;
                    errors.push(e);
                }
            }
        }
        Err(failover::exhausted(self.brokers.len(), errors))
    }

    /// One broker: on its open connection, or a fresh one if that turns out to be closed.
    async fn attempt(
        &self,
        i: usize,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>, Failure> {
        let (conn, fresh) = self.connection(i).await.map_err(Failure::Unusable)?;
        let max = self.max_tensor_bytes;
        match exchange(&conn, request, timeout, max).await {
            Err(Failure::Unusable(e)) => {
                let was_closed = conn.close_reason().is_some();
                self.discard(i, &conn).await;
                // A cached link may have died unnoticed (the broker restarted): dial once more.
                if fresh || !was_closed {
                    return Err(Failure::Unusable(e));
                }
                let (conn, _) = self.connection(i).await.map_err(Failure::Unusable)?;
                let again = exchange(&conn, request, timeout, max).await;
                if matches!(again, Err(Failure::Unusable(_))) {
                    self.discard(i, &conn).await;
                }
                again
            }
            other => other,
        }
    }

    /// The open connection to broker `i`, dialing (and saying hello) if there is none; the flag
    /// says whether it was dialed just now.
    async fn connection(&self, i: usize) -> Result<(Connection, bool)> {
        let broker = &self.brokers[i];
        let mut slot = broker.conn.lock().await;
        if let Some(conn) = slot.as_ref().filter(|c| c.close_reason().is_none()) {
            return Ok((conn.clone(), false));
        }
        let conn = self.dial(&broker.addr).await?;
        *slot = Some(conn.clone());
        Ok((conn, true))
    }

    /// Dials `addr` on `tb/ctl/1` and runs the hello, both within the connect timeout.
    async fn dial(&self, addr: &PeerAddr) -> Result<Connection> {
        let timeout = self.connect_timeout;
        let unreachable = |reason: String| Error::PeerUnreachable {
            peer: format!("broker {}@{}", addr.id.fmt_short(), addr.addr),
            reason,
        };
        let dial = async {
            let conn = self
                .endpoint
                .connect(addr.to_endpoint_addr(), CTL_ALPN)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            auth::client_hello(&conn, self.endpoint.id(), &self.key, CTL_ALPN, timeout, 0).await?;
            Ok(conn)
        };
        match tokio::time::timeout(timeout, dial).await {
            Ok(result) => result,
            Err(_) => Err(unreachable(format!("no connection within {timeout:?}"))),
        }
    }

    /// Closes `conn`, a connection to broker `i` that failed a request, and drops it so the
    /// next call dials afresh. A link that let a request time out is taken for dead (it can
    /// stall without closing until the QUIC idle timeout), so everything on it, subscriptions
    /// included, fails over now rather than waiting on it.
    async fn discard(&self, i: usize, conn: &Connection) {
        {
            let mut slot = self.brokers[i].conn.lock().await;
            if slot
                .as_ref()
                .is_some_and(|c| c.stable_id() == conn.stable_id())
            {
                slot.take();
            }
        }
        conn.close(CloseCode::Normal.code().into(), b"unresponsive");
    }

    /// Closes every ctl connection (at shutdown).
    pub(crate) async fn close(&self) {
        for broker in &self.brokers {
            if let Some(conn) = broker.conn.lock().await.take() {
                conn.close(
                    CloseCode::Shutdown.code().into(),
                    CloseCode::Shutdown.reason(),
                );
            }
        }
    }
}

async fn open_bi(conn: &Connection, timeout: Duration) -> Result<(SendStream, RecvStream)> {
    let peer = || conn.remote_id().fmt_short().to_string();
    match tokio::time::timeout(timeout, conn.open_bi()).await {
        Ok(Ok(streams)) => Ok(streams),
        Ok(Err(e)) => Err(Error::PeerUnreachable {
            peer: peer(),
            reason: format!("opening a ctl stream: {e}"),
        }),
        Err(_) => Err(Error::timeout(
            format!("a ctl stream to broker {}", peer()),
            timeout,
        )),
    }
}

/// One request on its own stream of `conn`: the frames of the answer, up to the final one.
async fn exchange(
    conn: &Connection,
    request: &CtlRequest,
    timeout: Duration,
    max_tensor_bytes: u64,
) -> Result<Vec<CtlResponse>, Failure> {
    let broker = conn.remote_id().fmt_short().to_string();
    let (mut send, mut recv) = open_bi(conn, timeout).await.map_err(Failure::Unusable)?;
    wire::write_frame(&mut send, request)
        .await
        .map_err(Failure::Unusable)?;
    let _ = send.finish();
    let mut frames = Vec::new();
    loop {
        if frames.len() >= MAX_ANSWER_FRAMES {
            return Err(Failure::Unusable(Error::Io(format!(
                "broker {broker} sent over {MAX_ANSWER_FRAMES} frames without a final one"
            ))));
        }
        let response = read_response(&mut recv, &broker, timeout, max_tensor_bytes)
            .await
            .map_err(Failure::Unusable)?;
        if let CtlResponse::Error { code, message } = response {
            return Err(failover::answer_error(broker, code, message));
        }
        let last = response.is_final();
        frames.push(response);
        if last {
            return Ok(frames);
        }
    }
}

/// Reads and validates one `CtlResponse` frame from `broker`, within `timeout`.
pub(crate) async fn read_response(
    recv: &mut RecvStream,
    broker: &str,
    timeout: Duration,
    max_tensor_bytes: u64,
) -> Result<CtlResponse> {
    let what = format!("an answer from broker {broker}");
    let response = match tokio::time::timeout(timeout, wire::read_frame(recv)).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => return Err(e.into_error(&what)),
        Err(_) => return Err(Error::timeout(what, timeout)),
    };
    check_response(response, broker, max_tensor_bytes)
}

/// Validates a response from `broker` before anyone uses it.
pub(crate) fn check_response(
    response: CtlResponse,
    broker: &str,
    max_tensor_bytes: u64,
) -> Result<CtlResponse> {
    match response.validate(max_tensor_bytes) {
        Ok(()) => Ok(response),
        Err(e) => Err(Error::Io(format!(
            "broker {broker} sent an invalid answer: {e}"
        ))),
    }
}
