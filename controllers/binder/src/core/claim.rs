//! syncClaim: a claim's phase, its binding, provisioning hand-off and the Pending condition.

use super::*;

pub(super) fn claim_phase_action(claim: &PersistentVolumeClaim, phase: &'static str) -> Option<Action> {
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
    // A claim waiting for its first consumer or for the scheduler is about to be updated by it
    // (VolumeBinding's PreBind sets selected-node): a condition write now would make that update
    // conflict and the pod's scheduling fail once. A claim and its pod created together make the
    // first wait look like "no consumer yet" until the pod is seen, so neither wait writes; the
    // Event says what it waits for (as kube-controller-manager, which writes nothing then).
    if let Some((reason, message)) = why
        && !matches!(reason, "WaitForPodScheduled" | "WaitForFirstConsumer")
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

pub(super) fn sync_claim_phase(claim: &PersistentVolumeClaim, cache: &Cache, env: &Env) -> Vec<Action> {
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
        let Some(pv) = cache.decode_pv(vol) else {
            return lost(&format!(
                "Bound claim has lost its PersistentVolume {vol:?}; data on the volume is lost!"
            ));
        };
        let pv = &*pv;
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
        let Some(pv) = cache.decode_pv(vol) else {
            out.extend(claim_phase_action(claim, "Pending"));
            out.push(ev(
                target,
                false,
                "FailedBinding",
                format!("waiting for volume {vol:?} to be created"),
            ));
            return out;
        };
        let pv = &*pv;
        if claim_ref(pv).is_none() || refers_to(pv, claim) {
            if cache.reserved_for_other(vol, &key) {
                out.extend(claim_phase_action(claim, "Pending"));
                return out;
            }
            // Selector and node affinity are not checked for volumes asked for by name (upstream).
            if claim_ref(pv).is_none()
                && let Err(why) = check(pv, claim, Scope::Named)
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
    match find_best(claim, cache, delay) {
        Found::Volume(pv) => {
            out.push(Action::Bind {
                pv: pv.name_any(),
                claim: key,
            });
            return out;
        }
        // Upstream's IsDelayBindingProvisioning: once the scheduler selected a node it chose
        // provisioning, which goes on below.
        Found::Delayed if chosen_node(claim, delay).is_none() => {
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
        Found::Delayed | Found::None => {}
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
                    explain(claim, cache)
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
                if let Some(why) = loop_refusal(claim, cache).or_else(|| fs_refusal(&class, env.local)) {
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
                } else if env.local {
                    let node = match chosen_node(claim, delay) {
                        Some(node) => Ok(node.to_string()),
                        // Binding at once: no scheduler chose, so this provisioner does.
                        None => pick_node(claim, &class, env),
                    };
                    match node {
                        Ok(node) => out.push(Action::ProvisionLoop {
                            claim: key,
                            class: name.into(),
                            node: Some(node),
                        }),
                        Err(NoNode::NotYetPublished(why)) => {
                            out.push(ev(target, false, WAITING_FOR_CAPACITY, why))
                        }
                        Err(NoNode::Failed(why)) => out.push(ev(target, true, "ProvisioningFailed", why)),
                    }
                } else {
                    out.push(Action::ProvisionLoop {
                        claim: key,
                        class: name.into(),
                        node: None,
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
                explain(claim, cache)
            ),
        )),
    }
    out
}

/// Reason of the Normal Event on a claim of a class that binds at once while no node has
/// published room for that class yet (local mode; a class made moments ago).
pub const WAITING_FOR_CAPACITY: &str = "WaitingForCapacity";

/// Why no node was picked for a claim of a class that binds at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoNode {
    /// The agents publish room for other classes but not yet for this one: they publish a new
    /// class within seconds, and the claim is provisioned then.
    NotYetPublished(String),
    /// Nothing fits, or no agent publishes at all.
    Failed(String),
}

/// Local mode, a class that binds at once: the node to make the volume on, as the anchors'
/// distributed provisioners pick one: among the nodes whose agents publish room for the class
/// (CSIStorageCapacity), that exist and that the class's allowed topologies admit, the one with
/// the most room that can hold the request (ties by name). The reason when none can.
pub fn pick_node(claim: &PersistentVolumeClaim, class: &StorageClass, env: &Env) -> Result<String, NoNode> {
    let want = claim_request(claim).unwrap_or(0);
    let name = class.name_any();
    let published = (env.room)(&name);
    let nothing_published = published.is_empty();
    let rooms: Vec<(String, u128)> = published
        .into_iter()
        .filter(|(node, _)| (env.node_labels)(node).is_some_and(|l| admits(class, &l)))
        .collect();
    // Most room first, then the first name.
    let most = |a: &&(String, u128), b: &&(String, u128)| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0));
    if let Some((node, _)) = rooms.iter().filter(|(_, bytes)| *bytes >= want).max_by(most) {
        return Ok(node.clone());
    }
    match rooms.iter().max_by(most) {
        // Nothing published for this class, though the agents publish: a class they have not
        // seen yet (they publish every class of the driver as it appears).
        None if nothing_published && (env.publishing)() => Err(NoNode::NotYetPublished(format!(
            "storage class {name:?} binds immediately, and the nodes' agents have not yet published room for it (they publish each new class of {LOOP_DRIVER} within seconds): the volume is made on the node with the most room once they have"
        ))),
        None => Err(NoNode::Failed(format!(
            "storage class {name:?} binds immediately, and no node publishes room for it: in local mode a volume is made in the image store of a node whose agent runs (its CSIStorageCapacity objects); check the agents, or set volumeBindingMode: WaitForFirstConsumer so the scheduler picks the node with its pod"
        ))),
        Some((node, bytes)) => Err(NoNode::Failed(format!(
            "no node's image store has room for {} of storage class {name:?} (the most is {} on node {node}); free space on a node, or ask for less",
            human(want),
            human(*bytes)
        ))),
    }
}

