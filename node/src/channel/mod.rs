//! Data channels: how the bytes of a transfer move between two peers whose iroh QUIC link has
//! authenticated them (the shape of TensorPipe's channels).
//!
//! The pooled QUIC link always carries the control frames, and QUIC itself is every
//! transfer's default and fallback. On each new link the dialer sends
//! [`DataRequest::Channels`](tb_proto::DataRequest::Channels) with its [`ChannelOffer`]s and
//! the other side answers with its own (`exchange` here, `serve` there); [`Channels`] keeps
//! what each peer offered, and [`Channels::pick`] names the channel a transfer with a peer
//! uses: the first in `Config::channels` that both run and that this node could open.
//!
//! The transfer code is written against one small trait, [`Channel`]: pull into a buffer,
//! pull as a tensor, push. [`route`] gives the channel a transfer with a peer uses (or none:
//! QUIC), and [`attempt`] turns what a channel could not do into a QUIC fallback, counted.
//!
//! Kinds (each in its own module, registered in [`Channels::new`]):
//! - `quic`: the link's own streams (striped over several for large tensors), in `client`;
//!   not a [`Channel`] but what every channel falls back to.
//! - `shm` (Linux): same-host shared memory, proven by reaching the peer's abstract Unix
//!   socket whose name only it was told.
//! - `tcp` (opt-in): plain TCP sockets admitted by one-time tokens, every piece verified,
//!   for trusted networks.
//! - `cuda_ipc`: a version on a same-host peer's GPU, mapped by CUDA IPC and copied device to
//!   device; a request kind on the link, tried first by pulls into device memory only.
//!
//! A pull into device memory takes one route ([`pull_to_device`]): CUDA IPC from a same-host
//! holder that keeps the version on a GPU; else the shm channel for host bytes, then one copy
//! up to the device; else QUIC, received through pinned staging straight into device memory.

pub(crate) mod cuda_ipc;
pub(crate) mod quic;
#[cfg(target_os = "linux")]
mod shm;
mod tcp;
pub(crate) mod verify;

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex, MutexGuard},
};

use iroh::EndpointId;
use tb_dashboard::TransferKind;
use tb_proto::{Access, ChannelKind, ChannelOffer, TensorMeta, TensorName};
use tracing::warn;

pub(crate) use cuda_ipc::service as cuda_ipc_service;
#[cfg(target_os = "linux")]
pub(crate) use shm::{
    CallRecv, CallSend, INLINE_MAX as SHM_PUSH_INLINE_MAX, Region, Shm, ShmCache, ShmRoute,
    ShmStream, ShmWatch, WatchOffer, copy_offer as shm_copy_offer,
    ctl::exchange as shm_ctl_exchange, ctl::open_subscription as shm_open_subscription,
    ctl::read_event as shm_read_event, memfds_work, open_socket_request, reading_sockets,
};
#[cfg(target_os = "linux")]
pub use shm::{ChunksRead, force_map_failures_for_tests, frame_chunks, read_chunks};
pub(crate) use tcp::{Tcp, TcpRoute, serve_ticket};

/// Without same-host sockets there is nothing to read: `poll` runs as it is.
#[cfg(not(target_os = "linux"))]
pub(crate) fn reading_sockets<T>(poll: impl FnOnce() -> T) -> (T, bool) {
    (poll(), false)
}

use crate::{
    LinkGuard,
    client::{self, Pulled},
    config::Config,
    ctx::NodeCtx,
    device::DeviceBuffer,
    error::{Error, Result},
    tensor::Tensor,
};

/// Why a channel did not complete a transfer.
#[derive(Debug)]
pub(crate) enum ChannelError {
    /// The channel failed before the transfer could complete on it: do it over QUIC (the
    /// channel is withdrawn for this peer, and the fallback counted).
    Fallback(Error),
    /// The peer cannot do this one on the channel (a version still arriving, device bytes,
    /// an upload limit): do it over QUIC (the channel itself is fine).
    ViaQuic,
    /// The peer answered with this error (or the answer was bad): give up as over QUIC.
    Final(Error),
}

