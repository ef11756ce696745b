//! The cluster-secret handshake that opens every `tb/data/1` and `tb/ctl/1` connection.
//!
//! The client opens the connection's first bi-stream and sends [`Hello`] (proofs bound to the
//! ALPN and both node ids, see [`ClusterKey::prove`]); the server reads nothing else until it
//! has checked it. A wrong proof closes the connection with [`CloseCode::Unauthorized`] and is
//! counted; a right one is answered by [`HelloReply::Welcome`] carrying the server's own proof,
//! so both sides know the other is of the cluster before any request is served either way.
//! Each side learns the [`Access`] the other proved (read-only or read-write): whoever serves
//! requests on the connection records it and checks it on every request.
//! Nodes without a secret use [`ClusterKey::open`]: the same exchange, which any open node
//! passes and no node with a secret does.
//!
//! Until the hello is verified a peer is held to little (see [`Admission`]): the hello is
//! read under [`MAX_HELLO_FRAME`], within [`LinkConfig::hello_timeout`], by at most
//! [`LinkConfig::max_pending_handshakes`] connections at once, under the pre-auth flow-control
//! limits of [`crate::endpoint`]; each side opens those limits only once it has verified the
//! other ([`endpoint::open_link`]). Every refusal is counted by [`AuthFailure`] reason.

use std::{sync::Arc, time::Duration};

use iroh::{
    EndpointId,
    endpoint::{Connection, ConnectionError, VarInt},
};
use tb_dashboard::AuthFailure;
use tb_proto::{
    Access, CloseCode, ClusterKey, FrameError, Hello, HelloReply, MAX_HELLO_FRAME, NodeId,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::debug;

use crate::{
    config::LinkConfig,
    endpoint,
    error::{Error, Result},
    framing::{self, ReadFrameError},
};

/// What a server grants connections before their hello is verified: a bounded number of
/// them wait at once, each for a bounded time. One per protocol handler; clones share the
/// waiting slots.
#[derive(Debug, Clone)]
pub struct Admission {
    waiting: Arc<Semaphore>,
    /// How long a connection may take to deliver a hello that verifies.
    pub hello_timeout: Duration,
    /// Streams an admitted peer may open at once.
    pub max_streams: u32,
}

impl Admission {
    /// The limits of `config`: [`LinkConfig::max_pending_handshakes`],
    /// [`LinkConfig::hello_timeout`], [`LinkConfig::max_concurrent_streams`]. Takes anything
    /// that gives a `LinkConfig`, such as tb-node's `&Config`.
    pub fn new(config: impl Into<LinkConfig>) -> Self {
        let config = config.into();
        Admission {
            waiting: Arc::new(Semaphore::new(
                config
                    .max_pending_handshakes
                    .clamp(1, Semaphore::MAX_PERMITS),
            )),
            hello_timeout: config.hello_timeout,
            max_streams: config.max_concurrent_streams,
        }
    }

    /// A waiting slot for one connection's hello, or `None` when all are taken.
    fn enter(&self) -> Option<OwnedSemaphorePermit> {
        self.waiting.clone().try_acquire_owned().ok()
    }
}

/// A node id as `tb-proto` spells it.
pub fn node_id(id: &EndpointId) -> NodeId {
    NodeId(*id.as_bytes())
}

/// What a client learns from the server's welcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcomed {
    /// The server's maximum tensor size.
    pub max_tensor_bytes: u64,
    /// What the server proved (read-only when this node holds only the read-only credential,
    /// which cannot check more): what it may ask of this node on the same connection.
    pub peer: Access,
}

/// Client side: proves `key` to the server of `conn` and checks its answer; once the server is
/// verified, lets it open `max_streams` streams back (0 where servers open none, as on
/// `tb/ctl/1`) and opens the link's window.
pub async fn client_hello(
    conn: &Connection,
    me: EndpointId,
    key: &ClusterKey,
    alpn: &[u8],
    timeout: Duration,
    max_streams: u32,
) -> Result<Welcomed> {
    let (me, peer) = (node_id(&me), node_id(&conn.remote_id()));
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| closed_error(conn, e))?;
        let hello = Hello {
            proof: key.prove(alpn, &me, &peer),
        };
        framing::write_frame(&mut send, &hello).await?;
        let _ = send.finish();
        match framing::read_frame::<HelloReply>(&mut recv).await {
            Ok(reply) => Ok(reply),
            Err(ReadFrameError::Closed(reason)) => Err(match closing_reason(conn).await {
                Some(e) => closed_error(conn, e),
                None => Error::Io(format!(
                    "hello to {}: {reason}",
                    conn.remote_id().fmt_short()
                )),
            }),
            Err(e) => Err(e.into_error("hello answer")),
        }
    };
    let reply = match tokio::time::timeout(timeout, exchange).await {
        Ok(reply) => reply?,
        Err(_) => return Err(Error::timeout("the peer's hello answer", timeout)),
    };
    let HelloReply::Welcome {
        max_tensor_bytes,
        proof,
    } = reply;
    let Some(access) = key.verify(alpn, &peer, &me, &proof) else {
        close(conn, CloseCode::Unauthorized);
        return Err(Error::Unauthorized(format!(
            "{} could not prove it knows the cluster secret",
            conn.remote_id().fmt_short()
        )));
    };
    endpoint::open_link(conn, max_streams);
    Ok(Welcomed {
        max_tensor_bytes,
        peer: access,
    })
}

