//! Remote functions in one process: a broker and worker nodes on loopback, serving and
//! calling by name. Results equal what the handler computed; a handler's error comes back
//! typed with its message; a server over its limits refuses before any large argument
//! moves; a caller's timeout cancels the handler on the server; read-only callers are
//! refused unless the function admits them; an unserved or dead server is not offered.
//! Every wait is bounded.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use tb_broker::{Broker, BrokerOptions};
use tb_call::{
    CallError, CallOptions, Calls, FailureKind, FunctionSpec, HostTensor, Output, RemoteFailure,
    Value,
};
use tb_node::{
    Config, Node,
    proto::{ChannelKind, ClusterKey, DType},
};
use tb_tests::{eventually_async, node, test_config, within};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"call tests share this secret, 32+ bytes long";

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

async fn broker(dir: &Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.node.cluster_key = key();
    opts.tick = Duration::from_millis(200);
    opts.state.liveness_timeout_ms = 2_000;
    within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

fn worker(broker: &Broker) -> Config {
    Config {
        brokers: vec![broker.addr().clone()],
        cluster_key: key(),
        heartbeat_interval: Duration::from_millis(300),
        channels: vec![ChannelKind::Quic],
        ..test_config()
    }
}

async fn calls(config: Config) -> (Node, Calls) {
    let node = node(config).await;
    let calls = Calls::attach(&node).expect("attach");
    (node, calls)
}

fn f32s(values: &[f32]) -> Value {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Value::Tensor(HostTensor::new(DType::F32, vec![values.len() as u64], bytes).expect("tensor"))
}

fn floats(value: &Value) -> Vec<f32> {
    let tensor = value.as_tensor().expect("a tensor");
    tensor
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// `x + 1` for an f32 tensor; a `ValueError` for anything else.
fn add_one(args: Value, _cx: tb_call::CallContext) -> Output {
    Output::Unary(Box::pin(async move {
        match &args {
            Value::Tensor(t) if t.dtype == DType::F32 => {
                let plus: Vec<f32> = floats(&args).iter().map(|v| v + 1.0).collect();
                let mut out = f32s(&plus);
                if let Value::Tensor(o) = &mut out {
                    o.shape = t.shape.clone();
                }
                Ok(out)
            }
            other => Err(RemoteFailure::new(
                FailureKind::Raised,
                "ValueError",
                format!("add_one takes an f32 tensor, not {other:?}"),
                "in add_one",
            )),
        }
    }))
}

async fn call(calls: &Calls, name: &str, args: &Value) -> Result<Value, CallError> {
    let options = CallOptions {
        timeout: Some(Duration::from_secs(20)),
        idempotent: false,
    };
    within(LIMIT, "call", calls.call(name, args, &options)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_function_is_called_by_name_and_its_errors_come_back_typed() {
    called_by_name(false).await;
}

/// The same between two nodes of one host: every call goes on the pair's same-host socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_served_on_this_host_is_called_over_the_same_host_socket() {
    called_by_name(true).await;
}

/// A worker's config: the default channels (`same_host`: shm between two nodes here), or
/// QUIC only; and the channel its calls take, then the other.
fn pair(broker: &Broker, same_host: bool) -> (Config, [&'static str; 2]) {
    match same_host {
        true => (same_host_worker(broker), ["shm", "quic"]),
        false => (worker(broker), ["quic", "shm"]),
    }
}

async fn called_by_name(same_host: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (config, [taken, not]) = pair(&broker, same_host);
    let (_server_node, server) = calls(config.clone()).await;
    let (_caller_node, caller) = calls(config).await;
    let spec = FunctionSpec::new("math/add_one")
        .expect("name")
        .concurrency(4);
    let _serving = within(LIMIT, "serve", server.serve(spec, add_one))
        .await
        .expect("serves");

    let args = f32s(&[1.0, 2.5, -3.0]);
    let result = call(&caller, "math/add_one", &args)
        .await
        .expect("the call");
    assert_eq!(floats(&result), vec![2.0, 3.5, -2.0]);

    // A larger argument than goes inline (pulled once accepted): 4 MiB.
    let big: Vec<f32> = (0..(1 << 20)).map(|i| i as f32).collect();
    let result = call(&caller, "math/add_one", &f32s(&big))
        .await
        .expect("a 4 MiB call");
    let want: Vec<f32> = big.iter().map(|v| v + 1.0).collect();
    assert!(floats(&result) == want, "4 MiB result differs");

    // The handler's own error: its type, message and traceback, and the server.
    let err = call(&caller, "math/add_one", &Value::Str("x".into()))
        .await
        .expect_err("a str is refused");
    match err {
        CallError::Remote { failure, .. } => {
            assert_eq!(failure.kind, FailureKind::Raised);
            assert_eq!(failure.remote_type, "ValueError");
            assert!(
                failure.message.contains("takes an f32 tensor"),
                "{failure:?}"
            );
            assert_eq!(failure.traceback, "in add_one");
        }
        other => panic!("expected a remote error, got {other:?}"),
    }

    // Nobody serves this one.
    let err = call(&caller, "math/nothing", &args)
        .await
        .expect_err("no server");
    assert!(matches!(err, CallError::NoServer { .. }), "{err:?}");

    // The broker lists the function with its one server.
    let listed = caller.node().functions("math/").await.expect("functions");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0].0.as_str(), listed[0].1), ("math/add_one", 1));

    // The server's heartbeats report the function's calls: 3 ended, 1 of them failed, none
    // in flight, and a rate (calls since it was served, over the time since).
    let server_id = _server_node.id();
    let figures = || async {
        let view = caller.node().members_with_stats().await.ok()?;
        let row = view
            .members
            .into_iter()
            .find(|m| m.member.node.0 == *server_id.as_bytes())?;
        let stats = row.heartbeat?.stats;
        stats
            .functions
            .into_iter()
            .find(|f| f.name.as_str() == "math/add_one")
    };
    let reported = eventually_async(LIMIT, || async {
        figures().await.is_some_and(|f| f.calls_total == 3)
    })
    .await;
    let f = figures().await.expect("the function's figures");
    assert!(reported, "{f:?}");
    assert_eq!(
        (f.calls_total, f.failed_total, f.in_flight),
        (3, 1, 0),
        "{f:?}"
    );
    assert!(f.calls_per_s.is_finite() && f.calls_per_s >= 0.0, "{f:?}");

    // Every call's stream took the pair's channel, on both sides.
    for (calls, side) in [(&caller, "caller"), (&server, "server")] {
        assert_eq!(calls.metrics().streams(side, taken), 3, "{side} on {taken}");
        assert_eq!(calls.metrics().streams(side, not), 0, "{side} on {not}");
    }
}

/// Holds every call until `gate` is released.
fn gated(gate: Arc<tokio::sync::Semaphore>, ran: Arc<AtomicU32>) -> impl tb_call::Handler {
    move |args: Value, cx: tb_call::CallContext| {
        let (gate, ran) = (gate.clone(), ran.clone());
        Output::Unary(Box::pin(async move {
            ran.fetch_add(1, Ordering::SeqCst);
            tokio::select! {
                _ = gate.acquire() => Ok(args),
                () = cx.cancel.cancelled() => Err(RemoteFailure::new(FailureKind::Stopped, "Cancelled", "", "")),
            }
        }))
    }
}

/// `slow` served by `server` with one slot and `queue` waiting places, its handler [`gated`]:
/// the serving handle, the gate and the count of handlers run.
async fn serve_gated(
    server: &Calls,
    queue: u32,
) -> (
    tb_call::Serving,
    Arc<tokio::sync::Semaphore>,
    Arc<AtomicU32>,
) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let ran = Arc::new(AtomicU32::new(0));
    let spec = FunctionSpec::new("slow")
        .expect("name")
        .concurrency(1)
        .queue(queue);
    let serving = within(
        LIMIT,
        "serve",
        server.serve(spec, gated(gate.clone(), ran.clone())),
    )
    .await
    .expect("serves");
    (serving, gate, ran)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_server_refuses_before_a_large_argument_moves_and_a_timeout_cancels_the_handler() {
    busy_then_cancelled(false).await;
}

/// The same on a same-host pair's socket: a cancelled call closes its connection, and the
/// calls after it take others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cancelled_on_the_same_host_socket_cancels_its_handler() {
    busy_then_cancelled(true).await;
}

