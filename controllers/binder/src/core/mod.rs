//! The binding state machine, as pure functions: given the controller's cache and a view of
//! classes and nodes, `sync_claim` and `sync_volume` return the actions that move one object
//! toward its desired state. No I/O, no clock. The executor (`crate::exec`) carries them out.
//!
//! The decisions follow upstream's persistentvolume-binder (syncClaim/syncVolume) step by step;
//! where stowage deliberately differs it says so (see docs/binder.md).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use stowage_common::store::informer::is_newer;
use stowage_common::store::{IntoStored, StoredClaim, StoredVolume};

use crate::index::VolumeIndex;
use crate::pv::*;
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
///
/// PVs and claims are held as the read model stores them (shared with the informers' stores
/// when they came from there): the cache holds every one of the cluster's, and a sync reads
/// only a few, so each read decodes the object it asks for (`decode_pv`, `decode_claim`: named
/// for what they cost). The maps are private so that every reader goes through those or the
/// metadata readers, which need no decoding.
#[derive(Debug, Default, Clone)]
pub struct Cache {
    pvs: HashMap<String, Arc<StoredVolume>>,
    claims: HashMap<String, Arc<StoredClaim>>,
    pub index: VolumeIndex,
    /// PV name → claim key holding it for an in-flight bind.
    pub reserved: HashMap<String, String>,
    /// Built-in driver's volume handle → the PVs naming it (normally one; more means an image
    /// shared by several PVs, which is never deleted while another PV names it).
    pub handles: HashMap<String, BTreeSet<String>>,
}

impl Cache {
    /// The newest version of PV `name`, decoded whole (a full decode per call).
    pub fn decode_pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.pvs.get(name).map(|p| Arc::new(p.decode()))
    }

    /// The newest version of claim `namespace/name`, decoded whole (a full decode per call).
    pub fn decode_claim(&self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.claims.get(key).map(|c| Arc::new(c.decode()))
    }

    /// A claim's metadata (no decoding).
    pub fn claim_meta(&self, key: &str) -> Option<&ObjectMeta> {
        self.claims.get(key).map(|c| c.meta())
    }

    pub fn has_pv(&self, name: &str) -> bool {
        self.pvs.contains_key(name)
    }

    pub fn has_claim(&self, key: &str) -> bool {
        self.claims.contains_key(key)
    }

    /// PV names.
    pub fn pv_names(&self) -> impl Iterator<Item = &String> {
        self.pvs.keys()
    }

    /// Claim keys (`namespace/name`).
    pub fn claim_keys(&self) -> impl Iterator<Item = &String> {
        self.claims.keys()
    }

    /// Stores `pv` unless the cache already has a newer version (upstream's storeObjectUpdate:
    /// an equal version passes, so resyncs are processed). Returns what it replaced and stored,
    /// decoded, or `None` when it kept the version it had: a newer one, or this very object (a
    /// resync hands back the store's objects, which the cache already shares; nothing to decode
    /// or re-index).
    pub fn put_pv(&mut self, pv: impl IntoStored<PersistentVolume>) -> Option<PvPut> {
        let pv = pv.into_stored();
        let name = pv.name_any();
        if let Some(old) = self.pvs.get(&name)
            && (Arc::ptr_eq(old, &pv) || is_newer_version(old.meta(), pv.meta()))
        {
            return None;
        }
        let new = pv.decode();
        self.index.upsert(&new);
        let old = self.pvs.insert(name.clone(), pv).map(|p| p.decode());
        if let Some(old) = &old {
            self.forget_handle(&name, old);
        }
        if let Some(h) = loop_handle(&new) {
            self.handles.entry(h.to_string()).or_default().insert(name);
        }
        Some(PvPut { old, new })
    }

    fn forget_handle(&mut self, name: &str, old: &PersistentVolume) {
        if let Some(h) = loop_handle(old)
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

    /// Stores claim `c` as `put_pv` stores a PV; returns whether it did (not when the cache
    /// holds a newer version or this very object).
    pub fn put_claim(&mut self, c: impl IntoStored<PersistentVolumeClaim>) -> bool {
        let c = c.into_stored();
        let key = claim_key(c.as_ref());
        if let Some(old) = self.claims.get(&key)
            && (Arc::ptr_eq(old, &c) || is_newer_version(old.meta(), c.meta()))
        {
            return false;
        }
        self.claims.insert(key, c);
        true
    }

    pub fn remove_pv(&mut self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.index.remove(name);
        let old = self.pvs.remove(name)?.decode();
        self.forget_handle(name, &old);
        Some(Arc::new(old))
    }

    pub fn remove_claim(&mut self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.claims.remove(key).map(|c| Arc::new(c.decode()))
    }

    fn reserved_for_other(&self, pv: &str, claim: &str) -> bool {
        self.reserved.get(pv).is_some_and(|c| c != claim)
    }

    /// Frees what a claim's bind reserved, when no report of it will come back (its task or its
    /// sync panicked); `held(pv)` keeps a reservation whose volume's own bind is still running.
    pub fn release_claim(&mut self, claim: &str, held: impl Fn(&str) -> bool) {
        self.reserved.retain(|pv, c| c != claim || held(pv));
    }
}

/// A PV the cache stored, and the version it replaced (both decoded once, for the caller's
/// comparisons).
pub struct PvPut {
    pub old: Option<PersistentVolume>,
    pub new: PersistentVolume,
}

/// Is the cached version `old` newer than `new` (same object, higher resourceVersion)?
fn is_newer_version(old: &ObjectMeta, new: &ObjectMeta) -> bool {
    old.uid == new.uid && is_newer(old.resource_version.as_deref(), new.resource_version.as_deref())
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
    /// Images live in each node's own store (`StoreMode::Local`): the built-in provisioner
    /// makes a volume for the node the scheduler selected (or, binding at once, the node with
    /// the most room), pinned to it.
    pub local: bool,
    /// Local mode: the room each node's store publishes for a class (CSIStorageCapacity), as
    /// (node, bytes).
    pub room: &'a dyn Fn(&str) -> Vec<(String, u128)>,
    /// Local mode: whether any node publishes room for any class of the driver (its agents run
    /// and publish). Asked only when a class has none: then it tells a class the agents have
    /// not published yet (a new class) from agents that publish nothing.
    pub publishing: &'a dyn Fn() -> bool,
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
        /// Local mode: the node whose store gets the image (the scheduler's choice).
        node: Option<String>,
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

#[cfg(test)]
mod tests;
