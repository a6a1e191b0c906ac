//! `make soak`: churn on the real control plane while the leader, the agents, kube-apiserver and
//! etcd are killed, the image store stalls and the API is squeezed, with an observer checking the
//! storage invariants all along and a leak check after quiescence. See docs/development.md.

pub mod cluster;
pub mod faults;
pub mod host;
pub mod observer;
pub mod report;
pub mod rng;
pub mod workload;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use stowage_testkit::ControlPlane;
use stowage_testkit::builders;

use crate::cluster::{CONTROLLER_SA, LEASE, LEASE_NS, Procs, Role, Roots};
use crate::faults::Faults;
use crate::host::ImageStore;
use crate::observer::Observer;
use crate::report::{Record, Summary};
use crate::rng::Rng;
use crate::workload::{CLASSES, Ctx, EXT_DRIVER, LOOP_DRIVER, NS};

#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    /// How long the workload and the faults run (quiescence and the end checks come after).
    pub duration: Duration,
    pub controllers: usize,
    pub agents: usize,
    /// Live claims at most.
    pub max_claims: usize,
    /// Seconds between faults (uniform in this range).
    pub fault_gap: (u64, u64),
    /// Bound on each wait after the churn (quiescence, clean-up): a broken run ends, it does not
    /// hang. Never a speed claim.
    pub settle_limit: Duration,
    /// Where a failing run's bundle goes.
    pub results: PathBuf,
    /// Leave the bundle for a passing run too.
    pub keep: bool,
}

impl Options {
    /// The profile for a duration: short runs use shorter gaps so every fault kind comes up.
    pub fn profile(seed: u64, duration: Duration, results: PathBuf) -> Self {
        let short = duration <= Duration::from_secs(300);
        Self {
            seed,
            duration,
            controllers: 3,
            agents: 2,
            max_claims: if short { 8 } else { 12 },
            fault_gap: if short { (5, 10) } else { (10, 30) },
            settle_limit: Duration::from_secs(600),
            results,
            keep: false,
        }
    }
}

const TICKER: &str = "soak-ticker";

/// Runs one soak and returns its summary; never panics on a finding (they are in the summary).
pub async fn run(opts: Options) -> Summary {
    let tmp = match tempfile::Builder::new().prefix("stowage-soak-").tempdir() {
        Ok(t) => t,
        Err(e) => return failed_early(&opts, format!("temporary dir: {e}")),
    };
    let dir = std::fs::canonicalize(tmp.path()).unwrap_or_else(|_| tmp.path().to_path_buf());
    let record = match Record::new(&dir) {
        Ok(r) => Arc::new(r),
        Err(e) => return failed_early(&opts, format!("timeline: {e}")),
    };
    let mut env = Env::default();
    // Ctrl-C or SIGTERM ends the run early, through the same tear-down.
    let interrupted = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    let outcome = tokio::select! {
        r = drive(&opts, &dir, record.clone(), &mut env) => r,
        _ = interrupted => Err(anyhow::anyhow!("interrupted")),
    };
    // Tear down whatever happened: processes first, then the host state of this run only.
    if let Some(ctx) = &env.ctx {
        ctx.stopping.store(true, Ordering::Relaxed);
    }
    for t in env.tasks.drain(..) {
        t.abort();
    }
    if let Some(p) = &env.procs {
        p.stop_all();
    }
    if let Some(cp) = env.cp.take() {
        let _ = tokio::task::spawn_blocking(move || drop(cp)).await;
    }
    if let Some(store) = &env.store {
        store.thaw().ok();
        host::unmount_all_under(&dir, &store.dir);
        store.teardown();
    }
    host::unmount_all_under(&dir, Path::new("/nonexistent"));
    record.close_timeline();
    let counters = record.snapshot();
    let mut summary = Summary {
        seed: opts.seed,
        churn_seconds: opts.duration.as_secs(),
        total_seconds: record.elapsed(),
        controllers: opts.controllers,
        agents: opts.agents,
        counters,
        bundle: None,
        error: outcome.err().map(|e| format!("{e:#}")),
    };
    if !summary.passed() || opts.keep {
        match bundle(&opts, &dir, &summary) {
            Ok(b) => summary.bundle = Some(b),
            Err(e) => eprintln!("soak: could not write the bundle: {e:#}"),
        }
    }
    drop(tmp);
    summary
}

