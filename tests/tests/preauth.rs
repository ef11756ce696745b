//! What a peer without the cluster secret can make a node hold before its hello is verified:
//! one stream, a few KiB, for a few seconds, with a bounded number of such peers at once.
//! Attackers here are raw iroh endpoints with fresh keys and no secret; the node under attack
//! is a real `tb-worker` process where memory is measured, an in-process node or broker
//! elsewhere. Every refusal must show up in `tb_auth_failures_total{reason}`.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    process::Command,
    time::Duration,
};

use bytes::Bytes;
use iroh::{
    Endpoint, SecretKey,
    endpoint::{Connection, ConnectionError, VarInt},
};
use tb_broker::{Broker, BrokerOptions};
use tb_node::{
    AuthFailure, Config, DEFAULT_HELLO_TIMEOUT, PeerAddr,
    proto::{CTL_ALPN, CloseCode, ClusterKey, DATA_ALPN},
};
use tb_tests::{
    f32_tensor, http,
    procs::{Proc, bin},
    raw_client_hello, test_config, within,
};

const LIMIT: Duration = Duration::from_secs(60);
const START: Duration = Duration::from_secs(30);
/// Slack on top of a hello timeout before a connection must have been closed.
const CLOSE_SLACK: Duration = Duration::from_secs(10);
const SECRET: &str = "preauth-test-cluster-secret-of-some-length";

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET.as_bytes()).expect("secret")
}

/// An endpoint with a fresh key; it knows no secret.
async fn attacker() -> Endpoint {
    tb_node::bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("attacker endpoint")
}

async fn connect(ep: &Endpoint, to: &PeerAddr, alpn: &[u8]) -> Connection {
    within(LIMIT, "connect", ep.connect(to.to_endpoint_addr(), alpn))
        .await
        .expect("the QUIC handshake itself needs no secret")
}

/// The application close code `conn` ends with, waiting at most `limit`.
async fn close_code(conn: &Connection, limit: Duration) -> Option<CloseCode> {
    match within(limit, "the node closing the connection", conn.closed()).await {
        ConnectionError::ApplicationClosed(close) => {
            let code = u32::try_from(close.error_code.into_inner()).ok()?;
            CloseCode::from_code(code)
        }
        other => panic!("expected an application close, got {other:?}"),
    }
}

fn close_of(code: CloseCode) -> VarInt {
    VarInt::from_u32(code.code())
}

// ---- a real tb-worker process ----

/// A broker and a worker process on `127.0.0.1:0`, with a secret file.
struct Procs {
    _dir: tempfile::TempDir,
    broker: Proc,
    broker_addr: PeerAddr,
    broker_metrics: String,
    worker: Proc,
    worker_addr: PeerAddr,
    worker_metrics: String,
}

impl Procs {
    fn start() -> Procs {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
        let daemon = |bin: Command, name: &str| {
            let mut cmd = bin;
            cmd.arg("--data-dir")
                .arg(dir.path().join(name))
                .args(["--listen", "127.0.0.1:0"])
                .arg("--cluster-secret-file")
                .arg(&secret)
                .args(["--metrics-addr", "127.0.0.1:0"]);
            cmd
        };
        let cmd = daemon(Command::new(bin("tb-broker")), "broker");
        let mut broker = Proc::start("broker", cmd, &dir.path().join("broker.log"));
        let ticket: tb_node::Ticket = broker.wait_line("ticket:", START).parse().expect("ticket");
        let broker_metrics = broker.wait_line("metrics:", START);
        let mut cmd = daemon(Command::new(bin("tb-worker")), "worker");
        cmd.arg("--join").arg(ticket.to_string());
        let mut worker = Proc::start("worker", cmd, &dir.path().join("worker.log"));
        let worker_addr = worker.wait_line("worker:", START).parse().expect("addr");
        let worker_metrics = worker.wait_line("metrics:", START);
        Procs {
            _dir: dir,
            broker,
            broker_addr: ticket.brokers[0].clone(),
            broker_metrics,
            worker,
            worker_addr,
            worker_metrics,
        }
    }
}

