//! Expansions followed to the end: a claim asked to grow must reach the size in its
//! `status.capacity`, its volume's capacity and image must hold that size, and the file system a
//! pod mounts must have grown past the size before.
//!
//! Online growth of a mounted ext4 needs `CAP_SYS_RESOURCE`; without it the agent grows the file
//! system at the next mount of the device (docs/agent.md), so after quiescence a claim still short
//! has its pod moved (or a pod started), as the agent's event tells a user to do.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};

use super::pods::{move_pod, pod_mount, start_pod, still_mounted};
use super::{CLASSES, Ctx, PodRef};
use crate::host;
use crate::rng::Rng;

const MI: u64 = 1024 * 1024;

/// Bytes of a storage quantity in the forms the API writes sizes (`24Mi`, `1Gi`, `25165824`).
pub fn quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// The size a file system must exceed once its claim's `status.capacity` is `capacity`: the
/// largest size asked for before (`sizes_mi`, in MiB). A file system never outgrows its device,
/// so one larger than that was grown, or made on the grown device. `None` when nothing grew.
pub fn grown_past(sizes_mi: &[u64], capacity: u64) -> Option<u64> {
    sizes_mi.iter().map(|s| s * MI).filter(|s| *s < capacity).max()
}

fn storage(map: Option<&BTreeMap<String, Quantity>>) -> Option<u64> {
    map.and_then(|m| m.get("storage"))
        .and_then(|q| quantity_bytes(&q.0))
}

/// A claim's `status.capacity`, in bytes.
pub(super) fn capacity_of(c: &PersistentVolumeClaim) -> Option<u64> {
    storage(c.status.as_ref().and_then(|s| s.capacity.as_ref()))
}

/// `(spec request, status.capacity)` of a claim, in bytes.
fn request_and_capacity(c: &PersistentVolumeClaim) -> (Option<u64>, Option<u64>) {
    let req = storage(
        c.spec
            .as_ref()
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref()),
    );
    (req, capacity_of(c))
}

