//! [`Value`]: what a function takes and returns, with tensors' bytes as [`Bytes`]; and how a
//! value is written to and read from a call's stream as a body (`tb_proto::call::Body`).
//!
//! Writing sends the skeleton then each tensor's bytes as they are (no copy, no hash: the
//! link is authenticated and encrypted, so the bytes arrive as sent). Reading checks the
//! skeleton's limits and that the tensors' sizes add up to the body before it allocates
//! anything, then reads each tensor into a buffer of its own.

use bytes::{Bytes, BytesMut};
use iroh::endpoint::RecvStream;
use tb_proto::{
    DType, byte_len_for,
    call::{Body, CallError as WireError, TensorSlot, Value as Skeleton},
};

/// A tensor in host memory, as calls carry it: element type, C-contiguous shape, bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// `product(shape) * itemsize` bytes.
    pub data: Bytes,
}

impl HostTensor {
    /// A tensor of `data`, checked to be `shape`'s size.
    pub fn new(dtype: DType, shape: Vec<u64>, data: impl Into<Bytes>) -> Result<Self, WireError> {
        let data = data.into();
        let want = byte_len_for(dtype, &shape)?;
        if want != data.len() as u64 {
            return Err(WireError::Malformed(format!(
                "a {} tensor of shape {shape:?} is {want} bytes, got {}",
                dtype.name(),
                data.len()
            )));
        }
        Ok(HostTensor { dtype, shape, data })
    }
}

/// An argument or result: plain data and tensors. Nothing in it is code.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Nothing.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// Text.
    Str(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// An ordered list.
    List(Vec<Value>),
    /// A string-keyed map, in insertion order.
    Map(Vec<(String, Value)>),
    /// A tensor.
    Tensor(HostTensor),
}

impl From<HostTensor> for Value {
    fn from(t: HostTensor) -> Self {
        Value::Tensor(t)
    }
}

impl Value {
    /// The tensor, when this value is one.
    pub fn as_tensor(&self) -> Option<&HostTensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The skeleton and the tensors' bytes in tree order.
    fn split(&self) -> (Skeleton, Vec<Bytes>) {
        let mut parts = Vec::new();
        let skeleton = self.skeleton(&mut parts);
        (skeleton, parts)
    }

    fn skeleton(&self, parts: &mut Vec<Bytes>) -> Skeleton {
        match self {
            Value::None => Skeleton::None,
            Value::Bool(b) => Skeleton::Bool(*b),
            Value::Int(i) => Skeleton::Int(*i),
            Value::Float(f) => Skeleton::Float(*f),
            Value::Str(s) => Skeleton::Str(s.clone()),
            Value::Bytes(b) => Skeleton::Bytes(b.clone()),
            Value::List(items) => Skeleton::List(items.iter().map(|v| v.skeleton(parts)).collect()),
            Value::Map(items) => Skeleton::Map(
                items
                    .iter()
                    .map(|(k, v)| (k.clone(), v.skeleton(parts)))
                    .collect(),
            ),
            Value::Tensor(t) => {
                parts.push(t.data.clone());
                Skeleton::Tensor(TensorSlot {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                })
            }
        }
    }
}

/// A value ready to write: the body's head (prefix and skeleton) and the tensors' bytes.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// Prefix and skeleton.
    pub head: Bytes,
    /// Each tensor's bytes, in tree order.
    pub tensors: Vec<Bytes>,
}

impl Encoded {
    /// Encodes `value`, checking the wire's limits (depth, counts, skeleton size).
    pub fn new(value: &Value) -> Result<Self, WireError> {
        let (skeleton, tensors) = value.split();
        let (head, _) = Body::head(&skeleton)?;
        Ok(Encoded {
            head: Bytes::from(head),
            tensors,
        })
    }

    /// The body's length on the wire.
    pub fn len(&self) -> u64 {
        self.head.len() as u64 + self.tensors.iter().map(|t| t.len() as u64).sum::<u64>()
    }

