//! The axum server every process runs on `--metrics-addr`: `/metrics`, `/healthz`, `/readyz`,
//! `/api/v1/status`, `/api/v1/cluster` (brokers) and the web dashboard's files, behind the
//! guards of [`HttpOptions`] (a concurrency limit with load shedding; a bearer token on
//! `/api/v1/*` when one is set).

use std::net::SocketAddr;

use axum::{
    Json, Router,
    error_handling::HandleErrorLayer,
    extract::{Query, State},
    http::{StatusCode, header},
    middleware,
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::{ServiceBuilder, limit::GlobalConcurrencyLimitLayer, load_shed::LoadShedLayer};

use crate::{
    access::{self, HttpOptions},
    api::{Cluster, ClusterData, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, Page},
    source::AppState,
};

/// The routes of the contract, guarded as `options` says: `/healthz` and `/readyz` are never
/// limited nor guarded (an orchestrator's probes must not fail because the dashboard is
/// busy), `/api/v1/*` takes the token, everything else counts toward the concurrency limit.
pub fn router(state: AppState, options: &HttpOptions) -> Router {
    let mut api = Router::new()
        .route("/api/v1/status", get(status))
        .route("/api/v1/cluster", get(cluster));
    if let Some(token) = &options.token {
        api = api.route_layer(middleware::from_fn_with_state(
            token.clone(),
            access::require_token,
        ));
    }
    // One semaphore for every route (a plain `ConcurrencyLimitLayer` would make one per
    // route); when it is taken, `LoadShed` fails the request at once and `HandleError` turns
    // that into a 503.
    let limit = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(access::overloaded))
        .layer(LoadShedLayer::new())
        .layer(GlobalConcurrencyLimitLayer::new(
            options.max_in_flight.max(1),
        ));
    Router::new()
        .route("/metrics", get(metrics))
        .merge(api)
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
        .layer(limit)
        // Added after the layer: outside it.
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Binds `addr` (port 0 picks a free one).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the routes on `listener`, guarded by `options`, until `shutdown` fires, then
/// finishes the requests under way.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    options: HttpOptions,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state, &options))
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

/// The query of `/api/v1/cluster`.
#[derive(Debug, Deserialize)]
struct PageQuery {
    after: Option<String>,
    limit: Option<usize>,
}

impl PageQuery {
    /// The page asked for, or why it cannot be served.
    fn page(self) -> Result<Page, &'static str> {
        let limit = self.limit.unwrap_or(DEFAULT_PAGE_LIMIT);
        if limit == 0 {
            return Err("limit must be at least 1");
        }
        let after = match self.after {
            None => None,
            Some(name) => Some(
                tb_proto::TensorName::new(&name)
                    .map_err(|_| "after must be a tensor name (a page's `next`)")?,
            ),
        };
        Ok(Page {
            after,
            limit: limit.min(MAX_PAGE_LIMIT),
        })
    }
}

