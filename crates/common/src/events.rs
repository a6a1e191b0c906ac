//! Events for people: a thin wrapper over kube-runtime's recorder (which folds repeats into a
//! series) that logs instead of failing when the apiserver refuses an event.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
}

impl Events {
    /// `controller` is the reporting component, e.g. `stowage-binder`.
    pub fn new(client: Client, controller: &str) -> Self {
        let reporter = Reporter {
            controller: controller.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client, reporter),
        }
    }

    pub async fn normal(&self, on: &ObjectReference, reason: &str, action: &str, note: String) {
        self.publish(on, EventType::Normal, reason, action, note).await;
    }

    pub async fn warning(&self, on: &ObjectReference, reason: &str, action: &str, note: String) {
        self.publish(on, EventType::Warning, reason, action, note).await;
    }

    async fn publish(
        &self,
        on: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, on).await {
            tracing::warn!(reason, error = %e, "cannot record event");
        }
    }
}
