//! Links per peer and per node (issue 23, item 5): what a member's links can make a node hold,
//! and that honest nodes still link and fetch beside members that misbehave.
//!
//! The misbehaving peers are raw endpoints that pass the hello and then stall: they open
//! streams and never read the answers, or send a request's first bytes and never the rest.

use std::time::{Duration, Instant};

use iroh::{
    Endpoint, SecretKey,
    endpoint::{Connection, RecvStream, SendStream},
};
use tb_node::{
    Config, Error, MAX_LINKS_PER_PEER, Node, Tensor,
    framing::{read_frame, write_frame},
    proto::{ChannelKind, CloseCode, DATA_ALPN, DataRequest, DataResponse, TensorName},
};
use tb_tests::{eventually, f32_tensor, node, raw_client_hello, test_config, within};

const LIMIT: Duration = Duration::from_secs(120);
/// Large enough that an answer nobody reads stalls on the stream window (1.25 MB).
const STALLED_LEN: usize = 1 << 20; // f32s: 4 MiB

/// A node that gives up on stalled streams quickly, so the tests wait seconds, not minutes.
fn server_config() -> Config {
    Config {
        request_timeout: Duration::from_secs(2),
        stall_timeout: Duration::from_secs(2),
        channels: vec![ChannelKind::Quic],
        ..test_config()
    }
}

fn quic_config() -> Config {
    Config {
        channels: vec![ChannelKind::Quic],
        ..test_config()
    }
}

/// A raw peer's endpoint with a fresh identity.
async fn identity() -> Endpoint {
    tb_node::bind_endpoint(&test_config(), SecretKey::generate())
        .await
        .expect("endpoint")
}

/// Links `ep` to `server` and passes the hello.
async fn link(ep: &Endpoint, server: &Node) -> Connection {
    let conn = ep
        .connect(server.addr().to_endpoint_addr(), DATA_ALPN)
        .await
        .expect("connect");
    raw_client_hello(&conn, ep.id()).await;
    conn
}

fn pull(name: &str) -> DataRequest {
    DataRequest::Pull {
        name: TensorName::new(name).expect("name"),
        version: None,
        range: None,
    }
}

/// Stalls `conn`: a pull of `name` whose answer is never read, and a stream that sends half
/// a request's length prefix and nothing more. The streams are returned to keep them open.
async fn stall(conn: &Connection, name: &str) -> Vec<(SendStream, RecvStream)> {
    let (mut send, recv) = conn.open_bi().await.expect("open");
    write_frame(&mut send, &pull(name)).await.expect("pull");
    let (mut silent, silent_recv) = conn.open_bi().await.expect("open");
    silent.write_all(&[0, 1]).await.expect("half a prefix");
    vec![(send, recv), (silent, silent_recv)]
}

/// Pulls `name` from `server` on `conn` by hand: the header, then exactly its bytes.
async fn raw_fetch(conn: &Connection, name: &str) -> Vec<u8> {
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    write_frame(&mut send, &pull(name)).await.expect("pull");
    let header = within(LIMIT, "header", read_frame::<DataResponse>(&mut recv)).await;
    let Ok(DataResponse::Header { meta, .. }) = header else {
        panic!("expected a header, got {header:?}");
    };
    let len = usize::try_from(meta.byte_len).expect("fits");
    let bytes = within(LIMIT, "payload", recv.read_to_end(len)).await;
    bytes.expect("payload")
}

/// Pulls `name` from `server`, again while the server's pool is full of links in use
/// (`TooManyConnections`): at most 200 tries, within `LIMIT`. Returns the tensor and how
/// many times it was refused.
async fn pull_when_linked(puller: &Node, server: &Node, name: &str) -> (Tensor, usize) {
    const TRIES: usize = 200;
    let started = Instant::now();
    let mut refused = 0;
    for _ in 0..TRIES {
        match within(LIMIT, "pull", puller.pull(server.addr(), name, None)).await {
            Ok(pulled) => return (pulled.buffer, refused),
            Err(Error::TooManyConnections { .. }) if started.elapsed() < LIMIT => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("pull of {name}: {err}"),
        }
    }
    panic!("no link after {TRIES} tries ({:?})", started.elapsed());
}

/// 64 member identities fill the server's 64-link pool and stall every link (an answer
/// nobody reads, a request that never completes): a 65th, honest node still links, within
/// the server's stall and request timeouts, and gets its tensor byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_stalled_identities_do_not_stop_a_65th_honest_node_from_linking() {
    const STALLERS: usize = 64;
    let server = node(server_config()).await;
    assert_eq!(server.config().max_links, STALLERS, "the default pool");
    let stalled = f32_tensor(STALLED_LEN, 3);
    server.publish_local("big", stalled).expect("publish");
    let wanted = f32_tensor(64 << 10, 9);
    server.publish_local("w", wanted.clone()).expect("publish");
    let mut held = Vec::new();
    for _ in 0..STALLERS {
        let ep = identity().await;
        let conn = within(LIMIT, "link", link(&ep, &server)).await;
        let streams = stall(&conn, "big").await;
        held.push((ep, conn, streams));
    }
    // Every stalled identity holds a pooled link, in use.
    let full = || {
        let stats = server.pool_stats();
        stats.links() == STALLERS && stats.links_active == STALLERS
    };
    assert!(
        eventually(LIMIT, full).await,
        "the stallers fill the pool: {:?}",
        server.pool_stats()
    );
    let honest = node(quic_config()).await;
    let (got, refused) = pull_when_linked(&honest, &server, "w").await;
    assert!(got == wanted, "the honest node's tensor is byte-identical");
    let stats = server.pool_stats();
    eprintln!(
        "honest node refused {refused} times; server: {} refusals (pool full), {} LRU \
         evictions, {} links",
        stats.refused_full,
        stats.evictions_lru,
        stats.links()
    );
    assert!(stats.links() <= STALLERS, "the pool stays at its cap");
    assert_eq!(
        stats.refused_full, refused as u64,
        "each refusal counted once"
    );
    drop(held);
    honest.shutdown().await;
    server.shutdown().await;
}

