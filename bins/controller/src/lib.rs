//! `stowage-controller`: one leader-elected process that runs the selected storage controllers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Parser;
use kube::Client;
use stowage_common::api::client::ApiArgs;
use stowage_common::api::ratelimit::{Adaptive, Limit};
use stowage_common::observe::metrics::Registry;
use stowage_common::observe::serve::{self, Health};
use stowage_common::runtime::leader::{self, Elector, Timings};
use stowage_common::store::informers::Informers;
use tokio::sync::watch;
use tokio::task::JoinSet;

pub mod rival;

/// Every controller this binary knows, in start order, and whether `*` turns it on.
pub const CONTROLLERS: &[(&str, bool)] = &[
    ("binder", true),
    ("pv-protection", true),
    ("pvc-protection", true),
    ("attachdetach", true),
    ("expand", true),
];

#[derive(Debug, Clone, Parser)]
#[command(
    name = "stowage-controller",
    version,
    about = "Kubernetes storage controllers: PV/PVC binder, attach/detach, expansion."
)]
pub struct Args {
    #[command(flatten)]
    pub api: ApiArgs,
    /// Used when --kube-api-qps is not given: the rate ceiling of the adaptive limiter, whose
    /// window of requests in flight halves when the apiserver answers 429 and grows while healthy.
    #[arg(long, default_value_t = 2000.0)]
    pub kube_api_max_qps: f32,
    #[command(flatten)]
    pub log: stowage_common::observe::logging::LogArgs,
    /// Controllers to run: names, `*` for all default ones, `-name` to leave one out
    /// (kube-controller-manager's syntax).
    #[arg(long, value_delimiter = ',', default_value = "*")]
    pub controllers: Vec<String>,
    /// Plain-HTTP address for /metrics, /healthz and /readyz; `0` turns it off (with
    /// --secure-port serving them instead).
    #[arg(long, default_value = "0.0.0.0:8080", value_parser = plain_address)]
    pub metrics_bind_address: PlainAddress,
    #[command(flatten)]
    pub secure: stowage_common::observe::secure::SecureArgs,
    /// Run controllers only while holding the leader Lease.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// How long a standby waits after the last observed renewal before taking over.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub leader_elect_lease_duration: Duration,
    /// How long the leader keeps trying to renew before it stops its controllers.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub leader_elect_renew_deadline: Duration,
    /// Time between acquire or renew attempts.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub leader_elect_retry_period: Duration,
    /// The lock kind: kube-controller-manager's flag, whose only value since v1.28 is `leases`.
    #[arg(long, value_enum, default_value_t = ResourceLock::Leases)]
    pub leader_elect_resource_lock: ResourceLock,
    /// Name of the Lease object.
    #[arg(long, default_value = "stowage-controller")]
    pub leader_elect_resource_name: String,
    /// Namespace of the Lease object.
    #[arg(long, default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,
    /// Identity written into the Lease (default: hostname and a random suffix).
    #[arg(long)]
    pub leader_elect_identity: Option<String>,
    /// Fill the caches while standing by (lists and watches: reads only, no writes before the
    /// lease is ours), so a takeover does not wait for the lists of every object; `false` lists
    /// only on becoming leader, as kube-controller-manager does.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub warm_standby: bool,
    /// Directory of the built-in driver's image files (shared mode: the store every agent mounts
    /// too; unused in local mode).
    #[arg(long, default_value = "/var/lib/stowage/images")]
    pub image_dir: std::path::PathBuf,
    /// `local`: each node has its own image store; volumes are provisioned for the node the
    /// scheduler selected, pinned to it, and that node's agent makes, grows and deletes their
    /// images (this process needs no store). `shared`: one store this process mounts as well.
    #[arg(long, default_value_t = stowage_loopdriver::StoreMode::Shared)]
    pub image_store_mode: stowage_loopdriver::StoreMode,
    /// Period of the binder's full resync (kube-controller-manager's --pvclaimbinder-sync-period).
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub pvclaimbinder_sync_period: Duration,
    /// Objects whose binder writes may be in flight at once; 0 sizes it from the client's rate
    /// (--kube-api-qps, else --kube-api-max-qps) as rate/8 within 2-64: 64 at the defaults.
    #[arg(long, default_value_t = 0)]
    pub binder_max_in_flight: usize,
    /// VolumeAttachment creates (and, separately, detaches) attachdetach runs at once; 0 sizes
    /// it from the client's rate as rate/4 within 32-256: 256 at the defaults.
    #[arg(long, default_value_t = 0)]
    pub attachdetach_max_in_flight: usize,
    /// How long a detach waits for a not-Ready node to unmount before it is forced.
    #[arg(long, default_value = "6m", value_parser = humantime::parse_duration)]
    pub max_wait_for_unmount: Duration,
    /// Never force a detach because --max-wait-for-unmount passed (the out-of-service taint and
    /// deleted nodes still detach at once).
    #[arg(long, default_value_t = false)]
    pub disable_force_detach_on_timeout: bool,
    /// What to do when kube-controller-manager is seen running a storage controller stowage runs
    /// too (its writes to their objects, or its pod's --controllers): `warn` reports it (Event,
    /// metric, log), `pause` also stops stowage's controllers until it is over, `ignore` does
    /// not look.
    #[arg(long, value_enum, default_value_t = OnConflict::Warn)]
    pub on_conflict: OnConflict,
    /// A conflict seen only through writes is over this long after the last one.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub conflict_quiet_period: Duration,
}