/// How long a client whose hello stream ended waits for the connection's close reason (a
/// refusing server closes the connection right after, and the reason can land a moment after
/// the stream's end).
const CLOSE_REASON_WAIT: Duration = Duration::from_millis(500);

/// The connection's close reason, waiting briefly for it to arrive.
async fn closing_reason(conn: &Connection) -> Option<ConnectionError> {
    if let Some(reason) = conn.close_reason() {
        return Some(reason);
    }
    tokio::time::timeout(CLOSE_REASON_WAIT, conn.closed())
        .await
        .ok()
}

/// Server side: reads the client's [`Hello`] from the first stream it opens and checks it,
/// within `admission`'s limits; once it verifies, opens the link's limits and answers with
/// the access the client proved.
/// On `Err` the connection is already closed (with `Unauthorized` for a wrong proof) and the
/// caller must serve nothing on it. Every refusal runs `on_refusal` with its reason first, so
/// a metric counts it before the client can see it; a peer that goes away by itself is no
/// refusal.
pub async fn server_hello(
    conn: &Connection,
    me: EndpointId,
    key: &ClusterKey,
    alpn: &[u8],
    admission: &Admission,
    max_tensor_bytes: u64,
    on_refusal: impl FnOnce(AuthFailure),
) -> Result<Access> {
    let who = conn.remote_id().fmt_short().to_string();
    let Some(_waiting) = admission.enter() else {
        debug!(peer = %who, "refusing a connection: too many waiting to authenticate");
        on_refusal(AuthFailure::TooManyPending);
        close(conn, CloseCode::TooManyHandshakes);
        return Err(Error::PeerUnreachable {
            peer: who,
            reason: "refused: too many connections waiting to authenticate".into(),
        });
    };
    let (me, peer) = (node_id(&me), node_id(&conn.remote_id()));
    let exchange = async {
        let (mut send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| (None, closed_error(conn, e)))?;
        let hello = framing::read_frame_within::<Hello>(&mut recv, MAX_HELLO_FRAME)
            .await
            .map_err(|e| (hello_failure(conn, &e), e.into_error("hello")))?;
        let Some(access) = key.verify(alpn, &peer, &me, &hello.proof) else {
            return Ok(None);
        };
        endpoint::open_link(conn, admission.max_streams);
        let reply = HelloReply::Welcome {
            max_tensor_bytes,
            proof: key.prove(alpn, &me, &peer),
        };
        framing::write_frame(&mut send, &reply)
            .await
            .map_err(|e| (None, e))?;
        let _ = send.finish();
        Ok::<_, (Option<AuthFailure>, Error)>(Some(access))
    };
    let timeout = admission.hello_timeout;
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(Some(access))) => Ok(access),
        Ok(Ok(None)) => {
            debug!(peer = %who, "refusing a peer without the cluster secret");
            on_refusal(AuthFailure::BadProof);
            close(conn, CloseCode::Unauthorized);
            Err(Error::Unauthorized(format!(
                "{who} did not prove it knows the cluster secret"
            )))
        }
        Ok(Err((reason, e))) => {
            if let Some(reason) = reason {
                debug!(peer = %who, %e, "refusing a bad hello");
                on_refusal(reason);
            }
            close(conn, CloseCode::ProtocolError);
            Err(e)
        }
        Err(_) => {
            debug!(peer = %who, "refusing a peer whose hello did not arrive in time");
            on_refusal(AuthFailure::Timeout);
            close(conn, CloseCode::ProtocolError);
            Err(Error::timeout(format!("a hello from {who}"), timeout))
        }
    }
}

/// The refusal reason for a hello that could not be read; `None` when the connection itself
/// went away (the peer left: nothing to refuse).
fn hello_failure(conn: &Connection, err: &ReadFrameError) -> Option<AuthFailure> {
    match err {
        ReadFrameError::Invalid(FrameError::TooLarge { .. }) => Some(AuthFailure::TooLarge),
        ReadFrameError::Invalid(_) => Some(AuthFailure::Malformed),
        ReadFrameError::Closed(_) if conn.close_reason().is_some() => None,
        ReadFrameError::Closed(_) => Some(AuthFailure::Malformed),
    }
}

/// Whether an error is a peer refusing us for the cluster secret.
fn refused_by_peer(err: &ConnectionError) -> bool {
    matches!(err, ConnectionError::ApplicationClosed(close)
        if close.error_code == VarInt::from_u32(CloseCode::Unauthorized.code()))
}

fn closed_error(conn: &Connection, err: ConnectionError) -> Error {
    let peer = conn.remote_id().fmt_short().to_string();
    if refused_by_peer(&err) {
        return Error::Unauthorized(format!("{peer} refused our cluster secret"));
    }
    Error::PeerUnreachable {
        peer,
        reason: format!("during the hello: {err}"),
    }
}

fn close(conn: &Connection, code: CloseCode) {
    conn.close(VarInt::from_u32(code.code()), code.reason());
}