async fn busy_then_cancelled(same_host: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (config, [taken, not]) = pair(&broker, same_host);
    let (_server_node, server) = calls(config.clone()).await;
    let (_caller_node, caller) = calls(config).await;
    let (serving, gate, ran) = serve_gated(&server, 0).await;

    // One call takes the only slot and times out: the handler is cancelled on the server.
    let short = CallOptions {
        timeout: Some(Duration::from_millis(500)),
        idempotent: false,
    };
    let first = caller.call("slow", &Value::Int(1), &short).await;
    assert!(matches!(first, Err(CallError::Timeout { .. })), "{first:?}");
    assert!(
        eventually_async(LIMIT, || async { serving.outstanding() == 0 }).await,
        "the cancelled call still holds its slot"
    );

    // Hold the slot with a call that waits on the gate, then offer 64 MiB: refused as
    // overloaded with no argument byte received by the server.
    let holder = {
        let caller = caller.clone();
        tokio::spawn(async move {
            caller
                .call("slow", &Value::Int(2), &CallOptions::default())
                .await
        })
    };
    // Running its handler (so its argument's bytes are counted already).
    let holding = eventually_async(LIMIT, || async {
        serving.outstanding() == 1 && ran.load(Ordering::SeqCst) == 2
    });
    assert!(holding.await, "the holder runs");
    let before = server.metrics().count("server", "overloaded");
    let bytes_in = server.metrics().bytes_moved("in");
    let big =
        Value::Tensor(HostTensor::new(DType::U8, vec![64 << 20], vec![7u8; 64 << 20]).expect("t"));
    let refused = call(&caller, "slow", &big).await;
    assert!(
        matches!(refused, Err(CallError::Overloaded { .. })),
        "{refused:?}"
    );
    assert_eq!(server.metrics().count("server", "overloaded"), before + 1);
    assert_eq!(
        server.metrics().bytes_moved("in"),
        bytes_in,
        "the refused argument moved"
    );

    gate.add_permits(1);
    let held = within(LIMIT, "held call", holder).await.expect("joins");
    assert_eq!(held.expect("the held call ends"), Value::Int(2));
    assert_eq!(ran.load(Ordering::SeqCst), 2, "the refused call never ran");
    assert_eq!(server.metrics().streams("server", taken), 3, "on {taken}");
    assert_eq!(server.metrics().streams("server", not), 0, "on {not}");
}

