//! The shm channel between two nodes of this process: what it verifies and what it trusts.
//! Bytes from a holder that proved only read-only access and every pushed memfd are hashed
//! before anyone sees them; a holder's lie is `Corrupt`, never a tensor.

use std::time::Duration;

use bytes::Bytes;
use tb_proto::{ChannelKind, ClusterKey, DType, TensorName};

use crate::{Config, Error, Node, Tensor};

const LIMIT: Duration = Duration::from_secs(30);
/// Above the inline limit: the payload goes as a memfd.
const LEN: usize = (1 << 20) + 13;

async fn node(key: ClusterKey) -> Node {
    let config = Config {
        cluster_key: key,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        ..Config::default()
    };
    Node::spawn(config).await.expect("node starts")
}

fn bytes(seed: u8) -> Bytes {
    (0..LEN)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

/// A tensor that claims `truth`'s hash over other bytes: what a lying holder or pusher has.
fn lie() -> (Tensor, Tensor) {
    let truth = Tensor::new(DType::U8, vec![LEN as u64], bytes(1)).expect("tensor");
    let lie = Tensor::from_verified(truth.meta().clone(), bytes(2));
    (truth, lie)
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {LIMIT:?}"),
    }
}

fn assert_corrupt_over_shm<T: std::fmt::Debug>(got: crate::Result<T>, what: &str) {
    match got {
        Err(Error::Corrupt(message)) => {
            assert!(message.contains("(shm)"), "{what}: {message}");
        }
        other => panic!("{what}: expected Corrupt over shm, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_holder_serving_other_bytes_over_shm_is_corrupt() {
    let holder = node(ClusterKey::open().read_only()).await;
    let reader = node(ClusterKey::open()).await;
    let (_truth, lie) = lie();
    let name = TensorName::new("lie/t").expect("name");
    holder.ctx().store.insert_at(name, 1, lie);
    let got = within("pull", reader.pull(holder.addr(), "lie/t", Some(1))).await;
    assert_corrupt_over_shm(got.map(|p| p.buffer), "pull");
    let mut dest = vec![0u8; LEN];
    let into = reader.pull_into(holder.addr(), "lie/t", Some(1), |_| Ok(&mut dest[..]));
    assert_corrupt_over_shm(within("pull_into", into).await.map(|_| ()), "pull_into");
    // The lie was caught on shm, not by falling back to QUIC.
    let channels = &reader.metrics().channels;
    assert_eq!(channels.fallbacks(ChannelKind::Shm), 0);
    // An honest read-only holder's bytes pass the same check.
    let honest = Tensor::new(DType::U8, vec![LEN as u64], bytes(3)).expect("tensor");
    holder
        .publish_local("honest/t", honest.clone())
        .expect("publish");
    let got = within("pull", reader.pull(holder.addr(), "honest/t", None))
        .await
        .expect("an honest read-only holder's bytes arrive");
    assert_eq!(got.buffer.data(), honest.data());
    assert_eq!(channels.transfers(ChannelKind::Shm), 1);
    holder.shutdown().await;
    reader.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_shm_push_whose_bytes_do_not_match_its_claim_is_refused() {
    let pusher = node(ClusterKey::open()).await;
    let receiver = node(ClusterKey::open()).await;
    let (truth, lie) = lie();
    let pushed = within("push", pusher.push(receiver.addr(), "lie/p", &lie)).await;
    match pushed {
        Err(Error::Corrupt(message)) => {
            assert!(message.contains("a same-host push"), "{message}");
        }
        other => panic!("expected the receiver's Corrupt, got {other:?}"),
    }
    let nothing = receiver.recv_timeout(Duration::from_millis(300)).await;
    assert!(nothing.is_err(), "a lying push reached recv(): {nothing:?}");
    // The same tensor told truthfully arrives, over shm.
    within("push", pusher.push(receiver.addr(), "true/p", &truth))
        .await
        .expect("an honest push");
    let got = within("recv", receiver.recv()).await.expect("received");
    assert_eq!(got.tensor.data(), truth.data());
    assert!(receiver.metrics().channels.transfers(ChannelKind::Shm) >= 1);
    pusher.shutdown().await;
    receiver.shutdown().await;
}

#[test]
fn a_private_view_is_written_without_changing_the_tensor() {
    let tensor = Tensor::copy_from(DType::U8, vec![LEN as u64], &bytes(4)).expect("tensor");
    let view = tensor.private_view().expect("view");
    assert!(
        view.is_mapped(),
        "a large tensor is viewed by mapping, not copied"
    );
    // SAFETY (test): the view is this test's own writable buffer of `len` bytes.
    #[allow(unsafe_code)]
    let written = unsafe { std::slice::from_raw_parts_mut(view.as_mut_ptr(), view.len()) };
    assert_eq!(&written[..], &bytes(4)[..]);
    written[0] ^= 0xff;
    written[LEN - 1] ^= 0xff;
    assert_eq!(tensor.data(), &bytes(4), "the tensor's bytes are untouched");
    let again = tensor.private_view().expect("view");
    // SAFETY (test): as above.
    #[allow(unsafe_code)]
    let fresh = unsafe { std::slice::from_raw_parts(again.as_mut_ptr(), again.len()) };
    assert_eq!(fresh, &bytes(4)[..], "another view sees the original bytes");
    // Small tensors are copies.
    let small = Tensor::copy_from(DType::U8, vec![16], &[7u8; 16]).expect("tensor");
    assert!(!small.private_view().expect("view").is_mapped());
}

#[tokio::test]
async fn idle_connections_are_kept_for_a_bounded_number_of_peers() {
    let shm = super::Shm::bind().expect("shm");
    let conn = || {
        let (ours, _theirs) = tokio::net::UnixStream::pair().expect("socket pair");
        super::socket::ShmStream::new(ours)
    };
    let first = iroh::SecretKey::generate().public();
    shm.put_idle(first, conn());
    for _ in 0..super::MAX_IDLE_PEERS + 10 {
        shm.put_idle(iroh::SecretKey::generate().public(), conn());
    }
    assert_eq!(shm.idle().len(), super::MAX_IDLE_PEERS);
    // A peer already in the table still pools (up to its own limit); a new one does not.
    for _ in 0..super::MAX_IDLE_PER_PEER + 2 {
        shm.put_idle(first, conn());
    }
    assert_eq!(shm.idle()[&first].len(), super::MAX_IDLE_PER_PEER);
    shm.forget(&first);
    assert!(shm.take_idle(&first).is_none());
    assert_eq!(shm.idle().len(), super::MAX_IDLE_PEERS - 1);
}
