//! Ingest: store and watch events become queued keys and the state the decisions read (the
//! cache, unbound claims by class, which pods use which claim). `Ingest` borrows exactly that
//! state from the controller for one change; it knows no controller.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use stowage_common::store::StoredPod;
use stowage_common::store::{StoredClaim, StoredVolume};

use stowage_common::runtime::queue::WorkQueue;
use stowage_common::store::informers::Informers;

use crate::core::{Cache, PodUse, Target};
use crate::exec::Executor;
use crate::key::{Key, subject};
use crate::pv::*;

/// Unbound claims (key → class) and the same by class, to wake the claims a freed volume could
/// satisfy without scanning every claim; and the classes to wake at the next flush.
#[derive(Default)]
pub(crate) struct Unbound {
    pub(crate) by_claim: HashMap<String, String>,
    pub(crate) by_class: HashMap<String, HashSet<String>>,
    pub(crate) woken: HashSet<String>,
}

impl Unbound {
    /// Queues the unbound claims of every class woken since the last flush, once each.
    pub(crate) fn flush(&mut self, queue: &mut WorkQueue<Key>) {
        for class in std::mem::take(&mut self.woken) {
            for key in self.by_class.get(&class).into_iter().flatten() {
                queue.add(Key::Claim(key.clone()));
            }
        }
    }

    /// Every class with unbound claims is woken (a class appeared or changed).
    pub(crate) fn wake_all(&mut self) {
        let classes: Vec<String> = self.by_class.keys().cloned().collect();
        self.woken.extend(classes);
    }
}

/// What one change touches: the decision cache, the queue, the unbound claims, the pod index,
/// and the executor's records of an object (its events gate entry, its operation timestamps).
pub(crate) struct Ingest<'a> {
    pub(crate) cache: &'a mut Cache,
    pub(crate) queue: &'a mut WorkQueue<Key>,
    pub(crate) unbound: &'a mut Unbound,
    pub(crate) pods: &'a mut PodIndex,
    pub(crate) executor: &'a Executor,
    pub(crate) cluster: &'a Informers,
}