/// `field` (e.g. `VmRSS`, `VmHWM`) of process `pid`, in KiB.
fn vm_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// One sample of a process's `/metrics` page, 0 when absent.
fn sample(metrics_url: &str, series: &str) -> f64 {
    let (status, page) = http::get(&format!("{metrics_url}/metrics")).expect("metrics");
    assert_eq!(status, 200);
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

fn auth_failures(metrics_url: &str, reason: AuthFailure) -> f64 {
    let series = format!("tb_auth_failures_total{{reason=\"{}\"}}", reason.as_str());
    sample(metrics_url, &series)
}

/// Streams the attacker tries to fill, and how much it writes on each (one stream window:
/// what the old code buffered per stream).
const FLOOD_STREAMS: usize = 400;
const FLOOD_BYTES: usize = 1_250_000;
/// Most the worker's peak memory may grow during the attack. The old code grew by ~500 MiB
/// (every flooded stream's window buffered); now the pre-auth window bounds it to a few KiB
/// plus the connection's own state, and this leaves room for allocator noise.
const MAX_GROWTH_KIB: u64 = 64 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_stream_flood_is_cut_off_at_the_hello_deadline_with_bounded_memory() {
    let mut procs = Procs::start();
    let pid = procs.worker.pid();
    let before = vm_kib(pid, "VmRSS");
    let ep = attacker().await;
    let conn = connect(&ep, &procs.worker_addr, DATA_ALPN).await;
    // The first stream (the hello's) stays silent; every other one is filled.
    let (_silent_send, _silent_recv) = conn.open_bi().await.expect("the hello stream");
    let payload = Bytes::from(vec![0x5a; FLOOD_BYTES]);
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..FLOOD_STREAMS {
        let (conn, payload) = (conn.clone(), payload.clone());
        flood.spawn(async move {
            let (mut send, _recv) = conn.open_bi().await.ok()?;
            let written = send.write_chunk(payload).await.is_ok();
            Some(written)
        });
    }
    // The node must close the connection at its hello deadline; memory is read then (or
    // once the slack has passed too, on a node that never closes it).
    let closed = tokio::time::timeout(DEFAULT_HELLO_TIMEOUT + CLOSE_SLACK, conn.closed()).await;
    let peak = vm_kib(pid, "VmHWM");
    eprintln!(
        "worker memory: VmRSS before {before} KiB, VmHWM after {peak} KiB, growth {} KiB",
        peak.saturating_sub(before)
    );
    assert!(
        peak.saturating_sub(before) < MAX_GROWTH_KIB,
        "peak RSS grew from {before} KiB to {peak} KiB"
    );
    match closed {
        Ok(ConnectionError::ApplicationClosed(close)) => {
            assert_eq!(close.error_code, close_of(CloseCode::ProtocolError));
        }
        other => panic!("expected a close at the hello deadline, got {other:?}"),
    }
    let opened = within(LIMIT, "the flood ending", flood.join_all())
        .await
        .into_iter()
        .filter(Option::is_some)
        .count();
    assert_eq!(opened, 0, "no stream beyond the hello's was granted");
    let url = procs.worker_metrics.clone();
    assert_eq!(auth_failures(&url, AuthFailure::Timeout), 1.0);
    for reason in [AuthFailure::BadProof, AuthFailure::TooManyPending] {
        assert_eq!(auth_failures(&url, reason), 0.0, "{reason:?}");
    }
    assert!(
        procs.worker.terminate(Duration::from_secs(15)),
        "graceful exit"
    );
    assert!(
        procs.broker.terminate(Duration::from_secs(15)),
        "graceful exit"
    );
    ep.close().await;
}

/// The sockets (by inode) process `pid` holds.
fn socket_inodes(pid: u32) -> HashSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_str()?;
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// An address as `/proc/net/{udp,tcp}[6]` prints it: the IP's 32-bit words in host order
/// (this machine is little-endian), then the port.
fn proc_net_addr(field: &str) -> SocketAddr {
    let (ip, port) = field.split_once(':').expect("ip:port");
    let port = u16::from_str_radix(port, 16).expect("port");
    let words: Vec<[u8; 4]> = (0..ip.len() / 8)
        .map(|i| {
            u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16)
                .expect("hex")
                .to_le_bytes()
        })
        .collect();
    let ip = match words.as_slice() {
        [w] => IpAddr::V4(Ipv4Addr::from(*w)),
        [a, b, c, d] => {
            let mut bytes = [0u8; 16];
            for (i, w) in [a, b, c, d].into_iter().enumerate() {
                bytes[i * 4..i * 4 + 4].copy_from_slice(w);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => panic!("unexpected address {field}"),
    };
    SocketAddr::new(ip, port)
}

/// The local addresses of `pid`'s own sockets in `/proc/<pid>/net/<table>`, with the
/// state column (`0A` is a listening TCP socket).
fn own_sockets(pid: u32, table: &str) -> Vec<(SocketAddr, String)> {
    let inodes = socket_inodes(pid);
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).expect(table);
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let inode: u64 = cols.get(9)?.parse().ok()?;
            inodes
                .contains(&inode)
                .then(|| (proc_net_addr(cols[1]), cols[3].to_string()))
        })
        .collect()
}

