//! The start of every cluster get: ask a broker where the version is, and whether this node's
//! own copy of it is the one to return.
//!
//! A copy in the local store is returned only when its hash is the registry's: a version
//! number can name other bytes here than in the registry (a publish that lost the version
//! to another publisher during a partition, `publish_local`). A copy that is not the
//! registry's is treated as not held: the get fetches the registry's bytes from the holders
//! (and they replace it in the store), and the mismatch is logged at warn.

use std::sync::Arc;

use tb_proto::{ContentHash, TensorName};
use tracing::warn;

use super::{Cluster, calls::Holders, slot::FetchSlot};
use crate::{
    error::{Error, Result},
    node::Node,
    store::Lookup,
    tensor::Tensor,
};

/// Where a get's bytes are.
pub(super) enum Found {
    /// Pull from these; the look-up took `slot` (handed back when the get drops it).
    Holders(Holders, FetchSlot),
    /// This node holds the version, and its hash is the registry's.
    Held(u64, Tensor),
}

/// Asks a broker where `version` (the newest when `None`) of `name` is, and returns this
/// node's copy instead when it holds the registry's bytes. The broker never names the asker
/// as a source: when this node is the only live holder (it published the version itself),
/// the answer is "no holder", and what it holds is the version to get, once the registry's
/// listing confirms its hash (where it lists that version: it lists only the newest).
pub(super) async fn look_up(
    node: &Node,
    cluster: &Arc<Cluster>,
    name: &TensorName,
    version: Option<u64>,
) -> Result<Found> {
    let store = &node.ctx().store;
    match cluster.lookup(name, version).await {
        Ok(holders) => {
            let slot = FetchSlot::taken(node, cluster, name, holders.version);
            let registry = holders.meta.hash;
            match store.get(name, Some(holders.version)) {
                Lookup::Found(v, tensor) if tensor.hash() == registry => {
                    drop(slot);
                    Ok(Found::Held(v, tensor))
                }
                Lookup::Found(v, tensor) => {
                    not_the_registrys(name, v, tensor.hash(), registry);
                    Ok(Found::Holders(holders, slot))
                }
                _ => Ok(Found::Holders(holders, slot)),
            }
        }
        Err(e @ Error::NotFound { .. }) => {
            let Lookup::Found(v, tensor) = store.get(name, version) else {
                return Err(e);
            };
            match listed_hash(cluster, name, v).await? {
                Some(registry) if registry != tensor.hash() => {
                    not_the_registrys(name, v, tensor.hash(), registry);
                    Err(Error::NotFound {
                        what: format!(
                            "tensor \"{name}\" v{v} (hash {registry}) on a live node: this \
                             node's copy has hash {}",
                            tensor.hash()
                        ),
                    })
                }
                _ => Ok(Found::Held(v, tensor)),
            }
        }
        Err(e) => Err(e),
    }
}

/// The hash the registry lists for `version` of `name`, when that is its newest version.
async fn listed_hash(
    cluster: &Cluster,
    name: &TensorName,
    version: u64,
) -> Result<Option<ContentHash>> {
    // Names sort before every longer name they prefix: the first entry is `name`, if live.
    let listed = cluster.ctl.list(name.as_str(), 1, cluster.request_timeout);
    Ok(listed
        .await?
        .into_iter()
        .find(|e| e.name == *name && e.version == version)
        .map(|e| e.meta.hash))
}

fn not_the_registrys(name: &TensorName, version: u64, held: ContentHash, registry: ContentHash) {
    warn!(
        %name, version, %held, %registry,
        "this node's copy of the version is not the registry's: not returning it"
    );
}
