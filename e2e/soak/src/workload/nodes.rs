//! Nodes: drained (cordon, pods moved, uncordon), shut down (agent killed and held, devices
//! freed, out-of-service taint, pods moved, node back later) or partitioned (agent killed and
//! held, mounts kept and written through, out-of-service taint, pods moved; the other node's
//! mount must be refused until the partitioned node goes; node back later).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};

use super::pods::{move_pod, pod_mount, pod_volume_dir, still_mounted};
use super::{CLASSES, Ctx, NS, PodRef, World};
use crate::host;
use crate::observer::OUT_OF_SERVICE;
use crate::rng::Rng;

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
pub(super) async fn drain(ctx: &Arc<Ctx>, rng: &mut Rng, node: &str) {
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
pub(super) async fn out_of_service(ctx: &Arc<Ctx>, rng: &mut Rng, node: &str) {
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
        node_back(&ctx2, &node2).await;
    });
    ctx.followups.lock().unwrap_or_else(|p| p.into_inner()).push(t);
}

/// The node comes back: its agent starts and cleans up what the deleted pods left on it, then the
/// out-of-service taint goes, as an operator removes it once the node is clean.
async fn node_back(ctx2: &Arc<Ctx>, node2: &str) {
    {
        let node2 = node2.to_string();
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
        set_out_of_service(ctx2, &node2, false).await;
        let mut w = ctx2.world();
        w.down.remove(&node2);
        w.cordoned.remove(&node2);
        drop(w);
        ctx2.record
            .op("out-of-service-untaint", serde_json::json!({"node": node2}));
    }
}

/// The claim on `node` a partition writes through and follows: a loop claim whose pod there is
/// verified and whose pattern generation is known.
pub(super) fn partition_subject(w: &World, node: &str) -> Option<(String, PodRef, String)> {
    w.claims.iter().find_map(|(name, c)| {
        let p = c.pod.as_ref()?;
        let v = c.volume.clone()?;
        (CLASSES[c.class].looped && p.node == node && p.verified && !c.maybe_next)
            .then(|| (name.clone(), p.clone(), v))
    })
}

/// How long a partition waits for the other node's mount to be refused in the name of
/// multi-mount protection: the controller's release and the new attachment, then the kernel's own
/// wait (about 21 s with the 5 s MMP interval) and the agent's retries.
const FENCE_WAIT: Duration = Duration::from_secs(180);

