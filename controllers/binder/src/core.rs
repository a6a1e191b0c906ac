//! The binding state machine, as pure functions: given the controller's cache and a view of
//! classes and nodes, `sync_claim` and `sync_volume` return the actions that move one object
//! toward its desired state. No I/O, no clock. The executor (`crate::exec`) carries them out.
//!
//! The decisions follow upstream's persistentvolume-binder (syncClaim/syncVolume) step by step;
//! where stowage deliberately differs it says so (see docs/binder.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use stowage_common::informer::is_newer;

use crate::index::VolumeIndex;
use crate::objects::*;
use crate::selector;

/// The controller's own view: the newest version it has seen or written of every PV and claim,
/// the index over the PVs, and volumes promised to claims whose bind is in flight.
#[derive(Debug, Default, Clone)]
pub struct Cache {
    pub pvs: HashMap<String, Arc<PersistentVolume>>,
    pub claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    pub index: VolumeIndex,
    /// PV name → claim key holding it for an in-flight bind.
    pub reserved: HashMap<String, String>,
    /// Built-in driver's volume handle → the PVs naming it (normally one; more means an image
    /// shared by several PVs, which is never deleted while another PV names it).
    pub handles: HashMap<String, BTreeSet<String>>,
}

impl Cache {
    /// Stores `pv` unless the cache already has a newer version (upstream's storeObjectUpdate:
    /// an equal version passes, so resyncs are processed). Returns whether it was stored.
    pub fn put_pv(&mut self, pv: Arc<PersistentVolume>) -> bool {
        let name = pv.name_any();
        if let Some(old) = self.pvs.get(&name)
            && old.metadata.uid == pv.metadata.uid
            && is_newer(
                old.resource_version().as_deref(),
                pv.resource_version().as_deref(),
            )
        {
            return false;
        }
        self.index.upsert(&pv);
        self.forget_handle(&name);
        if let Some(h) = loop_handle(&pv) {
            self.handles
                .entry(h.to_string())
                .or_default()
                .insert(name.clone());
        }
        self.pvs.insert(name, pv);
        true
    }

    fn forget_handle(&mut self, name: &str) {
        if let Some(h) = self.pvs.get(name).and_then(|p| loop_handle(p))
            && let Some(set) = self.handles.get_mut(h)
        {
            set.remove(name);
            if set.is_empty() {
                self.handles.remove(h);
            }
        }
    }

    /// The other PVs that name the same built-in image as `pv`.
    pub fn sharing_handle(&self, pv: &PersistentVolume) -> Vec<String> {
        let name = pv.name_any();
        loop_handle(pv)
            .and_then(|h| self.handles.get(h))
            .map(|set| set.iter().filter(|n| **n != name).cloned().collect())
            .unwrap_or_default()
    }

    pub fn put_claim(&mut self, c: Arc<PersistentVolumeClaim>) -> bool {
        let key = claim_key(&c);
        if let Some(old) = self.claims.get(&key)
            && old.metadata.uid == c.metadata.uid
            && is_newer(old.resource_version().as_deref(), c.resource_version().as_deref())
        {
            return false;
        }
        self.claims.insert(key, c);
        true
    }

    pub fn remove_pv(&mut self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.index.remove(name);
        self.forget_handle(name);
        self.pvs.remove(name)
    }

    pub fn remove_claim(&mut self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.claims.remove(key)
    }

    fn reserved_for_other(&self, pv: &str, claim: &str) -> bool {
        self.reserved.get(pv).is_some_and(|c| c != claim)
    }
}

/// What the state machine reads besides PVs and claims.
pub struct Env<'a> {
    pub class: &'a dyn Fn(&str) -> Option<Arc<StorageClass>>,
    /// Name of the default StorageClass, if exactly one is marked default (newest wins, as upstream).
    pub default_class: Option<String>,
    /// Labels of a node, when it exists.
    pub node_labels: &'a dyn Fn(&str) -> Option<BTreeMap<String, String>>,
    /// The pods (not terminated) whose volumes name claim `namespace/name`, sorted by name.
    pub pods_of: &'a dyn Fn(&str) -> Vec<PodUse>,
}

