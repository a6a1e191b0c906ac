//! `stowage-agent`: the per-node half of stowage.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use anyhow::{Context, bail};
use clap::Parser;
use stowage_common::client::ApiArgs;
use stowage_common::serve::{self, Health};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "stowage-agent",
    version,
    about = "Node agent of stowage: attach, mount and resize loop-device volumes."
)]
pub struct Args {
    #[command(flatten)]
    pub api: ApiArgs,
    /// Name of the Node this agent serves.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Where global device mounts and pod volume directories live.
    #[arg(long, default_value = "/var/lib/stowage")]
    pub root_dir: PathBuf,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub metrics_bind_address: SocketAddr,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.node_name.trim().is_empty() {
        bail!("--node-name must not be empty");
    }
    std::fs::create_dir_all(&args.root_dir)
        .with_context(|| format!("cannot create --root-dir {}", args.root_dir.display()))?;
    let registry = stowage_common::metrics::registry("stowage-agent");
    let health = Health::new(registry.clone());
    serve::spawn(args.metrics_bind_address, health.clone()).await?;
    let _client = args.api.client().await?;
    health.ready.store(true, Ordering::Relaxed);
    tracing::info!(node = %args.node_name, root = %args.root_dir.display(), "agent started");
    stowage_common::shutdown::signalled().await;
    Ok(())
}
