//! `PeerActor`: owns one QUIC connection to one peer — a pooled link, or a superseded one
//! (another link of a peer whose pooled link is preferred) closed once it is unused.
//!
//! It watches the connection and stops when it dies, closes it after the idle timeout once no
//! guard is alive (no stream open in either direction: the streams we serve hold guards too),
//! after [`SUPERSEDED_IDLE`] at most once it is superseded, and when the pool evicts it. Idle
//! closes use [`CloseCode::IdleEvicted`], which the peer reads as "redial". Its parent
//! `PoolActor` supervises it and drops it from the pool when it stops. It never waits on its
//! parent.

use std::{sync::Arc, time::Duration};

use iroh::{
    EndpointId,
    endpoint::{Connection, VarInt},
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tb_proto::CloseCode;
use tokio::task::JoinHandle;
use tracing::debug;

use tb_dashboard::Metrics;

use super::{SUPERSEDED_IDLE, link::LinkShared};

/// Messages a `PeerActor` handles.
#[derive(Debug)]
pub(crate) enum PeerMsg {
    /// The last guard was dropped: start (or keep) the idle clock.
    Released,
    /// The pool prefers another link of this peer: close this one once idle, after
    /// [`SUPERSEDED_IDLE`] at most.
    Supersede,
    /// Time to check whether the link has been idle long enough to close.
    CheckIdle,
    /// The pool evicted the link (or shuts down): close it with this code.
    Close(CloseCode),
    /// The connection died.
    Lost(String),
}

/// Start-up input.
pub(crate) struct PeerArgs {
    pub(crate) peer: EndpointId,
    pub(crate) conn: Connection,
    pub(crate) link: Arc<LinkShared>,
    pub(crate) idle_timeout: Duration,
    pub(crate) metrics: Arc<Metrics>,
}

pub(crate) struct PeerState {
    args: PeerArgs,
    watcher: JoinHandle<()>,
    check_scheduled: bool,
    /// Unpooled: closed once idle for [`SUPERSEDED_IDLE`] (or the idle timeout if shorter).
    superseded: bool,
}

impl PeerState {
    /// How long the link may stay idle before it is closed.
    fn idle_limit(&self) -> Duration {
        match self.superseded {
            true => self.args.idle_timeout.min(SUPERSEDED_IDLE),
            false => self.args.idle_timeout,
        }
    }
}

/// The actor for one link, pooled or superseded.
pub(crate) struct PeerActor;

/// Closes a connection with one of our close codes (unless it is closed already).
pub(crate) fn close(conn: &Connection, code: CloseCode) {
    if conn.close_reason().is_none() {
        conn.close(VarInt::from_u32(code.code()), code.reason());
    }
}

impl Actor for PeerActor {
    type Msg = PeerMsg;
    type State = PeerState;
    type Arguments = PeerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PeerMsg>,
        args: PeerArgs,
    ) -> Result<PeerState, ActorProcessingErr> {
        let conn = args.conn.clone();
        let me = myself.clone();
        let watcher = tokio::spawn(async move {
            let reason = conn.closed().await;
            let _ = me.cast(PeerMsg::Lost(reason.to_string()));
        });
        let mut state = PeerState {
            args,
            watcher,
            check_scheduled: false,
            superseded: false,
        };
        if state.args.link.idle_since().is_some() {
            let timeout = state.args.idle_timeout;
            schedule_check(&myself, &mut state, timeout);
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<PeerMsg>,
        msg: PeerMsg,
        state: &mut PeerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PeerMsg::Released => {
                let timeout = state.idle_limit();
                schedule_check(&myself, state, timeout);
            }
            PeerMsg::Supersede => {
                state.superseded = true;
                // A check set for the longer idle timeout may be pending: set a sooner one
                // (a spare check finds the link in use, or not idle long enough, and waits).
                state.check_scheduled = false;
                let timeout = state.idle_limit();
                schedule_check(&myself, state, timeout);
            }
            PeerMsg::CheckIdle => check_idle(&myself, state),
            PeerMsg::Close(code) => {
                state.args.link.mark_dead();
                close(&state.args.conn, code);
                myself.stop(Some(format!("closed: {code:?}")));
            }
            PeerMsg::Lost(reason) => {
                debug!(peer = %state.args.peer.fmt_short(), %reason, "link lost");
                state.args.link.mark_dead();
                myself.stop(Some(format!("lost: {reason}")));
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PeerMsg>,
        state: &mut PeerState,
    ) -> Result<(), ActorProcessingErr> {
        state.watcher.abort();
        state.args.link.mark_dead();
        // Stopped from outside (the node shuts down): nothing serves the link any more.
        close(&state.args.conn, CloseCode::Shutdown);
        Ok(())
    }
}

/// Keeps at most one idle check pending, so a busy link does not pile up timers.
fn schedule_check(myself: &ActorRef<PeerMsg>, state: &mut PeerState, after: Duration) {
    if !state.check_scheduled {
        state.check_scheduled = true;
        myself.send_after(after, || PeerMsg::CheckIdle);
    }
}

fn check_idle(myself: &ActorRef<PeerMsg>, state: &mut PeerState) {
    state.check_scheduled = false;
    let Some(since) = state.args.link.idle_since() else {
        return; // in use: the next `Released` restarts the clock
    };
    let idle_for = since.elapsed();
    let timeout = state.idle_limit();
    if idle_for < timeout {
        schedule_check(myself, state, timeout - idle_for);
        return;
    }
    if state.args.link.try_close() {
        let superseded = state.superseded;
        debug!(peer = %state.args.peer.fmt_short(), ?idle_for, superseded, "closing idle link");
        match superseded {
            true => state.args.metrics.pool_evictions_superseded.inc(),
            false => state.args.metrics.pool_evictions_idle.inc(),
        }
        close(&state.args.conn, CloseCode::IdleEvicted);
        myself.stop(Some("idle".into()));
    }
}
