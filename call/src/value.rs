//! [`Value`]: what a function takes and returns, with tensors' bytes as [`Bytes`]; and how a
//! value is written to and read from a call's stream as a body (`tb_proto::call::Body`).
//!
//! Writing sends the skeleton then each tensor's bytes as they are (no copy, no hash: the
//! link is authenticated and encrypted, so the bytes arrive as sent). Reading checks the
//! skeleton's limits and that the tensors' sizes add up to the body before it allocates
//! anything, then reads each tensor into a buffer of its own.
//!
//! A large tensor to a peer on this host is not written on the stream at all: it is lent to
//! that peer (`Node::lend`) and the skeleton names the loan (`Lent`); the reader pulls it
//! over the pair's channel (`Node::pull_lent`), which on one host hands over the sender's
//! memfd (up to 16 MiB unsealed, copied into a pooled buffer of the reader's; larger ones
//! sealed, mapped without a copy): QUIC's throughput ceiling out of the way.
//!
//! A tensor in CUDA device memory ([`DeviceTensor`]) is always lent (`Node::lend_device`, to
//! a peer on any host), named in the skeleton with its device (`LentDevice`). A reader that
//! has that device pulls it there (`Node::pull_lent_to`): on one host device to device by CUDA
//! IPC, with no host copy and no hash; elsewhere through staging. A reader without it pulls it
//! into host memory, and its value holds a host tensor.

use bytes::{Bytes, BytesMut};
use iroh::EndpointId;
use tb_node::RequestRecv;
use tb_proto::{
    ChannelKind, DType, LEND_PREFIX, TensorName, byte_len_for,
    call::{Body, CallError as WireError, LentSlot, TensorSlot, Value as Skeleton},
};

/// Tensors of at least this many bytes go to a peer on this host as loans (pulled over the
/// pair's channel), not on the call's stream, which on one host is a connection of the pair's
/// same-host socket. Echo calls from Rust between two processes (2-core VM), lent against on
/// the socket, one caller / 64 callers, calls/s: 64 KiB 4,594 / 12,795 against 9,200 /
/// 27,309; 256 KiB 3,961 / 5,379 against 4,475 / 9,647; 512 KiB 3,260 / 3,651 against 2,430
/// / 5,272 (`add_one`: 1,828 / 1,481 against 2,600 / 4,213); 1 MiB 1,672 / 1,931 against 1,229
/// / 3,024; 4 MiB 614 / 452 against 342 / 586. A loan costs a pull's round trip and a copy
/// out of the lender's memfd; the socket, a copy into the kernel and one out of it, each way.
pub const LEND_MIN: usize = 1 << 20;

/// A tensor in host memory, as calls carry it: element type, C-contiguous shape, bytes.
#[derive(Clone)]
pub struct HostTensor {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// `product(shape) * itemsize` bytes.
    pub data: Bytes,
    /// The node tensor `data` is the bytes of, when it came from one (received as a loan,
    /// or made by [`HostTensor::from_node`]): lent again as it is, viewed without a copy.
    held: Option<tb_node::Tensor>,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.len())
            .field("held", &self.held.is_some())
            .finish()
    }
}

impl PartialEq for HostTensor {
    fn eq(&self, other: &Self) -> bool {
        (self.dtype, &self.shape, &self.data) == (other.dtype, &other.shape, &other.data)
    }
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
        Ok(HostTensor {
            dtype,
            shape,
            data,
            held: None,
        })
    }

    /// The bytes of a node tensor in host memory, shared (no copy). A tensor made with
    /// [`tb_node::Tensor::copy_from`] sits in a memfd, so it is lent to a peer on this host as
    /// it is; so is one received as a loan, which a handler can return unchanged.
    pub fn from_node(tensor: tb_node::Tensor) -> Result<Self, WireError> {
        let data = tensor.host_data().cloned().ok_or_else(|| {
            WireError::Malformed("a device tensor: use DeviceTensor::from_node".into())
        })?;
        Ok(HostTensor {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            data,
            held: Some(tensor),
        })
    }

    /// The node tensor these bytes are, when they came from one ([`from_node`](Self::from_node),
    /// or received as a loan): what a private, writable view is made from without a copy.
    pub fn node_tensor(&self) -> Option<&tb_node::Tensor> {
        self.held.as_ref()
    }

    /// This tensor as a node tensor to lend: the one it came from, or a copy into a memfd
    /// (hashed on the way, on every core).
    fn to_node(&self) -> Result<tb_node::Tensor, tb_node::Error> {
        match &self.held {
            Some(tensor) => Ok(tensor.clone()),
            None => tb_node::Tensor::copy_from(self.dtype, self.shape.clone(), &self.data),
        }
    }
}

