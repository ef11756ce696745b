//! Remote function calls on the pooled data link: [`DataRequest::Call`](crate::DataRequest::Call)
//! and what follows it on the stream.
//!
//! A call is one bidirectional `tb/data/1` stream:
//! 1. the caller sends `Call { function, head }`, and, when the arguments' [body](Body) is at
//!    most [`MAX_INLINE_ARGS`] bytes, the body right after it (one round trip for a small call);
//! 2. the server answers [`DataResponse::Accepted`](crate::DataResponse::Accepted) with its
//!    load, or `DataResponse::Error` (`Busy`: over its concurrency and queue limits;
//!    `NotFound`: it serves no such function; `Unauthorized`: read-only callers refused)
//!    **before it reads any argument byte**; a caller with a larger body writes it only once
//!    accepted, so a busy server is sent nothing large;
//! 3. the server sends [`CallFrame`]s: an `Item` (its body follows) per result, then `Done`,
//!    or `Failed`; `Alive` every [`ALIVE_INTERVAL_MS`] while the call waits or runs. A unary call has one item; a streaming call as many as it produces, each
//!    only while the caller has granted [credit](CallUp::Credit) for it.
//!
//! The caller cancels by stopping its receive side (QUIC `STOP_SENDING`): the server drops a
//! queued call and cancels a running one. The deadline travels as the time left when the
//! call was sent ([`CallHead::deadline_ms`]).
//!
//! Values are [`Value`] trees: numbers, strings, bytes, lists, maps and tensors, bounded in
//! depth, count and size. Nothing in them is code: a decoder builds data, never objects.
//! A body is `[u32 LE skeleton length][postcard Value][the tensors' bytes, in tree order]`.
//!
//! Servers advertise a function as a holder mark on the registry entry
//! [`advertised_as`]`(function)` at version = their epoch: brokers replicate it like any mark,
//! and answer [`CtlRequest::Servers`](crate::CtlRequest::Servers) with the live members whose
//! current epoch holds it, so a node that dies or restarts stops being offered with no
//! unregister message.

use serde::{Deserialize, Serialize};

use crate::{DType, MetaError, TensorName, byte_len_for};

/// Registry entries under this prefix are function advertisements, not tensors.
pub const FUNCTION_PREFIX: &str = ".tb/fn/";

/// A body of at most this many bytes is sent with the call, before the server accepts it.
pub const MAX_INLINE_ARGS: u64 = 64 << 10;

/// The largest skeleton (the [`Value`] tree without the tensors' bytes) a node reads.
pub const MAX_SKELETON: u32 = 1 << 20;

/// The deepest a [`Value`] tree may nest.
pub const MAX_VALUE_DEPTH: usize = 32;

/// The most nodes (values of any kind) a [`Value`] tree may have.
pub const MAX_VALUE_NODES: usize = 1 << 16;

/// The most tensors one body may carry.
pub const MAX_BODY_TENSORS: usize = 4096;

/// The longest remote type, message or traceback a [`RemoteFailure`] carries (longer ones
/// are cut by the server).
pub const MAX_FAILURE_TEXT: usize = 16 << 10;

/// The most credit one [`CallUp::Credit`] grants.
pub const MAX_CREDIT: u32 = 1 << 16;

/// The registry name a server's advertisement of `function` is filed under, or `None` when
/// the prefixed name would be too long.
pub fn advertised_as(function: &TensorName) -> Option<TensorName> {
    TensorName::new(format!("{FUNCTION_PREFIX}{}", function.as_str())).ok()
}

/// The function an advertisement entry stands for, or `None` for a tensor's entry.
pub fn function_of(entry: &TensorName) -> Option<TensorName> {
    let rest = entry.as_str().strip_prefix(FUNCTION_PREFIX)?;
    TensorName::new(rest).ok()
}

