//! The `tb/ctl/1` requests a node makes, one typed method each, over [`CtlClient::call`].

use std::time::Duration;

use tb_proto::{
    CtlRequest, CtlResponse, HolderAddr, ListedEntry, MAX_ANNOUNCE_OPS, MemberStatus, NodeId,
    NodeStats, RegistryOp, Role, TensorMeta, TensorName,
};

use super::ctl_client::CtlClient;
use crate::{
    PeerAddr,
    error::{Error, Result},
};

/// Where to fetch one version: a `Holders` answer.
#[derive(Debug, Clone)]
pub(crate) struct Holders {
    pub(crate) version: u64,
    pub(crate) meta: TensorMeta,
    /// Best source first.
    pub(crate) holders: Vec<HolderAddr>,
    /// How many of the first holders to pull pieces from at once (the broker's set).
    pub(crate) sources: usize,
}

/// The variant's name, for messages about answers nobody expected.
fn kind(response: &CtlResponse) -> &'static str {
    match response {
        CtlResponse::Ok => "Ok",
        CtlResponse::Version { .. } => "Version",
        CtlResponse::Holders { .. } => "Holders",
        CtlResponse::Listing { .. } => "Listing",
        CtlResponse::Event(_) => "Event",
        CtlResponse::Members { .. } => "Members",
        CtlResponse::SyncDiff { .. } => "SyncDiff",
        CtlResponse::SyncEntries { .. } => "SyncEntries",
        CtlResponse::Error { .. } => "Error",
        CtlResponse::Servers { .. } => "Servers",
        CtlResponse::Functions { .. } => "Functions",
    }
}

fn unexpected(request: &str, response: &CtlResponse) -> Error {
    Error::Io(format!("broker answered {request} with {}", kind(response)))
}

/// The single final frame of a one-frame answer.
fn single(request: &str, mut frames: Vec<CtlResponse>) -> Result<CtlResponse> {
    match (frames.pop(), frames.is_empty()) {
        (Some(last), true) => Ok(last),
        (Some(last), false) => Err(Error::Io(format!(
            "broker answered {request} with {} frames ending in {}",
            frames.len() + 1,
            kind(&last)
        ))),
        (None, _) => Err(Error::Io(format!("broker answered {request} with nothing"))),
    }
}

impl CtlClient {
    /// A request answered by `Ok`.
    async fn expect_ok(&self, what: &str, request: &CtlRequest, timeout: Duration) -> Result<()> {
        match single(what, self.call(request, timeout).await?)? {
            CtlResponse::Ok => Ok(()),
            other => Err(unexpected(what, &other)),
        }
    }

    /// `Heartbeat` as a worker listening at `addrs`, in life `epoch`, with its live `stats`.
    pub(crate) async fn heartbeat(
        &self,
        addrs: Vec<String>,
        epoch: u64,
        stats: Option<NodeStats>,
        timeout: Duration,
    ) -> Result<()> {
        let request = CtlRequest::Heartbeat {
            role: Role::Worker,
            addrs,
            epoch,
            stats,
        };
        self.expect_ok("Heartbeat", &request, timeout).await
    }

    /// `Announce`s `ops`, [`MAX_ANNOUNCE_OPS`] per request, in order.
    pub(crate) async fn announce(&self, ops: Vec<RegistryOp>, timeout: Duration) -> Result<()> {
        for chunk in ops.chunks(MAX_ANNOUNCE_OPS) {
            let request = CtlRequest::Announce {
                ops: chunk.to_vec(),
            };
            self.expect_ok("Announce", &request, timeout).await?;
        }
        Ok(())
    }

    /// `Publish`: `ops` (a publish first) with the published version's bytes, for the
    /// subscribers' events.
    pub(crate) async fn publish_inline(
        &self,
        ops: Vec<RegistryOp>,
        bytes: Vec<u8>,
        timeout: Duration,
    ) -> Result<()> {
        let request = CtlRequest::Publish { ops, bytes };
        self.expect_ok("Publish", &request, timeout).await
    }

    /// `Servers`: the live nodes serving `function` now.
    pub(crate) async fn servers(
        &self,
        function: &TensorName,
        timeout: Duration,
    ) -> Result<Vec<HolderAddr>> {
        let request = CtlRequest::Servers {
            function: function.clone(),
        };
        match single("Servers", self.call(&request, timeout).await?)? {
            CtlResponse::Servers {
                function: answered,
                servers,
            } if answered == *function => Ok(servers),
            other => Err(unexpected("Servers", &other)),
        }
    }

