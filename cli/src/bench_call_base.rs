//! The baselines of `tb bench call`: the same `echo` and `add_one` calls made with the tools a
//! Rust user would pick instead, from server processes of this binary (`tb bench call-serve
//! --system grpc|zmq`, each printing `ready <address>` once it listens on 127.0.0.1):
//!
//! - **`grpc`**: tonic, unary calls. The service is registered without protobuf: each
//!   message is the f32 tensor's bytes, copied once into the message and once out of it, as a
//!   `bytes` field would be. Both ends use HTTP/2 adaptive flow control windows (through the
//!   default 64 KiB window a 16 MiB message crawls, and grpcio probes the bandwidth-delay
//!   product by default too) and no message size limit. One channel (one HTTP/2 connection)
//!   per server, shared by every calling task, as grpcio's callers share theirs in the Python
//!   benchmark. `add_one` of 1 MiB or more runs on a blocking thread, as tensor-broker's
//!   server does.
//! - **`zmq`**: libzmq REQ/REP over TCP loopback, the floor. A server is one REP socket on
//!   one thread, answering `[op, bytes]` with `[bytes]` (echo sends back the message it
//!   received). Each caller is a thread of its own with a REQ socket per server; it sends the
//!   argument without copying it (`zmq_send_const`) and reads the answer in libzmq's message.
//!
//! Each caller sends its calls to the case's servers in turn, starting at a different one.
//! Cases, warm-up and checks are those of tensor-broker's (see `bench_call`).
//!
//! Streams (a server sending `items` items of `size` bytes, the caller at most 2 ahead):
//! gRPC's is a server-streaming method (HTTP/2 flow control bounds how far it runs ahead);
//! ZeroMQ's is a DEALER/ROUTER pair on the REP server's thread, the caller returning a credit
//! for each item it takes, 2 ahead, as `f.stream`'s default `prefetch=2`. Each server keeps
//! one item per size, made on the first stream of that size (an untimed warm-up stream).

use std::{
    sync::{Arc, Barrier},
    task::{Context as TaskContext, Poll},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use bytes::{Buf, BufMut, Bytes};
use tokio::io::AsyncReadExt;
use tonic::{
    Status,
    client::Grpc,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::{Body, BoxFuture, Service, StdError, http},
    server::{NamedService, UnaryService},
    transport::{Channel, Endpoint, Server, server::TcpIncoming},
};

use crate::bench_call::{
    BLOCKING_MIN, CALL_LIMIT, CallBenchArgs, Case, STREAMS, StreamCase, StreamTimer,
    WARMUP_PER_SERVER, argument, check_bytes, check_item, each_case, each_stream, plus_one_bytes,
    timed,
};

/// The gRPC baseline's system name.
pub(crate) const GRPC: &str = "grpc";
/// The ZeroMQ baseline's system name.
pub(crate) const ZMQ: &str = "zmq";

/// The gRPC service's name.
const SERVICE: &str = "tb.bench.Bench";
/// How often a ZeroMQ server looks whether it should stop.
const ZMQ_POLL_MS: i64 = 100;
/// Items a ZeroMQ stream runs ahead of its caller (`f.stream`'s default prefetch).
const ZMQ_STREAM_AHEAD: u64 = 2;
/// Largest stream item a baseline server makes.
const MAX_STREAM_ITEM: u64 = 1 << 30;

/// The gRPC method path of an op.
fn path(op: &str) -> &'static str {
    match op {
        "echo" => "/tb.bench.Bench/echo",
        "stream" => "/tb.bench.Bench/stream",
        _ => "/tb.bench.Bench/add_one",
    }
}

