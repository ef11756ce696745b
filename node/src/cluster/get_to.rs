//! [`Node::get_to`]: a get whose tensor lands in device memory.
//!
//! To a CUDA device, the version is pulled from its holders with [`Node::pull_to`], best
//! first: from a holder on this host that keeps it on a device, device to device by CUDA IPC;
//! from one on this host that keeps it in host memory, over the shm channel and copied up
//! once; from any other, through pinned staging straight into device memory (no host copy of
//! the whole tensor). The tensor is the caller's: this node does not keep or serve it (like
//! `get_into`). When no holder can be pulled from that way, the version is got as
//! [`Node::get`] does and copied to the device once.

use tb_proto::TensorName;
use tracing::debug;

use super::{
    get,
    held::{self, Found},
};
use crate::{
    client::Pulled,
    device::{self, Device},
    error::{Error, Result},
    node::Node,
    tensor::Tensor,
};

impl Node {
    /// Gets `version` (the newest when `None`) of `name` from the cluster into memory on
    /// `device` (see the module docs). `Device::Host` is [`get`](Self::get) (or
    /// [`get_version`](Self::get_version)). `DeviceUnavailable` before any traffic when there
    /// is no such device.
    pub async fn get_to(
        &self,
        name: &str,
        version: Option<u64>,
        device: Device,
    ) -> Result<Pulled<Tensor>> {
        let Device::Cuda(ordinal) = device else {
            return match version {
                Some(v) => self.get_version(name, v).await,
                None => self.get(name).await,
            };
        };
        device::ensure(ordinal, &self.config().cuda)?;
        let cluster = self.cluster()?;
        let tensor_name = TensorName::new(name)?;
        let held = |pulled: Pulled<Tensor>| -> Result<Pulled<Tensor>> {
            let buffer = pulled.buffer.to_device(device)?;
            Ok(Pulled { buffer, ..pulled })
        };
        self.guarded(cluster.ensure_joined()).await?;
        let found = held::look_up(self, cluster, &tensor_name, version);
        let (holders, _slot) = match self.guarded(found).await? {
            Found::Holders(holders, slot) => (holders, slot),
            Found::Held(v, tensor) => return on_device(tensor_name, v, tensor, device),
        };
        let v = holders.version;
        for holder in holders.holders.iter().filter(|h| h.node != cluster.me()) {
            let Ok(peers) = get::peers_of(holder) else {
                continue;
            };
            for peer in peers {
                match self.pull_to(&peer, name, Some(v), device).await {
                    Ok(pulled) if pulled.meta == holders.meta => return Ok(pulled),
                    Ok(pulled) => {
                        debug!(name, v, hash = %pulled.meta.hash, "a holder sent other bytes");
                        break;
                    }
                    Err(Error::Shutdown) => return Err(Error::Shutdown),
                    Err(e) => debug!(name, v, %e, "pulling to the device failed; next holder"),
                }
            }
        }
        // No holder served it to the device: the cluster get, then one copy to the device.
        held(self.get_version(name, v).await?)
    }
}

/// A tensor this node holds, on `device` (copied there unless it is already).
fn on_device(
    name: TensorName,
    version: u64,
    tensor: Tensor,
    device: Device,
) -> Result<Pulled<Tensor>> {
    let buffer = tensor.to_device(device)?;
    Ok(Pulled {
        name,
        version,
        meta: buffer.meta().clone(),
        buffer,
    })
}
