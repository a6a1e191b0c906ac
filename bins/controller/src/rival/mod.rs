//! Noticing a second storage controller. If kube-controller-manager's binder or attach/detach
//! controller still runs beside stowage's, both write the same PVs, claims, VolumeAttachments and
//! Node statuses, and each undoes what the other decided. Two kinds of evidence are read:
//!
//! - **writes**: managedFields entries of the manager `kube-controller-manager` (or `k3s`: the
//!   apiserver names a manager by its client's user agent) that take a storage field
//!   (`footprint.rs`) while stowage runs, seen on a metadata-only watch of each kind;
//! - **flags**: a kube-controller-manager pod in `kube-system` (kubeadm's and kind's static pods
//!   carry `component=kube-controller-manager`) whose `--controllers` turns on a controller
//!   stowage also runs, caught before it writes anything.
//!
//! Each is reported as a Warning Event `ConflictingController`, a metric and a log line; with
//! `--on-conflict=pause` the controllers stop until neither has been seen for the quiet period.
//! The decisions here are pure; `exec.rs` does the watching and reporting.

mod exec;
pub mod footprint;

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

pub use exec::{Metrics, spawn};
pub use footprint::Footprint;

/// The field managers kube-controller-manager's writes are recorded under. The apiserver names
/// a manager by the first segment of the client's user agent, which client-go builds from the
/// process's name: `kube-controller-manager` for its own binary (kubeadm, kind, most
/// distributions), `k3s` where k3s runs it inside its server process. Nothing else k3s's process
/// runs writes the storage fields these entries are checked for.
pub const KCM_MANAGERS: [&str; 2] = ["kube-controller-manager", "k3s"];

/// The kinds whose writes are watched, with the stowage controller that owns their storage fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    PersistentVolume,
    PersistentVolumeClaim,
    VolumeAttachment,
    Node,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::PersistentVolume,
        Kind::PersistentVolumeClaim,
        Kind::VolumeAttachment,
        Kind::Node,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::PersistentVolume => "PersistentVolume",
            Kind::PersistentVolumeClaim => "PersistentVolumeClaim",
            Kind::VolumeAttachment => "VolumeAttachment",
            Kind::Node => "Node",
        }
    }

    /// The stowage controller whose writes to this kind a rival's would clash with.
    pub fn owner(self) -> &'static str {
        match self {
            Kind::PersistentVolume | Kind::PersistentVolumeClaim => "binder",
            Kind::VolumeAttachment | Kind::Node => "attachdetach",
        }
    }
}

/// One managedFields entry, as much of it as the decision needs.
#[derive(Debug, Clone, Deserialize)]
pub struct Entry {
    #[serde(default)]
    pub manager: String,
    #[serde(default)]
    pub subresource: String,
    /// RFC 3339, second precision.
    #[serde(default)]
    pub time: Option<String>,
    #[serde(rename = "fieldsV1", default)]
    pub fields: Footprint,
}

/// The metadata of a watched object (a `PartialObjectMetadata`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub uid: Option<String>,
    #[serde(default)]
    pub resource_version: Option<String>,
    /// RFC 3339.
    #[serde(default)]
    pub creation_timestamp: Option<String>,
    #[serde(default)]
    pub managed_fields: Vec<Entry>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Object {
    #[serde(default)]
    pub metadata: Meta,
}

/// A write of kube-controller-manager's to a storage field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RivalWrite {
    pub at: Timestamp,
    /// The storage fields, named for the Event.
    pub fields: &'static str,
    /// The field manager it was recorded under (one of [`KCM_MANAGERS`]).
    pub manager: &'static str,
}

/// The storage fields a kind's entries can own, named for the Event, in bit order.
const FIELDS: [&str; 6] = [
    "spec.claimRef",
    "status.phase",
    "bind annotations",
    "spec.volumeName",
    "spec (created it)",
    "status.volumesAttached",
];

/// Which storage fields of one object each of [`KCM_MANAGERS`] owns: 8 bits per manager, one
/// per entry of [`FIELDS`]. Two bytes per object, so the detector can remember every object it
/// has seen change.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Owned(u16);

impl Owned {
    fn of(manager: usize, fields: u8) -> Self {
        Owned(u16::from(fields) << (8 * manager))
    }

    fn fields(self, manager: usize) -> u8 {
        (self.0 >> (8 * manager)) as u8
    }
}

