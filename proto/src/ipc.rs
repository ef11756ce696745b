//! The same-host CUDA IPC handle exchange: a puller on the node's host asks for a version's
//! IPC handle ([`IpcRequest::Open`]) and maps the holder's device memory with it
//! ([`IpcResponse::Handle`]), or is told to use the network ([`IpcResponse::Declined`]).
//!
//! It is one request kind on the pooled data link: the request rides in
//! [`DataRequest::CudaIpc`](crate::DataRequest::CudaIpc), the answer in
//! [`DataResponse::CudaIpc`](crate::DataResponse::CudaIpc) (tb-node's `channel::cuda_ipc`).
//! Its messages are golden-byte tested and checked with explicit limits before they are
//! acted on: a request's host id is bounded (and the whole data request frame is read under
//! 4 KiB); a handle is exactly [`IPC_HANDLE_LEN`] bytes.

use serde::{Deserialize, Serialize};

use crate::{MetaError, TensorMeta, TensorName};

/// Bytes in a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_LEN: usize = 64;

/// The longest host id a request may carry (a Linux boot id is 36 characters).
pub const MAX_HOST_ID_LEN: usize = 128;

/// What a puller asks (inside [`DataRequest::CudaIpc`](crate::DataRequest::CudaIpc)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IpcRequest {
    /// Export this tensor's device memory to me.
    Open {
        /// The tensor.
        name: TensorName,
        /// A specific version, or the newest.
        version: Option<u64>,
        /// The requester's host (boot) id: the server exports only to its own machine.
        host: String,
        /// Below this size the requester prefers the network.
        min_bytes: u64,
    },
}

/// The server's answer to an [`IpcRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IpcResponse {
    /// Map this handle; finish your send side when done with it.
    Handle {
        /// The version's metadata (its hash included).
        meta: TensorMeta,
        /// The version exported.
        version: u64,
        /// The IPC handle, [`IPC_HANDLE_LEN`] bytes.
        handle: Vec<u8>,
    },
    /// Use the network instead.
    Declined {
        /// Why, for the requester's log.
        reason: String,
    },
}

/// Why an IPC message is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpcError {
    /// A host id over [`MAX_HOST_ID_LEN`] bytes.
    #[error("host id of {0} bytes (at most {MAX_HOST_ID_LEN})")]
    HostTooLong(usize),
    /// A handle that is not [`IPC_HANDLE_LEN`] bytes.
    #[error("IPC handle of {0} bytes (must be {IPC_HANDLE_LEN})")]
    HandleLength(usize),
    /// The exported version's metadata is invalid.
    #[error("invalid metadata: {0}")]
    Meta(#[from] MetaError),
}

impl IpcRequest {
    /// Checks the request's bounds before it is acted on.
    pub fn validate(&self) -> Result<(), IpcError> {
        let IpcRequest::Open { host, .. } = self;
        if host.len() > MAX_HOST_ID_LEN {
            return Err(IpcError::HostTooLong(host.len()));
        }
        Ok(())
    }
}

impl IpcResponse {
    /// Checks an answer before its handle is opened: the handle's length and the metadata,
    /// within `max_tensor_bytes`.
    pub fn validate(&self, max_tensor_bytes: u64) -> Result<(), IpcError> {
        match self {
            IpcResponse::Handle { meta, handle, .. } => {
                if handle.len() != IPC_HANDLE_LEN {
                    return Err(IpcError::HandleLength(handle.len()));
                }
                meta.validate(max_tensor_bytes)?;
                Ok(())
            }
            IpcResponse::Declined { .. } => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_handles_out_of_bounds_are_refused() {
        let open = |host: String| IpcRequest::Open {
            name: TensorName::new("w").expect("name"),
            version: None,
            host,
            min_bytes: 0,
        };
        assert_eq!(open("b".repeat(MAX_HOST_ID_LEN)).validate(), Ok(()));
        assert_eq!(
            open("b".repeat(MAX_HOST_ID_LEN + 1)).validate(),
            Err(IpcError::HostTooLong(MAX_HOST_ID_LEN + 1))
        );
        let meta =
            TensorMeta::new(crate::DType::U8, vec![4], crate::ContentHash([7; 32])).expect("meta");
        let handle = |len: usize| IpcResponse::Handle {
            meta: meta.clone(),
            version: 1,
            handle: vec![0; len],
        };
        assert_eq!(handle(IPC_HANDLE_LEN).validate(1 << 20), Ok(()));
        assert_eq!(
            handle(IPC_HANDLE_LEN - 1).validate(1 << 20),
            Err(IpcError::HandleLength(IPC_HANDLE_LEN - 1))
        );
        assert!(matches!(
            handle(IPC_HANDLE_LEN).validate(2),
            Err(IpcError::Meta(_))
        ));
    }
}