/// What a caller says about a call, with `DataRequest::Call`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallHead {
    /// Milliseconds left before the caller gives up, as it sent the call (`None`: none).
    pub deadline_ms: Option<u64>,
    /// Bytes of the arguments' [`Body`] that follow (before acceptance when at most
    /// [`MAX_INLINE_ARGS`], after it otherwise).
    pub body_len: u64,
    /// Whether the caller expects a stream of items (it then grants [`CallUp::Credit`]).
    pub stream: bool,
    /// The item index a resumed stream starts from (0 for a new call).
    pub start: u64,
}

impl CallHead {
    /// Checks the head against the serving node's largest tensor.
    pub fn validate(&self, max_body: u64) -> Result<(), CallError> {
        if self.body_len > max_body {
            return Err(CallError::TooLarge {
                what: "arguments",
                len: self.body_len,
                max: max_body,
            });
        }
        if !self.stream && self.start != 0 {
            return Err(CallError::Malformed(
                "a unary call cannot start past item 0".into(),
            ));
        }
        Ok(())
    }

    /// Whether the arguments are sent before the server accepts the call.
    pub fn inline(&self) -> bool {
        self.body_len <= MAX_INLINE_ARGS
    }
}

/// A server's load, reported when it accepts a call and when one ends: what callers choose
/// the less loaded of two servers by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    /// Calls of the function running now.
    pub running: u32,
    /// Calls of the function waiting for a slot.
    pub queued: u32,
    /// How many run at once.
    pub concurrency: u32,
}

impl Load {
    /// Outstanding calls per slot, in thousandths (the lower, the better).
    pub fn score(&self) -> u64 {
        let work = u64::from(self.running) + u64::from(self.queued);
        work * 1000 / u64::from(self.concurrency.max(1))
    }
}

/// What the server sends on a call's stream after accepting it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CallFrame {
    /// A result: its [`Body`] of `body_len` bytes follows. Unary calls send one, index 0.
    Item {
        /// Its index in the stream.
        index: u64,
        /// Bytes of the body that follows.
        body_len: u64,
    },
    /// The call ended well; nothing follows.
    Done {
        /// The server's load after the call.
        load: Load,
    },
    /// The call failed on the server; nothing follows.
    Failed(RemoteFailure),
    /// The server is alive and the call still queued or running: sent every
    /// [`ALIVE_INTERVAL_MS`] while the caller waits, so a caller that hears nothing for a few
    /// intervals knows the server is lost (a killed process says nothing; QUIC's own idle
    /// timeout is far longer).
    Alive,
    /// The caller of a bidirectional call may send this many more inputs
    /// ([`CallUp::Input`]); a call that takes no inputs is never granted any.
    InputCredit(u32),
}

/// How often a server tells a waiting caller it is alive ([`CallFrame::Alive`]).
pub const ALIVE_INTERVAL_MS: u64 = 500;

/// How long a caller waits for any frame of a call before it counts the server as lost.
pub const LIVENESS_TIMEOUT_MS: u64 = 4 * ALIVE_INTERVAL_MS;

/// What a caller sends after the arguments of a streaming call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CallUp {
    /// The server may send this many more items (at most [`MAX_CREDIT`] per frame).
    Credit(u32),
    /// An input item of a bidirectional call: its [`Body`] of `body_len` bytes follows. Sent
    /// only within the input credit the server granted ([`CallFrame::InputCredit`]).
    Input {
        /// Bytes of the body that follows.
        body_len: u64,
    },
    /// No input follows: the handler's inputs end here.
    InputEnd,
}

/// Inputs a server of a bidirectional call holds at most before its handler takes them: its
/// first [`CallFrame::InputCredit`] grants this many, and each one taken grants one more.
pub const INPUT_WINDOW: u32 = 2;

/// Why a call failed on its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FailureKind {
    /// The handler raised (returned an error).
    Raised,
    /// The deadline passed on the server.
    DeadlineExceeded,
    /// The arguments could not be read or did not fit the function.
    BadArguments,
    /// The server stopped before the call ended (shutting down, unserved).
    Stopped,
}

