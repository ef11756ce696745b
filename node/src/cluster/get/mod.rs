//! A get through the cluster: ask a broker where a version is (`held`: this node's own copy
//! is returned only when its hash is the registry's), pull it from the holders it names (best
//! first, resuming where a failed holder left off), keep it, and tell the broker this node
//! holds it now.
//!
//! A holder that fails (unreachable, connection lost, too slow, wrong bytes) is dropped for
//! this get and the next one is tried. A holder still receiving the version (`complete:
//! false`) that has not started yet is skipped for now, not dropped. When the list runs out,
//! the broker is asked once more and the holders not dropped are tried; after that the get
//! fails with `NoHolder`.
//!
//! Too slow: the stream from a source must bring `Config::min_source_rate` bytes per second
//! over each whole stall period (`Config::stall_timeout`), the first source's included; one
//! that does not fails with `Timeout` (the stream's watchdog, see `wire`), and the get
//! resumes from the next holder. A stream that ends within one period is never judged.
//!
//! Wrong bytes: the hash is checked over the whole buffer once every byte is in. When the
//! bytes came from one source it is dropped; when they came from several (the get resumed),
//! none is blamed for another's bytes: the buffer starts over and each of them is asked for
//! the whole version in turn, and from then on the get takes the version whole from one
//! source (see `tries`).
//!
//! While it receives, this node serves the version to its own pullers (cut-through, see
//! `inflight`): the receive is registered before the look-up when the version is known (a
//! puller the broker points here may arrive before the look-up's answer does), and its bytes
//! are published as they land. Only the verified tensor reaches the store.
//!
//! While it pulls a version over QUIC, the get asks the broker again every [`REFRESH`]
//! (which also keeps its fan-out slot fresh) and moves, resuming at the byte it reached, when
//! the broker now names another source first (it moves slow fetchers off sources that fast
//! ones need, onto a chain's tail) or when `pace` judges the current source slow: it
//! delivered under a quarter of the best rate this get has seen. A slow source is dropped for
//! the rest of the get and excluded from its look-ups. The source loses nothing: its stream is
//! stopped as a finished one, and the abandoned pull counts as no transfer.
//!
//! When nothing of the version has arrived yet and the pair's channel is not QUIC, the holder
//! hands it over whole on that channel (`by_channel`): on this host as its sealed memfd
//! (shm: zero-copy), or over verified TCP sockets. A holder still receiving the version
//! declines shm (Busy) and answers a TCP pull over QUIC on the ticket's stream, so QUIC
//! carries it cut-through as between hosts.
//!
//! A get dropped part-way (a deadline, a caller that stopped waiting) stops its streams and
//! its receive as it drops them, and hands its fan-out slot back (`slot`).
//!
//! The parts: this file (the get from look-up to store, and the choice between the ways);
//! `sources` (what they share: addresses, the channel check, reports); `pieces` (a large
//! version in verified pieces from several sources at once); `one_stream` (one source at a
//! time, resuming, moving).

mod one_stream;
mod pieces;
pub(super) mod sources;

use std::sync::Arc;

use tb_proto::{TensorMeta, TensorName};
use tracing::warn;

use crate::{
    channel::HostBuf,
    client::Pulled,
    cluster::{
        Cluster,
        calls::Holders,
        held::{self, Found},
    },
    error::{Error, Result},
    node::Node,
    progress::TransferProgress,
    store::{Inserted, Lookup},
    tensor::Tensor,
};

pub(crate) use self::sources::{Received, Reports, peers_of};