/// A node is partitioned, not shut down: its agent is killed and kept down but its kernel goes on,
/// so its mounts and loop devices stay, and the soak writes one more pattern generation through
/// its mount of a volume. The admin marks it out of service and its pods start on the other node,
/// which the released attachment lets attach the volume. Its mount must be refused (multi-mount
/// protection, said in a FailedMount Event) for as long as the partitioned node's mount is there;
/// then that node goes (powered off: its mounts and devices gone), the other node's mount goes
/// through, and its verifier must read the generation written through the partitioned mount.
pub(super) async fn partition(ctx: &Arc<Ctx>, rng: &mut Rng, node: &str) {
    let (claim, pod, volume, io) = {
        let mut w = ctx.world();
        if !w.down.is_empty() {
            return;
        }
        let Some((claim, pod, volume)) = partition_subject(&w, node) else {
            return;
        };
        w.down.insert(node.to_string());
        w.cordoned.insert(node.to_string());
        let io = w.claims[&claim].io.clone();
        (claim, pod, volume, io)
    };
    ctx.procs.hold(node, true);
    ctx.procs.kill(node, Duration::ZERO);
    let root = ctx.roots[node].clone();
    // One more generation through the partitioned node's mount: its kernel still writes.
    let written = {
        let _io = io.lock().await;
        let (uid, generation) = {
            let w = ctx.world();
            let c = &w.claims[&claim];
            (c.uid.clone(), c.generation)
        };
        let next = generation + 1;
        let source = pod_mount(ctx, &pod, &volume).map(|m| m.source);
        let dir = pod_volume_dir(ctx, &pod, &volume);
        let bytes = host::pattern(ctx.seed, &uid, next);
        let wrote = tokio::task::spawn_blocking(move || host::write_pattern(&dir, &bytes)).await;
        let landed = matches!(wrote, Ok(Ok(())))
            && source
                .as_deref()
                .is_some_and(|s| still_mounted(ctx, &pod, &volume, s));
        let mut w = ctx.world();
        if let Some(c) = w.claims.get_mut(&claim) {
            if landed {
                c.generation = next;
            } else {
                c.maybe_next = true;
            }
        }
        landed.then_some(next)
    };
    // Its attached devices nothing mounts (other volumes attached there) go at power-off too:
    // read now, while its attachments still name them (the taint releases them).
    let (own, _) = node_devices(ctx, node).await;
    let devices: BTreeSet<String> = host::mounts_under(&root)
        .unwrap_or_default()
        .into_iter()
        .map(|m| m.source)
        .filter(|s| s.starts_with("/dev/loop"))
        .collect();
    ctx.fenced
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(devices.iter().cloned());
    ctx.record.op(
        "partition",
        serde_json::json!({"node": node, "claim": claim, "volume": volume, "written_generation": written, "devices": devices}),
    );
    if !set_out_of_service(ctx, node, true).await {
        ctx.record.note("taint-failed", node);
    }
    let moved = pods_on(ctx, node);
    ctx.record.op(
        "partition-taint",
        serde_json::json!({"node": node, "pods": moved}),
    );
    for c in &moved {
        move_pod(ctx, rng, c).await;
    }
    let back = Duration::from_secs(rng.range(15, 30));
    let (ctx2, node2) = (ctx.clone(), node.to_string());
    ctx.world().fence_watched.insert(claim.clone());
    let t = tokio::spawn(async move {
        let ctx = &ctx2;
        let fenced = watch_fence(ctx, &claim, &volume, &devices).await;
        ctx.world().fence_watched.remove(&claim);
        // The partitioned node goes; only then may the other node mount. Its devices are those
        // its mounts are on and those its attachments named at the partition, but none another
        // node's attachment names now (one kernel plays both nodes: the other may have taken
        // over a device nothing mounted).
        let root = root.clone();
        let (_, others) = node_devices(ctx, &node2).await;
        let powered_off = tokio::task::spawn_blocking(move || host::power_off(&root, &own, &others))
            .await
            .unwrap_or_default();
        {
            let mut f = ctx.fenced.lock().unwrap_or_else(|p| p.into_inner());
            for d in &devices {
                f.remove(d);
            }
        }
        ctx.record.op(
            "partition-ended",
            serde_json::json!({"node": node2, "fenced": fenced, "power_off": powered_off}),
        );
        tokio::time::sleep(back).await;
        node_back(ctx, &node2).await;
    });
    ctx.followups.lock().unwrap_or_else(|p| p.into_inner()).push(t);
}

/// Watches the claim's new pod while the partitioned node's `devices` are still mounted: a mount
/// of the volume there is a violation (two kernels' mounts of one ext4); a FailedMount Event
/// naming multi-mount protection is the fence seen working. Whether it was seen.
async fn watch_fence(ctx: &Arc<Ctx>, claim: &str, volume: &str, devices: &BTreeSet<String>) -> bool {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(ctx.client.clone(), NS);
    let deadline = tokio::time::Instant::now() + FENCE_WAIT;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(pod) = ctx.world().claims.get(claim).and_then(|c| c.pod.clone()) else {
            continue;
        };
        if let Some(m) = pod_mount(ctx, &pod, volume)
            && !devices.contains(&m.source)
        {
            ctx.record.violation(
                &format!("partition-mount2:{claim}"),
                "volume mounted while a partitioned node still mounts it",
                format!(
                    "claim {claim} (volume {volume}) mounted by {} on {} while the partitioned node's devices {devices:?} are mounted",
                    pod.node, m.source
                ),
            );
            return false;
        }
        let lp = ListParams::default().fields(&format!("involvedObject.name={}", pod.name));
        let Ok(list) = events.list(&lp).await else {
            continue;
        };
        if let Some(e) = list.items.iter().find(|e| {
            e.reason.as_deref() == Some("FailedMount")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains("multi-mount protection"))
        }) {
            ctx.record.checks("partition-fenced", 1);
            ctx.record.log(
                "partition-fenced",
                serde_json::json!({"claim": claim, "pod": pod.name, "node": pod.node, "message": e.message}),
            );
            return true;
        }
    }
    ctx.record.violation(
        &format!("partition-unfenced:{claim}"),
        "no multi-mount protection refusal seen for a partitioned volume",
        format!(
            "claim {claim} (volume {volume}): no FailedMount Event naming multi-mount protection on its new pod within {FENCE_WAIT:?} while the partitioned node kept its mount"
        ),
    );
    false
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