/// A pod that uses a claim (in the claim's namespace).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodUse {
    pub name: String,
    /// Has the scheduler put it on a node?
    pub scheduled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Claim(String),
    Volume(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub target: Target,
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// One step toward the desired state. Writes are computed again by the executor from the newest
/// objects (see the `bound_*` functions), so an action names objects rather than carrying them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The four writes of a bind, in upstream's order: PV claimRef, PV status, claim volumeName,
    /// claim status; each skipped when already done.
    Bind {
        pv: String,
        claim: String,
    },
    /// Claim phase Pending (status access modes and capacity cleared) or Lost.
    ClaimPhase {
        claim: String,
        phase: &'static str,
    },
    /// Volume phase with a message (empty unless it explains a failure).
    VolumePhase {
        pv: String,
        phase: &'static str,
        message: String,
    },
    /// Mark Released after confirming with a live read that the claim is really gone.
    Release {
        pv: String,
    },
    /// Clear the claimRef the controller wrote (or only its UID if a user pre-bound it).
    Unbind {
        pv: String,
    },
    /// Write both storage-provisioner annotations on the claim.
    SetProvisioner {
        claim: String,
        provisioner: String,
    },
    /// Fill a class-less claim's class with the default class (retroactive default).
    SetDefaultClass {
        claim: String,
        class: String,
    },
    /// Built-in driver: create the PV `pvc-<claim uid>` (image pending).
    ProvisionLoop {
        claim: String,
        class: String,
    },
    /// Built-in driver: create the image of a PV created with the pending annotation.
    CreateLoopImage {
        pv: String,
    },
    /// Built-in driver: remove the image, then the finalizer, then the PV object.
    DeleteLoopVolume {
        pv: String,
    },
    /// Add or drop the built-in deleter's finalizer.
    SetDeleterFinalizer {
        pv: String,
        present: bool,
    },
    /// Metadata edits on one object, written with its resourceVersion: annotations set or
    /// removed and finalizers dropped (CSI migration marks, a selected node given back to the
    /// scheduler). `op` names the write in metrics.
    Annotate {
        target: Target,
        set: BTreeMap<String, String>,
        remove: Vec<String>,
        drop_finalizers: Vec<String>,
        add_finalizers: Vec<String>,
        op: &'static str,
    },
    /// Sync a claim soon (a PV changed in a way the claim must react to).
    WakeClaim(String),
    /// Nothing to write, but the object is in a state that should not last: sync it again
    /// with the failure backoff (upstream returns an error from the sync).
    RetryLater {
        why: String,
    },
    /// Say on the claim why it is still Pending (condition `stowage.dev/Pending`).
    ClaimCondition {
        claim: String,
        reason: &'static str,
        message: String,
    },
    Event(Event),
}

fn ev(target: Target, warning: bool, reason: &'static str, note: impl Into<String>) -> Action {
    Action::Event(Event {
        target,
        warning,
        reason,
        note: note.into(),
    })
}

fn is_wffc(class: &StorageClass) -> bool {
    class.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer")
}

/// Why a volume cannot serve a claim, in words a user can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    BeingDeleted,
    TooSmall { have: u128, want: u128 },
    Class { have: String, want: String },
    AccessModes { have: Vec<String>, want: Vec<String> },
    VolumeMode,
    Selector,
    NodeAffinity { node: String },
    AttributesClass { have: String, want: String },
    Reserved,
    ImagePending,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BeingDeleted => write!(f, "it is being deleted"),
            Self::TooSmall { have, want } => write!(f, "too small: {} < {}", human(*have), human(*want)),
            Self::Class { have, want } => write!(f, "storage class {have:?}, claim wants {want:?}"),
            Self::AccessModes { have, want } => {
                write!(
                    f,
                    "access modes [{}] do not cover [{}]",
                    have.join(","),
                    want.join(",")
                )
            }
            Self::VolumeMode => write!(f, "volumeMode differs"),
            Self::Selector => write!(f, "labels do not match the claim's selector"),
            Self::NodeAffinity { node } => write!(f, "node affinity excludes node {node:?}"),
            Self::AttributesClass { have, want } => {
                write!(f, "volume attributes class {have:?}, claim wants {want:?}")
            }
            Self::Reserved => write!(f, "being bound to another claim"),
            Self::ImagePending => write!(f, "its image is still being created"),
        }
    }
}

/// Bytes in the largest binary unit not above them, for messages ("1Gi", "1.50Gi", "512").
pub fn human(b: u128) -> String {
    for (unit, shift) in [("Ti", 40u32), ("Gi", 30), ("Mi", 20), ("Ki", 10)] {
        let base = 1u128 << shift;
        if b >= base {
            return if b.is_multiple_of(base) {
                format!("{}{unit}", b / base)
            } else {
                format!("{:.2}{unit}", b as f64 / base as f64)
            };
        }
    }
    b.to_string()
}

/// Which rules a candidate is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A volume pre-bound to the claim: size, modes, volume mode (and attributes class, node).
    Prebound,
    /// A volume the claim asked for by name (upstream's checkVolumeSatisfyClaim): adds the class.
    Named,
    /// Any free volume: adds the claim's label selector.
    Any,
}

/// The checks of one candidate, in upstream's order. `node` is set when a node has been chosen
/// for the claim (selected-node), to evaluate the volume's node affinity.
pub fn check(
    pv: &PersistentVolume,
    claim: &PersistentVolumeClaim,
    env: &Env,
    node: Option<&str>,
    scope: Scope,
) -> Result<(), Mismatch> {
    if being_deleted(pv) {
        return Err(Mismatch::BeingDeleted);
    }
    let want = claim_request(claim).unwrap_or(u128::MAX);
    let have = pv_capacity(pv).unwrap_or(0);
    if have < want {
        return Err(Mismatch::TooSmall { have, want });
    }
    if pv_block(pv) != claim_block(claim) {
        return Err(Mismatch::VolumeMode);
    }
    let (pm, cm) = (pv_modes(pv), claim_modes(claim));
    if !pm.is_superset(&cm) {
        return Err(Mismatch::AccessModes {
            have: pm.into_iter().collect(),
            want: cm.into_iter().collect(),
        });
    }
    if scope != Scope::Prebound {
        let want_class = claim_class(claim).unwrap_or("");
        if pv_class(pv) != want_class {
            return Err(Mismatch::Class {
                have: pv_class(pv).into(),
                want: want_class.into(),
            });
        }
    }
    if scope == Scope::Any
        && let Some(sel) = claim.spec.as_ref().and_then(|s| s.selector.as_ref())
        && !selector::labels_match(sel, pv.labels())
    {
        return Err(Mismatch::Selector);
    }
    if pv_vac(pv) != claim_vac(claim) {
        return Err(Mismatch::AttributesClass {
            have: pv_vac(pv).into(),
            want: claim_vac(claim).into(),
        });
    }
    if let (Some(node), Some(req)) = (
        node,
        pv.spec
            .as_ref()
            .and_then(|s| s.node_affinity.as_ref())
            .and_then(|a| a.required.as_ref()),
    ) {
        let labels = (env.node_labels)(node).unwrap_or_default();
        if !selector::node_matches(req, node, &labels) {
            return Err(Mismatch::NodeAffinity { node: node.into() });
        }
    }
    if has_ann(pv, ANN_IMAGE_PENDING) {
        return Err(Mismatch::ImagePending);
    }
    Ok(())
}