/// A stream request: `items` items of `size` bytes, as 16 little-endian bytes.
fn stream_request(items: u64, size: u64) -> Bytes {
    let mut out = Vec::with_capacity(16);
    out.extend_from_slice(&items.to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.into()
}

/// The (items, size) of a stream request; an error for anything else or an item over
/// [`MAX_STREAM_ITEM`] or not f32s.
fn parse_stream_request(raw: &[u8]) -> Result<(u64, u64), String> {
    let (Some(items), Some(size), 16) = (raw.get(..8), raw.get(8..16), raw.len()) else {
        return Err(format!("a stream request is 16 bytes, not {}", raw.len()));
    };
    let items = u64::from_le_bytes(items.try_into().unwrap_or_default());
    let size = u64::from_le_bytes(size.try_into().unwrap_or_default());
    if size == 0 || size > MAX_STREAM_ITEM || !size.is_multiple_of(4) {
        return Err(format!("stream items of {size} bytes"));
    }
    Ok((items, size))
}

/// The item of `size` bytes a server streams, made once per size (the benchmark's argument
/// pattern; a `Bytes` clone shares it) and kept for the process's life (ZeroMQ sends it
/// without a copy).
fn stream_item(size: u64) -> Result<Bytes, String> {
    use std::{collections::HashMap, sync::Mutex};
    static ITEMS: Mutex<Option<HashMap<u64, Bytes>>> = Mutex::new(None);
    let mut items = ITEMS.lock().unwrap_or_else(|p| p.into_inner());
    let items = items.get_or_insert_with(HashMap::new);
    if let Some(item) = items.get(&size) {
        return Ok(item.clone());
    }
    let made = argument(size).map_err(|e| e.to_string())?.data.to_vec();
    let item = Bytes::from(made);
    items.insert(size, item.clone());
    Ok(item)
}

/// What a server answers to `op` with argument bytes `x`: `x` itself, or `x + 1` (an error
/// for bytes that are no f32 tensor).
fn answer(op: &str, x: Bytes) -> Result<Bytes, String> {
    match op {
        "echo" => Ok(x),
        "add_one" if x.len().is_multiple_of(4) => Ok(plus_one_bytes(&x).into()),
        "add_one" => Err(format!("add_one takes f32s, not {} bytes", x.len())),
        _ => Err(format!("no op {op:?}")),
    }
}

// ---- gRPC ----

/// Messages as they are: the tensor's bytes.
#[derive(Debug, Clone, Copy, Default)]
struct BytesCodec;

#[derive(Debug)]
struct BytesEncoder;

#[derive(Debug)]
struct BytesDecoder;

impl Encoder for BytesEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for BytesDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl Codec for BytesCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = BytesEncoder;
    type Decoder = BytesDecoder;

    fn encoder(&mut self) -> BytesEncoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> BytesDecoder {
        BytesDecoder
    }
}

/// One op's handler.
struct Handler(&'static str);

impl UnaryService<Bytes> for Handler {
    type Response = Bytes;
    type Future = BoxFuture<tonic::Response<Bytes>, Status>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let op = self.0;
        let x = request.into_inner();
        Box::pin(async move {
            let out = match op == "add_one" && x.len() >= BLOCKING_MIN {
                true => tokio::task::spawn_blocking(move || answer(op, x))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?,
                false => answer(op, x),
            };
            out.map(tonic::Response::new)
                .map_err(Status::invalid_argument)
        })
    }
}

/// The stream method's handler: the item, `items` times.
struct StreamHandler;

impl tonic::server::ServerStreamingService<Bytes> for StreamHandler {
    type Response = Bytes;
    type ResponseStream =
        tonic::codegen::tokio_stream::Iter<std::iter::RepeatN<Result<Bytes, Status>>>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        let raw = request.into_inner();
        Box::pin(async move {
            let (items, size) = parse_stream_request(&raw).map_err(Status::invalid_argument)?;
            let item = tokio::task::spawn_blocking(move || stream_item(size))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(Status::internal)?;
            let items =
                usize::try_from(items).map_err(|e| Status::invalid_argument(e.to_string()))?;
            let stream = std::iter::repeat_n(Ok(item), items);
            Ok(tonic::Response::new(tonic::codegen::tokio_stream::iter(
                stream,
            )))
        })
    }
}