/// A tensor in CUDA device memory, as calls carry it: lent to the peer it is sent to, which
/// pulls it onto its own device of the same ordinal (by CUDA IPC on one host).
#[derive(Clone)]
pub struct DeviceTensor {
    dtype: DType,
    shape: Vec<u64>,
    buffer: tb_node::DeviceBuffer,
    /// The node tensor `buffer` is, when it came from one (received): lent again as it is.
    held: Option<tb_node::Tensor>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.buffer.len())
            .field("device", &self.buffer.ordinal())
            .finish()
    }
}

/// Two device tensors are equal when they are the same memory (comparing their bytes would
/// copy both to the host).
impl PartialEq for DeviceTensor {
    fn eq(&self, other: &Self) -> bool {
        (self.dtype, &self.shape) == (other.dtype, &other.shape)
            && self.buffer.ordinal() == other.buffer.ordinal()
            && self.buffer.device_ptr() == other.buffer.device_ptr()
    }
}

impl DeviceTensor {
    /// A `dtype` tensor of `shape` in `buffer`, checked to be its size. Nothing is hashed: on
    /// one host a peer copies it by CUDA IPC, which checks no hash; it is hashed only if it
    /// must cross the network.
    pub fn new(
        dtype: DType,
        shape: Vec<u64>,
        buffer: tb_node::DeviceBuffer,
    ) -> Result<Self, WireError> {
        let want = byte_len_for(dtype, &shape)?;
        if want != buffer.len() as u64 {
            return Err(WireError::Malformed(format!(
                "a {} tensor of shape {shape:?} is {want} bytes, the cuda:{} buffer {}",
                dtype.name(),
                buffer.ordinal(),
                buffer.len()
            )));
        }
        Ok(DeviceTensor {
            dtype,
            shape,
            buffer,
            held: None,
        })
    }