    /// `Functions`: the functions served now under `prefix`, with their server counts.
    pub(crate) async fn functions(
        &self,
        prefix: &str,
        limit: u32,
        timeout: Duration,
    ) -> Result<Vec<(TensorName, u32)>> {
        let request = CtlRequest::Functions {
            prefix: prefix.to_owned(),
            limit,
        };
        match single("Functions", self.call(&request, timeout).await?)? {
            CtlResponse::Functions { functions } => Ok(functions),
            other => Err(unexpected("Functions", &other)),
        }
    }

    /// `NextVersion`: the version the broker assigns to this node's next publish of `name`.
    pub(crate) async fn next_version(&self, name: &TensorName, timeout: Duration) -> Result<u64> {
        let request = CtlRequest::NextVersion { name: name.clone() };
        match single("NextVersion", self.call(&request, timeout).await?)? {
            CtlResponse::Version { version } => Ok(version),
            other => Err(unexpected("NextVersion", &other)),
        }
    }

    /// `Lookup`: where to fetch `version` (the newest if `None`) of `name`.
    pub(crate) async fn lookup(
        &self,
        name: &TensorName,
        version: Option<u64>,
        exclude: &[NodeId],
        timeout: Duration,
    ) -> Result<Holders> {
        let request = CtlRequest::Lookup {
            name: name.clone(),
            version,
            exclude: exclude.to_vec(),
        };
        match single("Lookup", self.call(&request, timeout).await?)? {
            CtlResponse::Holders {
                name: answered,
                version: found,
                meta,
                holders,
                sources,
            } if answered == *name && version.is_none_or(|v| v == found) => Ok(Holders {
                version: found,
                meta,
                holders,
                sources: usize::from(sources),
            }),
            CtlResponse::Holders {
                name: answered,
                version: found,
                ..
            } => Err(Error::Io(format!(
                "broker answered a lookup of \"{name}\"{} with \"{answered}\" v{found}",
                version.map(|v| format!(" v{v}")).unwrap_or_default()
            ))),
            other => Err(unexpected("Lookup", &other)),
        }
    }

    /// `Fetching`: this node started (`active`) or stopped fetching `version` of `name`.
    pub(crate) async fn fetching(
        &self,
        name: &TensorName,
        version: u64,
        active: bool,
        timeout: Duration,
    ) -> Result<()> {
        let request = CtlRequest::Fetching {
            name: name.clone(),
            version,
            active,
        };
        self.expect_ok("Fetching", &request, timeout).await
    }

    /// `List`: live entries whose names start with `prefix`, at most `limit`, in name order.
    pub(crate) async fn list(
        &self,
        prefix: &str,
        limit: u32,
        timeout: Duration,
    ) -> Result<Vec<ListedEntry>> {
        let request = CtlRequest::List {
            prefix: prefix.to_string(),
            limit,
        };
        let mut all = Vec::new();
        for frame in self.call(&request, timeout).await? {
            match frame {
                CtlResponse::Listing { entries, .. } => all.extend(entries),
                other => return Err(unexpected("List", &other)),
            }
        }
        all.truncate(limit as usize);
        Ok(all)
    }

    /// `Members`: the membership table, with each member's latest heartbeat stats.
    pub(crate) async fn members(&self, timeout: Duration) -> Result<Vec<MemberStatus>> {
        members_from(self.call(&CtlRequest::Members, timeout).await?)
    }

    /// `Members` asked of every broker at once: each one's table, or why it gave none.
    pub(crate) async fn members_each(
        &self,
        timeout: Duration,
    ) -> Vec<(PeerAddr, Result<Vec<MemberStatus>>)> {
        let answers = self.call_each(&CtlRequest::Members, timeout).await;
        answers
            .into_iter()
            .map(|(broker, frames)| (broker, frames.and_then(members_from)))
            .collect()
    }
}

/// The rows of a `Members` answer's frames.
fn members_from(frames: Vec<CtlResponse>) -> Result<Vec<MemberStatus>> {
    let mut all = Vec::new();
    for frame in frames {
        match frame {
            CtlResponse::Members { members, .. } => all.extend(members),
            other => return Err(unexpected("Members", &other)),
        }
    }
    Ok(all)
}