/// Gets `version` (the newest if `None`) of `name` through the cluster, recording the bytes
/// received on `progress` as they land.
pub(crate) async fn fetch(
    node: &Node,
    cluster: &Arc<Cluster>,
    name: TensorName,
    version: Option<u64>,
    progress: Option<&TransferProgress>,
) -> Result<Pulled<Tensor>> {
    let store = &node.ctx().store;
    cluster.ensure_joined().await?;
    let inflight = &node.ctx().inflight;
    // A version this node holds is served from its store meanwhile, not as a receive.
    let early = version
        .filter(|v| !matches!(store.get(&name, Some(*v)), Lookup::Found(..)))
        .map(|v| inflight.start(&name, v, None));
    let (holders, mut slot) = match held::look_up(node, cluster, &name, version).await? {
        Found::Holders(holders, slot) => (holders, slot),
        Found::Held(v, tensor) => {
            if let Some(receiving) = early {
                receiving.done(tensor.clone());
            }
            return Ok(pulled(name, v, tensor, progress));
        }
    };
    let (v, meta) = (holders.version, holders.meta.clone());
    if let Some(p) = progress {
        p.set_total(meta.byte_len);
    }
    let mut receiving = match early {
        Some(receiving) => {
            receiving.set_meta(&meta);
            receiving
        }
        None => inflight.start(&name, v, Some(meta.clone())),
    };
    let len = memory_len(&meta)?;
    slot.announce_start(meta.byte_len);
    let feed = Reports {
        receiving: &mut receiving,
        progress,
    };
    let mut dest = HostBuf::new(len)?;
    // Boxed: the transfer's future is deep, and callers nest gets in futures of their own
    // (the compiler's layout queries have a depth limit).
    let fetched = Box::pin(from_holders(
        node,
        cluster,
        &name,
        holders,
        feed,
        dest.as_mut(),
    ))
    .await;
    let tensor = match fetched? {
        Received::Whole(whole) => whole,
        Received::Filled(outline) => {
            let tensor = dest.into_tensor(meta.clone())?;
            match outline {
                Some(outline) => tensor.with_outline(outline),
                None => tensor,
            }
        }
    };
    let inserted = store.insert_at(name.clone(), v, tensor.clone());
    receiving.done(tensor.clone());
    if inserted == Inserted::Stored && cluster.serves {
        announce_held(node, cluster, &name, v);
        slot.ended_by_holding();
    }
    drop(slot);
    Ok(Pulled {
        name,
        version: v,
        meta,
        buffer: tensor,
    })
}

/// Tells the broker this node holds `name` v`version` now, from a task: the caller has its
/// bytes now, not one broker round trip later (the op is stamped, so a later "dropped it"
/// still wins however the two arrive).
fn announce_held(node: &Node, cluster: &Arc<Cluster>, name: &TensorName, version: u64) {
    let (op, cluster, cancel) = (
        cluster.holder_op(name, version, true),
        cluster.clone(),
        node.ctx().cancel.clone(),
    );
    let name = name.clone();
    node.ctx().tracker.spawn(async move {
        tokio::select! {
            _ = cancel.cancelled() => {}
            sent = cluster.announce(vec![op]) => if let Err(e) = sent {
                warn!(%name, version, %e, "fetched, but could not tell the broker this node holds it");
            }
        }
    });
}

/// The byte length of a tensor as an in-memory length.
pub(crate) fn memory_len(meta: &TensorMeta) -> Result<usize> {
    usize::try_from(meta.byte_len)
        .map_err(|_| Error::TooLarge(format!("{} bytes do not fit in memory", meta.byte_len)))
}

/// A version this node held already: all its bytes count as received.
fn pulled(
    name: TensorName,
    version: u64,
    tensor: Tensor,
    progress: Option<&TransferProgress>,
) -> Pulled<Tensor> {
    if let Some(p) = progress {
        p.set_total(tensor.byte_len());
        p.reached(tensor.byte_len());
    }
    Pulled {
        name,
        version,
        meta: tensor.meta().clone(),
        buffer: tensor,
    }
}

/// Receives the version `first` describes into `dest` (exactly its length): a large one in
/// pieces from the broker's set of sources (`pieces`) unless the pair's channel with the first
/// is not QUIC or no source offers pieces; otherwise in one stream (`one_stream`).
pub(crate) async fn from_holders(
    node: &Node,
    cluster: &Cluster,
    name: &TensorName,
    first: Holders,
    reports: Reports<'_>,
    dest: &mut [u8],
) -> Result<Received> {
    let Reports {
        receiving,
        progress,
    } = reports;
    let large = first.meta.byte_len >= pieces::MIN_BYTES;
    if large && !sources::whole_by_channel(node, cluster, &first).await {
        let reports = Reports {
            receiving: &mut *receiving,
            progress,
        };
        match pieces::fetch(node, cluster, name, &first, reports, &mut *dest).await? {
            pieces::Swarmed::Filled(outline) => return Ok(Received::Filled(Some(outline))),
            pieces::Swarmed::OneStream => {}
        }
    }
    receiving.in_one_stream();
    let reports = Reports {
        receiving,
        progress,
    };
    one_stream::fetch(node, cluster, name, first, reports, dest).await
}
