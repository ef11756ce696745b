//! `tb call` and `tb ls --functions` as a user runs them: a `tb-broker` process on loopback,
//! functions served by a node in the test process (joined through the broker's ticket), and
//! the `tb` binary run as a child per command. Results are checked byte for byte, failures by
//! exit code and message. Every wait is bounded, and every process started is killed by PID
//! when the test ends (the broker by its `Proc`, each `tb` by its guard).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tb_call::{
    CallContext, Calls, FailureKind, FunctionSpec, HostTensor, Output, RemoteFailure, Serving,
    Value,
};
use tb_node::{
    Config, Node, Ticket,
    proto::{ChannelKind, ClusterKey, DType},
};
use tb_tests::{
    eventually_async,
    procs::{Proc, bin, broker_command},
    test_config, within, write_npy,
};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &str = "cli-call-test-cluster-secret-32-bytes";

/// A broker process and a node in this process serving functions on it.
struct Cluster {
    dir: tempfile::TempDir,
    secret_file: PathBuf,
    ticket: Ticket,
    _broker: Proc,
    node: Node,
    calls: Calls,
}

impl Cluster {
    async fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
        let mut cmd = broker_command(dir.path(), "broker", &secret_file);
        cmd.args(["--liveness-timeout", "3"]);
        let mut broker = Proc::start("broker", cmd, &dir.path().join("broker.log"));
        let ticket: Ticket = broker.wait_line("ticket:", LIMIT).parse().expect("ticket");
        let node = Node::spawn(Config {
            brokers: ticket.brokers.clone(),
            cluster_key: ClusterKey::from_secret(SECRET.as_bytes()).expect("key"),
            heartbeat_interval: Duration::from_millis(300),
            channels: vec![ChannelKind::Quic],
            ..test_config()
        })
        .await
        .expect("server node");
        let calls = Calls::attach(&node).expect("attach");
        Cluster {
            dir,
            secret_file,
            ticket,
            _broker: broker,
            node,
            calls,
        }
    }

    async fn serve(&self, name: &str, handler: impl tb_call::Handler) -> Serving {
        let spec = FunctionSpec::new(name).expect("name").concurrency(4);
        self.serve_spec(spec, handler).await
    }

    async fn serve_spec(&self, spec: FunctionSpec, handler: impl tb_call::Handler) -> Serving {
        within(LIMIT, "serve", self.calls.serve(spec, handler))
            .await
            .expect("serves")
    }

    /// `tb ARGS ...` like [`tb`](Self::tb), started and left running.
    fn tb_started(&self, args: &[&str]) -> Reaped {
        let mut cmd = Command::new(bin("tb"));
        cmd.args(args)
            .arg("--join")
            .arg(self.ticket.to_string())
            .arg("--cluster-secret-file")
            .arg(&self.secret_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        Reaped(cmd.spawn().expect("starting tb"))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs `tb ARGS --join TICKET --cluster-secret-file SECRET` to its end (killed and
    /// failed past [`LIMIT`]).
    fn tb(&self, args: &[&str]) -> Ran {
        let mut cmd = Command::new(bin("tb"));
        cmd.args(args)
            .arg("--join")
            .arg(self.ticket.to_string())
            .arg("--cluster-secret-file")
            .arg(&self.secret_file);
        let ran = run(cmd, self.dir.path(), &args.join(" "));
        // Shown when a test fails (and with --nocapture).
        println!(
            "$ tb {}\nexit {:?}\n{}{}",
            args.join(" "),
            ran.code,
            ran.stdout,
            ran.stderr
        );
        ran
    }
}

/// What one `tb` run printed, and how it ended.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn ok(&self, what: &str) -> &str {
        assert_eq!(
            self.code,
            Some(0),
            "{what}: stdout {:?}, stderr {:?}",
            self.stdout,
            self.stderr
        );
        &self.stdout
    }
}

