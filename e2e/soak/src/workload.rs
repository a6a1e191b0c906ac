//! The seeded workload: claims of every class come and go, pods start on a node (the agent mounts
//! their volume; the soak then reads the pattern the previous pod left and writes the next one
//! through the mounted path), move between nodes, volumes grow online, nodes are drained or shut
//! down with the out-of-service taint. The soak also plays the scheduler (selected-node,
//! `spec.nodeName`) and the external provisioner of the external-driver classes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use stowage_testkit::builders::{pod, pvc};

use crate::cluster::{Procs, Roots};
use crate::host;
use crate::observer::OUT_OF_SERVICE;
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
    next_id: u64,
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
}

impl Ctx {
    pub fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), NS)
    }

    pub fn nodes(&self) -> Vec<String> {
        self.roots.keys().cloned().collect()
    }

    fn schedulable(&self) -> Vec<String> {
        let w = self.world();
        self.nodes()
            .into_iter()
            .filter(|n| !w.cordoned.contains(n))
            .collect()
    }

    fn api_failed(&self, what: &str, e: impl std::fmt::Display) {
        self.record.note("api-call-failed", &format!("{what}: {e}"));
    }
}

fn delete_now() -> DeleteParams {
    DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    }
}

/// Runs the workload until `until`.
pub async fn run(ctx: Arc<Ctx>, mut rng: Rng, until: tokio::time::Instant) {
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(rng.range(200, 900))).await;
        let near_end = until.saturating_duration_since(tokio::time::Instant::now()) < Duration::from_secs(40);
        let op = choose(&ctx, &mut rng, near_end);
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
        .filter(|(_, c)| CLASSES[c.class].looped && c.volume.is_some() && c.size_mi < 64)
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
    if let Some(c) = rng.pick(&with_pod) {
        menu.push((5, Op::DeletePod(c.clone())));
    }
    if let Some(c) = rng.pick(&growable) {
        menu.push((8, Op::Expand(c.clone())));
    }
    if w.claims.len() > 3
        && let Some(c) = rng.pick(&w.claims.keys().cloned().collect::<Vec<_>>())
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
        Op::CreateClaim => create_claim(ctx, rng).await,
        Op::StartPod(c) => {
            let nodes = ctx.schedulable();
            if let Some(n) = rng.pick(&nodes) {
                start_pod(ctx, &c, n).await;
            }
        }
        Op::MovePod(c) => move_pod(ctx, rng, &c).await,
        Op::DeletePod(c) => {
            if delete_pod(ctx, &c).await {
                ctx.record.op("delete-pod", serde_json::json!({"claim": c}));
            }
        }
        Op::Expand(c) => expand(ctx, &c).await,
        Op::DeleteClaim(c) => delete_claim(ctx, &c).await,
        Op::Drain(n) => drain(ctx, rng, &n).await,
        Op::OutOfService(n) => out_of_service(ctx, rng, &n).await,
    }
}

async fn create_claim(ctx: &Ctx, rng: &mut Rng) {
    let class = rng.below(CLASSES.len());
    let size_mi = if CLASSES[class].looped {
        16 * rng.range(1, 2)
    } else {
        64
    };
    let name = {
        let mut w = ctx.world();
        w.next_id += 1;
        format!("c{:04}", w.next_id)
    };
    let claim = pvc(NS, &name)
        .class(CLASSES[class].name)
        .request(&format!("{size_mi}Mi"))
        .build();
    let created = match ctx.claims().create(&PostParams::default(), &claim).await {
        Ok(made) => Ok(made),
        Err(e) => adopt(&ctx.claims(), &name, e).await,
    };
    match created {
        Ok(made) => {
            ctx.world().claims.insert(
                name.clone(),
                ClaimState {
                    class,
                    uid: made.uid().unwrap_or_default(),
                    size_mi,
                    generation: 0,
                    maybe_next: false,
                    fs_uuid: None,
                    pod: None,
                    selected_node: None,
                    volume: None,
                    io: Arc::default(),
                },
            );
            ctx.record.op(
                "create-claim",
                serde_json::json!({"claim": name, "class": CLASSES[class].name, "size": format!("{size_mi}Mi")}),
            );
        }
        Err(e) => ctx.api_failed("create claim", e),
    }
}