/// The gRPC service: `echo`, `add_one` and `stream`, routed by path.
#[derive(Debug, Clone, Copy)]
struct Bench;

impl NamedService for Bench {
    const NAME: &'static str = SERVICE;
}

impl<B> Service<http::Request<B>> for Bench
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() == path("stream") {
            return Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(BytesCodec)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX);
                Ok(grpc.server_streaming(StreamHandler, request).await)
            });
        }
        let op = match request.uri().path() {
            p if p == path("echo") => "echo",
            p if p == path("add_one") => "add_one",
            p => {
                let status = Status::unimplemented(format!("no method {p}"));
                return Box::pin(std::future::ready(Ok(status.into_http())));
            }
        };
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(BytesCodec)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX);
            Ok(grpc.unary(Handler(op), request).await)
        })
    }
}

/// The gRPC server process: listens on 127.0.0.1, prints `ready <ip:port>` and serves until
/// its stdin closes.
pub(crate) async fn serve_grpc() -> Result<()> {
    let incoming = TcpIncoming::bind(([127, 0, 0, 1], 0).into())
        .context("listening on 127.0.0.1")?
        .with_nodelay(Some(true));
    let addr = incoming.local_addr()?;
    println!("ready {addr}");
    let stdin_closed = async {
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    };
    Server::builder()
        .http2_adaptive_window(Some(true))
        .serve_with_incoming_shutdown(Bench, incoming, stdin_closed)
        .await
        .context("serving gRPC")
}

/// A gRPC client of the server at `addr` (`ip:port`).
async fn grpc_client(addr: &str) -> Result<Grpc<Channel>> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .http2_adaptive_window(true)
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to the gRPC server at {addr}"))?;
    Ok(Grpc::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX))
}

/// One gRPC call of `op` with `arg`: the result's bytes.
async fn grpc_call(client: &mut Grpc<Channel>, op: &str, arg: Bytes) -> Result<Bytes> {
    client.ready().await.context("gRPC channel")?;
    let path = http::uri::PathAndQuery::from_static(path(op));
    let request = tonic::Request::new(arg);
    let call = client.unary(request, path, BytesCodec);
    let response = tokio::time::timeout(CALL_LIMIT, call)
        .await
        .with_context(|| format!("no gRPC answer within {CALL_LIMIT:?}"))??;
    Ok(response.into_inner())
}

/// Every case of `args` against the gRPC servers at `servers` (and the streams, from the
/// first, when `stream_too`).
pub(crate) async fn measure_grpc(
    servers: &[String],
    args: &CallBenchArgs,
    stream_too: bool,
) -> Result<(Vec<Case>, Vec<StreamCase>)> {
    let mut clients = Vec::new();
    for addr in servers {
        clients.push(grpc_client(addr).await?);
    }
    let cases = each_case(args, GRPC, servers.len(), |op, size, concurrency| {
        grpc_case(clients.clone(), op, size, concurrency, args.seconds)
    })
    .await?;
    let streams = match stream_too {
        true => {
            let client = &clients[0];
            each_stream(args, GRPC, |size, items| {
                grpc_stream(client.clone(), size, items)
            })
            .await?
        }
        false => Vec::new(),
    };
    Ok((cases, streams))
}

/// One stream case over gRPC: see `each_stream`.
async fn grpc_stream(mut client: Grpc<Channel>, size: u64, items: u64) -> Result<StreamTimer> {
    let pattern = argument(size)?.data;
    let mut warm = grpc_open_stream(&mut client, 1, size).await?;
    let mut taken = 0;
    while let Some(item) = grpc_next(&mut warm).await? {
        check_item(&item, &pattern, true)?;
        taken += 1;
    }
    ensure!(taken == 1, "a warm-up stream of {taken} items, not 1");
    let mut timer = StreamTimer::start();
    for run in 0..STREAMS {
        timer.stream();
        let mut stream = grpc_open_stream(&mut client, items, size).await?;
        let mut taken = 0;
        while let Some(item) = grpc_next(&mut stream).await? {
            timer.item();
            check_item(&item, &pattern, run == 0 && taken == 0)?;
            taken += 1;
        }
        ensure!(taken == items, "a stream of {taken} items, not {items}");
    }
    Ok(timer)
}

