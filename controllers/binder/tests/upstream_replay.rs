//! Upstream's own binder, delete and recycle test tables (`binder_test.go`, `delete_test.go`,
//! `recycle_test.go` of kubernetes/kubernetes v1.36 `pkg/controller/volume/persistentvolume`),
//! replayed on the real apiserver.
//!
//! Upstream's tables check one call of syncClaim/syncVolume against a fake client. A real
//! controller keeps syncing until nothing changes, so what is compared here is the state the
//! controller *settles in*, and the oracle is kube-controller-manager itself: with
//! `STOWAGE_BLESS_UPSTREAM=1` each scenario is run under the real kube-controller-manager (only
//! its persistentvolume-binder-controller, resync 1 s) and its settled state is written to
//! `tests/upstream_settled.json`; normally each scenario runs under stowage's binder and must
//! settle in exactly that state (phases, claimRefs, volumeNames, the bind annotations, claim
//! status capacity/access modes/attributes class, finalizers the controller manages).
//! Scenarios whose upstream test needs a mocked in-tree plugin (a deleter or recycler that
//! succeeds or fails on cue) run with no such plugin, as on a real cluster: both controllers
//! then find no deleter/recycler. Not replayed: scenarios about the upstream controller's cache
//! internals (4-11, 4-12) or its mocked operations' timing (8-4..8-7, 6-3..6-8: a plugin that
//! fails or an object that changes between two of its calls), and 6-10, whose "Unknown" reclaim
//! policy the real apiserver refuses to store.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    GCEPersistentDiskVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, Pod, VolumeResourceRequirements,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use stowage_testkit::ControlPlane;
use tokio::task::JoinSet;

const NS: &str = "upstream";
const GOLDEN: &str = "tests/upstream_settled.json";
/// A snapshot unchanged for this long (more than two resync periods of 1 s) is settled.
const STABLE: Duration = Duration::from_millis(2600);
const LIMIT: Duration = Duration::from_secs(40);

// ---- scenario data, in upstream's terms ----

#[derive(Clone, Default)]
struct Vol {
    name: &'static str,
    cap: &'static str,
    /// Symbolic UID of the claim in claimRef ("" = none); mapped to the real claim's UID.
    uid: &'static str,
    claim: &'static str,
    phase: &'static str,
    policy: &'static str,
    class: &'static str,
    anns: Vec<(&'static str, &'static str)>,
    finalizers: Vec<&'static str>,
    block: bool,
    labels: bool,
    vac: Option<&'static str>,
    csi_driver: Option<&'static str>,
}

#[derive(Clone, Default)]
struct Claim {
    name: &'static str,
    uid: &'static str,
    cap: &'static str,
    volume: &'static str,
    phase: &'static str,
    class: Option<&'static str>,
    anns: Vec<(&'static str, &'static str)>,
    block: bool,
    selector: bool,
    modes: Option<Vec<&'static str>>,
    vac: Option<&'static str>,
    /// claim.status.currentVolumeAttributesClassName when Bound (upstream's withExpectedVAC).
    status_vac: Option<&'static str>,
}

/// A pod using a claim, in a phase (recycle tests: a volume still used must wait).
struct PodUse {
    name: &'static str,
    claim: &'static str,
    phase: &'static str,
}

struct Case {
    id: &'static str,
    vols: Vec<Vol>,
    claims: Vec<Claim>,
    pods: Vec<PodUse>,
    /// The volumes are alike, so which one a claim ends on depends on timing, on either side:
    /// compared as a set, the claim's volumeName as "one of them".
    interchangeable: bool,
}

const BBC: (&str, &str) = ("pv.kubernetes.io/bound-by-controller", "yes");
const BC: (&str, &str) = ("pv.kubernetes.io/bind-completed", "yes");
/// upstream's `AnnDynamicallyProvisioned` with its mock plugin's name.
const DYN: (&str, &str) = ("pv.kubernetes.io/provisioned-by", "kubernetes.io/mock-volume");

/// upstream's newVolume: RWO+ROX, a GCE PD source, the given claimRef, phase and policy.
fn v(
    name: &'static str,
    cap: &'static str,
    uid: &'static str,
    claim: &'static str,
    phase: &'static str,
    policy: &'static str,
    class: &'static str,
) -> Vol {
    Vol {
        name,
        cap,
        uid,
        claim,
        phase,
        policy,
        class,
        ..Default::default()
    }
}

/// upstream's newClaim: RWO+ROX, the request, the volume it names, the phase.
fn c(
    name: &'static str,
    uid: &'static str,
    cap: &'static str,
    volume: &'static str,
    phase: &'static str,
    class: Option<&'static str>,
) -> Claim {
    Claim {
        name,
        uid,
        cap,
        volume,
        phase,
        class,
        ..Default::default()
    }
}

impl Vol {
    fn ann(mut self, a: (&'static str, &'static str)) -> Self {
        self.anns.push(a);
        self
    }
    fn block(mut self) -> Self {
        self.block = true;
        self
    }
    fn labelled(mut self) -> Self {
        self.labels = true;
        self
    }
    fn vac(mut self, c: &'static str) -> Self {
        self.vac = Some(c);
        self
    }
    fn finalizer(mut self, f: &'static str) -> Self {
        self.finalizers.push(f);
        self
    }
    fn csi(mut self, driver: &'static str) -> Self {
        self.csi_driver = Some(driver);
        self
    }
}