/// The plain metrics address, or none (`0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlainAddress(pub Option<SocketAddr>);

fn plain_address(s: &str) -> Result<PlainAddress, String> {
    match s {
        "0" | "" => Ok(PlainAddress(None)),
        a => a
            .parse()
            .map(|a| PlainAddress(Some(a)))
            .map_err(|e| format!("{e}: an address:port, or 0 for none")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnConflict {
    Ignore,
    Warn,
    Pause,
}

/// The leader-election locks there are: only Leases (Endpoints and ConfigMaps locks are gone
/// upstream too), so a command line naming another fails at start with the one that works.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ResourceLock {
    Leases,
}

impl Args {
    /// The client limit: the fixed bucket the flags give, else the adaptive one.
    pub fn limit(&self) -> Limit {
        self.api.limit_or(Limit::Adaptive(Adaptive {
            max_qps: self.kube_api_max_qps.max(1.0),
            ..ADAPTIVE_WINDOW
        }))
    }
}

/// The adaptive window: 32 requests in flight reach this 2-core machine's write floor (the bench
/// measured the floor at 16-64); 512 leaves room on large apiservers; 1 keeps progress while the
/// apiserver sheds load.
const ADAPTIVE_WINDOW: Adaptive = Adaptive {
    start: 32.0,
    min: 1.0,
    max: 512.0,
    max_qps: 2000.0,
};

/// The selected controllers' metrics and settings, made once per process (metrics must be
/// registered once, however often leadership comes and goes).
#[derive(Clone)]
struct Wiring {
    binder: (stowage_binder::Metrics, stowage_binder::Config),
    protection: stowage_protection::Metrics,
    attachdetach: (stowage_attachdetach::Metrics, stowage_attachdetach::Config),
    expand: (stowage_expand::Metrics, stowage_expand::Config),
    rival: rival::Metrics,
    on_conflict: OnConflict,
    quiet: Duration,
}

impl Wiring {
    fn new(args: &Args, registry: &Registry) -> Self {
        let qps = args.limit().nominal_qps();
        Self {
            binder: (
                stowage_binder::Metrics::new(registry),
                stowage_binder::Config {
                    resync: args.pvclaimbinder_sync_period,
                    image_dir: args.image_dir.clone(),
                    store_mode: args.image_store_mode,
                    max_in_flight: match args.binder_max_in_flight {
                        0 => auto_in_flight(qps),
                        n => n,
                    },
                },
            ),
            protection: stowage_protection::Metrics::new(registry),
            attachdetach: (
                stowage_attachdetach::Metrics::new(registry),
                stowage_attachdetach::Config {
                    max_attaches_in_flight: match args.attachdetach_max_in_flight {
                        0 => auto_attach_in_flight(qps),
                        n => n,
                    },
                    max_detaches_in_flight: match args.attachdetach_max_in_flight {
                        0 => auto_attach_in_flight(qps),
                        n => n,
                    },
                    max_wait_for_unmount: args.max_wait_for_unmount,
                    disable_force_detach_on_timeout: args.disable_force_detach_on_timeout,
                    ..Default::default()
                },
            ),
            expand: (
                stowage_expand::Metrics::new(registry),
                stowage_expand::Config {
                    image_dir: args.image_dir.clone(),
                    ..Default::default()
                },
            ),
            rival: rival::Metrics::new(registry),
            on_conflict: args.on_conflict,
            quiet: args.conflict_quiet_period,
        }
    }
}

/// kube-controller-manager's names for the same controllers (v1.36's `names.go`, and the older
/// ones it still accepts as aliases — those equal to ours need no entry), so a `--controllers`
/// value copied from a KCM manifest works unchanged.
pub const KCM_ALIASES: &[(&str, &str)] = &[
    ("persistentvolume-binder-controller", "binder"),
    ("persistentvolume-binder", "binder"),
    ("persistentvolume-protection-controller", "pv-protection"),
    ("persistentvolumeclaim-protection-controller", "pvc-protection"),
    ("persistentvolume-attach-detach-controller", "attachdetach"),
    ("persistentvolume-expander-controller", "expand"),
    ("persistentvolume-expander", "expand"),
];

/// What to append to kube-controller-manager's `--controllers` value so that it turns off the
/// controllers this process runs (both running them would fight over the same objects):
/// `,-a,-b`. Appended, never a value of its own: the flag replaces the distribution's value, and
/// its opt-in controllers (kubeadm's `bootstrapsigner`, `tokencleaner`) must stay.
pub fn kcm_negations(running: &[&str]) -> String {
    let mut neg = String::new();
    for name in running {
        if let Some((kcm, _)) = KCM_ALIASES
            .iter()
            .find(|(k, n)| n == name && k.ends_with("-controller"))
        {
            neg.push_str(",-");
            neg.push_str(kcm);
        }
    }
    neg
}

/// kube-controller-manager's whole flag, from the value it runs with today (`base`).
pub fn kcm_flag(base: &str, running: &[&str]) -> String {
    format!("--controllers={base}{}", kcm_negations(running))
}

/// Expands `--controllers` into the list to run, rejecting unknown names.
pub fn resolve_controllers(spec: &[String]) -> anyhow::Result<Vec<&'static str>> {
    let mut on: Vec<&'static str> = Vec::new();
    let mut off: Vec<&str> = Vec::new();
    for item in spec.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        if item == "*" {
            on.extend(CONTROLLERS.iter().filter(|(_, d)| *d).map(|(n, _)| *n));
            continue;
        }
        let (name, enable) = match item.strip_prefix('-') {
            Some(n) => (n, false),
            None => (item, true),
        };
        let name = KCM_ALIASES
            .iter()
            .find(|(k, _)| *k == name)
            .map_or(name, |(_, ours)| *ours);
        let Some((known, _)) = CONTROLLERS.iter().find(|(n, _)| *n == name) else {
            let names: Vec<_> = CONTROLLERS.iter().map(|(n, _)| *n).collect();
            bail!(
                "unknown controller {name:?} in --controllers (known: {})",
                names.join(", ")
            );
        };
        if enable { on.push(known) } else { off.push(known) }
    }
    // Start order is the table's, whatever order the flag named them in.
    Ok(CONTROLLERS
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| on.contains(n) && !off.contains(n))
        .collect())
}