async fn grpc_open_stream(
    client: &mut Grpc<Channel>,
    items: u64,
    size: u64,
) -> Result<tonic::Streaming<Bytes>> {
    client.ready().await.context("gRPC channel")?;
    let path = http::uri::PathAndQuery::from_static(path("stream"));
    let request = tonic::Request::new(stream_request(items, size));
    let opened = client.server_streaming(request, path, BytesCodec);
    let response = tokio::time::timeout(CALL_LIMIT, opened)
        .await
        .with_context(|| format!("no gRPC stream within {CALL_LIMIT:?}"))??;
    Ok(response.into_inner())
}

async fn grpc_next(stream: &mut tonic::Streaming<Bytes>) -> Result<Option<Bytes>> {
    let next = tokio::time::timeout(CALL_LIMIT, stream.message());
    Ok(next
        .await
        .with_context(|| format!("no gRPC stream item within {CALL_LIMIT:?}"))??)
}

/// One case: every call's latency (µs) and the wall time (s).
async fn grpc_case(
    clients: Vec<Grpc<Channel>>,
    op: &'static str,
    size: u64,
    concurrency: usize,
    seconds: f64,
) -> Result<(Vec<f64>, f64)> {
    let arg = Bytes::from(argument(size)?.data.to_vec());
    for i in 0..WARMUP_PER_SERVER * clients.len() {
        let got = grpc_call(&mut clients[i % clients.len()].clone(), op, arg.clone()).await?;
        check_bytes(op, &arg, &got, true)?;
    }
    let shared = Arc::new((clients, arg));
    // Each caller's next server, in turn from its own first one.
    let turns = Arc::new(
        (0..concurrency)
            .map(std::sync::atomic::AtomicUsize::new)
            .collect::<Vec<_>>(),
    );
    timed(concurrency, seconds, move |caller| {
        let (shared, turns) = (shared.clone(), turns.clone());
        async move {
            let (clients, arg) = &*shared;
            let turn = turns[caller].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut client = clients[turn % clients.len()].clone();
            let t0 = Instant::now();
            let got = grpc_call(&mut client, op, arg.clone()).await?;
            let latency = t0.elapsed().as_secs_f64() * 1e6;
            check_bytes(op, arg, &got, false)?;
            Ok(latency)
        }
    })
    .await
}

// ---- ZeroMQ ----

/// The ZeroMQ server process: one REP socket on 127.0.0.1, answered on a thread; prints
/// `ready <endpoint>` and serves until its stdin closes.
pub(crate) async fn serve_zmq() -> Result<()> {
    let ctx = zmq::Context::new();
    let bound = |kind| -> Result<(zmq::Socket, String)> {
        let socket = ctx.socket(kind)?;
        socket.set_linger(0)?;
        socket.bind("tcp://127.0.0.1:*")?;
        let endpoint = socket
            .get_last_endpoint()?
            .map_err(|raw| anyhow::anyhow!("endpoint {raw:?} is not UTF-8"))?;
        Ok((socket, endpoint))
    };
    let (socket, endpoint) = bound(zmq::REP)?;
    let (streams, stream_endpoint) = bound(zmq::ROUTER)?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answering = {
        let stop = stop.clone();
        std::thread::spawn(move || zmq_answer(socket, streams, &stop))
    };
    println!("ready {endpoint} {stream_endpoint}");
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered = tokio::task::spawn_blocking(move || answering.join()).await?;
    answered.map_err(|_| anyhow::anyhow!("the ZeroMQ server thread panicked"))?
}

/// A ZeroMQ stream in progress: items left to send, credit, and the item.
struct ZmqStream {
    left: u64,
    credit: u64,
    item: Arc<Bytes>,
}

