//! [`Pipeline`]: a stream of [`Value`]s for data loading, composed and run in Rust.
//!
//! Sources: a streaming call's items ([`Pipeline::from_call`]), the tensors of a
//! subscription's versions ([`Pipeline::from_subscription`]), or anything that sends items
//! on a channel ([`Pipeline::from_channel`], which Python's iterables use). Combinators:
//! [`map`](Pipeline::map) and [`map_call`](Pipeline::map_call) (a local function or a remote
//! one, `parallel` at a time, in order or as they finish), [`interleave`](Pipeline::interleave)
//! (several sources, items as they come), [`prefetch`](Pipeline::prefetch) (a task runs
//! `k` items ahead) and [`batch`](Pipeline::batch) (`n` items stacked into one buffer per
//! tensor position).
//!
//! Pipelines are pulled: nothing runs ahead of the consumer but a `prefetch` stage (at most
//! its `k` items), a `map`'s `parallel` items in flight, and each streaming call's own
//! prefetch on its server. So the memory a pipeline holds is at most the sum of those.
//! The first error ends the pipeline: it is returned once, and then the end.

use std::{future::Future, pin::Pin};

use bytes::BytesMut;
use futures_util::{
    Stream, StreamExt,
    stream::{self, BoxStream},
};
use tb_node::{Node, SubEvent};
use tb_proto::DType;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

use crate::{CallError, CallOptions, CallStream, Calls, HostTensor, Value};

/// One item of a pipeline.
pub type Item = Result<Value, PipelineError>;

/// Most items one batch stacks.
pub const MAX_BATCH: usize = 1 << 20;

/// Most items a `prefetch` stage holds, and most a `map` runs at once.
pub const MAX_AHEAD: usize = 1 << 16;

/// Why a pipeline ended early.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A streaming call or a mapped remote call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// A subscription, or a get of a version it reported, failed.
    #[error(transparent)]
    Node(#[from] tb_node::Error),
    /// Items that cannot be stacked into one batch (tensors of different shapes, say).
    #[error("cannot batch: {0}")]
    Batch(String),
    /// A combinator's argument out of range.
    #[error("{0}")]
    Invalid(String),
    /// What a source or a mapped local function failed with (a Python exception, say).
    #[error("{0}")]
    Source(Box<dyn std::error::Error + Send + Sync>),
}

/// A stream of values, pulled by [`next`](Pipeline::next).
pub struct Pipeline {
    items: BoxStream<'static, Item>,
    ended: bool,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("ended", &self.ended)
            .finish()
    }
}

impl Pipeline {
    /// A pipeline of `items`.
    pub fn new(items: impl Stream<Item = Item> + Send + 'static) -> Self {
        Pipeline {
            items: items.boxed(),
            ended: false,
        }
    }

    /// The items of a streaming call (its own prefetch bounds how far its server runs
    /// ahead). Dropping the pipeline cancels the call.
    pub fn from_call(call: CallStream) -> Self {
        Pipeline::new(stream::unfold(call, |mut call| async move {
            let item = call.next().await?;
            Some((item.map_err(PipelineError::from), call))
        }))
    }

    /// The items sent on `rx`, until every sender is gone.
    pub fn from_channel(mut rx: mpsc::Receiver<Item>) -> Self {
        Pipeline::new(stream::poll_fn(move |cx| rx.poll_recv(cx)))
    }

