//! A cluster get into the caller's buffer ([`Node::get_into`]): the look-up and the holders
//! of `fetch`, with the payload read straight into memory the caller owns (a numpy array, a
//! pinned buffer) instead of a fresh allocation.
//!
//! The bytes are the caller's, so this node does not keep the version and announces no
//! holding: it is not a source of it afterwards. While it receives, pullers the broker points
//! here are served as usual (cut-through); if any was, the version is handed to them as a
//! tensor at the end (one copy, only then), else nothing is copied.

use std::sync::Arc;

use bytes::Bytes;
use tb_proto::{TensorMeta, TensorName};

use super::{
    Cluster,
    get::{self, Reports},
    held::{self, Found},
};
use crate::{
    error::{Error, Result},
    node::Node,
    tensor::Tensor,
};

impl Node {
    /// Gets `version` (the newest when `None`) of `name` from the cluster into `dest`, the
    /// caller's buffer, and returns the version and its metadata. `check` sees the metadata
    /// first and may refuse it (a dtype or shape `dest` does not hold); `dest` must be exactly
    /// `byte_len` bytes long (else `InvalidTensor`, nothing written). Over QUIC the payload is
    /// read straight into `dest` and verified there; a version this node holds (when its hash
    /// is the registry's), or one that a same-host holder hands over whole (shm), is copied
    /// in once. Unlike
    /// [`get`](Self::get), this node neither keeps nor serves the version afterwards.
    pub async fn get_into<F>(
        &self,
        name: &str,
        version: Option<u64>,
        dest: &mut [u8],
        check: F,
    ) -> Result<(u64, TensorMeta)>
    where
        F: FnOnce(&TensorMeta) -> Result<()> + Send,
    {
        let cluster = self.cluster()?;
        let name = TensorName::new(name)?;
        if version == Some(0) {
            return Err(Error::NotFound {
                what: format!("tensor \"{name}\" v0 (versions start at 1)"),
            });
        }
        self.guarded(into(self, cluster, name, version, dest, check))
            .await
    }
}

/// Checks `meta` with `check` and against `dest`'s length.
fn fits<F>(name: &TensorName, meta: &TensorMeta, dest: &[u8], check: F) -> Result<()>
where
    F: FnOnce(&TensorMeta) -> Result<()>,
{
    check(meta)?;
    if dest.len() as u64 != meta.byte_len {
        return Err(Error::InvalidTensor(format!(
            "tensor \"{name}\" is {} bytes ({} {:?}); the buffer has {}",
            meta.byte_len,
            meta.dtype,
            meta.shape,
            dest.len()
        )));
    }
    Ok(())
}

/// Copies a whole host tensor into `dest` (same length, checked by `fits`).
fn copy_in(name: &TensorName, tensor: &Tensor, dest: &mut [u8]) -> Result<()> {
    let host;
    let bytes = match tensor.host_data() {
        Some(bytes) => bytes,
        None => {
            host = tensor.to_device(crate::device::Device::Host)?;
            host.data()
        }
    };
    if bytes.len() != dest.len() {
        return Err(Error::InvalidTensor(format!(
            "tensor \"{name}\": {} bytes arrived for a buffer of {}",
            bytes.len(),
            dest.len()
        )));
    }
    dest.copy_from_slice(bytes);
    Ok(())
}

async fn into<F>(
    node: &Node,
    cluster: &Arc<Cluster>,
    name: TensorName,
    version: Option<u64>,
    dest: &mut [u8],
    check: F,
) -> Result<(u64, TensorMeta)>
where
    F: FnOnce(&TensorMeta) -> Result<()> + Send,
{
    let held = |v: u64, tensor: Tensor, dest: &mut [u8], check: F| {
        fits(&name, tensor.meta(), dest, check)?;
        copy_in(&name, &tensor, dest)?;
        Ok((v, tensor.meta().clone()))
    };
    cluster.ensure_joined().await?;
    let (holders, mut slot) = match held::look_up(node, cluster, &name, version).await? {
        Found::Holders(holders, slot) => (holders, slot),
        Found::Held(v, tensor) => return held(v, tensor, dest, check),
    };
    let (v, meta) = (holders.version, holders.meta.clone());
    fits(&name, &meta, dest, check)?;
    slot.announce_start(holders.meta.byte_len);
    let mut receiving = node.ctx().inflight.start(&name, v, Some(meta.clone()));
    let feed = Reports {
        receiving: &mut receiving,
        progress: None,
    };
    // Boxed, as in `fetch`: the transfer's future is deep.
    let fetched = Box::pin(get::from_holders(
        node, cluster, &name, holders, feed, &mut *dest,
    ))
    .await;
    drop(slot);
    if let get::Received::Whole(whole) = fetched? {
        copy_in(&name, &whole, dest)?;
    }
    if receiving.wanted() {
        // Pullers are being served from this receive: let them finish from a copy.
        receiving.done(Tensor::from_verified(
            meta.clone(),
            Bytes::copy_from_slice(dest),
        ));
    }
    Ok((v, meta))
}