/// Answers requests on `socket` and streams on `streams` until `stop` is set.
fn zmq_answer(
    socket: zmq::Socket,
    mut streams: zmq::Socket,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    let mut running: std::collections::HashMap<Vec<u8>, ZmqStream> = Default::default();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let mut ready = [
            socket.as_poll_item(zmq::POLLIN),
            streams.as_poll_item(zmq::POLLIN),
        ];
        zmq::poll(&mut ready, ZMQ_POLL_MS)?;
        let (requests, stream_requests) = (ready[0].is_readable(), ready[1].is_readable());
        if stream_requests {
            zmq_stream_step(&mut streams, &mut running)?;
        }
        if !requests {
            continue;
        }
        let op = socket.recv_msg(0)?;
        // A request of other than two parts is drained and refused (REP answers each one).
        let mut parts = 1;
        let mut x = zmq::Message::new();
        while socket.get_rcvmore()? {
            x = socket.recv_msg(0)?;
            parts += 1;
        }
        let reply = match (op.as_str(), parts != 2) {
            (_, true) => Err(format!("a request is [op, argument], not {parts} parts")),
            (Some("echo"), false) => {
                socket.send(x, 0)?;
                continue;
            }
            (Some(op), false) => answer(op, Bytes::copy_from_slice(&x)),
            (None, false) => Err("the op is not UTF-8".to_string()),
        };
        match reply {
            Ok(bytes) => socket.send(zmq::Message::from(Vec::from(bytes)), 0)?,
            // An empty answer is the error (no argument here is empty).
            Err(e) => {
                tracing::warn!("zmq bench server: {e}");
                socket.send(zmq::Message::new(), 0)?
            }
        }
    }
    Ok(())
}

/// Takes one message on the stream router: `[who, "start", items, size]` starts a stream,
/// `[who, "credit"]` lets one more item go; then sends what credit allows.
fn zmq_stream_step(
    router: &mut zmq::Socket,
    running: &mut std::collections::HashMap<Vec<u8>, ZmqStream>,
) -> Result<()> {
    let parts = router.recv_multipart(0)?;
    let Some((who, rest)) = parts.split_first() else {
        return Ok(());
    };
    match rest {
        [start, request] if start.as_slice() == b"start" => {
            let (items, size) = match parse_stream_request(request) {
                Ok(asked) => asked,
                Err(e) => {
                    tracing::warn!("zmq bench server: {e}");
                    return Ok(());
                }
            };
            // The per-size item, which a static keeps for the process's life.
            let item = match stream_item(size) {
                Ok(item) => Arc::new(item),
                Err(e) => bail!("making a stream item: {e}"),
            };
            running.insert(
                who.clone(),
                ZmqStream {
                    left: items,
                    credit: ZMQ_STREAM_AHEAD,
                    item,
                },
            );
        }
        [credit] if credit.as_slice() == b"credit" => {
            if let Some(stream) = running.get_mut(who) {
                stream.credit += 1;
            }
        }
        _ => {
            tracing::warn!(
                "zmq bench server: a stream message of {} parts",
                parts.len()
            );
            return Ok(());
        }
    }
    if let Some(stream) = running.get_mut(who) {
        while stream.left > 0 && stream.credit > 0 {
            router.send(who.as_slice(), zmq::SNDMORE)?;
            send_const(router, &stream.item)?;
            stream.left -= 1;
            stream.credit -= 1;
        }
        if stream.left == 0 {
            running.remove(who);
        }
    }
    Ok(())
}

