//! `tb bench broadcast` and `tb bench registry` as a user runs them: one JSON object each, in
//! the format the benchmarks promise, with sane values (never timings checked against limits:
//! speed is for the benchmark to report, not for tests to assert). Each run is a small
//! cluster in one `tb` process on loopback; the process is killed by PID if it hangs.

use std::{process::Command, time::Duration};

use tb_tests::procs::{Proc, bin};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `tb bench ARGS --json` and returns its one JSON line.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(bin("tb", "tb-cli"));
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
    for field in ["single_transfer_s", "broadcast_s", "naive_s"] {
        seconds(&v, field);
    }
    assert_eq!(v.as_object().map(|o| o.len()), Some(6), "{v}");
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
fn bench_refuses_bad_sizes_and_rates() {
    for bad in [
        &["broadcast", "--size", "0"][..],
        &["broadcast", "--size", "8MB/s"],
        &["broadcast", "--max-upload-rate", "100Mbit/s"],
        &["broadcast", "--chain-min-size", "lots"],
    ] {
        let out = Command::new(bin("tb", "tb-cli"))
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
