//! The cluster as users run it: `tb-broker` and `tb-worker` processes from the built
//! binaries, on loopback, with a cluster secret file. Each test starts its own cluster in its
//! own temporary dirs and kills every process it started (by PID) when it ends.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use tb_node::{
    Config, Node, SubEvent, Tensor, Ticket,
    proto::{ChannelKind, ClusterKey},
};
use tb_tests::{
    eventually_async, f32_tensor, pattern,
    procs::{Proc, bin, free_udp_addr},
    test_config, within,
};

const LIMIT: Duration = Duration::from_secs(90);
const START: Duration = Duration::from_secs(30);
const SECRET: &str = "processes-test-cluster-secret-32-bytes";

struct Cluster {
    dir: tempfile::TempDir,
    secret_file: PathBuf,
    brokers: Vec<Proc>,
    broker_listen: Vec<std::net::SocketAddr>,
    workers: Vec<Proc>,
    ticket: Ticket,
    /// The workers' `--channels`, when not the default.
    channels: Option<&'static str>,
}

impl Cluster {
    /// `brokers` brokers (the first prints the ticket, the others join it) and workers; the
    /// workers after the first subscribe to `model/*`.
    fn start(brokers: usize, workers: usize) -> Cluster {
        Cluster::start_with(brokers, workers, None)
    }

    /// [`start`](Self::start), the workers running only `channels` when given.
    fn start_with(brokers: usize, workers: usize, channels: Option<&'static str>) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
        let mut c = Cluster {
            dir,
            secret_file,
            brokers: Vec::new(),
            broker_listen: Vec::new(),
            workers: Vec::new(),
            ticket: Ticket {
                brokers: Vec::new(),
            },
            channels,
        };
        for i in 0..brokers {
            let listen = free_udp_addr();
            let join = (i > 0).then(|| c.ticket.to_string());
            let mut p = c.spawn_broker(i, listen, join.as_deref());
            let printed: Ticket = p.wait_line("ticket:", START).parse().expect("ticket");
            if i == 0 {
                c.ticket = printed;
            } else {
                c.ticket.brokers.push(printed.brokers[0].clone());
            }
            c.brokers.push(p);
            c.broker_listen.push(listen);
        }
        for i in 0..workers {
            let subscribe: &[&str] = if i == 0 { &[] } else { &["model/*"] };
            let w = c.spawn_worker(i, subscribe);
            c.workers.push(w);
        }
        c
    }

    fn data(&self, what: &str) -> PathBuf {
        self.dir.path().join(what)
    }

    fn spawn_broker(&self, i: usize, listen: std::net::SocketAddr, join: Option<&str>) -> Proc {
        let mut cmd = Command::new(bin("tb-broker"));
        cmd.arg("--data-dir")
            .arg(self.data(&format!("broker-{i}")))
            .arg("--listen")
            .arg(listen.to_string())
            .arg("--cluster-secret-file")
            .arg(&self.secret_file)
            .args(["--liveness-timeout", "2", "--sync-interval", "1"]);
        if let Some(t) = join {
            cmd.arg("--join").arg(t);
        }
        let log = self.data(&format!("broker-{i}.log"));
        Proc::start(&format!("broker {i}"), cmd, &log)
    }

    fn spawn_worker(&self, i: usize, subscribe: &[&str]) -> Proc {
        self.spawn_worker_joining(i, subscribe, &self.ticket)
    }

    /// Worker `i`, knowing only the brokers in `ticket`.
    fn spawn_worker_joining(&self, i: usize, subscribe: &[&str], ticket: &Ticket) -> Proc {
        let mut cmd = Command::new(bin("tb-worker"));
        cmd.arg("--join")
            .arg(ticket.to_string())
            .arg("--data-dir")
            .arg(self.data(&format!("worker-{i}")))
            .arg("--listen")
            .arg(free_udp_addr().to_string())
            .arg("--cluster-secret-file")
            .arg(&self.secret_file);
        for p in subscribe {
            cmd.arg("--subscribe").arg(p);
        }
        if let Some(channels) = self.channels {
            cmd.args(["--channels", channels]);
        }
        let log = self.data(&format!("worker-{i}.log"));
        let mut p = Proc::start(&format!("worker {i}"), cmd, &log);
        p.wait_line("worker:", START);
        p
    }