async fn cluster(State(state): State<AppState>, Query(query): Query<PageQuery>) -> Response {
    let page = match query.page() {
        Ok(page) => page,
        Err(why) => return (StatusCode::BAD_REQUEST, why).into_response(),
    };
    let Some(ClusterData {
        members,
        entries,
        next,
        registry,
        functions,
    }) = state.source.cluster(&page)
    else {
        return (StatusCode::NOT_FOUND, "no cluster view: not a broker").into_response();
    };
    Json(Cluster {
        broker: state.status().await,
        members,
        entries,
        next,
        registry,
        functions,
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::{
        metrics::{Metrics, Role},
        source::Source,
    };

    struct Fake {
        ready: AtomicBool,
        /// When set, `refresh` says it started and waits to be released (a slow request).
        gate: Option<Gate>,
    }

    #[derive(Default)]
    struct Gate {
        entered: tokio::sync::Notify,
        release: tokio::sync::Notify,
    }

    impl Fake {
        fn new(ready: bool) -> Fake {
            Fake {
                ready: AtomicBool::new(ready),
                gate: None,
            }
        }
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
            Box::pin(async {
                if let Some(gate) = &self.gate {
                    gate.entered.notify_one();
                    gate.release.notified().await;
                }
            })
        }
    }

    /// Serves `fake` with `options` on a free loopback port.
    async fn start(
        fake: Arc<Fake>,
        options: HttpOptions,
    ) -> (
        SocketAddr,
        CancellationToken,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let state = AppState {
            metrics: Metrics::new(Role::Worker).expect("metrics"),
            source: fake,
        };
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, state, options, stop.clone()));
        (addr, stop, server)
    }

    /// One HTTP/1.0 GET over a raw socket: (status line, headers, body).
    async fn raw_get(addr: SocketAddr, path: &str) -> (String, String, String) {
        raw_get_with(addr, path, "").await
    }

    /// [`raw_get`] with extra header lines (each ending in `\r\n`).
    async fn raw_get_with(addr: SocketAddr, path: &str, headers: &str) -> (String, String, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!("GET {path} HTTP/1.0\r\nHost: x\r\n{headers}\r\n");
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
        let fake = Arc::new(Fake::new(false));
        let (addr, stop, server) = start(fake.clone(), HttpOptions::default()).await;

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

    #[tokio::test]
    async fn the_api_wants_the_bearer_token_when_one_is_set() {
        const TOKEN: &str = "0123456789abcdef-token";
        let options = HttpOptions {
            token: Some(crate::HttpToken::new(TOKEN).expect("token")),
            ..HttpOptions::default()
        };
        let (addr, stop, server) = start(Arc::new(Fake::new(true)), options).await;
        for path in ["/api/v1/status", "/api/v1/cluster"] {
            let (status, headers, _) = raw_get(addr, path).await;
            assert!(status.contains("401"), "{path} without a token: {status}");
            assert!(
                headers.contains("www-authenticate: bearer"),
                "{path}: {headers}"
            );
            let wrong = "Authorization: Bearer 0123456789abcdef-tokeN\r\n";
            let (status, headers, _) = raw_get_with(addr, path, wrong).await;
            assert!(
                status.contains("401"),
                "{path} with a wrong token: {status}"
            );
            assert!(headers.contains("invalid_token"), "{path}: {headers}");
        }
        let right = format!("Authorization: Bearer {TOKEN}\r\n");
        let (status, _, body) = raw_get_with(addr, "/api/v1/status", &right).await;
        assert!(status.contains("200"), "{status}");
        let parsed: crate::api::Status = serde_json::from_str(&body).expect("status json");
        assert_eq!(parsed.node_id, "ab");
        // A worker has no cluster view: with the token, the answer says so.
        let (status, _, _) = raw_get_with(addr, "/api/v1/cluster", &right).await;
        assert!(status.contains("404"), "{status}");
        // Prometheus, the probes and the page itself need no token.
        for path in ["/metrics", "/healthz", "/readyz", "/", "/assets/app.js"] {
            let (status, _, _) = raw_get(addr, path).await;
            assert!(status.contains("200"), "{path}: {status}");
        }
        stop.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
        assert!(matches!(stopped, Ok(Ok(Ok(())))), "graceful stop");
    }

    #[tokio::test]
    async fn requests_beyond_the_limit_are_shed_with_503_and_probes_still_answer() {
        let fake = Arc::new(Fake {
            ready: AtomicBool::new(true),
            gate: Some(Gate::default()),
        });
        let options = HttpOptions {
            max_in_flight: 1,
            ..HttpOptions::default()
        };
        let (addr, stop, server) = start(fake.clone(), options).await;
        let gate = fake.gate.as_ref().expect("gate");
        // The first request takes the only slot and waits inside the handler.
        let slow = tokio::spawn(async move { raw_get(addr, "/metrics").await });
        tokio::time::timeout(Duration::from_secs(10), gate.entered.notified())
            .await
            .expect("the first request reached its handler");
        for path in ["/metrics", "/api/v1/status", "/"] {
            let (status, headers, _) = raw_get(addr, path).await;
            assert!(status.contains("503"), "{path} while busy: {status}");
            assert!(headers.contains("retry-after: 1"), "{path}: {headers}");
        }
        assert!(raw_get(addr, "/healthz").await.0.contains("200"));
        assert!(raw_get(addr, "/readyz").await.0.contains("200"));
        gate.release.notify_one();
        let (status, _, body) = tokio::time::timeout(Duration::from_secs(10), slow)
            .await
            .expect("the slow request finishes")
            .expect("task");
        assert!(status.contains("200") && body.contains("tb_store_tensors 7"));
        // The slot is free again.
        let next = tokio::spawn(async move { raw_get(addr, "/api/v1/status").await });
        tokio::time::timeout(Duration::from_secs(10), gate.entered.notified())
            .await
            .expect("the next request reached its handler");
        gate.release.notify_one();
        let (status, _, _) = next.await.expect("task");
        assert!(status.contains("200"), "{status}");
        stop.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
        assert!(matches!(stopped, Ok(Ok(Ok(())))), "graceful stop");
    }

    #[tokio::test]
    async fn bad_page_requests_are_refused_with_400() {
        let (addr, stop, server) = start(Arc::new(Fake::new(true)), HttpOptions::default()).await;
        for path in [
            "/api/v1/cluster?limit=0",
            "/api/v1/cluster?limit=-3",
            "/api/v1/cluster?after=no%20spaces",
        ] {
            let (status, _, body) = raw_get(addr, path).await;
            assert!(status.contains("400"), "{path}: {status} {body}");
        }
        stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    }
}
