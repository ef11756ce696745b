//! tb-call: remote functions over tensors, served and called by name.
//!
//! A node serves functions under names ([`Calls::serve`]) and calls those of others
//! ([`Calls::call`], [`Calls::stream`]). It sits on tb-node's extension point for request
//! kinds: a [`Service`](tb_node::Service) for `RequestKind::Call` on the pooled data link,
//! and [`Node::open_request`](tb_node::Node::open_request) to send one, and loans
//! ([`Node::lend`](tb_node::Node::lend)) for large values to a peer on this host. The wire is
//! tb-proto's (`tb_proto::call`: golden bytes, limits, a fuzz target).
//!
//! The parts:
//! - [`value`]: what functions take and return ([`Value`]: numbers, strings, bytes, lists,
//!   maps and tensors; nothing that runs code), and how it is written and read;
//! - `server`: the table of served functions, their concurrency and queue limits, and the
//!   service that answers calls;
//! - `caller`: choosing a server (cached lists, the less loaded of two), one attempt, and
//!   the retry rule;
//! - [`metrics`]: calls by side and result, durations, in flight, bytes;
//! - [`pipeline`]: data-loading streams built in Rust ([`Pipeline`]): streaming calls,
//!   subscriptions or channels as sources; `map` (local or remote), `interleave`,
//!   `prefetch` and `batch` (one buffer per tensor position).
//!
//! How a call flows: the caller looks the function's servers up (a broker's `Servers`
//! answer, cached for [`caller::STALE`]), picks one, opens a stream to it
//! ([`Node::open_request`](tb_node::Node::open_request): a connection of the pair's
//! same-host socket when both run on one host, else a QUIC stream on the pooled link) and
//! sends `Call` with the deadline left and — when small — the arguments. The server refuses
//! (`Busy`, `NotFound`, `Unauthorized`) or accepts before reading any large argument; then
//! it runs the handler when a slot frees and sends the result items and `Done`. The caller
//! dropping the stream (a timeout, a cancel) cancels the call on the server.
//!
//! The largest tensors to a peer on this host do not go on the stream: when the pair's
//! channel is shm, each tensor of at least [`value::LEND_MIN`] (1 MiB) is lent to the peer
//! ([`Node::lend`](tb_node::Node::lend)) and the body names the loan; the reader pulls it over
//! the channel ([`Node::pull_lent`](tb_node::Node::pull_lent)), which passes the sender's
//! memfd (nothing on QUIC): up to 16 MiB unsealed, for the reader to copy out of into a
//! buffer of its own pool (so both sides recycle their buffers), larger ones sealed, mapped.
//! The server pulls lent arguments once it accepted the call, while the call waits for its
//! slot, at most `concurrency` waiting calls at a time (so a long queue of large calls holds
//! the arguments of those about to run); the caller pulls lent results as it reads them.
//!
//! A tensor in CUDA device memory ([`DeviceTensor`], [`Value::Device`]) is lent to a peer
//! on any host, unhashed ([`Node::lend_device`](tb_node::Node::lend_device)); the reader
//! pulls it onto its own device of the same ordinal
//! ([`Node::pull_lent_to`](tb_node::Node::pull_lent_to)): device to device by CUDA IPC on one
//! host, through staging (hashed by the lender first) between hosts, into host memory where
//! the reader has no such device.
//!
//! A bidirectional function ([`FunctionSpec::inputs`]) also takes a stream of inputs
//! ([`Calls::stream_inputs`], [`CallContext::inputs`]): the server grants input credit
//! (`InputCredit`, [`INPUT_WINDOW`](tb_proto::call::INPUT_WINDOW) at first and one per input
//! taken) and the caller sends `Input`s within it, then `InputEnd`.
//!
//! Where calls are advertised: a server marks the function's registry entry at its epoch
//! ([`Node::advertise`](tb_node::Node::advertise)); brokers answer with live members only,
//! so dead and restarted servers drop out without an unregister message. Brokers never see
//! arguments.

pub mod caller;
mod error;
pub mod metrics;
pub mod pipeline;
mod server;
pub mod value;

use std::{sync::Arc, time::Duration};

use tb_node::Node;
use tb_proto::{RequestKind, TensorName, call::CallHead};

pub use caller::CallOptions;
pub use error::CallError;
pub use pipeline::{Pipeline, PipelineError};
pub use server::{CallContext, FunctionSpec, Handler, HandlerResult, Inputs, Output};
pub use tb_proto::call::{FailureKind, Load, RemoteFailure};
pub use value::{DeviceTensor, HostTensor, Value};

use caller::{Caller, Directory, Started};
use metrics::CallMetrics;
use server::{CallService, Served, Table};
use value::Encoded;

/// Most servers a call (or a resumable stream) is started on before its error is returned.
const MAX_RETRIES: usize = 4;

