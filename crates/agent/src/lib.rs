//! `stowage-agent`: the per-node half of stowage. Three loops share one context: the attacher
//! (VolumeAttachments → loop devices), the volume manager (pods → mounts, kubelet style) and the
//! node status task (`volumesInUse`, heartbeat).

pub mod attacher;
pub mod ctx;
pub mod fsgroup;
pub mod metrics;
pub mod mountinfo;
pub mod node;
pub mod paths;
pub mod probe;
pub mod reconcile;
pub mod state;
pub mod sys;
pub mod tracker;
pub mod volumes;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Context, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Api;
use kube::runtime::watcher;
use stowage_common::client::ApiArgs;
use stowage_common::events::Events;
use stowage_common::informer::{Informer, strip_managed_fields};
use stowage_common::serve::{self, Health};
use tokio::sync::watch;
use tokio::task::JoinSet;

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
    /// Directory holding the volume images `<volume-handle>.img` (shared with the controller).
    #[arg(long, default_value = "/var/lib/stowage/images")]
    pub image_dir: PathBuf,
    /// Create the Node object if missing and keep its Ready condition and Lease fresh (for
    /// nodes without a kubelet: the demo and the end-to-end tests).
    #[arg(long)]
    pub register_node: bool,
    /// The mount table the volume manager reads (tests point it at a source that fails).
    #[arg(long, default_value = mountinfo::PROC_MOUNTINFO, hide = true)]
    pub mount_table: PathBuf,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub metrics_bind_address: SocketAddr,
}

fn canonical_dir(p: &PathBuf, flag: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(p).with_context(|| format!("cannot create {flag} {}", p.display()))?;
    // The mount table shows canonical paths; ours must compare equal to them.
    std::fs::canonicalize(p).with_context(|| format!("cannot resolve {flag} {}", p.display()))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.node_name.trim().is_empty() {
        bail!("--node-name must not be empty");
    }
    let root = canonical_dir(&args.root_dir, "--root-dir")?;
    let image_dir = canonical_dir(&args.image_dir, "--image-dir")?;
    let registry = stowage_common::metrics::registry("stowage-agent");
    let metrics = metrics::Metrics::new(&registry);
    let health = Health::new(registry.clone());
    serve::spawn(args.metrics_bind_address, health.clone()).await?;
    let client = args.api.client().await?;

    let mut watches = JoinSet::new();
    let pods = Informer::spawn(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().fields(&format!("spec.nodeName={}", args.node_name)),
        strip_managed_fields,
        &mut watches,
    );
    let pvcs = Informer::spawn(
        Api::<PersistentVolumeClaim>::all(client.clone()),
        watcher::Config::default(),
        strip_managed_fields,
        &mut watches,
    );
    let pvs = Informer::spawn(
        Api::<PersistentVolume>::all(client.clone()),
        watcher::Config::default(),
        strip_managed_fields,
        &mut watches,
    );
    let vas = Informer::spawn(
        Api::<VolumeAttachment>::all(client.clone()),
        watcher::Config::default(),
        strip_managed_fields,
        &mut watches,
    );
    let ctx = Arc::new(ctx::Ctx {
        events: Events::new(client.clone(), "stowage-agent"),
        client: client.clone(),
        node: args.node_name.clone(),
        layout: paths::Layout::new(root.clone()),
        image_dir,
        mount_table: args.mount_table.clone(),
        metrics,
        pods,
        pvcs,
        pvs,
        vas,
    });

    tokio::join!(
        ctx.pods.ready(),
        ctx.pvcs.ready(),
        ctx.pvs.ready(),
        ctx.vas.ready()
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let (in_use_tx, in_use_rx) = watch::channel(None);
    let (reported_tx, reported_rx) = watch::channel(BTreeSet::new());
    let mut loops = JoinSet::new();
    loops.spawn(node::run(
        ctx.clone(),
        args.register_node,
        in_use_rx,
        reported_tx,
        stop_rx.clone(),
    ));
    loops.spawn(attacher::run(ctx.clone(), stop_rx.clone()));
    loops.spawn(volumes::run(
        ctx.clone(),
        volumes::NodeLink {
            in_use: in_use_tx,
            reported: reported_rx,
        },
        stop_rx,
    ));
    health.ready.store(true, Ordering::Relaxed);
    tracing::info!(node = %args.node_name, root = %root.display(), "agent started");

    tokio::select! {
        _ = stowage_common::shutdown::signalled() => {}
        r = loops.join_next() => {
            health.alive.store(false, Ordering::Relaxed);
            bail!("an agent loop ended unexpectedly: {r:?}");
        }
    }
    // Mounts stay as they are (a restart must not disturb running pods); only operations in
    // flight are allowed to finish.
    let _ = stop_tx.send(true);
    while loops.join_next().await.is_some() {}
    watches.abort_all();
    Ok(())
}