/// Whether a node with `labels` is inside the class's allowed topologies (any node when none).
fn admits(class: &StorageClass, labels: &BTreeMap<String, String>) -> bool {
    let Some(terms) = class.allowed_topologies.as_ref().filter(|t| !t.is_empty()) else {
        return true;
    };
    terms.iter().any(|t| {
        t.match_label_expressions.iter().flatten().all(|e| {
            labels
                .get(&e.key)
                .is_some_and(|v| e.values.iter().any(|w| w == v))
        })
    })
}

/// Why the built-in provisioner cannot provision for the node the scheduler selected (delayed
/// binding only): the node is unknown, or the class's allowed topologies exclude it, so a volume
/// made now could never be used by the pod waiting on that node.
pub(super) fn node_refusal(
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
    (!admits(class, &labels)).then(|| {
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
/// Why the built-in provisioner cannot make a volume of the class's file system
/// (`csi.storage.k8s.io/fstype`, or the older `fsType`): one it does not make, or XFS on a shared
/// store. Refused before any PV exists, rather than a volume that no node can ever stage.
pub fn fs_refusal(class: &StorageClass, local: bool) -> Option<String> {
    let fs = crate::loopdev::class_fs_type(class)?;
    let why = match stowage_loopdriver::csi::caps::fs_type(fs) {
        Err(why) => why,
        Ok(fs) if !local => stowage_loopdriver::csi::caps::shared_refusal(fs)?,
        Ok(_) => return None,
    };
    Some(format!("storage class {:?}: {why}", class.name_any()))
}

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
    let pv = cache.decode_pv(&name)?;
    if has_ann(pv.as_ref(), ANN_IMAGE_PENDING) && pv_phase(&pv) == "Failed" {
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

#[cfg(test)]
mod fs_tests {
    use super::fs_refusal;
    use stowage_testkit::builders::storage_class;

    #[test]
    fn xfs_is_made_only_for_node_local_stores_and_unknown_types_never() {
        let class = |k: &str, v: &str| storage_class("c", "loop.stowage.dev").parameter(k, v).build();
        for key in ["csi.storage.k8s.io/fstype", "fsType"] {
            assert_eq!(fs_refusal(&class(key, "ext4"), false), None);
            assert_eq!(fs_refusal(&class(key, "xfs"), true), None);
            let shared = fs_refusal(&class(key, "xfs"), false).unwrap();
            assert!(shared.contains("node-local image stores only"), "{shared}");
            let unknown = fs_refusal(&class(key, "btrfs"), true).unwrap();
            assert!(unknown.contains("\"btrfs\" is not supported"), "{unknown}");
        }
        let plain = storage_class("c", "loop.stowage.dev").build();
        assert_eq!(fs_refusal(&plain, false), None, "no type: ext4");
    }
}
