//! [`RegistryStore`]: the broker's registry replica on disk, in sled.
//!
//! Three trees: `entries` (key: the name's bytes, value: the postcard [`Entry`], tombstones
//! and placeholders included, so a delete survives a restart), `members` (key: the 32-byte node
//! id, value: the postcard [`Member`]) and `meta` (the store's format version, and this
//! broker's epoch counter).
//!
//! [`save_changed`](RegistryStore::save_changed) hands its batch to the store's writer
//! thread: the broker actor never waits for sled (whose writes now and then stop for a
//! segment rotation, hundreds of microseconds on a small VM, in every publish's answer).
//! Batches are applied in order; [`flush`](RegistryStore::flush) first waits for those
//! already handed over.
//!
//! Writes reach the disk when sled flushes (every half second by default) or on
//! [`flush`](RegistryStore::flush). A crash can lose the last writes; anti-entropy with the
//! other brokers brings them back, and a broker alone loses at most what its workers announce
//! again. What cannot be decoded or validated on load is skipped with a warning, never trusted.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use tb_proto::{Entry, Member, NodeId, Registry, TensorName};

/// The on-disk format this code reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// How long [`RegistryStore::open`] waits for the database lock. sled finishes background
/// writes after its last handle is dropped, so a store just closed in this process (a broker
/// restarted in place) keeps its lock for a moment; another process holding it is refused
/// after this long.
pub const LOCK_WAIT: Duration = Duration::from_secs(5);

/// Pause between attempts to take the lock.
const LOCK_RETRY: Duration = Duration::from_millis(25);

const FORMAT_KEY: &str = "format";
const EPOCH_KEY: &str = "epoch";

/// Why the registry store failed.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The database could not be opened (in use by another process, unreadable, ...).
    #[error("registry store {}: {source}", path.display())]
    Open {
        /// Its directory.
        path: PathBuf,
        /// What sled said.
        source: sled::Error,
    },
    /// A read or write failed.
    #[error("registry store: {0}")]
    Sled(#[from] sled::Error),
    /// A value could not be encoded.
    #[error("registry store: cannot encode {what}: {source}")]
    Encode {
        /// What was being written.
        what: String,
        /// What postcard said.
        source: postcard::Error,
    },
    /// The store was written in another format.
    #[error("registry store is format v{found}; this broker reads v{FORMAT_VERSION}")]
    Format {
        /// The format found.
        found: u32,
    },
    /// The writer thread is gone (it panicked).
    #[error("registry store: the writer thread is gone")]
    WriterGone,
    /// A value in the `meta` tree is not what this code wrote.
    #[error("registry store: meta key \"{key}\" is corrupt")]
    CorruptMeta {
        /// The key.
        key: &'static str,
    },
}

/// The registry replica in a sled database.
#[derive(Debug, Clone)]
pub struct RegistryStore {
    db: sled::Db,
    entries: sled::Tree,
    members: sled::Tree,
    meta: sled::Tree,
    /// The writer thread's queue (it ends when the last clone of the store is dropped).
    writer: std::sync::Arc<Writer>,
    /// Tests close it to hold flushes up (a slow disk).
    #[cfg(test)]
    pub(crate) gate: std::sync::Arc<test_gate::FlushGate>,
}

impl RegistryStore {
    /// Opens (or creates) the store in the directory `dir` (the broker uses
    /// `<data dir>/registry`), checking its format. Blocks up to [`LOCK_WAIT`] while the
    /// database is locked.
    pub fn open(dir: &Path) -> Result<Self, PersistError> {
        Self::open_waiting(dir, LOCK_WAIT)
    }

