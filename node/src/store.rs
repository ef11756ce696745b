//! [`Store`]: the tensors this node holds and serves, by name and version.
//!
//! In memory for now. A version is stored whole (the tensor is complete and verified before it
//! goes in), so a reader never sees part of one. Versions come from the node itself
//! ([`Store::insert`], the next one per name) or from the cluster ([`Store::insert_at`], the
//! version a broker assigned). [`Retention`] decides what stays: the newest `keep_versions` per
//! name (overridable per name pattern) and, optionally, nothing older than a TTL. A store made
//! with an eviction sink reports every version retention drops, so the cluster client can tell
//! the brokers; the report is queued without blocking, never sent under the store's lock.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use tb_proto::{NamePattern, TensorName};
use tokio::sync::mpsc::UnboundedSender;

use crate::tensor::Tensor;

/// What a look-up found.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// The tensor at this version.
    Found(u64, Tensor),
    /// The name was never held, or the version is unknown.
    Missing,
    /// That version was evicted by retention (or is older than one that was: versions the
    /// cluster assigned may never have been held here).
    Evicted {
        /// Oldest version still held (0: none).
        oldest: u64,
    },
}

/// What [`Store::insert_at`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// The version is now held (new, or replacing different bytes under that number).
    Stored,
    /// The same bytes were already held under that version: nothing changed.
    AlreadyHeld,
    /// Older than every version retention keeps for the name: not stored.
    TooOld,
}

/// Which versions a store keeps.
#[derive(Debug, Clone)]
pub struct Retention {
    /// Newest versions kept per name (at least 1).
    pub keep_versions: usize,
    /// Per-name overrides: the first pattern that matches a name sets its count.
    pub keep_versions_for: Vec<(NamePattern, usize)>,
    /// Versions held longer than this are evicted by [`Store::expire`], the newest included.
    pub ttl: Option<Duration>,
}

impl Retention {
    /// Keeps the newest `keep_versions` of every name, with no overrides and no TTL.
    pub fn versions(keep_versions: usize) -> Self {
        Retention {
            keep_versions,
            keep_versions_for: Vec::new(),
            ttl: None,
        }
    }

    /// How many versions of `name` are kept (at least 1).
    pub fn keep_for(&self, name: &TensorName) -> usize {
        self.keep_versions_for
            .iter()
            .find(|(pattern, _)| pattern.matches(name))
            .map_or(self.keep_versions, |(_, keep)| *keep)
            .max(1)
    }
}

/// A version retention dropped, reported to the eviction sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Evicted {
    pub(crate) name: TensorName,
    pub(crate) version: u64,
}

#[derive(Debug)]
struct Held {
    tensor: Tensor,
    since: Instant,
}

#[derive(Debug, Default)]
struct Versions {
    /// Highest version ever held.
    next: u64,
    /// Highest version retention evicted.
    evicted_upto: u64,
    /// This name's own count of versions to keep ([`Store::set_keep`]), over the retention's.
    keep: Option<usize>,
    held: BTreeMap<u64, Held>,
}

impl Versions {
    /// Drops the oldest versions beyond `keep`, noting them in `out`.
    fn trim(&mut self, name: &TensorName, keep: usize, out: &mut Vec<Evicted>) {
        while self.held.len() > keep {
            let Some((version, _)) = self.held.pop_first() else {
                break;
            };
            self.note_evicted(name, version, out);
        }
    }

    fn note_evicted(&mut self, name: &TensorName, version: u64, out: &mut Vec<Evicted>) {
        self.evicted_upto = self.evicted_upto.max(version);
        out.push(Evicted {
            name: name.clone(),
            version,
        });
    }
}

/// Shared handle to the node's tensors. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<Mutex<HashMap<TensorName, Versions>>>,
    retention: Arc<Retention>,
    evictions: Option<UnboundedSender<Evicted>>,
}

impl Store {
    /// An empty store keeping the newest `keep_versions` (at least 1) versions per name.
    pub fn new(keep_versions: usize) -> Self {
        Store::with_retention(Retention::versions(keep_versions))
    }

    /// An empty store keeping what `retention` says.
    pub fn with_retention(retention: Retention) -> Self {
        Store {
            inner: Arc::default(),
            retention: Arc::new(retention),
            evictions: None,
        }
    }

    /// An empty store that also reports every version retention evicts to `sink`.
    pub(crate) fn with_eviction_sink(retention: Retention, sink: UnboundedSender<Evicted>) -> Self {
        Store {
            evictions: Some(sink),
            ..Store::with_retention(retention)
        }
    }