/// Sends `data` as the last part of a message without copying it.
#[allow(unsafe_code)]
fn send_const(socket: &mut zmq::Socket, data: &Arc<Bytes>) -> Result<()> {
    // SAFETY: `zmq_send_const` reads `data` until libzmq has sent it. A REQ socket sends one
    // request and then waits for its answer, which the server writes only after it received
    // the whole request; the caller holds `data` (an `Arc` it keeps) until that answer came
    // or the socket is closed with linger 0 (pending messages dropped, never read again).
    // The stream router's items are `stream_item`'s, which a static keeps for the process's
    // life.
    // SAFETY (zmq_errno): reads the calling thread's error number.
    let (rc, errno) = unsafe {
        let rc = zmq_sys::zmq_send_const(socket.as_mut_ptr(), data.as_ptr().cast(), data.len(), 0);
        (rc, zmq_sys::zmq_errno())
    };
    if rc < 0 {
        bail!("zmq_send_const: {}", zmq::Error::from_raw(errno));
    }
    Ok(())
}

/// One caller's REQ sockets, one per server.
struct ZmqCaller {
    sockets: Vec<zmq::Socket>,
    next: usize,
}

impl ZmqCaller {
    fn connect(ctx: &zmq::Context, servers: &[String], first: usize) -> Result<ZmqCaller> {
        let mut sockets = Vec::new();
        for endpoint in servers {
            let socket = ctx.socket(zmq::REQ)?;
            socket.set_linger(0)?;
            socket.connect(endpoint)?;
            sockets.push(socket);
        }
        Ok(ZmqCaller {
            sockets,
            next: first,
        })
    }

    /// One call of `op` with `arg` to the next server: its latency in µs and the answer.
    fn call(&mut self, op: &str, arg: &Arc<Bytes>) -> Result<(f64, zmq::Message)> {
        let at = self.next % self.sockets.len();
        self.next += 1;
        let socket = &mut self.sockets[at];
        let t0 = Instant::now();
        socket.send(op, zmq::SNDMORE)?;
        send_const(socket, arg)?;
        let limit = i64::try_from(CALL_LIMIT.as_millis()).unwrap_or(i64::MAX);
        if socket.poll(zmq::POLLIN, limit)? == 0 {
            bail!("no ZeroMQ answer within {CALL_LIMIT:?}");
        }
        let got = socket.recv_msg(0)?;
        let latency = t0.elapsed().as_secs_f64() * 1e6;
        ensure!(!socket.get_rcvmore()?, "an answer of more than one part");
        ensure!(
            !got.is_empty(),
            "the ZeroMQ server refused {op} (see its log)"
        );
        Ok((latency, got))
    }
}

/// Every case of `args` against the ZeroMQ servers whose ready lines are `servers` (`<REP
/// endpoint> <stream endpoint>`), and the streams from the first when `stream_too`.
pub(crate) async fn measure_zmq(
    servers: &[String],
    args: &CallBenchArgs,
    stream_too: bool,
) -> Result<(Vec<Case>, Vec<StreamCase>)> {
    let endpoint = |line: &String, at: usize| -> Result<String> {
        let found = line.split_whitespace().nth(at);
        found
            .map(str::to_string)
            .with_context(|| format!("a ZeroMQ server's ready line {line:?}"))
    };
    let requests: Vec<String> = servers
        .iter()
        .map(|line| endpoint(line, 0))
        .collect::<Result<_>>()?;
    let cases = each_case(args, ZMQ, servers.len(), |op, size, concurrency| {
        let (endpoints, seconds) = (requests.clone(), args.seconds);
        async move {
            let case = move || zmq_case(&endpoints, op, size, concurrency, seconds);
            tokio::task::spawn_blocking(case).await?
        }
    })
    .await?;
    let streams = match (stream_too, servers.first()) {
        (true, Some(first)) => {
            let at = endpoint(first, 1)?;
            each_stream(args, ZMQ, |size, items| {
                let at = at.clone();
                async move {
                    tokio::task::spawn_blocking(move || zmq_stream(&at, size, items)).await?
                }
            })
            .await?
        }
        _ => Vec::new(),
    };
    Ok((cases, streams))
}