/// How long an unserved function waits for its calls to end before it stops waiting.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Remote functions on one node: what it serves, and calls to what others serve. Cheap to
/// clone.
#[derive(Clone)]
pub struct Calls {
    inner: Arc<Inner>,
}

struct Inner {
    table: Arc<Table>,
    caller: Caller,
}

impl std::fmt::Debug for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calls")
            .field("serving", &self.inner.table.names())
            .finish()
    }
}

impl Calls {
    /// Serves calls on `node` (its `Call` requests) and makes calls from it. One per node:
    /// a second is refused with `InUse`.
    pub fn attach(node: &Node) -> Result<Calls, tb_node::Error> {
        let table = Arc::new(Table::default());
        let metrics = Arc::new(CallMetrics::new(node.metrics().registry()));
        let service = CallService {
            table: table.clone(),
            node: node.downgrade(),
            metrics: metrics.clone(),
        };
        node.add_service(RequestKind::Call, Arc::new(service))?;
        // Each heartbeat lists the functions served here with their call figures (the
        // brokers' dashboards and `tb ls --functions` show them).
        let served = Arc::downgrade(&table);
        let last = std::sync::Mutex::new(std::collections::HashMap::new());
        node.add_stats_hook(Arc::new(move |stats| {
            if let Some(table) = served.upgrade() {
                let mut last = last
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                stats.functions = table.stats(&mut last);
            }
        }));
        Ok(Calls {
            inner: Arc::new(Inner {
                table,
                caller: Caller {
                    node: node.clone(),
                    directory: Directory::default(),
                    metrics,
                },
            }),
        })
    }

    /// The node.
    pub fn node(&self) -> &Node {
        &self.inner.caller.node
    }

    /// The call metrics.
    pub fn metrics(&self) -> &CallMetrics {
        &self.inner.caller.metrics
    }

    /// Serves `handler` as `spec.name` and advertises it to the cluster (needs read-write
    /// access: brokers refuse a read-only node's advertisement). The handle unserves it when
    /// dropped, after its calls end; [`Serving::stop`] does the same and waits.
    pub async fn serve(
        &self,
        spec: FunctionSpec,
        handler: impl Handler,
    ) -> Result<Serving, tb_node::Error> {
        let name = spec.name.clone();
        let served = Arc::new(Served::new(spec, Arc::new(handler)));
        if !self.inner.table.add(served.clone()) {
            return Err(tb_node::Error::InUse(format!(
                "function \"{name}\" is served by this node already"
            )));
        }
        if let Err(e) = self.node().advertise(&name).await {
            self.inner.table.remove(&name);
            return Err(e);
        }
        Ok(Serving {
            calls: self.clone(),
            served: Some(served),
        })
    }

    /// The functions this node serves, in name order.
    pub fn serving(&self) -> Vec<TensorName> {
        self.inner.table.names()
    }

    /// Calls `function` with `args` and returns its result.
    pub async fn call(
        &self,
        function: &str,
        args: &Value,
        options: &CallOptions,
    ) -> Result<Value, CallError> {
        let function = TensorName::new(function).map_err(tb_node::Error::from)?;
        // Checked once here (each attempt encodes again, lending to its server).
        check(&function, args)?;
        let started = std::time::Instant::now();
        let caller = &self.inner.caller;
        caller.metrics.in_flight("caller", 1);
        let call = self.call_retrying(&function, args, options);
        let result = match options.timeout {
            Some(timeout) => tokio::time::timeout(timeout, call)
                .await
                .unwrap_or_else(|_| {
                    Err(CallError::Timeout {
                        function: function.to_string(),
                        timeout,
                    })
                }),
            None => call.await,
        };
        // The deadline is one: whichever side saw it pass first, the call timed out.
        let result = match (result, options.timeout) {
            (Err(CallError::Remote { failure, .. }), Some(timeout))
                if failure.kind == FailureKind::DeadlineExceeded =>
            {
                Err(CallError::Timeout {
                    function: function.to_string(),
                    timeout,
                })
            }
            (result, _) => result,
        };
        caller.metrics.in_flight("caller", -1);
        caller.metrics.called_in(started.elapsed());
        caller.metrics.ended("caller", result_label(&result));
        result
    }

