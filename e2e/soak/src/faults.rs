//! Faults at seeded times, one at a time: SIGKILL the leader, SIGKILL an agent (preferably while
//! a volume on its node waits to grow, or a pod there waits for its mount), restart
//! kube-apiserver, restart etcd with its data kept, pause the image store (its file system
//! frozen), and squeeze the controller's API priority level.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use kube::api::{Api, DeleteParams, PostParams};
use stowage_testkit::ControlPlane;

use crate::cluster::{CONTROLLER_SA, Role, leader};
use crate::host::ImageStore;
use crate::rng::Rng;
use crate::workload::{CLASSES, Ctx};

pub const KINDS: [&str; 6] = [
    "leader-kill",
    "agent-kill",
    "apiserver-restart",
    "etcd-restart",
    "image-store-pause",
    "api-slow",
];

pub const APF_NAME: &str = "soak-slow";

pub struct Faults {
    /// A client with the controller's own identity: during a squeeze it keeps the squeezed level
    /// busy, as a noisy neighbour sharing the controller's flow would.
    pub neighbour: kube::Client,
    pub ctx: Arc<Ctx>,
    pub cp: Arc<ControlPlane>,
    pub store: Arc<ImageStore>,
}

impl Faults {
    /// Injects faults until `until`: each round takes every kind once in a shuffled order, with
    /// seeded gaps between them, so a run long enough for one round sees every kind.
    pub async fn run(&self, mut rng: Rng, until: tokio::time::Instant, gap: (u64, u64)) {
        tokio::time::sleep(Duration::from_secs(rng.range(gap.0, gap.1))).await;
        let mut round: Vec<&str> = Vec::new();
        while tokio::time::Instant::now() < until {
            if round.is_empty() {
                round = KINDS.to_vec();
                rng.shuffle(&mut round);
            }
            let kind = round.remove(0);
            self.inject(kind, &mut rng).await;
            tokio::time::sleep(Duration::from_secs(rng.range(gap.0, gap.1))).await;
        }
    }

