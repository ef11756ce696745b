//! The serving half: a table of functions by name, and the [`Service`] that answers
//! `Call` requests on the node's data links with it.
//!
//! Per call, in order: the function is looked up (`NotFound`), the caller's access checked
//! (`Unauthorized`: read-only callers, unless the function admits them), and a place taken
//! within the function's concurrency plus queue (`Busy` beyond it) — all before any
//! argument byte is read, so an overloaded server is sent nothing large. Then `Accepted`
//! with the load, the arguments, a slot (queued calls wait), the handler, and its results.
//! Arguments lent by the caller or passed by name are pulled while the call waits for its
//! slot, by at most `concurrency` waiting calls at once: a long queue of large calls holds
//! the bytes of the calls about to run, not of the whole queue.
//! The caller stopping its side of the stream (its deadline, a cancel, Ctrl-C) cancels the
//! call wherever it is: a queued call never runs, a running handler's future is dropped and
//! its [`CallContext`] says so to code that polls it (a Python sync handler).

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tb_node::{
    LocalStream, RequestRecv, RequestSend, ServeCtx, Service, ServiceFuture, ServiceStream,
};
use tb_proto::{
    Access, DataRequest, DataResponse, ErrorCode, FunctionStats, MAX_STATS_FUNCTIONS, TensorName,
    call::{
        ALIVE_INTERVAL_MS, CallFrame, CallHead, CallUp, FailureKind, INPUT_WINDOW, Load,
        MAX_CREDIT, RemoteFailure,
    },
};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::value::{Encoded, Lender, Value, read_body};

/// The longest a result lent to its caller waits to be pulled (the caller pulls it as it
/// reads the result; a caller gone meanwhile leaves it to end here).
pub const RESULT_LOAN_TTL: Duration = Duration::from_secs(30);

/// The longest a stream item lent to its caller waits to be pulled: the caller pulls it when
/// its consumer gets to it, up to a prefetch later. The call holds the loans and drops those
/// not pulled when it ends (but for the last items of a stream that ended well).
pub const STREAM_LOAN_TTL: Duration = Duration::from_secs(600);

/// How long a streaming call's server waits, after its last frame, for the caller to end
/// its side on a same-host connection (it does once it reads that frame), so that the
/// connection is served again instead of closed under the caller's pool.
const CALLER_END_WAIT: Duration = Duration::from_secs(1);

/// The most a streaming call's caller may still send after the server's last frame (credit
/// and inputs it sent before it read that frame) for the connection to be kept.
const CALLER_END_MAX: usize = 1 << 20;

/// What a handler's call ends with: a value, or a failure the caller gets as a remote error.
pub type HandlerResult = Result<Value, RemoteFailure>;

/// What a handler returns for one call.
pub enum Output {
    /// One result (a unary function).
    Unary(Pin<Box<dyn Future<Output = HandlerResult> + Send>>),
    /// A stream of results, ended by the sender's drop. The server takes an item from it
    /// only when the caller has credit for one, so a producer feeding a bounded channel runs
    /// at most the channel's capacity ahead of the caller's prefetch.
    Stream(mpsc::Receiver<HandlerResult>),
}

/// What a call's handler knows about it.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The caller's node.
    pub caller: iroh::EndpointId,
    /// The item index a resumed stream starts from.
    pub start: u64,
    /// Cancelled when the caller stops waiting, the deadline passes or the server stops.
    pub cancel: CancellationToken,
    /// The caller's inputs, in order, for a function that takes them
    /// ([`FunctionSpec::inputs`]); ended at once for any other.
    pub inputs: Inputs,
}

/// The inputs of a bidirectional call, in the order the caller sent them. The server holds
/// at most [`INPUT_WINDOW`] that the handler has not taken: the caller sends the next only
/// as the handler takes one, so a slow handler holds memory flat on both sides.
#[derive(Clone, Default)]
pub struct Inputs(Option<Arc<tokio::sync::Mutex<InputsInner>>>);

struct InputsInner {
    items: mpsc::Receiver<Value>,
    /// Told of each input taken (the server grants the caller one more).
    taken: mpsc::UnboundedSender<()>,
}