/// Concurrency that saturates the client's token bucket without more: a bind is 4 writes of a
/// few milliseconds each, so a handful of binds in flight already use a limited bucket fully, and
/// more would only interleave every claim's writes with everyone else's and raise each claim's
/// latency (measured in `make bench`). Unlimited clients get the full width.
pub fn auto_in_flight(qps: f32) -> usize {
    if qps <= 0.0 {
        return 64;
    }
    // Truncation is fine: the value is clamped to a small range right after.
    ((qps / 8.0).ceil() as usize).clamp(2, 64)
}

/// Attaches in flight: one write each, so the width that keeps a token bucket busy is its rate
/// times a write's latency (tens of ms, hundreds under load); 32 covers 50 QPS with room. Without a limit the apiserver alone sets the pace, as for upstream's unbounded
/// operation executor, so the width only bounds memory and a burst's fan-out.
pub fn auto_attach_in_flight(qps: f32) -> usize {
    if qps <= 0.0 {
        return 256;
    }
    // Truncation is fine: the value is clamped to a small range right after.
    ((qps / 4.0).ceil() as usize).clamp(32, 256)
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "stowage".into());
    format!("{host}_{:08x}", rand::random::<u32>())
}

/// The registry with every family this process exports, as `run` builds it before any
/// leadership, with the leader gauges and the controllers' metrics.
fn metrics(args: &Args) -> (Registry, stowage_common::observe::metrics::Leader, Wiring) {
    let registry = stowage_common::observe::metrics::registry("stowage-controller");
    stowage_common::api::clientmetrics::register(&registry);
    stowage_common::runtime::queue::register_metrics(&registry);
    stowage_common::observe::storageops::register_metrics(&registry);
    let leader =
        stowage_common::observe::metrics::leader_metrics(&registry, &args.leader_elect_resource_name);
    let wiring = Wiring::new(args, &registry);
    (registry, leader, wiring)
}