/// Outcome of looking for a volume.
#[derive(Debug, Clone, PartialEq)]
pub enum Found<'a> {
    Volume(&'a PersistentVolume),
    /// Nothing (yet); the claim waits for a consumer before taking an unnamed volume.
    WaitForConsumer,
    None,
}

/// The smallest volume that satisfies the claim: first a volume pre-bound to it, then, unless
/// binding is delayed without a chosen node, the free volumes of its class through the index.
pub fn find_best<'a>(claim: &PersistentVolumeClaim, cache: &'a Cache, env: &Env, delay: bool) -> Found<'a> {
    let key = claim_key(claim);
    let node = chosen_node(claim, delay);
    let mut prebound: Vec<&PersistentVolume> = cache
        .index
        .prebound_to(&key)
        .filter_map(|n| cache.pvs.get(n).map(Arc::as_ref))
        .filter(|pv| refers_to(pv, claim) && !cache.reserved_for_other(&pv.name_any(), &key))
        .filter(|pv| check(pv, claim, env, node, Scope::Prebound).is_ok())
        .collect();
    prebound.sort_by_key(|pv| (pv_capacity(pv), pv.name_any()));
    if let Some(pv) = prebound.first() {
        return Found::Volume(pv);
    }
    if delay && node.is_none() {
        return Found::WaitForConsumer;
    }
    let (Some(want), class) = (claim_request(claim), claim_class(claim).unwrap_or("")) else {
        return Found::None;
    };
    for group in cache.index.groups(class, &claim_modes(claim), want) {
        for (_, name) in group {
            if cache.reserved_for_other(name, &key) {
                continue;
            }
            let Some(pv) = cache.pvs.get(name) else { continue };
            if check(pv, claim, env, node, Scope::Any).is_ok() {
                return Found::Volume(pv);
            }
        }
    }
    Found::None
}

/// The node a volume's node affinity is checked against: the scheduler's choice, and only for
/// delayed binding. Upstream never checks node affinity for an Immediate claim (its volume
/// decides where the pod can go), even if some tool annotated a node on it.
fn chosen_node(claim: &PersistentVolumeClaim, delay: bool) -> Option<&str> {
    ann(claim, ANN_SELECTED_NODE).filter(|_| delay)
}

/// Names the rule that ruled out the nearest free volumes of the claim's class (by size).
pub fn explain(claim: &PersistentVolumeClaim, cache: &Cache, env: &Env) -> String {
    let class = claim_class(claim).unwrap_or("");
    let want = claim_request(claim).unwrap_or(0);
    let delay = claim_class(claim)
        .filter(|c| !c.is_empty())
        .and_then(|c| (env.class)(c))
        .is_some_and(|c| is_wffc(&c));
    let node = chosen_node(claim, delay);
    let key = claim_key(claim);
    // Bounded work whatever the number of volumes: only the neighbours of the requested size.
    let (total, candidates) = cache.index.near(class, want, 4);
    if total == 0 {
        return format!("no available volumes in storage class {class:?}");
    }
    let mut near: Vec<(u128, &str, Mismatch)> = candidates
        .into_iter()
        .filter_map(|(size, name)| {
            let pv = cache.pvs.get(name)?;
            let why = if cache.reserved_for_other(name, &key) {
                Mismatch::Reserved
            } else {
                check(pv, claim, env, node, Scope::Any).err()?
            };
            Some((size.abs_diff(want), name, why))
        })
        .collect();
    near.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    near.truncate(3);
    let parts: Vec<String> = near.iter().map(|(_, n, why)| format!("{n}: {why}")).collect();
    format!(
        "{total} available volume(s) in storage class {class:?}, none fits; nearest: {}",
        parts.join("; ")
    )
}

/// The claimRef a bind writes.
pub fn reference_to(claim: &PersistentVolumeClaim) -> ObjectReference {
    ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        api_version: Some("v1".into()),
        namespace: claim.namespace(),
        name: Some(claim.name_any()),
        uid: claim.metadata.uid.clone(),
        resource_version: claim.resource_version(),
        field_path: None,
    }
}