/// One stream case over ZeroMQ (a DEALER to the server's ROUTER): see `each_stream`.
fn zmq_stream(endpoint: &str, size: u64, items: u64) -> Result<StreamTimer> {
    let ctx = zmq::Context::new();
    let socket = ctx.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    socket.connect(endpoint)?;
    let pattern = argument(size)?.data;
    let limit = i64::try_from(CALL_LIMIT.as_millis()).unwrap_or(i64::MAX);
    // One stream of `n` items: `each(item, index)` for each, a credit back for each.
    let run = |n: u64, each: &mut dyn FnMut(&[u8], u64) -> Result<()>| -> Result<()> {
        let start = stream_request(n, size);
        socket.send_multipart([&b"start"[..], &start[..]], 0)?;
        for index in 0..n {
            if socket.poll(zmq::POLLIN, limit)? == 0 {
                bail!("no ZeroMQ stream item within {CALL_LIMIT:?}");
            }
            let item = socket.recv_msg(0)?;
            ensure!(
                !socket.get_rcvmore()?,
                "a stream item of more than one part"
            );
            each(&item, index)?;
            socket.send("credit", 0)?;
        }
        Ok(())
    };
    run(1, &mut |item, _| check_item(item, &pattern, true))?;
    let mut timer = StreamTimer::start();
    for stream in 0..STREAMS {
        timer.stream();
        run(items, &mut |item, index| {
            timer.item();
            check_item(item, &pattern, stream == 0 && index == 0)
        })?;
    }
    Ok(timer)
}

/// One case on `concurrency` threads: every latency and the wall time in seconds.
fn zmq_case(
    servers: &[String],
    op: &'static str,
    size: u64,
    concurrency: usize,
    seconds: f64,
) -> Result<(Vec<f64>, f64)> {
    let ctx = zmq::Context::new();
    let arg = Arc::new(Bytes::from(argument(size)?.data.to_vec()));
    let mut warm = ZmqCaller::connect(&ctx, servers, 0)?;
    for _ in 0..WARMUP_PER_SERVER * servers.len() {
        let (_, got) = warm.call(op, &arg)?;
        check_bytes(op, &arg, &got, true)?;
    }
    drop(warm);
    // Every caller connects first; the clock starts once all are ready.
    let ready = Barrier::new(concurrency + 1);
    let start = std::thread::scope(|scope| {
        let callers: Vec<_> = (0..concurrency)
            .map(|caller| {
                let (ctx, arg, ready) = (&ctx, &arg, &ready);
                scope.spawn(move || {
                    let connected = ZmqCaller::connect(ctx, servers, caller);
                    ready.wait();
                    let mut me = connected?;
                    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
                    let mut latencies = Vec::new();
                    loop {
                        let (latency, got) = me.call(op, arg)?;
                        latencies.push(latency);
                        check_bytes(op, arg, &got, false)?;
                        if Instant::now() >= deadline {
                            return anyhow::Ok(latencies);
                        }
                    }
                })
            })
            .collect();
        ready.wait();
        let start = Instant::now();
        let mut latencies = Vec::new();
        for caller in callers {
            match caller.join() {
                Ok(got) => latencies.extend(got?),
                Err(_) => bail!("a ZeroMQ calling thread panicked"),
            }
        }
        Ok((latencies, start.elapsed().as_secs_f64()))
    })?;
    Ok(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_answer_each_op_and_refuse_what_is_no_f32_tensor() {
        let x = Bytes::from(argument(64).expect("argument").data.to_vec());
        let echoed = answer("echo", x.clone()).expect("echo");
        check_bytes("echo", &x, &echoed, true).expect("echo returns its argument");
        let plus = answer("add_one", x.clone()).expect("add_one");
        check_bytes("add_one", &x, &plus, true).expect("x + 1");
        assert!(answer("add_one", Bytes::from_static(b"abc")).is_err());
        assert!(answer("sum", x).is_err());
        assert_eq!(path("echo"), format!("/{SERVICE}/echo"));
        assert_eq!(path("add_one"), format!("/{SERVICE}/add_one"));
    }
}