/// After a create failed without an answer from the apiserver (connection lost during a restart),
/// the object may exist all the same: look it up until the apiserver answers, so the soak never
/// loses track of a pod that holds a volume or a claim it must clean up.
async fn adopt<K>(api: &Api<K>, name: &str, error: kube::Error) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if matches!(error, kube::Error::Api(_)) {
        return Err(error);
    }
    for _ in 0..120 {
        match api.get(name).await {
            Ok(o) => return Ok(o),
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    Err(error)
}

/// Creates a pod for claim `name` on `node` (setting selected-node first for a
/// WaitForFirstConsumer claim, as the scheduler does) and starts its verifier.
async fn start_pod(ctx: &Arc<Ctx>, name: &str, node: &str) -> bool {
    let (class, selected, io) = {
        let w = ctx.world();
        let Some(c) = w.claims.get(name) else { return false };
        if c.pod.is_some() {
            return false;
        }
        (c.class, c.selected_node.clone(), c.io.clone())
    };
    let _io = io.lock().await;
    if CLASSES[class].wffc && selected.is_none() {
        let patch =
            serde_json::json!({"metadata": {"annotations": {"volume.kubernetes.io/selected-node": node}}});
        if let Err(e) = ctx
            .claims()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            ctx.api_failed("set selected-node", e);
            return false;
        }
        if let Some(c) = ctx.world().claims.get_mut(name) {
            c.selected_node = Some(node.to_string());
        }
    }
    let pod_name = {
        let mut w = ctx.world();
        w.next_id += 1;
        format!("{name}-p{:04}", w.next_id)
    };
    let p = pod(NS, &pod_name).claim("data", name).node(node).build();
    let created = match ctx.pods().create(&PostParams::default(), &p).await {
        Ok(made) => Ok(made),
        Err(e) => adopt(&ctx.pods(), &pod_name, e).await,
    };
    match created {
        Ok(made) => {
            let r = PodRef {
                name: pod_name.clone(),
                uid: made.uid().unwrap_or_default(),
                node: node.to_string(),
                verified: false,
            };
            if let Some(c) = ctx.world().claims.get_mut(name) {
                c.pod = Some(r.clone());
            }
            ctx.record.op(
                "start-pod",
                serde_json::json!({"claim": name, "pod": pod_name, "node": node}),
            );
            if CLASSES[class].looped {
                tokio::spawn(verify(ctx.clone(), name.to_string(), r));
            } else if let Some(c) = ctx.world().claims.get_mut(name)
                && let Some(p) = c.pod.as_mut()
            {
                // Nothing mounts an external driver's volume here: the pod is only an object.
                p.verified = true;
            }
            true
        }
        Err(e) => {
            ctx.api_failed("create pod", e);
            false
        }
    }
}

/// Deletes the pod of claim `name` at once (no kubelet runs to finish a graceful deletion).
async fn delete_pod(ctx: &Ctx, name: &str) -> bool {
    let Some(io) = ctx.world().claims.get(name).map(|c| c.io.clone()) else {
        return false;
    };
    let _io = io.lock().await;
    let Some(p) = ctx.world().claims.get(name).and_then(|c| c.pod.clone()) else {
        return false;
    };
    match ctx.pods().delete(&p.name, &delete_now()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => {
            ctx.api_failed("delete pod", e);
            return false;
        }
    }
    if let Some(c) = ctx.world().claims.get_mut(name) {
        c.pod = None;
    }
    true
}

