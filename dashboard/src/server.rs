//! The axum server every process runs on `--metrics-addr`: `/metrics`, `/healthz`, `/readyz`,
//! `/api/v1/status`, `/api/v1/cluster` (brokers) and the web dashboard's files.

use std::{future::Future, net::SocketAddr, pin::Pin, sync::Arc};

use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    api::{Cluster, ClusterData},
    metrics::Metrics,
};

/// The future [`Source::cluster`] returns.
pub type ClusterFuture<'a> = Pin<Box<dyn Future<Output = Option<ClusterData>> + Send + 'a>>;

/// The future [`Source::refresh`] returns.
pub type RefreshFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What only the process knows (the dashboard crate depends on neither node nor broker).
pub trait Source: Send + Sync + 'static {
    /// The node id in hex.
    fn node_id(&self) -> String;
    /// Where peers reach it.
    fn addrs(&self) -> Vec<String>;
    /// Whether it has joined (see `/readyz`).
    fn ready(&self) -> bool;
    /// Sets the gauges that mirror state (pool links, store, registry, cluster nodes); awaited
    /// before every scrape and status answer (a broker asks its actor, so it is async).
    fn refresh<'a>(&'a self, metrics: &'a Metrics) -> RefreshFuture<'a>;
    /// Members and registry entries: brokers only. `None` (the default) answers 404.
    fn cluster(&self) -> ClusterFuture<'_> {
        Box::pin(async { None })
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    /// The process's own figures.
    pub source: Arc<dyn Source>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("role", &self.metrics.role())
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// The `/api/v1/status` object, gauges refreshed.
    pub async fn status(&self) -> crate::api::Status {
        self.source.refresh(&self.metrics).await;
        self.metrics.status(
            self.source.node_id(),
            self.source.addrs(),
            self.source.ready(),
        )
    }
}

/// The routes of the contract.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/api/v1/status", get(status))
        .route("/api/v1/cluster", get(cluster))
        .route("/", get(|| asset(crate::assets::INDEX_HTML, HTML)))
        .route(
            "/index.html",
            get(|| asset(crate::assets::INDEX_HTML, HTML)),
        )
        .route("/assets/app.js", get(|| asset(crate::assets::APP_JS, JS)))
        .route(
            "/assets/style.css",
            get(|| asset(crate::assets::STYLE_CSS, CSS)),
        )
        .route(
            "/assets/vendor/uPlot.iife.min.js",
            get(|| asset(crate::assets::UPLOT_JS, JS)),
        )
        .route(
            "/assets/vendor/uPlot.min.css",
            get(|| asset(crate::assets::UPLOT_CSS, CSS)),
        )
        .with_state(state)
}

/// Binds `addr` (port 0 picks a free one).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the routes on `listener` until `shutdown` fires, then finishes the requests under
/// way.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

async fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    state.source.refresh(&state.metrics).await;
    let body = state.metrics.encode();
    ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response()
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.source.ready() {
        true => (StatusCode::OK, "ready").into_response(),
        false => (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response(),
    }
}

async fn status(State(state): State<AppState>) -> Response {
    Json(state.status().await).into_response()
}

async fn cluster(State(state): State<AppState>) -> Response {
    let broker = state.status().await;
    match state.source.cluster().await {
        Some(ClusterData { members, entries }) => Json(Cluster {
            broker,
            members,
            entries,
        })
        .into_response(),
        None => (StatusCode::NOT_FOUND, "no cluster view: not a broker").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::{AtomicBool, Ordering},
        time::Duration,
    };

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::metrics::Role;

    struct Fake {
        ready: AtomicBool,
    }

    impl Source for Fake {
        fn node_id(&self) -> String {
            "ab".into()
        }
        fn addrs(&self) -> Vec<String> {
            vec!["127.0.0.1:1".into()]
        }
        fn ready(&self) -> bool {
            self.ready.load(Ordering::Relaxed)
        }
        fn refresh<'a>(&'a self, metrics: &'a Metrics) -> crate::RefreshFuture<'a> {
            metrics.store_tensors.set(7);
            Box::pin(async {})
        }
    }

    /// One HTTP/1.0 GET over a raw socket: (status line, headers, body).
    async fn raw_get(addr: SocketAddr, path: &str) -> (String, String, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
        s.write_all(req.as_bytes()).await.expect("write");
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
        read.expect("answer in time").expect("read");
        let text = String::from_utf8_lossy(&buf).to_string();
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
        (status.to_string(), headers.to_lowercase(), body.to_string())
    }

    #[tokio::test]
    async fn routes_answer_with_their_types_and_the_server_stops() {
        let metrics = Metrics::new(Role::Worker).expect("metrics");
        let fake = Arc::new(Fake {
            ready: AtomicBool::new(false),
        });
        let state = AppState {
            metrics,
            source: fake.clone(),
        };
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, state, stop.clone()));

        let (status, headers, body) = raw_get(addr, "/metrics").await;
        assert!(status.contains("200"), "{status}");
        assert!(
            headers.contains("content-type: text/plain; version=0.0.4"),
            "{headers}"
        );
        assert!(
            body.contains("tb_store_tensors 7"),
            "refreshed before encoding"
        );
        assert!(raw_get(addr, "/healthz").await.0.contains("200"));
        let (status, _, body) = raw_get(addr, "/readyz").await;
        assert!(
            status.contains("503") && body == "not ready",
            "{status} {body}"
        );
        fake.ready.store(true, Ordering::Relaxed);
        let (status, _, body) = raw_get(addr, "/readyz").await;
        assert!(status.contains("200") && body == "ready", "{status} {body}");
        let (_, headers, body) = raw_get(addr, "/api/v1/status").await;
        assert!(headers.contains("application/json"), "{headers}");
        let status: crate::api::Status = serde_json::from_str(&body).expect("status json");
        assert_eq!((status.node_id.as_str(), status.store.tensors), ("ab", 7));
        assert!(status.ready);
        assert!(raw_get(addr, "/api/v1/cluster").await.0.contains("404"));
        for (path, ty) in [
            ("/", "text/html"),
            ("/assets/app.js", "text/javascript"),
            ("/assets/style.css", "text/css"),
            ("/assets/vendor/uPlot.iife.min.js", "text/javascript"),
            ("/assets/vendor/uPlot.min.css", "text/css"),
        ] {
            let (status, headers, _) = raw_get(addr, path).await;
            assert!(status.contains("200"), "{path}: {status}");
            assert!(
                headers.contains(&format!("content-type: {ty}")),
                "{path}: {headers}"
            );
        }
        stop.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
        assert!(matches!(stopped, Ok(Ok(Ok(())))), "graceful stop");
    }
}
