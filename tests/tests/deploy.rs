//! `deploy/` against the real thing: every metric the Grafana dashboard and the alert rules
//! query is one that real `tb-broker` and `tb-worker` processes export (with the label values
//! the queries select); promtool accepts the shipped Prometheus config, the alert rules and
//! both processes' real `/metrics`; a real Prometheus started with the shipped config (targets
//! swapped for a loopback cluster) scrapes every process and sees `tb_transfer_bytes_total`
//! rise after `tb put` and `tb get`; the container entrypoint builds tickets from real
//! brokers' `/api/v1/status`.
//!
//! promtool, prometheus and curl come from Debian packages (`.ci/run` installs them). Where
//! one is missing a test prints `SKIPPED: ...` and passes, unless `CI=true`: then it fails.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

#[path = "deploy/queries.rs"]
mod queries;

use queries::{
    Exported, Selector, all_panels, dashboard_queries, parse_exposition, rule_exprs, selectors,
};
use serde_json::Value;
use tb_tests::{
    http,
    procs::{Proc, bin, broker_command, free_udp_addr, worker_command},
};

/// How long a process may take to print its start-up lines.
const START: Duration = Duration::from_secs(30);
/// How long Prometheus may take to become ready, find its targets up, or see a change.
const PROM_WAIT: Duration = Duration::from_secs(60);
const SECRET: &str = "deploy-test-cluster-secret-of-32-bytes";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn deploy_file(rel: &str) -> PathBuf {
    repo().join("deploy").join(rel)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// An external tool, or `None` after printing why the test skips; under `CI=true` a missing
/// tool fails the test instead.
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{name} is not installed (Debian package `{package}`); CI=true needs it");
        }
        println!(
            "SKIPPED: {name} is not installed (Debian package `{package}`; .ci/run installs it)"
        );
    }
    found
}

// ---- A loopback cluster with metrics servers --------------------------------------------

/// One broker and one worker, both serving `/metrics` on a free loopback port.
struct Cluster {
    dir: tempfile::TempDir,
    secret_file: PathBuf,
    ticket: String,
    /// `ip:port` of the broker's HTTP server.
    broker_http: String,
    /// `ip:port` of the worker's HTTP server.
    worker_http: String,
    /// The worker's `<node-id>@<ip:port>`.
    worker_addr: String,
    procs: Vec<Proc>,
}

fn http_addr(line: &str) -> String {
    line.trim()
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("metrics line {line:?} is not http://ip:port"))
        .trim_end_matches('/')
        .to_string()
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");

        let cmd = broker_command(dir.path(), "broker", &secret_file);
        let mut broker = Proc::start("broker", cmd, &dir.path().join("broker.log"));
        let ticket = broker.wait_line("ticket:", START);
        let broker_http = http_addr(&broker.wait_line("metrics:", START));

        let cmd = worker_command(dir.path(), "worker", &secret_file, &ticket);
        let mut worker = Proc::start("worker", cmd, &dir.path().join("worker.log"));
        let worker_addr = worker.wait_line("worker:", START);
        let worker_http = http_addr(&worker.wait_line("metrics:", START));
        Cluster {
            dir,
            secret_file,
            ticket,
            broker_http,
            worker_http,
            worker_addr,
            procs: vec![broker, worker],
        }
    }

    /// Runs the `tb` command against this cluster; panics with its output if it fails.
    fn tb(&self, args: &[&str]) -> String {
        let out = Command::new(bin("tb"))
            .args(args)
            .arg("--join")
            .arg(&self.ticket)
            .arg("--cluster-secret-file")
            .arg(&self.secret_file)
            .args(["--timeout", "20"])
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .expect("running tb");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "tb {args:?} failed: {text}");
        text
    }

    fn shutdown(mut self) {
        for p in &mut self.procs {
            p.terminate(Duration::from_secs(10));
        }
    }
}

