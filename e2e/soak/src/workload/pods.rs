//! Pods: started on a node (the soak plays the scheduler), moved, deleted, and the verifier that
//! checks and rewrites the data pattern once the agent has mounted the volume.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use stowage_testkit::builders::pod;

use super::claims::adopt;
use super::expansion::{capacity_of, check_fs_grown};
use super::{CLASSES, Ctx, NS, PodRef, delete_now};
use crate::host;
use crate::rng::Rng;

/// Creates a pod for claim `name` on `node` (setting selected-node first for a
/// WaitForFirstConsumer claim, as the scheduler does) and starts its verifier.
pub(super) async fn start_pod(ctx: &Arc<Ctx>, name: &str, node: &str) -> bool {
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
pub(super) async fn delete_pod(ctx: &Ctx, name: &str) -> bool {
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

/// Moves the pod of claim `name` to another schedulable node; whether it was moved.
pub(super) async fn move_pod(ctx: &Arc<Ctx>, rng: &mut Rng, name: &str) -> bool {
    let Some(from) = ctx
        .world()
        .claims
        .get(name)
        .and_then(|c| c.pod.as_ref().map(|p| p.node.clone()))
    else {
        return false;
    };
    let others: Vec<String> = ctx.schedulable().into_iter().filter(|n| *n != from).collect();
    let Some(to) = rng.pick(&others).cloned() else {
        return false;
    };
    if delete_pod(ctx, name).await && start_pod(ctx, name, &to).await {
        ctx.record.op(
            "move-pod",
            serde_json::json!({"claim": name, "from": from, "to": to}),
        );
        return true;
    }
    false
}

/// Where the agent mounts `volume` for `pod` (the kubelet's layout under the node's root dir).
pub(super) fn pod_volume_dir(ctx: &Ctx, pod: &PodRef, volume: &str) -> PathBuf {
    ctx.roots[&pod.node]
        .join("pods")
        .join(&pod.uid)
        .join("volumes/kubernetes.io~csi")
        .join(volume)
        .join("mount")
}

/// The pod's mount of `volume`, once the agent has made it.
pub(super) fn pod_mount(ctx: &Ctx, pod: &PodRef, volume: &str) -> Option<host::Mount> {
    let target = pod_volume_dir(ctx, pod, volume);
    host::mounts_under(&target)
        .unwrap_or_default()
        .into_iter()
        .find(|m| m.target == target)
}

/// Whether the pod's mount of `volume` is still the one from `source`. A node power-off or a
/// kill's teardown can unmount a volume between a look at the mount table and a read or write;
/// only I/O through a mount still in place afterwards says anything about the volume.
pub(super) fn still_mounted(ctx: &Ctx, pod: &PodRef, volume: &str, source: &str) -> bool {
    pod_mount(ctx, pod, volume).is_some_and(|m| m.source == source)
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
        let target = pod_volume_dir(&ctx, &pod, &volume);
        let Some(mount) = pod_mount(&ctx, &pod, &volume) else {
            continue;
        };
        let _io = io.lock().await;
        let (generation, maybe_next, uuid_before, uid, sizes) = {
            let w = ctx.world();
            let Some(c) = w.claims.get(&claim) else { return };
            if c.pod.as_ref().map(|p| &p.uid) != Some(&pod.uid) {
                return;
            }
            (
                c.generation,
                c.maybe_next,
                c.fs_uuid.clone(),
                c.uid.clone(),
                c.sizes_mi.clone(),
            )
        };
        // Read before the file system: the agent writes a larger capacity only once it grew.
        let capacity = if sizes.len() > 1 {
            ctx.claims().get(&claim).await.ok().and_then(|c| capacity_of(&c))
        } else {
            None
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
        // A node powered off (or a kill's teardown) may unmount the volume between the look at
        // the mount table and the read: the read then saw the bare directory, which says nothing
        // about the volume's data. Only a read from a mount still in place is evidence.
        if found.is_none() && !still_mounted(&ctx, &pod, &volume, &mount.source) {
            ctx.record.note(
                "pattern-read-mount-gone",
                &format!("{claim}: the mount went during the read"),
            );
            continue;
        }
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
            (Err(e), _) => {
                // A mounted ext4 always has a UUID: unless the mount went meanwhile (then look
                // again), a probe that finds none means the device holds something else.
                if still_mounted(&ctx, &pod, &volume, &mount.source) {
                    ctx.record.violation(
                        &format!("uuid-missing:{claim}:{}", pod.uid),
                        "no file-system UUID on a mounted volume",
                        format!(
                            "claim {claim} (volume {volume}) on {}, {}: {e:#}",
                            pod.node, mount.source
                        ),
                    );
                } else {
                    ctx.record
                        .note("blkid-failed-mount-gone", &format!("{claim}: {e:#}"));
                    continue;
                }
            }
        }
        if let Some(cap) = capacity {
            check_fs_grown(&ctx, &claim, &pod, &volume, cap, &sizes).await;
        }
        let next = found.unwrap_or(generation) + 1;
        let bytes = host::pattern(seed, &uid, next);
        let dir = target.clone();
        let wrote = tokio::task::spawn_blocking(move || host::write_pattern(&dir, &bytes)).await;
        // A write that returned while the mount went away may have landed in the bare
        // directory: then the volume holds either generation, as after a failed write.
        let landed = matches!(wrote, Ok(Ok(()))) && still_mounted(&ctx, &pod, &volume, &mount.source);
        let mut w = ctx.world();
        if let Some(c) = w.claims.get_mut(&claim) {
            if let Ok(u) = &uuid {
                c.fs_uuid.get_or_insert_with(|| u.clone());
            }
            if landed {
                c.generation = next;
                c.maybe_next = false;
            } else {
                c.generation = next - 1;
                c.maybe_next = true;
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