    async fn inject(&self, kind: &str, rng: &mut Rng) {
        let record = &self.ctx.record;
        match kind {
            "leader-kill" => {
                let Some(holder) = leader(&self.ctx.client).await else {
                    record.note("fault-skipped", "leader-kill: no leader");
                    return;
                };
                // Sometimes back before its Lease (4 s) ran out, sometimes after a standby took it.
                let back = Duration::from_millis(rng.range(500, 8000));
                if self.ctx.procs.kill(&holder, back) {
                    record.fault(
                        kind,
                        serde_json::json!({"killed": holder, "restart_after_ms": back.as_millis() as u64}),
                    );
                } else {
                    record.note("fault-skipped", &format!("leader-kill: {holder} not running"));
                }
            }
            "agent-kill" => {
                // Prefer a node where a volume's file system waits to grow (a pending expansion
                // of a claim with a pod there: the kill lands mid-resize, and mid-mount too when
                // the pod still waits for its volume, the mount being where an offline growth
                // runs), then one where a pod waits for its mount.
                let (resizing, mounting, up) = {
                    let w = self.ctx.world();
                    let up: Vec<String> = self
                        .ctx
                        .procs
                        .names(Role::Agent)
                        .into_iter()
                        .filter(|n| !w.down.contains(n))
                        .collect();
                    let pods = || {
                        w.claims
                            .values()
                            .filter(|c| CLASSES[c.class].looped)
                            .filter_map(|c| c.pod.as_ref().map(|p| (c, p)))
                            .filter(|(_, p)| up.contains(&p.node))
                    };
                    let resizing: Vec<(String, bool)> = pods()
                        .filter(|(c, _)| c.resize_since.is_some())
                        .map(|(_, p)| (p.node.clone(), !p.verified))
                        .collect();
                    let mounting: Vec<String> = pods()
                        .filter(|(_, p)| !p.verified)
                        .map(|(_, p)| p.node.clone())
                        .collect();
                    (resizing, mounting, up)
                };
                let both: Vec<String> = resizing
                    .iter()
                    .filter(|(_, m)| *m)
                    .map(|(n, _)| n.clone())
                    .collect();
                let resizing: Vec<String> = resizing.into_iter().map(|(n, _)| n).collect();
                let (pool, mid_resize, mid_mount) = if !both.is_empty() {
                    (&both, true, true)
                } else if !resizing.is_empty() {
                    (&resizing, true, false)
                } else if !mounting.is_empty() {
                    (&mounting, false, true)
                } else {
                    (&up, false, false)
                };
                let Some(node) = rng.pick(pool).cloned() else {
                    record.note("fault-skipped", "agent-kill: no agent up");
                    return;
                };
                let back = Duration::from_millis(rng.range(500, 3000));
                if self.ctx.procs.kill(&node, back) {
                    record.fault(kind, serde_json::json!({"node": node, "mid_mount": mid_mount, "mid_resize": mid_resize, "restart_after_ms": back.as_millis() as u64}));
                }
            }
            "apiserver-restart" => {
                let down = Duration::from_millis(rng.range(500, 5000));
                let hard = rng.chance(50);
                record.fault(kind, serde_json::json!({"down_ms": down.as_millis() as u64, "signal": if hard {"SIGKILL"} else {"SIGTERM"}}));
                let cp = self.cp.clone();
                let r = tokio::task::spawn_blocking(move || {
                    if hard {
                        cp.kill_and_restart_apiserver(down)
                    } else {
                        cp.restart_apiserver(down)
                    }
                })
                .await;
                if let Ok(Err(e)) | Err(e) = r.map_err(anyhow::Error::from) {
                    record.note("apiserver-restart-failed", &format!("{e:#}"));
                }
                record.log("fault-end", serde_json::json!({"fault": kind}));
            }
            "etcd-restart" => {
                let down = Duration::from_millis(rng.range(500, 5000));
                record.fault(
                    kind,
                    serde_json::json!({"down_ms": down.as_millis() as u64, "data_dir": "kept"}),
                );
                let cp = self.cp.clone();
                let r = tokio::task::spawn_blocking(move || cp.restart_etcd(down)).await;
                if let Ok(Err(e)) | Err(e) = r.map_err(anyhow::Error::from) {
                    record.note("etcd-restart-failed", &format!("{e:#}"));
                }
                record.log("fault-end", serde_json::json!({"fault": kind}));
            }
            "image-store-pause" => {
                let pause = Duration::from_millis(rng.range(4000, 12000));
                let store = self.store.clone();
                match tokio::task::spawn_blocking(move || store.freeze()).await {
                    Ok(Ok(())) => {
                        record.fault(kind, serde_json::json!({"paused_ms": pause.as_millis() as u64}));
                        tokio::time::sleep(pause).await;
                        self.thaw().await;
                        record.log("fault-end", serde_json::json!({"fault": kind}));
                    }
                    other => record.note("fault-skipped", &format!("image-store-pause: {other:?}")),
                }
            }
            "api-slow" => {
                let hold = Duration::from_millis(rng.range(10000, 25000));
                match squeeze(&self.ctx.client).await {
                    Ok(()) => {
                        record.fault(kind, serde_json::json!({"for_ms": hold.as_millis() as u64, "priority_level": APF_NAME}));
                        let before = apf_counts(&self.ctx.client).await;
                        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
                        let noise: Vec<_> = (0..6)
                            .map(|_| {
                                let (c, stop) = (self.neighbour.clone(), stop.clone());
                                tokio::spawn(async move {
                                    let api: Api<k8s_openapi::api::events::v1::Event> = Api::all(c);
                                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                                        if api.list(&Default::default()).await.is_err() {
                                            tokio::time::sleep(Duration::from_millis(50)).await;
                                        }
                                    }
                                })
                            })
                            .collect();
                        tokio::time::sleep(hold).await;
                        stop.store(true, std::sync::atomic::Ordering::Relaxed);
                        for n in noise {
                            let _ = n.await;
                        }
                        let after = apf_counts(&self.ctx.client).await;
                        release(&self.ctx.client).await;
                        if let (Some(b), Some(a)) = (before, after) {
                            record.measured("dispatched", a.0.saturating_sub(b.0));
                            record.measured("rejected_429", a.1.saturating_sub(b.1));
                            record.measured("queued_ms", a.2.saturating_sub(b.2));
                            record.log("api-slow-effect", serde_json::json!({"dispatched": a.0.saturating_sub(b.0), "rejected": a.1.saturating_sub(b.1), "queued_ms": a.2.saturating_sub(b.2)}));
                        }
                        record.log("fault-end", serde_json::json!({"fault": kind}));
                    }
                    Err(e) => {
                        record.note("fault-skipped", &format!("api-slow: {e:#}"));
                        release(&self.ctx.client).await;
                    }
                }
            }
            _ => unreachable!("unknown fault kind {kind}"),
        }
    }

    pub async fn thaw(&self) {
        let store = self.store.clone();
        for _ in 0..20 {
            let s = store.clone();
            match tokio::task::spawn_blocking(move || s.thaw()).await {
                Ok(Ok(())) => return,
                other => {
                    // "Invalid argument" means it is not frozen (any more).
                    if matches!(&other, Ok(Err(e)) if format!("{e:#}").contains("Invalid argument")) {
                        return;
                    }
                    self.ctx.record.note("thaw-failed", &format!("{other:?}"));
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }
}

/// A priority level with the least concurrency an apiserver hands out (one share of ~245: 3 seats
/// of 600), no borrowing and a short single queue, and a FlowSchema sending every request of the
/// controller's service account to it: its requests wait in the queue or are answered 429.
async fn squeeze(client: &kube::Client) -> anyhow::Result<()> {
    let pp = PostParams::default();
    let level: PriorityLevelConfiguration = serde_json::from_value(serde_json::json!({
        "metadata": {"name": APF_NAME},
        "spec": {"type": "Limited", "limited": {
            "nominalConcurrencyShares": 1, "lendablePercent": 0, "borrowingLimitPercent": 0,
            "limitResponse": {"type": "Queue", "queuing": {"queues": 1, "handSize": 1, "queueLengthLimit": 4}}}},
    }))?;
    Api::<PriorityLevelConfiguration>::all(client.clone())
        .create(&pp, &level)
        .await?;
    let schema: FlowSchema = serde_json::from_value(serde_json::json!({
        "metadata": {"name": APF_NAME},
        "spec": {
            "priorityLevelConfiguration": {"name": APF_NAME},
            "matchingPrecedence": 50,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{
                "subjects": [{"kind": "ServiceAccount",
                              "serviceAccount": {"namespace": CONTROLLER_SA.0, "name": CONTROLLER_SA.1}}],
                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                   "clusterScope": true, "namespaces": ["*"]}],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }],
        },
    }))?;
    Api::<FlowSchema>::all(client.clone())
        .create(&pp, &schema)
        .await?;
    Ok(())
}

