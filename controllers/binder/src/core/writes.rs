//! The objects a write sends: each function returns the next version of a PV or claim (or
//! `None` when it already stands so); the executor writes them from the newest copy it has.

use super::*;

pub(super) fn ref_is_exact(pv: &PersistentVolume, claim: &PersistentVolumeClaim) -> bool {
    claim_ref(pv).is_some_and(|(ns, name, uid)| {
        ns == claim.namespace().unwrap_or_default()
            && name == claim.name_any()
            && Some(uid) == claim.metadata.uid.as_deref()
    })
}

/// Bind step 1: the PV with claimRef pointing exactly at the claim, or `None` if it already does.
pub fn bound_pv_spec(pv: &PersistentVolume, claim: &PersistentVolumeClaim) -> Option<PersistentVolume> {
    if ref_is_exact(pv, claim) {
        return None;
    }
    let mut out = pv.clone();
    // A user who pre-bound the PV to this claim by name keeps ownership of the binding.
    if !refers_to(pv, claim) {
        out.annotations_mut()
            .insert(ANN_BOUND_BY_CONTROLLER.into(), "yes".into());
    }
    out.spec.get_or_insert_with(Default::default).claim_ref = Some(reference_to(claim));
    Some(out)
}

/// Bind step 2: PV phase Bound.
pub fn bound_pv_status(pv: &PersistentVolume) -> Option<PersistentVolume> {
    (pv_phase(pv) != "Bound").then(|| with_pv_phase(pv, "Bound", ""))
}

pub fn with_pv_phase(pv: &PersistentVolume, phase: &str, message: &str) -> PersistentVolume {
    let mut out = pv.clone();
    let st = out.status.get_or_insert_with(Default::default);
    st.phase = Some(phase.into());
    st.message = (!message.is_empty()).then(|| message.into());
    out
}

/// Bind step 3: the claim naming the volume, with bind-completed.
pub fn bound_claim_spec(claim: &PersistentVolumeClaim, pv: &str) -> Option<PersistentVolumeClaim> {
    let needs_name = claim_volume_name(claim) != pv;
    if !needs_name && has_ann(claim, ANN_BIND_COMPLETED) {
        return None;
    }
    let mut out = claim.clone();
    if needs_name {
        out.spec.get_or_insert_with(Default::default).volume_name = Some(pv.into());
        out.annotations_mut()
            .insert(ANN_BOUND_BY_CONTROLLER.into(), "yes".into());
    }
    out.annotations_mut()
        .insert(ANN_BIND_COMPLETED.into(), "yes".into());
    Some(out)
}

