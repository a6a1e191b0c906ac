//! Finishing a node-side expansion in the claim's status, as the kubelet does.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::api::{Patch, PatchParams};

use crate::ctx::Ctx;

/// Finishes a node-side expansion in the claim's status the way the kubelet does: capacity is
/// the new size, the resize status entry and the resize conditions go. Returns the new
/// resourceVersion. Guarded by the resourceVersion read, so a concurrent change wins.
pub async fn finish_claim_resize(ctx: &Ctx, ns: &str, name: &str, size: &str) -> anyhow::Result<String> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let pvc = api.get_status(name).await?;
    let patch = resize_finished_patch(&pvc, size);
    let out = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(out.metadata.resource_version.unwrap_or_default())
}

/// The merge patch of `finish_claim_resize` (pure, for tests).
pub fn resize_finished_patch(pvc: &PersistentVolumeClaim, size: &str) -> serde_json::Value {
    const DONE: [&str; 3] = ["FileSystemResizePending", "Resizing", "NodeResizeError"];
    let conditions: Vec<_> = pvc
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| !DONE.contains(&c.type_.as_str()))
        .collect();
    serde_json::json!({
        "metadata": { "resourceVersion": pvc.metadata.resource_version },
        "status": {
            "capacity": { "storage": size },
            "allocatedResourceStatuses": { "storage": null },
            "conditions": conditions,
        }
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimCondition, PersistentVolumeClaimStatus};
    use kube::api::ObjectMeta;

    use super::*;

    #[test]
    fn resize_patch_clears_only_resize_state() {
        let pvc = PersistentVolumeClaim {
            metadata: ObjectMeta {
                resource_version: Some("42".into()),
                ..Default::default()
            },
            spec: None,
            status: Some(PersistentVolumeClaimStatus {
                conditions: Some(vec![
                    PersistentVolumeClaimCondition {
                        type_: "FileSystemResizePending".into(),
                        status: "True".into(),
                        ..Default::default()
                    },
                    PersistentVolumeClaimCondition {
                        type_: "Other".into(),
                        status: "True".into(),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
        };
        let p = resize_finished_patch(&pvc, "2Gi");
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["status"]["capacity"]["storage"], "2Gi");
        assert!(p["status"]["allocatedResourceStatuses"]["storage"].is_null());
        let conds = p["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 1);
        assert_eq!(conds[0]["type"], "Other");
    }
}
