//! `Watch` on the same-host socket: a subscriber on the same host as the publisher it
//! watches takes offers over the shm channel's unix socket, which costs a fraction of a QUIC
//! hop (see [`crate::watch`] for what watching is). One socket connection per watch, closed
//! when the watch ends; it is never pooled.

use iroh::EndpointId;
use tb_proto::{DataRequest, DataResponse, TensorName, frame::MAX_CONTROL_FRAME};
use tracing::debug;

use super::{ShmRoute, client::connection, socket::ShmStream, socket::within};
use crate::{channel::ChannelError, client::remote_error_from, ctx::NodeCtx, error::Result};

/// Serves a watch on a same-host connection until the watcher goes (a write fails) or the
/// node stops; refused `Busy` past the limits (`Watchers::register` says why). The connection is
/// not used again after it.
pub(crate) async fn serve(ctx: &NodeCtx, conn: &mut ShmStream, name: &TensorName) {
    let stall = ctx.config.stall_timeout;
    let mut watch = match ctx.watchers.register(name) {
        Ok(watch) => watch,
        Err(refusal) => {
            let _ = within(stall, "a refusal", conn.write_frame(&refusal)).await;
            return;
        }
    };
    loop {
        let frame = tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            frame = watch.next_frame() => match frame {
                Some(frame) => frame,
                None => return,
            },
        };
        // A watcher that went shows here: the write fails (its socket is closed).
        if let Err(e) = within(stall, "an offer", conn.write_frame(&frame)).await {
            debug!(%e, %name, "a same-host watch ended");
            return;
        }
        ctx.metrics.watch_offers_out.inc();
    }
}

/// A watch open on a same-host connection.
pub(crate) struct ShmWatch {
    conn: ShmStream,
    peer: EndpointId,
}

impl ShmWatch {
    /// Opens a watch of `name` at the route's peer; `Fallback` when the socket fails (watch
    /// over QUIC instead).
    pub(crate) async fn open(
        ctx: &NodeCtx,
        route: &ShmRoute,
        name: &TensorName,
    ) -> Result<ShmWatch, ChannelError> {
        let mut conn = connection(ctx, route, route.peer).await?;
        let request = DataRequest::Watch { name: name.clone() };
        let timeout = ctx.config.request_timeout;
        within(timeout, "a same-host watch", conn.write_frame(&request))
            .await
            .map_err(ChannelError::Fallback)?;
        Ok(ShmWatch {
            conn,
            peer: route.peer,
        })
    }

    /// The publisher.
    pub(crate) fn peer(&self) -> EndpointId {
        self.peer
    }

    /// The next frame the publisher sends (an `Error` answer as an error).
    pub(crate) async fn next(&mut self) -> Result<DataResponse> {
        match self.conn.read_frame(MAX_CONTROL_FRAME).await? {
            DataResponse::Error { code, message } => Err(remote_error_from(
                self.peer.fmt_short().to_string(),
                code,
                message,
            )),
            frame => Ok(frame),
        }
    }
}