    async fn call_retrying(
        &self,
        function: &TensorName,
        args: &Value,
        options: &CallOptions,
    ) -> Result<Value, CallError> {
        let caller = &self.inner.caller;
        let deadline = options.timeout.map(|t| tokio::time::Instant::now() + t);
        let mut tried = Vec::new();
        loop {
            let head = CallHead {
                deadline_ms: deadline.map(|d| {
                    d.saturating_duration_since(tokio::time::Instant::now())
                        .as_millis() as u64
                }),
                // Set by each attempt, which encodes the arguments for its server.
                body_len: 0,
                stream: false,
                start: 0,
            };
            let mut started = caller.start(function, args, head, &mut tried).await?;
            let idempotent = options.idempotent || started.idempotent;
            let result = async {
                let (_, value) =
                    caller
                        .next_item(function, &mut started)
                        .await?
                        .ok_or_else(|| CallError::BadValue {
                            function: function.to_string(),
                            detail: "the server ended the call without a result".into(),
                        })?;
                // `Done` (or a late failure) follows the one result.
                caller.next_item(function, &mut started).await?;
                caller::read_end(&mut started);
                Ok(value)
            }
            .await;
            match result {
                Err(CallError::ServerLost { .. }) if idempotent && tried.len() < MAX_RETRIES => {
                    continue;
                }
                other => return other,
            }
        }
    }

    /// Calls streaming `function` with `args`: the returned stream yields its items, with at
    /// most `prefetch` (at least 1) requested ahead of what was taken.
    pub async fn stream(
        &self,
        function: &str,
        args: &Value,
        prefetch: u32,
    ) -> Result<CallStream, CallError> {
        self.stream_with(function, args, prefetch, None).await
    }

    /// Calls bidirectional `function` (served with [`FunctionSpec::inputs`]) with `args` and
    /// the values `inputs` yields: its handler takes them in order
    /// ([`CallContext::inputs`]) and the returned stream yields its results. Inputs go up
    /// as the server asks for them (at most [`INPUT_WINDOW`](tb_proto::call::INPUT_WINDOW)
    /// waiting there) and only while the stream is read; the inputs end when `inputs` does.
    /// A bidirectional call is not resumed on another server (its inputs were taken).
    pub async fn stream_inputs(
        &self,
        function: &str,
        args: &Value,
        inputs: tokio::sync::mpsc::Receiver<Value>,
        prefetch: u32,
    ) -> Result<CallStream, CallError> {
        let feed = caller::InputFeed::new(inputs);
        self.stream_with(function, args, prefetch, Some(feed)).await
    }

    async fn stream_with(
        &self,
        function: &str,
        args: &Value,
        prefetch: u32,
        inputs: Option<caller::InputFeed>,
    ) -> Result<CallStream, CallError> {
        let function = TensorName::new(function).map_err(tb_node::Error::from)?;
        check(&function, args)?;
        let head = CallHead {
            deadline_ms: None,
            // Set by each attempt, which encodes the arguments for its server.
            body_len: 0,
            stream: true,
            start: 0,
        };
        let mut stream = CallStream {
            calls: self.clone(),
            function,
            started: None,
            args: args.clone(),
            head,
            prefetch: prefetch.max(1),
            owed: 0,
            next: 0,
            tried: Vec::new(),
            inputs,
        };
        stream.begin().await?;
        Ok(stream)
    }
}

/// Why the wire cannot carry `args`, if it cannot (checked once per call, without copying a
/// byte: each attempt encodes them for its server).
fn check(function: &TensorName, args: &Value) -> Result<(), CallError> {
    Encoded::check(args).map_err(|e| CallError::BadValue {
        function: function.to_string(),
        detail: e.to_string(),
    })
}

fn result_label(result: &Result<Value, CallError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(CallError::Remote { .. }) => "error",
        Err(CallError::Overloaded { .. }) => "overloaded",
        Err(CallError::Timeout { .. }) => "timeout",
        Err(CallError::ServerLost { .. }) => "lost",
        Err(_) => "failed",
    }
}

/// The items of a streaming call, taken one at a time ([`CallStream::next`]). Dropping it
/// cancels the call on its server.
pub struct CallStream {
    calls: Calls,
    function: TensorName,
    started: Option<Started>,
    /// What a restart sends again.
    args: Value,
    head: CallHead,
    prefetch: u32,
    /// Items taken and not yet granted back as credit: granted in one frame once they reach
    /// half the prefetch (so a large prefetch costs a frame per half window, not per item).
    /// The server is never starved: while fewer are owed, it still holds `prefetch - owed`.
    owed: u32,
    /// The index of the next item to yield.
    next: u64,
    /// Servers the stream was started on.
    tried: Vec<tb_node::PeerAddr>,
    /// A bidirectional call's inputs (`None`: the call sends none, and says so at once).
    inputs: Option<caller::InputFeed>,
}

impl std::fmt::Debug for CallStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallStream")
            .field("function", &self.function)
            .field("ended", &self.started.is_none())
            .finish()
    }
}

