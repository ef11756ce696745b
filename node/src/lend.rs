//! Tensors lent to one peer under a private name ([`Node::lend`](crate::Node::lend)): how a
//! crate on the extension point moves a large value over the pair's channel instead of its
//! own stream. The lender holds the tensor under a fresh name (`.tb/lend/` and 128 random
//! bits) that only the named peer may pull, once, while the [`Lent`] handle lives (or, once
//! the handle is let go with [`Lent::until_pulled`], until its time is up); the peer pulls it
//! like any tensor (`Node::pull_lent`: the pair's channel first, so on one host the bytes
//! pass as the tensor's sealed memfd, with no copy).
//!
//! One pull per loan: the serving side takes the loan out as it answers, so a loan never
//! outlives its use, and a handle let go costs nothing once pulled. A loan is served on the
//! stream it is asked on: never striped, never by a TCP ticket. Loans let go and never
//! pulled (their peer went) are swept out within about a second of their time, by the next
//! use or by the node's sweeper ([`Loans::sweep`]).
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

/// The version a lent tensor is pulled as.
pub const LENT_VERSION: u64 = 1;

/// How often loans whose time is up are swept out (on use, and by the node's sweeper).
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);

struct Loan {
    peer: EndpointId,
    tensor: Tensor,
    until: Instant,
}

/// A loan taken out to serve it: the tensor, with what the serving path's check made of it.
pub(crate) struct Taken<T> {
    /// The tensor as lent: a device tensor lent unhashed ([`crate::Node::lend_device`]) has
    /// an all-zero hash until [`Tensor::hashed`].
    pub tensor: Tensor,
    /// What the serving path's check returned.
    pub made: T,
}

#[derive(Default)]
struct State {
    loans: HashMap<TensorName, Loan>,
    /// When loans whose time was up were last swept out.
    swept: Option<Instant>,
}

impl State {
    /// Takes out the loans whose time is up, at most once per [`SWEEP_EVERY`] (the caller
    /// drops them outside the lock: a last reference may unmap a large region).
    fn sweep(&mut self, now: Instant) -> Vec<Loan> {
        if self
            .swept
            .is_some_and(|at| now.duration_since(at) < SWEEP_EVERY)
        {
            return Vec::new();
        }
        self.swept = Some(now);
        let ended: Vec<TensorName> = (self.loans.iter())
            .filter(|(_, loan)| loan.until <= now)
            .map(|(name, _)| name.clone())
            .collect();
        ended
            .iter()
            .filter_map(|name| self.loans.remove(name))
            .collect()
    }
}

/// The loans of one node.
#[derive(Clone, Default)]
pub(crate) struct Loans(Arc<Mutex<State>>);

impl std::fmt::Debug for Loans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Loans({})", self.state().loans.len())
    }
}