    /// A node tensor in device memory, shared (no copy).
    pub fn from_node(tensor: tb_node::Tensor) -> Result<Self, WireError> {
        let buffer = tensor.device_buffer().cloned().ok_or_else(|| {
            WireError::Malformed("a host tensor: use HostTensor::from_node".into())
        })?;
        Ok(DeviceTensor {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            buffer,
            held: Some(tensor),
        })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Dimensions.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The device memory.
    pub fn buffer(&self) -> &tb_node::DeviceBuffer {
        &self.buffer
    }

    /// The CUDA device ordinal.
    pub fn ordinal(&self) -> usize {
        self.buffer.ordinal()
    }

    /// The node tensor these bytes are, when they came from one (received).
    pub fn node_tensor(&self) -> Option<&tb_node::Tensor> {
        self.held.as_ref()
    }

    /// Lends it to `peer` through `node`.
    fn lend(
        &self,
        node: &tb_node::Node,
        peer: EndpointId,
        ttl: std::time::Duration,
    ) -> Result<tb_node::Lent, tb_node::Error> {
        match &self.held {
            Some(tensor) => node.lend(peer, tensor.clone(), ttl),
            None => {
                let (dtype, shape) = (self.dtype, self.shape.clone());
                node.lend_device(peer, dtype, shape, self.buffer.clone(), ttl)
            }
        }
    }

    /// A copy of the bytes in host memory (blocks while copying).
    fn to_host(&self) -> Result<HostTensor, WireError> {
        let bytes = self.buffer.to_host().map_err(|e| {
            WireError::Malformed(format!("copying a device tensor to host memory: {e}"))
        })?;
        HostTensor::new(self.dtype, self.shape.clone(), bytes)
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
    /// A tensor in host memory.
    Tensor(HostTensor),
    /// A tensor in CUDA device memory.
    Device(DeviceTensor),
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
    /// This value with its device tensors copied to host memory (blocks while copying): for a
    /// caller that writes results out, such as `tb call`.
    pub fn into_host(self) -> Result<Value, WireError> {
        Ok(match self {
            Value::Device(t) => Value::Tensor(t.to_host()?),
            Value::List(items) => Value::List(
                (items.into_iter())
                    .map(Value::into_host)
                    .collect::<Result<_, _>>()?,
            ),
            Value::Map(items) => Value::Map(
                (items.into_iter())
                    .map(|(k, v)| Ok((k, v.into_host()?)))
                    .collect::<Result<_, WireError>>()?,
            ),
            other => other,
        })
    }

    /// The tensor, when this value is one.
    pub fn as_tensor(&self) -> Option<&HostTensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The skeleton and the tensors' bytes in tree order; tensors `lender` lends are named
    /// in the skeleton instead.
    fn split(&self, lender: Option<&mut Lender<'_>>) -> Result<(Skeleton, Vec<Bytes>), WireError> {
        let mut parts = Vec::new();
        let skeleton = self.skeleton(Some(&mut parts), lender)?;
        Ok((skeleton, parts))
    }

    /// The skeleton, each tensor's bytes added to `parts` in tree order, or named in it as
    /// lent where `lender` lends. `parts` `None`: only the skeleton, to check it (no bytes
    /// are gathered, and a device tensor is named as a loan would name it: never copied to
    /// the host for a check).
    fn skeleton(
        &self,
        mut parts: Option<&mut Vec<Bytes>>,
        mut lender: Option<&mut Lender<'_>>,
    ) -> Result<Skeleton, WireError> {
        Ok(match self {
            Value::None => Skeleton::None,
            Value::Bool(b) => Skeleton::Bool(*b),
            Value::Int(i) => Skeleton::Int(*i),
            Value::Float(f) => Skeleton::Float(*f),
            Value::Str(s) => Skeleton::Str(s.clone()),
            Value::Bytes(b) => Skeleton::Bytes(b.clone()),
            Value::List(items) => Skeleton::List(
                items
                    .iter()
                    .map(|v| v.skeleton(parts.as_deref_mut(), lender.as_deref_mut()))
                    .collect::<Result<_, _>>()?,
            ),
            Value::Map(items) => Skeleton::Map(
                items
                    .iter()
                    .map(|(k, v)| {
                        let v = v.skeleton(parts.as_deref_mut(), lender.as_deref_mut())?;
                        Ok((k.clone(), v))
                    })
                    .collect::<Result<_, WireError>>()?,
            ),
            Value::Named { name, version } => Skeleton::Named {
                name: name.clone(),
                version: *version,
            },
            Value::Tensor(t) => {
                let slot = TensorSlot {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                };
                if let Some(name) = lender.and_then(|l| l.lend(t)) {
                    return Ok(Skeleton::Lent { slot, name });
                }
                if let Some(parts) = parts {
                    parts.push(t.data.clone());
                }
                Skeleton::Tensor(slot)
            }
            Value::Device(t) => {
                let slot = TensorSlot {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                };
                let device = u32::try_from(t.ordinal()).unwrap_or(u32::MAX);
                if let Some(name) = lender.and_then(|l| l.lend_device(t)) {
                    return Ok(Skeleton::LentDevice { slot, name, device });
                }
                let Some(parts) = parts else {
                    // A check: named as its loan will be (a name of the same length).
                    let name = TensorName::new(format!("{LEND_PREFIX}{:032x}", 0))
                        .map_err(|e| WireError::Malformed(e.to_string()))?;
                    return Ok(Skeleton::LentDevice { slot, name, device });
                };
                // Nothing to lend through (or the loan failed): its bytes on the stream.
                parts.push(t.to_host()?.data);
                Skeleton::Tensor(slot)
            }
        })
    }
}

/// Lends a value's large tensors to the peer it is written to, when that peer is on this host
/// (the pair's channel is shm): the loans made, held by whoever holds this until the peer has
/// pulled them (or no longer needs them).
pub struct Lender<'a> {
    node: &'a tb_node::Node,
    peer: EndpointId,
    ttl: std::time::Duration,
    /// Whether the pair's channel is shm (nothing is lent otherwise).
    on_host: bool,
    /// The loans made.
    pub loans: Vec<tb_node::Lent>,
}

impl Lender<'_> {
    /// The bytes of the tensors lent so far.
    pub fn lent_bytes(&self) -> u64 {
        self.loans.iter().map(|l| l.meta().byte_len).sum()
    }
}

impl<'a> Lender<'a> {
    /// A lender to `peer`, whose loans last at most `ttl`.
    pub fn new(node: &'a tb_node::Node, peer: EndpointId, ttl: std::time::Duration) -> Self {
        Lender {
            node,
            peer,
            ttl,
            on_host: node.channel_to(&peer) == ChannelKind::Shm,
            loans: Vec::new(),
        }
    }

    /// Lends `t` when it is large and the peer is on this host: its private name. `None`:
    /// written on the stream (small, another host, or the loan failed, which costs speed only).
    fn lend(&mut self, t: &HostTensor) -> Option<TensorName> {
        if !self.on_host || t.data.len() < LEND_MIN {
            return None;
        }
        let lent = t
            .to_node()
            .and_then(|tensor| self.node.lend(self.peer, tensor, self.ttl));
        self.keep(lent)
    }

