//! `Watch` on the same-host socket: a subscriber on the same host as the publisher it
//! watches takes offers over the shm channel's unix socket, which costs a fraction of a QUIC
//! hop (see [`crate::watch`] for what watching is). Versions too large for an `Offer` frame
//! come as a pull's `Header` and, up to 4 MiB:
//! - to a watcher that proved read-write access, the publisher's memfd, passed read-only and
//!   unsealed ([`ShmPayload::MemfdCopy`]): the watcher copies the bytes into a buffer of its
//!   own pool (one copy, nothing on the socket), through the mapping of that publisher buffer
//!   it kept from the buffer's previous offer (`peer_maps`; the kernel's `copy_file_range`
//!   where a buffer cannot be kept mapped), and answers `ShmCopied`, until which the publisher
//!   holds the version;
//! - to any other watcher, their bytes on the socket (the subscription is told the version is
//!   coming before they are read, so the broker's news of it does not fetch it again).
//!
//! Beyond 4 MiB the publisher's sealed memfd, mapped without a look-up or a pull. Measured on
//! the 2-core VM, 1 MiB by name from Rust: the bytes on the socket and the copy both took
//! 555-600 us one-way, the copy with fewer wake-ups (3,000 sends: ~150,000 context switches
//! on the machine against ~222,000). A 1 MiB `copy_file_range` between two memfds takes
//! ~110-250 us there, a `memcpy` through a kept mapping a fraction of it: from Python, 1 MiB
//! by name went from 688-719 to 510-573 us p50 one-way, 4 MiB from 2,436-2,584 to
//! 1,630-1,649 us. One socket connection per watch, closed when the watch ends; it is never
//! pooled.

use std::os::fd::AsFd;

use iroh::EndpointId;
use tb_proto::{
    Access, DataRequest, DataResponse, ShmCopied, ShmPayload, TensorMeta, TensorName,
    frame::MAX_CONTROL_FRAME,
};
use tracing::debug;

use super::{INLINE_MAX, ShmRoute, client::connection, socket::ShmStream, socket::within};
use crate::{
    channel::{ChannelError, verify},
    client::remote_error_from,
    ctx::NodeCtx,
    error::{Error, Result},
    tensor::Tensor,
    watch::Offer,
};

/// Serves a watch on a same-host connection until the watcher goes (a write fails) or the
/// node stops; refused `Busy` past the limits (`Watchers::register` says why). A small version
/// goes as an `Offer` with its bytes; a larger one as a pull's `Header` followed, up to 4 MiB
/// (`INLINE_MAX`), by its memfd to copy (a watcher with read-write `access`) or its bytes on
/// the socket, above that by its sealed memfd (`ShmPayload::Memfd`). The connection is not
/// used again after it.
pub(crate) async fn serve(ctx: &NodeCtx, conn: &mut ShmStream, name: &TensorName, access: Access) {
    let stall = ctx.config.stall_timeout;
    let copies = access == Access::ReadWrite;
    let direct = crate::watch::Direct::new(conn.socket().as_fd(), copies);
    let mut watch = match ctx.watchers.register_with(name, true, direct.clone()) {
        Ok(watch) => watch,
        Err(refusal) => {
            let _ = within(stall, "a refusal", conn.write_frame(&refusal)).await;
            return;
        }
    };
    loop {
        let offer = tokio::select! {
            _ = ctx.cancel.cancelled() => {
                // An offer written straight to the watcher holds its memfd until the watcher
                // copied it: its receipt is waited for before the offer goes (at most QUEUE
                // offers, each within `stall`).
                while let Some(offer) = watch.try_next() {
                    if !offer.sent {
                        continue;
                    }
                    let receipt = read_receipt(conn, offer.version);
                    if within(stall, "an offer's receipt", receipt).await.is_err() {
                        break;
                    }
                }
                return;
            }
            offer = watch.next() => match offer {
                Some(offer) => offer,
                None => return,
            },
        };
        // A watcher that went shows here: the write fails (its socket is closed). An offer
        // the publisher wrote itself ([`copy_offer`]) waits for its receipt only (counted
        // out where it was written).
        let written = match offer.sent {
            true => {
                within(
                    stall,
                    "an offer's receipt",
                    read_receipt(conn, offer.version),
                )
                .await
            }
            false => within(stall, "an offer", write_offer(conn, &offer, access)).await,
        };
        if let Some(direct) = &direct {
            direct.written();
        }
        if let Err(e) = written {
            debug!(%e, %name, "a same-host watch ended");
            return;
        }
        if !offer.sent {
            ctx.metrics.watch_offers_out.inc();
        }
    }
}