/// One way to move a transfer's bytes between this node and one peer whose QUIC link
/// authenticated it. A channel that cannot do a transfer says so ([`ChannelError::ViaQuic`],
/// [`ChannelError::Fallback`]) and the caller goes over QUIC, which is not a `Channel` but
/// the link itself. Each implementation counts the bytes it moves
/// (`tb_channel_bytes_total`) and says in its module docs what integrity it guarantees.
pub(crate) trait Channel {
    /// Pulls `name` (the newest version, or `version`) into the buffer `alloc` returns for
    /// the header; the bytes are verified when it returns.
    async fn pull_into<B, F>(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<B>, ChannelError>
    where
        B: AsMut<[u8]> + Send,
        F: FnOnce(&TensorMeta) -> Result<B> + Send;

    /// Pulls `name` as a tensor owning its bytes (zero-copy where the channel can).
    async fn pull(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
    ) -> Result<Pulled<Tensor>, ChannelError> {
        let pulled = self.pull_into(ctx, name, version, alloc_host).await?;
        pulled.into_tensor().map_err(ChannelError::Final)
    }

    /// Pushes `tensor` to the peer, filed as `name` (by default not on this channel).
    async fn push(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        tensor: &Tensor,
    ) -> Result<(), ChannelError> {
        let _ = (ctx, name, tensor);
        Err(ChannelError::ViaQuic)
    }
}

/// A receive buffer for a tensor of `meta` (the allocation of a `pull` into memory).
pub(crate) fn alloc_host(meta: &TensorMeta) -> Result<HostBuf> {
    let len = usize::try_from(meta.byte_len)
        .map_err(|_| Error::TooLarge(format!("{} bytes", meta.byte_len)))?;
    HostBuf::new(len)
}

/// Tensors at most this large are lent to readers as copies, not copy-on-write mappings, and
/// received into plain memory, not a memfd (a mapping costs more than such a copy).
#[cfg(target_os = "linux")]
pub(crate) const PRIVATE_COPY_MAX: usize = 64 << 10;

/// Private views ([`Tensor::private_view`]) of tensors at most this large are copies, not
/// copy-on-write mappings. A mapping costs its page-table work at the first read of each
/// page: on the development VM a Python `get` of a same-host tensor and a sum over it took
/// 210 us (1 MiB), 580 us (4 MiB) and 3.0 ms (16 MiB) with a mapping, 130 us, 300 us and
/// 1.8 ms with a copy (at 64 MiB the copy lost, 37 ms against 15: its memory is fresh). The
/// copy doubles the memory of what it copies, hence the bound.
pub const VIEW_COPY_MAX: usize = 4 << 20;

/// Where a host tensor's bytes are received (or copied at publish): on Linux, payloads above
/// [`PRIVATE_COPY_MAX`] go straight into a memfd that is sealed once full, so the node keeps
/// one copy that it serves to same-host peers and lends to readers without copying again
/// (plain memory where this kernel refuses to map sealed memfds).
pub(crate) enum HostBuf {
    /// Plain zeroed memory.
    Heap(Vec<u8>),
    /// A memfd being filled.
    #[cfg(target_os = "linux")]
    Memfd(shm::RegionWriter),
}

impl HostBuf {
    /// A buffer of `len` bytes.
    pub(crate) fn new(len: usize) -> Result<HostBuf> {
        #[cfg(target_os = "linux")]
        if len > PRIVATE_COPY_MAX && shm::memfds_work() {
            match shm::RegionWriter::new(len) {
                Ok(writer) => return Ok(HostBuf::Memfd(writer)),
                // Out of descriptors or memory maps: plain memory still holds the bytes.
                Err(err) => tracing::debug!(%err, len, "no memfd for a receive: plain memory"),
            }
        }
        Ok(HostBuf::Heap(vec![0u8; len]))
    }

