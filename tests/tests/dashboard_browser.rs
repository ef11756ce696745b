//! The web dashboard in a real browser: a cluster of `tb-broker` (its API behind a bearer
//! token, which the page takes from its address) and two `tb-worker` processes on loopback, a
//! tensor published with `tb put`, and the broker's page loaded in headless Chromium. The
//! page must list the tensor in its registry table, show a node's throughput figures move
//! after `tb get` pulls the tensor, and render to a PNG screenshot.
//!
//! The driver is Chromium's own command line, nothing else: `--dump-dom` prints the page's DOM
//! once `--virtual-time-budget` has elapsed. Virtual time stands still while a fetch is in
//! flight, so with a budget of a few seconds the page's 1 s poll of `api/v1/cluster` runs (and
//! its answers are rendered) several times before the DOM is printed. Each Chromium run gets
//! its own profile dir and process group, and the whole group is killed if it overruns.
//!
//! Without Chromium the test prints `SKIPPED: chromium not installed` and passes, except
//! under `CI=true`, where a missing browser is a failure.

use std::{
    collections::BTreeMap,
    io::Read,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use tb_tests::procs::{Proc, bin, broker_command, worker_command};

const START: Duration = Duration::from_secs(30);
/// Wall-clock limit of one Chromium run.
const BROWSER_LIMIT: Duration = Duration::from_secs(60);
/// How many page loads a condition gets before the test gives up (each takes a few seconds:
/// worker figures reach the broker with heartbeats, at most every 2 s).
const ATTEMPTS: usize = 20;
const SECRET: &str = "dashboard-browser-test-secret-32-bytes";
/// The broker's HTTP token (as `head -c 32 /dev/urandom | base64` makes them: `+`, `/`, `=`);
/// the page gets it from its address, `#token=...`.
const HTTP_TOKEN: &str = "ZGFzaGJv+YXJkL/Rva2VuL+Rlc3Qvc2VjcmV0LXRva2Vu==";
const TENSOR: &str = "dash/layer0.weight";
const TENSOR_LEN: usize = 8 << 20;
const SCREEN: (u32, u32) = (1440, 1100);

/// Where Chromium is: `TB_CHROMIUM` (when it names no file: nowhere), else Debian's and
/// other usual names on the `PATH` or in `/usr/bin`.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TB_CHROMIUM") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let names = ["chromium", "chromium-browser", "google-chrome", "chrome"];
    let dirs = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&dirs)
        .chain([PathBuf::from("/usr/bin")])
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| p.is_file())
}

/// Headless Chromium runs, each in a fresh profile under `dir`.
struct Browser {
    exe: PathBuf,
    dir: PathBuf,
    /// Wall-clock limit of one run.
    limit: Duration,
    runs: usize,
}

