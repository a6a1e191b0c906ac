//! Events for people, sent by one background task per component through a bounded queue.
//!
//! Callers never wait for the apiserver: an event is queued (or, when the queue is full, dropped
//! and counted), as client-go's broadcaster does with its 1,000-event queue. A burst of bad
//! objects therefore costs a bounded amount of memory instead of one parked task per event.
//!
//! kube-runtime's recorder folds events into a series by (object, reason, action) and keeps the
//! first note, so a changed explanation would never show. Callers here report a condition once
//! per change already, so every publish is a new event with its own note.

use std::sync::{Arc, LazyLock};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus::{IntCounterVec, Opts};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Events a component may have waiting; beyond this new ones are dropped (and counted).
pub const QUEUE_CAPACITY: usize = 1000;

/// `stowage_events_total{component, type, outcome}`, process-wide; `metrics::registry` exposes it.
pub(crate) static EVENTS_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    IntCounterVec::new(
        Opts::new(
            "stowage_events_total",
            "Kubernetes Events by outcome: recorded, failed (refused by the apiserver) or dropped (queue full).",
        ),
        &["component", "type", "outcome"],
    )
    .expect("static metric definition")
});

struct Pending {
    on: ObjectReference,
    type_: EventType,
    reason: String,
    action: String,
    note: String,
}

/// Aborts the sender when the last handle goes, so a stopped controller (lost leadership)
/// sends nothing more.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<Pending>,
    component: Arc<str>,
    _sender: Arc<AbortOnDrop>,
}

fn type_label(t: EventType) -> &'static str {
    match t {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }
}

impl Events {
    /// `controller` is the reporting component, e.g. `stowage-binder`. Spawns the sender on the
    /// current runtime.
    pub fn new(client: Client, controller: &str) -> Self {
        let reporter = Reporter {
            controller: controller.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        let component: Arc<str> = controller.into();
        let (tx, mut rx) = mpsc::channel::<Pending>(QUEUE_CAPACITY);
        let label = component.clone();
        let sender = tokio::spawn(async move {
            while let Some(p) = rx.recv().await {
                let ev = Event {
                    type_: p.type_,
                    reason: p.reason,
                    note: Some(p.note),
                    action: p.action,
                    secondary: None,
                };
                let recorder = Recorder::new(client.clone(), reporter.clone());
                let outcome = match recorder.publish(&ev, &p.on).await {
                    Ok(()) => "recorded",
                    Err(e) => {
                        tracing::warn!(reason = %ev.reason, error = %e, "cannot record event");
                        "failed"
                    }
                };
                EVENTS_TOTAL
                    .with_label_values(&[&*label, type_label(p.type_), outcome])
                    .inc();
            }
        });
        Self {
            tx,
            component,
            _sender: Arc::new(AbortOnDrop(sender)),
        }
    }

    pub fn normal(&self, on: &ObjectReference, reason: &str, action: &str, note: String) {
        self.queue(on, EventType::Normal, reason, action, note);
    }

    pub fn warning(&self, on: &ObjectReference, reason: &str, action: &str, note: String) {
        self.queue(on, EventType::Warning, reason, action, note);
    }

    fn queue(&self, on: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
        let p = Pending {
            on: on.clone(),
            type_,
            reason: reason.into(),
            action: action.into(),
            note,
        };
        if self.tx.try_send(p).is_err() {
            tracing::warn!(reason, object = ?on.name, "event queue full, event dropped");
            EVENTS_TOTAL
                .with_label_values(&[&*self.component, type_label(type_), "dropped"])
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_drops_and_counts_instead_of_growing() {
        // Nothing listens there: the sender's posts fail, which is fine for this test.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let events = Events::new(Client::try_from(config).unwrap(), "test-full-queue");
        let dropped = || {
            EVENTS_TOTAL
                .with_label_values(&["test-full-queue", "Warning", "dropped"])
                .get()
        };
        let on = ObjectReference {
            name: Some("x".into()),
            ..Default::default()
        };
        // The current-thread runtime does not run the sender until this test yields, so the
        // queue fills deterministically.
        for i in 0..QUEUE_CAPACITY + 5 {
            events.warning(&on, "Test", "Testing", format!("note {i}"));
        }
        assert_eq!(dropped(), 5);
    }
}
