use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, ObjectReference, PersistentVolumeClaimSpec, PersistentVolumeClaimStatus,
    PersistentVolumeSpec, VolumeResourceRequirements,
};
use kube::api::ObjectMeta;
use proptest::prelude::*;

use super::*;

const MI: u128 = 1 << 20;

fn q(s: &str) -> Quantity {
    Quantity(s.into())
}

fn mi(n: u128) -> Quantity {
    q(&format!("{n}Mi"))
}

fn sz(n: u128) -> Size {
    Size::of(&mi(n)).unwrap()
}

fn claim(req: &str, cap: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some("c".into()),
            namespace: Some("ns".into()),
            uid: Some("u1".into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            storage_class_name: Some("fast".into()),
            volume_name: Some("pv1".into()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".into(), q(req))])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            capacity: Some(BTreeMap::from([("storage".into(), q(cap))])),
            ..Default::default()
        }),
    }
}

fn pv(cap: &str, driver: &str) -> PersistentVolume {
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some("pv1".into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".into(), q(cap))])),
            csi: Some(CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: "pv1".into(),
                ..Default::default()
            }),
            claim_ref: Some(ObjectReference {
                namespace: Some("ns".into()),
                name: Some("c".into()),
                uid: Some("u1".into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

fn class(allow: bool) -> StorageClass {
    StorageClass {
        metadata: ObjectMeta {
            name: Some("fast".into()),
            ..Default::default()
        },
        provisioner: LOOP_DRIVER.into(),
        allow_volume_expansion: Some(allow),
        ..Default::default()
    }
}

fn t0() -> Timestamp {
    Timestamp::from_second(1_700_000_000).unwrap()
}

fn with_request(c: &PersistentVolumeClaim, req: Quantity) -> PersistentVolumeClaim {
    let mut c = c.clone();
    c.spec.as_mut().unwrap().resources.as_mut().unwrap().requests =
        Some(BTreeMap::from([("storage".into(), req)]));
    c
}

fn sync(c: &PersistentVolumeClaim, v: &PersistentVolume, allow: bool) -> Vec<Action> {
    sync_claim(c, Some(v), Some(&class(allow)), false, t0())
}

fn expand_size(actions: &[Action]) -> Option<u128> {
    actions.iter().find_map(|a| match a {
        Action::Expand { size, .. } => Some(size.bytes),
        _ => None,
    })
}

/// What the node agent does when it finishes: capacity = allocation, status entry and resize
/// conditions gone.
fn node_finishes(c: &PersistentVolumeClaim) -> PersistentVolumeClaim {
    let mut out = with_resize_conditions(c, vec![]);
    let a = allocated(c).unwrap();
    let st = out.status.as_mut().unwrap();
    st.capacity.as_mut().unwrap().insert("storage".into(), a.quantity);
    set_status_entry(&mut out, None);
    out
}

#[test]
fn a_larger_request_expands_a_loop_volume() {
    let c = claim("128Mi", "64Mi");
    let v = pv("64Mi", LOOP_DRIVER);
    let a = sync(&c, &v, true);
    assert_eq!(
        a,
        vec![Action::Expand {
            pv: "pv1".into(),
            handle: "pv1".into(),
            size: sz(128),
            mark: true,
            node_step: true,
            filesystem: true,
        }]
    );
}

#[test]
fn the_controller_steps_write_upstream_states() {
    let c = claim("128Mi", "64Mi");
    let marked = mark_in_progress(&c, &sz(128), t0());
    assert_eq!(resize_status(&marked), Some(CONTROLLER_RESIZE_IN_PROGRESS));
    assert_eq!(allocated(&marked), Some(sz(128)));
    assert!(has_condition(&marked, COND_RESIZING));
    let pending = mark_node_pending(&marked, true, t0());
    assert_eq!(resize_status(&pending), Some(NODE_RESIZE_PENDING));
    assert!(has_condition(&pending, COND_FS_RESIZE_PENDING));
    assert!(
        !has_condition(&pending, COND_RESIZING),
        "Resizing ends with the controller's work"
    );
    let finished = mark_finished(&marked, &sz(128));
    assert_eq!(resize_status(&finished), None);
    assert_eq!(capacity(&finished), Some(sz(128)));
    assert!(finished.status.unwrap().conditions.is_none());
}

#[test]
fn node_pending_waits_for_the_node_even_when_asked_for_more() {
    let c = mark_node_pending(
        &mark_in_progress(&claim("128Mi", "64Mi"), &sz(128), t0()),
        true,
        t0(),
    );
    let c = with_request(&c, mi(256));
    assert!(sync(&c, &pv("128Mi", LOOP_DRIVER), true).is_empty());
    // Once the node is done, the next expansion starts.
    let done = node_finishes(&c);
    assert_eq!(
        expand_size(&sync(&done, &pv("128Mi", LOOP_DRIVER), true)),
        Some(256 * MI)
    );
}

#[test]
fn two_requests_in_quick_succession_end_at_the_larger() {
    // The second request lands after the allocation of the first was recorded.
    let c = mark_in_progress(&claim("128Mi", "64Mi"), &sz(128), t0());
    let c = with_request(&c, mi(256));
    let a = sync(&c, &pv("64Mi", LOOP_DRIVER), true);
    assert_eq!(expand_size(&a), Some(256 * MI));
    assert!(matches!(a[0], Action::Expand { mark: true, .. }));
}

#[test]
fn a_class_without_expansion_only_warns() {
    let c = claim("128Mi", "64Mi");
    let a = sync(&c, &pv("64Mi", LOOP_DRIVER), false);
    assert!(matches!(
        &a[..],
        [Action::Event {
            warning: true,
            reason: REASON_NOT_ALLOWED,
            ..
        }]
    ));
    let a = sync_claim(&c, Some(&pv("64Mi", LOOP_DRIVER)), None, false, t0());
    match &a[..] {
        [Action::Event { note, .. }] => assert!(note.contains("does not exist"), "{note}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unbound_or_foreign_volumes_are_left_alone() {
    let mut c = claim("128Mi", "64Mi");
    c.status.as_mut().unwrap().phase = Some("Pending".into());
    assert!(sync(&c, &pv("64Mi", LOOP_DRIVER), true).is_empty());
    let c = claim("128Mi", "64Mi");
    let mut v = pv("64Mi", LOOP_DRIVER);
    v.spec.as_mut().unwrap().claim_ref.as_mut().unwrap().uid = Some("other".into());
    assert!(sync(&c, &v, true).is_empty());
    assert!(sync_claim(&c, None, Some(&class(true)), false, t0()).is_empty());
}

#[test]
fn other_drivers_are_handed_to_their_resizer_without_a_write() {
    let c = claim("2Gi", "1Gi");
    let v = pv("1Gi", "ebs.csi.aws.com");
    let a = sync(&c, &v, true);
    // An event only (the executor sends it once per note): external-resizer finds the claim by
    // the volume's driver, so nothing on the claim changes.
    assert!(
        matches!(
            a.as_slice(),
            [Action::Event {
                reason: REASON_EXTERNAL_EXPANDING,
                warning: false,
                ..
            }]
        ),
        "{a:?}"
    );
    let done = claim("2Gi", "2Gi");
    assert!(
        sync(&done, &pv("2Gi", "ebs.csi.aws.com"), true).is_empty(),
        "grown: nothing to say"
    );
}

/// A migrated in-tree volume (its PV still names the in-tree plugin) is handed to the CSI
/// driver's external-resizer through upstream's `volume.kubernetes.io/storage-resizer` on the
/// claim; before, only an event went out and the claim was never expanded.
#[test]
fn migrated_in_tree_claims_name_their_csi_resizer() {
    use k8s_openapi::api::core::v1::{AWSElasticBlockStoreVolumeSource, GCEPersistentDiskVolumeSource};
    let c = claim("2Gi", "1Gi");
    let mut v = pv("1Gi", "unused");
    let spec = v.spec.as_mut().unwrap();
    spec.csi = None;
    spec.aws_elastic_block_store = Some(AWSElasticBlockStoreVolumeSource {
        volume_id: "vol-1".into(),
        ..Default::default()
    });
    let a = sync(&c, &v, true);
    let [
        Action::Event { reason, note, .. },
        Action::ClaimStatus { claim: next, .. },
    ] = a.as_slice()
    else {
        panic!("{a:?}");
    };
    assert_eq!(*reason, REASON_EXTERNAL_EXPANDING);
    assert_eq!(
        note,
        "CSI migration enabled for kubernetes.io/aws-ebs; waiting for external resizer to expand the pvc"
    );
    assert_eq!(ann(next.as_ref(), ANN_STORAGE_RESIZER), Some("ebs.csi.aws.com"));
    // Already named: the event only.
    assert!(matches!(sync(next, &v, true).as_slice(), [Action::Event { .. }]));
    // Grown: nothing, unless the PV still carries pre-resize-capacity (upstream's second case).
    assert!(sync(&claim("2Gi", "2Gi"), &v, true).is_empty());
    v.metadata.annotations = Some(BTreeMap::from([(
        ANN_PRE_RESIZE_CAPACITY.to_string(),
        "1Gi".to_string(),
    )]));
    assert_eq!(sync(&claim("2Gi", "2Gi"), &v, true).len(), 2);
    // A class that does not allow expansion: the same warning as for any driver.
    let a = sync(&c, &v, false);
    assert!(
        matches!(
            a.as_slice(),
            [Action::Event {
                reason: REASON_NOT_ALLOWED,
                warning: true,
                ..
            }]
        ),
        "{a:?}"
    );
    // Every migrated plugin maps to its driver.
    let spec = v.spec.as_mut().unwrap();
    spec.aws_elastic_block_store = None;
    spec.gce_persistent_disk = Some(GCEPersistentDiskVolumeSource {
        pd_name: "d".into(),
        ..Default::default()
    });
    assert_eq!(
        migrated_plugin(&v),
        Some(("kubernetes.io/gce-pd", "pd.csi.storage.gke.io"))
    );
}

#[test]
fn block_volumes_finish_without_a_node_unless_attached() {
    let c = claim("128Mi", "64Mi");
    let mut v = pv("64Mi", LOOP_DRIVER);
    v.spec.as_mut().unwrap().volume_mode = Some("Block".into());
    let a = sync(&c, &v, true);
    assert!(matches!(
        a[0],
        Action::Expand {
            node_step: false,
            filesystem: false,
            ..
        }
    ));
    let a = sync_claim(&c, Some(&v), Some(&class(true)), true, t0());
    assert!(matches!(
        a[0],
        Action::Expand {
            node_step: true,
            filesystem: false,
            ..
        }
    ));
}

#[test]
fn lowering_the_request_after_a_failure_ends_the_attempt() {
    let c = mark_in_progress(&claim("128Mi", "64Mi"), &sz(128), t0());
    let c = mark_failed(&c, "disk on fire", false, t0()).unwrap();
    assert!(
        mark_failed(&c, "disk on fire", false, t0()).is_none(),
        "said once"
    );
    let c = with_request(&c, mi(64));
    let v = pv("64Mi", LOOP_DRIVER);
    let a = sync(&c, &v, true);
    let Action::ClaimStatus { claim: next, .. } = &a[0] else {
        panic!("{a:?}")
    };
    assert_eq!(allocated(next), Some(sz(64)));
    assert_eq!(resize_status(next), None);
    assert!(next.status.as_ref().unwrap().conditions.is_none());
    assert!(matches!(
        a[1],
        Action::Event {
            reason: REASON_RESIZE_CANCELED,
            ..
        }
    ));
    assert!(sync(next, &v, true).is_empty(), "converged");
}

#[test]
fn lowering_to_a_smaller_expansion_after_a_failure_retries_at_that_size() {
    let c = mark_in_progress(&claim("1Gi", "64Mi"), &Size::of(&q("1Gi")).unwrap(), t0());
    let c = mark_failed(&c, "too big", true, t0()).unwrap();
    let v = pv("64Mi", LOOP_DRIVER);
    assert!(sync(&c, &v, true).is_empty(), "infeasible at the same size waits");
    let later = t0() + std::time::Duration::from_secs(3600);
    assert!(
        !sync_claim(&c, Some(&v), Some(&class(true)), false, later).is_empty(),
        "slow retry"
    );
    let c = with_request(&c, mi(96));
    assert_eq!(expand_size(&sync(&c, &v, true)), Some(96 * MI));
}

#[test]
fn a_failed_attempt_is_retried_without_rewriting_the_status() {
    let c = mark_in_progress(&claim("128Mi", "64Mi"), &sz(128), t0());
    let c = mark_failed(&c, "EIO", false, t0()).unwrap();
    let a = sync(&c, &pv("64Mi", LOOP_DRIVER), true);
    assert!(matches!(a[..], [Action::Expand { mark: false, .. }]));
}

#[test]
fn leftover_conditions_and_annotations_are_cleaned_up() {
    let c = with_resize_conditions(
        &claim("128Mi", "128Mi"),
        vec![condition(COND_FS_RESIZE_PENDING, None, t0())],
    );
    let mut v = pv("128Mi", LOOP_DRIVER);
    v.annotations_mut()
        .insert(ANN_PRE_RESIZE_CAPACITY.into(), "64Mi".into());
    let a = sync(&c, &v, true);
    assert_eq!(a.len(), 2, "{a:?}");
    let Action::ClaimStatus { claim: next, .. } = &a[0] else {
        panic!()
    };
    let Action::Volume { pv: nv, .. } = &a[1] else {
        panic!()
    };
    assert!(sync(next, nv, true).is_empty());
}

#[test]
fn other_conditions_survive_resize_writes() {
    let mut c = claim("128Mi", "64Mi");
    c.status.as_mut().unwrap().conditions = Some(vec![PersistentVolumeClaimCondition {
        type_: "ModifyingVolume".into(),
        status: "True".into(),
        ..Default::default()
    }]);
    let m = mark_in_progress(&c, &sz(128), t0());
    let f = mark_finished(&m, &sz(128));
    let types: Vec<_> = f
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .map(|c| c.type_)
        .collect();
    assert_eq!(types, vec!["ModifyingVolume".to_string()]);
}

#[test]
fn the_pv_never_shrinks() {
    let v = pv("128Mi", LOOP_DRIVER);
    assert!(grown_pv(&v, &sz(64), None).is_none());
    let g = grown_pv(&v, &sz(256), Some(&sz(128))).unwrap();
    assert_eq!(pv_size(&g), Some(sz(256)));
    assert_eq!(ann(&g, ANN_PRE_RESIZE_CAPACITY), Some("128Mi"));
}

// ---- a model of the whole loop: controller, node, user, failures ----

#[derive(Debug, Clone)]
enum Op {
    Sync { fail: bool, infeasible: bool },
    Node,
    Raise(u128),
    Lower(u128),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<bool>(), any::<bool>()).prop_map(|(f, i)| Op::Sync { fail: f, infeasible: f && i }),
        2 => Just(Op::Node),
        2 => (1u128..200).prop_map(Op::Raise),
        1 => (0u128..200).prop_map(Op::Lower),
    ]
}

struct World {
    claim: PersistentVolumeClaim,
    pv: PersistentVolume,
    image: u128,
    now: Timestamp,
}

impl World {
    /// Carries out what the executor would, with an optional failure of the image growth.
    fn apply(&mut self, actions: Vec<Action>, fail: bool, infeasible: bool) {
        for a in actions {
            match a {
                Action::Expand {
                    size,
                    mark,
                    node_step,
                    filesystem,
                    ..
                } => {
                    if mark {
                        self.claim = mark_in_progress(&self.claim, &size, self.now);
                    }
                    if fail {
                        if let Some(n) = mark_failed(&self.claim, "boom", infeasible, self.now) {
                            self.claim = n;
                        }
                        return;
                    }
                    self.image = self.image.max(size.bytes);
                    let pre = if node_step { capacity(&self.claim) } else { None };
                    if let Some(n) = grown_pv(&self.pv, &size, pre.as_ref()) {
                        self.pv = n;
                    }
                    self.claim = if node_step {
                        mark_node_pending(&self.claim, filesystem, self.now)
                    } else {
                        mark_finished(&self.claim, &size)
                    };
                }
                Action::ClaimStatus { claim, .. } => self.claim = *claim,
                Action::Volume { pv, .. } => self.pv = *pv,
                Action::Event { .. } => {}
            }
        }
    }

    fn step(&mut self, op: &Op) {
        self.now += std::time::Duration::from_secs(1);
        match op {
            Op::Sync { fail, infeasible } => {
                let a = sync_claim(&self.claim, Some(&self.pv), Some(&class(true)), false, self.now);
                self.apply(a, *fail, *infeasible);
            }
            Op::Node => {
                if resize_status(&self.claim) == Some(NODE_RESIZE_PENDING) {
                    self.claim = node_finishes(&self.claim);
                }
            }
            Op::Raise(n) => {
                let r = request(&self.claim).unwrap().bytes / MI;
                self.claim = with_request(&self.claim, mi(r + n));
            }
            Op::Lower(n) => {
                // Validation: never below status.capacity.
                let r = request(&self.claim).unwrap().bytes / MI;
                let c = capacity(&self.claim).unwrap().bytes / MI;
                self.claim = with_request(&self.claim, mi(r.saturating_sub(*n).max(c)));
            }
        }
    }

    fn invariants(&self, image_before: u128, pv_before: u128) -> Result<(), TestCaseError> {
        let pvcap = pv_size(&self.pv).unwrap().bytes;
        prop_assert!(self.image >= image_before, "image shrank");
        prop_assert!(pvcap >= pv_before, "PV capacity shrank");
        prop_assert!(pvcap <= self.image, "PV says more than the image has");
        prop_assert!(
            capacity(&self.claim).unwrap().bytes <= pvcap,
            "claim says more than the PV"
        );
        Ok(())
    }
}

proptest! {
    /// Whatever users, nodes and failures do, sizes only grow, nothing claims more than the
    /// layer below has, and once failures stop the claim converges to (at least) its request
    /// with no resize state left and no further actions.
    #[test]
    fn expansion_converges_and_never_shrinks(ops in proptest::collection::vec(op(), 0..60)) {
        let mut w = World {
            claim: claim("64Mi", "64Mi"),
            pv: pv("64Mi", LOOP_DRIVER),
            image: 64 * MI,
            now: t0(),
        };
        for op in &ops {
            let (img, pvc) = (w.image, pv_size(&w.pv).unwrap().bytes);
            w.step(op);
            w.invariants(img, pvc)?;
        }
        // Failures stop; the slow retry of infeasible attempts comes due.
        w.now += INFEASIBLE_RETRY * 2;
        for _ in 0..10 {
            w.step(&Op::Sync { fail: false, infeasible: false });
            w.step(&Op::Node);
        }
        let req = request(&w.claim).unwrap().bytes;
        prop_assert!(capacity(&w.claim).unwrap().bytes >= req);
        prop_assert_eq!(resize_status(&w.claim), None);
        prop_assert!(!has_resize_condition(&w.claim));
        prop_assert!(sync_claim(&w.claim, Some(&w.pv), Some(&class(true)), false, w.now).is_empty());
        prop_assert_eq!(capacity(&w.claim).unwrap().bytes, pv_size(&w.pv).unwrap().bytes);
    }

    /// A converged claim (request met, no resize state) produces no action, whatever its sizes.
    #[test]
    fn converged_claims_need_nothing(cap in 1u128..4096, below in 0u128..4096) {
        let req = cap.saturating_sub(below).max(1);
        let c = claim(&format!("{req}Mi"), &format!("{cap}Mi"));
        let size = format!("{cap}Mi");
        prop_assert!(sync(&c, &pv(&size, LOOP_DRIVER), true).is_empty());
        prop_assert!(sync(&c, &pv(&size, "other.csi"), true).is_empty());
    }

    /// No decision ever asks for less than the volume already has.
    #[test]
    fn never_asks_to_shrink(req in 1u128..4096, cap in 1u128..4096, pvcap in 1u128..4096, alloc in proptest::option::of(1u128..4096),
                            st in proptest::option::of(prop_oneof![
                                Just(CONTROLLER_RESIZE_IN_PROGRESS), Just(CONTROLLER_RESIZE_INFEASIBLE),
                                Just(NODE_RESIZE_PENDING), Just(NODE_RESIZE_IN_PROGRESS), Just(NODE_RESIZE_INFEASIBLE)])) {
        let mut c = claim(&format!("{req}Mi"), &format!("{cap}Mi"));
        if let Some(a) = alloc {
            set_allocated(&mut c, &sz(a));
        }
        set_status_entry(&mut c, st);
        let v = pv(&format!("{pvcap}Mi"), LOOP_DRIVER);
        for a in sync(&c, &v, true) {
            if let Action::Expand { size, .. } = a {
                prop_assert!(size.bytes >= pvcap * MI);
                prop_assert!(size.bytes > cap * MI);
            }
        }
    }
}