/// What the rival managers own of `meta`'s storage fields now.
pub fn owned(kind: Kind, meta: &Meta) -> Owned {
    let mut o = Owned::default();
    for e in &meta.managed_fields {
        if let Some(m) = KCM_MANAGERS.iter().position(|m| *m == e.manager) {
            o.0 |= Owned::of(m, storage_bits(kind, &e.subresource, e.fields)).0;
        }
    }
    o
}

/// A write of kube-controller-manager's to one object since `since`, to fields that stowage's
/// `kind.owner()` writes too, or `None`.
///
/// managedFields date an entry, not its fields: a manager's entry keeps the fields it wrote long
/// ago, and any later write of the same manager to the same object (node lifecycle updating a
/// Node's conditions under `kube-controller-manager`, k3s's embedded kubelet writing Node status
/// under `k3s`) moves the entry's time. So a write counts only where the rival *took* a storage
/// field: its entry owns one that it did not own in `before` (this object as last seen). An
/// object seen for the first time has no `before`: if it was created since `since`, what the
/// rival owns it wrote since; otherwise nothing can be dated yet, and it becomes the baseline
/// (a rival that keeps fighting takes the field back from stowage, and that write counts).
pub fn rival_write(kind: Kind, meta: &Meta, since: Timestamp, before: Option<Owned>) -> Option<RivalWrite> {
    let created_since = meta
        .creation_timestamp
        .as_deref()
        .and_then(|t| t.parse::<Timestamp>().ok())
        .is_some_and(|t| t >= since);
    let before = match before {
        Some(b) => b,
        None if created_since => Owned::default(),
        None => return None,
    };
    meta.managed_fields
        .iter()
        .filter_map(|e| {
            let m = KCM_MANAGERS.iter().position(|m| *m == e.manager)?;
            let at: Timestamp = e.time.as_deref()?.parse().ok()?;
            let taken = storage_bits(kind, &e.subresource, e.fields) & !before.fields(m);
            let fields = (taken != 0).then(|| FIELDS[taken.trailing_zeros() as usize])?;
            (at >= since).then_some(RivalWrite {
                at,
                fields,
                manager: KCM_MANAGERS[m],
            })
        })
        .max_by_key(|w| w.at)
}

/// Which storage fields an entry of `kind` owns, as bits of [`FIELDS`].
fn storage_bits(kind: Kind, subresource: &str, fp: Footprint) -> u8 {
    let status = subresource == "status";
    let binder = matches!(kind, Kind::PersistentVolume | Kind::PersistentVolumeClaim);
    [
        kind == Kind::PersistentVolume && fp.claim_ref,
        binder && status && fp.phase,
        binder && fp.bind_annotations,
        kind == Kind::PersistentVolumeClaim && fp.volume_name,
        kind == Kind::VolumeAttachment && fp.attachment_spec,
        kind == Kind::Node && status && fp.volumes_attached,
    ]
    .iter()
    .enumerate()
    .fold(0, |acc, (i, on)| acc | (u8::from(*on) << i))
}

/// Which storage field an entry of `kind` owns (the first of [`FIELDS`]), named for the Event, or
/// `None`.
pub fn storage_fields(kind: Kind, subresource: &str, fp: Footprint) -> Option<&'static str> {
    let bits = storage_bits(kind, subresource, fp);
    (bits != 0).then(|| FIELDS[bits.trailing_zeros() as usize])
}

/// The storage controllers a kube-controller-manager command line turns on, by stowage's names.
/// `--controllers` is read as kube-controller-manager reads it: names on, `-name` off, `*` every
/// default one (all five storage controllers are on by default); absent, it is `*`.
pub fn kcm_storage_controllers(argv: &[String]) -> Vec<&'static str> {
    let mut value: Option<&str> = None;
    let mut args = argv.iter();
    while let Some(a) = args.next() {
        if let Some(v) = a.strip_prefix("--controllers=") {
            value = Some(v);
        } else if a == "--controllers" {
            value = args.next().map(String::as_str);
        }
    }
    let items: Vec<&str> = value.unwrap_or("*").split(',').map(str::trim).collect();
    let star = items.contains(&"*");
    // KCM's old names `attachdetach`, `pvc-protection` and `pv-protection` are stowage's own.
    let ours = |kcm: &str| {
        crate::KCM_ALIASES
            .iter()
            .find(|(k, _)| *k == kcm)
            .map(|(_, n)| *n)
            .or_else(|| {
                crate::CONTROLLERS
                    .iter()
                    .find(|(n, _)| *n == kcm)
                    .map(|(n, _)| *n)
            })
    };
    let mut on: Vec<&'static str> = Vec::new();
    for (name, _) in crate::CONTROLLERS {
        let named = |item: &str| ours(item) == Some(*name);
        let off = items.iter().any(|i| i.strip_prefix('-').is_some_and(named));
        let explicit = items.iter().any(|i| named(i));
        if !off && (star || explicit) {
            on.push(*name);
        }
    }
    on
}