    /// What this store keeps.
    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TensorName, Versions>> {
        // A poisoned lock only means another thread panicked mid-update of plain maps; the
        // maps are still consistent (every update is a single insert/remove).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues eviction reports; called after the lock is released.
    fn report(&self, evicted: Vec<Evicted>) {
        if let Some(sink) = &self.evictions {
            for e in evicted {
                // The receiver is gone only while the node shuts down: nobody to tell.
                let _ = sink.send(e);
            }
        }
    }

    /// Stores `tensor` as the next version of `name` and returns that version (1, 2, ...).
    pub fn insert(&self, name: TensorName, tensor: Tensor) -> u64 {
        let keep = self.retention.keep_for(&name);
        let mut evicted = Vec::new();
        let version = {
            let mut map = self.lock();
            let versions = map.entry(name.clone()).or_default();
            let keep = versions.keep.unwrap_or(keep);
            versions.next += 1;
            let version = versions.next;
            let since = Instant::now();
            versions.held.insert(version, Held { tensor, since });
            versions.trim(&name, keep, &mut evicted);
            version
        };
        self.report(evicted);
        version
    }

    /// Stores `tensor` as `version` of `name` (a version the cluster assigned), evicting what
    /// retention no longer keeps. Different bytes already held under that number are replaced.
    pub fn insert_at(&self, name: TensorName, version: u64, tensor: Tensor) -> Inserted {
        let keep = self.retention.keep_for(&name);
        let mut evicted = Vec::new();
        let inserted = {
            let mut map = self.lock();
            let versions = map.entry(name.clone()).or_default();
            let keep = versions.keep.unwrap_or(keep);
            let oldest = versions.held.first_key_value().map(|(v, _)| *v);
            match versions.held.get(&version) {
                Some(held) if held.tensor.hash() == tensor.hash() => Inserted::AlreadyHeld,
                None if versions.held.len() >= keep && oldest.is_some_and(|o| version < o) => {
                    Inserted::TooOld
                }
                _ => {
                    versions.next = versions.next.max(version);
                    let since = Instant::now();
                    versions.held.insert(version, Held { tensor, since });
                    versions.trim(&name, keep, &mut evicted);
                    Inserted::Stored
                }
            }
        };
        self.report(evicted);
        inserted
    }

    /// Keeps the newest `keep` (at least 1) versions of `name` from now on, whatever the
    /// retention says; older ones go at the next insert.
    pub fn set_keep(&self, name: &TensorName, keep: usize) {
        self.lock().entry(name.clone()).or_default().keep = Some(keep.max(1));
    }

    /// Forgets `version` of `name` without reporting it (it was never announced); true if it
    /// was held.
    pub(crate) fn remove(&self, name: &TensorName, version: u64) -> bool {
        let mut map = self.lock();
        map.get_mut(name)
            .is_some_and(|v| v.held.remove(&version).is_some())
    }

    /// The highest version of `name` this store ever held (0: none), evicted or deleted
    /// since or not.
    pub(crate) fn highest_ever(&self, name: &TensorName) -> u64 {
        self.lock().get(name).map_or(0, |v| v.next)
    }

    /// Forgets every version of `name` without reporting them (the name was deleted).
    pub(crate) fn remove_name(&self, name: &TensorName) {
        if let Some(versions) = self.lock().get_mut(name) {
            versions.held.clear();
        }
    }

    /// Evicts every version held longer than the TTL at `now` (nothing without a TTL);
    /// returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let Some(ttl) = self.retention.ttl else {
            return 0;
        };
        let mut evicted = Vec::new();
        {
            let mut map = self.lock();
            for (name, versions) in map.iter_mut() {
                let old: Vec<u64> = versions
                    .held
                    .iter()
                    .filter(|(_, h)| now.saturating_duration_since(h.since) >= ttl)
                    .map(|(v, _)| *v)
                    .collect();
                for version in old {
                    versions.held.remove(&version);
                    versions.note_evicted(name, version, &mut evicted);
                }
            }
        }
        let count = evicted.len();
        self.report(evicted);
        count
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
            (Some((v, held)), _) => Lookup::Found(*v, held.tensor.clone()),
            (None, Some(v)) if v >= 1 && v <= versions.evicted_upto => Lookup::Evicted {
                oldest: versions.held.first_key_value().map_or(0, |(k, _)| *k),
            },
            _ => Lookup::Missing,
        }
    }

    /// The versions of `name` held now, oldest first.
    pub fn held_versions(&self, name: &TensorName) -> Vec<u64> {
        let map = self.lock();
        map.get(name)
            .map(|v| v.held.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Number of tensors (all versions) and their total bytes.
    pub fn usage(&self) -> (usize, u64) {
        let map = self.lock();
        map.values()
            .flat_map(|v| v.held.values())
            .fold((0, 0), |(n, b), h| (n + 1, b + h.tensor.byte_len()))
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    fn tensor(byte: u8) -> Tensor {
        Tensor::from_bytes(vec![byte; 4])
    }

    fn drained(rx: &mut mpsc::UnboundedReceiver<Evicted>) -> Vec<u64> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|e| e.version)
            .collect()
    }

    #[test]
    fn versions_increase_and_old_ones_are_evicted() {
        let store = Store::new(2);
        let n = name("model/w");
        for i in 1..=3u8 {
            assert_eq!(store.insert(n.clone(), tensor(i)), u64::from(i));
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

    #[test]
    fn set_keep_overrides_the_retention_for_one_name() {
        let store = Store::new(2);
        let (kept, other) = (name("bench/x"), name("bench/y"));
        store.set_keep(&kept, 5);
        for i in 1..=6u8 {
            store.insert(kept.clone(), tensor(i));
            store.insert(other.clone(), tensor(i));
        }
        assert_eq!(store.held_versions(&kept), vec![2, 3, 4, 5, 6]);
        assert_eq!(store.held_versions(&other), vec![5, 6]);
        store.set_keep(&kept, 0);
        store.insert(kept.clone(), tensor(7));
        assert_eq!(store.held_versions(&kept), vec![7]);
    }

    #[test]
    fn insert_at_keeps_assigned_versions_and_reports_evictions() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let store = Store::with_eviction_sink(Retention::versions(2), tx);
        let n = name("m/w");
        assert_eq!(store.insert_at(n.clone(), 5, tensor(5)), Inserted::Stored);
        assert_eq!(
            store.insert_at(n.clone(), 5, tensor(5)),
            Inserted::AlreadyHeld
        );
        assert_eq!(store.insert_at(n.clone(), 9, tensor(9)), Inserted::Stored);
        assert!(drained(&mut rx).is_empty());
        assert_eq!(store.insert_at(n.clone(), 3, tensor(3)), Inserted::TooOld);
        assert_eq!(store.insert_at(n.clone(), 7, tensor(7)), Inserted::Stored);
        assert_eq!(drained(&mut rx), [5]);
        assert_eq!(store.held_versions(&n), [7, 9]);
        // Local publishes continue after the highest version held.
        assert_eq!(store.insert(n.clone(), tensor(10)), 10);
        assert_eq!(drained(&mut rx), [7]);
        // A version never held, newer than every evicted one, is missing, not evicted.
        assert!(matches!(store.get(&n, Some(8)), Lookup::Missing));
        assert!(matches!(
            store.get(&n, Some(5)),
            Lookup::Evicted { oldest: 9 }
        ));
        // Different bytes under a held number replace it.
        assert_eq!(store.insert_at(n.clone(), 10, tensor(1)), Inserted::Stored);
        match store.get(&n, Some(10)) {
            Lookup::Found(10, t) => assert_eq!(t.data().as_ref(), &[1u8; 4]),
            other => panic!("{other:?}"),
        }
        assert!(store.remove(&n, 10));
        assert!(!store.remove(&n, 10));
        assert!(drained(&mut rx).is_empty(), "removal is not eviction");
    }

    #[test]
    fn per_name_overrides_and_ttl() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let retention = Retention {
            keep_versions: 2,
            keep_versions_for: vec![
                ("ckpt/*".parse().expect("pattern"), 4),
                ("act/*".parse().expect("pattern"), 0),
            ],
            ttl: Some(Duration::from_secs(60)),
        };
        let store = Store::with_eviction_sink(retention, tx);
        let (ckpt, act, other) = (name("ckpt/a"), name("act/a"), name("w"));
        for i in 1..=5 {
            store.insert(ckpt.clone(), tensor(i));
            store.insert(act.clone(), tensor(i));
            store.insert(other.clone(), tensor(i));
        }
        assert_eq!(store.held_versions(&ckpt), [2, 3, 4, 5]);
        assert_eq!(store.held_versions(&act), [5], "0 counts as 1");
        assert_eq!(store.held_versions(&other), [4, 5]);
        assert_eq!(drained(&mut rx).len(), 1 + 4 + 3);
        assert_eq!(store.expire(Instant::now()), 0);
        assert_eq!(store.expire(Instant::now() + Duration::from_secs(61)), 7);
        assert_eq!(store.usage(), (0, 0));
        assert_eq!(drained(&mut rx).len(), 7);
        assert!(matches!(
            store.get(&other, Some(5)),
            Lookup::Evicted { oldest: 0 }
        ));
        assert_eq!(
            Store::new(2).expire(Instant::now() + Duration::from_secs(1 << 20)),
            0
        );
    }
}