impl std::fmt::Debug for Inputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inputs")
            .field("bidirectional", &self.0.is_some())
            .finish()
    }
}

impl Inputs {
    /// The next input, `None` once the caller said there are no more (or the call ended).
    pub async fn next(&self) -> Option<Value> {
        let inner = self.0.as_ref()?;
        let mut inner = inner.lock().await;
        let item = inner.items.recv().await;
        if item.is_some() {
            let _ = inner.taken.send(());
        }
        item
    }

    /// The next input without waiting for it to arrive, from a thread that may block (a sync
    /// handler's): `None` once they ended.
    pub fn blocking_next(&self) -> Option<Value> {
        let inner = self.0.as_ref()?;
        let mut inner = inner.blocking_lock();
        let item = inner.items.blocking_recv();
        if item.is_some() {
            let _ = inner.taken.send(());
        }
        item
    }
}

/// A function's code.
pub trait Handler: Send + Sync + 'static {
    /// Starts one call with `args`.
    fn call(&self, args: Value, cx: CallContext) -> Output;
}

impl<F> Handler for F
where
    F: Fn(Value, CallContext) -> Output + Send + Sync + 'static,
{
    fn call(&self, args: Value, cx: CallContext) -> Output {
        self(args, cx)
    }
}

/// How a function is served.
#[derive(Debug, Clone)]
pub struct FunctionSpec {
    /// Its name.
    pub name: TensorName,
    /// Calls running at once.
    pub concurrency: u32,
    /// Calls waiting for a slot beyond those; further calls are refused `Busy`.
    pub queue: u32,
    /// Whether read-only callers may call it (a pure function on a read-only inference node's
    /// path); read-write callers only otherwise.
    pub read_only_callers: bool,
    /// Whether a call may run twice (callers then retry it elsewhere after a lost server).
    pub idempotent: bool,
    /// Whether a streaming function restarts from any item index ([`CallContext::start`]):
    /// callers that lose its server mid-stream start it again elsewhere from the next item.
    pub resumable: bool,
    /// Whether calls also stream inputs to the handler ([`CallContext::inputs`]): a
    /// bidirectional function, called with [`Calls::stream_inputs`](crate::Calls::stream_inputs),
    /// whose handler yields its results as it takes its inputs.
    pub inputs: bool,
}

impl FunctionSpec {
    /// A function called `name`, one call at a time, 64 queued, read-write callers only.
    pub fn new(name: &str) -> Result<Self, tb_proto::NameError> {
        Ok(FunctionSpec {
            name: TensorName::new(name)?,
            concurrency: 1,
            queue: 64,
            read_only_callers: false,
            idempotent: false,
            resumable: false,
            inputs: false,
        })
    }

    /// Taking a stream of inputs (a bidirectional function).
    pub fn inputs(mut self, yes: bool) -> Self {
        self.inputs = yes;
        self
    }

    /// With `n` calls running at once (at least 1).
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// With at most `n` calls waiting.
    pub fn queue(mut self, n: u32) -> Self {
        self.queue = n;
        self
    }
}

/// One served function.
pub(crate) struct Served {
    pub(crate) spec: FunctionSpec,
    handler: Arc<dyn Handler>,
    slots: Arc<Semaphore>,
    /// Queued calls that may hold their lent or named arguments' bytes while they wait
    /// (`concurrency` of them: one call ready behind each running one); the others wait for
    /// one of these before they pull, so a full queue of large calls holds no more than
    /// twice the concurrency's arguments in memory.
    staging: Arc<Semaphore>,
    running: AtomicU32,
    queued: AtomicU32,
    /// Calls admitted and ended (however they ended), and of those the ones that failed.
    ended: AtomicU64,
    failed: AtomicU64,
    /// When this node started serving it (the first heartbeat's rate counts from here).
    since: Instant,
    /// Cancelled when the function is being unserved: new calls are refused `NotFound`
    /// (callers try another server), those admitted already run to their end.
    pub(crate) closing: CancellationToken,
}