impl Browser {
    /// Runs Chromium on `url` with `extra` arguments; returns its stdout. Fails if it overruns
    /// its limit (its whole process group is killed) or exits unsuccessfully.
    fn run(&mut self, url: &str, extra: &[String]) -> Result<String, String> {
        self.runs += 1;
        let profile = self.dir.join(format!("profile-{}", self.runs));
        let log = self.dir.join(format!("chromium-{}.log", self.runs));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("chromium log: {e}"))?;
        let mut cmd = Command::new(&self.exe);
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            "--mute-audio",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        // Its own process group: on a timeout the browser and all its helpers go together.
        .process_group(0);
        let mut child = cmd.spawn().map_err(|e| format!("starting chromium: {e}"))?;
        let mut stdout = child.stdout.take().ok_or("chromium stdout")?;
        let reader = std::thread::spawn(move || {
            let mut out = String::new();
            let _ = stdout.read_to_string(&mut out);
            out
        });
        let start = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if start.elapsed() < self.limit => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => {
                    let group = format!("-{}", child.id());
                    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
                    let _ = child.wait();
                    return Err(format!(
                        "chromium ran past {:?} on {url} (killed); log: {}",
                        self.limit,
                        log.display()
                    ));
                }
            }
        };
        let out = reader.join().unwrap_or_default();
        if !status.success() {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(format!("chromium exited with {status} on {url}: {tail}"));
        }
        Ok(out)
    }

    /// The page's DOM after `budget_ms` of virtual time.
    fn dump_dom(&mut self, url: &str, budget_ms: u32) -> String {
        let args = [
            "--dump-dom".to_string(),
            format!("--virtual-time-budget={budget_ms}"),
        ];
        self.run(url, &args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Loads `url` until `check` accepts its DOM (at most [`ATTEMPTS`] loads); returns the
    /// last DOM and whether it was accepted.
    fn dom_until(&mut self, url: &str, mut check: impl FnMut(&str) -> bool) -> (String, bool) {
        let mut dom = String::new();
        for _ in 0..ATTEMPTS {
            dom = self.dump_dom(url, 3000);
            if check(&dom) {
                return (dom, true);
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        (dom, false)
    }
}

/// The value of attribute `name` in the start tag `tag` (`<td class=".." data-x="..">`).
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

/// Every numeric node figure in the nodes table: `(node id, field) -> value`, from
/// `<td data-node=".." data-field=".." data-value="..">` (cells without a value are skipped).
fn node_figures(dom: &str) -> BTreeMap<(String, String), f64> {
    let mut figures = BTreeMap::new();
    for piece in dom.split("<td").skip(1) {
        let Some(tag) = piece.split('>').next() else {
            continue;
        };
        let (Some(node), Some(field), Some(value)) = (
            attr(tag, "data-node"),
            attr(tag, "data-field"),
            attr(tag, "data-value"),
        ) else {
            continue;
        };
        if let Ok(v) = value.parse::<f64>() {
            figures.insert((node.to_string(), field.to_string()), v);
        }
    }
    figures
}

fn figure(dom: &str, node: &str, field: &str) -> Option<f64> {
    node_figures(dom)
        .get(&(node.to_string(), field.to_string()))
        .copied()
}

/// The registry table's row for `tensor`, as HTML.
fn registry_row<'a>(dom: &'a str, tensor: &str) -> Option<&'a str> {
    let start = dom.find(&format!("<tr data-tensor=\"{tensor}\""))?;
    let len = dom[start..].find("</tr>")?;
    Some(&dom[start..start + len])
}

/// The functions table's row of `function`, up to its end.
fn function_row<'a>(dom: &'a str, function: &str) -> Option<&'a str> {
    let start = dom.find(&format!("<tr data-function=\"{function}\""))?;
    let rest = &dom[start..];
    Some(&rest[..rest.find("</tr>").unwrap_or(rest.len())])
}

/// A child process killed (by its PID) and reaped when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A node's id from a `worker: <id>@<ip:port>` line.
fn node_id(addr: &str) -> String {
    addr.split('@').next().unwrap_or_default().to_string()
}

/// The cargo target dir this test runs from (`target/<profile>/deps/<test>` -> `target`).
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .expect("target dir")
}

