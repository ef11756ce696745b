//! `tb put` and `tb get`: a tensor file to a worker, which publishes and holds it; a tensor
//! from the cluster into a file.
//!
//! Each prints one summary line on stdout (name, version, size, time, rate, and the worker or
//! the file); while a transfer of at least [`MIN_BAR_BYTES`](crate::progress::MIN_BAR_BYTES)
//! runs, a progress bar shows on stderr when stderr is a terminal.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result, bail};
use clap::Args;
use tb_node::{DType, Node, PeerAddr, Tensor, TensorSet, TransferProgress, auth::node_id};

use crate::{
    cluster::Join,
    files::Format,
    fmt::{bytes, mb_per_s},
    progress::{self, Bar},
    status::short_id,
};

/// Options of `tb put`.
#[derive(Debug, Clone, Args)]
pub struct PutArgs {
    /// The tensor's name (`model/layer1/w`).
    pub name: String,
    /// The file: `.npy`, `.safetensors`, or raw bytes (with --dtype and --shape). A
    /// `.safetensors` file without --key is published whole, as one version of the set NAME
    /// (each tensor is the member NAME/<key>; readers get all of one version or none).
    pub file: PathBuf,
    /// The worker to hold it (`<node-id>@<ip:port>`). Default: a live worker of the cluster.
    #[arg(long)]
    pub worker: Option<PeerAddr>,
    /// In a .safetensors file, the one tensor to send (as NAME) instead of the whole file.
    #[arg(long)]
    pub key: Option<String>,
    /// Element type of a raw file (f32, bf16, u8, ...).
    #[arg(long)]
    pub dtype: Option<tb_node::DType>,
    /// Shape of a raw file (`2,3,4`).
    #[arg(long)]
    pub shape: Option<String>,
    /// Succeed only once this many live nodes hold the new version (the worker that took it
    /// counts; the others are workers that subscribe to the name and fetch it). With 2 or
    /// more, the put outlives the worker that took it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub replicas: u32,
    /// How long to wait for --replicas, in seconds.
    #[arg(long, default_value_t = 60)]
    pub replicas_timeout: u64,
}

/// `tb put`: sends a tensor file to a worker, which publishes and holds it; prints the
/// version the cluster gave it.
pub async fn put(join: &Join, args: PutArgs) -> Result<()> {
    let name = tb_node::proto::TensorName::new(args.name.as_str())
        .with_context(|| format!("tensor name {:?}", args.name))?;
    let max = tb_node::DEFAULT_MAX_TENSOR_BYTES;
    let whole_file = Format::of(&args.file) == Format::Safetensors && args.key.is_none();
    let path = args.file.clone();
    let (tensor, what) = if whole_file {
        if args.dtype.is_some() || args.shape.is_some() {
            bail!(
                "{}: --dtype and --shape apply to raw files; a .safetensors file names its own",
                args.file.display()
            );
        }
        tokio::task::spawn_blocking(move || -> Result<(Tensor, String)> {
            let file = crate::files::read_safetensors_set(&path, max)?;
            let what = format!(
                "set of {} tensors ({})",
                file.tensors.len(),
                bytes(file.tensors.iter().map(|(_, t)| t.byte_len()).sum())
            );
            let set = TensorSet::pack(&name, &file.tensors, file.metadata, max)
                .with_context(|| format!("{} as the set {name:?}", path.display()))?;
            Ok((set, what))
        })
        .await
        .context("reading the file")??
    } else {
        let mut opts = crate::files::ReadOptions::new(max);
        opts.key = args.key.clone();
        opts.dtype = args.dtype;
        opts.shape = match &args.shape {
            Some(s) => Some(crate::files::parse_shape(s)?),
            None => None,
        };
        let tensor = tokio::task::spawn_blocking(move || crate::files::read(&path, &opts))
            .await
            .context("reading the file")??;
        let what = format!(
            "{} {:?} {}",
            tensor.dtype().name(),
            tensor.meta().shape,
            bytes(tensor.byte_len())
        );
        (tensor, what)
    };
    let node = join.node().await?;
    let result = async {
        let put = put_on(&node, &args, &tensor).await?;
        let held = match args.replicas {
            1 => 1,
            n => {
                let wait = Duration::from_secs(args.replicas_timeout);
                node.wait_for_holders(&args.name, put.version, n, wait)
                    .await
                    .with_context(|| {
                        format!(
                            "{} v{} is published but not yet on {n} nodes (do workers \
                             subscribe to it? `tb-worker --subscribe`)",
                            args.name, put.version
                        )
                    })?
            }
        };
        anyhow::Ok((put, held))
    }
    .await;
    crate::cluster::close(&node).await;
    let (put, held) = result?;
    let replicas = match held {
        1 => String::new(),
        n => format!(", held by {n} nodes"),
    };
    println!(
        "put {} v{}: {what} in {:.2} s ({:.0} MB/s) -> worker {}{replicas}",
        args.name,
        put.version,
        put.seconds,
        mb_per_s(tensor.byte_len(), put.seconds),
        short_id(&node_id(&put.worker.id)),
    );
    Ok(())
}

/// What a put did: the version the cluster gave the tensor, the worker that holds it, and
/// how long sending it took.
struct Put {
    version: u64,
    worker: PeerAddr,
    seconds: f64,
}

