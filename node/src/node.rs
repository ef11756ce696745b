//! [`Node`]: the embeddable handle. Starts the endpoint, the router and the link pool, and
//! offers the public async API: push, publish_local, pull, pull_to, pull_into,
//! pull_into_device, recv, wait_for, shutdown. The cluster API (publish, get, list, subscribe)
//! lives in `cluster`.

use std::{
    future::Future,
    sync::{
        Arc, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use iroh::{
    Endpoint, EndpointId,
    protocol::{DynProtocolHandler, Router},
};
use tb_dashboard::{Metrics, Role as MetricsRole, TransferKind};
use tb_link::{
    LinkGuard, PeerAddr, Pool, PoolArgs, PoolStats, ReadyLinks, auth, budget::ByteBudget,
};
use tb_proto::{ContentHash, DATA_ALPN, DType, TensorMeta, TensorName};
use tokio::sync::Mutex;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::debug;

use crate::{
    channel::{self, Channel, Channels},
    client::{self, Pulled},
    cluster::{self, Cluster},
    config::Config,
    ctx::NodeCtx,
    device::{self, Device, DeviceBuffer},
    error::{Error, Result},
    inbox::{Inbox, Received},
    inflight::Inflight,
    links::NodeLinks,
    progress::TransferProgress,
    rate::RateLimiter,
    serve::DataProtocol,
    tensor::Tensor,
};

/// How long `shutdown` waits for in-flight tasks to finish after cancelling them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A tensor-broker node: holds tensors and moves them peer to peer over pooled QUIC links.
///
/// Cloning is cheap; all clones drive the same node. Call [`Node::shutdown`] when done.
#[derive(Debug, Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

/// A handle that does not keep the node alive (for tasks the node owns, and services
/// registered in its table that need the node back).
#[derive(Debug, Clone)]
pub struct WeakNode(Weak<Inner>);

impl WeakNode {
    /// The node, unless it is gone.
    pub fn upgrade(&self) -> Option<Node> {
        self.0.upgrade().map(|inner| Node { inner })
    }
}

#[derive(Debug)]
struct Inner {
    ctx: Arc<NodeCtx>,
    /// The broker client; `None` on a standalone node.
    cluster: Option<Arc<Cluster>>,
    pool: Pool,
    router: Router,
    addr: PeerAddr,
    stopped: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Pulls to a device that went by CUDA IPC instead of the network.
    ipc_pulls: AtomicU64,
}

impl Drop for Inner {
    /// A node dropped without `shutdown()` still stops its actors and tasks (the router aborts
    /// on its own drop); only the graceful wait is skipped.
    fn drop(&mut self) {
        channel::cuda_ipc::in_this_process(self.addr.id, false);
        self.ctx.cancel.cancel();
        self.pool.stop(None);
    }
}

/// Largest payload [`Node::push_bytes`] streams straight from the caller's bytes to a
/// same-host peer; larger ones are copied into a tensor first (which blocks the calling
/// thread while it copies and hashes: a caller on an event loop copies those elsewhere).
pub const PUSH_BYTES_STREAMED_MAX: usize = 4 << 20;
#[cfg(target_os = "linux")]
const _: () = assert!(PUSH_BYTES_STREAMED_MAX == channel::SHM_PUSH_INLINE_MAX);

impl Node {
    /// Starts a node: binds the offline endpoint, the `tb/data/1` protocol and the pool.
    pub async fn spawn(config: Config) -> Result<Node> {
        let endpoint = Node::bind(&config).await?;
        Node::spawn_on(config, endpoint, Vec::new()).await
    }

    /// Binds the offline endpoint a node of `config` runs on, with the identity key from its
    /// data dir (or a fresh one). For processes that serve more protocols than `tb/data/1`
    /// (a broker's `tb/ctl/1` and gossip need the endpoint before the node starts).
    pub async fn bind(config: &Config) -> Result<Endpoint> {
        let key = match &config.data_dir {
            Some(dir) => tb_link::load_or_create_key(dir)?,
            None => iroh::SecretKey::generate(),
        };
        bind_endpoint(config, key).await
    }

    /// Starts a node on an endpoint from [`Node::bind`], serving `extra` protocols (ALPN,
    /// handler) on its router next to `tb/data/1`.
    pub async fn spawn_on(
        config: Config,
        endpoint: Endpoint,
        extra: Vec<(&'static [u8], Box<dyn DynProtocolHandler>)>,
    ) -> Result<Node> {
        raise_fd_limit();
        let mut addr = tb_link::local_peer_addr(&endpoint)?;
        // Peers dial what the node advertises, when it says (bound to 0.0.0.0, behind a NAT).
        if let Some(advertised) = config.advertise_addrs.first() {
            addr.addr = *advertised;
        }
        let (store, evictions) = cluster::store_for(&config);
        let ctx = context(config, &endpoint, store)?;
        for &kind in &ctx.config.channels {
            if !ctx.channels.runs(kind) {
                ctx.metrics.channels.set_unavailable(kind);
            }
        }
        Channels::start(&ctx)?;
        let (pool, handle) = Pool::spawn(PoolArgs {
            endpoint: endpoint.clone(),
            config: ctx.config.link(),
            metrics: ctx.metrics.clone(),
            ready: ctx.ready.clone(),
            events: Arc::new(NodeLinks::new(&ctx)),
            tracker: ctx.tracker.clone(),
            cancel: ctx.cancel.clone(),
        })
        .await?;
        let protocol = DataProtocol {
            ctx: ctx.clone(),
            pool: pool.clone(),
        };
        let router = Router::builder(endpoint).accept(DATA_ALPN, protocol);
        let router = extra
            .into_iter()
            .fold(router, |router, (alpn, handler)| {
                router.accept(alpn, handler)
            })
            .spawn();
        ctx.tracker
            .spawn(ctx.metrics.clone().run_sampler(ctx.cancel.clone()));
        ctx.tracker
            .spawn(sweep_loans(ctx.loans.clone(), ctx.cancel.clone()));
        let cluster = cluster::start(&ctx, &addr, evictions);
        channel::cuda_ipc::in_this_process(addr.id, true);
        debug!(node = %addr, brokers = ctx.config.brokers.len(), "node started");
        let node = Node {
            inner: Arc::new(Inner {
                ctx,
                cluster,
                pool,
                router,
                addr,
                stopped: Mutex::new(Some(handle)),
                ipc_pulls: AtomicU64::new(0),
            }),
        };
        // Its requests to a broker on this host can take the same-host socket.
        if let Some(cluster) = &node.inner.cluster {
            cluster.ctl.attach(node.downgrade());
        }
        Ok(node)
    }

    /// This node's id (its iroh public key).
    pub fn id(&self) -> EndpointId {
        self.inner.addr.id
    }

    /// The address peers dial: `<node-id>@<ip:port>`, the first of
    /// [`Config::advertise_addrs`] if any, else the bound one (an unspecified IP read as
    /// loopback).
    pub fn addr(&self) -> &PeerAddr {
        &self.inner.addr
    }

    /// The underlying iroh endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.ctx.endpoint
    }

    /// The configuration the node runs with.
    pub fn config(&self) -> &Config {
        &self.inner.ctx.config
    }

    /// Sends `tensor` straight to the peer at `addr`, which gets it from `recv()`/`wait_for()`.
    /// Returns once the peer has verified and queued it.
    pub async fn push(&self, addr: &PeerAddr, name: &str, tensor: &Tensor) -> Result<()> {
        self.push_inner(addr, name, tensor, None).await
    }

    /// [`push`](Self::push), recording on `progress` the payload bytes handed to the network
    /// so far (their total first), for a progress bar.
    pub async fn push_with_progress(
        &self,
        addr: &PeerAddr,
        name: &str,
        tensor: &Tensor,
        progress: &TransferProgress,
    ) -> Result<()> {
        self.push_inner(addr, name, tensor, Some(progress)).await
    }

    /// Pushes `bytes` as a `dtype` tensor of `shape` to the peer at `addr`, as
    /// [`push`](Self::push) does, without making a [`Tensor`] of them first. To a same-host
    /// peer, payloads up to 4 MiB go from `bytes` straight to its socket, hashed on the way in
    /// 64 KiB pieces with the hash after them (the peer checks what arrived against it, as it
    /// hashes the pieces in turn): the hash overlaps the transfer instead of preceding it, and
    /// nothing is copied into memory of this node. Otherwise a tensor is made (copied and
    /// hashed, blocking this thread meanwhile) and pushed.
    #[tracing::instrument(name = "push", skip_all, fields(me = %self.id().fmt_short(), peer = %addr.id.fmt_short(), tensor = name))]
    pub async fn push_bytes(
        &self,
        addr: &PeerAddr,
        name: &str,
        dtype: DType,
        shape: Vec<u64>,
        bytes: &[u8],
    ) -> Result<()> {
        let tensor_name = TensorName::new(name)?;
        crate::tensor::check_len(dtype, &shape, bytes.len())?;
        #[cfg(target_os = "linux")]
        if bytes.len() <= PUSH_BYTES_STREAMED_MAX {
            // No hash in the metadata: it follows the bytes.
            let meta = TensorMeta::new(dtype, shape.clone(), ContentHash([0; 32]))?;
            meta.validate(self.config().max_tensor_bytes)?;
            let ctx = &self.inner.ctx;
            let hashing = async |route: &channel::Route| match route {
                channel::Route::Shm(shm) => shm.push_hashing(ctx, &tensor_name, &meta, bytes).await,
                _ => Err(channel::ChannelError::ViaQuic),
            };
            if self
                .by_channel(addr, TransferKind::Push, hashing)
                .await?
                .is_some()
            {
                return Ok(());
            }
        }
        let tensor = channel::verify::blocking(|| Tensor::copy_from(dtype, shape, bytes))?;
        self.push_inner(addr, name, &tensor, None).await
    }

    #[tracing::instrument(name = "push", skip_all, fields(me = %self.id().fmt_short(), peer = %addr.id.fmt_short(), tensor = name))]
    async fn push_inner(
        &self,
        addr: &PeerAddr,
        name: &str,
        tensor: &Tensor,
        progress: Option<&TransferProgress>,
    ) -> Result<()> {
        let name = TensorName::new(name)?;
        tensor.meta().validate(self.config().max_tensor_bytes)?;
        // A device tensor received as a loan by CUDA IPC is hashed first (the peer checks).
        let tensor = &channel::verify::blocking(|| tensor.clone().hashed())?;
        if let Some(p) = progress {
            p.set_total(tensor.byte_len());
        }
        let ctx = &self.inner.ctx;
        let push = async |route: &channel::Route| route.push(ctx, &name, tensor).await;
        if self
            .by_channel(addr, TransferKind::Push, push)
            .await?
            .is_some()
        {
            crate::progress::reached(progress, tensor.byte_len());
            return Ok(());
        }
        let links = || self.link(addr);
        self.guarded(client::push(&self.inner.ctx, links, name, tensor, progress))
            .await
    }

    /// Holds `tensor` as the next version of `name` so peers can pull it; returns the version.
    pub fn publish_local(&self, name: &str, tensor: Tensor) -> Result<u64> {
        self.check_running()?;
        let name = TensorName::new(name)?;
        tensor.meta().validate(self.config().max_tensor_bytes)?;
        crate::set::check_publishable(&name, &tensor)?;
        let tensor = channel::verify::blocking(|| tensor.hashed())?;
        Ok(self.inner.ctx.store.insert(name, tensor))
    }

    /// Keeps the newest `keep` (at least 1) versions of `name` that this node holds, instead
    /// of `Config::keep_versions` (for a publisher whose readers ask for older versions).
    pub fn set_keep(&self, name: &str, keep: usize) -> Result<()> {
        let name = TensorName::new(name)?;
        self.inner.ctx.store.set_keep(&name, keep);
        Ok(())
    }

    /// Pulls `name` (the newest version, or `version`) from the peer at `addr`.
    pub async fn pull(
        &self,
        addr: &PeerAddr,
        name: &str,
        version: Option<u64>,
    ) -> Result<Pulled<Tensor>> {
        let name = TensorName::new(name)?;
        let ctx = &self.inner.ctx;
        let pull = async |route: &channel::Route| route.pull(ctx, &name, version).await;
        if let Some(pulled) = self.by_channel(addr, TransferKind::Pull, pull).await? {
            return Ok(pulled);
        }
        let pulled = self.quic_pull_into(addr, name, version, channel::alloc_host);
        pulled.await?.into_tensor()
    }

    /// Lends `tensor` to `peer` under a private name, for at most `ttl`: only `peer` may pull
    /// it ([`pull_lent`](Self::pull_lent), or [`pull_lent_to`](Self::pull_lent_to) a device),
    /// only while the returned handle lives. Nothing is published or stored; on one host the
    /// peer maps the tensor's sealed memfd (no copy), or a device tensor's memory by CUDA IPC.
    /// The extension point's way to move a large value beside a request's own stream.
    pub fn lend(&self, peer: EndpointId, tensor: Tensor, ttl: Duration) -> Result<crate::Lent> {
        self.check_running()?;
        self.inner.ctx.loans.lend(peer, tensor, ttl)
    }

    /// Lends the `dtype` tensor of `shape` in `buffer` (device memory) to `peer`, as
    /// [`lend`](Self::lend) does, without hashing it first: a peer on this host that pulls it
    /// to a device copies it by CUDA IPC and checks no hash of a loan; it is hashed (through
    /// staging) only when it is pulled over the network, whose reader checks.
    pub fn lend_device(
        &self,
        peer: EndpointId,
        dtype: DType,
        shape: Vec<u64>,
        buffer: DeviceBuffer,
        ttl: Duration,
    ) -> Result<crate::Lent> {
        self.check_running()?;
        let tensor = Tensor::unhashed_device(dtype, shape, buffer)?;
        self.inner.ctx.loans.lend(peer, tensor, ttl)
    }

    /// Pulls what `peer` lent to this node as `name` into memory on `device`
    /// ([`pull_lent`](Self::pull_lent) for the host). To a CUDA device: by CUDA IPC when the
    /// lender is on this host and lent a device tensor, else over the pair's channel or QUIC,
    /// then up (see [`pull_to`](Self::pull_to)). `DeviceUnavailable` before any traffic when
    /// there is no such device.
    pub async fn pull_lent_to(
        &self,
        peer: EndpointId,
        name: &TensorName,
        device: Device,
    ) -> Result<Tensor> {
        let Device::Cuda(ordinal) = device else {
            return self.pull_lent(peer, name).await;
        };
        if !crate::is_lent_name(name) {
            return Err(Error::InvalidTensor(format!(
                "\"{name}\" is not a lent name (they start with {})",
                crate::LEND_PREFIX
            )));
        }
        device::ensure(ordinal, &self.config().cuda)?;
        let ctx = &self.inner.ctx;
        let links = || async move {
            ctx.ready.try_guard(&peer).ok_or_else(|| {
                Error::Io(format!(
                    "no link to {} to pull a lent tensor on (it went away)",
                    peer.fmt_short()
                ))
            })
        };
        // CUDA IPC when the lender looks local by the link's path (the lender checks for real,
        // by boot id); a link without a direct IP path leaves the lender to decide.
        let local = ctx.endpoint.bound_sockets();
        let ipc = match ctx
            .ready
            .try_guard(&peer)
            .and_then(|l| channel::selected_addr(&l))
        {
            Some(addr) => channel::cuda_ipc::wanted(&ctx.config.cuda, addr, &local),
            None => ctx.config.cuda.ipc,
        };
        let version = Some(crate::LENT_VERSION);
        let pull = channel::pull_to_device(ctx, &peer, ipc, links, name, version, ordinal);
        let (pulled, via) = self.guarded(pull).await?;
        if via == channel::DeviceVia::CudaIpc {
            self.inner.ipc_pulls.fetch_add(1, Ordering::Relaxed);
        }
        Ok(pulled.buffer)
    }

    /// Tensors lent now ([`lend`](Self::lend)) whose handles are alive and time not up.
    pub fn loans(&self) -> usize {
        self.inner.ctx.loans.len()
    }

    /// Pulls what `peer` lent to this node as `name` (a [`crate::Lent::name`] it sent), over
    /// the pooled link `peer` has with this node (never dialing: a loan is answered on the
    /// link its request came on): the pair's channel first, then QUIC. Verified as any pull.
    pub async fn pull_lent(&self, peer: EndpointId, name: &TensorName) -> Result<Tensor> {
        if !crate::is_lent_name(name) {
            return Err(Error::InvalidTensor(format!(
                "\"{name}\" is not a lent name (they start with {})",
                crate::LEND_PREFIX
            )));
        }
        let ctx = &self.inner.ctx;
        let version = Some(crate::LENT_VERSION);
        let links = || async move {
            ctx.ready.try_guard(&peer).ok_or_else(|| {
                Error::Io(format!(
                    "no link to {} to pull a lent tensor on (it went away)",
                    peer.fmt_short()
                ))
            })
        };
        let pull = async |route: &channel::Route| route.pull(ctx, name, version).await;
        let first = channel::first(ctx, &peer, links, Some(TransferKind::Pull), pull);
        if let Some(pulled) = self.guarded(first).await? {
            return Ok(pulled.buffer);
        }
        let quic = client::pull_into(ctx, links, name.clone(), version, channel::alloc_host);
        Ok(self.guarded(quic).await?.into_tensor()?.buffer)
    }

    /// Pulls `name` into a buffer the caller supplies once it knows the metadata (the
    /// descriptor-then-read pattern): `alloc` gets the verified header and returns a buffer
    /// of exactly `meta.byte_len` bytes, which the payload is read straight into.
    #[tracing::instrument(name = "pull", skip_all, fields(me = %self.id().fmt_short(), peer = %addr.id.fmt_short(), tensor = name))]
    pub async fn pull_into<B, F>(
        &self,
        addr: &PeerAddr,
        name: &str,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<B>>
    where
        B: AsMut<[u8]> + Send,
        F: FnOnce(&TensorMeta) -> Result<B> + Send,
    {
        let name = TensorName::new(name)?;
        let mut alloc = Some(alloc);
        let ctx = &self.inner.ctx;
        let once = |meta: &TensorMeta| match alloc.take() {
            Some(alloc) => alloc(meta),
            None => Err(Error::Io("a pull allocated its buffer twice".into())),
        };
        let pull = async |route: &channel::Route| route.pull_into(ctx, &name, version, once).await;
        if let Some(pulled) = self.by_channel(addr, TransferKind::Pull, pull).await? {
            return Ok(pulled);
        }
        let alloc = alloc.ok_or_else(|| Error::Io("a pull allocated its buffer twice".into()))?;
        self.quic_pull_into(addr, name, version, alloc).await
    }

    /// Runs `transfer` on the channel of the pair with the peer at `addr` (dialing it first
    /// on first contact), timed as `kind`: `None` when it goes over QUIC instead (see
    /// [`channel::first`]).
    async fn by_channel<T>(
        &self,
        addr: &PeerAddr,
        kind: TransferKind,
        transfer: impl AsyncFnOnce(&channel::Route) -> Result<T, channel::ChannelError>,
    ) -> Result<Option<T>> {
        let links = || self.link(addr);
        let first = channel::first(&self.inner.ctx, &addr.id, links, Some(kind), transfer);
        self.guarded(first).await
    }

    /// [`pull_into`](Self::pull_into) over the QUIC link.
    async fn quic_pull_into<B, F>(
        &self,
        addr: &PeerAddr,
        name: TensorName,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<B>>
    where
        B: AsMut<[u8]> + Send,
        F: FnOnce(&TensorMeta) -> Result<B> + Send,
    {
        let links = || self.link(addr);
        self.guarded(client::pull_into(
            &self.inner.ctx,
            links,
            name,
            version,
            alloc,
        ))
        .await
    }

    /// Pulls `name` (the newest version, or `version`) from the peer at `addr` into memory on
    /// `device`. To a CUDA device: copied device to device by CUDA IPC when the peer is on
    /// this host and holds the version on a device; else received over the shm channel when
    /// the pair runs it (host bytes, then one copy up) or through pinned staging straight into
    /// device memory (QUIC). `DeviceUnavailable` before any traffic when there is no such device.
    pub async fn pull_to(
        &self,
        addr: &PeerAddr,
        name: &str,
        version: Option<u64>,
        device: Device,
    ) -> Result<Pulled<Tensor>> {
        let Device::Cuda(ordinal) = device else {
            return self.pull(addr, name, version).await;
        };
        let tensor_name = TensorName::new(name)?;
        device::ensure(ordinal, &self.config().cuda)?;
        let links = || self.link(addr);
        let ctx = &self.inner.ctx;
        let local = ctx.endpoint.bound_sockets();
        let ipc = channel::cuda_ipc::wanted(&ctx.config.cuda, addr.addr, &local);
        let pull =
            channel::pull_to_device(ctx, &addr.id, ipc, links, &tensor_name, version, ordinal);
        let (pulled, via) = self.guarded(pull).await?;
        if via == channel::DeviceVia::CudaIpc {
            self.inner.ipc_pulls.fetch_add(1, Ordering::Relaxed);
        }
        Ok(pulled)
    }

    /// Pulls `name` over the network into a device buffer the caller supplies once it knows
    /// the metadata (`alloc` returns a buffer of exactly `meta.byte_len` bytes that no clone
    /// shares). The payload passes through pinned staging, hashed on the way.
    #[tracing::instrument(name = "pull_device", skip_all, fields(me = %self.id().fmt_short(), peer = %addr.id.fmt_short(), tensor = name))]
    pub async fn pull_into_device<F>(
        &self,
        addr: &PeerAddr,
        name: &str,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<DeviceBuffer>>
    where
        F: FnOnce(&TensorMeta) -> Result<DeviceBuffer> + Send,
    {
        let name = TensorName::new(name)?;
        let links = || self.link(addr);
        let pull = client::pull_into_device(&self.inner.ctx, links, name, version, alloc);
        self.guarded(pull).await
    }

    /// How many pulls to a device went by CUDA IPC rather than the network.
    pub fn cuda_ipc_pulls(&self) -> u64 {
        self.inner.ipc_pulls.load(Ordering::Relaxed)
    }

    /// The next tensor pushed to this node (waits without limit).
    pub async fn recv(&self) -> Result<Received> {
        self.recv_timeout(Duration::MAX).await
    }

    /// The next tensor pushed to this node, or `Timeout` after `timeout`.
    pub async fn recv_timeout(&self, timeout: Duration) -> Result<Received> {
        self.guarded(self.inner.ctx.inbox.take(None, timeout)).await
    }

    /// The next tensor pushed to this node under `name`, or `Timeout` after `timeout`.
    /// Other pushed tensors stay queued for `recv()`.
    pub async fn wait_for(&self, name: &str, timeout: Duration) -> Result<Received> {
        let name = TensorName::new(name)?;
        self.guarded(self.inner.ctx.inbox.take(Some(&name), timeout))
            .await
    }

    /// Puts `item`, taken by [`recv`](Self::recv) or [`wait_for`](Self::wait_for), back
    /// where it was in the inbox (ahead of every push that arrived after it), for a taker
    /// that could not hand it on (an asyncio `recv` cancelled after the tensor was taken).
    /// Never refused.
    pub fn give_back(&self, item: Received) {
        let ctx = &self.inner.ctx;
        let bytes = item.tensor.byte_len();
        // Counted again against the budget it was received under.
        let held = match item.tensor.device() {
            Device::Host => ctx.inbox.reserve_again(bytes),
            Device::Cuda(_) => ctx.device_pushes.reserve_over(bytes),
        };
        ctx.inbox.give_back(item, held);
    }

    /// Serves `kind` requests on this node's `tb/data/1` links with `service` (see
    /// [`Service`](crate::Service)): the extension point for request kinds defined in
    /// tb-proto and served by a crate above this one. A kind served already (every built-in
    /// kind is) is refused with [`Error::InUse`].
    pub fn add_service(
        &self,
        kind: tb_proto::RequestKind,
        service: Arc<dyn crate::Service>,
    ) -> Result<()> {
        self.inner.ctx.services.add(kind, service)
    }

    /// Has `hook` fill in or add to the stats of each heartbeat this node sends its broker,
    /// after the node made them: how a crate on the extension point reports its figures
    /// (tb-call: the functions served here and their call rates). Hooks run in the order
    /// added, on the heartbeat's task: they must not block.
    pub fn add_stats_hook(&self, hook: crate::StatsHook) {
        self.inner.ctx.stats_hooks.add(hook);
    }

    /// Answers the control requests that nodes on this host send on the same-host socket
    /// ([`tb_proto::DataRequest::Ctl`]) with `handler`: what a broker registers on the node
    /// it runs, so that a publish or look-up from its host skips a QUIC round trip. Once per
    /// node: a second handler is refused with [`Error::InUse`].
    pub fn serve_ctl_on_socket(&self, handler: Arc<dyn crate::SocketCtl>) -> Result<()> {
        match self.inner.ctx.socket_ctl.set(handler) {
            true => Ok(()),
            false => Err(Error::InUse(
                "this node answers same-host control requests already".into(),
            )),
        }
    }

    /// Stops serving `kind` requests: later ones are answered `Unsupported` (streams being
    /// served finish). Returns the service taken out, which [`Node::add_service`] can put
    /// back; `None` when nothing served the kind.
    pub fn remove_service(&self, kind: tb_proto::RequestKind) -> Option<Arc<dyn crate::Service>> {
        self.inner.ctx.services.remove(kind)
    }

    /// Opens a request's stream to the peer at `addr`: a connection of the pair's same-host
    /// socket when the pair runs shm and the peer's service takes requests there
    /// ([`Service::serve_local`](crate::Service::serve_local)), else a stream on its pooled
    /// link (dialing it on first contact). Writes `request` and then `preamble` (what its
    /// service reads right after the request, such as a call's inline arguments), finishes
    /// the send side when `finish` (the request is all this side sends: the end rides with
    /// it instead of going on its own), and reads the first answer frame within `timeout` (a
    /// service that answers at once can be held to less than the node's request timeout, so
    /// a peer killed under the link is noticed sooner). Redials once when the peer closed the
    /// link (or a pooled connection) gracefully before answering (it never served the
    /// request); a socket that fails leaves the pair's shm channel aside for a backoff, as
    /// any transfer's failure does, and the request goes over QUIC. The extension point's
    /// client half: a crate that adds a request kind ([`add_service`](Self::add_service))
    /// calls it with its own messages; what follows the first answer is the service's
    /// protocol, on [`RequestSend`](crate::RequestSend) and
    /// [`RequestRecv`](crate::RequestRecv).
    pub async fn open_request(
        &self,
        addr: &PeerAddr,
        request: &tb_proto::DataRequest,
        preamble: &[&[u8]],
        finish: bool,
        timeout: Duration,
    ) -> Result<crate::RequestStream> {
        let links = || self.link(addr);
        let ctx = &self.inner.ctx;
        let open = client::open_request(ctx, &addr.id, links, request, preamble, finish, timeout);
        self.guarded(open).await
    }

    /// Each peer with a usable pooled link and the data channel negotiated with it.
    pub fn links(&self) -> Vec<(EndpointId, &'static str)> {
        let links = self.inner.ctx.links();
        links.into_iter().map(|(p, c)| (p, c.as_str())).collect()
    }

    /// Number of pooled links.
    pub fn pool_size(&self) -> usize {
        self.pool_stats().links()
    }

    /// The data channel transfers with `peer` use now: what the pair negotiated on its link
    /// (QUIC until the link's first exchange, or after a channel failed).
    pub fn channel_to(&self, peer: &EndpointId) -> tb_proto::ChannelKind {
        self.inner.ctx.channels.pick(peer)
    }

    /// Pool counters: links, dials, reuses, evictions, connect failures.
    pub fn pool_stats(&self) -> PoolStats {
        self.inner.pool.stats()
    }

    /// Same-host connections this node opened (a connect and a hello each; a request on a
    /// pooled connection opens none). For tests of the pooling.
    #[doc(hidden)]
    pub fn same_host_connections_opened(&self) -> u64 {
        self.inner.ctx.channels.same_host_connections_opened()
    }

    /// The process's metrics (shared with a broker that runs this node).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.ctx.metrics
    }

    /// Sets the metric gauges that mirror state (pooled links, the store) to their current
    /// values: call before reading or scraping them.
    pub fn refresh_metrics(&self) {
        self.inner.ctx.refresh_metrics();
    }

    /// Tensors held for peers to pull: (count over all versions, total bytes).
    pub fn store_usage(&self) -> (usize, u64) {
        self.inner.ctx.store.usage()
    }

    /// Whether this node has joined its cluster: a broker accepted its first heartbeat (a
    /// standalone node, or one that does not heartbeat, counts as joined).
    pub fn is_joined(&self) -> bool {
        self.inner.cluster.as_ref().is_none_or(|c| c.joined())
    }

    /// Peers refused so far before authenticating (every reason of
    /// `tb_auth_failures_total` together).
    pub fn auth_failures(&self) -> u64 {
        self.inner.ctx.metrics.auth_failures.total()
    }

    /// Versions this node is receiving from the cluster right now (their holders known), which
    /// it serves to peers as they arrive.
    pub fn versions_receiving(&self) -> usize {
        self.inner.ctx.inflight.started()
    }

    /// Payload bytes this node has sent to peers of versions it was itself still receiving
    /// (cut-through serving, counted while they were still arriving), since start.
    pub fn inflight_bytes_served(&self) -> u64 {
        self.inner
            .ctx
            .inflight_bytes_sent
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Pushed tensors waiting in the inbox.
    pub fn inbox_len(&self) -> usize {
        self.inner.ctx.inbox.len()
    }

    /// Host bytes held by pushes being received or waiting in the inbox (at most
    /// `Config::max_push_memory`).
    pub fn push_bytes_held(&self) -> u64 {
        self.inner.ctx.inbox.bytes()
    }

    /// Stops the node: in-flight calls end with `Shutdown`, links close, the endpoint closes.
    /// Idempotent.
    pub async fn shutdown(&self) {
        let ctx = &self.inner.ctx;
        ctx.cancel.cancel();
        let handle = self.inner.stopped.lock().await.take();
        let Some(handle) = handle else { return };
        self.inner.pool.stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, handle).await;
        ctx.tracker.close();
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, ctx.tracker.wait()).await;
        if let Some(cluster) = &self.inner.cluster {
            cluster.ctl.close().await;
        }
        if let Err(e) = self.inner.router.shutdown().await {
            debug!(%e, "router shutdown");
        }
        ctx.endpoint.close().await;
    }

    /// Whether `shutdown` has been called.
    pub fn is_shut_down(&self) -> bool {
        self.inner.ctx.cancel.is_cancelled()
    }

    /// What the node's actors and tasks share.
    pub(crate) fn ctx(&self) -> &Arc<NodeCtx> {
        &self.inner.ctx
    }

    /// The broker client, or `Standalone` on a node without brokers.
    pub(crate) fn cluster(&self) -> Result<&Arc<Cluster>> {
        self.inner.cluster.as_ref().ok_or(Error::Standalone)
    }

    /// A handle that does not keep the node alive.
    pub fn downgrade(&self) -> WeakNode {
        WeakNode(Arc::downgrade(&self.inner))
    }

    fn check_running(&self) -> Result<()> {
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        Ok(())
    }

    /// Runs `fut` unless the node is (or becomes) shut down, which ends it with `Shutdown`.
    ///
    /// A transfer can fail *because* of the shutdown inside a single poll (it reads chunk after
    /// ready chunk while another thread cancels and closes the links, then sees "connection
    /// lost"), before the select sees the cancellation: an error that ends a call once shutdown
    /// has begun is reported as `Shutdown`, which is what caused it.
    pub(crate) async fn guarded<T>(&self, fut: impl Future<Output = Result<T>>) -> Result<T> {
        self.check_running()?;
        tokio::select! {
            biased;
            _ = self.inner.ctx.cancel.cancelled() => Err(Error::Shutdown),
            result = fut => match result {
                Err(_) if self.is_shut_down() => Err(Error::Shutdown),
                result => result,
            },
        }
    }

    /// A guard on a pooled link to `addr`, dialing it if needed (one dial per peer at a time).
    pub(crate) async fn link(&self, addr: &PeerAddr) -> Result<LinkGuard> {
        Ok(self.inner.pool.acquire(addr).await?)
    }
}

/// Sweeps out loans whose time is up every [`SWEEP_EVERY`](crate::lend::SWEEP_EVERY) until
/// the node stops: what was let go and never pulled (its peer went) is freed without waiting
/// for the next loan.
async fn sweep_loans(loans: crate::lend::Loans, cancel: tokio_util::sync::CancellationToken) {
    let mut every = tokio::time::interval(crate::lend::SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = every.tick() => loans.sweep(),
        }
    }
}

/// Binds the offline endpoint a node of `config` listens on (`Config::bind_addr`), with
/// identity `key`: [`tb_link::bind_endpoint`], for callers that hold a node's config (tests,
/// benchmarks' raw endpoints).
pub async fn bind_endpoint(config: &Config, key: iroh::SecretKey) -> Result<Endpoint> {
    Ok(tb_link::bind_endpoint(config.bind_addr, key).await?)
}

/// Raises this process's soft limit on open files to its hard limit, once: every host tensor
/// above 64 KiB is a memfd, held open by the node and by each same-host reader, and Python's
/// common soft limit (1024) is a few hundred tensors.
fn raise_fd_limit() {
    static RAISED: std::sync::Once = std::sync::Once::new();
    RAISED.call_once(|| {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let mut limit = getrlimit(Resource::Nofile);
        if limit.current < limit.maximum {
            let from = limit.current;
            limit.current = limit.maximum;
            match setrlimit(Resource::Nofile, limit) {
                Ok(()) => debug!(?from, to = ?limit.current, "raised the open-file limit"),
                Err(e) => debug!(%e, "could not raise the open-file limit"),
            }
        }
    });
}

/// A node's shared context, before anything of it runs.
fn context(config: Config, endpoint: &Endpoint, store: crate::Store) -> Result<Arc<NodeCtx>> {
    let metrics = match &config.metrics {
        Some(metrics) => metrics.clone(),
        None => Metrics::new(MetricsRole::Worker)
            .map_err(|e| Error::Io(format!("creating the metrics: {e}")))?,
    };
    // Shown in `tb_insecure_open` and the status JSON: a node with the open key admits
    // anyone who can reach it.
    metrics
        .insecure_open
        .set(i64::from(config.cluster_key.is_open()));
    let written_out = metrics.watch_offers_out.clone();
    Ok(Arc::new(NodeCtx {
        endpoint: endpoint.clone(),
        store,
        inflight: Inflight::default(),
        upload: RateLimiter::new(config.max_upload_rate),
        inbox: Inbox::new(config.inbox_capacity, config.max_push_memory),
        device_pushes: ByteBudget::new(config.push_device_budget()),
        metrics,
        ready: Arc::new(ReadyLinks::default()),
        inflight_bytes_sent: Default::default(),
        cancel: CancellationToken::new(),
        tracker: TaskTracker::new(),
        admission: auth::Admission::new(&config),
        channels: Channels::new(&config),
        outlines: Default::default(),
        watchers: crate::watch::Watchers::new(written_out),
        services: crate::serve::Services::builtin(),
        socket_ctl: Default::default(),
        loans: Default::default(),
        stats_hooks: Default::default(),
        config,
    }))
}
