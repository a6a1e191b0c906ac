//! syncVolume: a volume's phase, reclaim (Retain, Delete, Recycle), the built-in deleter and
//! CSI migration marks.

use super::*;

/// Whether the built-in deleter may hold (and act on) this volume: made by this provisioner,
/// policy Delete, and a handle that can name an image of it.
pub fn deleter_wanted(pv: &PersistentVolume) -> bool {
    provisioned_here(pv) && reclaim_policy(pv) == "Delete" && loop_handle(pv).is_some_and(plain_handle)
}

/// Whether the claim the volume's claimRef names (with its UID) is in the cache.
pub(super) fn claim_alive(pv: &PersistentVolume, cache: &Cache) -> bool {
    claim_ref(pv).is_some_and(|(ns, n, uid)| {
        !uid.is_empty()
            && cache
                .claim_meta(&format!("{ns}/{n}"))
                .is_some_and(|m| m.uid.as_deref() == Some(uid))
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
pub(super) fn migration_edit<K: ResourceExt>(
    target: Target,
    obj: &K,
    claim: bool,
    policy: &str,
) -> Option<Action> {
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

pub(super) fn sync_volume_phase(pv: &PersistentVolume, cache: &Cache, env: &Env) -> Vec<Action> {
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
                out.extend(reclaim_loop(pv, cache, env));
                return out;
            }
            if claim_alive(pv, cache) {
                // Failed = creation failed for good: the claim reports it; no more retries.
                if pv_phase(pv) != "Failed" {
                    match loop_node(pv) {
                        // Node-local: that node's agent makes the image; say so if it is gone.
                        Some(node) => out.extend(node_gone(pv, node, env, "create")),
                        None => out.push(Action::CreateLoopImage { pv: name }),
                    }
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
        out.extend(reclaim_loop(pv, cache, env));
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
        .claim_meta(&key)
        .filter(|m| m.uid.as_deref() == Some(uid))
        .and_then(|_| cache.decode_claim(&key));
    let Some(claim) = claim else {
        if phase != "Released" && phase != "Failed" {
            out.push(Action::Release { pv: name });
            return out;
        }
        out.extend(reclaim(pv, cache, env));
        return out;
    };
    let claim = &*claim;
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
pub(super) fn reclaim(pv: &PersistentVolume, cache: &Cache, env: &Env) -> Vec<Action> {
    if migrated(pv) {
        // A CSI driver took this in-tree volume over; its external-provisioner reclaims it.
        return vec![];
    }
    match reclaim_policy(pv) {
        "Retain" => vec![],
        "Delete" if csi_driver(pv) == Some(LOOP_DRIVER) => reclaim_loop(pv, cache, env),
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
            if !pods.is_empty() && !cache.has_claim(&key) {
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
pub(super) fn migrated(pv: &PersistentVolume) -> bool {
    match wanted_migrated_to(pv.annotations(), false) {
        Some(driver) => driver.is_some(),
        None => has_ann(pv, ANN_MIGRATED_TO),
    }
}

/// Who deletes a Released Delete-policy volume that is not the built-in driver's.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Deleter {
    /// An external provisioner (a CSI volume, or one an external provisioner made).
    External,
    /// Nobody: an in-tree volume (local, nfs, hostPath, …). stowage runs no in-tree deleters.
    Nobody(String),
}

/// Upstream's findDeletablePlugin, without in-tree plugins: the provisioner recorded on the
/// volume if it is external, else the CSI driver's provisioner; anything else has no deleter.
pub(super) fn deleter(pv: &PersistentVolume) -> Deleter {
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

/// Reason of the Warning on a claim whose image, or a volume whose image deletion, waits for the
/// image store's marker (the store may not be mounted on the leader's node).
pub const IMAGE_STORE_NOT_READY: &str = "ImageStoreNotReady";

/// Reason of the Normal event on a node-local volume whose deletion was handed to its node.
pub const DELETE_REQUESTED: &str = "VolumeDeleteRequested";

/// Reason of the Warning on a volume whose deletion waits for its VolumeAttachments to go.
pub const DELETE_WAITS_FOR_DETACH: &str = "VolumeStillAttached";

/// Why the built-in deleter does not delete volume `pv` yet: VolumeAttachments on `nodes` still
/// name it (external-provisioner refuses "still attached to node" the same way). `None` when
/// none does. The note names the nodes sorted, at most ten, so it is the same on every retry.
pub fn still_attached(pv: &str, nodes: &[String]) -> Option<String> {
    const SHOWN: usize = 10;
    if nodes.is_empty() {
        return None;
    }
    let mut n: Vec<&str> = nodes.iter().map(String::as_str).collect();
    n.sort_unstable();
    n.dedup();
    let mut named = n.iter().take(SHOWN).copied().collect::<Vec<_>>().join(", ");
    if n.len() > SHOWN {
        named.push_str(&format!(" and {} more", n.len() - SHOWN));
    }
    Some(format!(
        "volume {pv} is still attached to node {named}; its image is deleted once no VolumeAttachment names the volume"
    ))
}

/// Deletes only what this provisioner made and no other PV still names (as external-provisioner's
/// `shouldDelete`); everything else stays Released, with a Warning saying why.
pub(super) fn reclaim_loop(pv: &PersistentVolume, cache: &Cache, env: &Env) -> Vec<Action> {
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
    if let Some(node) = loop_node(pv) {
        // The node holding the image deletes it once asked (`ANN_DELETE_IMAGE`); a node that is
        // gone cannot, and the volume stays, its file wherever that node's disk went.
        if let Some(gone) = node_gone(pv, node, env, "delete") {
            return vec![gone];
        }
        if has_ann(pv, ANN_DELETE_IMAGE) {
            return vec![];
        }
    }
    vec![Action::DeleteLoopVolume { pv: name }]
}

/// Event reason: the node whose store holds a node-local volume's image no longer exists.
pub const VOLUME_NODE_GONE: &str = "VolumeNodeGone";

/// A Warning when `node`, which holds (or is to make) the image of node-local volume `pv`, is not
/// a Node any more: nothing else can `what` its image, and nothing is deleted in its place.
pub(super) fn node_gone(pv: &PersistentVolume, node: &str, env: &Env, what: &str) -> Option<Action> {
    if (env.node_labels)(node).is_some() {
        return None;
    }
    let name = pv.name_any();
    Some(ev(
        Target::Volume(name.clone()),
        true,
        VOLUME_NODE_GONE,
        format!(
            "the image of volume {name} is in the image store of node {node:?}, which is not a Node of this cluster any more, so nothing can {what} it; the volume is kept (its data, if any, is on that node's disk): bring the node back, or delete the volume by hand once its disk has been dealt with"
        ),
    ))
}

pub(super) fn failed(pv: &PersistentVolume, reason: &'static str, msg: &str) -> Vec<Action> {
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