/// Queued calls pull their lent arguments only `concurrency` at a time: a long queue of large
/// calls holds the arguments of the calls about to run, and every call still gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_pull_their_large_arguments_one_slot_ahead() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (config, _) = pair(&broker, true);
    let (_server_node, server) = calls(config.clone()).await;
    let (caller_node, caller) = calls(config).await;
    let (serving, gate, ran) = serve_gated(&server, 8).await;
    let spawn = |value: Value| {
        let caller = caller.clone();
        tokio::spawn(async move { call(&caller, "slow", &value).await })
    };

    // A small call holds the only slot; four 1 MiB calls queue behind it, each lending its
    // argument (same host, at least `LEND_MIN`).
    let holder = spawn(Value::Int(1));
    let holding = eventually_async(LIMIT, || async { ran.load(Ordering::SeqCst) == 1 });
    assert!(holding.await, "the holder runs");
    let big = |i: u8| {
        let bytes: Vec<u8> = (0..1u32 << 20).map(|j| (j % 251) as u8 ^ i).collect();
        Value::Tensor(HostTensor::new(DType::U8, vec![1 << 20], bytes).expect("tensor"))
    };
    let queued: Vec<_> = (0..4).map(|i| (big(i), spawn(big(i)))).collect();
    let all_queued = eventually_async(LIMIT, || async {
        serving.outstanding() == 5 && caller_node.loans() <= 3
    });
    assert!(
        all_queued.await,
        "four calls queue and one pulls its argument"
    );
    // The three others keep their loans while the slot is held (bounded wait, no timing).
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(
            caller_node.loans(),
            3,
            "a queued call pulled out of its turn"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1);

    gate.add_permits(1);
    let held = within(LIMIT, "holder", holder).await.expect("joins");
    assert_eq!(held.expect("the holder ends"), Value::Int(1));
    for (sent, handle) in queued {
        let got = within(LIMIT, "queued call", handle).await.expect("joins");
        assert_eq!(got.expect("a queued call ends"), sent, "its own bytes back");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 5);
    assert_eq!(caller_node.loans(), 0, "every loan was pulled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_spread_over_servers_and_an_unserved_or_dead_server_is_not_offered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (_a_node, a) = calls(worker(&broker)).await;
    let (b_node, b) = calls(worker(&broker)).await;
    let (_caller_node, caller) = calls(worker(&broker)).await;
    let spec = || FunctionSpec::new("echo").expect("name").concurrency(8);
    let echo =
        |args: Value, _cx: tb_call::CallContext| Output::Unary(Box::pin(async move { Ok(args) }));
    let serving_a = a.serve(spec(), echo).await.expect("a serves");
    let _serving_b = b.serve(spec(), echo).await.expect("b serves");
    let servers = caller
        .node()
        .servers(&"echo".parse().expect("name"))
        .await
        .expect("servers");
    assert_eq!(servers.len(), 2);

    for i in 0..200 {
        let got = call(&caller, "echo", &Value::Int(i)).await.expect("echo");
        assert_eq!(got, Value::Int(i));
    }
    let served = |c: &Calls| c.metrics().count("server", "ok");
    assert_eq!(served(&a) + served(&b), 200);
    assert!(
        served(&a) > 0 && served(&b) > 0,
        "{} / {}",
        served(&a),
        served(&b)
    );

    // Unserved on a: the broker stops offering it, and calls keep working through b.
    serving_a.stop().await;
    let servers = caller
        .node()
        .servers(&"echo".parse().expect("name"))
        .await
        .expect("servers");
    assert_eq!(servers.len(), 1);
    for i in 0..20 {
        assert_eq!(
            call(&caller, "echo", &Value::Int(i)).await.expect("echo"),
            Value::Int(i)
        );
    }

    // b dies: once its liveness lapses nobody serves echo.
    b_node.shutdown().await;
    let gone = eventually_async(LIMIT, || async {
        caller
            .node()
            .servers(&"echo".parse().expect("name"))
            .await
            .is_ok_and(|s| s.is_empty())
    })
    .await;
    assert!(gone, "a dead server is still offered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_calls_yield_every_item_in_order() {
    streams_in_order(false).await;
}

/// The same on a same-host pair's socket, where a stream read to its end leaves its
/// connection pooled for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_calls_on_the_same_host_socket_yield_every_item_in_order() {
    streams_in_order(true).await;
}

