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
    DType, TensorName, byte_len_for,
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
    /// A tensor in the cluster by name and version (the newest when `None`): a server gets
    /// it before its handler runs, which sees a [`Value::Tensor`].
    Named {
        /// The tensor's name.
        name: TensorName,
        /// Its version, or the newest.
        version: Option<u64>,
    },
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
            Value::Named { name, version } => Skeleton::Named {
                name: name.clone(),
                version: *version,
            },
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

/// How long a read may see no byte, and how to tell a busy link from a lost peer: when
/// `stall` passes with nothing for this stream, the read goes on if the link as a whole
/// received something meanwhile (`progress`, e.g. the connection's received bytes: many
/// results share one link, and one may wait while others move), and fails otherwise.
#[derive(Clone, Copy)]
pub struct Stall<'a> {
    /// The longest wait without a byte for this stream.
    pub after: std::time::Duration,
    /// A counter that grows while the peer is heard from; `None`: none, the first stall
    /// fails the read.
    pub progress: Option<&'a (dyn Fn() -> u64 + Sync)>,
}

/// Fills `buf` from `recv` within `stall`.
async fn read_within(
    recv: &mut RecvStream,
    buf: &mut [u8],
    stall: Stall<'_>,
) -> Result<(), ReadError> {
    let heard = || stall.progress.map(|p| p());
    let mut seen = heard();
    let mut off = 0;
    while off < buf.len() {
        // `read` is cancel-safe: a timeout loses no byte.
        match tokio::time::timeout(stall.after, recv.read(&mut buf[off..])).await {
            Ok(Ok(Some(n))) => off += n,
            Ok(Ok(None)) => return Err(ReadError::Closed("the stream ended mid-body".into())),
            Ok(Err(e)) => return Err(ReadError::Closed(e.to_string())),
            Err(_) => {
                let now = heard();
                if now.is_none() || now == seen {
                    return Err(ReadError::Closed(format!(
                        "nothing heard from the peer for {:?} (it is lost)",
                        stall.after
                    )));
                }
                seen = now;
            }
        }
    }
    Ok(())
}

/// Reads a body of `body_len` bytes from `recv`: the skeleton (checked before any tensor byte
/// is allocated), then each tensor into a buffer of its own. A peer not heard from within
/// `stall` fails the read.
pub async fn read_body(
    recv: &mut RecvStream,
    body_len: u64,
    stall: Stall<'_>,
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
        Skeleton::Named { name, version } => Value::Named { name, version },
        Skeleton::Tensor(TensorSlot { dtype, shape }) => Value::Tensor(HostTensor {
            dtype,
            shape,
            // One buffer per slot was read above.
            data: buffers.next().unwrap_or_default(),
        }),
    }
}

/// `value` with every [`Value::Named`] replaced by the tensor it names, got from the cluster
/// through `node` (host tensors only).
pub async fn resolve(node: &tb_node::Node, value: Value) -> Result<Value, tb_node::Error> {
    let mut value = value;
    let mut named = Vec::new();
    collect_named(&mut value, &mut named);
    for slot in named {
        let Value::Named { name, version } = std::mem::replace(slot, Value::None) else {
            continue;
        };
        let pulled = match version {
            Some(v) => node.get_version(name.as_str(), v).await?,
            None => node.get(name.as_str()).await?,
        };
        let tensor = pulled.buffer;
        let data = tensor.host_data().cloned().ok_or_else(|| {
            tb_node::Error::InvalidTensor(format!(
                "\"{name}\" is a device tensor: calls carry host tensors"
            ))
        })?;
        *slot = Value::Tensor(HostTensor {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            data,
        });
    }
    Ok(value)
}

fn collect_named<'a>(value: &'a mut Value, out: &mut Vec<&'a mut Value>) {
    match value {
        Value::Named { .. } => out.push(value),
        Value::List(items) => items.iter_mut().for_each(|v| collect_named(v, out)),
        Value::Map(items) => items.iter_mut().for_each(|(_, v)| collect_named(v, out)),
        _ => {}
    }
}