fn failed_early(opts: &Options, error: String) -> Summary {
    Summary {
        seed: opts.seed,
        churn_seconds: opts.duration.as_secs(),
        total_seconds: 0.0,
        controllers: opts.controllers,
        agents: opts.agents,
        counters: Default::default(),
        bundle: None,
        error: Some(error),
    }
}

/// What has been started, for the tear-down.
#[derive(Default)]
struct Env {
    cp: Option<Arc<ControlPlane>>,
    store: Option<Arc<ImageStore>>,
    procs: Option<Arc<Procs>>,
    ctx: Option<Arc<Ctx>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn drive(opts: &Options, dir: &Path, record: Arc<Record>, env: &mut Env) -> anyhow::Result<()> {
    let store = Arc::new(ImageStore::create(dir, "4G").context("image store")?);
    env.store = Some(store.clone());
    let images = store.dir.clone();
    let cp_dir = dir.join("cp");
    let cp = Arc::new(
        tokio::task::spawn_blocking(move || ControlPlane::start_in(cp_dir, None))
            .await?
            .context("control plane")?,
    );
    env.cp = Some(cp.clone());
    let client = cp.client().await;
    record.log("setup", serde_json::json!({"apiserver": cp.url(), "dir": dir}));

    let observer = Observer::new(record.clone());
    env.tasks.extend(observer.spawn(client.clone()));
    wait_for(Duration::from_secs(120), "the observer's first lists", || async {
        observer.synced()
    })
    .await?;

    setup_objects(&client).await?;
    let sa_kubeconfig = cp
        .service_account_kubeconfig(CONTROLLER_SA.0, CONTROLLER_SA.1)
        .await?;

    let log_dir = dir.join("logs");
    std::fs::create_dir_all(&log_dir)?;
    let procs = Procs::new(log_dir.clone(), record.clone());
    env.procs = Some(procs.clone());
    let (controller_bin, agent_bin) = tokio::task::spawn_blocking(cluster::binaries).await?;
    for i in 0..opts.controllers {
        let id = format!("controller-{}", (b'a' + i as u8) as char);
        procs.add(
            &id,
            Role::Controller,
            controller_bin.clone(),
            vec![
                format!("--kubeconfig={}", sa_kubeconfig.display()),
                format!("--leader-elect-resource-namespace={LEASE_NS}"),
                format!("--leader-elect-resource-name={LEASE}"),
                format!("--leader-elect-identity={id}"),
                // Short terms so a killed leader is replaced within seconds.
                "--leader-elect-lease-duration=4s".into(),
                "--leader-elect-renew-deadline=3s".into(),
                "--leader-elect-retry-period=1s".into(),
                format!("--image-dir={}", images.display()),
            ],
        )?;
    }
    let mut roots = Roots::new();
    for i in 0..opts.agents {
        let node = format!("soak-node-{}", (b'a' + i as u8) as char);
        let root = dir.join(&node);
        std::fs::create_dir_all(&root)?;
        procs.add(
            &node,
            Role::Agent,
            agent_bin.clone(),
            vec![
                format!("--kubeconfig={}", cp.kubeconfig().display()),
                format!("--node-name={node}"),
                format!("--root-dir={}", root.display()),
                format!("--image-dir={}", images.display()),
                "--register-node".into(),
            ],
        )?;
        roots.insert(node, root);
    }
    {
        let procs = procs.clone();
        env.tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let p = procs.clone();
                let _ = tokio::task::spawn_blocking(move || p.supervise()).await;
            }
        }));
    }
    {
        let client = client.clone();
        let nodes: Vec<String> = roots.keys().cloned().collect();
        wait_for(Duration::from_secs(180), "a leader and every node", || {
            let (client, nodes) = (client.clone(), nodes.clone());
            async move {
                let api: Api<Node> = Api::all(client.clone());
                let mut ok = cluster::leader(&client).await.is_some();
                for n in &nodes {
                    ok &= api.get(n).await.is_ok();
                }
                ok
            }
        })
        .await?;
    }
    record.log("ready", serde_json::json!({}));

    let ctx = Arc::new(Ctx {
        client: client.clone(),
        record: record.clone(),
        procs: procs.clone(),
        seed: opts.seed,
        roots: roots.clone(),
        world: Default::default(),
        max_claims: opts.max_claims,
        stopping: Default::default(),
        followups: Default::default(),
    });
    env.ctx = Some(ctx.clone());
    env.tasks
        .push(tokio::spawn(workload::external_provisioner(ctx.clone())));
    env.tasks.push(tokio::spawn(ticker(client.clone())));
    {
        let observer = observer.clone();
        env.tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                observer.judge();
            }
        }));
    }
    {
        let (record, roots) = (record.clone(), roots.clone());
        env.tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                check_device_mounts(&record, &roots);
            }
        }));
    }

    // The churn.
    let root_rng = Rng::new(opts.seed);
    let until = tokio::time::Instant::now() + opts.duration;
    let neighbour = {
        let kc = kube::config::Kubeconfig::read_from(&sa_kubeconfig)?;
        Client::try_from(kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?)?
    };
    let faults = Faults {
        neighbour,
        ctx: ctx.clone(),
        cp: cp.clone(),
        store: store.clone(),
    };
    let work = tokio::spawn(workload::run(ctx.clone(), root_rng.fork(1), until));
    faults.run(root_rng.fork(2), until, opts.fault_gap).await;
    work.await?;
    record.log("churn-over", serde_json::json!({}));

    quiesce(opts, &ctx, &faults).await;
    dump(&client, &dir.join("dumps-quiesced")).await;
    clean_up_and_check_leaks(opts, &ctx, &observer, &images).await;
    dump(&client, &dir.join("dumps-final")).await;

    // The last judgement: the tickers move every watch past everything that happened.
    let target = {
        let api: Api<Node> = Api::all(client.clone());
        api.get(TICKER)
            .await
            .ok()
            .and_then(|n| n.resource_version())
            .and_then(|r| r.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let _ = wait_for(Duration::from_secs(60), "the watches to catch up", || async {
        observer.frontier() > target
    })
    .await;
    observer.judge();
    check_device_mounts(&record, &roots);
    if let Ok(lease) = Api::<Lease>::namespaced(client.clone(), LEASE_NS)
        .get(LEASE)
        .await
    {
        let n = lease.spec.and_then(|s| s.lease_transitions).unwrap_or(0);
        record.lease_transitions(u64::try_from(n).unwrap_or(0));
    }
    scan_logs(&record, &[log_dir, dir.join("cp")]);
    Ok(())
}

async fn wait_for<F, Fut>(limit: Duration, what: &str, mut ok: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if ok().await {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("gave up waiting for {what} after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The namespace, drivers, classes and the ticker objects.
async fn setup_objects(client: &Client) -> anyhow::Result<()> {
    let pp = PostParams::default();
    for ns in [NS, TICKER] {
        let (n, sa) = builders::namespace(ns);
        Api::<Namespace>::all(client.clone()).create(&pp, &n).await?;
        Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .create(&pp, &sa)
            .await?;
    }
    let drivers: Api<CSIDriver> = Api::all(client.clone());
    drivers
        .create(&pp, &builders::csi_driver(LOOP_DRIVER, true))
        .await?;
    // Nothing attaches the external driver's volumes here; pods of it are objects only.
    drivers
        .create(&pp, &builders::csi_driver(EXT_DRIVER, false))
        .await?;
    let classes: Api<StorageClass> = Api::all(client.clone());
    for c in &CLASSES {
        let mut b = builders::storage_class(c.name, if c.looped { LOOP_DRIVER } else { EXT_DRIVER })
            .reclaim(if c.retain { "Retain" } else { "Delete" })
            .allow_expansion(c.looped);
        if c.wffc {
            b = b.wait_for_first_consumer();
        }
        classes.create(&pp, &b.build()).await?;
    }
    // Objects patched every second so each watch keeps moving even when nothing else changes:
    // the observer judges cross-kind invariants only up to what every watch has delivered.
    Api::<Node>::all(client.clone())
        .create(&pp, &builders::node(TICKER).build())
        .await?;
    Api::<PersistentVolume>::all(client.clone())
        .create(
            &pp,
            &builders::pv(TICKER)
                .class("soak-ticker-volume")
                .driver("ticker.soak.stowage.dev", TICKER)
                .build(),
        )
        .await?;
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), TICKER)
        .create(
            &pp,
            &builders::pvc(TICKER, TICKER).class("soak-ticker-claim").build(),
        )
        .await?;
    Ok(())
}

async fn ticker(client: Client) {
    let mut n = 0u64;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        n += 1;
        let patch =
            serde_json::json!({"metadata": {"annotations": {"soak.stowage.dev/tick": n.to_string()}}});
        let pp = PatchParams::default();
        let _ = Api::<Node>::all(client.clone())
            .patch(TICKER, &pp, &Patch::Merge(&patch))
            .await;
        let _ = Api::<PersistentVolume>::all(client.clone())
            .patch(TICKER, &pp, &Patch::Merge(&patch))
            .await;
        let _ = Api::<PersistentVolumeClaim>::namespaced(client.clone(), TICKER)
            .patch(TICKER, &pp, &Patch::Merge(&patch))
            .await;
    }
}

/// No volume's device is mounted under two nodes' directories at once (one kernel here plays
/// both nodes, so this is what "two writers" looks like on the host).
fn check_device_mounts(record: &Record, roots: &Roots) {
    let mut by_volume: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (node, root) in roots {
        let global = root.join("plugins").join(LOOP_DRIVER).join("globalmount");
        for m in host::mounts_under(&global).unwrap_or_default() {
            if let Some(pv) = m.target.file_name() {
                by_volume
                    .entry(pv.to_string_lossy().into_owned())
                    .or_default()
                    .insert(node.clone());
            }
        }
    }
    record.checks("single-writer-mount", 1);
    for (pv, nodes) in by_volume {
        if nodes.len() > 1 {
            record.violation(
                &format!("mount2:{pv}:{nodes:?}"),
                "volume mounted on two nodes",
                format!("{pv} has device mounts under {nodes:?}"),
            );
        }
    }
}

/// After the churn: every node back, nothing paused or squeezed, every process up; then every
/// claim that should be Bound is, and every pod's volume was mounted and its data checked.
async fn quiesce(opts: &Options, ctx: &Arc<Ctx>, faults: &Faults) {
    let record = &ctx.record;
    let followups: Vec<_> = std::mem::take(&mut *ctx.followups.lock().unwrap_or_else(|p| p.into_inner()));
    for f in followups {
        let _ = tokio::time::timeout(opts.settle_limit, f).await;
    }
    faults.thaw().await;
    faults::release(&ctx.client).await;
    let deadline = tokio::time::Instant::now() + opts.settle_limit;
    let procs = ctx.procs.clone();
    let _ = wait_for(opts.settle_limit, "every process up", || {
        let p = procs.clone();
        async move { p.all_up() }
    })
    .await;
    record.log("quiescing", serde_json::json!({}));
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), NS);
    loop {
        let phases: BTreeMap<String, String> = match claims.list(&ListParams::default()).await {
            Ok(l) => l
                .items
                .iter()
                .map(|c| {
                    (
                        c.name_any(),
                        c.status
                            .as_ref()
                            .and_then(|s| s.phase.clone())
                            .unwrap_or_default(),
                    )
                })
                .collect(),
            Err(_) => {
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let (unbound, unverified) = {
            let w = ctx.world();
            let unbound: Vec<String> = w
                .claims
                .iter()
                .filter(|(_, c)| !CLASSES[c.class].wffc || c.selected_node.is_some())
                .filter(|(n, _)| phases.get(*n).map(String::as_str) != Some("Bound"))
                .map(|(n, _)| n.clone())
                .collect();
            let unverified: Vec<String> = w
                .claims
                .iter()
                .filter(|(_, c)| c.pod.as_ref().is_some_and(|p| !p.verified))
                .map(|(n, c)| {
                    format!(
                        "{n} (pod {} on {})",
                        c.pod.as_ref().map(|p| p.name.as_str()).unwrap_or(""),
                        c.pod.as_ref().map(|p| p.node.as_str()).unwrap_or("")
                    )
                })
                .collect();
            (unbound, unverified)
        };
        if unbound.is_empty() && unverified.is_empty() {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            for c in unbound {
                record.violation(
                    &format!("unbound:{c}"),
                    "claim not Bound after quiescence",
                    format!("{c} is {:?} after {:?}", phases.get(&c), opts.settle_limit),
                );
            }
            for c in unverified {
                record.violation(
                    &format!("unmounted:{c}"),
                    "pod volume not mounted after quiescence",
                    c,
                );
            }
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let n = ctx.world().claims.len() as u64;
    record.checks("bound-after-quiescence", n);
    record.log("quiesced", serde_json::json!({}));
}

/// Deletes every pod and claim, then checks what is left: Delete volumes leave no PV, image,
/// attachment or loop device; Retain volumes keep their image; no mount or loop device of this
/// run remains.
async fn clean_up_and_check_leaks(opts: &Options, ctx: &Arc<Ctx>, observer: &Observer, images: &Path) {
    let record = &ctx.record;
    ctx.stopping.store(true, Ordering::Relaxed);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), NS);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), NS);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let _ = pods.delete_collection(&now, &ListParams::default()).await;
    let _ = claims
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    {
        let mut w = ctx.world();
        let left: Vec<_> = std::mem::take(&mut w.claims).into_iter().collect();
        for (name, c) in left {
            w.deleted.push(workload::Deleted {
                name,
                uid: c.uid,
                class: c.class,
            });
        }
    }
    record.log("cleaning-up", serde_json::json!({}));
    let deleted = ctx.world().deleted.clone();
    let deadline = tokio::time::Instant::now() + opts.settle_limit;
    let leaks = loop {
        let leaks = find_leaks(ctx, observer, images, &deleted).await;
        if leaks.is_empty() || tokio::time::Instant::now() > deadline {
            break leaks;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    record.checks("no-leak-after-quiescence", deleted.len() as u64);
    for (what, detail) in leaks {
        record.leak(&what, detail);
    }
    // Retained volumes keep their PV (Released) and their image.
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    for d in deleted.iter().filter(|d| CLASSES[d.class].retain) {
        let pv = format!("pvc-{}", d.uid);
        let Some(unique) = observer.unique_of(&pv) else {
            continue; // never provisioned (deleted first)
        };
        record.checks("retain-keeps-data", 1);
        if pvs.get(&pv).await.is_err() {
            record.violation(
                &format!("retain-pv:{pv}"),
                "retained volume deleted",
                format!(
                    "{pv} of claim {} (class {}) is gone",
                    d.name, CLASSES[d.class].name
                ),
            );
        }
        if CLASSES[d.class].looped {
            let handle = unique.split('^').nth(1).unwrap_or_default();
            if !images.join(format!("{handle}.img")).exists() {
                record.violation(
                    &format!("retain-img:{pv}"),
                    "retained image deleted",
                    format!("{handle}.img of {pv} (claim {}) is gone", d.name),
                );
            }
        }
    }
}

async fn find_leaks(
    ctx: &Ctx,
    observer: &Observer,
    images: &Path,
    deleted: &[workload::Deleted],
) -> Vec<(String, String)> {
    let mut leaks = Vec::new();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), NS);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), NS);
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let vas: Api<VolumeAttachment> = Api::all(ctx.client.clone());
    match pods.list(&ListParams::default()).await {
        Ok(l) => leaks.extend(l.items.iter().map(|p| ("pod left".to_string(), p.name_any()))),
        Err(e) => leaks.push(("api".into(), e.to_string())),
    }
    match claims.list(&ListParams::default()).await {
        Ok(l) => leaks.extend(l.items.iter().map(|c| ("claim left".to_string(), c.name_any()))),
        Err(e) => leaks.push(("api".into(), e.to_string())),
    }
    match vas.list(&ListParams::default()).await {
        Ok(l) => leaks.extend(l.items.iter().map(|v| {
            (
                "VolumeAttachment left".to_string(),
                format!(
                    "{} ({:?} on {})",
                    v.name_any(),
                    v.spec.source.persistent_volume_name,
                    v.spec.node_name
                ),
            )
        })),
        Err(e) => leaks.push(("api".into(), e.to_string())),
    }
    for d in deleted.iter().filter(|d| !CLASSES[d.class].retain) {
        let pv = format!("pvc-{}", d.uid);
        match pvs.get(&pv).await {
            Ok(_) => leaks.push((
                "PV of a deleted Delete claim left".into(),
                format!("{pv} (claim {})", d.name),
            )),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => leaks.push(("api".into(), e.to_string())),
        }
        if CLASSES[d.class].looped
            && let Some(unique) = observer.unique_of(&pv)
        {
            let handle = unique.split('^').nth(1).unwrap_or_default().to_string();
            if images.join(format!("{handle}.img")).exists() {
                leaks.push((
                    "image of a deleted Delete volume left".into(),
                    format!("{handle}.img ({pv}, claim {})", d.name),
                ));
            }
        }
    }
    for root in ctx.roots.values() {
        for m in host::mounts_under(root).unwrap_or_default() {
            leaks.push((
                "mount left".into(),
                format!("{} ({})", m.target.display(), m.source),
            ));
        }
    }
    for (dev, file) in host::loops_backed_under(images) {
        leaks.push(("loop device left".into(), format!("{dev} -> {file}")));
    }
    leaks
}

