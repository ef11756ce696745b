//! [`RequestSend`] and [`RequestRecv`]: the two directions of a request of a service kind
//! ([`Node::open_request`](crate::Node::open_request) on the caller's side, a [`Service`]'s
//! [`LocalStream`] or [`ServiceStream`](crate::ServiceStream) on the server's). Between two
//! nodes on one host they are a connection of the pair's same-host socket; otherwise a QUIC
//! stream of the pair's pooled link. Both carry the same bytes and frames: a service written
//! against these types serves both.
//!
//! [`Service`]: crate::Service
//! [`LocalStream`]: crate::LocalStream

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use iroh::endpoint::{RecvStream, SendStream};
use serde::{Serialize, de::DeserializeOwned};
use tb_link::framing::ReadFrameError;
use tb_proto::frame;

use crate::error::{Error, Result};

/// A future that completes when the peer stopped listening (see [`RequestSend::stopped`]).
pub type Stopped = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// What this side sends of a request's stream.
pub struct RequestSend(SendHalf);

enum SendHalf {
    Quic(SendStream),
    #[cfg(target_os = "linux")]
    Socket(crate::channel::CallSend),
}

impl std::fmt::Debug for RequestSend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            SendHalf::Quic(_) => "RequestSend(quic)",
            #[cfg(target_os = "linux")]
            SendHalf::Socket(_) => "RequestSend(socket)",
        })
    }
}

impl From<SendStream> for RequestSend {
    fn from(stream: SendStream) -> Self {
        RequestSend(SendHalf::Quic(stream))
    }
}

#[cfg(target_os = "linux")]
impl From<crate::channel::CallSend> for RequestSend {
    fn from(half: crate::channel::CallSend) -> Self {
        RequestSend(SendHalf::Socket(half))
    }
}

impl RequestSend {
    /// Writes all of `bytes`.
    pub async fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        match &mut self.0 {
            SendHalf::Quic(s) => s
                .write_all(bytes)
                .await
                .map_err(|e| Error::io("sending on a stream", e)),
            #[cfg(target_os = "linux")]
            SendHalf::Socket(s) => s.write_all(bytes).await,
        }
    }

    /// Writes one length-prefixed frame.
    pub async fn write_frame<T: Serialize>(&mut self, msg: &T) -> Result<()> {
        let bytes = frame::encode(msg).map_err(|e| Error::io("encoding a frame", e))?;
        self.write_all(&bytes).await
    }

    /// Writes one frame, failing with `Timeout` if the peer does not take it within `stall`
    /// (a server's every write is bounded: a peer that stops reading cannot hold it).
    pub async fn write_frame_within<T: Serialize>(
        &mut self,
        msg: &T,
        stall: Duration,
    ) -> Result<()> {
        match tokio::time::timeout(stall, self.write_frame(msg)).await {
            Ok(written) => written,
            Err(_) => Err(Error::timeout("a peer taking a frame", stall)),
        }
    }

    /// Writes one frame and then `payload`'s parts right behind it (on a same-host
    /// connection, one `sendmsg`: one wake-up of the reader, not one per part).
    pub async fn write_frame_then<T: Serialize>(
        &mut self,
        msg: &T,
        payload: &[&[u8]],
    ) -> Result<()> {
        let head = frame::encode(msg).map_err(|e| Error::io("encoding a frame", e))?;
        match &mut self.0 {
            SendHalf::Quic(_) => {
                self.write_all(&head).await?;
                for part in payload {
                    self.write_all(part).await?;
                }
                Ok(())
            }
            #[cfg(target_os = "linux")]
            SendHalf::Socket(s) => {
                let parts: Vec<&[u8]> = std::iter::once(&head[..])
                    .chain(payload.iter().copied())
                    .collect();
                s.write_parts(&[], &parts, false).await
            }
        }
    }

    /// Writes one frame and ends this direction, within `stall` (on a same-host
    /// connection, one `sendmsg`).
    pub async fn write_frame_and_finish<T: Serialize>(
        &mut self,
        msg: &T,
        stall: Duration,
    ) -> Result<()> {
        let head = frame::encode(msg).map_err(|e| Error::io("encoding a frame", e))?;
        let written = async {
            match &mut self.0 {
                SendHalf::Quic(_) => {
                    self.write_all(&head).await?;
                    self.finish().await
                }
                #[cfg(target_os = "linux")]
                SendHalf::Socket(s) => s.write_parts(&[], &[&head], true).await,
            }
        };
        match tokio::time::timeout(stall, written).await {
            Ok(written) => written,
            Err(_) => Err(Error::timeout("a peer taking a frame", stall)),
        }
    }

    /// Ends this direction: the peer reads the end after what was written. Again: nothing.
    pub async fn finish(&mut self) -> Result<()> {
        match &mut self.0 {
            // QUIC queues the end; it rides in the last packet.
            SendHalf::Quic(s) => match s.finish() {
                Ok(()) => Ok(()),
                Err(e) => Err(Error::io("finishing a stream", e)),
            },
            #[cfg(target_os = "linux")]
            SendHalf::Socket(s) => s.finish().await,
        }
    }

    /// Completes when the peer stopped listening: it cancelled the request or is gone (a
    /// QUIC stream stopped or reset, the same-host connection closed). Borrows nothing, so
    /// it can be awaited while this side writes.
    pub fn stopped(&self) -> Stopped {
        match &self.0 {
            SendHalf::Quic(s) => {
                let stopped = s.stopped();
                Box::pin(async move {
                    let _ = stopped.await;
                })
            }
            #[cfg(target_os = "linux")]
            SendHalf::Socket(s) => Box::pin(s.stopped()),
        }
    }

    /// Whether this is a same-host connection (not a QUIC stream).
    pub fn is_same_host(&self) -> bool {
        !matches!(self.0, SendHalf::Quic(_))
    }
}

