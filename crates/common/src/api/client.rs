//! Building the one `kube::Client` a binary uses: kubeconfig or in-cluster configuration, the
//! HTTP/2 transport (`transport`), the client-side limiter in the tower stack, and a start-up
//! check that the apiserver answers.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use kube::client::retry::RetryPolicy;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::api::clientmetrics::MetricsLayer;
use crate::api::ratelimit::{Limit, RateLimitLayer};

/// The API connection flags shared by both binaries.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    /// Path to a kubeconfig file; without it the in-cluster service account is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Requests per second of a fixed client-side token bucket (0 = unlimited). Unset, the
    /// controller adapts its rate to the apiserver's answers (--kube-api-max-qps) and the agent
    /// uses 50.
    #[arg(long)]
    pub kube_api_qps: Option<f32>,
    /// Requests a fixed bucket lets through at once above --kube-api-qps.
    #[arg(long, default_value_t = 100)]
    pub kube_api_burst: u32,
    /// Accepted so kube-controller-manager's and the kubelet's command lines carry over; the
    /// client reads and writes JSON whichever is given (kube's client has no protobuf codec).
    #[arg(long, value_enum, default_value_t = ContentType::Json)]
    pub kube_api_content_type: ContentType,
}

/// The values kube-controller-manager's --kube-api-content-type takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ContentType {
    #[value(name = "application/json")]
    Json,
    #[value(name = "application/vnd.kubernetes.protobuf")]
    Protobuf,
}

/// The agent's rate when --kube-api-qps is not given: one per node, so a fixed modest rate
/// (the kubelet's own default) keeps a fleet's restart from flooding the apiserver.
pub const AGENT_QPS: f32 = 50.0;

impl ApiArgs {
    /// Loads the configuration; the error says in one line where it looked.
    pub async fn config(&self) -> anyhow::Result<Config> {
        match &self.kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path)
                    .map_err(|e| anyhow!("cannot read kubeconfig {}: {e}", path.display()))?;
                Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| anyhow!("kubeconfig {} is not usable: {e}", path.display()))
            }
            None => Config::incluster()
                .map_err(|e| anyhow!("no --kubeconfig given and no in-cluster service account found ({e})")),
        }
    }

    /// The fixed bucket the flags ask for, or `unset` when --kube-api-qps is not given.
    pub fn limit_or(&self, unset: Limit) -> Limit {
        match self.kube_api_qps {
            None => unset,
            Some(qps) if qps <= 0.0 => Limit::Unlimited,
            Some(qps) => Limit::Static {
                qps,
                burst: self.kube_api_burst,
            },
        }
    }

    /// A client with the rate limit in its stack, checked against the apiserver before returning.
    pub async fn client(&self, limit: Limit) -> anyhow::Result<Client> {
        Ok(self.clients(limit).await?.0)
    }

    /// The rate-limited client for the work, and one without the limit for leader election, so
    /// a busy controller's own traffic can never delay its lease renewals (kube-controller-manager
    /// uses a separate client for the same reason).
    pub async fn clients(&self, limit: Limit) -> anyhow::Result<(Client, Client)> {
        if self.kube_api_content_type == ContentType::Protobuf {
            tracing::info!(
                "--kube-api-content-type=application/vnd.kubernetes.protobuf is accepted, but requests use JSON"
            );
        }
        let config = self.config().await?;
        let url = config.cluster_url.clone();
        let client = build(config.clone(), limit)?;
        wait_reachable(&client, Duration::from_secs(10))
            .await
            .with_context(|| format!("apiserver {url} is not reachable"))?;
        Ok((client, build_without_limit(config)?))
    }
}

/// The election client: no limiter, so it does not overwrite the work client's limit gauge.
fn build_without_limit(config: Config) -> anyhow::Result<Client> {
    build_with(config, None)
}

fn host_of(config: &Config) -> String {
    config
        .cluster_url
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default()
}

/// Builds a client whose every request passes the limiter and is counted in the
/// `rest_client_*` metrics, and whose requests answered 429/503/504 are sent again.
///
/// The retry is client-go's (its REST client retries such answers up to 10 times, after the
/// server's `Retry-After`): a request API Priority and Fairness turned away was never processed,
/// and surfacing it would put the object into the controller's per-key backoff, which grows to
/// minutes. Each retry passes the limiter again, so the 429 also slows the rate.
pub fn build(config: Config, limit: Limit) -> anyhow::Result<Client> {
    build_with(config, Some(limit))
}

fn build_with(mut config: Config, limit: Option<Limit>) -> anyhow::Result<Client> {
    let host = host_of(&config);
    // kube's own retry sits below any layer added here: the 429s it absorbed would reach neither
    // the request metrics nor the adaptive limiter. Ours goes on top instead.
    config.default_retry = false;
    // Who is asking, in the apiserver's audit log and managedFields (`identity`).
    let agent = crate::api::identity::user_agent();
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_str(&agent).context("user agent")?,
    ));
    let manager = crate::api::identity::field_manager();
    let builder = crate::api::transport::client_builder(config)?;
    let builder = builder.with_layer(&tower::util::MapRequestLayer::new(
        move |req: http::Request<kube::client::Body>| crate::api::identity::with_field_manager(req, &manager),
    ));
    let retry = RetryPolicy::new(Duration::from_millis(250), Duration::from_secs(10), 10, true)
        .context("retry policy")?;
    let builder = builder.with_layer(&MetricsLayer::new(host.clone()));
    let builder = builder.with_layer(&match limit {
        Some(limit) => RateLimitLayer::for_host(limit, &host),
        None => RateLimitLayer::unlimited(),
    });
    Ok(builder
        // Retry needs a cloneable service; the buffer makes the stack one.
        .with_layer(&tower::buffer::BufferLayer::new(1024))
        .with_layer(&tower::retry::RetryLayer::new(retry))
        .build())
}

/// Asks the apiserver for its version until it answers or `limit` passes.
pub async fn wait_reachable(client: &Client, limit: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match client.apiserver_version().await {
            Ok(_) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(anyhow!("{e}")),
            Err(e) => {
                tracing::debug!(error = %e, "apiserver not answering yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// The client of the kubeconfig at `path` (unlimited: review requests are few), or `fallback`
/// when there is none (the secure port's `--authentication-kubeconfig` and
/// `--authorization-kubeconfig`, as kube-controller-manager has them).
pub async fn for_kubeconfig(
    path: &Option<std::path::PathBuf>,
    fallback: &kube::Client,
) -> anyhow::Result<kube::Client> {
    match path {
        None => Ok(fallback.clone()),
        Some(p) => {
            let args = ApiArgs {
                kubeconfig: Some(p.clone()),
                kube_api_qps: None,
                kube_api_burst: 100,
                kube_api_content_type: ContentType::Json,
            };
            let config = args.config().await?;
            build(config, crate::api::ratelimit::Limit::Unlimited)
        }
    }
}