impl Ingest<'_> {
    /// Reloads the cache from the stores (keeping newer objects we wrote) and queues everything.
    pub(crate) fn resync(&mut self) {
        let pvs = self.cluster.pvs.store().state();
        let claims = self.cluster.pvcs.store().state();
        let live_pvs: HashSet<String> = pvs.iter().map(|p| p.name_any()).collect();
        let live_claims: HashSet<String> = claims.iter().map(|c| claim_key(c.as_ref())).collect();
        // Objects deleted while a watch was down vanish from the store without an event.
        let gone_pvs: Vec<String> = self
            .cache
            .pv_names()
            .filter(|k| !live_pvs.contains(*k))
            .cloned()
            .collect();
        let gone_claims: Vec<String> = self
            .cache
            .claim_keys()
            .filter(|k| !live_claims.contains(*k))
            .cloned()
            .collect();
        for name in gone_pvs {
            if let Some(pv) = self.cache.remove_pv(&name) {
                self.pv_gone(&pv);
            }
        }
        for key in gone_claims {
            if let Some(c) = self.cache.remove_claim(&key) {
                self.claim_gone(&c);
            }
        }
        // A key backing off after a failure keeps its delay: the resync must not turn the
        // backoff into a retry every period (a change to the object still wakes it).
        // Claims waiting to bind are queued first, the pass over everything else after them: at
        // a start (a takeover, a cold start) that pass takes seconds at tens of thousands of
        // objects, and in one FIFO new work would wait behind it.
        let mut rest = Vec::with_capacity(pvs.len() + claims.len());
        for pv in pvs {
            rest.push(Key::Volume(pv.name_any()));
            self.cache.put_pv(pv);
        }
        for c in claims {
            let key = claim_key(c.as_ref());
            if self.cache.put_claim(c.clone()) {
                self.track_claim(&key, Some(&c.decode()));
            }
            // Only claims in the unbound index pay for reading their phase.
            let waiting = self.unbound.by_claim.contains_key(&key)
                && c.binding().is_ok_and(|b| b.phase.as_deref() != Some("Bound"));
            if waiting {
                self.requeue(Key::Claim(key));
            } else {
                rest.push(Key::Claim(key));
            }
        }
        for key in rest {
            self.requeue(key);
        }
    }

    /// Queues `key` now unless it is backing off after a failure.
    pub(crate) fn requeue(&mut self, key: Key) {
        if !self.queue.is_failing(&key) {
            self.queue.add(key);
        }
    }

    pub(crate) fn pv_seen(&mut self, pv: Arc<StoredVolume>) {
        let name = pv.name_any();
        if let Some(put) = self.cache.put_pv(pv) {
            self.queue.add(Key::Volume(name));
            // A volume that just became available may satisfy a waiting claim: wake the claims
            // of its class now instead of at the next resync (upstream waits, kubernetes#71761).
            let was_free = put.old.as_ref().is_some_and(is_free);
            if is_free(&put.new) && !was_free {
                self.wake_claims_of_class(pv_class(&put.new).to_string());
            }
        }
    }

    pub(crate) fn pv_gone(&mut self, pv: &PersistentVolume) {
        let name = pv.name_any();
        // The other volumes naming the same image may now delete it.
        for other in self.cache.sharing_handle(pv) {
            self.queue.add(Key::Volume(other));
        }
        self.cache.remove_pv(&name);
        // The end of a deletion this process started (a no-op for any other volume).
        self.executor.timestamps.finished(&name);
        self.queue.forget(&Key::Volume(name.clone()));
        self.executor.events.forget(&subject(&Target::Volume(name)));
        if let Some((ns, n, _)) = claim_ref(pv) {
            self.queue.add(Key::Claim(format!("{ns}/{n}")));
        }
    }

    pub(crate) fn claim_seen(&mut self, c: Arc<StoredClaim>) {
        let key = claim_key(c.as_ref());
        if self.cache.put_claim(c.clone()) {
            self.track_claim(&key, Some(&c.decode()));
            self.queue.add(Key::Claim(key));
        }
    }

    pub(crate) fn claim_gone(&mut self, c: &PersistentVolumeClaim) {
        let key = claim_key(c);
        self.cache.remove_claim(&key);
        self.executor.timestamps.forget(&key);
        self.track_claim(&key, None);
        self.queue.forget(&Key::Claim(key.clone()));
        self.executor.events.forget(&subject(&Target::Claim(key.clone())));
        let vol = claim_volume_name(c);
        if !vol.is_empty() {
            self.queue.add(Key::Volume(vol.to_string()));
        }
        // A claim that went away may have been waiting on a provisioned volume.
        let prebound: Vec<String> = self.cache.index.prebound_to(&key).map(String::from).collect();
        for pv in prebound {
            self.queue.add(Key::Volume(pv));
        }
    }

    /// Indexes a pod's claims; a change wakes what waits on pods: an unbound claim (its
    /// WaitForPodScheduled event) and a volume still naming the claim (Recycle waits for pods).
    pub(crate) fn pod_seen(&mut self, pod: &StoredPod, gone: bool) {
        for claim in self.pods.update(pod, gone) {
            if self.unbound.by_claim.contains_key(&claim) {
                self.queue.add(Key::Claim(claim.clone()));
            }
            let pvs: Vec<String> = self.cache.index.prebound_to(&claim).map(String::from).collect();
            for pv in pvs {
                self.queue.add(Key::Volume(pv));
            }
        }
    }

    pub(crate) fn pods_resync(&mut self) {
        *self.pods = PodIndex::default();
        for p in self.cluster.pods.store().state() {
            self.pods.update(&p, false);
        }
    }

    /// Keeps the index of unbound claims by class in step with the cache.
    pub(crate) fn track_claim(&mut self, key: &str, claim: Option<&PersistentVolumeClaim>) {
        let u = &mut *self.unbound;
        if let Some(old) = u.by_claim.remove(key)
            && let Some(set) = u.by_class.get_mut(&old)
        {
            set.remove(key);
            if set.is_empty() {
                u.by_class.remove(&old);
            }
        }
        if let Some(c) = claim.filter(|c| !has_ann(*c, ANN_BIND_COMPLETED)) {
            let class = claim_class(c).unwrap_or("").to_string();
            u.by_class
                .entry(class.clone())
                .or_default()
                .insert(key.to_string());
            u.by_claim.insert(key.to_string(), class);
        }
    }

    /// Marks a class whose unbound claims should be synced; the wake-ups of a burst of freed
    /// volumes are coalesced into one pass over the class's claims (`Unbound::flush`).
    pub(crate) fn wake_claims_of_class(&mut self, class: String) {
        self.unbound.woken.insert(class);
    }
}

/// Claim key → the pods (not terminated) that use it, and back.
#[derive(Default)]
pub(crate) struct PodIndex {
    by_claim: HashMap<String, BTreeMap<String, bool>>,
    by_pod: HashMap<String, Vec<String>>,
}

impl PodIndex {
    pub(crate) fn of(&self, claim: &str) -> Vec<PodUse> {
        self.by_claim
            .get(claim)
            .into_iter()
            .flatten()
            .map(|(name, scheduled)| PodUse {
                name: name.clone(),
                scheduled: *scheduled,
            })
            .collect()
    }

    /// Records `pod` (or its removal); returns the claims whose pods changed.
    pub(crate) fn update(&mut self, pod: &StoredPod, gone: bool) -> Vec<String> {
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let pod_key = format!("{ns}/{name}");
        let scheduled = pod.node_name().is_some();
        let now: Vec<String> = if gone || stowage_common::store::pods::pod_terminated(pod) {
            vec![]
        } else {
            stowage_common::store::pods::pod_claims(pod)
                .into_iter()
                .map(|c| format!("{ns}/{}", c.claim))
                .collect()
        };
        let before = self.by_pod.remove(&pod_key).unwrap_or_default();
        let mut changed = Vec::new();
        for c in &before {
            if !now.contains(c)
                && let Some(m) = self.by_claim.get_mut(c)
            {
                m.remove(&name);
                if m.is_empty() {
                    self.by_claim.remove(c);
                }
                changed.push(c.clone());
            }
        }
        for c in &now {
            let old = self
                .by_claim
                .entry(c.clone())
                .or_default()
                .insert(name.clone(), scheduled);
            if old != Some(scheduled) {
                changed.push(c.clone());
            }
        }
        if !now.is_empty() {
            self.by_pod.insert(pod_key, now);
        }
        changed
    }
}

/// A volume offered to any claim of its class.
pub(crate) fn is_free(pv: &PersistentVolume) -> bool {
    claim_ref(pv).is_none() && pv_phase(pv) == "Available" && !being_deleted(pv)
}