impl CallStream {
    /// Starts (or restarts, from item `self.next`) the call on a server not tried yet.
    async fn begin(&mut self) -> Result<(), CallError> {
        let caller = &self.calls.inner.caller;
        let head = CallHead {
            start: self.next,
            ..self.head
        };
        let mut started = caller
            .start(&self.function, &self.args, head, &mut self.tried)
            .await?;
        caller
            .credit(&self.function, &mut started, self.prefetch)
            .await?;
        self.owed = 0;
        if self.inputs.is_some() && !started.takes_inputs {
            // Dropping the started call cancels it on the server.
            return Err(CallError::BadValue {
                function: self.function.to_string(),
                detail: "it takes no inputs: call it with stream(), not stream_inputs()".into(),
            });
        }
        // A call without inputs says so: a bidirectional function called this way sees its
        // inputs end at once.
        if self.inputs.is_none() {
            let end = tb_proto::call::CallUp::InputEnd;
            caller.up(&self.function, &mut started, &end).await?;
        }
        self.started = Some(started);
        Ok(())
    }

    /// The next item, `None` once the stream ended. When the server is lost mid-stream and
    /// declared the function resumable, the call starts again on another server from the
    /// next item's index (no item is lost or repeated if production is deterministic).
    pub async fn next(&mut self) -> Option<Result<Value, CallError>> {
        loop {
            let started = self.started.as_mut()?;
            let caller = &self.calls.inner.caller;
            let item = match &mut self.inputs {
                None => caller.next_item(&self.function, started).await,
                Some(feed) => {
                    let next = caller.next_item_feeding(&self.function, started, feed);
                    next.await
                }
            };
            // Inputs taken by a lost server cannot be sent again: no resuming then.
            let resumable = started.resumable && self.inputs.is_none();
            match item {
                Err(CallError::ServerLost { .. })
                    if resumable && self.tried.len() < MAX_RETRIES =>
                {
                    self.started = None;
                    tracing::debug!(function = %self.function, next = self.next, "stream server lost: resuming elsewhere");
                    if let Err(e) = self.begin().await {
                        return Some(Err(e));
                    }
                }
                other => return self.took(other).await,
            }
        }
    }

    async fn took(
        &mut self,
        item: Result<Option<(u64, Value)>, CallError>,
    ) -> Option<Result<Value, CallError>> {
        let caller = &self.calls.inner.caller;
        let started = self.started.as_mut()?;
        match item {
            Ok(Some((index, value))) => {
                self.next = index + 1;
                self.owed += 1;
                if self.owed >= self.prefetch.div_ceil(2) {
                    // A server that sent its last item stops reading credit: what the stream
                    // says next (the end, or a loss) is read from it, not from this write.
                    let _ = caller.credit(&self.function, started, self.owed).await;
                    self.owed = 0;
                }
                Some(Ok(value))
            }
            // The server ended the call (its `Done` or `Failed` came): this side ends too, so
            // a same-host connection goes back to its pool (the server waits for this end).
            // Taken out first: a `next` cancelled during the write leaves the stream ended.
            Ok(None) => {
                if let Some(mut ended) = self.started.take() {
                    let _ = ended.stream.send.finish().await;
                }
                None
            }
            Err(e) => {
                let ended = self.started.take();
                if let (Some(mut ended), CallError::Remote { .. }) = (ended, &e) {
                    let _ = ended.stream.send.finish().await;
                }
                Some(Err(e))
            }
        }
    }
}

/// A function being served; dropping it unserves the function once its calls end.
pub struct Serving {
    calls: Calls,
    served: Option<Arc<Served>>,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.served.as_ref().map(|s| s.spec.name.to_string());
        f.debug_struct("Serving").field("function", &name).finish()
    }
}

impl Serving {
    /// The function's name.
    pub fn name(&self) -> Option<&TensorName> {
        self.served.as_ref().map(|s| &s.spec.name)
    }

    /// Calls running or queued now.
    pub fn outstanding(&self) -> u32 {
        self.served.as_ref().map_or(0, |s| s.outstanding())
    }

    /// Unserves the function: withdraws it from the cluster, refuses new calls (callers try
    /// another server), and waits for those admitted to end (at most [`DRAIN_TIMEOUT`]).
    pub async fn stop(mut self) {
        if let Some(served) = self.served.take() {
            drain(self.calls.clone(), served).await;
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let Some(served) = self.served.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(drain(self.calls.clone(), served));
            }
            // Dropped outside the runtime (a Python object collected): no drain can be
            // awaited here, so new calls are refused and the function leaves the table at
            // once; its broker mark lapses with this node's epoch.
            Err(_) => {
                served.closing.cancel();
                self.calls.inner.table.remove(&served.spec.name);
            }
        }
    }
}

async fn drain(calls: Calls, served: Arc<Served>) {
    let name = served.spec.name.clone();
    served.closing.cancel();
    if let Err(e) = calls.node().withdraw(&name).await {
        tracing::debug!(%name, %e, "withdrawing a function failed (its mark lapses with this node)");
    }
    let until = tokio::time::Instant::now() + DRAIN_TIMEOUT;
    while served.outstanding() > 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    calls.inner.table.remove(&name);
}
