//! The shm channel between two nodes of this process: what it verifies and what it trusts.
//! Bytes from a holder that proved only read-only access, every pushed memfd and every inline
//! payload are hashed before anyone sees them; a holder's lie is `Corrupt`, never a tensor.

use std::time::Duration;

use bytes::Bytes;
use tb_proto::{Access, ChannelKind, ClusterKey, DType, TensorName};

use crate::{Config, Error, Node, Tensor};

const LIMIT: Duration = Duration::from_secs(30);
/// Above the inline limit: the payload goes as a memfd.
const LEN: usize = super::INLINE_MAX + (1 << 20) + 13;
/// Above the plain-memory size (64 KiB) and within the inline limit: a push of it goes
/// inline, into a pooled memfd of the receiver (a pull passes the holder's memfd).
const INLINE_LEN: usize = (1 << 20) + 29;
const _: () = assert!(INLINE_LEN > crate::channel::PRIVATE_COPY_MAX);
const _: () = assert!(INLINE_LEN <= super::INLINE_MAX);

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
    bytes_of(LEN, seed)
}

fn bytes_of(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

/// A tensor that claims `truth`'s hash over other bytes: what a lying holder or pusher has.
fn lie() -> (Tensor, Tensor) {
    lie_of(LEN)
}

/// [`lie`] of `len` bytes.
fn lie_of(len: usize) -> (Tensor, Tensor) {
    let truth = Tensor::new(DType::U8, vec![len as u64], bytes_of(len, 1)).expect("tensor");
    let lie = Tensor::from_verified(truth.meta().clone(), bytes_of(len, 2));
    (truth, lie)
}

/// Whether `tensor`'s bytes are the mapping of its own memfd (not plain memory, which
/// `shm_region` would copy into a new one).
fn in_own_memfd(tensor: &Tensor) -> bool {
    let region = tensor.shm_region().expect("region");
    region.bytes().as_ptr() == tensor.data().as_ptr() && region.len() == tensor.data().len()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_above_64_kib_goes_inline_into_a_pooled_memfd_and_a_lie_is_refused() {
    // Read-write on both sides (and a read-only liar below).
    let holder = node(ClusterKey::open()).await;
    let reader = node(ClusterKey::open()).await;
    let channels = &reader.metrics().channels;

    // A pull of that size passes the holder's memfd to copy out of (unsealed: the holder's
    // pool recycles it), which the read-write reader does.
    let honest = Tensor::copy_from(DType::U8, vec![INLINE_LEN as u64], &bytes_of(INLINE_LEN, 5))
        .expect("tensor");
    holder
        .publish_local("inline/t", honest.clone())
        .expect("publish");
    let got = within("pull", reader.pull(holder.addr(), "inline/t", None))
        .await
        .expect("pull");
    assert_eq!(got.buffer.data(), honest.data());
    assert!(
        in_own_memfd(&got.buffer),
        "a copy in the reader's own memfd"
    );
    assert!(
        !honest.shm_region().expect("region").is_sealed(),
        "the holder's memfd was passed unsealed"
    );
    let mut dest = vec![0u8; INLINE_LEN];
    let into = reader.pull_into(holder.addr(), "inline/t", None, |_| Ok(&mut dest[..]));
    within("pull_into", into).await.expect("pull_into");
    assert_eq!(&dest[..], &honest.data()[..]);
    assert_eq!(channels.transfers(ChannelKind::Shm), 2);
    drop(got);

    // A lying holder that proved only read-only access: refused on shm, not by falling
    // back to QUIC.
    let (_truth, lie) = lie_of(INLINE_LEN);
    let liar = node(ClusterKey::open().read_only()).await;
    let name = TensorName::new("inline/lie").expect("name");
    liar.ctx().store.insert_at(name.clone(), 1, lie.clone());
    let got = within("pull", reader.pull(liar.addr(), "inline/lie", Some(1))).await;
    assert_corrupt_over_shm(got.map(|p| p.buffer), "pull");
    let into = reader.pull_into(liar.addr(), "inline/lie", Some(1), |_| Ok(&mut dest[..]));
    assert_corrupt_over_shm(within("pull_into", into).await.map(|_| ()), "pull_into");
    assert_eq!(channels.fallbacks(ChannelKind::Shm), 0);
    liar.shutdown().await;
    // A read-write holder's inline bytes get the trust its memfds get: not hashed again (it
    // could as well publish other bytes). Its small payloads still are (below 64 KiB a hash
    // costs less than deciding not to).
    holder.ctx().store.insert_at(name, 1, lie.clone());
    let got = within("pull", reader.pull(holder.addr(), "inline/lie", Some(1)))
        .await
        .expect("a read-write holder is trusted");
    assert_eq!(got.buffer.data(), lie.data(), "what it served");
    assert!(super::hash_inline(INLINE_LEN, None), "pushes are hashed");
    assert!(super::hash_inline(INLINE_LEN, Some(Access::ReadOnly)));
    assert!(!super::hash_inline(INLINE_LEN, Some(Access::ReadWrite)));
    assert!(super::hash_inline(64 << 10, Some(Access::ReadWrite)));

    // A lying push: refused by the receiver, and nothing reaches recv().
    let pushed = within("push", reader.push(holder.addr(), "inline/p", &lie)).await;
    match pushed {
        Err(Error::Corrupt(message)) => {
            assert!(message.contains("a same-host push"), "{message}");
        }
        other => panic!("expected the receiver's Corrupt, got {other:?}"),
    }
    let nothing = holder.recv_timeout(Duration::from_millis(300)).await;
    assert!(nothing.is_err(), "a lying push reached recv(): {nothing:?}");
    // An honest push arrives, inline, into a memfd of the receiver's own; the pusher's
    // memfd is never passed (so never sealed: its pool can recycle it), and the receiver's
    // buffer goes to its pool once dropped, for the next receive of that size.
    let fresh = Tensor::copy_from(DType::U8, vec![INLINE_LEN as u64], &bytes_of(INLINE_LEN, 6))
        .expect("tensor");
    within("push", reader.push(holder.addr(), "inline/p", &fresh))
        .await
        .expect("an honest push");
    let pushed = within("recv", holder.recv()).await.expect("received");
    assert_eq!(pushed.tensor.data(), fresh.data());
    assert!(in_own_memfd(&pushed.tensor), "pushed into a memfd");
    assert!(!fresh.shm_region().expect("region").is_sealed());
    drop(pushed);
    assert!(
        super::pool::holds(INLINE_LEN),
        "the received memfd is pooled"
    );
    assert_eq!(reader.metrics().channels.fallbacks(ChannelKind::Shm), 0);
    holder.shutdown().await;
    reader.shutdown().await;
}

#[tokio::test]
async fn an_inline_payload_above_the_limit_is_refused_before_anything_is_read() {
    let (ours, _theirs) = tokio::net::UnixStream::pair().expect("socket pair");
    let mut conn = super::socket::ShmStream::new(ours);
    let hash = tb_proto::ContentHash::of(b"");
    let over = super::INLINE_MAX as u64 + 1;
    let meta = tb_proto::TensorMeta::new(DType::U8, vec![over], hash).expect("meta");
    assert!(super::inline_len(&meta).is_err());
    // Nothing is sent: a reader that allocated and waited for the bytes would time out.
    match within("read", super::read_inline(&mut conn, &meta, "test", None)).await {
        Err(Error::Io(message)) => assert!(message.contains("limit"), "{message}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let at = tb_proto::TensorMeta::new(DType::U8, vec![over - 1], hash).expect("meta");
    assert_eq!(super::inline_len(&at).expect("within"), super::INLINE_MAX);
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
    let mut others = Vec::new();
    for _ in 0..super::MAX_IDLE_PEERS + 10 {
        let peer = iroh::SecretKey::generate().public();
        shm.put_idle(peer, conn());
        others.push(peer);
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
    // Over all peers, at most `MAX_IDLE` connections wait.
    for peer in &others[..8] {
        for _ in 0..super::MAX_IDLE_PER_PEER {
            shm.put_idle(*peer, conn());
        }
    }
    let total: usize = shm.idle().values().map(Vec::len).sum();
    assert_eq!(total, super::MAX_IDLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_bytes_hashes_as_it_sends_and_the_receiver_holds_what_arrived() {
    let pusher = node(ClusterKey::open()).await;
    let receiver = node(ClusterKey::open()).await;
    // Above 64 KiB (a pooled memfd), at 4 KiB (plain memory), and above the inline limit
    // (a tensor made and its memfd passed).
    for (len, seed) in [(INLINE_LEN, 3), (4096, 4), (LEN, 5)] {
        let data = bytes_of(len, seed);
        let shape = vec![1, len as u64];
        let name = format!("bytes/{len}");
        let pushed = pusher.push_bytes(receiver.addr(), &name, DType::U8, shape.clone(), &data);
        within("push_bytes", pushed).await.expect("pushed");
        let got = within("recv", receiver.recv()).await.expect("received");
        assert_eq!(
            (got.name.as_str(), got.tensor.data()),
            (name.as_str(), &data)
        );
        assert_eq!(got.tensor.meta().shape, shape);
        assert_eq!(
            got.tensor.hash(),
            tb_proto::ContentHash::of(&data),
            "the hash of what arrived"
        );
        assert_eq!(got.from, pusher.id());
    }
    assert_eq!(receiver.metrics().channels.transfers(ChannelKind::Shm), 3);
    assert_eq!(pusher.metrics().channels.fallbacks(ChannelKind::Shm), 0);
    // Bytes that do not fit the shape are refused before anything is sent.
    let short = pusher.push_bytes(receiver.addr(), "bytes/bad", DType::F32, vec![3], &[0; 8]);
    assert!(matches!(short.await, Err(Error::InvalidTensor(_))));
    pusher.shutdown().await;
    receiver.shutdown().await;
}

/// Parts written in one go arrive whole and in order, the ones past what one `sendmsg`
/// took resumed at the right byte (3 MiB: several times a socket's buffer), and a
/// descriptor passed with them arrives once.
#[tokio::test]
async fn parts_written_together_arrive_whole_and_in_order() {
    let (ours, theirs) = tokio::net::UnixStream::pair().expect("socket pair");
    let (mut reader, mut writer) = (
        super::socket::ShmStream::new(ours),
        super::socket::ShmStream::new(theirs),
    );
    let parts = [
        bytes_of(5, 1).to_vec(),
        Vec::new(),
        bytes_of(3 << 20, 2).to_vec(),
        bytes_of(77, 3).to_vec(),
    ];
    let whole: Vec<u8> = parts.concat();
    let region = super::Region::copy_of(b"passed along").expect("memfd");
    let fd = region.shared_fd().expect("fd");
    let write = async {
        let slices: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        writer
            .write_parts(&slices, Some(fd))
            .await
            .expect("written");
    };
    let mut got = vec![0u8; whole.len()];
    let (_, read) = tokio::join!(write, reader.read_exact(&mut got));
    read.expect("read");
    assert!(got == whole, "the bytes differ");
    reader.take_fd().expect("the descriptor came");
    assert!(reader.take_fd().is_err(), "and only once");
    let too_many = [&[1u8][..]; super::socket::MAX_PARTS + 1];
    assert!(writer.write_parts(&too_many, None).await.is_err());
}

#[tokio::test]
async fn bytes_whose_hash_after_them_disagrees_are_refused() {
    for len in [INLINE_LEN, 4096] {
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("socket pair");
        let (mut reader, mut writer) = (
            super::socket::ShmStream::new(ours),
            super::socket::ShmStream::new(theirs),
        );
        let data = bytes_of(len, 9);
        let meta =
            tb_proto::TensorMeta::new(DType::U8, vec![len as u64], tb_proto::ContentHash([0; 32]))
                .expect("meta");
        let good = tb_proto::ContentHash::of(&data);
        let mut bad = good;
        bad.0[31] ^= 1;
        for (sent, ok) in [(good, true), (bad, false)] {
            let write = async {
                writer.write_parts(&[&data], None).await.expect("bytes");
                writer.write_parts(&[&sent.0], None).await.expect("hash");
            };
            let (_, read) =
                tokio::join!(write, super::read_hashed_after(&mut reader, &meta, "test"));
            match (read, ok) {
                (Ok(tensor), true) => {
                    assert_eq!((tensor.data(), tensor.hash()), (&data, good));
                }
                (Err(Error::Corrupt(message)), false) => {
                    assert!(message.contains("the sender's hash"), "{message}");
                }
                (other, _) => panic!("len {len}, ok {ok}: got {other:?}"),
            }
        }
    }
}

/// Opens a same-host watch of `name` at `holder` from `reader`.
async fn open_watch(reader: &Node, holder: &Node, name: &TensorName) -> super::ShmWatch {
    let addr = holder.addr();
    let links = || reader.link(addr);
    let route = within(
        "route",
        crate::channel::route(reader.ctx(), &addr.id, links),
    )
    .await;
    let Ok(Some(crate::channel::Route::Shm(route))) = route else {
        panic!("no same-host route between two nodes of this process");
    };
    let open = super::ShmWatch::open(reader.ctx(), &route, name);
    match within("watch", open).await {
        Ok(watch) => watch,
        Err(_) => panic!("the same-host watch did not open"),
    }
}

/// Offers `version` of `name` to `holder`'s watchers until one took it (the watch is
/// registered when the holder reads its request); bounded: 250 tries, 20 ms apart.
async fn offer_to_watcher(holder: &Node, name: &TensorName, version: u64, tensor: &Tensor) {
    for _ in 0..250 {
        if holder.ctx().watchers.offer(name, version, tensor) == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no watcher of {name} registered at the holder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_write_watcher_copies_a_version_out_of_the_publishers_memfd_which_stays_unsealed() {
    let holder = node(ClusterKey::open()).await;
    // (the watcher's key, whether it is passed the memfd to copy from)
    for (round, key, copies) in [
        (0, ClusterKey::open(), true),
        (1, ClusterKey::open().read_only(), false),
    ] {
        let reader = node(key).await;
        // A name per round: the holder may not have seen the previous round's watcher go
        // yet, and must not count it as this one's.
        let name = TensorName::new(format!("watch/t{round}")).expect("name");
        let mut watch = open_watch(&reader, &holder, &name).await;
        let honest =
            Tensor::copy_from(DType::U8, vec![INLINE_LEN as u64], &bytes_of(INLINE_LEN, 7))
                .expect("tensor");
        offer_to_watcher(&holder, &name, 1, &honest).await;
        let got = match within("offer", watch.next(reader.ctx())).await {
            Ok(super::WatchOffer::Mapped { version: 1, tensor }) => {
                assert!(copies, "a read-only watcher was passed the memfd");
                tensor
            }
            Ok(super::WatchOffer::Coming { version: 1, meta }) => {
                assert!(!copies, "a read-write watcher got the bytes on the socket");
                within("bytes", watch.read_coming(reader.ctx(), 1, &meta))
                    .await
                    .expect("the bytes")
            }
            Ok(_) => panic!("an unexpected kind of offer"),
            Err(e) => panic!("no offer: {e}"),
        };
        assert_eq!(got.data(), honest.data());
        assert!(in_own_memfd(&got), "a copy in the watcher's own memfd");
        // Either way the publisher's memfd was never sealed: its pool recycles it.
        assert!(!honest.shm_region().expect("region").is_sealed());
        drop((watch, got));
        reader.shutdown().await;
    }

    // A publisher that proved only read-only access cannot tell a read-write watcher (it
    // holds no key to check that proof with), so it sends its bytes on the socket, and the
    // watcher hashes them: bytes other than its version's are Corrupt.
    let liar = node(ClusterKey::open().read_only()).await;
    let reader = node(ClusterKey::open()).await;
    let name = TensorName::new("watch/lie").expect("name");
    let mut watch = open_watch(&reader, &liar, &name).await;
    let (_truth, lie) = lie_of(INLINE_LEN);
    lie.shm_region().expect("the lie in a memfd");
    offer_to_watcher(&liar, &name, 1, &lie).await;
    let meta = match within("offer", watch.next(reader.ctx())).await {
        Ok(super::WatchOffer::Coming { version: 1, meta }) => meta,
        Ok(_) => panic!("a read-only publisher passed its memfd"),
        Err(e) => panic!("no offer: {e}"),
    };
    match within("bytes", watch.read_coming(reader.ctx(), 1, &meta)).await {
        Err(Error::Corrupt(message)) => assert!(message.contains("watch/lie"), "{message}"),
        Err(e) => panic!("expected Corrupt, got {e}"),
        Ok(_) => panic!("a lie was taken"),
    }
    assert!(!lie.shm_region().expect("region").is_sealed());
    reader.shutdown().await;
    liar.shutdown().await;
    holder.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_write_reader_copies_a_pull_out_of_the_holders_memfd_which_stays_unsealed() {
    let holder = node(ClusterKey::open()).await;
    // (the reader's key, whether it is passed the memfd to copy from)
    for (key, copies) in [
        (ClusterKey::open(), true),
        (ClusterKey::open().read_only(), false),
    ] {
        let reader = node(key).await;
        for version in 1..=3u8 {
            let name = format!("pull/copied{}", u8::from(copies));
            let tensor = Tensor::copy_from(
                DType::U8,
                vec![INLINE_LEN as u64],
                &bytes_of(INLINE_LEN, version),
            )
            .expect("tensor");
            holder
                .publish_local(&name, tensor.clone())
                .expect("publish");
            let got = within("pull", reader.pull(holder.addr(), &name, None))
                .await
                .expect("pulled");
            assert_eq!(got.buffer.data(), tensor.data());
            let mut dest = vec![0u8; INLINE_LEN];
            let into = reader.pull_into(holder.addr(), &name, None, |_| Ok(&mut dest[..]));
            within("pull_into", into).await.expect("pulled into");
            assert_eq!(&dest[..], tensor.data());
            // A read-write reader copied the bytes into a memfd of its own and the holder's
            // stayed unsealed (its pool recycles it); a read-only one mapped it, sealed.
            assert!(in_own_memfd(&got.buffer));
            let sealed = tensor.shm_region().expect("region").is_sealed();
            assert_eq!(sealed, !copies, "v{version}, a copying reader: {copies}");
        }
        let channels = &reader.metrics().channels;
        assert_eq!(channels.fallbacks(ChannelKind::Shm), 0);
        assert_eq!(channels.transfers(ChannelKind::Shm), 6);
        reader.shutdown().await;
    }
    holder.shutdown().await;
}
