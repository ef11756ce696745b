//! The metrics servers of real processes: a `tb-broker` and two `tb-worker`s on loopback, with
//! `--metrics-addr 127.0.0.1:0`, read over plain HTTP. Every process is killed by PID when the
//! test ends (`Proc`'s drop), and its data dir is a tempdir.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use tb_node::{PeerAddr, Ticket, auth::node_id};
use tb_tests::{
    http,
    procs::{Proc, bin, broker_command, free_udp_addr, worker_command},
};

const START: Duration = Duration::from_secs(30);
/// Longest poll for something that should happen within a few heartbeats.
const SETTLE: Duration = Duration::from_secs(30);
const SECRET: &str = "metrics-test-cluster-secret-of-32-bytes";

/// One broker and two workers; worker 1 subscribes to `model/*`, so it pulls what worker 0
/// is given.
struct Cluster {
    dir: tempfile::TempDir,
    secret_file: PathBuf,
    ticket: Ticket,
    broker: Proc,
    broker_url: String,
    workers: Vec<(Proc, PeerAddr, String)>,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
        let mut cmd = broker_command(dir.path(), "broker", &secret_file);
        cmd.args(["--liveness-timeout", "5"]);
        let mut broker = Proc::start("broker", cmd, &dir.path().join("broker.log"));
        let ticket: Ticket = broker.wait_line("ticket:", START).parse().expect("ticket");
        let broker_url = broker.wait_line("metrics:", START);
        let mut c = Cluster {
            dir,
            secret_file,
            ticket,
            broker,
            broker_url,
            workers: Vec::new(),
        };
        for i in 0..2 {
            let subscribe: &[&str] = if i == 1 { &["model/*"] } else { &[] };
            let secret = c.secret_file.clone();
            let w = c.spawn_worker(&format!("worker-{i}"), &secret, subscribe);
            c.workers.push(w);
        }
        c
    }

    fn spawn_worker(
        &self,
        name: &str,
        secret_file: &Path,
        subscribe: &[&str],
    ) -> (Proc, PeerAddr, String) {
        let ticket = self.ticket.to_string();
        let mut cmd = worker_command(self.dir.path(), name, secret_file, &ticket);
        for p in subscribe {
            cmd.arg("--subscribe").arg(p);
        }
        let log = self.dir.path().join(format!("{name}.log"));
        let mut p = Proc::start(name, cmd, &log);
        let addr: PeerAddr = p
            .wait_line("worker:", START)
            .parse()
            .expect("worker address");
        let url = p.wait_line("metrics:", START);
        (p, addr, url)
    }

    fn tb(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin("tb"))
            .args(args)
            .arg("--join")
            .arg(self.ticket.to_string())
            .arg("--cluster-secret-file")
            .arg(&self.secret_file)
            .args(["--timeout", "10"])
            .output()
            .expect("running tb")
    }
}

/// GET that must answer (any status).
fn get(url: &str) -> (u16, String) {
    http::get(url).unwrap_or_else(|e| panic!("{e}"))
}

fn get_json(url: &str) -> Value {
    let (status, body) = get(url);
    assert_eq!(status, 200, "GET {url}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {url}: {e}: {body}"))
}

/// Polls `check` every 100 ms until it holds or `limit` passes.
fn poll(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    check()
}

