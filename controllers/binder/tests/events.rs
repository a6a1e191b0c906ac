//! The shared event sink against the real apiserver: repeats of one event become one Event
//! object whose series counts them, instead of one object per repeat.

use k8s_openapi::api::events::v1::Event;
use kube::api::ListParams;
use kube::{Api, Resource};
use stowage_common::observe::events::Events;
use stowage_testkit::builders::pvc;
use stowage_testkit::inproc::WAIT;
use stowage_testkit::{InProcess, eventually};

#[tokio::test]
async fn ten_identical_events_are_one_event_object_with_a_series() {
    let h = InProcess::new().await;
    h.namespace("app").await;
    let claim = h.create_pvc(pvc("app", "noisy").build()).await;
    let on = claim.object_ref(&());
    let events = Events::new(h.client.clone(), "stowage-test");
    for _ in 0..10 {
        events.warning(&on, "ProvisioningFailed", "Provisioning", "same words".into());
    }
    let api: Api<Event> = Api::namespaced(h.client.clone(), "app");
    let about = |reason: &'static str| {
        let api = api.clone();
        async move {
            let all = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok::<Vec<Event>, String>(
                all.items
                    .into_iter()
                    .filter(|e| {
                        e.reason.as_deref() == Some(reason)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("noisy")
                    })
                    .collect(),
            )
        }
    };
    let ev = eventually(WAIT, || async {
        let found = about("ProvisioningFailed").await?;
        match found.as_slice() {
            [one] if one.series.as_ref().is_some_and(|s| s.count == 10) => Ok(one.clone()),
            other => Err(format!(
                "{} objects, series {:?}",
                other.len(),
                other.iter().map(|e| e.series.clone()).collect::<Vec<_>>()
            )),
        }
    })
    .await;
    assert_eq!(ev.note.as_deref(), Some("same words"));
    assert_eq!(ev.reporting_controller.as_deref(), Some("stowage-test"));
    assert!(ev.series.unwrap().count >= 2);

    // A changed explanation is a new event (it must show), not folded into the old one.
    events.warning(&on, "ProvisioningFailed", "Provisioning", "other words".into());
    eventually(WAIT, || async {
        let found = about("ProvisioningFailed").await?;
        if found.len() == 2 && found.iter().any(|e| e.note.as_deref() == Some("other words")) {
            Ok(())
        } else {
            Err(format!("{} objects", found.len()))
        }
    })
    .await;
}
