//! Over 600 lines: one table, a row per case, kept whole so it reads side by side with upstream's.
//! Example-based tests of the binder core, in the style of upstream's binder_test.go tables: each
//! row is the objects the controller knows (volumes, claims, classes, pods), the object synced,
//! and the actions that come out (writes exactly; events by type and reason). They sit beside the
//! property tests (`convergence`, `data_safety`): those say what must always hold, these pin the
//! answer for the cases a reader looks up first (docs: storage-semantics §1.4–1.9).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    HostPathVolumeSource, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimStatus,
    PersistentVolumeStatus,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use stowage_testkit::builders::{pv, pvc, storage_class};

use crate::core::{Action, Cache, Env, PodUse, sync_claim, sync_volume};
use crate::pv::*;

const NS: &str = "ns";
/// The claim every row's claim-side sync is about.
const C: &str = "ns/c";

fn classes(name: &str) -> Option<Arc<StorageClass>> {
    Some(Arc::new(match name {
        "fast" => storage_class("fast", "example.com/csi").build(),
        "wffc" => storage_class("wffc", "example.com/csi")
            .wait_for_first_consumer()
            .build(),
        "loop" => storage_class("loop", LOOP_DRIVER).build(),
        "manual" => storage_class("manual", "kubernetes.io/no-provisioner").build(),
        _ => return None,
    }))
}

fn nodes(name: &str) -> Option<BTreeMap<String, String>> {
    ["node-a", "node-b"]
        .contains(&name)
        .then(|| BTreeMap::from([("kubernetes.io/hostname".to_string(), name.to_string())]))
}

// ---- objects, in upstream's terms ----

/// A volume of some external CSI driver (so the built-in driver's own rules stay out of the way).
fn vol(name: &str, size: &str) -> PersistentVolume {
    pv(name).capacity(size).driver("example.com/csi", name).build()
}

fn with_phase(mut v: PersistentVolume, phase: &str) -> PersistentVolume {
    v.status = Some(PersistentVolumeStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    v
}

/// A free volume, as its own sync leaves it.
fn free(v: PersistentVolume) -> PersistentVolume {
    with_phase(v, "Available")
}

/// A volume bound (by the controller) to claim `name` of `NS`.
fn bound_to(v: PersistentVolume, name: &str) -> PersistentVolume {
    let mut v = with_phase(v, "Bound");
    v.spec.as_mut().unwrap().claim_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        api_version: Some("v1".into()),
        namespace: Some(NS.into()),
        name: Some(name.into()),
        uid: Some(format!("uid-{name}")),
        ..Default::default()
    });
    v.annotations_mut()
        .insert(ANN_BOUND_BY_CONTROLLER.into(), "yes".into());
    v
}

/// An unbound claim `name` of `NS` (status Pending, a UID, as the apiserver hands it out).
fn claim(c: PersistentVolumeClaim) -> PersistentVolumeClaim {
    let mut c = c;
    c.metadata.uid = Some(format!("uid-{}", c.name_any()));
    c.status = Some(PersistentVolumeClaimStatus {
        phase: Some("Pending".into()),
        ..Default::default()
    });
    c
}

/// A claim the controller bound to `pv`, with every bind write done.
fn bound_claim(c: PersistentVolumeClaim, pv: &str) -> PersistentVolumeClaim {
    let mut c = claim(c);
    c.spec.as_mut().unwrap().volume_name = Some(pv.into());
    c.annotations_mut()
        .insert(ANN_BIND_COMPLETED.into(), "yes".into());
    c.annotations_mut()
        .insert(ANN_BOUND_BY_CONTROLLER.into(), "yes".into());
    c.status = Some(PersistentVolumeClaimStatus {
        phase: Some("Bound".into()),
        access_modes: Some(vec!["ReadWriteOnce".into()]),
        capacity: Some(BTreeMap::from([("storage".into(), Quantity("1Gi".into()))])),
        ..Default::default()
    });
    c
}

fn c() -> stowage_testkit::builders::PvcBuilder {
    pvc(NS, "c")
}

