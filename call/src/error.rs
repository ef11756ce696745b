//! [`CallError`]: every way a call fails, typed so callers (and Python's exceptions) can tell
//! a handler's own error from an overloaded cluster, a lost server or a deadline.

use std::time::Duration;

use tb_proto::call::RemoteFailure;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The handler failed on the server (raised, or the server's side of the deadline).
    #[error("{function} on {server}: {} : {}", failure.remote_type, failure.message)]
    Remote {
        /// The function.
        function: String,
        /// The server (node id).
        server: String,
        /// What the server said (boxed: it is the largest variant by far).
        failure: Box<RemoteFailure>,
    },
    /// Every server tried was over its concurrency and queue limits.
    #[error("function \"{function}\" is overloaded: {detail}")]
    Overloaded {
        /// The function.
        function: String,
        /// The last server's refusal.
        detail: String,
    },
    /// No live node serves the function.
    #[error("no live node serves function \"{function}\"")]
    NoServer {
        /// The function.
        function: String,
    },
    /// The server was lost mid-call (killed, link gone): the call may have run.
    #[error("function \"{function}\": server {server} was lost mid-call ({reason}); the call {}", if *maybe_ran { "may have run" } else { "never started" })]
    ServerLost {
        /// The function.
        function: String,
        /// The server lost.
        server: String,
        /// Whether the server had accepted the call (it may have run).
        maybe_ran: bool,
        /// What failed.
        reason: String,
    },
    /// The caller's deadline passed.
    #[error("function \"{function}\": no result within {timeout:?}")]
    Timeout {
        /// The function.
        function: String,
        /// The deadline the caller set.
        timeout: Duration,
    },
    /// The caller may not call it (read-only access where the function wants read-write).
    #[error("function \"{function}\": {detail}")]
    Unauthorized {
        /// The function.
        function: String,
        /// The server's refusal.
        detail: String,
    },
    /// An argument or a result the wire cannot carry (limits, bad shapes).
    #[error("function \"{function}\": {detail}")]
    BadValue {
        /// The function.
        function: String,
        /// What is wrong.
        detail: String,
    },
    /// The node failed (no broker, shut down, a bad name).
    #[error(transparent)]
    Node(#[from] tb_node::Error),
}

impl CallError {
    /// Whether another server may be tried: the call never started anywhere.
    pub(crate) fn never_started(&self) -> bool {
        matches!(
            self,
            CallError::Overloaded { .. }
                | CallError::ServerLost {
                    maybe_ran: false,
                    ..
                }
        )
    }
}
