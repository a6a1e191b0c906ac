//! The seeded workload: claims of every class come and go, pods start on a node (the agent mounts
//! their volume; the soak then reads the pattern the previous pod left and writes the next one
//! through the mounted path), move between nodes, volumes grow online, nodes are drained, shut
//! down or partitioned (agent stopped, mounts kept) with the out-of-service taint. The soak also plays the scheduler (selected-node,
//! `spec.nodeName`) and the external provisioner of the external-driver classes.
//!
//! `claims` creates, grows and deletes claims, `pods` starts, moves and verifies pods, `nodes`
//! drains and shuts down nodes, `external` plays the external driver's provisioner.

mod claims;
mod expansion;
mod external;
mod nodes;
mod pods;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams};

pub use expansion::{follow as follow_expansions, settle as settle_expansions};
pub use external::external_provisioner;

use crate::cluster::{Procs, Roots};
use crate::report::Record;
use crate::rng::Rng;

pub const NS: &str = "soak";
pub const LOOP_DRIVER: &str = "loop.stowage.dev";
pub const EXT_DRIVER: &str = "ext.soak.stowage.dev";

pub struct Class {
    pub name: &'static str,
    pub looped: bool,
    pub wffc: bool,
    pub retain: bool,
}

pub const CLASSES: [Class; 6] = [
    Class {
        name: "soak-loop-immediate-delete",
        looped: true,
        wffc: false,
        retain: false,
    },
    Class {
        name: "soak-loop-immediate-retain",
        looped: true,
        wffc: false,
        retain: true,
    },
    Class {
        name: "soak-loop-wffc-delete",
        looped: true,
        wffc: true,
        retain: false,
    },
    Class {
        name: "soak-loop-wffc-retain",
        looped: true,
        wffc: true,
        retain: true,
    },
    Class {
        name: "soak-ext-immediate-delete",
        looped: false,
        wffc: false,
        retain: false,
    },
    Class {
        name: "soak-ext-wffc-retain",
        looped: false,
        wffc: true,
        retain: true,
    },
];

#[derive(Clone, Debug)]
pub struct PodRef {
    pub name: String,
    pub uid: String,
    pub node: String,
    pub verified: bool,
}

pub struct ClaimState {
    pub class: usize,
    pub uid: String,
    pub size_mi: u64,
    /// Every size asked for, the first at creation: a file system must outgrow the one before
    /// the size its claim reports.
    pub sizes_mi: Vec<u64>,
    /// Since when an expansion waits to show in `status.capacity` (none pending: `None`).
    pub resize_since: Option<tokio::time::Instant>,
    /// The last pattern generation written and confirmed (0: none yet).
    pub generation: u64,
    /// A write of `generation + 1` failed half-way: either may be found.
    pub maybe_next: bool,
    pub fs_uuid: Option<String>,
    pub pod: Option<PodRef>,
    pub selected_node: Option<String>,
    pub volume: Option<String>,
    /// Held while the pod's volume is read or written, and while the pod is deleted, so a pod is
    /// never pulled from under a write the soak is making.
    pub io: Arc<tokio::sync::Mutex<()>>,
}

impl ClaimState {
    /// A claim just created with `size_mi`: no pod, no volume, nothing written yet.
    pub(super) fn new(class: usize, uid: String, size_mi: u64) -> Self {
        Self {
            class,
            uid,
            size_mi,
            sizes_mi: vec![size_mi],
            resize_since: None,
            generation: 0,
            maybe_next: false,
            fs_uuid: None,
            pod: None,
            selected_node: None,
            volume: None,
            io: Arc::default(),
        }
    }
}

/// A claim the workload deleted, for the end checks.
#[derive(Clone, Debug)]
pub struct Deleted {
    pub name: String,
    pub uid: String,
    pub class: usize,
}

#[derive(Default)]
pub struct World {
    pub claims: BTreeMap<String, ClaimState>,
    pub deleted: Vec<Deleted>,
    /// Nodes no pod may be placed on (drained, or shut down).
    pub cordoned: BTreeSet<String>,
    /// Nodes whose agent is held down (out-of-service).
    pub down: BTreeSet<String>,
    /// Claims whose new pod is watched for the fence of a partitioned node: the churn neither
    /// deletes them nor their pod meanwhile, or the refusal it waits for could never come.
    pub fence_watched: BTreeSet<String>,
    pub(super) next_id: u64,
    /// Classes still to be created once before the choice is random.
    pub(super) class_order: Vec<usize>,
}

pub struct Ctx {
    pub client: Client,
    pub record: Arc<Record>,
    pub procs: Arc<Procs>,
    pub seed: u64,
    pub roots: Roots,
    pub world: Mutex<World>,
    pub max_claims: usize,
    /// Set when the soak tears down: verifiers stop.
    pub stopping: AtomicBool,
    /// Follow-up tasks (uncordon, node back) to await before quiescence.
    pub followups: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Loop devices a partitioned node still holds (its mounts left in place): another node may
    /// attach their images meanwhile, multi-mount protection keeping it from mounting them.
    pub fenced: Arc<Mutex<BTreeSet<String>>>,
}