async fn streams_in_order(same_host: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (config, [taken, _]) = pair(&broker, same_host);
    let (_s, server) = calls(config.clone()).await;
    let (caller_node, caller) = calls(config).await;
    let count = |args: Value, _cx: tb_call::CallContext| {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            let Value::Int(n) = args else { return };
            for i in 0..n {
                if tx.send(Ok(Value::Int(i))).await.is_err() {
                    return;
                }
            }
        });
        Output::Stream(rx)
    };
    let _serving = server
        .serve(FunctionSpec::new("count").expect("name"), count)
        .await
        .expect("serves");
    let mut stream = within(LIMIT, "stream", caller.stream("count", &Value::Int(50), 2))
        .await
        .expect("starts");
    let mut got = Vec::new();
    while let Some(item) = within(LIMIT, "item", stream.next()).await {
        got.push(item.expect("an item"));
    }
    assert_eq!(got, (0..50).map(Value::Int).collect::<Vec<_>>());
    drop(stream);
    // A stream cut short: the server's handler stops, and a call after it works.
    let mut cut = within(
        LIMIT,
        "stream",
        caller.stream("count", &Value::Int(1 << 20), 2),
    )
    .await
    .expect("starts");
    let first = within(LIMIT, "item", cut.next()).await;
    assert_eq!(first.map(|i| i.expect("an item")), Some(Value::Int(0)));
    drop(cut);
    let mut again = within(LIMIT, "stream", caller.stream("count", &Value::Int(3), 2))
        .await
        .expect("starts");
    let mut got = Vec::new();
    while let Some(item) = within(LIMIT, "item", again.next()).await {
        got.push(item.expect("an item"));
    }
    assert_eq!(got, (0..3).map(Value::Int).collect::<Vec<_>>());
    drop(again);
    // A stream read to its end leaves its same-host connection pooled (both sides ended
    // theirs): the next streams open none.
    let opened = caller_node.same_host_connections_opened();
    for n in [1, 4, 2] {
        let mut next = within(LIMIT, "stream", caller.stream("count", &Value::Int(n), 2))
            .await
            .expect("starts");
        let mut got = 0;
        while let Some(item) = within(LIMIT, "item", next.next()).await {
            assert_eq!(item.expect("an item"), Value::Int(got));
            got += 1;
        }
        assert_eq!(got, n);
    }
    assert_eq!(
        caller_node.same_host_connections_opened(),
        opened,
        "streams read to their end reuse the pooled connection"
    );
    if same_host {
        assert!(opened > 0, "the streams went over same-host connections");
    }
    assert_eq!(server.metrics().streams("server", taken), 6, "on {taken}");
    let cancelled = eventually_async(LIMIT, || async {
        server.metrics().count("server", "cancelled") == 1
    });
    assert!(cancelled.await, "the cut stream ended its handler");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_callers_are_refused_unless_the_function_admits_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (_s, server) = calls(worker(&broker)).await;
    let read_only = Config {
        cluster_key: key().read_only(),
        ..worker(&broker)
    };
    let (_r, reader) = calls(read_only.clone()).await;
    let echo =
        |args: Value, _cx: tb_call::CallContext| Output::Unary(Box::pin(async move { Ok(args) }));
    let _rw = server
        .serve(FunctionSpec::new("rw").expect("name"), echo)
        .await
        .expect("serves");
    let mut pure = FunctionSpec::new("pure").expect("name");
    pure.read_only_callers = true;
    let _ro = server.serve(pure, echo).await.expect("serves");

    let refused = call(&reader, "rw", &Value::Int(1)).await;
    assert!(
        matches!(refused, Err(CallError::Unauthorized { .. })),
        "{refused:?}"
    );
    assert_eq!(
        call(&reader, "pure", &Value::Int(1)).await.expect("pure"),
        Value::Int(1)
    );

    // A read-only node cannot serve: the broker refuses its advertisement.
    let served = reader
        .serve(FunctionSpec::new("mine").expect("name"), echo)
        .await;
    assert!(served.is_err(), "a read-only node served a function");
}