    /// The filled buffer as a tensor of `meta` (whose hash its bytes were verified against).
    pub(crate) fn into_tensor(self, meta: TensorMeta) -> Result<Tensor> {
        match self {
            HostBuf::Heap(vec) => Ok(Tensor::from_verified(meta, bytes::Bytes::from(vec))),
            #[cfg(target_os = "linux")]
            HostBuf::Memfd(writer) => Ok(Tensor::from_region(meta, writer.finish()?)),
        }
    }
}

impl AsMut<[u8]> for HostBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Heap(vec) => vec,
            #[cfg(target_os = "linux")]
            HostBuf::Memfd(writer) => writer.as_mut(),
        }
    }
}

/// The channel a transfer with one peer takes, when it is not QUIC.
pub(crate) enum Route {
    /// Same-host shared memory.
    #[cfg(target_os = "linux")]
    Shm(ShmRoute),
    /// Token-admitted, verified TCP.
    Tcp(TcpRoute),
}

impl Route {
    /// The peer this route leads to.
    pub(crate) fn peer(&self) -> EndpointId {
        match self {
            #[cfg(target_os = "linux")]
            Route::Shm(shm) => shm.peer,
            Route::Tcp(tcp) => tcp.peer(),
        }
    }

    /// Which channel this is.
    pub(crate) fn kind(&self) -> ChannelKind {
        match self {
            #[cfg(target_os = "linux")]
            Route::Shm(_) => ChannelKind::Shm,
            Route::Tcp(_) => ChannelKind::Tcp,
        }
    }
}

impl Channel for Route {
    async fn pull_into<B, F>(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<B>, ChannelError>
    where
        B: AsMut<[u8]> + Send,
        F: FnOnce(&TensorMeta) -> Result<B> + Send,
    {
        match self {
            #[cfg(target_os = "linux")]
            Route::Shm(shm) => shm.pull_into(ctx, name, version, alloc).await,
            Route::Tcp(tcp) => tcp.pull_into(ctx, name, version, alloc).await,
        }
    }

    async fn pull(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
    ) -> Result<Pulled<Tensor>, ChannelError> {
        match self {
            #[cfg(target_os = "linux")]
            Route::Shm(shm) => shm.pull(ctx, name, version).await,
            Route::Tcp(tcp) => tcp.pull(ctx, name, version).await,
        }
    }

    async fn push(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        tensor: &Tensor,
    ) -> Result<(), ChannelError> {
        match self {
            #[cfg(target_os = "linux")]
            Route::Shm(shm) => shm.push(ctx, name, tensor).await,
            Route::Tcp(tcp) => tcp.push(ctx, name, tensor).await,
        }
    }
}

/// A sealed region and where in it a tensor's bytes start.
#[cfg(target_os = "linux")]
pub(crate) type RegionAt = (Arc<Region>, usize);
/// Where shared memory is not built (not Linux): never one.
#[cfg(not(target_os = "linux"))]
pub(crate) type RegionAt = std::convert::Infallible;

/// Where shared memory is not built (not Linux): a tensor has no memfd to cache.
#[cfg(not(target_os = "linux"))]
#[derive(Debug, Clone, Default)]
pub(crate) struct ShmCache;

/// What a peer offered on its latest link.
#[derive(Debug)]
struct Offered {
    /// The link (`tb_link::Link::id`) whose exchange this came from: the entry goes
    /// when the peer's last link does, and only the end of the link it is filed under can
    /// remove it, so a newer link's offers never go with an older link.
    link: u64,
    /// The access it proved on that link: bytes from a read-only holder are verified.
    access: Access,
    offers: Vec<ChannelOffer>,
    /// Channels withdrawn after failing: until when, and how many failures in a row.
    withdrawn: HashMap<ChannelKind, (std::time::Instant, u32)>,
}

/// How long a channel that failed with a peer is left aside the first time; each failure in
/// a row doubles it, up to [`MAX_CHANNEL_BACKOFF`]. A transfer that succeeds on it resets it.
pub(crate) const CHANNEL_BACKOFF: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest a failed channel is left aside before it is tried again.
pub(crate) const MAX_CHANNEL_BACKOFF: std::time::Duration = std::time::Duration::from_secs(60);

/// The pause after `failures` failures in a row (at least one).
fn channel_backoff(failures: u32) -> std::time::Duration {
    let doubled = CHANNEL_BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(16));
    doubled.min(MAX_CHANNEL_BACKOFF)
}