fn ref_is_exact(pv: &PersistentVolume, claim: &PersistentVolumeClaim) -> bool {
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

fn claim_phase_action(claim: &PersistentVolumeClaim, phase: &'static str) -> Option<Action> {
    with_claim_phase(claim, phase).map(|_| Action::ClaimPhase {
        claim: claim_key(claim),
        phase,
    })
}

/// The claim condition that says why a claim is still Pending (events expire; a condition stays
/// and carries the time it became true). Removed by the bind.
pub const CONDITION_PENDING: &str = "stowage.dev/Pending";

/// syncClaim: the actions that move one claim toward Bound (or report why it cannot), plus the
/// Pending condition that keeps the reason visible on the claim itself.
pub fn sync_claim(claim: &PersistentVolumeClaim, cache: &Cache, env: &Env) -> Vec<Action> {
    let mut out: Vec<Action> = migration_edit(Target::Claim(claim_key(claim)), claim, true, "")
        .into_iter()
        .collect();
    out.extend(sync_claim_phase(claim, cache, env));
    if has_ann(claim, ANN_BIND_COMPLETED) || out.iter().any(|a| matches!(a, Action::Bind { .. })) {
        return out;
    }
    let key = claim_key(claim);
    let why = out.iter().find_map(|a| match a {
        Action::Event(e) if e.target == Target::Claim(key.clone()) => Some((e.reason, e.note.clone())),
        Action::ProvisionLoop { .. } => Some((
            "Provisioning",
            format!("waiting for {LOOP_DRIVER} to provision a volume"),
        )),
        _ => None,
    });
    if let Some((reason, message)) = why
        && pending_condition(claim) != Some((reason, message.as_str()))
    {
        out.push(Action::ClaimCondition {
            claim: key,
            reason,
            message,
        });
    }
    out
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

fn sync_claim_phase(claim: &PersistentVolumeClaim, cache: &Cache, env: &Env) -> Vec<Action> {
    let key = claim_key(claim);
    let target = Target::Claim(key.clone());
    let mut out = Vec::new();
    let vol = claim_volume_name(claim);

    if has_ann(claim, ANN_BIND_COMPLETED) {
        // B: a claim that was bound.
        let lost = |note: &str| {
            let mut v: Vec<Action> = claim_phase_action(claim, "Lost").into_iter().collect();
            if !v.is_empty() {
                v.push(ev(target.clone(), true, "ClaimLost", note));
            }
            v
        };
        if vol.is_empty() {
            return lost(
                "Bound claim has lost reference to its PersistentVolume; data on the volume is lost!",
            );
        }
        let Some(pv) = cache.pvs.get(vol) else {
            return lost(&format!(
                "Bound claim has lost its PersistentVolume {vol:?}; data on the volume is lost!"
            ));
        };
        match claim_ref(pv) {
            None => {}
            Some((_, _, uid)) if Some(uid) == claim.metadata.uid.as_deref() => {}
            Some(_) => {
                let mut v: Vec<Action> = claim_phase_action(claim, "Lost").into_iter().collect();
                if !v.is_empty() {
                    v.push(ev(
                        target,
                        true,
                        "ClaimMisbound",
                        format!("Two claims are bound to volume {vol:?}; this one is bound incorrectly"),
                    ));
                }
                return v;
            }
        }
        if bind_needed(pv, claim) {
            out.push(Action::Bind {
                pv: vol.into(),
                claim: key,
            });
        }
        return out;
    }

    if !vol.is_empty() {
        // A2: the user asked for a volume by name.
        let Some(pv) = cache.pvs.get(vol) else {
            out.extend(claim_phase_action(claim, "Pending"));
            out.push(ev(
                target,
                false,
                "FailedBinding",
                format!("waiting for volume {vol:?} to be created"),
            ));
            return out;
        };
        if claim_ref(pv).is_none() || refers_to(pv, claim) {
            if cache.reserved_for_other(vol, &key) {
                out.extend(claim_phase_action(claim, "Pending"));
                return out;
            }
            // Selector and node affinity are not checked for volumes asked for by name (upstream).
            if claim_ref(pv).is_none()
                && let Err(why) = check(pv, claim, env, None, Scope::Named)
            {
                out.extend(claim_phase_action(claim, "Pending"));
                out.push(ev(
                    target,
                    true,
                    "VolumeMismatch",
                    format!("Cannot bind to requested volume {vol:?}: {why}"),
                ));
                return out;
            }
            if bind_needed(pv, claim) {
                out.push(Action::Bind {
                    pv: vol.into(),
                    claim: key,
                });
            }
            return out;
        }
        let note = format!("volume {vol:?} already bound to a different claim.");
        if has_ann(claim, ANN_BOUND_BY_CONTROLLER) {
            // The controller named this volume and someone removed bind-completed: nothing a
            // retry of ours can mend, and resetting the claim would hide the evidence. Left as
            // it is, reported, and tried again with backoff (upstream: "should never happen").
            out.push(ev(target, true, "FailedBinding", note));
            out.push(Action::RetryLater {
                why: format!("invalid binding of claim {key:?} to volume {vol:?}: volume already claimed by another claim"),
            });
            return out;
        }
        out.extend(claim_phase_action(claim, "Pending"));
        out.push(ev(target, true, "FailedBinding", note));
        return out;
    }

    // A1: any volume will do.
    let class_name = claim_class(claim);
    let class = class_name.filter(|c| !c.is_empty()).and_then(|c| (env.class)(c));
    let delay = class.as_deref().is_some_and(is_wffc);
    match find_best(claim, cache, env, delay) {
        Found::Volume(pv) => {
            out.push(Action::Bind {
                pv: pv.name_any(),
                claim: key,
            });
            return out;
        }
        Found::WaitForConsumer => {
            out.extend(claim_phase_action(claim, "Pending"));
            // A consumer exists but is not scheduled yet: say which pod(s) it waits for.
            let waiting: Vec<String> = (env.pods_of)(&key)
                .into_iter()
                .filter(|p| !p.scheduled)
                .map(|p| p.name)
                .collect();
            out.push(match waiting.as_slice() {
                [] => ev(
                    target,
                    false,
                    "WaitForFirstConsumer",
                    "waiting for first consumer to be created before binding",
                ),
                [one] => ev(
                    target,
                    false,
                    "WaitForPodScheduled",
                    format!("waiting for pod {one} to be scheduled"),
                ),
                many => ev(
                    target,
                    false,
                    "WaitForPodScheduled",
                    format!("waiting for pods {} to be scheduled", many.join(",")),
                ),
            });
            return out;
        }
        Found::None => {}
    }
    if class_name.is_none()
        && let Some(default) = &env.default_class
    {
        out.push(Action::SetDefaultClass {
            claim: key,
            class: default.clone(),
        });
        return out;
    }
    out.extend(claim_phase_action(claim, "Pending"));
    match (class_name.filter(|c| !c.is_empty()), class) {
        (Some(name), None) => out.push(ev(
            target,
            true,
            "ProvisioningFailed",
            format!("storageclass.storage.k8s.io {name:?} not found; create it or change the claim's class"),
        )),
        (Some(_), Some(class))
            if class.provisioner.starts_with("kubernetes.io/")
                && migrated_driver(&class.provisioner).is_none() =>
        {
            // In-tree plugin names (kubernetes.io/no-provisioner, …): stowage has no in-tree
            // provisioners, and upstream reports these the same way when no plugin matches.
            out.push(ev(
                target,
                true,
                "ProvisioningFailed",
                format!(
                    "no volume plugin matched name: {}; waiting for a volume to be created manually ({})",
                    class.provisioner,
                    explain(claim, cache, env)
                ),
            ))
        }
        (Some(name), Some(class)) => {
            // An in-tree plugin's class is served by the CSI driver it migrated to, whose
            // external-provisioner acts on claims that name it (upstream's migration path).
            let prov = migrated_driver(&class.provisioner).unwrap_or(class.provisioner.as_str());
            if ann(claim, ANN_STORAGE_PROVISIONER) != Some(prov)
                || ann(claim, ANN_BETA_STORAGE_PROVISIONER) != Some(prov)
            {
                out.push(Action::SetProvisioner {
                    claim: key.clone(),
                    provisioner: prov.into(),
                });
            }
            if prov == LOOP_DRIVER {
                if let Some(why) = loop_refusal(claim, cache) {
                    out.push(ev(target, true, "ProvisioningFailed", why));
                } else if let Some(why) = node_refusal(claim, &class, env, delay) {
                    // The scheduler picked a node this class cannot serve: give the choice
                    // back (upstream's rescheduleProvisioning) so it picks again.
                    out.push(ev(target, true, "ProvisioningFailed", why));
                    out.push(Action::Annotate {
                        target: Target::Claim(key),
                        set: BTreeMap::new(),
                        remove: vec![ANN_SELECTED_NODE.into()],
                        drop_finalizers: vec![],
                        add_finalizers: vec![],
                        op: "reschedule",
                    });
                } else {
                    out.push(Action::ProvisionLoop {
                        claim: key,
                        class: name.into(),
                    });
                }
            } else {
                out.push(ev(
                    target,
                    false,
                    "ExternalProvisioning",
                    format!("Waiting for a volume to be created either by the external provisioner '{prov}' or manually by the system administrator. If volume creation is delayed, please verify that the provisioner is running and correctly registered."),
                ));
            }
        }
        _ => out.push(ev(
            target,
            false,
            "FailedBinding",
            format!(
                "no persistent volumes available for this claim and no storage class is set ({})",
                explain(claim, cache, env)
            ),
        )),
    }
    out
}

/// Why the built-in provisioner cannot provision for the node the scheduler selected (delayed
/// binding only): the node is unknown, or the class's allowed topologies exclude it, so a volume
/// made now could never be used by the pod waiting on that node.
fn node_refusal(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    env: &Env,
    delay: bool,
) -> Option<String> {
    let node = chosen_node(claim, delay)?;
    let Some(labels) = (env.node_labels)(node) else {
        return Some(format!(
            "selected node {node:?} does not exist; the scheduler is asked to choose again"
        ));
    };
    let terms = class.allowed_topologies.as_ref().filter(|t| !t.is_empty())?;
    let fits = terms.iter().any(|t| {
        t.match_label_expressions.iter().flatten().all(|e| {
            labels
                .get(&e.key)
                .is_some_and(|v| e.values.iter().any(|w| w == v))
        })
    });
    (!fits).then(|| {
        format!(
            "selected node {node:?} is outside the allowed topologies of storage class {:?}; the scheduler is asked to choose again",
            class.name_any()
        )
    })
}

/// Why the built-in provisioner will not (or can no longer) provision a volume for `claim`:
/// a multi-node writer access mode, a selector or a data source it cannot honour (as
/// external-provisioner refuses them), or an image creation that failed for good (the
/// provisioned PV is `Failed`, its message says why). `None`: go ahead (or keep waiting).
pub fn loop_refusal(claim: &PersistentVolumeClaim, cache: &Cache) -> Option<String> {
    if let Some(spec) = claim.spec.as_ref() {
        if spec.selector.is_some() {
            return Some(format!(
                "{LOOP_DRIVER} cannot provision a volume for a claim with a selector: it creates volumes, it cannot pick one by its labels; bind the claim to a labelled volume made by hand, or remove the selector"
            ));
        }
        let source = spec
            .data_source_ref
            .as_ref()
            .map(|r| (r.kind.as_str(), r.name.as_str()))
            .or_else(|| {
                spec.data_source
                    .as_ref()
                    .map(|r| (r.kind.as_str(), r.name.as_str()))
            });
        if let Some((kind, name)) = source {
            // Provisioning anyway would hand out an empty volume where data was expected.
            return Some(format!(
                "{LOOP_DRIVER} cannot fill a volume from {kind} {name:?}: cloning and snapshot restore are not supported, and an empty volume in its place would lose that data silently; remove the data source to get an empty volume"
            ));
        }
    }
    let modes = claim_modes(claim);
    let refused: Vec<&str> = MULTI_NODE_WRITER_MODES
        .iter()
        .copied()
        .filter(|m| modes.contains(*m))
        .collect();
    if !refused.is_empty() {
        return Some(format!(
            "{LOOP_DRIVER} cannot provision access mode {}: an ext4 file system on a loop image cannot be mounted read-write by two kernels (nodes) at once without corrupting it; ask for ReadWriteOnce or ReadWriteOncePod, or ReadOnlyMany to share it read-only",
            refused.join(",")
        ));
    }
    let name = crate::loopdev::provisioned_name(claim)?;
    let pv = cache.pvs.get(&name)?;
    if has_ann(pv.as_ref(), ANN_IMAGE_PENDING) && pv_phase(pv) == "Failed" {
        let msg = pv
            .status
            .as_ref()
            .and_then(|s| s.message.as_deref())
            .unwrap_or("the image could not be created");
        return Some(format!(
            "{msg}; this will not pass by retrying: delete the claim (its volume {name} is deleted with it) and ask for a size the image directory's file system can hold"
        ));
    }
    None
}

/// Whether the built-in deleter may hold (and act on) this volume: made by this provisioner,
/// policy Delete, and a handle that can name an image of it.
pub fn deleter_wanted(pv: &PersistentVolume) -> bool {
    provisioned_here(pv) && reclaim_policy(pv) == "Delete" && loop_handle(pv).is_some_and(plain_handle)
}

/// Whether the claim the volume's claimRef names (with its UID) is in the cache.
fn claim_alive(pv: &PersistentVolume, cache: &Cache) -> bool {
    claim_ref(pv).is_some_and(|(ns, n, uid)| {
        !uid.is_empty()
            && cache
                .claims
                .get(&format!("{ns}/{n}"))
                .is_some_and(|c| c.metadata.uid.as_deref() == Some(uid))
    })
}

/// Where `pv.kubernetes.io/migrated-to` should stand on an object (upstream's
/// updateMigrationAnnotations): `None` leaves it alone (no provisioner recorded: a static
/// volume); otherwise the CSI driver the recorded in-tree provisioner migrated to, or absent.
pub fn wanted_migrated_to(anns: &BTreeMap<String, String>, claim: bool) -> Option<Option<&'static str>> {
    let provisioner = if claim {
        anns.get(ANN_STORAGE_PROVISIONER)
            .or_else(|| anns.get(ANN_BETA_STORAGE_PROVISIONER))
    } else {
        anns.get(ANN_PROVISIONED_BY)
    }?;
    Some(migrated_driver(provisioner))
}

/// The edit that brings an object's migration marks in line: `migrated-to` as
/// [`wanted_migrated_to`] says, and on a dynamically provisioned volume the deletion finalizers
/// upstream's modifyDeletionFinalizers keeps: none of the in-tree kind once a CSI driver took the
/// plugin over (its external-provisioner deletes the volume); for a plugin that was not migrated,
/// `kubernetes.io/pv-controller` while the policy is Delete (the PV object cannot vanish while its
/// storage may still exist: stowage has no in-tree deleter, so the storage is the admin's to
/// delete, then the finalizer) and no external-provisioner finalizer.
fn migration_edit<K: ResourceExt>(target: Target, obj: &K, claim: bool, policy: &str) -> Option<Action> {
    let mut set = BTreeMap::new();
    let mut remove = Vec::new();
    let mut drop_finalizers = Vec::new();
    let mut add_finalizers = Vec::new();
    let have = ann(obj, ANN_MIGRATED_TO);
    match wanted_migrated_to(obj.annotations(), claim) {
        Some(Some(driver)) if have != Some(driver) => {
            set.insert(ANN_MIGRATED_TO.to_string(), driver.to_string());
        }
        Some(None) if have.is_some() => remove.push(ANN_MIGRATED_TO.to_string()),
        _ => {}
    }
    let has = |f: &str| obj.finalizers().iter().any(|x| x == f);
    if let Some(provisioner) = ann(obj, ANN_PROVISIONED_BY).filter(|_| !claim) {
        if migrated_driver(provisioner).is_some() {
            if has(FINALIZER_IN_TREE_PROTECTION) {
                drop_finalizers.push(FINALIZER_IN_TREE_PROTECTION.to_string());
            }
        } else if provisioner.starts_with("kubernetes.io/") {
            match policy {
                "Delete" if !has(FINALIZER_IN_TREE_PROTECTION) => {
                    add_finalizers.push(FINALIZER_IN_TREE_PROTECTION.to_string())
                }
                "Retain" | "Recycle" if has(FINALIZER_IN_TREE_PROTECTION) => {
                    drop_finalizers.push(FINALIZER_IN_TREE_PROTECTION.to_string())
                }
                _ => {}
            }
            if has(FINALIZER_EXTERNAL_PROTECTION) {
                drop_finalizers.push(FINALIZER_EXTERNAL_PROTECTION.to_string());
            }
        }
    }
    let changed =
        !set.is_empty() || !remove.is_empty() || !drop_finalizers.is_empty() || !add_finalizers.is_empty();
    changed.then_some(Action::Annotate {
        target,
        set,
        remove,
        drop_finalizers,
        add_finalizers,
        op: "migration",
    })
}

/// syncVolume: the actions that keep one PV's phase and reclaim in line with its claim.
pub fn sync_volume(pv: &PersistentVolume, cache: &Cache, env: &Env) -> Vec<Action> {
    let mut out: Vec<Action> = migration_edit(Target::Volume(pv.name_any()), pv, false, reclaim_policy(pv))
        .into_iter()
        .collect();
    out.extend(sync_volume_phase(pv, cache, env));
    out
}

fn sync_volume_phase(pv: &PersistentVolume, cache: &Cache, env: &Env) -> Vec<Action> {
    let name = pv.name_any();
    let mut out = Vec::new();
    let ours = csi_driver(pv) == Some(LOOP_DRIVER);
    let want = ours && deleter_wanted(pv);
    if ours {
        // Only volumes this provisioner made carry its finalizer; one found elsewhere (older
        // versions put it on every Delete volume) is removed, so their deletion can finish.
        let has = pv.finalizers().iter().any(|f| f == FINALIZER_LOOP_DELETER);
        if want != has && !(want && being_deleted(pv)) {
            out.push(Action::SetDeleterFinalizer {
                pv: name.clone(),
                present: want,
            });
        }
        if has_ann(pv, ANN_IMAGE_PENDING) && provisioned_here(pv) {
            // Never handed to a claim (binding waits for the image), so it holds no data.
            if being_deleted(pv) && want {
                out.extend(reclaim_loop(pv, cache));
                return out;
            }
            if claim_alive(pv, cache) {
                // Failed = creation failed for good: the claim reports it; no more retries.
                if pv_phase(pv) != "Failed" {
                    out.push(Action::CreateLoopImage { pv: name });
                }
                return out;
            }
            // Its claim is gone: release and reclaim it like any other volume.
        }
    }
    let phase = pv_phase(pv);
    let set_phase = |p: &'static str| {
        (phase != p).then(|| Action::VolumePhase {
            pv: name.clone(),
            phase: p,
            message: String::new(),
        })
    };
    // An unclaimed volume of ours an admin deleted: nothing uses it, its policy says delete.
    let unclaimed = claim_ref(pv).is_none_or(|(_, _, uid)| uid.is_empty());
    if unclaimed && want && being_deleted(pv) {
        out.extend(reclaim_loop(pv, cache));
        return out;
    }
    let Some((ns, cname, uid)) = claim_ref(pv) else {
        out.extend(set_phase("Available"));
        return out;
    };
    if uid.is_empty() {
        out.extend(set_phase("Available"));
        return out;
    }
    let key = format!("{ns}/{cname}");
    let claim = cache
        .claims
        .get(&key)
        .filter(|c| c.metadata.uid.as_deref() == Some(uid));
    let Some(claim) = claim else {
        if phase != "Released" && phase != "Failed" {
            out.push(Action::Release { pv: name });
            return out;
        }
        out.extend(reclaim(pv, cache, env));
        return out;
    };
    let vol = claim_volume_name(claim);
    if vol.is_empty() {
        if pv_block(pv) != claim_block(claim) {
            let note = format!("Cannot bind PersistentVolume {name:?} to claim {key:?}: volumeMode differs");
            out.push(ev(
                Target::Volume(name.clone()),
                true,
                "VolumeMismatch",
                note.clone(),
            ));
            out.push(ev(Target::Claim(key), true, "VolumeMismatch", note));
        } else {
            out.push(Action::WakeClaim(key));
        }
        return out;
    }
    if vol == name {
        out.extend(set_phase("Bound"));
        return out;
    }
    // The claim is bound to another volume.
    if has_ann(pv, ANN_PROVISIONED_BY) && reclaim_policy(pv) == "Delete" {
        if phase != "Released" && phase != "Failed" {
            out.push(Action::VolumePhase {
                pv: name,
                phase: "Released",
                message: String::new(),
            });
            return out;
        }
        out.extend(reclaim(pv, cache, env));
        return out;
    }
    out.push(Action::Unbind { pv: name });
    out
}