/// The value of the series `series` (name plus labels, exactly as printed) in a text-format
/// page, 0 when absent.
fn sample(page: &str, series: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

fn metric(base: &str, series: &str) -> f64 {
    let (status, page) = get(&format!("{base}/metrics"));
    assert_eq!(status, 200);
    sample(&page, series)
}

const BYTES_IN: &str = "tb_transfer_bytes_total{direction=\"in\"}";
const BAD_PROOF: &str = "tb_auth_failures_total{reason=\"bad_proof\"}";

#[test]
fn metrics_status_and_cluster_view_follow_a_put_and_a_get() {
    let mut c = Cluster::start();
    let urls: Vec<String> = std::iter::once(c.broker_url.clone())
        .chain(c.workers.iter().map(|w| w.2.clone()))
        .collect();
    for url in &urls {
        assert_eq!(get(&format!("{url}/healthz")), (200, "ok".to_string()));
        assert!(
            poll(SETTLE, || get(&format!("{url}/readyz"))
                == (200, "ready".into())),
            "{url} becomes ready"
        );
    }
    let (w0_url, w1_url) = (c.workers[0].2.clone(), c.workers[1].2.clone());
    let w0_id = node_id(&c.workers[0].1.id).to_string();
    let w1_id = node_id(&c.workers[1].1.id).to_string();

    // Status: role and node id.
    let status = get_json(&format!("{w0_url}/api/v1/status"));
    assert_eq!(status["role"], "worker");
    assert_eq!(status["node_id"], w0_id.as_str());
    assert_eq!(status["ready"], true);
    assert_eq!(status["throughput"]["window_s"], 10);
    let broker_status = get_json(&format!("{}/api/v1/status", c.broker_url));
    assert_eq!(broker_status["role"], "broker");
    assert_eq!(
        broker_status["node_id"],
        node_id(&c.ticket.brokers[0].id).to_string().as_str()
    );

    // Workers have no cluster view.
    assert_eq!(get(&format!("{w0_url}/api/v1/cluster")).0, 404);

    // A put to worker 0: it receives the push (serve); worker 1 subscribes and pulls it.
    let (w0_in, w1_in) = (metric(&w0_url, BYTES_IN), metric(&w1_url, BYTES_IN));
    let bytes: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7) as u8).collect();
    let len = bytes.len() as f64;
    let input = c.dir.path().join("w.bin");
    std::fs::write(&input, &bytes).expect("write");
    let w0_addr = c.workers[0].1.to_string();
    let input_s = input.to_string_lossy().to_string();
    let out = c.tb(&[
        "put", "model/w", &input_s, "--dtype", "f32", "--shape", "128,128", "--worker", &w0_addr,
    ]);
    assert!(
        out.status.success(),
        "tb put: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        metric(&w0_url, BYTES_IN) >= w0_in + len,
        "worker 0 counted the push"
    );
    let served = |url: &str| metric(url, "tb_transfers_total{kind=\"serve\",result=\"ok\"}");
    assert!(
        poll(SETTLE, || served(&w0_url) >= 1.0),
        "worker 0 counted the push it accepted"
    );
    assert!(
        poll(SETTLE, || metric(&w1_url, BYTES_IN) >= w1_in + len),
        "worker 1 counted its pull"
    );
    let pulled = || metric(&w1_url, "tb_transfers_total{kind=\"pull\",result=\"ok\"}");
    assert!(poll(SETTLE, || pulled() >= 1.0), "worker 1 counted a pull");
    assert!(metric(&w1_url, "tb_transfer_duration_seconds_count{kind=\"pull\"}") >= 1.0);
    let mut w1_status = Value::Null;
    let held = poll(SETTLE, || {
        w1_status = get_json(&format!("{w1_url}/api/v1/status"));
        w1_status["store"]["tensors"] == 1
    });
    assert!(held, "worker 1 holds the tensor: {w1_status:#}");
    let in_total = w1_status["throughput"]["in_bytes_total"].as_f64();
    assert!(in_total.unwrap_or(0.0) >= len, "{w1_status:#}");
    assert!(w1_status["transfers"]["ok"].as_u64().unwrap_or(0) >= 1);
    assert!(w1_status["transfers"]["latency_s"]["p50"].is_number());

    // By channel: the push from the CLI (same host) rode shm; worker 1's bytes are counted
    // on the channels that carried them (shm or QUIC, both on this host), none fell back.
    // Each pooled link shows its peer and the channel negotiated with it: shm here.
    let bytes_in = |url: &str, channel: &str| {
        metric(
            url,
            &format!("tb_channel_bytes_total{{channel=\"{channel}\",direction=\"in\"}}"),
        )
    };
    assert!(
        bytes_in(&w0_url, "shm") >= len,
        "worker 0 counted the push on shm"
    );
    let w1_in = || bytes_in(&w1_url, "shm") + bytes_in(&w1_url, "quic");
    assert!(
        poll(SETTLE, || w1_in() >= len),
        "worker 1 counted its pull by channel: {}",
        w1_in()
    );
    let transfers = |channel: &str| {
        metric(
            &w1_url,
            &format!("tb_channel_transfers_total{{channel=\"{channel}\"}}"),
        )
    };
    assert!(transfers("shm") + transfers("quic") >= 1.0);
    for channel in ["shm", "quic", "tcp"] {
        let fallbacks = format!("tb_channel_fallbacks_total{{channel=\"{channel}\"}}");
        assert_eq!(metric(&w1_url, &fallbacks), 0.0, "{channel}");
    }
    let links = w1_status["links"].as_array().cloned().unwrap_or_default();
    let to_w0 = links.iter().find(|l| l["peer"] == w0_id.as_str());
    assert_eq!(
        to_w0.map(|l| &l["channel"]),
        Some(&Value::from("shm")),
        "worker 1's link to worker 0: {w1_status:#}"
    );
    // `tb status` shows the same from worker 1's heartbeats (every 2 s).
    let mut members = Value::Null;
    let listed = poll(SETTLE, || {
        let out = c.tb(&["status", "--json"]);
        members = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let w1 = members["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["node_id"] == w1_id.as_str()));
        let links = w1.and_then(|w| w["stats"]["links"].as_array());
        links.is_some_and(|ls| {
            ls.iter()
                .any(|l| l["peer"] == w0_id.as_str() && l["channel"] == "shm")
        })
    });
    assert!(
        listed,
        "tb status lists worker 1's link to worker 0: {members:#}"
    );

    // A get through the cluster, served by a holder.
    let served_before = served(&w0_url) + served(&w1_url);
    let back = c.dir.path().join("back.bin");
    let back_s = back.to_string_lossy().to_string();
    let out = c.tb(&["get", "model/w", "-o", &back_s]);
    assert!(
        out.status.success(),
        "tb get: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&back).expect("read back"), bytes);
    assert!(
        poll(SETTLE, || served(&w0_url) + served(&w1_url) > served_before),
        "a worker served the get"
    );

    // The broker's view: the entry with both holders, both workers alive with stats.
    let view_ok = |view: &Value| {
        let entry = view["entries"]
            .as_array()
            .and_then(|es| es.iter().find(|e| e["name"] == "model/w"));
        let Some(e) = entry else { return false };
        let holders: Vec<&str> = e["holders"]
            .as_array()
            .map(|h| h.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let members = view["members"].as_array().cloned().unwrap_or_default();
        let worker_ok = |id: &str| {
            members.iter().any(|m| {
                m["node_id"] == id
                    && m["alive"] == true
                    && m["role"] == "worker"
                    && m["stats"]["tensors"] == 1
                    && m["stats"]["metrics_url"].is_string()
            })
        };
        e["version"] == 1
            && e["dtype"] == "f32"
            && e["shape"] == serde_json::json!([128, 128])
            && e["byte_len"] == 65536
            && holders.contains(&w0_id.as_str())
            && holders.contains(&w1_id.as_str())
            && worker_ok(&w0_id)
            && worker_ok(&w1_id)
    };
    let cluster_url = format!("{}/api/v1/cluster", c.broker_url);
    let mut last = Value::Null;
    let settled = poll(SETTLE, || {
        last = get_json(&cluster_url);
        view_ok(&last)
    });
    assert!(settled, "cluster view: {last:#}");
    assert_eq!(last["broker"]["role"], "broker");
    let broker_page = get(&format!("{}/metrics", c.broker_url)).1;
    assert_eq!(sample(&broker_page, "tb_registry_names"), 1.0);
    assert!(sample(&broker_page, "tb_cluster_nodes{state=\"alive\"}") >= 3.0);

    // A worker with the wrong secret is refused and counted; it never becomes ready.
    let before = metric(&c.broker_url, BAD_PROOF);
    let wrong = c.dir.path().join("wrong-secret");
    std::fs::write(&wrong, "not-the-cluster-secret-at-all-of-32-bytes\n").expect("secret");
    let (mut intruder, _, intruder_url) = c.spawn_worker("intruder", &wrong, &[]);
    assert!(
        poll(SETTLE, || metric(&c.broker_url, BAD_PROOF)
            >= before.max(0.0) + 1.0),
        "the broker counted the refusal"
    );
    assert_eq!(
        get(&format!("{intruder_url}/readyz")),
        (503, "not ready".into())
    );
    intruder.kill9();

    assert!(
        c.workers[1].0.terminate(Duration::from_secs(15)),
        "graceful exit"
    );
    assert!(c.broker.terminate(Duration::from_secs(15)), "graceful exit");
}

/// Every family of the metrics contract, and which role exports it.
const FAMILIES: &[(&str, &[&str])] = &[
    ("tb_pool_links", &["broker", "worker"]),
    ("tb_pool_dials_total", &["broker", "worker"]),
    ("tb_pool_reuses_total", &["broker", "worker"]),
    ("tb_pool_evictions_total", &["broker", "worker"]),
    ("tb_pool_refused_total", &["broker", "worker"]),
    ("tb_pool_connect_failures_total", &["broker", "worker"]),
    ("tb_transfer_bytes_total", &["broker", "worker"]),
    ("tb_transfers_total", &["broker", "worker"]),
    ("tb_transfer_duration_seconds", &["broker", "worker"]),
    ("tb_transfers_in_flight", &["broker", "worker"]),
    ("tb_registry_names", &["broker"]),
    ("tb_registry_holders", &["broker"]),
    ("tb_gossip_messages_total", &["broker"]),
    ("tb_sync_rounds_total", &["broker"]),
    ("tb_cluster_nodes", &["broker"]),
    ("tb_broker_refused_total", &["broker"]),
    ("tb_store_bytes", &["worker"]),
    ("tb_store_tensors", &["worker"]),
    ("tb_auth_failures_total", &["broker", "worker"]),
    ("tb_insecure_open", &["broker", "worker"]),
    ("tb_build_info", &["broker", "worker"]),
    ("tb_channel_bytes_total", &["broker", "worker"]),
    ("tb_channel_transfers_total", &["broker", "worker"]),
    ("tb_channel_fallbacks_total", &["broker", "worker"]),
    ("process_cpu_seconds_total", &["broker", "worker"]),
    ("process_resident_memory_bytes", &["broker", "worker"]),
    ("process_open_fds", &["broker", "worker"]),
    ("process_start_time_seconds", &["broker", "worker"]),
];

#[test]
fn every_contract_family_is_exported_at_zero_by_its_role() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
    let mut cmd = Command::new(bin("tb-broker"));
    cmd.arg("--data-dir")
        .arg(dir.path().join("broker"))
        .arg("--listen")
        .arg(free_udp_addr().to_string())
        .arg("--cluster-secret-file")
        .arg(&secret)
        .args(["--metrics-addr", "127.0.0.1:0"]);
    let mut broker = Proc::start("broker", cmd, &dir.path().join("broker.log"));
    let ticket = broker.wait_line("ticket:", START);
    let broker_url = broker.wait_line("metrics:", START);
    let mut cmd = Command::new(bin("tb-worker"));
    cmd.arg("--join")
        .arg(&ticket)
        .arg("--data-dir")
        .arg(dir.path().join("worker"))
        .arg("--listen")
        .arg(free_udp_addr().to_string())
        .arg("--cluster-secret-file")
        .arg(&secret)
        .args(["--metrics-addr", "127.0.0.1:0"]);
    let mut worker = Proc::start("worker", cmd, &dir.path().join("worker.log"));
    let worker_url = worker.wait_line("metrics:", START);
    for (role, url) in [("broker", &broker_url), ("worker", &worker_url)] {
        let (status, page) = get(&format!("{url}/metrics"));
        assert_eq!(status, 200);
        let declared: Vec<&str> = page
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        for (family, roles) in FAMILIES {
            assert_eq!(
                declared.contains(family),
                roles.contains(&role),
                "{role} exports {family}: expected {}",
                roles.contains(&role)
            );
        }
        // Labelled families are initialised: every label value is there at zero.
        for series in [
            "tb_pool_links{state=\"active\"} 0",
            "tb_pool_evictions_total{reason=\"idle\"} 0",
            "tb_transfers_total{kind=\"push\",result=\"error\"} 0",
            "tb_insecure_open 0",
        ] {
            assert!(page.contains(series), "{role} lacks {series}");
        }
        let build = format!("tb_build_info{{role=\"{role}\",version=\"");
        assert!(page.contains(&build), "{role} build info");
    }
    let page = get(&format!("{broker_url}/metrics")).1;
    assert!(page.contains("tb_cluster_nodes{state=\"dead\"} 0"));
    // The dashboard's files are served with their types.
    let (status, html) = get(&format!("{broker_url}/"));
    assert_eq!(status, 200);
    assert!(html.contains("<html"), "{html}");
    for path in [
        "/assets/app.js",
        "/assets/style.css",
        "/assets/vendor/uPlot.iife.min.js",
        "/assets/vendor/uPlot.min.css",
    ] {
        assert_eq!(get(&format!("{broker_url}{path}")).0, 200, "{path}");
    }
    assert_eq!(get(&format!("{broker_url}/nope")).0, 404);
    assert!(worker.terminate(Duration::from_secs(15)), "graceful exit");
    assert!(broker.terminate(Duration::from_secs(15)), "graceful exit");
}

#[test]
fn a_brokers_cluster_view_shows_the_figures_of_workers_that_heartbeat_to_another_broker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
    let log = |name: &str| dir.path().join(format!("{name}.log"));
    let mut b0 = Proc::start(
        "broker-0",
        broker_command(dir.path(), "broker-0", &secret),
        &log("broker-0"),
    );
    let t0: Ticket = b0.wait_line("ticket:", START).parse().expect("ticket");
    let url0 = b0.wait_line("metrics:", START);
    let mut cmd = broker_command(dir.path(), "broker-1", &secret);
    cmd.arg("--join").arg(t0.to_string());
    let mut b1 = Proc::start("broker-1", cmd, &log("broker-1"));
    let t1: Ticket = b1.wait_line("ticket:", START).parse().expect("ticket");
    // The worker knows (and heartbeats to) broker 1 only.
    let only_b1 = Ticket {
        brokers: vec![t1.brokers[0].clone()],
    };
    let cmd = worker_command(dir.path(), "worker", &secret, &only_b1.to_string());
    let mut w = Proc::start("worker", cmd, &log("worker"));
    let addr: PeerAddr = w
        .wait_line("worker:", START)
        .parse()
        .expect("worker address");
    let id = node_id(&addr.id).to_string();

    // Broker 0's dashboard shows the worker's figures, relayed from broker 1.
    let url = format!("{url0}/api/v1/cluster");
    let mut last = Value::Null;
    let shown = poll(SETTLE, || {
        last = get_json(&url);
        let members = last["members"].as_array().cloned().unwrap_or_default();
        members.iter().any(|m| {
            m["node_id"] == id.as_str()
                && m["role"] == "worker"
                && m["alive"] == true
                && m["stats"]["tensors"] == 0
                && m["stats"]["metrics_url"].is_string()
                && m["stats"]["age_s"].as_f64().is_some_and(|a| a >= 0.0)
        })
    });
    assert!(shown, "broker 0's view of the worker: {last:#}");
    drop(w);
    drop(b1);
    drop(b0);
}
