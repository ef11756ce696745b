//! Anti-entropy over `tb/ctl/1`: a broker that starts late, restarts, or comes back from a
//! partition pulls what it lacks from every peer broker, and a periodic round repairs
//! whatever gossip dropped.
//!
//! One conversation, on one stream, asker A and responder B:
//! 1. A -> `SyncBuckets` (256 bucket digests of its entries, and its member digests);
//! 2. B -> `SyncDiff` frames (B's member rows that differ, the buckets that differ);
//! 3. A -> `SyncNames` frames (A's per-name digests in those buckets);
//! 4. B -> `SyncEntries` frames (B's entries A lacks or holds otherwise); A merges them.
//!
//! It is pull-only: B learns A's news when B asks A, which every broker does every round. A
//! round in which nothing differs costs two small frames each way.
//!
//! What one side buffers from the other (A's names at B until A's last frame; B's rows and
//! entries at A until they are merged) is reserved, frame by frame, from the broker's sync
//! budget (`BrokerConfig::max_sync_bytes`, shared by all conversations): a conversation that
//! would go over ends at once, and B tells A why (`Busy`, or `TooLarge`).

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use iroh::{
    Endpoint, EndpointId,
    endpoint::{Connection, RecvStream, SendStream},
};
use ractor::ActorRef;
use serde::Serialize;
use tb_link::{
    PeerAddr, auth,
    budget::{BudgetError, ByteBudget, Reservation},
    framing::{read_frame, write_frame},
};
use tb_proto::{
    CTL_ALPN, ClusterKey, CtlRequest, CtlResponse, Entry, ErrorCode, MAX_CHUNK_BYTES,
    MAX_SYNC_MEMBERS, Member, MemberStatus, NodeId, Registry, TensorName, chunk_by_size,
};

use crate::{
    actor::BrokerMsg,
    ctl::ask,
    metrics::{Refusal, Refusals},
};

/// Most frames one side of a conversation may send in one step (a bound on the loop; 4096
/// frames of up to 1 MiB is far more than any registry this build is meant for).
const MAX_STEP_FRAMES: usize = 4096;

/// What went wrong in a conversation (logged; the next round tries again).
pub(crate) type SyncError = String;

/// The responder's side, run by the ctl handler when a `SyncBuckets` arrives.
pub(crate) struct Responder<'a> {
    pub(crate) actor: &'a ActorRef<BrokerMsg>,
    pub(crate) timeout: Duration,
    pub(crate) max_tensor_bytes: u64,
    /// What the asker's names may hold of this broker's memory, with every other conversation.
    pub(crate) budget: &'a ByteBudget,
    /// Where a conversation refused for the budget is counted.
    pub(crate) refused: &'a Refusals,
}

impl Responder<'_> {
    /// Steps 2 to 4, after the asker's `SyncBuckets`.
    pub(crate) async fn run(
        &self,
        buckets: Vec<[u8; 32]>,
        members: Vec<(NodeId, [u8; 32])>,
        send: &mut SendStream,
        recv: &mut RecvStream,
    ) -> Result<(), SyncError> {
        let snapshot = snapshot(self.actor, self.timeout).await?;
        let differing = snapshot.differing_buckets(&buckets);
        let theirs: BTreeMap<NodeId, [u8; 32]> = members.into_iter().collect();
        let rows = snapshot.members_to_send(&theirs);
        let mut frames = member_frames(rows);
        if let Some(CtlResponse::SyncDiff { buckets, .. }) = frames.first_mut() {
            buckets.clone_from(&differing);
        }
        for frame in &frames {
            write(send, frame).await?;
        }
        let mut names = BTreeMap::new();
        let mut held = self.budget.empty();
        for _ in 0..MAX_STEP_FRAMES {
            match read(recv, self.timeout, self.max_tensor_bytes).await? {
                CtlRequest::SyncNames { names: part, last } => {
                    if let Err(err) = held.try_grow(encoded_len(&part)) {
                        self.refused.inc(Refusal::SyncBudget);
                        let code = match err {
                            BudgetError::TooLarge { .. } => ErrorCode::TooLarge,
                            BudgetError::Busy { .. } => ErrorCode::Busy,
                        };
                        let message =
                            format!("anti-entropy names refused by the sync budget: {err}");
                        let _ = write(send, &CtlResponse::Error { code, message }).await;
                        return Err(format!("refused the asker's names: {err}"));
                    }
                    names.extend(part);
                    if last {
                        let entries = snapshot.entries_to_send(&names, &differing);
                        for frame in entry_frames(entries) {
                            write(send, &frame).await?;
                        }
                        return Ok(());
                    }
                }
                other => return Err(format!("expected SyncNames, got {other:?}")),
            }
        }
        Err("too many SyncNames frames".into())
    }
}

/// What one pull brought back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    /// Entries the peer sent.
    pub entries: usize,
    /// Member rows the peer sent.
    pub members: usize,
}