async fn move_pod(ctx: &Arc<Ctx>, rng: &mut Rng, name: &str) {
    let Some(from) = ctx
        .world()
        .claims
        .get(name)
        .and_then(|c| c.pod.as_ref().map(|p| p.node.clone()))
    else {
        return;
    };
    let others: Vec<String> = ctx.schedulable().into_iter().filter(|n| *n != from).collect();
    let Some(to) = rng.pick(&others).cloned() else {
        return;
    };
    if delete_pod(ctx, name).await && start_pod(ctx, name, &to).await {
        ctx.record.op(
            "move-pod",
            serde_json::json!({"claim": name, "from": from, "to": to}),
        );
    }
}

async fn expand(ctx: &Ctx, name: &str) {
    let Some(size) = ctx.world().claims.get(name).map(|c| c.size_mi + 8) else {
        return;
    };
    let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": format!("{size}Mi")}}}});
    match ctx
        .claims()
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            let online = {
                let mut w = ctx.world();
                let c = w.claims.get_mut(name);
                c.map(|c| {
                    c.size_mi = size;
                    c.pod.is_some()
                })
                .unwrap_or(false)
            };
            ctx.record.op(
                if online { "expand-online" } else { "expand-offline" },
                serde_json::json!({"claim": name, "to": format!("{size}Mi")}),
            );
        }
        Err(e) => ctx.api_failed("expand claim", e),
    }
}

async fn delete_claim(ctx: &Ctx, name: &str) {
    delete_pod(ctx, name).await;
    let Some((uid, class)) = ctx.world().claims.get(name).map(|c| (c.uid.clone(), c.class)) else {
        return;
    };
    match ctx.claims().delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => {
            ctx.api_failed("delete claim", e);
            return;
        }
    }
    let mut w = ctx.world();
    w.claims.remove(name);
    w.deleted.push(Deleted {
        name: name.to_string(),
        uid,
        class,
    });
    drop(w);
    ctx.record.op(
        "delete-claim",
        serde_json::json!({"claim": name, "class": CLASSES[class].name}),
    );
}

fn pods_on(ctx: &Ctx, node: &str) -> Vec<String> {
    ctx.world()
        .claims
        .iter()
        .filter(|(_, c)| c.pod.as_ref().is_some_and(|p| p.node == node))
        .map(|(n, _)| n.clone())
        .collect()
}

async fn set_unschedulable(ctx: &Ctx, node: &str, on: bool) {
    let patch = serde_json::json!({"spec": {"unschedulable": on}});
    if let Err(e) = Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        ctx.api_failed("cordon", e);
    }
}

/// Cordons `node`, moves its pods elsewhere, and uncordons it after a while.
async fn drain(ctx: &Arc<Ctx>, rng: &mut Rng, node: &str) {
    ctx.world().cordoned.insert(node.to_string());
    set_unschedulable(ctx, node, true).await;
    let moved = pods_on(ctx, node);
    ctx.record
        .op("drain", serde_json::json!({"node": node, "pods": moved}));
    for c in &moved {
        move_pod(ctx, rng, c).await;
    }
    let back = Duration::from_secs(rng.range(8, 25));
    let (ctx2, node2) = (ctx.clone(), node.to_string());
    let t = tokio::spawn(async move {
        tokio::time::sleep(back).await;
        set_unschedulable(&ctx2, &node2, false).await;
        ctx2.world().cordoned.remove(&node2);
        ctx2.record.op("uncordon", serde_json::json!({"node": node2}));
    });
    ctx.followups.lock().unwrap_or_else(|p| p.into_inner()).push(t);
}

