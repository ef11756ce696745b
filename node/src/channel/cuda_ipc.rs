//! The `cuda-ipc` channel: device memory shared between two processes of one host.
//!
//! A pull into device memory from a peer that looks local ([`wanted`]) first asks it, on a
//! stream of the pooled data link, for the version's IPC handle
//! ([`DataRequest::CudaIpc`]). The holder exports it only when the version is on one of its
//! devices, large enough, and the asker's boot id is its own ([`refusal`]); the asker maps
//! the holder's memory, copies it device to device into its own buffer, unmaps it, and
//! finishes its side of the stream, which is when the holder lets go of the version (a
//! caller that stops waiting cannot cut that short: the copy runs to its end on a thread of
//! its own). Any refusal (a build without CUDA declines every request; an older node answers
//! `Malformed`), a mapping shorter than the tensor, or a handle that does not open sends the
//! pull on to the pair's other channels: the bytes never leave device memory on this path.
//!
//! Trust: an IPC handle maps the holder's memory writable, so it is exported only to peers
//! that proved read-write access (the request kind's write action, checked once by the
//! serving loop). From a holder that proved read-write access no hash is checked: the
//! metadata (hash included) comes from it, whose bytes were hashed when it published them,
//! and it could as well have published others. From one that proved only read-only access
//! (or whose access this node has not learnt) the copy is hashed before it is returned: a
//! mismatch is `Corrupt`.

use std::{
    future::Future,
    net::SocketAddr,
    sync::{Arc, OnceLock},
};

use iroh::EndpointId;
use tb_proto::{
    Access, DataRequest, DataResponse, RequestKind, TensorName,
    ipc::{IPC_HANDLE_LEN, IpcRequest, IpcResponse},
};
use tracing::debug;

use crate::{
    LinkGuard,
    client::{self, Pulled},
    ctx::NodeCtx,
    device::{self, CudaConfig, Device, DeviceBuffer},
    error::{Error, Result},
    serve::service::{ServeCtx, Service, ServiceFuture, ServiceStream, mismatched},
    store::Lookup,
    wire,
};

/// Whether a pull into device memory from the peer at `peer` tries CUDA IPC first: IPC is on
/// here, and the peer looks like this host (a loopback address, or one of this node's bound
/// addresses; `local`). The holder checks for real, by boot id.
pub(crate) fn wanted(cfg: &CudaConfig, peer: SocketAddr, local: &[SocketAddr]) -> bool {
    let same_host = peer.ip().is_loopback()
        || local
            .iter()
            .any(|l| !l.ip().is_unspecified() && l.ip() == peer.ip());
    cfg.ipc && same_host
}

/// Why the holder declines an IPC request, or `None` when it can export the tensor.
/// `requester_host` and `my_host` are boot ids ([`host_id`]): equal only on one running
/// machine, so two containers or VMs that share an address are not mistaken for one host.
pub(crate) fn refusal(
    cfg: &CudaConfig,
    requester_host: &str,
    my_host: Option<&str>,
    src: Device,
    byte_len: u64,
    requester_min_bytes: u64,
) -> Option<String> {
    if !cfg.ipc {
        return Some("CUDA IPC is turned off on the serving node".into());
    }
    match my_host {
        Some(mine) if !mine.is_empty() && mine == requester_host => {}
        _ => return Some("requester is on another host".into()),
    }
    if src == Device::Host {
        return Some("the tensor is in host memory".into());
    }
    let min = requester_min_bytes.max(cfg.ipc_min_bytes);
    if byte_len < min {
        return Some(format!(
            "{byte_len} bytes is below the IPC minimum of {min}"
        ));
    }
    None
}

/// This machine's identity for same-host checks: the kernel's boot id (Linux), which differs
/// between hosts, VMs and reboots. `None` where it cannot be read: IPC is then never offered.
pub(crate) fn host_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_string())
}

/// The nodes of this process (ids), which CUDA IPC never goes between: the driver cannot map
/// memory into the process that exported it, and a failed map after the holder exported a
/// loan would have taken the loan out for nothing.
/// (Counted: a node may start again with its key before the old one is dropped.)
fn local_nodes() -> std::sync::MutexGuard<'static, std::collections::HashMap<EndpointId, usize>> {
    static NODES: OnceLock<std::sync::Mutex<std::collections::HashMap<EndpointId, usize>>> =
        OnceLock::new();
    let nodes = NODES.get_or_init(Default::default);
    nodes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records that a node `id` runs in this process (`true`, at its start) or that one no