/// What this node knows about its peers' channels, and the channels it runs itself.
#[derive(Debug)]
pub(crate) struct Channels {
    /// `Config::channels`: the kinds this node runs, best first.
    order: Vec<ChannelKind>,
    /// What each peer offered on its latest link (replaced when it offers again, e.g. after
    /// a restart), and the access it proved on that link; only peers with a link (or a dial
    /// whose exchange is done) have an entry.
    offered: Mutex<HashMap<EndpointId, Offered>>,
    /// This node's end of the shm channel, when it runs it.
    #[cfg(target_os = "linux")]
    shm: Option<Arc<Shm>>,
    /// This node's TCP listener and tickets, when it runs the TCP channel.
    tcp: Option<Arc<Tcp>>,
}

impl Channels {
    /// The channels a node with `config` runs (`Config::channels`). A channel that cannot
    /// start (no abstract sockets here, no TCP port) is left out, with a warning.
    pub(crate) fn new(config: &Config) -> Self {
        let order = config.channels.clone();
        #[cfg(target_os = "linux")]
        let shm = order
            .contains(&ChannelKind::Shm)
            .then(Shm::bind)
            .and_then(|bound| match bound {
                Ok(shm) => Some(Arc::new(shm)),
                Err(err) => {
                    // One warning per process: every later node fails the same way.
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    let mut first = false;
                    WARNED.call_once(|| first = true);
                    match first {
                        true => warn!(%err, "the shm channel is off in this process: same-host peers use QUIC"),
                        false => tracing::debug!(%err, "the shm channel is off"),
                    }
                    None
                }
            });
        let tcp = order
            .contains(&ChannelKind::Tcp)
            .then(|| Tcp::bind(config.bind_addr.ip()))
            .and_then(|bound| match bound {
                Ok(tcp) => Some(Arc::new(tcp)),
                Err(err) => {
                    warn!(%err, "the TCP channel could not start: peers use QUIC");
                    None
                }
            });
        Channels {
            order,
            offered: Mutex::new(HashMap::new()),
            #[cfg(target_os = "linux")]
            shm,
            tcp,
        }
    }

    /// Same-host client connections this node opened so far (none without the shm channel):
    /// a request on a pooled one opens none.
    pub(crate) fn same_host_connections_opened(&self) -> u64 {
        #[cfg(target_os = "linux")]
        if let Some(shm) = &self.shm {
            return shm.opened();
        }
        0
    }

    /// Starts the channels' listeners (with the node's context, once it exists).
    pub(crate) fn start(ctx: &Arc<NodeCtx>) -> Result<()> {
        #[cfg(target_os = "linux")]
        if let Some(shm) = &ctx.channels.shm {
            shm::spawn_listener(ctx, shm)?;
        }
        if let Some(tcp) = &ctx.channels.tcp {
            tcp::spawn_listener(ctx, tcp)?;
        }
        Ok(())
    }

    /// Whether this node runs `kind` now (QUIC always).
    pub(crate) fn runs(&self, kind: ChannelKind) -> bool {
        match kind {
            ChannelKind::Quic => true,
            #[cfg(target_os = "linux")]
            ChannelKind::Shm => self.shm.is_some(),
            #[cfg(not(target_os = "linux"))]
            ChannelKind::Shm => false,
            ChannelKind::Tcp => self.tcp.is_some(),
        }
    }

    fn offered(&self) -> MutexGuard<'_, HashMap<EndpointId, Offered>> {
        self.offered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The offers this node makes to `peer`, which proved `access` on the link.
    pub(crate) fn offers_for(&self, peer: EndpointId, access: Access) -> Vec<ChannelOffer> {
        let mut offers = Vec::new();
        #[cfg(target_os = "linux")]
        if let Some(shm) = &self.shm {
            offers.push(shm.offer(peer, access));
        }
        if let Some(tcp) = &self.tcp {
            offers.push(tcp.offer());
        }
        let _ = (peer, access);
        offers
    }