/// Asks `conn`'s broker for what this broker lacks and hands it to the actor to merge; what
/// the peer sends is held against `budget` until then.
pub(crate) async fn pull_from(
    conn: &Connection,
    actor: &ActorRef<BrokerMsg>,
    timeout: Duration,
    max_tensor_bytes: u64,
    budget: &ByteBudget,
) -> Result<SyncStats, SyncError> {
    let mut held = budget.empty();
    let snapshot = snapshot(actor, timeout).await?;
    let (mut send, mut recv) = tokio::time::timeout(timeout, conn.open_bi())
        .await
        .map_err(|_| "opening a stream timed out".to_string())?
        .map_err(|e| format!("opening a stream: {e}"))?;
    let mut members: Vec<(NodeId, [u8; 32])> = snapshot.member_digest().into_iter().collect();
    members.truncate(MAX_SYNC_MEMBERS);
    let buckets = CtlRequest::SyncBuckets {
        buckets: snapshot.bucket_digests(),
        members,
    };
    write_request(&mut send, &buckets).await?;
    let (rows, differing) = read_diff(&mut recv, timeout, max_tensor_bytes, &mut held).await?;
    let names = snapshot.names_in_buckets(&differing);
    let chunks = chunk_by_size(names.into_iter().collect(), MAX_CHUNK_BYTES);
    let count = chunks.len();
    for (i, names) in chunks.into_iter().enumerate() {
        let last = i + 1 == count;
        write_request(&mut send, &CtlRequest::SyncNames { names, last }).await?;
    }
    let _ = send.finish();
    let entries = read_entries(&mut recv, timeout, max_tensor_bytes, &mut held).await?;
    let stats = SyncStats {
        entries: entries.len(),
        members: rows.len(),
    };
    if !entries.is_empty() || !rows.is_empty() {
        actor
            .cast(BrokerMsg::Merge {
                entries,
                members: rows,
            })
            .map_err(|_| "broker stopped".to_string())?;
    }
    Ok(stats)
}

/// Asks the peer broker on `conn` for its membership table (`Members`), with the stats of the
/// workers that heartbeat to it: what a broker's dashboard relays about the peers' workers.
pub(crate) async fn ask_members(
    conn: &Connection,
    timeout: Duration,
    max_tensor_bytes: u64,
) -> Result<Vec<MemberStatus>, SyncError> {
    let (mut send, mut recv) = tokio::time::timeout(timeout, conn.open_bi())
        .await
        .map_err(|_| "opening a stream timed out".to_string())?
        .map_err(|e| format!("opening a stream: {e}"))?;
    write_request(&mut send, &CtlRequest::Members).await?;
    let _ = send.finish();
    let mut rows = Vec::new();
    for _ in 0..MAX_STEP_FRAMES {
        match read_response(&mut recv, timeout, max_tensor_bytes).await? {
            CtlResponse::Members { members, last } => {
                // Rows are validated (bounded in size) and one per member: a peer sending
                // more than a membership table holds is not answering honestly.
                if rows.len() + members.len() > MAX_SYNC_MEMBERS {
                    return Err(format!(
                        "peer sent more than {MAX_SYNC_MEMBERS} member rows"
                    ));
                }
                rows.extend(members);
                if last {
                    return Ok(rows);
                }
            }
            _ => return Err("peer answered Members with another kind of frame".to_string()),
        }
    }
    Err(format!(
        "peer sent more than {MAX_STEP_FRAMES} Members frames"
    ))
}

async fn read_diff(
    recv: &mut RecvStream,
    timeout: Duration,
    max: u64,
    held: &mut Reservation,
) -> Result<(Vec<Member>, Vec<u8>), SyncError> {
    let (mut rows, mut differing) = (Vec::new(), Vec::new());
    for _ in 0..MAX_STEP_FRAMES {
        match read_response(recv, timeout, max).await? {
            CtlResponse::SyncDiff {
                members,
                buckets,
                last,
            } => {
                hold(
                    held,
                    encoded_len(&members).saturating_add(encoded_len(&buckets)),
                    "member rows",
                )?;
                rows.extend(members);
                differing.extend(buckets);
                if last {
                    return Ok((rows, differing));
                }
            }
            other => return Err(format!("expected SyncDiff, got {other:?}")),
        }
    }
    Err("too many SyncDiff frames".into())
}

async fn read_entries(
    recv: &mut RecvStream,
    timeout: Duration,
    max: u64,
    held: &mut Reservation,
) -> Result<Vec<(TensorName, Entry)>, SyncError> {
    let mut all = Vec::new();
    for _ in 0..MAX_STEP_FRAMES {
        match read_response(recv, timeout, max).await? {
            CtlResponse::SyncEntries { entries, last } => {
                hold(held, encoded_len(&entries), "entries")?;
                all.extend(entries);
                if last {
                    return Ok(all);
                }
            }
            other => return Err(format!("expected SyncEntries, got {other:?}")),
        }
    }
    Err("too many SyncEntries frames".into())
}