/// A panic in any controller or agent log is a violation (they must turn bad input into Events
/// and retries, never panic).
fn scan_logs(record: &Record, dirs: &[PathBuf]) {
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(d) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !(name.starts_with("controller-") || name.starts_with("soak-node-")) {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            record.checks("no-panic-in-logs", 1);
            for (i, line) in text.lines().enumerate() {
                if line.contains("panicked at") || line.contains("RUST_BACKTRACE") {
                    record.violation(
                        &format!("panic:{name}:{i}"),
                        "panic in a log",
                        format!("{name}:{}: {line}", i + 1),
                    );
                }
            }
        }
    }
}

/// Object dumps (JSON) for the bundle.
async fn dump(client: &Client, to: &Path) {
    let _ = std::fs::create_dir_all(to);
    let lp = ListParams::default();
    macro_rules! put {
        ($file:literal, $api:expr) => {
            let text = match $api.list(&lp).await {
                Ok(l) => serde_json::to_string_pretty(&l.items).unwrap_or_default(),
                Err(e) => format!("{{\"error\": {:?}}}", e.to_string()),
            };
            let _ = std::fs::write(to.join($file), text);
        };
    }
    put!(
        "persistentvolumes.json",
        Api::<PersistentVolume>::all(client.clone())
    );
    put!(
        "persistentvolumeclaims.json",
        Api::<PersistentVolumeClaim>::all(client.clone())
    );
    put!(
        "volumeattachments.json",
        Api::<VolumeAttachment>::all(client.clone())
    );
    put!("nodes.json", Api::<Node>::all(client.clone()));
    put!("pods.json", Api::<Pod>::all(client.clone()));
    put!("events.json", Api::<KubeEvent>::all(client.clone()));
    put!("leases.json", Api::<Lease>::all(client.clone()));
}