    /// Records what `peer`, which proved `access` on its link `link`, offered (its offers
    /// were validated by the frame's reader). Idle same-host connections to it are dropped:
    /// the offer may come from a restarted process.
    pub(crate) fn learn(
        &self,
        peer: EndpointId,
        link: u64,
        access: Access,
        offers: Vec<ChannelOffer>,
    ) {
        let withdrawn = HashMap::new();
        let offered = Offered {
            link,
            access,
            offers,
            withdrawn,
        };
        self.offered().insert(peer, offered);
        #[cfg(target_os = "linux")]
        if let Some(shm) = &self.shm {
            shm.forget(&peer);
        }
    }

    /// `peer`'s link `link` went. If its entry was filed under that link: with `successor`
    /// (another live link of the peer) the entry is filed under that one now; without, it
    /// is removed, with its backoffs and idle same-host connections (the peer is back to
    /// QUIC until a link exchanges offers again). An entry filed under another link (a
    /// newer one, or a dial whose exchange finished first) stays: that link removes it.
    pub(crate) fn link_gone(&self, peer: &EndpointId, link: u64, successor: Option<u64>) {
        let mut offered = self.offered();
        let Some(entry) = offered.get_mut(peer).filter(|e| e.link == link) else {
            return;
        };
        match successor {
            Some(next) => entry.link = next,
            None => {
                offered.remove(peer);
                drop(offered);
                #[cfg(target_os = "linux")]
                if let Some(shm) = &self.shm {
                    shm.forget(peer);
                }
            }
        }
    }

    /// Peers whose offers are kept now.
    #[cfg(test)]
    pub(crate) fn peers_known(&self) -> usize {
        self.offered().len()
    }

    /// Whether `peer`'s offers are known (its link exchanged them).
    pub(crate) fn knows(&self, peer: &EndpointId) -> bool {
        self.offered().contains_key(peer)
    }

    /// The access `peer` proved on its latest link, once a link exchanged offers with it.
    pub(crate) fn access_of(&self, peer: &EndpointId) -> Option<Access> {
        self.offered().get(peer).map(|offered| offered.access)
    }

    /// Withdraws `kind` for `peer` after it failed (e.g. its shm socket cannot be reached
    /// from here: another network namespace) for a backoff ([`CHANNEL_BACKOFF`], doubling
    /// with each failure in a row up to [`MAX_CHANNEL_BACKOFF`]): meanwhile its transfers use
    /// the next channel, then `kind` is tried again. Returns the backoff.
    pub(crate) fn failed(&self, peer: &EndpointId, kind: ChannelKind) -> std::time::Duration {
        let mut backoff = CHANNEL_BACKOFF;
        if let Some(offered) = self.offered().get_mut(peer) {
            let entry = offered
                .withdrawn
                .entry(kind)
                .or_insert((std::time::Instant::now(), 0));
            entry.1 = entry.1.saturating_add(1);
            backoff = channel_backoff(entry.1);
            entry.0 = std::time::Instant::now() + backoff;
        }
        #[cfg(target_os = "linux")]
        if let (ChannelKind::Shm, Some(shm)) = (kind, &self.shm) {
            shm.forget(peer);
        }
        backoff
    }

    /// A transfer with `peer` on `kind` succeeded: its failures in a row are forgotten.
    pub(crate) fn succeeded(&self, peer: &EndpointId, kind: ChannelKind) {
        if let Some(offered) = self.offered().get_mut(peer)
            && !offered.withdrawn.is_empty()
        {
            offered.withdrawn.remove(&kind);
        }
    }

    /// Whether this node runs a channel besides QUIC (so first contact is worth a dial).
    pub(crate) fn runs_any(&self) -> bool {
        self.order
            .iter()
            .any(|&kind| kind != ChannelKind::Quic && self.runs(kind))
    }

    /// This node's TCP channel, when it runs one (to answer tickets).
    pub(crate) fn tcp(&self) -> Option<&Arc<Tcp>> {
        self.tcp.as_ref()
    }

