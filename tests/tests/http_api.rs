//! The broker's HTTP side in one process: a real broker and worker on loopback, and the
//! broker's metrics server (`tb_dashboard::serve` on 127.0.0.1:0) with the guards the daemons
//! give it. A burst of concurrent requests while the worker publishes: every publish is
//! acknowledged and listed, every HTTP answer is a correct 200 or a 503. With a token,
//! `/api/v1/*` answers 401 without it or with another one, 200 with it, and paging
//! `/api/v1/cluster` lists every name exactly once. Every wait is bounded.

use std::{
    collections::BTreeSet,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use serde_json::Value;
use tb_broker::{Broker, BrokerOptions};
use tb_dashboard::{HttpOptions, HttpToken};
use tb_node::{Config, Node, proto::ClusterKey};
use tb_tests::{eventually_async, f32_tensor, node, test_config, within};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"http api tests share this secret";
/// A token as `head -c 32 /dev/urandom | base64` makes them: `+`, `/` and `=` included.
const TOKEN: &str = "Zk9v+YmFy/cXV4eHl6enl6+enl6enl6enl6enl6eno=";

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

/// A broker serving HTTP with `options`, and a worker publishing through it.
struct Setup {
    broker: Broker,
    worker: Node,
    url: String,
    stop: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Setup {
    async fn start(options: HttpOptions) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let broker = within(
            LIMIT,
            "broker start",
            Broker::spawn(broker_options(dir.path())),
        )
        .await
        .expect("broker starts");
        let listener = tb_dashboard::bind(([127, 0, 0, 1], 0).into())
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let stop = CancellationToken::new();
        let server = tokio::spawn(tb_dashboard::serve(
            listener,
            broker.dashboard(),
            options,
            stop.clone(),
        ));
        let worker = node(Config {
            brokers: vec![broker.addr().clone()],
            cluster_key: key(),
            ..test_config()
        })
        .await;
        Setup {
            broker,
            worker,
            url,
            stop,
            server,
            _dir: dir,
        }
    }

    async fn shutdown(self) {
        self.stop.cancel();
        let stopped = within(LIMIT, "HTTP server stop", self.server).await;
        assert!(matches!(stopped, Ok(Ok(()))), "{stopped:?}");
        self.worker.shutdown().await;
        self.broker.shutdown().await;
    }
}

fn broker_options(dir: &Path) -> BrokerOptions {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.node.cluster_key = key();
    opts.tick = Duration::from_millis(200);
    opts
}

/// One GET: status, `WWW-Authenticate` (if any) and body. Blocking (call it off the runtime).
fn get(url: &str, token: Option<&str>) -> Result<(u16, Option<String>, String), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(20)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut request = agent.get(url);
    if let Some(token) = token {
        request = request.header("Authorization", &format!("Bearer {token}"));
    }
    let mut resp = request.call().map_err(|e| format!("GET {url}: {e}"))?;
    let status = resp.status().as_u16();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("GET {url}: reading the body: {e}"))?;
    Ok((status, challenge, body))
}