/// The conflict as last seen: which rival pods' flags clash, and when a rival write was last seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// `namespace/name` of kube-controller-manager pods whose flags turn on what stowage runs,
    /// with those controllers.
    pub flagged: Vec<(String, Vec<&'static str>)>,
    /// When the last rival write was seen (monotonic time, as a duration since the detector began).
    pub last_write: Option<Duration>,
}

impl Seen {
    /// A conflict holds while a pod's flags clash, or for `quiet` after the last rival write.
    pub fn active(&self, now: Duration, quiet: Duration) -> bool {
        !self.flagged.is_empty() || self.writes_active(now, quiet)
    }

    pub fn writes_active(&self, now: Duration, quiet: Duration) -> bool {
        self.last_write.is_some_and(|t| now.saturating_sub(t) < quiet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn meta(entries: serde_json::Value) -> Meta {
        serde_json::from_value(json!({"name": "pv-1", "managedFields": entries})).unwrap()
    }

    fn since() -> Timestamp {
        "2026-11-27T18:00:00Z".parse().unwrap()
    }

    /// Nothing owned by a rival when last seen.
    const CLEAN: Option<Owned> = Some(Owned(0));

    #[test]
    fn a_binders_write_after_start_is_a_rival_write() {
        let m = meta(json!([
            {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
             "time": "2026-11-27T18:00:05Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:phase": {}}}},
        ]));
        assert_eq!(
            rival_write(Kind::PersistentVolume, &m, since(), CLEAN).map(|w| w.fields),
            Some("status.phase")
        );
        // Written before stowage began watching: history, not a conflict now.
        let later: Timestamp = "2026-11-27T18:00:06Z".parse().unwrap();
        assert_eq!(rival_write(Kind::PersistentVolume, &m, later, CLEAN), None);
    }

    #[test]
    fn k3s_embedded_controller_manager_is_a_rival() {
        let m = meta(json!([
            {"manager": "k3s", "operation": "Update", "time": "2026-11-27T18:00:05Z",
             "fieldsV1": {"f:spec": {"f:claimRef": {}}}},
        ]));
        assert_eq!(
            rival_write(Kind::PersistentVolume, &m, since(), CLEAN).map(|w| w.fields),
            Some("spec.claimRef")
        );
    }

    #[test]
    fn stowage_and_other_managers_are_not_rivals() {
        let m = meta(json!([
            {"manager": "stowage-controller", "subresource": "status", "time": "2026-11-27T18:00:05Z",
             "fieldsV1": {"f:status": {"f:phase": {}}}},
            {"manager": "kube-controller-manager", "time": "2026-11-27T18:00:05Z",
             "fieldsV1": {"f:metadata": {"f:ownerReferences": {}}}},
        ]));
        let since: Timestamp = "2026-11-27T17:00:00Z".parse().unwrap();
        assert_eq!(rival_write(Kind::PersistentVolume, &m, since, CLEAN), None);
    }

    /// A Node's status entry of `manager` at `time`, owning `volumesAttached` and the conditions.
    fn node_status(manager: &str, time: &str, attached: bool) -> Meta {
        let mut fields = json!({"f:status": {"f:conditions": {}}});
        if attached {
            fields["f:status"]["f:volumesAttached"] = json!({});
        }
        serde_json::from_value(json!({
            "name": "node-1", "uid": "00000000-0000-0000-0000-000000000001",
            "creationTimestamp": "2026-11-27T10:00:00Z",
            "managedFields": [{"manager": manager, "operation": "Update", "subresource": "status",
                               "time": time, "fieldsV1": fields}],
        }))
        .unwrap()
    }

    #[test]
    fn a_field_kept_from_before_and_only_redated_is_no_write() {
        for manager in KCM_MANAGERS {
            // kube-controller-manager's attach/detach wrote volumesAttached before stowage took
            // over; node lifecycle (or, on k3s, the embedded kubelet) writes the same entry since.
            let old = node_status(manager, "2026-11-27T17:59:00Z", true);
            let bumped = node_status(manager, "2026-11-27T18:00:07Z", true);
            let before = Some(owned(Kind::Node, &old));
            assert_eq!(
                rival_write(Kind::Node, &bumped, since(), before),
                None,
                "{manager}: a re-dated entry is not a write to volumesAttached"
            );
            // Taken back after stowage had it: a write.
            let stowages = Some(owned(
                Kind::Node,
                &node_status(manager, "2026-11-27T17:59:00Z", false),
            ));
            assert_eq!(
                rival_write(Kind::Node, &bumped, since(), stowages).map(|w| (w.fields, w.manager)),
                Some(("status.volumesAttached", manager))
            );
        }
    }