/// longer does (`false`, when it is dropped).
pub(crate) fn in_this_process(id: EndpointId, running: bool) {
    let mut nodes = local_nodes();
    let count = nodes.entry(id).or_default();
    match running {
        true => *count += 1,
        false => *count = count.saturating_sub(1),
    }
    if *count == 0 {
        nodes.remove(&id);
    }
}

fn same_process(id: &EndpointId) -> bool {
    local_nodes().contains_key(id)
}

fn my_host() -> Option<&'static str> {
    static HOST: OnceLock<Option<String>> = OnceLock::new();
    HOST.get_or_init(host_id).as_deref()
}

/// The `cuda-ipc` request service: every node registers it (a build without the `cuda`
/// feature holds no device tensors, so it declines every request).
pub(crate) struct CudaIpc;

impl Service for CudaIpc {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let ServiceStream {
                request,
                peer,
                mut send,
                recv,
                ..
            } = stream;
            let got = request.kind();
            let DataRequest::CudaIpc(IpcRequest::Open {
                name,
                version,
                host,
                min_bytes,
            }) = request
            else {
                return mismatched(node, &mut send, got, RequestKind::CudaIpc).await;
            };
            let ctx = &node.ctx;
            if crate::is_lent_name(&name) {
                let answer = export_lent(ctx, &peer, &name, version, &host, min_bytes);
                // The loan ends once the requester has its copy; until then (a mapping that
                // did not open, another container on this host) it stays for the network.
                if answer_and_hold(node, send, recv, answer).await {
                    ctx.loans.end(&name);
                }
                return;
            }
            let (answer, hold) = match ctx.store.get(&name, version) {
                Lookup::Found(version, tensor) => match export(ctx, &host, &tensor, min_bytes) {
                    Ok(handle) => {
                        let meta = tensor.meta().clone();
                        let handle = handle.to_vec();
                        let answer = IpcResponse::Handle {
                            meta,
                            version,
                            handle,
                        };
                        (answer, Some(tensor))
                    }
                    Err(reason) => (IpcResponse::Declined { reason }, None),
                },
                _ => {
                    let reason = format!("\"{name}\" is not held here");
                    (IpcResponse::Declined { reason }, None)
                }
            };
            if let IpcResponse::Declined { reason } = &answer {
                debug!(%name, %reason, "CUDA IPC declined");
            }
            let _ = answer_and_hold(node, send, recv, (answer, hold)).await;
        })
    }
}

/// How long a requester may take to tell the holder its copy was made.
const IPC_COPIED_WRITE: std::time::Duration = std::time::Duration::from_secs(5);

/// Sends `answer`; when it exports memory (`hold`), keeps that tensor (and so the
/// allocation) alive until the requester, which has it mapped, finishes its side of the
/// stream, or until the time limit. Whether the requester said it made its copy (a byte
/// before it finished; older requesters send none).
async fn answer_and_hold(
    node: &ServeCtx,
    mut send: iroh::endpoint::SendStream,
    mut recv: iroh::endpoint::RecvStream,
    (answer, hold): (IpcResponse, Option<crate::tensor::Tensor>),
) -> bool {
    let answer = DataResponse::CudaIpc(answer);
    let stall = node.stall_timeout();
    if wire::write_frame_within(&mut send, &answer, stall)
        .await
        .is_err()
    {
        return false;
    }
    let _ = send.finish();
    let mut copied = false;
    if hold.is_some() {
        let timeout = node.request_timeout();
        let said = tokio::time::timeout(timeout, recv.read_to_end(IPC_HANDLE_LEN)).await;
        copied = matches!(said, Ok(Ok(bytes)) if !bytes.is_empty());
    }
    drop(hold);
    copied
}

/// The answer to an IPC request for a tensor lent to `peer` ([`crate::Node::lend_device`]):
/// its handle (the loan stays until the requester says it has its copy); or declined, the
/// loan left for the network path. A loan lent unhashed stays so: the requester checks no
/// hash of a loan's IPC copy (see [`pull`]).
fn export_lent(
    ctx: &NodeCtx,
    peer: &EndpointId,
    name: &TensorName,
    version: Option<u64>,
    host: &str,
    min_bytes: u64,
) -> (IpcResponse, Option<crate::tensor::Tensor>) {
    let declined = |reason: String| {
        debug!(%name, %reason, "CUDA IPC declined");
        (IpcResponse::Declined { reason }, None)
    };
    if version.is_some_and(|v| v != crate::LENT_VERSION) {
        return declined(format!(
            "\"{name}\" is lent as version {}",
            crate::LENT_VERSION
        ));
    }
    if same_process(peer) {
        return declined("the requester runs in this process".into());
    }
    let taken = ctx
        .loans
        .peek_if(peer, name, |tensor| export(ctx, host, tensor, min_bytes));
    let taken = match taken {
        Some(Ok(taken)) => taken,
        Some(Err(Some(reason))) => return declined(reason),
        Some(Err(None)) | None => {
            return declined(format!(
                "\"{name}\" is not lent to this peer (or no longer)"
            ));
        }
    };
    let handle = taken.made.to_vec();
    let tensor = taken.tensor;
    let answer = IpcResponse::Handle {
        meta: tensor.meta().clone(),
        version: crate::LENT_VERSION,
        handle,
    };
    (answer, Some(tensor))
}

