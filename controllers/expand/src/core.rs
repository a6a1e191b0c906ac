//! The pure decision core: given a claim, its volume and its class, what expansion work is due.
//! No I/O and no clock (time is an argument), so every rule is testable in isolation.
//!
//! Sizes follow upstream's fields: `spec.resources.requests` (what the user wants),
//! `status.allocatedResources` (what the system is trying to reach), PV `spec.capacity` (what the
//! volume has), claim `status.capacity` (what the workload can use).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimCondition};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use stowage_common::store::pv::{
    ann, claim_block, claim_class, claim_phase, claim_volume_name, csi_driver, pv_block, volume_handle,
};
use stowage_common::store::quantity;
use stowage_common::vocab::annotations::ANN_PRE_RESIZE_CAPACITY;
use stowage_loopdriver::DRIVER as LOOP_DRIVER;

pub use stowage_common::vocab::resize::{
    COND_CONTROLLER_RESIZE_ERROR, COND_FS_RESIZE_PENDING, COND_NODE_RESIZE_ERROR, COND_RESIZING,
    CONTROLLER_RESIZE_IN_PROGRESS, CONTROLLER_RESIZE_INFEASIBLE, FS_RESIZE_PENDING_MESSAGE,
    NODE_RESIZE_IN_PROGRESS, NODE_RESIZE_INFEASIBLE, NODE_RESIZE_PENDING, RESIZE_CONDITIONS,
};

pub const REASON_RESIZING: &str = "Resizing";
pub const REASON_FS_RESIZE_REQUIRED: &str = "FileSystemResizeRequired";
pub const REASON_RESIZE_SUCCESSFUL: &str = "VolumeResizeSuccessful";
pub const REASON_RESIZE_FAILED: &str = "VolumeResizeFailed";
pub const REASON_EXTERNAL_EXPANDING: &str = "ExternalExpanding";
/// The claim asks for more but its class does not (or no longer) allow expansion.
pub const REASON_NOT_ALLOWED: &str = "VolumeExpansionNotAllowed";
/// The user lowered the request back after an unfinished (usually failed) expansion.
pub const REASON_RESIZE_CANCELED: &str = "VolumeResizeCanceled";

/// A storage size: its bytes (for comparing) and the quantity it came from (for writing, so a
/// request of `128Mi` is recorded as `128Mi`, not as a byte count).
#[derive(Debug, Clone, PartialEq)]
pub struct Size {
    pub bytes: u128,
    pub quantity: Quantity,
}

impl Size {
    pub fn of(q: &Quantity) -> Option<Size> {
        Some(Size {
            bytes: quantity::bytes(&q.0)?,
            quantity: q.clone(),
        })
    }

    fn max(self, other: Size) -> Size {
        if other.bytes > self.bytes { other } else { self }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Grow the built-in driver's volume to `size` and record every step: the claim's
    /// allocation (`mark`, when not already recorded), the image file, the PV's capacity, then
    /// either the node's turn (`node_step`) or the finished resize.
    Expand {
        pv: String,
        handle: String,
        size: Size,
        mark: bool,
        node_step: bool,
        /// Whether the node step (if any) is a file-system resize or only a device refresh.
        filesystem: bool,
    },
    /// Writes the claim's status as given (ending an attempt, dropping stale conditions).
    ClaimStatus {
        claim: Box<PersistentVolumeClaim>,
        op: &'static str,
    },
    /// Writes the PV as given (the pre-resize-capacity annotation cleaned up).
    Volume {
        pv: Box<PersistentVolume>,
        op: &'static str,
    },
    /// An event on the claim. The events gate says each distinct (reason, note) once in a row
    /// (`Repeat::OnChange`), so a condition that persists across syncs is reported once.
    Event {
        warning: bool,
        reason: &'static str,
        note: String,
    },
}

fn storage(m: Option<&BTreeMap<String, Quantity>>) -> Option<Size> {
    m.and_then(|m| m.get("storage")).and_then(Size::of)
}

pub fn request(c: &PersistentVolumeClaim) -> Option<Size> {
    storage(
        c.spec
            .as_ref()
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref()),
    )
}

pub fn capacity(c: &PersistentVolumeClaim) -> Option<Size> {
    storage(c.status.as_ref().and_then(|s| s.capacity.as_ref()))
}

pub fn allocated(c: &PersistentVolumeClaim) -> Option<Size> {
    storage(c.status.as_ref().and_then(|s| s.allocated_resources.as_ref()))
}

pub fn resize_status(c: &PersistentVolumeClaim) -> Option<&str> {
    c.status
        .as_ref()?
        .allocated_resource_statuses
        .as_ref()?
        .get("storage")
        .map(String::as_str)
}

