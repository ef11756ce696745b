//! Tensors lent to one peer under a private name ([`Node::lend`](crate::Node::lend)): how a
//! crate on the extension point moves a large value over the pair's channel instead of its
//! own stream. The lender holds the tensor under a fresh name (`.tb/lend/` and 128 random
//! bits) that only the named peer may pull, once, while the [`Lent`] handle lives (or, once
//! the handle is let go with [`Lent::until_pulled`], until its time is up); the peer pulls it
//! like any tensor (`Node::pull_lent`: the pair's channel first, so on one host the bytes
//! pass as the tensor's sealed memfd, with no copy).
//!
//! One pull per loan: the serving side takes the loan out as it answers, so a loan never
//! outlives its use, and a handle let go costs nothing once pulled.
//!
//! A loan is never in the store: it is not published, counted, evicted or listed, and a
//! pull of its name by anyone else (or after it ended) is answered `NotFound`, as for a
//! name nobody holds.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use iroh::EndpointId;
use tb_proto::TensorName;

use crate::{error::Error, tensor::Tensor};

pub use tb_proto::LEND_PREFIX;

/// Most loans a node keeps at once; more are refused (`Busy`) until some end.
pub const MAX_LOANS: usize = 1 << 16;

/// Above this many loans, each new one first sweeps out those whose time is up.
const SWEEP_ABOVE: usize = 256;

/// The version a lent tensor is pulled as.
pub const LENT_VERSION: u64 = 1;

struct Loan {
    peer: EndpointId,
    tensor: Tensor,
    until: Instant,
}

/// The loans of one node.
#[derive(Clone, Default)]
pub(crate) struct Loans(Arc<Mutex<HashMap<TensorName, Loan>>>);

impl std::fmt::Debug for Loans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Loans({})", self.map().len())
    }
}

impl Loans {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<TensorName, Loan>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lends `tensor` to `peer` for at most `ttl`, under a new private name.
    pub(crate) fn lend(
        &self,
        peer: EndpointId,
        tensor: Tensor,
        ttl: Duration,
    ) -> Result<Lent, Error> {
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret)
            .map_err(|e| Error::Io(format!("no randomness for a lent name: {e}")))?;
        let name = TensorName::new(format!("{LEND_PREFIX}{}", hex::encode(secret)))?;
        let now = Instant::now();
        let until = now
            .checked_add(ttl)
            .unwrap_or(now + Duration::from_secs(86_400));
        let mut map = self.map();
        // Loans let go and never pulled end at their time: swept as new ones come.
        if map.len() >= SWEEP_ABOVE {
            map.retain(|_, loan| loan.until > now);
        }
        if map.len() >= MAX_LOANS {
            return Err(Error::Busy(format!(
                "{MAX_LOANS} tensors are lent already: try again when calls end"
            )));
        }
        let meta = tensor.meta().clone();
        map.insert(
            name.clone(),
            Loan {
                peer,
                tensor,
                until,
            },
        );
        Ok(Lent {
            name,
            meta,
            peer,
            loans: self.clone(),
            let_go: false,
        })
    }

    /// The tensor lent as `name`, taken out of the loans (one pull each), when `name` is a
    /// loan's: `Some(Ok)` for the peer it was lent to, while it lasts; `Some(Err(()))` for
    /// anyone else, after its time, or once pulled (answered like a name nobody holds); `None`
    /// when `name` is no lent name (look in the store).
    pub(crate) fn take(&self, peer: &EndpointId, name: &TensorName) -> Option<Result<Tensor, ()>> {
        if !name.as_str().starts_with(LEND_PREFIX) {
            return None;
        }
        let mut map = self.map();
        let Some(loan) = map.get(name) else {
            return Some(Err(()));
        };
        if loan.peer != *peer {
            return Some(Err(()));
        }
        let loan = map.remove(name)?;
        drop(map);
        Some(match loan.until > Instant::now() {
            true => Ok(loan.tensor),
            false => Err(()),
        })
    }

    /// Loans that are live now.
    pub(crate) fn len(&self) -> usize {
        let now = Instant::now();
        self.map().values().filter(|l| l.until > now).count()
    }
}

/// A tensor lent to one peer: its private name, which the peer pulls; the loan ends when
/// this handle is dropped (or its time is up, whichever comes first).
pub struct Lent {
    name: TensorName,
    meta: tb_proto::TensorMeta,
    peer: EndpointId,
    loans: Loans,
    /// Whether the loan outlives this handle (until pulled or its time is up).
    let_go: bool,
}

impl Lent {
    /// Lets the loan live on without this handle: until the peer pulls it, or its time is up
    /// (for a value sent to a peer that pulls it when it reads the value, after the sender
    /// has moved on).
    pub fn until_pulled(mut self) {
        self.let_go = true;
    }

    /// The private name the peer pulls (version [`LENT_VERSION`]).
    pub fn name(&self) -> &TensorName {
        &self.name
    }

    /// The lent tensor's metadata.
    pub fn meta(&self) -> &tb_proto::TensorMeta {
        &self.meta
    }

    /// The peer it is lent to.
    pub fn peer(&self) -> EndpointId {
        self.peer
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("name", &self.name.as_str())
            .field("peer", &self.peer.fmt_short().to_string())
            .field("bytes", &self.meta.byte_len)
            .finish()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if self.let_go {
            return;
        }
        let removed = self.loans.map().remove(&self.name);
        // The tensor's last reference may unmap a large region: dropped outside the lock.
        drop(removed);
    }
}

/// Whether `name` is a lent one (never published or stored under it).
pub fn is_lent_name(name: &TensorName) -> bool {
    name.as_str().starts_with(LEND_PREFIX)
}
