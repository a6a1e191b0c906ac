//! `stowage-agent`: the per-node half of stowage. Three loops share one context: the attacher
//! (VolumeAttachments → loop devices), the volume manager (pods → mounts, kubelet style) and the
//! node status task (`volumesInUse`, heartbeat).

pub mod attacher;
pub mod capacity;
pub mod core;
pub mod ctx;
pub mod error;
pub mod fsgroup;
pub mod images;
pub mod metrics;
pub mod node;
mod panic_hook;
mod passes;
pub mod paths;
pub mod probe;
pub mod state;
pub mod store;
pub mod tracker;
pub mod volumes;

// The device steps and the mount table belong to the driver crate; the agent's modules name them
// as before.
pub use stowage_loopdriver::{mountinfo, sys};

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Context, bail};
use clap::Parser;
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use kube::runtime::watcher;
use stowage_common::api::client::ApiArgs;
use stowage_common::observe::events::Events;
use stowage_common::observe::serve::{self, Health};
use stowage_common::store::informer::{Feed, Informer, as_decoded};
use stowage_loopdriver::csi::registration;
use stowage_loopdriver::csi::server::{self as csi_server, Endpoint, NodeSettings, socket_path};
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
    #[command(flatten)]
    pub log: stowage_common::observe::logging::LogArgs,
    /// Name of the Node this agent serves.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Where global device mounts and pod volume directories live.
    #[arg(long, default_value = "/var/lib/stowage")]
    pub root_dir: PathBuf,
    /// Directory holding the volume images `<volume-handle>.img`.
    #[arg(long, default_value = "/var/lib/stowage/images")]
    pub image_dir: PathBuf,
    /// `local`: the image dir is this node's own store; the node plugin reports the node as its
    /// volumes' topology, and this agent makes, grows and deletes the images of the volumes
    /// pinned to it. `shared`: one store every node and the controller mount.
    #[arg(long, default_value_t = stowage_loopdriver::StoreMode::Shared)]
    pub image_store_mode: stowage_loopdriver::StoreMode,
    /// Local mode: publish this node's free store space as CSIStorageCapacity objects in this
    /// namespace (one per storage class of the driver), for the scheduler. Unset: none.
    #[arg(long, env = "POD_NAMESPACE")]
    pub capacity_namespace: Option<String>,
    /// Create the Node object if missing and keep its Ready condition and Lease fresh (for
    /// nodes without a kubelet: the demo and the end-to-end tests).
    #[arg(long)]
    pub register_node: bool,
    /// The mount table the volume manager reads (tests point it at a source that fails).
    #[arg(long, default_value = mountinfo::PROC_MOUNTINFO, hide = true)]
    pub mount_table: PathBuf,
    /// How long a loop device of the store must stay unused and unnamed by any attachment before
    /// the attacher releases it (tests shorten it).
    #[arg(long, default_value_t = 120, hide = true)]
    pub stale_device_grace_seconds: u64,
    /// Run beside the kubelet whose root dir this is, as the driver's CSI node plugin: serve CSI
    /// on `<dir>/plugins/loop.stowage.dev/csi.sock`, register it through
    /// `<dir>/plugins_registry/`, and keep only the attacher; the kubelet stages and publishes.
    #[arg(long, conflicts_with = "register_node")]
    pub kubelet_dir: Option<PathBuf>,
    /// Serve the CSI Identity and Node services of the driver on this unix socket, as a kubelet's
    /// node plugin does (e.g. `/var/lib/kubelet/plugins/loop.stowage.dev/csi.sock`).
    #[arg(long, env = "CSI_ENDPOINT")]
    pub csi_endpoint: Option<String>,
    /// Also serve the CSI Controller service (create, delete, expand) on the endpoint, for the
    /// upstream external-provisioner and external-resizer.
    #[arg(long, requires = "csi_endpoint")]
    pub csi_controller: bool,
    /// Serve only CSI: no apiserver, no attacher, no volume manager (csi-sanity, or a plugin
    /// whose attachments come from elsewhere).
    #[arg(long, requires = "csi_endpoint")]
    pub csi_only: bool,
    /// The driver name the CSI endpoint reports and registers with the kubelet. Another name than
    /// loop.stowage.dev serves the same driver as a third-party one, driven by the upstream
    /// sidecars (stowage's attacher and provisioner serve only loop.stowage.dev), so it needs
    /// `--csi-only`.
    #[arg(long, default_value = stowage_loopdriver::DRIVER, requires = "csi_only")]
    pub csi_driver_name: String,
    /// Volumes this node may hold at once, reported by CSI NodeGetInfo (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_volumes: i64,
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub metrics_bind_address: SocketAddr,
    /// Debug builds only, for tests: `<operation>:<pv>` (attach, mount) panics that operation's
    /// next task once (`owed.rs`).
    #[cfg(debug_assertions)]
    #[arg(long, hide = true)]
    pub debug_panic_once: Vec<String>,
}

