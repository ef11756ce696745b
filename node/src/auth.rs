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

use std::time::Duration;

use iroh::{
    EndpointId,
    endpoint::{Connection, ConnectionError, VarInt},
};
use tb_proto::{Access, CloseCode, ClusterKey, Hello, HelloReply, NodeId};
use tracing::debug;

use crate::{
    error::{Error, Result},
    wire::{self, ReadFrameError},
};

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

/// Client side: proves `key` to the server of `conn` and checks its answer.
pub async fn client_hello(
    conn: &Connection,
    me: EndpointId,
    key: &ClusterKey,
    alpn: &[u8],
    timeout: Duration,
) -> Result<Welcomed> {
    let (me, peer) = (node_id(&me), node_id(&conn.remote_id()));
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| closed_error(conn, e))?;
        let hello = Hello {
            proof: key.prove(alpn, &me, &peer),
        };
        wire::write_frame(&mut send, &hello).await?;
        let _ = send.finish();
        match wire::read_frame::<HelloReply>(&mut recv).await {
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

/// Server side: reads the client's [`Hello`] from the first stream it opens and checks it;
/// returns the access the client proved. On `Err` the connection is already closed (with `Unauthorized` for a wrong proof, after
/// `on_refusal` ran, so a metric counts it before the client can see the refusal) and the
/// caller must serve nothing on it.
pub async fn server_hello(
    conn: &Connection,
    me: EndpointId,
    key: &ClusterKey,
    alpn: &[u8],
    timeout: Duration,
    max_tensor_bytes: u64,
    on_refusal: impl FnOnce(),
) -> Result<Access> {
    let (me, peer) = (node_id(&me), node_id(&conn.remote_id()));
    let exchange = async {
        let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| closed_error(conn, e))?;
        let hello = wire::read_frame::<Hello>(&mut recv)
            .await
            .map_err(|e| e.into_error("hello"))?;
        let Some(access) = key.verify(alpn, &peer, &me, &hello.proof) else {
            return Ok(None);
        };
        let reply = HelloReply::Welcome {
            max_tensor_bytes,
            proof: key.prove(alpn, &me, &peer),
        };
        wire::write_frame(&mut send, &reply).await?;
        let _ = send.finish();
        Ok::<_, Error>(Some(access))
    };
    let who = conn.remote_id().fmt_short().to_string();
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(Some(access))) => Ok(access),
        Ok(Ok(None)) => {
            debug!(peer = %who, "refusing a peer without the cluster secret");
            on_refusal();
            close(conn, CloseCode::Unauthorized);
            Err(Error::Unauthorized(format!(
                "{who} did not prove it knows the cluster secret"
            )))
        }
        Ok(Err(e)) => {
            close(conn, CloseCode::ProtocolError);
            Err(e)
        }
        Err(_) => {
            close(conn, CloseCode::ProtocolError);
            Err(Error::timeout(format!("a hello from {who}"), timeout))
        }
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
