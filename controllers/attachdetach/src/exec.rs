//! `Executor`: each decision of a pass becomes an API write run by a task of its own (started by
//! `start`); attaches and detaches draw from separate budgets so a burst of one never starves the
//! other. Every task reports an `Outcome` through `Owed`, also when it panics. The live-Node check
//! before a detach, with its unit tests, is here too.
//!
//! Why two semaphores and a JoinSet, not `stowage_common::runtime::queue` + `inflight::Window` (decided in
//! issue 17): the window runs one task per key, with keys waiting undecided in the queue; this
//! controller decides all (volume, node) pairs in one pass, and one task carries a node's status
//! patch and then that node's detaches (several keys), in that order, which the rule "never
//! detach while the node advertises the volume" needs. What the window gives is kept here: one
//! operation per (volume, node) is `PairState::op`, set before the task starts and cleared only
//! by its `Outcome`; a panicking task still reports (`Owed`, test
//! `a_panicked_attach_task_is_retried_and_the_volume_attached`); dropping the controller aborts
//! the tasks. A window of N keys would also make a burst beyond N wait for a later decision
//! rather than for a slot, which the attach throughput in docs/benchmarks.md was not measured
//! with.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use kube::Api;
use kube::api::{Patch, PatchParams};
use stowage_common::api::attachments::Attachments;
use stowage_common::observe::events::Events;
use stowage_common::store::VolumeAttachment;
use tokio::sync::{Semaphore, mpsc};

use crate::core::ForceReason;
use crate::error::Error;
use crate::metrics::Metrics;

/// A write task's debt: the `Outcome`s it owes its loop (`stowage_common::runtime::owed`).
pub(crate) type Owed = stowage_common::runtime::owed::Owed<Outcome>;

/// A test seam of the attach task (`controller.rs` live tests): empty in production, where each
/// point costs one `Option` check. Only this crate can fill it.
#[derive(Clone, Default)]
pub struct Hooks(Option<Arc<HookPoints>>);

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Hooks(set)"
        } else {
            "Hooks(none)"
        })
    }
}

#[derive(Default)]
pub(crate) struct HookPoints {
    /// The attach task of this PV panics once.
    pub(crate) panic_on_attach: std::sync::Mutex<Option<String>>,
    /// The attach task of this PV holds its result back until notified.
    pub(crate) hold_attach_result: std::sync::Mutex<Option<(String, Arc<tokio::sync::Notify>)>>,
}

impl Hooks {
    #[cfg(test)]
    pub(crate) fn new(points: Arc<HookPoints>) -> Self {
        Self(Some(points))
    }

    /// Panics if asked to for this attachment's PV (once).
    pub(crate) fn before_attach(&self, pv: Option<&str>) {
        let Some(h) = &self.0 else { return };
        let mut hook = h.panic_on_attach.lock().unwrap_or_else(|p| p.into_inner());
        if hook.is_some() && hook.as_deref() == pv {
            *hook = None;
            drop(hook);
            panic!("test hook: attach task panics");
        }
    }

    /// Waits, if asked to for this attachment's PV, before the result is reported.
    pub(crate) async fn before_attach_result(&self, pv: Option<&str>) {
        let Some(h) = &self.0 else { return };
        let held = h
            .hold_attach_result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_if(|(name, _)| Some(name.as_str()) == pv);
        if let Some((_, go)) = held {
            go.notified().await;
        }
    }
}

/// Results of the write tasks.
pub(crate) enum Outcome {
    Attach {
        volume: String,
        node: String,
        va_name: String,
        result: Result<VolumeAttachment, Error>,
    },
    Detach {
        volume: String,
        node: String,
        forced: Option<ForceReason>,
        /// `Some` while the VolumeAttachment still exists (finalizers), `None` once gone.
        result: Result<Option<VolumeAttachment>, Error>,
    },
    Status {
        node: String,
        /// Boxed: a `Node` is ~1.5 KB, and every outcome is moved at that size.
        result: Result<Box<Node>, Error>,
    },
    Release {
        volume: String,
        node: String,
        result: Result<VolumeAttachment, Error>,
    },
    PvFinalizer {
        pv: String,
        result: Result<(), Error>,
    },
}

/// Everything a write task needs. Shared behind one `Arc` (`Controller::executor`): kube's `Api`
/// carries its resource's names and path as owned strings, so a copy per task allocated a dozen
/// times for each API handle.
pub(crate) struct Executor {
    /// Their answers come back as the informer decodes them (no managed fields).
    pub(crate) vas: Attachments,
    pub(crate) pvs: Api<PersistentVolume>,
    pub(crate) nodes: Api<Node>,
    pub(crate) events: Events,
    pub(crate) metrics: Metrics,
    pub(crate) done: mpsc::UnboundedSender<Outcome>,
    pub(crate) attach_slots: Arc<Semaphore>,
    pub(crate) detach_slots: Arc<Semaphore>,
    pub(crate) hooks: Hooks,
}

/// Whether the live Node still allows releasing a dead node's attachment: it is gone, or it
/// still carries the out-of-service taint.
pub(crate) fn release_is_safe(node: &str, live: &Result<Option<Node>, String>) -> Result<(), Error> {
    match live {
        Err(e) => Err(Error::NodeUnreadable {
            node: node.to_string(),
            error: e.clone(),
        }),
        Ok(None) => Ok(()),
        Ok(Some(n)) => {
            let out_of_service = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == crate::read::TAINT_OUT_OF_SERVICE));
            if out_of_service {
                Ok(())
            } else {
                Err(Error::NodeBack(node.to_string()))
            }
        }
    }
}

