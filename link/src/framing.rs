//! Length-prefixed postcard frames on QUIC streams: the one way frames are read and written
//! on every protocol (`tb/data/1`, `tb/ctl/1`, the hello). The bytes' layout is defined in
//! `tb_proto::frame`; this file only moves them, with the length checked against its cap
//! before the body is allocated, and a bound on every write a server makes.
//!
//! Payload bytes (tensor data, hashed as they land) are tb-node's: they follow a frame on the
//! same stream but are read and written by its `wire` module.

use std::time::Duration;

use iroh::endpoint::{ReadExactError, RecvStream, SendStream};
use serde::{Serialize, de::DeserializeOwned};
use tb_proto::{FrameError, frame};

use crate::error::{Error, Result};

/// Why a frame could not be read: a cheap enum, since a peer ending a stream mid-frame is a
/// normal event on the hot path, not something to box.
#[derive(Debug)]
pub enum ReadFrameError {
    /// The stream ended (or was reset) before a whole frame arrived.
    Closed(String),
    /// The bytes are not a valid frame (too large, malformed): a protocol violation.
    Invalid(FrameError),
}

impl ReadFrameError {
    /// The link error for this failure, with `context` naming what was being read.
    pub fn into_error(self, context: &str) -> Error {
        match self {
            ReadFrameError::Closed(reason) => Error::Io(format!("{context}: {reason}")),
            ReadFrameError::Invalid(FrameError::TooLarge { len, max }) => Error::TooLarge(format!(
                "{context}: frame of {len} bytes, the limit is {max}"
            )),
            ReadFrameError::Invalid(e) => Error::Io(format!("{context}: {e}")),
        }
    }
}

/// Reads one length-prefixed frame. The length is checked against the control-frame cap
/// before the body is allocated.
pub async fn read_frame<T: DeserializeOwned>(recv: &mut RecvStream) -> Result<T, ReadFrameError> {
    read_frame_within(recv, frame::MAX_CONTROL_FRAME).await
}

/// Reads one length-prefixed frame of at most `max` body bytes (a cap below the control-frame
/// cap, such as the hello's), checked before the body is allocated.
pub async fn read_frame_within<T: DeserializeOwned>(
    recv: &mut RecvStream,
    max: u32,
) -> Result<T, ReadFrameError> {
    let mut prefix = [0u8; frame::LEN_PREFIX];
    recv.read_exact(&mut prefix).await.map_err(closed)?;
    let len = frame::body_len_within(prefix, max).map_err(ReadFrameError::Invalid)?;
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.map_err(closed)?;
    frame::decode_body(&body).map_err(ReadFrameError::Invalid)
}

fn closed(err: ReadExactError) -> ReadFrameError {
    ReadFrameError::Closed(match err {
        ReadExactError::FinishedEarly(n) => format!("stream ended after {n} bytes of a frame"),
        ReadExactError::ReadError(e) => e.to_string(),
    })
}

/// Writes one length-prefixed frame.
pub async fn write_frame<T: Serialize>(send: &mut SendStream, msg: &T) -> Result<()> {
    let bytes = frame::encode(msg).map_err(|e| Error::io("encoding a frame", e))?;
    send.write_all(&bytes)
        .await
        .map_err(|e| Error::io("sending a frame", e))
}

/// Writes one frame, failing with `Timeout` if the peer does not take it within `stall`: a
/// server's every write is bounded, so a peer that grants a tiny stream window and stops
/// reading cannot keep a stream (and so its link) in use.
pub async fn write_frame_within<T: Serialize>(
    send: &mut SendStream,
    msg: &T,
    stall: Duration,
) -> Result<()> {
    match tokio::time::timeout(stall, write_frame(send, msg)).await {
        Ok(written) => written,
        Err(_) => Err(Error::timeout("a peer taking a frame", stall)),
    }
}
