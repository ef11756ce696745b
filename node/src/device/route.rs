//! The one place that decides how a tensor travels between two nodes.
//!
//! Today there are two channels: the `tb/data/1` QUIC stream (always possible; device bytes go
//! through pinned host staging) and, for a CUDA tensor pulled to a CUDA device on the same
//! host, CUDA IPC (the receiver maps the sender's device memory and copies device to device,
//! no network copy). The puller proposes IPC only to a peer that looks local
//! ([`pull_route`]); the server agrees only when it is really the same machine and the tensor
//! can be exported ([`ipc_refusal`]); any refusal or failure falls back to the network.

use std::net::{IpAddr, SocketAddr};

use super::{CudaConfig, Device};

/// A channel for one transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The `tb/data/1` stream (through pinned staging for device bytes).
    Network,
    /// Try CUDA IPC first, falling back to the network when the server declines.
    CudaIpc,
}

/// The route a pull to `dst` from the peer at `peer` should try first. `local` are this
/// node's bound sockets.
pub fn pull_route(dst: Device, peer: SocketAddr, local: &[SocketAddr], cfg: &CudaConfig) -> Route {
    let same_host = peer.ip().is_loopback()
        || local
            .iter()
            .any(|l| !l.ip().is_unspecified() && l.ip() == peer.ip());
    match dst {
        Device::Cuda(_) if cfg.ipc && same_host => Route::CudaIpc,
        _ => Route::Network,
    }
}

/// Why the server declines an IPC request, or `None` when it can export the tensor.
/// `requester_host` and `my_host` are boot ids ([`host_id`]): equal only on one running
/// machine, so two containers or VMs that share an address are not mistaken for one host.
pub fn ipc_refusal(
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
pub fn host_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_string())
}

/// Whether `ip` is one this process could reach itself on (used in tests and diagnostics).
pub fn is_local_ip(ip: IpAddr, local: &[SocketAddr]) -> bool {
    ip.is_loopback() || local.iter().any(|l| l.ip() == ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn ipc_is_tried_only_for_device_pulls_from_local_peers() {
        let cfg = CudaConfig::default();
        let local = [addr("10.0.0.5:4000")];
        let cuda = Device::Cuda(0);
        assert_eq!(
            pull_route(cuda, addr("127.0.0.1:9"), &local, &cfg),
            Route::CudaIpc
        );
        assert_eq!(
            pull_route(cuda, addr("10.0.0.5:9"), &local, &cfg),
            Route::CudaIpc
        );
        assert_eq!(
            pull_route(cuda, addr("10.0.0.6:9"), &local, &cfg),
            Route::Network
        );
        assert_eq!(
            pull_route(Device::Host, addr("127.0.0.1:9"), &local, &cfg),
            Route::Network
        );
        let off = CudaConfig {
            ipc: false,
            ..CudaConfig::default()
        };
        assert_eq!(
            pull_route(cuda, addr("127.0.0.1:9"), &local, &off),
            Route::Network
        );
        // An unspecified bind address matches nothing.
        assert_eq!(
            pull_route(cuda, addr("0.0.0.0:9"), &[addr("0.0.0.0:1")], &cfg),
            Route::Network
        );
    }

    #[test]
    fn server_exports_only_device_tensors_to_the_same_boot() {
        let cfg = CudaConfig::default();
        let big = 64 << 20;
        let cuda = Device::Cuda(1);
        assert_eq!(
            ipc_refusal(&cfg, "boot-a", Some("boot-a"), cuda, big, 0),
            None
        );
        assert!(ipc_refusal(&cfg, "boot-a", Some("boot-b"), cuda, big, 0).is_some());
        assert!(ipc_refusal(&cfg, "boot-a", None, cuda, big, 0).is_some());
        assert!(ipc_refusal(&cfg, "", Some(""), cuda, big, 0).is_some());
        assert!(ipc_refusal(&cfg, "boot-a", Some("boot-a"), Device::Host, big, 0).is_some());
        assert!(ipc_refusal(&cfg, "boot-a", Some("boot-a"), cuda, 1024, 0).is_some());
        assert!(ipc_refusal(&cfg, "boot-a", Some("boot-a"), cuda, big, big + 1).is_some());
        let off = CudaConfig {
            ipc: false,
            ..CudaConfig::default()
        };
        assert!(ipc_refusal(&off, "boot-a", Some("boot-a"), cuda, big, 0).is_some());
    }

    #[test]
    fn host_id_is_stable_within_a_boot() {
        assert_eq!(host_id(), host_id());
        assert!(is_local_ip("127.0.0.1".parse().expect("ip"), &[]));
    }
}
