//! The metadata of recent versions: the registry keeps only the newest version's, but a
//! look-up may ask for any version whose holders it still keeps.

use std::collections::BTreeMap;

use tb_proto::{Entry, Registry, TensorMeta, TensorName};

use super::oldest_kept;

/// Metadata of each live name's kept versions, as far as this broker has seen them publish.
/// Not replicated: after a restart, or for a head that came by sync, only newer versions
/// than what this broker saw are known.
#[derive(Debug, Default)]
pub(super) struct MetaCache(BTreeMap<TensorName, BTreeMap<u64, TensorMeta>>);

impl MetaCache {
    /// The newest version's metadata of every live name in `registry`.
    pub(super) fn resumed(registry: &Registry) -> Self {
        let heads = registry
            .list("")
            .map(|(name, e)| (name.clone(), BTreeMap::from([(e.version, e.meta.clone())])));
        MetaCache(heads.collect())
    }

    /// Records `name`'s head after a change (`None`: no longer live), forgetting versions
    /// older than the kept ones.
    pub(super) fn update(&mut self, name: &TensorName, after: Option<&Entry>, keep_versions: u64) {
        let Some(e) = after else {
            self.0.remove(name);
            return;
        };
        let versions = self.0.entry(name.clone()).or_default();
        versions.insert(e.version, e.meta.clone());
        *versions = versions.split_off(&oldest_kept(e.version, keep_versions));
    }

    /// The metadata of `version` of `name`, if seen.
    pub(super) fn get(&self, name: &TensorName, version: u64) -> Option<&TensorMeta> {
        self.0.get(name)?.get(&version)
    }
}