/// reclaimVolume for a Released (or Failed) volume.
fn reclaim(pv: &PersistentVolume, cache: &Cache, env: &Env) -> Vec<Action> {
    if migrated(pv) {
        // A CSI driver took this in-tree volume over; its external-provisioner reclaims it.
        return vec![];
    }
    match reclaim_policy(pv) {
        "Retain" => vec![],
        "Delete" if csi_driver(pv) == Some(LOOP_DRIVER) => reclaim_loop(pv, cache),
        "Delete" => match deleter(pv) {
            // Other drivers' volumes are deleted by their external provisioner.
            Deleter::External => vec![],
            Deleter::Nobody(why) => failed(pv, "VolumeFailedDelete", &why),
        },
        "Recycle" => {
            // Pods still using the old claim may still write to the volume: wait for them
            // (only while no new claim of that name exists; those pods then use the new one).
            let (ns, claim, _) = claim_ref(pv).unwrap_or_default();
            let key = format!("{ns}/{claim}");
            let pods = (env.pods_of)(&key);
            if !pods.is_empty() && !cache.claims.contains_key(&key) {
                let names: Vec<String> = pods.iter().map(|p| format!("{ns}/{}", p.name)).collect();
                return vec![ev(
                    Target::Volume(pv.name_any()),
                    false,
                    "VolumeFailedRecycle",
                    format!("Volume is used by pods: {}", names.join(",")),
                )];
            }
            failed(
                pv,
                "VolumeFailedRecycle",
                "recycling is not supported (the Recycle policy is deprecated upstream); delete and re-create the volume, or set the policy to Retain or Delete",
            )
        }
        other => failed(
            pv,
            "VolumeUnknownReclaimPolicy",
            &format!("volume has unrecognized PersistentVolumeReclaimPolicy {other:?}"),
        ),
    }
}