impl Served {
    pub(crate) fn new(spec: FunctionSpec, handler: Arc<dyn Handler>) -> Self {
        Served {
            slots: Arc::new(Semaphore::new(spec.concurrency as usize)),
            staging: Arc::new(Semaphore::new(spec.concurrency as usize)),
            spec,
            handler,
            running: AtomicU32::new(0),
            queued: AtomicU32::new(0),
            ended: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            since: Instant::now(),
            closing: CancellationToken::new(),
        }
    }

    pub(crate) fn load(&self) -> Load {
        Load {
            running: self.running.load(Ordering::Relaxed),
            queued: self.queued.load(Ordering::Relaxed),
            concurrency: self.spec.concurrency,
        }
    }

    /// Counts an admitted call's end.
    fn ended(&self, failed: bool) {
        self.ended.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Calls running or waiting now.
    pub(crate) fn outstanding(&self) -> u32 {
        let load = self.load();
        load.running + load.queued
    }

    /// Takes a place in the queue, or `None` when concurrency and queue are full.
    fn admit<'a>(&'a self, metrics: &'a crate::metrics::CallMetrics) -> Option<Place<'a>> {
        let limit = self.spec.concurrency.saturating_add(self.spec.queue);
        let taken = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                let running = self.running.load(Ordering::Acquire);
                (q + running < limit).then_some(q + 1)
            });
        taken.ok().map(|_| {
            metrics.queued(1);
            Place {
                served: self,
                running: false,
                metrics,
            }
        })
    }
}

/// A call's place: queued, then running; given back on drop.
struct Place<'a> {
    served: &'a Served,
    running: bool,
    /// Where the queue's depth is shown (`tb_call_queue_depth`).
    metrics: &'a crate::metrics::CallMetrics,
}

impl Place<'_> {
    fn start(&mut self) {
        self.served.queued.fetch_sub(1, Ordering::AcqRel);
        self.served.running.fetch_add(1, Ordering::AcqRel);
        self.metrics.queued(-1);
        self.running = true;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let counter = match self.running {
            true => &self.served.running,
            false => {
                self.metrics.queued(-1);
                &self.served.queued
            }
        };
        counter.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The functions a node serves, by name.
#[derive(Default)]
pub(crate) struct Table {
    functions: RwLock<HashMap<TensorName, Arc<Served>>>,
}

impl Table {
    pub(crate) fn get(&self, name: &TensorName) -> Option<Arc<Served>> {
        let table = self.functions.read().unwrap_or_else(|e| e.into_inner());
        table.get(name).cloned()
    }

    /// Adds `served`; false when the name is served already.
    pub(crate) fn add(&self, served: Arc<Served>) -> bool {
        let mut table = self.functions.write().unwrap_or_else(|e| e.into_inner());
        match table.contains_key(&served.spec.name) {
            true => false,
            false => {
                table.insert(served.spec.name.clone(), served);
                true
            }
        }
    }

    pub(crate) fn remove(&self, name: &TensorName) -> Option<Arc<Served>> {
        let mut table = self.functions.write().unwrap_or_else(|e| e.into_inner());
        table.remove(name)
    }

    pub(crate) fn names(&self) -> Vec<TensorName> {
        let table = self.functions.read().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<_> = table.keys().cloned().collect();
        names.sort();
        names
    }

    /// The heartbeat's figures of the first [`MAX_STATS_FUNCTIONS`] functions by name: each
    /// rate over the time since `last` saw it (or since it was served), `last` then updated
    /// to now (and cleared of functions no longer served).
    pub(crate) fn stats(
        &self,
        last: &mut HashMap<TensorName, (u64, Instant)>,
    ) -> Vec<FunctionStats> {
        let now = Instant::now();
        let mut served: Vec<_> = {
            let table = self.functions.read().unwrap_or_else(|e| e.into_inner());
            table.values().cloned().collect()
        };
        served.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        served.truncate(MAX_STATS_FUNCTIONS);
        last.retain(|name, _| served.iter().any(|s| &s.spec.name == name));
        served
            .iter()
            .map(|s| {
                let ended = s.ended.load(Ordering::Relaxed);
                let (before, at) = last.get(&s.spec.name).copied().unwrap_or((0, s.since));
                last.insert(s.spec.name.clone(), (ended, now));
                let secs = now.saturating_duration_since(at).as_secs_f64();
                let calls_per_s = match secs > 0.0 {
                    true => ended.saturating_sub(before) as f64 / secs,
                    false => 0.0,
                };
                FunctionStats {
                    name: s.spec.name.clone(),
                    calls_total: ended,
                    // Clamped: the two counters are read apart (heartbeats refuse more).
                    failed_total: s.failed.load(Ordering::Relaxed).min(ended),
                    calls_per_s,
                    in_flight: s.outstanding(),
                }
            })
            .collect()
    }
}

/// The `Call` request service.
pub(crate) struct CallService {
    pub(crate) table: Arc<Table>,
    /// The node, to get tensors passed by name (weak: the node owns this service).
    pub(crate) node: tb_node::WeakNode,
    pub(crate) metrics: Arc<crate::metrics::CallMetrics>,
}

impl Service for CallService {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        let ServiceStream {
            request,
            peer,
            access,
            send,
            recv,
            ..
        } = stream;
        let stream = LocalStream {
            request,
            peer,
            access,
            send: send.into(),
            recv: recv.into(),
        };
        Box::pin(self.serve_call(node, stream))
    }

    /// Calls from a caller on this host come on the pair's same-host socket: the same
    /// frames, a fraction of a QUIC round trip.
    fn serve_local<'a>(
        &'a self,
        node: &'a ServeCtx,
        stream: LocalStream,
    ) -> Result<ServiceFuture<'a>, Box<LocalStream>> {
        Ok(Box::pin(self.serve_call(node, stream)))
    }
}

