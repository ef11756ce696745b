//! Real processes for cluster tests: the built `tb-broker` and `tb-worker` binaries, started
//! on loopback with their own data dirs, their stdout lines collected, and killed by PID
//! when the test drops them (a failing test leaves nothing running).

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

/// Each binary the tests run and the package that builds it: `CARGO_BIN_EXE_*` only names
/// binaries of the package under test, so the tests find the others in the target dir and
/// build them there when missing. Moving a binary to another crate is one line here.
const BINARIES: [(&str, &str); 3] = [
    ("tb", "tb-cli"),
    ("tb-broker", "tb-daemon"),
    ("tb-worker", "tb-daemon"),
];

/// The path of a workspace binary (`tb`, `tb-broker`, `tb-worker`) built in the same profile
/// as the running test, building it first if it is missing (`cargo test` builds only the
/// binaries of the package under test).
pub fn bin(name: &str) -> PathBuf {
    let package = BINARIES
        .iter()
        .find_map(|&(bin, package)| (bin == name).then_some(package))
        .unwrap_or_else(|| panic!("no package builds a binary named {name:?}"));
    static BUILT: OnceLock<Mutex<()>> = OnceLock::new();
    let _one_build_at_a_time = BUILT
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // target/<profile>/deps/<test-binary> -> target/<profile>/<name>
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let path = profile_dir.join(name);
    if !path.exists() {
        let release = profile_dir.ends_with("release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", package, "--bin", name]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "building {name} failed");
    }
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// A child process killed (SIGKILL, by PID) when dropped, with its stdout lines recorded.
pub struct Proc {
    /// What it is, for messages.
    pub label: String,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Starts `cmd` with stdout captured and stderr appended to `log` (kept for post-mortems).
    ///
    /// Daemons get `TB_METRICS_ADDR=127.0.0.1:0` unless the command sets it (a
    /// `--metrics-addr` flag wins over it too), so processes of one test never fight over the
    /// default metrics ports.
    pub fn start(label: &str, mut cmd: Command, log: &Path) -> Proc {
        if !cmd.get_envs().any(|(k, _)| k == "TB_METRICS_ADDR") {
            cmd.env("TB_METRICS_ADDR", "127.0.0.1:0");
        }
        let stderr = std::fs::File::create(log).expect("log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr));
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {label}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        Proc {
            label: label.to_string(),
            child,
            lines,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits (up to `limit`) for a stdout line starting with `prefix`; returns the rest.
    pub fn wait_line(&mut self, prefix: &str, limit: Duration) -> String {
        let start = Instant::now();
        while start.elapsed() < limit {
            {
                let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(line) = lines.iter().find_map(|l| l.strip_prefix(prefix)) {
                    return line.trim().to_string();
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before printing {prefix:?}",
                    self.label
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{} printed no {prefix:?} line within {limit:?}", self.label);
    }

    /// Waits up to `limit` for the process to exit by itself; its status, or `None` if it is
    /// still running.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The stdout lines printed so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// SIGKILL: the process dies without any chance to clean up.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (a name `kill` takes: `STOP`, `CONT`, ...); whether `kill` succeeded.
    pub fn signal(&self, signal: &str) -> bool {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// SIGTERM, then waits up to `limit` for a graceful exit (SIGKILL after that); returns
    /// whether it exited by itself with success.
    pub fn terminate(&mut self, limit: Duration) -> bool {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A free UDP address on 127.0.0.1 (bound then released).
pub fn free_udp_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], crate::free_udp_port()))
}

/// A `tb-broker` command for a test cluster: its data dir `dir/name`, a free loopback port, the
/// secret in `secret_file`, metrics on a free port (it prints `ticket:` and `metrics:` lines).
/// Add flags to it before starting it with [`Proc::start`].
pub fn broker_command(dir: &Path, name: &str, secret_file: &Path) -> Command {
    broker_command_at(dir, name, secret_file, &free_udp_addr().to_string())
}

/// [`broker_command`] listening at `listen` (a broker restarted at the address it had).
pub fn broker_command_at(dir: &Path, name: &str, secret_file: &Path, listen: &str) -> Command {
    let mut cmd = Command::new(bin("tb-broker"));
    cmd.arg("--data-dir")
        .arg(dir.join(name))
        .arg("--listen")
        .arg(listen)
        .arg("--cluster-secret-file")
        .arg(secret_file)
        .args(["--metrics-addr", "127.0.0.1:0"]);
    cmd
}

/// A `tb-worker` command joining `ticket`, like [`broker_command`] (it prints `worker:` and
/// `metrics:` lines).
pub fn worker_command(dir: &Path, name: &str, secret_file: &Path, ticket: &str) -> Command {
    let mut cmd = Command::new(bin("tb-worker"));
    cmd.arg("--join")
        .arg(ticket)
        .arg("--data-dir")
        .arg(dir.join(name))
        .arg("--listen")
        .arg(free_udp_addr().to_string())
        .arg("--cluster-secret-file")
        .arg(secret_file)
        .args(["--metrics-addr", "127.0.0.1:0"]);
    cmd
}