/// What the peer sends of a request's stream.
pub struct RequestRecv(RecvHalf);

enum RecvHalf {
    Quic(RecvStream),
    #[cfg(target_os = "linux")]
    Socket(crate::channel::CallRecv),
}

impl std::fmt::Debug for RequestRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            RecvHalf::Quic(_) => "RequestRecv(quic)",
            #[cfg(target_os = "linux")]
            RecvHalf::Socket(_) => "RequestRecv(socket)",
        })
    }
}

impl From<RecvStream> for RequestRecv {
    fn from(stream: RecvStream) -> Self {
        RequestRecv(RecvHalf::Quic(stream))
    }
}

#[cfg(target_os = "linux")]
impl From<crate::channel::CallRecv> for RequestRecv {
    fn from(half: crate::channel::CallRecv) -> Self {
        RequestRecv(RecvHalf::Socket(half))
    }
}

impl RequestRecv {
    /// Reads into `buf`: `Some(n)` bytes, `None` at the peer's end. Cancel-safe: a read
    /// dropped before it completes loses no byte.
    pub async fn read(&mut self, buf: &mut [u8]) -> Result<Option<usize>> {
        match &mut self.0 {
            RecvHalf::Quic(s) => s
                .read(buf)
                .await
                .map_err(|e| Error::io("reading a stream", e)),
            #[cfg(target_os = "linux")]
            RecvHalf::Socket(s) => s.read(buf).await,
        }
    }

    /// Reads exactly `buf.len()` bytes; the peer's end before them is an error.
    pub async fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        match &mut self.0 {
            RecvHalf::Quic(s) => s
                .read_exact(buf)
                .await
                .map_err(|e| Error::io("reading a stream", e)),
            #[cfg(target_os = "linux")]
            RecvHalf::Socket(s) => s.read_exact(buf).await,
        }
    }

    /// Reads one length-prefixed frame of at most the control-frame cap, checked before the
    /// body is allocated.
    pub async fn read_frame<T: DeserializeOwned>(
        &mut self,
    ) -> std::result::Result<T, ReadFrameError> {
        let mut prefix = [0u8; frame::LEN_PREFIX];
        let closed = |e: Error| ReadFrameError::Closed(e.to_string());
        self.read_exact(&mut prefix).await.map_err(closed)?;
        let len = frame::body_len_within(prefix, frame::MAX_CONTROL_FRAME)
            .map_err(ReadFrameError::Invalid)?;
        let mut body = vec![0u8; len];
        self.read_exact(&mut body).await.map_err(closed)?;
        frame::decode_body(&body).map_err(ReadFrameError::Invalid)
    }

    /// Reads and drops what the peer still sends until its end (`true`), within `limit` and at
    /// most `most` bytes: `false` if it sends more, fails or takes longer. A same-host
    /// connection whose two sides both ended is used again (the caller's goes back to its
    /// pool, the server's is served again).
    pub async fn discard_to_end(&mut self, most: usize, limit: std::time::Duration) -> bool {
        let mut buf = [0u8; 512];
        let mut left = most;
        let drained = async {
            // Bounded by `most`: each round reads at least one byte or ends.
            loop {
                match self.read(&mut buf).await {
                    Ok(Some(n)) if n <= left => left -= n,
                    Ok(None) => return true,
                    Ok(Some(_)) | Err(_) => return false,
                }
            }
        };
        tokio::time::timeout(limit, drained).await.unwrap_or(false)
    }

    /// A counter of the bytes received from the peer, for a same-host connection (how a
    /// reader tells a quiet peer from a lost one there; a QUIC stream's is its link's).
    pub(crate) fn socket_heard(&self) -> Option<Arc<AtomicU64>> {
        match &self.0 {
            RecvHalf::Quic(_) => None,
            #[cfg(target_os = "linux")]
            RecvHalf::Socket(s) => Some(s.heard()),
        }
    }
}
