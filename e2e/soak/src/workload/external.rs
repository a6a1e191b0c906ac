//! The external driver's half of the cluster: nothing attaches its volumes, but something must
//! provision and delete them.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::{CLASSES, Ctx, EXT_DRIVER, NS};

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