pub fn pv_size(pv: &PersistentVolume) -> Option<Size> {
    storage(pv.spec.as_ref().and_then(|s| s.capacity.as_ref()))
}

pub fn has_condition(c: &PersistentVolumeClaim, type_: &str) -> bool {
    c.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|x| x.type_ == type_ && x.status == "True"))
}

fn has_resize_condition(c: &PersistentVolumeClaim) -> bool {
    RESIZE_CONDITIONS.iter().any(|t| has_condition(c, t))
}

/// Whether the PV's claimRef names exactly this claim (namespace, name and UID, as upstream).
fn bound_to(pv: &PersistentVolume, c: &PersistentVolumeClaim) -> bool {
    let Some(r) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
        return false;
    };
    r.namespace == c.namespace()
        && r.name.as_deref() == Some(c.name_any().as_str())
        && r.uid.is_some()
        && r.uid == c.metadata.uid
}

/// How long an infeasible expansion waits before the same size is tried again.
pub const INFEASIBLE_RETRY: std::time::Duration = std::time::Duration::from_secs(300);

fn condition_probe_time(c: &PersistentVolumeClaim, type_: &str) -> Option<Timestamp> {
    let cond = c
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|x| x.type_ == type_)?;
    cond.last_probe_time
        .as_ref()
        .or(cond.last_transition_time.as_ref())
        .map(|t| t.0)
}

fn class_allows(class: Option<&StorageClass>) -> bool {
    class.and_then(|c| c.allow_volume_expansion) == Some(true)
}

fn not_allowed(claim: &PersistentVolumeClaim, class: Option<&StorageClass>, want: &Size) -> Action {
    let why = match (claim_class(claim).filter(|c| !c.is_empty()), class) {
        (None, _) => "the claim has no storage class".to_string(),
        (Some(name), None) => format!("its storage class {name:?} does not exist"),
        (Some(name), Some(_)) => {
            format!("its storage class {name:?} does not set allowVolumeExpansion: true")
        }
    };
    Action::Event {
        warning: true,
        reason: REASON_NOT_ALLOWED,
        note: format!("cannot expand the volume to {}: {why}", want.quantity.0),
    }
}

/// Decides what is due for one claim. `pv` is the volume the claim is bound to (if known),
/// `class` the claim's storage class (if it exists), `attached` whether any VolumeAttachment
/// names the volume (a Block volume in use needs the node to refresh its device).
pub fn sync_claim(
    claim: &PersistentVolumeClaim,
    pv: Option<&PersistentVolume>,
    class: Option<&StorageClass>,
    attached: bool,
    now: Timestamp,
) -> Vec<Action> {
    if claim_phase(claim) != "Bound" || claim_volume_name(claim).is_empty() {
        return vec![];
    }
    let Some(pv) = pv.filter(|pv| pv.name_any() == claim_volume_name(claim) && bound_to(pv, claim)) else {
        return vec![];
    };
    let (Some(req), Some(cap), Some(pvcap)) = (request(claim), capacity(claim), pv_size(pv)) else {
        return vec![];
    };
    match csi_driver(pv) {
        Some(LOOP_DRIVER) => sync_loop(claim, pv, class, attached, now, req, cap, pvcap),
        Some(driver) => hand_off(claim, class, driver, req, cap),
        None if migrated_plugin(pv).is_some() => migrated(claim, pv, class, req, cap),
        None if req.bytes > cap.bytes => vec![Action::Event {
            warning: false,
            reason: REASON_EXTERNAL_EXPANDING,
            note: format!(
                "waiting for an external controller to expand this PVC to {}",
                req.quantity.0
            ),
        }],
        None => vec![],
    }
}

/// Upstream's resizer annotation: the external-resizer of a migrated in-tree volume finds its
/// claim by it (the PV still names the in-tree plugin, not the CSI driver).
pub const ANN_STORAGE_RESIZER: &str = "volume.kubernetes.io/storage-resizer";

/// The in-tree plugin of a PV whose plugin csi-translation-lib migrates (every one of them is
/// migrated in v1.36), and the CSI driver that took it over.
pub fn migrated_plugin(pv: &PersistentVolume) -> Option<(&'static str, &'static str)> {
    let s = pv.spec.as_ref()?;
    let plugin = if s.aws_elastic_block_store.is_some() {
        "kubernetes.io/aws-ebs"
    } else if s.gce_persistent_disk.is_some() {
        "kubernetes.io/gce-pd"
    } else if s.azure_disk.is_some() {
        "kubernetes.io/azure-disk"
    } else if s.azure_file.is_some() {
        "kubernetes.io/azure-file"
    } else if s.cinder.is_some() {
        "kubernetes.io/cinder"
    } else if s.vsphere_volume.is_some() {
        "kubernetes.io/vsphere-volume"
    } else if s.portworx_volume.is_some() {
        "kubernetes.io/portworx-volume"
    } else {
        return None;
    };
    Some((plugin, stowage_common::vocab::migration::migrated_driver(plugin)?))
}

