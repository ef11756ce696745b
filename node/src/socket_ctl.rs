//! [`SocketCtl`]: how a broker answers control requests that nodes on its host send on the
//! same-host socket instead of its QUIC `tb/ctl/1` link (see `channel/shm/ctl.rs`).

use std::{future::Future, pin::Pin, sync::Arc};

use tb_proto::{Access, CtlRequest, CtlResponse, ErrorCode, NamePattern, NodeId};

/// The answers of one control request, as a broker computes them.
pub type CtlAnswer = Pin<Box<dyn Future<Output = Vec<CtlResponse>> + Send>>;

/// The frames of a subscription, as a broker sends them: `Ok` once it is registered, then an
/// `Event` per change, and an `Error` last when the broker ends it. Dropping it unsubscribes.
pub type CtlFrames = Pin<Box<dyn n0_future::Stream<Item = CtlResponse> + Send>>;

/// A subscription being registered: its frames (a refusal is an `Error` frame alone).
pub type CtlSubscribed = Pin<Box<dyn Future<Output = CtlFrames> + Send>>;

/// What answers control requests that same-host nodes send on the socket: a broker's
/// request handling, registered on the node it runs ([`crate::Node::serve_ctl_on_socket`]).
pub trait SocketCtl: Send + Sync + 'static {
    /// The answer frames to `request` from `peer`, which proved `access` (authorize and
    /// validate it as any request).
    fn answer(&self, peer: NodeId, access: Access, request: CtlRequest) -> CtlAnswer;

    /// A subscription to `pattern` from `peer`, which proved `access`, served on the socket
    /// for as long as the peer keeps it (authorize and bound it as any subscription). A
    /// handler that serves none answers `Unsupported`, and the peer subscribes over QUIC.
    fn subscribe(&self, peer: NodeId, access: Access, pattern: NamePattern) -> CtlSubscribed {
        let _ = (peer, access, pattern);
        let refusal = CtlResponse::Error {
            code: ErrorCode::Unsupported,
            message: "subscriptions are not served on this socket".into(),
        };
        Box::pin(async move { Box::pin(n0_future::stream::once(refusal)) as CtlFrames })
    }
}

/// The handler registered on a node, if any.
#[derive(Default)]
pub(crate) struct SocketCtlSlot(std::sync::OnceLock<Arc<dyn SocketCtl>>);

impl std::fmt::Debug for SocketCtlSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0.get() {
            Some(_) => "SocketCtl(set)",
            None => "SocketCtl(none)",
        })
    }
}

impl SocketCtlSlot {
    /// Registers `handler`; false if one was registered already.
    pub(crate) fn set(&self, handler: Arc<dyn SocketCtl>) -> bool {
        self.0.set(handler).is_ok()
    }

    /// The handler, once registered.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn get(&self) -> Option<&Arc<dyn SocketCtl>> {
        self.0.get()
    }
}
