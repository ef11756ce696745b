//! Roles, in one process: the cluster secret (read-write) and the read-only credential derived
//! from it, enforced by brokers on `tb/ctl/1` and by every node on `tb/data/1`. Real brokers and
//! nodes on loopback, plus raw ctl connections that ask what a well-behaved node never would.

use std::{path::Path, time::Duration};

use iroh::{Endpoint, SecretKey, endpoint::Connection};
use tb_broker::{Broker, BrokerOptions, StartError};
use tb_node::{
    Config, Error, PeerAddr, SubEvent, auth,
    framing::{read_frame, write_frame},
    proto::{
        Access, CTL_ALPN, ClusterKey, CtlRequest, CtlResponse, ErrorCode, NodeId, NodeStats,
        RegistryOp, Role, Stamp, TensorName,
    },
};
use tb_tests::{eventually_async, f32_tensor, node, test_config, within};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"roles tests share this cluster secret";

fn root() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

/// The read-only key, as a node reading `tb secret derive --read-only`'s output gets it.
fn read_only() -> ClusterKey {
    let text = root().read_only_credential().expect("derive");
    let key = tb_node::parse_secret(format!("{text}\n").as_bytes()).expect("credential");
    assert_eq!(key.access(), Access::ReadOnly);
    key
}

async fn broker(dir: &Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.node.cluster_key = root();
    opts.tick = Duration::from_millis(200);
    within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

fn member(broker: &Broker, key: ClusterKey) -> Config {
    Config {
        brokers: vec![broker.addr().clone()],
        cluster_key: key,
        heartbeat_interval: Duration::from_millis(300),
        ..test_config()
    }
}

/// A raw `tb/ctl/1` connection to `broker` that proved `key`.
async fn raw_ctl(broker: &PeerAddr, key: &ClusterKey) -> (Endpoint, Connection) {
    let ep = tb_node::bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let conn = ep
        .connect(broker.to_endpoint_addr(), CTL_ALPN)
        .await
        .expect("connect");
    let welcomed = auth::client_hello(&conn, ep.id(), key, CTL_ALPN, LIMIT, 0)
        .await
        .expect("hello");
    assert_eq!(
        welcomed.peer,
        key.access(),
        "what we can check of the broker"
    );
    (ep, conn)
}

/// Sends one request and reads its answer frames.
async fn ask(conn: &Connection, request: &CtlRequest) -> Vec<CtlResponse> {
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    write_frame(&mut send, request).await.expect("write");
    send.finish().expect("finish");
    let mut frames = Vec::new();
    for _ in 0..1000 {
        let frame: CtlResponse = within(LIMIT, "answer", read_frame(&mut recv))
            .await
            .expect("answer frame");
        let last = frame.is_final();
        frames.push(frame);
        if last {
            return frames;
        }
    }
    panic!("no final frame in 1000");
}

/// The one `Error` frame a refused request gets: its code and message.
async fn refused(conn: &Connection, request: &CtlRequest) -> (ErrorCode, String) {
    match ask(conn, request).await.as_slice() {
        [CtlResponse::Error { code, message }] => (*code, message.clone()),
        other => panic!("expected one error frame for {request:?}, got {other:?}"),
    }
}

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

fn assert_needs_secret(err: &Error, action: &str) {
    let shown = err.to_string();
    assert!(matches!(err, Error::Unauthorized(_)), "{shown}");
    assert!(
        shown.contains(action) && shown.contains("needs") && shown.contains("(read-write)"),
        "names what needs the secret: {shown}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_node_gets_lists_and_watches_but_cannot_publish_or_delete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = broker(dir.path()).await;
    let writer = node(member(&b, root())).await;
    let reader = node(member(&b, read_only())).await;
    let mut sub = within(LIMIT, "subscribe", reader.subscribe("m/*"))
        .await
        .expect("a read-only node watches");
    let v = within(LIMIT, "publish", writer.publish("m/w", f32_tensor(64, 1)))
        .await
        .expect("the secret publishes");
    match within(LIMIT, "event", sub.next()).await {
        Some(Ok(SubEvent::Version { version, .. })) => assert_eq!(version, v),
        other => panic!("expected the new version, got {other:?}"),
    }
    let listed = within(LIMIT, "list", reader.list("m/"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 1);
    let got = within(LIMIT, "get", reader.get("m/w")).await.expect("get");
    assert_eq!(got.buffer.data(), f32_tensor(64, 1).data());
    let members = within(LIMIT, "status", reader.members_with_stats())
        .await
        .expect("status");
    assert!(!members.members.is_empty());

    let err = within(LIMIT, "publish", reader.publish("m/x", f32_tensor(4, 2)))
        .await
        .expect_err("a read-only node cannot publish");
    assert_needs_secret(&err, "publishing");
    let err = within(LIMIT, "delete", reader.delete("m/w"))
        .await
        .expect_err("a read-only node cannot delete");
    assert_needs_secret(&err, "deleting");
    let still = within(LIMIT, "list", writer.list("m/"))
        .await
        .expect("list");
    assert_eq!(
        (still.len(), still[0].version),
        (1, v),
        "nothing changed the registry"
    );
    // Having fetched it, the read-only node holds it and serves it (readers check the hash).
    assert!(
        eventually_async(LIMIT, || async {
            writer
                .list("m/w")
                .await
                .is_ok_and(|l| l.first().is_some_and(|e| e.holders == 2))
        })
        .await,
        "the read-only node's holding is registered"
    );
    let third = node(member(&b, root())).await;
    let served = within(LIMIT, "pull", third.pull(reader.addr(), "m/w", Some(v)))
        .await
        .expect("a read-only node serves what it holds");
    assert_eq!(served.buffer.data(), f32_tensor(64, 1).data());
    for n in [writer, reader, third] {
        n.shutdown().await;
    }
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_need_the_secret_on_both_ends() {
    let (writer, worker) = (
        node(Config {
            cluster_key: root(),
            ..test_config()
        })
        .await,
        node(Config {
            cluster_key: root(),
            ..test_config()
        })
        .await,
    );
    let ro = node(Config {
        cluster_key: read_only(),
        ..test_config()
    })
    .await;
    let tensor = f32_tensor(256, 3);
    // A read-only node pushing straight to a worker is refused: a push is a publish.
    let err = within(LIMIT, "push", ro.push(worker.addr(), "m/p", &tensor))
        .await
        .expect_err("refused");
    assert_needs_secret(&err, "pushing a tensor");
    assert!(
        err.to_string()
            .contains("the requesting node has a read-only credential")
    );
    assert_eq!(worker.inbox_len(), 0, "nothing reached the worker's inbox");
    // A read-only worker takes no pushes, even from the secret's holders.
    let err = within(LIMIT, "push", writer.push(ro.addr(), "m/p", &tensor))
        .await
        .expect_err("refused");
    assert_needs_secret(&err, "pushing a tensor");
    assert!(
        err.to_string()
            .contains("this node has a read-only credential")
    );
    assert_eq!(ro.inbox_len(), 0);
    // Pulls are reads: they work both ways, and pushes between secret holders still do.
    ro.publish_local("held", f32_tensor(8, 5)).expect("local");
    worker
        .publish_local("held", f32_tensor(8, 6))
        .expect("local");
    let from_ro = within(LIMIT, "pull", writer.pull(ro.addr(), "held", None)).await;
    assert_eq!(
        from_ro.expect("pull").buffer.data(),
        f32_tensor(8, 5).data()
    );
    let by_ro = within(LIMIT, "pull", ro.pull(worker.addr(), "held", None)).await;
    assert_eq!(by_ro.expect("pull").buffer.data(), f32_tensor(8, 6).data());
    within(LIMIT, "push", writer.push(worker.addr(), "m/p", &tensor))
        .await
        .expect("the secret pushes");
    assert_eq!(worker.inbox_len(), 1);
    for n in [writer, worker, ro] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_peer_cannot_act_as_a_broker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = broker(dir.path()).await;
    let writer = node(member(&b, root())).await;
    within(LIMIT, "publish", writer.publish("m/w", f32_tensor(16, 1)))
        .await
        .expect("publish");
    let (ep, conn) = raw_ctl(b.addr(), &read_only()).await;
    let me = NodeId(*ep.id().as_bytes());
    let heartbeat = |role| CtlRequest::Heartbeat {
        role,
        addrs: vec!["127.0.0.1:9".into()],
        epoch: 1,
        stats: None,
    };
    let (code, message) = refused(&conn, &heartbeat(Role::Broker)).await;
    assert_eq!(code, ErrorCode::Unauthorized);
    assert!(
        message.contains("joining as a broker needs the cluster secret (read-write)"),
        "{message}"
    );
    let rows = writer.members().await.expect("members");
    assert!(
        !rows.iter().any(|m| m.node == me),
        "no membership row for the refused broker"
    );
    let asks = [
        CtlRequest::SyncBuckets {
            buckets: vec![[0; 32]; tb_node::proto::SYNC_BUCKETS],
            members: vec![],
        },
        CtlRequest::NextVersion { name: name("m/w") },
        CtlRequest::Announce {
            ops: vec![RegistryOp::Delete {
                name: name("m/w"),
                stamp: Stamp::ZERO,
            }],
        },
    ];
    for request in &asks {
        let (code, message) = refused(&conn, request).await;
        assert_eq!(code, ErrorCode::Unauthorized, "{request:?}: {message}");
        assert!(message.contains("read-only credential"), "{message}");
    }
    // What a read-only worker does is allowed: heartbeat as a worker, mark what it holds,
    // but only versions the registry keeps.
    assert_eq!(
        ask(&conn, &heartbeat(Role::Worker)).await,
        vec![CtlResponse::Ok]
    );
    let hold = |n: &str, version| CtlRequest::Announce {
        ops: vec![RegistryOp::AddHolder {
            name: name(n),
            version,
            node: me,
            stamp: Stamp::ZERO,
        }],
    };
    assert_eq!(ask(&conn, &hold("m/w", 1)).await, vec![CtlResponse::Ok]);
    for (n, version) in [("m/w", 7), ("made/up", 1)] {
        let (code, message) = refused(&conn, &hold(n, version)).await;
        assert_eq!(code, ErrorCode::NotFound, "{n} v{version}: {message}");
    }
    let listed = writer.list("").await.expect("list");
    assert_eq!(listed.len(), 1, "no made-up name: {listed:?}");
    assert_eq!(listed[0].name.as_str(), "m/w");
    assert_eq!(listed[0].holders, 2, "the writer and the read-only worker");
    // And a broker process refuses the read-only credential at start.
    let mut opts = BrokerOptions::new(dir.path().join("ro-broker"));
    opts.node = test_config();
    opts.node.cluster_key = read_only();
    match Broker::spawn(opts).await {
        Err(e @ StartError::ReadOnly(_)) => assert!(
            e.to_string()
                .contains("acting as a broker needs the cluster secret"),
            "{e}"
        ),
        Err(e) => panic!("expected ReadOnly, got {e}"),
        Ok(_) => panic!("a broker started with a read-only credential"),
    }
    conn.close(0u32.into(), b"done");
    ep.close().await;
    writer.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_heartbeat_records_no_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let b = broker(dir.path()).await;
    let (ep, conn) = raw_ctl(b.addr(), &root()).await;
    let me = NodeId(*ep.id().as_bytes());
    let heartbeat = |epoch, stats| CtlRequest::Heartbeat {
        role: Role::Worker,
        addrs: vec!["127.0.0.1:9".into()],
        epoch,
        stats,
    };
    assert_eq!(ask(&conn, &heartbeat(5, None)).await, vec![CtlResponse::Ok]);
    // An older epoch: the broker refuses the heartbeat, so its figures must not show.
    let figures = NodeStats {
        pool_links: 42,
        tensors: 7,
        ..NodeStats::default()
    };
    let (code, message) = refused(&conn, &heartbeat(4, Some(figures.clone()))).await;
    assert_eq!(code, ErrorCode::Malformed, "{message}");
    assert!(message.contains("before its known epoch"), "{message}");
    let row = |frames: Vec<CtlResponse>| {
        frames
            .into_iter()
            .flat_map(|f| match f {
                CtlResponse::Members { members, .. } => members,
                other => panic!("expected members, got {other:?}"),
            })
            .find(|r| r.member.node == me)
            .expect("our row")
    };
    // Invalid figures: refused before anything is recorded too.
    let nan = NodeStats {
        in_bytes_per_s: f64::NAN,
        ..figures.clone()
    };
    let (code, message) = refused(&conn, &heartbeat(5, Some(nan))).await;
    assert_eq!(code, ErrorCode::Malformed, "{message}");
    assert!(message.contains("in_bytes_per_s"), "{message}");
    let seen = row(ask(&conn, &CtlRequest::Members).await);
    assert_eq!(seen.member.epoch, 5);
    assert_eq!(
        seen.heartbeat, None,
        "a refused heartbeat's figures were recorded"
    );
    // An accepted heartbeat's figures do show.
    assert_eq!(
        ask(&conn, &heartbeat(5, Some(figures.clone()))).await,
        vec![CtlResponse::Ok]
    );
    let seen = row(ask(&conn, &CtlRequest::Members).await);
    assert_eq!(seen.heartbeat.map(|h| h.stats), Some(figures));
    conn.close(0u32.into(), b"done");
    ep.close().await;
    b.shutdown().await;
}

// ---- real processes: tb-broker, tb-worker and tb from target/<profile> ----------------------

mod procs {
    use std::{
        path::{Path, PathBuf},
        process::{Command, Output},
        time::{Duration, Instant},
    };

    use tb_node::{PeerAddr, Ticket};
    use tb_tests::{
        http, pattern,
        procs::{Proc, bin, broker_command, free_udp_addr, worker_command},
    };

    const START: Duration = Duration::from_secs(30);
    const SECRET: &str = "roles-process-tests-cluster-secret-32";

    /// Runs a daemon that must exit by itself (within `START`); returns its exit code and
    /// stderr. A daemon that keeps running fails the test (and is killed).
    fn run_to_exit(mut cmd: Command, dir: &Path, label: &str) -> (Option<i32>, String) {
        let log = dir.join(format!("{label}.log"));
        for var in ["TB_CLUSTER_SECRET_FILE", "TB_CLUSTER_SECRET", "TB_JOIN"] {
            cmd.env_remove(var);
        }
        let mut child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn");
        let started = Instant::now();
        while started.elapsed() < START {
            if let Some(status) = child.try_wait().expect("wait") {
                let stderr = std::fs::read_to_string(&log).expect("log");
                return (status.code(), stderr);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "{label} kept running: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    fn daemon(name: &str, dir: &Path, ticket: &str) -> Command {
        let mut cmd = Command::new(bin(name));
        cmd.arg("--data-dir")
            .arg(dir.join(format!("{name}-data")))
            .arg("--listen")
            .arg(free_udp_addr().to_string())
            .args(["--metrics-addr", "127.0.0.1:0"]);
        if name == "tb-worker" {
            cmd.arg("--join").arg(ticket);
        }
        cmd
    }

    /// A ticket naming a broker nobody runs (the worker must refuse before dialing it).
    fn nowhere_ticket() -> String {
        let addr = PeerAddr {
            id: iroh::SecretKey::generate().public(),
            addr: free_udp_addr(),
        };
        Ticket {
            brokers: vec![addr],
        }
        .to_string()
    }

    fn assert_one_line_refusal(code: Option<i32>, stderr: &str, expect: &[&str], what: &str) {
        assert!(
            matches!(code, Some(c) if c != 0),
            "{what}: exit {code:?}, {stderr}"
        );
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "{what}: one line: {stderr:?}"
        );
        for part in expect {
            assert!(stderr.contains(part), "{what}: {part:?} in {stderr:?}");
        }
    }

    #[test]
    fn daemons_without_a_usable_secret_exit_with_a_one_line_recipe() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ticket = nowhere_ticket();
        let short = dir.path().join("short");
        std::fs::write(&short, "0123456789abcdef\n").expect("write");
        let example = dir.path().join("example");
        let placeholder = tb_node::proto::EXAMPLE_SECRETS[0];
        std::fs::write(&example, format!("{placeholder}\n")).expect("write");
        let recipe = "head -c 32 /dev/urandom | base64 > secret && chmod 600 secret";
        for name in ["tb-broker", "tb-worker"] {
            let cmd = daemon(name, dir.path(), &ticket);
            let (code, stderr) = run_to_exit(cmd, dir.path(), &format!("{name}-none"));
            let expect = [recipe, "--cluster-secret-file", "--insecure-open"];
            assert_one_line_refusal(code, &stderr, &expect, &format!("{name} without a secret"));
            for (file, why) in [
                (&short, "16 bytes, under the minimum of 32"),
                (&example, "example"),
            ] {
                let mut cmd = daemon(name, dir.path(), &ticket);
                cmd.arg("--cluster-secret-file").arg(file);
                let (code, stderr) = run_to_exit(cmd, dir.path(), &format!("{name}-bad"));
                assert_one_line_refusal(code, &stderr, &[why, recipe], &format!("{name}: {why}"));
            }
        }
    }

    fn metrics_of(p: &mut Proc) -> String {
        let url = p.wait_line("metrics:", START);
        let (code, body) = http::get(&format!("{url}/metrics")).expect("metrics");
        assert_eq!(code, 200);
        body
    }

    fn status_of(p: &mut Proc) -> String {
        let url = p.wait_line("metrics:", START);
        let (code, body) = http::get(&format!("{url}/api/v1/status")).expect("status");
        assert_eq!(code, 200);
        body
    }

    #[test]
    fn insecure_open_daemons_start_warn_and_report_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cmd = daemon("tb-broker", dir.path(), "");
        cmd.arg("--insecure-open");
        let broker_log = dir.path().join("broker.log");
        let mut broker = Proc::start("open broker", cmd, &broker_log);
        let ticket = broker.wait_line("ticket:", START);
        let mut cmd = daemon("tb-worker", dir.path(), &ticket);
        cmd.arg("--insecure-open");
        let mut worker = Proc::start("open worker", cmd, &dir.path().join("worker.log"));
        worker.wait_line("worker:", START);
        for p in [&mut broker, &mut worker] {
            let metrics = metrics_of(p);
            assert!(metrics.contains("\ntb_insecure_open 1\n"), "{metrics}");
            let status = status_of(p);
            assert!(status.contains("\"insecure_open\":true"), "{status}");
        }
        let log = std::fs::read_to_string(&broker_log).expect("log");
        assert!(
            log.contains("WARN") && log.contains("--insecure-open"),
            "warns at start: {log}"
        );
        assert!(broker.terminate(START) && worker.terminate(START));
    }

    fn tb(args: &[&str], ticket: &str, secret: &Path) -> Output {
        Command::new(bin("tb"))
            .args(args)
            .arg("--join")
            .arg(ticket)
            .arg("--cluster-secret-file")
            .arg(secret)
            .args(["--timeout", "5"])
            .env_remove("TB_CLUSTER_SECRET_FILE")
            .output()
            .expect("running tb")
    }

    fn text(out: &Output) -> (String, String) {
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    #[test]
    fn a_read_only_credential_reads_but_never_writes_with_real_processes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
        let out = Command::new(bin("tb"))
            .args(["secret", "derive", "--read-only", "--cluster-secret-file"])
            .arg(&secret)
            .output()
            .expect("tb secret derive");
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "tb secret derive: {stderr}");
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        assert!(
            stdout.starts_with("tbro1-") && stdout.trim().len() == 6 + 64,
            "{stdout}"
        );
        let ro = dir.path().join("ro");
        std::fs::write(&ro, &stdout).expect("credential");

        let mut broker = Proc::start(
            "broker",
            broker_command(dir.path(), "broker", &secret),
            &dir.path().join("broker.log"),
        );
        let ticket = broker.wait_line("ticket:", START);
        assert!(metrics_of(&mut broker).contains("\ntb_insecure_open 0\n"));
        let start_worker = |name: &str, file: &PathBuf| {
            let cmd = worker_command(dir.path(), name, file, &ticket);
            let mut p = Proc::start(name, cmd, &dir.path().join(format!("{name}.log")));
            let addr = p.wait_line("worker:", START);
            (p, addr)
        };
        // The read-only worker's node id sorts first, so `tb put` without --worker meets it
        // first (members come in node id order): keys made up front in the data dirs.
        let ids: Vec<_> = ["w1", "w2"]
            .iter()
            .map(|n| {
                let key = tb_node::load_or_create_key(&dir.path().join(n)).expect("key");
                *key.public().as_bytes()
            })
            .collect();
        let (reader_name, writer_name) = match ids[0] < ids[1] {
            true => ("w1", "w2"),
            false => ("w2", "w1"),
        };
        let (mut writer, writer_addr) = start_worker(writer_name, &secret);
        let (mut reader, reader_addr) = start_worker(reader_name, &ro);

        let input = dir.path().join("in.bin");
        let bytes = pattern(4096, 3);
        std::fs::write(&input, &bytes).expect("write");
        let input = input.to_string_lossy().to_string();
        let put = |name: &'static str, worker: &str, key: &Path| {
            let args = [
                "put", name, &input, "--dtype", "u8", "--shape", "4096", "--worker", worker,
            ];
            tb(&args, &ticket, key)
        };
        let out = put("t/w", &writer_addr, &secret);
        assert!(
            out.status.success(),
            "tb put with the secret: {}",
            text(&out).1
        );

        // Reads work with the credential.
        let out = tb(&["ls"], &ticket, &ro);
        let (stdout, stderr) = text(&out);
        assert!(
            out.status.success() && stdout.contains("t/w"),
            "{stdout} {stderr}"
        );
        let back = dir.path().join("back.bin").to_string_lossy().to_string();
        let out = tb(&["get", "t/w", "-o", &back], &ticket, &ro);
        assert!(out.status.success(), "tb get: {}", text(&out).1);
        assert_eq!(std::fs::read(&back).expect("read"), bytes.to_vec());

        // Writes do not: tb put to a worker with the secret, and a worker with the credential
        // takes no push even from the secret.
        let out = put("t/x", &writer_addr, &ro);
        let stderr = text(&out).1;
        assert!(
            !out.status.success(),
            "tb put with a read-only credential succeeded"
        );
        assert!(
            stderr.contains("unauthorized")
                && stderr
                    .contains("pushing a tensor (a publish) needs the cluster secret (read-write)")
                && stderr.contains("the requesting node has a read-only credential"),
            "{stderr}"
        );
        let out = put("t/y", &reader_addr, &secret);
        let stderr = text(&out).1;
        assert!(!out.status.success(), "a read-only worker took a push");
        assert!(
            stderr.contains("this node has a read-only credential"),
            "{stderr}"
        );
        let out = tb(&["ls"], &ticket, &secret);
        let stdout = text(&out).0;
        assert!(
            !stdout.contains("t/x") && !stdout.contains("t/y"),
            "{stdout}"
        );
        // Without --worker, tb put moves past the read-only worker to one that takes pushes.
        let args = ["put", "t/z", &input, "--dtype", "u8", "--shape", "4096"];
        let out = tb(&args, &ticket, &secret);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "tb put to any worker: {stderr}");
        let writer_id: PeerAddr = writer_addr.parse().expect("address");
        let short = tb_node::auth::node_id(&writer_id.id).to_hex();
        assert!(
            stdout.contains(&format!("-> worker {}", &short[..8])),
            "held by the worker with the secret: {stdout}"
        );

        // A broker needs the secret.
        let mut cmd = daemon("tb-broker", dir.path(), "");
        cmd.arg("--cluster-secret-file").arg(&ro);
        let (code, stderr) = run_to_exit(cmd, dir.path(), "ro-broker");
        let expect = ["acting as a broker needs the cluster secret (read-write)"];
        assert_one_line_refusal(
            code,
            &stderr,
            &expect,
            "tb-broker with a read-only credential",
        );

        for p in [&mut reader, &mut writer, &mut broker] {
            assert!(p.terminate(START), "{} stops on SIGTERM", p.label);
        }
    }
}

