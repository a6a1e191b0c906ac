//! Matching a claim to a volume: why a volume cannot serve a claim, and the best one that can.

use super::*;

/// Why a volume cannot serve a claim, in words a user can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    BeingDeleted,
    TooSmall { have: u128, want: u128 },
    Class { have: String, want: String },
    AccessModes { have: Vec<String>, want: Vec<String> },
    VolumeMode,
    Selector,
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
    /// A volume pre-bound to the claim: size, modes, volume mode and attributes class.
    Prebound,
    /// A volume the claim asked for by name (upstream's checkVolumeSatisfyClaim): adds the class.
    Named,
    /// Any free volume: adds the claim's label selector.
    Any,
}

/// The checks of one candidate, in upstream's order (its controller path: node affinity is the
/// scheduler's to check).
pub fn check(pv: &PersistentVolume, claim: &PersistentVolumeClaim, scope: Scope) -> Result<(), Mismatch> {
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
    if has_ann(pv, ANN_IMAGE_PENDING) {
        return Err(Mismatch::ImagePending);
    }
    Ok(())
}

/// Outcome of looking for a volume.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    Volume(Arc<PersistentVolume>),
    /// Binding is delayed (WaitForFirstConsumer) and nothing is pre-bound to the claim: free
    /// volumes are the scheduler's to choose, so the claim waits for a consumer, or for the
    /// provisioner once a node is selected.
    Delayed,
    None,
}

/// The smallest volume that satisfies the claim: first a volume pre-bound to it, then, unless
/// binding is delayed, the free volumes of its class through the index.
///
/// As upstream's controller path (`FindMatchingVolume` with no node): node affinity is never
/// evaluated here, and a delayed claim never takes a free volume, even once the scheduler has
/// selected a node. The scheduler's volume-binding plugin binds free volumes to delayed claims
/// (it writes the volume's claimRef, which makes it pre-bound here); it selects a node only when
/// it chose dynamic provisioning, and taking a free volume then would race the provisioner.
pub fn find_best(claim: &PersistentVolumeClaim, cache: &Cache, delay: bool) -> Found {
    let key = claim_key(claim);
    let mut prebound: Vec<Arc<PersistentVolume>> = cache
        .index
        .prebound_to(&key)
        .filter(|n| !cache.reserved_for_other(n, &key))
        .filter_map(|n| cache.decode_pv(n))
        .filter(|pv| refers_to(pv, claim))
        .filter(|pv| check(pv, claim, Scope::Prebound).is_ok())
        .collect();
    prebound.sort_by_key(|pv| (pv_capacity(pv), pv.name_any()));
    if let Some(pv) = prebound.into_iter().next() {
        return Found::Volume(pv);
    }
    if delay {
        return Found::Delayed;
    }
    let (Some(want), class) = (claim_request(claim), claim_class(claim).unwrap_or("")) else {
        return Found::None;
    };
    for group in cache.index.groups(class, &claim_modes(claim), want) {
        for (_, name) in group {
            if cache.reserved_for_other(name, &key) {
                continue;
            }
            let Some(pv) = cache.decode_pv(name) else { continue };
            if check(&pv, claim, Scope::Any).is_ok() {
                return Found::Volume(pv);
            }
        }
    }
    Found::None
}

/// The node the scheduler selected for a delayed claim's provisioning. Upstream never reads it
/// for an Immediate claim (its volume decides where the pod can go), even if some tool
/// annotated a node on it.
pub(super) fn chosen_node(claim: &PersistentVolumeClaim, delay: bool) -> Option<&str> {
    ann(claim, ANN_SELECTED_NODE).filter(|_| delay)
}

/// Names the rule that ruled out the nearest free volumes of the claim's class (by size).
pub fn explain(claim: &PersistentVolumeClaim, cache: &Cache) -> String {
    let class = claim_class(claim).unwrap_or("");
    let want = claim_request(claim).unwrap_or(0);
    let key = claim_key(claim);
    // Bounded work whatever the number of volumes: only the neighbours of the requested size.
    let (total, candidates) = cache.index.near(class, want, 4);
    if total == 0 {
        return format!("no available volumes in storage class {class:?}");
    }
    let mut near: Vec<(u128, &str, Mismatch)> = candidates
        .into_iter()
        .filter_map(|(size, name)| {
            let why = if cache.reserved_for_other(name, &key) {
                Mismatch::Reserved
            } else {
                check(cache.decode_pv(name)?.as_ref(), claim, Scope::Any).err()?
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
