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

mod bundle;
mod hostcheck;
mod settle;
mod setup;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::{Client, ResourceExt};
use stowage_testkit::ControlPlane;

use crate::bundle::{bundle, dump, scan_logs};
use crate::cluster::{CONTROLLER_SA, LEASE, LEASE_NS, Procs, Role, Roots};
use crate::faults::Faults;
use crate::host::ImageStore;
use crate::hostcheck::check_host;
use crate::observer::Observer;
use crate::report::{Record, Summary};
use crate::rng::Rng;
use crate::settle::{clean_up_and_check_leaks, quiesce};
use crate::setup::{TICKER, setup_objects, ticker};
use crate::workload::Ctx;

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
    let previous_hook = catch_panics();
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
    let _ = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| previous_hook(info)));
    let panics = std::mem::take(&mut *PANICS.lock().unwrap_or_else(|p| p.into_inner()));
    for (i, p) in panics.into_iter().enumerate() {
        record.violation(&format!("soak-panic:{i}"), "panic in the soak itself", p);
    }
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

/// Panics of this run's own threads and tasks: a spawned task that panics just stops (a check
/// that stops running, a verifier that never reports), so each one fails the run.
static PANICS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

type PanicHook = Arc<dyn Fn(&std::panic::PanicHookInfo<'_>) + Send + Sync>;

/// Installs a hook that collects panics into [`PANICS`] (then runs the previous hook, which
/// prints them); returns the previous hook to put back.
fn catch_panics() -> PanicHook {
    let previous: PanicHook = Arc::from(std::panic::take_hook());
    let chained = previous.clone();
    std::panic::set_hook(Box::new(move |info| {
        // try_lock: a hook must never block a panicking thread.
        if let Ok(mut p) = PANICS.try_lock() {
            p.push(info.to_string());
        }
        chained(info);
    }));
    previous
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
    // The install step that marks the shared store as the image store (controllers refuse to
    // create or delete images in a directory without its marker).
    let out = std::process::Command::new(&controller_bin)
        .arg("init-image-store")
        .arg(&images)
        .output()
        .context("stowage-controller init-image-store")?;
    anyhow::ensure!(
        out.status.success(),
        "stowage-controller init-image-store failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
        fenced: Default::default(),
    });
    env.ctx = Some(ctx.clone());
    env.tasks
        .push(tokio::spawn(workload::external_provisioner(ctx.clone())));
    env.tasks
        .push(tokio::spawn(workload::follow_expansions(ctx.clone())));
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
        let (record, roots, images, fenced) =
            (record.clone(), roots.clone(), images.clone(), ctx.fenced.clone());
        env.tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let (record, roots, images, fenced) =
                    (record.clone(), roots.clone(), images.clone(), fenced.clone());
                // losetup and the mount table are blocking reads.
                let _ =
                    tokio::task::spawn_blocking(move || check_host(&record, &roots, &images, &fenced)).await;
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

    quiesce(opts, &ctx, &faults, &images).await;
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
    check_host(&record, &roots, &images, &ctx.fenced);
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

pub(crate) async fn wait_for<F, Fut>(limit: Duration, what: &str, mut ok: F) -> anyhow::Result<()>
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
