//! Per-RPC metrics of the CSI services, recorded by one tower layer on the gRPC server.
//!
//! The family has the name, labels, label values and buckets the CSI sidecars export for the
//! calls they make (kubernetes-csi/csi-lib-utils), so dashboards and alerts written for any CSI
//! driver read this one too: one series per driver, method (`/csi.v1.Node/NodeStageVolume`) and
//! gRPC code as grpc-go spells it (`OK`, `InvalidArgument`, `Aborted`, …).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus::{HistogramOpts, HistogramVec};
use tonic::Code;

/// The full gRPC path of every method of every CSI v1 service (generated from csi.proto).
pub mod spec {
    include!(concat!(env!("OUT_DIR"), "/csi_methods.rs"));
}

pub const NAME: &str = "csi_sidecar_operations_seconds";
/// The sidecars' buckets: CSI calls range from a capability query to a format of a large volume.
pub const BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// The histogram, not yet in any registry: the binary registers [`RpcMetrics::histogram`] in its
/// own and hands this to the server.
#[derive(Clone)]
pub struct RpcMetrics {
    seconds: HistogramVec,
}

impl std::fmt::Debug for RpcMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(NAME)
    }
}

impl Default for RpcMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RpcMetrics {
    pub fn new() -> Self {
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                NAME,
                "CSI calls served, by driver, method and gRPC status code, and how long each took.",
            )
            .buckets(BUCKETS.to_vec()),
            &["driver_name", "method_name", "grpc_status_code"],
        )
        .expect("static metric definition");
        Self { seconds }
    }

    pub fn histogram(&self) -> &HistogramVec {
        &self.seconds
    }

    /// The layer for a server of `driver` that serves the given services (`csi.v1.Node`, …).
    pub fn layer(&self, driver: &str, services: &[&str]) -> RpcLayer {
        let methods = spec::METHODS
            .iter()
            .copied()
            .filter(|m| {
                // Only the methods of services served: a call to another service never reaches
                // a handler, as with grpc-go's interceptors.
                services.iter().any(|s| {
                    m.strip_prefix('/')
                        .and_then(|m| m.strip_prefix(s))
                        .is_some_and(|rest| rest.starts_with('/'))
                })
            })
            .collect();
        RpcLayer(Some(Arc::new(Recorder {
            seconds: self.seconds.clone(),
            driver: driver.to_string(),
            methods,
        })))
    }
}

/// grpc-go's name of a code, the label value the sidecars write (tonic's `Debug` differs:
/// `Ok`, `Cancelled`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

struct Recorder {
    seconds: HistogramVec,
    driver: String,
    methods: Vec<&'static str>,
}

/// Records every call the wrapped gRPC server answers; `None` records nothing (a server without
/// a metrics endpoint), so the server's type is the same either way.
#[derive(Clone, Default)]
pub struct RpcLayer(Option<Arc<Recorder>>);

impl<S> tower::Layer<S> for RpcLayer {
    type Service = Recorded<S>;

