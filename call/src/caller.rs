//! The calling half: choosing a server, one attempt on it, and retrying where that is safe.
//!
//! Servers come from a broker's `Servers` answer, cached per function for [`STALE`]; a
//! broker is asked again when the list is stale, empty after exclusions, or a server said it
//! no longer serves the function. Each call picks the less loaded of two random servers by
//! the load their last answers reported (power of two choices). A call is tried on another
//! server only when it never started there (refused `Busy` or `NotFound`, or the link failed
//! before the server accepted it), or when the function is declared idempotent.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::Semaphore;

use tb_node::{Node, PeerAddr, RequestRecv, RequestSend, RequestStream};
use tb_proto::{
    DataRequest, DataResponse, ErrorCode, TensorName,
    call::{CallFrame, CallHead, CallUp, LIVENESS_TIMEOUT_MS, Load, MAX_CREDIT},
};

use crate::{
    error::CallError,
    metrics::CallMetrics,
    value::{Encoded, Lender, Value, read_body},
};

/// How long a function's server list is trusted before a broker is asked again.
pub const STALE: Duration = Duration::from_secs(5);

/// Most servers one call is tried on.
const MAX_TRIES: usize = 4;

/// The longest a call's lent arguments wait for the server to pull them. A server pulls
/// them while the call waits for its slot, once the calls ahead of it have pulled theirs,
/// so a call may wait as long as those run; the caller drops the loans when the call ends,
/// so this only bounds a call without a deadline.
const ARGS_LOAN_TTL: Duration = Duration::from_secs(86_400);

/// Time a call's loans outlast its deadline: the loan's clock starts on the caller before
/// the server's deadline clock does, and the server ends the call on its deadline first.
const ARGS_LOAN_SLACK: Duration = Duration::from_secs(10);

/// How long a server that answered `Busy` is passed over while others are free.
const BUSY_BACKOFF: Duration = Duration::from_millis(50);

/// How a call is made.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Give up after this long (the server is told the time left and stops too).
    pub timeout: Option<Duration>,
    /// The call may run twice: retried on another server even after one was lost mid-call.
    pub idempotent: bool,
}

#[derive(Debug, Clone)]
struct Server {
    addr: PeerAddr,
    score: u64,
    busy_until: Option<Instant>,
}

#[derive(Debug)]
struct List {
    fetched: Instant,
    servers: Vec<Server>,
}

/// How long a server that failed to answer is passed over (longer than a broker takes to
/// count a killed node dead, so a refreshed list does not bring it straight back).
const SUSPECT_FOR: Duration = Duration::from_secs(15);

/// The cached server lists.
#[derive(Debug, Default)]
pub(crate) struct Directory {
    lists: Mutex<HashMap<TensorName, List>>,
    /// Servers that failed to answer, until when they are passed over (any function).
    suspects: Mutex<HashMap<iroh::EndpointId, Instant>>,
}

impl Directory {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TensorName, List>> {
        self.lists.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached list, unless stale.
    fn fresh(&self, function: &TensorName) -> Option<Vec<Server>> {
        let lists = self.lock();
        let list = lists.get(function)?;
        (list.fetched.elapsed() < STALE && !list.servers.is_empty()).then(|| list.servers.clone())
    }

    async fn servers(
        &self,
        node: &Node,
        function: &TensorName,
        refresh: bool,
    ) -> Result<Vec<Server>, CallError> {
        if !refresh && let Some(servers) = self.fresh(function) {
            return Ok(servers);
        }
        let addrs = node.servers(function).await?;
        let mut lists = self.lock();
        let old = lists.remove(function);
        let score_of = |addr: &PeerAddr| {
            old.as_ref()
                .and_then(|l| l.servers.iter().find(|s| s.addr.id == addr.id))
                .map_or(0, |s| s.score)
        };
        let servers: Vec<Server> = addrs
            .into_iter()
            .map(|addr| Server {
                score: score_of(&addr),
                addr,
                busy_until: None,
            })
            .collect();
        lists.insert(
            function.clone(),
            List {
                fetched: Instant::now(),
                servers: servers.clone(),
            },
        );
        Ok(servers)
    }