/// A worker that offers the same-host channels (shm), as every default node does.
fn same_host_worker(broker: &Broker) -> Config {
    Config {
        channels: ChannelKind::DEFAULT.to_vec(),
        ..worker(broker)
    }
}

/// `n` f32 values `i * 0.5`: a tensor over the lending threshold when `n` is large.
fn ramp(n: usize) -> Value {
    f32s(&(0..n).map(|i| i as f32 * 0.5).collect::<Vec<_>>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_arguments_and_results_to_a_same_host_server_are_lent_over_shm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (server_node, server) = calls(same_host_worker(&broker)).await;
    let (caller_node, caller) = calls(same_host_worker(&broker)).await;
    let spec = |name: &str| FunctionSpec::new(name).expect("name");
    let _add = within(LIMIT, "serve", server.serve(spec("math/add_one"), add_one))
        .await
        .expect("serves");
    let echo = |args: Value, _cx: tb_call::CallContext| -> Output {
        Output::Unary(Box::pin(async move { Ok(args) }))
    };
    let _echo = within(LIMIT, "serve", server.serve(spec("echo"), echo))
        .await
        .expect("serves");
    // A small call sets the pair's link and channel up.
    call(&caller, "math/add_one", &f32s(&[1.0]))
        .await
        .expect("a small call");
    let server_id = server_node.id();
    let on_shm = eventually_async(LIMIT, || async {
        caller_node.channel_to(&server_id) == ChannelKind::Shm
    });
    assert!(on_shm.await, "the pair's channel becomes shm");

    // 1 MiB of f32 (over the lending threshold) each way.
    let n = 1 << 18;
    let args = ramp(n);
    let result = call(&caller, "math/add_one", &args).await.expect("add_one");
    let expected: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
    assert_eq!(floats(&result), expected, "x + 1 of every element");
    let got = result.as_tensor().expect("a tensor");
    assert_eq!(got.shape, vec![n as u64]);
    assert!(got.node_tensor().is_some(), "the result came as a loan");

    // Nested in a structure, two of them, returned unchanged: the same bytes back.
    let nested = Value::Map(vec![
        ("a".into(), ramp(n)),
        ("b".into(), Value::List(vec![Value::Int(7), ramp(n + 1)])),
    ]);
    let back = call(&caller, "echo", &nested).await.expect("echo");
    assert_eq!(back, nested, "every value and byte comes back");

    // Every loan was pulled once and ended: none is left on either side.
    let none_left = eventually_async(LIMIT, || async {
        server_node.loans() == 0 && caller_node.loans() == 0
    });
    assert!(none_left.await, "no loan outlives its pull");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_argument_to_a_quic_only_pair_rides_the_call_stream() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (_server_node, server) = calls(same_host_worker(&broker)).await;
    let (caller_node, caller) = calls(worker(&broker)).await;
    let _add = within(
        LIMIT,
        "serve",
        server.serve(FunctionSpec::new("math/add_one").expect("name"), add_one),
    )
    .await
    .expect("serves");
    let n = 1 << 18;
    let result = call(&caller, "math/add_one", &ramp(n))
        .await
        .expect("add_one");
    let expected: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
    assert_eq!(floats(&result), expected);
    let got = result.as_tensor().expect("a tensor");
    assert!(got.node_tensor().is_none(), "not lent: read off the stream");
    assert_eq!(caller_node.loans(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_tensor_is_pulled_once_by_its_peer_only_and_ends_with_its_handle() {
    let lender = node(test_config()).await;
    let borrower = node(test_config()).await;
    let other = node(test_config()).await;
    let bytes = tb_tests::pattern(300 << 10, 3);
    let tensor = tb_node::Tensor::from_bytes(bytes.clone());
    // Both peers get a link to the lender (a pull of something it holds).
    lender
        .publish_local("held", tensor.clone())
        .expect("publish");
    for peer in [&borrower, &other] {
        within(LIMIT, "a pull", peer.pull(lender.addr(), "held", None))
            .await
            .expect("pulls");
    }
    let ttl = Duration::from_secs(60);
    let lent = lender
        .lend(borrower.id(), tensor.clone(), ttl)
        .expect("lends");
    assert!(lent.name().as_str().starts_with(tb_node::LEND_PREFIX));
    assert_eq!(lender.loans(), 1);

    // Another peer that learns the name gets nothing.
    let stolen = within(LIMIT, "pull", other.pull_lent(lender.id(), lent.name())).await;
    assert!(
        matches!(stolen, Err(tb_node::Error::NotFound { .. })),
        "{stolen:?}"
    );
    // The borrower may pull it by its name like any tensor (the pair's channel first).
    let plain = within(
        LIMIT,
        "pull",
        borrower.pull(lender.addr(), lent.name().as_str(), None),
    )
    .await;
    let got = plain.expect("the borrower pulls it by name too").buffer;
    assert_eq!(got.data(), &bytes, "bytes equal");
    // One pull per loan: a second gets nothing.
    let again = within(LIMIT, "pull", borrower.pull_lent(lender.id(), lent.name())).await;
    assert!(
        matches!(again, Err(tb_node::Error::NotFound { .. })),
        "{again:?}"
    );
    assert_eq!(lender.loans(), 0);
    drop(lent);

    // A loan whose handle is dropped ends before it is pulled.
    let lent = lender
        .lend(borrower.id(), tensor.clone(), ttl)
        .expect("lends");
    let name = lent.name().clone();
    drop(lent);
    let ended = within(LIMIT, "pull", borrower.pull_lent(lender.id(), &name)).await;
    assert!(
        matches!(ended, Err(tb_node::Error::NotFound { .. })),
        "{ended:?}"
    );

    // A loan let go lives until pulled; one whose time is up is gone.
    let lent = lender
        .lend(borrower.id(), tensor.clone(), ttl)
        .expect("lends");
    let name = lent.name().clone();
    lent.until_pulled();
    let got = within(LIMIT, "pull", borrower.pull_lent(lender.id(), &name))
        .await
        .expect("pulled after its handle was let go");
    assert_eq!(got.data(), &bytes);
    let lent = lender
        .lend(borrower.id(), tensor, Duration::from_millis(1))
        .expect("lends");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let late = within(LIMIT, "pull", borrower.pull_lent(lender.id(), lent.name())).await;
    assert!(
        matches!(late, Err(tb_node::Error::NotFound { .. })),
        "{late:?}"
    );
    // A name that is not a lent one is refused before anything moves.
    let bad = tb_node::TensorName::new("held").expect("name");
    let refused = borrower.pull_lent(lender.id(), &bad).await;
    assert!(
        matches!(refused, Err(tb_node::Error::InvalidTensor(_))),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_for_a_slot_show_in_the_queue_depth_metric() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (server_node, server) = calls(worker(&broker)).await;
    let (_caller_node, caller) = calls(worker(&broker)).await;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let ran = Arc::new(AtomicU32::new(0));
    let spec = FunctionSpec::new("slow")
        .expect("name")
        .concurrency(1)
        .queue(4);
    let _serving = within(
        LIMIT,
        "serve",
        server.serve(spec, gated(gate.clone(), ran.clone())),
    )
    .await
    .expect("serves");
    // One call runs (waiting on the gate), two wait for its slot.
    let calls: Vec<_> = (0..3)
        .map(|i| {
            let caller = caller.clone();
            tokio::spawn(async move { call(&caller, "slow", &Value::Int(i)).await })
        })
        .collect();
    let queued = eventually_async(LIMIT, || async {
        server.metrics().queue_depth() == 2 && ran.load(Ordering::SeqCst) == 1
    });
    assert!(queued.await, "two calls queue behind the running one");
    let text = server_node.metrics().encode();
    assert!(text.contains("tb_call_queue_depth 2"), "exported: {text}");
    gate.add_permits(3);
    for (i, joined) in calls.into_iter().enumerate() {
        let got = within(LIMIT, "a queued call", joined).await.expect("joins");
        assert_eq!(got.expect("the call ends"), Value::Int(i as i64));
    }
    assert_eq!(server.metrics().queue_depth(), 0, "nothing waits any more");
}

/// A bidirectional function: yields the running sum of its inputs (ints), or each tensor input
/// with every byte plus one.
fn running_sum(_args: Value, cx: tb_call::CallContext) -> Output {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let mut total = 0;
        while let Some(input) = cx.inputs.next().await {
            let out = match input {
                Value::Int(i) => {
                    total += i;
                    Value::Int(total)
                }
                Value::Tensor(t) => {
                    let bytes: Vec<u8> = t.data.iter().map(|b| b.wrapping_add(1)).collect();
                    Value::Tensor(HostTensor::new(t.dtype, t.shape.clone(), bytes).expect("t"))
                }
                other => Value::List(vec![other]),
            };
            if tx.send(Ok(out)).await.is_err() {
                return;
            }
        }
    });
    Output::Stream(rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bidirectional_call_streams_inputs_in_and_results_out_with_bounded_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (server_node, server) = calls(same_host_worker(&broker)).await;
    let (caller_node, caller) = calls(same_host_worker(&broker)).await;
    let spec = FunctionSpec::new("sum").expect("name").inputs(true);
    let _serving = within(LIMIT, "serve", server.serve(spec, running_sum))
        .await
        .expect("serves");

    // 200 ints in, 200 running sums out, in order.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        for i in 0..200 {
            if tx.send(Value::Int(i)).await.is_err() {
                return;
            }
        }
    });
    let mut stream = within(
        LIMIT,
        "start",
        caller.stream_inputs("sum", &Value::None, rx, 2),
    )
    .await
    .expect("starts");
    let mut got = Vec::new();
    while let Some(item) = within(LIMIT, "item", stream.next()).await {
        got.push(item.expect("an item"));
    }
    let sums: Vec<Value> = (0..200).map(|i| Value::Int(i * (i + 1) / 2)).collect();
    assert_eq!(got, sums);

    // Large tensors both ways (lent over the same-host channel once it is up).
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let inputs: Vec<Vec<u8>> = (0..6u8).map(|k| vec![k; 1 << 20]).collect();
    let sent = inputs.clone();
    tokio::spawn(async move {
        for bytes in sent {
            let t = HostTensor::new(DType::U8, vec![1 << 20], bytes).expect("t");
            if tx.send(Value::Tensor(t)).await.is_err() {
                return;
            }
        }
    });
    let mut stream = within(
        LIMIT,
        "start",
        caller.stream_inputs("sum", &Value::None, rx, 2),
    )
    .await
    .expect("starts");
    for bytes in &inputs {
        let item = within(LIMIT, "item", stream.next()).await.expect("an item");
        let item = item.expect("a result");
        let t = item.as_tensor().expect("a tensor");
        assert!(
            t.data.iter().all(|&b| b == bytes[0] + 1),
            "every byte plus one"
        );
    }
    assert!(within(LIMIT, "end", stream.next()).await.is_none());

    // A stream dropped with lent items not read yet: their loans end with the call.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let sent = inputs.clone();
    tokio::spawn(async move {
        for bytes in sent {
            let t = HostTensor::new(DType::U8, vec![1 << 20], bytes).expect("t");
            if tx.send(Value::Tensor(t)).await.is_err() {
                return;
            }
        }
    });
    let mut stream = within(
        LIMIT,
        "start",
        caller.stream_inputs("sum", &Value::None, rx, 4),
    )
    .await
    .expect("starts");
    within(LIMIT, "item", stream.next())
        .await
        .expect("item")
        .expect("ok");
    drop(stream);
    let none_left = eventually_async(LIMIT, || async {
        server_node.loans() == 0 && caller_node.loans() == 0
    });
    assert!(none_left.await, "the dropped stream's loans ended");

    // A consumer that stops reading stops the inputs: of 1,000 offered, a bounded few move.
    let fed = Arc::new(AtomicU32::new(0));
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let counter = fed.clone();
    tokio::spawn(async move {
        for i in 0..1000 {
            if tx.send(Value::Int(i)).await.is_err() {
                return;
            }
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    let mut stream = within(
        LIMIT,
        "start",
        caller.stream_inputs("sum", &Value::None, rx, 2),
    )
    .await
    .expect("starts");
    for _ in 0..3 {
        within(LIMIT, "item", stream.next())
            .await
            .expect("item")
            .expect("ok");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let moved = fed.load(Ordering::SeqCst);
    assert!(
        moved < 30,
        "{moved} inputs taken while the consumer read 3 results"
    );
    drop(stream);

    // Called without inputs (a plain stream), its inputs end at once: no result.
    let mut plain = within(LIMIT, "start", caller.stream("sum", &Value::None, 2))
        .await
        .expect("starts");
    assert!(within(LIMIT, "end", plain.next()).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bidirectional_call_with_large_items_both_ways_on_the_quic_stream_never_stalls() {
    // Inputs and results of 4 MiB on one QUIC stream (no shm: nothing is lent): the server
    // reads inputs while it writes results, so neither side waits on the other's window.
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (_s, server) = calls(worker(&broker)).await;
    let (_c, caller) = calls(worker(&broker)).await;
    let spec = FunctionSpec::new("sum").expect("name").inputs(true);
    let _serving = within(LIMIT, "serve", server.serve(spec, running_sum))
        .await
        .expect("serves");
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tokio::spawn(async move {
        for k in 0..8u8 {
            let t = HostTensor::new(DType::U8, vec![4 << 20], vec![k; 4 << 20]).expect("t");
            if tx.send(Value::Tensor(t)).await.is_err() {
                return;
            }
        }
    });
    let mut stream = within(
        LIMIT,
        "start",
        caller.stream_inputs("sum", &Value::None, rx, 2),
    )
    .await
    .expect("starts");
    for k in 0..8u8 {
        let item = within(LIMIT, "item", stream.next()).await.expect("an item");
        let item = item.expect("a result");
        let t = item.as_tensor().expect("a tensor");
        assert!(t.node_tensor().is_none(), "read off the stream, not lent");
        assert!(t.data.iter().all(|&b| b == k + 1), "item {k}");
    }
    assert!(within(LIMIT, "end", stream.next()).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_to_a_function_that_takes_none_are_refused_typed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (_s, server) = calls(worker(&broker)).await;
    let (_c, caller) = calls(worker(&broker)).await;
    let forever = |_args: Value, _cx: tb_call::CallContext| {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            // Yields nothing until the call ends.
            tx.closed().await;
        });
        Output::Stream(rx)
    };
    let _serving = server
        .serve(FunctionSpec::new("plain").expect("name"), forever)
        .await
        .expect("serves");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Value::Int(1)).await.expect("queued");
    let started = within(
        LIMIT,
        "start",
        caller.stream_inputs("plain", &Value::None, rx, 2),
    )
    .await;
    match started {
        Err(CallError::BadValue { detail, .. }) => {
            assert!(detail.contains("takes no inputs"), "{detail}");
        }
        other => panic!("expected a typed refusal, got {other:?}"),
    }
}
