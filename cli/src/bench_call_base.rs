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
    BLOCKING_MIN, CALL_LIMIT, CallBenchArgs, Case, WARMUP_PER_SERVER, argument, check_bytes,
    each_case, plus_one_bytes, timed,
};

/// The gRPC baseline's system name.
pub(crate) const GRPC: &str = "grpc";
/// The ZeroMQ baseline's system name.
pub(crate) const ZMQ: &str = "zmq";

/// The gRPC service's name.
const SERVICE: &str = "tb.bench.Bench";
/// How often a ZeroMQ server looks whether it should stop.
const ZMQ_POLL_MS: i64 = 100;

/// The gRPC method path of an op.
fn path(op: &str) -> &'static str {
    match op {
        "echo" => "/tb.bench.Bench/echo",
        _ => "/tb.bench.Bench/add_one",
    }
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

/// The gRPC service: `echo` and `add_one`, routed by path.
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

/// Every case of `args` against the gRPC servers at `servers`.
pub(crate) async fn measure_grpc(servers: &[String], args: &CallBenchArgs) -> Result<Vec<Case>> {
    let mut clients = Vec::new();
    for addr in servers {
        clients.push(grpc_client(addr).await?);
    }
    each_case(args, GRPC, servers.len(), |op, size, concurrency| {
        grpc_case(clients.clone(), op, size, concurrency, args.seconds)
    })
    .await
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
    let socket = ctx.socket(zmq::REP)?;
    socket.set_linger(0)?;
    socket.bind("tcp://127.0.0.1:*")?;
    let endpoint = socket
        .get_last_endpoint()?
        .map_err(|raw| anyhow::anyhow!("endpoint {raw:?} is not UTF-8"))?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answering = {
        let stop = stop.clone();
        std::thread::spawn(move || zmq_answer(&socket, &stop))
    };
    println!("ready {endpoint}");
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered = tokio::task::spawn_blocking(move || answering.join()).await?;
    answered.map_err(|_| anyhow::anyhow!("the ZeroMQ server thread panicked"))?
}

/// Answers requests on `socket` until `stop` is set.
fn zmq_answer(socket: &zmq::Socket, stop: &std::sync::atomic::AtomicBool) -> Result<()> {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if socket.poll(zmq::POLLIN, ZMQ_POLL_MS)? == 0 {
            continue;
        }
        let op = socket.recv_msg(0)?;
        ensure!(socket.get_rcvmore()?, "a request without its argument");
        let x = socket.recv_msg(0)?;
        // A request of more parts than two is drained and refused.
        let mut extra = false;
        while socket.get_rcvmore()? {
            socket.recv_msg(0)?;
            extra = true;
        }
        let reply = match (op.as_str(), extra) {
            (_, true) => Err("a request is [op, argument]".to_string()),
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

/// Sends `data` as the last part of a message without copying it.
#[allow(unsafe_code)]
fn send_const(socket: &mut zmq::Socket, data: &Arc<Bytes>) -> Result<()> {
    // SAFETY: `zmq_send_const` reads `data` until libzmq has sent it. A REQ socket sends one
    // request and then waits for its answer, which the server writes only after it received
    // the whole request; the caller holds `data` (an `Arc` it keeps) until that answer came
    // or the socket is closed with linger 0 (pending messages dropped, never read again).
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

/// Every case of `args` against the ZeroMQ servers at `servers`.
pub(crate) async fn measure_zmq(servers: &[String], args: &CallBenchArgs) -> Result<Vec<Case>> {
    each_case(args, ZMQ, servers.len(), |op, size, concurrency| {
        let (endpoints, seconds) = (servers.to_vec(), args.seconds);
        async move {
            let case = move || zmq_case(&endpoints, op, size, concurrency, seconds);
            tokio::task::spawn_blocking(case).await?
        }
    })
    .await
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