    fn update(&self, function: &TensorName, server: &PeerAddr, change: impl FnOnce(&mut Server)) {
        let mut lists = self.lock();
        if let Some(s) = lists
            .get_mut(function)
            .and_then(|l| l.servers.iter_mut().find(|s| s.addr.id == server.id))
        {
            change(s);
        }
    }

    fn loaded(&self, function: &TensorName, server: &PeerAddr, load: Load) {
        self.update(function, server, |s| {
            s.score = load.score();
            s.busy_until = None;
        });
    }

    fn busy(&self, function: &TensorName, server: &PeerAddr) {
        self.update(function, server, |s| {
            s.busy_until = Some(Instant::now() + BUSY_BACKOFF);
        });
    }

    /// Passes `server` over for [`SUSPECT_FOR`] (unless nothing else is left).
    fn suspect(&self, server: &PeerAddr) {
        let mut suspects = self.suspects.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        suspects.retain(|_, until| *until > now);
        suspects.insert(server.id, now + SUSPECT_FOR);
    }

    /// The servers suspected now.
    fn suspected(&self) -> Vec<iroh::EndpointId> {
        let suspects = self.suspects.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        suspects
            .iter()
            .filter(|(_, until)| **until > now)
            .map(|(id, _)| *id)
            .collect()
    }

    fn forget(&self, function: &TensorName, server: &PeerAddr) {
        let mut lists = self.lock();
        if let Some(list) = lists.get_mut(function) {
            list.servers.retain(|s| s.addr.id != server.id);
        }
    }
}

/// A number below `n` (0 when `n` is 0), from a per-thread xorshift generator seeded once
/// from the OS (a choice of servers needs no secret randomness, and a system call per pick
/// showed as two per call).
fn random_below(n: usize) -> usize {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let mut bytes = [0u8; 8];
            // Should the OS refuse randomness, a fixed odd seed still spreads the picks.
            let _ = getrandom::fill(&mut bytes);
            u64::from_le_bytes(bytes) | 1
        });
    }
    let next = STATE.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    });
    (next % n.max(1) as u64) as usize
}

/// The less loaded of two random servers not in `tried`, free ones first, suspects last.
fn pick(servers: &[Server], tried: &[PeerAddr], suspects: &[iroh::EndpointId]) -> Option<PeerAddr> {
    let now = Instant::now();
    let untried: Vec<&Server> = servers
        .iter()
        .filter(|s| !tried.iter().any(|t| t.id == s.addr.id))
        .collect();
    let trusted: Vec<&Server> = untried
        .iter()
        .copied()
        .filter(|s| !suspects.contains(&s.addr.id))
        .collect();
    let left = if trusted.is_empty() { untried } else { trusted };
    let free: Vec<&Server> = left
        .iter()
        .copied()
        .filter(|s| s.busy_until.is_none_or(|until| until <= now))
        .collect();
    let pool = if free.is_empty() { left } else { free };
    match pool.len() {
        0 => None,
        1 => Some(pool[0].addr.clone()),
        n => {
            let a = random_below(n);
            let b = (a + 1 + random_below(n - 1)) % n;
            let best = if pool[a].score <= pool[b].score { a } else { b };
            Some(pool[best].addr.clone())
        }
    }
}

/// What one attempt's first answer says.
pub(crate) struct Started {
    pub(crate) stream: RequestStream,
    pub(crate) server: PeerAddr,
    /// What the server declared: the function may run twice.
    pub(crate) idempotent: bool,
    /// What the server declared: the stream restarts from any item.
    pub(crate) resumable: bool,
    /// What the server declared: the function takes a stream of inputs.
    pub(crate) takes_inputs: bool,
    /// The arguments lent to the server (it pulls them before the handler runs): held until
    /// the call ends.
    pub(crate) _loans: Vec<tb_node::Lent>,
}