/// Every metric family stowage-controller registers, series or not (docs/metrics.md is checked
/// against this list).
pub fn metric_families() -> Vec<stowage_common::observe::metrics::Family> {
    metrics(&Args::parse_from(["stowage-controller"])).0.families()
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // Every request says it is this binary's, whatever the executable is called.
    stowage_common::api::identity::set_component("stowage-controller");
    let controllers = resolve_controllers(&args.controllers)?;
    let (registry, leader_gauge, wiring) = metrics(&args);
    let health = Health::new(registry.clone());
    if let PlainAddress(Some(addr)) = args.metrics_bind_address {
        serve::spawn(addr, health.clone()).await?;
    } else if args.secure.secure_port == 0 {
        anyhow::bail!(
            "--metrics-bind-address=0 and --secure-port=0 leave no way to read /metrics or the probes"
        );
    }
    let timings = Timings {
        lease_duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry_period: args.leader_elect_retry_period,
    };
    if args.leader_elect {
        timings.validate().map_err(anyhow::Error::msg)?;
    }
    let (client, election_client) = args.api.clients(args.limit()).await?;
    let reviews = stowage_common::observe::secure::Reviews {
        authn: stowage_common::api::client::for_kubeconfig(&args.secure.authentication_kubeconfig, &client)
            .await?,
        authz: stowage_common::api::client::for_kubeconfig(&args.secure.authorization_kubeconfig, &client)
            .await?,
    };
    stowage_common::observe::secure::spawn(&args.secure, health.clone(), reviews).await?;
    health.ready.store(true, Ordering::Relaxed);
    tracing::info!(
        controllers = ?controllers,
        kcm_controllers_append = %kcm_negations(&controllers),
        kubeadm_example = %kcm_flag("*,bootstrapsigner,tokencleaner", &controllers),
        "starting; append kcm_controllers_append to kube-controller-manager's --controllers value (keep the value the distribution passes) so the two do not both run these"
    );

    let shutdown = stowage_common::runtime::shutdown::signalled();
    if !args.leader_elect {
        leader_gauge.set(true);
        tokio::select! {
            _ = shutdown => {}
            r = lead(client, &controllers, &registry, &wiring, None, &leader_gauge) => r?,
        }
        return Ok(());
    }

    let identity = args
        .leader_elect_identity
        .clone()
        .unwrap_or_else(default_identity);
    let elector = Elector::new(
        election_client,
        &args.leader_elect_resource_namespace,
        &args.leader_elect_resource_name,
        &identity,
        timings,
    );
    tracing::info!(%identity, lease = %args.leader_elect_resource_name, warm_standby = args.warm_standby, "standing for leader");
    let (tx, mut leading) = watch::channel(false);
    // The election ends (releasing the lease) only when told to, after the controllers of a
    // term have stopped: a release sent while their writes were still going out would let the
    // next leader start beside them.
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let election = tokio::spawn(leader::run(elector, tx, async move {
        let _ = released.await;
    }));
    tokio::pin!(shutdown);
    // A warm standby's informers run from now on, across terms of leadership; they only read.
    let mut warm_tasks = JoinSet::new();
    let warm = args.warm_standby.then(|| {
        let cluster = start_informers(client.clone(), &registry, &wiring, &mut warm_tasks);
        let (synced, gauge) = (cluster.clone(), leader_gauge.clone());
        warm_tasks.spawn(async move {
            let t0 = Instant::now();
            synced.ready().await;
            gauge.caches_synced(true);
            tracing::info!(listed_ms = elapsed_ms(t0), "standby: caches synced");
        });
        cluster
    });

    // Controllers run while `leading` is true and are dropped (stopped) the moment it turns false.
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            r = leading.wait_for(|l| *l) => if r.is_err() { break },
        }
        leader_gauge.set(true);
        let stopping = tokio::select! {
            _ = &mut shutdown => true,
            r = leading.wait_for(|l| !*l) => { let _ = r; false }
            r = lead(client.clone(), &controllers, &registry, &wiring, warm.as_ref(), &leader_gauge) => {
                if let Err(e) = r {
                    // /healthz turns red so an orchestrator restarts us; until then, retry
                    // slowly rather than spin on a failure that returns at once.
                    tracing::error!(error = %format!("{e:#}"), "controllers failed; restarting them in 5s");
                    health.alive.store(false, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                false
            }
        };
        // The term's controllers are dropped here: their tasks are aborted, no write of theirs
        // is left to send.
        leader_gauge.set(false);
        if warm.is_none() {
            // A cold replica's caches went with its term.
            leader_gauge.caches_synced(false);
        }
        wiring.rival.paused.set(0);
        if stopping {
            // Requests the controllers had already sent can still be queued in the apiserver
            // (seen: one received 12 ms after a release sent at once); the Lease is held a
            // moment longer so that they land before a standby can take over.
            tokio::time::sleep(RELEASE_DRAIN).await;
            break;
        }
        if election.is_finished() {
            break;
        }
    }
    leader_gauge.set(false);
    // Only now: the election task releases the lease (if held) and ends.
    let _ = release.send(());
    let _ = election.await;
    Ok(())
}

