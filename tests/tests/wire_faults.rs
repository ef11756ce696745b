//! A node facing misbehaving peers: raw iroh endpoints that speak `tb/data/1` wrongly on
//! purpose. The node must refuse bad input with typed errors, never allocate what a frame
//! merely claims, and keep serving everyone else.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use iroh::{
    Endpoint, SecretKey,
    endpoint::{Connection, RecvStream, SendStream, VarInt},
    protocol::{AcceptError, ProtocolHandler, Router},
};
use tb_node::{
    Config, ContentHash, Error, Node, PeerAddr,
    proto::{CloseCode, DATA_ALPN, DataRequest, DataResponse, ErrorCode, TensorName, frame},
};
use tb_tests::{
    f32_tensor, node, pattern, raw_client_hello, raw_server_hello, test_config, within,
};

const LIMIT: Duration = Duration::from_secs(30);

async fn raw_endpoint() -> Endpoint {
    tb_node::bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("raw endpoint")
}

/// A raw connection that passes the hello (these peers misbehave after it, not in it).
async fn raw_connect(ep: &Endpoint, to: &Node) -> Connection {
    let conn = ep
        .connect(to.addr().to_endpoint_addr(), DATA_ALPN)
        .await
        .expect("connect");
    raw_client_hello(&conn, ep.id()).await;
    conn
}

async fn read_response(recv: &mut RecvStream) -> DataResponse {
    let mut prefix = [0u8; 4];
    recv.read_exact(&mut prefix).await.expect("prefix");
    let len = frame::body_len(prefix).expect("len");
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.expect("body");
    frame::decode_body(&body).expect("decode")
}

async fn send_frame(send: &mut SendStream, msg: &DataRequest) {
    send.write_all(&frame::encode(msg).expect("encode"))
        .await
        .expect("write");
}

