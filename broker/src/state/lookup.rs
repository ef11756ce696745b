//! Look-ups: [`BrokerState::lookup`] (where to fetch a version, fanned out across holders and
//! fetchers in flight) and [`BrokerState::fetching`] (a node reports a fetch in flight).

use tb_proto::{CtlResponse, Entry, HolderAddr, NodeId, Registry, TensorMeta, TensorName};

use super::{BrokerState, oldest_kept, reachable};
use crate::{
    BrokerError,
    fanout::{Asker, Wanted},
};

/// Where to fetch one version: the answer to a `Lookup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holders {
    /// The tensor.
    pub name: TensorName,
    /// The version found (the newest, unless one was asked for).
    pub version: u64,
    /// What that version's bytes are.
    pub meta: TensorMeta,
    /// Sources best first: complete holders and fetchers in flight (`complete: false`), never
    /// the asker.
    pub holders: Vec<HolderAddr>,
    /// How many of the first holders the asker may pull pieces from at once (each counted
    /// one of its fan-out slots for the asker).
    pub sources: usize,
}

impl From<Holders> for CtlResponse {
    fn from(h: Holders) -> Self {
        CtlResponse::Holders {
            name: h.name,
            version: h.version,
            meta: h.meta,
            holders: h.holders,
            // At most MAX_SOURCES.
            sources: u8::try_from(h.sources).unwrap_or(u8::MAX),
        }
    }
}

impl BrokerState {
    /// Where `asker` can fetch `version` (the newest if `None`) of `name`: live, reachable
    /// holders (`complete`) and fetchers in flight (`complete: false`, they serve what they
    /// have so far), best first, at most [`MAX_HOLDERS_REPLY`](tb_proto::MAX_HOLDERS_REPLY).
    ///
    /// Asking is the start of a fetch: the asker is recorded as fetching (others may be
    /// pointed at it) and takes one of the first source's `fanout` slots, until
    /// [`fetching`](Self::fetching) says it stopped, it announces that it holds the version,
    /// or `fetch_timeout_ms` passes. Sources with a free slot come first. For a large tensor
    /// (`chain_min_bytes`) the source with the fewest fetchers comes first, even one still
    /// receiving, so fetchers arriving together form a chain (at most `max_chain_depth` long);
    /// for a small one complete holders come first, so they form a shallow tree.
    pub fn lookup(
        &mut self,
        name: &TensorName,
        version: Option<u64>,
        asker: NodeId,
        now_ms: u64,
    ) -> Result<Holders, BrokerError> {
        self.lookup_excluding(name, version, asker, &[], now_ms)
    }

    /// [`lookup`](Self::lookup), never offering the sources in `exclude` (the asker dropped
    /// them during this fetch).
    pub fn lookup_excluding(
        &mut self,
        name: &TensorName,
        version: Option<u64>,
        asker: NodeId,
        exclude: &[NodeId],
        now_ms: u64,
    ) -> Result<Holders, BrokerError> {
        let registry = &self.registry;
        let (entry, version) = kept(registry, name, version, self.config.keep_versions)?;
        let meta =
            match version == entry.version {
                true => entry.meta.clone(),
                false => self.metas.get(name, version).cloned().ok_or_else(|| {
                    BrokerError::UnknownMeta {
                        name: name.clone(),
                        version,
                    }
                })?,
            };
        let complete: Vec<NodeId> = entry.holders_of(version).collect();
        let addrs_of = |n: &NodeId| reachable(registry, n).map(|m| m.addrs.clone());
        let want = Wanted {
            name,
            version,
            byte_len: meta.byte_len,
        };
        let asker = Asker {
            node: asker,
            exclude,
        };
        let plan = self.fanout.plan(want, asker, &complete, addrs_of, now_ms);
        if plan.holders.is_empty() {
            return Err(BrokerError::NoHolder {
                name: name.clone(),
                version,
            });
        }
        Ok(Holders {
            name: name.clone(),
            version,
            meta,
            holders: plan.holders,
            sources: plan.sources,
        })
    }

    /// Notes `node`'s upload limit (bytes per second, 0: unlimited) from a heartbeat this
    /// broker took: for large tensors, a source far slower than the others is offered last.
    pub fn upload_limit(&mut self, node: NodeId, limit: u64) {
        if self.heard.knows(&node) {
            self.fanout.upload_limit(node, limit);
        }
    }

    /// `node` started (`active`) or stopped fetching `version` of `name`. While active (and
    /// refreshed within `fetch_timeout_ms`), look-ups offer it as a source in flight; stopping
    /// frees the slot it held at its source. Starting a fetch of a version that is not kept
    /// is refused like a look-up of it.
    pub fn fetching(
        &mut self,
        name: &TensorName,
        version: u64,
        node: NodeId,
        active: bool,
        now_ms: u64,
    ) -> Result<(), BrokerError> {
        if !active {
            self.fanout.finish(name, version, node);
            return Ok(());
        }
        let keep = self.config.keep_versions;
        let (entry, version) = kept(&self.registry, name, Some(version), keep)?;
        if !entry.holders_of(version).any(|n| n == node) {
            self.fanout.start(name, version, node, now_ms);
        }
        Ok(())
    }
}

/// `name`'s live entry and the version asked for (the newest if `None`), if the registry still
/// keeps that version's holders.
fn kept<'a>(
    registry: &'a Registry,
    name: &TensorName,
    version: Option<u64>,
    keep_versions: u64,
) -> Result<(&'a Entry, u64), BrokerError> {
    let not_found = || BrokerError::NotFound {
        name: name.clone(),
        version,
    };
    let entry = registry.entry(name).ok_or_else(not_found)?;
    let newest = entry.version;
    let version = version.unwrap_or(newest);
    let oldest = oldest_kept(newest, keep_versions);
    if version > newest {
        return Err(not_found());
    }
    if version < oldest {
        return Err(BrokerError::Evicted {
            name: name.clone(),
            version,
            oldest,
            newest,
        });
    }
    Ok((entry, version))
}

#[cfg(test)]
mod tests;