    #[test]
    fn an_object_first_seen_is_dated_by_its_creation() {
        let old = node_status("kube-controller-manager", "2026-11-27T18:00:07Z", true);
        assert_eq!(
            rival_write(Kind::Node, &old, since(), None),
            None,
            "made before stowage started: what its entry owns cannot be dated"
        );
        let mut new = old.clone();
        new.creation_timestamp = Some("2026-11-27T18:00:03Z".into());
        assert_eq!(
            rival_write(Kind::Node, &new, since(), None).map(|w| w.fields),
            Some("status.volumesAttached"),
            "made since: everything a rival owns of it, it wrote since"
        );
    }

    #[test]
    fn ownership_is_remembered_per_manager() {
        let m = meta(json!([
            {"manager": "kube-controller-manager", "time": "2026-11-27T18:00:05Z",
             "fieldsV1": {"f:spec": {"f:claimRef": {}}}},
            {"manager": "k3s", "subresource": "status", "time": "2026-11-27T18:00:05Z",
             "fieldsV1": {"f:status": {"f:phase": {}}}},
        ]));
        let o = owned(Kind::PersistentVolume, &m);
        assert_eq!(o.fields(0), 0b01);
        assert_eq!(o.fields(1), 0b10);
        assert_eq!(rival_write(Kind::PersistentVolume, &m, since(), Some(o)), None);
        // kube-controller-manager's claimRef is not k3s's: one manager's field is news for the other.
        let only_k3s = Some(Owned::of(1, 0b11));
        assert_eq!(
            rival_write(Kind::PersistentVolume, &m, since(), only_k3s).map(|w| w.manager),
            Some("kube-controller-manager")
        );
    }

    #[test]
    fn node_status_attachments_belong_to_attach_detach() {
        let fp = Footprint {
            volumes_attached: true,
            ..Default::default()
        };
        assert_eq!(
            storage_fields(Kind::Node, "status", fp),
            Some("status.volumesAttached")
        );
        assert_eq!(Kind::Node.owner(), "attachdetach");
        // The kubelet's volumesInUse is not the controller's field.
        assert_eq!(storage_fields(Kind::Node, "status", Footprint::default()), None);
    }

    #[test]
    fn kcm_flags_are_read_as_kcm_reads_them() {
        assert_eq!(
            kcm_storage_controllers(&s(&["kube-controller-manager", "--kubeconfig=/x"])),
            vec![
                "binder",
                "pv-protection",
                "pvc-protection",
                "attachdetach",
                "expand"
            ]
        );
        let off = "--controllers=*,bootstrapsigner,-persistentvolume-binder-controller,-persistentvolume-attach-detach-controller,-persistentvolume-expander-controller,-persistentvolume-protection-controller,-persistentvolumeclaim-protection-controller";
        assert!(kcm_storage_controllers(&s(&["kube-controller-manager", off])).is_empty());
        assert_eq!(
            kcm_storage_controllers(&s(&["--controllers", "persistentvolume-binder,garbagecollector"])),
            vec!["binder"]
        );
        // The old aliases turned off count as off.
        assert_eq!(
            kcm_storage_controllers(&s(&["--controllers=*,-persistentvolume-binder"])),
            vec!["pv-protection", "pvc-protection", "attachdetach", "expand"]
        );
        assert!(
            kcm_storage_controllers(&s(&[
                "--controllers=*,-persistentvolume-binder,-attachdetach,-persistentvolume-expander,-pvc-protection,-pv-protection"
            ]))
            .is_empty()
        );
    }

    proptest! {
        #[test]
        fn a_conflict_ends_only_when_quiet_and_unflagged(
            last in proptest::option::of(0u64..1000),
            now in 0u64..2000,
            quiet in 1u64..500,
            flagged in any::<bool>(),
        ) {
            let seen = Seen {
                flagged: if flagged { vec![("kube-system/kcm".into(), vec!["binder"])] } else { vec![] },
                last_write: last.map(Duration::from_secs),
            };
            let now_d = Duration::from_secs(now.max(last.unwrap_or(0)));
            let active = seen.active(now_d, Duration::from_secs(quiet));
            let recent = last.is_some_and(|l| now.max(l) - l < quiet);
            prop_assert_eq!(active, flagged || recent);
        }
    }
}
