//! Clients race the brokers of a ticket, as processes: with the first-listed broker killed,
//! `tb ls` and `tb get` of 1 MiB go to the live broker after a short stagger instead of a
//! 10 s connect timeout (the times are printed, not asserted); a wrong secret is told at
//! once; with every broker dead the error names each one. Every process started is killed by
//! PID when the test ends.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use tb_node::Ticket;
use tb_tests::{
    pattern,
    procs::{Proc, bin, broker_command, worker_command},
};

const START: Duration = Duration::from_secs(30);
const SECRET: &str = "broker-race-test-cluster-secret-32-bytes";

/// `tb ARGS` against `ticket` with the secret in `secret` and the default timeout (10 s),
/// and how long it took.
fn tb(args: &[&str], ticket: &Ticket, secret: &Path, extra: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = Command::new(bin("tb"))
        .args(args)
        .arg("--join")
        .arg(ticket.to_string())
        .arg("--cluster-secret-file")
        .arg(secret)
        .args(extra)
        .output()
        .expect("running tb");
    (out, started.elapsed())
}

fn ok(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn write_secret(dir: &Path, name: &str, secret: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{secret}\n")).expect("secret file");
    path
}

#[test]
fn clients_race_past_a_dead_first_broker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = write_secret(dir.path(), "secret", SECRET);
    let start_broker = |i: usize, join: Option<&Ticket>| {
        let mut cmd = broker_command(dir.path(), &format!("broker-{i}"), &secret);
        cmd.args(["--liveness-timeout", "2", "--sync-interval", "1"]);
        if let Some(ticket) = join {
            cmd.arg("--join").arg(ticket.to_string());
        }
        let mut p = Proc::start(
            &format!("broker {i}"),
            cmd,
            &dir.path().join(format!("b{i}.log")),
        );
        let ticket: Ticket = p.wait_line("ticket:", START).parse().expect("ticket");
        (p, ticket)
    };
    let (mut first, ticket) = start_broker(0, None);
    let (mut second, printed) = start_broker(1, Some(&ticket));
    let ticket = Ticket {
        brokers: vec![ticket.brokers[0].clone(), printed.brokers[0].clone()],
    };
    let cmd = worker_command(dir.path(), "worker-0", &secret, &ticket.to_string());
    let mut worker = Proc::start("worker 0", cmd, &dir.path().join("w0.log"));
    let worker_addr = worker.wait_line("worker:", START);

    let bytes = pattern(1 << 20, 4);
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &bytes).expect("write");
    let input = input.to_string_lossy().into_owned();
    let put = [
        "put", "race/w", &input, "--dtype", "u8", "--shape", "1048576",
    ];
    let put: Vec<&str> = put.into_iter().chain(["--worker", &worker_addr]).collect();
    ok("tb put", &tb(&put, &ticket, &secret, &[]).0);
    // The put is acknowledged by whichever broker answered first; the name must have reached
    // the second by gossip before the first dies, or nothing would be left to find.
    let only_second = Ticket {
        brokers: vec![printed.brokers[0].clone()],
    };
    let replicated = (0..60).any(|_| {
        let (out, _) = tb(&["ls", "race/"], &only_second, &secret, &[]);
        let seen = out.status.success() && String::from_utf8_lossy(&out.stdout).contains("race/w");
        if !seen {
            std::thread::sleep(Duration::from_millis(500));
        }
        seen
    });
    assert!(replicated, "race/w never reached the second broker in 30 s");

    // The first-listed broker dies: no goodbye, its port silent.
    first.kill9();
    let (out, ls_took) = tb(&["ls", "race/"], &ticket, &secret, &[]);
    assert!(ok("tb ls", &out).contains("race/w"));
    let output = dir.path().join("out.bin");
    let output_s = output.to_string_lossy().into_owned();
    let (out, get_took) = tb(&["get", "race/w", "-o", &output_s], &ticket, &secret, &[]);
    ok("tb get", &out);
    assert_eq!(std::fs::read(&output).expect("read back"), bytes.to_vec());

    // A wrong secret: `unauthorized` from the live broker, not after the dead one's timeout.
    let wrong = write_secret(dir.path(), "wrong", "not-this-clusters-secret-but-32-bytes");
    let (out, refused_took) = tb(&["ls"], &ticket, &wrong, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("unauthorized"),
        "{stderr}"
    );
    println!(
        "first-listed broker dead: tb ls {ls_took:?}, tb get of 1 MiB {get_took:?}, \
         wrong-secret tb ls {refused_took:?} (target < 0.5 s; each process includes its start)"
    );

    // Every broker dead: the error names each, with why.
    second.kill9();
    let (out, _) = tb(&["ls"], &ticket, &secret, &["--timeout", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    for broker in &ticket.brokers {
        let named = format!("{}@{}", broker.id.fmt_short(), broker.addr);
        assert!(stderr.contains(&named), "{named} not in: {stderr}");
    }
    worker.kill9();
}