/// Bind step 4: claim phase Bound with the volume's access modes; capacity only on the change to
/// Bound (a later difference may be a file system not yet grown, which expansion owns).
pub fn bound_claim_status(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
) -> Option<PersistentVolumeClaim> {
    let st = claim.status.clone().unwrap_or_default();
    let modes = pv.spec.as_ref().and_then(|s| s.access_modes.clone());
    // The class the volume has now (upstream's updateClaimStatus, VolumeAttributesClass GA).
    let vac = pv
        .spec
        .as_ref()
        .and_then(|s| s.volume_attributes_class_name.clone());
    let becoming_bound = st.phase.as_deref() != Some("Bound");
    if !becoming_bound
        && st.access_modes == modes
        && st.current_volume_attributes_class_name == vac
        && pending_condition(claim).is_none()
    {
        return None;
    }
    let mut out = claim.clone();
    let s = out.status.get_or_insert_with(Default::default);
    s.phase = Some("Bound".into());
    s.access_modes = modes;
    s.current_volume_attributes_class_name = vac;
    if let Some(conds) = s.conditions.as_mut() {
        conds.retain(|c| c.type_ != CONDITION_PENDING);
    }
    if becoming_bound {
        let mut cap = pv
            .spec
            .as_ref()
            .and_then(|s| s.capacity.clone())
            .unwrap_or_default();
        if let Some(pre) = ann(pv, ANN_PRE_RESIZE_CAPACITY) {
            cap.insert(
                "storage".into(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity(pre.into()),
            );
        }
        s.capacity = Some(cap);
    }
    Some(out)
}

/// Whether any of the four bind writes is still needed.
pub fn bind_needed(pv: &PersistentVolume, claim: &PersistentVolumeClaim) -> bool {
    bound_pv_spec(pv, claim).is_some()
        || bound_pv_status(pv).is_some()
        || bound_claim_spec(claim, &pv.name_any()).is_some()
        || bound_claim_status(claim, pv).is_some()
}

/// Claim status for Pending/Lost: phase set and the fields that describe a bound volume
/// (access modes, capacity, current VolumeAttributesClass) cleared, as upstream's
/// updateClaimStatus does when it has no volume (both for Pending and for Lost).
pub fn with_claim_phase(claim: &PersistentVolumeClaim, phase: &str) -> Option<PersistentVolumeClaim> {
    let st = claim.status.clone().unwrap_or_default();
    let unchanged = st.phase.as_deref().unwrap_or("Pending") == phase
        && st.access_modes.is_none()
        && st.capacity.is_none()
        && st.current_volume_attributes_class_name.is_none();
    if unchanged {
        return None;
    }
    let mut out = claim.clone();
    let s = out.status.get_or_insert_with(Default::default);
    s.phase = Some(phase.into());
    s.access_modes = None;
    s.capacity = None;
    s.current_volume_attributes_class_name = None;
    Some(out)
}

/// Undo the controller's binding of a PV: drop claimRef if the controller wrote it (and the
/// bound-by-controller annotation), else keep the user's pre-binding and drop only the UID.
pub fn unbound_pv(pv: &PersistentVolume) -> PersistentVolume {
    let mut out = pv.clone();
    let by_controller = has_ann(pv, ANN_BOUND_BY_CONTROLLER);
    let spec = out.spec.get_or_insert_with(Default::default);
    if by_controller {
        spec.claim_ref = None;
    } else if let Some(r) = spec.claim_ref.as_mut() {
        r.uid = None;
        r.resource_version = None;
    }
    if by_controller {
        out.annotations_mut().remove(ANN_BOUND_BY_CONTROLLER);
    }
    out
}

/// The default class among several (upstream's GetDefaultClass): the newest by creation time,
/// and among those created in the same second the first by name.
pub fn newest_default_class(
    defaults: impl IntoIterator<Item = (Option<k8s_openapi::jiff::Timestamp>, String)>,
) -> Option<String> {
    defaults
        .into_iter()
        .max_by(|(ta, na), (tb, nb)| ta.cmp(tb).then_with(|| nb.cmp(na)))
        .map(|(_, name)| name)
}

/// The claim's Pending condition as (reason, message), if it has one.
pub fn pending_condition(claim: &PersistentVolumeClaim) -> Option<(&str, &str)> {
    let c = claim
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_PENDING)?;
    Some((
        c.reason.as_deref().unwrap_or(""),
        c.message.as_deref().unwrap_or(""),
    ))
}

/// The claim with its Pending condition set; the transition time is kept while the condition
/// stays (only its reason or message changed), else `now`.
pub fn with_pending_condition(
    claim: &PersistentVolumeClaim,
    reason: &str,
    message: &str,
    now: k8s_openapi::jiff::Timestamp,
) -> PersistentVolumeClaim {
    use k8s_openapi::api::core::v1::PersistentVolumeClaimCondition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut out = claim.clone();
    let conds = out
        .status
        .get_or_insert_with(Default::default)
        .conditions
        .get_or_insert_with(Vec::new);
    let since = conds
        .iter()
        .find(|c| c.type_ == CONDITION_PENDING)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    conds.retain(|c| c.type_ != CONDITION_PENDING);
    conds.push(PersistentVolumeClaimCondition {
        type_: CONDITION_PENDING.into(),
        status: "True".into(),
        reason: Some(reason.into()),
        message: Some(message.chars().take(1000).collect()),
        last_transition_time: Some(since),
        last_probe_time: None,
    });
    out
}