/// A handler's failure as the caller gets it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFailure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// The remote exception's type (`ValueError`, `my.module.Error`), or a Rust error's kind.
    pub remote_type: String,
    /// Its message.
    pub message: String,
    /// Its traceback, as the server formatted it (may be empty).
    pub traceback: String,
}

impl RemoteFailure {
    /// A failure with each text cut to [`MAX_FAILURE_TEXT`] bytes (at a char boundary).
    pub fn new(
        kind: FailureKind,
        remote_type: impl Into<String>,
        message: impl Into<String>,
        traceback: impl Into<String>,
    ) -> Self {
        RemoteFailure {
            kind,
            remote_type: cut(remote_type.into()),
            message: cut(message.into()),
            traceback: cut(traceback.into()),
        }
    }

    /// Checks the text limits on a failure that came from the network.
    pub fn validate(&self) -> Result<(), CallError> {
        let longest = [&self.remote_type, &self.message, &self.traceback]
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(0);
        match longest > MAX_FAILURE_TEXT {
            true => Err(CallError::TooLarge {
                what: "failure text",
                len: longest as u64,
                max: MAX_FAILURE_TEXT as u64,
            }),
            false => Ok(()),
        }
    }
}

fn cut(mut text: String) -> String {
    if text.len() > MAX_FAILURE_TEXT {
        let mut end = MAX_FAILURE_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// A tensor in a [`Value`] tree: its bytes follow the skeleton, in tree order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlot {
    /// Element type.
    pub dtype: DType,
    /// Dimensions (at most [`MAX_RANK`](crate::MAX_RANK)).
    pub shape: Vec<u64>,
}

/// An argument or result: plain data and tensors, never code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Value {
    /// Nothing (Python's `None`).
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
    Bytes(#[serde(with = "serde_bytes")] Vec<u8>),
    /// An ordered list (Python lists and tuples).
    List(Vec<Value>),
    /// String-keyed map, in the sender's order.
    Map(Vec<(String, Value)>),
    /// A tensor, whose bytes follow the skeleton.
    Tensor(TensorSlot),
    /// A tensor already in the cluster, by name (and version; the newest when `None`): the
    /// server gets it from any holder before its handler runs. Nothing follows the skeleton
    /// for it.
    Named {
        /// The tensor's name.
        name: TensorName,
        /// Its version (at least 1), or the newest.
        version: Option<u64>,
    },
    /// A tensor the sender lent to the receiver under a private name (under
    /// [`LEND_PREFIX`](crate::LEND_PREFIX)): the receiver pulls it from the sender over the
    /// pair's channel (on one host, the sender's sealed memfd, with no copy). Nothing follows
    /// the skeleton for it.
    Lent {
        /// Element type and dimensions, which the pulled tensor must have.
        slot: TensorSlot,
        /// The private name to pull.
        name: TensorName,
    },
    /// A tensor in the sender's CUDA device memory, lent like [`Value::Lent`]: the receiver
    /// pulls it into memory on its own device `device` (the sender's ordinal) when it has
    /// that device, device to device by CUDA IPC on one host, else through staging; a
    /// receiver without that device pulls it into host memory. Nothing follows the skeleton
    /// for it.
    LentDevice {
        /// Element type and dimensions, which the pulled tensor must have.
        slot: TensorSlot,
        /// The private name to pull.
        name: TensorName,
        /// The CUDA ordinal the tensor is on at the sender.
        device: u32,
    },
}

/// A tensor the sender lent ([`Value::Lent`] or [`Value::LentDevice`]), as the receiver
/// pulls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LentSlot<'a> {
    /// Element type and dimensions.
    pub slot: &'a TensorSlot,
    /// The private name to pull.
    pub name: &'a TensorName,
    /// The sender's CUDA ordinal, for a device tensor.
    pub device: Option<u32>,
}

