//! Ingest: store and watch events become the claim keys to sync (`Known`'s methods return them;
//! the controller queues them); the objects this controller wrote are kept until the stores catch
//! up (newest resourceVersion wins), and resizes under way are tracked for their gauge and
//! duration.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::store::informer::is_newer;
use stowage_common::store::pv::{claim_key, claim_ref, claim_volume_name};

use stowage_common::store::informers::Informers;
use tokio::time::Instant;

use crate::core::{self};
use crate::metrics::Metrics;

pub(crate) fn split(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

pub(crate) fn newest<K: kube::Resource>(a: Option<Arc<K>>, b: Option<&Arc<K>>) -> Option<Arc<K>> {
    match (a, b) {
        (Some(a), Some(b))
            if is_newer(
                b.meta().resource_version.as_deref(),
                a.meta().resource_version.as_deref(),
            ) =>
        {
            Some(b.clone())
        }
        (Some(a), _) => Some(a),
        (None, b) => b.cloned(),
    }
}

/// What the controller knows besides the stores: its own writes until the stores catch up, and
/// the resizes under way.
pub(crate) struct Known {
    pub(crate) cluster: Arc<Informers>,
    /// Objects this controller wrote, until the stores catch up (newest resourceVersion wins).
    pub(crate) claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    pub(crate) pvs: HashMap<String, Arc<PersistentVolume>>,
    /// Claims with a resize status, and when this process started their expansion.
    pub(crate) resizing: HashMap<String, Option<Instant>>,
    pub(crate) metrics: Metrics,
}

/// A claim a change touched: its key, and whether it is bound (only bound claims are synced).
pub(crate) struct Touched {
    pub(crate) key: String,
    pub(crate) bound: bool,
}

impl Known {
    pub(crate) fn new(cluster: Arc<Informers>, metrics: Metrics) -> Self {
        Self {
            cluster,
            claims: HashMap::new(),
            pvs: HashMap::new(),
            resizing: HashMap::new(),
            metrics,
        }
    }

    pub(crate) fn claim(&self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        let (ns, name) = split(key);
        let stored = self.cluster.pvcs.store().get(&ObjectRef::new(name).within(ns));
        // A claim gone from the store is gone, whatever we wrote before.
        let stored = Arc::new(stored?.decode());
        newest(Some(stored), self.claims.get(key))
    }

    pub(crate) fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        let stored = Arc::new(self.cluster.pvs.store().get(&ObjectRef::new(name))?.decode());
        newest(Some(stored), self.pvs.get(name))
    }

    /// Every bound claim, to sync again (the periodic net, and after a relist).
    pub(crate) fn resync(&mut self) -> Vec<String> {
        let live: HashSet<String> = self
            .cluster
            .pvcs
            .store()
            .state()
            .iter()
            .map(|c| claim_key(c.as_ref()))
            .collect();
        self.claims.retain(|k, _| live.contains(k));
        self.resizing.retain(|k, _| live.contains(k));
        let live_pvs: HashSet<String> = self
            .cluster
            .pvs
            .store()
            .state()
            .iter()
            .map(|p| p.name_any())
            .collect();
        self.pvs.retain(|k, _| live_pvs.contains(k));
        let mut bound = vec![];
        for key in live {
            if let Some(c) = self.claim(&key) {
                self.observe(&key, &c);
                if !claim_volume_name(&c).is_empty() {
                    bound.push(key);
                }
            }
        }
        bound
    }

    /// A claim changed; `None` when the change is this controller's own write coming back.
    pub(crate) fn claim_seen(&mut self, c: &PersistentVolumeClaim) -> Option<Touched> {
        let key = claim_key(c);
        // Our own writes come back through the watch; they are known already and must not
        // bypass the backoff of a failing claim.
        if let Some(mine) = self.claims.get(&key) {
            let (seen, written) = (c.resource_version(), mine.resource_version());
            if !is_newer(seen.as_deref(), written.as_deref()) {
                // Our write's own echo: the store holds it now, so our copy can go.
                if seen == written {
                    self.claims.remove(&key);
                }
                return None;
            }
            self.claims.remove(&key);
        }
        self.observe(&key, c);
        Some(Touched {
            bound: !claim_volume_name(c).is_empty(),
            key,
        })
    }

    /// A claim was deleted: forgotten here; returns its key.
    pub(crate) fn claim_gone(&mut self, c: &PersistentVolumeClaim) -> String {
        let key = claim_key(c);
        self.claims.remove(&key);
        self.resizing.remove(&key);
        key
    }

    /// A volume changed: the key of its claim, unless the change is this controller's own write
    /// coming back.
    pub(crate) fn pv_seen(&mut self, pv: &PersistentVolume) -> Option<String> {
        let name = pv.name_any();
        if let Some(mine) = self.pvs.get(&name) {
            let (seen, written) = (pv.resource_version(), mine.resource_version());
            if !is_newer(seen.as_deref(), written.as_deref()) {
                // Our write's own echo: the store holds it now, so our copy can go.
                if seen == written {
                    self.pvs.remove(&name);
                }
                return None;
            }
            self.pvs.remove(&name);
        }
        claim_of(pv)
    }

    /// A volume was deleted: the key of its claim.
    pub(crate) fn pv_gone(&mut self, pv: &PersistentVolume) -> Option<String> {
        self.pvs.remove(&pv.name_any());
        claim_of(pv)
    }

    /// The bound claims of `class` (a class that now allows expansion unblocks them, and a
    /// refusal is news).
    pub(crate) fn claims_of_class(&self, class: &str) -> Vec<String> {
        // The few fields this reads are decoded, not each whole claim.
        self.cluster
            .pvcs
            .store()
            .state()
            .into_iter()
            .filter(|stored| {
                stored
                    .binding()
                    .is_ok_and(|b| b.class.as_deref() == Some(class) && !b.volume_name.is_empty())
            })
            .map(|stored| claim_key(stored.as_ref()))
            .collect()
    }

    /// Tracks resizes under way (a gauge) and, when one this process started ends, its duration.
    pub(crate) fn observe(&mut self, key: &str, c: &PersistentVolumeClaim) {
        if core::resize_status(c).is_some() {
            self.resizing.entry(key.to_string()).or_insert(None);
        } else if let Some(Some(started)) = self.resizing.remove(key) {
            let reached = match (core::capacity(c), core::allocated(c)) {
                (Some(cap), Some(a)) => cap.bytes >= a.bytes,
                _ => false,
            };
            if reached {
                self.metrics
                    .expansion_seconds
                    .with_label_values(&["total"])
                    .observe(started.elapsed().as_secs_f64());
            }
        }
    }
}

/// The key of the claim a volume is bound to.
fn claim_of(pv: &PersistentVolume) -> Option<String> {
    claim_ref(pv).map(|(ns, name, _)| format!("{ns}/{name}"))
}