/// The frames of an offer of `offer` to copy from its memfd (a `Header` and
/// `ShmPayload::MemfdCopy`) and that memfd reopened read-only: what `Watchers::offer` writes
/// straight to the socket of a watcher that proved read-write access, on the publishing
/// thread, instead of waking the watch's task to write them (a runtime thread's wake-up less
/// on the way of every version from 16 KiB to 4 MiB). `None` for a version that does not go
/// that way (not in a memfd of this node's pool, or beyond [`INLINE_MAX`]); the task's
/// [`write_offer`] then decides as before.
pub(crate) fn copy_offer(offer: &Offer) -> Option<(Vec<u8>, std::os::fd::OwnedFd)> {
    offer.tensor.host_data().filter(|d| d.len() <= INLINE_MAX)?;
    let fd = offer.tensor.made_region()?.read_only_fd().ok()?;
    let header = DataResponse::Header {
        meta: offer.tensor.meta().clone(),
        version: offer.version,
    };
    let mut frames = tb_proto::frame::encode(&header).ok()?;
    frames.extend(tb_proto::frame::encode(&ShmPayload::MemfdCopy { offset: 0 }).ok()?);
    Some((frames, fd))
}

/// Waits for the watcher's `ShmCopied` for an offer of `version` to copy: until then the
/// publisher holds the version (its memfd may not go back to the pool).
async fn read_receipt(conn: &mut ShmStream, version: u64) -> Result<()> {
    let copied: ShmCopied = conn.read_frame(MAX_CONTROL_FRAME).await?;
    if copied.version != version {
        return Err(Error::Io(format!(
            "a watcher copied v{} of an offer of v{version}",
            copied.version
        )));
    }
    Ok(())
}

/// Writes one offer: small ones in an `Offer` frame; up to [`INLINE_MAX`] as a `Header`
/// and the publisher's memfd, read-only and unsealed, for the watcher to copy out and answer
/// `ShmCopied` (a watcher that proved read-write access), or the bytes on the socket (any
/// other watcher, or a version in no memfd); either way the publisher's memfd stays
/// unsealed, so it goes back to its pool when evicted, and the watcher copies into a buffer
/// of its own pool: no fresh memory per version on either side, which a passed sealed memfd
/// costs. Larger ones go as a `Header` and the sealed memfd, which the watcher maps.
async fn write_offer(conn: &mut ShmStream, offer: &Offer, access: Access) -> Result<()> {
    if offer.inline() {
        return conn.write_frame(&offer.frame()).await;
    }
    let header = DataResponse::Header {
        meta: offer.tensor.meta().clone(),
        version: offer.version,
    };
    // The header and what follows it go in one write.
    if access == Access::ReadWrite
        && let Some((frames, fd)) = copy_offer(offer)
    {
        conn.write_parts(&[&frames], Some(fd.as_fd())).await?;
        drop(fd);
        // The offer (and so the memfd's bytes) is held until the watcher copied them.
        return read_receipt(conn, offer.version).await;
    }
    if let Some(data) = (offer.tensor.host_data()).filter(|d| d.len() <= INLINE_MAX) {
        let inline = ShmPayload::Inline;
        return conn.write_frames_and(&header, &inline, data, None).await;
    }
    let region = offer.tensor.shm_region()?;
    let memfd = ShmPayload::Memfd { offset: 0 };
    conn.write_frames_and(&header, &memfd, &[], Some(region.shared_fd()?))
        .await
}