    /// The tensor of each version `sub` reports, as a [`Value::Tensor`] (the one the
    /// subscription fetched, or got from a holder now). Skipped versions and deletes yield
    /// nothing; a version no node keeps any more by the time it is got is passed over.
    pub fn from_subscription(node: Node, sub: tb_node::Subscription) -> Self {
        Pipeline::new(stream::unfold((node, sub), |(node, mut sub)| async move {
            loop {
                let (name, version, tensor) = match sub.next().await? {
                    Err(e) => return Some((Err(e.into()), (node, sub))),
                    Ok(SubEvent::Version {
                        name,
                        version,
                        tensor,
                        ..
                    }) => (name, version, tensor),
                    Ok(_) => continue,
                };
                let tensor = match tensor {
                    Some(tensor) => tensor,
                    None => match node.get_version(name.as_str(), version).await {
                        Ok(pulled) => pulled.buffer,
                        Err(tb_node::Error::NotFound { .. }) => continue,
                        Err(e) => return Some((Err(e.into()), (node, sub))),
                    },
                };
                let value = HostTensor::from_node(tensor)
                    .map(Value::Tensor)
                    .map_err(|e| PipelineError::Invalid(format!("{name} v{version}: {e}")));
                return Some((value, (node, sub)));
            }
        }))
    }

    /// Each item through `f`, `parallel` at a time: in the items' order when `ordered`,
    /// else as they finish.
    pub fn map<F, Fut>(self, f: F, parallel: usize, ordered: bool) -> Result<Self, PipelineError>
    where
        F: FnMut(Value) -> Fut + Send + 'static,
        Fut: Future<Output = Item> + Send + 'static,
    {
        let parallel = within("parallel", parallel, MAX_AHEAD)?;
        let mut f = f;
        let calls = self
            .items
            .map(move |item| -> Pin<Box<dyn Future<Output = Item> + Send>> {
                match item {
                    Ok(value) => Box::pin(f(value)),
                    Err(e) => Box::pin(std::future::ready(Err(e))),
                }
            });
        Ok(if ordered {
            Pipeline::new(calls.buffered(parallel))
        } else {
            Pipeline::new(calls.buffer_unordered(parallel))
        })
    }

    /// Each item through the remote function `function`, called with `args(item)` (the
    /// function's argument convention: Python's functions take `{"args": [...], "kwargs":
    /// {...}}`), `parallel` calls at a time spread over its servers.
    pub fn map_call(
        self,
        calls: Calls,
        function: String,
        options: CallOptions,
        args: fn(Value) -> Value,
        parallel: usize,
        ordered: bool,
    ) -> Result<Self, PipelineError> {
        let map = move |item: Value| {
            let (calls, function, options) = (calls.clone(), function.clone(), options.clone());
            async move {
                let result = calls.call(&function, &args(item), &options).await;
                result.map_err(PipelineError::from)
            }
        };
        self.map(map, parallel, ordered)
    }

    /// The items of every source, each as soon as it comes (no source waits for another).
    pub fn interleave(sources: Vec<Pipeline>) -> Self {
        Pipeline::new(stream::select_all(sources.into_iter().map(|p| p.items)))
    }

    /// A task of its own pulls up to `k` items ahead of the consumer (it waits for a free
    /// place before it pulls the next, so at most `k` are held). Started by the first pull;
    /// dropping the pipeline stops it, and what it was waiting on.
    pub fn prefetch(self, k: usize) -> Result<Self, PipelineError> {
        let k = within("prefetch", k, MAX_AHEAD)?;
        let mut upstream = Some(self.items);
        let mut running: Option<(mpsc::Receiver<Item>, AbortOnDropHandle<()>)> = None;
        Ok(Pipeline::new(stream::poll_fn(move |cx| {
            if let Some(mut items) = upstream.take() {
                let (tx, rx) = mpsc::channel(k);
                let task = tokio::spawn(async move {
                    loop {
                        let Ok(place) = tx.reserve().await else {
                            return;
                        };
                        let Some(item) = items.next().await else {
                            return;
                        };
                        let failed = item.is_err();
                        place.send(item);
                        if failed {
                            return;
                        }
                    }
                });
                running = Some((rx, AbortOnDropHandle::new(task)));
            }
            let (rx, _task) = running.as_mut().expect("started above");
            rx.poll_recv(cx)
        })))
    }