pub(crate) struct DetachJob {
    pub(crate) volume: String,
    pub(crate) va_name: String,
    pub(crate) forced: Option<ForceReason>,
    pub(crate) waited: Duration,
}

/// Replaces `status.volumesAttached` (a merge patch replaces the whole list, which this
/// controller owns).
/// Splits detach jobs into those safe by the live Node (`Ok(None)`: the Node is gone) and those
/// refused: a non-forced job whose volume the node lists in `status.volumesInUse`, or every
/// non-forced job when the Node could not be read.
pub(crate) fn split_unsafe_detaches(
    jobs: Vec<DetachJob>,
    node: &str,
    fresh: &Result<Option<Node>, String>,
) -> (Vec<DetachJob>, Vec<(DetachJob, Error)>) {
    let in_use: HashSet<&str> = match fresh {
        Ok(n) => n
            .iter()
            .filter_map(|n| n.status.as_ref()?.volumes_in_use.as_ref())
            .flatten()
            .map(String::as_str)
            .collect(),
        Err(_) => HashSet::new(),
    };
    let mut safe = Vec::new();
    let mut refused = Vec::new();
    for j in jobs {
        if j.forced.is_some() {
            safe.push(j);
        } else if let Err(e) = fresh {
            let err = Error::NodeUnreadable {
                node: node.to_string(),
                error: e.clone(),
            };
            refused.push((j, err));
        } else if in_use.contains(j.volume.as_str()) {
            refused.push((j, Error::StillInUse(node.to_string())));
        } else {
            safe.push(j);
        }
    }
    (safe, refused)
}

/// A node's new `status.volumesAttached`, and the resourceVersion it must still have when the
/// list carries entries of other plugins (they were read there; a newer one may have more).
#[derive(Debug, Clone)]
pub(crate) struct StatusPatch {
    pub(crate) volumes: Vec<(String, String)>,
    pub(crate) guard: Option<String>,
}

pub(crate) async fn patch_node_status(
    api: &Api<Node>,
    node: &str,
    volumes: &[(String, String)],
    guard: Option<&str>,
) -> Result<Node, kube::Error> {
    let list: Vec<serde_json::Value> = volumes
        .iter()
        .map(|(name, path)| serde_json::json!({ "name": name, "devicePath": path }))
        .collect();
    let mut patch = serde_json::json!({ "status": { "volumesAttached": list } });
    if let Some(rv) = guard {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    api.patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

#[cfg(test)]
mod live_check_tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;
    use stowage_common::errors::MetricLabel;

    fn job(volume: &str, forced: Option<ForceReason>) -> DetachJob {
        DetachJob {
            volume: volume.into(),
            va_name: format!("va-{volume}"),
            forced,
            waited: Duration::ZERO,
        }
    }

    fn names(jobs: &[DetachJob]) -> Vec<&str> {
        jobs.iter().map(|j| j.volume.as_str()).collect()
    }

    #[test]
    fn a_dead_nodes_attachment_is_released_only_while_the_live_node_is_gone_or_out_of_service() {
        use k8s_openapi::api::core::v1::{NodeSpec, Taint};
        let tainted = Node {
            spec: Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: crate::read::TAINT_OUT_OF_SERVICE.into(),
                    effect: "NoExecute".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(release_is_safe("n1", &Ok(None)).is_ok(), "gone");
        assert!(
            release_is_safe("n1", &Ok(Some(tainted))).is_ok(),
            "out of service"
        );
        // Back in service since the informer's copy (the soak's seed 31 caught this race): the
        // node's own agent detaches.
        let back = release_is_safe("n1", &Ok(Some(Node::default()))).unwrap_err();
        assert!(matches!(&back, Error::NodeBack(n) if n == "n1"));
        assert_eq!(back.metric_label(), "node_back");
        let unreadable = release_is_safe("n1", &Err("timeout".into())).unwrap_err();
        assert_eq!(unreadable.metric_label(), "node_unreadable");
    }

    #[test]
    fn a_volume_the_live_node_still_uses_is_not_detached() {
        let node = Node {
            status: Some(NodeStatus {
                volumes_in_use: Some(vec!["used".into()]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let jobs = vec![
            job("used", None),
            job("free", None),
            job("used-forced", Some(ForceReason::OutOfService)),
        ];
        let mut jobs2 = jobs;
        jobs2[2].volume = "used".into();
        let (safe, refused) = split_unsafe_detaches(jobs2, "n1", &Ok(Some(node)));
        assert_eq!(names(&safe), vec!["free", "used"]);
        assert!(safe[1].forced.is_some());
        assert_eq!(refused.len(), 1);
        assert!(matches!(&refused[0].1, Error::StillInUse(n) if n == "n1"));
        assert_eq!(refused[0].1.metric_label(), "volume_in_use");
    }

    #[test]
    fn a_gone_node_uses_nothing_and_an_unreadable_one_refuses_all_but_forced() {
        let (safe, refused) = split_unsafe_detaches(vec![job("v", None)], "n1", &Ok(None));
        assert_eq!(names(&safe), vec!["v"]);
        assert!(refused.is_empty());
        let (safe, refused) = split_unsafe_detaches(
            vec![job("v", None), job("w", Some(ForceReason::Timeout))],
            "n1",
            &Err("timeout".into()),
        );
        assert_eq!(names(&safe), vec!["w"]);
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].1.metric_label(), "node_unreadable");
    }
}