/// A broker and two workers, each with a metrics server on a free port.
struct Cluster {
    dir: tempfile::TempDir,
    secret_file: PathBuf,
    ticket: String,
    dashboard: String,
    workers: Vec<String>,
    _procs: Vec<Proc>,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
        let token_file = dir.path().join("http_token");
        std::fs::write(&token_file, format!("{HTTP_TOKEN}\n")).expect("token");
        let mut cmd = broker_command(dir.path(), "broker", &secret_file);
        cmd.args(["--liveness-timeout", "5"]);
        cmd.arg("--http-token-file").arg(&token_file);
        let mut broker = Proc::start("broker", cmd, &dir.path().join("broker.log"));
        let ticket = broker.wait_line("ticket:", START);
        let dashboard = broker.wait_line("metrics:", START);
        let mut procs = vec![broker];
        let mut workers = Vec::new();
        for i in 0..2 {
            let name = format!("worker-{i}");
            let cmd = worker_command(dir.path(), &name, &secret_file, &ticket);
            let log = dir.path().join(format!("worker-{i}.log"));
            let mut w = Proc::start(&format!("worker {i}"), cmd, &log);
            workers.push(w.wait_line("worker:", START));
            w.wait_line("metrics:", START);
            procs.push(w);
        }
        Cluster {
            dir,
            secret_file,
            ticket,
            dashboard: format!("{}/#token={HTTP_TOKEN}", dashboard.trim_end_matches('/')),
            workers,
            _procs: procs,
        }
    }

    /// Runs `tb` against this cluster; panics with its stderr if it fails.
    fn tb(&self, args: &[&str]) -> String {
        let out = Command::new(bin("tb"))
            .args(args)
            .arg("--join")
            .arg(&self.ticket)
            .arg("--cluster-secret-file")
            .arg(&self.secret_file)
            .args(["--timeout", "10"])
            .output()
            .expect("running tb");
        assert!(
            out.status.success(),
            "tb {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Checks that `path` is a PNG of `SCREEN` size with real content.
fn assert_png(path: &Path) {
    let png = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    assert!(png.len() > 20_000, "{} is nearly empty", path.display());
    // IHDR: width and height, big-endian, right after the signature and chunk header.
    let dim = |at: usize| {
        png.get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    };
    assert_eq!(
        (dim(16), dim(20)),
        (Some(SCREEN.0), Some(SCREEN.1)),
        "screenshot size"
    );
}

#[test]
fn the_dashboard_shows_a_published_tensor_and_moving_throughput_in_chromium() {
    let Some(exe) = chromium() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but Chromium is not installed (set TB_CHROMIUM or install Debian's chromium)"
        );
        println!("SKIPPED: chromium not installed");
        return;
    };
    let c = Cluster::start();
    let mut browser = Browser {
        exe,
        dir: c.dir.path().join("chromium"),
        limit: BROWSER_LIMIT,
        runs: 0,
    };
    std::fs::create_dir_all(&browser.dir).expect("chromium dir");
    let url = c.dashboard.clone();
    let holder = c.workers[0].clone();
    let holder_id = node_id(&holder);

    // The page is served and lists both workers, alive.
    let (dom, ok) = browser.dom_until(&url, |dom| {
        c.workers
            .iter()
            .all(|w| dom.contains(&format!("data-node-row=\"{}\"", node_id(w))))
    });
    assert!(ok, "both workers in the nodes table; last DOM:\n{dom}");
    assert!(dom.contains("data-state=\"live\""), "page is live: {dom}");
    // Opened without the token, the page says the API wants one and offers a form for it.
    let bare = url.split('#').next().unwrap_or(&url);
    let dom = browser.dump_dom(bare, 3000);
    assert!(
        dom.contains("id=\"token-form\"") && dom.contains("HTTP 401"),
        "the page asks for the token: {dom}"
    );
    assert!(dom.contains("data-state=\"disconnected\""), "{dom}");

    // Publish a tensor on worker 0: the registry table shows it, next to worker 0's figures
    // (from its heartbeats).
    let input = c.dir.path().join("layer0.bin");
    let data: Vec<u8> = (0..TENSOR_LEN).map(|i| (i % 251) as u8).collect();
    std::fs::write(&input, &data).expect("write tensor file");
    let input_s = input.to_string_lossy().into_owned();
    let shape = TENSOR_LEN.to_string();
    let put = [
        "put", TENSOR, &input_s, "--dtype", "u8", "--shape", &shape, "--worker", &holder,
    ];
    c.tb(&put);
    let row = format!("data-tensor=\"{TENSOR}\"");
    let (before, ok) = browser.dom_until(&url, |dom| {
        dom.contains(&row) && figure(dom, &holder_id, "out_bytes_total").is_some()
    });
    assert!(
        ok,
        "registry row {row} and worker 0's out_bytes_total in the page; figures: {:?}",
        node_figures(&before)
    );
    let tr = registry_row(&before, TENSOR).unwrap_or_default();
    for shown in [
        "u8",
        &format!("[{TENSOR_LEN}]"),
        "8.00 MiB",
        holder_id.get(..8).unwrap_or(&holder_id),
    ] {
        assert!(tr.contains(shown), "registry row shows {shown:?}: {tr}");
    }
    let out_before = figure(&before, &holder_id, "out_bytes_total").unwrap_or_default();
    println!("before tb get: {:?}", node_figures(&before));

    // Move the bytes: `tb get` pulls the tensor from its holder, worker 0.
    let output = c.dir.path().join("layer0.out.bin");
    let output_s = output.to_string_lossy().into_owned();
    c.tb(&["get", TENSOR, "-o", &output_s]);
    assert_eq!(
        std::fs::read(&output).expect("read back"),
        data,
        "tb get bytes"
    );
    let (after, ok) = browser.dom_until(&url, |dom| {
        figure(dom, &holder_id, "out_bytes_total")
            .is_some_and(|v| v >= out_before + TENSOR_LEN as f64)
    });
    println!("after tb get: {:?}", node_figures(&after));
    assert!(
        ok,
        "worker 0's out_bytes_total in the page grew from {out_before} by >= {TENSOR_LEN}"
    );

    // Each node's channels cell lists its pooled links as `peer=channel`: QUIC between the
    // workers and the CLI, shm on a worker's link to the broker's node (the workers send
    // their control requests on the same-host socket).
    let cell = format!("data-node=\"{holder_id}\" data-field=\"channels\"");
    assert!(
        after.contains(&cell),
        "a channels cell for worker 0: {after}"
    );
    for tag in after
        .split("<td")
        .filter(|t| t.contains("data-field=\"channels\""))
    {
        let tag = tag.split('>').next().unwrap_or_default();
        let links = attr(tag, "data-value").unwrap_or_default();
        for link in links.split_whitespace() {
            assert!(
                link.ends_with("=quic") || link.ends_with("=shm"),
                "link {link} in {tag}"
            );
        }
    }

    // A process serving remote functions (`echo`, `add_one`): the functions table lists
    // them with that server.
    // It serves until its stdin closes: kept open here, and the process killed by its PID
    // when the test ends however it ends.
    let log = std::fs::File::create(c.dir.path().join("call-serve.log")).expect("log");
    let server = Command::new(bin("tb"))
        .args([
            "bench",
            "call-serve",
            "--join",
            &c.ticket,
            "--concurrency",
            "2",
        ])
        .arg("--cluster-secret-file")
        .arg(&c.secret_file)
        .env("TB_METRICS_ADDR", "127.0.0.1:0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("starting tb bench call-serve");
    let mut server = KillOnDrop(server);
    let stdout = server.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
        let _ = tx.send(line);
    });
    let ready = rx
        .recv_timeout(START)
        .expect("the call server's ready line");
    let server_id = node_id(ready.trim().strip_prefix("ready ").expect("a ready line"));
    let (dom, ok) = browser.dom_until(&url, |dom| {
        ["echo", "add_one"]
            .iter()
            .all(|f| function_row(dom, f).is_some_and(|tr| tr.contains(&server_id[..8])))
    });
    assert!(
        ok,
        "echo and add_one served by {server_id} in the functions table: {dom}"
    );

    // Two calls of echo: its row shows them once the server's heartbeat reported them.
    let arg = c.dir.path().join("x.npy");
    tb_tests::write_npy(&arg, &[1.0, 2.0, 3.0]);
    for _ in 0..2 {
        let out = Command::new(bin("tb"))
            .arg("call")
            .arg("echo")
            .arg(&arg)
            .arg("--join")
            .arg(&c.ticket)
            .arg("--cluster-secret-file")
            .arg(&c.secret_file)
            .output()
            .expect("running tb call");
        assert!(out.status.success(), "tb call echo: {out:?}");
    }
    let (dom, ok) = browser.dom_until(&url, |dom| {
        function_row(dom, "echo").is_some_and(|tr| {
            tr.contains("data-field=\"calls\">2<") && tr.contains("data-field=\"failed\">0<")
        })
    });
    assert!(ok, "echo's row counts 2 calls, none failed: {dom}");

    // A screenshot, with a few seconds of chart history.
    let shot = target_dir().join("dashboard-screenshot.png");
    let args = [
        format!("--screenshot={}", shot.display()),
        format!("--window-size={},{}", SCREEN.0, SCREEN.1),
        "--virtual-time-budget=8000".to_string(),
    ];
    let _ = std::fs::remove_file(&shot);
    browser.run(&url, &args).unwrap_or_else(|e| panic!("{e}"));
    assert_png(&shot);
    println!("screenshot: {}", shot.display());
}
