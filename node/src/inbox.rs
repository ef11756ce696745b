//! [`Inbox`]: tensors pushed to this node, queued until `recv()` or `wait_for()` takes them.
//!
//! Bounded in count and in bytes. Bytes: a push reserves its length from the inbox's budget
//! ([`Inbox::reserve`]) when its header arrives, before anything is allocated, and the
//! reservation stays with the tensor until `recv()` takes it; a push that does not fit is
//! refused at once. Count: when full, the stream that delivers a push waits for room (so the
//! pusher sees back-pressure, and nothing is dropped); every wait is bounded by a timeout.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use iroh::EndpointId;
use tb_proto::TensorName;
use tokio::sync::Notify;

use crate::{
    budget::{BudgetError, ByteBudget, Reservation},
    error::{Error, Result},
    tensor::Tensor,
};

/// A tensor another node pushed to this one.
#[derive(Debug, Clone)]
pub struct Received {
    /// The sender's node id.
    pub from: EndpointId,
    /// The name the sender gave it.
    pub name: TensorName,
    /// The verified tensor.
    pub tensor: Tensor,
    /// Its place in the order of arrival (set when it is queued): what puts a tensor given
    /// back ([`Inbox::give_back`]) where it was.
    pub(crate) seq: u64,
}

/// A queued tensor and the bytes it holds against a budget (host or device).
type Queued = (Received, Reservation);

#[derive(Debug)]
struct Inner {
    queue: Mutex<VecDeque<Queued>>,
    arrived: Notify,
    taken: Notify,
    capacity: usize,
    /// Host bytes of pushes being received or queued here.
    bytes: ByteBudget,
    /// The next arrival's [`Received::seq`].
    next_seq: AtomicU64,
}

/// The queue of pushed tensors. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Inbox(Arc<Inner>);

