//! [`Inbox`]: tensors pushed to this node, queued until `recv()` or `wait_for()` takes them.
//!
//! Bounded: when full, the stream that delivers a push waits for room (so the pusher sees
//! back-pressure, and nothing is dropped); every wait is bounded by a timeout.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use iroh::EndpointId;
use tb_proto::TensorName;
use tokio::sync::Notify;

use crate::{
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
}

#[derive(Debug)]
struct Inner {
    queue: Mutex<VecDeque<Received>>,
    arrived: Notify,
    taken: Notify,
    capacity: usize,
}

/// The queue of pushed tensors. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Inbox(Arc<Inner>);

impl Inbox {
    /// An empty inbox holding at most `capacity` (at least 1) tensors.
    pub fn new(capacity: usize) -> Self {
        Inbox(Arc::new(Inner {
            queue: Mutex::default(),
            arrived: Notify::new(),
            taken: Notify::new(),
            capacity: capacity.max(1),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Received>> {
        self.0.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a received tensor, waiting up to `timeout` for room.
    pub async fn deliver(&self, item: Received, timeout: Duration) -> Result<()> {
        let wait = async {
            loop {
                let notified = self.0.taken.notified();
                {
                    let mut queue = self.lock();
                    if queue.len() < self.0.capacity {
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

    fn try_take(&self, name: Option<&TensorName>) -> Option<Received> {
        let mut queue = self.lock();
        let index = match name {
            None => 0,
            Some(n) => queue.iter().position(|r| &r.name == n)?,
        };
        let item = queue.remove(index)?;
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
        }
    }

    #[tokio::test]
    async fn take_by_name_skips_others_and_keeps_order() {
        let inbox = Inbox::new(8);
        let t = Duration::from_secs(1);
        for n in ["a", "b", "a2"] {
            inbox.deliver(item(n), t).await.expect("deliver");
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

    #[tokio::test]
    async fn full_inbox_applies_back_pressure() {
        let inbox = Inbox::new(1);
        let t = Duration::from_secs(2);
        inbox.deliver(item("a"), t).await.expect("first");
        assert!(matches!(
            inbox.deliver(item("b"), Duration::from_millis(20)).await,
            Err(Error::Timeout { .. })
        ));
        let waiting = {
            let inbox = inbox.clone();
            tokio::spawn(async move { inbox.deliver(item("c"), t).await })
        };
        assert_eq!(inbox.take(None, t).await.expect("a").name.as_str(), "a");
        waiting.await.expect("join").expect("delivered after room");
        assert_eq!(inbox.take(None, t).await.expect("c").name.as_str(), "c");
    }
}