/// [`get`] from a blocking thread.
async fn get_async(url: String, token: Option<&'static str>) -> (u16, Option<String>, String) {
    tokio::task::spawn_blocking(move || get(&url, token))
        .await
        .expect("task")
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A 200 answer of `path` that is what it should be, or why not.
fn check_answer(path: &str, body: &str) -> Result<(), String> {
    if path == "/metrics" {
        return match body.contains("tb_registry_names ") {
            true => Ok(()),
            false => Err("no tb_registry_names".into()),
        };
    }
    let json: Value = serde_json::from_str(body).map_err(|e| format!("not JSON: {e}"))?;
    if path.starts_with("/api/v1/status") {
        return match json["role"] == "broker" {
            true => Ok(()),
            false => Err(format!("role {}", json["role"])),
        };
    }
    let entries = json["entries"].as_array().ok_or("no entries")?;
    let names: Vec<&str> = entries.iter().filter_map(|e| e["name"].as_str()).collect();
    let total = json["registry"]["names"]
        .as_u64()
        .ok_or("no registry.names")?;
    let sorted = names.windows(2).all(|w| w[0] < w[1]);
    let limit = if path.contains("limit=50") { 50 } else { 1000 };
    if names.len() != entries.len() || !sorted || names.len() > limit {
        return Err(format!("entries out of order or over the limit: {names:?}"));
    }
    if (names.len() as u64) > total || json["broker"]["role"] != "broker" {
        return Err(format!("{} entries but {total} names", names.len()));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_burst_during_publishes_answers_200_or_503_and_every_publish_lands() {
    // One request at a time: the handlers never wait, so a request holds its slot only while
    // a runtime thread runs it, and 32 clients on the test runtime's two threads overrun it.
    let options = HttpOptions {
        max_in_flight: 1,
        ..HttpOptions::default()
    };
    let s = Setup::start(options).await;
    const PUBLISHES: usize = 150;
    const CLIENTS: usize = 32;
    const PER_CLIENT: usize = 15;
    let paths = [
        "/api/v1/cluster",
        "/metrics",
        "/api/v1/status",
        "/api/v1/cluster?limit=50",
    ];
    let worker = s.worker.clone();
    // Publishes acknowledged so far: the burst starts after the first one and the count at
    // its end says how many it overlapped.
    let acked_live = Arc::new(AtomicUsize::new(0));
    let acked_during = acked_live.clone();
    let publishes = tokio::spawn(async move {
        let mut acked = 0;
        for i in 0..PUBLISHES {
            let name = format!("burst/{i:03}");
            let version = worker
                .publish(&name, f32_tensor(16, i as u8))
                .await
                .unwrap_or_else(|e| panic!("publish {name}: {e}"));
            assert_eq!(version, 1, "{name}");
            acked += 1;
            acked_live.fetch_add(1, Ordering::SeqCst);
        }
        acked
    });
    let url = s.url.clone();
    let burst = tokio::task::spawn_blocking({
        move || {
            let started = std::time::Instant::now();
            while acked_during.load(Ordering::SeqCst) == 0 && started.elapsed() < LIMIT {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (ok, shed) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let failures = std::sync::Mutex::new(Vec::new());
            std::thread::scope(|scope| {
                for c in 0..CLIENTS {
                    let (ok, shed, failures, url) = (&ok, &shed, &failures, &url);
                    scope.spawn(move || {
                        for r in 0..PER_CLIENT {
                            let path = paths[(c + r) % paths.len()];
                            let verdict = match get(&format!("{url}{path}"), None) {
                                Ok((200, _, body)) => check_answer(path, &body),
                                Ok((503, _, _)) => {
                                    shed.fetch_add(1, Ordering::Relaxed);
                                    continue;
                                }
                                Ok((status, _, body)) => Err(format!("{status}: {body}")),
                                Err(e) => Err(e),
                            };
                            match verdict {
                                Ok(()) => {
                                    ok.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => failures
                                    .lock()
                                    .expect("failures")
                                    .push(format!("{path}: {e}")),
                            }
                        }
                    });
                }
            });
            (
                ok.into_inner(),
                shed.into_inner(),
                failures.into_inner().expect("failures"),
                acked_during.load(Ordering::SeqCst),
            )
        }
    });
    let (ok_count, shed_count, failures, acked_by_end) = within(LIMIT, "the HTTP burst", burst)
        .await
        .expect("burst task");
    let acked = within(LIMIT, "the publishes", publishes)
        .await
        .expect("publish task");
    eprintln!(
        "http burst: {} requests, {ok_count} answered 200, {shed_count} shed with 503; \
         {acked} of {PUBLISHES} publishes acknowledged ({acked_by_end} by the burst's end)",
        CLIENTS * PER_CLIENT
    );
    assert!(failures.is_empty(), "wrong answers: {failures:#?}");
    assert_eq!(ok_count + shed_count, CLIENTS * PER_CLIENT);
    assert_eq!(acked, PUBLISHES);
    // Every publish is in the registry (asked over tb/ctl/1, as `tb ls` does) ...
    let listed = within(LIMIT, "list", s.worker.list("burst/"))
        .await
        .expect("list");
    let names: BTreeSet<String> = listed.iter().map(|e| e.name.as_str().to_string()).collect();
    let expected: BTreeSet<String> = (0..PUBLISHES).map(|i| format!("burst/{i:03}")).collect();
    assert_eq!(names, expected);
    // ... and on the dashboard once the next snapshot is published.
    let cluster = format!("{}/api/v1/cluster", s.url);
    let shown = eventually_async(LIMIT, || {
        let cluster = cluster.clone();
        async move {
            let (status, _, body) = get_async(cluster, None).await;
            let json: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            status == 200 && json["registry"]["names"] == PUBLISHES
        }
    })
    .await;
    assert!(shown, "the HTTP view caught up with every publish");
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_wants_its_token_and_pages_list_every_name_exactly_once() {
    let options = HttpOptions {
        token: Some(HttpToken::new(TOKEN).expect("token")),
        ..HttpOptions::default()
    };
    let s = Setup::start(options).await;
    const NAMES: usize = 230;
    for i in 0..NAMES {
        let name = format!("page/{i:03}");
        within(
            LIMIT,
            "publish",
            s.worker.publish(&name, f32_tensor(4, i as u8)),
        )
        .await
        .unwrap_or_else(|e| panic!("publish {name}: {e}"));
    }

    // The token: none or another one is refused with a Bearer challenge, the right one works.
    for path in ["/api/v1/status", "/api/v1/cluster"] {
        let url = format!("{}{path}", s.url);
        let (status, challenge, _) = get_async(url.clone(), None).await;
        assert_eq!(status, 401, "{path} without a token");
        assert!(
            challenge
                .as_deref()
                .is_some_and(|c| c.starts_with("Bearer")),
            "{path}: {challenge:?}"
        );
        let wrong = "Zk9v+YmFy/cXV4eHl6enl6+enl6enl6enl6enl6enp=";
        let (status, challenge, _) = get_async(url.clone(), Some(wrong)).await;
        assert_eq!(status, 401, "{path} with a wrong token");
        assert!(
            challenge
                .as_deref()
                .is_some_and(|c| c.contains("invalid_token")),
            "{path}: {challenge:?}"
        );
        let (status, _, body) = get_async(url, Some(TOKEN)).await;
        assert_eq!(status, 200, "{path} with the token: {body}");
    }
    // Prometheus and the probes need none.
    for path in ["/metrics", "/healthz", "/readyz", "/"] {
        let (status, _, _) = get_async(format!("{}{path}", s.url), None).await;
        assert_eq!(status, 200, "{path}");
    }

    // Paging: once the snapshot shows every name, pages of 37 list each exactly once.
    let first = format!("{}/api/v1/cluster?limit=37", s.url);
    let caught_up = eventually_async(LIMIT, || {
        let first = first.clone();
        async move {
            let (_, _, body) = get_async(first, Some(TOKEN)).await;
            let json: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            json["registry"]["names"] == NAMES
        }
    })
    .await;
    assert!(caught_up, "the snapshot shows every name");
    let mut seen = Vec::new();
    let mut url = first.clone();
    let mut pages = 0;
    loop {
        pages += 1;
        assert!(pages <= NAMES / 37 + 2, "paging does not end");
        let (status, _, body) = get_async(url, Some(TOKEN)).await;
        assert_eq!(status, 200, "{body}");
        let json: Value = serde_json::from_str(&body).expect("json");
        let entries = json["entries"].as_array().expect("entries");
        assert!(entries.len() <= 37);
        seen.extend(
            entries
                .iter()
                .map(|e| e["name"].as_str().expect("name").to_string()),
        );
        match json["next"].as_str() {
            Some(next) => {
                assert_eq!(seen.last().map(String::as_str), Some(next));
                url = format!("{}/api/v1/cluster?limit=37&after={next}", s.url);
            }
            None => break,
        }
    }
    let expected: Vec<String> = (0..NAMES).map(|i| format!("page/{i:03}")).collect();
    assert_eq!(seen, expected, "every name once, in order");
    assert_eq!(pages, NAMES.div_ceil(37));
    // A limit past the maximum is cut to it; a bad one is refused.
    let all = format!("{}/api/v1/cluster?limit=1000000", s.url);
    let (status, _, body) = get_async(all, Some(TOKEN)).await;
    let json: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(status, 200);
    assert_eq!(json["entries"].as_array().map(Vec::len), Some(NAMES));
    assert!(json["next"].is_null());
    let zero = format!("{}/api/v1/cluster?limit=0", s.url);
    assert_eq!(get_async(zero, Some(TOKEN)).await.0, 400);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_api_lists_served_functions_with_their_live_servers() {
    let s = Setup::start(HttpOptions::default()).await;
    let calls = tb_call::Calls::attach(&s.worker).expect("attach");
    let echo = |args: tb_call::Value, _cx: tb_call::CallContext| -> tb_call::Output {
        tb_call::Output::Unary(Box::pin(async move { Ok(args) }))
    };
    let spec = tb_call::FunctionSpec::new("math/echo").expect("name");
    let serving = within(LIMIT, "serve", calls.serve(spec, echo))
        .await
        .expect("serves");
    let url = format!("{}/api/v1/cluster", s.url);
    let worker_id = tb_node::auth::node_id(&s.worker.id()).to_string();
    let listed = |body: &str| -> Option<Vec<String>> {
        let json: Value = serde_json::from_str(body).ok()?;
        let f = json["functions"]
            .as_array()?
            .iter()
            .find(|f| f["name"] == "math/echo")?;
        let servers = f["servers"].as_array()?;
        Some(
            servers
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
        )
    };
    let shown = eventually_async(LIMIT, || async {
        let (status, _, body) = get_async(url.clone(), None).await;
        status == 200 && listed(&body) == Some(vec![worker_id.clone()])
    });
    assert!(shown.await, "the served function and its server are listed");
    // Unserved: it leaves the list (the advertisement is withdrawn).
    within(LIMIT, "unserve", serving.stop()).await;
    let gone = eventually_async(LIMIT, || async {
        let (status, _, body) = get_async(url.clone(), None).await;
        status == 200 && listed(&body).is_none()
    });
    assert!(gone.await, "an unserved function is not listed");
    s.shutdown().await;
}
