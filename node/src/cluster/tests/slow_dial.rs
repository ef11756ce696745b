//! A broker whose dial never completes (it accepts the QUIC connection and never answers the
//! hello) must hold up only the calls that need that dial, and each of those for one dial:
//! the ctl client dials without holding its lock.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use super::*;
use crate::cluster::ctl_client::CtlClient;

/// Accepts `tb/ctl/1` connections, counts them, and never answers their hello: each dial to
/// it lasts until the client gives up (its connect timeout) or closes.
#[derive(Debug, Clone, Default)]
struct StallingBroker {
    accepted: Arc<AtomicUsize>,
}

impl ProtocolHandler for StallingBroker {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        self.accepted.fetch_add(1, Ordering::SeqCst);
        conn.closed().await;
        Ok(())
    }
}

/// A stalling broker on loopback: its router (keep it alive), its address and its counter.
async fn stalling_broker() -> (Router, PeerAddr, Arc<AtomicUsize>) {
    let ep = bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let addr = PeerAddr {
        id: ep.id(),
        addr: ep.bound_sockets()[0],
    };
    let handler = StallingBroker::default();
    let accepted = handler.accepted.clone();
    let router = Router::builder(ep)
        .accept(tb_proto::CTL_ALPN, handler)
        .spawn();
    (router, addr, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_ctl_client_does_not_wait_for_a_dial_in_flight() {
    let (router, stalled, accepted) = stalling_broker().await;
    let ep = bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    // The dial would give up only after ten minutes: far beyond every bound below.
    let client = Arc::new(CtlClient::standalone(
        ep.clone(),
        tb_proto::ClusterKey::open(),
        Duration::from_secs(600),
        &[stalled],
    ));
    let caller = client.clone();
    let call = tokio::spawn(async move { caller.list("", 10, Duration::from_secs(600)).await });
    // The dial reached the broker, which will never answer it.
    assert!(eventually(|| accepted.load(Ordering::SeqCst) == 1).await);
    assert!(!call.is_finished(), "the call waits for its dial");
    // Closing takes the lock only to swap the state: it returns while the dial is pending,
    // and the call waiting for that dial ends at once.
    within("close", client.close()).await;
    let result = within("the call", call).await.expect("task");
    // (a closed client is final: no other broker is tried).
    assert!(matches!(&result, Err(Error::Shutdown)), "{result:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    ep.close().await;
    let _ = router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_to_a_stalled_broker_share_one_dial_and_fail_over() {
    let (router, stalled, accepted) = stalling_broker().await;
    let fake = FakeCluster::new();
    let (broker, live) = fake.broker(config(&[])).await;
    let node = worker(Config {
        heartbeats: false,
        ..config(&[stalled, live])
    })
    .await;
    // Every call starts at the stalled broker (the first in the list): they all wait for
    // the same dial, and race the live broker beside it after a stagger. Dialing under the
    // lock made them dial one after another, each for a whole connect timeout.
    const CALLS: usize = 4;
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let node = node.clone();
            tokio::spawn(async move { node.list("m/").await })
        })
        .collect();
    for call in calls {
        let listed = within("a call", call).await.expect("task");
        assert!(listed.expect("listed by the live broker").is_empty());
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one dial to the stalled broker for {CALLS} calls"
    );
    for n in [node, broker] {
        n.shutdown().await;
    }
    let _ = router.shutdown().await;
}