/// Has a CSI driver taken this volume over (as its marks stand once [`migration_edit`] ran)?
fn migrated(pv: &PersistentVolume) -> bool {
    match wanted_migrated_to(pv.annotations(), false) {
        Some(driver) => driver.is_some(),
        None => has_ann(pv, ANN_MIGRATED_TO),
    }
}

/// Who deletes a Released Delete-policy volume that is not the built-in driver's.
#[derive(Debug, PartialEq, Eq)]
enum Deleter {
    /// An external provisioner (a CSI volume, or one an external provisioner made).
    External,
    /// Nobody: an in-tree volume (local, nfs, hostPath, …). stowage runs no in-tree deleters.
    Nobody(String),
}

/// Upstream's findDeletablePlugin, without in-tree plugins: the provisioner recorded on the
/// volume if it is external, else the CSI driver's provisioner; anything else has no deleter.
fn deleter(pv: &PersistentVolume) -> Deleter {
    match ann(pv, ANN_PROVISIONED_BY).filter(|p| !p.is_empty()) {
        Some(p) if !p.starts_with("kubernetes.io/") => return Deleter::External,
        Some(p) => {
            return Deleter::Nobody(format!(
                "error getting deleter volume plugin for volume {:?}: no deletable volume plugin matched name {p:?} (stowage runs no in-tree volume plugins); delete the volume's storage and the PersistentVolume by hand, or set the reclaim policy to Retain",
                pv.name_any()
            ));
        }
        None => {}
    }
    if pv.spec.as_ref().is_some_and(|s| s.csi.is_some()) {
        return Deleter::External;
    }
    Deleter::Nobody(format!(
        "error getting deleter volume plugin for volume {:?}: no deletable volume plugin matched (a volume made by hand has no deleter); delete its storage and the PersistentVolume by hand, or set the reclaim policy to Retain",
        pv.name_any()
    ))
}