    /// The channel a transfer with `peer` uses now.
    pub(crate) fn pick(&self, peer: &EndpointId) -> ChannelKind {
        let offered = self.offered();
        let Some(offered) = offered.get(peer) else {
            return tb_proto::channel::pick(&self.order, &[], |kind| self.runs(kind));
        };
        let now = std::time::Instant::now();
        let usable = |kind: ChannelKind| {
            self.runs(kind)
                && offered
                    .withdrawn
                    .get(&kind)
                    .is_none_or(|(until, _)| *until <= now)
        };
        tb_proto::channel::pick(&self.order, &offered.offers, usable)
    }

    /// `peer`'s offer for `kind`, if it made one, and the access it proved.
    fn offer(&self, peer: &EndpointId, kind: ChannelKind) -> Option<(ChannelOffer, Access)> {
        let offered = self.offered();
        let offered = offered.get(peer)?;
        let offer = offered.offers.iter().find(|o| o.kind() == kind).cloned()?;
        Some((offer, offered.access))
    }

    /// The route of a pair whose channel is `kind` (`link`: a pooled link to `peer`, which
    /// TCP needs).
    fn route_for(
        &self,
        peer: EndpointId,
        kind: ChannelKind,
        link: Option<LinkGuard>,
    ) -> Option<Route> {
        let (offer, access) = self.offer(&peer, kind)?;
        match (kind, offer) {
            #[cfg(target_os = "linux")]
            (ChannelKind::Shm, ChannelOffer::Shm { socket, token }) => {
                let shm = self.shm.clone()?;
                Some(Route::Shm(ShmRoute::new(shm, peer, access, socket, token)))
            }
            (ChannelKind::Tcp, ChannelOffer::Tcp { port }) => {
                TcpRoute::new(link?, port).map(Route::Tcp)
            }
            _ => None,
        }
    }
}

/// The channel a transfer with `peer` takes now, or `None`: QUIC. `links` gives a pooled
/// link to the peer: dialed on first contact (the dial exchanges the offers), and held for
/// the transfer by a channel whose control frames ride it (TCP).
pub(crate) async fn route<L, LF>(
    ctx: &NodeCtx,
    peer: &EndpointId,
    links: L,
) -> Result<Option<Route>>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let channels = &ctx.channels;
    if !channels.runs_any() {
        return Ok(None);
    }
    let mut link = None;
    if !channels.knows(peer) {
        link = Some(links().await?);
    }
    let kind = channels.pick(peer);
    if kind == ChannelKind::Tcp && link.is_none() {
        link = Some(links().await?);
    }
    Ok(channels.route_for(*peer, kind, link))
}

/// The one "the pair's channel first, then QUIC" step every transfer takes: when the pair
/// with `peer` runs a channel other than QUIC, runs `transfer` on its route, timed as `timed`
/// when it is a transfer (see [`attempt`]; a request of a service kind is not). `Ok(None)`: do it over QUIC (the pair runs QUIC, or the channel left
/// this transfer to QUIC); `Err` final.
pub(crate) async fn first<T, L, LF>(
    ctx: &NodeCtx,
    peer: &EndpointId,
    links: L,
    timed: Option<TransferKind>,
    transfer: impl AsyncFnOnce(&Route) -> Result<T, ChannelError>,
) -> Result<Option<T>>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let Some(route) = route(ctx, peer, links).await? else {
        return Ok(None);
    };
    attempt(ctx, &route, timed, transfer(&route)).await
}

/// The peer's address on `link`'s selected path, when that is a direct IP path.
pub(crate) fn selected_addr(link: &LinkGuard) -> Option<std::net::SocketAddr> {
    let paths = link.connection().paths();
    let selected = paths.iter().find(|p| p.is_selected())?;
    match selected.remote_addr() {
        iroh::TransportAddr::Ip(addr) => Some(*addr),
        _ => None,
    }
}

/// How a pull into device memory came: by CUDA IPC (device to device), or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeviceVia {
    /// Mapped from a same-host holder's device memory and copied device to device.
    CudaIpc,
    /// The pair's channel (then one copy to the device), or QUIC through pinned staging.
    Network,
}