/// Holds `bytes` more of what a peer sent against the sync budget, or ends the conversation.
fn hold(held: &mut Reservation, bytes: u64, what: &str) -> Result<(), SyncError> {
    held.try_grow(bytes)
        .map_err(|err| format!("the peer's {what} refused by the sync budget: {err}"))
}

/// A message's encoded size: what it is charged against the sync budget.
fn encoded_len<T: Serialize + ?Sized>(value: &T) -> u64 {
    // Measuring plain data cannot fail; if it did, "too large" is the safe answer.
    postcard::serialize_with_flavor(value, postcard::ser_flavors::Size::default())
        .map_or(u64::MAX, |n| n as u64)
}

fn member_frames(rows: Vec<Member>) -> Vec<CtlResponse> {
    crate::ctl::pieces(rows, |members, last| CtlResponse::SyncDiff {
        members,
        buckets: Vec::new(),
        last,
    })
}

fn entry_frames(entries: Vec<(TensorName, Entry)>) -> Vec<CtlResponse> {
    crate::ctl::pieces(entries, |entries, last| CtlResponse::SyncEntries {
        entries,
        last,
    })
}

async fn snapshot(actor: &ActorRef<BrokerMsg>, timeout: Duration) -> Result<Arc<Registry>, String> {
    ask(actor, timeout, |reply| BrokerMsg::Snapshot { reply })
        .await
        .map_err(|e| format!("{e:?}"))
}

async fn write(send: &mut SendStream, frame: &CtlResponse) -> Result<(), SyncError> {
    write_frame(send, frame).await.map_err(|e| e.to_string())
}

async fn write_request(send: &mut SendStream, frame: &CtlRequest) -> Result<(), SyncError> {
    write_frame(send, frame).await.map_err(|e| e.to_string())
}

async fn read(recv: &mut RecvStream, timeout: Duration, max: u64) -> Result<CtlRequest, SyncError> {
    let frame = tokio::time::timeout(timeout, read_frame::<CtlRequest>(recv))
        .await
        .map_err(|_| "peer went quiet".to_string())?
        .map_err(|e| e.into_error("sync frame").to_string())?;
    frame.validate(max).map_err(|e| e.to_string())?;
    Ok(frame)
}

async fn read_response(
    recv: &mut RecvStream,
    timeout: Duration,
    max: u64,
) -> Result<CtlResponse, SyncError> {
    let frame = tokio::time::timeout(timeout, read_frame::<CtlResponse>(recv))
        .await
        .map_err(|_| "peer went quiet".to_string())?
        .map_err(|e| e.into_error("sync frame").to_string())?;
    frame.validate(max).map_err(|e| e.to_string())?;
    if let CtlResponse::Error { code, message } = frame {
        return Err(format!("peer refused: {code:?}: {message}"));
    }
    Ok(frame)
}

/// Authenticated `tb/ctl/1` connections to peer brokers, dialed on demand and reused.
pub(crate) struct PeerLinks {
    endpoint: Endpoint,
    key: ClusterKey,
    timeout: Duration,
    links: HashMap<EndpointId, Connection>,
}

impl PeerLinks {
    pub(crate) fn new(endpoint: Endpoint, key: ClusterKey, timeout: Duration) -> Self {
        PeerLinks {
            endpoint,
            key,
            timeout,
            links: HashMap::new(),
        }
    }

    /// A live, authenticated connection to `peer`.
    pub(crate) async fn get(&mut self, peer: &PeerAddr) -> Result<Connection, SyncError> {
        if let Some(conn) = self.links.get(&peer.id) {
            if conn.close_reason().is_none() {
                return Ok(conn.clone());
            }
            self.links.remove(&peer.id);
        }
        let conn = dial(&self.endpoint, &self.key, self.timeout, peer).await?;
        self.links.insert(peer.id, conn.clone());
        Ok(conn)
    }

    /// Forgets a link that failed.
    pub(crate) fn drop_link(&mut self, peer: &EndpointId) {
        self.links.remove(peer);
    }

    /// Closes every link.
    pub(crate) fn close_all(&mut self) {
        for (_, conn) in self.links.drain() {
            conn.close(0u32.into(), b"shutdown");
        }
    }
}

/// Dials `peer` on `tb/ctl/1` and proves the cluster secret, both within `timeout`.
pub(crate) async fn dial(
    endpoint: &Endpoint,
    key: &ClusterKey,
    timeout: Duration,
    peer: &PeerAddr,
) -> Result<Connection, SyncError> {
    let dial = async {
        let conn = endpoint
            .connect(peer.to_endpoint_addr(), CTL_ALPN)
            .await
            .map_err(|e| format!("dialing {}: {e}", peer.id.fmt_short()))?;
        auth::client_hello(&conn, endpoint.id(), key, CTL_ALPN, timeout, 0)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, SyncError>(conn)
    };
    tokio::time::timeout(timeout, dial)
        .await
        .map_err(|_| format!("no link to {} within {timeout:?}", peer.id.fmt_short()))?
}