fn ann<K: ResourceExt>(mut o: K, k: &str, v: &str) -> K {
    o.annotations_mut().insert(k.into(), v.into());
    o
}

// ---- expected actions ----

fn bind(pv: &str) -> Action {
    Action::Bind {
        pv: pv.into(),
        claim: C.into(),
    }
}

fn claim_phase(phase: &'static str) -> Action {
    Action::ClaimPhase {
        claim: C.into(),
        phase,
    }
}

fn volume_phase(pv: &str, phase: &'static str) -> Action {
    Action::VolumePhase {
        pv: pv.into(),
        phase,
        message: String::new(),
    }
}

fn provisioner(p: &str) -> Action {
    Action::SetProvisioner {
        claim: C.into(),
        provisioner: p.into(),
    }
}

/// Normal and Warning events, by reason.
fn n(reason: &'static str) -> (bool, &'static str) {
    (false, reason)
}
fn w(reason: &'static str) -> (bool, &'static str) {
    (true, reason)
}

enum Sync {
    Claim,
    Volume(&'static str),
}

struct Row {
    name: &'static str,
    pvs: Vec<PersistentVolume>,
    claims: Vec<PersistentVolumeClaim>,
    /// Pods using claim `C`.
    pods: Vec<PodUse>,
    default_class: Option<&'static str>,
    sync: Sync,
    /// The writes and in-memory steps, exactly and in order (the Pending condition aside: it
    /// only repeats the event's reason on the claim).
    actions: Vec<Action>,
    events: Vec<(bool, &'static str)>,
}

fn row(name: &'static str, pvs: Vec<PersistentVolume>, claims: Vec<PersistentVolumeClaim>) -> Row {
    Row {
        name,
        pvs,
        claims,
        pods: vec![],
        default_class: None,
        sync: Sync::Claim,
        actions: vec![],
        events: vec![],
    }
}

impl Row {
    fn volume(mut self, name: &'static str) -> Self {
        self.sync = Sync::Volume(name);
        self
    }
    fn pods(mut self, pods: &[(&str, bool)]) -> Self {
        self.pods = pods
            .iter()
            .map(|(name, scheduled)| PodUse {
                name: name.to_string(),
                scheduled: *scheduled,
            })
            .collect();
        self
    }
    fn default_class(mut self, class: &'static str) -> Self {
        self.default_class = Some(class);
        self
    }
    fn want(mut self, actions: Vec<Action>, events: Vec<(bool, &'static str)>) -> Self {
        self.actions = actions;
        self.events = events;
        self
    }

    fn run(&self) -> (Vec<Action>, Vec<(bool, &'static str)>) {
        let mut cache = Cache::default();
        for p in &self.pvs {
            cache.put_pv(Arc::new(p.clone()));
        }
        for c in &self.claims {
            cache.put_claim(Arc::new(c.clone()));
        }
        let pods = |key: &str| {
            if key == C { self.pods.clone() } else { vec![] }
        };
        let env = Env {
            class: &classes,
            default_class: self.default_class.map(String::from),
            node_labels: &nodes,
            pods_of: &pods,
            local: false,
            room: &|_: &str| Vec::new(),
            publishing: &|| false,
        };
        let out = match self.sync {
            Sync::Claim => sync_claim(&cache.decode_claim(C).expect("row has claim ns/c"), &cache, &env),
            Sync::Volume(name) => {
                sync_volume(&cache.decode_pv(name).expect("row has the volume"), &cache, &env)
            }
        };
        let events = out
            .iter()
            .filter_map(|a| match a {
                Action::Event(e) => Some((e.warning, e.reason)),
                _ => None,
            })
            .collect();
        let actions = out
            .into_iter()
            .filter(|a| !matches!(a, Action::Event(_) | Action::ClaimCondition { .. }))
            .collect();
        (actions, events)
    }
}

fn rows() -> Vec<Row> {
    let deleting = |mut v: PersistentVolume| {
        v.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        v.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into()]);
        v
    };
    let gold = |v: PersistentVolume| {
        let mut v = v;
        v.labels_mut().insert("tier".into(), "gold".into());
        v
    };
    let on_node = |name: &str, size: &str, node: &str| {
        free(
            pv(name)
                .capacity(size)
                .driver("example.com/csi", name)
                .class("wffc")
                .node_affinity_hostname(node)
                .build(),
        )
    };
    let built_in = |name: &str, policy: &str| {
        let mut v = pv(name).reclaim(policy).build();
        v.annotations_mut()
            .insert(ANN_PROVISIONED_BY.into(), LOOP_DRIVER.into());
        v.metadata.finalizers = Some(vec![FINALIZER_LOOP_DELETER.into()]);
        v
    };
    let hand_made = |name: &str| {
        let mut v = vol(name, "1Gi");
        let spec = v.spec.as_mut().unwrap();
        spec.persistent_volume_reclaim_policy = Some("Delete".into());
        spec.csi = None;
        spec.host_path = Some(HostPathVolumeSource {
            path: "/data".into(),
            type_: None,
        });
        v
    };
    vec![
        // ---- static binding (syncUnboundClaim, any volume will do) ----
        row("1-1 the only matching free volume is bound", vec![free(vol("v1", "1Gi"))], vec![claim(c().build())])
            .want(vec![bind("v1")], vec![]),
        row(
            "1-2 smallest fit: a 3Gi claim takes the 5Gi volume, not the 10Gi one",
            vec![free(vol("v1", "1Gi")), free(vol("v10", "10Gi")), free(vol("v5", "5Gi"))],
            vec![claim(c().request("3Gi").build())],
        )
        .want(vec![bind("v5")], vec![]),
        row(
            "1-3 equal sizes: the first by name",
            vec![free(vol("vb", "2Gi")), free(vol("va", "2Gi"))],
            vec![claim(c().build())],
        )
        .want(vec![bind("va")], vec![]),
        row(
            "1-4 nothing large enough and no class: FailedBinding, stays Pending",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().request("2Gi").build())],
        )
        .want(vec![], vec![n("FailedBinding")]),
        row(
            "1-5 an unbound claim whose status still says Bound is set back to Pending",
            vec![],
            vec![{
                let mut x = claim(c().build());
                x.status.as_mut().unwrap().phase = Some("Bound".into());
                x
            }],
        )
        .want(vec![claim_phase("Pending")], vec![n("FailedBinding")]),
        row(
            "1-6 class mismatch: a 'fast' claim does not take a class-less volume; handed to fast's provisioner",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().class("fast").build())],
        )
        .want(vec![provisioner("example.com/csi")], vec![n("ExternalProvisioning")]),
        row(
            "1-7 class match: a 'fast' claim takes the 'fast' volume",
            vec![free(vol("v0", "1Gi")), free(pv("v1").driver("example.com/csi", "v1").class("fast").build())],
            vec![claim(c().class("fast").build())],
        )
        .want(vec![bind("v1")], vec![]),
        row(
            "1-8 access modes: a ReadWriteMany claim does not take a ReadWriteOnce volume",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().access_modes(&["ReadWriteMany"]).build())],
        )
        .want(vec![], vec![n("FailedBinding")]),
        row(
            "1-9 access modes: a ReadWriteOnce+ReadOnlyMany volume serves a ReadWriteOnce claim",
            vec![free(
                pv("v1")
                    .driver("example.com/csi", "v1")
                    .access_modes(&["ReadWriteOnce", "ReadOnlyMany"])
                    .build(),
            )],
            vec![claim(c().build())],
        )
        .want(vec![bind("v1")], vec![]),
        row(
            "1-10 volume mode: a Block claim does not take a Filesystem volume",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().block().build())],
        )
        .want(vec![], vec![n("FailedBinding")]),
        row(
            "1-11 label selector: only the labelled volume, though larger",
            vec![free(vol("v1", "1Gi")), free(gold(vol("v2", "2Gi")))],
            vec![claim(c().selector("tier", "gold").build())],
        )
        .want(vec![bind("v2")], vec![]),
        row(
            "1-12 a volume being deleted is not matched",
            vec![deleting(free(vol("v1", "1Gi")))],
            vec![claim(c().build())],
        )
        .want(vec![], vec![n("FailedBinding")]),
        row(
            "1-13 a volume bound to another claim is not matched",
            vec![bound_to(vol("v1", "1Gi"), "other")],
            vec![claim(c().build())],
        )
        .want(vec![], vec![n("FailedBinding")]),
        // ---- pre-bound volume or claim ----
        row(
            "2-1 a volume pre-bound by name to the claim wins over a smaller free one",
            vec![free(vol("v1", "1Gi")), free(pv("p").capacity("5Gi").driver("example.com/csi", "p").claim_ref(NS, "c", "").build())],
            vec![claim(c().build())],
        )
        .want(vec![bind("p")], vec![]),
        row(
            "2-2 a claim naming a free volume is bound to it",
            vec![free(vol("v1", "1Gi")), free(vol("v2", "2Gi"))],
            vec![claim(c().volume_name("v2").build())],
        )
        .want(vec![bind("v2")], vec![]),
        row(
            "2-3 a claim naming a volume that does not exist waits, Pending",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().volume_name("missing").build())],
        )
        .want(vec![], vec![n("FailedBinding")]),
        row(
            "2-4 a claim naming a volume too small: VolumeMismatch",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().request("2Gi").volume_name("v1").build())],
        )
        .want(vec![], vec![w("VolumeMismatch")]),
        row(
            "2-5 a claim naming a volume of another class: VolumeMismatch",
            vec![free(pv("v1").driver("example.com/csi", "v1").class("fast").build())],
            vec![claim(c().volume_name("v1").build())],
        )
        .want(vec![], vec![w("VolumeMismatch")]),
        row(
            "2-6 a claim naming a volume bound to another claim: FailedBinding warning",
            vec![bound_to(vol("v1", "1Gi"), "other")],
            vec![claim(c().volume_name("v1").build())],
        )
        .want(vec![], vec![w("FailedBinding")]),
        row(
            "2-7 a claim naming a volume with a selector that does not match: selector not checked, bound",
            vec![free(vol("v1", "1Gi"))],
            vec![claim(c().volume_name("v1").selector("tier", "gold").build())],
        )
        .want(vec![bind("v1")], vec![]),
        // ---- bound claims (syncBoundClaim) ----
        row(
            "3-1 a bound claim with its bound volume: nothing to do",
            vec![bound_to(vol("v1", "1Gi"), "c")],
            vec![bound_claim(c().build(), "v1")],
        )
        .want(vec![], vec![]),
        row("3-2 a bound claim whose volume is gone is Lost", vec![], vec![bound_claim(c().build(), "v1")])
            .want(vec![claim_phase("Lost")], vec![w("ClaimLost")]),
        row(
            "3-3 a bound claim whose volume is bound to another claim is Lost (misbound)",
            vec![bound_to(vol("v1", "1Gi"), "other")],
            vec![bound_claim(c().build(), "v1")],
        )
        .want(vec![claim_phase("Lost")], vec![w("ClaimMisbound")]),
        row(
            "3-4 a bound claim whose volume lost its claimRef is bound again",
            vec![free(vol("v1", "1Gi"))],
            vec![bound_claim(c().build(), "v1")],
        )
        .want(vec![bind("v1")], vec![]),
        // ---- volumes (syncVolume) ----
        row("4-1 a new volume without claimRef becomes Available", vec![vol("v1", "1Gi")], vec![])
            .volume("v1")
            .want(vec![volume_phase("v1", "Available")], vec![]),
        row(
            "4-2 a volume pre-bound by name only (no UID) stays Available",
            vec![free(pv("v1").driver("example.com/csi", "v1").claim_ref(NS, "c", "").build())],
            vec![],
        )
        .volume("v1")
        .want(vec![], vec![]),
        row(
            "4-3 a volume whose claim names it becomes Bound",
            vec![with_phase(bound_to(vol("v1", "1Gi"), "c"), "Available")],
            vec![bound_claim(c().build(), "v1")],
        )
        .volume("v1")
        .want(vec![volume_phase("v1", "Bound")], vec![]),
        row(
            "4-4 a Bound volume whose claim is gone is Released (after a live read)",
            vec![bound_to(vol("v1", "1Gi"), "c")],
            vec![],
        )
        .volume("v1")
        .want(vec![Action::Release { pv: "v1".into() }], vec![]),
        row(
            "4-5 a volume whose claim was re-created (other UID) is Released",
            vec![bound_to(vol("v1", "1Gi"), "c")],
            vec![{
                let mut x = claim(c().build());
                x.metadata.uid = Some("uid-new".into());
                x
            }],
        )
        .volume("v1")
        .want(vec![Action::Release { pv: "v1".into() }], vec![]),
        row(
            "4-6 Released with Retain: kept as it is",
            vec![with_phase(bound_to(vol("v1", "1Gi"), "c"), "Released")],
            vec![],
        )
        .volume("v1")
        .want(vec![], vec![]),
        row(
            "4-7 Released with Delete, another CSI driver's volume: its external provisioner deletes",
            vec![with_phase(bound_to(pv("v1").reclaim("Delete").driver("example.com/csi", "v1").build(), "c"), "Released")],
            vec![],
        )
        .volume("v1")
        .want(vec![], vec![]),
        row(
            "4-8 Released with Delete, provisioned by the built-in driver: image and volume deleted",
            vec![with_phase(bound_to(built_in("v1", "Delete"), "c"), "Released")],
            vec![],
        )
        .volume("v1")
        .want(vec![Action::DeleteLoopVolume { pv: "v1".into() }], vec![]),
        row(
            "4-9 Released with Delete, built-in volume whose image another volume names: kept",
            vec![
                with_phase(bound_to(built_in("v1", "Delete"), "c"), "Released"),
                free(pv("v2").driver(LOOP_DRIVER, "v1").build()),
            ],
            vec![],
        )
        .volume("v1")
        .want(vec![], vec![w(crate::core::DELETE_REFUSED)]),
        row(
            "4-10 Released with Delete, made by hand: no deleter, Failed",
            vec![with_phase(bound_to(hand_made("v1"), "c"), "Released")],
            vec![],
        )
        .volume("v1")
        .want(
            vec![Action::VolumePhase {
                pv: "v1".into(),
                phase: "Failed",
                message: String::new(),
            }],
            vec![w("VolumeFailedDelete")],
        ),
        row(
            "4-11 Released with Recycle: not supported, Failed",
            vec![with_phase(bound_to(pv("v1").reclaim("Recycle").driver("example.com/csi", "v1").build(), "c"), "Released")],
            vec![],
        )
        .volume("v1")
        .want(
            vec![Action::VolumePhase {
                pv: "v1".into(),
                phase: "Failed",
                message: String::new(),
            }],
            vec![w("VolumeFailedRecycle")],
        ),
        row(
            "4-12 the claim is bound to another volume: the controller's binding is undone",
            vec![bound_to(vol("v1", "1Gi"), "c"), bound_to(vol("v2", "1Gi"), "c")],
            vec![bound_claim(c().build(), "v2")],
        )
        .volume("v1")
        .want(vec![Action::Unbind { pv: "v1".into() }], vec![]),
        row(
            "4-13 the claim is bound to another volume, this one provisioned with Delete: Released",
            vec![
                ann(bound_to(pv("v1").reclaim("Delete").driver("example.com/csi", "v1").build(), "c"), ANN_PROVISIONED_BY, "example.com/csi"),
                bound_to(vol("v2", "1Gi"), "c"),
            ],
            vec![bound_claim(c().build(), "v2")],
        )
        .volume("v1")
        .want(vec![volume_phase("v1", "Released")], vec![]),
        row(
            "4-14 a provisioned volume pre-bound to a claim that names no volume yet wakes the claim",
            vec![bound_to(vol("v1", "1Gi"), "c")],
            vec![claim(c().build())],
        )
        .volume("v1")
        .want(vec![Action::WakeClaim(C.into())], vec![]),
        // ---- WaitForFirstConsumer ----
        row(
            "5-1 delayed binding without a selected node: waits for a consumer, though a volume fits",
            vec![on_node("v1", "1Gi", "node-a")],
            vec![claim(c().class("wffc").build())],
        )
        .want(vec![], vec![n("WaitForFirstConsumer")]),
        row(
            "5-2 delayed binding with an unscheduled pod: names what it waits for",
            vec![],
            vec![claim(c().class("wffc").build())],
        )
        .pods(&[("web-0", false)])
        .want(vec![], vec![n("WaitForPodScheduled")]),
        row(
            "5-3 delayed binding with a selected node: free volumes are the scheduler's to bind, the claim goes to the provisioner",
            vec![on_node("va", "1Gi", "node-b"), on_node("vb", "2Gi", "node-a")],
            vec![ann(claim(c().class("wffc").build()), ANN_SELECTED_NODE, "node-a")],
        )
        .want(vec![provisioner("example.com/csi")], vec![n("ExternalProvisioning")]),
        row(
            "5-4 delayed binding honours a pre-bound volume before any node is chosen",
            vec![free(pv("p").driver("example.com/csi", "p").class("wffc").claim_ref(NS, "c", "").build())],
            vec![claim(c().class("wffc").build())],
        )
        .want(vec![bind("p")], vec![]),
        row(
            "5-5 delayed binding with a selected node and no volume there: handed to the provisioner",
            vec![on_node("va", "1Gi", "node-b")],
            vec![ann(claim(c().class("wffc").build()), ANN_SELECTED_NODE, "node-a")],
        )
        .want(vec![provisioner("example.com/csi")], vec![n("ExternalProvisioning")]),
        // ---- provisioning hand-off ----
        row(
            "6-1 already annotated with its provisioner: only the event",
            vec![],
            vec![ann(
                ann(claim(c().class("fast").build()), ANN_STORAGE_PROVISIONER, "example.com/csi"),
                ANN_BETA_STORAGE_PROVISIONER,
                "example.com/csi",
            )],
        )
        .want(vec![], vec![n("ExternalProvisioning")]),
        row("6-2 the built-in driver's class: annotated and provisioned here", vec![], vec![claim(c().class("loop").build())])
            .want(
                vec![
                    provisioner(LOOP_DRIVER),
                    Action::ProvisionLoop {
                        claim: C.into(),
                        class: "loop".into(),
                        node: None,
                    },
                ],
                vec![],
            ),
        row(
            "6-3 the built-in driver refuses a multi-node writer mode",
            vec![],
            vec![claim(c().class("loop").access_modes(&["ReadWriteMany"]).build())],
        )
        .want(vec![provisioner(LOOP_DRIVER)], vec![w("ProvisioningFailed")]),
        row("6-4 a class that does not exist: ProvisioningFailed, waits", vec![], vec![claim(c().class("nope").build())])
            .want(vec![], vec![w("ProvisioningFailed")]),
        row("6-5 an in-tree plugin name with no plugin: ProvisioningFailed", vec![], vec![claim(c().class("manual").build())])
            .want(vec![], vec![w("ProvisioningFailed")]),
        row("6-6 a class-less claim gets the default class (retroactive default)", vec![], vec![claim(c().build())])
            .default_class("fast")
            .want(
                vec![Action::SetDefaultClass {
                    claim: C.into(),
                    class: "fast".into(),
                }],
                vec![],
            ),
        row(
            "6-7 an explicit empty class is never given the default",
            vec![],
            vec![claim(c().class("").build())],
        )
        .default_class("fast")
        .want(vec![], vec![n("FailedBinding")]),
    ]
}

#[test]
fn binder_table() {
    let rows = rows();
    assert!(rows.len() >= 25);
    let mut failures = Vec::new();
    for r in &rows {
        let (actions, events) = r.run();
        // Failed phases carry the reason as message; the table checks phase and event reason.
        let actions: Vec<Action> = actions
            .into_iter()
            .map(|a| match a {
                Action::VolumePhase { pv, phase, .. } if phase == "Failed" => Action::VolumePhase {
                    pv,
                    phase,
                    message: String::new(),
                },
                a => a,
            })
            .collect();
        if actions != r.actions || events != r.events {
            failures.push(format!(
                "{}:\n  actions {actions:?}\n  want    {:?}\n  events  {events:?}\n  want    {:?}",
                r.name, r.actions, r.events
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