    /// `n` items at a time stacked into one value of the items' structure: tensors of one
    /// dtype and shape into one tensor of shape `[n, ...]` (one buffer, one copy of each
    /// item), numbers and booleans into a 1-D tensor, lists and maps position by position;
    /// anything else as a list of the items. The last batch may be short, unless
    /// `drop_last`.
    pub fn batch(self, n: usize, drop_last: bool) -> Result<Self, PipelineError> {
        let n = within("batch size", n, MAX_BATCH)?;
        Ok(Pipeline::new(stream::unfold(
            Some(self.items),
            move |items| async move {
                let mut items = items?;
                let mut got = Vec::with_capacity(n.min(1024));
                while got.len() < n {
                    match items.next().await {
                        Some(Ok(value)) => got.push(value),
                        Some(Err(e)) => return Some((Err(e), None)),
                        None => break,
                    }
                }
                if got.is_empty() || (drop_last && got.len() < n) {
                    return None;
                }
                let batch = collate(got).map_err(PipelineError::Batch);
                Some((batch, Some(items)))
            },
        )))
    }

    /// The next item; `None` at the end, and after the first error.
    pub async fn next(&mut self) -> Option<Item> {
        if self.ended {
            return None;
        }
        let item = self.items.next().await;
        if !matches!(item, Some(Ok(_))) {
            self.ended = true;
            // What the stages hold (calls, tasks) goes now, not when the pipeline is dropped.
            self.items = stream::empty().boxed();
        }
        item
    }
}

fn within(what: &str, n: usize, most: usize) -> Result<usize, PipelineError> {
    if n == 0 || n > most {
        return Err(PipelineError::Invalid(format!(
            "{what} must be 1 to {most}, not {n}"
        )));
    }
    Ok(n)
}

/// `items` (at least one) stacked: see [`Pipeline::batch`].
pub fn collate(items: Vec<Value>) -> Result<Value, String> {
    let n = items.len();
    match &items[0] {
        Value::Tensor(first) => {
            let (dtype, shape, len) = (first.dtype, first.shape.clone(), first.data.len());
            let total = len
                .checked_mul(n)
                .ok_or_else(|| format!("{n} tensors of {len} bytes overflow"))?;
            let mut buf = BytesMut::with_capacity(total);
            for (i, item) in items.iter().enumerate() {
                let Value::Tensor(t) = item else {
                    return Err(format!("item {i} is not a host tensor, item 0 is"));
                };
                if t.dtype != dtype || t.shape != shape {
                    return Err(format!(
                        "item {i} is a {} tensor of shape {:?}, item 0 a {} tensor of shape \
                         {shape:?}",
                        t.dtype.name(),
                        t.shape,
                        dtype.name()
                    ));
                }
                buf.extend_from_slice(&t.data);
            }
            let mut stacked = Vec::with_capacity(shape.len() + 1);
            stacked.push(n as u64);
            stacked.extend_from_slice(&shape);
            let tensor =
                HostTensor::new(dtype, stacked, buf.freeze()).map_err(|e| e.to_string())?;
            Ok(Value::Tensor(tensor))
        }
        Value::Int(_) if items.iter().all(|v| matches!(v, Value::Int(_))) => {
            numbers(DType::I64, &items, |v| match v {
                Value::Int(i) => i.to_le_bytes().to_vec(),
                _ => unreachable!("checked: all ints"),
            })
        }
        Value::Float(_) if items.iter().all(|v| matches!(v, Value::Float(_))) => {
            numbers(DType::F64, &items, |v| match v {
                Value::Float(f) => f.to_le_bytes().to_vec(),
                _ => unreachable!("checked: all floats"),
            })
        }
        Value::Bool(_) if items.iter().all(|v| matches!(v, Value::Bool(_))) => {
            numbers(DType::Bool, &items, |v| match v {
                Value::Bool(b) => vec![u8::from(*b)],
                _ => unreachable!("checked: all booleans"),
            })
        }
        Value::List(first) => {
            let width = first.len();
            let mut columns: Vec<Vec<Value>> = (0..width).map(|_| Vec::with_capacity(n)).collect();
            for (i, item) in items.into_iter().enumerate() {
                let Value::List(row) = item else {
                    return Err(format!("item {i} is not a list, item 0 is"));
                };
                if row.len() != width {
                    return Err(format!(
                        "item {i} is a list of {}, item 0 of {width}",
                        row.len()
                    ));
                }
                for (column, v) in columns.iter_mut().zip(row) {
                    column.push(v);
                }
            }
            let stacked = columns.into_iter().map(collate);
            Ok(Value::List(stacked.collect::<Result<_, _>>()?))
        }
        Value::Map(first) => {
            let keys: Vec<String> = first.iter().map(|(k, _)| k.clone()).collect();
            let mut columns: Vec<Vec<Value>> = keys.iter().map(|_| Vec::with_capacity(n)).collect();
            for (i, item) in items.into_iter().enumerate() {
                let Value::Map(row) = item else {
                    return Err(format!("item {i} is not a map, item 0 is"));
                };
                if row.len() != keys.len() || row.iter().zip(&keys).any(|((k, _), key)| k != key) {
                    return Err(format!("item {i}'s keys differ from item 0's ({keys:?})"));
                }
                for (column, (_, v)) in columns.iter_mut().zip(row) {
                    column.push(v);
                }
            }
            let stacked = keys
                .into_iter()
                .zip(columns)
                .map(|(k, column)| Ok((k, collate(column)?)));
            Ok(Value::Map(stacked.collect::<Result<_, String>>()?))
        }
        Value::Device(_) => Err(
            "item 0 is a CUDA tensor: batch stacks host tensors (stack device ones with torch)"
                .into(),
        ),
        _ => Ok(Value::List(items)),
    }
}

