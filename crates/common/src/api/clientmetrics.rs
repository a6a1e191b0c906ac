//! client-go's REST client metrics for the one API client of a binary, so `--kube-api-qps`
//! can be tuned by looking: requests by code and method, their latency, and the time each
//! request spent waiting for the client-side rate limiter (`ratelimit`), all labelled with the
//! apiserver's host as client-go labels them.

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Instant;

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, Opts};
use tower::{Layer, Service};

pub(crate) struct Families {
    pub(crate) requests: IntCounterVec,
    pub(crate) latency: HistogramVec,
    pub(crate) limiter_wait: HistogramVec,
    pub(crate) limit: GaugeVec,
    pub(crate) window: GaugeVec,
    pub(crate) cuts: IntCounterVec,
}

/// client-go's latency buckets (5 ms to 60 s).
const LATENCY_BUCKETS: &[f64] = &[0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0];

pub(crate) static FAMILIES: LazyLock<Families> = LazyLock::new(|| {
    Families {
    requests: IntCounterVec::new(
        Opts::new(
            "rest_client_requests_total",
            "API requests by HTTP status code (\"<error>\" when no response came), method and host.",
        ),
        &["code", "method", "host"],
    )
    .expect("static metric definition"),
    latency: HistogramVec::new(
        HistogramOpts::new(
            "rest_client_request_duration_seconds",
            "API request latency, from sending to the response head, by verb and host.",
        )
        .buckets(LATENCY_BUCKETS.to_vec()),
        &["verb", "host"],
    )
    .expect("static metric definition"),
    limiter_wait: HistogramVec::new(
        HistogramOpts::new(
            "rest_client_rate_limiter_duration_seconds",
            "Time requests waited for the client-side rate limiter (--kube-api-qps/--kube-api-burst), by verb and host.",
        )
        .buckets(LATENCY_BUCKETS.to_vec()),
        &["verb", "host"],
    )
    .expect("static metric definition"),
    limit: GaugeVec::new(
        Opts::new(
            "stowage_api_client_qps_limit",
            "Requests per second the client-side token bucket allows (0 = no limit).",
        ),
        &["host"],
    )
    .expect("static metric definition"),
    window: GaugeVec::new(
        Opts::new(
            "stowage_api_client_concurrency_limit",
            "Requests (watches not counted) the adaptive limiter lets be in flight now (0 = no window).",
        ),
        &["host"],
    )
    .expect("static metric definition"),
    cuts: IntCounterVec::new(
        Opts::new(
            "stowage_api_client_limit_cuts_total",
            "Times the adaptive limiter halved its window because the apiserver answered 429.",
        ),
        &["host"],
    )
    .expect("static metric definition"),
}
});

impl Families {
    pub(crate) fn register(&self, registry: &crate::observe::metrics::Registry) {
        use crate::observe::metrics::register;
        register(registry, self.requests.clone());
        register(registry, self.latency.clone());
        register(registry, self.limiter_wait.clone());
        register(registry, self.limit.clone());
        register(registry, self.window.clone());
        register(registry, self.cuts.clone());
    }
}

/// Records every request that passes; `host` is the apiserver's `host:port`.
#[derive(Clone, Debug)]
pub struct MetricsLayer {
    host: String,
}

impl MetricsLayer {
    pub fn new(host: impl Into<String>) -> Self {
        Self { host: host.into() }
    }
}

impl<S> Layer<S> for MetricsLayer {
    type Service = Metered<S>;

    fn layer(&self, inner: S) -> Metered<S> {
        Metered {
            inner,
            host: self.host.clone(),
        }
    }
}

pub struct Metered<S> {
    inner: S,
    host: String,
}

impl<S, B, RB> Service<http::Request<B>> for Metered<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = MeteredFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = req.method().as_str().to_string();
        MeteredFuture {
            inner: Box::pin(self.inner.call(req)),
            method,
            host: self.host.clone(),
            started: Instant::now(),
        }
    }
}

pub struct MeteredFuture<F> {
    inner: Pin<Box<F>>,
    method: String,
    host: String,
    started: Instant,
}

impl<F, RB, E> Future for MeteredFuture<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = std::task::ready!(self.inner.as_mut().poll(cx));
        let code = match &out {
            Ok(resp) => resp.status().as_u16().to_string(),
            Err(_) => "<error>".to_string(),
        };
        let f = &*FAMILIES;
        f.requests
            .with_label_values(&[&code, &self.method, &self.host])
            .inc();
        f.latency
            .with_label_values(&[&self.method, &self.host])
            .observe(self.started.elapsed().as_secs_f64());
        Poll::Ready(out)
    }
}

/// Registers the client's families (requests, latency, limiter waits, limits, windows, cuts) in
/// `registry`; each binary does, once, beside the families of its own.
pub fn register(registry: &crate::observe::metrics::Registry) {
    FAMILIES.register(registry);
}

/// Records a wait for the rate limiter (called by `ratelimit` once the request is known).
pub(crate) fn limiter_waited(method: &str, host: &str, secs: f64) {
    FAMILIES
        .limiter_wait
        .with_label_values(&[method, host])
        .observe(secs);
}

/// The bucket's rate (set at start).
pub(crate) fn limit_set(host: &str, qps: f64) {
    FAMILIES.limit.with_label_values(&[host]).set(qps);
}

/// The adaptive window's current size.
pub(crate) fn concurrency_limit_set(host: &str, n: f64) {
    FAMILIES.window.with_label_values(&[host]).set(n);
}

/// The cuts counter of `host` appears at zero (it is documented for every binary, adaptive or not).
pub(crate) fn limit_cuts_start(host: &str) {
    FAMILIES.cuts.with_label_values(&[host]);
}

/// The adaptive limiter cut its window after a 429.
pub(crate) fn limit_cut(host: &str) {
    FAMILIES.cuts.with_label_values(&[host]).inc();
}