impl Ctx {
    pub fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), NS)
    }

    pub(super) fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NS)
    }

    pub fn nodes(&self) -> Vec<String> {
        self.roots.keys().cloned().collect()
    }

    pub(super) fn schedulable(&self) -> Vec<String> {
        let w = self.world();
        self.nodes()
            .into_iter()
            .filter(|n| !w.cordoned.contains(n))
            .collect()
    }

    pub(super) fn api_failed(&self, what: &str, e: impl std::fmt::Display) {
        self.record.note("api-call-failed", &format!("{what}: {e}"));
    }
}

pub(super) fn delete_now() -> DeleteParams {
    DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    }
}

/// Runs the workload until `until`.
pub async fn run(ctx: Arc<Ctx>, mut rng: Rng, until: tokio::time::Instant) {
    let start = tokio::time::Instant::now();
    let churn = until.saturating_duration_since(start).as_secs_f64().max(1.0);
    // Every class once first (in a seeded order), so each reclaim policy and binding mode is met.
    {
        let mut order: Vec<usize> = (0..CLASSES.len()).collect();
        rng.shuffle(&mut order);
        ctx.world().class_order = order;
    }
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(rng.range(200, 900))).await;
        let near_end = until.saturating_duration_since(tokio::time::Instant::now()) < Duration::from_secs(40);
        let progress = start.elapsed().as_secs_f64() / churn;
        let op = forced(&ctx, &mut rng, progress, near_end).or_else(|| choose(&ctx, &mut rng, near_end));
        let Some(op) = op else { continue };
        // A bound for one step: during an apiserver outage a call may wait long.
        if tokio::time::timeout(Duration::from_secs(120), execute(&ctx, &mut rng, op))
            .await
            .is_err()
        {
            ctx.record
                .note("workload-step-timeout", "a workload step took over 120 s");
        }
    }
}

/// Operations every run must show, however the dice fall, with the share of the churn after
/// which one is forced while none has happened yet (and its preconditions hold).
const MUST: [(&str, f64); 4] = [
    ("expand-online", 0.15),
    ("drain", 0.25),
    ("out-of-service-taint", 0.45),
    ("partition", 0.60),
];

fn forced(ctx: &Ctx, rng: &mut Rng, progress: f64, near_end: bool) -> Option<Op> {
    for (kind, at) in MUST {
        if progress < at || ctx.record.operations(kind) > 0 {
            continue;
        }
        let w = ctx.world();
        let schedulable: Vec<String> = ctx
            .nodes()
            .into_iter()
            .filter(|n| !w.cordoned.contains(n))
            .collect();
        let op = match kind {
            "expand-online" => {
                let mounted: Vec<String> = w
                    .claims
                    .iter()
                    .filter(|(_, c)| growable(c) && c.pod.as_ref().is_some_and(|p| p.verified))
                    .map(|(n, _)| n.clone())
                    .collect();
                rng.pick(&mounted).cloned().map(Op::Expand)
            }
            // As in `choose`: a node leaves only while another takes its pods.
            _ if near_end || schedulable.len() < 2 || !w.down.is_empty() => None,
            "drain" => rng.pick(&schedulable).cloned().map(Op::Drain),
            "partition" => rng
                .pick(&partitionable(&w, &schedulable))
                .cloned()
                .map(Op::Partition),
            _ => rng.pick(&schedulable).cloned().map(Op::OutOfService),
        };
        if op.is_some() {
            return op;
        }
    }
    None
}

/// Schedulable nodes with a verified pod on a loop volume (data written through their mount,
/// whose generation is known): a partition of one of them has something to fence.
fn partitionable(w: &World, schedulable: &[String]) -> Vec<String> {
    schedulable
        .iter()
        .filter(|n| nodes::partition_subject(w, n).is_some())
        .cloned()
        .collect()
}

/// A loop claim with a volume, below the largest size the soak asks for.
fn growable(c: &ClaimState) -> bool {
    CLASSES[c.class].looped && c.volume.is_some() && c.size_mi < 64
}

/// The claims the churn may delete: all but the first grown loop claim, kept as the witness the
/// end check of expansions (`expansion-reached-size`) needs whichever claims the dice pick, and
/// but those a partition's fence watch follows.
fn deletable(w: &World) -> Vec<String> {
    let witness = w
        .claims
        .iter()
        .find(|(_, c)| CLASSES[c.class].looped && c.sizes_mi.len() > 1)
        .map(|(n, _)| n);
    w.claims
        .keys()
        .filter(|n| Some(*n) != witness && !w.fence_watched.contains(*n))
        .cloned()
        .collect()
}

#[derive(Debug)]
enum Op {
    CreateClaim,
    StartPod(String),
    MovePod(String),
    DeletePod(String),
    Expand(String),
    DeleteClaim(String),
    Drain(String),
    OutOfService(String),
    Partition(String),
}