/// Answers a refusal as the call's first answer.
async fn refuse(send: &mut RequestSend, code: ErrorCode, message: String, stall: Duration) {
    let refusal = DataResponse::Error { code, message };
    let _ = send.write_frame_and_finish(&refusal, stall).await;
}

impl CallService {
    async fn serve_call(&self, node: &ServeCtx, stream: LocalStream) {
        let LocalStream {
            request,
            peer,
            access,
            mut send,
            mut recv,
            ..
        } = stream;
        self.metrics.stream("server", send.is_same_host());
        let stall = node.stall_timeout();
        let DataRequest::Call { function, head } = request else {
            return refuse(&mut send, ErrorCode::Internal, "not a call".into(), stall).await;
        };
        if let Err(e) = head.validate(node.max_tensor_bytes()) {
            return refuse(&mut send, ErrorCode::TooLarge, e.to_string(), stall).await;
        }
        let Some(served) = self
            .table
            .get(&function)
            .filter(|s| !s.closing.is_cancelled())
        else {
            let message = format!("function \"{function}\" is not served by this node");
            return refuse(&mut send, ErrorCode::NotFound, message, stall).await;
        };
        if access == Access::ReadOnly && !served.spec.read_only_callers {
            let message = format!(
                "function \"{function}\" takes read-write callers only (this caller proved read-only access)"
            );
            self.metrics.ended("server", "refused");
            return refuse(&mut send, ErrorCode::Unauthorized, message, stall).await;
        }
        let Some(mut place) = served.admit(&self.metrics) else {
            let load = served.load();
            let message = format!(
                "function \"{function}\" is overloaded here: {} running, {} queued (concurrency {}, queue {})",
                load.running, load.queued, served.spec.concurrency, served.spec.queue
            );
            self.metrics.ended("server", "overloaded");
            return refuse(&mut send, ErrorCode::Busy, message, stall).await;
        };
        let accepted = DataResponse::Accepted {
            load: served.load(),
            idempotent: served.spec.idempotent,
            resumable: served.spec.resumable,
            inputs: served.spec.inputs,
        };
        if send.write_frame(&accepted).await.is_err() {
            return;
        }
        let started = std::time::Instant::now();
        self.metrics.in_flight("server", 1);
        // Cancelled when the call ends however it ends, this future's drop at node shutdown
        // included: a handler still running (a sync Python one) sees it.
        let cancel = CancellationToken::new();
        let _cancel_on_drop = cancel.clone().drop_guard();
        let deadline = head.deadline_ms.map(Duration::from_millis);
        let streaming = head.stream;
        let call = Call {
            node: &self.node,
            served: &served,
            stall: node.stall_timeout(),
            head,
            caller: peer,
            cancel: cancel.clone(),
            metrics: &self.metrics,
        };
        let run = call.run(&mut place, &mut send, &mut recv);
        let outcome = tokio::select! {
            outcome = run => outcome,
            () = node.stopping() => Outcome::Cancelled,
            () = sleep_or_never(deadline) => Outcome::Deadline,
        };
        cancel.cancel();
        drop(place);
        self.metrics.served_in(started.elapsed());
        self.metrics.in_flight("server", -1);
        let wrote_end = self
            .finish(node, &function, outcome, &mut send, &served)
            .await;
        // A unary call's caller ended its side with its arguments; a stream's ends its side
        // once it reads the last frame.
        if streaming && wrote_end && send.is_same_host() {
            tokio::select! {
                _ = recv.discard_to_end(CALLER_END_MAX, CALLER_END_WAIT) => {}
                () = node.stopping() => {}
            }
        }
    }