/// A child killed (by PID) and reaped when dropped, unless it ended already.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Runs `cmd` with stdout and stderr into files of `dir`, for at most [`LIMIT`].
fn run(mut cmd: Command, dir: &Path, what: &str) -> Ran {
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (out, err) = (
        dir.join(format!("tb-{n}.out")),
        dir.join(format!("tb-{n}.err")),
    );
    cmd.stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"));
    let mut child = Reaped(cmd.spawn().expect("starting tb"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("waiting for tb") {
            break status;
        }
        assert!(
            start.elapsed() < LIMIT,
            "tb {what}: still running after {LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    Ran {
        code: status.code(),
        stdout: std::fs::read_to_string(&out).expect("stdout"),
        stderr: std::fs::read_to_string(&err).expect("stderr"),
    }
}

/// A `.npy` file's header text and data bytes (format 1.0).
fn read_npy(path: &Path) -> (String, Vec<u8>) {
    let file = std::fs::read(path).expect("read .npy");
    assert!(
        file.starts_with(b"\x93NUMPY\x01\x00"),
        "not a .npy 1.0 file"
    );
    let len = u16::from_le_bytes([file[8], file[9]]) as usize;
    let header = String::from_utf8(file[10..10 + len].to_vec()).expect("ASCII header");
    (header, file[10 + len..].to_vec())
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `x + 1` for an f32 tensor, keeping its shape; a `ValueError` for anything else.
fn add_one(args: Value, _cx: CallContext) -> Output {
    Output::Unary(Box::pin(async move {
        match args {
            Value::Tensor(t) if t.dtype == DType::F32 => {
                let plus: Vec<u8> = t
                    .data
                    .chunks_exact(4)
                    .flat_map(|c| {
                        let v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                        (v + 1.0).to_le_bytes()
                    })
                    .collect();
                Ok(Value::Tensor(
                    HostTensor::new(DType::F32, t.shape.clone(), plus).expect("same shape"),
                ))
            }
            other => Err(RemoteFailure::new(
                FailureKind::Raised,
                "ValueError",
                format!("add_one takes an f32 tensor, not {other:?}"),
                "Traceback (most recent call last):\n  File \"srv.py\", line 7, in add_one",
            )),
        }
    }))
}

fn echo(args: Value, _cx: CallContext) -> Output {
    Output::Unary(Box::pin(async move { Ok(args) }))
}

/// Never answers; ends when the caller gives up (its cancel).
fn stall(_args: Value, cx: CallContext) -> Output {
    Output::Unary(Box::pin(async move {
        cx.cancel.cancelled().await;
        Err(RemoteFailure::new(
            FailureKind::Stopped,
            "Cancelled",
            "",
            "",
        ))
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_call_writes_the_result_and_tb_ls_lists_the_function() {
    let c = Cluster::start().await;
    let _serving = c.serve("add_one", add_one).await;

    let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 100.0).collect();
    let want = le_bytes(&x.iter().map(|v| v + 1.0).collect::<Vec<_>>());
    let (xs, ys) = (c.path("x.npy"), c.path("y.npy"));
    write_npy(&xs, &x);
    let (xs_s, ys_s) = (xs.to_string_lossy(), ys.to_string_lossy());
    let ran = c.tb(&["call", "add_one", &xs_s, "-o", &ys_s]);
    let stdout = ran.ok("tb call add_one");
    let (header, data) = read_npy(&ys);
    assert!(data == want, "y.npy is not x + 1 byte for byte");
    assert!(
        header.contains("'<f4'") && header.contains("(1000,)"),
        "{header}"
    );
    // The summary: dtype, shape and the BLAKE3 of the result's bytes.
    let hash = blake3::hash(&want).to_hex().to_string();
    assert!(
        stdout.contains("f32") && stdout.contains("[1000]") && stdout.contains(&hash),
        "{stdout}"
    );

    // Listed with its one server (this process's node), and once that server's heartbeat
    // reported it, the one call made: nothing in flight, none failed (a rate, then).
    let mut listed = String::new();
    let mut row = Vec::new();
    for _ in 0..60 {
        listed = c
            .tb(&["ls", "--functions"])
            .ok("tb ls --functions")
            .to_owned();
        row = listed
            .lines()
            .find(|l| l.split_whitespace().next() == Some("add_one"))
            .unwrap_or_else(|| panic!("add_one not listed: {listed}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        if row.get(4).map(String::as_str) == Some("1") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(row.len(), 6, "{listed}");
    assert_eq!(
        (
            &row[0][..],
            &row[1][..],
            &row[3][..],
            &row[4][..],
            &row[5][..]
        ),
        ("add_one", "1", "0", "1", "0"),
        "{listed}"
    );
    assert!(row[2].parse::<f64>().is_ok_and(|r| r >= 0.0), "{listed}");
    let ran = c.tb(&["ls", "--functions", "other/"]);
    assert!(
        ran.ok("tb ls --functions other/")
            .contains("no functions served"),
        "{}",
        ran.stdout
    );

    // Nobody serves this one: a non-zero exit with one line naming it.
    let ran = c.tb(&["call", "nobody/serves_this", &xs_s]);
    assert!(matches!(ran.code, Some(c) if c != 0), "exit {:?}", ran.code);
    assert!(
        ran.stderr.contains("nobody/serves_this") && ran.stderr.contains("no live node"),
        "{}",
        ran.stderr
    );
    assert_eq!(ran.stderr.trim().lines().count(), 1, "{}", ran.stderr);

    c.node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tb_call_reports_remote_errors_timeouts_and_plain_values() {
    let c = Cluster::start().await;
    let _add = c.serve("add_one", add_one).await;
    let _echo = c.serve("echo", echo).await;
    let stalled = c.serve("stall", stall).await;

    // The handler's own error: its type, message and traceback; nothing written.
    let ys = c.path("never.npy");
    let ran = c.tb(&["call", "add_one", "-o", &ys.to_string_lossy()]);
    assert!(matches!(ran.code, Some(c) if c != 0), "exit {:?}", ran.code);
    for part in [
        "add_one",
        "ValueError",
        "add_one takes an f32 tensor, not None",
        "line 7, in add_one",
    ] {
        assert!(ran.stderr.contains(part), "{part:?} in {}", ran.stderr);
    }
    assert!(!ys.exists(), "a failed call wrote its output");

    // No argument: the function gets None, and a plain result is printed as it is.
    let ran = c.tb(&["call", "echo"]);
    assert_eq!(ran.ok("tb call echo").trim(), "None");

    // A .safetensors argument is a map of its tensors; echoed back, it is written whole.
    let st = c.path("m.safetensors");
    let (w, b) = (le_bytes(&[1.0, 2.0, 3.0, 4.0]), le_bytes(&[-1.0]));
    {
        use safetensors::tensor::{Dtype, TensorView};
        let views = [
            ("w", TensorView::new(Dtype::F32, vec![2, 2], &w).expect("w")),
            ("b", TensorView::new(Dtype::F32, vec![1], &b).expect("b")),
        ];
        safetensors::serialize_to_file(views, None, &st).expect("write .safetensors");
    }
    let out = c.path("echoed.safetensors");
    let ran = c.tb(&[
        "call",
        "echo",
        &st.to_string_lossy(),
        "-o",
        &out.to_string_lossy(),
    ]);
    let stdout = ran.ok("tb call echo m.safetensors");
    assert!(stdout.contains("map of 2 tensors"), "{stdout}");
    let file = std::fs::read(&out).expect("echoed file");
    let echoed = safetensors::SafeTensors::deserialize(&file).expect("valid .safetensors");
    assert_eq!(echoed.tensor("w").expect("w").data(), &w[..]);
    assert_eq!(echoed.tensor("w").expect("w").shape(), [2, 2]);
    assert_eq!(echoed.tensor("b").expect("b").data(), &b[..]);

    // A result that never comes: the command gives up at --timeout with a non-zero exit.
    let started = Instant::now();
    let ran = c.tb(&["call", "stall", "--timeout", "2"]);
    assert!(matches!(ran.code, Some(c) if c != 0), "exit {:?}", ran.code);
    assert!(
        ran.stderr.contains("stall") && ran.stderr.contains("no result within 2 s"),
        "{}",
        ran.stderr
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    // The server saw the caller give up: the stalled handler was cancelled.
    assert!(
        eventually_async(LIMIT, || async { stalled.outstanding() == 0 }).await,
        "the stalled call still runs on the server"
    );

    // One call at a time and none waiting: while a call holds the slot, another is refused.
    let one = FunctionSpec::new("one_at_a_time")
        .expect("name")
        .concurrency(1)
        .queue(0);
    let one = c.serve_spec(one, stall).await;
    let mut holder = c.tb_started(&["call", "one_at_a_time", "--timeout", "50"]);
    assert!(
        eventually_async(LIMIT, || async { one.outstanding() == 1 }).await,
        "the first call never reached the server"
    );
    let ran = c.tb(&["call", "one_at_a_time"]);
    assert!(matches!(ran.code, Some(c) if c != 0), "exit {:?}", ran.code);
    assert!(
        ran.stderr.contains("one_at_a_time")
            && ran.stderr.contains("overloaded")
            && ran.stderr.contains("1 running, 0 queued"),
        "{}",
        ran.stderr
    );
    assert_eq!(ran.stderr.trim().lines().count(), 1, "{}", ran.stderr);

    // SIGTERM (as Ctrl-C) to the holder: it exits with an error, and its call is cancelled
    // on the server well before its link would time out (QUIC's idle timeout, 30 s).
    let pid = holder.0.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status();
    assert!(killed.is_ok_and(|s| s.success()), "kill -TERM {pid}");
    let start = Instant::now();
    let held = loop {
        if let Some(status) = holder.0.try_wait().expect("waiting for tb") {
            break status;
        }
        assert!(
            start.elapsed() < LIMIT,
            "the holding tb call ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!held.success(), "the interrupted call: {held}");
    assert!(
        eventually_async(Duration::from_secs(10), || async { one.outstanding() == 0 }).await,
        "the interrupted call still runs on the server"
    );

    c.node.shutdown().await;
}