/// After whatever abuse, the node still serves a normal pull on a fresh stream.
async fn still_serves(conn: &Connection) {
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    let pull = DataRequest::Pull {
        name: TensorName::new("ok").expect("name"),
        version: None,
        range: None,
    };
    send_frame(&mut send, &pull).await;
    send.finish().expect("finish");
    match read_response(&mut recv).await {
        DataResponse::Header { meta, .. } => assert_eq!(meta, *f32_tensor(8, 1).meta()),
        other => panic!("expected a header, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_frame_is_refused_without_allocating() {
    let b = node(test_config()).await;
    b.publish_local("ok", f32_tensor(8, 1)).expect("publish");
    let ep = raw_endpoint().await;
    let conn = raw_connect(&ep, &b).await;
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    // Claim a 2 GiB control frame and send nothing more: a node that believed the length
    // would allocate and wait for the body; ours answers at once.
    send.write_all(&(2u32 << 30).to_le_bytes())
        .await
        .expect("write");
    match within(LIMIT, "refusal", read_response(&mut recv)).await {
        DataResponse::Error { code, .. } => assert_eq!(code, ErrorCode::TooLarge),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    still_serves(&conn).await;
    ep.close().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_over_the_size_limit_is_refused_before_its_payload() {
    let b = node(Config {
        max_tensor_bytes: 1 << 20,
        ..test_config()
    })
    .await;
    let a = node(test_config()).await;
    let big = tb_node::Tensor::from_bytes(pattern(2 << 20, 1));
    match within(LIMIT, "push", a.push(b.addr(), "big", &big)).await {
        Err(Error::TooLarge(msg)) => assert!(msg.contains("limit"), "{msg}"),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(b.inbox_len(), 0);
    // Pulling something bigger than our own limit is refused too.
    let small_limit = node(Config {
        max_tensor_bytes: 1000,
        ..test_config()
    })
    .await;
    b.publish_local("mid", tb_node::Tensor::from_bytes(pattern(4000, 2)))
        .expect("publish");
    assert!(matches!(
        small_limit.pull(b.addr(), "mid", None).await,
        Err(Error::TooLarge(_))
    ));
    for n in [a, b, small_limit] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_end_the_stream_not_the_node() {
    let b = node(test_config()).await;
    b.publish_local("ok", f32_tensor(8, 1)).expect("publish");
    let ep = raw_endpoint().await;
    let conn = raw_connect(&ep, &b).await;
    for garbage in [
        vec![3, 0, 0, 0, 0xff, 0xff, 0xff],
        vec![0, 0, 0, 0],
        vec![5, 0, 0, 0, 9, 9, 9, 9, 9],
    ] {
        let (mut send, mut recv) = conn.open_bi().await.expect("open");
        send.write_all(&garbage).await.expect("write");
        send.finish().expect("finish");
        match within(LIMIT, "refusal", read_response(&mut recv)).await {
            DataResponse::Error { code, .. } => {
                assert_eq!(code, ErrorCode::Malformed, "{garbage:?}")
            }
            other => panic!("expected Malformed, got {other:?}"),
        }
    }
    // Same connection, next stream: still served. And another node is unaffected.
    still_serves(&conn).await;
    let c = node(test_config()).await;
    c.pull(b.addr(), "ok", None)
        .await
        .expect("others are served");
    ep.close().await;
    b.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_push_is_detected_and_not_delivered() {
    let b = node(test_config()).await;
    b.publish_local("ok", f32_tensor(8, 1)).expect("publish");
    let ep = raw_endpoint().await;
    let conn = raw_connect(&ep, &b).await;
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    let good = f32_tensor(1024, 3);
    let mut meta = good.meta().clone();
    meta.hash = ContentHash::of(b"something else");
    let push = DataRequest::Push {
        name: TensorName::new("bad").expect("name"),
        meta,
    };
    send_frame(&mut send, &push).await;
    send.write_all(good.data()).await.expect("payload");
    send.finish().expect("finish");
    match within(LIMIT, "answer", read_response(&mut recv)).await {
        DataResponse::Error { code, .. } => assert_eq!(code, ErrorCode::Corrupt),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(
        matches!(
            b.recv_timeout(Duration::from_millis(200)).await,
            Err(Error::Timeout { .. })
        ),
        "a corrupt tensor is never delivered"
    );
    still_serves(&conn).await;
    ep.close().await;
    b.shutdown().await;
}

/// A peer that announces one hash and sends other bytes.
#[derive(Debug, Clone)]
struct LyingServer(iroh::EndpointId);

impl ProtocolHandler for LyingServer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !raw_server_hello(&conn, self.0).await {
            return Ok(());
        }
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let mut prefix = [0u8; 4];
            if recv.read_exact(&mut prefix).await.is_err() {
                break;
            }
            let mut body = vec![0u8; frame::body_len(prefix).unwrap_or(0)];
            let _ = recv.read_exact(&mut body).await;
            let truth = f32_tensor(4096, 1);
            let header = DataResponse::Header {
                meta: truth.meta().clone(),
                version: 1,
            };
            let mut flipped = truth.data().to_vec();
            flipped[1000] ^= 0x01;
            let _ = send
                .write_all(&frame::encode(&header).expect("encode"))
                .await;
            let _ = send.write_chunk(Bytes::from(flipped)).await;
            let _ = send.finish();
            let _ = send.stopped().await;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_pull_is_an_error_never_a_tensor() {
    let ep = raw_endpoint().await;
    let liar = PeerAddr {
        id: ep.id(),
        addr: ep.bound_sockets()[0],
    };
    let me = ep.id();
    let router = Router::builder(ep)
        .accept(DATA_ALPN, LyingServer(me))
        .spawn();
    let a = node(test_config()).await;
    match within(LIMIT, "pull", a.pull(&liar, "anything", None)).await {
        Err(Error::Corrupt(msg)) => assert!(msg.contains("anything"), "{msg}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    a.shutdown().await;
    let _ = router.shutdown().await;
}

/// A peer that accepts streams and never answers.
#[derive(Debug, Clone)]
struct SilentServer(iroh::EndpointId);

impl ProtocolHandler for SilentServer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !raw_server_hello(&conn, self.0).await {
            return Ok(());
        }
        let mut held = Vec::new();
        while let Ok(streams) = conn.accept_bi().await {
            held.push(streams);
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out() {
    let ep = raw_endpoint().await;
    let silent = PeerAddr {
        id: ep.id(),
        addr: ep.bound_sockets()[0],
    };
    let me = ep.id();
    let router = Router::builder(ep)
        .accept(DATA_ALPN, SilentServer(me))
        .spawn();
    let a = node(Config {
        request_timeout: Duration::from_millis(300),
        ..test_config()
    })
    .await;
    match within(LIMIT, "pull", a.pull(&silent, "x", None)).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    a.shutdown().await;
    let _ = router.shutdown().await;
}

/// A peer whose idle close races with our first request: it closes its first link with
/// `IdleEvicted` the moment that request arrives, unanswered (as a node does that closed an
/// idle link just as the request was on its way), and serves later links honestly.
#[derive(Debug, Clone)]
struct IdleRacingServer {
    me: iroh::EndpointId,
    closed_one: Arc<AtomicBool>,
}

impl ProtocolHandler for IdleRacingServer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !raw_server_hello(&conn, self.me).await {
            return Ok(());
        }
        let race = !self.closed_one.swap(true, Ordering::SeqCst);
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let mut prefix = [0u8; 4];
            if recv.read_exact(&mut prefix).await.is_err() {
                break;
            }
            let mut body = vec![0u8; frame::body_len(prefix).unwrap_or(0)];
            let _ = recv.read_exact(&mut body).await;
            let request = frame::decode_body::<DataRequest>(&body);
            // The link's channel exchange is answered; the first request after it races.
            if race && !matches!(request, Ok(DataRequest::Channels { .. })) {
                let code = CloseCode::IdleEvicted;
                conn.close(VarInt::from_u32(code.code()), code.reason());
                break;
            }
            let answer = match request {
                // It offers no TCP channel, so a TCP pull is never asked: answered as a pull.
                Ok(DataRequest::Pull { .. } | DataRequest::TcpPull { .. }) => {
                    let truth = f32_tensor(4096, 1);
                    let header = DataResponse::Header {
                        meta: truth.meta().clone(),
                        version: 1,
                    };
                    let mut bytes = frame::encode(&header).expect("encode");
                    bytes.extend_from_slice(truth.data());
                    bytes
                }
                Ok(DataRequest::Push { meta, .. }) => {
                    let mut payload = vec![0u8; meta.byte_len as usize];
                    let _ = recv.read_exact(&mut payload).await;
                    frame::encode(&DataResponse::Ack).expect("encode")
                }
                // No channels besides QUIC.
                Ok(DataRequest::Channels { .. }) => {
                    let none = DataResponse::Channels { offers: Vec::new() };
                    frame::encode(&none).expect("encode")
                }
                // Pulled directly, never asked for pieces; nobody subscribes.
                Ok(
                    DataRequest::Pieces { .. }
                    | DataRequest::Watch { .. }
                    | DataRequest::Call { .. }
                    | DataRequest::Ctl
                    | DataRequest::CudaIpc(_),
                )
                | Err(_) => break,
            };
            let _ = send.write_all(&answer).await;
            let _ = send.finish();
            let _ = send.stopped().await;
        }
        Ok(())
    }
}

/// A node and an [`IdleRacingServer`] it can reach.
async fn idle_racing_server() -> (Node, PeerAddr, Router) {
    let ep = raw_endpoint().await;
    let at = PeerAddr {
        id: ep.id(),
        addr: ep.bound_sockets()[0],
    };
    let server = IdleRacingServer {
        me: ep.id(),
        closed_one: Arc::default(),
    };
    let router = Router::builder(ep).accept(DATA_ALPN, server).spawn();
    (node(test_config()).await, at, router)
}

/// Regression: a pull whose link the peer closed as idle just as the request was on its way
/// failed ("connection lost") instead of being sent again on a fresh link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_racing_the_peers_idle_close_is_redialed_not_failed() {
    let (a, at, router) = idle_racing_server().await;
    let pulled = within(LIMIT, "pull", a.pull(&at, "w", None)).await;
    let pulled = pulled.expect("the pull is redialed, not failed");
    assert_eq!(pulled.buffer.data(), f32_tensor(4096, 1).data());
    assert_eq!(a.pool_stats().dials, 2, "one redial");
    a.shutdown().await;
    let _ = router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_racing_the_peers_idle_close_is_redialed_not_failed() {
    let (a, at, router) = idle_racing_server().await;
    let pushed = within(LIMIT, "push", a.push(&at, "w", &f32_tensor(4096, 2))).await;
    pushed.expect("the push is redialed, not failed");
    assert_eq!(a.pool_stats().dials, 2, "one redial");
    a.shutdown().await;
    let _ = router.shutdown().await;
}
