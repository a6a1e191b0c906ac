//! What write tasks report back (`Outcome`) and the step that folds it into the state, metrics
//! and events.

use tokio::time::Instant;

use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use crate::core::pass_unaffected;
use crate::exec::Outcome;
use crate::metrics::observe_attempt;
use crate::read::VaState;
use crate::state::{Parts, STATUS_RETRY};
use stowage_common::errors::MetricLabel;
use stowage_common::observe::storageops::{VOLUME_ATTACH, VOLUME_DETACH};

impl stowage_common::runtime::owed::Work for Outcome {
    /// Whether `self` and `other` report the same piece of work.
    fn same_work(&self, other: &Outcome) -> bool {
        match (self, other) {
            (
                Outcome::Attach {
                    volume: a, node: b, ..
                },
                Outcome::Attach {
                    volume: c, node: d, ..
                },
            )
            | (
                Outcome::Detach {
                    volume: a, node: b, ..
                },
                Outcome::Detach {
                    volume: c, node: d, ..
                },
            )
            | (
                Outcome::Release {
                    volume: a, node: b, ..
                },
                Outcome::Release {
                    volume: c, node: d, ..
                },
            ) => a == c && b == d,
            (Outcome::Status { node: a, .. }, Outcome::Status { node: b, .. }) => a == b,
            (Outcome::PvFinalizer { pv: a, .. }, Outcome::PvFinalizer { pv: b, .. }) => a == b,
            _ => false,
        }
    }
}