/// Pulls `name` (the newest version, or `version`) from `peer` into new memory on CUDA device
/// `ordinal`, by the one route a device pull takes: CUDA IPC when `ipc` (the peer looks local:
/// [`cuda_ipc::wanted`]) and it keeps the version on a GPU ([`cuda_ipc`]); else, when the pair
/// runs shm, host bytes over it, copied up once they are in; else QUIC through pinned staging,
/// hashed on the way. The caller checked that the device exists.
pub(crate) async fn pull_to_device<L, LF>(
    ctx: &NodeCtx,
    peer: &EndpointId,
    ipc: bool,
    links: L,
    name: &TensorName,
    version: Option<u64>,
    ordinal: usize,
) -> Result<(Pulled<Tensor>, DeviceVia)>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    if ipc {
        let by_ipc = cuda_ipc::pull(ctx, &links, peer, name, version, ordinal);
        if let Some(pulled) = by_ipc.await? {
            return Ok((device_tensor(pulled), DeviceVia::CudaIpc));
        }
    }
    // Host bytes over shm (a mapping of the holder's memfd: no host copy), then one copy up.
    // Not over TCP: that would hold the whole tensor in host memory, where pinned staging
    // holds a few chunks and overlaps the copies with the network.
    #[cfg(target_os = "linux")]
    if let Some(shm @ Route::Shm(_)) = route(ctx, peer, &links).await? {
        let timed = Some(TransferKind::Pull);
        let pulled = attempt(ctx, &shm, timed, shm.pull(ctx, name, version)).await?;
        if let Some(pulled) = pulled {
            let device = crate::device::Device::Cuda(ordinal);
            let buffer = verify::blocking(|| pulled.buffer.to_device(device))?;
            let pulled = Pulled { buffer, ..pulled };
            return Ok((pulled, DeviceVia::Network));
        }
    }
    let alloc = |meta: &TensorMeta| {
        let len = usize::try_from(meta.byte_len)
            .map_err(|_| Error::TooLarge(format!("{} bytes", meta.byte_len)))?;
        DeviceBuffer::alloc(ordinal, len)
    };
    let pulled = client::pull_into_device(ctx, links, name.clone(), version, alloc).await?;
    Ok((device_tensor(pulled), DeviceVia::Network))
}

/// A pull into a device buffer as a tensor (its bytes were verified, or came from a holder
/// that proved read-write access).
pub(crate) fn device_tensor(pulled: Pulled<DeviceBuffer>) -> Pulled<Tensor> {
    Pulled {
        buffer: Tensor::from_verified_device(pulled.meta.clone(), pulled.buffer),
        name: pulled.name,
        version: pulled.version,
        meta: pulled.meta,
    }
}

/// What a channel's attempt at a transfer came to: `Ok(Some)` done; `Ok(None)` do it over
/// QUIC (a channel that failed is withdrawn for the peer for a backoff, logged at warn and
/// the fallback counted in `tb_channel_fallbacks_total`); `Err` final.
/// A transfer done or failed on the channel is timed as `timed`; one left to QUIC is timed
/// there.
pub(crate) async fn attempt<T>(
    ctx: &NodeCtx,
    route: &Route,
    timed: Option<TransferKind>,
    transfer: impl Future<Output = Result<T, ChannelError>>,
) -> Result<Option<T>> {
    let (peer, kind) = (route.peer(), route.kind());
    let timer = timed.map(|timed| ctx.metrics.start_transfer(timed));
    let result = transfer.await;
    match result {
        Ok(done) => {
            if let Some(timer) = timer {
                timer.ok();
            }
            ctx.channels.succeeded(&peer, kind);
            Ok(Some(done))
        }
        Err(ChannelError::Final(err)) => {
            if let Some(timer) = timer {
                timer.error();
            }
            Err(err)
        }
        Err(ChannelError::ViaQuic) => {
            if let Some(timer) = timer {
                timer.discard();
            }
            Ok(None)
        }
        Err(ChannelError::Fallback(err)) => {
            if let Some(timer) = timer {
                timer.discard();
            }
            let backoff = ctx.channels.failed(&peer, kind);
            tracing::warn!(peer = %peer.fmt_short(), channel = kind.as_str(), %err,
                retry_in = ?backoff, "channel failed: this transfer and the next go over QUIC");
            ctx.metrics.channels.fallback(kind);
            Ok(None)
        }
    }
}