fn choose(ctx: &Ctx, rng: &mut Rng, near_end: bool) -> Option<Op> {
    let w = ctx.world();
    let schedulable: Vec<String> = ctx
        .nodes()
        .into_iter()
        .filter(|n| !w.cordoned.contains(n))
        .collect();
    let idle: Vec<String> = w
        .claims
        .iter()
        .filter(|(_, c)| c.pod.is_none())
        .map(|(n, _)| n.clone())
        .collect();
    let with_pod: Vec<String> = w
        .claims
        .iter()
        .filter(|(_, c)| {
            c.pod
                .as_ref()
                .is_some_and(|p| p.verified || !CLASSES[c.class].looped)
        })
        .map(|(n, _)| n.clone())
        .collect();
    let growable: Vec<String> = w
        .claims
        .iter()
        .filter(|(_, c)| growable(c))
        .map(|(n, _)| n.clone())
        .collect();
    let mut menu: Vec<(u64, Op)> = Vec::new();
    if w.claims.len() < ctx.max_claims {
        menu.push((20, Op::CreateClaim));
    }
    if !schedulable.is_empty()
        && let Some(c) = rng.pick(&idle)
    {
        menu.push((25, Op::StartPod(c.clone())));
    }
    if let Some(c) = rng.pick(&with_pod) {
        menu.push((14, Op::MovePod(c.clone())));
    }
    let pod_deletable: Vec<String> = with_pod
        .iter()
        .filter(|c| !w.fence_watched.contains(*c))
        .cloned()
        .collect();
    if let Some(c) = rng.pick(&pod_deletable) {
        menu.push((5, Op::DeletePod(c.clone())));
    }
    if let Some(c) = rng.pick(&growable) {
        menu.push((8, Op::Expand(c.clone())));
    }
    if w.claims.len() > 3
        && let Some(c) = rng.pick(&deletable(&w))
    {
        menu.push((9, Op::DeleteClaim(c.clone())));
    }
    // A node leaves only while another can take its pods, and not in the last seconds (its
    // return must happen before quiescence).
    if !near_end && schedulable.len() >= 2 && w.down.is_empty() {
        if let Some(n) = rng.pick(&schedulable) {
            menu.push((3, Op::Drain(n.clone())));
        }
        if let Some(n) = rng.pick(&schedulable) {
            menu.push((2, Op::OutOfService(n.clone())));
        }
        if let Some(n) = rng.pick(&partitionable(&w, &schedulable)) {
            menu.push((1, Op::Partition(n.clone())));
        }
    }
    let total: u64 = menu.iter().map(|(w, _)| *w).sum();
    if total == 0 {
        return None;
    }
    let mut x = rng.range(0, total - 1);
    for (weight, op) in menu {
        if x < weight {
            return Some(op);
        }
        x -= weight;
    }
    None
}

async fn execute(ctx: &Arc<Ctx>, rng: &mut Rng, op: Op) {
    match op {
        Op::CreateClaim => claims::create_claim(ctx, rng).await,
        Op::StartPod(c) => {
            let nodes = ctx.schedulable();
            if let Some(n) = rng.pick(&nodes) {
                pods::start_pod(ctx, &c, n).await;
            }
        }
        Op::MovePod(c) => {
            pods::move_pod(ctx, rng, &c).await;
        }
        Op::DeletePod(c) => {
            if pods::delete_pod(ctx, &c).await {
                ctx.record.op("delete-pod", serde_json::json!({"claim": c}));
            }
        }
        Op::Expand(c) => expansion::expand(ctx, &c).await,
        Op::DeleteClaim(c) => claims::delete_claim(ctx, &c).await,
        Op::Drain(n) => nodes::drain(ctx, rng, &n).await,
        Op::OutOfService(n) => nodes::out_of_service(ctx, rng, &n).await,
        Op::Partition(n) => nodes::partition(ctx, rng, &n).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(class: usize, sizes_mi: &[u64]) -> ClaimState {
        let mut c = ClaimState::new(class, String::new(), sizes_mi[0]);
        c.size_mi = *sizes_mi.last().unwrap();
        c.sizes_mi = sizes_mi.to_vec();
        c.volume = Some("pv".into());
        c
    }

    #[test]
    fn the_first_grown_loop_claim_is_never_deleted_by_churn() {
        let ext = CLASSES.iter().position(|c| !c.looped).unwrap();
        let mut w = World::default();
        w.claims.insert("c0001".to_string(), claim(0, &[16]));
        w.claims.insert("c0002".to_string(), claim(ext, &[64, 72]));
        w.claims.insert("c0003".to_string(), claim(2, &[16, 24]));
        w.claims.insert("c0004".to_string(), claim(1, &[32, 40]));
        // The grown external claim is no witness (the end check follows loop claims only); the
        // first grown loop claim is, and the second stays deletable.
        assert_eq!(deletable(&w), ["c0001", "c0002", "c0004"]);
        w.claims.remove("c0003");
        assert_eq!(deletable(&w), ["c0001", "c0002"]);
        // A claim a partition's fence watch follows stays too.
        w.fence_watched.insert("c0002".to_string());
        assert_eq!(deletable(&w), ["c0001"]);
        // Nothing grown yet: everything may go.
        let mut fresh = World::default();
        fresh.claims.insert("c0001".to_string(), claim(0, &[16]));
        assert_eq!(deletable(&fresh), ["c0001"]);
    }
}
