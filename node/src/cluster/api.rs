//! The cluster API on [`Node`]: publish, get, get_version, get_within, publish_set, get_set,
//! list, members, subscribe. Each call fails with `Standalone` on a node without brokers and
//! `Shutdown` once the node stops.

use std::{collections::BTreeMap, time::Duration};

use tb_proto::{ErrorCode, ListedEntry, MAX_LIST_LIMIT, Member, NamePattern, TensorName};
use tracing::debug;

use super::{MembersView, Subscription, ctl_client::short_addr, failover, get, members, subscribe};
use crate::{
    PeerAddr,
    client::Pulled,
    error::{BrokerFailure, Error, Result},
    node::Node,
    progress::TransferProgress,
    set::TensorSet,
    store::Inserted,
    tensor::Tensor,
};

/// Tries at one publish when other publishers keep winning the version assigned.
const PUBLISH_TRIES: u32 = 8;
/// How often [`Node::wait_for_holders`] asks.
const HOLDERS_POLL: Duration = Duration::from_millis(50);
/// Pause after a lost race, times the number of the try.
const PUBLISH_BACKOFF: Duration = Duration::from_millis(5);

impl Node {
    /// Publishes `tensor` as the next version of `name` in the cluster and returns that version.
    ///
    /// The broker assigns the version; this node stores the tensor under it (readers never see
    /// part of a version), then announces that it published and holds it. If another publish
    /// of `name` won that version meanwhile, it asks again. If the announcement fails
    /// otherwise, the error is returned and the local copy stays (unannounced; a later publish
    /// replaces it).
    #[tracing::instrument(name = "publish", skip_all, fields(me = %self.id().fmt_short(), tensor = name))]
    pub async fn publish(&self, name: &str, tensor: Tensor) -> Result<u64> {
        let cluster = self.cluster()?;
        let name = TensorName::new(name)?;
        tensor.meta().validate(self.config().max_tensor_bytes)?;
        crate::set::check_publishable(&name, &tensor)?;
        // A device tensor received as a loan by CUDA IPC is hashed first (readers check).
        let tensor = crate::channel::verify::blocking(|| tensor.hashed())?;
        self.guarded(async {
            cluster.ensure_joined().await?;
            let store = &self.ctx().store;
            let mut lost = None;
            // A small host tensor's bytes ride with the publish and the subscribers' events.
            let inline = match tensor.host_data() {
                Some(bytes) if tensor.byte_len() <= tb_proto::MAX_INLINE_BYTES => {
                    Some(bytes.to_vec())
                }
                _ => None,
            };
            // Whether the first attempt proposes a version (its failure calls for no pause).
            let proposes = store.highest_ever(&name) > 0;
            for attempt in 0..PUBLISH_TRIES {
                let pause = attempt.saturating_sub(u32::from(proposes));
                if pause > 0 {
                    tokio::time::sleep(PUBLISH_BACKOFF * pause).await;
                }
                let version = next_version(cluster, store, &name, attempt == 0 && proposes);
                let version = version.await?;
                if store.insert_at(name.clone(), version, tensor.clone()) == Inserted::TooOld {
                    return Err(Error::InvalidTensor(format!(
                        "tensor \"{name}\": the broker assigned v{version}, but this node holds \
                         newer versions of it (published with publish_local?)"
                    )));
                }
                // The subscribers watching this node get the version straight away (a
                // small one inline, a larger one to same-host watchers as its memfd),
                // beside the publish (only a version this node proposed: one the broker
                // assigned after a lost race goes through the broker). Should the broker
                // refuse it (another publisher won it meanwhile, a rare race), watchers
                // were told a version the registry gives to another tensor, as when two
                // brokers each accept one before gossip settles which wins.
                if attempt == 0 && proposes {
                    self.ctx().watchers.offer(&name, version, &tensor);
                }
                let ops = cluster.publish_ops(&name, version, tensor.meta());
                let announced = match &inline {
                    Some(bytes) => cluster.announce_inline(ops, bytes.clone()).await,
                    None => cluster.announce(ops).await,
                };
                match announced {
                    Ok(()) => return Ok(version),
                    Err(
                        e @ Error::Remote {
                            code: ErrorCode::Busy,
                            ..
                        },
                    ) => {
                        lost_race(cluster, store, &name, version).await;
                        lost = Some(e);
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(lost.unwrap_or_else(|| Error::Io(format!("publishing \"{name}\""))))
        })
        .await
    }

    /// Publishes `members` (`(key, tensor)` pairs) with `metadata` as the next version of the
    /// set `prefix` and returns that version: one registry entry whose bytes hold every
    /// member, so readers of the set ([`get_set`](Self::get_set), subscribers) get all
    /// members of one version or none. Each `prefix/key` must be a valid name and keys unique.
    /// Copies the members once into the set's buffer (device members through host memory).
    pub async fn publish_set(
        &self,
        prefix: &str,
        members: Vec<(String, Tensor)>,
        metadata: BTreeMap<String, String>,
    ) -> Result<u64> {
        self.cluster()?;
        let name = TensorName::new(prefix)?;
        let max = self.config().max_tensor_bytes;
        let packing = name.clone();
        // Copying and hashing a checkpoint takes a while: off the runtime's threads.
        let set =
            tokio::task::spawn_blocking(move || TensorSet::pack(&packing, &members, metadata, max))
                .await
                .map_err(|e| Error::Io(format!("packing set \"{name}\": {e}")))??;
        self.publish(name.as_str(), set).await
    }

    /// Gets the newest version of the set `prefix` (or `version`), every member of that one
    /// version. `NotFound` like [`get`](Self::get); `InvalidTensor` when `prefix` names a
    /// tensor, not a set.
    pub async fn get_set(&self, prefix: &str, version: Option<u64>) -> Result<TensorSet> {
        let got = self.get_inner(prefix, version, None).await?;
        TensorSet::from_tensor(got.name, got.version, &got.buffer)
    }

    /// Gets the newest version of `name` from the cluster: asks a broker where it is, pulls it
    /// from its holders (verified by hash), keeps it (this node becomes a holder) and returns
    /// it. From the local store when this node holds that version already, with the
    /// registry's hash (a copy with another hash is fetched again). When no tensor is
    /// called `name` but a set `prefix` has the member `key` (`name` is `prefix/key`), that
    /// member of the set's newest version (the version is the set's).
    pub async fn get(&self, name: &str) -> Result<Pulled<Tensor>> {
        self.get_inner(name, None, None).await
    }

    /// Gets `version` of `name` from the cluster, like [`get`](Self::get). A version no node
    /// keeps any more is `NotFound`.
    pub async fn get_version(&self, name: &str, version: u64) -> Result<Pulled<Tensor>> {
        self.get_inner(name, Some(version), None).await
    }

    /// [`get`](Self::get) (or [`get_version`](Self::get_version) when `version` is set) that
    /// ends with `Timeout { after: deadline }` when it has not finished within `deadline`
    /// (`None`: no deadline, as `get`). At the deadline everything the get started stops: its
    /// streams, its receive (this node's own pullers of it are told it ended), and its
    /// fan-out slot at the broker (handed back from a task); nothing of it is kept.
    pub async fn get_within(
        &self,
        name: &str,
        version: Option<u64>,
        deadline: Option<Duration>,
    ) -> Result<Pulled<Tensor>> {
        let get = self.get_inner(name, version, None);
        let Some(deadline) = deadline else {
            return get.await;
        };
        match tokio::time::timeout(deadline, get).await {
            Ok(got) => got,
            Err(_) => {
                let which =
                    version.map_or_else(|| "the newest version".into(), |v| format!("v{v}"));
                Err(Error::timeout(
                    format!("get of \"{name}\" {which}"),
                    deadline,
                ))
            }
        }
    }

    /// [`get`](Self::get) (or [`get_version`](Self::get_version) when `version` is set),
    /// recording on `progress` the tensor's size once the broker answers, then the bytes
    /// received so far, for a progress bar. The count never goes back, even when the get
    /// starts over from another holder.
    pub async fn get_with_progress(
        &self,
        name: &str,
        version: Option<u64>,
        progress: &TransferProgress,
    ) -> Result<Pulled<Tensor>> {
        self.get_inner(name, version, Some(progress)).await
    }

    #[tracing::instrument(name = "get", skip_all, fields(me = %self.id().fmt_short(), tensor = name, version))]
    async fn get_inner(
        &self,
        name: &str,
        version: Option<u64>,
        progress: Option<&TransferProgress>,
    ) -> Result<Pulled<Tensor>> {
        let cluster = self.cluster()?;
        let name = TensorName::new(name)?;
        if version == Some(0) {
            return Err(Error::NotFound {
                what: format!("tensor \"{name}\" v0 (versions start at 1)"),
            });
        }
        let got = self
            .guarded(get::fetch(self, cluster, name.clone(), version, progress))
            .await;
        match got {
            Err(e @ Error::NotFound { .. }) => self
                .guarded(set_member(self, cluster, &name, version, progress))
                .await?
                .ok_or(e),
            got => got,
        }
    }

    /// Deletes `name` from the cluster (until a later publish): brokers stop offering it and
    /// tell subscribers; this node drops its copies. `NotFound` if the name is not live.
    pub async fn delete(&self, name: &str) -> Result<()> {
        let cluster = self.cluster()?;
        let name = TensorName::new(name)?;
        self.guarded(async {
            cluster.announce(vec![cluster.delete_op(&name)]).await?;
            self.ctx().store.remove_name(&name);
            Ok(())
        })
        .await
    }

    /// The live names in the cluster starting with `prefix` (`""`: all), in name order, with
    /// their newest version, its metadata and how many nodes hold it.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ListedEntry>> {
        let cluster = self.cluster()?;
        TensorName::validate_prefix(prefix)?;
        let timeout = self.config().request_timeout;
        self.guarded(cluster.ctl.list(prefix, MAX_LIST_LIMIT, timeout))
            .await
    }

    /// Waits until `version` of `name` is held by at least `holders` live nodes (as the
    /// registry says: holders count once they have the whole version), polling a broker, and
    /// returns how many hold it. A publish is only as durable as its copies: with worker
    /// processes that subscribe to the name, `publish` then `wait_for_holders(.., 2, ..)`
    /// means the version outlives its publisher. A newer version of `name` ends the wait too
    /// (returning its holder count). `Timeout` after `timeout`, naming the count reached.
    pub async fn wait_for_holders(
        &self,
        name: &str,
        version: u64,
        holders: u32,
        timeout: Duration,
    ) -> Result<u32> {
        let cluster = self.cluster()?;
        let name = TensorName::new(name)?;
        let request_timeout = self.config().request_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = 0;
        self.guarded(async {
            loop {
                let listed = cluster.ctl.list(name.as_str(), 1, request_timeout).await?;
                if let Some(e) = listed.iter().find(|e| e.name == name) {
                    seen = e.holders;
                    if e.version > version || (e.version == version && e.holders >= holders) {
                        return Ok(e.holders);
                    }
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::timeout(
                        format!("\"{name}\" v{version} held by {seen} of {holders} nodes"),
                        timeout,
                    ));
                }
                tokio::time::sleep(HOLDERS_POLL).await;
            }
        })
        .await
    }

    /// The cluster's membership table: every node with its role, addresses, epoch and
    /// liveness, in node id order.
    pub async fn members(&self) -> Result<Vec<Member>> {
        let cluster = self.cluster()?;
        let timeout = self.config().request_timeout;
        let rows = self.guarded(cluster.ctl.members(timeout)).await?;
        Ok(rows.into_iter().map(|row| row.member).collect())
    }

    /// The membership table as every broker this node knows sees it, asked of all of them at
    /// once and merged: each row with the stats of the member's freshest heartbeat to any of
    /// them (`None` for brokers and nodes no broker that answered heard stats from). What
    /// `tb status` shows. Brokers that do not answer are listed in the view; it fails only when
    /// none answers, as a single call would (`NoBroker`, or `Unauthorized` when all refused us).
    pub async fn members_with_stats(&self) -> Result<MembersView> {
        let cluster = self.cluster()?;
        let timeout = self.config().request_timeout;
        let answers = self.guarded(async { Ok(cluster.ctl.members_each(timeout).await) });
        let mut view = MembersView {
            members: Vec::new(),
            answered: Vec::new(),
            unanswered: Vec::new(),
        };
        let mut tables = Vec::new();
        for (broker, answer) in answers.await? {
            match answer {
                Ok(rows) => {
                    view.answered.push(broker);
                    tables.push(rows);
                }
                Err(e) => view.unanswered.push((broker, e)),
            }
        }
        if view.answered.is_empty() {
            let failures = view
                .unanswered
                .into_iter()
                .map(|(broker, error)| BrokerFailure {
                    broker: short_addr(&broker),
                    error,
                })
                .collect();
            return Err(failover::exhausted(failures));
        }
        view.members = members::merge(tables);
        Ok(view)
    }

    /// Subscribes to the names matching `pattern` (an exact name, `prefix/*`, or `*`): every
    /// version published after this returns is reported as a [`SubEvent`](crate::SubEvent), in increasing
    /// order per name, with the tensor when `Config::auto_fetch` is on. Versions not reported
    /// come as [`SubEvent::Skipped`](crate::SubEvent::Skipped). The subscription moves to another broker if its broker
    /// goes away; dropping it ends it.
    pub async fn subscribe(&self, pattern: &str) -> Result<Subscription> {
        let cluster = self.cluster()?;
        let pattern: NamePattern = pattern.parse()?;
        self.guarded(subscribe::start(self, cluster, pattern)).await
    }

    /// The broker cluster calls go to first (the one that answered last); `None` on a
    /// standalone node.
    pub fn current_broker(&self) -> Option<&PeerAddr> {
        self.cluster().ok()?.ctl.current()
    }
}

/// The member `name` of a set, when no tensor is called `name`: for `ckpt/layer.0/w`, the
/// member `w` of a set `ckpt/layer.0`, else the member `layer.0/w` of a set `ckpt` (the
/// longest parent first; one look-up each). `Ok(None)` when no ancestor is a set with that member. The member comes with the
/// set's version; the set itself is fetched whole (and kept, like any get).
async fn set_member(
    node: &Node,
    cluster: &std::sync::Arc<super::Cluster>,
    name: &TensorName,
    version: Option<u64>,
    progress: Option<&TransferProgress>,
) -> Result<Option<Pulled<Tensor>>> {
    let full = name.as_str();
    for (at, _) in full.rmatch_indices('/') {
        let (parent, key) = (&full[..at], &full[at + 1..]);
        let parent = TensorName::new(parent)?;
        let set = match get::fetch(node, cluster, parent.clone(), version, progress).await {
            Ok(set) => set,
            Err(Error::NotFound { .. }) => continue,
            Err(e) => return Err(e),
        };
        if set.meta.dtype != tb_proto::DType::Set {
            return Ok(None);
        }
        let set = TensorSet::from_tensor(parent, set.version, &set.buffer)?;
        let Some(member) = set.get(key) else {
            return Ok(None);
        };
        return Ok(Some(Pulled {
            name: name.clone(),
            version: set.version,
            meta: member.meta().clone(),
            buffer: member.clone(),
        }));
    }
    Ok(None)
}

/// The version a publish of `name` tries next. Proposed (no round trip) where this node
/// published the name before: the one after its own last, which the broker accepts unless
/// another publish came in between (then `Busy`, and the broker is asked). A broker that has
/// not yet heard of this node's last publish (it went through a broker that died before
/// gossiping it) would hand out a number this node already used: never reuse one, so held
/// bytes never change.
async fn next_version(
    cluster: &super::Cluster,
    store: &crate::store::Store,
    name: &TensorName,
    propose: bool,
) -> Result<u64> {
    let after_mine = store.highest_ever(name).saturating_add(1);
    if propose {
        return Ok(after_mine);
    }
    Ok(cluster.next_version(name).await?.max(after_mine))
}

/// Another publish won `version` of `name`: drops ours (and any holder mark the broker may
/// have kept for it), so the publish asks for the next one.
async fn lost_race(
    cluster: &super::Cluster,
    store: &crate::store::Store,
    name: &TensorName,
    version: u64,
) {
    debug!(%name, version, "lost the race for a version; asking again");
    store.remove(name, version);
    let unmark = cluster.holder_op(name, version, false);
    let _ = cluster.announce(vec![unmark]).await;
}