    /// Writes how a call ended, when the caller still listens: whether that last frame and
    /// the end of this side went out whole.
    async fn finish(
        &self,
        node: &ServeCtx,
        function: &TensorName,
        outcome: Outcome,
        send: &mut RequestSend,
        served: &Served,
    ) -> bool {
        let failure = match outcome {
            Outcome::Done => None,
            Outcome::Failed(f) => Some(f),
            Outcome::Deadline => Some(RemoteFailure::new(
                FailureKind::DeadlineExceeded,
                "TimeoutError",
                format!("function \"{function}\": the caller's deadline passed on the server"),
                "",
            )),
            Outcome::Cancelled | Outcome::Gone => {
                served.ended(false);
                self.metrics.ended("server", "cancelled");
                debug!(%function, "the caller stopped waiting: the call was cancelled");
                return false;
            }
        };
        served.ended(failure.is_some());
        let frame = match failure {
            None => {
                self.metrics.ended("server", "ok");
                CallFrame::Done {
                    load: served.load(),
                }
            }
            Some(failure) => {
                self.metrics.ended("server", "error");
                CallFrame::Failed(failure)
            }
        };
        send.write_frame_and_finish(&frame, node.stall_timeout())
            .await
            .is_ok()
    }
}

/// What a streaming call's wait ended with.
enum Wake {
    /// The caller sent something ([`Up`]), or its side ended (`None`).
    Up(Option<Up>),
    /// The handler took an input: one more may come.
    Taken,
    /// The handler's next item, or its end.
    Item(Option<HandlerResult>),
}

/// What the caller of a streaming call said.
enum Up {
    /// Credit for this many more items.
    Credit(u32),
    /// Its inputs broke the call's rules.
    Failed(RemoteFailure),
    /// Its side of the stream ended.
    Ended,
}