/// A migrated in-tree volume: as upstream, when the claim asks for more than it has (or the PV
/// still carries `pre-resize-capacity`), say so and name the CSI driver in the claim's
/// `volume.kubernetes.io/storage-resizer`, which is what its external-resizer acts on. The
/// class check is the same as for any external driver.
fn migrated(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
    req: Size,
    cap: Size,
) -> Vec<Action> {
    let Some((plugin, driver)) = migrated_plugin(pv) else {
        return vec![];
    };
    if req.bytes <= cap.bytes && ann(pv, ANN_PRE_RESIZE_CAPACITY).is_none() {
        return vec![];
    }
    if req.bytes > cap.bytes && !class_allows(class) {
        return vec![not_allowed(claim, class, &req)];
    }
    let mut out = vec![Action::Event {
        warning: false,
        reason: REASON_EXTERNAL_EXPANDING,
        note: format!("CSI migration enabled for {plugin}; waiting for external resizer to expand the pvc"),
    }];
    if ann(claim, ANN_STORAGE_RESIZER) != Some(driver) {
        let mut next = claim.clone();
        next.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(ANN_STORAGE_RESIZER.to_string(), driver.to_string());
        out.push(Action::ClaimStatus {
            claim: Box::new(next),
            op: "set_resizer",
        });
    }
    out
}

/// Other CSI drivers: their external-resizer finds the claim by the volume's driver; the
/// controller only says so, as upstream (no write to the claim).
fn hand_off(
    claim: &PersistentVolumeClaim,
    class: Option<&StorageClass>,
    driver: &str,
    req: Size,
    cap: Size,
) -> Vec<Action> {
    if req.bytes <= cap.bytes {
        return vec![];
    }
    if !class_allows(class) {
        return vec![not_allowed(claim, class, &req)];
    }
    vec![Action::Event {
        warning: false,
        reason: REASON_EXTERNAL_EXPANDING,
        note: format!(
            "waiting for an external controller ({driver}) to expand this PVC to {}",
            req.quantity.0
        ),
    }]
}