/// What a body's skeleton holds, once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Values in the tree.
    pub nodes: usize,
    /// Tensors in the tree.
    pub tensors: usize,
    /// The tensors' bytes together: what follows the skeleton.
    pub tensor_bytes: u64,
}

impl Value {
    /// Checks depth, node and tensor counts and each tensor's shape: what follows the
    /// skeleton, so the reader knows how many bytes to expect before reading any.
    pub fn validate(&self) -> Result<Shape, CallError> {
        let mut shape = Shape {
            nodes: 0,
            tensors: 0,
            tensor_bytes: 0,
        };
        // Depth-first with an explicit stack: a hostile tree cannot overflow ours.
        let mut stack: Vec<(&Value, usize)> = vec![(self, 1)];
        while let Some((value, depth)) = stack.pop() {
            shape.nodes += 1;
            if depth > MAX_VALUE_DEPTH {
                return Err(CallError::TooDeep);
            }
            if shape.nodes > MAX_VALUE_NODES {
                return Err(CallError::TooMany {
                    what: "values",
                    max: MAX_VALUE_NODES,
                });
            }
            match value {
                Value::List(items) => stack.extend(items.iter().map(|v| (v, depth + 1))),
                Value::Map(items) => stack.extend(items.iter().map(|(_, v)| (v, depth + 1))),
                Value::Tensor(slot) => {
                    shape.tensors += 1;
                    if shape.tensors > MAX_BODY_TENSORS {
                        return Err(CallError::TooMany {
                            what: "tensors",
                            max: MAX_BODY_TENSORS,
                        });
                    }
                    let len = byte_len_for(slot.dtype, &slot.shape)?;
                    shape.tensor_bytes = shape
                        .tensor_bytes
                        .checked_add(len)
                        .ok_or(CallError::Meta(MetaError::Overflow))?;
                }
                Value::Lent { slot, name } | Value::LentDevice { slot, name, .. } => {
                    shape.tensors += 1;
                    if shape.tensors > MAX_BODY_TENSORS {
                        return Err(CallError::TooMany {
                            what: "tensors",
                            max: MAX_BODY_TENSORS,
                        });
                    }
                    byte_len_for(slot.dtype, &slot.shape)?;
                    if !name.as_str().starts_with(crate::LEND_PREFIX) {
                        return Err(CallError::Malformed(format!(
                            "\"{name}\" is not a lent name"
                        )));
                    }
                }
                Value::Named {
                    version: Some(0), ..
                } => {
                    return Err(CallError::Malformed("version 0 does not exist".into()));
                }
                Value::Named { .. }
                | Value::None
                | Value::Bool(_)
                | Value::Int(_)
                | Value::Float(_)
                | Value::Str(_)
                | Value::Bytes(_) => {}
            }
        }
        Ok(shape)
    }

    /// The tensor slots in tree order: the order their bytes follow the skeleton in.
    pub fn tensors(&self) -> Vec<&TensorSlot> {
        self.leaves(|v| match v {
            Value::Tensor(slot) => Some(slot),
            _ => None,
        })
    }

    /// The lent tensors in tree order: what the reader pulls from the sender.
    pub fn lent(&self) -> Vec<LentSlot<'_>> {
        self.leaves(|v| match v {
            Value::Lent { slot, name } => Some(LentSlot {
                slot,
                name,
                device: None,
            }),
            Value::LentDevice { slot, name, device } => Some(LentSlot {
                slot,
                name,
                device: Some(*device),
            }),
            _ => None,
        })
    }

    /// Whether any leaf is a tensor passed by name (for the reader to get from a holder).
    pub fn names_tensors(&self) -> bool {
        !self
            .leaves(|v| matches!(v, Value::Named { .. }).then_some(()))
            .is_empty()
    }

    /// What `pick` takes of each value in tree order, lists and maps walked into.
    fn leaves<'a, T>(&'a self, pick: impl Fn(&'a Value) -> Option<T>) -> Vec<T> {
        fn walk<'a, T>(value: &'a Value, pick: &impl Fn(&'a Value) -> Option<T>, out: &mut Vec<T>) {
            match value {
                Value::List(items) => items.iter().for_each(|v| walk(v, pick, out)),
                Value::Map(items) => items.iter().for_each(|(_, v)| walk(v, pick, out)),
                leaf => out.extend(pick(leaf)),
            }
        }
        let mut out = Vec::new();
        walk(self, &pick, &mut out);
        out
    }
}