/// GETs `http://{addr}{path}`, expecting 200.
fn get_ok(addr: &str, path: &str) -> String {
    let url = format!("http://{addr}{path}");
    match http::get(&url) {
        Ok((200, body)) => body,
        Ok((status, body)) => panic!("GET {url}: {status}: {body}"),
        Err(e) => panic!("{e}"),
    }
}

/// Series Prometheus makes itself rather than scraping them.
fn synthetic(metric: &str) -> bool {
    metric == "up" || metric.starts_with("scrape_") || metric.starts_with("ALERTS")
}

/// Target labels Prometheus attaches; not in the processes' own output.
fn target_label(label: &str) -> bool {
    matches!(label, "job" | "instance" | "cluster")
}

/// Problems with the queries: metrics nobody exports, and `label="value"` matchers no
/// exported series of that metric carries.
fn unexported(queries: &[(String, Vec<Selector>)], exported: &Exported) -> Vec<String> {
    let mut problems = Vec::new();
    for (where_, sels) in queries {
        for s in sels {
            if synthetic(&s.metric) {
                continue;
            }
            let Some(series) = exported.get(&s.metric) else {
                problems.push(format!("{}: not exported ({where_})", s.metric));
                continue;
            };
            for (label, value) in s.equals.iter().filter(|(l, _)| !target_label(l)) {
                if !series.iter().any(|labels| labels.get(label) == Some(value)) {
                    problems.push(format!(
                        "{}{{{label}=\"{value}\"}}: no such series ({where_})",
                        s.metric
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn grafana_dashboard_is_valid_json_with_unique_panel_ids() {
    let dashboard: Value = serde_json::from_str(&read(&deploy_file("grafana/tensor-broker.json")))
        .expect("deploy/grafana/tensor-broker.json is valid JSON");
    assert_eq!(
        dashboard.get("uid").and_then(Value::as_str),
        Some("tensor-broker")
    );
    let mut panels = Vec::new();
    if let Some(Value::Array(top)) = dashboard.get("panels") {
        all_panels(top, &mut panels);
    }
    assert!(panels.len() >= 20, "only {} panels", panels.len());
    let mut ids = BTreeSet::new();
    for p in &panels {
        match p.get("id").and_then(Value::as_u64) {
            Some(id) if id >= 1 => {
                assert!(ids.insert(id), "panel id {id} is used twice");
            }
            other => panic!("panel {:?} has id {other:?}", p.get("title")),
        }
        let Some(pos) = p.get("gridPos") else {
            panic!("panel {:?} has no gridPos", p.get("title"));
        };
        let (Some(x), Some(w)) = (
            pos.get("x").and_then(Value::as_f64),
            pos.get("w").and_then(Value::as_f64),
        ) else {
            panic!("panel {:?}: bad gridPos", p.get("title"));
        };
        assert!(
            x + w <= 24.0,
            "panel {:?} is wider than the grid",
            p.get("title")
        );
    }
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 30, "only {} queries", queries.len());
    assert!(
        queries.iter().all(|(_, s)| !s.is_empty()),
        "a query names no metric"
    );
}

#[test]
fn every_queried_metric_is_exported() {
    let dashboard: Value = serde_json::from_str(&read(&deploy_file("grafana/tensor-broker.json")))
        .expect("dashboard JSON");
    let mut queries = dashboard_queries(&dashboard);
    for expr in rule_exprs(&read(&deploy_file("prometheus/alerts.yml"))) {
        queries.push((format!("alert rule: {expr}"), selectors(&expr)));
    }
    let queried: BTreeSet<&str> = queries
        .iter()
        .flat_map(|(_, s)| s.iter().map(|s| s.metric.as_str()))
        .collect();
    // The dashboard covers every area the deploy brief names.
    for needed in [
        "tb_pool_links",
        "tb_pool_dials_total",
        "tb_pool_reuses_total",
        "tb_transfer_bytes_total",
        "tb_transfers_total",
        "tb_transfer_duration_seconds_bucket",
        "tb_registry_names",
        "tb_registry_holders",
        "tb_cluster_nodes",
        "tb_store_bytes",
        "tb_auth_failures_total",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "up",
    ] {
        assert!(queried.contains(needed), "nothing queries {needed}");
    }

    let cluster = Cluster::start();
    let mut exported = Exported::new();
    parse_exposition(&get_ok(&cluster.broker_http, "/metrics"), &mut exported);
    parse_exposition(&get_ok(&cluster.worker_http, "/metrics"), &mut exported);
    cluster.shutdown();

    let problems = unexported(&queries, &exported);
    assert!(
        problems.is_empty(),
        "queried but not exported by tb-broker/tb-worker:\n  {}\nexported: {:?}",
        problems.join("\n  "),
        exported.keys().collect::<Vec<_>>()
    );
    println!(
        "{} queries name {} metrics, all exported: {:?}",
        queries.len(),
        queried.len(),
        queried
    );
}

// ---- promtool ---------------------------------------------------------------------------

fn promtool(promtool: &Path, args: &[&str], dir: &Path, stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new(promtool)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running promtool");
    if let Some(mut input) = child.stdin.take() {
        input
            .write_all(stdin.unwrap_or_default().as_bytes())
            .expect("promtool stdin");
    }
    let out = child.wait_with_output().expect("promtool output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn promtool_accepts_the_config_the_rules_and_real_metrics() {
    let Some(pt) = tool("promtool", "prometheus") else {
        return;
    };
    let dir = deploy_file("prometheus");
    // prometheus.yml names alerts.yml relative to itself: run where that resolves.
    let (ok, out) = promtool(&pt, &["check", "config", "prometheus.yml"], &dir, None);
    assert!(ok, "promtool check config:\n{out}");
    assert!(out.contains("1 rule files found"), "{out}");
    let (ok, out) = promtool(&pt, &["check", "rules", "alerts.yml"], &dir, None);
    assert!(ok, "promtool check rules:\n{out}");

    let cluster = Cluster::start();
    for (role, addr) in [
        ("tb-broker", cluster.broker_http.clone()),
        ("tb-worker", cluster.worker_http.clone()),
    ] {
        let metrics = get_ok(&addr, "/metrics");
        // Lint warnings count as failures: promtool exits non-zero on them.
        let (ok, out) = promtool(&pt, &["check", "metrics"], &dir, Some(&metrics));
        assert!(ok, "promtool check metrics on {role}'s /metrics:\n{out}");
        assert!(out.trim().is_empty(), "promtool on {role}: {out}");
    }
    cluster.shutdown();
}

// ---- A real Prometheus ------------------------------------------------------------------

/// The shipped prometheus.yml with every job's service discovery replaced by static targets
/// and a 1 s scrape and evaluation interval. Job names, rule files and everything else stay.
/// Fails on a job it has no targets for.
fn config_for_test(shipped: &str, targets: &BTreeMap<&str, String>) -> Result<String, String> {
    let mut out = Vec::new();
    let mut job: Option<String> = None;
    let mut job_indent = 0;
    let mut skipping: Option<usize> = None;
    let mut seen = BTreeSet::new();
    for line in shipped.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        if let Some(level) = skipping {
            if t.is_empty() || t.starts_with('#') || indent > level {
                continue;
            }
            skipping = None;
        }
        if let Some(name) = t.strip_prefix("- job_name:") {
            let name = name.trim().trim_matches(['"', '\'']).to_string();
            let target = targets
                .get(name.as_str())
                .ok_or(format!("no test target for job {name:?}"))?;
            job_indent = indent + 2;
            out.push(line.to_string());
            out.push(format!("{:job_indent$}static_configs:", ""));
            out.push(format!("{:job_indent$}  - targets: [\"{target}\"]", ""));
            seen.insert(name.clone());
            job = Some(name);
            continue;
        }
        if job.is_some() && indent == job_indent && t.ends_with("_configs:") {
            skipping = Some(indent); // static_configs, dns_sd_configs, ...: replaced above
            continue;
        }
        if t.starts_with("scrape_interval:") || t.starts_with("evaluation_interval:") {
            let key = t.split(':').next().unwrap_or_default();
            out.push(format!("{:indent$}{key}: 1s", ""));
            continue;
        }
        if t.starts_with("scrape_timeout:") {
            out.push(format!("{:indent$}scrape_timeout: 1s", ""));
            continue;
        }
        out.push(line.to_string());
    }
    for name in targets.keys() {
        if !seen.contains(*name) {
            return Err(format!("the shipped config has no job {name:?}"));
        }
    }
    Ok(out.join("\n") + "\n")
}

fn free_tcp_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Polls `check` every 250 ms until it returns `Some` or `limit` passes.
fn wait_for<T>(limit: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The scalar value of a one-series instant-query result (`"value":[<ts>,"<v>"]`).
fn query_value(prom: &str, promql_urlencoded: &str) -> Option<f64> {
    let (status, body) = http::get(&format!(
        "http://{prom}/api/v1/query?query={promql_urlencoded}"
    ))
    .ok()?;
    if status != 200 {
        return None;
    }
    let json: Value = serde_json::from_str(&body).ok()?;
    let results = json.get("data")?.get("result")?.as_array()?;
    // `"value": [<ts>, "<v>"]`
    results
        .first()?
        .get("value")?
        .get(1)?
        .as_str()?
        .parse()
        .ok()
}

/// Active targets' `(job, health)`.
fn target_health(prom: &str) -> Vec<(String, String)> {
    let Ok((200, body)) = http::get(&format!("http://{prom}/api/v1/targets?state=active")) else {
        return Vec::new();
    };
    let Ok(json) = serde_json::from_str::<Value>(&body) else {
        return Vec::new();
    };
    let Some(Value::Array(active)) = json.get("data").and_then(|d| d.get("activeTargets")) else {
        return Vec::new();
    };
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
    active
        .iter()
        .map(|t| {
            let job = text(t.get("labels").and_then(|l| l.get("job")));
            (job, text(t.get("health")))
        })
        .collect()
}

#[test]
fn real_prometheus_scrapes_every_process_and_sees_transfers() {
    let Some(prometheus) = tool("prometheus", "prometheus") else {
        return;
    };
    let cluster = Cluster::start();
    let dir = cluster.dir.path().join("prometheus");
    std::fs::create_dir_all(&dir).expect("prometheus dir");
    let port = free_tcp_port();
    let prom = format!("127.0.0.1:{port}");
    let targets = BTreeMap::from([
        ("prometheus", prom.clone()),
        ("tb-broker", cluster.broker_http.clone()),
        ("tb-worker", cluster.worker_http.clone()),
    ]);
    let config = config_for_test(&read(&deploy_file("prometheus/prometheus.yml")), &targets)
        .expect("test config");
    std::fs::write(dir.join("prometheus.yml"), &config).expect("config");
    std::fs::copy(deploy_file("prometheus/alerts.yml"), dir.join("alerts.yml"))
        .expect("alerts.yml");

    let mut cmd = Command::new(prometheus);
    cmd.arg(format!(
        "--config.file={}",
        dir.join("prometheus.yml").display()
    ))
    .arg(format!(
        "--storage.tsdb.path={}",
        dir.join("data").display()
    ))
    .arg(format!("--web.listen-address={prom}"))
    .arg("--log.level=warn")
    .current_dir(&dir);
    let log = dir.join("prometheus.log");
    let mut server = Proc::start("prometheus", cmd, &log);
    let tail = |what: &str| -> String {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let start = text.len().saturating_sub(4000);
        format!(
            "{what}\n--- config ---\n{config}--- prometheus log (tail) ---\n{}",
            &text[start..]
        )
    };

    let ready = wait_for(PROM_WAIT, || {
        matches!(http::get(&format!("http://{prom}/-/ready")), Ok((200, _))).then_some(())
    });
    assert!(ready.is_some(), "{}", tail("prometheus never became ready"));

    // Every target of every shipped job is up.
    let health = wait_for(PROM_WAIT, || {
        let h = target_health(&prom);
        let all_up = h.len() == targets.len() && h.iter().all(|(_, health)| health == "up");
        all_up.then_some(h)
    });
    assert!(
        health.is_some(),
        "{}",
        tail(&format!("targets not all up: {:?}", target_health(&prom)))
    );
    let sum_bytes = "sum%28tb_transfer_bytes_total%29";
    let before = wait_for(PROM_WAIT, || query_value(&prom, sum_bytes))
        .unwrap_or_else(|| panic!("{}", tail("no value for sum(tb_transfer_bytes_total)")));
    let up = wait_for(PROM_WAIT, || {
        query_value(&prom, "count%28up%20%3D%3D%201%29").filter(|v| *v >= 3.0)
    });
    assert_eq!(up, Some(3.0), "{}", tail("count(up == 1)"));

    // One tensor pushed to the worker (`tb put`) and pulled back (`tb get`).
    const LEN: usize = 1 << 20;
    let data = tb_tests::pattern(LEN, 7);
    let input = cluster.dir.path().join("in.bin");
    std::fs::write(&input, &data).expect("input");
    let input = input.to_string_lossy().into_owned();
    let shape = LEN.to_string();
    let put = cluster.tb(&[
        "put",
        "deploy/w",
        &input,
        "--dtype",
        "u8",
        "--shape",
        &shape,
        "--worker",
        &cluster.worker_addr,
    ]);
    let output = cluster.dir.path().join("out.bin");
    let output_s = output.to_string_lossy().into_owned();
    let get = cluster.tb(&["get", "deploy/w", "-o", &output_s]);
    assert_eq!(
        std::fs::read(&output).expect("tb get output"),
        data,
        "tb get returned other bytes ({put} / {get})"
    );

    // The worker received it and served it: the cluster-wide byte counter rises by both.
    let want = before + 2.0 * LEN as f64;
    let after = wait_for(PROM_WAIT, || {
        query_value(&prom, sum_bytes).filter(|v| *v >= want)
    });
    assert!(
        after.is_some(),
        "{}",
        tail(&format!(
            "sum(tb_transfer_bytes_total) went from {before} to {:?}, not to {want} or more",
            query_value(&prom, sum_bytes)
        ))
    );
    println!(
        "prometheus {prom}: targets {:?}; sum(tb_transfer_bytes_total) {before} -> {:?}",
        health.unwrap_or_default(),
        after
    );
    server.terminate(Duration::from_secs(10));
    cluster.shutdown();
}

#[test]
fn config_for_test_swaps_discovery_for_static_targets() {
    let shipped = read(&deploy_file("prometheus/prometheus.yml"));
    let targets = BTreeMap::from([
        ("prometheus", "127.0.0.1:1".to_string()),
        ("tb-broker", "127.0.0.1:2".to_string()),
        ("tb-worker", "127.0.0.1:3".to_string()),
    ]);
    let config = config_for_test(&shipped, &targets).expect("config");
    for t in targets.values() {
        assert!(config.contains(&format!("[\"{t}\"]")), "{config}");
    }
    assert!(!config.contains("dns_sd_configs"), "{config}");
    assert!(!config.contains("broker-1:9410"), "{config}");
    assert!(config.contains("  - alerts.yml"), "{config}");
    assert!(config.contains("scrape_interval: 1s"), "{config}");
    // A job the test knows nothing about is an error, not a silently unscraped job.
    let fewer = BTreeMap::from([("prometheus", "127.0.0.1:1".to_string())]);
    assert!(config_for_test(&shipped, &fewer).is_err());
}

// ---- The container entrypoint -------------------------------------------------------------

#[test]
fn entrypoint_builds_tickets_from_brokers_status_api() {
    if tool("curl", "curl").is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
    // As in the shipped manifests, the API wants a bearer token, which the entrypoint sends
    // (a base64 token: `+` and `/` must survive the header).
    let token_file = dir.path().join("http_token");
    std::fs::write(&token_file, "deploy+test/http+token==\n").expect("token");
    let broker_bin = bin("tb-broker");
    let worker_bin = bin("tb-worker");
    let bin_dir = broker_bin.parent().expect("bin dir").to_path_buf();
    assert_eq!(worker_bin.parent(), Some(bin_dir.as_path()));
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let entrypoint = deploy_file("docker/tb-entrypoint");
    let start = |role: &str, name: &str, join_urls: Option<&str>| -> (Proc, u16) {
        let metrics_port = free_tcp_port();
        let mut cmd = Command::new("sh");
        cmd.arg(&entrypoint)
            .arg(role)
            .env("PATH", &path)
            .env("TB_POD_IP", "127.0.0.1")
            .env("TB_QUIC_PORT", free_udp_addr().port().to_string())
            .env("TB_METRICS_PORT", metrics_port.to_string())
            .env("TB_DATA_DIR", dir.path().join(name))
            .env("TB_CLUSTER_SECRET_FILE", &secret_file)
            .env("TB_HTTP_TOKEN_FILE", &token_file)
            .env("TB_JOIN_WAIT", "30")
            .env_remove("TB_JOIN")
            .env_remove("TB_LISTEN")
            .env_remove("TB_METRICS_ADDR")
            .env_remove("TB_JOIN_FILE");
        match join_urls {
            Some(urls) => cmd.env("TB_JOIN_URLS", urls).env("TB_JOIN_REQUIRED", "1"),
            None => cmd.env_remove("TB_JOIN_URLS"),
        };
        let log = dir.path().join(format!("{name}.log"));
        (Proc::start(name, cmd, &log), metrics_port)
    };

    // The first broker: no URLs, so no ticket; it serves its status on the metrics port.
    let (mut first, first_port) = start("tb-broker", "broker-0", None);
    let first_ticket = first.wait_line("ticket:", START);
    let first_http = http_addr(&first.wait_line("metrics:", START));
    assert!(
        first_http.ends_with(&format!(":{first_port}")),
        "{first_http} is not on TB_METRICS_PORT {first_port}"
    );
    let first_id = first_ticket
        .strip_prefix("tbc1:")
        .and_then(|t| t.split('@').next())
        .expect("ticket names a broker")
        .to_string();
    // Without the token the status is refused: discovery below works only with it.
    let refused = http::get(&format!("http://{first_http}/api/v1/status"));
    assert!(matches!(refused, Ok((401, _))), "{refused:?}");

    // A broker that is gone by now: its URL answers nothing and is left out of tickets.
    let (mut gone, gone_port) = start("tb-broker", "broker-1", None);
    gone.wait_line("ticket:", START);
    gone.kill9();
    let urls = format!("http://127.0.0.1:{gone_port} http://127.0.0.1:{first_port}");
    let (mut joined, _) = start("tb-broker", "broker-2", Some(&urls));
    let joined_ticket = joined.wait_line("ticket:", START);
    assert!(
        joined_ticket.contains(&first_id) && joined_ticket.split(',').count() == 2,
        "the joining broker's ticket {joined_ticket:?} should name itself and the first broker {first_id}"
    );

    // A worker joins through the same discovery and gets to heartbeat (ready).
    let (mut worker, worker_port) = start("tb-worker", "worker-0", Some(&urls));
    worker.wait_line("worker:", START);
    let ready = wait_for(START, || {
        matches!(
            http::get(&format!("http://127.0.0.1:{worker_port}/readyz")),
            Ok((200, _))
        )
        .then_some(())
    });
    assert!(ready.is_some(), "the worker never became ready");
    for p in [&mut worker, &mut joined, &mut first] {
        p.terminate(Duration::from_secs(10));
    }
}