/// Regression: shm between a read-write node and a read-only one failed its admission (the
/// holder's token named the access it could verify, the client presented its own), so every
/// link paid two `bad_proof` failures and fell back to QUIC. Both directions now go over
/// shm, with no auth failure and no fallback (and the read-only holder's bytes are hashed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_works_between_read_only_and_read_write_nodes() {
    use tb_node::{AuthFailure, proto::ChannelKind};
    let rw = node(Config {
        cluster_key: root(),
        ..test_config()
    })
    .await;
    let ro = node(Config {
        cluster_key: read_only(),
        ..test_config()
    })
    .await;
    // Above the 4 MiB inline limit: each goes as a memfd.
    let (a, b) = (f32_tensor(1_100_000, 1), f32_tensor(1_100_000, 2));
    rw.publish_local("shm/a", a.clone()).expect("publish");
    ro.publish_local("shm/b", b.clone()).expect("publish");
    for _ in 0..2 {
        let got = within(LIMIT, "pull from ro", rw.pull(ro.addr(), "shm/b", None))
            .await
            .expect("a read-write node pulls from a read-only holder");
        assert_eq!(got.buffer.data(), b.data());
        let got = within(LIMIT, "pull from rw", ro.pull(rw.addr(), "shm/a", None))
            .await
            .expect("a read-only node pulls from a read-write holder");
        assert_eq!(got.buffer.data(), a.data());
    }
    for n in [&rw, &ro] {
        let m = n.metrics();
        assert_eq!(
            m.auth_failures.get(AuthFailure::BadProof),
            0,
            "no bad proof"
        );
        assert_eq!(m.channels.fallbacks(ChannelKind::Shm), 0, "no shm fallback");
        assert_eq!(
            m.channels.transfers(ChannelKind::Shm),
            4,
            "every pull on shm"
        );
    }
    rw.shutdown().await;
    ro.shutdown().await;
}
