//! `tb bench p2p`, `tb bench broadcast`, `tb bench registry` and `tb bench call` as a user
//! runs them: one JSON object each, in the format the benchmarks promise, with sane values
//! (never timings checked against limits: speed is for the benchmark to report, not for tests
//! to assert). Each run is a small cluster in one `tb` process on loopback (`tb bench call`
//! adds server processes of its own, which exit when its pipe to them closes); the process
//! is killed by PID if it hangs.

use std::{process::Command, time::Duration};

use tb_tests::procs::{Proc, bin};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `tb bench ARGS --json` and returns its one JSON line.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(bin("tb"));
    cmd.arg("bench").args(args).arg("--json");
    let mut p = Proc::start("tb bench", cmd, &dir.path().join("bench.log"));
    let line = p.wait_line("{", LIMIT);
    serde_json::from_str(&format!("{{{line}")).expect("one JSON object")
}

fn seconds(v: &serde_json::Value, field: &str) -> f64 {
    let s = v[field].as_f64().unwrap_or(-1.0);
    assert!(s.is_finite() && s > 0.0, "{field} = {v}");
    s
}

#[test]
fn bench_broadcast_prints_the_promised_json() {
    let v = bench_json(&[
        "broadcast",
        "--receivers",
        "3",
        "--size",
        "2MiB",
        "--max-upload-rate",
        "0",
    ]);
    assert_eq!(v["bench"], "broadcast");
    assert_eq!(v["receivers"], 3);
    assert_eq!(v["size_bytes"], 2 << 20);
    for field in [
        "single_transfer_s",
        "broadcast_s",
        "naive_s",
        "others_s",
        "all_s",
        "from_holders_s",
    ] {
        seconds(&v, field);
    }
    assert_eq!(v["slow_receivers"], 0);
    assert_eq!(v["others_s"], v["all_s"], "no slow receivers: {v}");
    assert_eq!(v["broadcast_s"], v["all_s"]);
    assert_eq!(v["slow_uploaded_bytes"], 0);
    // The publisher sent at least one copy (someone got it from the publisher).
    let sent = v["publisher_uploaded_bytes"]
        .as_u64()
        .expect("a byte count");
    assert!(sent >= 2 << 20, "{v}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(12), "{v}");
}

#[test]
fn bench_broadcast_with_slow_receivers_reports_both_times() {
    let v = bench_json(&[
        "broadcast",
        "--receivers",
        "3",
        "--size",
        "2MiB",
        "--max-upload-rate",
        "20MB/s",
        "--slow-receivers",
        "1",
        "--slow-upload-rate",
        "1MB/s",
    ]);
    assert_eq!(v["slow_receivers"], 1);
    let (others, all) = (seconds(&v, "others_s"), seconds(&v, "all_s"));
    assert!(others <= all, "{v}");
    assert!(v["slow_uploaded_bytes"].as_u64().is_some(), "{v}");
}

#[test]
fn bench_registry_prints_the_promised_json() {
    let v = bench_json(&["registry", "--brokers", "2", "--names", "40"]);
    assert_eq!(v["bench"], "registry");
    assert_eq!(v["names"], 40);
    let (p50, p99) = (seconds(&v, "visible_p50_ms"), seconds(&v, "visible_p99_ms"));
    assert!(p50 <= p99, "{v}");
    seconds(&v, "catch_up_s");
    assert_eq!(v.as_object().map(|o| o.len()), Some(5), "{v}");
}

#[test]
fn bench_call_prints_the_promised_json() {
    let v = bench_json(&[
        "call",
        "--servers",
        "1,2",
        "--sizes",
        "4KiB,64KiB",
        "--concurrency",
        "1,4",
        "--seconds",
        "0.2",
        "--stream-sizes",
        "256KiB",
    ]);
    assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
    // A stream of 256 KiB items per system, 3 streams of 64 items, every item counted.
    let streams = v["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), 4, "{v}");
    for system in ["tensor-broker", "tensor-broker-quic", "grpc", "zmq"] {
        let found: Vec<_> = streams.iter().filter(|c| c["system"] == system).collect();
        assert_eq!(found.len(), 1, "{system}: {v}");
        let case = found[0];
        assert_eq!(case["size_bytes"], 256 << 10, "{case}");
        assert_eq!(case["streams"], 3, "{case}");
        assert_eq!(case["items_per_stream"], 64, "{case}");
        positive(&case["items_per_s"], "items_per_s");
        positive(&case["mb_s"], "mb_s");
        let p50 = positive(&case["gap_p50_us"], "gap_p50_us");
        let p99 = positive(&case["gap_p99_us"], "gap_p99_us");
        assert!(p50 <= p99, "{case}");
        assert_eq!(case.as_object().map(|o| o.len()), Some(8), "{case}");
    }
    let cases = v["cases"].as_array().expect("cases");
    // Four systems (the default channels, QUIC only, and the gRPC and ZeroMQ baselines) x
    // servers x ops x sizes x concurrency.
    assert_eq!(cases.len(), 4 * 2 * 2 * 2 * 2, "{v}");
    let each = [1, 2].into_iter().flat_map(|servers| {
        ["tensor-broker", "tensor-broker-quic", "grpc", "zmq"]
            .into_iter()
            .map(move |system| (servers, system))
    });
    for (servers, system) in each {
        for op in ["echo", "add_one"] {
            for size in [4096, 65536] {
                for concurrency in [1, 4] {
                    let found: Vec<_> = cases
                        .iter()
                        .filter(|c| {
                            c["servers"] == servers
                                && c["system"] == system
                                && c["op"] == op
                                && c["size_bytes"] == size
                                && c["concurrency"] == concurrency
                        })
                        .collect();
                    let what = format!("{system} {servers} {op} {size} {concurrency}");
                    assert_eq!(found.len(), 1, "{what}: {v}");
                    let case = found[0];
                    positive(&case["calls_per_s"], "calls_per_s");
                    let p50 = positive(&case["p50_us"], "p50_us");
                    let p99 = positive(&case["p99_us"], "p99_us");
                    assert!(p50 <= p99, "{case}");
                    assert_eq!(case.as_object().map(|o| o.len()), Some(8), "{case}");
                }
            }
        }
    }
}

/// The tensor-broker systems `tb bench p2p` measures with every channel named.
const BROKERS: [&str; 5] = [
    "tensor-broker",
    "tensor-broker-quic",
    "tensor-broker-quic-striped",
    "tensor-broker-tcp",
    "tensor-broker-shm",
];
/// The baselines, with the ops each has.
const BASELINES: [(&str, &[&str]); 3] = [
    ("raw-iroh", &["pull_into", "get"]),
    ("raw-tcp", &["pull_into", "get"]),
    ("memcpy", &["get"]),
];

fn positive(v: &serde_json::Value, what: &str) -> f64 {
    let x = v.as_f64().unwrap_or(-1.0);
    assert!(x.is_finite() && x > 0.0, "{what} = {v}");
    x
}

/// Checks one system's cases: `ops` at 1 MiB (and `pull_into` at 4 KiB), each with sane
/// figures, and the channel a tensor-broker system used.
fn check_system(v: &serde_json::Value, system: &str, ops: &[&str]) {
    let cases: Vec<&serde_json::Value> = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .filter(|c| c["system"] == system)
        .collect();
    let mut expected: Vec<(&str, u64)> = ops.iter().map(|op| (*op, 1 << 20)).collect();
    expected.push(("pull_into", 4096));
    if ops == ["get"] {
        expected.pop();
    }
    assert_eq!(cases.len(), expected.len(), "{system}: {cases:?}");
    for (op, size) in expected {
        let case = cases
            .iter()
            .find(|c| c["op"] == op && c["size_bytes"] == size)
            .unwrap_or_else(|| panic!("{system} lacks {op} at {size}: {cases:?}"));
        positive(&case["throughput_mb_s"], "throughput_mb_s");
        positive(&case["first_transfer_ms"], "first_transfer_ms");
        if system.starts_with("tensor-broker") {
            assert_eq!(case["channel"], expected_channel(system), "{case}");
        } else {
            assert!(case.get("channel").is_none(), "{case}");
        }
    }
    positive(&v["peak_rss_bytes"][system], "peak_rss_bytes");
}

#[test]
fn bench_p2p_prints_the_promised_json() {
    let v = bench_json(&[
        "p2p",
        "--iters",
        "1",
        "--rounds",
        "1",
        "--round-trips",
        "20",
        "--max-size",
        "1MiB",
    ]);
    assert_eq!(v["bench"], "p2p");
    assert_eq!(v["device"], "host");
    for system in BROKERS {
        check_system(&v, system, &["pull_into", "get", "push"]);
        for rtt in ["rtt_4k", "rtt_4k_push"] {
            let p50 = positive(&v[rtt][system]["p50_us"], "p50_us");
            let p99 = positive(&v[rtt][system]["p99_us"], "p99_us");
            assert!(p50 <= p99, "{rtt} {system}: {v}");
        }
        assert_eq!(v["channel"][system], expected_channel(system));
    }
    for (system, ops) in BASELINES {
        check_system(&v, system, ops);
        assert!(v["rtt_4k_push"].get(system).is_none(), "{v}");
        let pulls = v["rtt_4k"].get(system);
        assert_eq!(pulls.is_some(), system != "memcpy", "{system}: {v}");
    }
    positive(&v["receiver_peak_rss_bytes"], "receiver_peak_rss_bytes");
    assert_eq!(v["cases"].as_array().map(Vec::len), Some(5 * 4 + 3 + 3 + 1));
}

#[test]
fn bench_p2p_measures_only_the_channels_asked_for() {
    let v = bench_json(&[
        "p2p",
        "--iters",
        "1",
        "--rounds",
        "1",
        "--round-trips",
        "5",
        "--max-size",
        "1MiB",
        "--channels",
        "quic",
    ]);
    let mut systems: Vec<&str> = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .filter_map(|c| c["system"].as_str())
        .collect();
    systems.dedup();
    assert_eq!(
        systems,
        [
            "tensor-broker",
            "tensor-broker-quic",
            "tensor-broker-quic-striped",
            "raw-iroh",
            "raw-tcp",
            "memcpy"
        ]
    );
}

#[test]
fn bench_gets_checks_every_tensor_and_prints_the_promised_json() {
    let v = bench_json(&[
        "gets",
        "--count",
        "3",
        "--size",
        "2MiB",
        "--runs",
        "2",
        "--tcp-reads",
        "2",
    ]);
    assert_eq!(v["bench"], "gets");
    assert_eq!(v["count"], 3);
    assert_eq!(v["size_bytes"], 2 << 20);
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{v}");
    for run in runs {
        // Both processes are on this host: the pair negotiates shm.
        assert_eq!(run["channel"], "shm", "{run}");
        positive(&run["hold_s"], "hold_s");
        let gets = run["get_mb_s"].as_array().expect("get_mb_s");
        assert_eq!(gets.len(), 3, "{run}");
        gets.iter().for_each(|g| _ = positive(g, "get_mb_s"));
        let tcp = run["tcp_mb_s"].as_array().expect("tcp_mb_s");
        assert_eq!(tcp.len(), 2, "{run}");
        tcp.iter().for_each(|t| _ = positive(t, "tcp_mb_s"));
    }
    let min = positive(&v["min_ratio"], "min_ratio");
    let median = positive(&v["median_ratio"], "median_ratio");
    assert!(min <= median, "{v}");
    positive(&v["get_median_mb_s"], "get_median_mb_s");
    positive(&v["tcp_median_mb_s"], "tcp_median_mb_s");
}

#[test]
fn bench_refuses_bad_sizes_and_rates() {
    for bad in [
        &["broadcast", "--size", "0"][..],
        &["broadcast", "--size", "8MB/s"],
        &["broadcast", "--max-upload-rate", "100Mbit/s"],
        &["broadcast", "--chain-min-size", "lots"],
        &["p2p", "--channels", "udp"],
        &["gets", "--count", "0"],
        &["gets", "--size", "0"],
        &["gets", "--runs", "0"],
        &["call", "--sizes", "6"],
        &["call", "--systems", "redis"],
    ] {
        let out = Command::new(bin("tb"))
            .arg("bench")
            .args(bad)
            .output()
            .expect("run tb");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {stderr}");
        assert!(stderr.contains(bad[1]), "{bad:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// The channel a tensor-broker system's pair negotiates: both bench processes are on this
/// host, so auto and shm negotiate shm; tcp its TCP channel; the others QUIC.
fn expected_channel(system: &str) -> &'static str {
    match system {
        "tensor-broker" | "tensor-broker-shm" => "shm",
        "tensor-broker-tcp" => "tcp",
        _ => "quic",
    }
}
