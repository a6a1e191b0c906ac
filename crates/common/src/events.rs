//! Events for people: a thin wrapper over kube-runtime's recorder that logs instead of failing
//! when the apiserver refuses an event.
//!
//! kube-runtime's recorder folds events into a series by (object, reason, action) and keeps the
//! first note, so a changed explanation would never show. Callers here report a condition once
//! per change already, so every publish is a new event with its own note.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

#[derive(Clone)]
pub struct Events {
    client: Client,
    reporter: Reporter,
}

impl Events {
    /// `controller` is the reporting component, e.g. `stowage-binder`.
    pub fn new(client: Client, controller: &str) -> Self {
        let reporter = Reporter {
            controller: controller.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self { client, reporter }
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
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(e) = recorder.publish(&ev, on).await {
            tracing::warn!(reason, error = %e, "cannot record event");
        }
    }
}