/// Wakes `wake` on every change `feed` brings, until stopped (a loop whose pass reads the stores
/// whatever changed).
async fn wake_on<K: Clone>(
    mut feed: Feed<K>,
    wake: Arc<tokio::sync::Notify>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            r = feed.next() => match r {
                Ok(_) => wake.notify_one(),
                Err(e) => {
                    tracing::error!(error = %e, "a storage capacity watch ended");
                    return;
                }
            },
        }
    }
}

fn canonical_dir(p: &PathBuf, flag: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(p).with_context(|| format!("cannot create {flag} {}", p.display()))?;
    // The mount table shows canonical paths; ours must compare equal to them.
    std::fs::canonicalize(p).with_context(|| format!("cannot resolve {flag} {}", p.display()))
}

/// The registry with every family this process exports, as `run` builds it.
fn registry() -> (stowage_common::observe::metrics::Registry, metrics::Metrics) {
    let registry = stowage_common::observe::metrics::registry("stowage-agent");
    stowage_common::api::clientmetrics::register(&registry);
    let metrics = metrics::Metrics::new(&registry);
    (registry, metrics)
}

/// Every metric family stowage-agent registers, series or not (docs/metrics.md is checked
/// against this list).
pub fn metric_families() -> Vec<stowage_common::observe::metrics::Family> {
    registry().0.families()
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // Every request says it is this binary's, whatever the executable is called.
    stowage_common::api::identity::set_component("stowage-agent");
    if args.node_name.trim().is_empty() {
        bail!("--node-name must not be empty");
    }
    #[cfg(debug_assertions)]
    panic_hook::arm(&args.debug_panic_once);
    let root = canonical_dir(&args.root_dir, "--root-dir")?;
    let image_dir = canonical_dir(&args.image_dir, "--image-dir")?;
    let endpoint = match (&args.csi_endpoint, &args.kubelet_dir) {
        (Some(e), _) => Some(socket_path(e)),
        (None, Some(k)) => Some(registration::csi_socket(k, &args.csi_driver_name)),
        (None, None) => None,
    };
    let mut csi = endpoint.clone().map(|socket| Endpoint {
        driver: args.csi_driver_name.clone(),
        socket,
        images: stowage_loopdriver::ImageStore::new(image_dir.clone()),
        node: Some(NodeSettings {
            node_id: args.node_name.clone(),
            state_dir: root.join("csi"),
            max_volumes: args.max_volumes,
            local: args.image_store_mode.is_local(),
        }),
        controller: args.csi_controller,
        // Set below: only the full agent serves a metrics endpoint.
        metrics: None,
    });
    if args.csi_only {
        let endpoint = csi.expect("clap requires --csi-endpoint with --csi-only");
        let socket = endpoint.socket.clone();
        let Some(kubelet_dir) = &args.kubelet_dir else {
            csi_server::serve(endpoint, stowage_common::runtime::shutdown::signalled()).await?;
            return Ok(());
        };
        // A node plugin beside a kubelet whose attachments come from elsewhere (the upstream
        // external-attacher): CSI and the kubelet registration, nothing else.
        let registrar = registration::Registrar {
            driver: args.csi_driver_name.clone(),
            csi_endpoint: socket,
            registered: Default::default(),
        };
        let registered = registration::serve(
            registration::registration_socket(kubelet_dir, &args.csi_driver_name),
            root.join("csi").join("registration.sock"),
            registrar,
            stowage_common::runtime::shutdown::signalled(),
        );
        let served = csi_server::serve(endpoint, stowage_common::runtime::shutdown::signalled());
        // Either failing ends the process (the kubelet must not keep a plugin that is gone).
        tokio::try_join!(registered, served)?;
        return Ok(());
    }
    let (registry, metrics) = registry();
    if let Some(e) = &mut csi {
        e.metrics = Some(metrics.csi.clone());
    }
    let health = Health::new(registry.clone());
    serve::spawn(args.metrics_bind_address, health.clone()).await?;
    let client = args
        .api
        .client(args.api.limit_or(stowage_common::api::ratelimit::Limit::Static {
            qps: stowage_common::api::client::AGENT_QPS,
            burst: args.api.kube_api_burst,
        }))
        .await?;

    // The informers' watch tasks, held so shutdown can abort them: supervision, not a bound on
    // concurrent writes (each loop bounds its own operations).
    let mut watches = JoinSet::new();
    let pods = Informer::spawn(
        client.clone(),
        watcher::Config::default().fields(&format!("spec.nodeName={}", args.node_name)),
        as_decoded,
        &mut watches,
    );
    let pvcs = Informer::spawn(
        client.clone(),
        watcher::Config::default(),
        as_decoded,
        &mut watches,
    );
    let pvs = Informer::spawn(
        client.clone(),
        watcher::Config::default(),
        as_decoded,
        &mut watches,
    );
    let vas = Informer::spawn(
        client.clone(),
        watcher::Config::default(),
        as_decoded,
        &mut watches,
    );
    let ctx = Arc::new(ctx::Ctx {
        events: Events::new(client.clone(), "stowage-agent"),
        client: client.clone(),
        node: args.node_name.clone(),
        layout: paths::Layout::new(root.clone()),
        images: stowage_loopdriver::ImageStore::new(image_dir.clone()),
        store_mode: args.image_store_mode,
        capacity_changed: Default::default(),
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
    // Supervision, not write concurrency: one task per long-lived loop; one ending is fatal.
    let mut loops = JoinSet::new();
    let grace = std::time::Duration::from_secs(args.stale_device_grace_seconds);
    loops.spawn(attacher::run(ctx.clone(), stop_rx.clone(), grace));
    loops.spawn(store::run(ctx.clone(), stop_rx.clone()));
    if args.image_store_mode.is_local() {
        loops.spawn(images::run(ctx.clone(), stop_rx.clone()));
        if let Some(ns) = args.capacity_namespace.clone().filter(|n| !n.is_empty()) {
            let classes = Informer::spawn(
                client.clone(),
                watcher::Config::default(),
                as_decoded,
                &mut watches,
            );
            // Only this node's own objects: what its plan compares with and replaces.
            let objects = Informer::<CSIStorageCapacity>::spawn_in(
                client.clone(),
                &ns,
                watcher::Config::default().labels(&capacity::selector(&ctx.node)),
                as_decoded,
                &mut watches,
            );
            tokio::join!(classes.ready(), objects.ready());
            let nudge = ctx.capacity_changed.clone();
            // A class added or removed, or an object changed by someone else, changes what is
            // to be written.
            loops.spawn(wake_on(classes.feed(), nudge.clone(), stop_rx.clone()));
            loops.spawn(wake_on(objects.feed(), nudge.clone(), stop_rx.clone()));
            loops.spawn(capacity::run(
                ctx.clone(),
                ns,
                classes.store().clone(),
                objects.store().clone(),
                nudge,
                stop_rx.clone(),
            ));
        }
    }
    if args.kubelet_dir.is_none() {
        // Without a kubelet the agent is the node's volume manager and reports volumesInUse.
        loops.spawn(node::run(
            ctx.clone(),
            args.register_node,
            in_use_rx,
            reported_tx,
            stop_rx.clone(),
        ));
        // Its own Node: the volume manager mounts only what `status.volumesAttached` lists.
        let node = Informer::spawn(
            client.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", args.node_name)),
            as_decoded,
            &mut watches,
        );
        loops.spawn(volumes::run(
            ctx.clone(),
            volumes::NodeLink {
                in_use: in_use_tx,
                reported: reported_rx,
                node,
            },
            stop_rx,
        ));
    }
    // Supervision too: the CSI server and the kubelet registration; one ending is fatal.
    let mut csi_task = JoinSet::new();
    if let Some(endpoint) = csi {
        let mut stop = stop_tx.subscribe();
        csi_task.spawn(csi_server::serve(endpoint, async move {
            let _ = stop.wait_for(|s| *s).await;
        }));
    }
    if let (Some(kubelet_dir), Some(csi_endpoint)) = (&args.kubelet_dir, endpoint) {
        let mut stop = stop_tx.subscribe();
        let registrar = registration::Registrar {
            driver: args.csi_driver_name.clone(),
            csi_endpoint,
            registered: Default::default(),
        };
        csi_task.spawn(registration::serve(
            registration::registration_socket(kubelet_dir, &args.csi_driver_name),
            root.join("csi").join("registration.sock"),
            registrar,
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        ));
    }
    health.ready.store(true, Ordering::Relaxed);
    tracing::info!(node = %args.node_name, root = %root.display(), "agent started");

    tokio::select! {
        _ = stowage_common::runtime::shutdown::signalled() => {}
        r = loops.join_next() => {
            health.alive.store(false, Ordering::Relaxed);
            bail!("an agent loop ended unexpectedly: {r:?}");
        }
        Some(r) = csi_task.join_next() => {
            health.alive.store(false, Ordering::Relaxed);
            bail!("the CSI server ended unexpectedly: {r:?}");
        }
    }
    // Mounts stay as they are (a restart must not disturb running pods); only operations in
    // flight are allowed to finish.
    let _ = stop_tx.send(true);
    while loops.join_next().await.is_some() {}
    while csi_task.join_next().await.is_some() {}
    watches.abort_all();
    Ok(())
}