#[allow(clippy::too_many_arguments)]
fn sync_loop(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
    attached: bool,
    now: Timestamp,
    req: Size,
    cap: Size,
    pvcap: Size,
) -> Vec<Action> {
    let status = resize_status(claim);
    let alloc = allocated(claim);
    // The node's turn: it sets the capacity and clears the status when done. A request raised
    // meanwhile waits for that, as upstream (the node may be resizing right now).
    if matches!(status, Some(NODE_RESIZE_PENDING | NODE_RESIZE_IN_PROGRESS)) {
        return vec![];
    }
    let controller_side = matches!(
        status,
        Some(CONTROLLER_RESIZE_IN_PROGRESS | CONTROLLER_RESIZE_INFEASIBLE)
    );
    // Recovery: an unfinished controller attempt that grew nothing, and the user no longer asks
    // for more than the claim has. End it cleanly instead of leaving the allocation behind.
    if controller_side && req.bytes <= cap.bytes && pvcap.bytes <= cap.bytes {
        let from = alloc
            .as_ref()
            .map_or_else(|| "?".to_string(), |a| a.quantity.0.clone());
        return vec![
            Action::ClaimStatus {
                claim: Box::new(end_attempt(claim, &cap)),
                op: "end_attempt",
            },
            Action::Event {
                warning: false,
                reason: REASON_RESIZE_CANCELED,
                note: format!(
                    "request lowered to {} (capacity {}); the unfinished expansion to {from} was abandoned",
                    req.quantity.0, cap.quantity.0
                ),
            },
        ];
    }
    let failed =
        status == Some(CONTROLLER_RESIZE_INFEASIBLE) || has_condition(claim, COND_CONTROLLER_RESIZE_ERROR);
    // The size to reach (upstream's expand-and-recover table, see docs/expand.md).
    let target = match status {
        // Let the node retry at the size the volume already has.
        Some(NODE_RESIZE_INFEASIBLE) => Some(alloc.clone().unwrap_or(req.clone())),
        // After a failure the user's current request is the new attempt (it may be lower).
        Some(CONTROLLER_RESIZE_INFEASIBLE) => Some(req.clone()),
        Some(CONTROLLER_RESIZE_IN_PROGRESS) if failed => Some(req.clone()),
        // Interrupted (crash, conflict): resume, and take a larger request along.
        Some(CONTROLLER_RESIZE_IN_PROGRESS) => Some(match alloc.clone() {
            Some(a) => a.max(req.clone()),
            None => req.clone(),
        }),
        _ => (req.bytes > cap.bytes).then(|| req.clone()),
    }
    // Never below what the volume already has: the image is not shrunk and the claim's
    // allocation must not claim less than the volume holds.
    .map(|t| t.max(pvcap.clone()))
    .filter(|t| t.bytes > cap.bytes);

    let Some(target) = target else {
        return housekeeping(claim, pv, &cap, &pvcap);
    };
    let recorded = controller_side && alloc.as_ref().map(|a| a.bytes) == Some(target.bytes);
    // Infeasible at this very size: a changed request starts a new attempt at once, the same
    // one is retried only slowly (upstream's "slow set").
    if recorded && status == Some(CONTROLLER_RESIZE_INFEASIBLE) {
        let since = condition_probe_time(claim, COND_CONTROLLER_RESIZE_ERROR);
        if since.is_none_or(|t| now.duration_since(t).as_secs_f64() < INFEASIBLE_RETRY.as_secs_f64()) {
            return vec![];
        }
    }
    // A new attempt needs the class's consent; one already recorded is finished regardless.
    if !recorded && !class_allows(class) {
        return vec![not_allowed(claim, class, &target)];
    }
    let block = pv_block(pv) || claim_block(claim);
    let Some(handle) = volume_handle(pv) else {
        return vec![];
    };
    vec![Action::Expand {
        pv: pv.name_any(),
        handle: handle.to_string(),
        size: target,
        // An infeasible attempt retried at the same size becomes "in progress" again.
        mark: !recorded || status == Some(CONTROLLER_RESIZE_INFEASIBLE),
        node_step: !block || attached,
        filesystem: !block,
    }]
}

/// Leftovers once no resize is under way: resize conditions that are no longer true
/// (kubernetes#131402) and the PV's pre-resize-capacity annotation.
fn housekeeping(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    cap: &Size,
    pvcap: &Size,
) -> Vec<Action> {
    let mut out = Vec::new();
    let idle = resize_status(claim).is_none() && cap.bytes >= pvcap.bytes;
    if idle && has_resize_condition(claim) {
        out.push(Action::ClaimStatus {
            claim: Box::new(with_resize_conditions(claim, vec![])),
            op: "clear_conditions",
        });
    }
    if idle && ann(pv, ANN_PRE_RESIZE_CAPACITY).is_some() {
        let mut next = pv.clone();
        next.annotations_mut().remove(ANN_PRE_RESIZE_CAPACITY);
        out.push(Action::Volume {
            pv: Box::new(next),
            op: "drop_pre_resize_capacity",
        });
    }
    out
}

// ---- the writes, as pure functions of the object last seen ----

fn condition(type_: &str, message: Option<String>, now: Timestamp) -> PersistentVolumeClaimCondition {
    PersistentVolumeClaimCondition {
        type_: type_.into(),
        status: "True".into(),
        last_probe_time: Some(Time(now)),
        last_transition_time: Some(Time(now)),
        message,
        reason: None,
    }
}

/// Replaces the resize conditions by `new`, keeping every other condition. A condition that
/// stays true keeps its lastTransitionTime.
pub fn with_resize_conditions(
    claim: &PersistentVolumeClaim,
    new: Vec<PersistentVolumeClaimCondition>,
) -> PersistentVolumeClaim {
    let mut out = claim.clone();
    let st = out.status.get_or_insert_with(Default::default);
    let old = st.conditions.take().unwrap_or_default();
    let mut conds: Vec<_> = old
        .iter()
        .filter(|c| !RESIZE_CONDITIONS.contains(&c.type_.as_str()))
        .cloned()
        .collect();
    for mut c in new {
        if let Some(prev) = old.iter().find(|o| o.type_ == c.type_ && o.status == c.status) {
            c.last_transition_time = prev.last_transition_time.clone();
        }
        conds.push(c);
    }
    st.conditions = (!conds.is_empty()).then_some(conds);
    out
}

