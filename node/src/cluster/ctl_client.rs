//! [`CtlClient`]: this node's `tb/ctl/1` links to the brokers, one reused connection per
//! broker (re-dialed when it closes), and requests with failover.
//!
//! A request goes on a bi-stream of its own: one `CtlRequest` frame, the send side finished,
//! then `CtlResponse` frames until one is final, each read bounded by a timeout and validated
//! before use. A call goes to the broker that answered last first, and to the next one too if
//! the first has not answered (dial, hello and request) within a short stagger (see `race`),
//! and so on; the first answer wins. A broker found unusable moves the call on to the others (see
//! `failover`); a broker's `Error` answer, or its refusing our secret, ends the call. Ctl links stay
//! out of the data pool, which holds `tb/data/1` links only.
//!
//! Each broker's link is a small state machine (`Idle`, `Dialing`, `Ready`) behind a lock that
//! is held only to read or change it, never across a dial: a dial runs in a task of its own,
//! every call that needs that broker meanwhile waits for the same dial's outcome, and calls to
//! other brokers, discarding a dead link and closing the client never wait for it.

use std::{
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use iroh::{
    Endpoint, EndpointId,
    endpoint::{Connection, RecvStream, SendStream},
};
use tb_proto::{CTL_ALPN, CloseCode, ClusterKey, CtlRequest, CtlResponse, MAX_LIST_LIMIT};
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::debug;

use super::{
    failover::{self, Failure},
    race::{self, EACH_GRACE, Lost, STAGGER},
};
use crate::{
    PeerAddr, auth,
    ctx::NodeCtx,
    error::{BrokerFailure, Error, Result},
    wire,
};

/// How long a request on a cached ctl link goes unanswered before a fresh link to the same
/// broker is dialed beside it (see `CtlClient::attempt_redialing`). Longer than the stagger
/// between brokers: a busy broker should not cost a reconnect.
const REDIAL_AFTER: Duration = Duration::from_millis(500);

/// Most frames one answer may have (a listing of `MAX_LIST_LIMIT` entries one per frame, and
/// the final one): a bound on a broker that never says `last`.
const MAX_ANSWER_FRAMES: usize = MAX_LIST_LIMIT as usize + 1;

/// One broker and the state of the ctl link to it.
#[derive(Debug)]
struct BrokerLink {
    addr: PeerAddr,
    /// Locked only to read or change the state, never across an await.
    link: Mutex<Link>,
}

impl BrokerLink {
    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The ctl link to one broker.
#[derive(Debug, Default)]
enum Link {
    /// No connection, no dial.
    #[default]
    Idle,
    /// A dial is under way; every call that needs this broker waits for its outcome.
    Dialing(Dial),
    /// A connection (it may have closed since: checked at use).
    Ready(Connection),
}

/// A dial under way.
#[derive(Debug)]
struct Dial {
    /// Tells this dial from a later one to the same broker.
    id: u64,
    /// Its outcome once it has one; the sender is dropped unanswered when it is cancelled.
    outcome: watch::Receiver<Option<Result<Connection>>>,
    /// Stops it (when the client closes).
    cancel: CancellationToken,
}

/// What a dial needs: shared with the dial tasks.
#[derive(Debug, Clone)]
struct Dialer {
    endpoint: Endpoint,
    key: ClusterKey,
    timeout: Duration,
}

/// The node's client side of `tb/ctl/1`.
#[derive(Debug)]
pub(crate) struct CtlClient {
    dialer: Dialer,
    max_tensor_bytes: u64,
    brokers: Vec<Arc<BrokerLink>>,
    /// Index of the broker that worked last.
    current: AtomicUsize,
    next_dial: AtomicU64,
    /// Owns the dial tasks; `cancel` stops them (the node's shutdown).
    tracker: TaskTracker,
    cancel: CancellationToken,
    /// Brokers on this host, reached on the same-host socket for most requests.
    #[cfg(target_os = "linux")]
    same_host: super::same_host::SameHost,
}

impl CtlClient {
    /// A client for the brokers in `ctx`'s config; dials nothing yet.
    pub(crate) fn new(ctx: &NodeCtx) -> Self {
        let dialer = Dialer {
            endpoint: ctx.endpoint.clone(),
            key: ctx.config.cluster_key.clone(),
            timeout: ctx.config.connect_timeout,
        };
        CtlClient::with(
            dialer,
            ctx.config.max_tensor_bytes,
            &ctx.config.brokers,
            ctx.tracker.clone(),
            ctx.cancel.clone(),
        )
    }

    /// A client of `brokers` on `endpoint` with its own task tracker, for tests.
    #[cfg(test)]
    pub(super) fn standalone(
        endpoint: Endpoint,
        key: ClusterKey,
        connect_timeout: Duration,
        brokers: &[PeerAddr],
    ) -> Self {
        let dialer = Dialer {
            endpoint,
            key,
            timeout: connect_timeout,
        };
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        CtlClient::with(dialer, 1 << 30, brokers, tracker, cancel)
    }

    fn with(
        dialer: Dialer,
        max_tensor_bytes: u64,
        brokers: &[PeerAddr],
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Self {
        let brokers = brokers
            .iter()
            .map(|addr| {
                Arc::new(BrokerLink {
                    addr: addr.clone(),
                    link: Mutex::new(Link::Idle),
                })
            })
            .collect();
        CtlClient {
            dialer,
            max_tensor_bytes,
            brokers,
            current: AtomicUsize::new(0),
            next_dial: AtomicU64::new(0),
            tracker,
            cancel,
            #[cfg(target_os = "linux")]
            same_host: Default::default(),
        }
    }

    /// The node this client belongs to: its requests to a broker on this host take the
    /// same-host socket (see [`super::same_host`]).
    pub(crate) fn attach(&self, node: crate::node::WeakNode) {
        #[cfg(target_os = "linux")]
        self.same_host.attach(node);
        #[cfg(not(target_os = "linux"))]
        let _ = node;
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

    /// Closes the cached QUIC link to broker `id`, whose same-host socket just closed under
    /// a subscription, and drops its pooled socket connections: the process behind them is
    /// most likely gone, and a link to it would answer nothing until its idle timeout (a
    /// broker restarted on the same address is a new process: the old link stays dead). The
    /// next call dials afresh.
    pub(crate) fn close_link(&self, id: &EndpointId) {
        #[cfg(target_os = "linux")]
        self.same_host.drop_idle(id);
        let Some(i) = self.brokers.iter().position(|b| b.addr.id == *id) else {
            return;
        };
        let ready = match &*self.brokers[i].link() {
            Link::Ready(conn) => Some(conn.clone()),
            _ => None,
        };
        if let Some(conn) = ready {
            self.discard(i, &conn);
        }
    }

    /// The brokers in the order a call tries them: see [`failover::order_avoiding`]. A broker
    /// counts as lost when its cached link is closed (a link being dialed counts as live).
    fn order(&self) -> Vec<usize> {
        let lost: Vec<bool> = self
            .brokers
            .iter()
            .map(|b| matches!(&*b.link(), Link::Ready(c) if c.close_reason().is_some()))
            .collect();
        let start = self.current.load(Ordering::Relaxed);
        failover::order_avoiding(start, self.brokers.len(), &lost)
    }
    /// Sends `request` and returns every frame of the answer (the last one final, none an
    /// `Error`). The request goes to the broker that answered last and, whenever the newest
    /// attempt has gone [`STAGGER`] without an answer, to the next broker too (see
    /// [`race::staggered`]); the first answer wins. So a broker that died with our link to it
    /// still open (SIGKILL sends no close; the link looks fine until its idle timeout) costs a
    /// call one stagger, not a request timeout. Every request but `Heartbeat` is safe to send
    /// twice (queries, and registry ops that are idempotent). A heartbeat is not hedged: a
    /// broker that hears a worker judges its liveness from then on, so a worker heartbeats to
    /// one broker at a time ([`call_one_at_a_time`](Self::call_one_at_a_time)).
    /// Each read waits at most `timeout`.
    #[tracing::instrument(name = "ctl", skip_all, fields(request = request.kind(), tensor = request.tensor().map(|n| n.as_str())))]
    pub(crate) async fn call(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>> {
        if matches!(request, CtlRequest::Heartbeat { .. }) {
            return self.call_one_at_a_time(request, timeout).await;
        }
        #[cfg(target_os = "linux")]
        if let Some(answered) = self.on_same_host(request, timeout).await {
            return answered;
        }
        let mut failed = Vec::new();
        let attempt = |i| self.attempt_redialing(i, request, timeout);
        match race::staggered(&self.order(), STAGGER, &mut failed, attempt).await {
            Ok((i, frames)) => {
                self.remember(i);
                Ok(frames)
            }
            Err(Lost::Answered(i, e)) => {
                self.remember(i);
                Err(e)
            }
            Err(Lost::Exhausted) => Err(self.exhausted(failed)),
        }
    }

    /// The answer of the first broker in [`order`](Self::order) on the same-host socket (see
    /// [`super::same_host`]); `None`: ask on QUIC (the request or the broker does not take the
    /// socket, it failed before an answer, or the broker is shutting down).
    #[cfg(target_os = "linux")]
    async fn on_same_host(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Option<Result<Vec<CtlResponse>>> {
        if !super::same_host::eligible(request) {
            return None;
        }
        let i = self.order().first().copied()?;
        let broker = &self.brokers[i].addr;
        let first_within = STAGGER.min(timeout);
        let answered = match self
            .same_host
            .call(broker, request, first_within, timeout)
            .await?
        {
            Ok(frames) => Ok(frames),
            Err(Failure::Answered(e)) => Err(e),
            Err(Failure::Unusable(_)) => return None,
        };
        self.remember(i);
        Some(answered)
    }

    /// A subscription (`request`) on the same-host socket of the first broker in
    /// [`order`](Self::order): its connection and the broker, once registered. `None`:
    /// subscribe over QUIC (see [`SameHost::subscribe`](super::same_host::SameHost::subscribe)).
    #[cfg(target_os = "linux")]
    pub(crate) async fn subscribe_on_same_host(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Option<Result<(crate::channel::ShmStream, EndpointId)>> {
        let i = self.order().first().copied()?;
        let broker = &self.brokers[i].addr;
        let opened = match self.same_host.subscribe(broker, request, timeout).await? {
            Ok(conn) => Ok((conn, broker.id)),
            Err(Failure::Answered(e)) => Err(e),
            Err(Failure::Unusable(_)) => return None,
        };
        self.remember(i);
        Some(opened)
    }

    /// Whether the first broker in [`order`](Self::order) is known to be on this host, so
    /// that a subscription to it can go on the socket; starts finding out when not known.
    #[cfg(target_os = "linux")]
    pub(crate) fn first_broker_is_local(&self) -> bool {
        self.order()
            .first()
            .is_some_and(|&i| self.same_host.is_local(&self.brokers[i].addr))
    }

    /// [`call`](Self::call) without hedging: on the first broker whose link is ready (see
    /// [`race`](Self::race)), moving on to the others only when a broker turns out unusable.
    async fn call_one_at_a_time(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>> {
        let mut failed = Vec::new();
        // Each turn rules out one broker at least.
        for _ in 0..self.brokers.len() {
            let (i, (conn, fresh)) = self.race(&mut failed).await?;
            match self.exchange_on(i, conn, fresh, request, timeout).await {
                Ok(frames) => {
                    self.remember(i);
                    return Ok(frames);
                }
                Err(Failure::Answered(e)) => {
                    self.remember(i);
                    return Err(e);
                }
                Err(Failure::Unusable(e)) => {
                    debug!(broker = %self.brokers[i].addr, %e, "broker unusable, trying the next");
                    failed.push((i, e));
                }
            }
        }
        Err(self.exhausted(failed))
    }

    /// Sends `request` to every broker at once, without failover, and returns each one's
    /// answer in list order: for questions whose answer differs per broker (`Members`: each
    /// broker knows the stats of the workers that heartbeat to it). Once one broker has
    /// answered, the others get [`EACH_GRACE`] more (see `race::all_with_grace`), so a dead
    /// broker costs the call that grace instead of a connect timeout; those that miss it are
    /// answered `Timeout`.
    pub(crate) async fn call_each(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Vec<(PeerAddr, Result<Vec<CtlResponse>>)> {
        let attempts = (0..self.brokers.len())
            .map(|i| async move {
                let answer = self.attempt(i, request, timeout).await;
                answer.map_err(|(Failure::Answered(e) | Failure::Unusable(e))| e)
            })
            .collect();
        let answers = race::all_with_grace(attempts, EACH_GRACE).await;
        let late = |broker: &BrokerLink| {
            let what = format!("broker {} after another answered", short_addr(&broker.addr));
            Err(Error::timeout(what, EACH_GRACE))
        };
        let answers = answers.into_iter().zip(&self.brokers);
        answers
            .map(|(answer, b)| (b.addr.clone(), answer.unwrap_or_else(|| late(b))))
            .collect()
    }

    /// Opens a stream for a long-lived request (`Subscribe`): writes `request` and leaves both
    /// sides open. Fails over like [`call`](Self::call); returns the connection too (to
    /// [`probe`](Self::probe) it).
    pub(crate) async fn open_stream(
        &self,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<(SendStream, RecvStream, Connection)> {
        let mut failed = Vec::new();
        for _ in 0..self.brokers.len() {
            let (i, (conn, _)) = self.race(&mut failed).await?;
            let opened = async {
                let (mut send, recv) = open_bi(&conn, timeout).await?;
                wire::write_frame(&mut send, request).await?;
                Ok::<_, Error>((send, recv, conn.clone()))
            };
            match opened.await {
                Ok(streams) => {
                    self.remember(i);
                    return Ok(streams);
                }
                Err(e) => {
                    self.discard(i, &conn);
                    failed.push((i, e));
                }
            }
        }
        Err(self.exhausted(failed))
    }

    /// How many brokers this client knows (the most tries a failover makes).
    pub(crate) fn broker_count(&self) -> usize {
        self.brokers.len()
    }

    /// The largest tensor this node accepts, which bounds what an answer may describe.
    pub(crate) fn max_tensor_bytes(&self) -> u64 {
        self.max_tensor_bytes
    }

    /// Checks that the broker at the other end of `conn` still answers (a one-entry `List`
    /// within `timeout`; any answer counts). A long-lived stream on a link to a broker killed
    /// without a close would otherwise wait for QUIC's idle timeout (30 s): when the probe
    /// gets no answer, the link is closed (which ends every stream on it) and dropped.
    pub(crate) async fn probe(&self, conn: &Connection, timeout: Duration) -> Result<()> {
        let request = CtlRequest::List {
            prefix: String::new(),
            limit: 1,
        };
        match exchange(conn, &request, timeout, self.max_tensor_bytes).await {
            Ok(_) | Err(Failure::Answered(_)) => Ok(()),
            Err(Failure::Unusable(e)) => {
                let id = conn.remote_id();
                match self.brokers.iter().position(|b| b.addr.id == id) {
                    Some(i) => self.discard(i, conn),
                    None => conn.close(CloseCode::Normal.code().into(), b"unresponsive"),
                }
                Err(e)
            }
        }
    }

    /// Checks that `broker`, whose subscription runs on the same-host socket, still answers
    /// there (a one-entry `List` within `timeout`, on a connection of the pool): a broker
    /// that froze (stopped, deadlocked) keeps its socket open, where one that died closes it.
    #[cfg(target_os = "linux")]
    pub(crate) async fn probe_on_same_host(
        &self,
        broker: &EndpointId,
        timeout: Duration,
    ) -> Result<()> {
        // Not known as local right now (a request's socket failed a moment ago): no probe;
        // the socket's close still tells a broker that died.
        let Some(link) = self.brokers.iter().find(|b| b.addr.id == *broker) else {
            return Ok(());
        };
        if !self.same_host.is_local(&link.addr) {
            return Ok(());
        }
        let request = CtlRequest::List {
            prefix: String::new(),
            limit: 1,
        };
        match self
            .same_host
            .call(&link.addr, &request, timeout, timeout)
            .await
        {
            Some(Ok(_) | Err(Failure::Answered(_))) => Ok(()),
            Some(Err(Failure::Unusable(e))) => Err(e),
            None => Err(Error::Io(format!(
                "broker {} did not answer on the same-host socket",
                broker.fmt_short()
            ))),
        }
    }

    /// The link of the first broker to have one ready, of those not in `failed`: the brokers
    /// are dialed in [`order`](Self::order), staggered by [`STAGGER`] (see `race`). A broker
    /// that refuses our secret ends the call at once; the others' failures go onto `failed`.
    /// Dials that lose go on in their own tasks and leave their link for later calls.
    async fn race(&self, failed: &mut Vec<(usize, Error)>) -> Result<(usize, (Connection, bool))> {
        let order: Vec<usize> = self
            .order()
            .into_iter()
            .filter(|i| !failed.iter().any(|(f, _)| f == i))
            .collect();
        let connect =
            |i| async move { self.connection(i).await.map_err(failover::connect_failure) };
        match race::staggered(&order, STAGGER, failed, connect).await {
            Ok(won) => Ok(won),
            Err(Lost::Answered(i, e)) => {
                debug!(broker = %self.brokers[i].addr, %e, "broker refused the hello");
                Err(e)
            }
            Err(Lost::Exhausted) => Err(self.exhausted(std::mem::take(failed))),
        }
    }

    /// Makes broker `i` the one the next call starts with: it answered last.
    fn remember(&self, i: usize) {
        self.current.store(i, Ordering::Relaxed);
    }

    /// The error of a call that every broker failed: each broker named with its failure.
    fn exhausted(&self, failed: Vec<(usize, Error)>) -> Error {
        let failures = failed
            .into_iter()
            .map(|(i, error)| BrokerFailure {
                broker: short_addr(&self.brokers[i].addr),
                error,
            })
            .collect();
        failover::exhausted(failures)
    }

    /// One broker: on its open connection, or a fresh one if that turns out to be closed.
    async fn attempt(
        &self,
        i: usize,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>, Failure> {
        let (conn, fresh) = self.connection(i).await.map_err(Failure::Unusable)?;
        self.exchange_on(i, conn, fresh, request, timeout).await
    }

    /// One broker, for a hedged [`call`](Self::call): on its open connection, and if that has
    /// not answered within [`REDIAL_AFTER`], on a freshly dialed one beside it; the first
    /// answer wins. A broker killed and restarted at the same address answers the fresh link
    /// at once, while our cached link to its old life would go unanswered until QUIC's idle
    /// timeout (30 s): nothing told us it died.
    async fn attempt_redialing(
        &self,
        i: usize,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>, Failure> {
        let (conn, fresh) = self
            .connection(i)
            .await
            .map_err(failover::connect_failure)?;
        if fresh {
            return self.exchange_on(i, conn, true, request, timeout).await;
        }
        let cached = self.exchange_on(i, conn.clone(), false, request, timeout);
        tokio::pin!(cached);
        tokio::select! {
            answer = &mut cached => return answer,
            () = tokio::time::sleep(REDIAL_AFTER) => {}
        }
        debug!(broker = %self.brokers[i].addr, "no answer on the cached ctl link; dialing beside it");
        self.forget(i, &conn);
        let redial = async {
            let (conn, _) = self
                .connection(i)
                .await
                .map_err(failover::connect_failure)?;
            self.exchange_on(i, conn, true, request, timeout).await
        };
        tokio::pin!(redial);
        // The first answer wins; an unusable link waits for the other.
        tokio::select! {
            answer = &mut cached => match answer {
                Err(Failure::Unusable(_)) => redial.await,
                answer => answer,
            },
            answer = &mut redial => match answer {
                Err(Failure::Unusable(_)) => cached.await,
                answer => answer,
            },
        }
    }

    /// `request` on `conn`, a link to broker `i` (`fresh`: dialed just now); a cached link
    /// that turns out dead is dialed once more.
    async fn exchange_on(
        &self,
        i: usize,
        conn: Connection,
        fresh: bool,
        request: &CtlRequest,
        timeout: Duration,
    ) -> Result<Vec<CtlResponse>, Failure> {
        let max = self.max_tensor_bytes;
        match exchange(&conn, request, timeout, max).await {
            Err(Failure::Unusable(e)) => {
                let was_closed = conn.close_reason().is_some();
                self.discard(i, &conn);
                // A cached link may have died unnoticed (the broker restarted): dial once more.
                if fresh || !was_closed {
                    return Err(Failure::Unusable(e));
                }
                let (conn, _) = self.connection(i).await.map_err(Failure::Unusable)?;
                let again = exchange(&conn, request, timeout, max).await;
                if matches!(again, Err(Failure::Unusable(_))) {
                    self.discard(i, &conn);
                }
                again
            }
            other => other,
        }
    }

    /// The open connection to broker `i`, dialing (and saying hello) if there is none, or
    /// waiting for the dial under way; the flag says whether it was dialed just now.
    async fn connection(&self, i: usize) -> Result<(Connection, bool)> {
        let mut outcome = {
            let mut link = self.brokers[i].link();
            match &*link {
                Link::Ready(conn) if conn.close_reason().is_none() => {
                    return Ok((conn.clone(), false));
                }
                Link::Dialing(dial) => dial.outcome.clone(),
                Link::Idle | Link::Ready(_) => {
                    let dial = self.start_dial(i);
                    let outcome = dial.outcome.clone();
                    *link = Link::Dialing(dial);
                    outcome
                }
            }
        };
        // The dial is bounded by the connect timeout; the sender goes away (an error here)
        // only when the dial is cancelled.
        match outcome.wait_for(Option::is_some).await {
            Ok(done) => match &*done {
                Some(result) => result.clone().map(|conn| (conn, true)),
                None => Err(Error::Shutdown),
            },
            Err(_) => Err(Error::Shutdown),
        }
    }

    /// Starts dialing broker `i` in a task of its own, which installs the connection (or
    /// clears the state, on failure) and then tells the waiters.
    fn start_dial(&self, i: usize) -> Dial {
        let id = self.next_dial.fetch_add(1, Ordering::Relaxed);
        let (tell, outcome) = watch::channel(None);
        let cancel = self.cancel.child_token();
        let (broker, dialer, stop) = (self.brokers[i].clone(), self.dialer.clone(), cancel.clone());
        self.tracker.spawn(async move {
            let result = tokio::select! {
                _ = stop.cancelled() => return,
                result = dialer.dial(&broker.addr) => result,
            };
            let superseded = {
                let mut link = broker.link();
                let ours = matches!(&*link, Link::Dialing(d) if d.id == id);
                if ours {
                    *link = match &result {
                        Ok(conn) => Link::Ready(conn.clone()),
                        Err(_) => Link::Idle,
                    };
                }
                !ours
            };
            if let (true, Ok(conn)) = (superseded, &result) {
                // The client closed while this dial ran: nobody will use the connection.
                close_shutdown(conn);
            }
            tell.send_replace(Some(result));
        });
        Dial {
            id,
            outcome,
            cancel,
        }
    }

    /// Closes `conn`, a connection to broker `i` that failed a request, and drops it so the
    /// next call dials afresh. A link that let a request time out is taken for dead (it can
    /// stall without closing until the QUIC idle timeout), so everything on it, subscriptions
    /// included, fails over now rather than waiting on it.
    fn discard(&self, i: usize, conn: &Connection) {
        self.forget(i, conn);
        conn.close(CloseCode::Normal.code().into(), b"unresponsive");
    }

    /// Stops using `conn` for broker `i` (if it is still its link) without closing it: a
    /// request may still be waiting on it. The next call dials afresh.
    fn forget(&self, i: usize, conn: &Connection) {
        let mut link = self.brokers[i].link();
        if matches!(&*link, Link::Ready(c) if c.stable_id() == conn.stable_id()) {
            *link = Link::Idle;
        }
    }

    /// Closes every ctl connection and cancels every dial under way (at shutdown); the calls
    /// waiting for a dial fail with `Shutdown`.
    pub(crate) async fn close(&self) {
        for broker in &self.brokers {
            let old = std::mem::take(&mut *broker.link());
            match old {
                Link::Ready(conn) => close_shutdown(&conn),
                Link::Dialing(dial) => dial.cancel.cancel(),
                Link::Idle => {}
            }
        }
    }
}

impl Dialer {
    /// Dials `addr` on `tb/ctl/1` and runs the hello, both within the connect timeout.
    async fn dial(&self, addr: &PeerAddr) -> Result<Connection> {
        let timeout = self.timeout;
        let unreachable = |reason: String| Error::PeerUnreachable {
            peer: format!("broker {}", short_addr(addr)),
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
}

/// `addr` as messages name a broker: `<short id>@<ip:port>`.
pub(crate) fn short_addr(addr: &PeerAddr) -> String {
    format!("{}@{}", addr.id.fmt_short(), addr.addr)
}

fn close_shutdown(conn: &Connection) {
    conn.close(
        CloseCode::Shutdown.code().into(),
        CloseCode::Shutdown.reason(),
    );
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
        Ok(Err(e)) => return Err(e.into_error(&what).into()),
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
