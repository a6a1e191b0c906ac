//! The end of a run: quiescence (every node back, every process up, every claim Bound, every pod's
//! data checked), then the clean-up and the leak checks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};

use crate::faults::{self, Faults};
use crate::host;
use crate::observer::Observer;
use crate::rng::Rng;
use crate::workload::{self, CLASSES, Ctx, LOOP_DRIVER, NS};
use crate::{Options, wait_for};

/// After the churn: every node back, nothing paused or squeezed, every process up; then every
/// claim that should be Bound is, and every pod's volume was mounted and its data checked.
pub(crate) async fn quiesce(opts: &Options, ctx: &Arc<Ctx>, faults: &Faults, images: &Path) {
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
    // Expansions end too: claim, volume, image and file system at the size asked for.
    let mut rng = Rng::new(opts.seed).fork(3);
    workload::settle_expansions(ctx, &mut rng, images, opts.settle_limit).await;
    record.log("quiesced", serde_json::json!({}));
}

/// Deletes every pod and claim, then checks what is left: Delete volumes leave no PV, image,
/// attachment or loop device; Retain volumes keep their image; no mount or loop device of this
/// run remains.
pub(crate) async fn clean_up_and_check_leaks(
    opts: &Options,
    ctx: &Arc<Ctx>,
    observer: &Observer,
    images: &Path,
) {
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
    let mut reported = BTreeSet::new();
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
                reported.insert(format!("{handle}.img"));
                leaks.push((
                    "image of a deleted Delete volume left".into(),
                    format!("{handle}.img ({pv}, claim {})", d.name),
                ));
            }
        }
    }
    // Any other file in the store that no volume names is a leak too, whatever made it (an image
    // whose volume was never created, or whose deletion forgot it): the checks above only know
    // the volumes the observer saw.
    match pvs.list(&ListParams::default()).await {
        Ok(l) => {
            let named: BTreeSet<String> = l
                .items
                .iter()
                .filter_map(|p| p.spec.as_ref()?.csi.as_ref())
                .filter(|c| c.driver == LOOP_DRIVER)
                .map(|c| format!("{}.img", c.volume_handle))
                .collect();
            match host::files_in(images) {
                Ok(files) => leaks.extend(
                    files
                        .into_iter()
                        // The store's marker (`stowage-controller init-image-store`) is no image.
                        .filter(|f| f != ".stowage-image-store")
                        .filter(|f| !named.contains(f) && !reported.contains(f))
                        .map(|f| ("image no volume names".to_string(), f)),
                ),
                Err(e) => leaks.push(("image store unreadable".into(), e.to_string())),
            }
        }
        Err(e) => leaks.push(("api".into(), e.to_string())),
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