/// The IPC handle of `tensor`'s device memory, or why not.
fn export(
    ctx: &NodeCtx,
    host: &str,
    tensor: &crate::tensor::Tensor,
    min_bytes: u64,
) -> Result<[u8; IPC_HANDLE_LEN], String> {
    let cfg = &ctx.config.cuda;
    let (src, len) = (tensor.device(), tensor.byte_len());
    if let Some(reason) = refusal(cfg, host, my_host(), src, len, min_bytes) {
        return Err(reason);
    }
    let buf = tensor
        .device_buffer()
        .ok_or_else(|| "the tensor is in host memory".to_string())?;
    device::ipc_export(buf, cfg)
}

/// Tries to pull `name` from `peer` (over a link from `links`) by CUDA IPC into a new buffer
/// on device `ordinal`. `Ok(None)`: not possible this way (the caller goes on to the pair's
/// other channels); `Err`: a failure those would hit too (out of device memory, no device), or
/// a copy that does not hash to what a read-only holder said.
pub(crate) async fn pull<L, LF>(
    ctx: &NodeCtx,
    links: L,
    peer: &EndpointId,
    name: &TensorName,
    version: Option<u64>,
    ordinal: usize,
) -> Result<Option<Pulled<DeviceBuffer>>>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    // A read-only node is never exported to, nor a node of this process: go straight to
    // the network.
    let Some(host) = my_host().filter(|_| ctx.config.cluster_key.access() == Access::ReadWrite)
    else {
        return Ok(None);
    };
    if same_process(peer) {
        return Ok(None);
    }
    let request = DataRequest::CudaIpc(IpcRequest::Open {
        name: name.clone(),
        version,
        host: host.to_string(),
        min_bytes: ctx.config.cuda.ipc_min_bytes,
    });
    let asked = client::with_redial(links, |link| {
        let request = &request;
        async move {
            match ask(ctx, &link, request).await {
                Ok(asked) => Ok((link, asked)),
                Err(err) => Err((link, err)),
            }
        }
    });
    let (link, (mut send, answer)) = match asked.await {
        Ok(asked) => asked,
        // The peer cannot be reached, or refused this node's link: the network path would
        // dial again only to fail the same way.
        Err(err @ (Error::PeerUnreachable { .. } | Error::TooManyConnections { .. })) => {
            return Err(err);
        }
        Err(err) => {
            // The network path reports the failure, with its own fallbacks.
            debug!(%err, "no CUDA IPC with this peer");
            return Ok(None);
        }
    };
    let (meta, got_version, handle) = match answer {
        DataResponse::CudaIpc(answer) => {
            answer
                .validate(ctx.config.max_tensor_bytes)
                .map_err(|e| Error::InvalidTensor(format!("a CUDA IPC answer: {e}")))?;
            match answer {
                IpcResponse::Handle {
                    meta,
                    version,
                    handle,
                } => (meta, version, handle),
                IpcResponse::Declined { reason } => {
                    debug!(%reason, "CUDA IPC declined by the peer");
                    return Ok(None);
                }
            }
        }
        other => {
            // `Unsupported` from a node that does not serve the kind, or an error the
            // network path will report.
            debug!(?other, "no CUDA IPC answer from the peer");
            return Ok(None);
        }
    };
    if version.is_some_and(|v| v != got_version) {
        return Err(Error::InvalidTensor(format!(
            "asked for \"{name}\" v{} by CUDA IPC, offered v{got_version}",
            version.unwrap_or_default()
        )));
    }
    let Ok(handle) = <[u8; IPC_HANDLE_LEN]>::try_from(handle.as_slice()) else {
        return Ok(None);
    };
    // Once the mapping is closed (or never opened), the holder may let go: the send side
    // finishes, and the link is no longer in use for this request. A copy made says so first
    // (one byte), which is when a lender takes its loan out: a loan whose copy failed stays
    // for the network path.
    let rt = tokio::runtime::Handle::current();
    let done = move |copied: bool| {
        if copied {
            let said = rt.block_on(tokio::time::timeout(IPC_COPIED_WRITE, send.write_all(&[1])));
            if !matches!(said, Ok(Ok(()))) {
                debug!("could not tell the holder a CUDA IPC copy was made");
            }
        }
        let _ = send.finish();
        drop(link);
    };
    let copied = device::ipc_import(&ctx.config.cuda, ordinal, &handle, meta.byte_len, done);
    let Some(buffer) = copied.await? else {
        return Ok(None);
    };
    // A loan's hash comes from its lender, unchecked: left out, so that anything that trusts
    // a hash (publishing, pushing, a set's manifest) computes it first (`Tensor::hashed`).
    let meta = match crate::is_lent_name(name) {
        true => tb_proto::TensorMeta::new(meta.dtype, meta.shape, tb_proto::ContentHash([0; 32]))
            .map_err(|e| Error::InvalidTensor(format!("a CUDA IPC answer: {e}")))?,
        false => meta,
    };
    // A holder that proved only read-only access may not publish: its bytes are hashed
    // (through staging buffers) before anyone sees them. Not a loan's: its hash comes from
    // the lender with its bytes (no registry vouches for it), so checking one against the
    // other proves nothing, and a device tensor is lent unhashed (`Node::lend_device`).
    if !crate::is_lent_name(name) && ctx.channels.access_of(peer) != Some(Access::ReadWrite) {
        let got = match super::verify::blocking(|| buffer.hash()) {
            Ok(got) => got,
            Err(e) => {
                // The network path hashes as it receives: use it.
                debug!(%e, "hashing a CUDA IPC copy failed: the network path instead");
                return Ok(None);
            }
        };
        if got != meta.hash {
            return Err(Error::Corrupt(format!(
                "tensor \"{name}\" v{got_version} by CUDA IPC from {}: expected hash {}, got {got}",
                peer.fmt_short(),
                meta.hash
            )));
        }
    }
    Ok(Some(Pulled {
        name: name.clone(),
        version: got_version,
        meta,
        buffer,
    }))
}