fn assert_listens_only_on(pid: u32, label: &str, quic: &PeerAddr, metrics_url: &str) {
    let metrics: SocketAddr = metrics_url
        .strip_prefix("http://")
        .and_then(|a| a.parse().ok())
        .expect("metrics address");
    let udp: Vec<SocketAddr> = own_sockets(pid, "udp").into_iter().map(|s| s.0).collect();
    let udp6 = own_sockets(pid, "udp6");
    assert_eq!(udp, vec![quic.addr], "{label}: UDP sockets");
    assert!(quic.addr.ip().is_loopback() && quic.addr.port() != 0);
    assert_eq!(udp6, Vec::new(), "{label}: no IPv6 UDP socket");
    let listening: Vec<SocketAddr> = ["tcp", "tcp6"]
        .into_iter()
        .flat_map(|t| own_sockets(pid, t))
        .filter(|(_, state)| state == "0A")
        .map(|s| s.0)
        .collect();
    assert_eq!(listening, vec![metrics], "{label}: TCP listeners");
}

#[test]
fn daemons_listen_only_on_the_addresses_they_were_given() {
    if !Path::new("/proc/self/net/udp6").exists() {
        eprintln!("no /proc/<pid>/net here: nothing to check");
        return;
    }
    let mut procs = Procs::start();
    let worker = (
        procs.worker.pid(),
        &procs.worker_addr,
        &procs.worker_metrics,
    );
    assert_listens_only_on(worker.0, "worker", worker.1, worker.2);
    let broker = (
        procs.broker.pid(),
        &procs.broker_addr,
        &procs.broker_metrics,
    );
    assert_listens_only_on(broker.0, "broker", broker.1, broker.2);
    assert!(
        procs.worker.terminate(Duration::from_secs(15)),
        "graceful exit"
    );
    assert!(
        procs.broker.terminate(Duration::from_secs(15)),
        "graceful exit"
    );
}

// ---- in-process nodes and brokers ----