impl Parts<'_> {
    /// Takes a write task's result back into the state.
    /// Folds a finished write task into the state; returns the time it was folded at when it
    /// made a full pass due (the controller then moves its wake-up).
    pub(crate) fn finish(&mut self, done: Outcome) -> Option<Instant> {
        let now = Instant::now();
        let m = self.executor.metrics.clone();
        let mut pass_due = true;
        match done {
            Outcome::Attach {
                volume,
                node,
                va_name,
                result,
            } => {
                m.queue_depth.with_label_values(&["attach"]).dec();
                // The entry with its create still in flight: what the result is compared with.
                let before = self.st.actual.get(&volume, &node).cloned().unwrap_or_default();
                let clear_op = |c: &mut Self| {
                    if let Some(e) = c.st.actual.get_mut(&volume, &node) {
                        e.op = None;
                    }
                };
                match result {
                    Ok(va) => {
                        m.operations.with_label_values(&["attach", "success"]).inc();
                        self.succeeded(&volume, &node);
                        // In a burst of attaches, this is what would start a full pass per
                        // attachment; an attachment created as wanted decides nothing new.
                        let marked = self.va_applied(&va);
                        clear_op(self);
                        // Checked again from the entry as it ended: when the watch had already
                        // brought a newer copy, the object adds nothing, but the create leaving
                        // the entry still changes it (a volume no longer wanted can now be
                        // detached).
                        let wanted = self.st.desired.get(&volume, &node).is_some();
                        pass_due = marked
                            || !self
                                .st
                                .actual
                                .get(&volume, &node)
                                .is_some_and(|after| pass_unaffected(&before, after, wanted));
                    }
                    Err(err) if err.is_conflict() => {
                        clear_op(self);
                        // Someone (a previous leader) created it: follow the stored copy.
                        m.operations.with_label_values(&["attach", "success"]).inc();
                        self.succeeded(&volume, &node);
                        match self.cluster.attachments.store().get(&ObjectRef::new(&va_name)) {
                            Some(va) => {
                                self.va_applied(&va);
                            }
                            None => {
                                if let Some(e) = self.st.actual.get_mut(&volume, &node)
                                    && e.va.is_none()
                                {
                                    // Its watch event is on the way; a resync corrects a miss.
                                    e.va = Some(VaState {
                                        name: va_name,
                                        ..Default::default()
                                    });
                                }
                            }
                        }
                    }
                    Err(err) => {
                        clear_op(self);
                        m.operations.with_label_values(&["attach", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["attach", err.metric_label()])
                            .inc();
                        tracing::warn!(%volume, %node, error = %err, "attach failed");
                        if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                            e.failed(now);
                            if let Some(t) = e.attach_started.take() {
                                observe_attempt(&e.driver, VOLUME_ATTACH, false, t);
                            }
                        }
                        let msg = err.to_string();
                        self.pod_events(&volume, &node, true, "FailedAttachVolume", |pv| {
                            format!("Cannot request attaching volume \"{pv}\": {msg}")
                        });
                    }
                }
                self.st.actual.tidy(&volume, &node, now);
            }
            Outcome::Detach {
                volume,
                node,
                forced,
                result,
            } => {
                m.queue_depth.with_label_values(&["detach"]).dec();
                if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                    e.op = None;
                }
                match result {
                    Ok(left) => {
                        m.operations.with_label_values(&["detach", "success"]).inc();
                        if let Some(r) = forced {
                            m.forced_detach(r);
                        }
                        self.succeeded(&volume, &node);
                        match left {
                            // Finalizers hold it: the attacher detaches, the watch reports the end.
                            Some(va) => {
                                self.va_applied(&va);
                            }
                            None => {
                                if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                                    e.va = None;
                                    e.reported = None;
                                    e.detach_requested = None;
                                    if let Some(t) = e.detach_started.take() {
                                        m.detach_seconds.observe(t.elapsed().as_secs_f64());
                                        observe_attempt(&e.driver, VOLUME_DETACH, true, t);
                                    }
                                }
                            }
                        }
                    }
                    Err(err) => {
                        m.operations.with_label_values(&["detach", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["detach", err.metric_label()])
                            .inc();
                        tracing::warn!(%volume, %node, error = %err, "detach failed");
                        if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                            e.failed(now);
                            if let Some(t) = e.detach_started.take() {
                                observe_attempt(&e.driver, VOLUME_DETACH, false, t);
                            }
                        }
                    }
                }
                self.st.actual.tidy(&volume, &node, now);
            }
            Outcome::Release { volume, node, result } => {
                if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                    e.op = None;
                }
                match result {
                    Ok(va) => {
                        m.operations.with_label_values(&["release", "success"]).inc();
                        tracing::warn!(%volume, %node, va = %va.name_any(), "released the attachment of a node that is gone or out of service");
                        self.executor.events.warning(
                            &va.object_ref(&()),
                            "AttachmentReleased",
                            "Detach",
                            format!(
                                "node {node} is gone or out of service and no attacher is left there: the controller dropped the attacher's finalizer so volume {volume} can be attached elsewhere"
                            ),
                        );
                        self.succeeded(&volume, &node);
                        self.va_applied(&va);
                    }
                    Err(err) if err.is_not_found() => {
                        m.operations.with_label_values(&["release", "success"]).inc();
                    }
                    Err(err) => {
                        m.operations.with_label_values(&["release", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["release", err.metric_label()])
                            .inc();
                        tracing::warn!(%volume, %node, error = %err, "release of a dead node's attachment failed");
                        if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                            e.failed(now);
                        }
                    }
                }
                self.st.actual.tidy(&volume, &node, now);
            }
            Outcome::PvFinalizer { pv, result } => {
                self.st.pv_patching.remove(&pv);
                match result {
                    Ok(()) => {
                        m.operations.with_label_values(&["pv_finalizer", "success"]).inc();
                    }
                    Err(e) if e.is_not_found() => {}
                    Err(e) => {
                        m.operations.with_label_values(&["pv_finalizer", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["pv_finalizer", e.metric_label()])
                            .inc();
                        tracing::warn!(%pv, error = %e, "cannot update the attacher finalizer of the volume");
                        // A conflict is decided again on the newer copy; other errors wait for
                        // the next change or the periodic resync.
                        if e.is_conflict() {
                            self.st.pv_dirty.insert(pv);
                        }
                    }
                }
            }
            Outcome::Status { node, result } => {
                self.st.status_in_flight.remove(&node);
                match result {
                    Ok(n) => {
                        m.operations.with_label_values(&["node_status", "success"]).inc();
                        self.st.status_retry.remove(&node);
                        self.node_applied(&n);
                    }
                    Err(e) if e.is_not_found() => {
                        m.operations.with_label_values(&["node_status", "success"]).inc();
                    }
                    Err(e) => {
                        m.operations.with_label_values(&["node_status", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["node_status", e.metric_label()])
                            .inc();
                        tracing::warn!(%node, error = %e, "node status update failed");
                        self.st.status_retry.insert(node, now + STATUS_RETRY);
                    }
                }
            }
        }
        if pass_due {
            self.st.dirty = true;
            return Some(now);
        }
        None
    }

    pub(crate) fn succeeded(&mut self, volume: &str, node: &str) {
        if let Some(e) = self.st.actual.get_mut(volume, node) {
            e.succeeded();
        }
    }
}