async fn put_on(node: &Node, args: &PutArgs, tensor: &Tensor) -> Result<Put> {
    let (worker, seconds) = match &args.worker {
        Some(w) => (w.clone(), push_to(node, w, args, tensor).await?),
        None => push_to_a_live_worker(node, args, tensor).await?,
    };
    // The worker publishes what it is pushed; wait until the cluster lists this content.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(join_timeout(node));
    loop {
        let listed = node.list(&args.name).await.context("listing")?;
        if let Some(e) = listed
            .iter()
            .find(|e| e.name.as_str() == args.name && e.meta.hash == tensor.hash())
        {
            return Ok(Put {
                version: e.version,
                worker,
                seconds,
            });
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("the worker took the tensor but the cluster does not list it yet");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn join_timeout(node: &Node) -> u64 {
    node.config().request_timeout.as_secs().max(1)
}

/// Pushes `tensor` to `worker`; returns how long sending took.
async fn push_to(node: &Node, worker: &PeerAddr, args: &PutArgs, tensor: &Tensor) -> Result<f64> {
    let progress = Arc::new(TransferProgress::default());
    let bar = Bar::follow(format!("put {}", args.name), progress.clone());
    let started = std::time::Instant::now();
    let pushed = node
        .push_with_progress(worker, &args.name, tensor, &progress)
        .await;
    let seconds = started.elapsed().as_secs_f64();
    progress::finish(bar).await;
    pushed.with_context(|| format!("sending to worker {worker}"))?;
    Ok(seconds)
}

/// Most live workers `tb put` offers a tensor to when none is named.
const MAX_PUT_TRIES: usize = 8;

/// Pushes to the first live worker that takes it. Workers that run with a read-only
/// credential take no pushes: their refusal (one round trip, before the payload matters) moves
/// the put on to the next worker. A node with a read-only credential itself stops at the first
/// refusal, which names the role it needs.
async fn push_to_a_live_worker(
    node: &Node,
    args: &PutArgs,
    tensor: &Tensor,
) -> Result<(PeerAddr, f64)> {
    let read_write = node.config().cluster_key.access() == tb_node::proto::Access::ReadWrite;
    let mut refused = None;
    for worker in live_workers(node).await?.into_iter().take(MAX_PUT_TRIES) {
        match push_to(node, &worker, args, tensor).await {
            Ok(seconds) => return Ok((worker, seconds)),
            Err(e) if read_write && unauthorized(&e) => refused = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(refused.unwrap_or_else(|| {
        anyhow::anyhow!(
            "no live worker in the cluster to hold the tensor (start one, or pass --worker)"
        )
    }))
}

fn unauthorized(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<tb_node::Error>(),
        Some(tb_node::Error::Unauthorized(_))
    )
}

/// The cluster's live workers, in the broker's (node id) order.
async fn live_workers(node: &Node) -> Result<Vec<PeerAddr>> {
    let members = node.members().await.context("asking for the members")?;
    Ok(members
        .iter()
        .filter(|m| m.alive && m.role == tb_node::proto::Role::Worker)
        .filter_map(|m| {
            let id = iroh::EndpointId::from_bytes(&m.node.0).ok()?;
            let addr = m.addrs.iter().find_map(|a| a.parse().ok())?;
            Some(PeerAddr { id, addr })
        })
        .collect())
}

/// Options of `tb get`.
#[derive(Debug, Clone, Args)]
pub struct GetArgs {
    /// The tensor's (or set's) name.
    pub name: String,
    /// Where to write it: `.npy`, `.safetensors`, or raw bytes for any other name. A set is
    /// written as a `.safetensors` file with every member and the set's metadata.
    /// Default: `<last part of the name>.npy` (`.safetensors` for a set) in the current folder.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// A specific version (default: the newest).
    #[arg(long)]
    pub version: Option<u64>,
}

/// `tb get`: fetches a tensor (or a whole set) from the cluster and writes it to a file.
pub async fn get(join: &Join, args: GetArgs) -> Result<()> {
    let node = join.node().await?;
    let progress = Arc::new(TransferProgress::default());
    let bar = Bar::follow(format!("get {}", args.name), progress.clone());
    let started = std::time::Instant::now();
    let got = node
        .get_with_progress(&args.name, args.version, &progress)
        .await;
    let seconds = started.elapsed().as_secs_f64();
    progress::finish(bar).await;
    crate::cluster::close(&node).await;
    let got = got.with_context(|| format!("getting {:?}", args.name))?;
    let is_set = got.meta.dtype == DType::Set;
    let output = args.output.clone().unwrap_or_else(|| {
        let last = args.name.rsplit('/').next().unwrap_or("tensor");
        PathBuf::from(match is_set {
            true => format!("{last}.safetensors"),
            false => format!("{last}.npy"),
        })
    });
    let (version, size) = (got.version, got.meta.byte_len);
    let path = output.clone();
    let (format, what) = if is_set {
        if Format::of(&output) != Format::Safetensors {
            bail!(
                "{:?} is a set of tensors; write it to a .safetensors file (-o {}.safetensors)",
                args.name,
                args.name.rsplit('/').next().unwrap_or("set")
            );
        }
        let set = TensorSet::from_tensor(got.name, got.version, &got.buffer)?;
        let what = format!(
            "set of {} tensors ({})",
            set.members.len(),
            bytes(set.members_bytes())
        );
        tokio::task::spawn_blocking(move || {
            crate::files::write_safetensors_set(&path, &set.members, &set.metadata)
        })
        .await
        .context("writing the file")??;
        (Format::Safetensors, what)
    } else {
        let tensor = got.buffer;
        let key = args.name.clone();
        let format = tokio::task::spawn_blocking(move || crate::files::write(&path, &tensor, &key))
            .await
            .context("writing the file")??;
        (format, bytes(size))
    };
    println!(
        "get {} v{version}: {what} in {seconds:.2} s ({:.0} MB/s) -> {} ({format})",
        args.name,
        mb_per_s(size, seconds),
        output.display(),
    );
    Ok(())
}