/// Reads the end of a finished call's stream when it has already arrived (it comes with the
/// server's `Done`). A stream dropped unread to its end is stopped, which costs a packet to
/// the server, and a wake-up of its process, per call.
pub(crate) fn read_end(started: &mut Started) {
    use futures_util::FutureExt;
    let mut byte = [0u8; 1];
    let _ = started.stream.recv.read(&mut byte).now_or_never();
}

/// What a server said of the function when it accepted a call.
pub(crate) struct Declared {
    idempotent: bool,
    resumable: bool,
    inputs: bool,
}

/// The caller's state shared by every call through one [`Calls`](crate::Calls).
pub(crate) struct Caller {
    pub(crate) node: Node,
    pub(crate) directory: Directory,
    pub(crate) metrics: Arc<CallMetrics>,
}

impl Caller {
    /// Finds a server, sends the call, and hands back the stream once it is accepted (the
    /// arguments written). Tries other servers while the call never started.
    pub(crate) async fn start(
        &self,
        function: &TensorName,
        args: &Value,
        head: CallHead,
        tried: &mut Vec<PeerAddr>,
    ) -> Result<Started, CallError> {
        let mut refresh = false;
        let mut last = None;
        while tried.len() < MAX_TRIES {
            let servers = self
                .directory
                .servers(&self.node, function, refresh)
                .await?;
            let suspects = self.directory.suspected();
            let Some(server) = pick(&servers, tried, &suspects) else {
                if !refresh {
                    refresh = true;
                    continue;
                }
                break;
            };
            tried.push(server.clone());
            match self.attempt(function, &server, args, head).await {
                Ok((stream, declared, loans)) => {
                    return Ok(Started {
                        stream,
                        server,
                        idempotent: declared.idempotent,
                        resumable: declared.resumable,
                        takes_inputs: declared.inputs,
                        _loans: loans,
                    });
                }
                Err(e) if e.never_started() || matches!(e, CallError::NoServer { .. }) => {
                    if matches!(e, CallError::NoServer { .. }) {
                        self.directory.forget(function, &server);
                        refresh = true;
                    }
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| CallError::NoServer {
            function: function.to_string(),
        }))
    }

    /// One try on `server`, up to its acceptance (the arguments then written, their large
    /// tensors lent when the server is on this host: the loans are returned).
    async fn attempt(
        &self,
        function: &TensorName,
        server: &PeerAddr,
        args: &Value,
        mut head: CallHead,
    ) -> Result<(RequestStream, Declared, Vec<tb_node::Lent>), CallError> {
        let lost = |reason: String, maybe_ran| server_lost(function, server, maybe_ran, reason);
        let ttl = head.deadline_ms.map_or(ARGS_LOAN_TTL, |ms| {
            Duration::from_millis(ms)
                .saturating_add(ARGS_LOAN_SLACK)
                .min(ARGS_LOAN_TTL)
        });
        let mut lender = Lender::new(&self.node, server.id, ttl);
        let args = Encoded::lending(args, Some(&mut lender)).map_err(|e| CallError::BadValue {
            function: function.to_string(),
            detail: e.to_string(),
        })?;
        let sent_bytes = args.len() + lender.lent_bytes();
        let loans = std::mem::take(&mut lender.loans);
        head.body_len = args.len();
        let request = DataRequest::Call {
            function: function.clone(),
            head,
        };
        let parts = args.parts();
        let preamble: &[&[u8]] = if head.inline() { &parts } else { &[] };
        // A server answers at once (before reading arguments or queueing): one that says
        // nothing within the liveness timeout is lost, and the call never started there.
        let answer_within = Duration::from_millis(LIVENESS_TIMEOUT_MS);
        // A unary call with inline arguments sends nothing after them (the server watches
        // for the caller stopping its side, not for more frames): the stream's end rides in
        // the request's last packet.
        let sent_all = head.inline() && !head.stream;
        let opened = self
            .node
            .open_request(server, &request, preamble, sent_all, answer_within);
        let mut stream = match opened.await {
            Ok(stream) => stream,
            Err(tb_node::Error::Shutdown) => return Err(tb_node::Error::Shutdown.into()),
            Err(e) => {
                self.directory.suspect(server);
                return Err(lost(e.to_string(), false));
            }
        };
        self.metrics.stream("caller", stream.send.is_same_host());
        let declared = match std::mem::replace(&mut stream.answer, DataResponse::Ack) {
            DataResponse::Accepted {
                load,
                idempotent,
                resumable,
                inputs,
            } => {
                self.directory.loaded(function, server, load);
                Declared {
                    idempotent,
                    resumable,
                    inputs,
                }
            }
            DataResponse::Error { code, message } => {
                if code == ErrorCode::Busy {
                    self.directory.busy(function, server);
                }
                return Err(refusal(function, server, code, message));
            }
            other => return Err(lost(format!("unexpected answer {other:?}"), false)),
        };
        if !head.inline() {
            args.write(&mut stream.send)
                .await
                .map_err(|e| lost(e, true))?;
        }
        self.metrics.bytes("out", sent_bytes);
        if !head.stream && !sent_all {
            let _ = stream.send.finish().await;
        }
        Ok((stream, declared, loans))
    }

    /// Reads the next frame of a started call: an item's value (`Some`) or the end (`None`).
    pub(crate) async fn next_item(
        &self,
        function: &TensorName,
        started: &mut Started,
    ) -> Result<Option<(u64, Value)>, CallError> {
        let Started { stream, server, .. } = started;
        let heard = stream.heard();
        self.read_item(function, server, &heard, &mut stream.recv, None)
            .await
    }

    /// [`next_item`](Self::next_item) of a bidirectional call: while it waits, the caller's
    /// inputs go up as the server grants credit for them (`InputCredit` frames), and
    /// `InputEnd` once `feed` ends.
    pub(crate) async fn next_item_feeding(
        &self,
        function: &TensorName,
        started: &mut Started,
        feed: &mut InputFeed,
    ) -> Result<Option<(u64, Value)>, CallError> {
        let Started { stream, server, .. } = started;
        let heard = stream.heard();
        let RequestStream { send, recv, .. } = stream;
        let InputFeed {
            items,
            credit,
            ended,
            loans,
        } = feed;
        let read = self.read_item(function, server, &heard, recv, Some(credit));
        tokio::pin!(read);
        loop {
            tokio::select! {
                got = &mut read => return got,
                next = next_input(credit, items), if !*ended => match next {
                    Some(value) => {
                        self.write_input(function, server, send, &value, loans)
                            .await?
                    }
                    None => {
                        *ended = true;
                        self.write_up(function, server, send, &CallUp::InputEnd).await?;
                    }
                },
            }
        }
    }

    /// Sends one input of a bidirectional call (its large tensors lent to the server, which
    /// pulls them as it reads the input).
    async fn write_input(
        &self,
        function: &TensorName,
        server: &PeerAddr,
        send: &mut RequestSend,
        value: &Value,
        loans: &mut std::collections::VecDeque<tb_node::Lent>,
    ) -> Result<(), CallError> {
        let mut lender = Lender::new(&self.node, server.id, crate::server::RESULT_LOAN_TTL);
        let encoded =
            Encoded::lending(value, Some(&mut lender)).map_err(|e| CallError::BadValue {
                function: function.to_string(),
                detail: format!("an input: {e}"),
            })?;
        let up = CallUp::Input {
            body_len: encoded.len(),
        };
        let written = send.write_frame_then(&up, &encoded.parts()).await;
        written.map_err(|e| server_lost(function, server, true, e.to_string()))?;
        self.metrics
            .bytes("out", encoded.len() + lender.lent_bytes());
        while loans.front().is_some_and(tb_node::Lent::ended) {
            loans.pop_front();
        }
        loans.extend(std::mem::take(&mut lender.loans));
        Ok(())
    }

    /// Writes `up` on a call's stream.
    async fn write_up(
        &self,
        function: &TensorName,
        server: &PeerAddr,
        send: &mut RequestSend,
        up: &CallUp,
    ) -> Result<(), CallError> {
        send.write_frame(up)
            .await
            .map_err(|e| server_lost(function, server, true, e.to_string()))
    }

    /// Reads a call's frames up to its next item (`Some`) or its end (`None`), adding the
    /// input credit the server grants to `input_credit` (a bidirectional call).
    async fn read_item(
        &self,
        function: &TensorName,
        server: &PeerAddr,
        heard: &(dyn Fn() -> u64 + Sync),
        recv: &mut RequestRecv,
        input_credit: Option<&Semaphore>,
    ) -> Result<Option<(u64, Value)>, CallError> {
        let lost = |reason: String| server_lost(function, server, true, reason);
        let liveness = Duration::from_millis(LIVENESS_TIMEOUT_MS);
        // The server's frames for this call can wait behind other streams' bytes on a busy
        // link (many large results at once): silence here is tolerated while the link as a
        // whole receives bytes, and the server is lost only when the whole link is quiet.
        let frame = loop {
            let read = recv.read_frame();
            tokio::pin!(read);
            let mut seen = heard();
            let frame = loop {
                match tokio::time::timeout(liveness, &mut read).await {
                    Ok(frame) => break frame,
                    Err(_) if heard() != seen => seen = heard(),
                    Err(_) => {
                        return Err(lost(format!("no word from the server for {liveness:?}")));
                    }
                }
            };
            let frame = frame.map_err(|e| lost(e.into_error("the call's answer").to_string()))?;
            match frame {
                // `Alive` only says the server still works on the call.
                CallFrame::Alive => {}
                // Ignored by a caller with no inputs (it said `InputEnd` at once).
                CallFrame::InputCredit(n) => {
                    if let Some(credit) = input_credit {
                        credit.add_permits(n.min(MAX_CREDIT) as usize);
                    }
                }
                frame => break frame,
            }
        };
        let CallFrame::Item { index, body_len } = frame else {
            return self.ended(function, server, frame);
        };
        let max = self.node.config().max_tensor_bytes;
        if body_len > max {
            return Err(CallError::BadValue {
                function: function.to_string(),
                detail: format!("a result of {body_len} bytes is over this node's {max}"),
            });
        }
        let stall = crate::value::Stall {
            after: liveness,
            progress: Some(&heard),
        };
        let read_failed = |e| match e {
            crate::value::ReadError::Closed(reason) => lost(reason),
            crate::value::ReadError::Lent(reason) => lost(format!("a lent result: {reason}")),
            invalid => CallError::BadValue {
                function: function.to_string(),
                detail: invalid.to_string(),
            },
        };
        let body = read_body(recv, body_len, stall)
            .await
            .map_err(read_failed)?;
        let lent = body.lent_bytes();
        // Lent results are pulled from the server now (it holds them until then).
        let value = body
            .into_value(&self.node, server.id)
            .await
            .map_err(read_failed)?;
        self.metrics.bytes("in", body_len + lent);
        Ok(Some((index, value)))
    }

    /// What a call's last frame (`Done` or `Failed`) says.
    fn ended(
        &self,
        function: &TensorName,
        server: &PeerAddr,
        frame: CallFrame,
    ) -> Result<Option<(u64, Value)>, CallError> {
        match frame {
            CallFrame::Failed(failure) => {
                failure.validate().map_err(|e| CallError::BadValue {
                    function: function.to_string(),
                    detail: e.to_string(),
                })?;
                Err(CallError::Remote {
                    function: function.to_string(),
                    server: server.id.fmt_short().to_string(),
                    failure: Box::new(failure),
                })
            }
            CallFrame::Done { load } => {
                self.directory.loaded(function, server, load);
                Ok(None)
            }
            // Items, `Alive` and credit are read by `read_item` before it gets here.
            CallFrame::Item { .. } | CallFrame::Alive | CallFrame::InputCredit(_) => Ok(None),
        }
    }

    /// Grants the server `n` more items of a streaming call.
    pub(crate) async fn credit(
        &self,
        function: &TensorName,
        started: &mut Started,
        n: u32,
    ) -> Result<(), CallError> {
        self.up(function, started, &CallUp::Credit(n)).await
    }

    /// Writes `up` on a started call's stream.
    pub(crate) async fn up(
        &self,
        function: &TensorName,
        started: &mut Started,
        up: &CallUp,
    ) -> Result<(), CallError> {
        let Started { stream, server, .. } = started;
        self.write_up(function, server, &mut stream.send, up).await
    }
}

/// The inputs a bidirectional call sends, and the credit the server granted for them.
pub(crate) struct InputFeed {
    pub(crate) items: tokio::sync::mpsc::Receiver<Value>,
    pub(crate) credit: Semaphore,
    /// `InputEnd` was sent.
    pub(crate) ended: bool,
    /// The loans of inputs sent (the server pulls each as it reads the input): held until
    /// pulled or until the stream ends, when those the server never read end with it.
    pub(crate) loans: std::collections::VecDeque<tb_node::Lent>,
}

impl InputFeed {
    /// A feed of `items`, with no credit yet.
    pub(crate) fn new(items: tokio::sync::mpsc::Receiver<Value>) -> Self {
        InputFeed {
            items,
            credit: Semaphore::new(0),
            ended: false,
            loans: Default::default(),
        }
    }
}

/// The next input, once the server granted credit for it (cancel-safe: a credit taken is
/// given back unless an input came with it).
async fn next_input(
    credit: &Semaphore,
    items: &mut tokio::sync::mpsc::Receiver<Value>,
) -> Option<Value> {
    let permit = credit.acquire().await.ok()?;
    let item = items.recv().await;
    if item.is_some() {
        permit.forget();
    }
    item
}

/// The error a server's refusal of a call is (it never started there).
fn refusal(function: &TensorName, server: &PeerAddr, code: ErrorCode, detail: String) -> CallError {
    let function = function.to_string();
    match code {
        ErrorCode::Busy => CallError::Overloaded { function, detail },
        ErrorCode::NotFound | ErrorCode::Unsupported | ErrorCode::ShuttingDown => {
            CallError::NoServer { function }
        }
        ErrorCode::Unauthorized => CallError::Unauthorized { function, detail },
        ErrorCode::TooLarge => CallError::BadValue { function, detail },
        _ => server_lost(&function, server, false, format!("{code:?}: {detail}")),
    }
}

/// `server` was lost on a call of `function` (it may have run the call when `maybe_ran`).
fn server_lost(
    function: &(impl std::fmt::Display + ?Sized),
    server: &PeerAddr,
    maybe_ran: bool,
    reason: String,
) -> CallError {
    CallError::ServerLost {
        function: function.to_string(),
        server: server.id.fmt_short().to_string(),
        maybe_ran,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_picks_stay_below_their_bound_and_reach_every_value() {
        assert_eq!(random_below(0), 0);
        assert_eq!(random_below(1), 0);
        let mut seen = [0u32; 4];
        for _ in 0..1_000 {
            let i = random_below(4);
            assert!(i < 4);
            seen[i] += 1;
        }
        // Each value's chance of never showing in 1,000 draws is (3/4)^1000.
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }
}