    /// [`open`](Self::open), waiting up to `lock_wait` for the database lock.
    pub fn open_waiting(dir: &Path, lock_wait: Duration) -> Result<Self, PersistError> {
        let db = open_db(dir, lock_wait).map_err(|source| PersistError::Open {
            path: dir.to_path_buf(),
            source,
        })?;
        let entries = db.open_tree("entries")?;
        let members = db.open_tree("members")?;
        let writer = std::sync::Arc::new(spawn_writer(entries.clone(), members.clone())?);
        let store = RegistryStore {
            entries,
            members,
            meta: db.open_tree("meta")?,
            writer,
            db,
            #[cfg(test)]
            gate: Default::default(),
        };
        match store.meta.get(FORMAT_KEY)? {
            None => {
                store
                    .meta
                    .insert(FORMAT_KEY, &FORMAT_VERSION.to_be_bytes())?;
            }
            Some(bytes) => {
                let found = <[u8; 4]>::try_from(bytes.as_ref())
                    .map(u32::from_be_bytes)
                    .map_err(|_| PersistError::CorruptMeta { key: FORMAT_KEY })?;
                if found != FORMAT_VERSION {
                    return Err(PersistError::Format { found });
                }
            }
        }
        Ok(store)
    }

    /// Reads the stored registry. Entries and rows that fail to decode or validate (against
    /// `max_tensor_bytes`) are skipped with a warning naming their key.
    pub fn load(&self, max_tensor_bytes: u64) -> Result<Registry, PersistError> {
        self.drain()?;
        let mut registry = Registry::new();
        for kv in self.entries.iter() {
            let (key, value) = kv?;
            match decode_entry(&key, &value, max_tensor_bytes) {
                Ok((name, entry)) => {
                    registry.merge_entry(&name, &entry);
                }
                Err(error) => tracing::warn!(
                    key = %String::from_utf8_lossy(&key),
                    %error,
                    "registry store: skipped an entry"
                ),
            }
        }
        for kv in self.members.iter() {
            let (key, value) = kv?;
            match decode_member(&key, &value) {
                Ok(member) => {
                    registry.merge_member(&member);
                }
                Err(error) => tracing::warn!(
                    key = %hex::encode(&key),
                    %error,
                    "registry store: skipped a member row"
                ),
            }
        }
        Ok(registry)
    }

    /// Writes `name`'s entry.
    pub fn save_entry(&self, name: &TensorName, entry: &Entry) -> Result<(), PersistError> {
        self.entries.insert(
            name.as_str(),
            encode(entry, || format!("tensor \"{name}\""))?,
        )?;
        Ok(())
    }

    /// Writes a membership row.
    pub fn save_member(&self, member: &Member) -> Result<(), PersistError> {
        let value = encode(member, || format!("member {}", member.node))?;
        self.members.insert(member.node.0, value)?;
        Ok(())
    }

    /// Writes the entries of `names` and the rows of `nodes` as `registry` holds them now (the
    /// `names` and `members` of a [`Changes`](crate::Changes)): encoded here, applied by the
    /// writer thread in the order given. A row `registry` no longer has (forgotten: see
    /// [`Registry::forget`]) is deleted.
    pub fn save_changed(
        &self,
        registry: &Registry,
        names: &[TensorName],
        nodes: &[NodeId],
    ) -> Result<(), PersistError> {
        let mut entries = Vec::with_capacity(names.len());
        for (name, entry) in registry.entries_for(names) {
            let value = encode(&entry, || format!("tensor \"{name}\""))?;
            entries.push((
                sled::IVec::from(name.as_str()),
                Some(sled::IVec::from(value)),
            ));
        }
        let mut members = Vec::with_capacity(nodes.len());
        for node in nodes {
            let value = match registry.member(node) {
                Some(member) => Some(sled::IVec::from(encode(member, || {
                    format!("member {node}")
                })?)),
                None => None,
            };
            members.push((sled::IVec::from(&node.0[..]), value));
        }
        self.writer.send(Write::Changes { entries, members })
    }