/// Pause after a failed `accept` on a channel's listener (out of descriptors, typically)
/// before the next, so the loop does not spin on the error.
pub(crate) const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);

/// Takes a channel's bound listener out of its slot to start its accept loop (once: later
/// calls get `None`).
pub(crate) fn take_listener<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Fills `buf` with random bytes from the OS (channel names and tokens).
pub(crate) fn fill_random(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| Error::Io(format!("reading random bytes: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm_offer() -> ChannelOffer {
        ChannelOffer::Shm {
            socket: [7; tb_proto::channel::SHM_SOCKET_NAME_LEN],
            token: [9; 32],
        }
    }

    #[test]
    fn a_failed_channel_is_left_aside_for_a_growing_backoff_then_tried_again() {
        let channels = Channels::new(&Config::default());
        if !channels.runs(ChannelKind::Shm) {
            eprintln!("SKIPPED: the shm channel does not run here");
            return;
        }
        let peer = iroh::SecretKey::generate().public();
        channels.learn(peer, 1, Access::ReadWrite, vec![shm_offer()]);
        assert_eq!(channels.pick(&peer), ChannelKind::Shm);
        // Failures in a row double the pause, up to the cap.
        let pauses: Vec<_> = (0..9)
            .map(|_| channels.failed(&peer, ChannelKind::Shm))
            .collect();
        assert_eq!(pauses[0], CHANNEL_BACKOFF);
        assert_eq!(pauses[1], CHANNEL_BACKOFF * 2);
        assert_eq!(pauses[2], CHANNEL_BACKOFF * 4);
        assert_eq!(pauses[8], MAX_CHANNEL_BACKOFF);
        assert_eq!(
            channels.pick(&peer),
            ChannelKind::Quic,
            "left aside meanwhile"
        );
        // The pause over: shm again, its offer kept all along.
        let expire = |channels: &Channels| {
            let mut offered = channels.offered();
            let until = &mut offered.get_mut(&peer).expect("peer").withdrawn;
            until
                .values_mut()
                .for_each(|(t, _)| *t = std::time::Instant::now());
        };
        expire(&channels);
        assert_eq!(channels.pick(&peer), ChannelKind::Shm);
        // A success forgets the failures: the next one pauses for the first backoff again.
        channels.succeeded(&peer, ChannelKind::Shm);
        assert_eq!(channels.failed(&peer, ChannelKind::Shm), CHANNEL_BACKOFF);
    }

    /// Regression: a peer's offers (and backoffs) were kept for every peer ever seen; and
    /// removing them when a link went could drop what a newer link of the peer had learned.
    #[test]
    fn offers_go_with_the_peers_last_link_and_only_with_the_link_they_came_on() {
        let channels = Channels::new(&Config::default());
        let (a, b) = (
            iroh::SecretKey::generate().public(),
            iroh::SecretKey::generate().public(),
        );
        channels.learn(a, 1, Access::ReadWrite, vec![shm_offer()]);
        channels.learn(b, 2, Access::ReadWrite, vec![shm_offer()]);
        channels.failed(&a, ChannelKind::Shm);
        // A newer link of `a` (3) learned again; the old one (1) goes: 3's offers stay.
        channels.learn(a, 3, Access::ReadOnly, vec![shm_offer()]);
        channels.link_gone(&a, 1, None);
        assert!(channels.knows(&a), "a newer link's offers stay");
        // Link 3 goes while link 4 of `a` lives: the entry is filed under 4 now.
        channels.link_gone(&a, 3, Some(4));
        assert!(channels.knows(&a));
        channels.link_gone(&a, 3, None);
        assert!(channels.knows(&a), "3 no longer owns the entry");
        channels.link_gone(&a, 4, None);
        assert!(!channels.knows(&a), "gone with the last link");
        assert!(channels.knows(&b));
        channels.link_gone(&b, 2, None);
        assert_eq!(channels.peers_known(), 0, "nothing kept for unlinked peers");
    }
}