/// The framing of a body: the skeleton's length prefix and encoding.
pub struct Body;

impl Body {
    /// Bytes of the length prefix before the skeleton.
    pub const PREFIX: usize = 4;

    /// The prefix and the skeleton of `value`: the tensors' bytes follow them. Fails on a
    /// tree [`Value::validate`] refuses or a skeleton over [`MAX_SKELETON`].
    pub fn head(value: &Value) -> Result<(Vec<u8>, Shape), CallError> {
        let shape = value.validate()?;
        let skeleton =
            postcard::to_allocvec(value).map_err(|e| CallError::Malformed(e.to_string()))?;
        if skeleton.len() > MAX_SKELETON as usize {
            return Err(CallError::TooLarge {
                what: "value skeleton",
                len: skeleton.len() as u64,
                max: u64::from(MAX_SKELETON),
            });
        }
        let mut head = Vec::with_capacity(Self::PREFIX + skeleton.len());
        head.extend_from_slice(&(skeleton.len() as u32).to_le_bytes());
        head.extend_from_slice(&skeleton);
        Ok((head, shape))
    }

    /// The skeleton's length from its prefix, checked against [`MAX_SKELETON`] and against
    /// the `body_len` it sits in.
    pub fn skeleton_len(prefix: [u8; 4], body_len: u64) -> Result<usize, CallError> {
        let len = u32::from_le_bytes(prefix);
        if len > MAX_SKELETON {
            return Err(CallError::TooLarge {
                what: "value skeleton",
                len: u64::from(len),
                max: u64::from(MAX_SKELETON),
            });
        }
        if u64::from(len) + Self::PREFIX as u64 > body_len {
            return Err(CallError::Malformed(format!(
                "a skeleton of {len} bytes does not fit a body of {body_len}"
            )));
        }
        Ok(len as usize)
    }

    /// Decodes and checks a skeleton, and that its tensors' bytes are exactly what is left
    /// of a body of `body_len` bytes.
    pub fn skeleton(bytes: &[u8], body_len: u64) -> Result<(Value, Shape), CallError> {
        let value: Value =
            postcard::from_bytes(bytes).map_err(|e| CallError::Malformed(e.to_string()))?;
        let shape = value.validate()?;
        let rest = body_len - (Self::PREFIX + bytes.len()) as u64;
        if shape.tensor_bytes != rest {
            return Err(CallError::Malformed(format!(
                "the tensors need {} bytes but {rest} follow the skeleton",
                shape.tensor_bytes
            )));
        }
        Ok((value, shape))
    }

    /// The whole body of a value without tensors (or whose tensors' bytes the caller
    /// appends): prefix and skeleton.
    pub fn encode_plain(value: &Value) -> Result<Vec<u8>, CallError> {
        Self::head(value).map(|(head, _)| head)
    }
}

/// What is wrong with a call message or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// Something over a limit.
    #[error("{what} of {len} bytes is over the limit of {max}")]
    TooLarge {
        /// What.
        what: &'static str,
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Too many of something.
    #[error("more than {max} {what} in one value")]
    TooMany {
        /// What.
        what: &'static str,
        /// The limit.
        max: usize,
    },
    /// Nested deeper than [`MAX_VALUE_DEPTH`].
    #[error("a value nested deeper than {MAX_VALUE_DEPTH} levels")]
    TooDeep,
    /// A tensor's dtype and shape do not make a size.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// Not a well-formed message or body.
    #[error("malformed call message: {0}")]
    Malformed(String),
}