    /// Waits until the writer thread applied every batch handed to it so far, and returns
    /// the first error it met since the last wait.
    fn drain(&self) -> Result<(), PersistError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.writer.send(Write::Drained(tx))?;
        rx.recv().map_err(|_| PersistError::WriterGone)?
    }

    /// Counts one more start of this broker and returns the new epoch (1 on the first start),
    /// flushed to disk before it is returned: an epoch is never handed out twice.
    pub fn bump_epoch(&self) -> Result<u64, PersistError> {
        let old = match self.meta.get(EPOCH_KEY)? {
            None => 0,
            Some(bytes) => <[u8; 8]>::try_from(bytes.as_ref())
                .map(u64::from_be_bytes)
                .map_err(|_| PersistError::CorruptMeta { key: EPOCH_KEY })?,
        };
        let epoch = old
            .checked_add(1)
            .ok_or(PersistError::CorruptMeta { key: EPOCH_KEY })?;
        self.meta.insert(EPOCH_KEY, &epoch.to_be_bytes())?;
        self.flush()?;
        Ok(epoch)
    }

    /// Writes everything to disk now, batches handed to the writer included.
    pub fn flush(&self) -> Result<(), PersistError> {
        #[cfg(test)]
        self.gate.pass();
        self.drain()?;
        self.db.flush()?;
        Ok(())
    }
}

/// A key and its new value (`None`: delete it).
type KeyChange = (sled::IVec, Option<sled::IVec>);

/// How long the writer gathers changes after the first one before it applies them together:
/// a name published a thousand times a second is written to sled ~200 times, its latest entry
/// each time, not a thousand, and the thread wakes once per batch, not per publish. A flush
/// does not wait for it.
const GATHER: Duration = Duration::from_millis(5);

/// What the writer thread is asked.
enum Write {
    /// Write these keys, in this order.
    Changes {
        entries: Vec<KeyChange>,
        members: Vec<KeyChange>,
    },
    /// Answer once everything before is applied (with the first error since the last answer).
    Drained(std::sync::mpsc::SyncSender<Result<(), PersistError>>),
}

impl std::fmt::Debug for Write {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Write::Changes { .. } => "Changes",
            Write::Drained(_) => "Drained",
        })
    }
}