/// Copies logs, dumps and the timeline into `<results>/soak-<seed>-<unix time>/`.
fn bundle(opts: &Options, dir: &Path, summary: &Summary) -> anyhow::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let out = opts.results.join(format!("soak-{}-{stamp}", opts.seed));
    std::fs::create_dir_all(out.join("logs"))?;
    let copy_dir = |from: &Path, to: &Path, only_logs: bool| {
        let _ = std::fs::create_dir_all(to);
        if let Ok(rd) = std::fs::read_dir(from) {
            for e in rd.flatten() {
                let name = e.file_name();
                let n = name.to_string_lossy();
                if e.path().is_file() && (!only_logs || n.ends_with(".log")) {
                    let _ = std::fs::copy(e.path(), to.join(&name));
                }
            }
        }
    };
    copy_dir(&dir.join("logs"), &out.join("logs"), true);
    copy_dir(&dir.join("cp"), &out.join("logs"), true);
    copy_dir(&dir.join("dumps-quiesced"), &out.join("dumps-quiesced"), false);
    copy_dir(&dir.join("dumps-final"), &out.join("dumps-final"), false);
    let _ = std::fs::copy(dir.join("timeline.jsonl"), out.join("timeline.jsonl"));
    std::fs::write(out.join("summary.txt"), summary.render())?;
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(summary)?)?;
    Ok(out)
}