/// Asks for 8 MiB more, online when a pod runs on the claim.
pub(super) async fn expand(ctx: &Ctx, name: &str) {
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
                    c.sizes_mi.push(size);
                    c.resize_since.get_or_insert_with(tokio::time::Instant::now);
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

/// Checks the file system of `pod`'s mount of `volume` against the claim's `capacity` (read
/// before this call: the agent writes it only after the file system grew). Returns false when
/// the mount is not there (the pod went or was not mounted yet), so nothing was checked.
pub(super) async fn check_fs_grown(
    ctx: &Ctx,
    claim: &str,
    pod: &PodRef,
    volume: &str,
    capacity: u64,
    sizes_mi: &[u64],
) -> bool {
    let Some(floor) = grown_past(sizes_mi, capacity) else {
        return true;
    };
    let Some(mount) = pod_mount(ctx, pod, volume) else {
        return false;
    };
    let source = mount.source.clone();
    let fs = tokio::task::spawn_blocking(move || host::ext_fs_bytes(Path::new(&source))).await;
    match fs {
        Ok(Ok(bytes)) => {
            judge_fs_size(ctx, claim, volume, &pod.node, capacity, floor, bytes);
            true
        }
        Ok(Err(e)) => {
            // Unless the mount went meanwhile, a mounted volume's device must show its superblock.
            if still_mounted(ctx, pod, volume, &mount.source) {
                ctx.record.violation(
                    &format!("fs-size:{claim}:{}", pod.uid),
                    "no ext file system on a mounted volume's device",
                    format!("claim {claim} (volume {volume}) on {}: {e:#}", pod.node),
                );
            }
            false
        }
        Err(_) => false,
    }
}

fn judge_fs_size(ctx: &Ctx, claim: &str, volume: &str, node: &str, capacity: u64, floor: u64, bytes: u64) {
    ctx.record.checks("fs-grown-with-claim", 1);
    if bytes <= floor {
        ctx.record.violation(
            &format!("fs-grown:{claim}:{capacity}"),
            "file system not grown with its claim",
            format!(
                "claim {claim} (volume {volume}) on {node}: status.capacity {} MiB, but the file system holds {bytes} bytes, no more than the {} MiB before",
                capacity / MI,
                floor / MI
            ),
        );
    }
}

/// Follows the pending expansions (a claim asking for more than its `status.capacity` shows):
/// counts each one finished, and checks the file system of a pod mounted on it then.
pub async fn follow(ctx: Arc<Ctx>) {
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if ctx.stopping.load(Ordering::Relaxed) {
            return;
        }
        let pending: BTreeSet<String> = ctx
            .world()
            .claims
            .iter()
            .filter(|(_, c)| c.resize_since.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        if pending.is_empty() {
            continue;
        }
        let Ok(list) = ctx.claims().list(&ListParams::default()).await else {
            continue;
        };
        for c in list.items {
            let name = c.name_any();
            if !pending.contains(&name) {
                continue;
            }
            let (Some(req), Some(cap)) = request_and_capacity(&c) else {
                continue;
            };
            if cap < req {
                continue;
            }
            let (since, pod, volume, sizes) = {
                let mut w = ctx.world();
                let Some(s) = w
                    .claims
                    .get_mut(&name)
                    .filter(|s| Some(&s.uid) == c.uid().as_ref())
                else {
                    continue;
                };
                (
                    s.resize_since.take(),
                    s.pod.clone(),
                    s.volume.clone(),
                    s.sizes_mi.clone(),
                )
            };
            ctx.record.op(
                "expansion-finished",
                serde_json::json!({"claim": name, "capacity_mi": cap / MI, "seconds": since.map(|t| t.elapsed().as_secs())}),
            );
            if let (Some(p), Some(v)) = (pod.filter(|p| p.verified), volume) {
                check_fs_grown(&ctx, &name, &p, &v, cap, &sizes).await;
            }
        }
    }
}

/// One loop claim asked to grow, as the API shows it after quiescence.
struct Grown {
    name: String,
    request: u64,
    capacity: u64,
    volume: Option<String>,
}

/// The loop claims whose request is above the size they were created with.
async fn grown_claims(ctx: &Ctx) -> Option<Vec<Grown>> {
    let list = ctx.claims().list(&ListParams::default()).await.ok()?;
    let w = ctx.world();
    Some(
        list.items
            .iter()
            .filter_map(|c| {
                let s = w.claims.get(&c.name_any())?;
                let first = s.sizes_mi.first()? * MI;
                let (req, cap) = request_and_capacity(c);
                let req = req?;
                (CLASSES[s.class].looped && req > first).then(|| Grown {
                    name: c.name_any(),
                    request: req,
                    capacity: cap.unwrap_or(0),
                    volume: c.spec.as_ref().and_then(|s| s.volume_name.clone()),
                })
            })
            .collect(),
    )
}

/// After quiescence: every grown loop claim finishes (its pod moved, or a pod started, when the
/// file system can only grow at the next mount), then claim, volume, image and file system are
/// checked against the request. Bounded by `limit`; a claim still short then is a violation.
pub async fn settle(ctx: &Arc<Ctx>, rng: &mut Rng, images: &Path, limit: Duration) {
    let record = &ctx.record;
    let start = tokio::time::Instant::now();
    // Time for a growth to finish where it is: online where the agent may grow a mounted ext4,
    // else only for the controller's part.
    let online = host::may_grow_mounted_ext4();
    let online_grace = Duration::from_secs(if online { 30 } else { 5 });
    record.log(
        "settling-expansions",
        serde_json::json!({"online_growth_permitted": online}),
    );
    let mut remounted = BTreeMap::new();
    let grown = loop {
        let Some(grown) = grown_claims(ctx).await else {
            if start.elapsed() > limit {
                record.note("expansions-not-settled", "the claims could not be listed");
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let short: Vec<&Grown> = grown.iter().filter(|g| g.capacity < g.request).collect();
        let unverified = {
            let w = ctx.world();
            grown.iter().any(|g| {
                w.claims
                    .get(&g.name)
                    .and_then(|c| c.pod.as_ref())
                    .is_some_and(|p| !p.verified)
            })
        };
        if (short.is_empty() && !unverified) || start.elapsed() > limit {
            break grown;
        }
        if start.elapsed() > online_grace {
            for g in short {
                // A larger request waits for the node's step of the one before (as upstream), so
                // one claim may need a mount per step: again once the last one had its time.
                if remounted
                    .get(&g.name)
                    .is_some_and(|t: &tokio::time::Instant| t.elapsed() < online_grace)
                {
                    continue;
                }
                let pod = ctx.world().claims.get(&g.name).and_then(|c| c.pod.clone());
                if pod.as_ref().is_some_and(|p| !p.verified) {
                    continue; // still mounting
                }
                let done = if pod.is_some() {
                    move_pod(ctx, rng, &g.name).await
                } else if let Some(node) = rng.pick(&ctx.schedulable()).cloned() {
                    start_pod(ctx, &g.name, &node).await
                } else {
                    false
                };
                if done {
                    remounted.insert(g.name.clone(), tokio::time::Instant::now());
                    record.op(
                        "remount-for-resize",
                        serde_json::json!({"claim": g.name, "pod_moved": pod.is_some(), "capacity_mi": g.capacity / MI}),
                    );
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    for g in grown {
        record.checks("expansion-reached-size", 1);
        let mi = |b: u64| b / MI;
        if g.capacity < g.request {
            record.violation(
                &format!("expansion:{}", g.name),
                "expansion not finished after quiescence",
                format!(
                    "claim {} asks for {} MiB, status.capacity is {} MiB after {limit:?}",
                    g.name,
                    mi(g.request),
                    mi(g.capacity)
                ),
            );
            continue;
        }
        let Some(volume) = g.volume else { continue };
        let pv = match pvs.get(&volume).await {
            Ok(pv) => pv,
            Err(e) => {
                ctx.api_failed("get grown volume", e);
                continue;
            }
        };
        let pv_cap = storage(pv.spec.as_ref().and_then(|s| s.capacity.as_ref())).unwrap_or(0);
        if pv_cap < g.request {
            record.violation(
                &format!("expansion-pv:{}", g.name),
                "volume smaller than its grown claim",
                format!(
                    "{volume} has {} MiB, claim {} {} MiB",
                    mi(pv_cap),
                    g.name,
                    mi(g.request)
                ),
            );
        }
        if let Some(handle) = pv
            .spec
            .as_ref()
            .and_then(|s| s.csi.as_ref())
            .map(|c| c.volume_handle.clone())
        {
            let image = images.join(format!("{handle}.img"));
            let len = std::fs::metadata(&image).map(|m| m.len()).unwrap_or(0);
            if len < g.request {
                record.violation(
                    &format!("expansion-img:{}", g.name),
                    "image smaller than its grown claim",
                    format!(
                        "{} is {len} bytes, claim {} {} MiB",
                        image.display(),
                        g.name,
                        mi(g.request)
                    ),
                );
            }
        }
        let (pod, sizes) = {
            let w = ctx.world();
            let c = w.claims.get(&g.name);
            (
                c.and_then(|c| c.pod.clone()),
                c.map(|c| c.sizes_mi.clone()).unwrap_or_default(),
            )
        };
        if let Some(p) = pod.filter(|p| p.verified)
            && !check_fs_grown(ctx, &g.name, &p, &volume, g.capacity, &sizes).await
        {
            record.note(
                "grown-fs-not-checked",
                &format!("{}: no mount of pod {}", g.name, p.name),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_in_the_forms_the_api_writes_sizes() {
        assert_eq!(quantity_bytes("24Mi"), Some(24 * MI));
        assert_eq!(quantity_bytes("1Gi"), Some(1024 * MI));
        assert_eq!(quantity_bytes("25165824"), Some(24 * MI));
        assert_eq!(quantity_bytes("2k"), Some(2000));
        assert_eq!(quantity_bytes("1.5Gi"), None);
        assert_eq!(quantity_bytes(""), None);
    }

    #[test]
    fn a_file_system_must_outgrow_the_size_asked_before_its_capacity() {
        let sizes = [16, 24, 32];
        assert_eq!(grown_past(&sizes, 16 * MI), None, "never grown");
        assert_eq!(grown_past(&sizes, 24 * MI), Some(16 * MI));
        assert_eq!(grown_past(&sizes, 32 * MI), Some(24 * MI));
        // A capacity between the sizes asked (a request lost in an outage): the one below.
        assert_eq!(grown_past(&sizes, 28 * MI), Some(24 * MI));
    }
}