/// The writer thread's queue. A change wakes the thread only when the queue was empty (the
/// first of a batch) and a drain always: the changes that follow within [`GATHER`] join the
/// batch without a wake-up each (a thread switch per publish, on a busy broker's cores).
#[derive(Debug, Default)]
struct WriteQueue {
    state: std::sync::Mutex<Queued>,
    woken: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Queued {
    writes: Vec<Write>,
    /// Every [`Writer`] is gone: apply what is queued and end.
    closed: bool,
    /// The thread is gone (it panicked): nothing more is queued.
    dead: bool,
}

impl WriteQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `write`; false when the thread is gone (the write is dropped, so a drain's
    /// answer never comes and its waiter sees the sender gone).
    fn push(&self, write: Write) -> bool {
        let mut queued = self.lock();
        if queued.dead {
            return false;
        }
        let wake = queued.writes.is_empty() || matches!(write, Write::Drained(_));
        queued.writes.push(write);
        drop(queued);
        if wake {
            self.woken.notify_one();
        }
        true
    }

    /// The next batch: waits for a first write, then up to [`GATHER`] more for others (less
    /// when a drain is asked). `None` once closed and empty.
    fn next_batch(&self) -> Option<Vec<Write>> {
        let mut queued = self.lock();
        while queued.writes.is_empty() {
            if queued.closed {
                return None;
            }
            queued = self.woken.wait(queued).unwrap_or_else(|p| p.into_inner());
        }
        let until = Instant::now() + GATHER;
        loop {
            let drain = queued.writes.iter().any(|w| matches!(w, Write::Drained(_)));
            let left = until.saturating_duration_since(Instant::now());
            if drain || queued.closed || left.is_zero() {
                return Some(std::mem::take(&mut queued.writes));
            }
            queued = self
                .woken
                .wait_timeout(queued, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The stores' handle on the writer thread: dropping the last one (with the last clone of
/// the store) lets the thread apply what is queued and end.
#[derive(Debug)]
struct Writer(std::sync::Arc<WriteQueue>);

impl Writer {
    fn send(&self, write: Write) -> Result<(), PersistError> {
        match self.0.push(write) {
            true => Ok(()),
            false => Err(PersistError::WriterGone),
        }
    }
}

/// Held by the writer thread: when it ends (or unwinds), the queue refuses new writes and
/// drops those left, so no drain waits for it forever.
struct Dead(std::sync::Arc<WriteQueue>);

impl Drop for Dead {
    fn drop(&mut self) {
        let mut queued = self.0.lock();
        queued.dead = true;
        queued.writes.clear();
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.woken.notify_one();
    }
}

/// Starts the thread that applies [`RegistryStore::save_changed`]'s batches in order; it
/// ends when the last [`Writer`] is dropped.
fn spawn_writer(entries: sled::Tree, members: sled::Tree) -> Result<Writer, PersistError> {
    let queue = std::sync::Arc::new(WriteQueue::default());
    let theirs = queue.clone();
    std::thread::Builder::new()
        .name("registry-writer".into())
        .spawn(move || {
            let queue = Dead(theirs);
            let mut failed: Option<PersistError> = None;
            while let Some(writes) = queue.0.next_batch() {
                // The latest value of each key, one sled batch per tree, applied before each
                // drain in the batch is answered.
                let mut gathered = Gathered::default();
                for write in writes {
                    match write {
                        Write::Changes {
                            entries: e,
                            members: m,
                        } => {
                            gathered.entries.extend(e);
                            gathered.members.extend(m);
                        }
                        Write::Drained(answer) => {
                            gathered.apply(&entries, &members, &mut failed);
                            let _ = answer.send(failed.take().map_or(Ok(()), Err));
                        }
                    }
                }
                gathered.apply(&entries, &members, &mut failed);
            }
        })
        .map_err(|e| PersistError::Sled(sled::Error::Io(e)))?;
    Ok(Writer(queue))
}

/// Changes gathered by the writer: the latest value of each key, applied key by key. Not
/// as a `sled::Batch`: sled writes out and syncs (`sync_file_range`, waiting) every batch
/// as it is applied, two writes per batch (the batch and its marker), where single
/// inserts wait in sled's buffer for its flush. Keys are independent records (a name's
/// entry, a member's row), so nothing needs two of them to land together.
#[derive(Default)]
struct Gathered {
    entries: BTreeMap<sled::IVec, Option<sled::IVec>>,
    members: BTreeMap<sled::IVec, Option<sled::IVec>>,
}

impl Gathered {
    /// Applies and clears what was gathered; the first failure is kept in `failed`.
    fn apply(
        &mut self,
        entries: &sled::Tree,
        members: &sled::Tree,
        failed: &mut Option<PersistError>,
    ) {
        if self.entries.is_empty() && self.members.is_empty() {
            return;
        }
        let applied = apply(entries, std::mem::take(&mut self.entries))
            .and_then(|()| apply(members, std::mem::take(&mut self.members)));
        if let Err(e) = applied {
            tracing::warn!(%e, "persisting registry changes (anti-entropy will repair a restart)");
            failed.get_or_insert(e.into());
        }
    }
}

/// Writes `changes` into `tree` one key at a time (see [`Gathered`]).
fn apply(tree: &sled::Tree, changes: BTreeMap<sled::IVec, Option<sled::IVec>>) -> sled::Result<()> {
    for (key, value) in changes {
        match value {
            Some(value) => tree.insert(key, value).map(drop)?,
            None => tree.remove(key).map(drop)?,
        }
    }
    Ok(())
}

/// A gate tests close to make flushes wait, as on a disk that takes its time to sync.
#[cfg(test)]
pub(crate) mod test_gate {
    use std::{
        sync::{
            Condvar, Mutex,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    /// Longest a flush waits at a closed gate (a failing test must not hang).
    const MAX_HOLD: Duration = Duration::from_secs(60);

    /// Flushes that reached the gate, and whether it is closed.
    #[derive(Debug, Default)]
    pub(crate) struct FlushGate {
        closed: Mutex<bool>,
        opened: Condvar,
        pub(crate) arrived: AtomicUsize,
    }

    impl FlushGate {
        /// Makes flushes wait until [`open`](Self::open).
        pub(crate) fn close(&self) {
            *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        }

        /// Lets flushes through.
        pub(crate) fn open(&self) {
            *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = false;
            self.opened.notify_all();
        }

        /// Counts a flush and waits while the gate is closed.
        pub(super) fn pass(&self) {
            self.arrived.fetch_add(1, Ordering::SeqCst);
            let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
            let _ = self
                .opened
                .wait_timeout_while(closed, MAX_HOLD, |closed| *closed);
        }
    }
}

/// Opens the database in `dir`, retrying for up to `lock_wait` while it is locked.
fn open_db(dir: &Path, lock_wait: Duration) -> sled::Result<sled::Db> {
    let deadline = Instant::now() + lock_wait;
    loop {
        match sled::open(dir) {
            // sled reports a held lock only in the message of an `Other` I/O error.
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(LOCK_RETRY);
            }
            result => return result,
        }
    }
}

/// Why one stored value was skipped.
#[derive(Debug, thiserror::Error)]
enum Skip {
    #[error("key is not a valid name")]
    Name,
    #[error("key is not a 32-byte node id")]
    NodeKey,
    #[error("row is for node {0}, not its key's")]
    NodeMismatch(NodeId),
    #[error("undecodable: {0}")]
    Decode(#[from] postcard::Error),
    #[error("invalid: {0}")]
    Invalid(#[from] tb_proto::RegistryError),
}

fn decode_entry(key: &[u8], value: &[u8], max: u64) -> Result<(TensorName, Entry), Skip> {
    let name = std::str::from_utf8(key)
        .ok()
        .and_then(|s| TensorName::new(s).ok())
        .ok_or(Skip::Name)?;
    let entry: Entry = postcard::from_bytes(value)?;
    entry.validate(&name, max)?;
    Ok((name, entry))
}

fn decode_member(key: &[u8], value: &[u8]) -> Result<Member, Skip> {
    let node = NodeId(<[u8; 32]>::try_from(key).map_err(|_| Skip::NodeKey)?);
    let member: Member = postcard::from_bytes(value)?;
    if member.node != node {
        return Err(Skip::NodeMismatch(member.node));
    }
    member.validate()?;
    Ok(member)
}

fn encode<T: serde::Serialize>(
    value: &T,
    what: impl FnOnce() -> String,
) -> Result<Vec<u8>, PersistError> {
    postcard::to_allocvec(value).map_err(|source| PersistError::Encode {
        what: what(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use tb_proto::{ContentHash, DType, RegistryOp, Role, Stamp, TensorMeta};

    use super::*;

    const MAX: u64 = 1 << 30;

    fn stamp(wall_ms: u64) -> Stamp {
        Stamp {
            wall_ms,
            logical: 0,
            node: NodeId([9; 32]),
        }
    }

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    fn sample() -> Registry {
        let mut r = Registry::new();
        let meta = TensorMeta::new(DType::F32, vec![2, 3], ContentHash([7; 32])).expect("meta");
        for (i, n) in ["m/a", "m/b", "gone"].iter().enumerate() {
            r.apply(&RegistryOp::Publish {
                name: name(n),
                version: 3,
                meta: meta.clone(),
                publisher: NodeId([1; 32]),
                stamp: stamp(10 + i as u64),
            });
            r.apply(&RegistryOp::AddHolder {
                name: name(n),
                version: 3,
                node: NodeId([1; 32]),
                stamp: stamp(20),
            });
        }
        r.apply(&RegistryOp::Delete {
            name: name("gone"),
            stamp: stamp(30),
        });
        // A holder mark that arrived before its publish: a placeholder entry.
        r.apply(&RegistryOp::AddHolder {
            name: name("early"),
            version: 1,
            node: NodeId([2; 32]),
            stamp: stamp(40),
        });
        r.apply(&RegistryOp::Member(Member {
            node: NodeId([1; 32]),
            role: Role::Worker,
            addrs: vec!["127.0.0.1:1".into()],
            epoch: 4,
            alive: true,
            stamp: stamp(50),
        }));
        r
    }

    fn all_names(r: &Registry) -> Vec<TensorName> {
        r.digest().into_keys().collect()
    }

    fn all_nodes(r: &Registry) -> Vec<NodeId> {
        r.members().map(|m| m.node).collect()
    }

    #[test]
    fn registry_survives_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = sample();
        {
            let store = RegistryStore::open(dir.path()).expect("open");
            store
                .save_changed(&r, &all_names(&r), &all_nodes(&r))
                .expect("save");
            store.flush().expect("flush");
        }
        let store = RegistryStore::open(dir.path()).expect("reopen");
        let loaded = store.load(MAX).expect("load");
        assert_eq!(loaded, r);
        assert!(loaded.entry(&name("gone")).is_none(), "tombstone kept");
    }

    #[test]
    fn changes_gathered_together_keep_the_latest_value_of_each_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RegistryStore::open(dir.path()).expect("open");
        let mut r = sample();
        let meta = TensorMeta::new(DType::U8, vec![4], ContentHash([9; 32])).expect("meta");
        // Many versions of one name in quick succession (gathered into few batches), then the
        // member's row forgotten after it was saved: the store ends as the registry does.
        store
            .save_changed(&r, &all_names(&r), &all_nodes(&r))
            .expect("save");
        for version in 4..200 {
            r.apply(&RegistryOp::Publish {
                name: name("m/a"),
                version,
                meta: meta.clone(),
                publisher: NodeId([1; 32]),
                stamp: stamp(100 + version),
            });
            store.save_changed(&r, &[name("m/a")], &[]).expect("save");
        }
        store.flush().expect("flush");
        assert_eq!(store.load(MAX).expect("load"), r);
        let mut forgotten = Registry::new();
        for n in all_names(&r) {
            let entries = r.entries_for([&n]);
            forgotten.merge_entry(&n, &entries[0].1);
        }
        store
            .save_changed(&forgotten, &[], &[NodeId([1; 32])])
            .expect("save");
        store.flush().expect("flush");
        let loaded = store.load(MAX).expect("load");
        assert_eq!(loaded.members().count(), 0, "the deleted row stays deleted");
        assert_eq!(loaded.entry(&name("m/a")), r.entry(&name("m/a")));
    }

    #[test]
    fn changes_queued_when_the_last_clone_drops_are_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = sample();
        {
            let store = RegistryStore::open(dir.path()).expect("open");
            let other = store.clone();
            store.save_changed(&r, &all_names(&r), &[]).expect("save");
            drop(store);
            // The writer still runs for the clone left, and then writes what is queued.
            other.save_changed(&r, &[], &all_nodes(&r)).expect("save");
        }
        let store = RegistryStore::open(dir.path()).expect("reopen");
        assert_eq!(store.load(MAX).expect("load"), r);
    }

    #[test]
    fn single_saves_overwrite() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RegistryStore::open(dir.path()).expect("open");
        let mut r = sample();
        for n in all_names(&r) {
            let entries = r.entries_for([&n]);
            store.save_entry(&n, &entries[0].1).expect("save");
        }
        r.apply(&RegistryOp::Delete {
            name: name("m/a"),
            stamp: stamp(60),
        });
        store
            .save_entry(&name("m/a"), &r.entries_for([&name("m/a")])[0].1)
            .expect("save");
        for m in r.members() {
            store.save_member(m).expect("save");
        }
        assert_eq!(store.load(MAX).expect("load"), r);
    }

    #[test]
    fn corrupt_and_invalid_values_are_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RegistryStore::open(dir.path()).expect("open");
        let r = sample();
        store
            .save_changed(&r, &all_names(&r), &all_nodes(&r))
            .expect("save");
        // The writer has applied the batch: the garbage below replaces it.
        store.drain().expect("drain");
        store
            .entries
            .insert("m/a", &[0xff, 0xff, 0xff][..])
            .expect("garbage");
        store
            .entries
            .insert("bad name!", &[0u8][..])
            .expect("bad key");
        store.members.insert([3u8; 5], &[0u8][..]).expect("bad key");
        // A row stored under another node's key.
        let m = r.members().next().expect("row").clone();
        store
            .members
            .insert([8u8; 32], postcard::to_allocvec(&m).expect("encode"))
            .expect("moved row");

        let loaded = store.load(MAX).expect("load");
        assert!(loaded.entry(&name("m/a")).is_none());
        assert!(loaded.entry(&name("m/b")).is_some());
        assert_eq!(loaded.members().count(), 1);
        // Metadata over this broker's size limit is refused too.
        let small = store.load(4).expect("load");
        assert!(small.entry(&name("m/b")).is_none());
    }

    #[test]
    fn a_broker_restarted_from_its_store_answers_as_before() {
        use crate::{BrokerConfig, BrokerState};

        let dir = tempfile::tempdir().expect("tempdir");
        let (broker, worker, reader) = (NodeId([1; 32]), NodeId([2; 32]), NodeId([3; 32]));
        let config = BrokerConfig::default();
        let w = name("m/w");
        let before = {
            let store = RegistryStore::open(dir.path()).expect("open");
            let mut state = BrokerState::new(broker, config.clone(), Registry::new(), 1_000);
            let mut changes = state
                .heartbeat(worker, Role::Worker, vec!["10.0.0.2:1".into()], 1, 1_000)
                .expect("heartbeat");
            let meta = TensorMeta::new(DType::U8, vec![4], ContentHash([1; 32])).expect("meta");
            changes.extend(state.publish(w.clone(), meta, worker, 1_001).1);
            store
                .save_changed(state.registry(), &changes.names, &changes.members)
                .expect("save");
            state.registry().clone()
        };
        let store = RegistryStore::open(dir.path()).expect("reopen");
        let loaded = store.load(config.max_tensor_bytes).expect("load");
        assert_eq!(loaded, before);
        let mut state = BrokerState::new(broker, config, loaded, 2_000);
        let found = state.lookup(&w, None, reader, 2_001).expect("found");
        assert_eq!(found.holders[0].node, worker);
    }

    #[test]
    fn epochs_increase_across_reopens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut seen = Vec::new();
        for _ in 0..3 {
            let store = RegistryStore::open(dir.path()).expect("open");
            seen.push(store.bump_epoch().expect("epoch"));
        }
        assert_eq!(seen, [1, 2, 3]);
    }

    #[test]
    fn a_store_in_use_is_refused_after_the_lock_wait() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _held = RegistryStore::open(dir.path()).expect("open");
        let started = Instant::now();
        let wait = Duration::from_millis(200);
        match RegistryStore::open_waiting(dir.path(), wait) {
            Err(e @ PersistError::Open { .. }) => {
                assert!(e.to_string().contains("lock"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() >= wait);
    }

    #[test]
    fn other_formats_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = RegistryStore::open(dir.path()).expect("open");
            store
                .meta
                .insert(FORMAT_KEY, &7u32.to_be_bytes())
                .expect("insert");
            store.flush().expect("flush");
        }
        match RegistryStore::open(dir.path()) {
            Err(PersistError::Format { found: 7 }) => {}
            other => panic!("{other:?}"),
        }
    }
}
