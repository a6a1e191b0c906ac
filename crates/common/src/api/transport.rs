//! The HTTP transport under every API client: HTTP/2 when the apiserver offers it (it always
//! does), as client-go speaks it.
//!
//! kube's own stack speaks HTTP/1.1 only, so each request in flight holds a TCP + TLS connection
//! of its own: an attach burst opened ~190 connections to the apiserver (client-go: 1–3), each
//! with a TLS handshake on the apiserver's CPU, which the controller shares. Over HTTP/2 the
//! requests are streams of one connection, and the server's stream limit queues them instead.
//! The stack above the connection is kube's (base URI, credentials, extra headers), from its
//! public `ConfigExt`; only the hyper client differs. With a proxy configured, kube's own stack
//! is used unchanged.

use std::time::Duration;

use anyhow::Context;
use http::Response;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::Config;
use kube::client::{Body, ClientBuilder, ConfigExt, DynBody};
use tower::{BoxError, ServiceBuilder, ServiceExt};

/// Idle time after which the connection is pinged, and how long the answer may take before the
/// connection is dropped and the next request dials again (client-go's HTTP/2 health check uses
/// 30 s and 15 s): a half-open connection would otherwise hang every stream on it, watches too.
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);

/// kube's boxed service type (it does not export the name).
pub type Service = tower::util::BoxService<http::Request<Body>, Response<Box<DynBody>>, BoxError>;

/// kube's client stack for `config` over an HTTP/2-capable connection pool.
pub fn client_builder(config: Config) -> anyhow::Result<ClientBuilder<Service>> {
    if config.proxy_url.is_some() {
        return ClientBuilder::try_from(config).context("cannot build an API client");
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let tls = config
        .rustls_client_config()
        .context("TLS settings of the kubeconfig")?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(
            name.clone()
                .try_into()
                .with_context(|| format!("tls-server-name {name:?} is not a valid server name"))?,
        )),
        None => https,
    };
    let https = https.enable_http1().enable_http2().wrap_connector(http);
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .http2_keep_alive_interval(PING_INTERVAL)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .build::<_, Body>(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer().context("credentials of the kubeconfig")?)
        .layer(
            config
                .extra_headers_layer()
                .context("headers of the kubeconfig")?,
        )
        .map_err(BoxError::from)
        .service(hyper)
        .map_response(|res: Response<hyper::body::Incoming>| {
            res.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>)
        });
    let service = tower::util::BoxService::new(service);
    Ok(ClientBuilder::new(service, config.default_namespace.clone()))
}
