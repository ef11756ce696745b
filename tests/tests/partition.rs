//! A real network partition: a broker in a network namespace of its own, linked to the test's
//! namespace by a veth pair, is cut off by taking the link down while names are published and
//! deleted on the other side, for longer than QUIC's idle timeout (so every connection
//! between the two sides dies), and converges once the link is back up.
//!
//! Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip`.
//! Without them the test says SKIPPED: the partition is also covered, by stopping and
//! restarting brokers, in `cluster.rs` and `processes.rs`. The namespace, the veth pair and
//! every process are removed when the test ends, passing or failing.

use std::{net::SocketAddr, path::Path, process::Command, time::Duration};

use tb_node::{Config, Node, Ticket, proto::ClusterKey};
use tb_tests::{
    eventually, f32_tensor,
    netns::Netns,
    procs::{Proc, bin, free_udp_addr},
    test_config, within,
};

const LIMIT: Duration = Duration::from_secs(60);
const START: Duration = Duration::from_secs(30);
const SECRET: &str = "partition-test-cluster-secret-32-bytes";
/// How long the link stays down: past QUIC's idle timeout (30 s).
const PARTITION: Duration = Duration::from_secs(33);

/// Names `tb ls` lists, asked from inside the namespace of a broker named by `ticket` alone.
fn listed_inside(ns: &Netns, ticket: &Ticket, secret: &Path) -> Option<String> {
    let out = ns
        .command(&bin("tb"))
        .arg("ls")
        .arg("--join")
        .arg(ticket.to_string())
        .arg("--cluster-secret-file")
        .arg(secret)
        .args(["--timeout", "5"])
        .output()
        .expect("running tb ls");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_broker_converges_after_the_partition_heals() {
    // Declared first, dropped last: the processes inside are killed before it goes.
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!("SKIPPED: cannot create a network namespace ({why})");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");

    // Broker A on this side of the link, broker B inside the namespace, joined to A.
    let a_listen = SocketAddr::from((ns.outer_ip, free_udp_addr().port()));
    let mut a_cmd = Command::new(bin("tb-broker"));
    a_cmd
        .arg("--data-dir")
        .arg(dir.path().join("a"))
        .arg("--listen")
        .arg(a_listen.to_string())
        .arg("--cluster-secret-file")
        .arg(&secret)
        .args(["--sync-interval", "1"]);
    let mut a = Proc::start("broker a", a_cmd, &dir.path().join("a.log"));
    let a_ticket: Ticket = a.wait_line("ticket:", START).parse().expect("ticket");

    let b_listen = SocketAddr::from((ns.inner_ip, 7410));
    let mut b_cmd = ns.command(&bin("tb-broker"));
    b_cmd
        .arg("--data-dir")
        .arg(dir.path().join("b"))
        .arg("--listen")
        .arg(b_listen.to_string())
        .arg("--cluster-secret-file")
        .arg(&secret)
        .arg("--join")
        .arg(a_ticket.to_string())
        .args(["--sync-interval", "1"]);
    let mut b = Proc::start("broker b", b_cmd, &dir.path().join("b.log"));
    let b_ticket: Ticket = b.wait_line("ticket:", START).parse().expect("ticket");
    let b_alone = Ticket {
        brokers: vec![b_ticket.brokers[0].clone()],
    };
    assert_eq!(b_alone.brokers[0].addr, b_listen);

    // A publisher in the test process, talking to A only.
    let client = Node::spawn(Config {
        brokers: a_ticket.brokers.clone(),
        cluster_key: ClusterKey::from_secret(SECRET.as_bytes()).expect("secret"),
        auto_fetch: false,
        ..test_config()
    })
    .await
    .expect("client node");
    within(
        LIMIT,
        "publish",
        client.publish("before/w", f32_tensor(64, 1)),
    )
    .await
    .expect("publish before");
    let seen = |what: &'static str| {
        let (ns, ticket, secret) = (&ns, &b_alone, &secret);
        move || listed_inside(ns, ticket, secret).is_some_and(|l| l.contains(what))
    };
    assert!(
        eventually(LIMIT, seen("before/w")).await,
        "B hears of A's names"
    );

    // The partition: while the link is down A gets 10 names and loses one; B, still running
    // and answering inside its namespace, hears of none of it.
    ns.link(false);
    for i in 0..10u8 {
        let name = format!("during/{i}");
        within(LIMIT, "publish", client.publish(&name, f32_tensor(64, i)))
            .await
            .expect("publish during the partition");
    }
    within(LIMIT, "delete", client.delete("before/w"))
        .await
        .expect("delete during the partition");
    let cut_off = listed_inside(&ns, &b_alone, &secret).expect("B answers inside");
    assert!(cut_off.contains("before/w"), "{cut_off}");
    assert!(!cut_off.contains("during/"), "{cut_off}");
    // Long enough for QUIC's 30 s idle timeout to close every connection between them:
    // nothing is left to retransmit what gossip lost, only anti-entropy can repair it.
    let cut_at = std::time::Instant::now();
    tokio::time::sleep(PARTITION.saturating_sub(cut_at.elapsed())).await;
    let still_cut = listed_inside(&ns, &b_alone, &secret).expect("B answers inside");
    assert!(!still_cut.contains("during/"), "{still_cut}");

    // Healed: B converges on everything A did, the delete included.
    ns.link(true);
    let healed_at = std::time::Instant::now();
    let converged = eventually(LIMIT, || {
        listed_inside(&ns, &b_alone, &secret).is_some_and(|l| {
            (0..10).all(|i| l.contains(&format!("during/{i}"))) && !l.contains("before/w")
        })
    })
    .await;
    let last = listed_inside(&ns, &b_alone, &secret);
    assert!(converged, "B converges after healing: {last:?}");
    eprintln!("converged {:?} after healing", healed_at.elapsed());
    client.shutdown().await;
    assert!(b.terminate(START), "B stops on SIGTERM");
    assert!(a.terminate(START), "A stops on SIGTERM");
}