    fn worker_addr(&mut self, i: usize) -> tb_node::PeerAddr {
        self.workers[i]
            .wait_line("worker:", START)
            .parse()
            .expect("worker address")
    }

    /// A node of this cluster in the test process, asking the brokers from `first` on.
    async fn client(&self, first: usize) -> Node {
        self.client_on(first, &ChannelKind::DEFAULT).await
    }

    /// [`client`](Self::client) running only `channels`.
    async fn client_on(&self, first: usize, channels: &[ChannelKind]) -> Node {
        let mut brokers = self.ticket.brokers.clone();
        let n = brokers.len();
        brokers.rotate_left(first % n);
        Node::spawn(Config {
            brokers,
            cluster_key: ClusterKey::from_secret(SECRET.as_bytes()).expect("secret"),
            auto_fetch: false,
            channels: channels.to_vec(),
            ..test_config()
        })
        .await
        .expect("client node")
    }
}

fn tb(args: &[&str], ticket: &Ticket, secret: &Path) -> std::process::Output {
    Command::new(bin("tb"))
        .args(args)
        .arg("--join")
        .arg(ticket.to_string())
        .arg("--cluster-secret-file")
        .arg(secret)
        .args(["--timeout", "5"])
        .output()
        .expect("running tb")
}

/// Waits until `name`'s newest version has `holders` live holders, as `node`'s broker sees it.
async fn holders_reach(node: &Node, name: &str, holders: u32) -> bool {
    eventually_async(LIMIT, || async {
        node.list(name)
            .await
            .map(|l| {
                l.iter()
                    .any(|e| e.name.as_str() == name && e.holders >= holders)
            })
            .unwrap_or(false)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_on_one_worker_and_every_subscribed_worker_fetches_it() {
    let mut c = Cluster::start(3, 4);
    let client = c.client(1).await;
    let tensor = f32_tensor(250_000, 5);
    // `tb put` in library form: push to worker 0, which publishes what it is pushed.
    let w0 = c.worker_addr(0);
    within(LIMIT, "push", client.push(&w0, "model/w", &tensor))
        .await
        .expect("push to worker 0");
    // Workers 1..3 subscribe to model/* and fetch each new version: 4 holders in all.
    assert!(
        holders_reach(&client, "model/w", 4).await,
        "every subscribed worker fetched model/w"
    );
    let got = within(LIMIT, "get", client.get("model/w"))
        .await
        .expect("get");
    assert_eq!(got.buffer.data(), tensor.data(), "bytes equal");
    // The CLI sees the same, through another broker.
    let out = tb(&["ls", "model/"], &c.ticket, &c.secret_file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tb ls: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("model/w") && stdout.contains("f32"),
        "{stdout}"
    );
    client.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_survives_its_holder_being_killed_mid_transfer() {
    let mut c = Cluster::start(1, 4);
    // On QUIC: over shm, a holder of this host hands the whole version over at once.
    let client = c.client_on(0, &[ChannelKind::Quic]).await;
    let big = Tensor::from_bytes(pattern(256 << 20, 3));
    let w0 = c.worker_addr(0);
    within(LIMIT, "push", client.push(&w0, "model/big", &big))
        .await
        .expect("push");
    assert!(holders_reach(&client, "model/big", 4).await, "4 holders");
    let getter = {
        let client = client.clone();
        tokio::spawn(async move { client.get("model/big").await })
    };
    // Kill two of the four holders while the 256 MiB pull is under way: whichever it was
    // reading from, it must finish from a survivor.
    tokio::time::sleep(Duration::from_millis(60)).await;
    c.workers[0].kill9();
    c.workers[1].kill9();
    let got = within(LIMIT, "get", getter)
        .await
        .expect("no panic")
        .expect("the get completes from a surviving holder");
    assert_eq!(got.meta.hash, big.hash());
    assert_eq!(got.buffer.data(), big.data());
    client.shutdown().await;
}

/// A subscribing worker whose broker is SIGKILLed (no close reaches it; QUIC would notice at
/// its 30 s idle timeout) moves its subscription to the other broker and keeps fetching new
/// versions: well before that timeout (the bound below is under it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_moves_on_when_its_broker_is_killed() {
    // QUIC only: on one host a subscriber takes each new version straight from its publisher
    // (a same-host watch), whatever its broker does, and holds it without announcing it; here
    // v2 must come through the subscription that moved, fetched (and announced).
    let mut c = Cluster::start_with(2, 2, Some("quic"));
    // Publishes through broker 1, which stays up.
    let client = c.client(1).await;
    let first = within(
        LIMIT,
        "publish",
        client.publish("model/k", f32_tensor(1000, 1)),
    )
    .await
    .expect("publish");
    assert_eq!(first, 1);
    assert!(
        holders_reach(&client, "model/k", 2).await,
        "worker 1 fetched v1"
    );
    // Worker 1 subscribed through broker 0 (first in its ticket).
    c.brokers[0].kill9();
    let second = within(
        LIMIT,
        "publish",
        client.publish("model/k", f32_tensor(1000, 2)),
    )
    .await
    .expect("publish with broker 0 dead");
    assert_eq!(second, 2);
    let moved = eventually_async(Duration::from_secs(20), || async {
        client.list("model/k").await.is_ok_and(|l| {
            l.iter()
                .any(|e| e.name.as_str() == "model/k" && e.version == 2 && e.holders >= 2)
        })
    })
    .await;
    assert!(moved, "the subscriber fetched v2 through broker 1");
    client.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_restart_and_rejoin_without_losing_the_registry() {
    let mut c = Cluster::start(3, 1);
    let client = c.client(0).await;
    let w0 = c.worker_addr(0);
    for i in 0..10u8 {
        let name = format!("ckpt/t{i}");
        client
            .push(&w0, &name, &f32_tensor(64, i))
            .await
            .expect("push");
    }
    let all = eventually_async(LIMIT, || async {
        client.list("ckpt/").await.map(|l| l.len()).unwrap_or(0) == 10
    })
    .await;
    assert!(all, "10 names published");

    // Broker 2 goes away (its gossip and sync with it); the cluster moves on without it.
    assert!(
        c.brokers[2].terminate(Duration::from_secs(20)),
        "graceful exit on SIGTERM"
    );
    for i in 10..15u8 {
        let name = format!("ckpt/t{i}");
        client
            .push(&w0, &name, &f32_tensor(64, i))
            .await
            .expect("push");
    }
    // It comes back on the same data dir and address: it still has the first 10 (sled) and
    // catches up on the 5 it missed (anti-entropy).
    let listen = c.broker_listen[2];
    let again = c.spawn_broker(2, listen, Some(&c.ticket.to_string()));
    c.brokers[2] = again;
    c.brokers[2].wait_line("ticket:", START);
    let only_broker_2 = Node::spawn(Config {
        brokers: vec![c.ticket.brokers[2].clone()],
        cluster_key: ClusterKey::from_secret(SECRET.as_bytes()).expect("secret"),
        ..test_config()
    })
    .await
    .expect("node");
    let converged = eventually_async(LIMIT, || async {
        only_broker_2
            .list("ckpt/")
            .await
            .map(|l| l.len())
            .unwrap_or(0)
            == 15
    })
    .await;
    assert!(converged, "the restarted broker converged on all 15 names");
    only_broker_2.shutdown().await;
    client.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secrets_are_refused_and_dead_workers_are_withdrawn() {
    let mut c = Cluster::start(1, 2);
    let wrong = c.data("wrong-secret");
    std::fs::write(&wrong, "a different secret of enough length\n").expect("write");
    let out = tb(&["ls"], &c.ticket, &wrong);
    assert!(!out.status.success(), "tb ls with the wrong secret fails");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unauthorized"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let client = c.client(0).await;
    let w0 = c.worker_addr(0);
    client
        .push(&w0, "solo/w", &f32_tensor(32, 1))
        .await
        .expect("push");
    assert!(holders_reach(&client, "solo/w", 1).await);
    // kill -9: no goodbye. After the 2 s liveness timeout its copy is no longer offered.
    c.workers[0].kill9();
    let withdrawn = eventually_async(LIMIT, || async {
        matches!(
            client.get("solo/w").await,
            Err(tb_node::Error::NotFound { .. })
        )
    })
    .await;
    assert!(withdrawn, "a dead worker's tensor is not offered");
    client.shutdown().await;
}

#[test]
fn a_broker_hands_out_the_address_it_is_told_to_advertise() {
    let c = Cluster::start(0, 0);
    // Listening on 127.0.0.1, reachable (say, through a port mapping) at 127.0.0.9.
    let advertised = std::net::SocketAddr::from(([127, 0, 0, 9], free_udp_addr().port()));
    let mut cmd = tb_tests::procs::broker_command(c.dir.path(), "adv", &c.secret_file);
    cmd.arg("--advertise").arg(advertised.to_string());
    let mut p = Proc::start("broker adv", cmd, &c.data("adv.log"));
    let ticket: Ticket = p.wait_line("ticket:", START).parse().expect("ticket");
    assert_eq!(ticket.brokers.len(), 1);
    assert_eq!(ticket.brokers[0].addr, advertised, "{ticket}");
    let metrics = p.wait_line("metrics:", START);
    let (code, body) =
        tb_tests::http::get(&format!("{}/api/v1/status", metrics.trim())).expect("status");
    assert_eq!(code, 200);
    assert!(body.contains(&format!("\"{advertised}\"")), "{body}");
    assert!(p.terminate(START), "the broker stops on SIGTERM");

    // Bad fan-out settings are refused before anything starts.
    for bad in [
        &["--fanout", "0"][..],
        &["--chain-min-size", "8MB/s"],
        &["--advertise", "not-an-address"],
    ] {
        let out = Command::new(bin("tb-broker"))
            .args(bad)
            .output()
            .expect("run tb-broker");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains(bad[0]), "{bad:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_put_and_tb_get_round_trip_a_file() {
    let mut c = Cluster::start(1, 1);
    let w0 = c.worker_addr(0).to_string();
    let input = c.data("weights.bin");
    let bytes = pattern(4000, 8);
    std::fs::write(&input, &bytes).expect("write");
    let input_s = input.to_string_lossy().to_string();
    let put = [
        "put", "t/w", &input_s, "--dtype", "f32", "--shape", "10,100", "--worker", &w0,
    ];
    let out = tb(&put, &c.ticket, &c.secret_file);
    assert!(
        out.status.success(),
        "tb put: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("t/w v1"));
    let raw = c.data("back.bin").to_string_lossy().to_string();
    let out = tb(&["get", "t/w", "-o", &raw], &c.ticket, &c.secret_file);
    assert!(
        out.status.success(),
        "tb get: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read(&raw).expect("read back"),
        bytes.to_vec(),
        "bytes equal"
    );
    // Bad input: a one-line error and a non-zero exit, never a panic.
    for args in [
        vec!["put", "t/x", "/nonexistent/file.npy"],
        vec![
            "put",
            "bad//name",
            &input_s,
            "--dtype",
            "f32",
            "--shape",
            "1000",
        ],
        vec!["put", "t/x", &input_s, "--dtype", "f32", "--shape", "7"],
        vec!["get", "no/such/tensor", "-o", &raw],
    ] {
        let out = tb(&args, &c.ticket, &c.secret_file);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(
            stderr.contains("error:") && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}

/// A `.safetensors` file without `--key` goes in whole as one version of a set (one row of
/// dtype `set` in `tb ls`) and comes back from `tb get` as a `.safetensors` file with the
/// same tensors, dtypes, shapes, bytes and `__metadata__`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_put_of_a_safetensors_file_publishes_a_set_and_tb_get_writes_it_back() {
    use safetensors::{Dtype, SafeTensors, tensor::TensorView};
    let c = Cluster::start(1, 1);
    let w = pattern(4 * 6, 1);
    let b = pattern(2 * 5, 2);
    let ids = pattern(8 * 3, 3);
    let views = vec![
        (
            "model.w",
            TensorView::new(Dtype::F32, vec![2, 3], &w).expect("valid"),
        ),
        (
            "model.b",
            TensorView::new(Dtype::BF16, vec![5], &b).expect("valid"),
        ),
        (
            "ids",
            TensorView::new(Dtype::I64, vec![3], &ids).expect("valid"),
        ),
    ];
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let file = safetensors::serialize(views, Some(meta.clone())).expect("serialize");
    let input = c.data("model.safetensors");
    std::fs::write(&input, &file).expect("write");
    let input_s = input.to_string_lossy().to_string();

    let out = tb(&["put", "ckpt", &input_s], &c.ticket, &c.secret_file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tb put: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ckpt v1: set of 3 tensors"), "{stdout}");
    let out = tb(&["ls"], &c.ticket, &c.secret_file);
    let listing = String::from_utf8_lossy(&out.stdout);
    let row = listing
        .lines()
        .find(|l| l.starts_with("ckpt "))
        .unwrap_or_else(|| panic!("no ckpt row: {listing}"));
    assert_eq!(row.split_whitespace().nth(2), Some("set"), "{row}");

    let back = c.data("back.safetensors");
    let back_s = back.to_string_lossy().to_string();
    let out = tb(&["get", "ckpt", "-o", &back_s], &c.ticket, &c.secret_file);
    assert!(
        out.status.success(),
        "tb get: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("set of 3 tensors"));
    let written = std::fs::read(&back).expect("read back");
    let (_, header) = SafeTensors::read_metadata(&written).expect("valid safetensors");
    assert_eq!(header.metadata().as_ref(), Some(&meta));
    let parsed = SafeTensors::deserialize(&written).expect("valid safetensors");
    let original = SafeTensors::deserialize(&file).expect("valid");
    let mut names = parsed.names();
    names.sort();
    assert_eq!(names, ["ids", "model.b", "model.w"]);
    for name in names {
        let (a, b) = (
            original.tensor(name).expect("valid"),
            parsed.tensor(name).expect("valid"),
        );
        assert_eq!(
            (a.dtype(), a.shape(), a.data()),
            (b.dtype(), b.shape(), b.data()),
            "{name}"
        );
    }

    // A set is not one array: writing it to .npy is refused with what to do instead.
    let npy = c.data("x.npy").to_string_lossy().to_string();
    let out = tb(&["get", "ckpt", "-o", &npy], &c.ticket, &c.secret_file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("write it to a .safetensors file"),
        "{stderr}"
    );
    // With --key, one tensor of the file goes in as a plain tensor.
    let out = tb(
        &["put", "one", &input_s, "--key", "model.w"],
        &c.ticket,
        &c.secret_file,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("one v1: f32 [2, 3]"), "{stdout}");
}

/// Whether `text` has terminal control characters (a progress bar's `\r` or escapes).
fn has_control_chars(text: &str) -> bool {
    text.chars().any(|c| c.is_control() && c != '\n')
}

/// The facts `tb status --json` gives about the workers: `(alive, pool_links, tensors)` for
/// each worker the broker has heartbeat stats of.
fn workers_in_status(json: &serde_json::Value) -> Vec<(bool, u64, u64)> {
    let members = json["members"].as_array().cloned().unwrap_or_default();
    members
        .iter()
        .filter(|m| m["role"] == "worker" && m["stats"].is_object())
        .map(|m| {
            (
                m["alive"].as_bool().unwrap_or(false),
                m["stats"]["pool_links"].as_u64().unwrap_or(0),
                m["stats"]["tensors"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_status_shows_each_workers_links_and_tensors_and_put_get_print_clean_summaries() {
    // Worker 1 subscribes to model/* and fetches what worker 0 is pushed.
    let mut c = Cluster::start(1, 2);
    let w0_addr = c.worker_addr(0);
    let w0 = w0_addr.to_string();
    let w0_short: String = tb_node::auth::node_id(&w0_addr.id)
        .to_hex()
        .chars()
        .take(8)
        .collect();
    c.worker_addr(1);
    let input = c.data("big.bin");
    // Large enough for a progress bar on a terminal; the captured output must stay clean.
    let bytes = pattern(8 << 20, 2);
    std::fs::write(&input, &bytes).expect("write");
    let input_s = input.to_string_lossy().to_string();
    let shape = bytes.len().to_string();
    let put = [
        "put", "model/s", &input_s, "--dtype", "u8", "--shape", &shape, "--worker", &w0,
    ];
    let out = tb(&put, &c.ticket, &c.secret_file);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "tb put: {stderr}");
    assert!(
        stdout.starts_with("put model/s v1: u8 [8388608] 8 MiB in ")
            && stdout
                .trim_end()
                .ends_with(&format!("-> worker {w0_short}"))
            && stdout.lines().count() == 1,
        "one summary line: {stdout}"
    );
    assert!(
        !has_control_chars(&stdout) && !has_control_chars(&stderr),
        "{stdout:?} {stderr:?}"
    );
    let back = c.data("back.bin").to_string_lossy().to_string();
    let out = tb(&["get", "model/s", "-o", &back], &c.ticket, &c.secret_file);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "tb get: {stderr}");
    assert_eq!(std::fs::read(&back).expect("read back"), bytes.to_vec());
    assert!(
        stdout.starts_with("get model/s v1: 8 MiB in ")
            && stdout.trim_end().ends_with(&format!("-> {back} (raw)"))
            && stdout.lines().count() == 1,
        "one summary line: {stdout}"
    );
    assert!(
        !has_control_chars(&stdout) && !has_control_chars(&stderr),
        "{stdout:?} {stderr:?}"
    );

    // Both workers hold the one version, and each has a pooled link (worker 1 pulled from
    // worker 0), as their next heartbeats tell the broker.
    let mut last = serde_json::Value::Null;
    let want = vec![(true, 1, 1); 2];
    let seen = eventually_async(LIMIT, || {
        let out = tb(&["status", "--json"], &c.ticket, &c.secret_file);
        last = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let workers = workers_in_status(&last)
            .into_iter()
            .map(|(alive, links, tensors)| (alive, links.min(1), tensors))
            .collect::<Vec<_>>();
        let ok = workers == want;
        async move { ok }
    })
    .await;
    assert!(
        seen,
        "both workers alive, >= 1 link, 1 tensor each: {last:#}"
    );
    assert_eq!(
        last["members"].as_array().map(Vec::len),
        Some(3),
        "{last:#}"
    );

    // The table says the same, one whitespace-separated row per member.
    let out = tb(&["status"], &c.ticket, &c.secret_file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tb status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!has_control_chars(&stdout), "{stdout:?}");
    println!("{stdout}");
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with("NODE"));
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
    // The table ends at the first blank line (the per-node link lines follow it).
    let rows: Vec<Vec<&str>> = lines
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    let workers: Vec<&Vec<&str>> = rows.iter().filter(|r| r[col("ROLE")] == "worker").collect();
    assert_eq!(workers.len(), 2, "{stdout}");
    for w in workers {
        assert_eq!(w[col("STATE")], "alive", "{stdout}");
        let links: u64 = w[col("LINKS")].parse().expect("links");
        assert!(links >= 1, "{stdout}");
        assert_eq!(w[col("TENSORS")], "1", "{stdout}");
        assert_eq!(w[col("STORED")], "8MiB", "{stdout}");
        assert_ne!(w[col("HEARD")], "-", "{stdout}");
    }
    let broker = rows
        .iter()
        .find(|r| r[col("ROLE")] == "broker")
        .expect("broker row");
    assert_eq!(
        broker[col("LINKS")],
        "-",
        "brokers send no heartbeat stats: {stdout}"
    );
}

/// The node ids (hex) of the workers `tb status --json` has heartbeat stats for, sorted.
fn workers_with_stats(json: &serde_json::Value) -> Vec<String> {
    let members = json["members"].as_array().cloned().unwrap_or_default();
    let mut ids: Vec<String> = members
        .iter()
        .filter(|m| m["role"] == "worker" && m["stats"].is_object())
        .filter_map(|m| m["node_id"].as_str().map(str::to_string))
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_status_asks_every_broker_and_names_the_ones_that_do_not_answer() {
    // Two joined brokers; each worker knows (and heartbeats to) one of them only, so each
    // broker has the figures of one worker, and only asking both shows both.
    let mut c = Cluster::start(2, 0);
    let only = |c: &Cluster, i: usize| Ticket {
        brokers: vec![c.ticket.brokers[i].clone()],
    };
    for i in 0..2 {
        let w = c.spawn_worker_joining(i, &[], &only(&c, i));
        c.workers.push(w);
    }
    let worker_ids: Vec<String> = (0..2)
        .map(|i| tb_node::auth::node_id(&c.worker_addr(i).id).to_hex())
        .collect();
    let status = |ticket: &Ticket| {
        let out = tb(&["status", "--json"], ticket, &c.secret_file);
        assert!(
            out.status.success(),
            "tb status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default()
    };
    let mut both = worker_ids.clone();
    both.sort();
    let mut last = serde_json::Value::Null;
    let seen = eventually_async(LIMIT, || {
        last = status(&c.ticket);
        let ok = workers_with_stats(&last) == both;
        async move { ok }
    })
    .await;
    assert!(seen, "both workers' figures, from two brokers: {last:#}");
    assert_eq!(
        last["answered"].as_array().map(Vec::len),
        Some(2),
        "{last:#}"
    );
    assert_eq!(
        last["unanswered"].as_array().map(Vec::len),
        Some(0),
        "{last:#}"
    );
    assert_eq!(
        last["members"].as_array().map(Vec::len),
        Some(4),
        "{last:#}"
    );
    // Asked alone, each broker knows its own worker's figures only.
    for (i, id) in worker_ids.iter().enumerate() {
        let alone = status(&only(&c, i));
        assert_eq!(
            workers_with_stats(&alone),
            vec![id.clone()],
            "broker {i}: {alone:#}"
        );
        assert_eq!(alone["answered"].as_array().map(Vec::len), Some(1));
    }

    // Broker 1 dies: tb status still answers from broker 0, names broker 1 as unanswered,
    // and has no figures for the worker that heartbeated to broker 1 only.
    c.brokers[1].kill9();
    let gone = c.ticket.brokers[1].to_string();
    let last = status(&c.ticket);
    let unanswered = last["unanswered"].as_array().cloned().unwrap_or_default();
    assert_eq!(unanswered.len(), 1, "{last:#}");
    assert_eq!(unanswered[0]["broker"], gone.as_str(), "{last:#}");
    assert!(
        unanswered[0]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{last:#}"
    );
    assert_eq!(
        workers_with_stats(&last),
        vec![worker_ids[0].clone()],
        "{last:#}"
    );
    let out = tb(&["status"], &c.ticket, &c.secret_file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("brokers answering: 1 of 2\n")
            && stdout.contains(&format!("no answer from {gone}: ")),
        "{stdout}"
    );

    // After the liveness timeout (2 s here) broker 0 shows broker 1 dead, as it would a
    // silent worker; broker 0 stays alive.
    let row_alive = |json: &serde_json::Value, id: &str| {
        let members = json["members"].as_array().cloned().unwrap_or_default();
        let row = members.into_iter().find(|m| m["node_id"] == id);
        row.and_then(|m| m["alive"].as_bool())
    };
    let hex = |i: usize| tb_node::auth::node_id(&c.ticket.brokers[i].id).to_hex();
    let mut last = serde_json::Value::Null;
    let dead = eventually_async(LIMIT, || {
        last = status(&c.ticket);
        let ok = row_alive(&last, &hex(1)) == Some(false);
        async move { ok }
    })
    .await;
    assert!(dead, "the killed broker is shown dead: {last:#}");
    assert_eq!(row_alive(&last, &hex(0)), Some(true), "{last:#}");

    // With every broker gone it is a clear error, not an empty table.
    c.brokers[0].kill9();
    let out = tb(&["status"], &c.ticket, &c.secret_file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(stderr.contains("broker"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_up_runs_a_cluster_whose_ticket_names_every_broker_and_stops_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("up");
    let mut cmd = Command::new(bin("tb"));
    cmd.args(["up", "--brokers", "2", "--workers", "2"])
        .args(["--base-port", "0", "--metrics-port", "0"])
        .arg("--data-dir")
        .arg(&data);
    let mut up = Proc::start("tb up", cmd, &dir.path().join("up.log"));
    let ticket: Ticket = up.wait_line("ticket:", START).parse().expect("ticket");
    up.wait_line("dashboard:", START);
    assert_eq!(
        ticket.brokers.len(),
        2,
        "both brokers in the ticket: {ticket}"
    );
    let secret = data.join("secret");
    let written = std::fs::read_to_string(data.join("ticket")).expect("ticket file");
    assert_eq!(written.trim(), ticket.to_string());

    // A round trip through the cluster, as the README tells a new user to do.
    let input = dir.path().join("in.bin");
    let bytes = pattern(1 << 20, 5);
    std::fs::write(&input, &bytes).expect("write");
    let input_s = input.to_string_lossy().to_string();
    let shape = bytes.len().to_string();
    let put = ["put", "up/x", &input_s, "--dtype", "u8", "--shape", &shape];
    let out = tb(&put, &ticket, &secret);
    assert!(
        out.status.success(),
        "tb put: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back = dir.path().join("back.bin").to_string_lossy().to_string();
    let out = tb(&["get", "up/x", "-o", &back], &ticket, &secret);
    assert!(
        out.status.success(),
        "tb get: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&back).expect("read back"), bytes.to_vec());

    // Both brokers answer tb status, and it lists all four members.
    let out = tb(&["status", "--json"], &ticket, &secret);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        json["answered"].as_array().map(Vec::len),
        Some(2),
        "{json:#}"
    );
    assert_eq!(
        json["members"].as_array().map(Vec::len),
        Some(4),
        "{json:#}"
    );

    // Ctrl-C (SIGTERM here) stops everything and removes the ticket it wrote.
    assert!(up.terminate(Duration::from_secs(30)), "tb up exits 0");
    assert!(!data.join("ticket").exists(), "ticket file removed");
}

/// A subscriber on its broker's host takes the broker's events on the same-host socket. When
/// that broker freezes (SIGSTOP: its socket stays open, unlike a broker that dies), the quiet
/// stream's probe on the socket finds it out: the subscription moves to the other broker and
/// reports the version published meanwhile, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_on_the_socket_leaves_a_frozen_broker() {
    let c = Cluster::start(2, 0);
    let subscriber = c.client(0).await;
    let mut sub = within(LIMIT, "subscribe", subscriber.subscribe("fz/*"))
        .await
        .expect("subscribe");
    // Bounded: versions until the subscription runs on the socket (its node learns in the
    // background that its broker is local).
    let first_publisher = c.client(0).await;
    let mut version = 0;
    while sub.events_channel() != ChannelKind::Shm {
        version += 1;
        assert!(version <= 100, "the subscription never moved to the socket");
        let got = first_publisher
            .publish("fz/t", f32_tensor(64, version as u8))
            .await
            .expect("publish");
        assert_eq!(got, version);
        match within(LIMIT, "event", sub.next()).await {
            Some(Ok(SubEvent::Version { version: v, .. })) => assert_eq!(v, version),
            other => panic!("expected fz/t v{version}, got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first_publisher.shutdown().await;
    // Its broker freezes; the other one's clients publish on.
    let frozen = sub.events_broker().expect("a broker");
    let i = (c.ticket.brokers.iter().position(|b| b.id == frozen)).expect("a broker of the ticket");
    let publisher = c.client(1 - i).await;
    assert!(c.brokers[i].signal("STOP"), "SIGSTOP broker {i}");
    version += 1;
    let tensor = f32_tensor(64, version as u8);
    let got = publisher
        .publish("fz/t", tensor.clone())
        .await
        .expect("publish while a broker is frozen");
    assert_eq!(got, version);
    let event = within(LIMIT, "the version published meanwhile", sub.next()).await;
    let moved_to = sub.events_broker();
    assert!(c.brokers[i].signal("CONT"), "SIGCONT broker {i}");
    match event {
        Some(Ok(SubEvent::Version { version: v, .. })) => assert_eq!(v, version),
        other => panic!("expected fz/t v{version}, got {other:?}"),
    }
    assert_ne!(
        moved_to,
        Some(frozen),
        "the events come from the other broker"
    );
    let pulled = subscriber.get("fz/t").await.expect("get");
    assert_eq!(
        (pulled.version, pulled.buffer.data()),
        (version, tensor.data())
    );
    // The other broker runs on this host too: the new stream is on its socket, or moves there.
    let on_socket =
        eventually_async(LIMIT, || async { sub.events_channel() == ChannelKind::Shm }).await;
    assert!(
        on_socket,
        "the new stream never reached the other broker's socket"
    );
    drop(sub);
    subscriber.shutdown().await;
    publisher.shutdown().await;
}
