//! The binding state machine, as pure functions: given the controller's cache and a view of
//! classes and nodes, `sync_claim` and `sync_volume` return the actions that move one object
//! toward its desired state. No I/O, no clock. The executor (`crate::exec`) carries them out.
//!
//! The decisions follow upstream's persistentvolume-binder (syncClaim/syncVolume) step by step;
//! where stowage deliberately differs it says so (see docs/binder.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use stowage_common::informer::is_newer;

use crate::index::VolumeIndex;
use crate::objects::*;
use crate::selector;

mod claim;
mod matching;
mod volume;
mod writes;

pub use claim::*;
pub use matching::*;
pub use volume::*;
pub use writes::*;

/// The controller's own view: the newest version it has seen or written of every PV and claim,
/// the index over the PVs, and volumes promised to claims whose bind is in flight.
#[derive(Debug, Default, Clone)]
pub struct Cache {
    pub pvs: HashMap<String, Arc<PersistentVolume>>,
    pub claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    pub index: VolumeIndex,
    /// PV name → claim key holding it for an in-flight bind.
    pub reserved: HashMap<String, String>,
    /// Built-in driver's volume handle → the PVs naming it (normally one; more means an image
    /// shared by several PVs, which is never deleted while another PV names it).
    pub handles: HashMap<String, BTreeSet<String>>,
}

impl Cache {
    /// Stores `pv` unless the cache already has a newer version (upstream's storeObjectUpdate:
    /// an equal version passes, so resyncs are processed). Returns whether it was stored.
    pub fn put_pv(&mut self, pv: Arc<PersistentVolume>) -> bool {
        let name = pv.name_any();
        if let Some(old) = self.pvs.get(&name)
            && old.metadata.uid == pv.metadata.uid
            && is_newer(
                old.resource_version().as_deref(),
                pv.resource_version().as_deref(),
            )
        {
            return false;
        }
        self.index.upsert(&pv);
        self.forget_handle(&name);
        if let Some(h) = loop_handle(&pv) {
            self.handles
                .entry(h.to_string())
                .or_default()
                .insert(name.clone());
        }
        self.pvs.insert(name, pv);
        true
    }

    fn forget_handle(&mut self, name: &str) {
        if let Some(h) = self.pvs.get(name).and_then(|p| loop_handle(p))
            && let Some(set) = self.handles.get_mut(h)
        {
            set.remove(name);
            if set.is_empty() {
                self.handles.remove(h);
            }
        }
    }

    /// The other PVs that name the same built-in image as `pv`.
    pub fn sharing_handle(&self, pv: &PersistentVolume) -> Vec<String> {
        let name = pv.name_any();
        loop_handle(pv)
            .and_then(|h| self.handles.get(h))
            .map(|set| set.iter().filter(|n| **n != name).cloned().collect())
            .unwrap_or_default()
    }

    pub fn put_claim(&mut self, c: Arc<PersistentVolumeClaim>) -> bool {
        let key = claim_key(&c);
        if let Some(old) = self.claims.get(&key)
            && old.metadata.uid == c.metadata.uid
            && is_newer(old.resource_version().as_deref(), c.resource_version().as_deref())
        {
            return false;
        }
        self.claims.insert(key, c);
        true
    }

    pub fn remove_pv(&mut self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.index.remove(name);
        self.forget_handle(name);
        self.pvs.remove(name)
    }

    pub fn remove_claim(&mut self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.claims.remove(key)
    }

    fn reserved_for_other(&self, pv: &str, claim: &str) -> bool {
        self.reserved.get(pv).is_some_and(|c| c != claim)
    }
}

/// What the state machine reads besides PVs and claims.
pub struct Env<'a> {
    pub class: &'a dyn Fn(&str) -> Option<Arc<StorageClass>>,
    /// Name of the default StorageClass, if exactly one is marked default (newest wins, as upstream).
    pub default_class: Option<String>,
    /// Labels of a node, when it exists.
    pub node_labels: &'a dyn Fn(&str) -> Option<BTreeMap<String, String>>,
    /// The pods (not terminated) whose volumes name claim `namespace/name`, sorted by name.
    pub pods_of: &'a dyn Fn(&str) -> Vec<PodUse>,
}

/// A pod that uses a claim (in the claim's namespace).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodUse {
    pub name: String,
    /// Has the scheduler put it on a node?
    pub scheduled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Claim(String),
    Volume(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub target: Target,
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// One step toward the desired state. Writes are computed again by the executor from the newest
/// objects (see the `bound_*` functions), so an action names objects rather than carrying them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The four writes of a bind, in upstream's order: PV claimRef, PV status, claim volumeName,
    /// claim status; each skipped when already done.
    Bind {
        pv: String,
        claim: String,
    },
    /// Claim phase Pending (status access modes and capacity cleared) or Lost.
    ClaimPhase {
        claim: String,
        phase: &'static str,
    },
    /// Volume phase with a message (empty unless it explains a failure).
    VolumePhase {
        pv: String,
        phase: &'static str,
        message: String,
    },
    /// Mark Released after confirming with a live read that the claim is really gone.
    Release {
        pv: String,
    },
    /// Clear the claimRef the controller wrote (or only its UID if a user pre-bound it).
    Unbind {
        pv: String,
    },
    /// Write both storage-provisioner annotations on the claim.
    SetProvisioner {
        claim: String,
        provisioner: String,
    },
    /// Fill a class-less claim's class with the default class (retroactive default).
    SetDefaultClass {
        claim: String,
        class: String,
    },
    /// Built-in driver: create the PV `pvc-<claim uid>` (image pending).
    ProvisionLoop {
        claim: String,
        class: String,
    },
    /// Built-in driver: create the image of a PV created with the pending annotation.
    CreateLoopImage {
        pv: String,
    },
    /// Built-in driver: remove the image, then the finalizer, then the PV object.
    DeleteLoopVolume {
        pv: String,
    },
    /// Add or drop the built-in deleter's finalizer.
    SetDeleterFinalizer {
        pv: String,
        present: bool,
    },
    /// Metadata edits on one object, written with its resourceVersion: annotations set or
    /// removed and finalizers dropped (CSI migration marks, a selected node given back to the
    /// scheduler). `op` names the write in metrics.
    Annotate {
        target: Target,
        set: BTreeMap<String, String>,
        remove: Vec<String>,
        drop_finalizers: Vec<String>,
        add_finalizers: Vec<String>,
        op: &'static str,
    },
    /// Sync a claim soon (a PV changed in a way the claim must react to).
    WakeClaim(String),
    /// Nothing to write, but the object is in a state that should not last: sync it again
    /// with the failure backoff (upstream returns an error from the sync).
    RetryLater {
        why: String,
    },
    /// Say on the claim why it is still Pending (condition `stowage.dev/Pending`).
    ClaimCondition {
        claim: String,
        reason: &'static str,
        message: String,
    },
    Event(Event),
}

fn ev(target: Target, warning: bool, reason: &'static str, note: impl Into<String>) -> Action {
    Action::Event(Event {
        target,
        warning,
        reason,
        note: note.into(),
    })
}

fn is_wffc(class: &StorageClass) -> bool {
    class.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer")
}