/// The squeezed level's totals in the apiserver's metrics: requests dispatched, rejected, and
/// milliseconds spent waiting in its queue.
async fn apf_counts(client: &kube::Client) -> Option<(u64, u64, u64)> {
    let req = http::Request::get("/metrics").body(Vec::new()).ok()?;
    let text = client.request_text(req).await.ok()?;
    let level = format!("priority_level=\"{APF_NAME}\"");
    let (mut dispatched, mut rejected, mut waited) = (0.0, 0.0, 0.0);
    for line in text.lines().filter(|l| l.contains(&level)) {
        let value: f64 = line.rsplit(' ').next()?.parse().ok()?;
        if line.starts_with("apiserver_flowcontrol_dispatched_requests_total{") {
            dispatched += value;
        } else if line.starts_with("apiserver_flowcontrol_rejected_requests_total{") {
            rejected += value;
        } else if line.starts_with("apiserver_flowcontrol_request_wait_duration_seconds_sum{") {
            waited += value;
        }
    }
    Some((dispatched as u64, rejected as u64, (waited * 1000.0) as u64))
}

fn gone<T>(r: &Result<T, kube::Error>) -> bool {
    match r {
        Ok(_) => true,
        Err(kube::Error::Api(s)) => s.code == 404,
        Err(_) => false,
    }
}

/// Removes the squeeze (retried: the apiserver may be restarting).
pub async fn release(client: &kube::Client) {
    for _ in 0..60 {
        let a = Api::<FlowSchema>::all(client.clone())
            .delete(APF_NAME, &DeleteParams::default())
            .await;
        let b = Api::<PriorityLevelConfiguration>::all(client.clone())
            .delete(APF_NAME, &DeleteParams::default())
            .await;
        if gone(&a) && gone(&b) {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
