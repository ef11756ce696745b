//! What the cluster knows of served functions, on [`Node`]: advertise one, withdraw it, find
//! its servers, list them. The calls themselves are tb-call's (a service on the data link);
//! this is the registry half.
//!
//! A server advertises a function as a holder mark on the entry
//! [`advertised_as`](tb_proto::call::advertised_as)`(function)`, at version = this node's
//! epoch. Brokers replicate the mark like any other, and answer `Servers` with the live
//! members whose *current* epoch holds it: a node that dies stops being offered when its
//! liveness lapses, and one that restarts (a new epoch) no longer counts its old marks, with
//! no unregister message.

use tb_proto::{MAX_LIST_LIMIT, NameError, TensorName, call};

use super::get::sources::peers_of;
use crate::{
    PeerAddr,
    error::{Error, Result},
    node::Node,
};

/// The advertisement entry of `function`, or `InvalidName` when the prefixed name is too long.
fn entry_of(function: &TensorName) -> Result<TensorName> {
    call::advertised_as(function).ok_or(Error::InvalidName(NameError::TooLong {
        len: function.as_str().len() + call::FUNCTION_PREFIX.len(),
    }))
}

impl Node {
    /// Tells the cluster this node serves `function` (until [`withdraw`](Self::withdraw),
    /// its death or its restart). Needs read-write access: brokers refuse a read-only
    /// node's advertisement, so read-only nodes cannot serve.
    pub async fn advertise(&self, function: &TensorName) -> Result<()> {
        self.mark_function(function, true).await
    }

    /// Tells the cluster this node no longer serves `function`.
    pub async fn withdraw(&self, function: &TensorName) -> Result<()> {
        self.mark_function(function, false).await
    }

    async fn mark_function(&self, function: &TensorName, present: bool) -> Result<()> {
        let cluster = self.cluster()?;
        let entry = entry_of(function)?;
        self.guarded(async {
            cluster.ensure_joined().await?;
            let op = cluster.holder_op(&entry, cluster.epoch, present);
            cluster.announce(vec![op]).await
        })
        .await
    }

    /// The live nodes serving `function` now, each at the first of its addresses that
    /// parses, in node id order (empty when nobody serves it).
    pub async fn servers(&self, function: &TensorName) -> Result<Vec<PeerAddr>> {
        let cluster = self.cluster()?;
        entry_of(function)?;
        let timeout = self.config().request_timeout;
        let servers = self.guarded(cluster.ctl.servers(function, timeout)).await?;
        Ok(servers
            .iter()
            .filter_map(|s| peers_of(s).ok()?.into_iter().next())
            .collect())
    }

    /// The functions served now whose names start with `prefix` (`""`: all), in name order,
    /// with how many live nodes serve each.
    pub async fn functions(&self, prefix: &str) -> Result<Vec<(TensorName, u32)>> {
        let cluster = self.cluster()?;
        TensorName::validate_prefix(prefix)?;
        let timeout = self.config().request_timeout;
        self.guarded(cluster.ctl.functions(prefix, MAX_LIST_LIMIT, timeout))
            .await
    }
}