    /// Lends the device tensor `t` (to a peer on any host: its bytes are in device memory,
    /// and the peer's pull moves them device to device on one host, through staging
    /// elsewhere): its private name. `None`: the loan failed; its bytes go on the stream.
    fn lend_device(&mut self, t: &DeviceTensor) -> Option<TensorName> {
        let lent = t.lend(self.node, self.peer, self.ttl);
        self.keep(lent)
    }

    /// Keeps a loan made (its name, to write in the skeleton); a failed one costs speed only:
    /// the tensor's bytes go on the stream.
    fn keep(&mut self, lent: Result<tb_node::Lent, tb_node::Error>) -> Option<TensorName> {
        match lent {
            Ok(lent) => {
                let name = lent.name().clone();
                self.loans.push(lent);
                Some(name)
            }
            Err(e) => {
                tracing::debug!(%e, "a tensor goes on the call's stream, not lent");
                None
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
        Self::lending(value, None)
    }

    /// Checks that `value` fits the wire's limits (depth, counts, skeleton size) as
    /// [`new`](Self::new) would, without gathering any bytes: a device tensor is not copied to
    /// the host for it.
    pub fn check(value: &Value) -> Result<(), WireError> {
        let skeleton = value.skeleton(None, None)?;
        Body::head(&skeleton)?;
        Ok(())
    }

    /// Encodes `value`, its large tensors lent to the lender's peer where it lends (see
    /// [`Lender`]).
    pub fn lending(value: &Value, lender: Option<&mut Lender<'_>>) -> Result<Self, WireError> {
        let (skeleton, tensors) = value.split(lender)?;
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
    pub async fn write(&self, send: &mut tb_node::RequestSend) -> Result<(), String> {
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
    /// A tensor the sender lent could not be pulled (or was not what the skeleton said).
    #[error("a lent tensor: {0}")]
    Lent(String),
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
    recv: &mut RequestRecv,
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

/// A body read up to its lent tensors: the checked skeleton and the bytes of the tensors that
/// came on the stream. [`into_value`](Self::into_value) pulls the lent ones.
#[derive(Debug)]
pub struct ReadBody {
    skeleton: Skeleton,
    buffers: Vec<Bytes>,
}

/// Reads a body of `body_len` bytes from `recv`: the skeleton (checked before any tensor byte
/// is allocated), then each tensor into a buffer of its own. A peer not heard from within
/// `stall` fails the read.
pub async fn read_body(
    recv: &mut RequestRecv,
    body_len: u64,
    stall: Stall<'_>,
) -> Result<ReadBody, ReadError> {
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
    Ok(ReadBody { skeleton, buffers })
}

impl ReadBody {
    /// The bytes of the tensors the body names as lent (to pull from its sender).
    pub fn lent_bytes(&self) -> u64 {
        let slots = self.skeleton.lent().into_iter();
        slots
            .filter_map(|l| byte_len_for(l.slot.dtype, &l.slot.shape).ok())
            .sum()
    }

    /// Whether reading the value moves tensor bytes beyond the body's: a lent tensor to
    /// pull or one passed by name to get.
    pub fn pulls(&self) -> bool {
        !self.skeleton.lent().is_empty() || self.skeleton.names_tensors()
    }

    /// The value, each lent tensor pulled from `sender` through `node` (over the pair's
    /// channel) and checked to be the dtype and shape the skeleton says.
    pub async fn into_value(
        self,
        node: &tb_node::Node,
        sender: EndpointId,
    ) -> Result<Value, ReadError> {
        let mut lent = Vec::new();
        for LentSlot { slot, name, device } in self.skeleton.lent() {
            // Boxed: the pull's future is about 30 KB, which would otherwise sit in every
            // call's server future (and be copied with it) though few calls lend tensors.
            let tensor = match device {
                Some(ordinal) => Box::pin(pull_lent_to_device(node, sender, name, ordinal)).await,
                None => Box::pin(node.pull_lent(sender, name)).await,
            };
            let tensor = tensor.map_err(|e| ReadError::Lent(e.to_string()))?;
            if tensor.dtype() != slot.dtype || tensor.shape() != slot.shape.as_slice() {
                return Err(ReadError::Lent(format!(
                    "\"{name}\" is a {} tensor of shape {:?}, the skeleton says {} {:?}",
                    tensor.dtype().name(),
                    tensor.shape(),
                    slot.dtype.name(),
                    slot.shape
                )));
            }
            let value = match tensor.device_buffer() {
                Some(_) => DeviceTensor::from_node(tensor).map(Value::Device),
                None => HostTensor::from_node(tensor).map(Value::Tensor),
            };
            lent.push(value.map_err(|e| ReadError::Lent(e.to_string()))?);
        }
        let (mut buffers, mut lent) = (self.buffers.into_iter(), lent.into_iter());
        Ok(fill(self.skeleton, &mut buffers, &mut lent))
    }
}

/// Pulls a device tensor lent as `name` onto this node's device `ordinal` (the lender's), or
/// into host memory when this node has no such device.
async fn pull_lent_to_device(
    node: &tb_node::Node,
    sender: EndpointId,
    name: &TensorName,
    ordinal: u32,
) -> Result<tb_node::Tensor, tb_node::Error> {
    let device = tb_node::Device::Cuda(ordinal as usize);
    match node.pull_lent_to(sender, name, device).await {
        // Checked before any traffic: the loan is still there to pull to the host.
        Err(tb_node::Error::DeviceUnavailable(_)) => node.pull_lent(sender, name).await,
        pulled => pulled,
    }
}

/// The value of a checked skeleton with its tensors' bytes and its lent tensors (pulled), each
/// in tree order.
fn fill(
    skeleton: Skeleton,
    buffers: &mut impl Iterator<Item = Bytes>,
    lent: &mut impl Iterator<Item = Value>,
) -> Value {
    match skeleton {
        Skeleton::None => Value::None,
        Skeleton::Bool(b) => Value::Bool(b),
        Skeleton::Int(i) => Value::Int(i),
        Skeleton::Float(f) => Value::Float(f),
        Skeleton::Str(s) => Value::Str(s),
        Skeleton::Bytes(b) => Value::Bytes(b),
        Skeleton::List(items) => {
            Value::List(items.into_iter().map(|v| fill(v, buffers, lent)).collect())
        }
        Skeleton::Map(items) => Value::Map(
            items
                .into_iter()
                .map(|(k, v)| (k, fill(v, buffers, lent)))
                .collect(),
        ),
        Skeleton::Named { name, version } => Value::Named { name, version },
        Skeleton::Tensor(TensorSlot { dtype, shape }) => Value::Tensor(HostTensor {
            dtype,
            shape,
            // One buffer per slot was read above.
            data: buffers.next().unwrap_or_default(),
            held: None,
        }),
        // One pulled tensor per lent slot (checked against it).
        Skeleton::Lent { slot, .. } | Skeleton::LentDevice { slot, .. } => {
            lent.next().unwrap_or(Value::Tensor(HostTensor {
                dtype: slot.dtype,
                shape: slot.shape,
                data: Bytes::new(),
                held: None,
            }))
        }
    }
}

/// `value` with every [`Value::Named`] replaced by the tensor it names, got from the cluster
/// through `node` (into host memory, unless this node holds it on a device itself).
pub async fn resolve(node: &tb_node::Node, value: Value) -> Result<Value, tb_node::Error> {
    let mut value = value;
    let mut named = Vec::new();
    collect_named(&mut value, &mut named);
    for slot in named {
        let Value::Named { name, version } = std::mem::replace(slot, Value::None) else {
            continue;
        };
        let pulled = match version {
            // Boxed, as a lent tensor's pull is (`into_value`): a get's future is about 9 KB.
            Some(v) => Box::pin(node.get_version(name.as_str(), v)).await?,
            None => Box::pin(node.get(name.as_str())).await?,
        };
        let tensor = pulled.buffer;
        let bad = |e: WireError| tb_node::Error::InvalidTensor(format!("\"{name}\": {e}"));
        *slot = match tensor.device_buffer() {
            // Held on a device by this node itself.
            Some(_) => Value::Device(DeviceTensor::from_node(tensor).map_err(bad)?),
            None => Value::Tensor(HostTensor::from_node(tensor).map_err(bad)?),
        };
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

#[cfg(test)]
mod tests {
    use tb_proto::call::MAX_VALUE_DEPTH;

    use super::*;

    #[test]
    fn a_check_agrees_with_encoding_and_gathers_no_bytes() {
        let t = HostTensor::new(DType::U8, vec![3], vec![1u8, 2, 3]).expect("tensor");
        let fine = Value::Map(vec![(
            "x".into(),
            Value::List(vec![t.into(), Value::Int(1)]),
        )]);
        assert!(Encoded::check(&fine).is_ok());
        let encoded = Encoded::new(&fine).expect("encodes");
        assert_eq!(encoded.tensors, [Bytes::from_static(&[1, 2, 3])]);
        let mut deep = Value::None;
        for _ in 0..MAX_VALUE_DEPTH {
            deep = Value::List(vec![deep]);
        }
        assert!(matches!(Encoded::check(&deep), Err(WireError::TooDeep)));
        assert!(matches!(Encoded::new(&deep), Err(WireError::TooDeep)));
    }
}