impl Claim {
    fn ann(mut self, a: (&'static str, &'static str)) -> Self {
        self.anns.push(a);
        self
    }
    fn block(mut self) -> Self {
        self.block = true;
        self
    }
    fn selector(mut self) -> Self {
        self.selector = true;
        self
    }
    fn modes(mut self, m: &[&'static str]) -> Self {
        self.modes = Some(m.to_vec());
        self
    }
    fn vac(mut self, c: &'static str) -> Self {
        self.vac = Some(c);
        self
    }
    fn status_vac(mut self, c: &'static str) -> Self {
        self.status_vac = Some(c);
        self
    }
}

fn case(id: &'static str, vols: Vec<Vol>, claims: Vec<Claim>) -> Case {
    Case {
        id,
        vols,
        claims,
        pods: vec![],
        interchangeable: false,
    }
}

impl Case {
    fn interchangeable(mut self) -> Self {
        self.interchangeable = true;
        self
    }
}

/// The settled state as compared: for interchangeable volumes, their states as a sorted list
/// and a claim's volumeName among them as "one of them".
fn canonical(case: &Case, state: &Value) -> Value {
    if !case.interchangeable {
        return state.clone();
    }
    let names: Vec<&str> = case.vols.iter().map(|v| v.name).collect();
    let mut pvs: Vec<String> = Vec::new();
    let mut out = serde_json::Map::new();
    for (k, v) in state.as_object().into_iter().flatten() {
        if k.starts_with("pv/") {
            pvs.push(v.to_string());
        } else {
            let mut v = v.clone();
            if let Some(n) = v.get("volumeName").and_then(Value::as_str)
                && names.contains(&n)
            {
                v["volumeName"] = json!("<one of the scenario's volumes>");
            }
            out.insert(k.clone(), v);
        }
    }
    pvs.sort();
    out.insert("pvs".into(), json!(pvs));
    Value::Object(out)
}

const AV: &str = "Available";
const BO: &str = "Bound";
const PE: &str = "Pending";
const RETAIN: &str = "Retain";
const DELETE: &str = "Delete";
const RECYCLE: &str = "Recycle";
const WAIT: Option<&str> = Some("wait");
const GOLD: Option<&str> = Some("gold");

/// The scenarios' initial objects, by upstream's id (binder_test.go TestSync, TestSyncBlockVolume,
/// TestMultiSync; delete_test.go; recycle_test.go).
fn cases() -> Vec<Case> {
    let sel = "selected-node";
    vec![
        // [1] claims that do not name a volume
        case(
            "1-1 successful bind",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, None)],
        ),
        case(
            "1-2 noop",
            vec![v("volume1-2", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-2", "uid1-2", "10Gi", "", PE, None)],
        ),
        case(
            "1-3 reset to Pending",
            vec![v("volume1-3", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-3", "uid1-3", "10Gi", "", BO, None)],
        ),
        case(
            "1-4 smallest volume",
            vec![
                v("volume1-4-1", "10Gi", "", "", AV, RETAIN, ""),
                v("volume1-4-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-4", "uid1-4", "1Gi", "", PE, None)],
        ),
        case(
            "1-5 prebound volume by name",
            vec![
                v("volume1-5-1", "10Gi", "", "claim1-5", AV, RETAIN, ""),
                v("volume1-5-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-5", "uid1-5", "1Gi", "", PE, None)],
        ),
        case(
            "1-6 prebound volume by UID",
            vec![
                v("volume1-6-1", "10Gi", "uid1-6", "claim1-6", AV, RETAIN, ""),
                v("volume1-6-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-6", "uid1-6", "1Gi", "", PE, None)],
        ),
        case(
            "1-7 prebound volume to different claim",
            vec![v("volume1-7", "10Gi", "uid1-777", "claim1-7", AV, RETAIN, "")],
            vec![c("claim1-7", "uid1-7", "1Gi", "", PE, None)],
        ),
        case(
            "1-8 complete bind after crash, PV bound",
            vec![v("volume1-8", "1Gi", "uid1-8", "claim1-8", AV, RETAIN, "").ann(BBC)],
            vec![c("claim1-8", "uid1-8", "1Gi", "", PE, None)],
        ),
        case(
            "1-9 complete bind after crash, PV status saved",
            vec![v("volume1-9", "1Gi", "uid1-9", "claim1-9", BO, RETAIN, "").ann(BBC)],
            vec![c("claim1-9", "uid1-9", "1Gi", "", PE, None)],
        ),
        case(
            "1-10 complete bind after crash, PVC bound",
            vec![v("volume1-10", "1Gi", "uid1-10", "claim1-10", BO, RETAIN, "").ann(BBC)],
            vec![
                c("claim1-10", "uid1-10", "1Gi", "volume1-10", PE, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "1-11 bind when selector matches",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "").labelled()],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, None).selector()],
        ),
        case(
            "1-12 do not bind when selector does not match",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, None).selector()],
        ),
        case(
            "1-13 delayed binding",
            vec![v("volume1-1", "1Gi", "", "", AV, RETAIN, "wait")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, WAIT)],
        ),
        case(
            "1-14 successful prebound PV",
            vec![v("volume1-1", "1Gi", "", "claim1-1", AV, RETAIN, "wait")],
            vec![c("claim1-1", "uid1-1", "1Gi", "", PE, WAIT)],
        ),
        case(
            "1-15 successful prebound PVC",
            vec![
                v("volume1-15-1", "10Gi", "", "", AV, RETAIN, ""),
                v("volume1-15-2", "1Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim1-15", "uid1-15", "1Gi", "volume1-15-1", PE, None)],
        ),
        case(
            "1-16 prebound PVC whose modes the volume lacks",
            vec![v("volume1-16", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim1-16", "uid1-16", "1Gi", "volume1-16", PE, None).modes(&["ReadWriteMany"])],
        ),
        case(
            "1-17 skip non-available PV if it's not pre-bound",
            vec![
                v("volume1-17-pending", "1Gi", "", "", PE, RETAIN, ""),
                v("volume1-17-failed", "1Gi", "", "", "Failed", RETAIN, ""),
                v("volume1-17-released", "1Gi", "", "", "Released", RETAIN, ""),
                v("volume1-17-empty", "1Gi", "", "", "", RETAIN, ""),
            ],
            vec![c("claim1-17", "uid1-17", "1Gi", "", PE, None)],
        )
        .interchangeable(),
        case(
            "1-18 pre-bound PV to a delayed claim with a selected node",
            vec![v("volume1-18", "1Gi", "uid1-18", "claim1-18", AV, RETAIN, "wait")],
            vec![
                c("claim1-18", "uid1-18", "1Gi", "", PE, WAIT)
                    .ann(("volume.kubernetes.io/selected-node", "node1")),
            ],
        ),
        // [2] claims that name a volume
        case(
            "2-1 claim prebound to non-existing volume",
            vec![],
            vec![c("claim2-1", "uid2-1", "10Gi", "volume2-1", PE, None)],
        ),
        case(
            "2-2 claim prebound to non-existing volume, reset status",
            vec![],
            vec![c("claim2-2", "uid2-2", "10Gi", "volume2-2", BO, None)],
        ),
        case(
            "2-3 claim prebound to unbound volume",
            vec![v("volume2-3", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim2-3", "uid2-3", "1Gi", "volume2-3", PE, None)],
        ),
        case(
            "2-4 claim prebound to prebound volume by name",
            vec![v("volume2-4", "1Gi", "", "claim2-4", AV, RETAIN, "")],
            vec![c("claim2-4", "uid2-4", "1Gi", "volume2-4", PE, None)],
        ),
        case(
            "2-5 claim prebound to prebound volume by UID",
            vec![v("volume2-5", "1Gi", "uid2-5", "claim2-5", AV, RETAIN, "")],
            vec![c("claim2-5", "uid2-5", "1Gi", "volume2-5", PE, None)],
        ),
        case(
            "2-6 claim prebound to already bound volume",
            vec![v("volume2-6", "1Gi", "uid2-6_1", "claim2-6-1", BO, RETAIN, "")],
            vec![c("claim2-6", "uid2-6", "1Gi", "volume2-6", BO, None)],
        ),
        case(
            "2-7 claim bound by controller to already bound volume",
            vec![v("volume2-7", "1Gi", "uid2-7_1", "claim2-7-1", BO, RETAIN, "")],
            vec![c("claim2-7", "uid2-7", "1Gi", "volume2-7", BO, None).ann(BBC)],
        ),
        case(
            "2-8 claim prebound to volume that does not match the selector",
            vec![v("volume2-8", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim2-8", "uid2-8", "1Gi", "volume2-8", PE, None).selector()],
        ),
        case(
            "2-9 claim prebound to a smaller volume",
            vec![v("volume2-9", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim2-9", "uid2-9", "2Gi", "volume2-9", BO, None)],
        ),
        case(
            "2-10 claim prebound to volume of another class",
            vec![v("volume2-10", "1Gi", "1", "", AV, RETAIN, "gold")],
            vec![c("claim2-10", "uid2-10", "1Gi", "volume2-10", BO, None)],
        ),
        case(
            "2-11 claim prebound to volume of another attributes class",
            vec![
                v("volume2-11", "1Gi", "", "", AV, RETAIN, "")
                    .vac("gold")
                    .csi("vac.example.com"),
            ],
            vec![c("claim2-11", "uid2-11", "1Gi", "volume2-11", BO, None)],
        ),
        case(
            "2-12 claim prebound to volume of the same attributes class",
            vec![
                v("volume2-12", "1Gi", "", "", AV, RETAIN, "")
                    .vac("gold")
                    .csi("vac.example.com"),
            ],
            vec![c("claim2-12", "uid2-12", "1Gi", "volume2-12", PE, None).vac("gold")],
        ),
        case(
            "2-13 bound claim prebound to volume of the same attributes class",
            vec![
                v("volume2-13", "1Gi", "", "", AV, RETAIN, "")
                    .vac("gold")
                    .csi("vac.example.com"),
            ],
            vec![
                c("claim2-13", "uid2-13", "1Gi", "volume2-13", BO, None)
                    .vac("gold")
                    .status_vac("gold"),
            ],
        ),
        // [3] claims that were bound
        case(
            "3-1 bound claim with missing volumeName",
            vec![],
            vec![c("claim3-1", "uid3-1", "10Gi", "", BO, None).ann(BBC).ann(BC)],
        ),
        case(
            "3-2 bound claim with missing volume",
            vec![],
            vec![
                c("claim3-2", "uid3-2", "10Gi", "volume3-2", BO, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "3-3 bound claim with unbound volume",
            vec![v("volume3-3", "10Gi", "", "", AV, RETAIN, "")],
            vec![
                c("claim3-3", "uid3-3", "10Gi", "volume3-3", PE, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "3-4 bound claim with prebound volume",
            vec![v("volume3-4", "10Gi", "claim3-4-x", "claim3-4", AV, RETAIN, "")],
            vec![
                c("claim3-4", "uid3-4", "10Gi", "volume3-4", PE, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        case(
            "3-5 bound claim with bound volume",
            vec![v("volume3-5", "10Gi", "uid3-5", "claim3-5", AV, RETAIN, "")],
            vec![c("claim3-5", "uid3-5", "10Gi", "volume3-5", PE, None).ann(BC)],
        ),
        case(
            "3-6 bound claim with volume bound elsewhere",
            vec![v("volume3-6", "10Gi", "uid3-6-x", "claim3-6-x", AV, RETAIN, "")],
            vec![c("claim3-6", "uid3-6", "10Gi", "volume3-6", PE, None).ann(BC)],
        ),
        case(
            "3-7 bound claim with unbound volume where selector doesn't match",
            vec![v("volume3-3", "10Gi", "", "", AV, RETAIN, "")],
            vec![
                c("claim3-3", "uid3-3", "10Gi", "volume3-3", PE, None)
                    .ann(BBC)
                    .ann(BC)
                    .selector(),
            ],
        ),
        // [4] volumes
        case(
            "4-1 pending volume",
            vec![v("volume4-1", "10Gi", "", "", PE, RETAIN, "")],
            vec![],
        ),
        case(
            "4-2 pending prebound volume",
            vec![v("volume4-2", "10Gi", "", "claim4-2", PE, RETAIN, "")],
            vec![],
        ),
        case(
            "4-3 bound volume with missing claim",
            vec![v("volume4-3", "10Gi", "uid4-3", "claim4-3", BO, RETAIN, "")],
            vec![],
        ),
        case(
            "4-4 volume bound to claim with different UID",
            vec![v("volume4-4", "10Gi", "uid4-4", "claim4-4", BO, RETAIN, "")],
            vec![c("claim4-4", "uid4-4-x", "10Gi", "volume4-4", BO, None).ann(BC)],
        ),
        case(
            "4-5 volume bound by controller to unbound claim",
            vec![v("volume4-5", "10Gi", "uid4-5", "claim4-5", BO, RETAIN, "").ann(BBC)],
            vec![c("claim4-5", "uid4-5", "10Gi", "", PE, None)],
        ),
        case(
            "4-5b volume bound by user to unbound claim",
            vec![v("volume4-5", "10Gi", "uid4-5", "claim4-5", BO, RETAIN, "")],
            vec![c("claim4-5", "uid4-5", "10Gi", "", PE, None)],
        ),
        case(
            "4-6 volume bound to bound claim",
            vec![v("volume4-6", "10Gi", "uid4-6", "claim4-6", AV, RETAIN, "")],
            vec![c("claim4-6", "uid4-6", "10Gi", "volume4-6", BO, None)],
        ),
        case(
            "4-7 volume bound by controller to claim bound somewhere else",
            vec![v("volume4-7", "10Gi", "uid4-7", "claim4-7", BO, RETAIN, "").ann(BBC)],
            vec![c("claim4-7", "uid4-7", "10Gi", "volume4-7-x", BO, None)],
        ),
        case(
            "4-8 volume bound by user to claim bound somewhere else",
            vec![v("volume4-8", "10Gi", "uid4-8", "claim4-8", BO, RETAIN, "")],
            vec![c("claim4-8", "uid4-8", "10Gi", "volume4-8-x", BO, None)],
        ),
        case(
            "4-9 volume bound to bound claim, policy Delete",
            vec![v("volume4-9", "10Gi", "uid4-9", "claim4-9", AV, DELETE, "")],
            vec![c("claim4-9", "uid4-9", "10Gi", "volume4-9", BO, None)],
        ),
        case(
            "4-10 volume bound to missing claim, policy Delete",
            vec![v("volume4-10", "10Gi", "uid4-10", "claim4-10", AV, DELETE, "")],
            vec![],
        ),
        // [13] classes
        case(
            "13-1 binding to class",
            vec![
                v("volume13-1-1", "1Gi", "", "", AV, RETAIN, ""),
                v("volume13-1-2", "10Gi", "", "", AV, RETAIN, "gold"),
            ],
            vec![c("claim13-1", "uid13-1", "1Gi", "", PE, GOLD)],
        ),
        case(
            "13-2 binding without a class",
            vec![
                v("volume13-2-1", "1Gi", "", "", AV, RETAIN, "gold"),
                v("volume13-2-2", "10Gi", "", "", AV, RETAIN, ""),
            ],
            vec![c("claim13-2", "uid13-2", "1Gi", "", PE, None)],
        ),
        case(
            "13-3 binding to a specific class",
            vec![
                v("volume13-3-1", "1Gi", "", "", AV, RETAIN, "silver"),
                v("volume13-3-2", "10Gi", "", "", AV, RETAIN, "gold"),
            ],
            vec![c("claim13-3", "uid13-3", "1Gi", "", PE, GOLD)],
        ),
        case(
            "13-4 empty class",
            vec![v("volume13-4", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim13-4", "uid13-4", "1Gi", "", PE, Some(""))],
        ),
        case(
            "13-5 nil class",
            vec![v("volume13-5", "1Gi", "", "", AV, RETAIN, "")],
            vec![c("claim13-5", "uid13-5", "1Gi", "", PE, None)],
        ),
        // [14] volume modes
        case(
            "14-1 block to block",
            vec![v("volume14-1", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-1", "uid14-1", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-2 filesystem to filesystem",
            vec![v("volume14-2", "10Gi", "", "", AV, RETAIN, "")],
            vec![c("claim14-2", "uid14-2", "10Gi", "", PE, None)],
        ),
        case(
            "14-3 filesystem volume, block claim",
            vec![v("volume14-3", "10Gi", "", "", AV, RETAIN, "")],
            vec![c("claim14-3", "uid14-3", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-4 block volume, filesystem claim",
            vec![v("volume14-4", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-4", "uid14-4", "10Gi", "", PE, None)],
        ),
        case(
            "14-5 class matches, mode does not",
            vec![v("volume14-5", "10Gi", "", "", AV, RETAIN, "gold")],
            vec![c("claim14-5", "uid14-5", "10Gi", "", PE, GOLD).block()],
        ),
        case(
            "14-5-1 mode matches, class does not",
            vec![v("volume14-5-1", "10Gi", "", "", AV, RETAIN, "gold")],
            vec![c("claim14-5-1", "uid14-5-1", "10Gi", "", PE, Some("silver"))],
        ),
        case(
            "14-5-2 prebound claim, mode matches, class does not",
            vec![v("volume14-5-2", "10Gi", "", "", AV, RETAIN, "gold")],
            vec![c(
                "claim14-5-2",
                "uid14-5-2",
                "10Gi",
                "volume14-5-2",
                PE,
                Some("silver"),
            )],
        ),
        case(
            "14-7 prebound volume, modes match",
            vec![v("volume14-7", "10Gi", "", "claim14-7", AV, RETAIN, "").block()],
            vec![c("claim14-7", "uid14-7", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-8 prebound claim, modes differ",
            vec![v("volume14-8", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-8", "uid14-8", "10Gi", "volume14-8", PE, None)],
        ),
        case(
            "14-8-1 prebound volume, modes differ",
            vec![v("volume14-8-1", "10Gi", "", "claim14-8-1", AV, RETAIN, "").block()],
            vec![c("claim14-8-1", "uid14-8-1", "10Gi", "", PE, None)],
        ),
        case(
            "14-9 prebound claim, block",
            vec![v("volume14-9", "10Gi", "", "", AV, RETAIN, "").block()],
            vec![c("claim14-9", "uid14-9", "10Gi", "volume14-9", PE, None).block()],
        ),
        case(
            "14-10 prebound volume, block",
            vec![v("volume14-10", "10Gi", "", "claim14-10", AV, RETAIN, "").block()],
            vec![c("claim14-10", "uid14-10", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-11 prebound claim, filesystem",
            vec![v("volume14-11", "10Gi", "", "", AV, RETAIN, "")],
            vec![c("claim14-11", "uid14-11", "10Gi", "volume14-11", PE, None)],
        ),
        case(
            "14-12 prebound volume, filesystem",
            vec![v("volume14-12", "10Gi", "", "claim14-12", AV, RETAIN, "")],
            vec![c("claim14-12", "uid14-12", "10Gi", "", PE, None)],
        ),
        case(
            "14-13 volume bound by controller, modes differ (file/block)",
            vec![v("volume14-13", "10Gi", "uid14-13", "claim14-13", AV, RETAIN, "").ann(BBC)],
            vec![c("claim14-13", "uid14-13", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-13-1 volume bound by controller, modes differ (block/file)",
            vec![
                v(
                    "volume14-13-1",
                    "10Gi",
                    "uid14-13-1",
                    "claim14-13-1",
                    AV,
                    RETAIN,
                    "",
                )
                .ann(BBC)
                .block(),
            ],
            vec![c("claim14-13-1", "uid14-13-1", "10Gi", "", PE, None)],
        ),
        case(
            "14-14 volume bound by controller, block",
            vec![
                v("volume14-14", "10Gi", "uid14-14", "claim14-14", AV, RETAIN, "")
                    .ann(BBC)
                    .block(),
            ],
            vec![c("claim14-14", "uid14-14", "10Gi", "", PE, None).block()],
        ),
        case(
            "14-14-1 volume bound by controller, filesystem",
            vec![
                v(
                    "volume14-14-1",
                    "10Gi",
                    "uid14-14-1",
                    "claim14-14-1",
                    AV,
                    RETAIN,
                    "",
                )
                .ann(BBC),
            ],
            vec![c("claim14-14-1", "uid14-14-1", "10Gi", "", PE, None)],
        ),
        // [10] multi-sync
        case(
            "10-1 successful bind",
            vec![v("volume10-1", "1Gi", "", "", PE, RETAIN, "")],
            vec![c("claim10-1", "uid10-1", "1Gi", "", PE, None)],
        ),
        case(
            "10-2 bind PV race",
            vec![
                v("volume10-2-1", "1Gi", "uid10-2", "claim10-2", BO, RETAIN, "").ann(BBC),
                v("volume10-2-2", "1Gi", "uid10-2", "claim10-2", BO, RETAIN, "").ann(BBC),
            ],
            vec![
                c("claim10-2", "uid10-2", "1Gi", "volume10-2-1", BO, None)
                    .ann(BBC)
                    .ann(BC),
            ],
        ),
        // [8] delete (no deleter plugin on either side)
        case(
            "8-1 delete, no deleter",
            vec![v("volume8-1", "1Gi", "uid8-1", "claim8-1", BO, DELETE, "").ann(BBC)],
            vec![],
        ),
        case(
            "8-2 delete prebound volume, no deleter",
            vec![v("volume8-2", "1Gi", "uid8-2", "claim8-2", BO, DELETE, "")],
            vec![],
        ),
        case(
            "8-3 plugin not found",
            vec![v("volume8-3", "1Gi", "uid8-3", "claim8-3", BO, DELETE, "").ann(DYN)],
            vec![],
        ),
        case(
            "8-9 prebound volume deleted while a claim of that name exists",
            vec![v("volume8-9", "1Gi", "uid8-9", "claim8-9", BO, DELETE, "")],
            vec![c("claim8-9", "uid8-9-x", "10Gi", "", PE, None)],
        ),
        case(
            "8-10-1 external deleter, dynamically provisioned",
            vec![
                v("volume8-10-1", "1Gi", "uid10-1-1", "claim10-1-1", BO, DELETE, "")
                    .ann(BBC)
                    .ann(("pv.kubernetes.io/provisioned-by", "external.io/test"))
                    .csi("pd.csi.storage.gke.io"),
            ],
            vec![],
        ),
        case(
            "8-10-2 external deleter, statically provisioned",
            vec![
                v("volume8-10-2", "1Gi", "uid10-1-2", "claim10-1-2", BO, DELETE, "")
                    .ann(BBC)
                    .csi("pd.csi.storage.gke.io"),
            ],
            vec![],
        ),
        case(
            "8-10-3 external deleter, migrated",
            vec![
                v("volume8-10-3", "1Gi", "uid10-1-3", "claim10-1-3", BO, DELETE, "")
                    .ann(("pv.kubernetes.io/provisioned-by", "kubernetes.io/gce-pd"))
                    .ann(("pv.kubernetes.io/migrated-to", "pd.csi.storage.gke.io")),
            ],
            vec![],
        ),
        case(
            "8-11 two PVs provisioned for a single claim",
            vec![
                v("volume8-11-1", "1Gi", "uid8-11", "claim8-11", BO, DELETE, "").ann(DYN),
                v("volume8-11-2", "1Gi", "uid8-11", "claim8-11", BO, DELETE, "").ann(DYN),
            ],
            vec![c("claim8-11", "uid8-11", "10Gi", "volume8-11-2", BO, None)],
        ),
        case(
            "8-13 in-tree protected volume of a deleted claim",
            vec![
                v("volume8-13", "1Gi", "uid8-13", "claim8-13", BO, DELETE, "")
                    .ann(BBC)
                    .finalizer("kubernetes.io/pv-controller"),
            ],
            vec![],
        ),
        // [6] recycle (no recycler plugin on either side)
        case(
            "6-1 recycle, no recycler",
            vec![v("volume6-1", "1Gi", "uid6-1", "claim6-1", BO, RECYCLE, "").ann(BBC)],
            vec![],
        ),
        case(
            "6-2 recycle prebound volume, no recycler",
            vec![v("volume6-2", "1Gi", "uid6-2", "claim6-2", BO, RECYCLE, "")],
            vec![],
        ),
        case(
            "6-9 prebound volume recycled while a claim of that name exists",
            vec![v("volume6-9", "1Gi", "uid6-9", "claim6-9", BO, RECYCLE, "")],
            vec![c("claim6-9", "uid6-9-x", "10Gi", "", PE, None)],
        ),
        Case {
            interchangeable: false,
            id: "6-11 used by running pod",
            vols: vec![v("volume6-11", "1Gi", "uid6-11", "running-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![],
            pods: vec![PodUse {
                name: "running-pod",
                claim: "running-claim",
                phase: "Running",
            }],
        },
        Case {
            interchangeable: false,
            id: "6-12 used by pending pod",
            vols: vec![v("volume6-12", "1Gi", "uid6-12", "pending-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![],
            pods: vec![PodUse {
                name: "pending-pod",
                claim: "pending-claim",
                phase: "Pending",
            }],
        },
        Case {
            interchangeable: false,
            id: "6-13 used by completed pod",
            vols: vec![v("volume6-13", "1Gi", "uid6-13", "completed-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![],
            pods: vec![PodUse {
                name: "completed-pod",
                claim: "completed-claim",
                phase: "Succeeded",
            }],
        },
        Case {
            interchangeable: false,
            id: "6-14 seemingly used by running pod",
            vols: vec![v("volume6-14", "1Gi", "uid6-14", "completed-claim", BO, RECYCLE, "").ann(BBC)],
            claims: vec![c("completed-claim", "uid6-14-x", "10Gi", "", BO, None)],
            pods: vec![PodUse {
                name: "running-pod",
                claim: "completed-claim",
                phase: "Running",
            }],
        },
    ]
    .into_iter()
    .map(|mut k| {
        // `sel` documents the one scenario that needs a node name; nodes are not created.
        let _ = sel;
        k.claims.sort_by_key(|c| c.name);
        k
    })
    .collect()
}

// ---- objects ----

fn qty(q: &str) -> BTreeMap<String, Quantity> {
    BTreeMap::from([("storage".to_string(), Quantity(q.into()))])
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([("foo".into(), "true".into()), ("bar".into(), "false".into())])
}

fn fake_uid(sym: &str) -> String {
    format!("00000000-fake-{sym}")
}

fn claim_object(c: &Claim) -> PersistentVolumeClaim {
    let modes = c
        .modes
        .clone()
        .unwrap_or_else(|| vec!["ReadWriteOnce", "ReadOnlyMany"]);
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(c.name.into()),
            namespace: Some(NS.into()),
            annotations: (!c.anns.is_empty()).then(|| {
                c.anns
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            }),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(modes.iter().map(|m| m.to_string()).collect()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(qty(c.cap)),
                ..Default::default()
            }),
            volume_name: (!c.volume.is_empty()).then(|| c.volume.into()),
            storage_class_name: c.class.map(String::from),
            volume_mode: Some(if c.block { "Block" } else { "Filesystem" }.into()),
            selector: c.selector.then(|| LabelSelector {
                match_labels: Some(labels()),
                ..Default::default()
            }),
            volume_attributes_class_name: c.vac.map(String::from),
            ..Default::default()
        }),
        status: None,
    }
}

fn claim_status(c: &Claim) -> Value {
    if c.phase == BO {
        let modes = c
            .modes
            .clone()
            .unwrap_or_else(|| vec!["ReadWriteOnce", "ReadOnlyMany"]);
        json!({"status": {"phase": "Bound", "accessModes": modes, "capacity": {"storage": c.cap},
            "currentVolumeAttributesClassName": c.status_vac}})
    } else {
        json!({"status": {"phase": c.phase}})
    }
}

fn volume_object(v: &Vol, uids: &BTreeMap<&str, String>) -> PersistentVolume {
    let mut spec = PersistentVolumeSpec {
        capacity: Some(qty(v.cap)),
        access_modes: Some(vec!["ReadWriteOnce".into(), "ReadOnlyMany".into()]),
        persistent_volume_reclaim_policy: Some(v.policy.into()),
        storage_class_name: Some(v.class.into()),
        volume_mode: Some(if v.block { "Block" } else { "Filesystem" }.into()),
        volume_attributes_class_name: v.vac.map(String::from),
        ..Default::default()
    };
    match v.csi_driver {
        Some(driver) => {
            spec.csi = Some(k8s_openapi::api::core::v1::CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: v.name.into(),
                ..Default::default()
            })
        }
        None => {
            spec.gce_persistent_disk = Some(GCEPersistentDiskVolumeSource {
                pd_name: v.name.into(),
                ..Default::default()
            })
        }
    }
    if !v.claim.is_empty() {
        spec.claim_ref = Some(ObjectReference {
            kind: Some("PersistentVolumeClaim".into()),
            api_version: Some("v1".into()),
            namespace: Some(NS.into()),
            name: Some(v.claim.into()),
            uid: (!v.uid.is_empty()).then(|| uids.get(v.uid).cloned().unwrap_or_else(|| fake_uid(v.uid))),
            ..Default::default()
        });
    }
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(v.name.into()),
            annotations: (!v.anns.is_empty()).then(|| {
                v.anns
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            }),
            labels: v.labels.then(labels),
            finalizers: (!v.finalizers.is_empty())
                .then(|| v.finalizers.iter().map(|f| f.to_string()).collect()),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

// ---- the settled state, in symbolic terms ----

const KEPT_ANNOTATIONS: &[&str] = &[
    "pv.kubernetes.io/bound-by-controller",
    "pv.kubernetes.io/bind-completed",
    "pv.kubernetes.io/provisioned-by",
    "pv.kubernetes.io/migrated-to",
];
const KEPT_FINALIZERS: &[&str] = &[
    "kubernetes.io/pv-controller",
    "external-provisioner.volume.kubernetes.io/finalizer",
];

/// What the table compares, with real UIDs turned back into the table's symbols.
async fn snapshot(client: &Client, case: &Case, syms: &BTreeMap<String, &str>) -> Value {
    let sym = |uid: Option<&str>| -> Value {
        match uid {
            None => Value::Null,
            Some(u) => syms
                .get(u)
                .map(|s| json!(s))
                .or_else(|| u.strip_prefix("00000000-fake-").map(|s| json!(s)))
                .unwrap_or_else(|| json!("<other>")),
        }
    };
    let kept = |anns: &BTreeMap<String, String>| -> Value {
        anns.iter()
            .filter(|(k, _)| KEPT_ANNOTATIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let mut out = serde_json::Map::new();
    for v in &case.vols {
        let got = pvs.get_opt(v.name).await.expect("get PV");
        let state = match got {
            None => json!("deleted"),
            Some(pv) => {
                let spec = pv.spec.clone().unwrap_or_default();
                let r = spec.claim_ref.as_ref();
                json!({
                    "phase": pv.status.as_ref().and_then(|s| s.phase.clone()),
                    "claimRef": r.map(|r| json!({"name": r.name, "uid": sym(r.uid.as_deref())})),
                    "annotations": kept(pv.annotations()),
                    "finalizers": pv.finalizers().iter().filter(|f| KEPT_FINALIZERS.contains(&f.as_str())).collect::<Vec<_>>(),
                })
            }
        };
        out.insert(format!("pv/{}", v.name), state);
    }
    for c in &case.claims {
        let got = pvcs.get_opt(c.name).await.expect("get claim");
        let state = match got {
            None => json!("deleted"),
            Some(pvc) => {
                let st = pvc.status.clone().unwrap_or_default();
                json!({
                    "phase": st.phase,
                    "volumeName": pvc.spec.as_ref().and_then(|s| s.volume_name.clone()),
                    "annotations": kept(pvc.annotations()),
                    "capacity": st.capacity.as_ref().and_then(|c| c.get("storage")).map(|q| q.0.clone()),
                    "accessModes": st.access_modes,
                    "currentVolumeAttributesClassName": st.current_volume_attributes_class_name,
                })
            }
        };
        out.insert(format!("pvc/{}", c.name), state);
    }
    Value::Object(out)
}

/// Event reasons per object (for the report; events are not compared: stowage reports once per
/// change and adds its own, as docs/binder.md says).
async fn events(client: &Client) -> Vec<String> {
    let api: Api<Event> = Api::all(client.clone());
    let mut out: Vec<String> = api
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| {
            let who = e.regarding.as_ref()?.name.clone()?;
            Some(format!(
                "{who}: {} {}",
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default()
            ))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

// ---- running one scenario ----

enum Runner {
    Stowage,
    Upstream(std::path::PathBuf),
}

/// The controller under test for one scenario; stopped when dropped.
enum Running {
    Stowage(JoinSet<()>, tokio::task::JoinHandle<anyhow::Result<()>>),
    Upstream(std::process::Child),
}

impl Drop for Running {
    fn drop(&mut self) {
        match self {
            Running::Stowage(informers, ctrl) => {
                ctrl.abort();
                informers.abort_all();
            }
            Running::Upstream(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

async fn start(runner: &Runner, cp: &ControlPlane, client: &Client) -> Running {
    match runner {
        Runner::Stowage => {
            let mut informers = JoinSet::new();
            let registry = prometheus::Registry::new();
            let cluster =
                stowage_common::cluster::Cluster::start(client.clone(), registry.clone(), &mut informers);
            cluster.ready().await;
            let config = stowage_binder::Config {
                resync: Duration::from_secs(1),
                image_dir: std::env::temp_dir(),
                max_in_flight: 16,
            };
            let ctrl = tokio::spawn(stowage_binder::run(
                cluster,
                stowage_binder::Metrics::new(&registry),
                config,
            ));
            Running::Stowage(informers, ctrl)
        }
        Runner::Upstream(kcm) => {
            let child = std::process::Command::new(kcm)
                .args([
                    format!("--kubeconfig={}", cp.kubeconfig().display()),
                    "--leader-elect=false".into(),
                    "--use-service-account-credentials=false".into(),
                    "--secure-port=0".into(),
                    "--controllers=persistentvolume-binder-controller".into(),
                    "--pvclaimbinder-sync-period=1s".into(),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("kube-controller-manager starts");
            Running::Upstream(child)
        }
    }
}

async fn clean(client: &Client) {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let unfinalize = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    let pp = PatchParams::default();
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        let _ = pods.delete(&p.name_any(), &now).await;
    }
    for c in pvcs.list(&ListParams::default()).await.unwrap().items {
        let _ = pvcs.patch(&c.name_any(), &pp, &unfinalize).await;
        let _ = pvcs.delete(&c.name_any(), &now).await;
    }
    for v in pvs.list(&ListParams::default()).await.unwrap().items {
        let _ = pvs.patch(&v.name_any(), &pp, &unfinalize).await;
        let _ = pvs.delete(&v.name_any(), &now).await;
    }
    let _ = events
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let _ = Api::<Event>::namespaced(client.clone(), "default")
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let deadline = Instant::now() + LIMIT;
    loop {
        let left = pvs.list(&ListParams::default()).await.unwrap().items.len()
            + pvcs.list(&ListParams::default()).await.unwrap().items.len()
            + pods.list(&ListParams::default()).await.unwrap().items.len();
        if left == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{left} objects left after clean-up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates the scenario (controller stopped), runs the controller until the state holds still,
/// returns the settled state and the events seen.
async fn run_case(runner: &Runner, cp: &ControlPlane, client: &Client, case: &Case) -> (Value, Vec<String>) {
    clean(client).await;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = PatchParams::default();
    let mut uids: BTreeMap<&str, String> = BTreeMap::new();
    for c in &case.claims {
        let made = pvcs
            .create(&PostParams::default(), &claim_object(c))
            .await
            .unwrap();
        uids.insert(c.uid, made.uid().unwrap());
        pvcs.patch_status(c.name, &pp, &Patch::Merge(claim_status(c)))
            .await
            .unwrap();
    }
    for v in &case.vols {
        pvs.create(&PostParams::default(), &volume_object(v, &uids))
            .await
            .unwrap();
        if !v.phase.is_empty() {
            pvs.patch_status(v.name, &pp, &Patch::Merge(json!({"status": {"phase": v.phase}})))
                .await
                .unwrap();
        }
    }
    for p in &case.pods {
        let pod = stowage_testkit::builders::pod(NS, p.name)
            .claim("data", p.claim)
            .node("node1")
            .build();
        pods.create(&PostParams::default(), &pod).await.unwrap();
        pods.patch_status(p.name, &pp, &Patch::Merge(json!({"status": {"phase": p.phase}})))
            .await
            .unwrap();
    }
    let syms: BTreeMap<String, &str> = uids.iter().map(|(s, u)| (u.clone(), *s)).collect();
    let running = start(runner, cp, client).await;
    let deadline = Instant::now() + LIMIT;
    let mut last = snapshot(client, case, &syms).await;
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = snapshot(client, case, &syms).await;
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= STABLE {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: never settled; last state {last:#}",
            case.id
        );
    }
    drop(running);
    (last, events(client).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_scenarios_settle_where_kube_controller_manager_does() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let client = cp.client().await;
    stowage_testkit::builders::create_namespace(&client, NS).await;
    let wait_class = StorageClass {
        metadata: ObjectMeta {
            name: Some("wait".into()),
            ..Default::default()
        },
        provisioner: "kubernetes.io/no-provisioner".into(),
        volume_binding_mode: Some("WaitForFirstConsumer".into()),
        ..Default::default()
    };
    Api::<StorageClass>::all(client.clone())
        .create(&PostParams::default(), &wait_class)
        .await
        .unwrap();
    let golden_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    let bless = std::env::var_os("STOWAGE_BLESS_UPSTREAM").is_some();
    let runner = if bless {
        Runner::Upstream(stowage_testkit::controlplane::bin_dir().join("kube-controller-manager"))
    } else {
        Runner::Stowage
    };
    let golden: BTreeMap<String, Value> = if bless {
        BTreeMap::new()
    } else {
        let text = std::fs::read_to_string(&golden_path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (record it with STOWAGE_BLESS_UPSTREAM=1)",
                golden_path.display()
            )
        });
        serde_json::from_str(&text).expect("golden JSON")
    };
    let mut recorded = BTreeMap::new();
    let mut failures = Vec::new();
    let cases = cases();
    for case in &cases {
        let (state, seen) = run_case(&runner, &cp, &client, case).await;
        if bless {
            recorded.insert(case.id.to_string(), json!({"settled": state, "events": seen}));
            eprintln!("recorded {}", case.id);
            continue;
        }
        let want = &golden.get(case.id).unwrap_or_else(|| {
            panic!(
                "{} not in {GOLDEN}: record it with STOWAGE_BLESS_UPSTREAM=1",
                case.id
            )
        })["settled"];
        if canonical(case, &state) == canonical(case, want) {
            eprintln!("ok   {}", case.id);
        } else {
            eprintln!("FAIL {}", case.id);
            failures.push(format!(
                "{}:\n  kube-controller-manager settled in {want}\n  stowage settled in         {state}\n  stowage's events: {seen:?}\n  upstream's events: {}",
                case.id,
                golden[case.id]["events"]
            ));
        }
    }
    if bless {
        std::fs::write(
            &golden_path,
            serde_json::to_string_pretty(&recorded).unwrap() + "\n",
        )
        .unwrap();
        eprintln!("wrote {} scenarios to {}", recorded.len(), golden_path.display());
        return;
    }
    eprintln!(
        "{} scenarios, {} settled as upstream",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} scenarios differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
