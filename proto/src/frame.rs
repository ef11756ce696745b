//! Framing: a little-endian `u32` body length, then the postcard body. Control frames are
//! capped at [`MAX_CONTROL_FRAME`]; the cap is checked before anyone allocates the body.
//! Tensor payloads are not framed: their `byte_len` raw bytes follow a `Header`/`Push`.

use serde::{Serialize, de::DeserializeOwned};

/// Largest control-frame body, in bytes.
pub const MAX_CONTROL_FRAME: u32 = 1 << 20;
/// Size of the length prefix.
pub const LEN_PREFIX: usize = 4;

/// Why a frame could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The declared or actual body length is over the cap.
    #[error("frame of {len} bytes is over the limit of {max}")]
    TooLarge {
        /// The length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// The body is not a valid message.
    #[error("malformed frame: {0}")]
    Decode(postcard::Error),
    /// The message could not be serialized.
    #[error("cannot encode frame: {0}")]
    Encode(postcard::Error),
    /// The body has bytes after the message.
    #[error("malformed frame: {extra} bytes after the message")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
}

/// Serializes `msg` as prefix + body.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = postcard::to_extend(msg, vec![0u8; LEN_PREFIX]).map_err(FrameError::Encode)?;
    let body = out.len() - LEN_PREFIX;
    if body > MAX_CONTROL_FRAME as usize {
        return Err(FrameError::TooLarge {
            len: body as u64,
            max: u64::from(MAX_CONTROL_FRAME),
        });
    }
    out[..LEN_PREFIX].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(out)
}

/// The body length a prefix declares, refused if over the cap (before any allocation).
pub fn body_len(prefix: [u8; LEN_PREFIX]) -> Result<usize, FrameError> {
    body_len_within(prefix, MAX_CONTROL_FRAME)
}

/// The body length a prefix declares, refused if over `max` (a cap below the control-frame
/// cap, e.g. [`MAX_HELLO_FRAME`](crate::MAX_HELLO_FRAME)), before any allocation.
pub fn body_len_within(prefix: [u8; LEN_PREFIX], max: u32) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix);
    let max = max.min(MAX_CONTROL_FRAME);
    if len > max {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            max: u64::from(max),
        });
    }
    Ok(len as usize)
}

/// Decodes a whole body; trailing bytes are an error.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let (msg, rest) = postcard::take_from_bytes(body).map_err(FrameError::Decode)?;
    if !rest.is_empty() {
        return Err(FrameError::TrailingBytes { extra: rest.len() });
    }
    Ok(msg)
}

/// Decodes the first frame of `buf`: `None` while incomplete, else the message and the bytes
/// it used.
pub fn decode_frame<T: DeserializeOwned>(buf: &[u8]) -> Result<Option<(T, usize)>, FrameError> {
    let Some(prefix) = buf.first_chunk::<LEN_PREFIX>() else {
        return Ok(None);
    };
    let len = body_len(*prefix)?;
    let Some(body) = buf.get(LEN_PREFIX..LEN_PREFIX + len) else {
        return Ok(None);
    };
    Ok(Some((decode_body(body)?, LEN_PREFIX + len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_is_checked_on_the_prefix() {
        assert_eq!(body_len(0u32.to_le_bytes()).ok(), Some(0));
        assert_eq!(
            body_len(MAX_CONTROL_FRAME.to_le_bytes()).ok(),
            Some(MAX_CONTROL_FRAME as usize)
        );
        assert!(matches!(
            body_len((MAX_CONTROL_FRAME + 1).to_le_bytes()),
            Err(FrameError::TooLarge { len, max }) if len == u64::from(MAX_CONTROL_FRAME) + 1
                && max == u64::from(MAX_CONTROL_FRAME)
        ));
        // An oversized prefix is refused even though the body has not arrived.
        assert!(matches!(
            decode_frame::<u8>(&u32::MAX.to_le_bytes()),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_smaller_cap_is_checked_on_the_prefix() {
        assert_eq!(body_len_within(512u32.to_le_bytes(), 512).ok(), Some(512));
        assert!(matches!(
            body_len_within(513u32.to_le_bytes(), 512),
            Err(FrameError::TooLarge { len: 513, max: 512 })
        ));
        // A cap above the control-frame cap is the control-frame cap.
        assert!(matches!(
            body_len_within((MAX_CONTROL_FRAME + 1).to_le_bytes(), u32::MAX),
            Err(FrameError::TooLarge { max, .. }) if max == u64::from(MAX_CONTROL_FRAME)
        ));
    }

    #[test]
    fn encode_refuses_oversized_bodies() {
        let big = vec![0u8; MAX_CONTROL_FRAME as usize];
        // A byte vector's length prefix pushes the body just over the cap.
        assert!(matches!(encode(&big), Err(FrameError::TooLarge { .. })));
        let fits = vec![0u8; MAX_CONTROL_FRAME as usize - 3];
        let frame = encode(&fits).expect("fits");
        assert_eq!(frame.len(), LEN_PREFIX + MAX_CONTROL_FRAME as usize);
    }

    #[test]
    fn partial_frames_wait_and_whole_frames_decode() {
        let mut buf = encode(&"hello").expect("encode");
        let one = buf.len();
        for cut in 0..one {
            assert!(
                decode_frame::<String>(&buf[..cut])
                    .expect("partial")
                    .is_none()
            );
        }
        buf.extend(encode(&"world").expect("encode"));
        let (msg, used) = decode_frame::<String>(&buf).expect("ok").expect("whole");
        assert_eq!((msg.as_str(), used), ("hello", one));
        let (msg, _) = decode_frame::<String>(&buf[used..])
            .expect("ok")
            .expect("whole");
        assert_eq!(msg, "world");
    }

    #[test]
    fn trailing_bytes_are_refused() {
        assert!(matches!(
            decode_body::<u8>(&[7, 0, 0]),
            Err(FrameError::TrailingBytes { extra: 2 })
        ));
        let err = decode_body::<String>(&[9, b'a']).expect_err("truncated");
        assert!(err.to_string().starts_with("malformed frame: "), "{err}");
    }
}
