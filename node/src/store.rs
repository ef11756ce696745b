//! [`Store`]: the tensors this node holds and serves, by name and version.
//!
//! In memory for now. Each publish of a name makes a new version (increasing per name);
//! the newest `keep_versions` versions are kept and older ones evicted.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
};

use tb_proto::TensorName;

use crate::tensor::Tensor;

/// What a look-up found.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// The tensor at this version.
    Found(u64, Tensor),
    /// The name was never held, or the version is unknown.
    Missing,
    /// That version was held once and has been evicted by retention.
    Evicted {
        /// Oldest version still held.
        oldest: u64,
    },
}

#[derive(Debug, Default)]
struct Versions {
    next: u64,
    held: BTreeMap<u64, Tensor>,
}

/// Shared handle to the node's tensors. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<Mutex<HashMap<TensorName, Versions>>>,
    keep_versions: usize,
}

impl Store {
    /// An empty store keeping the newest `keep_versions` (at least 1) versions per name.
    pub fn new(keep_versions: usize) -> Self {
        Store {
            inner: Arc::default(),
            keep_versions: keep_versions.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TensorName, Versions>> {
        // A poisoned lock only means another thread panicked mid-update of plain maps; the
        // maps are still consistent (every update is a single insert/remove).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores `tensor` as the next version of `name` and returns that version (1, 2, ...).
    pub fn insert(&self, name: TensorName, tensor: Tensor) -> u64 {
        let mut map = self.lock();
        let versions = map.entry(name).or_default();
        versions.next += 1;
        let version = versions.next;
        versions.held.insert(version, tensor);
        while versions.held.len() > self.keep_versions {
            versions.held.pop_first();
        }
        version
    }

    /// The given version of `name`, or the newest when `version` is `None`.
    pub fn get(&self, name: &TensorName, version: Option<u64>) -> Lookup {
        let map = self.lock();
        let Some(versions) = map.get(name) else {
            return Lookup::Missing;
        };
        let found = match version {
            None => versions.held.last_key_value(),
            Some(v) => versions.held.get_key_value(&v),
        };
        match (found, version) {
            (Some((v, t)), _) => Lookup::Found(*v, t.clone()),
            (None, Some(v)) if v >= 1 && v <= versions.next => Lookup::Evicted {
                oldest: versions.held.first_key_value().map_or(0, |(k, _)| *k),
            },
            _ => Lookup::Missing,
        }
    }

    /// Number of tensors (all versions) and their total bytes.
    pub fn usage(&self) -> (usize, u64) {
        let map = self.lock();
        map.values()
            .flat_map(|v| v.held.values())
            .fold((0, 0), |(n, b), t| (n + 1, b + t.byte_len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    #[test]
    fn versions_increase_and_old_ones_are_evicted() {
        let store = Store::new(2);
        let n = name("model/w");
        for i in 1..=3u8 {
            assert_eq!(
                store.insert(n.clone(), Tensor::from_bytes(vec![i; 4])),
                u64::from(i)
            );
        }
        match store.get(&n, None) {
            Lookup::Found(3, t) => assert_eq!(t.data().as_ref(), &[3u8; 4]),
            other => panic!("{other:?}"),
        }
        assert!(matches!(store.get(&n, Some(2)), Lookup::Found(2, _)));
        assert!(matches!(
            store.get(&n, Some(1)),
            Lookup::Evicted { oldest: 2 }
        ));
        assert!(matches!(store.get(&n, Some(9)), Lookup::Missing));
        assert!(matches!(store.get(&name("other"), None), Lookup::Missing));
        assert_eq!(store.usage(), (2, 8));
    }
}