/// What a same-host watch brings.
pub(crate) enum WatchOffer {
    /// An `Offer` frame with the bytes inline, to be checked as any offer is.
    Inline(DataResponse),
    /// A version passed as the publisher's memfd: its sealed memfd mapped, or its buffer
    /// copied into this process's pool (`ShmPayload::MemfdCopy`); its metadata checked, its
    /// bytes verified unless the publisher proved read-write access (the trust a pull of a
    /// memfd gives).
    Mapped { version: u64, tensor: Tensor },
    /// A version whose bytes follow on the socket (its metadata checked): read them with
    /// [`ShmWatch::read_coming`] before the next offer.
    Coming { version: u64, meta: TensorMeta },
}

/// A watch open on a same-host connection.
pub(crate) struct ShmWatch {
    conn: ShmStream,
    peer: EndpointId,
    name: TensorName,
    /// Hash mapped versions before handing them out (the publisher proved read-only access).
    verify: bool,
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
            name: name.clone(),
            verify: route.access != Access::ReadWrite,
        })
    }

    /// The publisher.
    pub(crate) fn peer(&self) -> EndpointId {
        self.peer
    }

    /// The next version the publisher sends (an `Error` answer as an error; a mapped version
    /// that does not check out is `Corrupt`).
    pub(crate) async fn next(&mut self, ctx: &NodeCtx) -> Result<WatchOffer> {
        match self.conn.read_frame(MAX_CONTROL_FRAME).await? {
            DataResponse::Error { code, message } => Err(remote_error_from(
                self.peer.fmt_short().to_string(),
                code,
                message,
            )),
            DataResponse::Header { meta, version } => self.mapped(ctx, version, meta).await,
            frame => Ok(WatchOffer::Inline(frame)),
        }
    }

    /// The bytes of the version a [`WatchOffer::Coming`] announced, read into a buffer of
    /// this process's pool and hashed as they arrive unless the publisher proved read-write
    /// access (the trust a pull gives it).
    pub(crate) async fn read_coming(
        &mut self,
        ctx: &NodeCtx,
        version: u64,
        meta: &TensorMeta,
    ) -> Result<Tensor> {
        let holder = (!self.verify).then_some(Access::ReadWrite);
        let (name, peer) = (&self.name, self.peer.fmt_short());
        let what = format!("an offer of \"{name}\" v{version} from {peer}");
        let read = super::read_inline(&mut self.conn, meta, &what, holder);
        within(ctx.config.stall_timeout, "an offer's bytes", read).await
    }

    /// The memfd after a `Header`, mapped as a version of `meta`.
    async fn mapped(
        &mut self,
        ctx: &NodeCtx,
        version: u64,
        meta: TensorMeta,
    ) -> Result<WatchOffer> {
        let (name, peer) = (&self.name, self.peer.fmt_short());
        let what = || format!("an offer of \"{name}\" v{version} from {peer}");
        let max = ctx.config.max_tensor_bytes;
        if let Err(e) = tb_proto::check_offered_meta(name, version, &meta, max) {
            return Err(Error::Corrupt(format!("{}: {e}", what())));
        }
        let stall = ctx.config.stall_timeout;
        let payload = within(stall, "an offered memfd", async {
            self.conn.read_frame::<ShmPayload>(MAX_CONTROL_FRAME).await
        })
        .await?;
        if payload == ShmPayload::Inline {
            super::inline_len(&meta).map_err(|e| Error::Io(format!("{}: {e}", what())))?;
            return Ok(WatchOffer::Coming { version, meta });
        }
        if let ShmPayload::MemfdCopy { offset } = payload {
            let fd = self.conn.take_fd()?;
            let tensor = super::tensor_copied_from_memfd(fd, offset, &meta, self.verify, &what())?;
            // The publisher may recycle its memfd from now on.
            let copied = ShmCopied { version };
            within(stall, "an offer's receipt", self.conn.write_frame(&copied)).await?;
            return Ok(WatchOffer::Mapped { version, tensor });
        }
        if payload != (ShmPayload::Memfd { offset: 0 }) || meta.byte_len == 0 {
            return Err(Error::Io(format!("{} sent as {payload:?}", what())));
        }
        let tensor = super::tensor_from_memfd(self.conn.take_fd()?, 0, meta)?;
        if self.verify {
            verify::check_all(tensor.data(), tensor.hash(), &what())?;
            super::region::release_resident(tensor.data());
        }
        Ok(WatchOffer::Mapped { version, tensor })
    }
}