    /// Whether the body is empty (never: a body has at least its prefix).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Every part in order, as slices.
    pub fn parts(&self) -> Vec<&[u8]> {
        std::iter::once(&self.head[..])
            .chain(self.tensors.iter().map(|t| &t[..]))
            .collect()
    }

    /// Writes the body on `send`.
    pub async fn write(&self, send: &mut iroh::endpoint::SendStream) -> Result<(), String> {
        for part in self.parts() {
            send.write_all(part).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The bytes broke the wire's rules (limits, a skeleton that does not fit the body).
    #[error(transparent)]
    Invalid(#[from] WireError),
    /// The stream ended or failed before the whole body arrived.
    #[error("the stream ended mid-body: {0}")]
    Closed(String),
}

/// How much of a tensor one read takes: each read is bounded by the stall limit, so a peer
/// that stops sending mid-body is noticed within it, whatever the body's size.
const READ_CHUNK: usize = 1 << 20;

/// Fills `buf` from `recv`, each [`READ_CHUNK`] within `stall`.
async fn read_within(
    recv: &mut RecvStream,
    buf: &mut [u8],
    stall: std::time::Duration,
) -> Result<(), ReadError> {
    for chunk in buf.chunks_mut(READ_CHUNK) {
        match tokio::time::timeout(stall, recv.read_exact(chunk)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ReadError::Closed(e.to_string())),
            Err(_) => {
                return Err(ReadError::Closed(format!(
                    "no byte for {stall:?} (the peer is lost)"
                )));
            }
        }
    }
    Ok(())
}

/// Reads a body of `body_len` bytes from `recv`: the skeleton (checked before any tensor byte
/// is allocated), then each tensor into a buffer of its own. A peer that sends nothing for
/// `stall` fails the read.
pub async fn read_body(
    recv: &mut RecvStream,
    body_len: u64,
    stall: std::time::Duration,
) -> Result<Value, ReadError> {
    if body_len < Body::PREFIX as u64 {
        return Err(WireError::Malformed(format!("a body of {body_len} bytes")).into());
    }
    let mut prefix = [0u8; Body::PREFIX];
    read_within(recv, &mut prefix, stall).await?;
    let len = Body::skeleton_len(prefix, body_len)?;
    let mut skeleton = vec![0u8; len];
    read_within(recv, &mut skeleton, stall).await?;
    let (skeleton, _) = Body::skeleton(&skeleton, body_len)?;
    let mut buffers = Vec::new();
    for slot in skeleton.tensors() {
        // Checked by `Body::skeleton`: the sizes fit in what the body has left.
        let len = byte_len_for(slot.dtype, &slot.shape).map_err(WireError::from)? as usize;
        let mut buf = BytesMut::zeroed(len);
        read_within(recv, &mut buf, stall).await?;
        buffers.push(buf.freeze());
    }
    let mut buffers = buffers.into_iter();
    Ok(fill(skeleton, &mut buffers))
}

/// The value of a checked skeleton with its tensors' bytes, in tree order.
fn fill(skeleton: Skeleton, buffers: &mut impl Iterator<Item = Bytes>) -> Value {
    match skeleton {
        Skeleton::None => Value::None,
        Skeleton::Bool(b) => Value::Bool(b),
        Skeleton::Int(i) => Value::Int(i),
        Skeleton::Float(f) => Value::Float(f),
        Skeleton::Str(s) => Value::Str(s),
        Skeleton::Bytes(b) => Value::Bytes(b),
        Skeleton::List(items) => Value::List(items.into_iter().map(|v| fill(v, buffers)).collect()),
        Skeleton::Map(items) => Value::Map(
            items
                .into_iter()
                .map(|(k, v)| (k, fill(v, buffers)))
                .collect(),
        ),
        Skeleton::Tensor(TensorSlot { dtype, shape }) => Value::Tensor(HostTensor {
            dtype,
            shape,
            // One buffer per slot was read above.
            data: buffers.next().unwrap_or_default(),
        }),
    }
}