/// Sends `request` on a new stream of `link` and reads the answer: the send side (held open
/// while the mapping is in use) and the answer.
async fn ask(
    ctx: &NodeCtx,
    link: &LinkGuard,
    request: &DataRequest,
) -> Result<(iroh::endpoint::SendStream, DataResponse)> {
    let (mut send, mut recv) = client::open(ctx, link).await?;
    wire::write_frame(&mut send, request)
        .await
        .map_err(|e| Error::Io(format!("sending a CUDA IPC request: {e}")))?;
    let answer = client::read_response(ctx, &mut recv, "a CUDA IPC request").await?;
    Ok((send, answer))
}

/// The service as the table holds it.
pub(crate) fn service() -> Arc<dyn Service> {
    Arc::new(CudaIpc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn ipc_is_tried_only_with_peers_that_look_local() {
        let cfg = CudaConfig::default();
        let local = [addr("10.0.0.5:4000")];
        assert!(wanted(&cfg, addr("127.0.0.1:9"), &local));
        assert!(wanted(&cfg, addr("10.0.0.5:9"), &local));
        assert!(!wanted(&cfg, addr("10.0.0.6:9"), &local));
        let off = CudaConfig {
            ipc: false,
            ..CudaConfig::default()
        };
        assert!(!wanted(&off, addr("127.0.0.1:9"), &local));
        // An unspecified bind address matches nothing.
        assert!(!wanted(&cfg, addr("0.0.0.0:9"), &[addr("0.0.0.0:1")]));
    }

    #[test]
    fn the_holder_exports_only_device_tensors_to_the_same_boot() {
        let cfg = CudaConfig::default();
        let big = 64 << 20;
        let cuda = Device::Cuda(1);
        assert_eq!(refusal(&cfg, "boot-a", Some("boot-a"), cuda, big, 0), None);
        assert!(refusal(&cfg, "boot-a", Some("boot-b"), cuda, big, 0).is_some());
        assert!(refusal(&cfg, "boot-a", None, cuda, big, 0).is_some());
        assert!(refusal(&cfg, "", Some(""), cuda, big, 0).is_some());
        assert!(refusal(&cfg, "boot-a", Some("boot-a"), Device::Host, big, 0).is_some());
        assert!(refusal(&cfg, "boot-a", Some("boot-a"), cuda, 1024, 0).is_some());
        assert!(refusal(&cfg, "boot-a", Some("boot-a"), cuda, big, big + 1).is_some());
        let off = CudaConfig {
            ipc: false,
            ..CudaConfig::default()
        };
        assert!(refusal(&off, "boot-a", Some("boot-a"), cuda, big, 0).is_some());
    }

    #[test]
    fn host_id_is_stable_within_a_boot() {
        assert_eq!(host_id(), host_id());
    }
}