/// How long a leader told to stop keeps its Lease after its controllers stopped (see `run`).
const RELEASE_DRAIN: Duration = Duration::from_millis(500);

/// Runs `f` in a span naming the controller, so every line it logs can be filtered by it
/// (`"span":{"controller":"binder",…}` in JSON lines, a `run{controller=binder}:` prefix in text).
fn in_span<F: std::future::Future>(name: &'static str, f: F) -> tracing::instrument::Instrumented<F> {
    use tracing::Instrument;
    f.instrument(tracing::info_span!("run", controller = name))
}

/// One term of leadership: the conflict detector beside the controllers. With
/// `--on-conflict=pause` the controllers stop while a conflict holds (dropped, as when leadership
/// is lost, so no write of theirs is left running) and start again once it is over, on the
/// caches as they stand (fresh ones when cold); the Lease is kept meanwhile so no standby takes
/// over into the same conflict. `warm`: the informers a warm standby started (else each run
/// starts its own).
async fn lead(
    client: Client,
    controllers: &[&'static str],
    registry: &Registry,
    wiring: &Wiring,
    warm: Option<&Arc<Informers>>,
    gauge: &stowage_common::observe::metrics::Leader,
) -> anyhow::Result<()> {
    let run = || run_controllers(client.clone(), controllers, registry, wiring, warm, gauge);
    if wiring.on_conflict == OnConflict::Ignore {
        return run().await;
    }
    let (mut conflict, _detector) =
        rival::spawn(client.clone(), controllers, wiring.quiet, wiring.rival.clone());
    if wiring.on_conflict == OnConflict::Warn {
        return run().await;
    }
    loop {
        if *conflict.borrow() {
            wiring.rival.paused.set(1);
            tracing::warn!("controllers paused (--on-conflict=pause) until the conflict is over");
            if conflict.wait_for(|c| !*c).await.is_err() {
                anyhow::bail!("the conflict detector stopped");
            }
            wiring.rival.paused.set(0);
            tracing::info!("conflict over: starting the controllers again");
        }
        tokio::select! {
            r = run() => return r,
            r = conflict.wait_for(|c| *c) => {
                if r.is_err() {
                    anyhow::bail!("the conflict detector stopped");
                }
            }
        }
    }
}

/// The shared informers (reads only), on `tasks`.
fn start_informers(
    client: Client,
    registry: &Registry,
    wiring: &Wiring,
    tasks: &mut JoinSet<()>,
) -> Arc<Informers> {
    // Local mode: the binder reads the room each node's store publishes.
    let local = wiring.binder.1.store_mode.is_local();
    Informers::start_with(client, registry.clone(), tasks, local)
}

fn elapsed_ms(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Runs the selected controllers until one fails or the future is dropped (leadership lost):
/// starts the shared informers (unless a warm standby's are given), waits for their first
/// lists, then spawns each controller.
async fn run_controllers(
    client: Client,
    controllers: &[&'static str],
    registry: &Registry,
    wiring: &Wiring,
    warm: Option<&Arc<Informers>>,
    gauge: &stowage_common::observe::metrics::Leader,
) -> anyhow::Result<()> {
    let mut informers = JoinSet::new();
    let cluster = match warm {
        Some(cluster) => cluster.clone(),
        None => start_informers(client, registry, wiring, &mut informers),
    };
    let t0 = Instant::now();
    cluster.ready().await;
    gauge.caches_synced(true);
    tracing::info!(
        controllers = ?controllers,
        warm = warm.is_some(),
        waited_ms = elapsed_ms(t0),
        "leading: caches synced, controllers started"
    );
    let mut running: JoinSet<(&'static str, anyhow::Result<()>)> = JoinSet::new();
    for &name in controllers {
        let cluster = cluster.clone();
        match name {
            "binder" => {
                let (m, c) = wiring.binder.clone();
                running.spawn(in_span(name, async move {
                    (name, stowage_binder::run(cluster, m, c).await)
                }));
            }
            "pvc-protection" => {
                let m = wiring.protection.clone();
                running.spawn(in_span(name, async move {
                    (name, stowage_protection::run_pvc_protection(cluster, m).await)
                }));
            }
            "pv-protection" => {
                let m = wiring.protection.clone();
                running.spawn(in_span(name, async move {
                    (name, stowage_protection::run_pv_protection(cluster, m).await)
                }));
            }
            "attachdetach" => {
                let (m, c) = wiring.attachdetach.clone();
                running.spawn(in_span(name, async move {
                    (name, stowage_attachdetach::run(cluster, m, c).await)
                }));
            }
            "expand" => {
                let (m, c) = wiring.expand.clone();
                running.spawn(in_span(name, async move {
                    (name, stowage_expand::run(cluster, m, c).await)
                }));
            }
            other => unreachable!("resolve_controllers only returns known names, got {other}"),
        }
    }
    if running.is_empty() {
        // Nothing selected (or only controllers not yet built): hold the lease and the caches.
        futures::future::pending::<()>().await;
    }
    match running.join_next().await {
        Some(Ok((name, Ok(())))) => anyhow::bail!("controller {name} stopped"),
        Some(Ok((name, Err(e)))) => Err(e.context(format!("controller {name} failed"))),
        Some(Err(e)) => anyhow::bail!("a controller task panicked: {e}"),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn kube_controller_managers_shared_flags_parse() {
        let args = Args::try_parse_from([
            "stowage-controller",
            "--logging-format=json",
            "--kube-api-content-type=application/vnd.kubernetes.protobuf",
            "--kube-api-qps=50",
            "--kube-api-burst=100",
            "--leader-elect=true",
            "--leader-elect-resource-lock=leases",
            "--leader-elect-lease-duration=15s",
            "--secure-port=10257",
            "--bind-address=0.0.0.0",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            "--metrics-bind-address=0",
            "--v=4",
        ])
        .unwrap();
        assert_eq!(
            args.log.log_format,
            stowage_common::observe::logging::Format::Json
        );
        assert_eq!(args.log.verbosity, 4);
        assert_eq!(args.secure.secure_port, 10257);
        assert_eq!(args.metrics_bind_address, PlainAddress(None));
        let err = Args::try_parse_from(["stowage-controller", "--leader-elect-resource-lock=endpoints"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("leases"), "{err}");
        assert!(Args::try_parse_from(["stowage-controller", "--kube-api-content-type=text/plain"]).is_err());
    }

    #[test]
    fn star_minus_one() {
        assert_eq!(
            resolve_controllers(&s(&["*", "-expand"])).unwrap(),
            vec!["binder", "pv-protection", "pvc-protection", "attachdetach"]
        );
    }

    #[test]
    fn kube_controller_manager_names_are_accepted() {
        assert_eq!(
            resolve_controllers(&s(&[
                "persistentvolume-binder-controller",
                "persistentvolume-attach-detach-controller",
                "persistentvolume-expander"
            ]))
            .unwrap(),
            vec!["binder", "attachdetach", "expand"]
        );
        assert_eq!(
            resolve_controllers(&s(&["*", "-persistentvolumeclaim-protection-controller"])).unwrap(),
            vec!["binder", "pv-protection", "attachdetach", "expand"]
        );
        assert!(resolve_controllers(&s(&["persistentvolume-binder-controler"])).is_err());
    }

    #[test]
    fn the_kcm_flag_turns_off_what_runs_here() {
        assert_eq!(
            kcm_flag(
                "*,bootstrapsigner,tokencleaner",
                &resolve_controllers(&s(&["*"])).unwrap()
            ),
            "--controllers=*,bootstrapsigner,tokencleaner,-persistentvolume-binder-controller,-persistentvolume-protection-controller,-persistentvolumeclaim-protection-controller,-persistentvolume-attach-detach-controller,-persistentvolume-expander-controller",
            "the distribution's opt-in controllers stay"
        );
        assert_eq!(
            kcm_negations(&["expand"]),
            ",-persistentvolume-expander-controller"
        );
        assert_eq!(kcm_flag("*", &[]), "--controllers=*");
    }

    #[test]
    fn explicit_list_keeps_table_order() {
        assert_eq!(
            resolve_controllers(&s(&["expand", "binder"])).unwrap(),
            vec!["binder", "expand"]
        );
    }

    #[test]
    fn attach_width_follows_the_rate_limit() {
        assert_eq!(auto_attach_in_flight(50.0), 32);
        assert_eq!(auto_attach_in_flight(400.0), 100);
        assert_eq!(auto_attach_in_flight(0.0), 256);
        assert_eq!(auto_attach_in_flight(100000.0), 256);
    }

    #[test]
    fn in_flight_follows_the_rate_limit() {
        assert_eq!(auto_in_flight(0.0), 64);
        assert_eq!(auto_in_flight(20.0), 3);
        assert_eq!(auto_in_flight(50.0), 7);
        assert_eq!(auto_in_flight(5000.0), 64);
        assert_eq!(auto_in_flight(1.0), 2);
    }

    #[test]
    fn default_widths_follow_the_adaptive_ceiling() {
        // The numbers --help and the operator guide state for the defaults and a fixed 50/s.
        let width = |argv: &[&str]| {
            let qps = Args::parse_from(argv).limit().nominal_qps();
            (auto_in_flight(qps), auto_attach_in_flight(qps))
        };
        assert_eq!(width(&["stowage-controller"]), (64, 256));
        assert_eq!(width(&["stowage-controller", "--kube-api-qps=50"]), (7, 32));
        assert_eq!(width(&["stowage-controller", "--kube-api-qps=0"]), (64, 256));
    }

    /// What a JSON log pipeline filters on: each line a controller logs names it in
    /// `span.controller`, beside the line's own fields.
    #[test]
    fn json_lines_name_their_controller() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let out = Buffer::default();
        let args = stowage_common::observe::logging::LogArgs {
            log_format: stowage_common::observe::logging::Format::Json,
            verbosity: 2,
        };
        let writer = out.clone();
        let subscriber = stowage_common::observe::logging::subscriber(&args, move || writer.clone(), false);
        tracing::subscriber::with_default(subscriber, || {
            futures::executor::block_on(in_span("pvc-protection", async {
                tracing::info!(claim = "ns/data", "added protection finalizer");
            }))
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).expect(&text);
        assert_eq!(line["span"]["controller"], "pvc-protection", "{text}");
        assert_eq!(line["fields"]["claim"], "ns/data", "{text}");
        assert_eq!(line["fields"]["message"], "added protection finalizer", "{text}");
    }

    #[test]
    fn unknown_name_is_a_clear_error() {
        let e = resolve_controllers(&s(&["binder", "nope"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown controller \"nope\""), "{e}");
    }
}