fn numbers(dtype: DType, items: &[Value], bytes: fn(&Value) -> Vec<u8>) -> Result<Value, String> {
    let data: Vec<u8> = items.iter().flat_map(bytes).collect();
    let tensor =
        HostTensor::new(dtype, vec![items.len() as u64], data).map_err(|e| e.to_string())?;
    Ok(Value::Tensor(tensor))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: &[f32], shape: &[u64]) -> Value {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Value::Tensor(
            HostTensor::new(DType::F32, shape.to_vec(), data).expect("sized to its shape"),
        )
    }

    fn items(values: Vec<Value>) -> Pipeline {
        Pipeline::new(stream::iter(values.into_iter().map(Ok)))
    }

    async fn all(mut p: Pipeline) -> Vec<Item> {
        let mut out = Vec::new();
        while let Some(item) = p.next().await {
            out.push(item);
            assert!(out.len() < 10_000, "a pipeline that does not end");
        }
        out
    }

    #[test]
    fn collate_stacks_tensors_numbers_lists_and_maps() {
        let rows = (0..3)
            .map(|i| {
                let x = tensor(&[i as f32, 10.0 + i as f32], &[2]);
                Value::Map(vec![
                    ("x".into(), x),
                    ("y".into(), Value::Int(i)),
                    ("tag".into(), Value::Str(format!("t{i}"))),
                ])
            })
            .collect();
        let Value::Map(batch) = collate(rows).expect("same structure") else {
            panic!("a map batches into a map")
        };
        assert_eq!(batch[0].0, "x");
        assert_eq!(
            batch[0].1,
            tensor(&[0.0, 10.0, 1.0, 11.0, 2.0, 12.0], &[3, 2])
        );
        let y = batch[1].1.as_tensor().expect("ints stack into a tensor");
        assert_eq!((y.dtype, y.shape.clone()), (DType::I64, vec![3]));
        assert_eq!(&y.data[8..16], &1i64.to_le_bytes());
        let tags = Value::List((0..3).map(|i| Value::Str(format!("t{i}"))).collect());
        assert_eq!(batch[2].1, tags);
    }

    #[test]
    fn collate_refuses_mismatched_items() {
        let err = collate(vec![tensor(&[1.0, 2.0], &[2]), tensor(&[1.0], &[1])])
            .expect_err("items that do not stack");
        assert!(err.contains("item 1") && err.contains("[1]"), "{err}");
        let lists = vec![Value::List(vec![Value::Int(1)]), Value::List(vec![])];
        assert!(
            collate(lists)
                .expect_err("items that do not stack")
                .contains("list of 0")
        );
        let maps = vec![
            Value::Map(vec![("a".into(), Value::Int(1))]),
            Value::Map(vec![("b".into(), Value::Int(1))]),
        ];
        assert!(
            collate(maps)
                .expect_err("items that do not stack")
                .contains("keys differ")
        );
    }

    #[tokio::test]
    async fn batch_map_prefetch_in_order_with_a_short_last_batch() {
        let source = items((0..10).map(Value::Int).collect());
        let doubled = source
            .map(
                |v| async move {
                    match v {
                        Value::Int(i) => Ok(Value::Int(i * 2)),
                        other => Ok(other),
                    }
                },
                4,
                true,
            )
            .expect("parallel within limits");
        let batches = doubled
            .batch(4, false)
            .expect("n within limits")
            .prefetch(2)
            .expect("k within limits");
        let got = all(batches).await;
        let sizes: Vec<u64> = got
            .iter()
            .map(|b| {
                b.as_ref()
                    .expect("no error")
                    .as_tensor()
                    .expect("a batch of ints")
                    .shape[0]
            })
            .collect();
        assert_eq!(sizes, [4, 4, 2]);
        let last = got[2]
            .as_ref()
            .expect("no error")
            .as_tensor()
            .expect("a batch of ints");
        let want: Vec<u8> = [16i64, 18].iter().flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(&last.data[..], &want[..]);

        let source = items((0..10).map(Value::Int).collect());
        let dropped = all(source.batch(4, true).expect("n within limits")).await;
        assert_eq!(dropped.len(), 2);
    }

    #[tokio::test]
    async fn interleave_yields_every_item_of_every_source() {
        let sources = (0..3)
            .map(|s| items((0..5).map(|i| Value::Int(s * 100 + i)).collect()))
            .collect();
        let mut got: Vec<i64> = all(Pipeline::interleave(sources))
            .await
            .into_iter()
            .map(|v| match v.expect("no error") {
                Value::Int(i) => i,
                other => panic!("{other:?}"),
            })
            .collect();
        got.sort_unstable();
        let want: Vec<i64> = (0..3)
            .flat_map(|s| (0..5).map(move |i| s * 100 + i))
            .collect();
        assert_eq!(got, want);
    }

    #[tokio::test]
    async fn the_first_error_ends_the_pipeline() {
        let failing = stream::iter(vec![
            Ok(Value::Int(1)),
            Err(PipelineError::Invalid("broken source".into())),
            Ok(Value::Int(2)),
        ]);
        let got = all(Pipeline::new(failing).prefetch(4).expect("k within limits")).await;
        assert_eq!(got.len(), 2);
        assert!(matches!(&got[1], Err(PipelineError::Invalid(m)) if m == "broken source"));
        assert!(matches!(
            items(vec![]).batch(0, false),
            Err(PipelineError::Invalid(_))
        ));
    }

    #[tokio::test]
    async fn prefetch_holds_at_most_k_items() {
        let (tx, rx) = mpsc::channel::<Item>(64);
        for i in 0..20 {
            tx.send(Ok(Value::Int(i))).await.expect("room for 20");
        }
        let pulled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = pulled.clone();
        let source = Pipeline::from_channel(rx)
            .map(
                move |v| {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    std::future::ready(Ok(v))
                },
                1,
                true,
            )
            .expect("parallel within limits");
        let mut ahead = source.prefetch(3).expect("k within limits");
        assert!(matches!(ahead.next().await, Some(Ok(Value::Int(0)))));
        // Bounded wait for the task to fill its places: 1 taken + 3 held.
        for _ in 0..200 {
            if pulled.load(std::sync::atomic::Ordering::SeqCst) >= 4 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(pulled.load(std::sync::atomic::Ordering::SeqCst), 4);
    }
}