/// Event reason for a Delete-policy volume of the built-in driver whose image is kept.
pub const DELETE_REFUSED: &str = "VolumeDeleteRefused";

/// Deletes only what this provisioner made and no other PV still names (as external-provisioner's
/// `shouldDelete`); everything else stays Released, with a Warning saying why.
fn reclaim_loop(pv: &PersistentVolume, cache: &Cache) -> Vec<Action> {
    let name = pv.name_any();
    let handle = loop_handle(pv).unwrap_or("");
    let target = Target::Volume(name.clone());
    if !provisioned_here(pv) {
        return vec![ev(
            target,
            true,
            DELETE_REFUSED,
            format!(
                "volume {name} was not provisioned by {LOOP_DRIVER} (annotation {ANN_PROVISIONED_BY} is {:?}), so its image {handle}.img is not deleted and the volume stays Released; delete the volume (and the image, if nobody needs it) by hand, or set its reclaim policy to Retain",
                ann(pv, ANN_PROVISIONED_BY).unwrap_or("")
            ),
        )];
    }
    if !plain_handle(handle) {
        return failed(
            pv,
            DELETE_REFUSED,
            &format!(
                "volume handle {handle:?} is not a plain file name, so it names no image of {LOOP_DRIVER}; nothing was deleted"
            ),
        );
    }
    let sharing = cache.sharing_handle(pv);
    if !sharing.is_empty() {
        return vec![ev(
            target,
            true,
            DELETE_REFUSED,
            format!(
                "image {handle}.img is also the volume of PersistentVolume(s) {}; it is kept, and deleted with this volume once no other PersistentVolume names it",
                sharing.join(", ")
            ),
        )];
    }
    vec![Action::DeleteLoopVolume { pv: name }]
}

fn failed(pv: &PersistentVolume, reason: &'static str, msg: &str) -> Vec<Action> {
    if pv_phase(pv) == "Failed" {
        return vec![];
    }
    let name = pv.name_any();
    vec![
        Action::VolumePhase {
            pv: name.clone(),
            phase: "Failed",
            message: msg.into(),
        },
        ev(Target::Volume(name), true, reason, msg),
    ]
}