fn set_status_entry(claim: &mut PersistentVolumeClaim, value: Option<&str>) {
    let st = claim.status.get_or_insert_with(Default::default);
    let mut m = st.allocated_resource_statuses.take().unwrap_or_default();
    match value {
        Some(v) => {
            m.insert("storage".into(), v.into());
        }
        None => {
            m.remove("storage");
        }
    }
    st.allocated_resource_statuses = (!m.is_empty()).then_some(m);
}

fn set_allocated(claim: &mut PersistentVolumeClaim, size: &Size) {
    let st = claim.status.get_or_insert_with(Default::default);
    st.allocated_resources
        .get_or_insert_with(BTreeMap::new)
        .insert("storage".into(), size.quantity.clone());
}

/// Start (or restart) of the controller's part: allocation recorded, `Resizing` true.
pub fn mark_in_progress(claim: &PersistentVolumeClaim, size: &Size, now: Timestamp) -> PersistentVolumeClaim {
    let mut out = with_resize_conditions(claim, vec![condition(COND_RESIZING, None, now)]);
    set_allocated(&mut out, size);
    set_status_entry(&mut out, Some(CONTROLLER_RESIZE_IN_PROGRESS));
    out
}

/// The controller's part is done; the node must grow the file system (or refresh the device).
pub fn mark_node_pending(
    claim: &PersistentVolumeClaim,
    filesystem: bool,
    now: Timestamp,
) -> PersistentVolumeClaim {
    let conds = if filesystem {
        vec![condition(
            COND_FS_RESIZE_PENDING,
            Some(FS_RESIZE_PENDING_MESSAGE.into()),
            now,
        )]
    } else {
        vec![]
    };
    let mut out = with_resize_conditions(claim, conds);
    set_status_entry(&mut out, Some(NODE_RESIZE_PENDING));
    out
}

/// Nothing left for a node to do: the claim has the new size.
pub fn mark_finished(claim: &PersistentVolumeClaim, size: &Size) -> PersistentVolumeClaim {
    let mut out = with_resize_conditions(claim, vec![]);
    set_allocated(&mut out, size);
    set_status_entry(&mut out, None);
    out.status
        .get_or_insert_with(Default::default)
        .capacity
        .get_or_insert_with(BTreeMap::new)
        .insert("storage".into(), size.quantity.clone());
    out
}

/// A failed attempt: `ControllerResizeError` says why; an infeasible one also says so in the
/// status (upstream's states). `None` when the claim already says exactly this.
pub fn mark_failed(
    claim: &PersistentVolumeClaim,
    message: &str,
    infeasible: bool,
    now: Timestamp,
) -> Option<PersistentVolumeClaim> {
    let status = if infeasible {
        CONTROLLER_RESIZE_INFEASIBLE
    } else {
        CONTROLLER_RESIZE_IN_PROGRESS
    };
    let same_condition = claim
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == COND_CONTROLLER_RESIZE_ERROR && c.message.as_deref() == Some(message))
                && !cs.iter().any(|c| c.type_ == COND_RESIZING)
        });
    if same_condition && resize_status(claim) == Some(status) {
        return None;
    }
    let mut out = with_resize_conditions(
        claim,
        vec![condition(COND_CONTROLLER_RESIZE_ERROR, Some(message.into()), now)],
    );
    set_status_entry(&mut out, Some(status));
    Some(out)
}

/// Recovery: the attempt ends, the allocation falls back to what the claim really has.
pub fn end_attempt(claim: &PersistentVolumeClaim, cap: &Size) -> PersistentVolumeClaim {
    let mut out = with_resize_conditions(claim, vec![]);
    set_allocated(&mut out, cap);
    set_status_entry(&mut out, None);
    out
}

/// The PV with `capacity` grown to `size` (never lowered); while a node step is pending the old
/// claim capacity goes into `pre-resize-capacity`, so a re-bind reports what the file system
/// really has. `None` when nothing changes.
pub fn grown_pv(pv: &PersistentVolume, size: &Size, pre_resize: Option<&Size>) -> Option<PersistentVolume> {
    let grow = pv_size(pv).is_none_or(|p| p.bytes < size.bytes);
    let annotate = pre_resize.is_some() && ann(pv, ANN_PRE_RESIZE_CAPACITY).is_none();
    if !grow && !annotate {
        return None;
    }
    let mut out = pv.clone();
    if grow {
        out.spec
            .get_or_insert_with(Default::default)
            .capacity
            .get_or_insert_with(BTreeMap::new)
            .insert("storage".into(), size.quantity.clone());
    }
    if annotate && let Some(pre) = pre_resize {
        out.annotations_mut()
            .insert(ANN_PRE_RESIZE_CAPACITY.into(), pre.quantity.0.clone());
    }
    Some(out)
}

#[cfg(test)]
mod tests;