/// The next input taken, or never when the call takes none.
async fn next_taken(taken: &mut Option<mpsc::UnboundedReceiver<()>>) -> Option<()> {
    match taken {
        Some(taken) => taken.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_or_never(after: Option<Duration>) {
    match after {
        Some(after) => tokio::time::sleep(after).await,
        None => std::future::pending().await,
    }
}

/// How a call ended on the server.
enum Outcome {
    Done,
    Failed(RemoteFailure),
    Deadline,
    /// The caller stopped its side (cancel, timeout, Ctrl-C) or the server stopped.
    Cancelled,
    /// The stream failed under a write.
    Gone,
}

struct Call<'a> {
    node: &'a tb_node::WeakNode,
    served: &'a Served,
    stall: Duration,
    head: CallHead,
    caller: iroh::EndpointId,
    cancel: CancellationToken,
    metrics: &'a crate::metrics::CallMetrics,
}

impl Call<'_> {
    async fn run(
        self,
        place: &mut Place<'_>,
        send: &mut RequestSend,
        recv: &mut RequestRecv,
    ) -> Outcome {
        let stall = crate::value::Stall {
            after: self.stall,
            progress: None,
        };
        let body = match read_body(recv, self.head.body_len, stall).await {
            Ok(body) => body,
            Err(e) => {
                return Outcome::Failed(RemoteFailure::new(
                    FailureKind::BadArguments,
                    "ValueError",
                    format!("the arguments could not be read: {e}"),
                    "",
                ));
            }
        };
        self.metrics
            .bytes("in", self.head.body_len + body.lent_bytes());
        let Some(node) = self.node.upgrade() else {
            return Outcome::Cancelled;
        };
        // Lent arguments are pulled from the caller now, before the call waits for its slot,
        // by at most `concurrency` queued calls at once (the others wait their turn to pull).
        let staged = match body.pulls() {
            true => {
                let staging = self.served.staging.clone();
                match self.alive_while(send, staging.acquire_owned()).await {
                    Ok(Ok(permit)) => Some(permit),
                    Ok(Err(_)) => return Outcome::Cancelled,
                    Err(outcome) => return outcome,
                }
            }
            false => None,
        };
        let args = match self
            .alive_while(send, body.into_value(&node, self.caller))
            .await
        {
            Err(outcome) => return outcome,
            Ok(Ok(args)) => args,
            Ok(Err(e)) => {
                return Outcome::Failed(RemoteFailure::new(
                    FailureKind::BadArguments,
                    "ValueError",
                    format!("the arguments could not be read: {e}"),
                    "",
                ));
            }
        };
        let resolving = self.alive_while(send, crate::value::resolve(&node, args));
        let args = match resolving.await {
            Err(outcome) => return outcome,
            Ok(Ok(args)) => args,
            Ok(Err(e)) => {
                let remote_type = match e {
                    tb_node::Error::NotFound { .. } | tb_node::Error::NoHolder { .. } => {
                        "LookupError"
                    }
                    _ => "RuntimeError",
                };
                return Outcome::Failed(RemoteFailure::new(
                    FailureKind::BadArguments,
                    remote_type,
                    format!("a tensor passed by name could not be got: {e}"),
                    "",
                ));
            }
        };
        // Wait for a slot, unless the caller goes or the function is unserved meanwhile.
        let slots = self.served.slots.clone();
        let permit = match self.alive_while(send, slots.acquire_owned()).await {
            Ok(permit) => permit,
            Err(outcome) => {
                debug!("the caller stopped while the call was queued");
                return outcome;
            }
        };
        let Ok(_permit) = permit else {
            return Outcome::Cancelled;
        };
        drop(staged);
        place.start();
        // A bidirectional function's inputs, when called as a stream (ended at once otherwise).
        let (inputs, feed) = match self.served.spec.inputs && self.head.stream {
            true => {
                let (items, rx) = mpsc::channel(INPUT_WINDOW as usize);
                let (taken, taken_rx) = mpsc::unbounded_channel();
                let inner = InputsInner { items: rx, taken };
                let inputs = Inputs(Some(Arc::new(tokio::sync::Mutex::new(inner))));
                (inputs, Some((items, taken_rx)))
            }
            false => (Inputs::default(), None),
        };
        let cx = CallContext {
            caller: self.caller,
            start: self.head.start,
            cancel: self.cancel.clone(),
            inputs,
        };
        match self.served.handler.call(args, cx) {
            Output::Unary(fut) => {
                let result = match self.alive_while(send, fut).await {
                    Ok(result) => result,
                    Err(outcome) => return outcome,
                };
                match result {
                    Ok(value) => {
                        // The caller pulls them as it reads the result, right away.
                        let (outcome, loans) =
                            self.send_item(send, 0, &value, RESULT_LOAN_TTL).await;
                        loans.into_iter().for_each(tb_node::Lent::until_pulled);
                        outcome
                    }
                    Err(failure) => Outcome::Failed(failure),
                }
            }
            // Boxed: a stream's future (about 32 KB) would otherwise be part of every unary
            // call's too.
            Output::Stream(items) => Box::pin(self.stream(items, send, recv, feed)).await,
        }
    }

    /// Waits for `work`, telling the caller every [`ALIVE_INTERVAL_MS`] that the call lives;
    /// `Err` when the caller stopped its side (`Cancelled`) or a frame could not be sent.
    async fn alive_while<T>(
        &self,
        send: &mut RequestSend,
        work: impl Future<Output = T>,
    ) -> Result<T, Outcome> {
        let every = Duration::from_millis(ALIVE_INTERVAL_MS);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let stopped = send.stopped();
        tokio::pin!(work, stopped);
        loop {
            tokio::select! {
                out = &mut work => return Ok(out),
                _ = &mut stopped => return Err(Outcome::Cancelled),
                _ = tick.tick() => {
                    let alive = send.write_frame_within(&CallFrame::Alive, self.stall);
                    if alive.await.is_err() {
                        return Err(Outcome::Gone);
                    }
                }
            }
        }
    }

    /// Sends one result item; `Done` when it went out, with the loans of its large tensors
    /// (lent to a caller on this host for at most `ttl`, which it pulls as it reads the item):
    /// whoever gets them decides how long they live.
    async fn send_item(
        &self,
        send: &mut RequestSend,
        index: u64,
        value: &Value,
        ttl: Duration,
    ) -> (Outcome, Vec<tb_node::Lent>) {
        let node = self.node.upgrade();
        let mut lender = node
            .as_ref()
            .map(|node| Lender::new(node, self.caller, ttl));
        let encoded = match Encoded::lending(value, lender.as_mut()) {
            Ok(encoded) => encoded,
            Err(e) => {
                let failure = RemoteFailure::new(
                    FailureKind::Raised,
                    "ValueError",
                    format!("the handler returned a value the wire cannot carry: {e}"),
                    "",
                );
                return (Outcome::Failed(failure), Vec::new());
            }
        };
        let item = CallFrame::Item {
            index,
            body_len: encoded.len(),
        };
        if send
            .write_frame_then(&item, &encoded.parts())
            .await
            .is_err()
        {
            return (Outcome::Gone, Vec::new());
        }
        let lent = lender.as_ref().map_or(0, Lender::lent_bytes);
        self.metrics.bytes("out", encoded.len() + lent);
        (Outcome::Done, lender.map(|l| l.loans).unwrap_or_default())
    }

    /// Sends a stream's items as the caller grants credit, and (a bidirectional call, `feed`)
    /// hands the caller's inputs to the handler, granting one more input for each taken.
    async fn stream(
        &self,
        mut items: mpsc::Receiver<HandlerResult>,
        send: &mut RequestSend,
        recv: &mut RequestRecv,
        feed: Option<(mpsc::Sender<Value>, mpsc::UnboundedReceiver<()>)>,
    ) -> Outcome {
        let (inputs, mut taken) = match feed {
            Some((inputs, taken)) => (Some(inputs), Some(taken)),
            None => (None, None),
        };
        if taken.is_some() {
            let grant = CallFrame::InputCredit(INPUT_WINDOW);
            if send.write_frame_within(&grant, self.stall).await.is_err() {
                return Outcome::Gone;
            }
        }
        let (events, mut heard) = mpsc::unbounded_channel();
        // The reader runs for the whole call, writes included: a caller writing a large input
        // while this side writes a large item is always read (neither waits on the other).
        // Once it returns (its last event told), it waits forever; the call ends on that event.
        let reader = async {
            self.read_ups(recv, inputs, events).await;
            std::future::pending::<()>().await
        };
        // Items' loans: the caller pulls each as it reads the item, which may be a prefetch
        // behind; those of an item not pulled when the call ends are dropped, unless it ended
        // well (the caller still reads what was sent).
        let mut loans: std::collections::VecDeque<tb_node::Lent> = Default::default();
        let run = async {
            let mut credit: u64 = 0;
            let mut index = self.head.start;
            loop {
                let wait = async {
                    tokio::select! {
                        up = heard.recv() => Wake::Up(up),
                        Some(()) = next_taken(&mut taken) => Wake::Taken,
                        item = items.recv(), if credit > 0 => Wake::Item(item),
                    }
                };
                let wake = match self.alive_while(send, wait).await {
                    Ok(wake) => wake,
                    Err(outcome) => return outcome,
                };
                match wake {
                    Wake::Up(Some(Up::Credit(n))) => credit += u64::from(n.min(MAX_CREDIT)),
                    Wake::Up(Some(Up::Failed(failure))) => return Outcome::Failed(failure),
                    Wake::Up(Some(Up::Ended) | None) => return Outcome::Cancelled,
                    Wake::Taken => {
                        let grant = CallFrame::InputCredit(1);
                        if send.write_frame_within(&grant, self.stall).await.is_err() {
                            return Outcome::Gone;
                        }
                    }
                    Wake::Item(None) => return Outcome::Done,
                    Wake::Item(Some(Err(failure))) => return Outcome::Failed(failure),
                    Wake::Item(Some(Ok(value))) => {
                        let sent = self.send_item(send, index, &value, STREAM_LOAN_TTL).await;
                        let (outcome, lent) = sent;
                        if !matches!(outcome, Outcome::Done) {
                            return outcome;
                        }
                        while loans.front().is_some_and(tb_node::Lent::ended) {
                            loans.pop_front();
                        }
                        loans.extend(lent);
                        credit -= 1;
                        index += 1;
                    }
                }
            }
        };
        let outcome = tokio::select! {
            outcome = run => outcome,
            () = reader => Outcome::Cancelled,
        };
        if matches!(outcome, Outcome::Done) {
            loans.into_iter().for_each(tb_node::Lent::until_pulled);
        }
        outcome
    }

    /// Reads what the caller sends on a streaming call until its side ends (then returns):
    /// credit, told to `events`; inputs (a bidirectional call), read, their lent tensors
    /// pulled, and handed to the handler through `inputs` (dropped at `InputEnd`, which ends
    /// the handler's inputs); a failure (an input beyond the credit granted, an input to a
    /// function that takes none, a body that cannot be read), told to `events`.
    async fn read_ups(
        &self,
        recv: &mut RequestRecv,
        mut inputs: Option<mpsc::Sender<Value>>,
        events: mpsc::UnboundedSender<Up>,
    ) {
        let bad = |message: String| {
            let failure = RemoteFailure::new(FailureKind::BadArguments, "ValueError", message, "");
            let _ = events.send(Up::Failed(failure));
        };
        let node = self.node.upgrade();
        loop {
            let Ok(up) = recv.read_frame::<CallUp>().await else {
                let _ = events.send(Up::Ended);
                return;
            };
            let body_len = match up {
                CallUp::Credit(n) => {
                    let _ = events.send(Up::Credit(n));
                    continue;
                }
                CallUp::InputEnd => {
                    inputs = None;
                    continue;
                }
                CallUp::Input { body_len } => body_len,
            };
            let (Some(tx), Some(node)) = (&inputs, &node) else {
                return bad("this function takes no inputs (or they ended)".into());
            };
            let max = node.config().max_tensor_bytes;
            if body_len > max {
                return bad(format!(
                    "an input of {body_len} bytes is over this node's {max}"
                ));
            }
            let stall = crate::value::Stall {
                after: self.stall,
                progress: None,
            };
            let value = match read_body(recv, body_len, stall).await {
                Ok(body) => body.into_value(node, self.caller).await,
                Err(e) => Err(e),
            };
            let value = match value {
                Ok(value) => value,
                Err(e) => return bad(format!("an input could not be read: {e}")),
            };
            self.metrics.bytes("in", body_len);
            match tx.try_send(value) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    return bad("an input beyond the credit granted".into());
                }
                // The handler stopped taking inputs: the rest are dropped.
                Err(mpsc::error::TrySendError::Closed(_)) => {}
            }
        }
    }
}
