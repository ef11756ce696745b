//! Clients race the brokers of their list: a dead broker listed first costs a call one
//! stagger, not a connect timeout; a broker that refuses our secret answers at once; when
//! every broker fails, the error names each one.

use tb_proto::ClusterKey;

use super::*;

/// A cluster key of the test secret `tag` (repeated to the minimum length).
fn key(tag: &str) -> ClusterKey {
    ClusterKey::from_secret(tag.repeat(8).as_bytes()).expect("test secret")
}

/// A config whose connect timeout is far beyond what any call here may take, so that only a
/// race (not a timeout) gets a call past the dead broker.
fn racing(brokers: &[PeerAddr], secret: &str) -> Config {
    Config {
        connect_timeout: Duration::from_secs(20),
        cluster_key: key(secret),
        ..config(brokers)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_broker_costs_a_stagger_not_a_connect_timeout() {
    let fake = FakeCluster::new();
    let (broker, live) = fake.broker(racing(&[], "right-secret")).await;
    let publisher = worker(racing(std::slice::from_ref(&live), "right-secret")).await;
    let t = tensor(1 << 18, 9); // 1 MiB
    within("publish", publisher.publish("m/w", t.clone()))
        .await
        .expect("publish");
    // A reader that heartbeats not: like the `tb` CLI, every call starts from the list.
    let reader = worker(Config {
        heartbeats: false,
        ..racing(&[dead_broker(), live.clone()], "right-secret")
    })
    .await;
    let started = Instant::now();
    let listed = within("list", reader.list("m/")).await.expect("list");
    let listed_in = started.elapsed();
    assert_eq!(listed.len(), 1);
    let started = Instant::now();
    let got = within("get", reader.get("m/w")).await.expect("get");
    let got_in = started.elapsed();
    assert_eq!(got.buffer.data(), t.data());
    assert_eq!(
        reader.current_broker(),
        Some(&live),
        "the winner is remembered"
    );
    println!("dead first broker: ls {listed_in:?}, get of 1 MiB {got_in:?} (target < 0.5 s)");
    for node in [publisher, reader, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_told_at_once_despite_a_dead_first_broker() {
    let fake = FakeCluster::new();
    let (broker, live) = fake.broker(racing(&[], "right-secret")).await;
    let intruder = worker(Config {
        heartbeats: false,
        ..racing(&[dead_broker(), live], "wrong-secret")
    })
    .await;
    // Within the test's limit, which is far below the dead broker's 20 s connect timeout.
    match within("list", intruder.list("")).await {
        Err(Error::Unauthorized(_)) => {}
        other => panic!("expected Unauthorized, got {other:?}"),
    }
    for node in [intruder, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_broker_fails_the_error_names_each() {
    let dead = [dead_broker(), dead_broker()];
    let lost = worker(Config {
        heartbeats: false,
        connect_timeout: Duration::from_millis(500),
        ..config(&dead)
    })
    .await;
    let e = within("list", lost.list("")).await.expect_err("no broker");
    let Error::NoBroker { tried, failures } = &e else {
        panic!("expected NoBroker, got {e:?}");
    };
    assert_eq!((*tried, failures.len()), (2, 2));
    let text = e.to_string();
    for broker in &dead {
        let named = format!("{}@{}", broker.id.fmt_short(), broker.addr);
        assert!(failures.iter().any(|f| f.broker == named), "{failures:?}");
        assert!(text.contains(&named), "{text}");
    }
    lost.shutdown().await;
}