impl Loans {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops the loans whose time is up (the node's sweeper calls it every [`SWEEP_EVERY`]).
    pub(crate) fn sweep(&self) {
        let ended = self.state().sweep(Instant::now());
        drop(ended);
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
        let meta = tensor.meta().clone();
        let mut state = self.state();
        let ended = state.sweep(now);
        if state.loans.len() >= MAX_LOANS {
            return Err(Error::Busy(format!(
                "{MAX_LOANS} tensors are lent already: try again when calls end"
            )));
        }
        let loan = Loan {
            peer,
            tensor,
            until,
        };
        state.loans.insert(name.clone(), loan);
        drop(state);
        drop(ended);
        Ok(Lent {
            name,
            meta,
            peer,
            loans: self.clone(),
            let_go: false,
        })
    }

    /// [`take_if`](Self::take_if) that leaves the loan in place (for CUDA IPC, whose
    /// requester may fail to map what was exported: the loan ends with [`end`](Self::end) once
    /// it says it has its copy).
    pub(crate) fn peek_if<T, E>(
        &self,
        peer: &EndpointId,
        name: &TensorName,
        check: impl FnOnce(&Tensor) -> Result<T, E>,
    ) -> Option<Result<Taken<T>, Option<E>>> {
        self.find_if(peer, name, check, false)
    }

    /// The tensor lent as `name`, taken out of the loans (one pull each), when `name` is a
    /// loan's and `check` takes it: `Some(Ok)` for the peer it was lent to, while it lasts, with
    /// what `check` made of the tensor; `Some(Err(Some))` when `check` refused it (the loan
    /// stays, for a path that can serve it); `Some(Err(None))` for anyone else, after its
    /// time, or once pulled (answered like a name nobody holds); `None` when `name` is no lent
    /// name (look in the store).
    pub(crate) fn take_if<T, E>(
        &self,
        peer: &EndpointId,
        name: &TensorName,
        check: impl FnOnce(&Tensor) -> Result<T, E>,
    ) -> Option<Result<Taken<T>, Option<E>>> {
        self.find_if(peer, name, check, true)
    }

    fn find_if<T, E>(
        &self,
        peer: &EndpointId,
        name: &TensorName,
        check: impl FnOnce(&Tensor) -> Result<T, E>,
        take: bool,
    ) -> Option<Result<Taken<T>, Option<E>>> {
        if !is_lent_name(name) {
            return None;
        }
        let mut state = self.state();
        let Some(loan) = state.loans.get(name) else {
            return Some(Err(None));
        };
        if loan.peer != *peer {
            return Some(Err(None));
        }
        if loan.until <= Instant::now() {
            let ended = state.loans.remove(name);
            drop(state);
            drop(ended);
            return Some(Err(None));
        }
        let made = match check(&loan.tensor) {
            Ok(made) => made,
            Err(e) => return Some(Err(Some(e))),
        };
        let tensor = match take {
            true => state.loans.remove(name)?.tensor,
            false => loan.tensor.clone(),
        };
        drop(state);
        Some(Ok(Taken { tensor, made }))
    }

    /// Loans that are live now.
    pub(crate) fn len(&self) -> usize {
        let now = Instant::now();
        (self.state().loans.values())
            .filter(|l| l.until > now)
            .count()
    }

    fn holds(&self, name: &TensorName) -> bool {
        self.state().loans.contains_key(name)
    }

    /// Ends the loan `name` (its handle dropped, or its one pull done another way).
    pub(crate) fn end(&self, name: &TensorName) {
        let removed = self.state().loans.remove(name);
        drop(removed);
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

    /// Whether the loan ended: pulled, or its time up and swept out.
    pub fn ended(&self) -> bool {
        !self.loans.holds(&self.name)
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
        if !self.let_go {
            self.loans.end(&self.name);
        }
    }
}

/// Whether `name` is a lent one (never published or stored under it).
pub fn is_lent_name(name: &TensorName) -> bool {
    name.as_str().starts_with(LEND_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> EndpointId {
        iroh::SecretKey::generate().public()
    }

    #[test]
    fn a_peek_leaves_the_loan_a_take_ends_it_and_a_refusal_keeps_it() {
        let loans = Loans::default();
        let (me, other) = (peer(), peer());
        let tensor = Tensor::from_bytes(vec![7u8; 100]);
        let lent = loans
            .lend(me, tensor.clone(), Duration::from_secs(60))
            .expect("lends");
        let name = lent.name().clone();
        // A check that refuses (a path that cannot serve it) leaves it, saying why.
        let refused = loans.take_if(&me, &name, |_| Err::<(), _>("not here"));
        assert!(matches!(refused, Some(Err(Some("not here")))));
        // A peek (CUDA IPC's export) leaves it too; only its peer sees it.
        let peeked = loans.peek_if(&me, &name, |t| Ok::<_, ()>(t.byte_len()));
        assert!(matches!(peeked, Some(Ok(Taken { made: 100, .. }))));
        assert!(matches!(
            loans.peek_if(&other, &name, |_| Ok::<_, ()>(())),
            Some(Err(None))
        ));
        assert!(!lent.ended());
        // A take ends it: the next one finds nothing.
        let taken = loans
            .take_if(&me, &name, |_| Ok::<_, ()>(()))
            .expect("a lent name");
        assert_eq!(taken.ok().map(|t| t.tensor.hash()), Some(tensor.hash()));
        assert!(lent.ended());
        assert!(matches!(
            loans.take_if(&me, &name, |_| Ok::<_, ()>(())),
            Some(Err(None))
        ));
        // `end` (CUDA IPC's copy made) ends one too; a store name is not a loan's.
        let again = loans
            .lend(me, tensor, Duration::from_secs(60))
            .expect("lends");
        loans.end(again.name());
        assert!(again.ended());
        let stored = TensorName::new("model/w").expect("name");
        assert!(loans.peek_if(&me, &stored, |_| Ok::<_, ()>(())).is_none());
    }
}