    fn layer(&self, inner: S) -> Recorded<S> {
        Recorded {
            inner,
            recorder: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Recorded<S> {
    inner: S,
    recorder: Option<Arc<Recorder>>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for Recorded<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    R: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let call = self.recorder.as_ref().and_then(|r| {
            let method = r.methods.iter().find(|m| **m == req.uri().path())?;
            Some(Call {
                recorder: r.clone(),
                method,
                started: Instant::now(),
                deadline: req
                    .headers()
                    .get("grpc-timeout")
                    .and_then(|v| grpc_timeout(v.to_str().ok()?)),
                done: false,
            })
        });
        let fut = self.inner.call(req);
        let Some(mut call) = call else {
            return Box::pin(fut);
        };
        Box::pin(async move {
            let res = fut.await;
            call.finish(match &res {
                Ok(resp) => response_code(resp),
                // tonic's routes do not fail; anything else is no status the handler chose.
                Err(_) => Code::Unknown,
            });
            res
        })
    }
}

/// The code of a unary call's answer, known at its head: an error is sent trailers-only, its
/// `grpc-status` in the headers; a reply message has none there (its trailers say OK).
fn response_code<R>(resp: &http::Response<R>) -> Code {
    match resp.headers().get("grpc-status") {
        None => Code::Ok,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.parse::<i32>().ok())
            .map_or(Code::Unknown, Code::from_i32),
    }
}

/// A `grpc-timeout` header value: up to 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
fn grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// One call being served. Dropped unfinished, the call was given up by the server: the client
/// went away or its deadline passed (tonic drops the handler then; grpc-go's handler would see
/// its context end with Canceled or DeadlineExceeded).
struct Call {
    recorder: Arc<Recorder>,
    method: &'static str,
    started: Instant,
    deadline: Option<Duration>,
    done: bool,
}

impl Call {
    fn finish(&mut self, code: Code) {
        self.done = true;
        self.recorder
            .seconds
            .with_label_values(&[self.recorder.driver.as_str(), self.method, code_name(code)])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.done {
            let code = match self.deadline {
                Some(d) if self.started.elapsed() >= d => Code::DeadlineExceeded,
                _ => Code::Cancelled,
            };
            self.finish(code);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::core::Collector;
    use tower::{Layer, Service, ServiceExt};

    fn sample(m: &RpcMetrics, method: &str, code: &str) -> u64 {
        m.histogram()
            .get_metric_with_label_values(&["d", method, code])
            .map_or(0, |h| h.get_sample_count())
    }

    /// A server whose answer is given by the request's path.
    fn server(
        m: &RpcMetrics,
    ) -> impl Service<
        http::Request<()>,
        Response = http::Response<()>,
        Error = std::convert::Infallible,
        Future: Send,
    > {
        m.layer("d", &["csi.v1.Node", "csi.v1.Identity"])
            .layer(tower::service_fn(|req: http::Request<()>| async move {
                let mut resp = http::Response::new(());
                match req.uri().path() {
                    "/csi.v1.Node/NodeStageVolume" => {
                        resp.headers_mut().insert("grpc-status", "3".parse().unwrap());
                    }
                    "/csi.v1.Node/NodeUnstageVolume" => std::future::pending::<()>().await,
                    _ => {}
                }
                Ok(resp)
            }))
    }

    fn request(path: &str) -> http::Request<()> {
        http::Request::builder().uri(path).body(()).unwrap()
    }

    #[tokio::test]
    async fn answers_are_counted_by_method_and_grpc_go_code_name() {
        let m = RpcMetrics::new();
        let mut s = server(&m);
        for path in [
            "/csi.v1.Identity/Probe",
            "/csi.v1.Identity/Probe",
            "/csi.v1.Node/NodeStageVolume",
            // Not served here, not in the spec: no series.
            "/csi.v1.Controller/CreateVolume",
            "/csi.v1.Node/NoSuchMethod",
        ] {
            s.ready().await.unwrap().call(request(path)).await.unwrap();
        }
        assert_eq!(sample(&m, "/csi.v1.Identity/Probe", "OK"), 2);
        assert_eq!(sample(&m, "/csi.v1.Node/NodeStageVolume", "InvalidArgument"), 1);
        let series: usize = m.histogram().collect().iter().map(|f| f.get_metric().len()).sum();
        assert_eq!(series, 2, "only served spec methods have series");
    }

    #[tokio::test]
    async fn a_call_given_up_is_canceled_or_past_its_deadline() {
        let m = RpcMetrics::new();
        let mut s = server(&m);
        let unstage = "/csi.v1.Node/NodeUnstageVolume";
        let call = s.ready().await.unwrap().call(request(unstage));
        assert!(
            tokio::time::timeout(Duration::from_millis(20), call)
                .await
                .is_err()
        );
        assert_eq!(sample(&m, unstage, "Canceled"), 1);

        let mut req = request(unstage);
        req.headers_mut().insert("grpc-timeout", "10m".parse().unwrap());
        let call = s.ready().await.unwrap().call(req);
        assert!(
            tokio::time::timeout(Duration::from_millis(30), call)
                .await
                .is_err()
        );
        assert_eq!(sample(&m, unstage, "DeadlineExceeded"), 1);
    }

    #[test]
    fn grpc_timeouts_are_read_as_the_spec_writes_them() {
        assert_eq!(grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(grpc_timeout("150m"), Some(Duration::from_millis(150)));
        assert_eq!(grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        for bad in ["", "S", "5", "5x", "123456789S", "-1S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn every_spec_method_is_a_full_path() {
        assert!(spec::METHODS.contains(&"/csi.v1.Node/NodeStageVolume"));
        assert!(spec::METHODS.contains(&"/csi.v1.Identity/GetPluginInfo"));
        assert!(spec::METHODS.iter().all(|m| m.starts_with("/csi.v1.")));
    }
}