/// One member opens ten links, each with a stalled stream: it ends up with at most
/// `MAX_LINKS_PER_PEER` (its oldest closed with `TooManyConnections`, counted), and can
/// still fetch on its newest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_opening_more_links_than_the_cap_keeps_the_cap_and_still_fetches() {
    const OPENED: usize = 10;
    let server = node(server_config()).await;
    server
        .publish_local("big", f32_tensor(STALLED_LEN, 3))
        .expect("publish");
    let wanted = f32_tensor(64 << 10, 9);
    server.publish_local("w", wanted.clone()).expect("publish");
    let ep = identity().await;
    let mut conns = Vec::new();
    let mut held = Vec::new();
    for _ in 0..OPENED {
        let conn = within(LIMIT, "link", link(&ep, &server)).await;
        held.push(stall(&conn, "big").await);
        conns.push(conn);
        // Each link is adopted, and its stalled streams taken (it is busy, pooled as the
        // newest), before the next is opened: the cap closes idle links first, so a link
        // whose streams the server had not yet accepted would be closed before older busy
        // ones (the cap is about what is held).
        let adopted = conns.len();
        let seen = || {
            let s = server.pool_stats();
            s.links() + s.links_superseded + s.evictions_peer_cap as usize >= adopted
                && s.links_active == 1
        };
        assert!(eventually(LIMIT, seen).await, "link {adopted} adopted");
    }
    let excess = (OPENED - MAX_LINKS_PER_PEER) as u64;
    let closed = || server.pool_stats().evictions_peer_cap == excess;
    assert!(eventually(LIMIT, closed).await, "{:?}", server.pool_stats());
    let stats = server.pool_stats();
    assert_eq!(
        stats.links() + stats.links_superseded,
        MAX_LINKS_PER_PEER,
        "the server holds the cap of links to the peer: {stats:?}"
    );
    // The peer sees the same: its oldest links closed with `TooManyConnections`.
    let gone = || {
        conns.iter().filter(|c| c.close_reason().is_some()).count() == OPENED - MAX_LINKS_PER_PEER
    };
    assert!(
        eventually(LIMIT, gone).await,
        "the peer sees its links closed"
    );
    for (i, conn) in conns.iter().enumerate() {
        let open = conn.close_reason().is_none();
        assert_eq!(
            open,
            i >= OPENED - MAX_LINKS_PER_PEER,
            "link {i}: the newest stay"
        );
        if !open {
            let code = close_code(conn);
            assert_eq!(code, Some(CloseCode::TooManyConnections), "link {i}");
        }
    }
    let newest = conns.last().expect("links");
    let got = raw_fetch(newest, "w").await;
    assert!(
        got == wanted.data()[..],
        "the peer still fetches, byte for byte"
    );
    drop(held);
    ep.close().await;
    server.shutdown().await;
}

/// The close code a peer closed `conn` with, if one of ours.
fn close_code(conn: &Connection) -> Option<CloseCode> {
    match conn.close_reason()? {
        iroh::endpoint::ConnectionError::ApplicationClosed(close) => {
            u32::try_from(close.error_code.into_inner())
                .ok()
                .and_then(CloseCode::from_code)
        }
        _ => None,
    }
}

/// Regression: a node kept every peer's channel offers (and backoffs) forever. Once the
/// pair's link closes (idle), each side forgets what the other offered: a transfer with it
/// is back to QUIC until a new link exchanges offers again (which it does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_offers_are_forgotten_when_the_link_closes() {
    let config = Config {
        idle_timeout: Duration::from_millis(300),
        ..test_config()
    };
    let a = node(config.clone()).await;
    let b = node(config).await;
    let wanted = f32_tensor(1024, 4);
    b.publish_local("w", wanted.clone()).expect("publish");
    let pulled = within(LIMIT, "pull", a.pull(b.addr(), "w", None)).await;
    assert!(pulled.expect("pull").buffer == wanted);
    assert_eq!(a.channel_to(&b.id()), ChannelKind::Shm, "offers learned");
    assert_eq!(b.channel_to(&a.id()), ChannelKind::Shm, "offers learned");
    // The link goes idle and closes on both sides: the offers go with it.
    let closed = || a.pool_size() == 0 && b.pool_size() == 0;
    assert!(eventually(LIMIT, closed).await, "the idle link closes");
    let forgotten =
        || a.channel_to(&b.id()) == ChannelKind::Quic && b.channel_to(&a.id()) == ChannelKind::Quic;
    assert!(eventually(LIMIT, forgotten).await, "offers forgotten");
    // A new link exchanges them again.
    let pulled = within(LIMIT, "pull", a.pull(b.addr(), "w", None)).await;
    assert!(pulled.expect("pull again").buffer == wanted);
    assert_eq!(a.channel_to(&b.id()), ChannelKind::Shm, "learned again");
    a.shutdown().await;
    b.shutdown().await;
}
