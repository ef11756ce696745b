//! The opt-in TCP channel: pulls between two nodes move byte-identical over token-admitted
//! sockets (several for large tensors; small ones over QUIC on the ticket's stream);
//! sockets without a valid token are closed before any tensor byte and counted; tampered
//! TCP bytes are never returned (the pull is made again over QUIC); a socket cut mid-transfer is finished over QUIC from the byte it reached.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use iroh::{
    Endpoint, SecretKey,
    endpoint::{Connection, RecvStream, SendStream},
    protocol::{AcceptError, ProtocolHandler, Router},
};
use tb_node::{
    Config, Error, Node, PeerAddr, Tensor,
    proto::{
        ByteRange, ChannelKind, ChannelOffer, DATA_ALPN, DType, DataRequest, DataResponse,
        TcpHello, TensorName, frame,
    },
};
use tb_tests::{node, pattern, raw_client_hello, raw_server_hello, test_config, within};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

const LIMIT: Duration = Duration::from_secs(60);
const TCP_FIRST: [ChannelKind; 2] = [ChannelKind::Tcp, ChannelKind::Quic];

fn tcp_config() -> Config {
    Config {
        channels: TCP_FIRST.to_vec(),
        hello_timeout: Duration::from_millis(500),
        ..test_config()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_pulls_are_byte_identical_and_counted() {
    let holder = node(tcp_config()).await;
    let reader = node(tcp_config()).await;
    // Empty and small (under 1 MiB: answered over QUIC on the ticket's stream), one socket,
    // and several sockets with a tail that is no multiple of a chunk or a piece.
    let sizes = [0usize, 1, 5_000, (3 << 20) + 13, (50 << 20) + 7];
    let big = |len: usize| len >= 1 << 20;
    let (mut by_tcp, mut by_quic) = (0u64, 0u64);
    within(LIMIT, "tcp pulls", async {
        for (i, &len) in sizes.iter().enumerate() {
            let bytes = pattern(len, i as u8);
            let tensor = Tensor::new(DType::U8, vec![len as u64], bytes.clone()).expect("t");
            let name = format!("tcp/{i}");
            holder
                .publish_local(&name, tensor.clone())
                .expect("publish");
            let got = reader.pull(holder.addr(), &name, None).await.expect("pull");
            assert_eq!(got.buffer.data(), &bytes, "{len} bytes: pull");
            assert_eq!(got.meta, *tensor.meta());
            let into = reader
                .pull_into(holder.addr(), &name, None, |m| {
                    Ok(vec![0xAAu8; m.byte_len as usize])
                })
                .await
                .expect("pull_into");
            assert_eq!(&into.buffer[..], &bytes[..], "{len} bytes: pull_into");
            *(if big(len) { &mut by_tcp } else { &mut by_quic }) += 2 * len as u64;
        }
    })
    .await;
    assert_eq!(reader.channel_to(&holder.id()), ChannelKind::Tcp);
    let (r, h) = (&reader.metrics().channels, &holder.metrics().channels);
    use tb_dashboard::Direction::{In, Out};
    let big_pulls = sizes.iter().filter(|&&len| big(len)).count() as u64;
    assert_eq!(r.bytes(ChannelKind::Tcp, In), by_tcp);
    assert_eq!(r.transfers(ChannelKind::Tcp), 2 * big_pulls);
    assert_eq!(
        r.bytes(ChannelKind::Quic, In),
        by_quic,
        "small tensors over QUIC"
    );
    assert_eq!(r.fallbacks(ChannelKind::Tcp), 0);
    assert_eq!(h.bytes(ChannelKind::Tcp, Out), by_tcp);
    assert_eq!(h.refusals(ChannelKind::Tcp), 0);
    reader.shutdown().await;
    holder.shutdown().await;
}

/// A raw QUIC client of `node` (hello passed): exchanges channel offers and returns the
/// node's TCP port.
async fn raw_tcp_port(ep: &Endpoint, to: &Node) -> (Connection, u16) {
    let conn = ep
        .connect(to.addr().to_endpoint_addr(), DATA_ALPN)
        .await
        .expect("connect");
    raw_client_hello(&conn, ep.id()).await;
    let answer = request(&conn, &DataRequest::Channels { offers: vec![] }).await;
    let DataResponse::Channels { offers } = answer else {
        panic!("expected offers, got {answer:?}");
    };
    let port = offers
        .iter()
        .find_map(|o| match o {
            ChannelOffer::Tcp { port } => Some(*port),
            _ => None,
        })
        .expect("a TCP offer");
    (conn, port)
}

async fn request(conn: &Connection, req: &DataRequest) -> DataResponse {
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    send.write_all(&frame::encode(req).expect("encode"))
        .await
        .expect("write");
    send.finish().expect("finish");
    frame::decode_body(&read_body(&mut recv).await).expect("decode")
}

/// The body of the next frame on `recv`.
async fn read_body(recv: &mut RecvStream) -> Vec<u8> {
    let mut prefix = [0u8; 4];
    recv.read_exact(&mut prefix).await.expect("prefix");
    let mut body = vec![0u8; frame::body_len(prefix).expect("len")];
    recv.read_exact(&mut body).await.expect("body");
    body
}

/// Connects to `port`, writes `first`, and returns every byte the node sent back before
/// closing the socket (a reset, when the node closed it with `first` unread, ends it too).
async fn tcp_exchange(port: u16, first: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    stream.write_all(first).await.expect("write");
    let mut back = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let read_all = async {
        // Bounded by the timeout around it and the node's close.
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => back.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("read: {e}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read_all)
        .await
        .expect("the node closes the socket");
    back
}

fn hello(token: [u8; 32], offset: u64, len: u64) -> Vec<u8> {
    let range = ByteRange { offset, len };
    frame::encode(&TcpHello { token, range }).expect("encode")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_without_a_valid_token_are_refused_before_any_byte() {
    let holder = node(tcp_config()).await;
    // Large enough for a ticket (smaller tensors are answered over QUIC).
    const LEN: u64 = (2 << 20) + 5;
    let bytes = pattern(LEN as usize, 3);
    let tensor = Tensor::new(DType::U8, vec![LEN], bytes.clone()).expect("t");
    holder.publish_local("secret", tensor).expect("publish");
    let ep = tb_node::bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let (conn, port) = raw_tcp_port(&ep, &holder).await;
    let refused = || holder.metrics().channels.refusals(ChannelKind::Tcp);
    within(LIMIT, "refusals", async {
        // Garbage, a frame claiming a huge body, a well-formed hello with a guessed token,
        // and silence: each closed with nothing sent.
        assert!(
            tcp_exchange(port, b"GET / HTTP/1.1\r\n\r\n")
                .await
                .is_empty()
        );
        assert!(tcp_exchange(port, &u32::MAX.to_le_bytes()).await.is_empty());
        assert!(tcp_exchange(port, &hello([7; 32], 0, LEN)).await.is_empty());
        assert!(tcp_exchange(port, &[]).await.is_empty());
    })
    .await;
    assert_eq!(refused(), 4);
    // A real ticket admits exactly the sockets it was asked for, once each.
    let pull = DataRequest::TcpPull {
        name: TensorName::new("secret").expect("name"),
        version: None,
        sockets: 1,
    };
    let DataResponse::TcpTicket { token, meta, .. } = request(&conn, &pull).await else {
        panic!("expected a ticket");
    };
    assert_eq!(meta.byte_len, LEN);
    within(LIMIT, "admitted", async {
        let outside = tcp_exchange(port, &hello(token, LEN - 1, 2)).await;
        assert!(outside.is_empty(), "a range outside the tensor is refused");
        let got = tcp_exchange(port, &hello(token, 10, LEN - 10)).await;
        assert_eq!(&got[..], &bytes[10..]);
        let replay = tcp_exchange(port, &hello(token, 0, LEN)).await;
        assert!(replay.is_empty(), "a used-up token admits nothing");
    })
    .await;
    assert_eq!(refused(), 6);
    ep.close().await;
    holder.shutdown().await;
}

/// How the fake holder's TCP listener misbehaves.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Sends the range with one bit flipped.
    Flip,
    /// Sends the first half of the range, then closes.
    Cut,
}

/// A holder that speaks the protocol on QUIC (offers, tickets, range pulls of the truth)
/// and misbehaves on its TCP sockets.
#[derive(Debug, Clone)]
struct FakeHolder {
    me: iroh::EndpointId,
    port: u16,
    truth: Tensor,
}

const TOKEN: [u8; 32] = [0x42; 32];

impl FakeHolder {
    async fn answer(&self, mut send: SendStream, mut recv: RecvStream) {
        let body = read_body(&mut recv).await;
        let request: DataRequest = frame::decode_body(&body).expect("decode");
        let meta = self.truth.meta().clone();
        let reply = |msg: &DataResponse| frame::encode(msg).expect("encode");
        match request {
            DataRequest::Channels { .. } => {
                let offers = vec![ChannelOffer::Tcp { port: self.port }];
                let _ = send
                    .write_all(&reply(&DataResponse::Channels { offers }))
                    .await;
            }
            DataRequest::Pieces { .. }
            | DataRequest::Watch { .. }
            | DataRequest::Call { .. }
            | DataRequest::Ctl
            | DataRequest::CudaIpc(_) => {
                // This holder serves in one stream only, nobody subscribes and nobody calls.
                let no = DataResponse::Error {
                    code: tb_node::proto::ErrorCode::NotFound,
                    message: "no pieces here".into(),
                };
                let _ = send.write_all(&reply(&no)).await;
            }
            DataRequest::TcpPull { .. } => {
                let ticket = DataResponse::TcpTicket {
                    meta,
                    version: 1,
                    token: TOKEN,
                };
                let _ = send.write_all(&reply(&ticket)).await;
            }
            DataRequest::Pull { range, .. } => {
                let range = range.unwrap_or(ByteRange {
                    offset: 0,
                    len: meta.byte_len,
                });
                let header = DataResponse::Header { meta, version: 1 };
                let _ = send.write_all(&reply(&header)).await;
                let (start, end) = (range.offset as usize, (range.offset + range.len) as usize);
                let _ = send.write_chunk(self.truth.data().slice(start..end)).await;
            }
            DataRequest::Push { .. } => {}
        }
        let _ = send.finish();
        let _ = send.stopped().await;
    }
}

impl ProtocolHandler for FakeHolder {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !raw_server_hello(&conn, self.me).await {
            return Ok(());
        }
        while let Ok((send, recv)) = conn.accept_bi().await {
            let me = self.clone();
            tokio::spawn(async move { me.answer(send, recv).await });
        }
        Ok(())
    }
}

/// Serves the fake holder's TCP sockets with `fault`; counts the sockets it served.
async fn misbehave(listener: TcpListener, truth: Bytes, fault: Fault, served: Arc<AtomicUsize>) {
    // Bounded by the test: the task is aborted when it ends.
    while let Ok((mut stream, _)) = listener.accept().await {
        let mut prefix = [0u8; 4];
        if stream.read_exact(&mut prefix).await.is_err() {
            continue;
        }
        let mut body = vec![0u8; frame::body_len(prefix).expect("len")];
        stream.read_exact(&mut body).await.expect("hello");
        let hello: TcpHello = frame::decode_body(&body).expect("decode");
        assert_eq!(hello.token, TOKEN);
        let (start, len) = (hello.range.offset as usize, hello.range.len as usize);
        let mut bytes = truth[start..start + len].to_vec();
        match fault {
            Fault::Flip => {
                if let Some(b) = bytes.get_mut(len / 2) {
                    *b ^= 0x10;
                }
            }
            Fault::Cut => bytes.truncate(len / 2),
        }
        let _ = stream.write_all(&bytes).await;
        let _ = stream.shutdown().await;
        served.fetch_add(1, Ordering::SeqCst);
    }
}

/// Pulls a 40 MiB tensor from a fake holder whose TCP sockets misbehave with `fault`.
async fn pull_from_fake(fault: Fault) -> (Result<Bytes, Error>, Node, usize) {
    let len = 40 << 20;
    let truth = Tensor::new(DType::U8, vec![len as u64], pattern(len, 9)).expect("t");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let served = Arc::new(AtomicUsize::new(0));
    let tcp = tokio::spawn(misbehave(
        listener,
        truth.data().clone(),
        fault,
        served.clone(),
    ));
    let ep = tb_node::bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let fake = PeerAddr {
        id: ep.id(),
        addr: SocketAddr::new([127, 0, 0, 1].into(), ep.bound_sockets()[0].port()),
    };
    let holder = FakeHolder {
        me: ep.id(),
        port,
        truth,
    };
    let router = Router::builder(ep).accept(DATA_ALPN, holder).spawn();
    let reader = node(tcp_config()).await;
    let pulled = within(LIMIT, "pull", reader.pull(&fake, "w", None)).await;
    let result = pulled.map(|p| p.buffer.data().clone());
    let _ = router.shutdown().await;
    tcp.abort();
    (result, reader, served.load(Ordering::SeqCst))
}

/// Tampered TCP bytes never become the tensor: they fail the ticket's root, and the pull
/// is made again, whole, over QUIC (whose bytes the fake serves truthfully here; a QUIC peer
/// that lies is `Corrupt`, see wire_faults.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_tcp_bytes_are_refetched_over_quic_never_returned() {
    let (result, reader, served) = pull_from_fake(Fault::Flip).await;
    assert!(served >= 1, "the bytes came over TCP");
    let got = result.expect("the pull completes over QUIC");
    assert_eq!(
        got,
        pattern(40 << 20, 9),
        "the true bytes, not the tampered ones"
    );
    let channels = &reader.metrics().channels;
    assert_eq!(channels.transfers(ChannelKind::Tcp), 0);
    assert_eq!(channels.transfers(ChannelKind::Quic), 1);
    assert_eq!(channels.fallbacks(ChannelKind::Tcp), 1);
    reader.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_cut_mid_transfer_is_finished_over_quic_from_where_it_stopped() {
    let (result, reader, served) = pull_from_fake(Fault::Cut).await;
    let len = 40u64 << 20;
    let got = result.expect("the pull completes over QUIC");
    assert_eq!(got, pattern(len as usize, 9), "byte-identical");
    let channels = &reader.metrics().channels;
    use tb_dashboard::Direction::In;
    // Each socket sent half its share over TCP; QUIC carried the rest, no more.
    assert_eq!(served, 2, "40 MiB rides two sockets");
    assert_eq!(
        channels.bytes(ChannelKind::Tcp, In) + channels.bytes(ChannelKind::Quic, In),
        len
    );
    assert!(channels.bytes(ChannelKind::Tcp, In) >= len / 2 - 2);
    assert_eq!(
        channels.fallbacks(ChannelKind::Tcp),
        1,
        "one transfer fell back"
    );
    reader.shutdown().await;
}
