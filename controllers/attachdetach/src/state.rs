//! The decision state of attach/detach, and the parts' view of it: `Parts` borrows that state
//! with the handles a part writes through (the informers, the executor, the write tasks) for one
//! change or one pass, so ingest, the executor's starters and results take data, not the
//! controller.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use stowage_common::store::informers::Informers;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::actual::Actual;
use crate::core::Nodes;
use crate::desired::{Desired, PodRef};
use crate::exec::Executor;

/// How long a failed node status patch waits before the next try.
pub(crate) const STATUS_RETRY: Duration = Duration::from_secs(1);

/// (namespace, name).
pub(crate) type PodKey = (String, String);

/// What the controller remembers of a scheduled, active pod.
pub(crate) struct PodSeen {
    pub(crate) uid: String,
    pub(crate) node: String,
    pub(crate) claims: Vec<String>,
}

/// What attach/detach knows and has under way, besides its write tasks.
pub(crate) struct State {
    pub(crate) desired: Desired,
    pub(crate) actual: Actual,
    pub(crate) nodes: Nodes,
    /// Active scheduled pods, managed node or not (a node may become managed later).
    pub(crate) pods: HashMap<PodKey, PodSeen>,
    /// (namespace, claim) → names of active pods that mount it.
    pub(crate) claim_pods: HashMap<(String, String), HashSet<String>>,
    /// Pods to resolve again before the next pass.
    pub(crate) dirty_pods: HashSet<PodKey>,
    /// When a dirty pod's watch event arrived, and from it when each (volume, node) a pod
    /// wants was first wanted and not yet attached: the start of an attach's decision latency.
    pub(crate) pod_seen: HashMap<PodKey, Instant>,
    pub(crate) wanted_since: HashMap<(String, String), Instant>,
    /// Volumes a resolved pod wants: their attaches are decided by the next attach step.
    pub(crate) attach_dirty: BTreeSet<String>,
    /// When each detach now held back for unmount was first wanted (the full pass's count).
    pub(crate) waiting_since: Vec<Instant>,
    /// VolumeAttachment name → (volume, node).
    pub(crate) va_keys: HashMap<String, (String, String)>,
    /// PV name → attachments naming it that arrived before the PV.
    pub(crate) unresolved: HashMap<String, HashSet<String>>,
    /// PV name → VolumeAttachments naming it (any driver), for the PV finalizer.
    pub(crate) pv_attachments: HashMap<String, HashSet<String>>,
    /// PVs whose attacher finalizer is to be checked at the next pass, and those being patched.
    pub(crate) pv_dirty: HashSet<String>,
    pub(crate) pv_patching: HashSet<String>,
    /// Nodes with a status patch in flight, and nodes whose last patch failed (retry time).
    pub(crate) status_in_flight: HashSet<String>,
    pub(crate) status_retry: HashMap<String, Instant>,
    /// A pass is due.
    pub(crate) dirty: bool,
    /// Events handled since the last pass.
    pub(crate) backlog: usize,
    /// While loading the initial state: no events for what was already there.
    pub(crate) quiet: bool,
}

/// One part's view: the state, and the handles it reads and writes through.
pub(crate) struct Parts<'a> {
    pub(crate) st: &'a mut State,
    pub(crate) cluster: &'a Arc<Informers>,
    pub(crate) executor: &'a Arc<Executor>,
    pub(crate) tasks: &'a mut JoinSet<()>,
}

impl State {
    /// A change that may alter a pass's decisions: a pass is due.
    pub(crate) fn touch(&mut self) {
        self.dirty = true;
        self.backlog += 1;
    }
}

impl Parts<'_> {
    pub(crate) fn pod_events(
        &self,
        volume: &str,
        node: &str,
        warning: bool,
        reason: &'static str,
        note: impl Fn(&str) -> String,
    ) {
        let Some(d) = self.st.desired.get(volume, node) else {
            return;
        };
        let text = note(&d.spec.pv_name);
        for pod in d.pods.values() {
            self.pod_event(pod, warning, reason, text.clone());
        }
    }

    pub(crate) fn pod_event(&self, pod: &PodRef, warning: bool, reason: &'static str, note: String) {
        let on = pod.reference();
        // Queued: events never hold up the reconciler.
        if warning {
            self.executor.events.warning(&on, reason, "Attach", note);
        } else {
            self.executor.events.normal(&on, reason, "Attach", note);
        }
    }
}
