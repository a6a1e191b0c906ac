//! A claim's resize state, as the expand controller writes it and the node (the kubelet, or
//! stowage's agent) finishes it: condition types, `status.allocatedResourceStatuses` values, and
//! the patch that ends a node-side expansion. One home, so a condition the controller starts
//! writing is also one the node clears (upstream: pkg/volume/util/resize_util.go).

use k8s_openapi::api::core::v1::PersistentVolumeClaim;

pub const COND_RESIZING: &str = "Resizing";
pub const COND_FS_RESIZE_PENDING: &str = "FileSystemResizePending";
pub const COND_CONTROLLER_RESIZE_ERROR: &str = "ControllerResizeError";
pub const COND_NODE_RESIZE_ERROR: &str = "NodeResizeError";
/// The condition types that belong to resizing; they are replaced together, others are kept.
pub const RESIZE_CONDITIONS: [&str; 4] = [
    COND_RESIZING,
    COND_FS_RESIZE_PENDING,
    COND_CONTROLLER_RESIZE_ERROR,
    COND_NODE_RESIZE_ERROR,
];

pub const CONTROLLER_RESIZE_IN_PROGRESS: &str = "ControllerResizeInProgress";
pub const CONTROLLER_RESIZE_INFEASIBLE: &str = "ControllerResizeInfeasible";
pub const NODE_RESIZE_PENDING: &str = "NodeResizePending";
pub const NODE_RESIZE_IN_PROGRESS: &str = "NodeResizeInProgress";
pub const NODE_RESIZE_INFEASIBLE: &str = "NodeResizeInfeasible";

/// Upstream's message, so tools that match on it keep working.
pub const FS_RESIZE_PENDING_MESSAGE: &str =
    "Waiting for user to (re-)start a pod to finish file system resize of volume on node.";

/// True when the claim waits for node-side expansion, per its resize status or the older
/// `FileSystemResizePending` condition.
pub fn node_resize_pending(pvc: &PersistentVolumeClaim) -> bool {
    let Some(st) = pvc.status.as_ref() else {
        return false;
    };
    let by_status = st
        .allocated_resource_statuses
        .as_ref()
        .and_then(|m| m.get("storage"))
        .is_some_and(|s| s == NODE_RESIZE_PENDING || s == NODE_RESIZE_IN_PROGRESS);
    let by_condition = st
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == COND_FS_RESIZE_PENDING && c.status == "True");
    by_status || by_condition
}

/// The merge patch that finishes a node-side expansion the way the kubelet does: capacity is the
/// new size, the resize status entry and every resize condition go, other conditions stay.
/// Guarded by the claim's resourceVersion, so a concurrent change wins.
pub fn finished_patch(pvc: &PersistentVolumeClaim, size: &str) -> serde_json::Value {
    let conditions: Vec<_> = pvc
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| !RESIZE_CONDITIONS.contains(&c.type_.as_str()))
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
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn claim(conditions: &[&str], status: Option<&str>) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                resource_version: Some("42".into()),
                ..Default::default()
            },
            spec: None,
            status: Some(PersistentVolumeClaimStatus {
                conditions: Some(
                    conditions
                        .iter()
                        .map(|t| PersistentVolumeClaimCondition {
                            type_: t.to_string(),
                            status: "True".into(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                allocated_resource_statuses: status
                    .map(|s| [("storage".to_string(), s.to_string())].into_iter().collect()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn the_finished_patch_clears_every_resize_condition_and_keeps_the_rest() {
        let mut types = RESIZE_CONDITIONS.to_vec();
        types.push("Other");
        let p = finished_patch(&claim(&types, Some(NODE_RESIZE_IN_PROGRESS)), "2Gi");
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["status"]["capacity"]["storage"], "2Gi");
        assert!(p["status"]["allocatedResourceStatuses"]["storage"].is_null());
        let conds = p["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 1, "{conds:?}");
        assert_eq!(conds[0]["type"], "Other");
    }

    #[test]
    fn a_node_resize_is_pending_by_status_or_by_the_older_condition() {
        assert!(node_resize_pending(&claim(&[], Some(NODE_RESIZE_PENDING))));
        assert!(node_resize_pending(&claim(&[], Some(NODE_RESIZE_IN_PROGRESS))));
        assert!(node_resize_pending(&claim(&[COND_FS_RESIZE_PENDING], None)));
        assert!(!node_resize_pending(&claim(
            &[COND_RESIZING],
            Some(CONTROLLER_RESIZE_IN_PROGRESS)
        )));
        assert!(!node_resize_pending(&claim(&[], Some(NODE_RESIZE_INFEASIBLE))));
    }
}