async fn set_out_of_service(ctx: &Ctx, node: &str, on: bool) -> bool {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(ctx.client.clone());
    for _ in 0..30 {
        let n = match nodes.get(node).await {
            Ok(n) => n,
            Err(e) => {
                ctx.api_failed("get node", e);
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
        };
        let mut taints: Vec<serde_json::Value> = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|t| t.key != OUT_OF_SERVICE)
            .filter_map(|t| serde_json::to_value(t).ok())
            .collect();
        if on {
            taints.push(
                serde_json::json!({"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}),
            );
        }
        // Guarded by the resourceVersion read: the agent writes the same Node.
        let patch = serde_json::json!({"metadata": {"resourceVersion": n.resource_version()}, "spec": {"taints": taints, "unschedulable": on}});
        match nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return true,
            Err(e) => {
                ctx.api_failed("taint node", e);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    false
}

/// A node shuts down: its agent is killed and kept down, the node gets the out-of-service taint,
/// its pods are deleted at once and started elsewhere (their volumes may only attach there once
/// the dead node let go). Later the node comes back: agent started, its leftovers cleaned up by
/// it, taint removed.
async fn out_of_service(ctx: &Arc<Ctx>, rng: &mut Rng, node: &str) {
    {
        let mut w = ctx.world();
        if !w.down.is_empty() {
            return;
        }
        w.down.insert(node.to_string());
        w.cordoned.insert(node.to_string());
    }
    ctx.procs.hold(node, true);
    ctx.procs.kill(node, Duration::ZERO);
    // The node's kernel goes too: no write of the soak's may be running on it then.
    let locks: Vec<_> = {
        let w = ctx.world();
        w.claims
            .values()
            .filter(|c| c.pod.as_ref().is_some_and(|p| p.node == node))
            .map(|c| c.io.clone())
            .collect()
    };
    let mut held = Vec::new();
    for l in &locks {
        held.push(l.lock().await);
    }
    let root = ctx.roots[node].clone();
    // Its kernel's loop devices include attached ones nothing mounts yet (or any more): the
    // agent (now dead) named each in its attachment's status. Those of other nodes stay.
    let (own, others) = node_devices(ctx, node).await;
    let powered_off = tokio::task::spawn_blocking(move || host::power_off(&root, &own, &others))
        .await
        .unwrap_or_default();
    drop(held);
    ctx.record.op(
        "node-shutdown",
        serde_json::json!({"node": node, "power_off": powered_off}),
    );
    if !set_out_of_service(ctx, node, true).await {
        ctx.record.note("taint-failed", node);
    }
    let moved = pods_on(ctx, node);
    ctx.record.op(
        "out-of-service-taint",
        serde_json::json!({"node": node, "pods": moved}),
    );
    for c in &moved {
        move_pod(ctx, rng, c).await;
    }
    let back = Duration::from_secs(rng.range(15, 30));
    let (ctx2, node2) = (ctx.clone(), node.to_string());
    let t = tokio::spawn(async move {
        tokio::time::sleep(back).await;
        ctx2.procs.hold(&node2, false);
        ctx2.record.op("node-back", serde_json::json!({"node": node2}));
        // The agent tears down what the deleted pods left on the node before the taint goes, as
        // an operator removes it once the node is clean.
        let root = ctx2.roots[&node2].join("pods");
        let clean = async {
            loop {
                let left = host::mounts_under(&root).map(|m| m.len()).unwrap_or(1);
                if left == 0 && ctx2.procs.is_up(&node2) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(300), clean)
            .await
            .is_err()
        {
            ctx2.record.note("node-back-not-clean", &node2);
        }
        set_out_of_service(&ctx2, &node2, false).await;
        let mut w = ctx2.world();
        w.down.remove(&node2);
        w.cordoned.remove(&node2);
        drop(w);
        ctx2.record
            .op("out-of-service-untaint", serde_json::json!({"node": node2}));
    });
    ctx.followups.lock().unwrap_or_else(|p| p.into_inner()).push(t);
}

/// Loop devices named by the attachments of `node` (with their volume handles, which the agent
/// writes into the status beside the device), and those named by the attachments of every other
/// node. Read until it succeeds: the API may be down or squeezed.
async fn node_devices(ctx: &Arc<Ctx>, node: &str) -> (Vec<(String, String)>, BTreeSet<String>) {
    let vas: Api<VolumeAttachment> = Api::all(ctx.client.clone());
    for _ in 0..120 {
        let list = match vas.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => {
                ctx.api_failed("list attachments for power-off", e);
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut own = Vec::new();
        let mut others = BTreeSet::new();
        for va in &list.items {
            let meta = va.status.as_ref().and_then(|s| s.attachment_metadata.as_ref());
            let Some(dev) = meta.and_then(|m| m.get("devicePath")) else {
                continue;
            };
            if va.spec.node_name != node {
                others.insert(dev.clone());
            } else if let Some(h) = meta.and_then(|m| m.get("volumeHandle")) {
                own.push((dev.clone(), h.clone()));
            }
        }
        return (own, others);
    }
    (Vec::new(), BTreeSet::new())
}

/// Waits until the agent has mounted the pod's volume, then checks the data the previous pod
/// left (pattern generation, file-system UUID) and writes the next generation.
async fn verify(ctx: Arc<Ctx>, claim: String, pod: PodRef) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if ctx.stopping.load(Ordering::Relaxed) {
            return;
        }
        let (volume, io) = {
            let w = ctx.world();
            let Some(c) = w.claims.get(&claim) else { return };
            if c.pod.as_ref().map(|p| &p.uid) != Some(&pod.uid) {
                return;
            }
            (c.volume.clone(), c.io.clone())
        };
        let volume = match volume {
            Some(v) => v,
            None => {
                let Ok(c) = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), NS)
                    .get(&claim)
                    .await
                else {
                    continue;
                };
                let Some(v) = c.spec.and_then(|s| s.volume_name).filter(|v| !v.is_empty()) else {
                    continue;
                };
                if let Some(c) = ctx.world().claims.get_mut(&claim) {
                    c.volume = Some(v.clone());
                }
                v
            }
        };
        let target: PathBuf = ctx.roots[&pod.node]
            .join("pods")
            .join(&pod.uid)
            .join("volumes/kubernetes.io~csi")
            .join(&volume)
            .join("mount");
        let Some(mount) = host::mounts_under(&target)
            .unwrap_or_default()
            .into_iter()
            .find(|m| m.target == target)
        else {
            continue;
        };
        let _io = io.lock().await;
        let (generation, maybe_next, uuid_before, uid) = {
            let w = ctx.world();
            let Some(c) = w.claims.get(&claim) else { return };
            if c.pod.as_ref().map(|p| &p.uid) != Some(&pod.uid) {
                return;
            }
            (c.generation, c.maybe_next, c.fs_uuid.clone(), c.uid.clone())
        };
        let seed = ctx.seed;
        let dir = target.clone();
        let source = mount.source.clone();
        let uid2 = uid.clone();
        let read = tokio::task::spawn_blocking(move || {
            let data = host::read_pattern(&dir);
            let uuid = host::fs_uuid(&source);
            (data, uuid)
        })
        .await;
        let Ok((data, uuid)) = read else { continue };
        let data = match data {
            Ok(d) => d,
            Err(e) => {
                // The mount went away under us (a kill, a teardown): look again.
                ctx.record.note("pattern-read-failed", &format!("{claim}: {e}"));
                continue;
            }
        };
        let found = match &data {
            None if generation == 0 => Some(0),
            None => None,
            Some(b) if generation > 0 && *b == host::pattern(seed, &uid2, generation) => Some(generation),
            Some(b) if maybe_next && *b == host::pattern(seed, &uid2, generation + 1) => Some(generation + 1),
            Some(_) => None,
        };
        ctx.record.checks("pattern-intact", 1);
        if found.is_none() {
            ctx.record.violation(
                &format!("pattern:{claim}:{}", pod.uid),
                "data pattern not intact",
                format!(
                    "claim {claim} (volume {volume}) on {} in pod {}: expected generation {generation}{}, found {}",
                    pod.node,
                    pod.name,
                    if maybe_next { " or the next" } else { "" },
                    match &data {
                        None => "no pattern file".to_string(),
                        Some(b) => format!("{} bytes of other data", b.len()),
                    }
                ),
            );
        }
        match (&uuid, &uuid_before) {
            (Ok(now), Some(before)) => {
                ctx.record.checks("fs-uuid-unchanged", 1);
                if now != before {
                    ctx.record.violation(
                        &format!("uuid:{claim}:{now}"),
                        "file system reformatted",
                        format!(
                            "claim {claim} (volume {volume}): UUID {before} before, {now} on {} now",
                            pod.node
                        ),
                    );
                }
            }
            (Ok(_), None) => {}
            (Err(e), _) => ctx.record.note("blkid-failed", &format!("{claim}: {e:#}")),
        }
        let next = found.unwrap_or(generation) + 1;
        let bytes = host::pattern(seed, &uid, next);
        let dir = target.clone();
        let wrote = tokio::task::spawn_blocking(move || host::write_pattern(&dir, &bytes)).await;
        let mut w = ctx.world();
        if let Some(c) = w.claims.get_mut(&claim) {
            if let Ok(u) = &uuid {
                c.fs_uuid.get_or_insert_with(|| u.clone());
            }
            match wrote {
                Ok(Ok(())) => {
                    c.generation = next;
                    c.maybe_next = false;
                }
                _ => {
                    c.generation = next - 1;
                    c.maybe_next = true;
                }
            }
            if let Some(p) = c.pod.as_mut()
                && p.uid == pod.uid
            {
                p.verified = true;
            }
        }
        drop(w);
        ctx.record.op(
            "pod-verified",
            serde_json::json!({"claim": claim, "pod": pod.name, "node": pod.node, "generation": next}),
        );
        return;
    }
}

/// The external provisioner and deleter of `ext.soak.stowage.dev`: a PV pre-bound to each claim
/// the binder handed to it, and Released Delete volumes removed.
pub async fn external_provisioner(ctx: Arc<Ctx>) {
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    loop {
        // Runs through the clean-up too: Released Delete volumes must still be deleted then.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let Ok(claims) = ctx.claims().list(&ListParams::default()).await else {
            continue;
        };
        for c in claims.items {
            let ann = c.annotations();
            if ann
                .get("volume.kubernetes.io/storage-provisioner")
                .map(String::as_str)
                != Some(EXT_DRIVER)
                || c.spec.as_ref().and_then(|s| s.volume_name.as_ref()).is_some()
                || c.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let Some(uid) = c.uid() else { continue };
            let spec = c.spec.clone().unwrap_or_default();
            let class = spec.storage_class_name.clone().unwrap_or_default();
            let Some(cls) = CLASSES.iter().find(|k| k.name == class) else {
                continue;
            };
            let size = spec
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get("storage"))
                .map(|q| q.0.clone())
                .unwrap_or_else(|| "64Mi".into());
            let pv: PersistentVolume = match serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("pvc-{uid}"), "annotations": {"pv.kubernetes.io/provisioned-by": EXT_DRIVER}},
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": if cls.retain { "Retain" } else { "Delete" },
                    "storageClassName": class,
                    "claimRef": {"kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": NS, "name": c.name_any(), "uid": uid, "resourceVersion": c.resource_version()},
                    "csi": {"driver": EXT_DRIVER, "volumeHandle": format!("ext-{uid}")},
                },
            })) {
                Ok(p) => p,
                Err(_) => continue,
            };
            match pvs.create(&PostParams::default(), &pv).await {
                Ok(_) => ctx
                    .record
                    .op("external-provision", serde_json::json!({"claim": c.name_any()})),
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => ctx.api_failed("external provision", e),
            }
        }
        let Ok(list) = pvs.list(&ListParams::default()).await else {
            continue;
        };
        for p in list.items {
            let ours = p
                .annotations()
                .get("pv.kubernetes.io/provisioned-by")
                .map(String::as_str)
                == Some(EXT_DRIVER);
            let released = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released");
            let delete = p
                .spec
                .as_ref()
                .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
                == Some("Delete");
            if ours && released && delete && p.metadata.deletion_timestamp.is_none() {
                match pvs.delete(&p.name_any(), &DeleteParams::default()).await {
                    Ok(_) => ctx
                        .record
                        .op("external-delete", serde_json::json!({"volume": p.name_any()})),
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => ctx.api_failed("external delete", e),
                }
            }
        }
    }
}
