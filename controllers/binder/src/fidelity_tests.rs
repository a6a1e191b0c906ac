//! Upstream fidelity of the claim status and the default class (issue 16, items 2, 5 and 8),
//! as pure functions: objects in, the status upstream's updateClaimStatus writes out.

use k8s_openapi::api::core::v1::{PersistentVolumeClaimStatus, PersistentVolumeSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::jiff::Timestamp;
use stowage_testkit::builders::{pv, pvc};

use crate::core::{bound_claim_status, newest_default_class, with_claim_phase};

#[test]
fn binding_sets_the_current_volume_attributes_class_of_the_volume() {
    let mut v = pv("v").build();
    v.spec
        .get_or_insert_with(PersistentVolumeSpec::default)
        .volume_attributes_class_name = Some("gold".into());
    let c = pvc("ns", "c").build();
    let bound = bound_claim_status(&c, &v).expect("a bind writes the claim status");
    let st = bound.status.unwrap();
    assert_eq!(st.phase.as_deref(), Some("Bound"));
    assert_eq!(st.current_volume_attributes_class_name.as_deref(), Some("gold"));
    // A bound claim whose volume's class changed follows it.
    let mut again = bound_claim_status(&c, &v).unwrap();
    again
        .status
        .as_mut()
        .unwrap()
        .current_volume_attributes_class_name = Some("silver".into());
    assert!(bound_claim_status(&again, &v).is_some());
}

#[test]
fn pending_and_lost_clear_what_described_the_volume() {
    for phase in ["Pending", "Lost"] {
        let mut c = pvc("ns", "c").build();
        c.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            capacity: Some([("storage".to_string(), Quantity("1Gi".into()))].into()),
            current_volume_attributes_class_name: Some("gold".into()),
            ..Default::default()
        });
        let st = with_claim_phase(&c, phase).unwrap().status.unwrap();
        assert_eq!(st.phase.as_deref(), Some(phase));
        assert_eq!(st.access_modes, None, "{phase}");
        assert_eq!(st.capacity, None, "{phase}");
        assert_eq!(st.current_volume_attributes_class_name, None, "{phase}");
        // Written once: the cleared status needs nothing more.
        let mut done = c.clone();
        done.status = Some(st);
        assert!(with_claim_phase(&done, phase).is_none());
    }
}

#[test]
fn the_default_class_is_the_newest_then_the_first_by_name() {
    let t = |s: i64| Some(Timestamp::from_second(s).unwrap());
    let pick = |v: Vec<(Option<Timestamp>, &str)>| {
        newest_default_class(v.into_iter().map(|(t, n)| (t, n.to_string())))
    };
    assert_eq!(pick(vec![(t(10), "old"), (t(20), "new")]).as_deref(), Some("new"));
    // Created in the same second: name ascending (upstream sorts so).
    assert_eq!(
        pick(vec![(t(20), "b"), (t(20), "a"), (t(10), "0")]).as_deref(),
        Some("a")
    );
    assert_eq!(pick(vec![]), None);
}
