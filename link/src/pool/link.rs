//! One link's shared bookkeeping and the guard that marks it in use.
//!
//! "In use" is a fact of the type system: a [`LinkGuard`] exists exactly while a stream on
//! the link may be open, in either direction — a request of ours holds one, and so does each
//! stream the peer opened that we serve. The count lives in an atomic shared by the guards,
//! the link's `PeerActor` and the pool, so handing out a guard never waits on an actor, and a
//! guard's `Drop` only does a non-blocking `cast`. A link is closed (idle, LRU) only by a
//! compare-and-swap of that count from zero, so a link with an open stream is never closed
//! that way, and no stream is taken on a link once it is.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Instant,
};

use iroh::{
    EndpointId,
    endpoint::{Connection, ConnectionError},
};
use ractor::ActorRef;
use tb_proto::CloseCode;

use super::peer::PeerMsg;

/// `in_use` value of a link the pool has closed: no guard can be taken from it again.
const CLOSED: usize = usize::MAX;

/// Use count and idle clock of one link.
#[derive(Debug)]
pub(crate) struct LinkShared {
    in_use: AtomicUsize,
    dead: AtomicBool,
    released_at: Mutex<Instant>,
}

impl LinkShared {
    pub(crate) fn new(now: Instant) -> Self {
        LinkShared {
            in_use: AtomicUsize::new(0),
            dead: AtomicBool::new(false),
            released_at: Mutex::new(now),
        }
    }

    /// Counts one more user, unless the link is closed or dead.
    pub(crate) fn try_acquire(&self) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return false;
        }
        self.in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n != CLOSED).then_some(n + 1)
            })
            .is_ok()
    }

    /// Counts one user fewer; returns true when that was the last one.
    pub(crate) fn release(&self, now: Instant) -> bool {
        let last = self.in_use.fetch_sub(1, Ordering::AcqRel) == 1;
        if last {
            *self.released_at.lock().unwrap_or_else(|p| p.into_inner()) = now;
        }
        last
    }

    /// Closes the link for good if nobody uses it: the only way a link leaves the idle state.
    pub(crate) fn try_close(&self) -> bool {
        self.in_use
            .compare_exchange(0, CLOSED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Marks the link as unusable (its connection died); guards still alive finish with errors.
    pub(crate) fn mark_dead(&self) {
        self.dead.store(true, Ordering::Release);
    }

    /// Whether guards can still be taken from it.
    pub(crate) fn is_usable(&self) -> bool {
        !self.dead.load(Ordering::Acquire) && self.in_use.load(Ordering::Acquire) != CLOSED
    }

    /// When the link became unused, or `None` while it is in use (or closed).
    pub(crate) fn idle_since(&self) -> Option<Instant> {
        (self.in_use.load(Ordering::Acquire) == 0)
            .then(|| *self.released_at.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A fresh link id, unique in this process: what the owner files what a link taught it under
/// (see `LinkEvents`), so that the end of one link never drops what another learned.
pub(crate) fn next_link_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One link as the pool and the serving side hold it: its connection, use count and actor.
#[derive(Debug, Clone)]
pub struct Link {
    /// Its [`next_link_id`].
    pub(crate) id: u64,
    pub(crate) conn: Connection,
    pub(crate) shared: Arc<LinkShared>,
    pub(crate) actor: ActorRef<PeerMsg>,
}

impl Link {
    /// A guard on this link, or `None` once it is closed or dead.
    pub fn guard(&self) -> Option<LinkGuard> {
        LinkGuard::try_new(&self.conn, &self.shared, &self.actor)
    }

    /// Its id, unique in this process: what the owner files what it learned on it under.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The QUIC connection (to accept the peer's streams; open ours under a [`guard`](Self::guard)).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Whether guards can still be taken: false once the pool closed it (idle, evicted, shut
    /// down) or it died.
    pub fn is_usable(&self) -> bool {
        self.shared.is_usable()
    }
}

/// A connection, held for the duration of one or more streams (ours or the peer's).
///
/// While any guard is alive the link is "active" and is never idle-evicted or LRU-evicted.
#[derive(Debug)]
pub struct LinkGuard {
    conn: Connection,
    shared: Arc<LinkShared>,
    peer_actor: ActorRef<PeerMsg>,
}

impl LinkGuard {
    /// Takes a guard, or `None` if the link can no longer be used.
    pub(crate) fn try_new(
        conn: &Connection,
        shared: &Arc<LinkShared>,
        peer_actor: &ActorRef<PeerMsg>,
    ) -> Option<Self> {
        if conn.close_reason().is_some() || !shared.try_acquire() {
            return None;
        }
        Some(LinkGuard {
            conn: conn.clone(),
            shared: shared.clone(),
            peer_actor: peer_actor.clone(),
        })
    }

    /// The QUIC connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The peer's node id.
    pub fn peer(&self) -> EndpointId {
        self.conn.remote_id()
    }

    /// The close code the peer closed the connection with, if it did with one of ours.
    pub fn peer_close(&self) -> Option<CloseCode> {
        peer_close(&self.conn)
    }
}

/// The close code the peer closed `conn` with, if it did with one of ours.
pub(crate) fn peer_close(conn: &Connection) -> Option<CloseCode> {
    match conn.close_reason()? {
        ConnectionError::ApplicationClosed(close) => u32::try_from(close.error_code.into_inner())
            .ok()
            .and_then(CloseCode::from_code),
        _ => None,
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        if self.shared.release(Instant::now()) {
            // Non-blocking: ractor mailboxes are unbounded. A stopped actor needs no notice.
            let _ = self.peer_actor.cast(PeerMsg::Released);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_links_hand_out_nothing() {
        let link = LinkShared::new(Instant::now());
        assert!(link.try_acquire());
        assert!(!link.try_close(), "in use: cannot close");
        assert!(link.idle_since().is_none());
        assert!(link.release(Instant::now()));
        assert!(link.idle_since().is_some());
        assert!(link.try_close());
        assert!(!link.try_acquire(), "closed: no new users");
        assert!(!link.is_usable());
    }

    #[test]
    fn dead_links_hand_out_nothing() {
        let link = LinkShared::new(Instant::now());
        link.mark_dead();
        assert!(!link.try_acquire());
    }
}
