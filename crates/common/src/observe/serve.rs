//! The HTTP endpoints of both binaries: `/metrics` (Prometheus text), `/healthz`, `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::observe::metrics::Registry;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

/// What the endpoints report; flags are flipped by the binary as it starts and stops.
#[derive(Clone)]
pub struct Health {
    pub registry: Registry,
    /// Set once the process has reached the apiserver and started its loops.
    pub ready: Arc<AtomicBool>,
    /// Cleared when a loop the process cannot live without has died.
    pub alive: Arc<AtomicBool>,
}

impl Health {
    pub fn new(registry: Registry) -> Self {
        Self {
            registry,
            ready: Arc::new(AtomicBool::new(false)),
            alive: Arc::new(AtomicBool::new(true)),
        }
    }
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        crate::observe::metrics::encode(&h.registry),
    )
}

fn flag(ok: bool) -> (StatusCode, &'static str) {
    if ok {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ok")
    }
}

/// The three endpoints, for the plain port here and the secure one (`secure.rs`).
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route(
            "/healthz",
            get(|State(h): State<Health>| async move { flag(h.alive.load(Ordering::Relaxed)) }),
        )
        .route(
            "/readyz",
            get(|State(h): State<Health>| async move {
                flag(h.alive.load(Ordering::Relaxed) && h.ready.load(Ordering::Relaxed))
            }),
        )
        .with_state(health)
}

/// Binds `addr` (so a taken port fails start-up with a clear error) and serves in the background.
pub async fn spawn(addr: SocketAddr, health: Health) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr} for metrics and health: {e}"))?;
    let bound = listener.local_addr()?;
    let app = router(health);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tracing::info!(%bound, "serving /metrics, /healthz, /readyz");
    Ok(bound)
}