impl Inbox {
    /// An empty inbox holding at most `capacity` (at least 1) tensors, and at most
    /// `max_bytes` host bytes of pushes being received or queued.
    pub fn new(capacity: usize, max_bytes: u64) -> Self {
        Inbox(Arc::new(Inner {
            queue: Mutex::default(),
            arrived: Notify::new(),
            taken: Notify::new(),
            capacity: capacity.max(1),
            bytes: ByteBudget::new(max_bytes),
            next_seq: AtomicU64::new(0),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Queued>> {
        self.0.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves host memory for a push of `bytes` about to be received, if it fits now (never
    /// waits). Hand the reservation to [`Inbox::deliver`] with the tensor.
    pub fn reserve(&self, bytes: u64) -> Result<Reservation, BudgetError> {
        self.0.bytes.try_reserve(bytes)
    }

    /// Host bytes held by pushes being received or queued.
    pub fn bytes(&self) -> u64 {
        self.0.bytes.in_use()
    }

    /// Queues a received tensor with the reservation that holds its bytes (released when it
    /// is taken), waiting up to `timeout` for room.
    pub async fn deliver(
        &self,
        item: Received,
        held: Reservation,
        timeout: Duration,
    ) -> Result<()> {
        let mut item = (item, held);
        let wait = async {
            loop {
                let notified = self.0.taken.notified();
                {
                    let mut queue = self.lock();
                    if queue.len() < self.0.capacity {
                        // Numbered under the lock: the queue stays in `seq` order.
                        item.0.seq = self.0.next_seq.fetch_add(1, Ordering::Relaxed);
                        queue.push_back(item);
                        self.0.arrived.notify_waiters();
                        return;
                    }
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| Error::timeout("room in the receiver's inbox", timeout))
    }

    /// Takes the oldest received tensor, or the oldest named `name`, waiting up to `timeout`.
    pub async fn take(&self, name: Option<&TensorName>, timeout: Duration) -> Result<Received> {
        let wait = async {
            loop {
                let notified = self.0.arrived.notified();
                if let Some(item) = self.try_take(name) {
                    return item;
                }
                notified.await;
            }
        };
        let what = match name {
            Some(n) => format!("a pushed tensor named \"{n}\""),
            None => "a pushed tensor".to_string(),
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| Error::timeout(what, timeout))
    }

    /// Puts `item`, taken by [`take`](Self::take), back where it was in the queue (before
    /// every tensor that arrived after it): its taker could not hand it on (an asyncio
    /// `recv` cancelled after the runtime took the tensor but before the event loop
    /// delivered it). Never waits and never refuses: the tensor is in memory already, so it
    /// is queued even past the count limit, its bytes counted again by `held` (from
    /// [`reserve_again`](Self::reserve_again) or the device pushes' budget).
    pub(crate) fn give_back(&self, item: Received, held: Reservation) {
        let mut queue = self.lock();
        let at = queue.partition_point(|(queued, _)| queued.seq < item.seq);
        queue.insert(at, (item, held));
        drop(queue);
        self.0.arrived.notify_waiters();
    }

    /// Holds `bytes` of host memory against the inbox's budget again, even past its limit:
    /// for a pushed tensor given back ([`give_back`](Self::give_back)).
    pub(crate) fn reserve_again(&self, bytes: u64) -> Reservation {
        self.0.bytes.reserve_over(bytes)
    }

    fn try_take(&self, name: Option<&TensorName>) -> Option<Received> {
        let mut queue = self.lock();
        let index = match name {
            None => 0,
            Some(n) => queue.iter().position(|(r, _)| &r.name == n)?,
        };
        // The reservation drops here: from now on the bytes are the caller's.
        let (item, _held) = queue.remove(index)?;
        self.0.taken.notify_waiters();
        Some(item)
    }

    /// Number of queued tensors.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(name: &str) -> Received {
        Received {
            from: iroh::SecretKey::generate().public(),
            name: TensorName::new(name).expect("name"),
            tensor: Tensor::from_bytes(name.as_bytes().to_vec()),
            seq: 0,
        }
    }

    /// Reserves an item's bytes and delivers it.
    async fn deliver(inbox: &Inbox, name: &str, timeout: Duration) -> Result<()> {
        let held = inbox.reserve(name.len() as u64).expect("room");
        inbox.deliver(item(name), held, timeout).await
    }

    #[tokio::test]
    async fn take_by_name_skips_others_and_keeps_order() {
        let inbox = Inbox::new(8, 1 << 20);
        let t = Duration::from_secs(1);
        for n in ["a", "b", "a2"] {
            deliver(&inbox, n, t).await.expect("deliver");
        }
        let b = TensorName::new("b").expect("name");
        assert_eq!(inbox.take(Some(&b), t).await.expect("b").name, b);
        assert_eq!(inbox.take(None, t).await.expect("a").name.as_str(), "a");
        assert_eq!(inbox.take(None, t).await.expect("a2").name.as_str(), "a2");
        assert!(matches!(
            inbox.take(None, Duration::from_millis(20)).await,
            Err(Error::Timeout { .. })
        ));
    }

    /// Regression: an asyncio `recv` cancelled after the runtime took its tensor lost it.
    #[tokio::test]
    async fn tensors_given_back_go_where_they_were_and_count_again() {
        let inbox = Inbox::new(1, 8);
        let t = Duration::from_secs(1);
        deliver(&inbox, "first", t).await.expect("first");
        let first = inbox.take(None, t).await.expect("first");
        deliver(&inbox, "second", t).await.expect("second");
        let second = inbox.take(None, t).await.expect("second");
        deliver(&inbox, "later", t).await.expect("later");
        assert_eq!(inbox.bytes(), 5);
        // Back where they were, given back in either order, even though the inbox is full
        // (capacity 1) and their bytes count past the budget's 8.
        for item in [second, first] {
            let held = inbox.reserve_again(item.tensor.byte_len());
            inbox.give_back(item, held);
        }
        assert_eq!((inbox.len(), inbox.bytes()), (3, 16));
        for name in ["first", "second", "later"] {
            let got = inbox.take(None, t).await.expect("taken");
            assert_eq!(got.name.as_str(), name);
        }
        assert_eq!(inbox.bytes(), 0);
    }

    #[tokio::test]
    async fn full_inbox_applies_back_pressure() {
        let inbox = Inbox::new(1, 1 << 20);
        let t = Duration::from_secs(2);
        deliver(&inbox, "a", t).await.expect("first");
        assert!(matches!(
            deliver(&inbox, "b", Duration::from_millis(20)).await,
            Err(Error::Timeout { .. })
        ));
        let waiting = {
            let inbox = inbox.clone();
            tokio::spawn(async move { deliver(&inbox, "c", t).await })
        };
        assert_eq!(inbox.take(None, t).await.expect("a").name.as_str(), "a");
        waiting.await.expect("join").expect("delivered after room");
        assert_eq!(inbox.take(None, t).await.expect("c").name.as_str(), "c");
    }

    /// Regression: the inbox was bounded by count only, so a thousand large pushes nobody
    /// took could fill the node's memory.
    #[tokio::test]
    async fn inbox_refuses_pushes_by_bytes_until_recv_takes_them() {
        let inbox = Inbox::new(1024, 100);
        let t = Duration::from_secs(1);
        let held = inbox.reserve(60).expect("60 of 100 bytes fit");
        inbox.deliver(item("a"), held, t).await.expect("queued");
        assert_eq!(inbox.bytes(), 60, "a queued push keeps its bytes");
        assert_eq!(
            inbox.reserve(41).expect_err("full"),
            BudgetError::Busy {
                bytes: 41,
                in_use: 60,
                limit: 100
            }
        );
        assert!(matches!(
            inbox.reserve(101),
            Err(BudgetError::TooLarge { .. })
        ));
        let refused = inbox.reserve(41);
        assert!(refused.is_err());
        drop(refused);
        assert_eq!(inbox.len(), 1, "a refused push leaves nothing behind");
        assert_eq!(inbox.bytes(), 60);
        assert_eq!(inbox.take(None, t).await.expect("a").name.as_str(), "a");
        assert_eq!(inbox.bytes(), 0, "taking a push releases its bytes");
        let whole = inbox.reserve(100).expect("the whole budget once empty");
        drop(whole);
        assert_eq!(
            inbox.bytes(),
            0,
            "a push that ends early releases its bytes"
        );
    }
}
