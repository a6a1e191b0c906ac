//! Building the one `kube::Client` a binary uses: kubeconfig or in-cluster configuration, the
//! client-side token bucket in the tower stack, and a start-up check that the apiserver answers.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::clientmetrics::MetricsLayer;
use crate::ratelimit::RateLimitLayer;

/// The API connection flags shared by both binaries.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    /// Path to a kubeconfig file; without it the in-cluster service account is used.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Steady-state requests per second to the apiserver (client-side token bucket; 0 = unlimited).
    #[arg(long, default_value_t = 50.0)]
    pub kube_api_qps: f32,
    /// Requests that may be sent at once above the steady rate.
    #[arg(long, default_value_t = 100)]
    pub kube_api_burst: u32,
}

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

    /// A client with the rate limit in its stack, checked against the apiserver before returning.
    pub async fn client(&self) -> anyhow::Result<Client> {
        Ok(self.clients().await?.0)
    }

    /// The rate-limited client for the work, and one without the limit for leader election, so
    /// a busy controller's own traffic can never delay its lease renewals (kube-controller-manager
    /// uses a separate client for the same reason).
    pub async fn clients(&self) -> anyhow::Result<(Client, Client)> {
        let config = self.config().await?;
        let url = config.cluster_url.clone();
        let client = build(config.clone(), self.kube_api_qps, self.kube_api_burst)?;
        wait_reachable(&client, Duration::from_secs(10))
            .await
            .with_context(|| format!("apiserver {url} is not reachable"))?;
        Ok((client, build(config, 0.0, 0)?))
    }
}

/// Builds a client whose every request passes the token bucket and is counted in the
/// `rest_client_*` metrics.
pub fn build(config: Config, qps: f32, burst: u32) -> anyhow::Result<Client> {
    let host = config
        .cluster_url
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let builder = ClientBuilder::try_from(config).context("cannot build an API client")?;
    Ok(builder
        .with_layer(&MetricsLayer::new(host.clone()))
        .with_layer(&RateLimitLayer::for_host(qps, burst, &host))
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
