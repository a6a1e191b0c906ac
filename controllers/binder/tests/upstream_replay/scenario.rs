//! The scenario data in upstream's terms (volumes, claims, pods, the expected settled state) and
//! the API objects they become.

use super::*;

// ---- scenario data, in upstream's terms ----

#[derive(Clone, Default)]
pub(super) struct Vol {
    pub(super) name: &'static str,
    pub(super) cap: &'static str,
    /// Symbolic UID of the claim in claimRef ("" = none); mapped to the real claim's UID.
    pub(super) uid: &'static str,
    pub(super) claim: &'static str,
    pub(super) phase: &'static str,
    pub(super) policy: &'static str,
    pub(super) class: &'static str,
    pub(super) anns: Vec<(&'static str, &'static str)>,
    pub(super) finalizers: Vec<&'static str>,
    pub(super) block: bool,
    pub(super) labels: bool,
    pub(super) vac: Option<&'static str>,
    pub(super) csi_driver: Option<&'static str>,
}

#[derive(Clone, Default)]
pub(super) struct Claim {
    pub(super) name: &'static str,
    pub(super) uid: &'static str,
    pub(super) cap: &'static str,
    pub(super) volume: &'static str,
    pub(super) phase: &'static str,
    pub(super) class: Option<&'static str>,
    pub(super) anns: Vec<(&'static str, &'static str)>,
    pub(super) block: bool,
    pub(super) selector: bool,
    pub(super) modes: Option<Vec<&'static str>>,
    pub(super) vac: Option<&'static str>,
    /// claim.status.currentVolumeAttributesClassName when Bound (upstream's withExpectedVAC).
    pub(super) status_vac: Option<&'static str>,
}

/// A pod using a claim, in a phase (recycle tests: a volume still used must wait).
pub(super) struct PodUse {
    pub(super) name: &'static str,
    pub(super) claim: &'static str,
    pub(super) phase: &'static str,
}

pub(super) struct Case {
    pub(super) id: &'static str,
    pub(super) vols: Vec<Vol>,
    pub(super) claims: Vec<Claim>,
    pub(super) pods: Vec<PodUse>,
    /// The volumes are alike, so which one a claim ends on depends on timing, on either side:
    /// compared as a set, the claim's volumeName as "one of them".
    pub(super) interchangeable: bool,
}

pub(super) const BBC: (&str, &str) = ("pv.kubernetes.io/bound-by-controller", "yes");
pub(super) const BC: (&str, &str) = ("pv.kubernetes.io/bind-completed", "yes");
/// upstream's `AnnDynamicallyProvisioned` with its mock plugin's name.
pub(super) const DYN: (&str, &str) = ("pv.kubernetes.io/provisioned-by", "kubernetes.io/mock-volume");

/// upstream's newVolume: RWO+ROX, a GCE PD source, the given claimRef, phase and policy.
pub(super) fn v(
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
pub(super) fn c(
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
    pub(super) fn ann(mut self, a: (&'static str, &'static str)) -> Self {
        self.anns.push(a);
        self
    }
    pub(super) fn block(mut self) -> Self {
        self.block = true;
        self
    }
    pub(super) fn labelled(mut self) -> Self {
        self.labels = true;
        self
    }
    pub(super) fn vac(mut self, c: &'static str) -> Self {
        self.vac = Some(c);
        self
    }
    pub(super) fn finalizer(mut self, f: &'static str) -> Self {
        self.finalizers.push(f);
        self
    }
    pub(super) fn csi(mut self, driver: &'static str) -> Self {
        self.csi_driver = Some(driver);
        self
    }
}

impl Claim {
    pub(super) fn ann(mut self, a: (&'static str, &'static str)) -> Self {
        self.anns.push(a);
        self
    }
    pub(super) fn block(mut self) -> Self {
        self.block = true;
        self
    }
    pub(super) fn selector(mut self) -> Self {
        self.selector = true;
        self
    }
    pub(super) fn modes(mut self, m: &[&'static str]) -> Self {
        self.modes = Some(m.to_vec());
        self
    }
    pub(super) fn vac(mut self, c: &'static str) -> Self {
        self.vac = Some(c);
        self
    }
    pub(super) fn status_vac(mut self, c: &'static str) -> Self {
        self.status_vac = Some(c);
        self
    }
}

pub(super) fn case(id: &'static str, vols: Vec<Vol>, claims: Vec<Claim>) -> Case {
    Case {
        id,
        vols,
        claims,
        pods: vec![],
        interchangeable: false,
    }
}

impl Case {
    pub(super) fn interchangeable(mut self) -> Self {
        self.interchangeable = true;
        self
    }
}

/// The settled state as compared: for interchangeable volumes, their states as a sorted list
/// and a claim's volumeName among them as "one of them".
pub(super) fn canonical(case: &Case, state: &Value) -> Value {
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

pub(super) const AV: &str = "Available";
pub(super) const BO: &str = "Bound";
pub(super) const PE: &str = "Pending";
pub(super) const RETAIN: &str = "Retain";
pub(super) const DELETE: &str = "Delete";
pub(super) const RECYCLE: &str = "Recycle";
pub(super) const WAIT: Option<&str> = Some("wait");
pub(super) const GOLD: Option<&str> = Some("gold");

// ---- objects ----

pub(super) fn qty(q: &str) -> BTreeMap<String, Quantity> {
    BTreeMap::from([("storage".to_string(), Quantity(q.into()))])
}

pub(super) fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([("foo".into(), "true".into()), ("bar".into(), "false".into())])
}

pub(super) fn fake_uid(sym: &str) -> String {
    format!("00000000-fake-{sym}")
}

pub(super) fn claim_object(c: &Claim) -> PersistentVolumeClaim {
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

pub(super) fn claim_status(c: &Claim) -> Value {
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

pub(super) fn volume_object(v: &Vol, uids: &BTreeMap<&str, String>) -> PersistentVolume {
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

pub(super) const KEPT_ANNOTATIONS: &[&str] = &[
    "pv.kubernetes.io/bound-by-controller",
    "pv.kubernetes.io/bind-completed",
    "pv.kubernetes.io/provisioned-by",
    "pv.kubernetes.io/migrated-to",
];
pub(super) const KEPT_FINALIZERS: &[&str] = &[
    "kubernetes.io/pv-controller",
    "external-provisioner.volume.kubernetes.io/finalizer",
];