fn member_config() -> Config {
    Config {
        cluster_key: key(),
        ..test_config()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_and_malformed_hellos_are_refused_by_reason() {
    // A long hello timeout: a refusal seen well before it is the frame's, not the deadline's.
    let node = tb_tests::node(Config {
        hello_timeout: Duration::from_secs(120),
        ..member_config()
    })
    .await;
    let ep = attacker().await;
    let failures = &node.metrics().auth_failures;

    // A 64 KiB hello: refused on its length prefix, before the body is read or allocated. Its
    // body cannot even reach the node: the pre-auth window lets a few KiB through.
    let conn = connect(&ep, node.addr(), DATA_ALPN).await;
    let (mut send, _recv) = conn.open_bi().await.expect("hello stream");
    let mut frame = (64u32 << 10).to_le_bytes().to_vec();
    frame.resize(4 + (64 << 10), 0x77);
    let writer = tokio::spawn(async move { send.write_all(&frame).await.is_ok() });
    assert_eq!(
        close_code(&conn, LIMIT).await,
        Some(CloseCode::ProtocolError)
    );
    assert!(
        !within(LIMIT, "write", writer).await.expect("task"),
        "never all sent"
    );
    assert_eq!(failures.get(AuthFailure::TooLarge), 1);

    // A frame of the right size that is not a hello, and a hello cut short.
    let not_a_hello = {
        let mut f = 40u32.to_le_bytes().to_vec();
        f.extend([1u8; 40]);
        f
    };
    let cut_short = {
        let mut f = 32u32.to_le_bytes().to_vec();
        f.extend([1u8; 10]);
        f
    };
    for bytes in [not_a_hello, cut_short] {
        let conn = connect(&ep, node.addr(), DATA_ALPN).await;
        let (mut send, _recv) = conn.open_bi().await.expect("hello stream");
        send.write_all(&bytes).await.expect("write");
        send.finish().expect("finish");
        assert_eq!(
            close_code(&conn, LIMIT).await,
            Some(CloseCode::ProtocolError)
        );
    }
    assert_eq!(failures.get(AuthFailure::Malformed), 2);
    assert_eq!(failures.get(AuthFailure::Timeout), 0);
    assert_eq!(failures.total(), 3);

    // Members still get in.
    let member = tb_tests::node(member_config()).await;
    node.publish_local("ok", f32_tensor(16, 1))
        .expect("publish");
    within(LIMIT, "pull", member.pull(node.addr(), "ok", None))
        .await
        .expect("a member pulls");
    ep.close().await;
    member.shutdown().await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_pending_handshakes_are_refused_and_counted() {
    let hello_timeout = Duration::from_secs(3);
    let node = tb_tests::node(Config {
        max_pending_handshakes: 2,
        hello_timeout,
        ..member_config()
    })
    .await;
    let ep = attacker().await;
    // Three silent connections for two waiting slots: whichever arrives last is refused at
    // once, the other two at the hello deadline.
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(connect(&ep, node.addr(), DATA_ALPN).await);
    }
    let mut codes = Vec::new();
    for conn in &conns {
        codes.push(close_code(conn, hello_timeout + CLOSE_SLACK).await);
    }
    let count = |code| codes.iter().filter(|c| **c == Some(code)).count();
    assert_eq!(count(CloseCode::TooManyHandshakes), 1, "{codes:?}");
    assert_eq!(count(CloseCode::ProtocolError), 2, "{codes:?}");
    let failures = &node.metrics().auth_failures;
    assert_eq!(failures.get(AuthFailure::TooManyPending), 1);
    assert_eq!(failures.get(AuthFailure::Timeout), 2);
    // The slots are free again: a member gets in.
    let member = tb_tests::node(member_config()).await;
    node.publish_local("ok", f32_tensor(16, 1))
        .expect("publish");
    within(LIMIT, "pull", member.pull(node.addr(), "ok", None))
        .await
        .expect("a member pulls");
    ep.close().await;
    member.shutdown().await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_ctl_peer_gets_one_stream_and_is_cut_off_at_the_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hello_timeout = Duration::from_secs(2);
    let mut opts = BrokerOptions::new(dir.path().join("broker"));
    opts.node = Config {
        hello_timeout,
        ..member_config()
    };
    let broker = within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker");
    let ep = attacker().await;
    let conn = connect(&ep, broker.addr(), CTL_ALPN).await;
    let (_hello_send, _hello_recv) = conn.open_bi().await.expect("the hello stream");
    // A second stream is not granted before the hello is verified: opening it waits.
    let second = tokio::time::timeout(Duration::from_millis(500), conn.open_bi()).await;
    assert!(
        second.is_err(),
        "a second stream was granted before the hello"
    );
    assert_eq!(
        close_code(&conn, hello_timeout + CLOSE_SLACK).await,
        Some(CloseCode::ProtocolError)
    );
    let failures = &broker.counters().auth_failures;
    assert_eq!(failures.get(AuthFailure::Timeout), 1);
    assert_eq!(failures.total(), 1);
    ep.close().await;
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_member_may_open_many_streams() {
    // The open (secret-less) cluster, so the raw test hello passes.
    let node = tb_tests::node(test_config()).await;
    let ep = attacker().await;
    let conn = connect(&ep, node.addr(), DATA_ALPN).await;
    raw_client_hello(&conn, ep.id()).await;
    let mut streams = Vec::new();
    for _ in 0..16 {
        let opened = within(START, "open a stream", conn.open_bi()).await;
        streams.push(opened.expect("stream after the hello"));
    }
    conn.close(close_of(CloseCode::Normal), b"done");
    ep.close().await;
    node.shutdown().await;
}

/// Connections and streams per connection of the request-frame flood.
const MEMBER_CONNECTIONS: usize = 4;
const MEMBER_STREAMS: usize = 256;

/// Regression (measured on 3f1de9a: +1,065 MiB): a member holding only the read-only
/// credential opens several connections and many streams on each, and announces a 1 MiB
/// request frame on every one, then sends almost all of it. A data request is capped at a few
/// KiB on its length prefix, before anything is allocated: each stream is refused
/// `TooLarge`, the worker's peak memory stays bounded, and it keeps serving an honest member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_members_request_frame_flood_is_refused_with_bounded_memory() {
    let procs = Procs::start();
    let pid = procs.worker.pid();
    let before = vm_kib(pid, "VmRSS");
    let body = Bytes::from(vec![0x5a; (1 << 20) - 1]);
    let mut prefix = (1u32 << 20).to_le_bytes().to_vec();
    prefix.extend_from_slice(&body);
    let frame = Bytes::from(prefix);
    let mut conns = Vec::new();
    let mut flood = tokio::task::JoinSet::new();
    let read_only = key().read_only();
    for _ in 0..MEMBER_CONNECTIONS {
        let ep = attacker().await;
        let conn = connect(&ep, &procs.worker_addr, DATA_ALPN).await;
        let hello = tb_node::auth::client_hello(
            &conn,
            ep.id(),
            &read_only,
            DATA_ALPN,
            LIMIT,
            Config::default().max_concurrent_streams,
        );
        within(LIMIT, "a read-only member's hello", hello)
            .await
            .expect("the read-only credential is a member's");
        for _ in 0..MEMBER_STREAMS {
            let (conn, frame) = (conn.clone(), frame.clone());
            flood.spawn(async move {
                let (mut send, mut recv) = conn.open_bi().await.ok()?;
                let _ = send.write_chunk(frame).await;
                tb_node::framing::read_frame::<tb_node::proto::DataResponse>(&mut recv)
                    .await
                    .ok()
            });
        }
        conns.push((ep, conn));
    }
    let answers = within(LIMIT, "the flood's answers", flood.join_all()).await;
    let peak = vm_kib(pid, "VmHWM");
    eprintln!(
        "worker memory under a read-only member's request flood: VmRSS before {before} KiB, \
         VmHWM after {peak} KiB, growth {} KiB",
        peak.saturating_sub(before)
    );
    assert!(
        peak.saturating_sub(before) < MAX_GROWTH_KIB,
        "peak RSS grew from {before} KiB to {peak} KiB"
    );
    let too_large = answers
        .iter()
        .filter(|a| {
            matches!(
                a,
                Some(tb_node::proto::DataResponse::Error {
                    code: tb_node::proto::ErrorCode::TooLarge,
                    ..
                })
            )
        })
        .count();
    assert_eq!(
        too_large,
        MEMBER_CONNECTIONS * MEMBER_STREAMS,
        "every oversized request refused TooLarge"
    );
    // The worker still serves an honest member.
    let honest = tb_tests::node(Config {
        cluster_key: key(),
        ..test_config()
    })
    .await;
    let err = within(
        LIMIT,
        "an honest pull",
        honest.pull(&procs.worker_addr, "absent", None),
    )
    .await
    .expect_err("nothing is held under that name");
    assert!(matches!(err, tb_node::Error::NotFound { .. }), "{err:?}");
    honest.shutdown().await;
    drop(conns);
}
